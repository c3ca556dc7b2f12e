"""The scheduler's pick made into what every rank runs: a ``StepPlan`` of segments (serve/step/plans.py), on the front,
before any rank takes part.

Every running request's next tokens become decode rows; the prefill's tokens (several prompts packed, a whole
prompt, its next chunk sized to the step's budget, a context carrying its questions) are placed by
serve/placement.py; the prompts the prefix cache answers whole need no segment at all.

Nothing here may end the engine: a prompt whose placement raises runs in the safe layout (whole, on the front
alone, its response saying why), and one that cannot be planned even so is handed back to the engine to end by
itself (``Drafted.refused``), while the step goes on with the others. Only the ranks' collective work, after
this, can fail the engine.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

from kvrunahead.errors import InputError
from kvrunahead.serve import asking
from kvrunahead.serve.chunking import ChunkPlanner
from kvrunahead.serve.placement import Placement
from kvrunahead.serve.scheduler import Step
from kvrunahead.serve.sequence import RequestFigures, Sequence
from kvrunahead.serve.step.executor import PrefillOutcome
from kvrunahead.serve.step.plans import Decode, DecodeRow, Prompt, ShardedRow, StepPlan
from kvrunahead.serve.step.rank import RankContext

log = logging.getLogger(__name__)


@dataclass
class Drafted:
    """A step as planned: the scheduler's step less the requests that could not be planned, the plan every rank
    runs, the K,V the front holds for its prompt (the prefix cache's), the outcomes of the prompts that need no
    prefill (Placement.answered) and the requests to end with why."""

    step: Step
    plan: StepPlan
    held: list | None = None
    ready: dict[str, PrefillOutcome] = field(default_factory=dict)
    refused: list[tuple[Sequence, Exception]] = field(default_factory=list)


class StepPlanner:
    """Places the scheduler's step, as sized there (a prompt whole, or its chunk up to ``Step.chunk_end``)."""

    def __init__(self, ctx: RankContext, placement: Placement, chunks: ChunkPlanner | None, decoder,
                 attention: str) -> None:
        self.ctx, self.placement, self.chunks = ctx, placement, chunks
        self.decoder, self.attention = decoder, attention

    def plan(self, step: Step) -> Drafted:
        rows = tuple(row for seq in step.decodes for row in self._rows(seq))
        ready = {}
        for seq in step.prefills:
            try:
                if (got := self._ready(seq)) is not None:
                    ready[seq.request_id] = got
            except Exception:  # noqa: BLE001 - the prefix cache could not answer it: it is prefilled instead
                log.exception("the prefix cache's answer to %s failed; prefilling it", seq.request_id)
        prompts = [seq for seq in step.prefills if seq.request_id not in ready]
        held, segments, cuts, refused = None, (), None, []
        if len(prompts) > 1:  # the rows run beside the packed prompts, in their own forward
            planned, refused = self._guarded(prompts, lambda: self._packed(prompts),
                                             lambda why: self._packed(prompts, alone=why))
            if planned is not None:
                segments, cuts = planned
        elif prompts:
            seq = prompts[0]
            planned, refused = self._guarded(prompts, lambda: self._segment(seq, step.chunk_end, not step.decodes),
                                             None if seq.prefilled else lambda why: self._alone(seq, why))
            if planned is not None:
                seg, held = planned
                segments = (seg,)
        try:
            plan = StepPlan(rows + tuple(segments), self.attention, packed=cuts)
        except ValueError as e:  # a bug in how the step was put together: its prompts end, its rows go on
            log.exception("the step's plan is not valid")
            ended = {seq.request_id for seq, _ in refused}
            refused += [(seq, e) for seq in prompts if seq.request_id not in ended]
            plan, held = StepPlan(rows, self.attention), None
        if refused:
            gone = {seq.request_id for seq, _ in refused}
            step = dataclasses.replace(step, prefills=[s for s in step.prefills if s.request_id not in gone])
        return Drafted(step, plan, held, ready, refused)

    @staticmethod
    def _guarded(seqs: list[Sequence], plan, fallback):
        """``plan()``, else (where it raised for other than the request's own input) ``fallback(why)``: the
        prompts' safe layout; None and the requests with what stopped them where neither could place them."""
        try:
            return plan(), []
        except InputError as e:  # the request's own problem (a 400)
            return None, [(seq, e) for seq in seqs]
        except Exception as e:  # noqa: BLE001 - a placement that cannot serve: one request's, not the engine's
            names = ", ".join(s.request_id for s in seqs)
            log.exception("placing %s failed%s", names, "; they run on the front alone" if fallback else "")
            if fallback is None:
                return None, [(seq, e) for seq in seqs]
            try:
                return fallback(f"one rank: the placement failed ({type(e).__name__}: {e})"), []
            except Exception as again:  # noqa: BLE001
                log.exception("placing %s on the front alone failed too", names)
                return None, [(seq, again) for seq in seqs]

    def _rows(self, seq: Sequence) -> list[Decode]:
        """A running request's next tokens as segments: one per unfinished question, else its next token on the
        front or on every rank's shard (KVP)."""
        if seq.answers is not None:
            return asking.question_rows(seq, self.decoder.shared[seq.request_id], self.ctx.lm.eos_token_ids)
        row = ShardedRow if seq.request_id in self.ctx.shards else DecodeRow
        return [row(seq.request_id, (seq.output_ids[-1],), seq.next_position)]

    def _ready(self, seq: Sequence) -> PrefillOutcome | None:
        """The outcome of a prompt the prefix cache answers whole (its first-token logits kept), else None."""
        if seq.prefilled or not self.placement.answers(seq):
            return None
        seq.prefill_start_s = time.monotonic()
        placed, outcome = self.placement.answered(seq.prefill_ids, seq.request_id)
        seq.figures = placed.figures(seq.request.arrival_s, seq.prefill_start_s)
        return outcome

    def _alone(self, seq: Sequence, why: str) -> tuple[Prompt, None]:
        """The safe layout of a prompt not yet started: whole, on the front alone (its questions after it)."""
        request = seq.request
        seq.prefill_start_s, seq.chunked = time.monotonic(), False
        seg, placed = self.placement.alone(seq.request_id, seq.prefill_ids, seq.rope,
                                           request.params.prompt_logprobs, why)
        seq.figures = placed.figures(request.arrival_s, seq.prefill_start_s)
        return (asking.with_questions(seg, request) if request.questions else seg), None

    def _segment(self, seq: Sequence, chunk_end: int | None, explore: bool = True) -> tuple[Prompt, list | None]:
        """The prefill's segment: the whole prompt where the scheduler did not chunk it (placed by the prefix cache
        and the degree policy, which explores no other layout while decodes wait: ``explore``; a context carries
        its questions), else its next chunk, up to ``chunk_end``."""
        n, request = seq.prefill_len, seq.request
        if chunk_end is None:
            seq.prefill_start_s = time.monotonic()
            seg, placed, held = self.placement.prompt(seq.request_id, seq.prefill_ids, seq.rope,
                                                      request.params.prompt_logprobs, explore)
            seq.figures = placed.figures(request.arrival_s, seq.prefill_start_s)
            return (asking.with_questions(seg, request) if request.questions else seg), held
        done = seq.prefilled
        if not done:
            seq.prefill_start_s, seq.chunked = time.monotonic(), True
            seq.figures = RequestFigures(0.0, seq.prefill_start_s - request.arrival_s, self.ctx.world_size,
                                         [0, n], self.placement.chunked_source(seq), self.chunks.describe(),
                                         decode=self.placement.chunked_decode(seq))
        seg = self.placement.chunk(seq.request_id, seq.prefill_ids, self.chunks.cuts(done, chunk_end), seq.rope,
                                   request.params.prompt_logprobs)
        return seg, None

    def _packed(self, seqs: list[Sequence], alone: str | None = None) -> tuple[list[Prompt], tuple[int, ...]]:
        """Several waiting prompts packed into one prefill (Placement.packed): their segments and cuts."""
        start = time.monotonic()
        segments, cuts, placed = self.placement.packed([s.prefill_ids for s in seqs],
                                                       tuple(s.request_id for s in seqs),
                                                       all(s.request.params.max_tokens == 1 for s in seqs), alone)
        for seq in seqs:
            seq.prefill_start_s = start
            seq.figures = placed.figures(seq.request.arrival_s, start, packed_with=len(seqs))
        return segments, cuts
