"""The model's linear layers on the CPU with their weights prepacked once for oneDNN (as vLLM's CPU backend does):
``torch.ops.mkldnn._reorder_linear_weight`` at load, ``_linear_pointwise`` at every call.

Measured per shape, dtype and row count on SmolLM2's layers, on an AMD EPYC (Zen 5, avx512_bf16, no AMX;
experiments/kernels/linears.jsonl, interleaved rounds): float32 runs 2.1-2.5x faster than ``F.linear`` (MKL's
sgemm, which takes its AVX2 path on AMD) on prompt-sized blocks, and 1.1-3.4x on decode rows (1-8) whose weights
stream from memory, as a forward's do (each layer's weights read once a step, 14 MB a layer in float32 against a
32 MB L3); bfloat16 is 1.2-1.6x faster on 1-8 rows and level (1.02-1.05x) on prompt-sized blocks. Only a small
float32 weight called again while it sits in the caches (one row through k or v, hot) is faster on ``F.linear``,
which no forward does; so every layer takes the packed path.

Applied by ``load_model`` after loading, to ``nn.Linear`` modules on the CPU in float32, and in bfloat16 where the
CPU has oneDNN's bfloat16 path (AVX-512: an AVX2-only CPU keeps its bfloat16 layers on ``F.linear``); the weights
stay as they are (state dicts, TP cuts and tied embeddings read them), the packed copy beside them.
Which is faster depends on the CPU's BLAS: on an Intel Xeon without AMX, MKL's sgemm beat the packed layers (the
16k default run 51.3 s on ``F.linear`` against 61.7 s packed, float32, experiments/kernels). So ``--linears auto``,
the default, times both on a prompt-sized block of SmolLM2's shapes in each dtype, once per machine and torch
version (``linears.json`` in the cache folder), and packs where oneDNN was faster. ``KVR_LINEARS=onednn|torch``
(or ``--linears``) forces one; ``torch.compile`` unpacks first (inductor chooses its own GEMMs).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from kvrunahead.choices import LINEARS, LINEARS_ENV
from kvrunahead.config import cache_root
from kvrunahead.kernels import DTYPES, kept_timings
from kvrunahead.kernels.timing import best_time

ENV = LINEARS_ENV
CHOICES = LINEARS


# The timed block: 2048 rows through SmolLM2's q, k, gate and down shapes (out x in).
TIMED_ROWS, TIMED_SHAPES = 2048, ((576, 576), (192, 576), (1536, 576), (576, 1536))


def chosen() -> str:
    name = os.environ.get(ENV, "auto") or "auto"
    if name not in CHOICES:
        raise ValueError(f"{ENV}={name!r}: one of {', '.join(CHOICES)}")
    return name


def choice_for(dtype: torch.dtype) -> str:
    """``onednn`` or ``torch`` for layers in ``dtype``: as chosen, or with ``auto`` the faster here."""
    name = chosen()
    if name != "auto":
        return name
    return auto_choice().get(str(dtype).removeprefix("torch."), {}).get("linears", "onednn")


def choice_file():
    return cache_root() / "linears" / f"torch-{torch.__version__}.json"


_picks: dict = {}


def auto_choice() -> dict[str, dict]:
    """Per dtype ``{"linears": "onednn" | "torch", "onednn_gflops": .., "torch_gflops": ..}``: read from the cache
    folder, or timed now and kept there (said once)."""
    path = choice_file()
    if _picks.get("path") != path:
        picks = kept_timings(path, lambda: {name: time_linears(getattr(torch, name)) for name in DTYPES},
                             lambda picks: "CPU linears auto: " + "; ".join(
                                 f"{d} {p['linears']} (oneDNN packed {p['onednn_gflops']:.1f}, F.linear "
                                 f"{p['torch_gflops']:.1f} GFLOP/s)" for d, p in picks.items()))
        _picks.update(path=path, dtypes=picks)
    return _picks["dtypes"]


@torch.no_grad()
def time_linears(dtype: torch.dtype) -> dict:
    """Both ways on the timed block at this process's threads; oneDNN's only where it computes ``dtype``."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(TIMED_ROWS, 576, generator=g).to(dtype)
    layers = [torch.randn(o, i, generator=g).to(dtype) for o, i in TIMED_SHAPES]
    inputs = [x if i == 576 else torch.randn(TIMED_ROWS, i, generator=g).to(dtype) for _, i in TIMED_SHAPES]
    flops = sum(2.0 * TIMED_ROWS * o * i for o, i in TIMED_SHAPES)
    plain = best_time(lambda: [F.linear(a, w) for a, w in zip(inputs, layers)])
    pick = {"linears": "torch", "torch_gflops": flops / plain / 1e9, "onednn_gflops": 0.0}
    if dtype == torch.float32 or bf16_supported():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in layers]
        seconds = best_time(lambda: [torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], "")
                                 for a, w in zip(inputs, packed)])
        pick.update(onednn_gflops=flops / seconds / 1e9, linears="onednn" if seconds <= plain else "torch")
    return pick


class PackedLinear(torch.nn.Linear):
    """``nn.Linear`` with its weight also prepacked for oneDNN (``packed``)."""

    packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or (torch.is_grad_enabled() and self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


def packable(module: torch.nn.Module) -> bool:
    """A CPU ``nn.Linear`` in float32, or in bfloat16 where oneDNN computes it (AVX-512 or AMX: on an AVX2-only CPU
    its bfloat16 reorder raises, and the layer stays on ``F.linear``)."""
    if type(module) is not torch.nn.Linear or module.weight.device.type != "cpu":
        return False
    return module.weight.dtype == torch.float32 or (module.weight.dtype == torch.bfloat16 and bf16_supported())


def bf16_supported() -> bool:
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


@torch.no_grad()
def prepack(model: torch.nn.Module, group: bool = True) -> int:
    """Pack every CPU linear layer of ``model`` for oneDNN, in place, in each dtype where it is chosen (unless
    oneDNN is missing), the layers of one input together (``GROUPS``; ``group`` False: each alone, as a measure of
    what that gains); returns how many were packed."""
    if chosen() == "torch" or not torch.backends.mkldnn.is_available():
        return 0
    count = 0
    for module in model.modules():
        if packable(module) and choice_for(module.weight.dtype) == "onednn":
            packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
            module.register_buffer("packed", packed, persistent=False)
            module.__class__ = PackedLinear
            count += 1
    for module in list(model.modules()) if group else ():
        for names in GROUPS:
            members = [getattr(module, name, None) for name in names]
            if all(type(m) is PackedLinear for m in members) and len({_signature(m) for m in members}) == 1:
                PackedGroup(members)
    return count


GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # a module's linears that read one input


def _signature(module: torch.nn.Linear) -> tuple:
    return module.in_features, module.weight.dtype, module.weight.device, module.bias is None


class PackedGroup:
    """Linears that read the same input (a layer's q, k and v; its gate and up), packed as one oneDNN weight in
    place of theirs: a member called with an input the group has not computed computes every member's output in one
    product, and the others take theirs from it (the model's code calls them one after the other on one tensor).
    The product's columns are the members' own (on the CPUs measured, equal to the bit to separate products)."""

    def __init__(self, members: list[torch.nn.Linear]) -> None:
        self.members = members
        self.sizes = [m.out_features for m in members]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(torch.cat([m.weight.detach() for m in members]), None)
        self.bias = None if members[0].bias is None else torch.cat([m.bias.detach() for m in members])
        self._last: tuple = (None, (), set())  # input, outputs, members still to take theirs (one assignment)
        for index, member in enumerate(members):
            del member.packed
            member.__class__ = GroupedLinear
            member.group, member.index = self, index

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """Every member's output of ``x``, side by side ``[..., sum of out_features]``."""
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        last, outputs, waiting = self._last
        if last is not x or index not in waiting:
            outputs, waiting = self.product(x).split(self.sizes, dim=-1), set(range(len(self.sizes)))
            self._last = (x, outputs, waiting)
        waiting.discard(index)
        if not waiting:
            self._last = (None, (), set())  # nothing held past the last member's call
        return outputs[index].contiguous()

    def unpack(self) -> None:
        for member in self.members:
            del member.group, member.index
            member.__class__ = torch.nn.Linear

    def repack(self) -> None:
        for index, member in enumerate(self.members):
            member.__class__ = GroupedLinear
            member.group, member.index = self, index


class GroupedLinear(torch.nn.Linear):
    """``nn.Linear`` computed with the rest of its ``PackedGroup``."""

    group: PackedGroup
    index: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or (torch.is_grad_enabled() and self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)
        return self.group.output(x, self.index)


def groups(model: torch.nn.Module) -> list[PackedGroup]:
    found = {id(m.group): m.group for m in model.modules() if isinstance(m, GroupedLinear)}
    return list(found.values())


def packed_bytes(model: torch.nn.Module) -> int:
    """The bytes of the packed copies ``prepack`` keeps beside the weights."""
    tensors = [m.packed for m in model.modules() if isinstance(m, PackedLinear)] + [g.packed for g in groups(model)]
    return sum(t.numel() * t.element_size() for t in tensors)


def unpack(model: torch.nn.Module) -> None:
    """Back to plain ``nn.Linear`` (before ``torch.compile``)."""
    for group in groups(model):
        group.unpack()
    for module in model.modules():
        if isinstance(module, PackedLinear):
            del module.packed
            module.__class__ = torch.nn.Linear


@contextlib.contextmanager
def unpacked(model: torch.nn.Module) -> Iterator[None]:
    """``model`` with plain ``nn.Linear`` layers inside the block (to copy it: a packed weight is an opaque oneDNN
    tensor), packed again after."""
    packed = {m: m.packed for m in model.modules() if isinstance(m, PackedLinear)}
    grouped = groups(model)
    unpack(model)
    try:
        yield
    finally:
        for module, weight in packed.items():
            module.register_buffer("packed", weight, persistent=False)
            module.__class__ = PackedLinear
        for group in grouped:
            group.repack()
