"""Replay the per-layer schedule of every prefill mode on p ranks (paper fig. 3-5) with a ``CostModel``.

- kvr: rank i computes its Q,K,V, waits for the prefix K,V of the layer from rank i-1 (its receive is posted
  when the previous layer's prefix arrived, before this layer's projection, so the wait overlaps it),
  concatenates, sends [0, b_{i+1}) on to rank i+1 (in order on its link, overlapped with its attention and
  MLP), then attends and runs the MLP. A message moves once the receiver has posted its receive (gloo and
  MPI's rendezvous for large messages): a sender far ahead of its successor waits for it.
- kvr-nocomm: the same with the prefix already local (the practical bound of section 5).
- tsp: even parts; every layer all-gathers K,V (all ranks meet), then full masked score rows.
- cp-allgather: zigzag chunks (rank i holds chunks i and 2p-1-i), all-gather, each chunk against the keys it sees.
- ring: zigzag chunks; p steps per layer, each attends to the block in hand while passing it on.
- spp: stream pipeline parallel (Medha): the layers cut into stages, one per rank; the prompt's chunks go through
  them in order, a stage starting chunk c once it has finished chunk c-1 and chunk c's hidden states have arrived
  (the pipeline's fill and drain are the first and last chunks' passes); one hidden-state message per chunk and
  stage boundary.
- single: one rank, the whole prompt.
Compute of one rank is serial; transfers run beside it. TTFT ends with the LM head on the emitting rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrunahead.partition import Partition, zigzag_ranges
from kvrunahead.sim.costmodel import CostModel
from kvrunahead.sim.links import Links, NoiseModel

MODES = ("single", "kvr", "kvr-nocomm", "tsp", "cp-allgather", "ring", "spp")


class SimError(ValueError):
    """A simulation that cannot run as asked."""


@dataclass
class RankTimes:
    rank: int
    tokens: int
    compute_s: float = 0.0
    wait_s: float = 0.0
    link_busy_s: float = 0.0  # time this rank's outgoing links were busy
    bytes_sent: float = 0.0
    end_s: float = 0.0


@dataclass(frozen=True)
class Span:
    rank: int
    layer: int
    kind: str  # "compute", "wait" or "send"
    start_s: float
    end_s: float


@dataclass
class SimResult:
    mode: str
    context_len: int
    world_size: int
    boundaries: tuple[int, ...]
    ttft_s: float
    ranks: list[RankTimes]
    link_bytes: dict[str, float]
    spans: list[Span] = field(default_factory=list)


class _Clock:
    """Per-rank time and accounting."""

    def __init__(self, p: int, tokens: list[int], record: bool) -> None:
        self.t = [0.0] * p
        self.ranks = [RankTimes(r, tokens[r]) for r in range(p)]
        self.record = record
        self.spans: list[Span] = []

    def compute(self, rank: int, layer: int, seconds: float) -> None:
        self._span(rank, layer, "compute", self.t[rank], self.t[rank] + seconds)
        self.ranks[rank].compute_s += seconds
        self.t[rank] += seconds

    def wait_until(self, rank: int, layer: int, when: float) -> None:
        if when > self.t[rank]:
            self._span(rank, layer, "wait", self.t[rank], when)
            self.ranks[rank].wait_s += when - self.t[rank]
            self.t[rank] = when

    def sent(self, rank: int, layer: int, start: float, end: float, nbytes: float) -> None:
        self._span(rank, layer, "send", start, end)
        self.ranks[rank].link_busy_s += end - start
        self.ranks[rank].bytes_sent += nbytes

    def _span(self, rank, layer, kind, start, end) -> None:
        if self.record and end > start:
            self.spans.append(Span(rank, layer, kind, start, end))


def simulate(model: CostModel, mode: str, context_len: int, world_size: int,
             boundaries: tuple[int, ...] | None = None, attention: str = "split", noise: NoiseModel | None = None,
             record: bool = False, stages: tuple[int, ...] | None = None,
             chunk_tokens: int | None = None) -> SimResult:
    """TTFT and per-rank breakdown of one prefill. ``boundaries``: the kvr partition (even if None); ``stages``
    and ``chunk_tokens``: spp's layer boundaries (even if None) and chunk (the whole prompt if None)."""
    if mode not in MODES:
        raise SimError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")
    if world_size < 1:
        raise SimError(f"world size must be at least 1, got {world_size}")
    p = 1 if mode == "single" else world_size
    if context_len < p or context_len < 1:
        raise SimError(f"context of {context_len} tokens cannot be split over {p} ranks")
    if mode in ("cp-allgather", "ring") and context_len < 2 * p:
        raise SimError(f"{mode} needs at least {2 * p} tokens for its 2p chunks")
    if model.shape.sliding and mode not in ("single", "kvr", "kvr-nocomm", "spp"):
        raise SimError(f"{model.shape.name} has sliding-window layers, which the simulator prices for the KV chain "
                       f"and the pipeline only (single, kvr, spp), not for {mode}")
    if mode == "spp":
        stages = stages or Partition.even(model.layers, p).boundaries
        return simulate_spp(model, context_len, stages, chunk_tokens or context_len, noise, record, attention)
    kvr = mode in ("kvr", "kvr-nocomm")
    b = tuple(boundaries) if boundaries is not None and kvr else Partition.even(context_len, p).boundaries
    if len(b) != p + 1 or b[0] != 0 or b[-1] != context_len or any(y <= x for x, y in zip(b, b[1:])):
        raise SimError(f"boundaries {b} are not a partition of {context_len} tokens over {p} ranks")
    links = Links(model.link, p, noise)
    if mode in ("cp-allgather", "ring"):
        ranges = zigzag_ranges(context_len, p)
    else:
        ranges = [[(b[r], b[r + 1])] for r in range(p)]
    clock = _Clock(p, [sum(e - a for a, e in r) for r in ranges], record)
    if mode in ("single", "kvr", "kvr-nocomm"):
        _kvr(model, clock, links, b, attention, comm=mode == "kvr")
        emitter = p - 1
    elif mode == "tsp":
        _gather(model, clock, links, ranges, context_len, zig=False)
        emitter = p - 1
    elif mode == "cp-allgather":
        _gather(model, clock, links, ranges, context_len, zig=True)
        emitter = 0
    else:
        _ring(model, clock, links, ranges)
        emitter = 0
    if mode == "ring":
        clock.wait_until(emitter, model.layers, links.free_at.get((emitter, (emitter + 1) % p), 0.0))  # the drain
    clock.compute(emitter, model.layers, model.lm_head_s())
    for r in clock.ranks:
        r.end_s = clock.t[r.rank]
    link_bytes = {f"{s}->{d}": v for (s, d), v in sorted(links.bytes_sent.items())}
    return SimResult(mode, context_len, p, b, clock.t[emitter], clock.ranks, link_bytes, clock.spans)


def simulate_spp(model: CostModel, context_len: int, stages: tuple[int, ...], chunk_tokens: int,
                 noise: NoiseModel | None = None, record: bool = False, attention: str = "split") -> SimResult:
    """The stream pipeline (modes/spp.py): stage s holds layers [stages[s], stages[s+1]); chunk c enters stage s
    once stage s is done with chunk c-1 and stage s-1 has sent chunk c's hidden states (whose receive stage s
    posted when it took chunk c-1). The last stage's LM head on the last position ends the TTFT."""
    p = len(stages) - 1
    if p < 1 or stages[0] != 0 or stages[-1] != model.layers or any(y <= x for x, y in zip(stages, stages[1:])):
        raise SimError(f"stages {stages} are not a cut of {model.layers} layers into {p} non-empty stages")
    if chunk_tokens < 1:
        raise SimError(f"a chunk holds at least one token, got {chunk_tokens}")
    links = Links(model.link, p, noise)
    clock = _Clock(p, [context_len] * p, record)
    posted = [0.0] * p  # when each stage posted the receive of the chunk about to arrive
    for a in range(0, context_len, chunk_tokens):
        n = min(chunk_tokens, context_len - a)
        arrival = 0.0
        for s in range(p):
            first = stages[s]
            if s > 0:
                clock.wait_until(s, first, arrival)
                posted[s] = clock.t[s]
                clock.compute(s, first, model.transfer_cpu_s(model.hidden_bytes(n)))
            for layer in range(stages[s], stages[s + 1]):
                clock.compute(s, layer, model.spp_layer_s(attention, n, a, layer))
            if s < p - 1:
                nbytes = model.hidden_bytes(n)
                start = max(clock.t[s], posted[s + 1], links.free_at.get((s, s + 1), 0.0))
                arrival = links.send(s, s + 1, start, nbytes)
                clock.sent(s, stages[s + 1] - 1, start, arrival, nbytes)
                clock.compute(s, stages[s + 1] - 1, model.transfer_cpu_s(nbytes))
    clock.compute(p - 1, model.layers, model.lm_head_s())
    for r in clock.ranks:
        r.end_s = clock.t[r.rank]
    link_bytes = {f"{s}->{d}": v for (s, d), v in sorted(links.bytes_sent.items())}
    return SimResult("spp", context_len, p, tuple(stages), clock.t[p - 1], clock.ranks, link_bytes, clock.spans)


def simulate_chunk(model: CostModel, boundaries: tuple[int, ...], attention: str = "split") -> SimResult:
    """One chunk of a chunked prefill (serve/chunking.py): positions [b[0], b[-1]) over the chain, every rank
    holding the first ``b[0]`` already, so the chain carries only the chunk's own positions; then the last rank
    sends each other rank the chunk's positions it lacks (the catch-up). Every part but the last empty: the last
    rank alone. The step ends when every rank is done (the front gathers their figures)."""
    b = tuple(boundaries)
    p = len(b) - 1
    alone = b[0] == b[-2]
    if p < 1 or b[0] < 0 or b[-1] <= b[-2] or (not alone and any(y <= x for x, y in zip(b, b[1:]))):
        raise SimError(f"boundaries {b} are not a chunk's cuts over {p} ranks")
    links = Links(model.link, p)
    clock = _Clock(p, [b[r + 1] - b[r] for r in range(p)], False)
    if alone:
        for layer in range(model.layers):
            clock.compute(p - 1, layer, model.rank_layer_s(attention, b[-1] - b[0], b[0], layer))
    else:
        _kvr(model, clock, links, b, attention, comm=True, base=b[0])
    clock.compute(p - 1, model.layers, model.lm_head_s())
    for r in range(p - 1):  # the catch-up, from the front once it is done
        nbytes = model.kv_bytes(b[-1] - (b[0] if alone else b[r + 1])) * model.layers
        arrival = links.send(p - 1, r, clock.t[p - 1], nbytes)
        clock.compute(p - 1, model.layers, model.transfer_cpu_s(nbytes))
        clock.wait_until(r, model.layers, arrival)
        clock.compute(r, model.layers, model.transfer_cpu_s(nbytes) + model.copy_s(nbytes))  # appended in place
    for r in clock.ranks:
        r.end_s = clock.t[r.rank]
    link_bytes = {f"{s}->{d}": v for (s, d), v in sorted(links.bytes_sent.items())}
    return SimResult("kvr", b[-1], p, b, max(clock.t), clock.ranks, link_bytes)


def _kvr(model: CostModel, clock: _Clock, links: Links, b: tuple[int, ...], attention: str, comm: bool,
         base: int = 0) -> None:
    """The chain; every rank holding the first ``base`` positions already, the messages carry what follows them
    (``simulate_chunk``)."""
    p = len(b) - 1
    posted = [0.0] * p  # when each rank's receive for the current layer was posted
    for layer in range(model.layers):
        arrival = 0.0
        for i in range(p):
            n, prefix = b[i + 1] - b[i], b[i]
            held = model.kept(prefix - base, layer)  # what the predecessor hands on (a sliding layer: its window)
            clock.compute(i, layer, model.qkv_s(n))
            if i > 0 and comm:
                clock.wait_until(i, layer, arrival)
                posted[i] = clock.t[i]  # the next layer's receive goes up as this one's data is in
                clock.compute(i, layer, model.transfer_cpu_s(model.kv_bytes(held)))
            if prefix:  # the prefix and the rank's own K,V joined; a chunk appends to the base it holds in place
                clock.compute(i, layer, model.copy_s(model.kv_bytes(held + n)))
            if i < p - 1 and comm:
                nbytes = model.kv_bytes(model.kept(b[i + 1] - base, layer))
                start = max(clock.t[i], posted[i + 1], links.free_at.get((i, i + 1), 0.0))
                arrival = links.send(i, i + 1, start, nbytes)
                clock.sent(i, layer, start, arrival, nbytes)
                clock.compute(i, layer, model.transfer_cpu_s(nbytes))
            clock.compute(i, layer, model.kvr_attention_s(attention, n, prefix, layer) + model.other_s(n))


def _gather(model: CostModel, clock: _Clock, links: Links, ranges, context_len: int, zig: bool) -> None:
    p = len(ranges)
    tokens = [sum(e - a for a, e in r) for r in ranges]
    width = max(tokens)  # all-gather blocks are padded to the largest part
    for layer in range(model.layers):
        for r in range(p):
            clock.compute(r, layer, model.qkv_s(tokens[r]))
        start = max(clock.t)
        end = links.all_gather(start, model.kv_bytes(width))
        moved = (p - 1) * model.kv_bytes(width) if p > 1 else 0.0
        for r in range(p):
            clock.sent(r, layer, start, end, moved)
            clock.wait_until(r, layer, end)
            clock.compute(r, layer, model.transfer_cpu_s(2 * moved))  # sent and received
            if zig:
                attn = sum(model.masked_s(e - a, e) for a, e in ranges[r])
            else:
                attn = model.masked_s(tokens[r], context_len)
            clock.compute(r, layer, model.copy_s(model.kv_bytes(context_len)) + attn + model.other_s(tokens[r]))


def _block_s(model: CostModel, q_range: tuple[int, int], k_range: tuple[int, int]) -> float:
    (qa, qe), (ka, ke) = q_range, k_range
    if ka >= qe:
        return 0.0
    if ka == qa:
        return model.causal_s(qe - qa)
    return model.full_s(qe - qa, ke - ka)


def _ring(model: CostModel, clock: _Clock, links: Links, ranges) -> None:
    p = len(ranges)
    tokens = [sum(e - a for a, e in r) for r in ranges]
    for layer in range(model.layers):
        for r in range(p):
            clock.compute(r, layer, model.qkv_s(tokens[r]))
        for step in range(p):
            arrivals = [0.0] * p
            cpu = [0.0] * p  # this step's transfers' copies, on the ranks that send and receive them
            if step < p - 1:
                for r in range(p):
                    # Both ends post at the start of their step: the block moves once both have.
                    held, nxt = (r - step) % p, (r + 1) % p
                    nbytes = model.kv_bytes(tokens[held])
                    start = max(clock.t[r], clock.t[nxt], links.free_at.get((r, nxt), 0.0))
                    arrivals[nxt] = links.send(r, nxt, start, nbytes)
                    clock.sent(r, layer, start, arrivals[nxt], nbytes)
                    cpu[r] += model.transfer_cpu_s(nbytes)
                    cpu[nxt] += model.transfer_cpu_s(nbytes)
            for r in range(p):
                held = (r - step) % p
                clock.compute(r, layer, sum(_block_s(model, q, k) for q in ranges[r] for k in ranges[held]))
                if step < p - 1:
                    clock.wait_until(r, layer, arrivals[r])
                    clock.compute(r, layer, cpu[r])
        for r in range(p):
            clock.compute(r, layer, model.other_s(tokens[r]))
