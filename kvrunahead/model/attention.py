"""Putting our own attention into an unmodified transformers model.

The attention functions are registered with transformers' ``AttentionInterface`` and read the per-forward state
from a context variable, so the model code stays transformers' own.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AutoModelForCausalLM, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

from kvrunahead.kernels import attention as kernel
from kvrunahead.model import tp
from kvrunahead.model.forward import one_position

_STATE: contextvars.ContextVar = contextvars.ContextVar("kvrunahead_attention_state")
# model -> {implementation: [(config, the value set_attn_implementation gave it)]}: a switch made once is replayed
_SWITCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _configs(model: torch.nn.Module) -> list[PretrainedConfig]:
    """Every config a switch of ``model``'s attention can touch: its submodels' and their sub-configs."""
    found: dict[int, PretrainedConfig] = {}
    queue = [m.config for m in model.modules() if isinstance(getattr(m, "config", None), PretrainedConfig)]
    while queue:
        config = queue.pop()
        if id(config) not in found:
            found[id(config)] = config
            queue += [c for key in config.sub_configs if isinstance(c := getattr(config, key, None),
                                                                     PretrainedConfig)]
    return list(found.values())


def switch_attention(model: torch.nn.Module, implementation: str) -> None:
    """``model.set_attn_implementation(implementation)``, which walks every module and checks the name each time
    (a few milliseconds a call on a 30-layer model: a decode step switches twice); the first switch of a model to a
    name goes through it, later ones set the configs to what it set."""
    known = _SWITCHES.setdefault(model, {})
    if implementation not in known:
        model.set_attn_implementation(implementation)
        known[implementation] = [(c, c._attn_implementation_internal) for c in _configs(model)]
        return
    for config, value in known[implementation]:
        config._attn_implementation_internal = value


@contextlib.contextmanager
def attention_mode(model: torch.nn.Module, implementation: str, state: object):
    """Run ``model`` with a registered attention function and its state, then restore the one it had."""
    token = _STATE.set(state)
    previous = model.config._attn_implementation
    switch_attention(model, implementation)
    try:
        yield
    finally:
        switch_attention(model, previous)
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
        with attention_mode(model, _PROBE, calls), tp.alone():  # a TP shard probes without its group
            model.base_model(**one_position(model), use_cache=False)
        model._kvrunahead_uses_interface = len(calls) > 0
    return model._kvrunahead_uses_interface


register(_PROBE, _probe_attention)


CPU_KERNEL = "kvrunahead_cpu"


def cpu_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """A causal model's own attention on our CPU kernel (kvrunahead/kernels), the one-process path: its queries are
    the last of its keys' positions, masked pairs never scored, K,V never repeated per query head. Anything it does
    not take (a mask, soft-capping, dropout, a non-causal module, a GPU tensor) goes to transformers' SDPA."""
    if (attention_mask is None and kwargs.get("softcap") is None and not dropout and is_causal is not False
            and getattr(module, "is_causal", True) and kernel.usable(query)):
        start = key.shape[2] - query.shape[2]
        out, _ = kernel.block(query, key, value, start, 0, causal=True, window=kwargs.get("sliding_window"),
                              scale=scaling, out_float=False)
        return out, None
    if attention_mask is None and is_causal is not False and getattr(module, "is_causal", True):
        # _cpu_mask left the mask out (the queries are the last of the keys): SDPA's own causal flag would align
        # the queries with the first keys, so the mask is spelled out, the window's too
        attention_mask = _last_positions_mask(query.shape[2], key.shape[2], kwargs.get("sliding_window"),
                                              query.device)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def _last_positions_mask(queries: int, keys: int, window: int | None, device) -> torch.Tensor:
    """Which keys each of the last ``queries`` of ``keys`` positions sees, causal (within ``window``)."""
    q = torch.arange(keys - queries, keys, device=device)[:, None]
    k = torch.arange(keys, device=device)[None, :]
    seen = k <= q
    return (seen & (k > q - window) if window else seen)[None, None]


def _cpu_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
              attention_mask=None, local_size=None, **kwargs):
    """No mask where the kernel's positions say it all: causal, no padding, the queries the last of the keys (a
    sliding window's layers pass their window to the attention). Else SDPA's mask, which the attention hands on."""
    plain = (mask_function is causal_mask_function and local_size is None and kv_offset == 0
             and isinstance(q_offset, int) and q_offset + q_length == kv_length)
    if plain and (attention_mask is None or bool(attention_mask.all())):
        return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset,
                     mask_function=mask_function, attention_mask=attention_mask, local_size=local_size, **kwargs)


register(CPU_KERNEL, cpu_attention)
AttentionMaskInterface.register(CPU_KERNEL, _cpu_mask)


def expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Repeat K/V heads to the query heads (GQA/MQA), as transformers' SDPA path does with a mask."""
    b, kv_heads, n, d = t.shape
    if kv_heads == heads:
        return t
    return t[:, :, None].expand(b, kv_heads, heads // kv_heads, n, d).reshape(b, heads, n, d)
