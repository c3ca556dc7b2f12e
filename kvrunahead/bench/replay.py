"""The engine's schedule replayed on the cost model: what a trace of requests (arrival, prompt and output tokens)
would see under a policy on other hardware, a built-in GPU profile or this machine's.

The engine's own ``Scheduler`` decides every step, with the engine's chunk planner and LARS slack
(serve/chunking.py); each step takes the cost model's time: a whole prefill on one rank or over the chain,
whichever the model predicts faster (as the degree policy chooses), a chunk as ``simulate_chunk`` prices it, a
decode step of every running request on the front (``CostModel.decode_step_s``). Packing, the prefix cache and
the KVP decode are left out: a prediction of the schedule, not of every mechanism.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvrunahead.serve.chunking import ChunkPlanner, lars_slack
from kvrunahead.serve.scheduler import Scheduler
from kvrunahead.serve.sequence import Request, Sequence
from kvrunahead.sim.costmodel import CostModel
from kvrunahead.sim.optimize import balanced_boundaries
from kvrunahead.sim.simulate import simulate

ROUND = 64  # whole prefills priced per this many tokens


@dataclass(frozen=True)
class Arrival:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    kind: str = "short"


@dataclass
class Replayed:
    kind: str
    arrival_s: float
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0

    @property
    def tpot_s(self) -> float | None:
        if self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class SloConfig:
    """What ``lars_slack`` reads of an EngineConfig."""

    ttft_slo_s: float = 2.0
    ttft_slo_factor: float = 4.0


@dataclass
class _Engine:
    cost: CostModel
    world_size: int
    attention: str
    planner: ChunkPlanner
    _whole: dict = field(default_factory=dict)

    def prefill_s(self, n: int) -> float:
        key = -(-n // ROUND) * ROUND
        if key not in self._whole:
            one = simulate(self.cost, "single", key, 1).ttft_s
            chain = one
            if self.world_size > 1 and key >= self.world_size:
                b = balanced_boundaries(self.cost, key, self.world_size, self.attention)
                chain = simulate(self.cost, "kvr", key, self.world_size, b, self.attention).ttft_s
            self._whole[key] = min(one, chain)
        return self._whole[key]


def replay(trace: list[Arrival], cost: CostModel, world_size: int, work: Callable[[int], float],
           policy: str = "fcfs", budget_s: float = 0.0, attention: str = "split", slo: SloConfig | None = None,
           max_steps: int = 10_000_000, mixed: bool = True) -> list[Replayed]:
    """Every request's TTFT and end as the engine would schedule ``trace`` on ``cost`` over ``world_size`` ranks
    (``mixed``: decodes ride along the prefill steps, as ``EngineConfig.mixed_steps``)."""
    planner = ChunkPlanner(cost, world_size, attention, work, budget_s)
    engine = _Engine(cost, world_size, attention, planner)
    slack = lars_slack(planner, slo or SloConfig()) if policy == "lars" else None
    scheduler = Scheduler(len(trace) + 1, 0, policy, slack, mixed=mixed, chunks=planner)
    order = sorted(range(len(trace)), key=lambda i: trace[i].arrival_s)
    out = [Replayed(a.kind, a.arrival_s) for a in trace]
    seqs: dict[str, int] = {}
    now, nxt = 0.0, 0
    for _ in range(max_steps):
        while nxt < len(order) and trace[order[nxt]].arrival_s <= now:
            i = order[nxt]
            seq = Sequence(Request(str(i), [0] * trace[i].prompt_tokens, arrival_s=trace[i].arrival_s))
            seqs[seq.request_id] = i
            scheduler.add(seq)
            nxt += 1
        step = scheduler.schedule(now)
        if step is None:
            if nxt == len(order):
                return out
            now = trace[order[nxt]].arrival_s
            continue
        if step.decodes:  # in a mixed step the rows share the prefill's step; their time adds to it
            now += cost.decode_step_s([s.next_position + 1 for s in step.decodes])
            for seq in step.decodes:
                r = out[seqs[seq.request_id]]
                seq.output_ids.append(0)
                r.output_tokens += 1
                if r.output_tokens >= trace[seqs[seq.request_id]].output_tokens:
                    r.e2e_s = now - r.arrival_s
                    scheduler.finish(seq)
        if not step.prefills:
            continue
        [seq] = step.prefills  # packing is off
        n = seq.prompt_len
        if step.chunk_end is not None:  # sized by the scheduler, as the engine's
            end = step.chunk_end
            now += planner.predict_s(seq.prefilled, end)
            seq.prefilled = end
            if end < n:
                scheduler.resume(seq)
                continue
        else:
            now += engine.prefill_s(n)
        r = out[seqs[seq.request_id]]
        r.ttft_s, r.output_tokens = now - r.arrival_s, 1
        seq.output_ids.append(0)
        if trace[seqs[seq.request_id]].output_tokens <= 1:
            r.e2e_s = r.ttft_s
        else:
            scheduler.start_decoding(seq)
    raise RuntimeError(f"the replay did not end within {max_steps} steps")
