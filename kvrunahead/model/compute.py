"""What a CPU rank computes with beyond the model and the dtype: the attention kernel (with its path) and the linear
layers, each chosen per dtype (``--attention-kernel``, ``--linears``). A rank's cost depends on both, so a partition
table records the settings it was searched with and a run compares them with its own (``Table.stale``); the rates
this CPU was timed at for each (``kvr-kernels``) let the cost model re-weight a stale table."""

from __future__ import annotations

from kvrunahead import kernels
from kvrunahead.model import linears

TORCH_THROUGHOUT = {"attention_kernel": "torch", "linears": "torch"}


def compute_settings(dtype: str, device_kind: str = "cpu", timing: bool = False) -> dict[str, str] | None:
    """``{"attention_kernel": "ours (avx512bf16)" | "torch", "linears": "onednn" | "torch"}`` for ranks on
    ``device_kind`` in ``dtype`` (a name: ``float32``) under this process's settings; None where ``auto`` would have
    to time the kernels or the linears first (``kvr-kernels`` has not run in this cache folder): the ranks will, and
    a decision made before them does not wait for it; ``timing``: time them now instead (on the ranks)."""
    if device_kind != "cpu":
        return dict(TORCH_THROUGHOUT)
    untimed = (kernels.chosen() != "torch" and not kernels.timed()) or (
        linears.chosen() == "auto" and not linears.choice_file().exists())
    if untimed and not timing:
        return None
    kernel = kernels.describe("cpu", dtype)
    kernel = "torch" if kernel.startswith("torch") else kernel.removesuffix(" (auto)")
    return {"attention_kernel": kernel, "linears": linears.choice_for(dtype)}


def compute_scale(settings: dict[str, str] | None, dtype: str) -> tuple[float, float] | None:
    """The attention's and the linears' rates under ``settings`` over torch's throughout, in ``dtype`` on this CPU
    (the cost model's CPU profile times torch's kernels): from the kernels' and the linears' timings; None where
    either was not timed."""
    if settings is None:
        return None
    attention = kernels.auto_choice().get(dtype, {}) if kernels.timed() and kernels.build() else {}
    layers = linears.auto_choice().get(dtype, {}) if linears.choice_file().exists() else {}
    ours = attention.get("ours_gflops") if settings["attention_kernel"] != "torch" else attention.get("torch_gflops")
    packed = layers.get(f"{settings['linears']}_gflops")
    if not (ours and packed and attention.get("torch_gflops") and layers.get("torch_gflops")):
        return None
    return ours / attention["torch_gflops"], packed / layers["torch_gflops"]
