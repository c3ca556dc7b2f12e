"""The chain link of a step's prompt segment (serve/step/plans.py): what its placement adds to the paper's chain.

- A segment held on the front (a prefix cache hit) over the chain: rank 0 receives the held positions from the front
  as its prefix (``send_held_prefix``) instead of computing them, and the chain goes on as usual.
- Held on every rank (the chunks before this one of a chunked prefill; full-attention layers only): every rank holds
  the first B positions already, so the chain carries only what comes after them, [B, start) to this rank and
  [B, end) on, and a chunk's traffic does not grow with the prompt; the exchange appends to what the rank holds.
  On the front alone, the held positions are the base the same way.
- Kept on every rank: each layer's K,V of [0, end) stay as the next chunk's base (``whole``).
- Kept sharded (KV-parallel decode): a full layer keeps only the rank's own positions (``OwnPartLink``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvrunahead.model.growing import GrowingKV
from kvrunahead.modes.kvr import OwnPartLink


@dataclass
class SegmentLink(OwnPartLink):
    holder: int | None = None  # the rank that sends rank 0 its prefix (held there), else the chain's own order
    base: list[GrowingKV] | None = None  # per layer: positions [0, B) held already, the exchange appends to them
    keep_whole: bool = False  # keep each layer's K,V after the exchange in ``whole`` (the next chunk's base)
    own_part: bool = False  # keep only this rank's own positions (the KVP shard)
    whole: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._held = self.base[0].n if self.base else 0  # the exchange appends to the base: fix B first

    @property
    def prev(self) -> int:
        return self.rank - 1 if self.rank > 0 else self.holder

    @property
    def held_len(self) -> int:
        return self._held

    @property
    def has_prev(self) -> bool:
        return super().has_prev or self.holder is not None

    def join(self, layer: int, received: list[torch.Tensor], local_kv: torch.Tensor) -> torch.Tensor:
        if self.base:  # the last chunk's too: a copy into storage of its own size would cost the step a copy of
            # every position on every rank (about 1.6 s at 12k on 2 CPU ranks); what keeps the cache longer (the prefix
            # cache) keeps its own copy, a decode's ends with the request
            kv = self.base[layer].extend(*received, local_kv)
        else:
            kv = super().join(layer, received, local_kv)
        if self.keep_whole:
            self.whole[layer] = self.base[layer] if self.base else GrowingKV.stacked(kv)
        return kv

    def keep(self, layer: int, kv: torch.Tensor) -> torch.Tensor:
        return super().keep(layer, kv) if self.own_part else kv
