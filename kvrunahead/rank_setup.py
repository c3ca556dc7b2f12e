"""A rank's set-up, written once for every way into the ranks (the serving engine, the runner, kvr-ask, a packed
batch): device, dtype, threads, the model (kept loaded across runs of one process), its KV layout, the transport."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrunahead.config import RunConfig
from kvrunahead.launcher import World, pick_backend
from kvrunahead.model.compiled import COMPILE_WAIT_S, compile_model
from kvrunahead.model.device import config_dtype, default_threads, resolve_device, resolve_dtype
from kvrunahead.model.layout import KVLayout, probe_kv_layout
from kvrunahead.model.load import LoadedModel, load_model, resolve_config
from kvrunahead.model.rope import RopeExtension
from kvrunahead.model.stage import StageSpec
from kvrunahead.transport import Transport, make_transport

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

    def load(self, cfg: RunConfig, rope: RopeExtension | None) -> LoadedModel:
        """The same model with another RoPE extension (loaded once per extension)."""
        return loaded_model(cfg.model, self.dtype, self.device, cfg.seed, rope, compiled=cfg.compile)


def set_up_rank(cfg: RunConfig, world: World, rope: RopeExtension | None = None,
                stage: StageSpec | None = None) -> RankSetup:
    """``stage``: this rank's pipeline stage (spp), whose layers alone it loads."""
    device = resolve_device(cfg.device, world.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    own = config_dtype(resolve_config(cfg.model)) if cfg.dtype == "auto" and device.type == "cuda" else None
    dtype = resolve_dtype(cfg, device, own)
    threads = cfg.threads or default_threads(world.local_world_size)
    torch.set_num_threads(threads)
    lm = loaded_model(cfg.model, dtype, device, cfg.seed, rope, stage, compiled=cfg.compile)
    # a compiled peer's first call of a shape family compiles (minutes on a CPU): its successor waits that long
    timeout_s = max(cfg.timeout_s, COMPILE_WAIT_S) if cfg.compile else cfg.timeout_s
    transport = cached_transport(cfg.transport, world.rank, world.world_size, device, timeout_s, cfg.allgather)
    return RankSetup(device, dtype, threads, lm, probe_kv_layout(lm.model), transport)


def loaded_model(name: str, dtype: torch.dtype, device: torch.device, seed: int,
                 rope: RopeExtension | None = None, stage: StageSpec | None = None,
                 compiled: bool = False) -> LoadedModel:
    """Models stay loaded across runs of one process (benchmarks, test harnesses); ``compiled``: its decoder stack
    through torch.compile (model/compiled.py), warmed up here, before anything is timed."""
    key = (name, dtype, str(device), seed, rope, stage, compiled)
    if key not in _MODELS:
        _MODELS.clear()
        _MODELS[key] = load_model(name, dtype, device, seed=seed, rope=rope, stage=stage)
        if compiled:
            compile_model(_MODELS[key].model)
    return _MODELS[key]


def cached_transport(name: str, rank: int, world_size: int, device: torch.device, timeout_s: float,
                     allgather: str) -> Transport:
    """One transport (and its process groups and communicators, made here, before anything is timed) per process
    and kind, reused across runs."""
    backend = pick_backend(device)
    key = (name, rank, world_size, backend)
    if key not in _TRANSPORTS:
        _TRANSPORTS[key] = make_transport(name, rank, world_size, backend, timeout_s, allgather, device)
    transport = _TRANSPORTS[key]
    transport.timeout_s = timeout_s
    transport.set_allgather(allgather)
    return transport


def forget_transports() -> None:
    """Drop the cached transports (their pair groups die with the world that made them)."""
    _TRANSPORTS.clear()
