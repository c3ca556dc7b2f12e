"""``--attention-kernel auto`` (the default) follows the choice kept beside the built kernel: each choice forced
through that file, per dtype, is what ``kvr-prefill`` reports running and what ``kvr-kernels`` prints with both
rates; ``ours`` and ``torch`` still force one; a missing file is timed again and written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from kvrunahead import kernels
from tests.test_serve_cli import ENV, ROOT

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def cache(tmp_path):
    """A cache folder of this session's own holding the built kernel (copied, not built again)."""
    assert kernels.build(), kernels.why_not_built()
    here = kernels.cache_dir()
    there = tmp_path / "kernels" / here.name
    shutil.copytree(here, there)
    (there / kernels.CHOICE_FILE).unlink(missing_ok=True)
    return tmp_path, there


def _force(folder, float32: str, bfloat16: str) -> None:
    picks = {"float32": {"kernel": float32, "ours_gflops": 11.0, "torch_gflops": 22.0},
             "bfloat16": {"kernel": bfloat16, "ours_gflops": 33.0, "torch_gflops": 44.0}}
    (folder / kernels.CHOICE_FILE).write_text(json.dumps({"dtypes": picks}))


def _ran(root, dtype: str, *args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "kvrunahead.cli.prefill", "--json", "--model", "tiny-llama", "--ctx",
                        "64", "--max-new-tokens", "2", "--dtype", dtype, *args], capture_output=True, text=True,
                       timeout=300, env={**ENV, "KVR_CACHE": str(root)}, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)["attention_kernel"]


@pytest.mark.parametrize("float32,bfloat16", [("torch", "ours"), ("ours", "torch")])
def test_each_choice_forced_through_the_cache_is_what_the_tools_run(cache, float32, bfloat16):
    root, folder = cache
    _force(folder, float32, bfloat16)
    for dtype, pick in (("float32", float32), ("bfloat16", bfloat16)):
        said = _ran(root, dtype)
        assert said.startswith(pick) and said.endswith("(auto)"), (dtype, said)
    assert _ran(root, "float32", "--attention-kernel", "ours").startswith("ours")
    assert _ran(root, "bfloat16", "--attention-kernel", "torch") == "torch (chosen)"
    r = subprocess.run([sys.executable, "-m", "kvrunahead.cli.kernels"], capture_output=True, text=True, timeout=300,
                       env={**ENV, "KVR_CACHE": str(root)}, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any("float32" in line and "11.0" in line and "22.0" in line and line.endswith(f"runs {float32}")
               for line in lines), r.stdout
    assert any("bfloat16" in line and "33.0" in line and "44.0" in line and line.endswith(f"runs {bfloat16}")
               for line in lines), r.stdout


def test_without_a_kept_choice_kvr_kernels_times_both_and_keeps_it(cache):
    root, folder = cache
    r = subprocess.run([sys.executable, "-m", "kvrunahead.cli.kernels"], capture_output=True, text=True, timeout=300,
                       env={**ENV, "KVR_CACHE": str(root)}, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    kept = json.loads((folder / kernels.CHOICE_FILE).read_text())["dtypes"]
    assert set(kept) == {"float32", "bfloat16"}
    for pick in kept.values():
        faster = "ours" if pick["ours_gflops"] >= pick["torch_gflops"] else "torch"
        assert pick["kernel"] == faster and pick["ours_gflops"] > 0 and pick["torch_gflops"] > 0
        assert f"runs {pick['kernel']}" in r.stdout
        assert pick["tiles"] == (pick["tiles_gflops"] > pick["vector_gflops"]) and pick["vector_gflops"] > 0
    assert "attention kernel auto:" in r.stderr  # said once, in the log
    for dtype, pick in kept.items():  # a process that reads the choice runs the faster path, and says which
        said = subprocess.run([sys.executable, "-c", "from kvrunahead import kernels; kernels.auto_choice(); "
                               f"print(kernels.path('{dtype}'), kernels.isa())"], capture_output=True, text=True,
                              timeout=120, env={**ENV, "KVR_CACHE": str(root)}, cwd=ROOT)
        path, isa = said.stdout.split()
        assert (path in ("amx", "brgemm")) == pick["tiles"] and (path == isa) != pick["tiles"], (dtype, pick, path)
        assert f"{dtype:9} prefill rows take the {path} path" in r.stdout


@pytest.mark.parametrize("window", [None, 3])
def test_what_our_attention_hands_to_sdpa_sees_the_last_positions_of_its_keys(window):
    """The model's attention with our kernel on a dtype the kernel does not take (here float64, as float32 where
    auto runs torch's): queries that are the last of their keys see every key up to their own position (within
    the window), as the one-process model's mask says, not the first keys SDPA's causal flag would align them to."""
    from types import SimpleNamespace

    import torch

    from kvrunahead.model.attention import cpu_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for n in (3, 7, 7))
    out, _ = cpu_attention(SimpleNamespace(is_causal=True, num_key_value_groups=1), q, k, v, None, scaling=0.5,
                           sliding_window=window)
    scores = (q @ k.transpose(-1, -2)) * 0.5
    positions = torch.arange(4, 7)[:, None]
    keys = torch.arange(7)[None, :]
    seen = (keys <= positions) & ((keys > positions - window) if window else True)
    want = (scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v).transpose(1, 2)
    assert torch.allclose(out, want, atol=1e-12)
