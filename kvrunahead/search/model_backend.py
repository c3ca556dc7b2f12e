"""``kvr-search --backend model``: the partition table from the cost model and simulator, without a rank started;
and the model's answer a measured search starts from (``--refine``, ``--criterion balance``)."""

from __future__ import annotations

import dataclasses

import click

from kvrunahead.decide.tables import TABLES_DIR, Table, TableEntry, TableKey, TableMeta, table_filename
from kvrunahead.errors import InputError
from kvrunahead.partition import Partition
from kvrunahead.search.balance import Measurement
from kvrunahead.search.options import SearchOptions, table_key
from kvrunahead.sim.costmodel import CostModel
from kvrunahead.sim.optimize import ModelSearch, rescaled_profile, search_partition
from kvrunahead.sim.profile import resolve_profile
from kvrunahead.sim.shape import shape_from_config
from kvrunahead.sim.simulate import simulate
from kvrunahead.version import __version__


def cost_model(opts: SearchOptions, world_size: int) -> tuple[TableKey, CostModel, str, str, dict[str, str]]:
    """The table's key and its cost model: the model's shape on the chosen profile, over the table's link.
    With --device auto the table is for the profile's device kind (a GPU profile writes a cuda table). A CPU
    profile (timed on torch's kernels) is scaled to the kernels a run uses here, where they were timed; the last
    item says which (the table records them)."""
    from kvrunahead.model.compute import compute_scale, compute_settings
    from kvrunahead.model.load import ModelError, resolve_config

    profile, which = resolve_profile(opts.profile, opts.threads)
    if opts.device == "auto":
        opts = dataclasses.replace(opts, device=profile.device_kind)
    key = table_key(opts, world_size)
    computes = compute_settings(key.dtype, key.device_kind) if profile.device_kind == "cpu" else None
    scale = compute_scale(computes, key.dtype)
    if scale is not None:
        profile = dataclasses.replace(rescaled_profile(profile, scale), name=profile.name)
        which = (f"{which}, scaled to {computes['attention_kernel']} attention ({scale[0]:.2f}x) and "
                 f"{computes['linears']} linears ({scale[1]:.2f}x)")
    profile, link, link_note = profile.for_network(key.bandwidth)
    try:
        shape = shape_from_config(resolve_config(opts.model), key.dtype, opts.model)
    except ModelError as e:
        raise InputError(f"--backend model: {e}") from None
    return key, CostModel(shape, profile, link), which, link_note, computes if scale is not None else {}


def model_answer(opts: SearchOptions, ctx: int, world_size: int) -> ModelSearch:
    key, cost, *_ = cost_model(opts, world_size)
    return search_partition(cost, ctx, world_size, key.kvr_attention, min_stride=opts.min_stride_tokens)


def model_search(opts: SearchOptions, world_size: int) -> None:
    """``--backend model``: the table from the cost model, without starting a rank."""
    key, cost, which, link_note, computes = cost_model(opts, world_size)
    # Its own file: a prediction never lands in (or is read as) the measured table of the same setting.
    out = opts.out or TABLES_DIR / table_filename(key).replace(".json", "_model.json")
    click.echo(f"model search for {key.describe()} on {which}, {link_note} -> {out}", err=True)
    if cost.link_label != key.bandwidth:
        click.echo(f"warning: the profile has no link {key.bandwidth!r}; its {cost.link_label!r} link is used",
                   err=True)
    existing = Table.load(out) if out.exists() else None
    if existing is not None:
        existing.check(key, name=str(out))
        if existing.meta.source == "measured":
            raise InputError(f"{out} holds measured entries; a model-backed search writes a table of its own "
                             f"(--out)")
    fresh = existing is not None and not existing.stale(computes)  # entries of other kernels are replaced
    table = existing if fresh else Table(TableMeta(
        model=opts.model, config_hash=key.config_hash, dtype=key.dtype, world_size=world_size, backend="model",
        transport="model", device=cost.profile.device, threads_per_rank=opts.threads, bandwidth=key.bandwidth,
        version=__version__, kvr_attention=key.kvr_attention, device_kind=key.device_kind,
        source=f"cost model: {cost.profile.name}", **computes))
    for ctx in opts.context_lens:
        r = search_partition(cost, ctx, world_size, key.kvr_attention, min_stride=opts.min_stride_tokens)
        busy = predicted_busy(cost, r.boundaries, key.kvr_attention)
        balance = round(Measurement(r.ttft_s, tuple(busy)).balance, 4)
        table.add(TableEntry(context_len=ctx, boundaries=list(r.boundaries),
                             ratios=list(Partition(tuple(r.boundaries)).ratios),
                             ttft_s=r.ttft_s, even_ttft_s=r.even_ttft_s, evaluations=r.simulations,
                             search_s=round(r.search_s, 2), balance=balance, criterion="model", busy_s=busy))
        click.echo(f"[ctx {ctx}] predicted best {','.join(map(str, r.boundaries))}: TTFT {r.ttft_s:.3f} s "
                   f"(even {r.even_ttft_s:.3f} s), balance {balance:.3f}, {r.simulations} simulations, "
                   f"{r.search_s:.1f} s", err=True)
    table.save(out)
    click.echo(f"wrote {out}", err=True)


def predicted_busy(cost: CostModel, boundaries: tuple[int, ...], attention: str) -> list[float]:
    """Each rank's compute under the model at ``boundaries`` (no waits): what a measured balance search reads."""
    sim = simulate(cost, "kvr", boundaries[-1], len(boundaries) - 1, tuple(boundaries), attention)
    return [round(r.compute_s, 4) for r in sim.ranks]
