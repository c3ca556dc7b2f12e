"""Attention pieces the context-parallel modes share: masks by position, attention with its log-sum-exp and the
merge of partial blocks."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def causal_mask(q_start: int, q_len: int, k_start: int, k_len: int, device, window: int | None = None) -> torch.Tensor:
    """Boolean ``[q_len, k_len]``: key position j is visible to query position i when j <= i (and, in a sliding
    window of ``window``, i - j < window, transformers' convention)."""
    q = torch.arange(q_start, q_start + q_len, device=device)[:, None]
    k = torch.arange(k_start, k_start + k_len, device=device)[None, :]
    visible = k <= q
    return visible & (k > q - window) if window else visible


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


def refuse_softcap(kwargs: dict, mode: str) -> None:
    if kwargs.get("softcap") is not None:
        raise NotImplementedError(f"this model soft-caps its attention logits, which {mode} does not do; use "
                                  "--kvr-attention masked (kvr) or another mode")
