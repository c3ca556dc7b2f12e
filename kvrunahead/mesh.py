"""The 2D world of ``--nproc P --tp N``: P/N tensor-parallel groups of N ranks, chained by KV-Runahead.

Global rank ``g * N + t`` is TP rank ``t`` of group ``g``. A group's N ranks each hold 1/N of every layer's heads
and MLP (model/tp.py) and all-reduce twice per layer (``TpCollective``); TP rank ``t`` of group ``g`` hands its
heads' K,V to TP rank ``t`` of group ``g + 1`` (a *lane*: the chain of every group's ``t``-th rank). Everything
above the ranks (partitions, the engine's plans) sees the chain of groups: ``chain_world`` is the world it runs on.

The all-reduce goes where it is fastest on the ranks' transport: MPI's (shared memory between local ranks, 4-5 us
for 2 KB on a 2-vCPU host against gloo's 0.3-0.4 ms: experiments/tp_collective), else torch.distributed's on the
``tp`` dimension of a ``DeviceMesh`` (NCCL on GPUs, gloo on CPUs).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from kvrunahead.launcher import World
from kvrunahead.transport import import_mpi


def chain_world(world: World, tp: int) -> World:
    """The world of TP groups a global ``world`` forms at degree ``tp`` (``world`` itself at 1)."""
    if tp == 1:
        return world
    if world.world_size % tp:
        raise ValueError(f"--tp {tp} does not divide the {world.world_size} ranks")
    return dataclasses.replace(world, rank=world.rank // tp, world_size=world.world_size // tp,
                               local_world_size=max(1, world.local_world_size // tp), tp=tp,
                               tp_rank=world.rank % tp)


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


def tp_collective(transport: str, world: World, device: torch.device) -> TpCollective:
    """This process's TP collective (made once, before anything is timed): MPI's where the ranks run on MPI, else
    torch.distributed's."""
    if world.tp == 1:
        return TpCollective()
    key = (transport, world, str(device))
    if key not in _COLLECTIVES:
        _COLLECTIVES[key] = MpiCollective(world) if transport == "mpi" else TorchCollective(world, device)
    return _COLLECTIVES[key]


def forget_collectives() -> None:
    _COLLECTIVES.clear()
