"""One prefill run on this rank: load, partition, time, gather, decode, verify."""

from __future__ import annotations

import logging
import os
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import DynamicCache

from kvrunahead.launcher import World, init_world, local_rank_hint, pick_backend
from kvrunahead.models import (
    LoadedModel,
    ModelError,
    load_model,
    load_tokenizer,
    resolve_config,
    uses_attention_interface,
)
from kvrunahead.modes import MODES, Step, check_model
from kvrunahead.net import liveness
from kvrunahead.net.spec import NetError, NetSpec, parse_net
from kvrunahead.partition import Partition, PartitionError, check_fits, parse_partition
from kvrunahead.prompt import PromptError, build_prompt
from kvrunahead.rope import ContextError, RopeExtension, plan_extension
from kvrunahead.runahead import greedy_decode, last_token_logits, layer_windows, probe_kv_layout, soft_caps
from kvrunahead.sim.flops import estimated_partition
from kvrunahead.tables import Lookup, Table, TableError, TableKey, config_hash, find_table
from kvrunahead.transport import ALLGATHERS, TRANSPORTS, KVLayout, Transport, make_transport

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class InputError(ValueError):
    """Bad user input, reported as one line before any rank starts working."""


@dataclass
class RunConfig:
    model: str = "smollm2-135m"
    mode: str = "kvr"
    transport: str = "torch"
    context_len: int | None = 2048
    prompt_text: str | None = None
    chat: bool = True
    partition: str = "auto"  # a matching table, else the cost model; or even, boundaries, ratios, table
    kvr_attention: str = "auto"  # split where the model uses the attention interface, else masked
    table: str | None = None
    force_table: bool = False
    dtype: str | None = None  # float32 on CPU, bfloat16 on GPU
    device: str = "auto"
    threads: int | None = None
    max_new_tokens: int = 1
    verify: bool = False
    atol: float | None = None
    timeout_s: float = 60.0
    allow_long_context: bool = False  # beyond the trained positions without a RoPE extension
    seed: int = 0
    net: str | None = None  # --net: "loopback", "cap=400MB/s", "cap=13MB/s,noise"; None: loopback for one host
    allgather: str = "auto"  # all-gather modes: the library's collective or a ring of point-to-point transfers


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


@dataclass
class Verification:
    single_ttft_s: float  # at the threads of one rank
    single_all_threads_ttft_s: float | None  # at the threads of all ranks together (what one process gets)
    single_all_threads: int
    max_abs_logit_diff: float
    atol: float
    first_token_match: bool
    generated_match: bool
    reference_tokens: list[int]

    @property
    def ok(self) -> bool:
        return self.first_token_match and self.generated_match and self.max_abs_logit_diff <= self.atol


@dataclass
class RunResult:
    model: str
    mode: str
    world_size: int
    launcher: str
    backend: str
    transport: str
    network: str  # the --net label ("loopback", "cap=400MB/s,noise"), "unlabelled" across hosts without one
    allgather: str | None  # tsp and cp-allgather: "native" (the library's collective) or "p2p" (a ring of sends)
    device: str
    dtype: str
    threads_per_rank: int
    oversubscribed: bool  # more busy threads on the node than cores: timings are not meaningful
    context_len: int
    rope_extension: str | None  # "RoPE extended by YaRN x2 beyond the 8192 trained positions"
    kvr_attention: str | None  # kvr modes: the attention that ran, and why
    sliding_layers: int  # layers with a sliding window (their chain hands on the window only)
    full_chain_bytes: int | None  # kvr with sliding layers: what the chain would send if every layer were full
    boundaries: list[int]
    partition_source: str
    partition_warning: str | None
    ratios: list[float]
    ttft_s: float
    ranks: list[RankStats]
    first_token: int
    first_token_text: str
    generated_tokens: list[int]
    generated_text: str
    verification: Verification | None = None
    logits: torch.Tensor | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("logits")
        if self.verification is not None:
            d["verification"]["ok"] = self.verification.ok
        return d


def resolve_device(spec: str, local_rank: int) -> torch.device:
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cuda":
        if not torch.cuda.is_available():
            raise InputError("--device cuda asked for but CUDA is not available")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_dtype(cfg: RunConfig, device: torch.device) -> torch.dtype:
    name = cfg.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if name not in DTYPES:
        raise InputError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def default_threads(local_world_size: int) -> int:
    if os.environ.get("OMP_NUM_THREADS"):
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, (os.cpu_count() or 1) // local_world_size)


@dataclass
class Prepared:
    ids: list[int]
    partition: Partition
    partition_source: str  # "even", "explicit", the table and entries, or the cost model (estimate) and why
    warning: str | None = None
    rope: RopeExtension | None = None
    kvr_attention: str = "masked"
    attention_source: str = ""


def _dtype_name(cfg: RunConfig) -> str:
    return cfg.dtype or ("bfloat16" if _device_kind(cfg) == "cuda" else "float32")


def _device_kind(cfg: RunConfig) -> str:
    return "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"


def network_spec(cfg: RunConfig) -> NetSpec:
    try:
        return parse_net(cfg.net)
    except NetError as e:
        raise InputError(str(e)) from None


def network_label(cfg: RunConfig, world_size: int, local_world_size: int, tables: bool = True) -> str:
    """The network a run's tables must have been searched on (``tables``: its cap, not its noise) or the run's whole
    setting: as given, else loopback when all ranks share a host."""
    if cfg.net:
        spec = network_spec(cfg)
        return spec.table_label if tables else spec.label
    return "loopback" if local_world_size == world_size else "unlabelled"


def resolve_attention(cfg: RunConfig, config) -> tuple[str, str]:
    """The kvr attention to run and why: split (the faster, exact) where the model's attention goes through
    transformers' attention interface, else masked."""
    fits = uses_attention_interface(config)
    softcap = soft_caps(config)
    if cfg.kvr_attention in (None, "auto"):
        if fits and softcap:
            return "masked", "default: the model soft-caps its attention logits, which split does not do"
        if fits:
            return "split", "default: the model uses transformers' attention interface"
        return "masked", "default: the model computes attention itself, so split cannot be inserted"
    if cfg.kvr_attention == "split" and not fits:
        raise InputError(f"--kvr-attention split needs a model whose attention goes through transformers' "
                         f"attention interface; {cfg.model} computes it itself: use masked")
    if cfg.kvr_attention not in ("masked", "split"):
        raise InputError(f"unknown --kvr-attention {cfg.kvr_attention!r}: use auto, masked or split")
    return cfg.kvr_attention, "as asked"


def table_key(cfg: RunConfig, config, world_size: int, attention: str, local_world_size: int) -> TableKey:
    return TableKey(cfg.model, config_hash(config), world_size, _dtype_name(cfg), attention, _device_kind(cfg),
                    network_label(cfg, world_size, local_world_size))


def _table_partition(cfg: RunConfig, key: TableKey, context_len: int) -> Lookup:
    path = Path(cfg.table) if cfg.table else find_table(key)
    table = Table.load(path)
    if not cfg.force_table:
        table.check(key, name=path.name)
    return table.lookup(context_len, name=path.name)


def _auto_partition(cfg: RunConfig, config, key: TableKey, context_len: int, attention: str,
                    threads: int) -> tuple[Partition, str]:
    """The table of this exact setting, interpolated, where it covers the context; else the cost model's
    partition on this machine's profile for the ranks' ``threads`` (CPU), else the FLOP estimate (never silently
    the even partition: the chain makes later ranks wait, so even is never the best)."""
    if key.world_size == 1:
        return Partition.even(context_len, 1), "one rank"
    try:
        path = find_table(key)
    except TableError:
        why = f"no partition table for {key.describe()}"
    else:
        table = Table.load(path)
        lo, hi = (table.entries[0].context_len, table.entries[-1].context_len) if table.entries else (0, -1)
        if lo <= context_len <= hi:
            lookup = table.lookup(context_len, name=path.name)
            return lookup.partition, lookup.source
        why = (f"{context_len} tokens is outside {path.name} ({lo}..{hi})" if table.entries
               else f"{path.name} has no entries")
    if key.device_kind == "cpu" and any(w is not None for w in layer_windows(config)):
        why = f"{why}; the cost model prices full-attention layers only"
    elif key.device_kind == "cpu":
        from kvrunahead.sim.optimize import predicted_partition
        from kvrunahead.sim.profile import ProfileError

        try:
            partition, source = predicted_partition(config, key.dtype, threads, context_len, key.world_size,
                                                     attention, key.bandwidth)
            return partition, f"{source} ({why})"
        except ProfileError as e:
            why = f"{why}; {e}"
    partition = estimated_partition(config, context_len, key.world_size, attention)
    return partition, f"cost estimate of the ranks' work ({why})"


def prepare(cfg: RunConfig, world_size: int, local_world_size: int | None = None) -> Prepared:
    """Validate the input and build the prompt and partition; raises InputError with one line."""
    if cfg.mode not in MODES:
        raise InputError(f"unknown mode {cfg.mode!r}: use one of {', '.join(MODES)}")
    if cfg.mode == "single" and world_size != 1:
        raise InputError(f"mode 'single' runs one process, but the world size is {world_size}")
    mode = MODES[cfg.mode]
    if mode.own_partition and (cfg.partition not in ("auto", "even") or cfg.table):
        raise InputError(f"mode {cfg.mode!r} sets its own layout; --partition and --table apply to kvr and "
                         "kvr-nocomm only")
    if cfg.transport not in TRANSPORTS:
        raise InputError(f"unknown transport {cfg.transport!r}: use one of {', '.join(TRANSPORTS)}")
    if cfg.allgather not in ALLGATHERS:
        raise InputError(f"unknown all-gather {cfg.allgather!r}: use one of {', '.join(ALLGATHERS)}")
    network_spec(cfg)
    if cfg.threads is not None and cfg.threads < 1:
        raise InputError(f"--threads must be at least 1, got {cfg.threads}")
    if cfg.prompt_text is not None and not cfg.prompt_text.strip():
        raise InputError("the prompt file is empty (or only whitespace)")
    try:
        config = resolve_config(cfg.model)
        ids = build_prompt(load_tokenizer(cfg.model), cfg.context_len, cfg.prompt_text, chat=cfg.chat)
        rope = plan_extension(config, len(ids), cfg.allow_long_context, cfg.model)
        attention, why = resolve_attention(cfg, config) if cfg.mode.startswith("kvr") else ("masked", "")
        check_model(cfg.mode, config, attention)
        done = {"rope": rope, "kvr_attention": attention, "attention_source": why}
        if mode.own_partition:
            return Prepared(ids, Partition.even(len(ids), world_size), "even", **done)
        local_world_size = local_world_size or world_size
        key = table_key(cfg, config, world_size, attention, local_world_size)
        if cfg.partition == "table" or cfg.table:
            lookup = _table_partition(cfg, key, len(ids))
            if lookup.partition.world_size != world_size:
                raise InputError(f"{lookup.source} has {lookup.partition.world_size} parts, world size is {world_size}")
            return Prepared(ids, lookup.partition, lookup.source, lookup.warning, **done)
        if cfg.partition.strip() == "auto":
            check_fits(len(ids), world_size)
            threads = cfg.threads or default_threads(local_world_size)  # what each rank will run with
            partition, source = _auto_partition(cfg, config, key, len(ids), attention, threads)
            return Prepared(ids, partition, source, **done)
        partition = parse_partition(cfg.partition, len(ids), world_size)
    except (ModelError, PromptError, PartitionError, TableError, ContextError) as e:
        raise InputError(str(e)) from None
    except NotImplementedError as e:
        raise InputError(f"mode {cfg.mode!r} cannot run {cfg.model}: {e}") from None
    return Prepared(ids, partition, "even" if cfg.partition.strip() == "even" else "explicit", **done)


def full_chain_bytes(layout: KVLayout, partition: Partition) -> int:
    """What the KV chain would send on ``partition`` if every layer kept the whole prefix: rank i hands on
    [0, b_{i+1}) of every layer."""
    itemsize = torch.empty((), dtype=layout.dtype).element_size()
    per_token = sum(2 * layout.heads[i] * layout.head_dim[i] for i in range(layout.num_layers)) * itemsize
    return per_token * sum(partition.boundaries[1:-1])


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run(cfg: RunConfig, launcher: str, world_size: int) -> RunResult | None:
    """Check the input, join the ranks, run one prefill; the last rank returns the result, others None."""
    prepare(cfg, world_size)
    if cfg.transport == "mpi" and launcher != "mpi" and world_size > 1:
        raise InputError("--transport mpi needs the ranks to be started by mpirun")
    device = resolve_device(cfg.device, local_rank_hint())
    world = init_world(launcher, pick_backend(device), cfg.timeout_s)
    try:
        return run_on_world(cfg, world)
    finally:
        leave_world()


def leave_world() -> None:
    """Drop the cached transports and destroy every process group: a rank that exits with gloo's threads
    still running can abort ("terminate called without an active exception")."""
    _TRANSPORTS.clear()
    liveness.forget()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_on_world(cfg: RunConfig, world: World) -> RunResult | None:
    """One prefill on ranks that have already joined (a notebook or a harness may call it repeatedly)."""
    prepared = prepare(cfg, world.world_size, world.local_world_size)
    ids, partition = prepared.ids, prepared.partition
    device = resolve_device(cfg.device, world.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = resolve_dtype(cfg, device)
    backend = pick_backend(device)
    threads = cfg.threads or default_threads(world.local_world_size)
    torch.set_num_threads(threads)
    lm = _loaded(cfg.model, dtype, device, cfg.seed, prepared.rope)
    layout = probe_kv_layout(lm.model)
    rank, p = world.rank, world.world_size
    mode = MODES[cfg.mode]
    transport = _transport(cfg.transport, rank, p, backend, cfg.timeout_s, cfg.allgather)
    if p > 1:
        _check_same_plan(cfg, prepared)
    transport.reset_stats()
    ranges = mode.token_ranges(partition)
    mine = ranges[rank]
    my_ids = torch.tensor([[t for a, e in mine for t in ids[a:e]]], device=device)
    step = Step(lm.model, my_ids, ids, ranges, transport, layout, len(ids), prepared.kvr_attention)
    state = mode.setup(step)
    emitter = mode.emitter(p)
    if p > 1:  # a single process inside a world of ranks (kvr-bench's interleaved singles) meets nobody
        liveness.patient_barrier("the other ranks to start the prefill")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    logits, cache = mode.prefill(step, state)
    first_token = int(logits.argmax()) if rank == emitter else -1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    total_s = time.perf_counter() - t0
    st = transport.stats
    stats = RankStats(
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
    all_stats = liveness.gather_objects(stats, "the other ranks to finish the prefill") if p > 1 else [stats]
    if rank != emitter:
        return None
    new_tokens = cfg.max_new_tokens if mode.decodes else 1
    tokens = greedy_decode(lm.model, first_token, cache, len(ids), new_tokens, lm.eos_token_ids)
    result = RunResult(
        model=cfg.model,
        mode=cfg.mode,
        world_size=p,
        launcher=world.launcher,
        backend=backend if p > 1 else "none",
        transport=transport.name,
        network=network_label(cfg, p, world.local_world_size, tables=False),
        allgather=transport.allgather if cfg.mode in ("tsp", "cp-allgather") and p > 1 else None,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        threads_per_rank=threads,
        oversubscribed=threads * world.local_world_size > (os.cpu_count() or 1),
        context_len=len(ids),
        rope_extension=prepared.rope.describe() if prepared.rope else None,
        kvr_attention=f"{prepared.kvr_attention} ({prepared.attention_source})" if cfg.mode.startswith("kvr") else None,
        sliding_layers=sum(layout.window(i) is not None for i in range(layout.num_layers)),
        full_chain_bytes=full_chain_bytes(layout, partition) if cfg.mode == "kvr" and layout.windows else None,
        boundaries=list(partition.boundaries),
        partition_source=prepared.partition_source,
        partition_warning=prepared.warning,
        ratios=[round(r, 4) for r in partition.ratios],
        ttft_s=total_s,
        ranks=all_stats,
        first_token=first_token,
        first_token_text=lm.decode([first_token]),
        generated_tokens=tokens,
        generated_text=lm.decode(tokens),
        logits=logits.float().cpu(),
    )
    if cfg.verify:
        all_threads = min(threads * world.local_world_size, os.cpu_count() or 1)
        result.verification = verify(lm, ids, result, cfg, dtype, threads, all_threads)
    return result


_MODELS: dict = {}
_TRANSPORTS: dict = {}
def _check_same_plan(cfg: RunConfig, prepared: Prepared) -> None:
    """Every rank derives the partition, attention and RoPE itself (from its own partition_tables/ and
    device): ranks on hosts that differ there would size their buffers differently and hang, so compare."""
    mine = (tuple(prepared.partition.boundaries), prepared.kvr_attention, prepared.rope)
    plans = liveness.gather_objects(mine, "the other ranks' plans")
    if any(plan != plans[0] for plan in plans):
        raise RuntimeError(f"the ranks chose different plans (partition, attention, RoPE): {plans}; their hosts' "
                           "partition tables or devices differ: pass --partition and --kvr-attention explicitly")


def _loaded(name: str, dtype: torch.dtype, device: torch.device, seed: int,
            rope: RopeExtension | None = None) -> LoadedModel:
    """Models stay loaded across runs of one process (benchmarks, test harnesses)."""
    key = (name, dtype, str(device), seed, rope)
    if key not in _MODELS:
        _MODELS.clear()
        _MODELS[key] = load_model(name, dtype, device, seed=seed, rope=rope)
    return _MODELS[key]


def _transport(name: str, rank: int, world_size: int, backend: str, timeout_s: float, allgather: str) -> Transport:
    """One transport (and its process groups) per process and kind, reused across runs."""
    key = (name, rank, world_size, backend)
    if key not in _TRANSPORTS:
        _TRANSPORTS[key] = make_transport(name, rank, world_size, backend, timeout_s, allgather)
    transport = _TRANSPORTS[key]
    transport.timeout_s = timeout_s
    transport.set_allgather(allgather)
    return transport


def default_atol(dtype: torch.dtype) -> float:
    # float32 differs from one full forward only by summation order; half precisions by rounding.
    return {torch.float32: 1e-3, torch.bfloat16: 0.5, torch.float16: 0.1}[dtype]


@torch.no_grad()
def verify(lm: LoadedModel, ids: list[int], result: RunResult, cfg: RunConfig, dtype: torch.dtype, threads: int,
           all_threads: int) -> Verification:
    """Run the single-process prefill and decode of the same prompt and compare; time the single process at
    the threads of one rank and, when more, at those of all ranks together (what one process on these cores
    would get)."""
    device = next(lm.model.parameters()).device
    full = torch.tensor([ids], device=device)
    cache = DynamicCache(config=lm.model.config)
    t0 = time.perf_counter()
    ref_logits = last_token_logits(lm.model, full, past_key_values=cache)
    ref_first = int(ref_logits.argmax())
    single_ttft_s = time.perf_counter() - t0
    new_tokens = cfg.max_new_tokens if MODES[cfg.mode].decodes else 1
    ref_tokens = greedy_decode(lm.model, ref_first, cache, len(ids), new_tokens, lm.eos_token_ids)
    all_threads_s = None
    if all_threads > threads and device.type == "cpu":
        torch.set_num_threads(all_threads)
        try:
            t0 = time.perf_counter()
            last_token_logits(lm.model, full, past_key_values=DynamicCache(config=lm.model.config))
            all_threads_s = time.perf_counter() - t0
        finally:
            torch.set_num_threads(threads)
    return Verification(
        single_ttft_s=single_ttft_s,
        single_all_threads_ttft_s=all_threads_s,
        single_all_threads=all_threads,
        max_abs_logit_diff=float((ref_logits.float().cpu() - result.logits).abs().max()),
        atol=cfg.atol if cfg.atol is not None else default_atol(dtype),
        first_token_match=ref_first == result.first_token,
        generated_match=ref_tokens == result.generated_tokens,
        reference_tokens=ref_tokens,
    )
