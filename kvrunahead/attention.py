"""Attention pieces shared by the context-parallel modes: masks by position, log-sum-exp merge, zigzag layout.

The custom attention functions are registered with transformers' ``AttentionInterface`` and read the
per-forward state from a context variable, so the model code stays transformers' own.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kvrunahead.partition import Partition, zigzag_ranges

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
def uses_attention_interface(model: torch.nn.Module) -> bool:
    """Whether the model's attention goes through transformers' AttentionInterface (Falcon, for one,
    calls SDPA itself), which the context-parallel modes need to put their own attention in."""
    if not hasattr(model, "_kvrunahead_uses_interface"):
        calls: list = []
        one_token = torch.zeros((1, 1), dtype=torch.long, device=next(model.parameters()).device)
        with attention_mode(model, _PROBE, calls):
            model.base_model(input_ids=one_token, use_cache=False)
        model._kvrunahead_uses_interface = len(calls) > 0
    return model._kvrunahead_uses_interface


register(_PROBE, _probe_attention)


def zigzag_token_ranges(partition: Partition) -> list[list[tuple[int, int]]]:
    return zigzag_ranges(partition.context_len, partition.world_size)


def zigzag_emitter(world_size: int) -> int:
    return 0  # rank 0 holds chunk 2p-1, the end of the prompt


def causal_mask(q_start: int, q_len: int, k_start: int, k_len: int, device, window: int | None = None) -> torch.Tensor:
    """Boolean ``[q_len, k_len]``: key position j is visible to query position i when j <= i (and, in a sliding
    window of ``window``, i - j < window, transformers' convention)."""
    q = torch.arange(q_start, q_start + q_len, device=device)[:, None]
    k = torch.arange(k_start, k_start + k_len, device=device)[None, :]
    visible = k <= q
    return visible & (k > q - window) if window else visible


def expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Repeat K/V heads to the query heads (GQA/MQA), as transformers' SDPA path does with a mask."""
    b, kv_heads, n, d = t.shape
    if kv_heads == heads:
        return t
    return t[:, :, None].expand(b, kv_heads, heads // kv_heads, n, d).reshape(b, heads, n, d)


def attend(q, k, v, mask, scale) -> torch.Tensor:
    """SDPA of ``q`` against visible keys; ``mask`` None means all keys are visible."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def attend_with_lse(q, k, v, causal: bool, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output and its per-row log-sum-exp (float32), for exact merging of partial blocks.

    ``causal`` is top-left aligned, which is right for a diagonal block (queries and keys of one chunk).
    On CPU this is the same flash kernel that ``scaled_dot_product_attention`` dispatches to.
    """
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out.float(), lse.float()
    scores = (q.float() @ k.float().transpose(-1, -2)) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if causal:
        n = q.shape[-2]
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ v.float(), lse


def merge_lse(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Combine two softmax-normalised partial results over disjoint key sets (ring attention's merge)."""
    if out is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - new_lse)[..., None] + block_out * torch.exp(block_lse - new_lse)[..., None]
    return out, new_lse
