"""What one ``kvr-search`` is asked for (``SearchOptions``), the key of the table it writes, and its input checks.

Torch-free at import: the policy and model loading are imported where they are used, so that ``--help`` and the
input checks answer before torch is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvrunahead.choices import DEFAULT_MODEL
from kvrunahead.decide.tables import TABLES_DIR, Table, TableError, TableKey, table_filename
from kvrunahead.errors import InputError
from kvrunahead.model.rope import ContextError, plan_extension
from kvrunahead.prompt import parse_tokens

if TYPE_CHECKING:
    from kvrunahead.config import RunConfig

CRITERIA = ("ttft", "balance")

PEER_TIMEOUT_NOTE = "; the candidates measured so far are kept (--resume continues)"


@dataclass(frozen=True)
class SearchOptions:
    """What one search is asked for: every ``kvr-search`` option but ``--nproc``."""

    context_lens: tuple[int, ...]
    model: str = DEFAULT_MODEL
    min_stride_tokens: int = 64  # the finest step of a boundary
    repeats: int = 3  # timed runs per candidate (their median is its TTFT)
    warmup_runs: int = 1  # untimed runs before the first candidate of each length
    kvr_attention: str = "auto"
    seeded: bool = True  # start from the table's interpolation and search only the window around it
    window_tokens: int = 256  # either side of a seed
    seed_table: Path | None = None  # seed from this table instead of the one being written
    out: Path | None = None  # None: partition_tables/ under the setting's name
    resume: bool = False
    checkpoints: Path | None = None  # None: next to the table, as <table>.search/
    threads: int = 1
    device: str = "auto"
    dtype: str | None = None
    net: str | None = None
    backend: str = "measured"  # or "model": the cost model's table, no rank started
    criterion: str = "ttft"  # ttft: golden-section/grid on measured TTFT; balance: the ranks' balance per run
    confirm_rounds: int = 3  # --criterion balance: interleaved rounds timing the balanced point and neighbours
    confirm: str = "toward"  # --criterion balance: the neighbours confirmed (search.balance.CONFIRM)
    confirm_margin: float = 0.01  # --criterion balance: a neighbour must be this much faster to be chosen
    carry_rates: bool = True  # --criterion balance: seed a length by the rates a shorter entry measured
    profile: str | None = None  # the hardware profile of --backend model
    refine: bool = False  # measure only around the cost model's answer
    allow_long_context: bool = False
    timeout_s: float = 600.0
    tp: int = 1  # the ranks form TP groups of this many, chained: the table's world size counts the groups

    @classmethod
    def from_cli(cls, contexts: str, **options) -> SearchOptions:
        """From kvr-search's arguments: ``--ctx`` as typed (e.g. ``2k,4k``), paths as strings (empty: none)."""
        for name in ("seed_table", "out", "checkpoints"):
            options[name] = Path(options[name]) if options[name] else None
        return cls(context_lens=tuple(parse_tokens(c) for c in contexts.split(",") if c.strip()), **options)


def base_config(opts: SearchOptions) -> RunConfig:
    from kvrunahead.config import RunConfig

    return RunConfig(model=opts.model, threads=opts.threads, device=opts.device, dtype=opts.dtype,
                     max_new_tokens=1, allow_long_context=opts.allow_long_context, timeout_s=opts.timeout_s,
                     kvr_attention=opts.kvr_attention, net=opts.net, tp=opts.tp)


def table_key(opts: SearchOptions, world_size: int, local_world_size: int | None = None, config=None) -> TableKey:
    """What the table being written is for (and what an existing --out must have been made for); ``config``:
    the model's config where the caller has resolved it already."""
    from kvrunahead.decide.policy import resolve_attention
    from kvrunahead.decide.policy import table_key as policy_table_key
    from kvrunahead.model.load import resolve_config

    base = base_config(opts)
    config = config if config is not None else resolve_config(opts.model)
    attention, _ = resolve_attention(base, config)
    return policy_table_key(base, config, world_size, attention, local_world_size or world_size)


def check_inputs(opts: SearchOptions, world_size: int) -> Path:
    """One-line errors before any rank starts; returns the table path."""
    from kvrunahead.model.device import check_device
    from kvrunahead.model.load import ModelError, resolve_config

    for flag, value, least in (("--threads", opts.threads, 1), ("--repeats", opts.repeats, 1),
                               ("--warmup", opts.warmup_runs, 0), ("--min-stride", opts.min_stride_tokens, 1),
                               ("--window", opts.window_tokens, 1), ("--confirm-rounds", opts.confirm_rounds, 1)):
        if value < least:
            raise InputError(f"{flag} must be at least {least}, got {value}")
    if not 0 <= opts.confirm_margin < 1:
        raise InputError(f"--confirm-margin is a fraction in [0, 1), got {opts.confirm_margin}")
    if world_size < 1:
        raise InputError(f"--nproc must be at least 1, got {world_size}")
    if opts.tp > 1 and opts.backend == "model":
        raise InputError("--backend model writes the cost model's table for ranks that hold the whole model; with "
                         "--tp the runtime already partitions by the cost model priced at the TP degree")
    if opts.tp != 1:
        from kvrunahead.decide.policy import tp_groups

        world_size = tp_groups(base_config(opts), world_size)  # the chain's groups; one line for a bad shape
    if world_size == 1 and (opts.criterion == "balance" or opts.backend == "model"):
        raise InputError("one rank has no partition to balance or model: --nproc 1 measures the one-rank TTFT "
                         "(the degree policy's table), with --criterion ttft on the ranks")
    check_device(opts.device)
    if not opts.context_lens:
        raise InputError("--ctx names no context length")
    try:
        config = resolve_config(opts.model)
        key = table_key(opts, world_size, config=config)
        for ctx in opts.context_lens:
            plan_extension(config, ctx, opts.allow_long_context, opts.model)
    except (ModelError, ContextError) as e:
        raise InputError(str(e)) from None
    out = opts.out or TABLES_DIR / table_filename(key)
    if out.exists() and not (opts.backend == "model" and not opts.refine):  # model_search checks its own
        try:
            existing = Table.load(out)
            existing.check(key, name=str(out))
        except TableError as e:
            raise InputError(f"{e}; --out must be a new table or one made for the same setting") from None
        if existing.meta.source != "measured":
            raise InputError(f"{out} holds the cost model's predictions ({existing.meta.source}); a measured "
                             f"search writes a table of its own (--out)")
    for ctx in opts.context_lens:
        if ctx < world_size * opts.min_stride_tokens:
            raise InputError(f"context of {ctx} tokens is too short for {world_size} ranks at --min-stride "
                             f"{opts.min_stride_tokens}")
    return out


