"""What the next step computes (torch-free): the running requests' next tokens (decode segments; a request carrying
questions decodes one row per question) and one prefill (a prompt, a chunk of a long one, a packed batch of short
ones). A request carrying questions is one request like the others: its context is its prompt, prefilled alone (never
packed, never chunked), in the queue's order.

Mixed steps (the default; vLLM v1's and Sarathi's stall-free batching): every step carries every running request's
next token beside the next prefill, so a long prompt's chunks never hold a decode back by more than the step they
share. TTFT first: a waiting request is prefilled as soon as the engine is free; the requests waiting behind it join
its prefill as one packed sequence (Prepacking) while their tokens fit ``pack_tokens``. With ``prefill_first`` (an
offline batch, whose figure is the time to every prompt's first token), the running requests decode only once no
prefill waits. With ``mixed`` off, a step
is a prefill or a decode, never both (after a prefill, the next step decodes whenever any request is decoding).

Which prefill goes first is the policy's:
- ``fcfs``: first come, first served; a long prompt prefilled in chunks keeps its place in line.
- ``lars``: Medha's length-aware relative slack. A request's slack is the time left to its TTFT deadline less the
  predicted prefill work it still has; LARS divides it by the request's whole predicted work, and the request with
  the least relative slack goes first. A short request with the same seconds of slack as a long one can afford to
  wait more (its slack is many times its work); as time passes, every waiting request's slack falls, so a long
  one's turn comes. Bounded: a request passed over ``starve_after`` prefill steps in a row goes next whatever the
  slacks say, so a stream of urgent short requests cannot starve a long one (nor the other way round).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvrunahead.choices import SCHEDULES
from kvrunahead.serve.chunking import ALONE_BUDGETS, ChunkPlanner, Slack
from kvrunahead.serve.sequence import QueueFull, Sequence


@dataclass
class Step:
    """One engine step, plain data: the running requests whose next tokens it computes, and the waiting ones it
    prefills (none; one, whole or its next chunk; several packed end to end, modes/packing.py; or those the prefix
    cache answers whole, which need no prefill: the other choices of ``n``). The prefilled requests are out of the
    queue; a decode's are still in ``running``."""

    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[Sequence] = field(default_factory=list)
    chunk_end: int | None = None  # a chunked prefill's next chunk: its positions [prefilled, chunk_end); None: whole
    budget_s: float = 0.0  # the seconds that chunk was sized to (the step budget, LARS's share or its whole rest)


STARVE_AFTER = 8  # prefill steps a request may be passed over in a row before it goes next
YIELD_FLOOR = 0.5  # the least share of a step's budget a long prefill keeps while others wait (LARS)
WHOLE_CAP = 3.0  # the most step budgets a prefill takes in one step where its deadline needs it whole (LARS)


class Scheduler:
    """``chunks``: how long a prompt's steps are (serve/chunking.py; None: every prompt whole). The scheduler sizes
    each step: which requests it carries and, for a chunked prefill, where its next chunk ends."""

    def __init__(self, max_queue: int, pack_tokens: int = 0, policy: str = "fcfs", slack: Slack | None = None,
                 starve_after: int = STARVE_AFTER, mixed: bool = True, prefill_first: bool = False,
                 cached: Callable[[list[int], object], bool] | None = None,
                 answered: Callable[[Sequence], bool] | None = None, chunks: ChunkPlanner | None = None) -> None:
        if policy not in SCHEDULES:
            raise ValueError(f"unknown schedule {policy!r}; policies: {', '.join(SCHEDULES)}")
        if policy == "lars" and slack is None:
            raise ValueError("the lars schedule needs each request's predicted work (a cost model)")
        self.max_queue = max_queue
        self.pack_tokens = pack_tokens  # 0: one prompt per prefill
        self.policy, self.slack, self.starve_after = policy, slack, starve_after
        self.mixed, self.prefill_first = mixed, prefill_first
        self.cached = cached or (lambda ids, rope: False)  # a prompt whose start is cached prefills alone
        self.answered = answered or (lambda seq: False)  # one the prefix cache holds whole: nothing to compute
        self.chunks = chunks
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # long prompts partly prefilled, between their chunks
        self.running: list[Sequence] = []
        self._last_was_prefill = False
        self.hold_prefills = False  # a worker is lost: no prefill runs until the workers are back (decodes go on, and
        # the prompts the prefix cache answers whole)
        self.kv = None  # the front's K,V pool (serve/kv_pool.KVRoom): a prefill is taken where its blocks are free

    @property
    def queued(self) -> int:
        """The requests waiting for a prefill or their next chunk."""
        return len(self.waiting) + len(self.prefilling)

    def check_room(self, queued: int) -> None:
        """Raise QueueFull where ``queued`` requests waiting leave no room for one more."""
        if queued >= self.max_queue:
            raise QueueFull(f"{queued} requests are waiting (--max-queue {self.max_queue})")

    def add(self, seq: Sequence) -> None:
        self.check_room(self.queued)
        self.waiting.append(seq)

    def schedule(self, now: float | None = None) -> Step | None:
        """The next step, or None when idle. A prefilled sequence leaves ``waiting`` (or ``prefilling``) here; a
        chunk's sequence comes back through ``resume``."""
        now = time.monotonic() if now is None else now
        decoding = bool(self.running)
        if self.prefill_first and (self.waiting or self.prefilling):
            return self._sized([], self._prefill(now), now)
        if self.mixed:
            prefills = self._prefill(now)
            return self._sized(list(self.running), prefills, now) if prefills or decoding else None
        decode_due = decoding and (self._last_was_prefill or not (self.waiting or self.prefilling))
        if decode_due:
            self._last_was_prefill = False
            return Step(list(self.running))
        prefills = self._prefill(now)
        self._last_was_prefill = bool(prefills)
        return self._sized([], prefills, now) if prefills else None

    def _sized(self, decodes: list[Sequence], prefills: list[Sequence], now: float) -> Step:
        """The step, its prefill's chunk sized: a prompt whose one-step prefill would overrun the budget (never one
        carrying questions, nor one the prefix cache answers whole) runs its next chunk, the longest expected to
        fit this chunk's budget (``--chunk-tokens``: its chunk)."""
        step = Step(decodes, prefills)
        if self.chunks is None or len(prefills) != 1:
            return step
        seq = prefills[0]
        if not seq.prefilled and (seq.request.questions or not self.chunks.chunked(seq.prefill_len)
                                  or self.answered(seq)):
            return step
        step.budget_s = self.chunk_budget(seq, now)
        if seq.prefilled and not self.chunks.fixed and not (self.running or self.waiting or self.prefilling):
            # Nothing decodes and nothing waits: the chunk may take as long as the prompt's prefill so far, up to
            # ALONE_BUDGETS budgets, so a prompt alone runs in fewer, longer chunks (each chunk's fixed cost paid
            # fewer times) and a request that arrives meanwhile waits at most that long.
            step.budget_s = max(step.budget_s, min(ALONE_BUDGETS * step.budget_s,
                                                   self.chunks.predict_s(0, seq.prefilled)))
        step.chunk_end = self.chunks.end(seq.prefill_len, seq.prefilled, step.budget_s)
        return step

    def chunk_budget(self, seq: Sequence, now: float) -> float:
        """The seconds ``seq``'s next chunk may take: the step budget; under LARS less what a long prefill yields by
        its relative slack while shorter prefills wait, and more where cutting the rest of a prefill would miss its
        TTFT deadline (``whole_if_due``)."""
        budget_s = self.chunks.budget_s
        if self.policy != "lars":
            return budget_s
        if self.shorter_waiting(seq):
            return budget_s * yielded_share(self.slack.of(seq, now))
        return max(budget_s, self.whole_if_due(seq, now))

    def whole_if_due(self, seq: Sequence, now: float) -> float:
        """The predicted seconds of the rest of ``seq``'s prefill where it should run in one step, else 0: where its
        chunks, each followed by a decode step of the running requests, would end after its TTFT deadline, and the
        rest takes at most ``WHOLE_CAP`` step budgets (what it then holds the decodes back by). A prompt of a few
        hundred tokens cut into chunks pays each step's fixed costs and a decode step between them; a long document
        with its deadline minutes away is still cut to the budget."""
        chunks = self.chunks
        rest = chunks.predict_s(seq.prefilled, seq.prefill_len)
        if not chunks.budget_s < rest <= WHOLE_CAP * chunks.budget_s:
            return 0.0
        running = [s.next_position for s in self.running]
        gap = chunks.cost.decode_step_s(running) if running else 0.0
        chunked_end = now + rest + (math.ceil(rest / chunks.budget_s) - 1) * gap
        deadline = seq.request.arrival_s + self.slack.target_s(seq)
        return rest if chunked_end > deadline else 0.0

    def _prefill(self, now: float) -> list[Sequence]:
        """The next prefill's requests, taken out of the queue (none when nothing waits; while prefills are held, only
        those the prefix cache answers whole, which no rank computes)."""
        if self.hold_prefills:
            return self._take_answered(self.order(now))
        if self.waiting or self.prefilling:
            order = self.order(now)
            first = order[0]
            if not self._admit(first):  # it waits for its blocks, the decodes freeing them: no new prompt overtakes
                first = next((s for s in order if s in self.prefilling), None)  # a chunked one holds its own
                if first is None:
                    return []
            for seq in order:
                seq.passed_over = 0 if seq is first else seq.passed_over + 1
            if first in self.prefilling:
                self.prefilling.remove(first)
                return [first]
            self.waiting.remove(first)
            if self.answered(first):  # nothing to compute: every other such request goes in the same step (n)
                return [first] + self._take_answered(order[1:])
            seqs, total = [first], first.prefill_len
            # A prompt whose length needs the RoPE extended runs on another model variant, one whose start the
            # prefix cache holds prefills its new tokens alone, one scored keeps each position's logits: never
            # packed. The others are taken in the policy's order, up to the first that does not fit, so none is
            # overtaken.
            packs = bool(self.pack_tokens) and self._packable(first)
            for seq in (s for s in order[1:] if s in self.waiting):
                if not (packs and total + seq.prefill_len <= self.pack_tokens and self._packable(seq)
                        and self._admit(seq)):
                    break
                self.waiting.remove(seq)
                seqs.append(seq)
                total += seq.prefill_len
            for seq in seqs[1:]:
                seq.passed_over = 0
            return seqs
        return []

    def _take_answered(self, order: list[Sequence]) -> list[Sequence]:
        """The waiting requests of ``order`` that the prefix cache answers whole and the pool admits, taken out."""
        seqs = [s for s in order if s in self.waiting and self.answered(s) and self._admit(s)]
        for seq in seqs:
            self.waiting.remove(seq)
            seq.passed_over = 0
        return seqs

    def _admit(self, seq: Sequence) -> bool:
        """Whether ``seq``'s prefill may run now: its K,V blocks taken where the front has a pool."""
        return self.kv is None or self.kv.admit(seq, self.answered(seq))

    def _packable(self, seq: Sequence) -> bool:
        return (seq.rope is None and seq.request.params.prompt_logprobs is None and not seq.request.questions
                and not self.cached(seq.prefill_ids, seq.rope))

    def order(self, now: float) -> list[Sequence]:
        """The prefills in the order the policy takes them: by arrival (fcfs), or those passed over ``starve_after``
        times first (by arrival), then by relative slack (lars)."""
        candidates = [*self.prefilling, *self.waiting]

        def key(seq: Sequence):
            if self.policy == "fcfs":  # arrival order is total: nobody starves
                return (False, 0.0, seq.request.arrival_s)
            starved = seq.passed_over >= self.starve_after
            return (not starved, 0.0 if starved else self.slack.of(seq, now), seq.request.arrival_s)

        return sorted(candidates, key=key)

    def shorter_waiting(self, seq: Sequence) -> bool:
        """Whether a prefill with less predicted work left than ``seq``'s waits (LARS): a long prefill yields part
        of its step to shorter ones (Medha's space sharing); a short prompt never yields to a longer one, which
        would only cut the short one into more chunks, each paying a step's fixed cost."""
        left = self.slack.remaining_s
        mine = left(seq)
        return any(s is not seq and left(s) < mine for s in (*self.waiting, *self.prefilling))

    def resume(self, seq: Sequence) -> None:
        """A chunk of ``seq``'s prefill ran; the rest waits for its turn."""
        self.prefilling.append(seq)

    def requeue(self, seq: Sequence) -> None:
        """``seq`` waits again for its prefill, from its prompt (a worker was lost); never refused for room: it was
        admitted already."""
        self.waiting.appendleft(seq)

    def take_waiting(self) -> list[Sequence]:
        """Every request waiting for its prefill or its next chunk, taken out."""
        seqs = [*self.waiting, *self.prefilling]
        self.waiting.clear()
        self.prefilling.clear()
        return seqs

    def take_prefilling(self) -> list[Sequence]:
        """The chunked prefills between their chunks, taken out (a worker holding their positions was lost)."""
        seqs, self.prefilling = self.prefilling, []
        return seqs

    def start_decoding(self, seq: Sequence) -> None:
        seq.status = "running"
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """``seq`` is out (ended, or to run again): out of the running requests, its K,V blocks freed."""
        if seq in self.running:
            self.running.remove(seq)
        if self.kv is not None:
            self.kv.release(seq)

    def remove(self, request_id: str) -> Sequence | None:
        """Take a request out wherever it is (cancel); the caller frees its cache."""
        for queue in (self.prefilling, self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    return seq
        return None

    def drain_all(self) -> list[Sequence]:
        """Every request in flight, removed (the engine failed)."""
        seqs = [*self.take_waiting(), *self.running]
        self.running.clear()
        return seqs

    @property
    def in_flight(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.running)


def yielded_share(relative_slack: float) -> float:
    """The share of the step's budget a long prefill takes while others wait (Medha's space sharing): ``1 - rho``
    of it, between ``YIELD_FLOOR`` and all of it; a request behind its deadline keeps all."""
    return min(1.0, max(YIELD_FLOOR, 1.0 - relative_slack))
