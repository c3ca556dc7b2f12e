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

import contextlib
import datetime
import functools
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click

REPO = Path(__file__).resolve().parents[2]
CONTEXTS = (4096, 16384, 32768, 65536, 131072)
PREDICT_CONTEXTS = (16384, 32768, 65536, 131072)
CHAIN_RANKS = 8
PEER_MODES = ("kvr", "tsp", "cp-allgather", "ring")
# What the campaign imports; the GPU machine's image lacks gguf, fastapi, uvicorn and pydantic, which the serving
# side needs and the campaign does not.
NEEDS = ("torch", "transformers", "safetensors", "accelerate", "numpy", "scipy", "click", "pytest")
FILES = ("machine.json", "exactness.txt", "profile.json", "timings.jsonl", "predictions.jsonl", "summary.md",
         "campaign.log")
DECODE_BATCHES = (1, 8, 32)
DECODE_CONTEXT = 512
PEAK_CONTEXT = 16384
# Dense bf16 tensor-core peaks of the data sheets (TFLOP/s, without sparsity), by a word of the device's name.
SHEET_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0}


@dataclass(frozen=True)
class Setup:
    device: str
    tiny: bool
    out: Path
    repeats: int
    contexts: tuple[int, ...]
    predict_contexts: tuple[int, ...]


def model_configs(tiny: bool) -> dict:
    """The shapes timed, as transformers configs: the paper's Llama-7B and SmolLM2-135M-Instruct (the shape of the
    GGUF the project serves: 30 layers of 576, 9 query and 3 K,V heads of 64, tied embeddings). Tiny: two small
    Llama configs through the same code."""
    from transformers import LlamaConfig

    from kvrunahead.model.load import PRESETS

    if tiny:
        small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=8192)
        return {"llama-7b": LlamaConfig(vocab_size=512, **small),
                "smollm2-135m": LlamaConfig(vocab_size=512, tie_word_embeddings=True, **small)}
    llama = PRESETS["llama-7b"]()
    llama.max_position_embeddings = max(CONTEXTS)
    smol = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=max(CONTEXTS),
                       rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    return {"llama-7b": llama, "smollm2-135m": smol}


class Log:
    """Lines to stdout and to campaign.log, with the seconds since the start."""

    def __init__(self, path: Path) -> None:
        self.start = time.perf_counter()
        self.file = path.open("a")

    def __call__(self, text: str) -> None:
        line = f"[{self.elapsed():6.1f} s] {text}"
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def write_row(path: Path, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


# ---------------------------------------------------------------- the plan: predicted seconds per step

def gpu_cost(config, dtype: str = "bfloat16"):
    from kvrunahead.sim.costmodel import CostModel
    from kvrunahead.sim.profile import builtin_profiles
    from kvrunahead.sim.shape import shape_from_config

    return CostModel(shape_from_config(config, dtype, "plan"), builtin_profiles()["h100-nvlink"])


def part_s(cost, tokens: float, prefix: float) -> float:
    """The simulator's seconds for the last rank of a KVR chain: its part of ``tokens`` after ``prefix`` (split
    attention, nothing waited for) and the LM head on its last token."""
    return cost.layers * cost.rank_layer_s("split", tokens, prefix) + cost.lm_head_s()


def predicted_steps(setup: Setup) -> dict[str, float]:
    """Seconds each step should take on one H100, from the built-in h100-nvlink profile (public figures) plus
    fixed costs for what it does not model (start-up, drawing 7B random weights, the exactness suite's cases)."""
    from kvrunahead.sim.simulate import simulate

    if setup.tiny:
        return {"machine": 2, "exactness": 30, "calibrate": 60, "prefill": 20, "rank-part": 20, "decode-graphs": 20,
                "prefill-peak": 60, "predictions": 10}
    configs = model_configs(False)
    calibrate = 30 + calibrate_s(gpu_cost(configs["llama-7b"]), setup.repeats)
    runs = setup.repeats + 1  # a warm-up each
    prefill = rank = 0.0
    for config in configs.values():
        cost = gpu_cost(config)
        for n in setup.contexts:
            prefill += runs * simulate(cost, "single", n, 1).ttft_s
            # the last rank of an even 8-way chain (an upper bound on an uneven one's last part)
            rank += runs * part_s(cost, n / CHAIN_RANKS, n - n / CHAIN_RANKS)
    llama = gpu_cost(configs["llama-7b"])
    # drawing the model and filling each batch's cache (a prefill of batch x 512 tokens); the steps themselves
    # (about 50 of a few ms each) are in the 20 s
    decode = 20 + sum(simulate(llama, "single", b * DECODE_CONTEXT, 1).ttft_s for b in DECODE_BATCHES)
    peak = 90 + 2 * runs * simulate(llama, "single", PEAK_CONTEXT, 1).ttft_s  # 90 s: compiling the 7B stack
    return {"machine": 5, "exactness": 70, "calibrate": calibrate, "prefill": 20 + prefill, "rank-part": 20 + rank,
            "decode-graphs": decode, "prefill-peak": peak, "predictions": 15}


def calibrate_s(cost, repeats: int) -> float:
    """kvr-calibrate --device cuda's timed work, each point a warm-up and ``repeats`` runs: its projections over 4
    layers, its three attention kernels at every shape, its decode steps and whole prefills (the fixed costs,
    drawing the 7B model and the decode caches, are the caller's)."""
    from kvrunahead.calibrate.calibrate import DECODE_KEYS, GPU_WHOLE_TOKENS, LINEAR_LAYERS, _shapes
    from kvrunahead.sim.simulate import simulate

    linear, shapes = _shapes(False, gpu=True)
    work = sum(LINEAR_LAYERS * (cost.qkv_s(n) + cost.other_s(n)) for n in linear)
    work += sum(cost.causal_s(q) + cost.full_s(q, k) + cost.masked_s(q, k) for q, k in shapes)
    work += sum(cost.layers * cost.decode_attention_s(n) for n in DECODE_KEYS)
    work += sum(simulate(cost, "single", n, 1).ttft_s for n in GPU_WHOLE_TOKENS)
    return (repeats + 1) * work


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
def _no_later_than(seconds: float):
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
    from kvrunahead.cli.sim import describe, keep_builtin_links

    # at most twice its plan, and never into the time the timing steps need
    with _no_later_than(min(2 * predicted_steps(setup)["calibrate"], deadline - log.elapsed())):
        if setup.tiny:
            profile = calibrate("tiny-llama", "float32", 1, (), repeats=1, quick=True, on_step=log,
                                device=setup.device)
        else:
            profile = calibrate("llama-7b", "bfloat16", 1, (), repeats=setup.repeats, on_step=log, device="cuda")
    keep_builtin_links(profile)
    profile.save(setup.out / "profile.json")
    for line in describe(profile).splitlines():
        log(line)


# ---------------------------------------------------------------- steps 4 and 5: timing on one GPU

def _build(config, setup: Setup):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if setup.tiny else torch.bfloat16
    torch.manual_seed(0)
    with torch.device(setup.device):  # random weights drawn on the device: real ones do not travel
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def _time(fn, repeats: int) -> tuple[float, list[float]]:
    from kvrunahead.calibrate.timing import timed_runs

    times = timed_runs(fn, repeats)
    return statistics.median(times), times


@contextlib.contextmanager
def _peak_memory(row: dict, device: str):
    import torch

    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    yield
    if device == "cuda":
        row["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)


def _measure(setup: Setup, log: Log, row: dict, fn, predicted_s: float, deadline: float) -> None:
    """Time ``fn`` into ``row`` (or say why not: out of memory, over the budget) and write the row."""
    import torch

    if log.elapsed() + (setup.repeats + 1) * predicted_s > deadline:
        row["skipped"] = "over the budget"
    else:
        try:
            with _peak_memory(row, setup.device):
                row["ttft_s"], row["times_s"] = _time(fn, setup.repeats)
            row["tokens_per_s"] = round(row["tokens"] / row["ttft_s"], 1)
        except torch.OutOfMemoryError as e:
            row["skipped"] = f"out of memory: {str(e).splitlines()[0][:160]}"
            torch.cuda.empty_cache()
    write_row(setup.out / "timings.jsonl", row)
    log(f"{row['kind']} {row['model']} {row['context']}: "
        + (f"{row['ttft_s']:.4f} s, {row['tokens_per_s']:.0f} tok/s, peak {row.get('peak_memory_gib', '-')} GiB"
           if "ttft_s" in row else row["skipped"]))


def step_prefill(setup: Setup, log: Log, deadline: float) -> None:
    """One prompt through the whole model on one GPU: the decoder layers without a cache (their K,V would hold
    64 GiB at 128k for Llama-7B: the time to compute them is what is measured), then the LM head on the last
    position."""
    import torch

    from kvrunahead.sim.simulate import simulate

    for name, config in model_configs(setup.tiny).items():
        model = _build(config, setup)
        cost = gpu_cost(config)
        for n in setup.contexts:
            ids = torch.randint(0, config.vocab_size, (1, n), device=setup.device)

            @torch.no_grad()
            def run(ids=ids, model=model):
                hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state
                return model.lm_head(hidden[:, -1:])

            row = {"kind": "single-prefill", "model": name, "context": n, "tokens": n, "device": setup.device,
                   "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}
            _measure(setup, log, row, run, simulate(cost, "single", n, 1).ttft_s, deadline)
            del ids
        del model
        _empty(setup.device)


def chain_part(context: int, config, profile) -> tuple[int, int]:
    """The last rank's part of an 8-rank KVR chain at ``context``: the partition the cost model finds on
    ``profile`` (the measured one where calibrate ran, else the built-in)."""
    from kvrunahead.sim.costmodel import CostModel
    from kvrunahead.sim.optimize import search_partition
    from kvrunahead.sim.shape import shape_from_config

    cost = CostModel(shape_from_config(config, "bfloat16", "part"), profile)
    b = search_partition(cost, context, CHAIN_RANKS, "split", None,
                         min_stride=min(max(16, context // 1024), context // (2 * CHAIN_RANKS))).boundaries
    return b[-2], b[-1]


def step_rank_part(setup: Setup, log: Log, deadline: float) -> None:
    """The last rank of an 8-GPU chain: its part's forward through the runtime's chain code (``kvr_prefill``,
    split attention), its prefix K,V already on the GPU (the no-communication bound: what the rank computes, not
    what it waits for). One random prefix tensor serves every layer (the attention reads it all the same; 32
    distinct ones would hold 56 GiB at 128k), and the rank keeps only its own part's K,V, as a server's ranks
    do."""
    import torch

    from kvrunahead.model.layout import probe_kv_layout
    from kvrunahead.modes.kvr import LocalPrefixLink, OwnPartLink, kvr_prefill
    from kvrunahead.ranks.transport import LocalTransport

    class LastRankLink(LocalPrefixLink):
        """The last rank, in one process: its prefix is local, nothing goes on, its cache keeps its own part."""

        @property
        def has_prev(self) -> bool:
            return self.prefix_len > 0

        keep = OwnPartLink.keep

    profile = _profile(setup)
    for name, config in model_configs(setup.tiny).items():
        model = _build(config, setup)
        layout = probe_kv_layout(model)
        cost = gpu_cost(config)
        for n in setup.contexts:
            start, end = chain_part(n, config, profile)
            ids = torch.randint(0, config.vocab_size, (1, end - start), device=setup.device)
            prefix = torch.randn(layout.kv_shape(0, start), device=setup.device).to(layout.dtype)

            def run(ids=ids, start=start, prefix=prefix, model=model, layout=layout):
                link = LastRankLink(LocalTransport(), start, layout, torch.device(setup.device))
                link.prefixes = [prefix] * layout.num_layers
                return kvr_prefill(model, ids, link, "split")

            row = {"kind": "kvr-last-rank", "model": name, "context": n, "ranks": CHAIN_RANKS, "part": [start, end],
                   "tokens": end - start, "device": setup.device, "partition_profile": profile.name}
            predicted = part_s(cost, end - start, start)
            _measure(setup, log, row, run, predicted, deadline)
            del ids, prefix
        del model
        _empty(setup.device)


def _empty(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _profile(setup: Setup):
    """The profile this run measured, else the built-in H100 one."""
    from kvrunahead.sim.profile import HardwareProfile, builtin_profiles

    path = setup.out / "profile.json"
    return HardwareProfile.load(path) if path.exists() else builtin_profiles()["h100-nvlink"]


# ---------------------------------------------------------------- step 6: decode steps as CUDA graphs

def step_decode_graphs(setup: Setup, log: Log, deadline: float) -> None:
    """One decode step of Llama-7B's shape (random bf16 weights) at each batch size, every row behind a
    512-token prompt in a static cache (transformers' ``StaticCache``: fixed addresses, what a graph needs): the
    eager step, then the same step captured once as a CUDA graph and replayed. Rows: time per output token of
    each and their ratio; the replay's logits against the eager step's. On a CPU (the dry run) the graph is not
    captured and the row says so."""
    config = model_configs(setup.tiny)["llama-7b"]
    model = _build(config, setup)
    context = 32 if setup.tiny else DECODE_CONTEXT
    for batch in (1, 2) if setup.tiny else DECODE_BATCHES:
        row = {"kind": "decode-step", "model": "llama-7b", "batch": batch, "context": context, "tokens": batch,
               "device": setup.device, "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}
        if log.elapsed() > deadline:
            row["skipped"] = "over the budget"
            write_row(setup.out / "timings.jsonl", row)
            continue
        try:
            row.update(_decode_graph_row(model, config, batch, context, setup))
        except Exception as e:  # noqa: BLE001 - a capture that fails is a finding: its row says why
            row["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        write_row(setup.out / "timings.jsonl", row)
        log(f"decode-step llama-7b batch {batch}: " + (
            f"eager {row['eager_s'] * 1e3:.2f} ms, graph "
            + (f"{row['graph_s'] * 1e3:.2f} ms ({row['speedup']:.2f}x)" if "graph_s" in row else row["graph"])
            if "eager_s" in row else row.get("failed", row.get("skipped", ""))))
        _empty(setup.device)
    del model
    _empty(setup.device)


def _decode_graph_row(model, config, batch: int, context: int, setup: Setup) -> dict:
    import torch
    from transformers import StaticCache

    device = setup.device
    with torch.no_grad():
        cache = StaticCache(config=config, max_cache_len=context + 64)  # every step writes the same slot
        prompt = torch.randint(0, config.vocab_size, (batch, context), device=device)
        model(input_ids=prompt, past_key_values=cache, cache_position=torch.arange(context, device=device),
              use_cache=True, logits_to_keep=1)
        ids = torch.randint(0, config.vocab_size, (batch, 1), device=device)
        position = torch.tensor([context], device=device)

        def step():
            return model(input_ids=ids, past_key_values=cache, cache_position=position, use_cache=True).logits

        eager_logits = step().float()
        out = {}
        out["eager_s"], out["eager_times_s"] = _time(step, setup.repeats)
        if device != "cuda":
            out["graph"] = "not captured: no CUDA device"
            return out
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        graph.replay()
        torch.cuda.synchronize()
        out["graph_max_abs_logit_diff"] = float((captured.float() - eager_logits).abs().max())
        out["graph_s"], out["graph_times_s"] = _time(graph.replay, setup.repeats)
        out["speedup"] = out["eager_s"] / out["graph_s"]
        del graph, captured
    return out


# ---------------------------------------------------------------- step 7: the 16k prefill against the dense peak

def step_prefill_peak(setup: Setup, log: Log, deadline: float) -> None:
    """Llama-7B's shape (random bf16 weights), one 16k prompt through the decoder layers and the LM head on its
    last position, eager and then compiled (``torch.compile`` of the decoder stack, inductor); its FLOPs counted
    as the cost model counts them (projections, MLP, causal attention pairs, one LM-head row). The peak: a
    8192-cube bf16 matmul timed on the device, and the data sheet's dense figure where the name is known."""
    import torch

    from kvrunahead.sim.flops import part_flops
    from kvrunahead.sim.simulate import simulate

    config = model_configs(setup.tiny)["llama-7b"]
    n = 256 if setup.tiny else PEAK_CONTEXT
    size = 256 if setup.tiny else 8192
    dtype = torch.float32 if setup.tiny else torch.bfloat16
    a = torch.randn(size, size, device=setup.device, dtype=dtype)
    b = torch.randn(size, size, device=setup.device, dtype=dtype)
    peak_s, _ = _time(functools.partial(torch.matmul, a, b), setup.repeats)
    measured_peak = 2.0 * size**3 / peak_s
    sheet = next((v for k, v in SHEET_BF16_TFLOPS.items() if setup.device == "cuda"
                  and k in torch.cuda.get_device_name()), None)
    del a, b
    log(f"prefill-peak: {size}^3 matmul {measured_peak / 1e12:.1f} TFLOP/s"
        + (f", data sheet {sheet:.0f}" if sheet else ""))
    model = _build(config, setup)
    flops = part_flops(config, 0, n, "split", lm_head_rows=1)
    ids = torch.randint(0, config.vocab_size, (1, n), device=setup.device)
    cost = gpu_cost(config)
    for compiled in (False, True):
        if compiled:
            model.base_model.compile(dynamic=False)

        @torch.no_grad()
        def run(ids=ids, model=model):
            hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state
            return model.lm_head(hidden[:, -1:])

        row = {"kind": "prefill-peak", "model": "llama-7b", "context": n, "tokens": n, "device": setup.device,
               "compiled": compiled, "flops": flops, "matmul_peak_flops_per_s": measured_peak,
               "sheet_peak_tflops": sheet}
        if log.elapsed() + (setup.repeats + 2) * simulate(cost, "single", n, 1).ttft_s + 90 * compiled > deadline:
            row["skipped"] = "over the budget"
        else:
            if compiled:
                t0 = time.perf_counter()
                run()  # the compile, outside the timing
                row["compile_s"] = time.perf_counter() - t0
            row["ttft_s"], row["times_s"] = _time(run, setup.repeats)
            row["flops_per_s"] = flops / row["ttft_s"]
            row["share_of_matmul_peak"] = row["flops_per_s"] / measured_peak
            if sheet:
                row["share_of_sheet_peak"] = row["flops_per_s"] / (sheet * 1e12)
        write_row(setup.out / "timings.jsonl", row)
        log(f"prefill-peak {'compiled' if compiled else 'eager'} {n}: " + (
            f"{row['ttft_s']:.4f} s, {row['flops_per_s'] / 1e12:.1f} TFLOP/s, "
            f"{row['share_of_matmul_peak']:.1%} of the matmul's"
            + (f", {row['share_of_sheet_peak']:.1%} of the sheet's" if sheet else "")
            if "ttft_s" in row else row["skipped"]))
    del model, ids
    _empty(setup.device)


# ---------------------------------------------------------------- step 8: the simulator beside the measurements

def step_predictions(setup: Setup, log: Log) -> None:
    from kvrunahead.sim.costmodel import CostModel
    from kvrunahead.sim.plan import plan
    from kvrunahead.sim.profile import builtin_profiles
    from kvrunahead.sim.shape import shape_from_config
    from kvrunahead.sim.simulate import simulate

    measured = _profile(setup) if (setup.out / "profile.json").exists() else None
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
