"""Where and how a rank computes: its device, its dtype and its threads."""

from __future__ import annotations

import os
import resource

import torch

from kvrunahead.config import RunConfig
from kvrunahead.errors import InputError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_device(spec: str) -> None:
    """One line when ``--device cuda`` cannot be had, before anything is loaded or any rank starts."""
    if spec != "cuda" or torch.cuda.is_available():
        return
    if torch.version.cuda is None:
        why = f"this torch ({torch.__version__}) is built without CUDA"
    else:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = "no CUDA device is visible" + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
    raise InputError(f"--device cuda asked for, but {why}; run on a machine with a GPU, or give --device cpu")


def resolve_device(spec: str, local_rank: int) -> torch.device:
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cuda":
        check_device(spec)
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_dtype(cfg: RunConfig, device: torch.device) -> torch.dtype:
    name = cfg.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if name not in DTYPES:
        raise InputError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def oversubscribed(threads: int, local_world_size: int) -> bool:
    """More busy threads on this node than it has cores: the ranks time-share them, and timings measure the
    scheduler as much as the work."""
    return threads * local_world_size > (os.cpu_count() or 1)


def default_threads(local_world_size: int) -> int:
    if os.environ.get("OMP_NUM_THREADS"):
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, (os.cpu_count() or 1) // local_world_size)


def peak_memory_bytes(device: torch.device) -> int:
    """The peak since ``reset_peak_memory``: allocated on a GPU; resident (the weights included) on a CPU, where
    Linux keeps it as VmHWM (elsewhere the process's lifetime peak)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def reset_peak_memory(device: torch.device) -> None:
    """Start the peak over (before a timed prefill): a process that ran other prefills, or loaded the whole model
    before a pipeline stage's, reports this one's peak."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident size
    except OSError:
        pass
