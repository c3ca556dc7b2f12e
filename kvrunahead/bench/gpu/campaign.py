"""The GPU campaign: what the simulator predicts for GPUs, measured on one GPU in one short window.

Steps, in the order of their value (a wrong GPU path makes every later number moot):
  machine      the GPU, driver, torch, CUDA and transformers versions; what the campaign imports is importable
  exactness    tests/test_gpu.py on the device: fused kernels, split attention and KVP merge against float64,
               every model family and mode at p = 1 against the single-process model
  calibrate    kvr-calibrate's steps on the GPU (llama-7b shape, random bf16 weights): the measured profile
  prefill      single-GPU prefill, 4k-128k, Llama-7B's and SmolLM2-135M's shapes, random bf16 weights:
               TTFT, tokens/s, peak memory
  rank-part    the last rank of an 8-GPU KV-Runahead chain: its part's queries against the prefix before it,
               through the runtime's own chain code with the prefix held locally (what that rank computes)
  decode-graphs  decode steps of Llama-7B's shape at batch 1, 8 and 32 over a 512-token static cache: eager
               against the same step captured once as a CUDA graph and replayed (time per output token)
  prefill-peak the 16k single prefill of Llama-7B's shape, eager and compiled (torch.compile), its counted FLOPs
               against the device's dense bf16 peak (measured by a large matmul, and the data sheet's)
  predictions  the simulator beside every measurement (relative error), and 8-GPU predictions from the measured
               profile (labelled predictions: one GPU measures no link)
Every step has a predicted time from the built-in GPU profile (printed first); ``--budget-s`` skips what would not
fit. Rows are written as they are measured, so a run cut short keeps what it measured.

Usage: bash experiments/gpu/campaign.sh [--out DIR] [--budget-s 480] [--dry-run]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from kvrunahead.bench.gpu.checks import step_calibrate, step_exactness, step_machine, step_predictions
from kvrunahead.bench.gpu.plan import CONTEXTS, FILES, PREDICT_CONTEXTS, REPO, Log, Setup, predicted_steps
from kvrunahead.bench.gpu.timings import step_decode_graphs, step_prefill, step_prefill_peak, step_rank_part

# ---------------------------------------------------------------- the run

STEPS = ("machine", "exactness", "calibrate", "prefill", "rank-part", "decode-graphs", "prefill-peak", "predictions")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Folder for the outputs (default: $OUT where set, else experiments/gpu/out).")
@click.option("--budget-s", type=float, default=480.0, show_default=True,
              help="Seconds the run may take: a step (or a timing point) predicted not to fit is skipped.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True)
@click.option("--tiny", is_flag=True, help="Tiny models and contexts (a check that the campaign runs, not data).")
@click.option("--dry-run", is_flag=True, help="Print the plan for one H100, then run every step on CPU with --tiny.")
@click.option("--steps", default=",".join(STEPS), show_default=True, help="Which steps, comma-separated.")
@click.option("--repeats", type=int, default=3, show_default=True,
              help="Timed runs per point (median), after a warm-up.")
def main(out_dir, budget_s, device, tiny, dry_run, steps, repeats) -> None:
    """Run the GPU campaign: exactness on the GPU, its measured profile, single-GPU and chain-rank timings, and
    the simulator's predictions beside them. Writes at most seven files into one folder."""
    chosen = [s.strip() for s in steps.split(",") if s.strip()]
    bad = [s for s in chosen if s not in STEPS]
    if bad or budget_s <= 0 or repeats < 1:
        raise click.UsageError(f"unknown step(s) {bad}: choose from {', '.join(STEPS)}" if bad
                               else "--budget-s and --repeats must be positive")
    full_plan = predicted_steps(Setup("cuda", False, Path("."), repeats, CONTEXTS, PREDICT_CONTEXTS))
    print(f"plan on one H100 (built-in h100-nvlink profile), budget {budget_s:.0f} s:")
    for name in STEPS:
        print(f"  {name:<12} {full_plan[name]:7.1f} s predicted")
    print(f"  {'total':<12} {sum(full_plan.values()):7.1f} s")
    if dry_run:
        device, tiny = "cpu", True
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise click.UsageError("no CUDA device here: run on a GPU machine, or give --dry-run")
    out = Path(out_dir or os.environ.get("OUT") or REPO / "experiments/gpu/out")
    out.mkdir(parents=True, exist_ok=True)
    for name in FILES:  # a fresh run: rows are appended as they are measured
        (out / name).unlink(missing_ok=True)
    setup = Setup(device, tiny, out, 1 if tiny else repeats, (128, 256) if tiny else CONTEXTS,
                  (256,) if tiny else PREDICT_CONTEXTS)
    predicted = predicted_steps(setup)
    log = Log(out / "campaign.log")
    log(f"campaign on {device}{' (tiny)' if tiny else ''}, budget {budget_s:.0f} s, steps {', '.join(chosen)}")
    failed = []
    for name in STEPS:
        if name not in chosen:
            continue
        if name not in ("machine", "predictions") and log.elapsed() + min(predicted[name], 30) > budget_s:
            log(f"{name}: skipped, {predicted[name]:.0f} s predicted and {budget_s - log.elapsed():.0f} s left")
            continue
        log(f"{name}: start ({predicted[name]:.0f} s predicted)")
        try:
            if name in ("machine", "predictions"):
                {"machine": step_machine, "predictions": step_predictions}[name](setup, log)
            else:
                {"exactness": step_exactness, "calibrate": step_calibrate, "prefill": step_prefill,
                 "rank-part": step_rank_part, "decode-graphs": step_decode_graphs,
                 "prefill-peak": step_prefill_peak}[name](setup, log, budget_s)
        except Exception as e:  # noqa: BLE001 - a step that breaks is reported; the others still run
            failed.append(name)
            log(f"{name}: FAILED: {type(e).__name__}: {e}")
    log(f"done in {log.elapsed():.0f} s; files: {', '.join(sorted(p.name for p in out.iterdir()))}"
        + (f"; failed: {', '.join(failed)}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
