"""Where the ranks come from: torchrun (env), mpirun (mpi4py), or ``--nproc N`` (spawned here)."""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvrunahead.net import liveness
from kvrunahead.net.session import network
from kvrunahead.net.spec import NetSpec
from kvrunahead.ranks.fork import ForkedRank, can_fork, fork_rank
from kvrunahead.ranks.recovery import DIR_ENV, GENERATION_ENV, RecoveryDir
from kvrunahead.ranks.supervise import supervise, supervise_recovering
from kvrunahead.ranks.transport import import_mpi

log = logging.getLogger(__name__)

MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str  # "single", "torchrun", "mpi" or "spawn"
    tp: int = 1  # tensor-parallel degree: ``rank`` and ``world_size`` count TP groups (the chain's links) when > 1
    tp_rank: int = 0  # this process's place in its TP group
    tp_local: bool = True  # every TP group's ranks on one host (the hosts' local ranks come in whole groups)

    @property
    def host_ranks(self) -> int:
        """Processes on this host (every TP rank of every local group): what shares its cores."""
        return self.local_world_size * self.tp

    @property
    def global_rank(self) -> int:
        return self.rank * self.tp + self.tp_rank


def detect_launcher() -> str:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return "spawn" if os.environ.get("KVRUNAHEAD_SPAWNED") else "torchrun"
    if any(k in os.environ for k in MPI_ENV):
        return "mpi"
    return "single"


def local_rank_hint() -> int:
    """This process's index on its node, before the process group exists (selects the GPU)."""
    for key in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


def world_size_hint(launcher: str, nproc: int) -> int:
    """The world size the launcher will give, known before joining (inputs are checked against it)."""
    if launcher in ("torchrun", "spawn"):
        return int(os.environ["WORLD_SIZE"])
    if launcher == "mpi":
        return import_mpi().COMM_WORLD.Get_size()
    return nproc


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_world(launcher: str, backend: str, timeout_s: float, device: torch.device | None = None) -> World:
    """Join the process group (no-op for a single process). With NCCL, ``device`` (this rank's GPU) binds the group
    to it, which makes its communicator at once rather than inside the first timed operation."""
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)  # before any NCCL call: a batched send/receive on another device hangs
    if launcher == "single":
        return World(0, 1, 0, 1, "single")
    if launcher == "mpi":
        MPI = import_mpi()
        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        local_rank, local_size = local.Get_rank(), local.Get_size()
        if rank == 0:
            addr = os.environ.get("MASTER_ADDR") or (
                "127.0.0.1" if local_size == size else socket.gethostbyname(socket.gethostname())
            )
            port = int(os.environ.get("MASTER_PORT") or free_port())
        else:
            addr = port = None
        addr, port = comm.bcast((addr, port), root=0)
    else:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend=backend,
        **rendezvous(addr, port, rank, size, timeout),
        rank=rank,
        world_size=size,
        timeout=timeout,
        device_id=device if backend == "nccl" else None,
    )
    # Every world beats: the waits for another rank's whole prefill are bounded by the heartbeats (net/liveness.py).
    liveness.start_heartbeat(timeout_s)
    return World(rank, size, local_rank, local_size, launcher)


def rendezvous(addr: str, port: int, rank: int, size: int, timeout: datetime.timedelta) -> dict:
    """How to meet: a store listening on ``addr`` only (torch's own listens on every interface), whose socket rank 0
    binds and hands over. Under torchrun the agent's store (on the agent's address) is joined as torch does."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return {"init_method": "env://"}
    if rank != 0:
        return {"store": dist.TCPStore(addr, port, size, False, timeout)}
    family, kind, proto, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(where)
    listener.listen(256)
    return {"store": dist.TCPStore(addr, port, size, True, timeout, wait_for_workers=False,
                                   master_listen_fd=listener.detach())}


def leave_world() -> None:
    """Stop the heartbeat and destroy every process group: a rank that exits with gloo's threads (or the heartbeat
    on the store) still running can abort ("terminate called without an active exception")."""
    liveness.forget()
    if dist.is_initialized():
        dist.destroy_process_group()


def pick_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_env(rank: int, world_size: int, port: int, addr: str = "127.0.0.1", **extra: str) -> dict[str, str]:
    """The environment torchrun gives a local rank (rendezvous on ``addr``:``port``), plus ``extra``; on loopback
    gloo's own sockets stay on ``lo`` too."""
    env = dict(os.environ)
    if addr.startswith("127."):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
               MASTER_ADDR=addr, MASTER_PORT=str(port), **extra)
    return env


def spawn(nproc: int, argv: list[str], grace_s: float = 5.0, module: str = "kvrunahead.cli.prefill", net=None,
          front: int | None = None, fork: bool = False) -> int:
    """Start ``nproc`` local ranks running this same command; return the first non-zero exit code.

    ``net`` (a ``NetSpec``) with a cap puts every rank on an emulated host of its own, and with noise runs the
    sidecar beside them; both are removed when the ranks end, however they end. ``front``: the rank of a server
    that outlives its workers (ranks/recovery.py): a worker's loss starts its generation of workers again, on the
    same hosts, and only the front's end ends the job. ``fork``: this process is the tool the ranks run (its
    imports done), so a rank on this host is forked from it where that is safe (ranks/fork.py).
    """
    with network(net or NetSpec(), nproc) as hosts, tempfile.TemporaryDirectory(prefix="kvr-recovery-") as folder:
        def start(rank: int, port: int, gen: int) -> subprocess.Popen | ForkedRank:
            extra = dict(KVRUNAHEAD_SPAWNED="1", **hosts.env)
            if front is not None:
                extra.update({DIR_ENV: folder, GENERATION_ENV: str(gen)})
            env = rank_env(rank, nproc, port, hosts.master_addr, **extra)
            prefix = hosts.prefix(rank)
            if fork and not prefix and can_fork():
                return fork_rank(module, argv, env, _dies_with(os.getpid()))
            return subprocess.Popen(prefix + [sys.executable, "-m", module, *argv], env=env,
                                    preexec_fn=_dies_with(os.getpid()))

        port = free_port()
        procs = [start(rank, port, 0) for rank in range(nproc)]
        if front is None:
            code = supervise(procs, grace_s)
        else:
            def again(gen: int) -> tuple[list[subprocess.Popen], int]:
                port = free_port()
                return [start(rank, port, gen) for rank in range(nproc) if rank != front], port

            code = supervise_recovering(procs, front, RecoveryDir(folder), grace_s=grace_s, start=again)
        if hosts.noise is not None:
            report = hosts.noise.stop()
            if report is not None:
                log.warning("%s", report.describe())
        return code


def _dies_with(launcher: int):
    """What a rank runs before its command: it is killed when the launcher dies, however it dies (Linux's
    parent-death signal), so that no rank outlives the launcher that would have ended it; a launcher already gone
    by then ends it at once."""
    def arm() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != launcher:
            os._exit(1)
    return arm


PR_SET_PDEATHSIG = 1


def spawn_restarting(nproc: int, argv: list[str], restarts: int, grace_s: float, module: str, net=None,
                     front: int | None = None, fork: bool = False) -> int:
    """``spawn`` the ranks; while they end with an error and restarts are left, spawn them again (every rank, the
    same command without ``--restarts``). Returns the last exit code (0 after a drain; an interrupt is never
    restarted). ``front``: as ``spawn``'s (a lost worker's generation is started again within one spawn)."""
    argv = _without_restarts(argv)
    code = 0
    for attempt in range(restarts + 1):
        code = spawn(nproc, argv, grace_s=grace_s, module=module, net=net, front=front, fork=fork)
        if code in (0, 130) or attempt == restarts:
            return code
        log.warning("the server ended with exit code %d; starting it again (%d of %d restarts)", code, attempt + 1,
                    restarts)
        time.sleep(1.0)
    return code


def _without_restarts(argv: list[str]) -> list[str]:
    """The command line for the ranks, without --restarts (a rank never restarts anything)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--restarts":
            skip = True
        elif not arg.startswith("--restarts="):
            out.append(arg)
    return out
