"""Device, dtype and backend choice of a rank, with CUDA present (mocked: CI has no GPU) and absent."""

import subprocess

import pytest
import torch

from kvrunahead.config import RunConfig
from kvrunahead.errors import InputError
from kvrunahead.model import device as device_module
from kvrunahead.model.device import dtype_name, fast_dtype, resolve_device, resolve_dtype
from kvrunahead.ranks.launcher import pick_backend


def test_with_cuda_each_local_rank_takes_its_gpu_in_bfloat16_over_nccl(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    devices = [resolve_device("auto", local_rank) for local_rank in range(8)]
    assert devices == [torch.device("cuda", i) for i in range(8)]
    assert resolve_device("auto", 9) == torch.device("cuda", 1)  # more local ranks than GPUs: wrap around
    assert pick_backend(devices[0]) == "nccl"
    assert resolve_dtype(RunConfig(), devices[0]) == torch.bfloat16
    assert resolve_dtype(RunConfig(dtype="float16"), devices[0]) == torch.float16


def test_without_cuda_ranks_run_on_cpu_in_float32_over_gloo(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    device = resolve_device("auto", 3)
    assert device == torch.device("cpu") and pick_backend(device) == "gloo"
    assert resolve_dtype(RunConfig(), device) == torch.float32
    with pytest.raises(InputError, match="--device cuda asked for, but"):
        resolve_device("cuda", 0)


@pytest.mark.parametrize("flags, bf16_gemm, fast", [({"avx512f", "avx512_bf16"}, 300.0, "bfloat16"),
                                                    ({"avx512f", "avx512_bf16"}, 190.0, "float32"),
                                                    ({"amx_bf16", "amx_tile"}, 1300.0, "bfloat16"),
                                                    ({"avx2", "avx512f"}, 300.0, "float32"), (set(), 300.0, "float32")])
def test_dtype_auto_on_a_cpu_is_bfloat16_only_where_its_bfloat16_instructions_beat_float32(monkeypatch, flags,
                                                                                           bf16_gemm, fast):
    """bfloat16 where the CPU has the instructions and its GEMMs were timed faster than float32's (an AVX-512 Xeon
    without AMX: 190 against 343 GFLOP/s, experiments/kernels)."""
    monkeypatch.setattr(device_module, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(device_module, "gemm_rates", lambda: {"float32": 250.0, "bfloat16": bf16_gemm})
    assert fast_dtype("cpu") == fast
    assert resolve_dtype(RunConfig(dtype="auto"), torch.device("cpu")) == device_module.DTYPES[fast]
    assert dtype_name(None, "cpu") == "float32"  # without --dtype: float32 on a CPU, whatever it has


def test_dtype_auto_on_a_gpu_is_the_models_own_16_bit_dtype():
    assert fast_dtype("cuda", "float16") == "float16"
    assert fast_dtype("cuda", "bfloat16") == "bfloat16"
    assert fast_dtype("cuda", "float32") == "bfloat16"  # a checkpoint stored in float32 (a converted GGUF)
    assert fast_dtype("cuda") == "bfloat16"
    with pytest.raises(InputError, match="unknown dtype 'float64'"):
        dtype_name("float64", "cpu")


def test_this_machines_cpu_flags_are_read():
    flags = device_module.cpu_flags()
    assert not flags or "fpu" in flags or "fp" in flags or "sse2" in flags  # x86 or an ARM's 'fp'


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("argv", [
    ["kvr-prefill", "--device", "cuda", "--ctx", "1k"],
    ["kvr-prefill", "--device", "cuda", "--ctx", "1k", "--nproc", "2"],
    ["kvr-serve", "--device", "cuda", "--nproc", "2"],
    ["kvr-search", "--device", "cuda", "--nproc", "2", "--ctx", "2k", "--out", "unused.json"],
])
def test_asking_for_cuda_without_a_gpu_is_one_line_and_exit_2_before_any_rank_starts(argv, tmp_path):
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2
    assert out.stdout == ""
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"{argv[0]}: error: --device cuda asked for, but ")
    assert not (tmp_path / "unused.json").exists()
