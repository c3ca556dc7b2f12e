"""How many ranks prefill a request: one, or the whole chain.

KV-Runahead pays for its parallel prefill with the chain's fill and the K,V it hands on (section 4), so a short
prompt finishes sooner on one rank while a long one wins on the chain. The crossover is never a constant: it comes
from measurement (partition tables searched at world size 1 and at p, whose entries carry the measured TTFT), else
from the cost model of kvrunahead/sim (the predicted TTFT at degree 1 and at p on this machine's profile); the
reason is returned with the choice and reported per request (``RequestFigures.degree_source``).

A prompt on one rank runs while the other ranks of the node idle, so the front takes their cores
(``solo_threads``, see serve/step/executor.py): the degree-1 side is priced at those threads, the chain at ``threads``
per rank and at the partition the engine will run (``partition_of``: the table's where one covers the length),
not at the cost model's own optimum, which the served partition may miss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

from kvrunahead.config import RunConfig, cache_root
from kvrunahead.decide.policy import network_label, table_key
from kvrunahead.decide.tables import Table, TableError, find_table, table_filename
from kvrunahead.errors import ProfileError
from kvrunahead.provenance import cpu_name, machine
from kvrunahead.serve.learning import LayoutLearner
from kvrunahead.sim.costmodel import CostModel
from kvrunahead.sim.optimize import search_partition
from kvrunahead.sim.profile import resolve_profile
from kvrunahead.sim.shape import shape_from_config
from kvrunahead.sim.simulate import simulate


@dataclass(frozen=True)
class DegreeChoice:
    """``basis``: what decided, in a word (``/metrics`` counts the choices by it): fixed (one rank is all there is or
    the prompt is shorter than the chain), forced (``--degree``), prior (tables or the cost model), exploring or
    learned (serve/learning.py). ``prices``: the prior's seconds per degree at ``priced_at`` tokens."""

    degree: int
    source: str
    basis: str = "prior"
    prices: tuple[tuple[int, float], ...] = ()
    priced_at: int = 0


def parse_degree(spec: str, world_size: int) -> int | None:
    """``--degree``: ``auto`` (None), or 1 or the world size (a chain over a subset of the ranks would need a
    transport of its own per subset; not built)."""
    if spec == "auto":
        return None
    try:
        degree = int(spec)
    except ValueError:
        raise ValueError(f"--degree must be auto, 1 or {world_size}, got {spec!r}") from None
    if degree not in (1, world_size):
        raise ValueError(f"--degree must be auto, 1 or {world_size} (the world size), got {degree}")
    return degree


def _measured_ttft(table: Table, n: int) -> float | None:
    """The table's measured TTFT at ``n`` tokens, interpolated between its two nearest entries; None outside."""
    entries = table.entries
    if not entries or table.meta.source != "measured" or not entries[0].context_len <= n <= entries[-1].context_len:
        return None
    lo = max((e for e in entries if e.context_len <= n), key=lambda e: e.context_len)
    hi = min((e for e in entries if e.context_len >= n), key=lambda e: e.context_len)
    if hi.context_len == lo.context_len:
        return lo.ttft_s
    w = (n - lo.context_len) / (hi.context_len - lo.context_len)
    return (1 - w) * lo.ttft_s + w * hi.ttft_s


def layout_learner(spec: str, cfg: RunConfig, config, world_size: int, local_world_size: int, attention: str,
                   threads: int, solo_threads: int, pipeline: bool) -> LayoutLearner | None:
    """``--learn``: off (the prior alone), auto (the timings kept in the cache folder, one file per setting) or a
    file's path. The key names what the timings are valid for: the table's key, the threads of each degree, TP, the
    chain or the pipeline, and the machine."""
    if spec == "off" or world_size == 1:
        return None
    key = table_key(cfg, config, world_size, attention, local_world_size)
    prefill = "spp" if pipeline else "chain"
    stamp = {**dataclasses.asdict(key), "solo_bandwidth": network_label(cfg, 1, 1), "threads": threads,
             "solo_threads": solo_threads, "tp": cfg.tp, "prefill": prefill, "device": cpu_name(),
             "machine": machine()}
    name = f"{table_filename(key).removesuffix('.json')}_t{threads}_s{solo_threads}_tp{cfg.tp}_{prefill}.json"
    path = learned_folder() / name if spec == "auto" else Path(spec)
    names = {1: "1 TP group" if cfg.tp > 1 else "1 rank",
             world_size: f"the {'pipeline' if pipeline else 'chain'} of {world_size}"}
    return LayoutLearner(stamp, path, names)


def learned_folder() -> Path:
    """Where ``--learn auto`` keeps its files, one per setting."""
    return cache_root() / "learned"


# Lengths within one step share their choice (priced at the step's end): 64 tokens up to 4096, then 256 up to
# 16384, then 1024, so a step is never more than about 6% of its length and a server of 32k prices 128 of them.
STEPS = ((4096, 64), (16384, 256), (None, 1024))


def step_end(n: int) -> int:
    """The end of the length step ``n`` falls in."""
    for limit, step in STEPS:
        if limit is None or n <= limit:
            return -(-n // step) * step
    raise AssertionError("the last step has no limit")


def step_ends(max_len: int) -> list[int]:
    """Every step's end up to the step of ``max_len``."""
    ends, n = [], 1
    while not ends or ends[-1] < max_len:
        ends.append(step_end(n))
        n = ends[-1] + 1
    return ends


class DegreePolicy:
    """The degree per prompt length, decided once per step of length (``step_end``: priced at the step's end) and
    remembered: traffic rarely repeats a length exactly, and each price runs the cost model or reads the tables.
    The server prices every step up to its ``max_model_len`` at its start (``decide_up_to``), so a request's own
    choice is a look-up (and the learned layout's correction of it, serve/learning.py)."""

    def __init__(self, cfg: RunConfig, config, world_size: int, local_world_size: int, attention: str,
                 threads: int, degree: str = "auto", solo_threads: int | None = None,
                 partition_of: Callable[[int], tuple[int, ...]] | None = None,
                 learner: LayoutLearner | None = None) -> None:
        self.learner = learner  # the prior corrected by the server's own timings (serve/learning.py); None: not
        self.cfg, self.config, self.p = cfg, config, world_size
        self.partition_of = partition_of  # the chain's boundaries for n tokens; None: the cost model's optimum
        self.local_world_size, self.attention, self.threads = local_world_size, attention, threads
        self.solo_threads = solo_threads or threads
        self.forced = parse_degree(degree, world_size)
        self._decide = lru_cache(maxsize=None)(self._measured_or_predicted)
        self._costs: dict[int, tuple[CostModel | None, str]] = {}  # threads -> the cost model and its profile
        self.priced = 0  # steps priced (tables read or the cost model run): at the start, not per request

    def decide_up_to(self, max_len: int) -> int:
        """Price every step up to ``max_len`` tokens now (the server's start), so that no request runs the cost
        model or reads a table: a request looks its step's choice up. Returns the steps priced."""
        if self.p == 1 or self.forced is not None:
            return 0
        before = self.priced
        for edge in step_ends(max_len):
            if edge >= self.p:
                self._decide(edge)
        return self.priced - before

    def choose(self, n: int, explore: bool = True) -> DegreeChoice:
        """The degree for ``n`` tokens; ``explore``: False where the prefill will not be timed (packed, after a
        cached prefix), so that it runs what the timings say without trying another layout."""
        if self.p == 1:
            return DegreeChoice(1, "one rank in the world", "fixed")
        if n < self.p:  # even under --degree p: a chain needs a token per rank
            return DegreeChoice(1, f"{n} tokens: fewer than the {self.p} ranks", "fixed")
        if self.forced is not None:
            return DegreeChoice(self.forced, f"as asked (--degree {self.forced})", "forced")
        prior = self._prior(n)
        prices = self._prices(prior, n)
        if self.learner is None or not prices:
            return prior
        learned = self.learner.choose(n, prices, explore)
        if learned is None:
            return prior
        return dataclasses.replace(prior, degree=learned.degree, basis=learned.basis,
                                   source=f"{learned.why}; the prior: {prior.source}")

    def learn(self, n: int, degree: int, seconds: float, boundaries, busy: tuple[float, ...] = ()) -> None:
        """A whole prompt's prefill as the server timed it (no prefix cache, not packed, not chunked); ``busy``: a
        chain's ranks' compute seconds (what its partition learns from, forced degree or not)."""
        if self.learner is None or n < self.p or self.p == 1:
            return
        price = self._prices(self._prior(n), n).get(degree)
        if price is not None:
            self.learner.learn(n, degree, seconds, price, tuple(boundaries), busy)

    def _prior(self, n: int) -> DegreeChoice:
        """The tables' or the cost model's choice for ``n`` tokens, priced at the end of its 64-token step."""
        return self._decide(step_end(n))

    @staticmethod
    def _prices(prior: DegreeChoice, n: int) -> dict[int, float]:
        """The prior's seconds per degree scaled from the step's length to ``n`` (in proportion: a step is at most
        64 tokens long)."""
        return {d: s * n / prior.priced_at for d, s in prior.prices} if prior.priced_at else {}

    def _measured_or_predicted(self, n: int) -> DegreeChoice:
        self.priced += 1
        measured, unmeasured = self._from_tables(n)
        if measured is not None:
            return measured
        predicted, why = self._from_cost_model(n)
        if predicted is not None:
            return dataclasses.replace(predicted, source=f"{predicted.source} at {n} tokens; {unmeasured}")
        return DegreeChoice(self.p, f"the chain: {unmeasured} and no cost model ({why})",
                            prices=((1, float(n)), (self.p, float(n))), priced_at=n)  # alike until timed

    @cached_property
    def _table_pair(self) -> tuple[dict[int, Table] | None, str]:
        """The degree-1 and degree-p tables the measured answer compares, found and checked once (not per length):
        both must exist, be measured at the threads each degree runs with here (one rank takes the node's idle
        cores) and on the same kind of machine (their ratio is what carries over to this one); else None and why."""
        tables = {}
        for d in (1, self.p):
            key = table_key(self.cfg, self.config, d, self.attention, self.local_world_size)
            if d == 1:  # a single rank's table does not depend on the network
                key = dataclasses.replace(key, bandwidth=network_label(self.cfg, 1, 1))
            try:
                tables[d] = Table.load(find_table(key))
            except TableError:
                return None, f"no measured table at degree {d}"
            threads = self.solo_threads if d == 1 else self.threads
            if tables[d].meta.threads_per_rank != threads:
                return None, (f"the degree-{d} table was measured at {tables[d].meta.threads_per_rank} "
                              f"thread(s), not {threads}")
        if tables[1].meta.device != tables[self.p].meta.device:
            return None, f"the degree-1 and degree-{self.p} tables were measured on different machines"
        return tables, ""

    def _from_tables(self, n: int) -> tuple[DegreeChoice | None, str]:
        """The measured answer where the table pair covers ``n``; else None and why not."""
        tables, why = self._table_pair
        if tables is None:
            return None, why
        ttft = {d: _measured_ttft(t, n) for d, t in tables.items()}
        if None in ttft.values():
            return None, f"{n} tokens is outside the measured tables"
        degree = 1 if ttft[1] <= ttft[self.p] else self.p
        return DegreeChoice(degree, f"measured: {ttft[1]:.3f} s on 1 rank, {ttft[self.p]:.3f} s on {self.p} "
                                    f"(partition tables, interpolated at {n} tokens)",
                            prices=tuple(ttft.items()), priced_at=n), ""

    def _from_cost_model(self, n: int) -> tuple[DegreeChoice | None, str]:
        cost, which = self.cost_model(self.threads)
        if cost is None:
            return None, which
        solo, solo_which = self.cost_model(self.solo_threads)
        if solo is None:  # no profile at the front's solo threads: one rank priced at the chain's threads (slower)
            solo, solo_which = cost, f"{which}, at {self.threads} thread(s): none for {self.solo_threads}"
        one = simulate(solo, "kvr", n, 1, None, self.attention).ttft_s
        if self.partition_of is not None:
            chain = simulate(cost, "kvr", n, self.p, tuple(self.partition_of(n)), self.attention).ttft_s
        else:
            stride = max(1, min(64, n // (8 * self.p)))
            chain = search_partition(cost, n, self.p, self.attention, min_stride=stride).ttft_s
        degree = 1 if one <= chain else self.p
        return DegreeChoice(degree, f"cost model: predicted {one:.3f} s on 1 rank of {self.solo_threads} "
                                    f"thread(s) ({solo_which}), {chain:.3f} s on {self.p} ranks of {self.threads} "
                                    f"({which})", prices=((1, one), (self.p, chain)), priced_at=n), ""

    def cost_model(self, threads: int) -> tuple[CostModel | None, str]:
        """The cost model of this setting at ``threads`` per rank and the profile it stands on, or None and why
        there is none; built once per thread count, not per length."""
        if threads not in self._costs:
            self._costs[threads] = self._build_cost_model(threads)
        return self._costs[threads]

    def _build_cost_model(self, threads: int) -> tuple[CostModel | None, str]:
        key = table_key(self.cfg, self.config, self.p, self.attention, self.local_world_size)
        if key.device_kind != "cpu":
            return None, "the CPU cost model prices CPU ranks only"
        try:
            profile, which = resolve_profile(None, threads)
        except ProfileError as e:
            return None, str(e)
        profile, used, _ = profile.for_network(key.bandwidth)
        return CostModel(shape_from_config(self.config, key.dtype), profile, used), which
