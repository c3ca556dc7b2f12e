"""The GPU campaign's plan: the shapes, contexts and files, and each step's seconds predicted from the built-in GPU
profile (what ``--budget-s`` skips by)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]  # the checkout (the campaign runs its tests)
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


def run_profile(setup: Setup):
    """The profile this run measured, else the built-in H100 one."""
    from kvrunahead.sim.profile import HardwareProfile, builtin_profiles

    path = setup.out / "profile.json"
    return HardwareProfile.load(path) if path.exists() else builtin_profiles()["h100-nvlink"]
