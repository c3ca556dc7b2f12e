"""The split attention holds one block at a time and never a score matrix: its peak memory is what its blocks need."""

import functools
import json
import os
import subprocess
import sys

import pytest
import torch

from kvrunahead import kernels
from kvrunahead.modes.attention import attend_with_lse, lse_kernel
from tests.helpers import HERE

CONTEXT = 32768


@functools.cache
def peak(part: int, kernel: str) -> dict:
    out = subprocess.run([sys.executable, str(HERE / "attention_memory_probe.py"), str(CONTEXT), str(part)],
                         capture_output=True, text=True, timeout=300, check=True,
                         env={**os.environ, kernels.ENV: kernel})
    return json.loads(out.stdout)


@pytest.mark.parametrize("kernel", ["ours", "torch"])
def test_split_attention_at_32k_needs_within_10_percent_of_its_blocks(kernel):
    # One 16k x 32k float32 score matrix per head would be 2 GiB; torch's blocks need about 110 MB, ours 38 MB (55
    # with its tile path's packed K,V head).
    m = peak(16384, kernel)
    assert m["peak_extra_bytes"] <= 1.10 * m["need_bytes"], m


@pytest.mark.parametrize("kernel", ["ours", "torch"])
def test_split_attention_memory_grows_linearly_with_the_part_not_with_the_context(kernel):
    small, large = peak(4096, kernel), peak(16384, kernel)
    growth = large["peak_extra_bytes"] - small["peak_extra_bytes"]
    expected = large["need_bytes"] - small["need_bytes"]
    assert abs(growth - expected) <= 0.10 * expected, (small, large)


@pytest.mark.parametrize("kv_heads", [1, 3, 9])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_with_lse_of_grouped_heads_equals_the_materialised_softmax(kv_heads, causal):
    torch.manual_seed(0)
    heads, n, keys, dim = 9, 7, 7 if causal else 11, 16
    q, k, v = torch.randn(1, heads, n, dim), torch.randn(1, kv_heads, keys, dim), torch.randn(1, kv_heads, keys, dim)
    out, lse = attend_with_lse(q, k, v, causal, scale=None)
    kx, vx = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = q @ kx.transpose(-1, -2) / dim**0.5
    if causal:
        scores = scores.masked_fill(~torch.ones(n, keys, dtype=torch.bool).tril(), float("-inf"))
    assert torch.allclose(lse, torch.logsumexp(scores, -1), atol=1e-5)
    assert torch.allclose(out, torch.softmax(scores, -1) @ vx, atol=1e-5)


def test_each_device_gets_a_fused_kernel_that_returns_the_log_sum_exp():
    assert lse_kernel("cpu", torch.float32, 64) == "cpu-flash"
    assert lse_kernel("cuda", torch.bfloat16, 128) == "flash"
    assert lse_kernel("cuda", torch.float16, 64) == "flash"
    assert lse_kernel("cuda", torch.float32, 64) == "efficient"  # flash takes half precisions only
    assert lse_kernel("cuda", torch.bfloat16, 320) == "efficient"  # beyond flash's head size
    with pytest.raises(NotImplementedError, match="no fused attention"):
        lse_kernel("mps", torch.float16, 64)

# The CUDA kernels against a float64 reference: tests/test_gpu.py (run on a GPU by experiments/gpu/campaign.sh).
