"""What the front tells every rank to run next (serve/executor.py broadcasts them): a step of segments (a prompt, a
chunk of one or packed prompts, over the chain or on the front; decode rows; KV-parallel decode tokens), state to
drop, a heartbeat, the end. Pickled, so plain data only."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvrunahead.model.rope import RopeExtension
from kvrunahead.pack.plan import PackedStep

NOWHERE, FRONT, RANKS, SHARDED, STAGED = "nowhere", "front", "ranks", "sharded", "staged"
PLACES = (NOWHERE, FRONT, RANKS, SHARDED, STAGED)


def question_id(request_id: str, question: int) -> str:
    """The id under which a shared context's question emits and decodes."""
    return f"{request_id}/q{question}"


@dataclass(frozen=True)
class Segment:
    """One request's tokens computed in a step, against the positions it already holds: a whole prompt, a chunk of
    one, one decode token. Where its K,V of [0, start) are (``held``) and where its K,V of [0, end) stay after the
    step (``keep``):

    - ``nowhere``: no earlier positions (``start`` 0); as ``keep``, only of packed prompts that end at their first
      token (an offline batch's): their logits come to the front, their K,V stay where they were made;
    - ``front``: on the front alone (the prefix cache's entry; a request decoding there);
    - ``ranks``: on every rank (the chunks before this one of a chunked prefill);
    - ``sharded``: each rank its own part (a request decoding KV-cache parallel, kvrunahead/kvp.py);
    - ``staged``: each rank its pipeline stage's layers (the chunks before this one of a pipelined prefill).

    ``owner``: a chunk computed KV-parallel (Medha's KVP for prefill chunks, kvrunahead/kvp.py): every rank runs
    its tokens through the model attending its own shard of the positions before it, the partial outputs merged by
    log-sum-exp, and rank ``owner`` appends the chunk's K,V to its shard; held and kept sharded.

    ``stages``: the segment runs through the stream pipeline (modes/spp.py) instead of the chain: rank r runs every
    position through the layers [stages[r], stages[r+1]) of the whole model, in chunks of ``pipeline_chunk`` tokens
    handed stage to stage; kept on the front, the stages then send it their layers' K,V so it holds the whole cache.

    ``cuts``: the rank boundaries over the chain (absolute positions, ``cuts[0] == start``, ``cuts[-1] == end``); a
    segment whose every part but the last is empty runs on the front alone, and so does one without cuts (a decode
    row). Only a segment kept on the front or sharded emits: its last token's logits go to the front's sampler.

    ``questions``: a shared context's questions. After the segment's prefill the front prefills them packed behind
    its whole cache (kvrunahead/questions.py); each one's first-token logits are emitted under ``question_id``, and
    its later tokens are decode rows of that id.

    ``score``: every rank scores its own part's positions against the tokens that follow them (the LM head on each
    position, in the same forward, model/forward.py ``Scoring``); the front gathers them. A scored segment holds
    nothing before it on the front (no prefix cache: a cached position has no logits) and is never packed."""

    request_id: str
    tokens: tuple[int, ...]
    start: int = 0
    held: str = NOWHERE
    keep: str = FRONT
    cuts: tuple[int, ...] | None = None
    rope: RopeExtension | None = None
    decode: bool = False  # a running request's next token (a decode row), not a prompt's
    questions: tuple[tuple[int, ...], ...] = ()  # IPPD: questions after this prompt (a shared context), see below
    score: int | None = None  # the prompt's log-probabilities with this many alternatives (see below); None: none
    follows: int | None = None  # the prompt's token after this segment (a chunk's), scored by its last position
    stages: tuple[int, ...] | None = None  # the pipeline's layer boundaries, one stage per rank (see above)
    owner: int | None = None  # a KV-parallel chunk (see above): the rank that keeps its K,V
    pipeline_chunk: int = 0  # tokens handed stage to stage at a time; 0: the whole segment

    def __post_init__(self) -> None:
        if self.held not in PLACES or self.keep not in PLACES:
            raise ValueError(f"a segment is held {self.held!r} and kept {self.keep!r}; places: {PLACES}")
        if (self.held == NOWHERE) != (self.start == 0):
            raise ValueError("a segment holds earlier positions exactly when it does not start at 0")
        if self.decode and (len(self.tokens) != 1 or self.cuts is not None or self.held != self.keep
                            or self.held not in (FRONT, SHARDED)):
            raise ValueError("a decode segment is one token of a request held on the front or sharded")
        if self.questions and (self.decode or self.keep != FRONT or not all(self.questions)):
            raise ValueError("questions follow a prompt kept whole on the front, each at least one token")
        if self.score is not None and (self.decode or self.held == FRONT):
            raise ValueError("a scored segment is a prompt or chunk that holds nothing on the front alone")
        if self.owner is not None and (self.keep != SHARDED or self.held not in (NOWHERE, SHARDED) or self.cuts
                                       or self.stages or self.decode or self.score is not None):
            raise ValueError("a KV-parallel chunk is held and kept sharded, neither cut, pipelined nor scored")
        staged = self.stages is not None
        if (STAGED in (self.held, self.keep)) and not staged:
            raise ValueError("only a pipelined segment (with stages) is held or kept staged")
        if staged and (self.held not in (NOWHERE, STAGED) or self.keep not in (STAGED, FRONT) or self.cuts
                       or self.decode or self.score is not None):
            raise ValueError("a pipelined segment is a prompt or chunk after nothing or its earlier chunks, kept "
                             "staged or on the front, neither cut over the chain nor scored")

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def bounds(self) -> tuple[int, ...]:
        """Its cuts over the chain, else its first and end positions."""
        return self.cuts or (self.start, self.end)

    @property
    def alone(self) -> bool:
        """Whether the front computes every token (no cuts, or every other rank's part empty; a pipelined segment
        runs on every rank)."""
        return self.stages is None and self.owner is None and (self.cuts is None or self.cuts[0] == self.cuts[-2])

    @property
    def is_row(self) -> bool:
        """A decode row: one token of a request decoding on the front."""
        return self.decode and self.held == FRONT

    def targets(self, start: int, end: int) -> list[int]:
        """The tokens that positions [start, end) of this segment predict: the next ones of the prompt (none after
        its last)."""
        if end <= start:
            return []
        after = list(self.tokens[start + 1 - self.start:end + 1 - self.start])
        return after + [self.follows] if end == self.end and self.follows is not None else after

    def part(self, rank: int, world_size: int) -> tuple[int, int]:
        """The positions ``rank`` computes: its cut, or all of them on the front where the segment runs alone (on
        every rank where it is pipelined or KV-parallel)."""
        if self.stages is not None or self.owner is not None:
            return self.start, self.end
        if self.alone:
            return (self.start, self.end) if rank == world_size - 1 else (self.start, self.start)
        return self.cuts[rank], self.cuts[rank + 1]


@dataclass(frozen=True)
class StepPlan:
    """One engine step on every rank (serve/executor.py ``run_step``): the prompt segments (one prompt or a chunk of
    one, over the chain or on the front alone; or several prompts packed end to end and cut at ``packed``, the
    packed sequence's rank boundaries: Prepacking), the decode rows that ride along on the front, and the
    KV-parallel requests' decode tokens, which every rank runs on its shard."""

    segments: tuple[Segment, ...]
    attention: str = "split"
    packed: tuple[int, ...] | None = None  # several prompts packed: the rank boundaries of the packed sequence

    def __post_init__(self) -> None:
        prompts = self.prompts
        if len(prompts) > 1 and self.packed is None:
            raise ValueError("a step computes one prompt or chunk, or several prompts packed (with their cuts)")
        keeps = {p.keep for p in prompts}
        if self.packed is not None and (any(p.start or p.cuts is not None for p in prompts)
                                        or keeps not in ({FRONT}, {NOWHERE})):
            raise ValueError("packed prompts are whole prompts cut by the packed boundaries, all kept on the front or "
                             "all kept nowhere")
        if self.packed is None and any(p.keep == NOWHERE for p in prompts):
            raise ValueError("only packed prompts are kept nowhere")

    @property
    def prompts(self) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if not s.decode)

    @property
    def prompt(self) -> Segment | None:
        """The prompt or chunk segment of a step that is not packed, if any."""
        prompts = self.prompts
        return prompts[0] if len(prompts) == 1 and self.packed is None else None

    @property
    def packed_step(self) -> PackedStep | None:
        """The packed prompts' step (pack/plan.py), if packed."""
        if self.packed is None:
            return None
        prompts = self.prompts
        return PackedStep(tuple(range(len(prompts))), tuple(len(p.tokens) for p in prompts), self.packed)

    @property
    def rows(self) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if s.is_row)

    @property
    def sharded(self) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if s.decode and s.held == SHARDED)

    @property
    def needs_workers(self) -> bool:
        """Whether a worker takes part: a segment cut over the chain, one every rank keeps or held, a KVP row."""
        if self.sharded:
            return True
        if self.packed is not None:
            return self.packed[0] != self.packed[-2]
        p = self.prompt
        return p is not None and (not p.alone or RANKS in (p.held, p.keep) or p.keep == SHARDED)

    @property
    def workers_plan(self) -> StepPlan:
        """What the workers need: the front's decode rows and a prompt's questions stay on the front."""
        return StepPlan(tuple(dataclasses.replace(s, questions=()) for s in self.segments if not s.is_row),
                        self.attention, self.packed)


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
