"""Partition lookup tables (paper section 4.2, fig. 10): plain JSON, one file per model x world size x setting.

At run time the partition for a length between two entries is the linear interpolation of their ratios,
renormalised and rounded to tokens; outside the table's range the nearest entry is used, with a warning.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvrunahead.partition import Partition

log = logging.getLogger(__name__)

TABLES_DIR = Path(__file__).resolve().parents[2] / "partition_tables"


class TableError(ValueError):
    """A table that is missing, malformed, or made for another model, world size, dtype, attention, device
    kind or network."""


@dataclass(frozen=True)
class TableKey:
    """What a table must have been searched for to apply to a run: the partition that minimises TTFT depends
    on every one of these (the model's shape, the number of ranks, the attention's cost, the device, the
    network's speed)."""

    model: str
    config_hash: str
    world_size: int
    dtype: str
    kvr_attention: str
    device_kind: str  # "cpu" or "cuda"
    bandwidth: str  # the network label
    tp: int = 1  # ranks per TP group: ``world_size`` counts the chain's groups

    def describe(self) -> str:
        groups = f" of TP groups of {self.tp}" if self.tp > 1 else ""
        return (f"{self.model} at world size {self.world_size}{groups} in {self.dtype} with {self.kvr_attention} "
                f"attention on {self.device_kind} over {self.bandwidth}")


@dataclass
class TableMeta:
    model: str
    config_hash: str
    dtype: str
    world_size: int
    backend: str
    transport: str
    device: str  # CPU or GPU model
    threads_per_rank: int
    bandwidth: str
    date: str = field(default_factory=lambda: datetime.date.today().isoformat())
    version: str = ""
    kvr_attention: str = "masked"  # tables made before split attention existed were searched with masked
    device_kind: str = "cpu"
    noise: str | None = None  # the noise sidecar during the search, if any (not part of the key)
    source: str = "measured"  # or "cost model: <profile>" (kvr-search --backend model)
    oversubscribed: bool = False  # measured with more busy threads than the node has cores: the scheduler timed
    tp: int = 1  # searched over TP groups of this many ranks (kvr-search --tp); world_size counts the groups
    # What the ranks computed with, beyond the key (model.compute.compute_settings): the CPU attention kernel and
    # its path ("ours (avx512bf16)", "torch") and the linears ("onednn", "torch"). None: searched before they were
    # recorded, on torch's attention and linears.
    attention_kernel: str | None = None
    linears: str | None = None

    @property
    def key(self) -> TableKey:
        return TableKey(self.model, self.config_hash, self.world_size, self.dtype, self.kvr_attention,
                        self.device_kind, self.bandwidth, self.tp)


@dataclass
class TableEntry:
    context_len: int
    boundaries: list[int]
    ratios: list[float]
    ttft_s: float
    even_ttft_s: float | None
    evaluations: int
    search_s: float
    seeded: bool = False
    balance: float | None = None  # max rank busy / min: read on the ranks (--criterion balance) or predicted (model)
    criterion: str | None = None  # how it was found: None (older tables) or ttft, balance, model
    busy_s: list[float] | None = None  # per rank, compute without waits: median of its runs, or the model's


@dataclass
class Lookup:
    partition: Partition
    source: str  # which table and entries it came from
    warning: str | None = None


@dataclass
class Table:
    meta: TableMeta
    entries: list[TableEntry] = field(default_factory=list)

    def add(self, entry: TableEntry) -> None:
        self.entries = sorted([e for e in self.entries if e.context_len != entry.context_len] + [entry],
                              key=lambda e: e.context_len)

    def save(self, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"meta": asdict(self.meta), "entries": [asdict(e) for e in self.entries]}
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Table:
        try:
            data = json.loads(Path(path).read_text())
            return cls(TableMeta(**data["meta"]), [TableEntry(**e) for e in data["entries"]])
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise TableError(f"cannot read partition table {path}: {e}") from None

    def lookup(self, context_len: int, name: str = "table") -> Lookup:
        """The partition for ``context_len``: interpolated between the two nearest entries (fig. 10)."""
        if not self.entries:
            raise TableError(f"partition table {name} has no entries")
        if self.meta.source != "measured":
            name = f"{name} ({self.meta.source})"
        if self.meta.oversubscribed:
            name = f"{name} (searched OVERSUBSCRIBED)"
        below = [e for e in self.entries if e.context_len <= context_len]
        above = [e for e in self.entries if e.context_len >= context_len]
        if below and above:
            lo, hi = below[-1], above[0]
            if lo.context_len == hi.context_len:
                return Lookup(Partition.from_ratios(lo.ratios, context_len), f"{name}, entry {lo.context_len}")
            w = (context_len - lo.context_len) / (hi.context_len - lo.context_len)
            ratios = [(1 - w) * a + w * b for a, b in zip(lo.ratios, hi.ratios)]
            return Lookup(Partition.from_ratios(ratios, context_len),
                          f"{name}, interpolated between entries {lo.context_len} and {hi.context_len}")
        nearest = below[-1] if below else above[0]
        warning = (f"context {context_len} is outside table {name} ({self.entries[0].context_len}.."
                   f"{self.entries[-1].context_len}); using the nearest entry {nearest.context_len}")
        return Lookup(Partition.from_ratios(nearest.ratios, context_len), f"{name}, nearest entry "
                      f"{nearest.context_len}", warning)

    def search_seed(self, context_len: int) -> tuple[int, ...]:
        """Where a partition search for ``context_len`` starts: the lookup inside the table's range; beyond it
        the ratios of the two nearest entries extrapolated linearly (the optimal skew keeps growing with the
        context), each part kept at least 1/(4p) of the context. An extrapolation that gives a later rank
        more than an earlier one (noisy entries; never optimal, fig. 10) falls back to the nearest entry.
        Only a starting point: the search corrects it."""
        below = [e for e in self.entries if e.context_len < context_len]
        above = [e for e in self.entries if e.context_len > context_len]
        if len(self.entries) < 2 or (below and above) or any(e.context_len == context_len for e in self.entries):
            return self.lookup(context_len).partition.boundaries
        a, b = (below[-2], below[-1]) if below else (above[0], above[1])
        w = (context_len - a.context_len) / (b.context_len - a.context_len)
        floor = 1 / (4 * len(a.ratios))
        ratios = [max(floor, (1 - w) * x + w * y) for x, y in zip(a.ratios, b.ratios)]
        if any(later > earlier for earlier, later in zip(ratios, ratios[1:])):
            return self.lookup(context_len).partition.boundaries
        return Partition.from_ratios([r / sum(ratios) for r in ratios], context_len).boundaries

    def searched_with(self) -> dict[str, str]:
        """The compute settings the table was searched with (torch's throughout for a table that predates them)."""
        return {"attention_kernel": self.meta.attention_kernel or "torch", "linears": self.meta.linears or "torch"}

    def stale(self, run: dict[str, str], name: str = "table") -> str | None:
        """A line saying how the run's compute settings (``attention_kernel``, ``linears``) differ from those the
        table was searched with, or None where they agree: a rank's cost moved and the table did not."""
        searched = self.searched_with()
        differ = [f"{what.replace('_', ' ')} {searched[what]} (this run: {run[what]})" for what in searched
                  if what in run and run[what] != searched[what]]
        if not differ:
            return None
        unrecorded = "" if self.meta.attention_kernel else ", before tables recorded their settings"
        return (f"partition table {name} is stale: searched with {', '.join(differ)}{unrecorded}; its partitions are "
                f"re-weighted by the cost model until it is searched again (kvr-search)")

    def markdown(self) -> str:
        """The entries as a Markdown table (for experiment write-ups and a quick look at a table)."""
        lines = ["| context | boundaries | rank 0 share | TTFT s | even s | best / even | candidates | search time |",
                 "|---|---|---|---|---|---|---|---|"]
        for e in self.entries:
            even = f"{e.even_ttft_s:.2f}" if e.even_ttft_s else ""
            ratio = f"{e.ttft_s / e.even_ttft_s:.2f}" if e.even_ttft_s else ""
            lines.append(f"| {e.context_len} | {','.join(map(str, e.boundaries))} | {e.ratios[0]:.3f} | "
                         f"{e.ttft_s:.2f} | {even} | {ratio} | {e.evaluations} | {e.search_s:.0f} s |")
        return "\n".join(lines) + "\n"

    def check(self, want: TableKey, name: str = "table") -> None:
        """Refuse a table made for another setting (its partitions would be tuned for other costs)."""
        m = self.meta.key
        problems = []
        if m.world_size != want.world_size:
            problems.append(f"world size {m.world_size}, not {want.world_size}")
        if m.model != want.model or m.config_hash != want.config_hash:
            problems.append(f"model {m.model} ({m.config_hash}), not {want.model} ({want.config_hash})")
        for what in ("dtype", "kvr_attention", "device_kind", "bandwidth", "tp"):
            if getattr(m, what) != getattr(want, what):
                label = {"kvr_attention": "attention", "device_kind": "device", "bandwidth": "network",
                         "tp": "--tp"}.get(what, what)
                problems.append(f"{label} {getattr(m, what)}, not {getattr(want, what)}")
        if problems:
            raise TableError(f"partition table {name} was made for {'; '.join(problems)}: pass --force-table "
                             "to use it anyway")


def table_filename(key: TableKey) -> str:
    """``smollm2-135m_p2_float32_cpu_split.json``; a network other than loopback is named as well, and a TP degree
    (``smollm2-135m_p2_tp2_...``: two groups of two)."""
    net = "" if key.bandwidth == "loopback" else f"_{key.bandwidth}"
    tp = f"_tp{key.tp}" if key.tp > 1 else ""
    name = f"{key.model}_p{key.world_size}{tp}_{key.dtype}_{key.device_kind}_{key.kvr_attention}{net}".lower()
    slug = "".join(c if c.isalnum() or c == "_" else "-" for c in name)
    return "-".join(filter(None, slug.split("-"))) + ".json"


def find_table(want: TableKey, directory: Path | None = None) -> Path:
    """The table in ``directory`` (default: the shipped partition_tables/) made for exactly this setting."""
    directory = TABLES_DIR if directory is None else directory
    matches = []
    for path in sorted(Path(directory).glob("*.json")):
        try:
            meta = Table.load(path).meta
        except TableError:
            continue
        if meta.key == want:
            matches.append(path)
    if not matches:
        raise TableError(f"no partition table in {directory} for {want.describe()}; make one with kvr-search or "
                         "give --table PATH")
    return matches[-1]


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        table = Table.load(Path(arg))
        print(f"{arg}: {table.meta.key.describe()}\n\n{table.markdown()}")
