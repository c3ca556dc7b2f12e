"""A pipeline stage of a transformers model: its decoder layers [first, last) as a model of their own (Medha's
stream pipeline parallelism, medha.txt section 3).

The stage is the unmodified model class built from a config cut to its layers: ``num_hidden_layers`` and
``layer_types`` sliced, each layer renumbered from 0, so the model's own forward, masks and ``DynamicCache`` (one
cache layer per stage layer, sliding or full as the original) work as they do for the whole model. The first stage
embeds token ids; a later stage takes the previous stage's hidden states as ``inputs_embeds`` (which skips the
embedding, Gemma's scaling included, since the scale lives in the embedding module). Only the last stage applies
the final norm and holds the LM head; only the stages that embed or emit hold the (tied) embedding matrix.

Each stage loads only its own weights: a real model's tensors are read one by one from its safetensors file; a
seeded preset is drawn whole (every rank must draw the same numbers) and cut.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig


@dataclass(frozen=True)
class StageSpec:
    first: int  # the stage's first decoder layer
    last: int  # one past its last
    num_layers: int  # the whole model's

    @classmethod
    def of(cls, stages: tuple[int, ...], rank: int) -> StageSpec:
        """Rank ``rank``'s stage of the layer boundaries ``stages``."""
        return cls(stages[rank], stages[rank + 1], stages[-1])

    @property
    def embeds(self) -> bool:
        return self.first == 0

    @property
    def emits(self) -> bool:
        return self.last == self.num_layers


@dataclass(frozen=True)
class Cut:
    """Where a model's pipeline cut falls, read off its own plans: the base model's attribute (``model``), and in
    it the embedding, the decoder-layer list and the final norm (the keys of ``base_model_pp_plan``, in order), then
    the causal LM's head (its class's ``_pp_plan``)."""

    prefix: str
    embed: str
    layers: str
    norm: str
    head: str

    def layer_of(self, key: str) -> tuple[int, str] | None:
        """A checkpoint tensor's decoder layer and the rest of its name, or None outside the layer list."""
        start = f"{self.prefix}.{self.layers}."
        if not key.startswith(start):
            return None
        index, rest = key[len(start):].split(".", 1)
        return int(index), rest

    def is_embed(self, key: str) -> bool:
        return key.startswith(f"{self.prefix}.{self.embed}.")

    def emits_with(self, key: str) -> bool:
        """Whether only the emitting stage holds the tensor (the final norm, the head)."""
        return key.startswith((f"{self.prefix}.{self.norm}.", f"{self.head}."))


def pipeline_cut(model_or_config) -> Cut:
    """The model's pipeline cut; NotImplementedError with one line naming what is missing."""
    config = getattr(model_or_config, "config", model_or_config)
    cls = AutoModelForCausalLM._model_mapping.get(type(config), None)
    text = config.get_text_config(decoder=True)
    plan = getattr(text, "base_model_pp_plan", None) or getattr(config, "base_model_pp_plan", None)
    name = getattr(cls, "__name__", type(config).__name__)
    if not plan or "layers" not in plan or len(plan) < 3 or cls is None or not getattr(cls, "_pp_plan", None):
        raise NotImplementedError(f"spp cuts a model's decoder layers into stages by its pipeline plan "
                                  f"(base_model_pp_plan: embedding, layers, final norm); {name} ships none")
    names = list(plan)
    return Cut(cls.base_model_prefix, names[0], "layers", names[-1], next(iter(cls._pp_plan)))


def check_stageable(model_or_config) -> None:
    """NotImplementedError with one line where the model has no pipeline plan to cut it by."""
    pipeline_cut(model_or_config)


def stage_config(config: PretrainedConfig, spec: StageSpec) -> PretrainedConfig:
    """``config`` cut to the stage's layers."""
    cut = copy.deepcopy(config)
    cut.num_hidden_layers = spec.last - spec.first
    if getattr(config, "layer_types", None) is not None:
        cut.layer_types = list(config.layer_types[spec.first:spec.last])
    return cut


def stage_keys(key: str, spec: StageSpec, tied: bool, cut: Cut) -> str | None:
    """The stage model's name for a whole model's tensor, or None where the stage does not hold it."""
    layer = cut.layer_of(key)
    if layer is not None:
        i, rest = layer
        return f"{cut.prefix}.{cut.layers}.{i - spec.first}.{rest}" if spec.first <= i < spec.last else None
    if cut.is_embed(key):
        return key if spec.embeds or (spec.emits and tied) else None
    if cut.emits_with(key):
        return key if spec.emits else None
    return key  # anything else (rotary buffers saved by some checkpoints) every stage keeps


def ties_embeddings(config: PretrainedConfig) -> bool:
    return bool(getattr(config.get_text_config(decoder=True), "tie_word_embeddings", False)
                or getattr(config, "tie_word_embeddings", False))


def build_stage(config: PretrainedConfig, spec: StageSpec, tensors: Iterator[tuple[str, torch.Tensor]],
                dtype: torch.dtype, device: torch.device, attn_implementation: str) -> torch.nn.Module:
    """The stage's model from its config, its weights taken from ``tensors`` (a whole model's names and tensors,
    read lazily: only the stage's are kept)."""
    names = pipeline_cut(config)
    cut = stage_config(config, spec)
    tied = ties_embeddings(config)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cut, dtype=dtype, attn_implementation=attn_implementation)
    state = model.state_dict()
    seen = set()
    with torch.no_grad():
        for key, tensor in tensors:
            name = stage_keys(key, spec, tied, names)
            if name is None or name not in state:
                continue
            state[name].copy_(tensor)
            seen.add(name)
    wanted = {k for k in state if _wanted(k, spec, tied, names)}
    missing = sorted(wanted - seen - ({f"{names.head}.weight"} if tied else set()))
    if missing:
        raise ValueError(f"the stage's weights lack {', '.join(missing[:4])}")
    return _trimmed(model, spec, tied, names)


def _trimmed(model: torch.nn.Module, spec: StageSpec, tied: bool, cut: Cut) -> torch.nn.Module:
    """The stage without what it does not run: the embedding where it neither embeds nor emits through it, the
    final norm and the LM head where it does not emit."""
    if not spec.embeds and not (spec.emits and tied):
        setattr(model.base_model, cut.embed, None)  # the forward embeds only when given ids; a later stage gets
    if not spec.emits:  # states
        setattr(model.base_model, cut.norm, torch.nn.Identity())  # the residual stream goes on unnormalised
        setattr(model, cut.head, None)
    return model.eval()


def _wanted(key: str, spec: StageSpec, tied: bool, cut: Cut) -> bool:
    if cut.is_embed(key):
        return spec.embeds or (spec.emits and tied)
    if cut.emits_with(key):
        return spec.emits
    return cut.layer_of(key) is not None


DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
           "I32": torch.int32}


def safetensors_entries(folder: Path) -> Iterator[tuple[object, int, str, dict]]:
    """Every tensor of a model folder's safetensors files, as (the open file, the offset of its data, its name in
    the model, its header entry), file after file; the file stays open while its tensors are taken. A name is the
    checkpoint's as transformers renames it on loading (GPT-NeoX's ``embed_out`` is the model's ``lm_head``)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no safetensors file")
    rename = model_names(folder)
    for path in files:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
            for key, meta in header.items():
                if key != "__metadata__":
                    yield f, 8 + size + meta["data_offsets"][0], rename(key), meta


@functools.cache
def model_names(folder: Path) -> Callable[[str], str]:
    """A checkpoint key of ``folder``'s model as the model names it: transformers' own renamings on loading (its
    conversion mapping for the class, on a model built without weights). NotImplementedError where a tensor is
    converted on loading, not just renamed (fused or split by transformers): a part of the model cannot read it."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    if not (folder / "config.json").is_file():  # tensors without a model: their names are the only ones
        return str
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    names = {key: True for key in model.state_dict()}

    def rename(key: str) -> str:
        name, converted = rename_source_key(key, renamings, converters, model.base_model_prefix, names)
        if converted is not None:
            raise NotImplementedError(f"{config.model_type}'s checkpoint tensor {key} is converted by transformers "
                                      "on loading; a pipeline stage or a TP shard reads tensors as stored")
        return name
    return rename


def safetensors_tensors(folder: Path, wanted: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a model folder's safetensors files whose names ``wanted`` accepts, one at a time, read with
    plain reads (no mapping of the file: a stage's peak memory holds its own weights, not the pages of the others
    it passed over)."""
    for f, offset, key, meta in safetensors_entries(folder):
        if not wanted(key):
            continue
        a, e = meta["data_offsets"]
        tensor = torch.empty(meta["shape"], dtype=DTYPES[meta["dtype"]])
        f.seek(offset)
        f.readinto(memoryview(tensor.view(torch.uint8).numpy()) if e > a else bytearray())
        yield key, tensor


def stage_view(model: torch.nn.Module, spec: StageSpec) -> torch.nn.Module:
    """The stage's model over ``model``'s own weights (shared, not copied): a server whose ranks hold the whole
    model (the front decodes with every layer) runs a pipelined prefill through views of it. Its layers are new
    modules numbered from 0 holding ``model``'s parameters, so the stage's cache is an ordinary one of its layers."""
    names = pipeline_cut(model.config)
    cut = stage_config(model.config, spec)
    dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
    with torch.device("meta"):
        stage = AutoModelForCausalLM.from_config(cut, dtype=dtype,
                                                 attn_implementation=model.config._attn_implementation)
    tied = ties_embeddings(model.config)
    shared = {name: t for key, t in model.state_dict(keep_vars=True).items()
              if (name := stage_keys(key, spec, tied, names)) is not None}
    stage.load_state_dict(shared, strict=False, assign=True)
    base, whole = stage.base_model, model.base_model
    for name, module in whole.named_children():  # the embedding, norm, rotary embedding: shared modules (their
        if name != names.layers:  # buffers, such as Gemma's embedding scale, are computed, not saved)
            setattr(base, name, module)
    setattr(stage, names.head, getattr(model, names.head))
    own = getattr(whole, names.layers)
    for i, layer in enumerate(getattr(base, names.layers)):  # the hooks on the layers' modules (a TP shard's sums
        originals = dict(own[spec.first + i].named_modules())  # over its group) hold in the view too
        for name, module in layer.named_modules():
            module._forward_hooks.update(originals[name]._forward_hooks)
    stage = _trimmed(stage, spec, tied, names)
    left = [name for name, t in [*stage.named_parameters(), *stage.named_buffers()] if t.is_meta]
    if left:
        raise NotImplementedError(f"a stage of {type(model).__name__} keeps tensors the whole model does not "
                                  f"share ({', '.join(left[:3])})")
    return stage
