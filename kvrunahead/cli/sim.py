"""``kvr-calibrate`` (measure this machine's profile) and ``kvr-plan`` (rank count, mode and partition)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import click

from kvrunahead.calibrate.calibrate import calibrate
from kvrunahead.choices import DTYPES
from kvrunahead.cli import common
from kvrunahead.errors import ProfileError
from kvrunahead.net.spec import NetError, parse_net, parse_rate
from kvrunahead.prompt import PromptError, parse_tokens
from kvrunahead.sim.costmodel import CostModel
from kvrunahead.sim.links import NoiseModel
from kvrunahead.sim.plan import Option, plan
from kvrunahead.sim.profile import (
    SHIPPED_DIR,
    HardwareProfile,
    describe_profile,
    keep_builtin_links,
    local_profile_path,
    resolve_profile,
)
from kvrunahead.sim.shape import DTYPE_BYTES, PAPER_SHAPES, ModelShape, shape_from_config
from kvrunahead.sim.simulate import MODES, SimError
from kvrunahead.sim.timeline import plot_timeline

# kvrunahead.model.load imports torch (and transformers): it is imported where a model's config is read, so that
# --help answers without it.


def resolve_shape(name: str, dtype: str):
    """A paper model's shape by name, or any model kvr-prefill knows (preset, default, local directory)."""
    from kvrunahead.model.load import ModelError, resolve_config

    if name in PAPER_SHAPES:
        s = PAPER_SHAPES[name]
        return s if dtype is None else ModelShape(**{**s.to_dict(), "dtype_bytes": DTYPE_BYTES[dtype]})
    try:
        return shape_from_config(resolve_config(name), dtype or "float32", name)
    except ModelError as e:
        raise ProfileError(f"{e} (or a paper shape: {', '.join(PAPER_SHAPES)})") from None


def parse_noise(spec: str | None, interval_s: float = 1.0, duty: float = 0.5):
    return None if not spec else NoiseModel(parse_rate(spec), interval_s, duty)


@click.command(context_settings=common.SETTINGS)
@common.model_option(help="Model whose layers are timed.")
@common.attention_kernel_option()
@common.linears_option()
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True)
@click.option("--threads", type=int, default=1, show_default=True, help="Threads per rank, as the runs will use.")
@click.option("--net", "nets", multiple=True,
              help="Network(s) whose link to measure, as kvr-prefill --net takes them (repeatable; default "
                   "loopback; a cap needs root).")
@click.option("--no-link", is_flag=True,
              help="Skip the two-rank link benchmark (keep the shipped profile's link figures: the one for "
                   "--threads, else the 1-thread one).")
@click.option("--repeats", type=int, default=3, show_default=True, help="Timed runs per point (median).")
@click.option("--quick", is_flag=True, help="Fewer shapes (about a minute); for a check, not for predictions.")
@click.option("--ranks", "concurrent", type=int, default=None,
              help="Ranks computing at once while the steps are timed, as in the runs to predict (they share "
                   "memory bandwidth and caches). Default: 2 where the machine has 2 or more cores, else 1.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="What to time: this machine's CPU, or its GPU (one GPU alone; no link is measured: the "
                   "NVLink figures of the built-in profile are kept and the profile says so).")
@click.option("--out", type=click.Path(dir_okay=False),
              help="Profile to write. Default: this machine's profile, where kvr-plan and kvr-search "
                   "--backend model find it (~/.cache/kvrunahead/profiles/cpu-t<threads>.json; gpu-measured.json "
                   "with --device cuda).")
def calibrate_main(model, dtype, threads, nets, no_link, repeats, quick, concurrent, device, out) -> None:
    """Measure this machine's hardware profile for the cost model and simulator.

    \b
    Times the runtime's own model code and kernels on one rank: the decoder layers' projections and MLP,
    the attention kernels of every mode at the shapes of 1k-16k prompts, a decode step's attention over
    1k-32k keys, the cache copies; and, on two
    ranks, the link through the runtime's transport (point-to-point and all-gather), on each --net.
    Writes JSON with the machine, versions, date and each fit's worst residual. On a GPU (--device cuda) the
    same steps run on one GPU alone, with a random-weight model of the shape given (llama-7b: the paper's).
    Examples:
      kvr-calibrate --out /tmp/cpu.json
      kvr-calibrate --device cuda --model llama-7b --dtype bfloat16 --out h100-measured.json
    """
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    gpu = device == "cuda"
    if concurrent is None:
        concurrent = 1 if gpu else 2 if (os.cpu_count() or 1) >= 2 * threads else 1
    if threads < 1 or repeats < 1 or concurrent < 1:
        common.fail("kvr-calibrate", "--threads, --repeats and --ranks must be at least 1")
    if gpu and (nets or concurrent > 1):
        common.fail("kvr-calibrate", "--device cuda times one GPU alone: --net and --ranks do not apply (its link "
                                     "figures come from the built-in GPU profile)")
    if gpu:
        from kvrunahead.errors import InputError
        from kvrunahead.model.device import check_device

        try:
            check_device("cuda")
        except InputError as e:
            common.fail("kvr-calibrate", str(e))
    target = Path(out) if out else local_profile_path(threads)
    if gpu and not out:
        target = target.with_name("gpu-measured.json")
    shipped = SHIPPED_DIR / f"cpu-t{threads}.json"
    if not shipped.exists():  # a link is the transport's: the 1-thread profile's serves where none of these exists
        shipped = SHIPPED_DIR / "cpu-t1.json"
    with common.failure_ending("kvr-calibrate"):
        for net in nets:
            if parse_net(net).noise is not None:
                raise NetError(f"--net {net}: a link is measured quiet (noise is the simulator's --noise)")
    start = time.perf_counter()

    def step(what: str) -> None:
        click.echo(f"[{time.perf_counter() - start:5.0f} s] measuring {what}", err=True)

    try:
        profile = calibrate(model, dtype, threads, () if no_link or gpu else (tuple(nets) or ("loopback",)),
                            repeats, quick, step, concurrent, device)
    except Exception as e:  # noqa: BLE001 - one line for the user, whatever broke
        click.echo(f"kvr-calibrate: error: {e}", err=True)
        sys.exit(1)
    if gpu:
        keep_builtin_links(profile)
    elif no_link:
        base = HardwareProfile.load(shipped)
        profile.links, profile.default_link = base.links, base.default_link
        profile.sources["links"] = f"from the shipped profile ({base.device}, {base.date[:10]})"
    profile.save(target)
    click.echo(describe_profile(profile))
    click.echo(f"wrote {target} in {time.perf_counter() - start:.0f} s")


@click.command(context_settings=common.SETTINGS)
@click.option("--ctx", "contexts", required=True, help="Context length(s), e.g. 16k or 1k,8k,1M.")
@click.option("--profile", default=None,
              help="a100-nvlink, a100-pcie, a100-nvlink-flash, h100-nvlink (public figures), h100-measured "
                   "(measured on an H100), h200-measured (on an H200), cpu (this machine's kvr-calibrate "
                   "profile, else the shipped one) or a profile file. Default: cpu.")
@click.option("--model", default=None,
              help="Model shape: llama-7b, llama-13b, llama-7b-gqa8, llama-7b-mqa, falcon-7b, or any model "
                   "kvr-prefill takes. Default: llama-7b on a GPU profile, smollm2-135m on a CPU one.")
@click.option("--max-ranks", type=int, default=8, show_default=True)
@click.option("--ranks", default=None, help="Rank counts to consider instead, e.g. 2,3,4.")
@click.option("--modes", default=None,
              help="Parallel modes to compare. Default: kvr,tsp,cp-allgather,ring,spp; kvr and spp for a model "
                   "with sliding-window layers (the simulator prices those for the KV chain and the pipeline "
                   "only).")
@click.option("--kvr-attention", "attention", type=click.Choice(["split", "masked"]), default=None,
              help="KV-Runahead's attention (default: masked on the eager paper profiles, else split).")
@click.option("--link", default=None, help="Which of the profile's links (e.g. loopback, cap=22MB/s, ib): the "
              "chain's, between ranks (between TP groups with --tp).")
@click.option("--tp", type=int, default=1, show_default=True,
              help="Run every mode over TP groups of this many ranks (Megatron TP inside each, two all-reduces per "
                   "layer on --tp-link), and add Megatron TP over all the ranks as an option.")
@click.option("--tp-link", default=None, help="The link of a TP group's all-reduces (e.g. nvlink). Default: the "
              "profile's default link.")
@click.option("--noise", default=None, help="Noise on one random adjacent link, e.g. 100MB/s (1 s, duty 0.5).")
@click.option("--json", "as_json", is_flag=True, help="Every option as JSON on stdout.")
@click.option("--timeline", type=click.Path(dir_okay=False), help="Plot the recommended option's timeline (PNG).")
def plan_main(contexts, profile, model, max_ranks, ranks, modes, attention, link, tp, tp_link, noise, as_json,
              timeline) -> None:
    """Recommend the rank count, mode and partition for a context length, with every option's predicted TTFT.

    \b
    Simulates single and every parallel mode at 2, 4, 8, ... up to --max-ranks ranks on a hardware profile,
    KV-Runahead with the partition the cost model finds for each count. Example:
      kvr-plan --ctx 16k --profile a100-nvlink --max-ranks 8

    \b
    Llama-70B on one and two nodes of 8 A100s: TP8 within a node, the modes across nodes, against TP16:
      kvr-plan --model llama-70b --profile a100-nvlink-flash --ctx 16k,128k --tp 8 --tp-link nvlink --link ib \
        --ranks 8,16
    """
    try:
        ctxs = [parse_tokens(c) for c in contexts.split(",") if c.strip()]
        prof, which = resolve_profile(profile)
        shape = resolve_shape(model or ("llama-7b" if prof.device_kind == "cuda" else "smollm2-135m"), prof.dtype)
        modes = modes or ("kvr,spp" if shape.sliding else "kvr,tsp,cp-allgather,ring,spp")
        chosen = tuple(m.strip() for m in modes.split(",") if m.strip())
        bad = [m for m in chosen if m not in MODES or m in ("single", "kvr-nocomm")]
        if bad:
            raise ProfileError(f"unknown mode(s) {bad}: choose from kvr, tsp, cp-allgather, ring, spp")
        if shape.sliding and set(chosen) - {"kvr", "spp"}:
            raise ProfileError(f"{shape.name} has sliding-window layers, which the simulator prices for the KV "
                               "chain and the pipeline only: --modes kvr,spp")
        counts = [int(x) for x in ranks.split(",")] if ranks else None
        if max_ranks < 1 or (counts and min(counts) < 1):
            raise ProfileError("rank counts must be at least 1")
        cost = CostModel(shape, prof, link)
        cost.link  # noqa: B018 - one-line error now if the profile lacks the link
        if tp < 1:
            raise ProfileError(f"--tp must be at least 1, got {tp}")
        prof.link(tp_link)
        noise_model = parse_noise(noise)
    except (PromptError, ProfileError, ValueError) as e:
        common.fail("kvr-plan", str(e))
    attention = attention or ("masked" if prof.attention["masked"].score_bytes else "split")
    click.echo(f"{shape.name} on {which}, link {link or prof.default_link}"
               + (f", noise {noise}" if noise else "") + f", KVR attention {attention}", err=True)
    report = []
    for ctx in ctxs:
        t = time.perf_counter()
        try:
            options = plan(cost, ctx, max_ranks, chosen, attention, noise_model, counts, record=bool(timeline),
                           tp=tp, tp_link=tp_link)
        except SimError as e:
            common.fail("kvr-plan", str(e))
        report.append(_report(ctx, options))
        if not as_json:
            _print_options(ctx, options, time.perf_counter() - t)
        if timeline:
            path = Path(timeline) if len(ctxs) == 1 else Path(timeline).with_stem(f"{Path(timeline).stem}_{ctx}")
            _plot_timeline(options[0], path)
    if as_json:
        click.echo(json.dumps(report, indent=1))


def _report(ctx: int, options: list[Option]) -> dict:
    """One context's options as kvr-plan --json writes them, fastest first."""
    single = next(o for o in options if o.mode == "single").ttft_s
    best = options[0]
    return {"context_len": ctx, "recommended": {"ranks": best.ranks, "mode": best.mode, "tp": best.tp,
                                                "boundaries": list(best.boundaries), "ttft_s": best.ttft_s},
            "options": [{"ranks": o.ranks, "mode": o.mode, "tp": o.tp, "label": o.label, "ttft_s": o.ttft_s,
                         "weight_bytes_per_rank": o.weight_bytes, "boundaries": list(o.boundaries),
                         "chunk_tokens": o.chunk_tokens, "speedup_vs_single": single / o.ttft_s} for o in options]}


def _print_options(ctx: int, options: list[Option], elapsed_s: float) -> None:
    single = next(o for o in options if o.mode == "single").ttft_s
    best = options[0]
    click.echo(f"\ncontext {ctx}: predicted TTFT of every option ({elapsed_s:.1f} s)")
    click.echo(f"  {'option':<22} {'TTFT s':>10} {'vs single':>10} {'GB/rank':>8}  partition")
    for o in sorted(options, key=lambda o: (o.ranks, o.mode)):
        part = {"kvr": ",".join(map(str, o.boundaries)),
                "spp": f"stages {','.join(map(str, o.boundaries))}, chunks of {o.chunk_tokens}"}.get(o.mode,
                                                                                                 "even/zigzag")
        if len(part) > 60:
            part = part[:57] + "..."
        click.echo(f"  {o.label:<22} {o.ttft_s:>10.4f} {single / o.ttft_s:>9.2f}x {o.weight_bytes / 1e9:>8.1f}  {part}")
    click.echo(f"recommended: {best.label}, TTFT {best.ttft_s:.4f} s ({single / best.ttft_s:.2f}x single)"
               + (f", partition {','.join(map(str, best.boundaries))}" if best.mode == "kvr" else ""))


def _plot_timeline(best: Option, path: Path) -> None:
    try:
        import matplotlib  # noqa: F401 - optional (the bench extra): only --timeline needs it
    except ImportError:
        common.fail("kvr-plan", "--timeline needs matplotlib: pip install matplotlib")
    plot_timeline(best.result, path)
    click.echo(f"timeline: {path}", err=True)
