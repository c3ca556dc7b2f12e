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


BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # the CPU instructions that make bfloat16 GEMMs faster than float32's


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags, as Linux lists them (empty where /proc/cpuinfo is not there)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def fast_dtype(device_kind: str, model_dtype: str | None = None) -> str:
    """``--dtype auto``: what the hardware is fast in. On a GPU the model's own 16-bit dtype (bfloat16 for a
    checkpoint stored in float32); on a CPU with avx512_bf16 or AMX bfloat16, unless this CPU's linears were timed
    faster in float32 (``kvr-kernels``: an AVX-512 Xeon without AMX runs float32's GEMMs faster than bfloat16's);
    else float32 (a CPU without them computes bfloat16 by conversion, slower than float32)."""
    if device_kind == "cuda":
        return model_dtype if model_dtype in ("bfloat16", "float16") else "bfloat16"
    if not cpu_flags() & set(BF16_FLAGS):
        return "float32"
    rates = gemm_rates()
    return "bfloat16" if rates["bfloat16"] > rates["float32"] else "float32"


def gemm_rates() -> dict[str, float]:
    """The linears' GEMM rate in each dtype on this CPU (GFLOP/s, the faster of oneDNN's and F.linear's): timed once
    per machine and torch version (model.linears), read afterwards."""
    from kvrunahead.model import linears

    return {dtype: max(pick["onednn_gflops"], pick["torch_gflops"]) for dtype, pick in linears.auto_choice().items()}


def dtype_name(requested: str | None, device_kind: str, model_dtype: str | None = None) -> str:
    """The dtype a run computes in: the one asked for; ``auto``, the fast one; none, float32 on a CPU and
    bfloat16 on a GPU."""
    if requested == "auto":
        return fast_dtype(device_kind, model_dtype)
    name = requested or ("bfloat16" if device_kind == "cuda" else "float32")
    if name not in DTYPES:
        raise InputError(f"unknown dtype {name!r}: use one of auto, {', '.join(DTYPES)}")
    return name


def config_dtype(config) -> str | None:
    """The dtype a transformers config says its weights are stored in, by name."""
    dtype = getattr(config, "dtype", None)
    return str(dtype).removeprefix("torch.") if dtype is not None else None


def resolve_dtype(cfg: RunConfig, device: torch.device, model_dtype: str | None = None) -> torch.dtype:
    return DTYPES[dtype_name(cfg.dtype, device.type, model_dtype)]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work: a timer read after it measures the work, not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


_RESIDENT = {"peak": 0}  # the highest resident size of this process before the last reset of its peak


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) * 1024
    except (OSError, StopIteration):
        return None


def resident_bytes() -> int:
    """This process's resident size now (Linux's VmRSS; 0 where it is not known)."""
    return _status_bytes("VmRSS") or 0


def lifetime_peak_resident_bytes() -> int:
    """This process's highest resident size since it started, across the resets of ``reset_peak_memory``."""
    now = _status_bytes("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return max(_RESIDENT["peak"], now)


def reset_peak_memory(device: torch.device) -> None:
    """Start the peak over (before a timed prefill): a process that ran other prefills, or loaded the whole model
    before a pipeline stage's, reports this one's peak (the lifetime peak is kept, for
    ``lifetime_peak_resident_bytes``)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    _RESIDENT["peak"] = lifetime_peak_resident_bytes()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident size
    except OSError:
        pass


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of a model's parameters (a tied embedding counted once)."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
