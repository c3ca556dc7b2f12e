"""A rank's set-up, written once for every way into the ranks (the serving engine, the runner, kvr-ask, a packed
batch): device, dtype, threads, the model (kept loaded across runs of one process), its KV layout, the transport."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvrunahead.config import RunConfig
from kvrunahead.model.compiled import COMPILE_WAIT_S, compile_model
from kvrunahead.model.device import (
    config_dtype,
    default_threads,
    resident_bytes,
    resolve_device,
    resolve_dtype,
    weight_bytes,
)
from kvrunahead.model.layout import KVLayout, probe_kv_layout
from kvrunahead.model.linears import packed_bytes
from kvrunahead.model.load import LoadedModel, load_model, resolve_config
from kvrunahead.model.rope import RopeExtension
from kvrunahead.model.stage import StageSpec
from kvrunahead.model.tp import TpSpec
from kvrunahead.net import liveness
from kvrunahead.net.spec import parse_net
from kvrunahead.ranks.launcher import World, init_world, pick_backend
from kvrunahead.ranks.mesh import TpCollective, forget_collectives, tp_collective
from kvrunahead.ranks.recovery import RecoveryDir, generation
from kvrunahead.ranks.stats import LOADS
from kvrunahead.ranks.transport import Transport, make_transport

_MODELS: dict = {}
_TRANSPORTS: dict = {}


@dataclass
class RankSetup:
    """What a rank works with, set up once for every way into the ranks (the engine, the runner, kvr-ask, a packed
    batch): its device, dtype and threads, the model (with the RoPE extension asked), its KV layout and the
    transport to its peers."""

    device: torch.device
    dtype: torch.dtype
    threads: int
    lm: LoadedModel
    layout: KVLayout
    transport: Transport

    tp: TpSpec | None = None  # this rank's tensor-parallel shard (model/tp.py); None: the whole model
    collective: TpCollective | None = None

    def load(self, cfg: RunConfig, rope: RopeExtension | None) -> LoadedModel:
        """The same model (this rank's shard of it) with another RoPE extension (loaded once per extension)."""
        return loaded_model(cfg.model, self.dtype, self.device, cfg.seed, rope, compiled=cfg.compile, tp=self.tp,
                            collective=self.collective)

    def whole(self, cfg: RunConfig, rope: RopeExtension | None) -> LoadedModel:
        """The whole model on this rank alone (a TP rank's report: its text and ``--verify``), after the timing."""
        return loaded_model(cfg.model, self.dtype, self.device, cfg.seed, rope)


def _basics(cfg: RunConfig, world: World) -> tuple[torch.device, torch.dtype, int]:
    """This rank's device, dtype and threads (the threads set)."""
    device = resolve_device(cfg.device, world.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    own = config_dtype(resolve_config(cfg.model)) if cfg.dtype == "auto" and device.type == "cuda" else None
    dtype = resolve_dtype(cfg, device, own)
    threads = cfg.threads or default_threads(world.host_ranks)
    torch.set_num_threads(threads)
    return device, dtype, threads


def _transport_timeout(cfg: RunConfig) -> float:
    """A compiled peer's first call of a shape family compiles (minutes on a CPU): its successor waits that long."""
    return max(cfg.timeout_s, COMPILE_WAIT_S) if cfg.compile else cfg.timeout_s


def preload(cfg: RunConfig, world: World) -> None:
    """Load the whole model as ``set_up_rank`` will (kept loaded), before the rank joins its world: a worker
    started to replace a lost one (ranks/recovery.py) is ready before the front, which serves meanwhile, waits
    on it. Whole-model ranks only (no TP shard, no stage)."""
    device, dtype, _ = _basics(cfg, world)
    loaded_model(cfg.model, dtype, device, cfg.seed, compiled=cfg.compile)


def ready_before_joining(cfg: RunConfig, launcher: str) -> None:
    """A worker started in a lost one's place (ranks/recovery.py) loads the model before it joins, and says so:
    the front, which serves meanwhile, joins only a generation whose every worker is ready. Nothing for the first
    generation, or outside a launcher that brings workers back."""
    folder, gen = RecoveryDir.from_env(), generation()
    if folder is None or gen == 0:
        return
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    preload(cfg, World(rank, size, int(os.environ.get("LOCAL_RANK", rank)),
                       int(os.environ.get("LOCAL_WORLD_SIZE", size)), launcher))
    folder.say_ready(gen, rank)


def rejoin(cfg: RunConfig, world: World, setup: RankSetup, port: int) -> Transport:
    """The front meets a new generation of workers on rendezvous ``port`` (their ranks, world size and address
    as before): the old process group dropped (its peers are dead: nothing waits on them), a new one made and
    the transport made again in the order the workers make theirs (``set_up_rank``); the model, the caches and
    the requests stay. Whole-model ranks only."""
    liveness.forget()
    if dist.is_initialized():
        dist.destroy_process_group()
    forget_transports()
    os.environ["MASTER_PORT"] = str(port)
    init_world(world.launcher, pick_backend(setup.device), cfg.timeout_s, setup.device)
    setup.transport = cached_transport(cfg.transport, world, setup.device, _transport_timeout(cfg), cfg.allgather)
    return setup.transport


def set_up_rank(cfg: RunConfig, world: World, rope: RopeExtension | None = None,
                stage: StageSpec | None = None) -> RankSetup:
    """``stage``: this rank's pipeline stage (spp), whose layers alone it loads."""
    device, dtype, threads = _basics(cfg, world)
    tp = TpSpec(world.tp_rank, world.tp) if world.tp > 1 else None
    # shared memory between TP ranks on one real host (not emulated hosts, whose capped links TP must cross)
    shared = world.tp_local and not parse_net(cfg.net).emulated
    collective = tp_collective(cfg.transport, world, device, shared, cfg.timeout_s) if tp else None
    lm = loaded_model(cfg.model, dtype, device, cfg.seed, rope, stage, compiled=cfg.compile, tp=tp,
                      collective=collective)
    transport = cached_transport(cfg.transport, world, device, _transport_timeout(cfg), cfg.allgather)
    return RankSetup(device, dtype, threads, lm, probe_kv_layout(lm.model), transport, tp, collective)


def loaded_model(name: str, dtype: torch.dtype, device: torch.device, seed: int,
                 rope: RopeExtension | None = None, stage: StageSpec | None = None,
                 compiled: bool = False, tp: TpSpec | None = None, collective: TpCollective | None = None
                 ) -> LoadedModel:
    """Models stay loaded across runs of one process (benchmarks, test harnesses); ``compiled``: its decoder stack
    through torch.compile (model/compiled.py), warmed up here, before anything is timed."""
    key = (name, dtype, str(device), seed, rope, stage, compiled, tp)
    if key not in _MODELS:
        _MODELS.clear()
        if LOADS["before"] is None:
            LOADS["before"] = resident_bytes()
        _MODELS[key] = load_model(name, dtype, device, seed=seed, rope=rope, stage=stage, tp=tp,
                                  collective=collective)
        if weight_bytes(_MODELS[key].model) > LOADS["weights"]:
            LOADS.update(weights=weight_bytes(_MODELS[key].model), packed=packed_bytes(_MODELS[key].model))
        if compiled:
            compile_model(_MODELS[key].model)
    return _MODELS[key]


def cached_transport(name: str, world: World, device: torch.device, timeout_s: float, allgather: str) -> Transport:
    """One transport (and its process groups and communicators, made here, before anything is timed) per process
    and kind, reused across runs; with TP, over the chain of TP groups (this rank's lane, mesh.py)."""
    backend = pick_backend(device)
    key = (name, world.rank, world.world_size, backend, world.tp)
    if key not in _TRANSPORTS:
        _TRANSPORTS[key] = make_transport(name, world.rank, world.world_size, backend, timeout_s, allgather, device,
                                          world.tp, world.tp_rank)
    transport = _TRANSPORTS[key]
    transport.timeout_s = timeout_s
    transport.set_allgather(allgather)
    return transport


def forget_transports() -> None:
    """Drop the cached transports and TP collectives (their groups die with the world that made them)."""
    _TRANSPORTS.clear()
    forget_collectives()
