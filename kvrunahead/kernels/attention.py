"""The Python face of ``kvr::attention``: a varlen batch of query rows, each against its own K,V pieces, visible by
position. Callers describe what they have; nothing is copied, padded or repeated per query head.

A row is a run of queries at consecutive positions in one batch entry of ``q``; its pieces are slices of K,V
tensors (``[batch, kv_heads, tokens, head_dim]``, any strides with the head dimension contiguous), each with the
position of its first key. A key is visible to a query when ``key <= query`` (``causal``) and ``query - key <
window`` (a sliding window; 0 for none); ``causal=False`` and no window: every key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvrunahead import kernels


@dataclass(frozen=True)
class Piece:
    keys: torch.Tensor
    values: torch.Tensor
    position: int  # of key index ``lo``
    batch: int = 0
    lo: int = 0
    hi: int | None = None  # None: to the end


@dataclass(frozen=True)
class Row:
    batch: int
    q_lo: int
    q_hi: int
    position: int  # of query index ``q_lo``
    pieces: list[Piece] = field(default_factory=list)


def _register_fake() -> None:
    if getattr(_register_fake, "done", False):
        return

    @torch.library.register_fake("kvr::attention")
    def _(q, keys, values, rows, pieces, causal, window, scale, out_float):
        b, heads, n, d = q.shape
        out = q.new_empty((b, n, heads, d), dtype=torch.float32 if out_float else q.dtype)
        return out, q.new_empty((b, heads, n), dtype=torch.float32)

    _register_fake.done = True


def varlen(q: torch.Tensor, rows: list[Row], causal: bool = True, window: int | None = None,
           scale: float | None = None, out_float: bool = True, paged: tuple | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``rows`` of ``q`` (``[B, heads, n, head_dim]``); returns the output ``[B, n, heads, head_dim]``
    (float32, or q's dtype when ``out_float`` is False: the layout transformers' attention functions return) and
    the log-sum-exp ``[B, heads, n]`` (float32). Queries in no row get 0 and -inf. ``paged``: more rows, after
    ``rows``, already as the kernel's tables over one K,V pair, ``(keys, values, row_table, piece_table)`` with
    their pieces naming tensor 0 and numbered from 0 (model/paged.PagedKV.tables)."""
    tensors: dict[int, int] = {}
    keys, values, row_table, piece_table = [], [], [], []
    for row in rows:
        first = len(piece_table)
        for p in row.pieces:
            t = tensors.get(id(p.keys))
            if t is None:
                t = tensors[id(p.keys)] = len(keys)
                keys.append(_head_contiguous(p.keys))
                values.append(_head_contiguous(p.values))
            hi = p.keys.shape[2] if p.hi is None else p.hi
            piece_table.append((t, p.batch, p.lo, hi, p.position))
        row_table.append((row.batch, row.q_lo, row.q_hi, row.position, first, len(piece_table)))
    if not kernels.build():
        raise RuntimeError(f"the CPU attention kernel is not built: {kernels.why_not_built()}")
    _register_fake()
    row_t = torch.tensor(row_table, dtype=torch.long).reshape(-1, 6)
    piece_t = torch.tensor(piece_table, dtype=torch.long).reshape(-1, 5)
    if paged is not None:
        k, v, more_rows, more_pieces = paged
        if keys:  # renumbered after the rows' own
            more_rows = more_rows + more_rows.new_tensor([0, 0, 0, 0, len(piece_table), len(piece_table)])
            more_pieces = more_pieces + more_pieces.new_tensor([len(keys), 0, 0, 0, 0])
        keys, values = [*keys, k], [*values, v]
        row_t, piece_t = torch.cat((row_t, more_rows)), torch.cat((piece_t, more_pieces))
    return torch.ops.kvr.attention(
        _head_contiguous(q), keys, values, row_t, piece_t, causal, int(window or 0),
        float(scale if scale is not None else 1 / math.sqrt(q.shape[-1])), out_float)


def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_position: int = 0, k_position: int = 0,
          causal: bool = True, window: int | None = None, scale: float | None = None, out_float: bool = True
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every batch entry's queries (positions from ``q_position``) against its keys (from ``k_position``);
    ``k``/``v`` of batch 1 are shared by every entry. Returns as ``varlen``."""
    b, n = q.shape[0], q.shape[2]
    shared = k.shape[0] == 1
    rows = [Row(i, 0, n, q_position, [Piece(k, v, k_position, 0 if shared else i)]) for i in range(b)]
    return varlen(q, rows, causal, window, scale, out_float)


def usable(q: torch.Tensor) -> bool:
    """Whether ``q``'s attention runs on our kernel: a CPU tensor of float32 or bfloat16, our kernel chosen for its
    dtype and built."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and kernels.ours_on_cpu(q.dtype)


def _head_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
