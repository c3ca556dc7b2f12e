"""Megatron tensor parallelism of an unmodified transformers model, cut by the model's own ``base_model_tp_plan``.

The plan names what to cut: a ``colwise`` projection (q, k, v, gate, up) keeps its output rows of this rank's
heads or MLP slice, a ``rowwise`` one (o, down) its input columns, and its output is summed over the TP group (two
all-reduces per layer, a forward hook on each rowwise module). What the plan replicates (norms, Gemma's q/k norms)
and what it leaves out (the embedding, the final norm, the LM head) every rank holds whole.

The shard is the model's own class built from a config cut to the rank's share (its query and K,V head counts,
its MLP width, the head size fixed), so the model's forward, masks and ``DynamicCache`` run as they do for the whole
model, on fewer heads. Fused projections are cut part by part (``FUSED``): Phi-3's ``qkv_proj`` stacks q, k and v
and its ``gate_up_proj`` gate and up, each part cut to the rank's heads or rows; GPT-NeoX's ``query_key_value``
interleaves [q, k, v] head by head, so a rank's heads are one block of rows. GPT-NeoX sizes its attention from the
hidden size (hidden / heads), so its shard's attention is refitted to the kept head size (``REFIT``). A layout whose
shapes follow neither its head counts nor a known fusion is found by comparing the built shard with the plan, and
refused in one line.

Heads are cut by K,V group: with at least as many K,V heads as ranks each rank takes whole groups (as evenly as
they go: SmolLM2's 3 K,V heads over 2 ranks are 2 and 1, so 6 and 3 query heads); with fewer, each K,V head is
replicated on ranks that split its query heads evenly. Anything else is refused before any weight is read.

Each rank reads only its shard from the safetensors file: a colwise tensor's rows are one contiguous read, a rowwise
tensor's columns are read a block of rows at a time.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import fnmatch
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from kvrunahead.model.stage import DTYPES, safetensors_entries, ties_embeddings

COLWISE, ROWWISE = "colwise", "rowwise"
WHOLE = ("replicated_with_grad_allreduce", "embedding_rowwise")  # styles every rank keeps whole here
# transformers' styles whose output is gathered (or whose input split) around a colwise (rowwise) cut: here the
# colwise output stays on its rank and the rowwise input is that output, the same sum as Megatron's
GATHERED = {"colwise_gather_output": COLWISE, "rowwise_split_input": ROWWISE}


@dataclass(frozen=True)
class Fused:
    """A projection whose output rows stack several parts, each in units of a query head (``q``), a K,V head
    (``kv``) or an MLP row (``mlp``), in order; ``per_head``: the parts interleaved head by head instead (GPT-NeoX's
    [q_h, k_h, v_h] for every head h, which needs as many K,V heads as query heads)."""

    parts: tuple[str, ...]
    per_head: bool = False


FUSED = {  # model type -> the base model's module name (its tail) -> how its rows stack
    "phi3": {"self_attn.qkv_proj": Fused(("q", "kv", "kv")), "mlp.gate_up_proj": Fused(("mlp", "mlp"))},
    "gpt_neox": {"attention.query_key_value": Fused(("q", "kv", "kv"), per_head=True)},
}


@dataclass(frozen=True)
class TpSpec:
    rank: int
    size: int


@dataclass(frozen=True)
class Share:
    """One TP rank's share of a model: its query heads, K,V heads and MLP rows, each a [first, last) range."""

    q: tuple[int, int]
    kv: tuple[int, int]
    mlp: tuple[int, int]


def _even(n: int, parts: int) -> list[tuple[int, int]]:
    """``n`` in ``parts`` contiguous ranges as even as they go, the first ones the longer."""
    cuts = [-(-n * i // parts) for i in range(parts + 1)]
    return list(zip(cuts, cuts[1:]))


def _text(config: PretrainedConfig) -> PretrainedConfig:
    return config.get_text_config(decoder=True)


def tp_plan(config: PretrainedConfig) -> dict[str, str]:
    """The model's tensor-parallel plan; NotImplementedError naming what is missing or unknown."""
    text = _text(config)
    plan = getattr(text, "base_model_tp_plan", None) or getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise NotImplementedError(f"{config.model_type} ships no tensor-parallel plan (base_model_tp_plan); "
                                  "--tp cannot cut it")
    plan = {pattern: GATHERED.get(style, style) for pattern, style in plan.items()}
    odd = sorted({style for style in plan.values() if style not in (COLWISE, ROWWISE, *WHOLE)})
    if odd:
        raise NotImplementedError(f"{config.model_type}'s tensor-parallel plan cuts with {', '.join(odd)}; --tp "
                                  "cuts colwise and rowwise projections only")
    return plan


def shares(config: PretrainedConfig, tp: int) -> list[Share]:
    """Every TP rank's share at degree ``tp``; NotImplementedError with one line where the heads do not split."""
    tp_plan(config)
    text = _text(config)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    width = getattr(text, "intermediate_size", None) or 4 * text.hidden_size
    if tp < 1:
        raise ValueError(f"--tp must be at least 1, got {tp}")
    if tp > width:
        raise NotImplementedError(f"the MLP's {width} rows do not split over {tp} ranks")
    group = heads // kv_heads
    if kv_heads >= tp:
        kv = _even(kv_heads, tp)
        q = [(a * group, b * group) for a, b in kv]
    elif tp % kv_heads == 0 and group % (tp // kv_heads) == 0:
        copies = tp // kv_heads  # ranks per K,V head, each with an even slice of its query heads
        kv = [(t // copies, t // copies + 1) for t in range(tp)]
        q = _even(heads, tp)
    else:
        raise NotImplementedError(f"{heads} query heads in {kv_heads} K,V groups do not split over {tp} ranks "
                                  f"(--tp must divide the K,V heads' query groups, or be at most {kv_heads})")
    return [Share(q[t], kv[t], m) for t, m in enumerate(_even(width, tp))]


def check_tp(config: PretrainedConfig, tp: int) -> None:
    """NotImplementedError with one line where ``config``'s model cannot run at degree ``tp``: its plan, its heads,
    and every rank's shard built without weights (on the meta device) against the whole model's shapes."""
    if tp == 1:
        return
    shares(config, tp)
    with torch.device("meta"):
        whole = AutoModelForCausalLM.from_config(config)
    full = {k: tuple(v.shape) for k, v in whole.state_dict().items()}
    for rank in range(tp):
        ShardBuilder(config, TpSpec(rank, tp)).cuts(torch.device("meta"), full)


def shard_config(config: PretrainedConfig, share: Share) -> PretrainedConfig:
    """``config`` cut to one rank's share: its head counts and MLP width, the head size kept."""
    cut = copy.deepcopy(config)
    text = _text(cut)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    text.head_dim = head_dim
    text.num_attention_heads = share.q[1] - share.q[0]
    if getattr(text, "num_key_value_heads", None) is not None:
        text.num_key_value_heads = share.kv[1] - share.kv[0]
    if getattr(text, "intermediate_size", None) is not None:
        text.intermediate_size = share.mlp[1] - share.mlp[0]
    return cut


def _style(plan: dict[str, str], key: str) -> tuple[str | None, str]:
    """The plan's style for a checkpoint tensor (None: not in the plan) and the module it belongs to."""
    module = key.rsplit(".", 1)[0]
    name = module.split(".", 1)[1] if "." in module else module  # the base model's name for it
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(name, pattern):
            return style, module
    return None, module


Where = tuple[int, tuple[tuple[int, int], ...]]  # a shard's dim and its [first, last) ranges along it, in order


def _cut(key: str, full: tuple[int, ...], shard: tuple[int, ...], plan: dict[str, str], share: Share,
         config: PretrainedConfig, head_dim: int) -> Where | None:
    """Where a checkpoint tensor's shard lies: (dim, ranges), or None where the rank keeps it whole. ValueError
    where the built shard's shape is not what the plan and the share say (a layout the cut does not know)."""
    style, module = _style(plan, key)
    if style not in (COLWISE, ROWWISE) or (style == ROWWISE and key.endswith(".bias")):
        if tuple(full) != tuple(shard):
            raise ValueError(f"{key} is {tuple(full)} whole and {tuple(shard)} in the shard, but the plan keeps it "
                             "whole")
        return None
    dim = 0 if style == COLWISE else 1
    size = full[dim]
    text = _text(config)
    heads = text.num_attention_heads
    units = {"q": (heads * head_dim, share.q, head_dim),
             "kv": ((getattr(text, "num_key_value_heads", None) or heads) * head_dim, share.kv, head_dim),
             "mlp": (getattr(text, "intermediate_size", None) or 4 * text.hidden_size, share.mlp, 1)}
    fused = next((f for tail, f in FUSED.get(config.model_type, {}).items() if module.endswith(tail)), None)
    if fused is not None and fused.per_head:  # the parts of one head side by side: the rank's heads, one block
        block = sum(units[part][2] for part in fused.parts)
        ranges, whole = ((share.q[0] * block, share.q[1] * block),), heads * block
    elif fused is not None:  # the parts one after another: each part's own rows of this rank
        ranges, whole = [], 0
        for part in fused.parts:
            total, (first, last), unit = units[part]
            ranges.append((whole + first * unit, whole + last * unit))
            whole += total
    else:
        part = "mlp" if "mlp" in module else "q" if size == units["q"][0] else "kv"  # q rows or o columns; k, v
        total, (first, last), unit = units[part]
        ranges, whole = ((first * unit, last * unit),), total
    if sum(b - a for a, b in ranges) != shard[dim] or whole != size:
        raise ValueError(f"{key} ({tuple(full)}) does not cut to the shard's {tuple(shard)}: its layout does not "
                         "follow the head count" + ("" if fused else " (a fused projection --tp does not know)"))
    return dim, tuple(ranges)


def _refit_neox(model: torch.nn.Module, head_dim: int) -> None:
    """GPT-NeoX's attention sizes its heads as hidden / heads: refit each layer's to the kept head size, its fused
    q,k,v and its output to the rank's heads."""
    for layer in model.base_model.layers:
        a = layer.attention
        heads = _text(model.config).num_attention_heads
        a.rotary_ndims = int(head_dim * a.rotary_ndims / a.head_size)
        a.head_size, a.scaling = head_dim, head_dim ** -0.5
        a.query_key_value = _linear(a.query_key_value, a.query_key_value.in_features, 3 * heads * head_dim)
        a.dense = _linear(a.dense, heads * head_dim, a.dense.out_features)


def _linear(like: torch.nn.Linear, inputs: int, outputs: int) -> torch.nn.Linear:
    w = like.weight
    return torch.nn.Linear(inputs, outputs, bias=like.bias is not None, device=w.device, dtype=w.dtype)


REFIT = {"gpt_neox": _refit_neox}  # families whose shard's modules do not follow a cut config alone


@dataclass
class ShardBuilder:
    """One TP rank's shard of a model: its config, its empty model and where each checkpoint tensor's part lies."""

    config: PretrainedConfig
    spec: TpSpec

    def __post_init__(self) -> None:
        self.plan = tp_plan(self.config)
        self.share = shares(self.config, self.spec.size)[self.spec.rank]
        self.cut = shard_config(self.config, self.share)
        self.head_dim = _text(self.cut).head_dim

    def cuts(self, device: torch.device, full_shapes: dict, dtype: torch.dtype | None = None,
             attn_implementation: str | None = None) -> tuple[torch.nn.Module, dict]:
        """The shard's empty model on ``device`` and, per checkpoint tensor it holds, where its part lies."""
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(self.cut, dtype=dtype, attn_implementation=attn_implementation)
        if self.config.model_type in REFIT:
            REFIT[self.config.model_type](model, self.head_dim)
        state = model.state_dict()
        cuts = {}
        for key, shape in full_shapes.items():
            if key in state:
                try:
                    cuts[key] = _cut(key, shape, tuple(state[key].shape), self.plan, self.share, self.config,
                                     self.head_dim)
                except ValueError as e:
                    raise NotImplementedError(f"--tp cannot cut {self.config.model_type}: {e}") from None
        return model, cuts

    def build(self, dtype: torch.dtype, device: torch.device, attn_implementation: str, full_shapes: dict,
              tensors) -> torch.nn.Module:
        """The shard's model with its weights from ``tensors(cut_of)``: an iterator of (name, tensor) already cut,
        given ``cut_of(name, full_shape)``. NotImplementedError where the layout does not follow the plan."""
        model, cuts = self.cuts(device, full_shapes, dtype, attn_implementation)
        state = model.state_dict()
        seen = set()
        with torch.no_grad():
            for key, tensor in tensors(lambda k: cuts.get(k, "skip")):
                state[key].copy_(tensor)
                seen.add(key)
                if self.spec.rank and key.endswith(".bias") and _style(self.plan, key)[0] == ROWWISE:
                    state[key].zero_()  # a rowwise bias is added once, by TP rank 0, before the sum
        missing = sorted(set(state) - seen - ({"lm_head.weight"} if ties_embeddings(self.config) else set()))
        if missing:
            raise ValueError(f"the shard's weights lack {', '.join(missing[:4])}")
        return model


def add_all_reduces(model: torch.nn.Module, collective) -> None:
    """Sum each rowwise module's output over the TP group (the plan's rowwise modules, o and down)."""
    plan = tp_plan(model.config)
    for name, module in model.base_model.named_modules():
        if any(fnmatch.fnmatchcase(name, p) for p, s in plan.items() if s == ROWWISE):
            module.register_forward_hook(_summed(collective))


_ALONE = contextvars.ContextVar("kvrunahead_tp_alone", default=False)


@contextlib.contextmanager
def alone():
    """A forward on this rank's shard without the group's sums: a probe whose numbers nobody reads (which attention
    the model calls), run by one rank at a time its peers cannot know of."""
    token = _ALONE.set(True)
    try:
        yield
    finally:
        _ALONE.reset(token)


def _summed(collective):
    @torch.compiler.disable
    def hook(module, args, output):
        return output if _ALONE.get() else collective.all_reduce(output)
    return hook


def cut_tensors(tensors: Iterator[tuple[str, torch.Tensor]]):
    """The ``tensors`` argument of ``ShardBuilder.build`` for tensors held whole (a seeded preset drawn on every
    rank): each cut in memory."""
    def cut(cut_of):
        for key, tensor in tensors:
            where = cut_of(key)
            if where == "skip":
                continue
            yield key, tensor if where is None else torch.cat([tensor.narrow(where[0], a, b - a) for a, b in where[1]],
                                                              where[0])
    return cut


def safetensors_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    return {key: tuple(meta["shape"]) for _, _, key, meta in safetensors_entries(folder)}


ROW_BLOCK_BYTES = 1 << 22  # a rowwise tensor's columns are read through blocks of rows of about 4 MB


def safetensors_shard(folder: Path):
    """The ``tensors`` argument of ``ShardBuilder.build`` for a model folder: only each tensor's shard is read."""
    def read(cut_of):
        for f, offset, key, meta in safetensors_entries(folder):
            if (where := cut_of(key)) != "skip":
                yield key, _read(f, offset, meta, where)
    return read


def _read(f, offset: int, meta: dict, where: Where | None) -> torch.Tensor:
    dtype, shape = DTYPES[meta["dtype"]], list(meta["shape"])
    item = torch.empty((), dtype=dtype).element_size()
    if where is None or where[0] == 0:  # whole, or whole rows: one contiguous read a range
        ranges = ((0, shape[0] if shape else 1),) if where is None else where[1]
        row = item * math.prod(shape[1:])
        parts = []
        for first, last in ranges:
            out = torch.empty([last - first, *shape[1:]] if shape else [], dtype=dtype)
            f.seek(offset + first * row)
            f.readinto(memoryview(out.view(torch.uint8).numpy()).cast("B") if out.numel() else bytearray())
            parts.append(out)
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    rows, cols = shape  # columns of a matrix: blocks of whole rows, each cut
    widths = [(a, b) for a, b in where[1]]
    out = torch.empty((rows, sum(b - a for a, b in widths)), dtype=dtype)
    block = max(1, ROW_BLOCK_BYTES // (cols * item))
    buf = torch.empty((block, cols), dtype=dtype)
    f.seek(offset)
    for a in range(0, rows, block):
        n = min(block, rows - a)
        f.readinto(memoryview(buf[:n].view(torch.uint8).numpy()).cast("B"))
        out[a:a + n] = torch.cat([buf[:n, first:last] for first, last in widths], 1)
    return out
