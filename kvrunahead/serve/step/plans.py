"""What the front tells every rank to run next (serve/step/executor.py broadcasts them): a step of segments (a prompt, a
chunk of one or packed prompts, over the chain or on the front; decode rows; KV-parallel decode tokens), state to
drop, a heartbeat, the end. Pickled, so plain data only."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvrunahead.model.rope import RopeExtension
from kvrunahead.modes.packing import PackedStep

NOWHERE, FRONT, RANKS, SHARDED, STAGED = "nowhere", "front", "ranks", "sharded", "staged"
PLACES = (NOWHERE, FRONT, RANKS, SHARDED, STAGED)

# How a segment runs (``Segment.way``), set by the placement; the executor runs each through its entry of
# serve/step/executor.py ``WAYS``, as the one-shot modes run through modes.MODES.
ALONE = "alone"  # the front (one rank, or one TP group) computes every token
CHAIN = "chain"  # KV-Runahead: cut over the chain at ``cuts``, each rank handing on the K,V before its successor
KV_PARALLEL = "kv-parallel"  # every rank all the tokens against its own shard; rank ``owner`` keeps their K,V
PIPELINE = "pipeline"  # every rank all the tokens through its stage of the layers (``stages``)
PACKED = "packed"  # whole prompts packed end to end, cut at the plan's ``packed`` boundaries (Prepacking)
ROW = "row"  # one decode token of a request whose cache is on the front
SHARDED_ROW = "sharded-row"  # one decode token of a request whose cache is sharded (KV-parallel decode)
PEERS = ("tsp", "ring", "cp-allgather")  # the peer prefills of modes/, cut by their own partition (``cuts``)
WAYS = (ALONE, CHAIN, KV_PARALLEL, PIPELINE, PACKED, ROW, SHARDED_ROW, *PEERS)
ROWS = (ROW, SHARDED_ROW)
CUT = (CHAIN, *PEERS)  # the ways cut over the ranks at ``cuts``


def cut_at(cuts) -> dict:
    """The way and cuts of a prompt or chunk cut at ``cuts``: over the chain, or on the front alone where every part
    but the last is empty (a chunk shorter than the ranks)."""
    return {"way": CHAIN if cuts[0] != cuts[-2] else ALONE, "cuts": tuple(cuts)}


def question_id(request_id: str, question: int) -> str:
    """The id under which a shared context's question emits and decodes."""
    return f"{request_id}/q{question}"


@dataclass(frozen=True)
class Segment:
    """One request's tokens computed in a step, against the positions it already holds: a whole prompt, a chunk of
    one, one decode token. ``way`` says how it runs (above: alone, chain, kv-parallel, pipeline, packed, a decode
    row, a KV-parallel decode row, a peer's prefill); where its K,V of [0, start) are (``held``) and where its K,V
    of [0, end) stay after the step (``keep``):

    - ``nowhere``: no earlier positions (``start`` 0); as ``keep``, only of packed prompts that end at their first
      token (an offline batch's) and of ring attention's prompt: their logits come to the front, their K,V stay
      where they were made;
    - ``front``: on the front alone (the prefix cache's entry; a request decoding there);
    - ``ranks``: on every rank (the chunks before this one of a chunked prefill);
    - ``sharded``: each rank its own part (a request decoding KV-cache parallel, kvrunahead/decode/kvp.py);
    - ``staged``: each rank its pipeline stage's layers (the chunks before this one of a pipelined prefill).

    The ways' own fields: ``cuts``, the rank boundaries (absolute positions, ``cuts[0] == start``, ``cuts[-1] ==
    end``) of the chain and the peers (alone, they may say where the chain would have cut: every part but the last
    empty); ``owner``, the rank that keeps a KV-parallel chunk's K,V (Medha's KVP for prefill chunks: the partial
    outputs merged by log-sum-exp, held and kept sharded); ``stages`` and ``pipeline_chunk``, the pipeline's layer
    boundaries (rank r runs every position through the layers [stages[r], stages[r+1]) of the whole model, in
    chunks of ``pipeline_chunk`` tokens handed stage to stage; kept on the front, the stages then send it their
    layers' K,V). Only a segment kept on the front or sharded emits: its last token's logits go to the front's
    sampler.

    ``questions``: a shared context's questions. After the segment's prefill the front prefills them packed behind
    its whole cache (decode/shared_prefix.py); each one's first-token logits are emitted under ``question_id``, and
    its later tokens are decode rows of that id.

    ``score``: every rank scores its own part's positions against the tokens that follow them (the LM head on each
    position, in the same forward, model/forward.py ``Scoring``); the front gathers them. A scored segment runs
    alone or over the chain and holds nothing before it on the front (no prefix cache: a cached position has no
    logits)."""

    request_id: str
    tokens: tuple[int, ...]
    start: int = 0
    way: str = ALONE
    held: str = NOWHERE
    keep: str = FRONT
    cuts: tuple[int, ...] | None = None
    rope: RopeExtension | None = None
    questions: tuple[tuple[int, ...], ...] = ()  # IPPD: questions after this prompt (a shared context), see below
    score: int | None = None  # the prompt's log-probabilities with this many alternatives (see below); None: none
    follows: int | None = None  # the prompt's token after this segment (a chunk's), scored by its last position
    stages: tuple[int, ...] | None = None  # pipeline: the layer boundaries, one stage per rank (see above)
    owner: int | None = None  # kv-parallel: the rank that keeps the chunk's K,V (see above)
    pipeline_chunk: int = 0  # pipeline: tokens handed stage to stage at a time; 0: the whole segment

    def __post_init__(self) -> None:
        way, held, keep = self.way, self.held, self.keep
        if way not in WAYS:
            raise ValueError(f"a segment runs {way!r}; ways: {WAYS}")
        if held not in PLACES or keep not in PLACES:
            raise ValueError(f"a segment is held {held!r} and kept {keep!r}; places: {PLACES}")
        if (held == NOWHERE) != (self.start == 0):
            raise ValueError("a segment holds earlier positions exactly when it does not start at 0")
        if (self.cuts is not None and way not in (*CUT, ALONE)) or (self.cuts is None and way in CUT) or (
                self.cuts is not None and (self.cuts[0] != self.start or self.cuts[-1] != self.end
                                           or (way == ALONE and self.cuts[0] != self.cuts[-2]))):
            raise ValueError("the chain and the peers are cut at their cuts, from the start to the end (alone, "
                             "every part but the last empty)")
        if (self.stages is not None) != (way == PIPELINE) or (self.owner is not None) != (way == KV_PARALLEL):
            raise ValueError("a pipelined segment has its stages, a KV-parallel one its owner, no other either")
        if way in ROWS and (len(self.tokens) != 1 or held != keep or held != (FRONT if way == ROW else SHARDED)):
            raise ValueError("a decode row is one token of a request held on the front (sharded: a sharded row)")
        if self.questions and (way in ROWS or keep != FRONT or not all(self.questions)):
            raise ValueError("questions follow a prompt kept whole on the front, each at least one token")
        if self.score is not None and (way not in (ALONE, CHAIN) or held == FRONT):
            raise ValueError("a scored segment is a prompt or chunk, alone or over the chain, that holds nothing on "
                             "the front alone")
        if way == KV_PARALLEL and (keep != SHARDED or held not in (NOWHERE, SHARDED)):
            raise ValueError("a KV-parallel chunk is held and kept sharded")
        if STAGED in (held, keep) and way != PIPELINE or way == PIPELINE and (
                held not in (NOWHERE, STAGED) or keep not in (STAGED, FRONT)):
            raise ValueError("a pipelined segment is a prompt or chunk after nothing or its earlier chunks, kept "
                             "staged or on the front; no other is held or kept staged")
        if (way == PACKED or way in PEERS) and (held != NOWHERE or keep not in (FRONT, NOWHERE)):
            raise ValueError("packed prompts and the peers' prompts are whole prompts kept on the front or nowhere")
        if keep == NOWHERE and way not in (PACKED, "ring"):
            raise ValueError("only packed prompts (ending at their first token) and ring attention's keep nothing")
        if keep == SHARDED and way not in (CHAIN, KV_PARALLEL, SHARDED_ROW):
            raise ValueError("only the chain, a KV-parallel chunk and a sharded row keep their K,V sharded")

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def bounds(self) -> tuple[int, ...]:
        """Its cuts over the chain, else its first and end positions."""
        return self.cuts or (self.start, self.end)

    @property
    def is_row(self) -> bool:
        """A decode row: one token of a request decoding on the front."""
        return self.way == ROW

    def targets(self, start: int, end: int) -> list[int]:
        """The tokens that positions [start, end) of this segment predict: the next ones of the prompt (none after
        its last)."""
        if end <= start:
            return []
        after = list(self.tokens[start + 1 - self.start:end + 1 - self.start])
        return after + [self.follows] if end == self.end and self.follows is not None else after

    def part(self, rank: int, world_size: int) -> tuple[int, int]:
        """The positions ``rank`` computes of a segment alone, over the chain, pipelined or KV-parallel: its cut,
        all of them on the front alone, all of them on every rank through the pipeline or KV-parallel."""
        if self.way in (PIPELINE, KV_PARALLEL):
            return self.start, self.end
        if self.way == ALONE:
            return (self.start, self.end) if rank == world_size - 1 else (self.start, self.start)
        return self.cuts[rank], self.cuts[rank + 1]


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
        if any((p.way == PACKED) != packed for p in prompts) or len({p.keep for p in prompts}) > 1:
            raise ValueError("packed prompts (way packed) come with the packed boundaries, all kept alike")

    @property
    def prompts(self) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if s.way not in ROWS)

    @property
    def way(self) -> str | None:
        """How the step's prompt or chunk (or packed prompts) run; None in a step of decode rows only."""
        prompts = self.prompts
        return prompts[0].way if prompts else None

    @property
    def prompt(self) -> Segment | None:
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
    def rows(self) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if s.way == ROW)

    @property
    def sharded(self) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if s.way == SHARDED_ROW)

    @property
    def needs_workers(self) -> bool:
        """Whether a worker takes part: every way but the front alone (packed on the front: cut at the front
        alone), a prompt alone that every rank held or keeps, a KV-parallel decode row."""
        way, p = self.way, self.prompts[0] if self.prompts else None
        if self.sharded:
            return True
        if way == PACKED:
            return self.packed[0] != self.packed[-2]
        if way == ALONE:
            return RANKS in (p.held, p.keep)
        return way is not None

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
