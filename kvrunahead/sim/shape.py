"""A decoder's shape as the cost model needs it: FLOPs per token and per query-key pair, K,V bytes per token.

Read from a transformers config (parameters counted on the meta device, so any architecture and no memory),
or given by hand for the paper's models (Llama-7B and Falcon-7B in fp16, from their published configs).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import asdict, dataclass

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    qkv_params: int  # per layer: the Q, K and V projections
    other_params: int  # per layer: output projection, MLP, norms
    vocab: int
    dtype_bytes: int
    windows: tuple[int | None, ...] = ()  # per layer, its sliding window (None: full attention); (): all full

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    @property
    def sliding(self) -> bool:
        return any(w is not None for w in self.windows)

    @property
    def qkv_flops_per_token(self) -> float:
        return 2.0 * self.qkv_params

    @property
    def other_flops_per_token(self) -> float:
        return 2.0 * self.other_params

    @property
    def flops_per_pair(self) -> float:
        """QK^T and AV: two multiply-adds per head dimension per query head, for one visible query-key pair."""
        return 4.0 * self.heads * self.head_dim

    @property
    def layer_params(self) -> int:
        return self.qkv_params + self.other_params

    def causal_flops_per_token(self, context: int) -> float:
        """Average FLOPs of one token in one layer of a causal prefill of ``context`` tokens: its linear work and
        its share of the (context + 1) / 2 query-key pairs a token sees on average."""
        return self.qkv_flops_per_token + self.other_flops_per_token + self.flops_per_pair * (context + 1) / 2

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in one layer: what the chain and the all-gathers move."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def lm_head_bytes(self) -> int:
        return self.hidden * self.vocab * self.dtype_bytes

    def tp_shard(self, tp: int) -> ModelShape:
        """One rank's shape at tensor-parallel degree ``tp`` (model/tp.py): its query heads, its K,V heads (one
        where there are fewer than ranks: replicated), 1/tp of the projections and MLP; the LM head whole."""
        if tp == 1:
            return self
        if self.kv_heads >= tp:  # whole K,V groups, the busiest rank's share (model/tp.py's split)
            kv_heads = -(-self.kv_heads // tp)
            heads = kv_heads * (self.heads // self.kv_heads)
        else:
            heads, kv_heads = -(-self.heads // tp), 1
        return dataclasses.replace(self, name=f"{self.name} tp{tp}", heads=heads, kv_heads=kv_heads,
                                   qkv_params=self.hidden * (heads + 2 * kv_heads) * self.head_dim,
                                   other_params=-(-self.other_params // tp))

    def to_dict(self) -> dict:
        return asdict(self)


_SHAPES: dict[tuple[str, str, str], ModelShape] = {}


def shape_from_config(config, dtype: str, name: str = "") -> ModelShape:
    """The shape of a transformers model, with each layer's sliding window (the cost model prices a sliding layer's
    attention over its window, and its traffic as the window's K,V, for the KV chain). Built once per config: it
    instantiates the model on the meta device."""
    key = (config.to_json_string(), dtype, name)
    if key not in _SHAPES:
        _SHAPES[key] = _shape_from_config(config, dtype, name)
    return _SHAPES[key]


def _shape_from_config(config, dtype: str, name: str) -> ModelShape:
    import torch  # here, not at the top: kvr-plan and kvr-search import this module and answer --help torch-free
    from transformers import AutoModelForCausalLM

    from kvrunahead.model.layout import layer_windows

    windows = layer_windows(config)

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    skip = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings())
            if m is not None and getattr(m, "weight", None) is not None}
    # Learned absolute position embeddings (GPT-2 style) are no per-token layer work either.
    skip |= {id(p) for n, p in model.named_parameters() if n.endswith(("wpe.weight", "embed_positions.weight"))}
    per_layer = sum(p.numel() for p in model.parameters() if id(p) not in skip) // config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    qkv = config.hidden_size * (heads + 2 * kv_heads) * head_dim
    return ModelShape(name=name or config.model_type, layers=config.num_hidden_layers, hidden=config.hidden_size,
                      heads=heads, kv_heads=kv_heads, head_dim=head_dim, qkv_params=qkv,
                      other_params=per_layer - qkv, vocab=config.vocab_size, dtype_bytes=DTYPE_BYTES[dtype],
                      windows=windows if any(w is not None for w in windows) else ())


def _llama(name: str, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
           dtype_bytes: int = 2) -> ModelShape:
    head_dim = hidden // heads
    qkv = hidden * (heads + 2 * kv_heads) * head_dim
    other = hidden * hidden + 3 * hidden * intermediate + 2 * hidden  # o_proj, gated MLP, two RMSNorms
    return ModelShape(name, layers, hidden, heads, kv_heads, head_dim, qkv, other, vocab, dtype_bytes)


# The paper's models (section 5, appendix A), from their published configs; fp16 as in the paper.
PAPER_SHAPES: dict[str, ModelShape] = {
    "llama-7b": _llama("llama-7b", 32, 4096, 32, 32, 11008, 32000),
    "llama-13b": _llama("llama-13b", 40, 5120, 40, 40, 13824, 32000),
    "llama-7b-gqa8": _llama("llama-7b-gqa8", 32, 4096, 32, 8, 11008, 32000),
    "llama-7b-mqa": _llama("llama-7b-mqa", 32, 4096, 32, 1, 11008, 32000),
    # Llama-2-70B (GQA, 8 K,V heads): about 140 GB in bfloat16, more than one A100 or H100 holds.
    "llama-70b": _llama("llama-70b", 80, 8192, 64, 8, 28672, 32000),
    # Falcon-7B: multi-query attention (71 query heads of 64, one K,V head), a non-gated 4x MLP run in parallel
    # with attention, one LayerNorm with bias per layer.
    "falcon-7b": ModelShape("falcon-7b", 32, 4544, 71, 1, 64, 4544 * 73 * 64, 4544 * 4544 + 2 * 4544 * 18176
                            + 2 * 4544, 65024, 2),
}


def config_hash(config) -> str:
    """A short hash of a model config's architecture (not of its weights or run-time settings)."""
    d = {k: v for k, v in config.to_dict().items()
         if not k.startswith("_") and k not in ("transformers_version", "dtype", "torch_dtype", "architectures")}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:12]
