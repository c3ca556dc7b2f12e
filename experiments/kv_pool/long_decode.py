"""A decode step of the server's decoder (``BatchDecoder``) after one long prompt, in one process on 2 threads:
SmolLM2-135M in float32, a random K,V cache of 1k, 8k and 16k positions, the time its ``add`` takes (the prompt's
K,V into the decoder's own K,V) and the median of 10 steps after 2. Run from a worktree of an older commit
(``PYTHONPATH=<tree>``) to compare; prints one line per length.

    python experiments/kv_pool/long_decode.py
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import DynamicCache

from kvrunahead.model.layout import probe_kv_layout
from kvrunahead.model.load import load_model
from kvrunahead.serve.step.batch_decode import BatchDecoder


def main() -> None:
    torch.set_num_threads(2)
    model = load_model("smollm2-135m", torch.float32, torch.device("cpu")).model
    layout = probe_kv_layout(model)
    for n in (1024, 8192, 16384):
        decoder = BatchDecoder(model, batched=True, layout=layout)
        cache = DynamicCache(config=model.config)
        for i, layer in enumerate(cache.layers):
            keys = torch.randn(1, layout.heads[i], n, layout.head_dim[i])
            layer.lazy_initialization(keys, keys)
            layer.keys, layer.values = keys, keys.clone()
        t0 = time.perf_counter()
        decoder.add("r", cache)
        add_s = time.perf_counter() - t0
        times = []
        for step in range(12):
            t0 = time.perf_counter()
            decoder.step({"r": 5}, {"r": n + step})
            times.append(time.perf_counter() - t0)
        step_ms = statistics.median(times[2:]) * 1e3
        print(f"float32 {n:>6} positions: add {add_s * 1e3:6.1f} ms, step median {step_ms:6.1f} ms", flush=True)


if __name__ == "__main__":
    main()
