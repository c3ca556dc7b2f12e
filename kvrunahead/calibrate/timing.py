"""Timing for ``kvr-calibrate``: the median of repeated runs (the GPU's queue drained around each), and the fit of
a cost formula to the times."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import numpy as np


def synchronize() -> None:
    """Wait for the GPU's queued kernels (a CUDA call returns before its kernel ends); nothing on CPU."""
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()


def timed_runs(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` runs of ``fn`` after one warm-up (allocations, kernel selection)."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return times


def median_time(fn: Callable[[], object], repeats: int) -> float:
    return statistics.median(timed_runs(fn, repeats))


def read_bandwidth(repeats: int = 5) -> float:
    """Bytes per second of a float32 sum over 256 MB (far beyond the caches) on torch's current threads: the rate a
    memory-bound step (a decode step's weights) can stream at."""
    import torch

    x = torch.ones(64 * 2**20)
    return x.numel() * x.element_size() / median_time(lambda: x.sum(), repeats)


def fit(columns: list[list[float]], times: list[float]) -> tuple[np.ndarray, float]:
    """Non-negative least squares in relative error; returns the coefficients and the worst residual."""
    from scipy.optimize import nnls

    a = np.array(columns, dtype=float).T
    t = np.array(times, dtype=float)
    coef, _ = nnls(a / t[:, None], np.ones_like(t))
    worst = float(np.max(np.abs(a @ coef - t) / t))
    return coef, worst
