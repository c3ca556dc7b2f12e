"""How ranks move K,V: point-to-point sends and receives, and all-gather, over torch.distributed or MPI.

Both transports count what they move and how long the caller was blocked, so every prefill mode reports
bytes sent and wait time the same way.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from kvrunahead.choices import ALLGATHERS, TRANSPORTS
from kvrunahead.errors import LaunchError, PeerTimeout

MPI_HINT = "apt-get install -y openmpi-bin libopenmpi-dev && pip install mpi4py (or pip install 'kvrunahead[mpi]')"
# torch >= 2.13 names the all-gather into one tensor all_gather_single (the old name warns); older releases
# only have the old one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def import_mpi():
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise LaunchError(f"MPI launch needs mpi4py and an MPI library ({e}); install: {MPI_HINT}") from None
    return MPI


@dataclass
class LinkStats:
    wait_s: float = 0.0  # blocked on data from other ranks (receives, all-gathers)
    send_s: float = 0.0  # blocked on own sends (issuing them, draining them at the end)
    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0


class Request(Protocol):
    def wait(self, timeout: datetime.timedelta | None = None) -> bool: ...


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Transport:
    """Point-to-point and all-gather between the ranks of one world, with accounting."""

    name = "none"
    native_allgather_fair = False  # whether the library's all-gather is as fast per byte as point-to-point

    def __init__(self, rank: int, world_size: int, timeout_s: float = 60.0, allgather: str = "auto") -> None:
        self.rank, self.world_size = rank, world_size
        self.timeout_s = timeout_s  # the longest wait for data in flight (net/liveness.py)
        self.set_allgather(allgather)
        self.stats = LinkStats()
        self._sends: list[tuple[Request, torch.Tensor, str]] = []

    def set_allgather(self, choice: str) -> None:
        """"native", "p2p", or "auto": the library's collective where it is as fast per byte as point-to-point."""
        if choice not in ALLGATHERS:
            raise ValueError(f"unknown all-gather {choice!r}: use one of {', '.join(ALLGATHERS)}")
        self.allgather = ("native" if self.native_allgather_fair else "p2p") if choice == "auto" else choice

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
        self._sends.append((self._isend(t, dst, tag), t, f"its send to rank {dst} (tag {tag})"))
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

    def wait(self, req: Request, what: str = "data from another rank") -> None:
        start = time.perf_counter()
        self._bounded_wait(req, what)
        self.stats.wait_s += time.perf_counter() - start

    def _bounded_wait(self, req: Request, what: str) -> None:
        """Wait at most ``timeout_s``; then one line naming this rank and what it waited for. (gloo and NCCL time
        a wait themselves; without a bound, a receive from a stopped peer waits forever.)"""
        try:
            req.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            if "imed out" not in str(e) and "imeout" not in str(e):
                raise
            raise PeerTimeout(f"rank {self.rank}: no progress for {self.timeout_s:g} s waiting for {what} (the peer "
                              "is stopped, gone, or its link is down or starved)") from None

    def all_gather(self, inp: torch.Tensor) -> torch.Tensor:
        """``[world_size, *inp.shape]``: every rank's ``inp``, in rank order."""
        # Blocks concatenated along dim 0, the layout the all-gather into one tensor expects.
        out = torch.empty((self.world_size * inp.shape[0], *inp.shape[1:]), dtype=inp.dtype, device=inp.device)
        start = time.perf_counter()
        if self.allgather == "p2p":
            self._ring_all_gather(out, inp.contiguous())
        else:
            self._all_gather(out, inp.contiguous())
        out = out.view(self.world_size, *inp.shape)
        self.stats.wait_s += time.perf_counter() - start
        # Each rank's block reaches the p-1 others: (p-1) x its size, whatever algorithm the library picks.
        self.stats.bytes_sent += (self.world_size - 1) * nbytes(inp)
        self.stats.bytes_received += (self.world_size - 1) * nbytes(inp)
        return out

    def _ring_all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """All-gather as p-1 ring steps over the chain's point-to-point links: in step s every rank sends the
        block of rank (r - s) to r+1 and receives that of rank (r - s - 1) from r-1; at p = 2 one exchange each
        way, as NCCL does it."""
        p, r = self.world_size, self.rank
        blocks = out.view(p, *inp.shape)
        blocks[r].copy_(inp)
        for step in range(p - 1):
            src_block, dst_block = (r - step) % p, (r - step - 1) % p
            tag = 1_000_000 + step
            recv = self._irecv(blocks[dst_block], (r - 1) % p, tag)
            send = self._isend(blocks[src_block], (r + 1) % p, tag)
            self._bounded_wait(recv, f"all-gather step {step} from rank {(r - 1) % p}")
            self._bounded_wait(send, f"all-gather step {step} to rank {(r + 1) % p}")

    def drain(self) -> None:
        """Wait for this rank's sends still in flight."""
        start = time.perf_counter()
        for req, _, what in self._sends:
            self._bounded_wait(req, what)
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

    def __init__(self, rank: int, world_size: int, backend: str, timeout_s: float = 60.0,
                 allgather: str = "auto") -> None:
        self.backend = backend
        self.native_allgather_fair = backend == "nccl"
        super().__init__(rank, world_size, timeout_s, allgather)
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
        self._bounded_wait(_all_gather_single(out, inp, async_op=True), "the all-gather of every rank's K,V")

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
        self._sends.append((works[1], send, f"its send to rank {dst}"))
        return works[0]


class MpiTransport(Transport):
    """mpi4py on host buffers: Isend/Irecv for the chain and the ring, Allgather for the gathers."""

    name = "mpi"

    def __init__(self, rank: int, world_size: int, timeout_s: float = 60.0, allgather: str = "auto") -> None:
        super().__init__(rank, world_size, timeout_s, allgather)
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
        req = _MpiRequest(self.comm.Iallgather(self._buf(inp), self._buf(out)))
        self._bounded_wait(req, "the all-gather of every rank's K,V")


@dataclass
class _MpiRequest:
    req: object

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if timeout is None:
            self.req.Wait()
            return True
        # MPI has no timed wait: poll, backing off to 1 ms (the chain's waits are milliseconds to seconds).
        deadline = time.monotonic() + timeout.total_seconds()
        pause = 1e-5
        while not self.req.Test():
            if time.monotonic() > deadline:
                raise RuntimeError("timed out")
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
        return True


class LocalTransport(Transport):
    """One process: nothing to send."""

    name = "local"

    def __init__(self) -> None:
        super().__init__(0, 1)

    def _all_gather(self, out, inp):
        out.copy_(inp)


def make_transport(name: str, rank: int, world_size: int, backend: str, timeout_s: float = 60.0,
                   allgather: str = "auto") -> Transport:
    if world_size == 1:
        return LocalTransport()
    if name == "torch":
        return TorchTransport(rank, world_size, backend, timeout_s, allgather)
    if name == "mpi":
        return MpiTransport(rank, world_size, timeout_s, allgather)
    raise ValueError(f"unknown transport {name!r}: use one of {', '.join(TRANSPORTS)}")
