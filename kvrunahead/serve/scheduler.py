"""What runs next: one prefill, or one batched decode of every running request (torch-free).

TTFT first: a waiting request is prefilled as soon as the engine is free; the requests waiting behind it join its
prefill as one packed sequence (Prepacking) while their tokens fit ``pack_tokens``. Decodes are never starved: after a
prefill, the next step decodes whenever any request is decoding, so a stream of arrivals still lets every running
request advance every other step at worst.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvrunahead.serve.sequence import AskRequest, QueueFull, Sequence


@dataclass
class PrefillWork:
    seq: Sequence


@dataclass
class PackedPrefillWork:
    """Several waiting requests prefilled together, packed end to end (kvrunahead/pack)."""

    seqs: list[Sequence]


@dataclass
class DecodeWork:
    seqs: list[Sequence]


@dataclass
class AskWork:
    """A shared-context request, run to its answers in one step."""

    ask: AskRequest


Work = PrefillWork | PackedPrefillWork | DecodeWork | AskWork


def taken(work: Work | None) -> list[Sequence]:
    """The sequences a prefill took out of the queue (a decode's are still in the scheduler's lists)."""
    if isinstance(work, PrefillWork):
        return [work.seq]
    return list(work.seqs) if isinstance(work, PackedPrefillWork) else []


class Scheduler:
    def __init__(self, max_queue: int, pack_tokens: int = 0) -> None:
        self.max_queue = max_queue
        self.pack_tokens = pack_tokens  # 0: one prompt per prefill
        self.waiting: deque[Sequence] = deque()
        self.asks: deque[AskRequest] = deque()
        self.running: list[Sequence] = []
        self._last_was_prefill = False

    def add(self, seq: Sequence) -> None:
        self._check_room()
        self.waiting.append(seq)

    def add_ask(self, ask: AskRequest) -> None:
        self._check_room()
        self.asks.append(ask)

    def _check_room(self) -> None:
        if len(self.waiting) + len(self.asks) >= self.max_queue:
            raise QueueFull(f"{len(self.waiting) + len(self.asks)} requests are waiting (--max-queue "
                            f"{self.max_queue})")

    def schedule(self) -> Work | None:
        """The next step, or None when idle. A prefilled sequence leaves ``waiting`` here."""
        decode_due = bool(self.running) and (self._last_was_prefill or not (self.waiting or self.asks))
        if decode_due:
            self._last_was_prefill = False
            return DecodeWork(list(self.running))
        if self.waiting:
            self._last_was_prefill = True
            seqs = [self.waiting.popleft()]
            total = seqs[0].prompt_len
            # A prompt whose length needs the RoPE extended runs on another model variant: never packed. The queue
            # is taken in order, up to the first request that does not fit, so none is overtaken.
            while (self.pack_tokens and seqs[0].rope is None and self.waiting and self.waiting[0].rope is None
                   and total + self.waiting[0].prompt_len <= self.pack_tokens):
                seqs.append(self.waiting.popleft())
                total += seqs[-1].prompt_len
            return PrefillWork(seqs[0]) if len(seqs) == 1 else PackedPrefillWork(seqs)
        if self.asks:
            self._last_was_prefill = True
            return AskWork(self.asks.popleft())
        return None

    def start_decoding(self, seq: Sequence) -> None:
        seq.status = "running"
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)

    def remove(self, request_id: str) -> Sequence | None:
        """Take a request out wherever it is (cancel); the caller frees its cache."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                self.running.remove(seq)
                return seq
        return None

    def remove_ask(self, request_id: str) -> AskRequest | None:
        for ask in self.asks:
            if ask.request_id == request_id:
                self.asks.remove(ask)
                return ask
        return None

    def drain_asks(self) -> list[AskRequest]:
        asks = list(self.asks)
        self.asks.clear()
        return asks

    def drain_all(self) -> list[Sequence]:
        """Every request in flight, removed (the engine failed)."""
        seqs = [*self.waiting, *self.running]
        self.waiting.clear()
        self.running.clear()
        return seqs

    @property
    def in_flight(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.asks)
