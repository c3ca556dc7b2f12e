"""What a CPU rank computes with beyond the model and the dtype: the attention kernel (with its path) and the linear
layers, each chosen per dtype (``--attention-kernel``, ``--linears``). A rank's cost depends on both, so a partition
table records the settings it was searched with and a run compares them with its own (``Table.stale``); the rates
this CPU was timed at for each (``kvr-kernels``) let the cost model re-weight a stale table."""

from __future__ import annotations

from kvrunahead import kernels
from kvrunahead.model import linears

TORCH_THROUGHOUT = {"attention_kernel": "torch", "linears": "torch"}


def compute_settings(dtype: str, device_kind: str = "cpu") -> dict[str, str]:
    """``{"attention_kernel": "ours (avx512bf16)" | "torch", "linears": "onednn" | "torch"}`` for ranks on
    ``device_kind`` in ``dtype`` (a name: ``float32``) under this process's settings."""
    if device_kind != "cpu":
        return dict(TORCH_THROUGHOUT)
    kernel = kernels.describe("cpu", dtype)
    kernel = "torch" if kernel.startswith("torch") else kernel.removesuffix(" (auto)")
    return {"attention_kernel": kernel, "linears": linears.choice_for(dtype)}


def compute_rates(settings: dict[str, str], dtype: str) -> tuple[float, float] | None:
    """(attention, linears) GFLOP/s of ``settings`` in ``dtype`` on this CPU, from the kernels' and the linears'
    timings; None where either was not timed (the kernel not built)."""
    attention = kernels.auto_choice().get(dtype, {}) if kernels.build() else {}
    layers = linears.auto_choice().get(dtype, {})
    a = attention.get("torch_gflops" if settings["attention_kernel"] == "torch" else "ours_gflops")
    m = layers.get(f"{settings['linears']}_gflops")
    return (a, m) if a and m else None
