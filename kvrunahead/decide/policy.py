"""The partition policy: what one prefill request runs with, decided before any rank works.

It checks the input, chooses the attention, finds the partition (the table of this exact setting, interpolated;
else the cost model; else the FLOP estimate) and labels the network. The runner, the bench and the search all ask
it, so a request is planned the same way wherever it comes from.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kvrunahead.choices import ALLGATHERS, DECODES, KVR_ATTENTIONS, TRANSPORTS
from kvrunahead.config import RunConfig
from kvrunahead.decide.tables import Lookup, Table, TableError, TableKey, find_table
from kvrunahead.decode.kvp import check_kvp
from kvrunahead.errors import InputError, ProfileError
from kvrunahead.model.attention import uses_attention_interface
from kvrunahead.model.compute import compute_scale, compute_settings
from kvrunahead.model.device import check_device, config_dtype, default_threads, dtype_name
from kvrunahead.model.layout import soft_caps
from kvrunahead.model.load import ModelError, load_tokenizer, resolve_config
from kvrunahead.model.rope import ContextError, RopeExtension, plan_extension
from kvrunahead.model.tp import check_tp
from kvrunahead.modes import MODES, check_model
from kvrunahead.net.spec import NetError, NetSpec, parse_net
from kvrunahead.partition import Partition, PartitionError, check_fits, parse_partition
from kvrunahead.prompt import PromptError, build_prompt
from kvrunahead.sim.flops import estimated_partition
from kvrunahead.sim.optimize import predicted_partition, predicted_pipeline, reweighted_partition
from kvrunahead.sim.shape import config_hash

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    ids: list[int]
    partition: Partition
    partition_source: str  # "even", "explicit", the table and entries, or the cost model (estimate) and why
    warning: str | None = None
    rope: RopeExtension | None = None
    kvr_attention: str = "masked"
    attention_source: str = ""
    stages: tuple[int, ...] | None = None  # spp: each rank's layers [stages[r], stages[r+1])
    chunk_tokens: int | None = None  # spp: the chunk pipelined through the stages
    pipeline_source: str | None = None  # spp: where the stages and chunk come from


def _dtype_name(cfg: RunConfig, config=None) -> str:
    return dtype_name(cfg.dtype, _device_kind(cfg), config_dtype(config) if config is not None else None)


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
    if cfg.kvr_attention not in KVR_ATTENTIONS:
        raise InputError(f"unknown --kvr-attention {cfg.kvr_attention!r}: use auto, masked or split")
    return cfg.kvr_attention, "as asked"


def table_key(cfg: RunConfig, config, world_size: int, attention: str, local_world_size: int) -> TableKey:
    return TableKey(cfg.model, config_hash(config), world_size, _dtype_name(cfg, config), attention, _device_kind(cfg),
                    network_label(cfg, world_size, local_world_size), cfg.tp)


def _table_partition(cfg: RunConfig, config, key: TableKey, context_len: int, attention: str,
                     threads: int) -> Lookup:
    path = Path(cfg.table) if cfg.table else find_table(key)
    table = Table.load(path)
    if not cfg.force_table:
        table.check(key, name=path.name)
    return _fresh_or_reweighted(table, table.lookup(context_len, name=path.name), path.name, config, key,
                                context_len, attention, threads, cfg.tp)


def _auto_partition(cfg: RunConfig, config, key: TableKey, context_len: int, attention: str,
                    threads: int) -> Lookup:
    """The table of this exact setting, interpolated, where it covers the context (re-weighted where it is stale);
    else the cost model's partition on this machine's profile for the ranks' ``threads`` (CPU), else the FLOP
    estimate (never silently the even partition: the chain makes later ranks wait, so even is never the best)."""
    if key.world_size == 1:
        return Lookup(Partition.even(context_len, 1), "one rank")
    try:
        path = find_table(key)
    except TableError:
        why = f"no partition table for {key.describe()}"
    else:
        table = Table.load(path)
        lo, hi = (table.entries[0].context_len, table.entries[-1].context_len) if table.entries else (0, -1)
        if lo <= context_len <= hi:
            lookup = table.lookup(context_len, name=path.name)
            return _fresh_or_reweighted(table, lookup, path.name, config, key, context_len, attention, threads,
                                        cfg.tp)
        why = (f"{context_len} tokens is outside {path.name} ({lo}..{hi})" if table.entries
               else f"{path.name} has no entries")
    if key.device_kind == "cpu":
        try:
            scale = compute_scale(compute_settings(key.dtype), key.dtype) or (1.0, 1.0)
            partition, source = predicted_partition(config, key.dtype, threads, context_len, key.world_size,
                                                     attention, key.bandwidth, cfg.tp, scale)
            return Lookup(partition, f"{source} ({why})")
        except ProfileError as e:
            why = f"{why}; {e}"
    partition = estimated_partition(config, context_len, key.world_size, attention)
    return Lookup(partition, f"cost estimate of the ranks' work ({why})")


_said_stale: set[str] = set()


def _fresh_or_reweighted(table: Table, lookup: Lookup, name: str, config, key: TableKey, context_len: int,
                         attention: str, threads: int, tp: int) -> Lookup:
    """The table's partition where the run computes as the table was searched; else (a stale table: said in the
    lookup's warning, and in the log once per table) the partition re-weighted by the cost model for the change of
    this CPU's rates, until the table is searched again."""
    run = compute_settings(key.dtype, key.device_kind)
    stale = None if run is None else table.stale(run, name)
    if stale is None or lookup.partition.world_size != key.world_size:  # another world size: refused by the caller
        return lookup
    if name not in _said_stale:
        _said_stale.add(name)
        log.warning("%s", stale)
    warning = "; ".join(filter(None, (lookup.warning, stale)))
    searched, now = compute_scale(table.searched_with(), key.dtype), compute_scale(run, key.dtype)
    if key.device_kind != "cpu" or searched is None or now is None:
        return Lookup(lookup.partition, f"{lookup.source} (stale: no rates to re-weight it by)", warning)
    try:
        partition = reweighted_partition(config, key.dtype, threads, context_len, key.world_size, attention,
                                         list(lookup.partition.ratios), searched, now, key.bandwidth, tp)
    except ProfileError as e:
        return Lookup(lookup.partition, f"{lookup.source} (stale; not re-weighted: {e})", warning)
    return Lookup(partition, f"{lookup.source}, stale: re-weighted by the cost model for "
                             f"{run['attention_kernel']} attention and {run['linears']} linears", warning)


TP_MODES = ("kvr", "tp", "tsp", "ring", "cp-allgather", "kvr-nocomm", "spp")


def tp_groups(cfg: RunConfig, nproc: int) -> int:
    """The number of TP groups ``nproc`` ranks form at ``cfg.tp`` (the chain's length), after checking the degree
    against the ranks, the mode and the model without loading any weight; InputError with one line."""
    if cfg.tp < 1:
        raise InputError(f"--tp must be at least 1, got {cfg.tp}")
    if nproc % cfg.tp:
        raise InputError(f"--tp {cfg.tp} does not divide --nproc {nproc}: the ranks form groups of --tp ranks")
    if cfg.tp == 1:
        return nproc
    if cfg.mode not in TP_MODES:
        raise InputError(f"--tp runs the modes {', '.join(TP_MODES)}; mode {cfg.mode!r} does not run over TP "
                         "groups yet")
    if cfg.mode == "tp" and cfg.tp != nproc:
        raise InputError(f"mode 'tp' is one TP group of every rank: --tp {cfg.tp} must equal --nproc {nproc}")
    try:
        check_tp(resolve_config(cfg.model), cfg.tp)
    except ModelError as e:
        raise InputError(str(e)) from None
    except NotImplementedError as e:
        raise InputError(f"--tp {cfg.tp} cannot run {cfg.model}: {e}") from None
    return nproc // cfg.tp


def with_tp_mode(cfg: RunConfig, nproc: int) -> RunConfig:
    """``--mode tp`` without ``--tp``: every rank in one TP group."""
    return dataclasses.replace(cfg, tp=nproc) if cfg.mode == "tp" and cfg.tp == 1 else cfg


def prepare(cfg: RunConfig, world_size: int, local_world_size: int | None = None) -> Prepared:
    """Validate the input and build the prompt and partition for a chain of ``world_size`` ranks (TP groups, with
    ``--tp``); raises InputError with one line."""
    check_device(cfg.device)
    if cfg.mode not in MODES:
        raise InputError(f"unknown mode {cfg.mode!r}: use one of {', '.join(MODES)}")
    if cfg.mode in ("single", "tp") and world_size != 1:
        raise InputError(f"mode {cfg.mode!r} runs one {'TP group' if cfg.mode == 'tp' else 'process'}, but the "
                         f"world has {world_size}")
    mode = MODES[cfg.mode]
    if mode.own_partition and (cfg.partition not in ("auto", "even") or cfg.table):
        raise InputError(f"mode {cfg.mode!r} sets its own layout; --partition and --table apply to kvr and "
                         "kvr-nocomm only")
    if cfg.transport not in TRANSPORTS:
        raise InputError(f"unknown transport {cfg.transport!r}: use one of {', '.join(TRANSPORTS)}")
    if cfg.allgather not in ALLGATHERS:
        raise InputError(f"unknown all-gather {cfg.allgather!r}: use one of {', '.join(ALLGATHERS)}")
    network_spec(cfg)
    if cfg.decode not in DECODES:
        raise InputError(f"unknown decode {cfg.decode!r}: use one of {', '.join(DECODES)}")
    if cfg.decode == "kvp" and cfg.mode != "kvr":
        raise InputError(f"--decode kvp decodes on the K,V that kvr leaves on each rank; mode {cfg.mode!r} does "
                         "not leave them there")
    if cfg.threads is not None and cfg.threads < 1:
        raise InputError(f"--threads must be at least 1, got {cfg.threads}")
    if cfg.mode != "spp" and (cfg.chunk_tokens is not None or cfg.stages.strip() != "auto"):
        raise InputError("--chunk-tokens and --stages apply to --mode spp")
    if cfg.chunk_tokens is not None and cfg.chunk_tokens < 1:
        raise InputError(f"--chunk-tokens must be at least 1, got {cfg.chunk_tokens}")
    if cfg.prompt_text is not None and not cfg.prompt_text.strip():
        raise InputError("the prompt file is empty (or only whitespace)")
    try:
        config = resolve_config(cfg.model)
        ids = build_prompt(load_tokenizer(cfg.model), cfg.context_len, cfg.prompt_text, chat=cfg.chat)
        rope = plan_extension(config, len(ids), cfg.allow_long_context, cfg.model)
        attention, why = resolve_attention(cfg, config) if cfg.mode.startswith(("kvr", "spp")) else ("masked", "")
        check_model(cfg.mode, config, attention)
        if cfg.decode == "kvp":
            try:
                check_kvp(config)
            except NotImplementedError as e:
                raise InputError(f"--decode kvp cannot run {cfg.model}: {e}") from None
        done = {"rope": rope, "kvr_attention": attention, "attention_source": why}
        if cfg.mode == "spp":
            done.update(zip(("stages", "chunk_tokens", "pipeline_source"),
                            plan_stages(cfg, config, len(ids), world_size, local_world_size or world_size,
                                        attention)))
        if mode.own_partition:
            return Prepared(ids, Partition.even(len(ids), world_size), "even", **done)
        partition, source, warning = choose_partition(cfg, config, len(ids), world_size, attention,
                                                      local_world_size or world_size)
    except (ModelError, PromptError, PartitionError, TableError, ContextError) as e:
        raise InputError(str(e)) from None
    except NotImplementedError as e:
        raise InputError(f"mode {cfg.mode!r} cannot run {cfg.model}: {e}") from None
    return Prepared(ids, partition, source, warning, **done)


def plan_stages(cfg: RunConfig, config, n: int, world_size: int, local_world_size: int, attention: str = "split"
                ) -> tuple[tuple[int, ...], int, str]:
    """spp's layer stages and chunk for a prompt of ``n`` tokens, and where they come from: as given, else the cost
    model's (stages of equal predicted time, the chunk with the least predicted TTFT) on a CPU, else equal layer
    counts and 2048-token chunks."""
    layers = config.get_text_config(decoder=True).num_hidden_layers
    if world_size > layers:
        raise InputError(f"spp needs a stage of at least one layer per rank: {cfg.model} has {layers} layers, "
                         f"the world size is {world_size}")
    given = None
    if cfg.stages.strip() != "auto":
        if "." in cfg.stages:
            raise InputError("--stages takes layer boundaries (0,15,30), not ratios")
        try:
            given = parse_partition(cfg.stages, layers, world_size).boundaries
        except PartitionError as e:
            raise InputError(f"--stages: {e} (layers, not tokens: {cfg.model} has {layers})") from None
    if _device_kind(cfg) == "cpu":
        threads = cfg.threads or default_threads(local_world_size)
        try:
            plan, source = predicted_pipeline(config, _dtype_name(cfg, config), threads, n, world_size,
                                              network_label(cfg, world_size, local_world_size), given,
                                              cfg.chunk_tokens, attention)
        except ProfileError as e:
            raise InputError(str(e)) from None
        said = [what for what, g in (("stages", given), ("chunk", cfg.chunk_tokens)) if g]
        return plan.stages, min(plan.chunk_tokens, n), f"{' and '.join(said) + ' as given; ' if said else ''}{source}"
    stages = given or Partition.even(layers, world_size).boundaries
    return stages, min(cfg.chunk_tokens or 2048, n), "equal layer counts, 2048-token chunks (no GPU cost model)"


def choose_partition(cfg: RunConfig, config, n: int, world_size: int, attention: str,
                     local_world_size: int) -> tuple[Partition, str, str | None]:
    """The kvr partition of a prompt of ``n`` tokens and where it comes from (with the table's warning, if any):
    ``--table``/``table``: the table; ``auto``: the table of this exact setting where it covers ``n``, else the
    cost model, else the FLOP estimate; else the boundaries or ratios given. ``prepare`` and the serving engine
    (per request) both ask it."""
    key = table_key(cfg, config, world_size, attention, local_world_size)
    threads = cfg.threads or default_threads(local_world_size * cfg.tp)  # what each rank will run with
    if cfg.partition == "table" or cfg.table:
        lookup = _table_partition(cfg, config, key, n, attention, threads)
        if lookup.partition.world_size != world_size:
            raise InputError(f"{lookup.source} has {lookup.partition.world_size} parts, world size is {world_size}")
        return lookup.partition, lookup.source, lookup.warning
    if cfg.partition.strip() == "auto":
        check_fits(n, world_size)
        lookup = _auto_partition(cfg, config, key, n, attention, threads)
        return lookup.partition, lookup.source, lookup.warning
    source = "even" if cfg.partition.strip() == "even" else "explicit"
    return parse_partition(cfg.partition, n, world_size), source, None
