"""The 2D world of ``--nproc P --tp N``: P/N tensor-parallel groups of N ranks, chained by KV-Runahead.

Global rank ``g * N + t`` is TP rank ``t`` of group ``g``. A group's N ranks each hold 1/N of every layer's heads
and MLP (model/tp.py) and all-reduce twice per layer (``TpCollective``); TP rank ``t`` of group ``g`` hands its
heads' K,V to TP rank ``t`` of group ``g + 1`` (a *lane*: the chain of every group's ``t``-th rank). Everything
above the ranks (partitions, the engine's plans) sees the chain of groups: ``chain_world`` is the world it runs on.

The all-reduce goes where it is fastest: MPI's where the ranks run on MPI (shared memory between local ranks, 4-5 us
for 2 KB on a 2-vCPU host against gloo's 0.3-0.4 ms: experiments/tp_collective); between CPU ranks of one host a
shared-memory all-reduce of our own (``ShmCollective``: ranks started by torchrun or ``--nproc`` have no MPI); else
torch.distributed's on the ``tp`` dimension of a ``DeviceMesh`` (NCCL on GPUs, gloo across hosts).
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from kvrunahead.errors import PeerTimeout
from kvrunahead.ranks.launcher import World
from kvrunahead.ranks.transport import import_mpi


def chain_world(world: World, tp: int) -> World:
    """The world of TP groups a global ``world`` forms at degree ``tp`` (``world`` itself at 1)."""
    if tp == 1:
        return world
    if world.world_size % tp:
        raise ValueError(f"--tp {tp} does not divide the {world.world_size} ranks")
    return dataclasses.replace(world, rank=world.rank // tp, world_size=world.world_size // tp,
                               local_world_size=max(1, world.local_world_size // tp), tp=tp,
                               tp_rank=world.rank % tp, tp_local=world.local_world_size % tp == 0)


class TpCollective:
    """The sum of a tensor over this rank's TP group, in place (every member ends with the same values)."""

    name = "none"
    size = 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t


class MpiCollective(TpCollective):
    """MPI's all-reduce on a communicator of the group (``COMM_WORLD`` split by group). MPI sums no bfloat16 or
    float16: those are summed in float32 and rounded once."""

    name = "mpi"

    def __init__(self, world: World) -> None:
        self.MPI = import_mpi()
        self.comm = self.MPI.COMM_WORLD.Split(color=world.rank, key=world.tp_rank)
        self.size = world.tp

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu":
            self.comm.Allreduce(self.MPI.IN_PLACE, [t.numpy(), self.MPI.FLOAT])
            return t
        wide = t.detach().to("cpu", torch.float32).contiguous()
        self.comm.Allreduce(self.MPI.IN_PLACE, [wide.numpy(), self.MPI.FLOAT])
        t.copy_(wide)
        return t


def shared_file(path: Path, nbytes: int, creates: bool, maps: bool, what: str) -> torch.Tensor | None:
    """``nbytes`` of memory shared through ``path``, made by every rank of the world together (it meets them twice):
    the rank that ``creates`` it makes the file, those that ``maps`` it map it, and the file is gone once they
    have (the memory lives until the last one lets go). Returns the bytes where this rank maps them, else None."""
    from kvrunahead.net import liveness

    if creates:
        with open(path, "wb") as f:
            f.truncate(nbytes)
    liveness.patient_barrier(what)
    buf = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8) if maps else None
    liveness.patient_barrier(what)
    if creates:
        path.unlink()
    return buf


class ShmCollective(TpCollective):
    """The all-reduce of a TP group whose ranks share one host's memory, through a file in /dev/shm: each rank
    copies its tensor into its slot, raises its flag to the call's number, waits for every flag, and sums the slots
    in rank order (so every rank ends with the same bits; half precisions summed in float32 and rounded once). Two
    sets of slots alternate, so a rank that runs ahead writes the set nobody reads any more; a tensor larger than a
    slot goes through in slot-sized pieces. The wait spins (microseconds matter: a SmolLM2 decode token makes 60
    all-reduces of 2 KB) and gives up after ``timeout_s`` without a peer's flag. On one host this is what MPI's and
    vLLM CPU's shared-memory all-reduces do; gloo's takes 0.3-0.4 ms for 2 KB (experiments/tp_collective)."""

    name = "shm"
    SLOT_BYTES = 8 << 20
    LINE = 64  # one cache line per rank's flag

    def __init__(self, world: World, key: str, timeout_s: float) -> None:
        self.size, self.me, self.timeout_s = world.tp, world.tp_rank, timeout_s
        self.buf = shared_file(Path("/dev/shm") / f"kvrunahead-tp-{key}-{world.rank}",
                               self.LINE * self.size + 2 * self.size * self.SLOT_BYTES, self.me == 0, True,
                               "the TP group's shared memory")
        self.flags = self.buf[:self.LINE * self.size].view(torch.int64).view(self.size, self.LINE // 8)[:, 0]
        self.flags[self.me] = 0
        self.peek = self.flags.numpy()  # the flags as numpy reads them: a microsecond a look, not a torch op's ten
        self.data = self.buf[self.LINE * self.size:]
        self.calls = 0
        self._views: dict = {}

    def _slots(self, dtype: torch.dtype, n: int) -> list[torch.Tensor]:
        """Every rank's slot of this call's set, as ``n`` values of ``dtype`` (made once per shape: a decode
        step's 60 calls reuse them)."""
        key = (self.calls % 2, dtype, n)
        if key not in self._views:
            item = torch.empty((), dtype=dtype).element_size()
            base = (self.calls % 2) * self.size * self.SLOT_BYTES
            self._views[key] = [self.data[base + r * self.SLOT_BYTES:base + r * self.SLOT_BYTES + n * item]
                                .view(dtype) for r in range(self.size)]
        return self._views[key]

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        flat = t.view(-1)
        per = self.SLOT_BYTES // t.element_size()
        for a in range(0, flat.numel(), per):
            piece = flat[a:a + per]
            self.calls += 1
            slots = self._slots(t.dtype, piece.numel())
            slots[self.me].copy_(piece)
            self.peek[self.me] = self.calls  # after the copy: stores reach the other cores in order (x86)
            self._wait()
            if t.dtype in (torch.bfloat16, torch.float16):
                total = slots[0].float()
                for slot in slots[1:]:
                    total += slot.float()
                piece.copy_(total)
            else:
                torch.add(slots[0], slots[1], out=piece)
                for slot in slots[2:]:
                    piece.add_(slot)
        return t

    def _wait(self) -> None:
        spins, start = 0, None
        while self.peek.min() < self.calls:
            spins += 1
            if spins % 4096 == 0:
                start = start or time.monotonic()
                if time.monotonic() - start > self.timeout_s:
                    raise PeerTimeout(f"TP rank {self.me}: no all-reduce from the rest of its group for "
                                      f"{self.timeout_s:.0f} s (a peer stopped, died or fell behind)")


class ShmMailbox:
    """Bytes from TP rank 0 of a group to the group's other ranks, through a file in /dev/shm: the writer waits
    until every reader has taken the last piece (its ack), copies the next one in, then raises the piece's number;
    a reader spins on that number for ``spin_s`` (a TP decode's next plan comes within milliseconds), then polls as
    long as its peers are alive (net/liveness.py), copies the piece out and acks it. A message larger than a
    piece goes through in pieces. What a serving TP group's front tells its peers every step (its plan) travels
    here rather than through a gloo broadcast (two collectives a step, and a reader's sleeping poll)."""

    PIECE_BYTES = 1 << 20
    LINE = 64

    def __init__(self, buf: torch.Tensor, size: int, me: int, spin_s: float) -> None:
        self.buf, self.size, self.me, self.spin_s = buf, size, me, spin_s
        lines = buf[:self.LINE * (1 + size)].view(torch.int64).view(1 + size, self.LINE // 8)
        self.head = lines[0].numpy()  # [piece number, its bytes, the message's bytes]
        self.acks = lines[1:, 0].numpy()  # each reader's last piece taken
        self.data = buf[self.LINE * (1 + size):].numpy()
        self.pieces = 0

    @classmethod
    def of_group(cls, world: World, group: int, key: str, spin_s: float = 0.05) -> ShmMailbox | None:
        """The mailbox of TP group ``group`` on its members (None elsewhere); made by every rank of the world
        together (it meets them twice)."""
        member = world.rank == group
        buf = shared_file(Path("/dev/shm") / f"kvrunahead-plans-{key}-{group}",
                          cls.LINE * (1 + world.tp) + cls.PIECE_BYTES, member and world.tp_rank == 0, member,
                          "the TP group's plan mailbox")
        return cls(buf, world.tp, world.tp_rank, spin_s) if member else None

    def send(self, payload: bytes) -> None:
        from kvrunahead.net import liveness

        for a in range(0, max(len(payload), 1), self.PIECE_BYTES):
            piece = payload[a:a + self.PIECE_BYTES]
            if self.acks[1:].min() < self.pieces:
                liveness.wait_until(lambda: self.acks[1:].min() >= self.pieces, "the TP peers to take the plan")
            self.data[:len(piece)] = np.frombuffer(piece, dtype=np.uint8)
            self.head[1], self.head[2] = len(piece), len(payload)
            self.pieces += 1
            self.head[0] = self.pieces  # after the data and sizes: stores reach the other cores in order (x86)

    def recv(self, what: str) -> bytes:
        out, total = bytearray(), None
        while total is None or len(out) < total:
            self._wait(what)
            n, total = int(self.head[1]), int(self.head[2])
            out += self.data[:n].tobytes()
            self.pieces += 1
            self.acks[self.me] = self.pieces
        return bytes(out)

    def _wait(self, what: str) -> None:
        from kvrunahead.net import liveness

        ready = lambda: self.head[0] > self.pieces  # noqa: E731
        deadline = time.monotonic() + self.spin_s
        while not ready():
            if time.monotonic() > deadline:
                liveness.wait_until(ready, what)
                return


class TorchCollective(TpCollective):
    """torch.distributed's all-reduce on the ``tp`` dimension of the world's ``DeviceMesh`` (chain x tp)."""

    name = "torch"

    def __init__(self, world: World, device: torch.device) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world.world_size, world.tp), mesh_dim_names=("chain", "tp"))
        self.group = mesh.get_group("tp")
        self.size = world.tp

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t


_COLLECTIVES: dict = {}


def tp_collective(transport: str, world: World, device: torch.device, shared_memory: bool,
                  timeout_s: float = 60.0) -> TpCollective:
    """This process's TP collective (made once, before anything is timed): MPI's where the ranks run on MPI, else
    shared memory where ``shared_memory`` (CPU ranks of one real host: not across emulated hosts, whose links the
    collective must cross), else torch.distributed's."""
    if world.tp == 1:
        return TpCollective()
    key = (transport, world, str(device), shared_memory)
    if key not in _COLLECTIVES:
        if transport == "mpi":
            _COLLECTIVES[key] = MpiCollective(world)
        elif shared_memory and device.type == "cpu":
            _COLLECTIVES[key] = ShmCollective(world, os.environ.get("MASTER_PORT", str(os.getppid())), timeout_s)
        else:
            _COLLECTIVES[key] = TorchCollective(world, device)
    return _COLLECTIVES[key]


def collective_in_use() -> str | None:
    """The name of the TP collective this process made (shm, mpi or torch), or None without TP."""
    return next((c.name for c in _COLLECTIVES.values()), None)


def forget_collectives() -> None:
    _COLLECTIVES.clear()
