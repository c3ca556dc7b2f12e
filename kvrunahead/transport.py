"""Point-to-point KV links between neighbouring ranks of the chain.

A rank holds a link from its predecessor (receive) and a link to its successor (send). The
layer's K and V travel as one contiguous ``[2, batch, heads, tokens, head_dim]`` tensor, so one
message per layer and hop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class KVLayout:
    """Shape of one layer's cached K (and V) apart from the token axis: ``[batch, heads, *, head_dim]``."""

    heads: tuple[int, ...]  # per layer: K/V heads (1 for MQA, fewer than query heads for GQA)
    head_dim: tuple[int, ...]
    dtype: torch.dtype

    @property
    def num_layers(self) -> int:
        return len(self.heads)

    def bytes_per_token(self, layer: int) -> int:
        return 2 * self.heads[layer] * self.head_dim[layer] * torch.tensor([], dtype=self.dtype).element_size()


@dataclass
class LinkStats:
    wait_s: float = 0.0
    send_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0


@dataclass
class ChainLink:
    """This rank's place in the KV chain: receives [0, prefix_len) from rank-1, sends [0, end) to rank+1.

    ``recv_group`` / ``send_group`` are the process groups of the two adjacent pairs. With NCCL every
    point-to-point op of one communicator runs in order on one stream, so a pending receive from
    rank-1 would hold back the send to rank+1 if both used the same communicator.
    """

    rank: int
    world_size: int
    prefix_len: int
    layout: KVLayout
    device: torch.device
    recv_group: object | None = None
    send_group: object | None = None
    lookahead: int = 1
    stats: LinkStats = field(default_factory=LinkStats)
    _pending_recv: dict = field(default_factory=dict)
    _pending_send: list = field(default_factory=list)

    @property
    def has_prev(self) -> bool:
        return self.rank > 0

    @property
    def has_next(self) -> bool:
        return self.rank < self.world_size - 1

    def start(self) -> None:
        """Post the first receives; called before the forward starts."""
        for layer in range(min(self.lookahead, self.layout.num_layers)):
            self._post_recv(layer)

    def _post_recv(self, layer: int) -> None:
        if not self.has_prev or layer >= self.layout.num_layers or layer in self._pending_recv:
            return
        # The buffer shape follows from the partition alone: no per-layer shape handshake.
        buf = torch.empty(
            (2, 1, self.layout.heads[layer], self.prefix_len, self.layout.head_dim[layer]),
            dtype=self.layout.dtype,
            device=self.device,
        )
        work = dist.irecv(buf, src=self.rank - 1, group=self.recv_group, tag=layer)
        self._pending_recv[layer] = (work, buf)

    def exchange(self, layer: int, local_kv: torch.Tensor) -> torch.Tensor:
        """Prepend the predecessor's prefix to ``local_kv``, forward the result, return it."""
        if self.has_prev:
            self._post_recv(layer)  # no-op when posted ahead, as it normally is
            work, prefix = self._pending_recv.pop(layer)
            t = time.perf_counter()
            work.wait()
            self.stats.wait_s += time.perf_counter() - t
            self.stats.bytes_received += prefix.numel() * prefix.element_size()
            self._post_recv(layer + self.lookahead)
            kv = torch.cat((prefix, local_kv), dim=-2)
        else:
            kv = local_kv.contiguous()
        if self.has_next:
            t = time.perf_counter()
            self._pending_send.append((dist.isend(kv, dst=self.rank + 1, group=self.send_group, tag=layer), kv))
            self.stats.send_s += time.perf_counter() - t
            self.stats.bytes_sent += kv.numel() * kv.element_size()
            self.stats.messages_sent += 1
        return kv

    def finish(self) -> None:
        """Wait for the sends still in flight (their buffers must outlive them)."""
        t = time.perf_counter()
        for work, _ in self._pending_send:
            work.wait()
        self._pending_send.clear()
        self.stats.send_s += time.perf_counter() - t


def pair_groups(world_size: int, backend: str) -> list:
    """One process group per adjacent pair (i, i+1); every rank must call this in the same order."""
    if world_size < 2:
        return []
    return [dist.new_group([i, i + 1], backend=backend) for i in range(world_size - 1)]
