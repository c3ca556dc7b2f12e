"""The layout of a prefill corrected by the server's own timings.

The degree policy (serve/degree.py) prices one rank against the chain from partition tables or the cost model; on a
host that neither was measured on, that prior misses the crossover (experiments/serve_degree: by 5-11% at 512-2048
tokens). A server that has answered requests has measured the truth, so every whole-prompt prefill it times is kept
here, per layout (the degree: one rank or one TP group, else the chain or the pipeline) and per length bucket (two
per doubling), as the ratio of its seconds to the prior's price at its length. A bucket's choice is then:

- **exploring** while a layout the prior does not rule out (priced under ``RULED_OUT`` times the cheaper) has fewer
  than ``MIN_TIMINGS`` timings there: the layout with the fewest runs, the prior's at a tie, so that a cold bucket
  costs at most ``MIN_TIMINGS`` requests on the slower layout;
- **learned** once each has: the prior's prices scaled by each layout's median ratio (its latest ``KEEP`` timings),
  the cheaper wins; one request in ``REFRESH_EVERY`` runs the runner-up while it is within ``REFRESH_WITHIN`` of the
  winner, so a host whose speed drifts is followed. No more than that share of a settled bucket is exploratory.

The timings persist in a small JSON file (rewritten after each timing, on a thread of its own) keyed by what they
are valid for (the model, dtype, world, threads, network, machine): a restart keeps what was learned, a change of
any of those starts afresh. ``export`` writes them as measured partition tables at degree 1 and p, the pair the
degree policy reads first (``kvr-learned FILE --export DIR``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from kvrunahead.decide.tables import Table, TableEntry, TableKey, TableMeta, table_filename
from kvrunahead.partition import Partition, PartitionError, Work, boundaries_at_rates, rank_rates

log = logging.getLogger(__name__)

BUCKETS_PER_DOUBLING = 2
MIN_TIMINGS = 3
KEEP = 12
REFRESH_EVERY = 10
REFRESH_WITHIN = 1.10
RULED_OUT = 1.5
FORMAT = 1
QUANTUM = 8  # a learned partition's boundaries, in tokens


def _index(n: int) -> int:
    return round(math.log2(n) * BUCKETS_PER_DOUBLING)


def bucket_of(n: int) -> int:
    """The length, in tokens, at the middle of ``n``'s bucket: 512, 724, 1024, 1448, 2048, ... Each bucket spans
    a quarter of a doubling either side, so the round lengths people ask for (and a token either side of them, as
    a text's tokenisation varies) sit well inside one."""
    return int(2 ** (_index(n) / BUCKETS_PER_DOUBLING))


def bucket_range(n: int) -> str:
    k = _index(n)

    def edge(x: float) -> int:  # the first length whose index is above x
        return math.floor(2 ** (x / BUCKETS_PER_DOUBLING)) + 1

    return f"{edge(k - 0.5)}-{edge(k + 0.5) - 1}"


@dataclass(frozen=True)
class Timing:
    tokens: int
    seconds: float
    ratio: float  # seconds over the prior's price at ``tokens``
    boundaries: tuple[int, ...]
    busy: tuple[float, ...] = ()  # per rank of a chain: its compute, without its waits


@dataclass
class Choice:
    degree: int
    basis: str  # exploring or learned
    why: str


@dataclass
class Bucket:
    timings: dict[int, deque] = field(default_factory=dict)  # degree -> its latest Timings
    requests: int = 0  # choices made here since the start

    def of(self, degree: int) -> deque:
        return self.timings.setdefault(degree, deque(maxlen=KEEP))


class LayoutLearner:
    """``key``: what the timings are valid for (a file made for another key is set aside, not read); ``path``:
    where they persist (None: this run only); ``names``: each degree's words (``{1: "1 rank", 2: "the chain"}``)."""

    def __init__(self, key: dict, path: Path | None, names: dict[int, str]) -> None:
        self.key, self.path, self.names = key, path, names
        self.buckets: dict[int, Bucket] = {}
        self.ignored: list[str] = []  # the stored timings left out at load, a line each (``_read``)
        self._lock = threading.Lock()  # the writer's: the latest snapshot to write, and whether it is writing
        self._pending: dict | None = None
        self._writing = False
        if path is not None and path.exists():
            self._load(path)

    def choose(self, n: int, prices: dict[int, float], explore: bool = True) -> Choice | None:
        """The layout for an ``n``-token prompt from what this server measured, the prior's ``prices`` (seconds
        per degree at ``n``) scaled by each layout's timings; None where there is nothing to correct (one layout
        left once the prior rules the others out, or a bucket still to explore where ``explore`` is False)."""
        cheapest = min(prices.values())
        open_ = [d for d, s in sorted(prices.items()) if s <= RULED_OUT * cheapest]
        if len(open_) < 2:
            return None
        edge = bucket_of(n)
        b = self.buckets.setdefault(edge, Bucket())
        b.requests += explore
        counts = {d: len(b.of(d)) for d in open_}
        where = f"at {bucket_range(n)} tokens"
        short = [d for d in open_ if counts[d] < MIN_TIMINGS]
        if short and not explore:
            return None
        if short:
            prior = min(open_, key=lambda d: prices[d])
            d = min(short, key=lambda d: (counts[d], d != prior))
            return Choice(d, "exploring", f"exploring: {self.names[d]} timed {counts[d]} of {MIN_TIMINGS} times "
                                          f"{where}")
        est = {d: prices[d] * statistics.median(t.ratio for t in b.of(d)) for d in open_}
        ranked = sorted(open_, key=lambda d: est[d])
        best, second = ranked[0], ranked[1]
        told = ", ".join(f"{self.names[d]} {est[d]:.3f} s ({counts[d]} timings)" for d in ranked)
        if explore and b.requests % REFRESH_EVERY == 0 and est[second] <= REFRESH_WITHIN * est[best]:
            return Choice(second, "exploring", f"exploring: the runner-up retimed (learned {told} {where})")
        return Choice(best, "learned", f"learned: {told} {where}")

    def learn(self, n: int, degree: int, seconds: float, price: float, boundaries: tuple[int, ...],
              busy: tuple[float, ...] = ()) -> None:
        """A whole prompt of ``n`` tokens prefilled at ``degree`` in ``seconds``, priced ``price`` by the prior;
        ``busy``: a chain's ranks' compute seconds."""
        if price <= 0 or seconds <= 0:
            return
        self.buckets.setdefault(bucket_of(n), Bucket()).of(degree).append(
            Timing(n, seconds, seconds / price, tuple(boundaries), tuple(busy)))
        if self.path is not None:
            self._save_soon()

    def _save_soon(self) -> None:
        """The file rewritten on a thread of its own, from a snapshot taken here (the buckets change on the engine's
        thread only): the step that timed the prefill, and its first token, do not wait on the disk."""
        snapshot = self._data()
        with self._lock:
            self._pending = snapshot
            if self._writing:
                return
            self._writing = True
        threading.Thread(target=self._write_pending, name="kvr-learned-save", daemon=True).start()

    def _write_pending(self) -> None:
        while True:
            with self._lock:
                data, self._pending = self._pending, None
                if data is None:
                    self._writing = False
                    return
            try:
                self._write(self.path, data)
            except OSError as e:  # a full disk or a folder made read-only since the start: learnt in memory only
                log.warning("cannot save the learned timings to %s (%s); they are kept in memory", self.path, e)

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until the latest timings are on disk (the server's shutdown, tests)."""
        import time

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                if not self._writing:
                    return
            time.sleep(0.01)

    def timings(self) -> int:
        return sum(len(t) for b in self.buckets.values() for t in b.timings.values())

    def save(self, path: Path) -> None:
        self._write(path, self._data())

    def _data(self) -> dict:
        return {"format": FORMAT, "key": self.key, "buckets": {
            str(edge): {str(d): [[t.tokens, t.seconds, t.ratio, list(t.boundaries), list(t.busy)] for t in ts]
                        for d, ts in b.timings.items() if ts}
            for edge, b in sorted(self.buckets.items())}}

    @staticmethod
    def _write(path: Path, data: dict) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(data) + "\n")
        tmp.replace(path)

    def _load(self, path: Path) -> None:
        """The file as untrusted input: one of another setting is set aside, one that cannot be read is ignored,
        and of a readable one every timing that could not serve is left out (``_read``), each with a warning."""
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("key") != self.key:
                log.warning("%s was learned for another setting; starting afresh (it is kept as %s.old)", path,
                            path.name)
                path.replace(path.with_suffix(path.suffix + ".old"))
                return
            self.ignored = self._read(data)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("cannot read the learned timings %s (%s); starting afresh", path, e)
            self.buckets = {}
            return
        if self.ignored:
            log.warning("%s: ignored %d learned timing(s) that cannot serve, e.g. %s; the rest is used", path,
                        len(self.ignored), "; ".join(self.ignored[:3]))
        log.info("learned timings: %d from %s (kvr-learned %s --reset forgets them)", self.timings(), path, path)

    def _read(self, data: dict) -> list[str]:
        """Take the file's timings that can serve (``timing_of``); what was left out, a line each."""
        ignored = []
        for edge, per in data["buckets"].items():
            for d, rows in per.items():
                for row in rows:
                    try:
                        timing, degree, bucket = timing_of(edge, d, row, set(self.names))
                    except (ValueError, TypeError, IndexError) as e:
                        ignored.append(f"bucket {edge!r}, degree {d!r}: {e}")
                        continue
                    self.buckets.setdefault(bucket, Bucket()).of(degree).append(timing)
        return ignored

    def rates(self, n: int, degree: int, work: Work) -> tuple[list[float], int] | None:
        """Each rank's median rate (seconds per unit of modelled work) over the chain prefills timed in ``n``'s
        bucket at ``degree``, and how many; None where none reported its ranks."""
        runs = [t for t in self.buckets.get(bucket_of(n), Bucket()).timings.get(degree, ())
                if len(t.busy) == degree and len(t.boundaries) == degree + 1 and min(t.busy) > 0]
        if not runs:
            return None
        per_run = [rank_rates(t.boundaries, t.busy, work) for t in runs]
        return [statistics.median(r[i] for r in per_run) for i in range(degree)], len(runs)

    def per_length(self, degree: int) -> list[tuple[int, float, tuple[int, ...], int]]:
        """Each length timed at ``degree``: (tokens, median seconds, the boundaries last run, timings)."""
        by_n: dict[int, list[Timing]] = {}
        for b in self.buckets.values():
            for t in b.timings.get(degree, ()):
                by_n.setdefault(t.tokens, []).append(t)
        return [(n, statistics.median(t.seconds for t in ts), ts[-1].boundaries, len(ts))
                for n, ts in sorted(by_n.items())]


def _positive(x, what: str) -> float:
    x = float(x)
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{what} {x} is not a positive number")
    return x


def timing_of(edge, degree, row, degrees: set[int]) -> tuple[Timing, int, int]:
    """One stored timing (``[tokens, seconds, ratio, boundaries, busy]`` under its bucket and degree), checked
    for what it will be used for: a length within its bucket, positive finite times, boundaries that are a
    partition of its tokens over its degree (or whole), a compute time per rank of a chain (or none). ``degrees``: the
    degrees this setting runs (empty: any). Raises ValueError naming what is wrong."""
    bucket, degree = int(edge), int(degree)
    if degrees and degree not in degrees:
        raise ValueError(f"degree {degree} is not run here ({sorted(degrees)})")
    tokens = row[0]
    if not isinstance(tokens, int) or tokens < max(1, degree):
        raise ValueError(f"{tokens!r} tokens cannot run at degree {degree}")
    if bucket_of(tokens) != bucket:
        raise ValueError(f"{tokens} tokens lie in bucket {bucket_of(tokens)}, not {bucket}")
    seconds, ratio = _positive(row[1], "seconds"), _positive(row[2], "the ratio to the prior")
    boundaries = tuple(row[3])  # the chain's cuts, or [0, n] (one rank, the pipeline: every rank all of them)
    if len(boundaries) not in (2, degree + 1) or not all(isinstance(b, int) for b in boundaries) or \
            boundaries[-1] != tokens:
        raise ValueError(f"boundaries {list(boundaries)} do not cut {tokens} tokens in 1 or {degree}")
    try:
        Partition(boundaries)
    except PartitionError as e:  # an empty or negative part
        raise ValueError(f"boundaries {list(boundaries)}: {e}") from None
    busy = tuple(float(x) for x in row[4]) if len(row) > 4 else ()
    if busy and (len(busy) != degree or not all(math.isfinite(x) and x >= 0 for x in busy)):
        raise ValueError(f"compute times {list(busy)} are not one per rank of {degree}")
    return Timing(tokens, seconds, ratio, boundaries, busy), degree, bucket


def load(path: Path) -> LayoutLearner:
    """A learned-timings file as it is, whatever setting it was made for (``kvr-learned``)."""
    data = json.loads(Path(path).read_text())
    learner = LayoutLearner(data["key"], None, {})
    learner.ignored = learner._read(data)
    return learner


def check_path(spec: str, auto_folder: Path) -> None:
    """``--learn``'s file (``auto``: one per setting in ``auto_folder``) must be one the server can write, or it
    would serve until its first timing and then end: raises ValueError naming why not."""
    if spec == "off":
        return
    path = None if spec == "auto" else Path(spec)
    if path is not None and path.is_dir():
        raise ValueError(f"--learn {spec}: a folder, not a file; give a file's path, auto or off")
    if path is not None and path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"--learn {spec}: the file cannot be written")
    folder = auto_folder if path is None else path.parent
    while not folder.exists():  # save() makes the missing folders: the nearest one there must take them
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"--learn {spec}: {folder} is not a folder this server can write in")


def export(learner: LayoutLearner, out: Path, work: Work | None = None) -> list[Path]:
    """The timings as measured partition tables, one per degree timed (``<table name>_served.json`` in ``out``):
    each length's median seconds and its partition: where ``work`` is given, the one the ranks' learned rates
    balance (what the server would run next), else the one it last ran. The degree-1 and degree-p pair is what the
    degree policy reads before its cost model; the chain's table is also what ``kvr-prefill --table`` and the
    partition policy read."""
    k = learner.key
    written = []
    for degree in sorted({d for b in learner.buckets.values() for d, ts in b.timings.items() if ts}):
        one = degree == 1
        key = TableKey(k["model"], k["config_hash"], degree, k["dtype"], k["kvr_attention"], k["device_kind"],
                       k["solo_bandwidth"] if one else k["bandwidth"])
        table = Table(TableMeta(key.model, key.config_hash, key.dtype, degree, "served", "served", k["device"],
                                k["solo_threads"] if one else k["threads"], key.bandwidth,
                                kvr_attention=key.kvr_attention, device_kind=key.device_kind))
        for n, seconds, boundaries, count in learner.per_length(degree):
            learned = None if one or work is None else learner.rates(n, degree, work)
            bounds = [0, n] if one else list(boundaries_at_rates(learned[0], work, n, QUANTUM) if learned
                                             else boundaries)
            table.add(TableEntry(n, bounds, [(b - a) / n for a, b in zip(bounds, bounds[1:])], seconds, None,
                                 count, 0.0, criterion="served"))
        path = Path(out) / f"{table_filename(key).removesuffix('.json')}_served.json"
        table.save(path)
        written.append(path)
    return written
