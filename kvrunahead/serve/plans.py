"""What the front tells every rank to run next (serve/executor.py broadcasts them): a step of segments (a prompt or a
chunk of one over the chain, decode rows, KV-parallel decode tokens), a packed prefill, state to drop, a heartbeat,
the end. Pickled, so plain data only."""

from __future__ import annotations

from dataclasses import dataclass

from kvrunahead.model.rope import RopeExtension
from kvrunahead.pack.plan import PackedStep

NOWHERE, FRONT, RANKS, SHARDED = "nowhere", "front", "ranks", "sharded"
PLACES = (NOWHERE, FRONT, RANKS, SHARDED)


@dataclass(frozen=True)
class Segment:
    """One request's tokens computed in a step, against the positions it already holds: a whole prompt, a chunk of
    one, one decode token. Where its K,V of [0, start) are (``held``) and where its K,V of [0, end) stay after the
    step (``keep``):

    - ``nowhere``: no earlier positions (``start`` 0);
    - ``front``: on the front alone (the prefix cache's entry; a request decoding there);
    - ``ranks``: on every rank (the chunks before this one of a chunked prefill);
    - ``sharded``: each rank its own part (a request decoding KV-cache parallel, kvrunahead/kvp.py).

    ``cuts``: the rank boundaries over the chain (absolute positions, ``cuts[0] == start``, ``cuts[-1] == end``); a
    segment whose every part but the last is empty runs on the front alone, and so does one without cuts (a decode
    row). Only a segment kept on the front or sharded emits: its last token's logits go to the front's sampler."""

    request_id: str
    tokens: tuple[int, ...]
    start: int = 0
    held: str = NOWHERE
    keep: str = FRONT
    cuts: tuple[int, ...] | None = None
    rope: RopeExtension | None = None
    decode: bool = False  # a running request's next token (a decode row), not a prompt's

    def __post_init__(self) -> None:
        if self.held not in PLACES or self.keep not in PLACES or self.keep == NOWHERE:
            raise ValueError(f"a segment is held {self.held!r} and kept {self.keep!r}; places: {PLACES}")
        if (self.held == NOWHERE) != (self.start == 0):
            raise ValueError("a segment holds earlier positions exactly when it does not start at 0")
        if self.decode and (len(self.tokens) != 1 or self.cuts is not None or self.held != self.keep
                            or self.held not in (FRONT, SHARDED)):
            raise ValueError("a decode segment is one token of a request held on the front or sharded")

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def alone(self) -> bool:
        """Whether the front computes every token (no cuts, or every other rank's part empty)."""
        return self.cuts is None or self.cuts[0] == self.cuts[-2]

    @property
    def is_row(self) -> bool:
        """A decode row: one token of a request decoding on the front."""
        return self.decode and self.held == FRONT

    def part(self, rank: int, world_size: int) -> tuple[int, int]:
        """The positions ``rank`` computes: its cut, or all of them on the front where the segment runs alone."""
        if self.alone:
            return (self.start, self.end) if rank == world_size - 1 else (self.start, self.start)
        return self.cuts[rank], self.cuts[rank + 1]


@dataclass(frozen=True)
class StepPlan:
    """One engine step on every rank: at most one segment over the chain or on the front (a prompt or a chunk),
    the decode rows that ride along its forward on the front, and the KV-parallel requests' decode tokens, which
    every rank runs on its shard (serve/executor.py ``run_step``)."""

    segments: tuple[Segment, ...]
    attention: str = "split"

    def __post_init__(self) -> None:
        if sum(not s.decode for s in self.segments) > 1:
            raise ValueError("a step computes at most one prompt or chunk (packed prompts run as a PackedPlan)")

    @property
    def prompt(self) -> Segment | None:
        """The prompt or chunk segment, if any."""
        return next((s for s in self.segments if not s.decode), None)

    @property
    def rows(self) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if s.is_row)

    @property
    def sharded(self) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if s.decode and s.held == SHARDED)

    @property
    def needs_workers(self) -> bool:
        """Whether a worker takes part: a segment cut over the chain, one every rank keeps or held, a KVP row."""
        p = self.prompt
        return bool(self.sharded) or (p is not None and (not p.alone or RANKS in (p.held, p.keep)
                                                         or p.keep == SHARDED))

    @property
    def workers_plan(self) -> StepPlan:
        """What the workers need: the front's decode rows stay on the front."""
        return StepPlan(tuple(s for s in self.segments if not s.is_row), self.attention)


@dataclass(frozen=True)
class PackedPlan:
    """Several prompts prefilled as one packed sequence cut at ``boundaries`` (kvrunahead/pack), relayed whole to
    the front, which decodes them all."""

    request_ids: tuple[str, ...]
    prompts: tuple[tuple[int, ...], ...]
    boundaries: tuple[int, ...]

    @property
    def step(self) -> PackedStep:
        return PackedStep(tuple(range(len(self.prompts))), tuple(map(len, self.prompts)), self.boundaries)


@dataclass(frozen=True)
class Drop:
    """The requests whose state every rank drops: KVP shards, a chunked prefill's positions (finished,
    cancelled)."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class Ping:
    """Sent while no prefill runs: proves to the workers that the front is alive and to the front that they are."""


@dataclass(frozen=True)
class Shutdown:
    """Ends every worker's loop (the server is stopping)."""


Plan = StepPlan | PackedPlan | Drop | Ping | Shutdown
