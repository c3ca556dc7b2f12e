"""Attention pieces the context-parallel modes share: masks by position, attention with its log-sum-exp and the
merge of partial blocks."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvrunahead.kernels import attention as kernel
from kvrunahead.model.attention import expand_kv, uses_attention_interface
from kvrunahead.model.layout import soft_caps


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


def lse_kernel(device_type: str, dtype: torch.dtype, head_dim: int) -> str:
    """The fused kernel that returns attention with its log-sum-exp on a device: never a materialised score matrix.

    CPU: the flash kernel SDPA dispatches to. CUDA: flash attention for half precisions and head sizes it takes,
    else the memory-efficient kernel (float32, odd head sizes), which computes the log-sum-exp when asked.
    """
    if device_type == "cpu":
        return "cpu-flash"
    if device_type == "cuda":
        if dtype in (torch.float16, torch.bfloat16) and head_dim <= 256 and head_dim % 8 == 0:
            return "flash"
        return "efficient"
    raise NotImplementedError(f"no fused attention with log-sum-exp on {device_type!r}; the split and ring "
                              "attentions run on cpu and cuda")


def _fused_with_lse(q, k, v, causal: bool, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused kernel call; ``k``/``v`` have as many heads as ``q``."""
    kernel = lse_kernel(q.device.type, q.dtype, q.shape[-1])
    if kernel == "cpu-flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    elif kernel == "flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                          scale=scale)[:2]
        lse = lse[..., : q.shape[-2]]  # the kernel pads its log-sum-exp rows to a multiple of 32
    return out.float(), lse.float()


def attend_with_lse(q, k, v, causal: bool, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output (float32) and its per-row log-sum-exp (float32), for exact merging of partial blocks.

    ``k``/``v`` may have fewer heads than ``q`` (GQA, MQA). ``causal`` is top-left aligned, which is right for a
    diagonal block (queries and keys of one chunk); only such a block has its K,V repeated to the query heads. A
    block every query sees in full runs the query heads of one K,V head as one longer query sequence instead, so
    the (long) prefix K,V is never copied per query head.
    """
    if kernel.usable(q):  # the CPU's: one call, K,V read in place for every query head of theirs
        out, lse = kernel.block(q, k, v, causal=causal, scale=scale)
        return out.transpose(1, 2), lse
    b, heads, n, d = q.shape
    kv_heads = k.shape[1]
    if causal or kv_heads == heads:
        return _fused_with_lse(q, expand_kv(k, heads), expand_kv(v, heads), causal, scale)
    grouped = q.reshape(b, kv_heads, heads // kv_heads * n, d)
    out, lse = _fused_with_lse(grouped, k, v, False, scale)
    # reshape, not view: a CUDA kernel's output may be laid out [b, rows, heads, d] (transposed), not contiguous
    return out.reshape(b, heads, n, d), lse.reshape(b, heads, n)


def positional_attention_with_lse(q, k, v, q_start: int, k_start: int, window: int | None, scale
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries at positions from ``q_start`` against keys at positions from ``k_start``, each seeing the keys at or
    before it (within ``window``): output ``[B, heads, n, d]`` and log-sum-exp, float32. A query that sees no key
    gets output 0 and log-sum-exp -inf. On the CPU no mask is built."""
    if kernel.usable(q):
        out, lse = kernel.block(q, k, v, q_start, k_start, causal=True, window=window, scale=scale)
        return out.transpose(1, 2), lse
    visible = causal_mask(q_start, q.shape[2], k_start, k.shape[2], q.device, window)
    return masked_attention_with_lse(q, k, v, visible, scale)


def masked_attention_with_lse(q, k, v, visible: torch.Tensor, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention under a boolean ``visible`` broadcastable to the scores ``[B, heads, n, keys]``, the scores
    materialised (short key blocks only: a decode step's own tokens, a window). Output and log-sum-exp, float32; a
    query that sees no key gets output 0 and log-sum-exp -inf (it adds nothing to a merge)."""
    heads, d = q.shape[1], q.shape[-1]
    k, v = expand_kv(k, heads).float(), expand_kv(v, heads).float()
    scores = (q.float() @ k.transpose(-1, -2)) * (scale if scale is not None else 1 / math.sqrt(d))
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v, lse


def merge_lse(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Combine two softmax-normalised partial results over disjoint key sets (ring attention's merge).

    In place: ``out`` and ``block_out`` are the kernels' own float32 buffers, so the merge allocates nothing of the
    size of an output."""
    if out is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    block_out.mul_(torch.exp(block_lse - new_lse)[..., None])
    out.mul_(torch.exp(lse - new_lse)[..., None]).add_(block_out)
    return out, new_lse


def why_not_inserted(config, what: str) -> str | None:
    """Why ``what`` (an attention of ours put into the model through transformers' interface) cannot run this
    model exactly, or None: the model must use that interface and must not soft-cap its logits."""
    if soft_caps(config):
        return f"it soft-caps its attention logits, which {what} does not do"
    if not uses_attention_interface(config):
        return f"it computes attention itself, not through transformers' AttentionInterface, which {what} needs"
    return None


def refuse_softcap(kwargs: dict, mode: str) -> None:
    if kwargs.get("softcap") is not None:
        raise NotImplementedError(f"this model soft-caps its attention logits, which {mode} does not do; use "
                                  "--kvr-attention masked (kvr) or another mode")
