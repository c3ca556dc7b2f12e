"""Continuous batching of the decode on the front rank: every decoding request advances in one forward per step.

Paged (models whose attention goes through transformers' interface: every model our attention enters): a request's
K,V is its table of blocks in the rank's pool (model/paged.py), written once from its prompt's cache and then by
one write per layer for every row of a step; a step is the rows of a mixed step (serve/step/rows.py) with no prompt
beside them, each row's query against its own blocks at its own length, sliding windows included (the kernel's
parameter); a Llama's or a Gemma 3's rows skip its forward's plumbing (model/direct_rows.py). A request joins or leaves
without touching the others' K,V: there is no batch to rebuild and no pad to compute. The ``n`` choices of a prompt
share its blocks by reference (``PagedKV.fork``).

The fallback, for models that compute their attention themselves: the requests' caches are left-padded to a common
length and stacked into one ``DynamicCache``; a 2D attention mask zeroes the pads and explicit position ids give
every request its own positions, so each row attends exactly what it would alone. The batch is rebuilt only when
its membership changes. Such a model with sliding-window layers decodes one request per forward on its own cache
(one padded cache cannot trim a window per row).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from transformers import DynamicCache

from kvrunahead.decode.shared_prefix import SharedContext
from kvrunahead.model import direct_rows
from kvrunahead.model.compiled import eager
from kvrunahead.model.forward import forward_takes, with_cache
from kvrunahead.model.growing import GrowingKV, GrowingLayer, grow_in_place
from kvrunahead.model.layout import KVLayout
from kvrunahead.model.paged import BLOCK_TOKENS, PagedKV
from kvrunahead.modes.kvr import ChainLink
from kvrunahead.ranks.transport import LocalTransport
from kvrunahead.serve.step.plans import question_id
from kvrunahead.serve.step.rows import Row, can_mix, mixed_forward

log = logging.getLogger(__name__)
KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, heads, tokens, head_dim], no pads
DEFAULT_TOKENS = 1 << 16  # a pool of its own where none is given (its blocks take memory only once written)


def cache_kv(cache: DynamicCache) -> KV:
    return [(layer.keys, layer.values) for layer in cache.layers]


class BatchDecoder:
    """``layout`` given and the model's attention pluggable: paged, in ``kv`` (the rank's pool; one of
    ``DEFAULT_TOKENS`` positions where None). Else the padded batch (``batched``) or one request per forward."""

    def __init__(self, model: torch.nn.Module, batched: bool, layout: KVLayout | None = None,
                 kv: PagedKV | None = None) -> None:
        self.model = model
        self.batched = batched
        self.device = next(model.parameters()).device
        self.paged = layout is not None and can_mix(model)
        if self.paged and kv is None:
            kv = PagedKV(layout, DEFAULT_TOKENS // BLOCK_TOKENS, layout.dtype, self.device)
        self.kv = kv if self.paged else None
        # a Llama's or a Gemma 3's rows over its weights, without its forward (model/direct_rows.py)
        self.direct = self.paged and direct_rows.takes(model, layout.dtype)
        self.blocks = kv  # the rank's pool, where the prefix cache's entries live even when this decode is unpaged
        self.layout = layout
        self.own: dict[str, object] = {}  # request id -> its pool (paged), its KV (padded) or its cache (one each)
        self.members: list[str] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [batch, tokens]: 0 on the pads
        self._keep = forward_takes(model, "logits_to_keep")

    def add(self, request_id: str, cache: DynamicCache | None, fork: bool | str = False) -> None:
        """A request joins the decode with its prompt's ``cache``. ``fork``: the prompt is shared (the prefix
        cache's entry): a name, the holder in this decoder's pool whose blocks it starts with (``cache`` None);
        True, ``cache`` is shared tensors, which a paged decode writes once for all their forks and holds by
        reference. Unpaged, a copy of its own is made."""
        if isinstance(fork, str) and fork:
            if self.paged:
                self.kv.share(request_id, fork)
                self.own[request_id] = self.kv
                return
            cache = DynamicCache(config=self.model.config)  # gathered, for a decode that cannot read blocks
            for layer, (k, v) in enumerate(self.blocks.gathered(fork)):
                cache.update(k, v, layer)
        if self.paged:
            tokens = max(layer.get_seq_length() for layer in cache.layers)  # a sliding layer keeps its window only
            (self.kv.fork if fork else self.kv.add)(request_id, cache_kv(cache), tokens)
            self.own[request_id] = self.kv
        elif self.batched:
            self.own[request_id] = cache_kv(cache)
        else:
            self.own[request_id] = grow_in_place(cache)

    def remove(self, request_id: str) -> None:
        """Free a request's K,V (finished or cancelled); a padded batch drops its row at the next step."""
        if self.own.pop(request_id, None) is not None and self.paged:
            self.kv.release(request_id)
        if request_id in self.members and self.cache is not None:
            self._unbatch()
        elif request_id in self.members:  # paged: no batch, only the list of who stepped last
            self.members.remove(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.own

    def rollback(self, request_id: str, tokens: int) -> None:
        """Cut the request's K,V back to its first ``tokens`` positions, where a forward it rode in failed part way
        (a worker lost in a mixed step: its token's position was taken before the forward). Only a paged row grows
        inside another forward; a padded batch or a request's own cache is appended by its decode step alone."""
        if self.paged and request_id in self.own:
            self.kv.truncate(request_id, tokens)

    def riders(self, segments) -> dict[str, Row]:
        """The decode rows ``segments`` (serve/step/plans.DecodeRow, one token each) as ``Row`` s that share a
        prompt's forward (serve/step/rows.py); none where the model decodes unpaged or has sliding windows (a
        prompt's part keeps a window's positions only)."""
        if not self.paged or self.layout.windows:
            return {}
        return {seg.request_id: Row(seg.tokens[0], seg.start, seg.request_id, self.kv) for seg in segments}

    @torch.no_grad()
    @eager()  # a compiled model's decode steps run eager (serve/rows.mixed_forward says why)
    def step(self, tokens: dict[str, int], positions: dict[str, int]) -> dict[str, torch.Tensor]:
        """Feed each request its last token at its position; the next-token logits ``[vocab]`` of each."""
        if self.paged:
            return self._rows_step(tokens, positions)
        if not self.batched:
            return {rid: self._forward(self.own[rid], [tokens[rid]], [positions[rid]], None)[0] for rid in tokens}
        if list(tokens) != self.members:
            self._rebuild(list(tokens))
        self.mask = torch.cat((self.mask, self.mask.new_ones(len(self.members), 1)), dim=1)
        logits = self._forward(self.cache, [tokens[r] for r in self.members], [positions[r] for r in self.members],
                               self.mask)
        return dict(zip(self.members, logits))

    def _rows_step(self, tokens: dict[str, int], positions: dict[str, int]) -> dict[str, torch.Tensor]:
        """One forward of every request's token, each attending its own blocks (no pads, nothing rebuilt)."""
        self.members = list(tokens)
        if self.direct:
            return dict(zip(tokens, direct_rows.decode_rows(self.model, self.kv, self.members, list(tokens.values()),
                                                            [positions[rid] for rid in tokens])))
        rows = [Row(tokens[rid], positions[rid], rid, self.kv) for rid in tokens]
        link = ChainLink(LocalTransport(), 0, self.layout, self.device)
        _, logits, _ = mixed_forward(self.model, [], link, rows, emit=False)
        return dict(zip(tokens, logits))

    def _forward(self, cache, tokens: list[int], positions: list[int], mask) -> torch.Tensor:
        ids = torch.tensor([[t] for t in tokens], device=self.device)
        pos = torch.tensor([[p] for p in positions], device=self.device)
        extra = {"logits_to_keep": 1} if self._keep else {}
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                         **with_cache(self.model, cache), **extra)
        return out.logits[:, -1]

    def _unbatch(self) -> None:
        """Give every member still alive its own (unpadded) KV back, then drop the batch."""
        total = self.mask.shape[1]
        for b, rid in enumerate(self.members):
            if rid in self.own:
                pad = total - int(self.mask[b].sum())
                self.own[rid] = [(layer.keys[b:b + 1, :, pad:], layer.values[b:b + 1, :, pad:])
                                 for layer in self.cache.layers]
        self.members, self.cache, self.mask = [], None, None

    def _rebuild(self, members: list[str]) -> None:
        if self.cache is not None:
            self._unbatch()
        kvs = [self.own[r] for r in members]
        lengths = [kv[0][0].shape[-2] for kv in kvs]
        total = max(lengths)
        cache = DynamicCache(config=self.model.config)
        cache.layers = [GrowingLayer(GrowingKV.left_padded([kv[layer] for kv in kvs])) for layer in range(len(kvs[0]))]
        self.mask = torch.tensor([[0] * (total - n) + [1] * n for n in lengths], device=self.device)
        self.members, self.cache = members, cache


class VariantDecoders:
    """One ``BatchDecoder`` per RoPE variant (see ``rank.RankContext``): requests whose prompts run different
    rotary embeddings advance in separate forwards, one per variant in use, each batched. Beside them, the
    shared-context requests' questions (decode/shared_prefix.py): one forward per request for all its questions
    still answering, its context read once."""

    def __init__(self, decoder_for: Callable[[object], BatchDecoder], record: bool = False) -> None:
        self.decoder_for = decoder_for
        # the front of a TP group: what its peers repeat (the prefix cache's changes too, in the same list)
        self.ops: list[tuple] | None = [] if record else None
        self.by_variant: dict[object, BatchDecoder] = {}
        self.variant_of: dict[str, object] = {}
        self.shared: dict[str, SharedContext] = {}  # request id -> its questions after its context
        self.question_of: dict[str, tuple[str, int]] = {}  # question row id -> (request id, question index)

    def add_questions(self, request_id: str, model: torch.nn.Module, cache: DynamicCache,
                      questions: list[list[int]]) -> torch.Tensor:
        """A shared context's questions join the decode after their packed prefill behind ``cache`` (the context's
        whole cache); each question's first-token logits ``[n, vocab]``."""
        shared = SharedContext(model, [torch.stack((layer.keys, layer.values)) for layer in cache.layers], questions)
        logits = shared.prefill()
        self.shared[request_id] = shared
        self.question_of.update((question_id(request_id, i), (request_id, i)) for i in range(len(questions)))
        return logits

    def take_ops(self) -> tuple:
        """The batch's changes since the last call (``record``), for the front's TP peers (plans.Mirrored)."""
        ops = tuple(self.ops or ())
        if self.ops is not None:
            self.ops.clear()  # the same list: the prefix cache records into it
        return ops

    def add(self, request_id: str, cache: DynamicCache, variant: object = None, fork: bool = False) -> None:
        if self.ops is not None:
            self.ops.append(("add", request_id, variant, fork))
        if variant not in self.by_variant:
            self.by_variant[variant] = self.decoder_for(variant)
        self.by_variant[variant].add(request_id, cache, fork)
        self.variant_of[request_id] = variant

    def remove(self, request_id: str) -> None:
        if self.ops is not None and request_id in self:
            self.ops.append(("remove", request_id))
        if request_id in self.variant_of:
            self.by_variant[self.variant_of.pop(request_id)].remove(request_id)
        if self.shared.pop(request_id, None) is not None:
            self.question_of = {q: owner for q, owner in self.question_of.items() if owner[0] != request_id}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.variant_of or request_id in self.shared

    def rollback(self, request_id: str, tokens: int) -> None:
        if request_id in self.variant_of:
            self.by_variant[self.variant_of[request_id]].rollback(request_id, tokens)

    @property
    def members(self) -> list[str]:
        """The requests in a batch now (for tests and the queue gauges)."""
        return [r for d in self.by_variant.values() for r in d.members]

    def riders(self, segments, variant: object = None) -> dict[str, Row]:
        """The rows among ``segments`` that can share the forward of a prompt run with ``variant`` (the same
        model), as ``BatchDecoder.riders`` gives them."""
        decoder = self.by_variant.get(variant)
        mine = [s for s in segments if s.request_id in self.variant_of and self.variant_of[s.request_id] == variant]
        return decoder.riders(mine) if decoder is not None and mine else {}

    @property
    def own(self) -> dict[str, object]:
        return {r: kv for d in self.by_variant.values() for r, kv in d.own.items()}

    def step(self, tokens: dict[str, int], positions: dict[str, int]) -> dict[str, torch.Tensor]:
        logits: dict[str, torch.Tensor] = {}
        asked: dict[str, dict[int, str]] = {}  # request id -> question index -> row id
        for row in tokens:
            if row in self.question_of:
                owner, i = self.question_of[row]
                asked.setdefault(owner, {})[i] = row
        for owner, rows in asked.items():
            got = self.shared[owner].step({i: tokens[r] for i, r in rows.items()},
                                          {i: positions[r] for i, r in rows.items()})
            logits.update((rows[i], row_logits) for i, row_logits in got.items())
        tokens = {r: t for r, t in tokens.items() if r not in self.question_of}
        for variant, decoder in self.by_variant.items():
            mine = [r for r in tokens if self.variant_of[r] == variant]
            if mine:
                logits.update(decoder.step({r: tokens[r] for r in mine}, {r: positions[r] for r in mine}))
        return logits
