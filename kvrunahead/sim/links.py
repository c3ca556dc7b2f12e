"""Links between ranks in the simulator: one per direction per pair, messages in order, optional noise.

Noise follows the sidecar of ``kvrunahead.net.noise``: every ``interval_s`` one random pair of adjacent
ranks is drawn, and for the first ``duty`` of the interval its links in both directions lose ``rate_Bps``
of their bandwidth (never below 5% of it).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvrunahead.sim.profile import LinkProfile

FLOOR = 0.05


@dataclass(frozen=True)
class NoiseModel:
    rate_Bps: float
    interval_s: float = 1.0
    duty: float = 0.5
    seed: int = 0

    def active_pair(self, interval: int, world_size: int) -> int:
        """The lower rank of the pair loaded during ``interval``."""
        return random.Random(self.seed * 1_000_003 + interval).randrange(max(1, world_size - 1))


@dataclass
class Links:
    link: LinkProfile
    world_size: int
    noise: NoiseModel | None = None
    free_at: dict[tuple[int, int], float] = field(default_factory=dict)
    bytes_sent: dict[tuple[int, int], float] = field(default_factory=dict)

    def _bandwidth(self, src: int, dst: int, t: float) -> tuple[float, float]:
        """Bandwidth of the link at time ``t`` and the time until it may change."""
        bw = self.link.bandwidth_Bps
        n = self.noise
        if n is None or abs(src - dst) != 1 or self.world_size < 2:
            return bw, float("inf")
        k = int(t // n.interval_s)
        phase = t - k * n.interval_s
        on = phase < n.duty * n.interval_s and n.active_pair(k, self.world_size) == min(src, dst)
        change = (n.duty * n.interval_s - phase) if phase < n.duty * n.interval_s else (n.interval_s - phase)
        return (max(bw - n.rate_Bps, FLOOR * bw) if on else bw), max(change, 1e-12)

    def send(self, src: int, dst: int, start_s: float, nbytes: float, slowdown: float = 1.0) -> float:
        """Queue a message; returns when its last byte arrives. ``slowdown``: the message moves that many times
        slower than the link's rate (an all-gather's transfers, all at once)."""
        if nbytes <= 0:
            return start_s
        t = max(start_s, self.free_at.get((src, dst), 0.0)) + self.link.latency_s
        left = float(nbytes) * slowdown
        while True:
            bw, window = self._bandwidth(src, dst, t)
            if left <= bw * window:
                t += left / bw
                break
            left -= bw * window
            t += window
        self.free_at[(src, dst)] = t
        self.bytes_sent[(src, dst)] = self.bytes_sent.get((src, dst), 0.0) + nbytes
        return t

    def all_gather(self, start_s: float, block_bytes: float) -> float:
        """Every rank contributes ``block_bytes``; returns when all hold everything (all start together)."""
        p = self.world_size
        if p < 2:
            return start_s
        if self.link.allgather == "native":
            # A collective: (p-1) blocks into every rank at the collective's rate, on the slowest link.
            nbytes = (p - 1) * block_bytes
            return max(self.send(r, (r + 1) % p, start_s, nbytes, 1 / self.link.allgather_efficiency)
                       for r in range(p))
        t = start_s
        # The ring: p-1 steps, each waits for the slowest transfer; all links busy at once cost what the
        # measured efficiency says (on one host the transfers share the CPU that copies them).
        for _ in range(p - 1):
            t = max(self.send(r, (r + 1) % p, t, block_bytes, 1 / self.link.allgather_efficiency) for r in range(p))
        return t
