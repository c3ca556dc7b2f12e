"""How much of a long prompt one step prefills (Medha's adaptive chunking), priced by the cost model.

A prompt whose prefill the cost model (kvrunahead/sim) predicts to take longer than ``--step-budget-ms`` is
prefilled in chunks, one per engine step, so that decodes and short prompts run between them. Each chunk is a
chain prefill of its new tokens after the positions before it, whose K,V every rank holds already (the chain
carries only the chunk's own positions; the front then sends each worker those it lacks: ``simulate_chunk``
prices exactly that); the chunk is the longest that the model predicts to fit the step's budget. As the cache
grows each new token attends to more keys, so the chunks shrink along the prompt.

The model's error on this machine is learnt as the chunks run: each prediction is scaled by how much longer or
shorter than predicted the last chunks took (the median ratio of ``LEARN_CHUNKS``, a prompt's first and last chunk
left out: they carry one-off costs), so that a profile off by a fifth does not put every chunk over the budget.
Responses report the model's own prediction beside the correction in force.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvrunahead.errors import InputError
from kvrunahead.modes.packing import cuts_after_cached
from kvrunahead.serve.sequence import Sequence
from kvrunahead.sim.costmodel import CostModel
from kvrunahead.sim.simulate import simulate_chunk

MIN_CHUNK = 16  # tokens: the shortest chunk; past a few thousand positions a chunk's time is its attention over
#                  them, so the budget, not this floor, sizes the chunks (a chunk over the budget delays every
#                  short prompt that arrives during it)
ROUND = 64  # prompt lengths are priced in steps of this many tokens (a whole prompt's prediction, for LARS)
LEARN_CHUNKS = 8  # the last chunks whose measured / predicted seconds correct the next predictions
CORRECTION_CAP = 4.0  # the correction stays within [1 / CAP, CAP] of the model
ALONE_BUDGETS = 4  # alone on the server a prompt's chunk may run as long as its prefill so far, up to this many budgets


def relative_slack(arrival_s: float, target_s: float, remaining_s: float, total_s: float, now: float) -> float:
    """LARS's priority (lower goes first): the seconds to spare before the TTFT deadline ``arrival + target`` once
    the predicted remaining work is done, per second of the request's whole predicted work."""
    return (arrival_s + target_s - now - remaining_s) / max(total_s, 1e-9)


@dataclass(frozen=True)
class Slack:
    """What LARS needs of a request, from the engine's cost model: its TTFT target, its whole predicted prefill and
    what is left of it (seconds)."""

    target_s: Callable[[Sequence], float]
    total_s: Callable[[Sequence], float]
    remaining_s: Callable[[Sequence], float]

    def of(self, seq: Sequence, now: float) -> float:
        return relative_slack(seq.request.arrival_s, self.target_s(seq), self.remaining_s(seq), self.total_s(seq),
                              now)


@dataclass
class ChunkPlanner:
    cost: CostModel  # a rank of the chain (or the front alone where the world is one rank)
    world_size: int
    attention: str
    work: Callable[[int], float]  # a prompt's first t tokens' work (sim.flops.prompt_work): the chunk's cuts
    budget_s: float
    min_chunk: int = MIN_CHUNK
    fixed: int = 0  # chunks of this many tokens whatever they cost (Sarathi-style); 0: by the budget
    _whole: dict[int, float] = field(default_factory=dict)
    _ratios: deque = field(default_factory=lambda: deque(maxlen=LEARN_CHUNKS))  # measured / predicted, latest last

    def cuts(self, done: int, end: int) -> tuple[int, ...]:
        """The chunk's rank boundaries: its new tokens cut by their work with the positions before them priced in;
        a chunk shorter than the ranks runs on the front alone (every part but the last empty)."""
        if end - done < self.world_size:
            return (done,) * self.world_size + (end,)
        return cuts_after_cached(done, end, self.world_size, self.work)

    def predict_s(self, done: int, end: int) -> float:
        """The predicted seconds of a chunk prefilling positions [done, end)."""
        return simulate_chunk(self.cost, self.cuts(done, end), self.attention).ttft_s

    @property
    def correction(self) -> float:
        """The factor that scales the model's chunk predictions: the median measured / predicted seconds of the last
        ``LEARN_CHUNKS`` chunks learnt from (1 before any), within ``CORRECTION_CAP`` of the model."""
        if not self._ratios:
            return 1.0
        return min(CORRECTION_CAP, max(1 / CORRECTION_CAP, statistics.median(self._ratios)))

    def expected_s(self, done: int, end: int) -> float:
        """A chunk's predicted seconds as this machine has run them lately (the model's times the correction)."""
        return self.predict_s(done, end) * self.correction

    def record(self, cuts: tuple[int, ...], seconds: float, budget_s: float, learn: bool = True,
               beside: list[int] = ()) -> dict:
        """What a response reports of one chunk: its positions, cuts, time (its step's, the decode rows beside it
        included), the model's prediction, the correction that sized it, its budget. ``learn``: the step's measured
        time corrects the next predictions; ``beside``: the contexts of the decode rows that shared its step (their
        predicted share of it is left out of what it teaches)."""
        predicted, correction = self.predict_s(cuts[0], cuts[-1]), self.correction
        beside_s = self.cost.decode_step_s(list(beside)) if beside else 0.0
        if learn and predicted > 0 and seconds > 0:
            self._ratios.append(seconds / (predicted + beside_s))
        return {"start": cuts[0], "end": cuts[-1], "cuts": list(cuts), "seconds": seconds,
                "predicted_s": predicted, "beside_s": beside_s, "correction": correction, "budget_s": budget_s}

    def whole_s(self, n: int) -> float:
        """The predicted seconds of a whole ``n``-token prefill in one step (rounded up to ``ROUND`` tokens)."""
        key = -(-n // ROUND) * ROUND
        if key not in self._whole:
            self._whole[key] = self.predict_s(0, key)
        return self._whole[key]

    def remaining_s(self, n: int, done: int) -> float:
        """What is left of an ``n``-token prefill after ``done`` tokens, predicted (without the chunks' extra
        transfers: LARS needs the order of magnitude)."""
        return max(0.0, self.whole_s(n) - (self.whole_s(done) if done else 0.0))

    def chunked(self, n: int) -> bool:
        """Whether an ``n``-token prompt is prefilled in chunks: its one-step prefill would overrun the budget."""
        if self.fixed:
            return n > self.fixed
        return self.budget_s > 0 and n > self.min_chunk and self.expected_s(0, n) > self.budget_s

    def describe(self) -> str:
        if self.fixed:
            return f"chunks of {self.fixed} tokens (--chunk-tokens)"
        return f"chunks that the cost model fits in {self.budget_s * 1000:.0f} ms (--step-budget-ms)"

    def end(self, n: int, done: int, budget_s: float | None = None) -> int:
        """The end of the next chunk of an ``n``-token prompt after ``done`` tokens: the longest expected to fit
        ``budget_s`` (the planner's budget by default), at least ``min_chunk`` tokens, at most the rest."""
        if self.fixed:
            return min(n, done + self.fixed)
        budget = (self.budget_s if budget_s is None else budget_s) / self.correction
        lo = min(n, done + max(self.min_chunk, self.world_size))
        if self.predict_s(done, n) <= budget:
            return n
        hi = n
        while hi - lo > max(1, self.min_chunk // 4):  # the predicted time grows with the chunk's end
            mid = (lo + hi) // 2
            if self.predict_s(done, mid) <= budget:
                lo = mid
            else:
                hi = mid
        return lo


def pack_limit(planner: ChunkPlanner | None, pack_tokens: int, max_len: int) -> int:
    """The most tokens packed into one prefill: ``pack_tokens``, and with chunking on, what fits one step."""
    if planner is None or not (planner.fixed or planner.budget_s):
        return pack_tokens
    return min(pack_tokens, planner.end(max_len, 0))


def chunk_planner(config, placement, model_config) -> ChunkPlanner | None:
    """The engine's chunk planner (``config``: an EngineConfig), or None where nothing is chunked and LARS is off;
    raises InputError where the budget or LARS needs a cost model this setting has none of."""
    wanted = config.step_budget_ms > 0 or config.chunk_tokens > 0 or config.schedule == "lars"
    if config.step_budget_ms < 0 or config.chunk_tokens < 0:
        raise InputError("--step-budget-ms and --chunk-tokens take 0 (off) or a positive value")
    if not wanted:
        return None
    if placement.ctx.layout.windows:
        raise InputError("chunked prefill runs full-attention models only (a sliding layer's cache keeps its "
                         "window, not the positions a later chunk's cut needs)")
    degrees = placement.degrees
    threads = degrees.threads if placement.ctx.world_size > 1 else degrees.solo_threads
    cost, why = degrees.cost_model(threads)
    if cost is None and (config.step_budget_ms > 0 or config.schedule == "lars"):
        raise InputError(f"--step-budget-ms and --schedule lars price prefills with the cost model, and there is "
                         f"none here: {why}")
    if cost is None:
        raise InputError(f"--chunk-tokens needs the cost model for the chunks' cuts over the ranks: {why}")
    return ChunkPlanner(cost, placement.ctx.world_size, placement.attention, placement.work,
                        config.step_budget_ms / 1000, fixed=config.chunk_tokens)


def lars_slack(planner: ChunkPlanner, config) -> Slack:
    """LARS's view of a request: its target (the request's own, else the larger of ``ttft_slo_s`` and
    ``ttft_slo_factor`` times its predicted prefill), its whole predicted prefill, and what is left of it plus one
    step budget. Steps are not preempted: a request whose turn comes may first wait for a chunk under way (up to a
    budget), so its slack is counted from the end of that step. Without the margin a 2 s target with a 1 s budget
    let a short prompt wait until its slack fell below a long document's, then behind one more chunk: 2-3 s."""

    def target(seq) -> float:
        if seq.request.ttft_target_s is not None:
            return seq.request.ttft_target_s
        return max(config.ttft_slo_s, config.ttft_slo_factor * planner.whole_s(seq.prefill_len))

    return Slack(target, lambda seq: planner.whole_s(seq.prefill_len),
                 lambda seq: planner.remaining_s(seq.prefill_len, seq.prefilled) + planner.budget_s)
