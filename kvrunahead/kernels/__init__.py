"""Kernels of our own, built from C++ on the machine that runs them.

``attention.cpp`` is the CPU attention every mode, the server and the one-process path call (``kvr::attention``, a
torch custom op). It is compiled on first use through ``torch.utils.cpp_extension`` into the project's cache folder
(``KVR_CACHE``, default ``~/.cache/kvrunahead``) and found there afterwards; ``kvr-kernels`` does it ahead of
time. Where it cannot be built (no compiler), the attention falls back to torch's kernels and says so once.

Which kernel runs: ``--attention-kernel auto|ours|torch`` on every tool, or ``KVR_ATTENTION_KERNEL`` (the tools set
it for the ranks they start); it applies to CPU tensors only (a GPU runs torch's flash attention). ``auto``, the
default, runs the faster on this CPU in each dtype: the first time it is asked (``kvr-kernels``, or a tool's first
run) ours and torch's are timed on a causal block and a decode step in float32 and bfloat16, and the choice and
both rates are kept beside the kernel (``choice.json``) and said once; so is the faster of our kernel's two paths
for prefill rows, which ``ours`` runs on too (``KVR_ATTENTION_TILES`` and ``KVR_ATTENTION_TILES_<DTYPE>``, 1 or 0,
force one).

A prefill's rows take the kernel's tile path (Q.K^T and P.V through ATen's batch-reduce GEMM: AMX tiles on a Xeon
that has them, oneDNN's AVX-512 or AVX2 micro-kernels elsewhere) or its vector path, whichever was timed faster;
decode rows take the vector path. ``path(dtype)``
says which a prefill row takes here.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
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
    """The setting: ``auto``, ``ours`` or ``torch``."""
    name = os.environ.get(ENV, "auto") or "auto"
    if name not in KERNELS:
        raise ValueError(f"{ENV}={name!r}: one of {', '.join(KERNELS)}")
    return name


TORCH_BATON = "lock"  # torch.utils.cpp_extension's lock file in the build folder
BUILD_LOCK = "build.flock"  # ours beside it, held (flock) while a process builds or loads


def build(verbose: bool = False) -> bool:
    """Compile (or find compiled) and load the kernels; True when they are loaded. Safe to call from several
    threads and processes at once: the build folder is locked (``flock``, let go when its process dies) while one of
    them compiles or loads."""
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
            with open(folder / BUILD_LOCK, "w") as held:
                fcntl.flock(held, fcntl.LOCK_EX)
                # torch's own lock is a file that a process killed mid-build leaves behind, and every later load
                # would wait on it forever; under ours no live process holds it.
                (folder / TORCH_BATON).unlink(missing_ok=True)
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


def ours_on_cpu(dtype=None) -> bool:
    """Whether CPU attention in ``dtype`` runs our kernel: chosen (by the setting, or by ``auto``'s timings), and
    built (built now if it has not been). ``dtype`` None: in any dtype."""
    name = chosen()
    if name == "torch" or not build():
        return False
    picks = auto_choice()  # with ours chosen too: which of its paths is faster here
    if name == "ours":
        return True
    if dtype is None:
        return any(pick["kernel"] == "ours" for pick in picks.values())
    pick = picks.get(str(dtype).removeprefix("torch."))
    return pick is None or pick["kernel"] == "ours"


CHOICE_FILE = "choice.json"
DTYPES = ("float32", "bfloat16")


def auto_choice() -> dict[str, dict]:
    """``auto``'s choice per dtype (``{"kernel": "ours" | "torch", "ours_gflops": .., "torch_gflops": ..}``): read
    from beside the kernel, or timed now and kept there (said once)."""
    with _lock:
        if "choice" in _state:
            return _state["choice"]

    def measure() -> dict[str, dict]:
        from kvrunahead.kernels.timing import time_kernels

        log.warning("timing the CPU attention kernels (once per kernel build: --attention-kernel auto)")
        return time_kernels(DTYPES)

    picks = kept_timings(cache_dir() / CHOICE_FILE, measure, describe_choice)
    for dtype, pick in picks.items():  # the faster of its paths, unless the user set one
        if "tiles" in pick:
            os.environ.setdefault(tiles_variable(dtype), "1" if pick["tiles"] else "0")
    with _lock:
        _state["choice"] = picks
    return picks


def timed() -> bool:
    """Whether ``auto``'s choice is known without timing anything now: read already, or kept beside a built kernel."""
    return "choice" in _state or (cache_dir() / CHOICE_FILE).exists()


def kept_timings(path: Path, measure, said) -> dict[str, dict]:
    """The per-dtype timings kept at ``path``, or ``measure()``'s, kept there now and ``said(them)`` once in the
    log (the attention kernels' choice, the linears')."""
    try:
        return json.loads(path.read_text())["dtypes"]
    except (OSError, ValueError, KeyError):
        pass
    picks = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"dtypes": picks, "threads": _threads(), "at": time.time()}, indent=1))
    tmp.replace(path)
    log.warning("%s", said(picks))
    return picks


def tiles_variable(dtype: str) -> str:
    """The variable that turns our kernel's tile path on (1) or off (0) for one dtype (attention.cpp)."""
    return f"KVR_ATTENTION_TILES_{dtype.upper()}"


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def describe_choice(picks: dict[str, dict]) -> str:
    return "attention kernel auto: " + "; ".join(
        f"{dtype} {pick['kernel']} (ours {pick['ours_gflops']:.1f}{_paths(pick)}, torch's {pick['torch_gflops']:.1f} "
        "GFLOP/s)" for dtype, pick in picks.items())


def _paths(pick: dict) -> str:
    if "tiles" not in pick:
        return ""
    return (f" on its {'tiles' if pick['tiles'] else 'vector path'}: prefill rows {pick['tiles_gflops']:.1f} on the "
            f"tiles, {pick['vector_gflops']:.1f} on the vector path")


def isa() -> str | None:
    """The instruction set the kernel's vector path runs with on this CPU (``avx512bf16``, ``avx512``, ``avx2``,
    ``portable``), or None where it is not built."""
    if not build():
        return None
    import torch

    return torch.ops.kvr.isa()


def path(dtype="float32") -> str | None:
    """The path a prefill row takes in ``dtype`` on this CPU: ``amx`` (tiles), ``brgemm`` (oneDNN's AVX-512 or
    AVX2 micro-kernels), or the vector path's instruction set; None where the kernel is not built."""
    if not build():
        return None
    import torch

    return torch.ops.kvr.path(str(dtype).removeprefix("torch.") == "bfloat16")


def describe(device_type: str = "cpu", dtype=None) -> str:
    """The attention kernel a run on ``device_type`` in ``dtype`` uses, for its report: ``ours (amx)``,
    ``ours (brgemm, avx2)``, ``torch (auto)``, ``torch (chosen)``, or ``torch (ours could not be built: ...)``."""
    if device_type != "cpu":
        return "torch"
    if chosen() == "torch":
        return "torch (chosen)"
    if not build():
        return f"torch (ours could not be built: {why_not_built()})"
    if not ours_on_cpu(dtype):
        return "torch (auto)"
    way = path(dtype or "float32")
    how = way if way in ("amx", isa()) else f"{way}, {isa()}"
    return f"ours ({how})" + (" (auto)" if chosen() == "auto" else "")
