"""Putting our own attention into an unmodified transformers model.

The attention functions are registered with transformers' ``AttentionInterface`` and read the per-forward state
from a context variable, so the model code stays transformers' own.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AutoModelForCausalLM, PretrainedConfig

from kvrunahead.model.forward import one_position

_STATE: contextvars.ContextVar = contextvars.ContextVar("kvrunahead_attention_state")


@contextlib.contextmanager
def attention_mode(model: torch.nn.Module, implementation: str, state: object):
    """Run ``model`` with a registered attention function and its state, then restore SDPA."""
    token = _STATE.set(state)
    previous = model.config._attn_implementation
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
        _STATE.reset(token)


def current_state():
    return _STATE.get()


def register(name: str, fn) -> None:
    AttentionInterface.register(name, fn)


def require_attention_interface(model: torch.nn.Module, mode: str) -> None:
    if not uses_attention_interface(model):
        raise NotImplementedError(
            f"{type(model).__name__} computes attention itself instead of through transformers' "
            f"AttentionInterface, which mode {mode!r} needs to insert its attention"
        )


_PROBE = "kvrunahead_probe"


def _probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    current_state().append(module)
    out = F.scaled_dot_product_attention(query, expand_kv(key, query.shape[1]), expand_kv(value, query.shape[1]))
    return out.transpose(1, 2).contiguous(), None


@torch.no_grad()
def uses_attention_interface(model: torch.nn.Module | PretrainedConfig) -> bool:
    """Whether the model's attention goes through transformers' AttentionInterface, which the context-parallel
    modes need to put their own attention in.

    Given a config, it is read from the model class without building the model (to plan a run); given a built
    model, a one-token forward probes it, since a class can declare the interface and still call SDPA itself
    (Falcon, for one): the runtime probes before relying on it.
    """
    if isinstance(model, PretrainedConfig):
        cls = AutoModelForCausalLM._model_mapping.get(type(model), None)
        return bool(getattr(cls, "_supports_attention_backend", False))
    if not hasattr(model, "_kvrunahead_uses_interface"):
        calls: list = []
        with attention_mode(model, _PROBE, calls):
            model.base_model(**one_position(model), use_cache=False)
        model._kvrunahead_uses_interface = len(calls) > 0
    return model._kvrunahead_uses_interface


register(_PROBE, _probe_attention)


def expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Repeat K/V heads to the query heads (GQA/MQA), as transformers' SDPA path does with a mask."""
    b, kv_heads, n, d = t.shape
    if kv_heads == heads:
        return t
    return t[:, :, None].expand(b, kv_heads, heads // kv_heads, n, d).reshape(b, heads, n, d)
