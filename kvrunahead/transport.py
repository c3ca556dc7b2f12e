"""How ranks move K,V: point-to-point sends and receives, and all-gather, over torch.distributed or MPI.

Both transports count what they move and how long the caller was blocked, so every prefill mode reports
bytes sent and wait time the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

TRANSPORTS = ("torch", "mpi")
# torch >= 2.13 names the all-gather into one tensor all_gather_single (the old name warns); older releases
# only have the old one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class LinkStats:
    wait_s: float = 0.0  # blocked on data from other ranks (receives, all-gathers)
    send_s: float = 0.0  # blocked on own sends (issuing them, draining them at the end)
    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0


class Request(Protocol):
    def wait(self) -> None: ...


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Transport:
    """Point-to-point and all-gather between the ranks of one world, with accounting."""

    name = "none"

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.stats = LinkStats()
        self._sends: list[tuple[Request, torch.Tensor]] = []

    # Subclasses implement these three.
    def _isend(self, t: torch.Tensor, dst: int, tag: int) -> Request:
        raise NotImplementedError

    def _irecv(self, t: torch.Tensor, src: int, tag: int) -> Request:
        raise NotImplementedError

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        raise NotImplementedError

    def isend(self, t: torch.Tensor, dst: int, tag: int) -> None:
        """Send in the background; the tensor is kept alive until ``drain``."""
        start = time.perf_counter()
        self._sends.append((self._isend(t, dst, tag), t))
        self.stats.send_s += time.perf_counter() - start
        self.stats.bytes_sent += nbytes(t)
        self.stats.messages_sent += 1

    def irecv(self, t: torch.Tensor, src: int, tag: int) -> Request:
        self.stats.bytes_received += nbytes(t)
        return self._irecv(t, src, tag)

    def exchange(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, tag: int) -> Request:
        """Send ``send`` to ``dst`` and receive ``recv`` from ``src`` at once (a ring step); returns the receive."""
        req = self.irecv(recv, src, tag)
        self.isend(send, dst, tag)
        return req

    def wait(self, req: Request) -> None:
        start = time.perf_counter()
        req.wait()
        self.stats.wait_s += time.perf_counter() - start

    def all_gather(self, inp: torch.Tensor) -> torch.Tensor:
        """``[world_size, *inp.shape]``: every rank's ``inp``, in rank order."""
        # Blocks concatenated along dim 0, the layout the all-gather into one tensor expects.
        out = torch.empty((self.world_size * inp.shape[0], *inp.shape[1:]), dtype=inp.dtype, device=inp.device)
        start = time.perf_counter()
        self._all_gather(out, inp.contiguous())
        out = out.view(self.world_size, *inp.shape)
        self.stats.wait_s += time.perf_counter() - start
        # Each rank's block reaches the p-1 others: (p-1) x its size, whatever algorithm the library picks.
        self.stats.bytes_sent += (self.world_size - 1) * nbytes(inp)
        self.stats.bytes_received += (self.world_size - 1) * nbytes(inp)
        return out

    def drain(self) -> None:
        """Wait for this rank's sends still in flight."""
        start = time.perf_counter()
        for req, _ in self._sends:
            req.wait()
        self._sends.clear()
        self.stats.send_s += time.perf_counter() - start

    def reset_stats(self) -> None:
        self.stats = LinkStats()


class TorchTransport(Transport):
    """gloo on CPU, NCCL on GPU.

    Point-to-point ops go through one process group per neighbouring pair: with NCCL every op of one
    communicator runs in order on one stream, so a pending receive from rank i-1 would otherwise hold
    back the send to rank i+1. (gloo's ``batch_isend_irecv`` can hang; plain isend/irecv are used.)
    """

    name = "torch"

    def __init__(self, rank: int, world_size: int, backend: str) -> None:
        super().__init__(rank, world_size)
        self.backend = backend
        self._pairs: dict[frozenset[int], object] = {}
        if world_size > 1:
            # Every rank creates every group, in the same order: (i, i+1) and the ring's wrap-around.
            for i in range(world_size):
                j = (i + 1) % world_size
                key = frozenset((i, j))
                if key not in self._pairs:
                    self._pairs[key] = dist.new_group(sorted(key), backend=backend)

    def _group(self, a: int, b: int):
        return self._pairs[frozenset((a, b))]

    def _isend(self, t, dst, tag):
        return dist.isend(t, dst=dst, group=self._group(self.rank, dst), tag=tag)

    def _irecv(self, t, src, tag):
        return dist.irecv(t, src=src, group=self._group(self.rank, src), tag=tag)

    def _all_gather(self, out, inp):
        _all_gather_single(out, inp)

    def exchange(self, send, dst, recv, src, tag):
        if self.backend != "nccl":
            return super().exchange(send, dst, recv, src, tag)
        # NCCL runs one communicator's ops in order: with two ranks both neighbours share one pair group,
        # and a receive queued before the matching send would deadlock. A batched pair is one group call.
        start = time.perf_counter()
        ops = [dist.P2POp(dist.irecv, recv, src, group=self._group(self.rank, src)),
               dist.P2POp(dist.isend, send, dst, group=self._group(self.rank, dst))]
        works = dist.batch_isend_irecv(ops)
        self.stats.send_s += time.perf_counter() - start
        self.stats.bytes_sent += nbytes(send)
        self.stats.bytes_received += nbytes(recv)
        self.stats.messages_sent += 1
        self._sends.append((works[1], send))
        return works[0]


class MpiTransport(Transport):
    """mpi4py on host buffers: Isend/Irecv for the chain and the ring, Allgather for the gathers."""

    name = "mpi"

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        from kvrunahead.launcher import import_mpi

        self.MPI = import_mpi()
        self.comm = self.MPI.COMM_WORLD
        if self.comm.Get_size() != world_size:
            raise RuntimeError("--transport mpi needs the ranks to be started by mpirun")

    def _buf(self, t: torch.Tensor):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("MPI transport needs contiguous host tensors")
        # Bytes, so bfloat16 (which numpy lacks) travels too.
        return [t.view(torch.uint8).numpy(), self.MPI.BYTE]

    def _isend(self, t, dst, tag):
        return _MpiRequest(self.comm.Isend(self._buf(t), dest=dst, tag=tag))

    def _irecv(self, t, src, tag):
        return _MpiRequest(self.comm.Irecv(self._buf(t), source=src, tag=tag))

    def _all_gather(self, out, inp):
        self.comm.Allgather(self._buf(inp), self._buf(out))


@dataclass
class _MpiRequest:
    req: object

    def wait(self) -> None:
        self.req.Wait()


class LocalTransport(Transport):
    """One process: nothing to send."""

    name = "local"

    def __init__(self) -> None:
        super().__init__(0, 1)

    def _all_gather(self, out, inp):
        out.copy_(inp)


def make_transport(name: str, rank: int, world_size: int, backend: str) -> Transport:
    if world_size == 1:
        return LocalTransport()
    if name == "torch":
        return TorchTransport(rank, world_size, backend)
    if name == "mpi":
        return MpiTransport(rank, world_size)
    raise ValueError(f"unknown transport {name!r}: use one of {', '.join(TRANSPORTS)}")


@dataclass(frozen=True)
class KVLayout:
    """Shape of one layer's cached K (and V) apart from the token axis: ``[batch, heads, *, head_dim]``."""

    heads: tuple[int, ...]  # per layer: K/V heads (1 for MQA, fewer than query heads for GQA)
    head_dim: tuple[int, ...]
    dtype: torch.dtype

    @property
    def num_layers(self) -> int:
        return len(self.heads)

    def kv_shape(self, layer: int, tokens: int) -> tuple[int, ...]:
        """K and V of ``tokens`` positions stacked: ``[2, 1, heads, tokens, head_dim]``."""
        return (2, 1, self.heads[layer], tokens, self.head_dim[layer])


@dataclass
class ChainLink:
    """This rank's place in the KV chain: receives [0, prefix_len) from rank-1, sends [0, end) to rank+1.

    A layer's K and V travel as one contiguous ``[2, 1, heads, tokens, head_dim]`` tensor: one message
    per layer and hop.
    """

    transport: Transport
    prefix_len: int
    layout: KVLayout
    device: torch.device
    lookahead: int = 1
    _pending: dict = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def has_prev(self) -> bool:
        return self.rank > 0

    @property
    def has_next(self) -> bool:
        return self.rank < self.transport.world_size - 1

    def start(self) -> None:
        """Post the first receives; called before the forward starts."""
        for layer in range(min(self.lookahead, self.layout.num_layers)):
            self._post_recv(layer)

    def _post_recv(self, layer: int) -> None:
        if not self.has_prev or layer >= self.layout.num_layers or layer in self._pending:
            return
        # The buffer shape follows from the partition alone: no per-layer shape handshake.
        buf = torch.empty(self.layout.kv_shape(layer, self.prefix_len), dtype=self.layout.dtype, device=self.device)
        self._pending[layer] = (self.transport.irecv(buf, self.rank - 1, tag=layer), buf)

    def prefix(self, layer: int) -> torch.Tensor:
        """The predecessor's K,V of [0, prefix_len) for ``layer``; posts the next layer's receive."""
        self._post_recv(layer)  # no-op when posted ahead, as it normally is
        req, buf = self._pending.pop(layer)
        self.transport.wait(req)
        self._post_recv(layer + self.lookahead)
        return buf

    def exchange(self, layer: int, local_kv: torch.Tensor) -> torch.Tensor:
        """Prepend the predecessor's prefix to ``local_kv``, forward the result, return it."""
        kv = torch.cat((self.prefix(layer), local_kv), dim=-2) if self.has_prev else local_kv.contiguous()
        if self.has_next:
            self.transport.isend(kv, self.rank + 1, tag=layer)
        return kv

    def finish(self) -> None:
        """Wait for the sends still in flight (their buffers must outlive them)."""
        self.transport.drain()
