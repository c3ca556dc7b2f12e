"""What one rank reports of a timed prefill or step: its seconds (compute, waiting, sending), its bytes and its
peak memory. The one-shot runner (runner.py), the serving engine's steps (serve/step/executor.py) and kvr-bench's rows
report the same figures."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvrunahead.model.device import lifetime_peak_resident_bytes, peak_memory_bytes
from kvrunahead.ranks.transport import Transport


@dataclass
class RankStats:
    rank: int
    tokens: int
    total_s: float
    compute_s: float
    wait_s: float
    send_s: float
    bytes_sent: int
    bytes_received: int
    peak_mem_bytes: int
    bytes_sent_by_kind: dict[str, int] = field(default_factory=dict)  # kvr: K,V handed on, per layer kind

    @classmethod
    def alone(cls, rank: int, tokens: int, total_s: float) -> RankStats:
        """The figures of work a rank did alone: all compute, nothing sent or waited for."""
        return cls(rank=rank, tokens=tokens, total_s=total_s, compute_s=total_s, wait_s=0.0, send_s=0.0,
                   bytes_sent=0, bytes_received=0, peak_mem_bytes=0)


def rank_stats(rank: int, mine: list[tuple[int, int]], total_s: float, transport: Transport, state: object,
               device: torch.device) -> RankStats:
    """This rank's figures of the ``total_s`` seconds just timed, from the transport's counters (``state``: the
    mode's link, which may count the bytes it handed on per layer kind)."""
    st = transport.stats
    return RankStats(
        rank=rank,
        tokens=sum(e - a for a, e in mine),
        total_s=total_s,
        compute_s=total_s - st.wait_s - st.send_s,
        wait_s=st.wait_s,
        send_s=st.send_s,
        bytes_sent=st.bytes_sent,
        bytes_received=st.bytes_received,
        peak_mem_bytes=peak_memory_bytes(device),
        bytes_sent_by_kind=dict(getattr(state, "bytes_sent_by_kind", {})),
    )


@dataclass
class RankMemory:
    """What one rank held over a whole run (every rank of every TP group): the bytes of the largest model it
    loaded (with --tp its shard; the whole model too where ``--verify`` loaded it for the reference) and that model's
    oneDNN-packed copies of its linears (model/linears.py: beside the weights), its resident size before any model
    was loaded and its highest resident size since it started."""

    rank: int  # the global rank
    group: int  # its place in the chain (its TP group)
    tp_rank: int
    weight_bytes: int
    packed_bytes: int
    resident_before_load_bytes: int
    peak_resident_bytes: int


# this process's resident size before its first model; its largest model's weights, and their packed copies
LOADS = {"before": None, "weights": 0, "packed": 0}


def rank_memory(rank: int, group: int, tp_rank: int) -> RankMemory:
    return RankMemory(rank, group, tp_rank, LOADS["weights"], LOADS["packed"], LOADS["before"] or 0,
                      lifetime_peak_resident_bytes())
