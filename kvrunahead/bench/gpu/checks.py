"""The GPU campaign's checks: the machine, exactness on the device, kvr-calibrate's profile there, and the simulator
beside every measurement."""

from __future__ import annotations

import contextlib
import datetime
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys

from kvrunahead.bench.gpu.plan import (
    CHAIN_RANKS,
    NEEDS,
    PEER_MODES,
    REPO,
    Log,
    Setup,
    model_configs,
    part_s,
    predicted_steps,
    run_profile,
    write_row,
)

# ---------------------------------------------------------------- step 1: the machine

def step_machine(setup: Setup, log: Log) -> None:
    import torch
    import transformers

    info = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__,
            "device": setup.device, "cpu_count": os.cpu_count(), "commit": _commit()}
    if setup.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(), gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count, capability=f"{props.major}.{props.minor}",
                    driver=_driver())
    missing = []
    for name in NEEDS:
        try:
            importlib.import_module(name)
            info.setdefault("versions", {})[name] = importlib.metadata.version(name)
        except ImportError as e:
            missing.append(f"{name} ({e})")
    info["missing"] = missing
    (setup.out / "machine.json").write_text(json.dumps(info, indent=1) + "\n")
    log("machine: " + ", ".join(f"{k} {info.get(k)}" for k in ("gpu", "gpu_memory_gib", "driver", "torch", "cuda",
                                                                  "transformers") if k in info))
    if missing:
        raise RuntimeError(f"missing: {', '.join(missing)}")


def _commit() -> str:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# ---------------------------------------------------------------- step 2: exactness

def step_exactness(setup: Setup, log: Log, deadline: float) -> None:
    # only the plugins the suite needs: another installed plugin (langsmith's, say) may import what is absent there
    env = dict(os.environ, KVR_TEST_DEVICE=setup.device, PYTHONPATH=_pythonpath(), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    timeout = ["-p", "pytest_timeout"] if importlib.util.find_spec("pytest_timeout") else []
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *timeout, "tests/test_gpu.py"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=max(30.0, deadline - log.elapsed()))
    text = done.stdout + done.stderr
    (setup.out / "exactness.txt").write_text(" ".join(cmd) + "\n\n" + text)
    tail = text.strip().splitlines()[-1] if text.strip() else "(no output)"
    log(f"exactness on {setup.device}: {tail}")
    if done.returncode != 0:
        raise RuntimeError(f"the exactness suite failed on {setup.device} (exactness.txt)")


def _pythonpath() -> str:
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)


# ---------------------------------------------------------------- step 3: kvr-calibrate on the GPU

@contextlib.contextmanager
def no_later_than(seconds: float):
    """TimeoutError in this (the main) thread once ``seconds`` have passed: a step that overruns its plan ends and
    leaves the budget to the steps after it."""
    import signal

    def stop(*_):
        raise TimeoutError(f"still running after {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, max(1.0, seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def step_calibrate(setup: Setup, log: Log, deadline: float) -> None:
    from kvrunahead.calibrate.calibrate import calibrate
    from kvrunahead.sim.profile import describe_profile, keep_builtin_links

    # at most twice its plan, and never into the time the timing steps need
    with no_later_than(min(2 * predicted_steps(setup)["calibrate"], deadline - log.elapsed())):
        if setup.tiny:
            profile = calibrate("tiny-llama", "float32", 1, (), repeats=1, quick=True, on_step=log,
                                device=setup.device)
        else:
            profile = calibrate("llama-7b", "bfloat16", 1, (), repeats=setup.repeats, on_step=log, device="cuda")
    keep_builtin_links(profile)
    profile.save(setup.out / "profile.json")
    for line in describe_profile(profile).splitlines():
        log(line)

# ---------------------------------------------------------------- step 8: the simulator beside the measurements

def step_predictions(setup: Setup, log: Log) -> None:
    from kvrunahead.sim.costmodel import CostModel
    from kvrunahead.sim.plan import plan
    from kvrunahead.sim.profile import builtin_profiles
    from kvrunahead.sim.shape import shape_from_config
    from kvrunahead.sim.simulate import simulate

    measured = run_profile(setup) if (setup.out / "profile.json").exists() else None
    profiles = {"built-in h100-nvlink (public figures)": builtin_profiles()["h100-nvlink"]}
    if measured is not None:
        profiles["measured on this GPU"] = measured
    dtype = "float32" if setup.tiny else "bfloat16"
    configs = model_configs(setup.tiny)
    rows = [json.loads(line) for line in (setup.out / "timings.jsonl").read_text().splitlines()] \
        if (setup.out / "timings.jsonl").exists() else []
    out = setup.out / "predictions.jsonl"
    lines = ["# GPU campaign", "", f"Machine: {_machine_line(setup)}", "",
             "## One GPU: measured against the simulator (relative error = predicted / measured - 1)", "",
             "| what | model | context | measured s | " + " | ".join(profiles) + " |",
             "|---|---|---:|---:|" + "---:|" * len(profiles)]
    for row in rows:
        if "ttft_s" not in row or row["kind"] not in ("single-prefill", "kvr-last-rank"):
            continue
        config = configs[row["model"]]
        cells = []
        for label, profile in profiles.items():
            cost = CostModel(shape_from_config(config, dtype, row["model"]), profile)
            if row["kind"] == "single-prefill":
                predicted = simulate(cost, "single", row["context"], 1).ttft_s
            else:
                start, end = row["part"]
                predicted = part_s(cost, end - start, start)
            error = predicted / row["ttft_s"] - 1
            write_row(out, {"kind": row["kind"], "model": row["model"], "context": row["context"], "profile": label,
                            "measured_s": row["ttft_s"], "predicted_s": predicted, "relative_error": error})
            cells.append(f"{predicted:.4f} ({error:+.0%})")
        lines.append(f"| {row['kind']} | {row['model']} | {row['context']} | {row['ttft_s']:.4f} | "
                     + " | ".join(cells) + " |")
    if measured is not None:
        lines += ["", f"## {CHAIN_RANKS} GPUs: PREDICTIONS from the measured profile (links: its built-in NVLink "
                  "figures, not measured)", "", "| model | context | single s | " + " | ".join(PEER_MODES) + " |",
                  "|---|---:|---:|" + "---:|" * len(PEER_MODES)]
        for name, config in configs.items():
            cost = CostModel(shape_from_config(config, dtype, name), measured)
            for n in setup.predict_contexts:
                options = plan(cost, n, CHAIN_RANKS, PEER_MODES, "split", ranks=[CHAIN_RANKS])
                single = next(o for o in options if o.mode == "single").ttft_s
                by_mode = {o.mode: o for o in options if o.ranks == CHAIN_RANKS}
                for o in by_mode.values():
                    write_row(out, {"kind": "prediction-8gpu", "model": name, "context": n, "mode": o.mode,
                                    "ranks": CHAIN_RANKS, "predicted_s": o.ttft_s,
                                    "speedup_vs_single": single / o.ttft_s, "boundaries": list(o.boundaries),
                                    "profile": "measured on this GPU"})
                lines.append(f"| {name} | {n} | {single:.4f} | " + " | ".join(
                    f"{by_mode[m].ttft_s:.4f} ({single / by_mode[m].ttft_s:.2f}x)" for m in PEER_MODES) + " |")
    (setup.out / "summary.md").write_text("\n".join(lines) + "\n")
    log(f"predictions: {len(rows)} measured rows compared; summary.md written")


def _machine_line(setup: Setup) -> str:
    path = setup.out / "machine.json"
    if not path.exists():
        return setup.device
    m = json.loads(path.read_text())
    return ", ".join(f"{k} {m[k]}" for k in ("gpu", "driver", "torch", "cuda", "transformers", "commit") if k in m)
