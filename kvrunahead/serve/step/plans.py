"""What the front tells every rank to run next (serve/step/executor.py broadcasts them): a step of segments (a prompt, a
chunk of one or packed prompts, over the chain or on the front; decode rows; KV-parallel decode tokens), state to
drop, a heartbeat, the end. Pickled, so plain data only."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from kvrunahead.model.rope import RopeExtension
from kvrunahead.modes.packing import PackedStep

NOWHERE, FRONT, RANKS, SHARDED, STAGED = "nowhere", "front", "ranks", "sharded", "staged"
PLACES = (NOWHERE, FRONT, RANKS, SHARDED, STAGED)
PEERS = ("tsp", "ring", "cp-allgather")  # the peer prefills of modes/ (a Peer segment's ``peer``)


def question_id(request_id: str, question: int) -> str:
    """The id under which a shared context's question emits and decodes."""
    return f"{request_id}/q{question}"


@dataclass(frozen=True)
class Segment:
    """One request's tokens computed in a step, against the positions it already holds: a whole prompt, a chunk of
    one, one decode token. Its class says how it runs (one per way, below: each carries its own fields, and the
    executor runs each through its entry of serve/step/executor.py ``WAYS``, as the one-shot modes run through
    modes.MODES); where its K,V of [0, start) are (``held``) and where its K,V of [0, end) stay after the step
    (``keep``):

    - ``nowhere``: no earlier positions (``start`` 0); as ``keep``, only of packed prompts that end at their first
      token (an offline batch's) and of ring attention's prompt: their logits come to the front, their K,V stay
      where they were made;
    - ``front``: on the front alone (the prefix cache's entry; a request decoding there);
    - ``ranks``: on every rank (the chunks before this one of a chunked prefill);
    - ``sharded``: each rank its own part (a request decoding KV-cache parallel, kvrunahead/decode/kvp.py);
    - ``staged``: each rank its pipeline stage's layers (the chunks before this one of a pipelined prefill).

    Each way names the places it may be held and kept (``HOLDS``, ``KEEPS``). Only a segment kept on the front or
    sharded emits: its last token's logits go to the front's sampler."""

    HOLDS: ClassVar[tuple[str, ...]] = (NOWHERE,)
    KEEPS: ClassVar[tuple[str, ...]] = (FRONT,)

    request_id: str
    tokens: tuple[int, ...]
    start: int = 0
    held: str = NOWHERE
    keep: str = FRONT
    rope: RopeExtension | None = None

    def __post_init__(self) -> None:
        if (self.held == NOWHERE) != (self.start == 0):
            raise ValueError("a segment holds earlier positions exactly when it does not start at 0")
        if self.held not in self.HOLDS or self.keep not in self.KEEPS:
            raise ValueError(f"{self.way()} is held {self.held!r} (it may be: {', '.join(self.HOLDS)}) and kept "
                             f"{self.keep!r} (it may be: {', '.join(self.KEEPS)})")

    @classmethod
    def way(cls) -> str:
        """The way's name, as a response and a log say it."""
        return cls.__name__.lower()

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def bounds(self) -> tuple[int, ...]:
        """Its cuts over the ranks, else its first and end positions."""
        return self.start, self.end

    def part(self, rank: int, world_size: int) -> tuple[int, int]:
        """The positions ``rank`` computes: every one of them (the pipeline and KV-parallel run them all on every
        rank); the ways cut over the ranks say otherwise."""
        return self.start, self.end


@dataclass(frozen=True, kw_only=True)
class Prompt(Segment):
    """A prompt or a chunk of one. ``questions``: a shared context's (IPPD). After the segment's prefill the front
    prefills them packed behind its whole cache (decode/shared_prefix.py); each one's first-token logits are emitted
    under ``question_id``, and its later tokens are decode rows of that id."""

    questions: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.questions and (self.keep != FRONT or not all(self.questions)):
            raise ValueError("questions follow a prompt kept whole on the front, each at least one token")


@dataclass(frozen=True, kw_only=True)
class Cut(Prompt):
    """A prompt or chunk cut over the ranks at ``cuts``, its rank boundaries (absolute positions, ``cuts[0] ==
    start``, ``cuts[-1] == end``): rank r computes [cuts[r], cuts[r+1])."""

    CUT_REQUIRED: ClassVar[bool] = True  # whether the way always has its cuts
    cuts: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        cuts = self.cuts
        if cuts is None:
            if self.CUT_REQUIRED:
                raise ValueError(f"the {self.way()} is cut at its cuts")
        elif cuts[0] != self.start or cuts[-1] != self.end:
            raise ValueError("a segment's cuts run from its start to its end")

    @property
    def bounds(self) -> tuple[int, ...]:
        return self.cuts or (self.start, self.end)

    def part(self, rank: int, world_size: int) -> tuple[int, int]:
        return self.cuts[rank], self.cuts[rank + 1]


@dataclass(frozen=True, kw_only=True)
class Scorable(Cut):
    """A prompt or chunk that may be scored (``score``): every rank scores its own part's positions against the
    tokens that follow them (the LM head on each position, in the same forward, model/forward.py ``Scoring``),
    ``follows`` being the prompt's token after a chunk; the front gathers them. A scored segment holds nothing
    before it on the front (no prefix cache: a cached position has no logits)."""

    HOLDS: ClassVar[tuple[str, ...]] = (NOWHERE, FRONT, RANKS)
    score: int | None = None  # the prompt's log-probabilities with this many alternatives; None: none
    follows: int | None = None  # the prompt's token after this segment (a chunk's), scored by its last position

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.score is not None and self.held == FRONT:
            raise ValueError("a scored segment holds nothing on the front alone")

    def targets(self, start: int, end: int) -> list[int]:
        """The tokens that positions [start, end) of this segment predict: the next ones of the prompt (none after
        its last)."""
        if end <= start:
            return []
        after = list(self.tokens[start + 1 - self.start:end + 1 - self.start])
        return after + [self.follows] if end == self.end and self.follows is not None else after


@dataclass(frozen=True, kw_only=True)
class Alone(Scorable):
    """The front (one rank, or one TP group) computes every token. ``cuts``, if any, say where the chain would
    have cut: every part but the last empty (a chunk shorter than the ranks)."""

    CUT_REQUIRED: ClassVar[bool] = False
    KEEPS: ClassVar[tuple[str, ...]] = (FRONT, RANKS)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cuts is not None and self.cuts[0] != self.cuts[-2]:
            raise ValueError("a segment alone on the front is cut, if at all, with every part but the last empty")

    def part(self, rank: int, world_size: int) -> tuple[int, int]:
        return (self.start, self.end) if rank == world_size - 1 else (self.start, self.start)


@dataclass(frozen=True, kw_only=True)
class Chain(Scorable):
    """KV-Runahead: cut over the chain at ``cuts``, each rank handing on the K,V before its successor."""

    KEEPS: ClassVar[tuple[str, ...]] = (FRONT, RANKS, SHARDED)


def over(cuts) -> type[Chain] | type[Alone]:
    """The way of a prompt or chunk cut at ``cuts``: over the chain, or on the front alone where every part but
    the last is empty (a chunk shorter than the ranks)."""
    return Chain if cuts[0] != cuts[-2] else Alone


@dataclass(frozen=True, kw_only=True)
class Peer(Cut):
    """A whole prompt through one of the peer prefills of modes/ (``peer``: tsp, ring, cp-allgather), cut by its
    own partition (``cuts``); ring attention's is kept nowhere (its K,V stay where they were made)."""

    KEEPS: ClassVar[tuple[str, ...]] = (FRONT, NOWHERE)
    peer: str

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.peer not in PEERS:
            raise ValueError(f"a peer prefill is one of {', '.join(PEERS)}, not {self.peer!r}")
        if self.keep == NOWHERE and self.peer != "ring":
            raise ValueError("of the peers only ring attention keeps nothing")


@dataclass(frozen=True, kw_only=True)
class Pipeline(Prompt):
    """Every rank runs all the tokens through its stage of the layers: rank r the layers [stages[r], stages[r+1])
    of the whole model, in chunks of ``pipeline_chunk`` tokens handed stage to stage (0: the whole segment); kept on
    the front, the stages then send it their layers' K,V."""

    HOLDS: ClassVar[tuple[str, ...]] = (NOWHERE, STAGED)
    KEEPS: ClassVar[tuple[str, ...]] = (STAGED, FRONT)
    stages: tuple[int, ...]
    pipeline_chunk: int = 0


@dataclass(frozen=True, kw_only=True)
class KvParallel(Prompt):
    """Every rank runs all the tokens against its own shard (Medha's KVP for prefill chunks: the partial outputs
    merged by log-sum-exp); rank ``owner`` keeps their K,V."""

    HOLDS: ClassVar[tuple[str, ...]] = (NOWHERE, SHARDED)
    KEEPS: ClassVar[tuple[str, ...]] = (SHARDED,)
    owner: int

    @classmethod
    def way(cls) -> str:
        return "kv-parallel"


@dataclass(frozen=True, kw_only=True)
class Packed(Prompt):
    """One of whole prompts packed end to end, cut at the plan's ``packed`` boundaries (Prepacking); kept nowhere
    where every one ends at its first token."""

    KEEPS: ClassVar[tuple[str, ...]] = (FRONT, NOWHERE)


@dataclass(frozen=True)
class Decode(Segment):
    """One decode token of a running request."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.tokens) != 1:
            raise ValueError("a decode row is one token")


@dataclass(frozen=True)
class DecodeRow(Decode):
    """One decode token of a request whose cache is on the front."""

    HOLDS: ClassVar[tuple[str, ...]] = (FRONT,)
    held: str = FRONT

    @classmethod
    def way(cls) -> str:
        return "decode row"


@dataclass(frozen=True)
class ShardedRow(Decode):
    """One decode token of a request whose cache is sharded (KV-parallel decode): every rank runs it on its
    shard."""

    HOLDS: ClassVar[tuple[str, ...]] = (SHARDED,)
    KEEPS: ClassVar[tuple[str, ...]] = (SHARDED,)
    held: str = SHARDED
    keep: str = SHARDED

    @classmethod
    def way(cls) -> str:
        return "sharded decode row"


@dataclass(frozen=True)
class StepPlan:
    """One engine step on every rank (executor.py ``run_step``): the prompt segments (one prompt or a chunk of
    one, over the chain or on the front alone; or several prompts packed end to end and cut at ``packed``, the
    packed sequence's rank boundaries: Prepacking), the decode rows that ride along on the front, and the
    KV-parallel requests' decode tokens, which every rank runs on its shard."""

    segments: tuple[Segment, ...]
    attention: str = "split"
    packed: tuple[int, ...] | None = None  # several prompts packed: the rank boundaries of the packed sequence

    def __post_init__(self) -> None:
        prompts, packed = self.prompts, self.packed is not None
        if len(prompts) > 1 and not packed:
            raise ValueError("a step computes one prompt or chunk, or several prompts packed (with their cuts)")
        if any(isinstance(p, Packed) != packed for p in prompts) or len({p.keep for p in prompts}) > 1:
            raise ValueError("packed prompts (way packed) come with the packed boundaries, all kept alike")

    @property
    def prompts(self) -> tuple[Prompt, ...]:
        return tuple(s for s in self.segments if isinstance(s, Prompt))

    @property
    def way(self) -> type[Prompt] | None:
        """How the step's prompt or chunk (or packed prompts) run: its segment's class; None in a step of decode
        rows only."""
        prompts = self.prompts
        return type(prompts[0]) if prompts else None

    @property
    def prompt(self) -> Prompt | None:
        """The prompt or chunk segment of a step that is not packed, if any."""
        prompts = self.prompts
        return prompts[0] if len(prompts) == 1 and self.packed is None else None

    @property
    def packed_step(self) -> PackedStep | None:
        """The packed prompts' step (modes/packing.py), if packed."""
        if self.packed is None:
            return None
        prompts = self.prompts
        return PackedStep(tuple(range(len(prompts))), tuple(len(p.tokens) for p in prompts), self.packed)

    @property
    def rows(self) -> tuple[DecodeRow, ...]:
        return tuple(s for s in self.segments if isinstance(s, DecodeRow))

    @property
    def sharded(self) -> tuple[ShardedRow, ...]:
        return tuple(s for s in self.segments if isinstance(s, ShardedRow))

    @property
    def needs_workers(self) -> bool:
        """Whether a worker takes part: every way but the front alone (packed on the front: cut at the front
        alone), a prompt alone that every rank held or keeps, a KV-parallel decode row."""
        way, p = self.way, self.prompts[0] if self.prompts else None
        if self.sharded:
            return True
        if way is Packed:
            return self.packed[0] != self.packed[-2]
        if way is Alone:
            return RANKS in (p.held, p.keep)
        return way is not None

    @property
    def workers_plan(self) -> StepPlan:
        """What the workers need: the front's decode rows and a prompt's questions stay on the front."""
        return StepPlan(tuple(dataclasses.replace(s, questions=()) if isinstance(s, Prompt) else s
                              for s in self.segments if not isinstance(s, DecodeRow)), self.attention, self.packed)


@dataclass(frozen=True)
class Mirrored:
    """A step the front runs, told to every rank when the front is a TP group (``--tp``): the front's TP peers run
    the whole step as it does (its decode rows, a prompt's questions), on their shards, after taking the changes
    to the front's decode batch since the last one (``ops``: ("add", request id, RoPE variant) for a prompt the
    last step prefilled, ("remove", request id)); the other groups' ranks run the workers' part where it needs
    them."""

    plan: StepPlan
    ops: tuple = ()


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


Plan = StepPlan | Mirrored | Drop | Ping | Shutdown
