"""``--net``: the network setting of a run, e.g. ``loopback``, ``cap=400MB/s`` or ``cap=13MB/s,noise``.

The cap decides the partition (tables are keyed on it, like on the model); noise is a condition of a run,
recorded in every row but not part of a table's key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {  # bytes per second
    "b/s": 1, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9,
    "kib/s": 2**10, "mib/s": 2**20, "gib/s": 2**30,
    "bit/s": 1 / 8, "kbit/s": 1e3 / 8, "mbit/s": 1e6 / 8, "gbit/s": 1e9 / 8,
}
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-z/]+)\s*$", re.IGNORECASE)


class NetError(ValueError):
    """A network setting that cannot be parsed or set up; one line."""


def parse_rate(text: str) -> float:
    """``400MB/s``, ``3.2Gbit/s``, ``13MiB/s`` -> bytes per second (MB = 10^6 bytes)."""
    m = _RATE.match(text)
    unit = m and m.group(2).lower()
    if unit and not unit.endswith("/s"):
        unit += "/s"
    if not m or unit not in _UNITS:
        raise NetError(f"cannot read the rate {text!r}: use a number and a unit such as 400MB/s, 13MB/s, "
                       f"3.2Gbit/s or 10MiB/s")
    value = float(m.group(1)) * _UNITS[unit]
    if value <= 0:
        raise NetError(f"a rate must be positive, got {text!r}")
    return value


def format_rate(bytes_per_s: float) -> str:
    """The canonical spelling of a rate, as it appears in labels and table names."""
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:g}{unit}"
    return f"{bytes_per_s:g}B/s"


@dataclass(frozen=True)
class NoiseSpec:
    """Bulk traffic between one random pair of adjacent ranks, both ways; the pair redrawn every
    ``interval_s``, sending for ``duty`` of each interval at ``rate_bytes_per_s`` per direction."""

    rate_bytes_per_s: float
    interval_s: float = 1.0
    duty: float = 0.5

    def describe(self) -> str:
        return f"noise {format_rate(self.rate_bytes_per_s)} each way, pair redrawn every {self.interval_s:g} s, " \
               f"on {self.duty:.0%} of the time"


@dataclass(frozen=True)
class NetSpec:
    """A network setting: rate cap per link and direction (None: no emulation, loopback) and noise."""

    cap_bytes_per_s: float | None = None
    noise: NoiseSpec | None = None

    @property
    def emulated(self) -> bool:
        return self.cap_bytes_per_s is not None

    @property
    def table_label(self) -> str:
        """The part partition tables are keyed on: the link's speed."""
        return "loopback" if self.cap_bytes_per_s is None else f"cap={format_rate(self.cap_bytes_per_s)}"

    @property
    def label(self) -> str:
        return self.table_label + (",noise" if self.noise else "")

    def describe(self) -> str:
        where = ("unshaped loopback" if self.cap_bytes_per_s is None else
                 f"one emulated host per rank, links capped at {format_rate(self.cap_bytes_per_s)} each way")
        return where + (f"; {self.noise.describe()}" if self.noise else "")

    def quiet(self) -> NetSpec:
        return NetSpec(self.cap_bytes_per_s, None)


# The sidecar's rate when none is given: half the cap per direction (it contends, it does not saturate: the paper's
# noisy network is a shared link, not a broken one), at most 100 MB/s: moving bytes costs CPU (about 0.05% of a
# core per MB/s through the kernel's TCP stack here), and on 2 cores the sidecar must stay under 5% of one.
DEFAULT_NOISE_SHARE = 0.5
MAX_DEFAULT_NOISE = 100e6  # bytes/s, also the rate on loopback, which has no cap to take a share of


def parse_net(text: str | None) -> NetSpec:
    """``loopback``, ``cap=400MB/s``, ``cap=13MB/s,noise``, ``cap=400MB/s,noise=100MB/s,interval=2,duty=0.3``."""
    if text is None or not text.strip():
        return NetSpec()
    cap = None
    noise = False
    rate = None
    interval = duty = None
    for item in (x.strip() for x in text.split(",")):
        name, _, value = item.partition("=")
        name = name.strip().lower()
        try:
            if name == "loopback" and not value:
                continue
            if name == "cap" and value:
                cap = parse_rate(value)
            elif name == "noise":
                noise = True
                if value:
                    rate = parse_rate(value)
            elif name == "interval" and value:
                interval = float(value.removesuffix("s"))
            elif name == "duty" and value:
                duty = float(value)
            else:
                raise NetError(f"unknown network item {item!r}")
        except ValueError as e:
            if isinstance(e, NetError):
                raise NetError(f"--net {text!r}: {e}") from None
            raise NetError(f"--net {text!r}: cannot read {item!r}") from None
    if (interval is not None or duty is not None) and not noise:
        raise NetError(f"--net {text!r}: interval and duty describe the noise; add 'noise'")
    interval = 1.0 if interval is None else interval
    duty = 0.5 if duty is None else duty
    if not 0 < duty <= 1 or interval <= 0:
        raise NetError(f"--net {text!r}: duty must be in (0, 1] and interval positive")
    spec_noise = None
    if noise:
        if rate is None:
            rate = MAX_DEFAULT_NOISE if cap is None else min(DEFAULT_NOISE_SHARE * cap, MAX_DEFAULT_NOISE)
        spec_noise = NoiseSpec(rate, interval, duty)
    return NetSpec(cap, spec_noise)
