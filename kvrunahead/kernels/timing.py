"""``--attention-kernel auto``'s measurement: our kernel and torch's timed on the same work in each dtype, at this
process's threads. Two cases weigh equally: a causal block (a prefill's diagonal, 2048 queries) and a decode step
(one query over 8192 keys), both of SmolLM2's shape (9 query heads over 3 K,V heads of 64). Our kernel's prefill
rows are timed on both its paths first (the tiles and the vector path: which is faster depends on the CPU, the
vector path on AVX-512, the tiles on AVX2 and AMX), and ours runs on the faster."""

from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.nn.functional as F

from kvrunahead.kernels import tiles_variable

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
BLOCK, CONTEXT = 2048, 8192
RUNS = 3


def time_kernels(dtypes: tuple[str, ...]) -> dict[str, dict]:
    """Per dtype: each kernel's rate over both cases (GFLOP/s) and the faster one."""
    picks = {}
    for name in dtypes:
        dtype = getattr(torch, name)
        cases = [_case(BLOCK, BLOCK, dtype, causal=True), _case(1, CONTEXT, dtype, causal=False)]
        flops = sum(case[-1] for case in cases)
        paths = {}
        for on in (True, False):
            with tiles(name, on):
                paths[on] = best_time(lambda c=cases[0]: _ours(*c[:4]))
        on = paths[True] < paths[False]
        with tiles(name, on):
            ours = sum(best_time(lambda c=c: _ours(*c[:4])) for c in cases)
        theirs = sum(best_time(lambda c=c: _torch(*c[:4])) for c in cases)
        picks[name] = {"kernel": "ours" if ours <= theirs else "torch", "ours_gflops": flops / ours / 1e9,
                       "torch_gflops": flops / theirs / 1e9, "tiles": on,
                       "tiles_gflops": cases[0][-1] / paths[True] / 1e9,
                       "vector_gflops": cases[0][-1] / paths[False] / 1e9}
    return picks


@contextlib.contextmanager
def tiles(dtype: str, on: bool):
    """Our kernel's prefill rows in ``dtype`` on its tile path (``on``) or its vector path, within the block."""
    name = tiles_variable(dtype)
    before = os.environ.get(name)
    os.environ[name] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _case(queries: int, keys: int, dtype: torch.dtype, causal: bool):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, queries, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(1, KV_HEADS, keys, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(1, KV_HEADS, keys, HEAD_DIM, generator=g).to(dtype)
    pairs = queries * keys / 2 if causal else queries * keys
    return q, k, v, causal, 4 * pairs * HEADS * HEAD_DIM


def _ours(q, k, v, causal) -> None:
    from kvrunahead.kernels.attention import block

    block(q, k, v, q_position=k.shape[2] - q.shape[2], causal=True)


def _torch(q, k, v, causal) -> None:
    F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def best_time(run) -> float:
    """The fastest of RUNS runs of ``run()`` after one untimed (what it builds on first use)."""
    run()  # warm: the first call builds what it needs
    times = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return min(times)
