"""One prefill run on this rank: load, partition, time, gather, decode, verify."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass, field

import torch
from transformers import DynamicCache

from kvrunahead import kernels
from kvrunahead.config import RunConfig
from kvrunahead.decide.policy import Prepared, network_label, prepare, tp_groups
from kvrunahead.errors import InputError
from kvrunahead.model.compiled import eager
from kvrunahead.model.device import (
    oversubscribed,
    reset_peak_memory,
    resolve_device,
    synchronize,
    weight_bytes,
)
from kvrunahead.model.forward import greedy_decode, last_token_logits
from kvrunahead.model.layout import KVLayout, probe_kv_layout
from kvrunahead.model.linears import PackedLinear
from kvrunahead.model.load import LoadedModel
from kvrunahead.model.reference import HALF, HalfGrade, default_atol, grade_half, where_parted
from kvrunahead.model.stage import StageSpec
from kvrunahead.modes import MODES, Mode, Step
from kvrunahead.net import liveness
from kvrunahead.partition import Partition
from kvrunahead.ranks import launcher
from kvrunahead.ranks.launcher import World, init_world, local_rank_hint, pick_backend
from kvrunahead.ranks.mesh import chain_world, collective_in_use
from kvrunahead.ranks.setup import forget_transports, set_up_rank
from kvrunahead.ranks.stats import RankMemory, RankStats, rank_memory, rank_stats
from kvrunahead.ranks.transport import Transport

log = logging.getLogger(__name__)


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
    # Where the greedy continuations part: the step, and how far apart the reference model puts the two tokens'
    # logits there (a tie within ``atol``: half-precision GPU kernels that sum in another order pick either).
    parted_at: int | None = None
    parted_gap: float | None = None
    half: HalfGrade | None = None  # bfloat16 and float16: the run and one process, graded against float32

    @property
    def generated_within_rounding(self) -> bool:
        """The continuation equals the reference's, or parts from it only where the two tokens tie within the
        logit tolerance (after that the two continue from different tokens: nothing more to compare)."""
        return self.generated_match or (self.parted_gap is not None and self.parted_gap <= self.atol)

    @property
    def ok(self) -> bool:
        if self.half is not None:  # half precision: as close to float32 as one process in that precision is
            return self.half.ok
        return self.first_token_match and self.generated_within_rounding and self.max_abs_logit_diff <= self.atol


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
    attention_kernel: str  # "ours (avx512bf16)": our CPU kernel and its instruction set, or torch's
    linears: str  # "onednn": prepacked oneDNN weights (model/linears.py), or "torch"
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
    stages: list[int] | None = None  # spp: the layer boundaries of the stages, one per rank
    chunk_tokens: int | None = None  # spp: the chunk pipelined through them
    pipeline_source: str | None = None
    decode: str = "gathered"  # or kvp: every rank decoded on its own part of the cache
    decode_s: float | None = None  # seconds from the first token to the last (the tokens after the first)
    compiled: bool = False  # the decoder stack ran through torch.compile (--compile)
    tp: int = 1  # ranks per TP group (world_size counts groups)
    tp_collective: str | None = None  # with --tp: the group's all-reduce (shm, mpi or torch: ranks/mesh.py)
    weight_bytes: int | None = None  # with --tp: the weights one rank of the emitting group holds
    memory: list[RankMemory] | None = None  # every rank's weights and resident size over the run (kvr-prefill)
    verification: Verification | None = None
    logits: torch.Tensor | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("logits")
        if self.verification is not None:
            d["verification"]["ok"] = self.verification.ok
            if self.verification.half is not None:
                d["verification"]["half"].update(ok=self.verification.half.ok,
                                                 allowed_error=self.verification.half.allowed_error)
        return d


def full_chain_bytes(layout: KVLayout, partition: Partition) -> int:
    """What the KV chain would send on ``partition`` if every layer kept the whole prefix: rank i hands on
    [0, b_{i+1}) of every layer."""
    itemsize = torch.empty((), dtype=layout.dtype).element_size()
    per_token = sum(2 * layout.heads[i] * layout.head_dim[i] for i in range(layout.num_layers)) * itemsize
    return per_token * sum(partition.boundaries[1:-1])


def run(cfg: RunConfig, launcher: str, world_size: int, on_world=None) -> RunResult | None:
    """Check the input, join the ranks, run one prefill (``on_world``, default ``prefill_on_world``); the emitting rank
    returns the result, others None."""
    prepare(cfg, tp_groups(cfg, world_size))
    if cfg.transport == "mpi" and launcher != "mpi" and world_size > 1:
        raise InputError("--transport mpi needs the ranks to be started by mpirun")
    device = resolve_device(cfg.device, local_rank_hint())
    world = init_world(launcher, pick_backend(device), cfg.timeout_s, device)
    try:
        chain = chain_world(world, cfg.tp)  # with --tp: a chain of TP groups
        result = (on_world or prefill_on_world)(cfg, chain)
        memory = liveness.gather_objects(rank_memory(chain.global_rank, chain.rank, chain.tp_rank),
                                         "every rank's memory report")
        if isinstance(result, RunResult):
            result.memory = sorted(memory, key=lambda m: m.rank)
        # rank 0 hosts the rendezvous store: a rank that left while the last one still decodes or verifies would
        # take the store of its heartbeat away (torch prints a C++ trace for it), so the ranks leave together
        liveness.patient_barrier("the emitting rank to finish its report")
        return result
    finally:
        leave_world()


def leave_world() -> None:
    """Drop the cached transports (their pair groups die with the world), then leave the world."""
    forget_transports()
    launcher.leave_world()


def prefill_on_world(cfg: RunConfig, world: World) -> RunResult | None:
    """One prefill on ranks that have already joined (a notebook or a harness may call it repeatedly)."""
    new_tokens = _new_tokens(cfg)
    prepared = prepare(cfg, world.world_size, world.local_world_size)
    ids, partition = prepared.ids, prepared.partition
    rank, p = world.rank, world.world_size
    stage = StageSpec.of(prepared.stages, rank) if cfg.mode == "spp" and p > 1 else None
    rs = set_up_rank(cfg, world, prepared.rope, stage)
    device, dtype, threads, lm, layout, transport = rs.device, rs.dtype, rs.threads, rs.lm, rs.layout, rs.transport
    mode = MODES[cfg.mode]
    if p > 1:
        _check_same_plan(cfg, prepared)
    transport.reset_stats()
    step = mode.step(lm.model, ids, partition, transport, layout, prepared.kvr_attention,
                     own_kv_only=cfg.decode == "kvp", chunk_tokens=prepared.chunk_tokens)
    ranges = step.ranges
    state = mode.setup(step)
    emits = rank == mode.emitter(p)
    logits, cache, first_token, total_s = timed_prefill(mode, step, state, device, emits)
    stats = rank_stats(rank, ranges[rank], total_s, transport, state, device)
    all_stats = liveness.gather_objects(stats, "the other ranks to finish the prefill")[::world.tp] if p > 1 \
        else [stats]  # with --tp, each group's first rank speaks for it
    t0 = time.perf_counter()
    if emits and new_tokens > 1:  # the emitting rank (group) holds the whole cache
        tokens = greedy_decode(lm.model, first_token, cache, len(ids), new_tokens, lm.eos_token_ids)
    elif emits:
        tokens = [first_token]
    if not emits or world.tp_rank:
        return None
    decode_s = time.perf_counter() - t0
    weights = weight_bytes(lm.model) if world.tp > 1 else None
    if stage is not None or (world.tp > 1 and cfg.verify):  # the reference: the whole model, after the timing
        del cache
        lm = rs.whole(cfg, prepared.rope)
        layout = probe_kv_layout(lm.model)
    ran = Ran(world, prepared, lm, layout, transport, dtype, threads, weights)
    return finish_result(cfg, ran, total_s, all_stats, logits, tokens, decode_s)


def _new_tokens(cfg: RunConfig) -> int:
    """The tokens the runner gives: the greedy continuation where the emitting rank ends with the whole cache, else
    the first token alone. The pipeline's last stage holds its own layers' K,V and a KV-parallel rank its own part;
    their decode runs in the serving engine (``kvrunahead.run_on_world``, oneshot/on_engine.py), so the runner, which
    times prefills for kvr-bench and the search, refuses to continue them."""
    if not MODES[cfg.mode].decodes:
        return 1
    if (cfg.mode == "spp" or cfg.decode == "kvp") and cfg.max_new_tokens > 1:
        raise InputError(f"the runner times the prefill of {'--mode spp' if cfg.mode == 'spp' else '--decode kvp'} "
                         "and gives its first token only; its decode runs in the serving engine "
                         "(kvrunahead.run_on_world)")
    return cfg.max_new_tokens


@dataclass
class Ran:
    """What a one-shot prefill ran on: its world, plan, model (the prompt's RoPE variant) and threads per rank."""

    world: World
    prepared: Prepared
    lm: LoadedModel
    layout: KVLayout
    transport: Transport
    dtype: torch.dtype
    threads: int
    weight_bytes: int | None = None  # with --tp: the weights of the emitting group's first rank


def finish_result(cfg: RunConfig, ran: Ran, ttft_s: float, ranks: list[RankStats], logits: torch.Tensor,
                  tokens: list[int], decode_s: float | None = None) -> RunResult:
    """The emitting rank's report of a one-shot prefill (the runner's or the serving engine's) and, with
    ``--verify``, its check against the single process."""
    world, prepared, lm, layout = ran.world, ran.prepared, ran.lm, ran.layout
    partition, p, device = prepared.partition, world.world_size, next(lm.model.parameters()).device
    result = RunResult(
        model=cfg.model,
        mode=cfg.mode,
        world_size=p,
        launcher=world.launcher,
        backend=pick_backend(device) if p > 1 else "none",
        transport=ran.transport.name,
        network=network_label(cfg, p, world.local_world_size, tables=False),
        allgather=ran.transport.allgather if cfg.mode in ("tsp", "cp-allgather") and p > 1 else None,
        device=str(device),
        dtype=str(ran.dtype).removeprefix("torch."),
        compiled=cfg.compile,
        threads_per_rank=ran.threads,
        oversubscribed=oversubscribed(ran.threads, world.host_ranks),
        tp=world.tp,
        tp_collective=collective_in_use() if world.tp > 1 else None,
        weight_bytes=ran.weight_bytes,
        context_len=len(prepared.ids),
        rope_extension=prepared.rope.describe() if prepared.rope else None,
        kvr_attention=(f"{prepared.kvr_attention} ({prepared.attention_source})"
                       if cfg.mode.startswith(("kvr", "spp")) else None),
        attention_kernel=kernels.describe(device.type, ran.dtype),
        linears="onednn" if any(isinstance(m, PackedLinear) for m in lm.model.modules()) else "torch",
        sliding_layers=sum(layout.window(i) is not None for i in range(layout.num_layers)),
        full_chain_bytes=full_chain_bytes(layout, partition) if cfg.mode == "kvr" and layout.windows else None,
        boundaries=list(partition.boundaries),
        partition_source=prepared.partition_source,
        partition_warning=prepared.warning,
        ratios=[round(r, 4) for r in partition.ratios],
        ttft_s=ttft_s,
        ranks=ranks,
        first_token=tokens[0],
        first_token_text=lm.decode(tokens[:1]),
        generated_tokens=tokens,
        generated_text=lm.decode(tokens),
        stages=list(prepared.stages) if prepared.stages else None,
        chunk_tokens=prepared.chunk_tokens,
        pipeline_source=prepared.pipeline_source,
        decode=cfg.decode if cfg.mode != "spp" else "gathered",
        decode_s=decode_s,
        logits=logits.float().cpu(),
    )
    if cfg.verify:
        all_threads = min(ran.threads * world.host_ranks, os.cpu_count() or 1)
        result.verification = verify(lm, prepared.ids, result, cfg, ran.dtype, ran.threads, all_threads)
    return result


def timed_prefill(mode: Mode, step: Step, state: object, device: torch.device, emits: bool):
    """The timed region: from the start barrier to this rank's last K,V sent (and, on the emitting rank, the first
    token chosen). Returns the logits, the cache, the first token (-1 off the emitting rank) and the seconds."""
    if step.transport.world_size > 1:  # a single process inside a world of ranks (kvr-bench's singles) meets nobody
        liveness.patient_barrier("the other ranks to start the prefill")
    synchronize(device)
    reset_peak_memory(device)
    t0 = time.perf_counter()
    logits, cache = mode.prefill(step, state)
    first_token = int(logits.argmax()) if emits else -1
    synchronize(device)
    return logits, cache, first_token, time.perf_counter() - t0


def _check_same_plan(cfg: RunConfig, prepared: Prepared) -> None:
    """Every rank derives the partition, attention and RoPE itself (from its own partition_tables/ and
    device): ranks on hosts that differ there would size their buffers differently and hang, so compare."""
    mine = (tuple(prepared.partition.boundaries), prepared.kvr_attention, prepared.rope, prepared.stages,
            prepared.chunk_tokens)
    plans = liveness.gather_objects(mine, "the other ranks' plans")
    if any(plan != plans[0] for plan in plans):
        raise RuntimeError(f"the ranks chose different plans (partition, attention, RoPE, stages): {plans}; their "
                           "hosts' "
                           "partition tables or devices differ: pass --partition and --kvr-attention explicitly")


@torch.no_grad()
@eager()
def verify(lm: LoadedModel, ids: list[int], result: RunResult, cfg: RunConfig, dtype: torch.dtype, threads: int,
           all_threads: int) -> Verification:
    """Run the single-process prefill and decode of the same prompt and compare; time the single process at
    the threads of one rank and, when more, at those of all ranks together (what one process on these cores
    would get)."""
    device = next(lm.model.parameters()).device
    full = torch.tensor([ids], device=device)
    cache = DynamicCache(config=lm.model.config)
    t0 = time.perf_counter()
    ref_logits = last_token_logits(lm.model, full, cache=cache)
    ref_first = int(ref_logits.argmax())
    single_ttft_s = time.perf_counter() - t0
    new_tokens = cfg.max_new_tokens if MODES[cfg.mode].decodes else 1
    ref_tokens = greedy_decode(lm.model, ref_first, cache, len(ids), new_tokens, lm.eos_token_ids)
    all_threads_s = None
    if all_threads > threads and device.type == "cpu":
        torch.set_num_threads(all_threads)
        try:
            t0 = time.perf_counter()
            last_token_logits(lm.model, full, cache=DynamicCache(config=lm.model.config))
            all_threads_s = time.perf_counter() - t0
        finally:
            torch.set_num_threads(threads)
    parted_at = parted_gap = None
    if ref_tokens != result.generated_tokens and ref_first == result.first_token:
        parted_at, parted_gap = where_parted(lm.model, ids, ref_tokens, result.generated_tokens)
    half = None
    if dtype in HALF:
        half = grade_half(lm.model, ids, result.generated_tokens, result.logits, ref_tokens, ref_logits)
    return Verification(
        half=half,
        parted_at=parted_at,
        parted_gap=parted_gap,
        single_ttft_s=single_ttft_s,
        single_all_threads_ttft_s=all_threads_s,
        single_all_threads=all_threads,
        max_abs_logit_diff=float((ref_logits.float().cpu() - result.logits).abs().max()),
        atol=cfg.atol if cfg.atol is not None else default_atol(dtype, ref_logits),
        first_token_match=ref_first == result.first_token,
        generated_match=ref_tokens == result.generated_tokens,
        reference_tokens=ref_tokens,
    )
