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
    def is_completed(self) -> bool: ...

    def wait(self, timeout: datetime.timedelta | None = None) -> bool: ...


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Transport:
    """Point-to-point and all-gather between the ranks of one world, with accounting."""

    name = "none"
    native_allgather_fair = False  # whether the library's all-gather is as fast per byte as point-to-point
    polls = False  # whether waits poll ``is_completed`` against the deadline (the library's wait cannot time out)
    poll_pause_s = 1e-3  # the longest sleep between polls

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
        self._keep_send(self._isend(t, dst, tag), t, dst, tag, start)

    def _keep_send(self, req: Request, t: torch.Tensor, dst: int, tag: int, start: float) -> None:
        """Count a send posted since ``start`` and keep it (and its tensor) until ``drain``."""
        self._sends.append((req, t, f"its send to rank {dst} (tag {tag})"))
        self.stats.send_s += time.perf_counter() - start
        self.stats.bytes_sent += nbytes(t)
        self.stats.messages_sent += 1

    def irecv(self, t: torch.Tensor, src: int, tag: int) -> Request:
        self.stats.bytes_received += nbytes(t)
        return self._irecv(t, src, tag)

    def exchange(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, tag: int) -> Request:
        """Send ``send`` to ``dst`` and receive ``recv`` from ``src`` at once (a ring step); returns the receive."""
        start = time.perf_counter()
        recv_req, send_req = self._post_exchange(send, dst, recv, src, tag)
        self._keep_send(send_req, send, dst, tag, start)
        self.stats.bytes_received += nbytes(recv)
        return recv_req

    def wait(self, req: Request, what: str = "data from another rank") -> None:
        start = time.perf_counter()
        self._bounded_wait(req, what)
        self.stats.wait_s += time.perf_counter() - start

    def _bounded_wait(self, req: Request, what: str) -> None:
        """Wait at most ``timeout_s``; then one line naming this rank and what it waited for. (Without a bound, a
        receive from a stopped peer waits forever.)"""
        if not self.polls:  # gloo bounds a wait itself
            try:
                req.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
            except RuntimeError as e:
                if "imed out" not in str(e) and "imeout" not in str(e):
                    raise
                self._timed_out(what)
            return
        # NCCL's wait only orders the caller's stream after the operation (it returns at once unless blocking wait
        # is on) and MPI has no timed wait: both are polled against a deadline, which also makes wait_s real.
        deadline = time.monotonic() + self.timeout_s
        pause = 1e-6
        while not req.is_completed():
            if time.monotonic() > deadline:
                self._timed_out(what)
            time.sleep(pause)
            pause = min(2 * pause, self.poll_pause_s)
        req.wait()

    def _timed_out(self, what: str):
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
            recv, send = self._post_exchange(blocks[src_block], (r + 1) % p, blocks[dst_block], (r - 1) % p,
                                             1_000_000 + step)
            self._bounded_wait(recv, f"all-gather step {step} from rank {(r - 1) % p}")
            self._bounded_wait(send, f"all-gather step {step} to rank {(r + 1) % p}")

    def _post_exchange(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int,
                       tag: int) -> tuple[Request, Request]:
        """Post a receive from ``src`` and a send to ``dst``; returns (receive, send) requests."""
        return self._irecv(recv, src, tag), self._isend(send, dst, tag)

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

    The NCCL orderings, which tests/test_nccl_orderings.py replays against NCCL's rules for p = 2-5:
    - the chain: each pair's communicator carries one direction only (rank i sends layer after layer, rank i+1
      receives them in the same order), so it completes whatever the partition;
    - a ring step (ring attention, the point-to-point all-gather): at p = 2 both neighbours are one pair group,
      where a receive queued before the matching send deadlocks, so the receive and the send are one batched
      group call; at p > 2 they are on two different pair groups, which one batch may not mix, so each is posted
      on its own pair's communicator, where this step's traffic again goes one way;
    - every communicator is made before anything is timed (``connect``): the first batched call on a group must
      include every rank of it, and a communicator made lazily by the first send would be timed.
    """

    name = "torch"

    def __init__(self, rank: int, world_size: int, backend: str, timeout_s: float = 60.0,
                 allgather: str = "auto", device: torch.device | None = None,
                 lanes: list[list[int]] | None = None, lane: int = 0) -> None:
        self.backend = backend
        self.native_allgather_fair = self.polls = backend == "nccl"
        if self.polls:
            self.poll_pause_s = 1e-4  # a GPU's waits are short: poll closely
        super().__init__(rank, world_size, timeout_s, allgather)
        self.device = device or (torch.device("cuda", torch.cuda.current_device()) if self.polls
                                 else torch.device("cpu"))
        # With tensor parallelism the chain's ranks are TP groups: this transport joins this rank's lane (the same
        # TP rank of every group, mesh.py); ``rank`` and ``world_size`` count groups, ``members`` maps them to
        # global ranks.
        lanes = lanes or [list(range(world_size))]
        self.members = lanes[lane]
        self._pairs: dict[frozenset[int], object] = {}
        self._lane_group = None
        if world_size > 1:
            # Every rank creates every group, in the same order: (i, i+1) and the ring's wrap-around, then every
            # rank with the last (the serving engine's front gathers pipeline stages from and hands chunks to every
            # rank), per lane.
            for index, ranks in enumerate(lanes):
                pairs = {}
                for a, b in [(i, (i + 1) % world_size) for i in range(world_size)] + [
                        (i, world_size - 1) for i in range(world_size - 1)]:
                    key = frozenset((ranks[a], ranks[b]))
                    if key not in pairs:
                        pairs[key] = dist.new_group(sorted(key), backend=backend)
                whole = dist.new_group(ranks, backend=backend) if len(lanes) > 1 else None
                if index == lane:
                    self._pairs, self._lane_group = pairs, whole
            if self.polls:
                self.connect()

    def _group(self, a: int, b: int):
        return self._pairs[frozenset((self.members[a], self.members[b]))]

    def connect(self) -> None:
        """Make every NCCL communicator this rank will use, before any timed region: a batched exchange with each
        neighbour (the first batched call on a group, with every rank of it), one plain message each way (plain
        point-to-point may get a communicator of its own), and one all-gather of the world."""
        one = torch.zeros(1, device=self.device)
        me = self.members[self.rank]
        for key, group in self._pairs.items():
            if me not in key:
                continue
            (peer,) = key - {me}
            got = torch.empty(1, device=self.device)
            works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, peer, group=group),
                                            dist.P2POp(dist.isend, one, peer, group=group)])
            for work in works:
                self._bounded_wait(work, f"connecting to rank {peer}")
            # The lower rank sends first: each side's two plain operations meet in the same order.
            sends_first = me < peer
            index = self.members.index(peer)
            for sending in (sends_first, not sends_first):
                work = self._isend(one, index, 0) if sending else self._irecv(got, index, 0)
                self._bounded_wait(work, f"connecting to rank {peer}")
        self._all_gather(torch.empty(self.world_size, device=self.device), one)

    def _isend(self, t, dst, tag):
        return dist.isend(t, dst=self.members[dst], group=self._group(self.rank, dst), tag=tag)

    def _irecv(self, t, src, tag):
        return dist.irecv(t, src=self.members[src], group=self._group(self.rank, src), tag=tag)

    def _all_gather(self, out, inp):
        self._bounded_wait(_all_gather_single(out, inp, group=self._lane_group, async_op=True),
                           "the all-gather of every rank's K,V")

    def _post_exchange(self, send, dst, recv, src, tag):
        group = self._group(self.rank, src)
        if self.backend != "nccl" or group is not self._group(self.rank, dst):
            return super()._post_exchange(send, dst, recv, src, tag)
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, recv, self.members[src], group=group, tag=tag),
                                        dist.P2POp(dist.isend, send, self.members[dst], group=group, tag=tag)])
        # NCCL coalesces a batch into one request; other backends return one per operation.
        return works[0], works[-1]

    def _timed_out(self, what: str):
        if self.polls:
            # A communicator with an operation that will never complete blocks its own destruction: abort them all,
            # so that the rank exits with its one line instead of hanging on the way out.
            dist.distributed_c10d._abort_process_group()
        super()._timed_out(what)


class MpiTransport(Transport):
    """mpi4py on host buffers: Isend/Irecv for the chain and the ring, Allgather for the gathers."""

    name = "mpi"
    polls = True  # MPI has no timed wait; the chain's waits are milliseconds to seconds

    def __init__(self, rank: int, world_size: int, timeout_s: float = 60.0, allgather: str = "auto",
                 tp: int = 1) -> None:
        super().__init__(rank, world_size, timeout_s, allgather)
        self.MPI = import_mpi()
        self.comm = self.MPI.COMM_WORLD
        if self.comm.Get_size() != world_size * tp:
            raise RuntimeError("--transport mpi needs the ranks to be started by mpirun")
        if tp > 1:  # this rank's lane (mesh.py): the same TP rank of every group, ranked by group
            me = self.comm.Get_rank()
            self.comm = self.comm.Split(color=me % tp, key=me // tp)

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

    def is_completed(self) -> bool:
        return self.req.Test()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.req.Wait()
        return True


class LocalTransport(Transport):
    """One process: nothing to send."""

    name = "local"

    def __init__(self) -> None:
        super().__init__(0, 1)

    def _all_gather(self, out, inp):
        out.copy_(inp)


def make_transport(name: str, rank: int, world_size: int, backend: str, timeout_s: float = 60.0,
                   allgather: str = "auto", device: torch.device | None = None, tp: int = 1,
                   tp_rank: int = 0) -> Transport:
    """The chain's transport; with ``tp`` > 1, ``rank`` and ``world_size`` count TP groups and the transport
    joins this rank's lane (mesh.py)."""
    if world_size == 1:
        return LocalTransport()
    if name == "torch":
        lanes = [[g * tp + t for g in range(world_size)] for t in range(tp)]
        return TorchTransport(rank, world_size, backend, timeout_s, allgather, device, lanes, tp_rank)
    if name == "mpi":
        return MpiTransport(rank, world_size, timeout_s, allgather, tp)
    raise ValueError(f"unknown transport {name!r}: use one of {', '.join(TRANSPORTS)}")
