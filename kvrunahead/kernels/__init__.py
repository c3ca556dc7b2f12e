"""Kernels of our own, built from C++ on the machine that runs them.

``attention.cpp`` is the CPU attention every mode, the server and the one-process path call (``kvr::attention``, a
torch custom op). It is compiled on first use through ``torch.utils.cpp_extension`` into the project's cache folder
(``KVR_CACHE``, default ``~/.cache/kvrunahead``) and found there afterwards; ``kvr-kernels`` does it ahead of
time. Where it cannot be built (no compiler), the attention falls back to torch's kernels and says so once.

Which kernel runs: ``--attention-kernel ours|torch`` on every tool, or ``KVR_ATTENTION_KERNEL`` (the tools set it
for the ranks they start). ``ours`` is the default; it applies to CPU tensors only (a GPU runs torch's flash
attention).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path

from kvrunahead.choices import ATTENTION_KERNEL_ENV, ATTENTION_KERNELS
from kvrunahead.config import cache_root

log = logging.getLogger(__name__)

KERNELS = ATTENTION_KERNELS
ENV = ATTENTION_KERNEL_ENV
SOURCE = Path(__file__).with_name("attention.cpp")
CFLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"]  # OpenMP: at::parallel_for is inline

_lock = threading.Lock()
_state: dict = {}  # "loaded": bool once tried, "error": why it could not be built


def cache_dir() -> Path:
    root = cache_root()
    import torch

    tag = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:12]
    return root / "kernels" / f"torch-{torch.__version__}-{tag}"


def set_kernel(name: str) -> None:
    """Choose the attention kernel for this process and the ranks it starts."""
    if name not in KERNELS:
        raise ValueError(f"attention kernel {name!r}: one of {', '.join(KERNELS)}")
    os.environ[ENV] = name


def chosen() -> str:
    name = os.environ.get(ENV, "ours") or "ours"
    if name not in KERNELS:
        raise ValueError(f"{ENV}={name!r}: one of {', '.join(KERNELS)}")
    return name


def build(verbose: bool = False) -> bool:
    """Compile (or find compiled) and load the kernels; True when they are loaded. Safe to call from several
    threads and processes at once: the build folder is locked while one of them compiles."""
    with _lock:
        if "loaded" in _state:
            return _state["loaded"]
        import torch
        from torch.utils import cpp_extension

        folder = cache_dir()
        built = any(folder.glob("*.so"))
        try:
            if shutil.which(os.environ.get("CXX", "c++")) is None and not built:
                raise RuntimeError("no C++ compiler on PATH")
            folder.mkdir(parents=True, exist_ok=True)
            if not built:
                log.warning("building the CPU attention kernel into %s (once per machine and torch version, "
                            "about a minute)", folder)
            start = time.perf_counter()
            cpp_extension.load(name="kvr_kernels", sources=[str(SOURCE)], extra_cflags=CFLAGS,
                               extra_ldflags=["-fopenmp"], build_directory=str(folder), is_python_module=False,
                               verbose=verbose)
            if not built:
                log.warning("built the CPU attention kernel in %.0f s", time.perf_counter() - start)
            _state["loaded"] = hasattr(torch.ops.kvr, "attention")
        except Exception as e:  # noqa: BLE001 - any failure to build means the fallback, said once
            _state["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            log.warning("the CPU attention kernel could not be built (%s); attention runs on torch's kernels",
                        _state["error"])
            _state["loaded"] = False
        return _state["loaded"]


def why_not_built() -> str | None:
    return _state.get("error")


def ours_on_cpu() -> bool:
    """Whether CPU attention runs our kernel: chosen, and built (built now if it has not been)."""
    return chosen() == "ours" and build()


def isa() -> str | None:
    """The instruction set the kernel runs with on this CPU (``avx512bf16``, ``avx512``, ``avx2``, ``portable``),
    or None where it is not built."""
    if not build():
        return None
    import torch

    return torch.ops.kvr.isa()


def describe(device_type: str = "cpu") -> str:
    """The attention kernel a run on ``device_type`` uses, for its report: ``ours (avx512bf16)``, ``torch``, or
    ``torch (ours could not be built: ...)``."""
    if device_type != "cpu":
        return "torch"
    if chosen() == "torch":
        return "torch (chosen)"
    if not build():
        return f"torch (ours could not be built: {why_not_built()})"
    return f"ours ({isa()})"
