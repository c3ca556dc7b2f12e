"""The GPU campaign (experiments/gpu/campaign.sh) runs end to end on CPU at tiny sizes, without the packages the GPU
machine's image lacks, fits its budget by its own plan, and writes the files it promises."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import HERE

REPO = HERE.parent
SCRIPT = REPO / "experiments/gpu/campaign.sh"
FILES = {"machine.json", "exactness.txt", "profile.json", "timings.jsonl", "predictions.jsonl", "summary.md",
         "campaign.log"}
ABSENT_THERE = ("fastapi", "uvicorn", "gguf", "pydantic", "starlette", "openai")  # not in the GPU image
BLOCKER = f'''import importlib.abc, sys
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {ABSENT_THERE!r}:
            raise ImportError(f"{{name}} is not installed on the GPU machine")
sys.meta_path.insert(0, _Absent())
'''


def campaign(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    """The campaign as the GPU machine runs it: from another folder, with the packages its image lacks absent
    (a sitecustomize on PYTHONPATH refuses them, in the campaign and in every process it starts)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(site))
    env.pop("OUT", None)
    done = subprocess.run(["bash", str(SCRIPT), "--out", str(out), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    return done, out


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    return campaign(tmp_path_factory.mktemp("dry"), "--dry-run")


def test_the_dry_run_runs_every_step_on_cpu_and_writes_the_promised_files(dry_run):
    done, out = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == FILES  # at most 8 files come back from the GPU machine
    assert re.search(r"exactness on cpu: \d+ passed", done.stdout)
    rows = [json.loads(line) for line in (out / "timings.jsonl").read_text().splitlines()]
    assert {r["kind"] for r in rows} == {"single-prefill", "kvr-last-rank", "decode-step", "prefill-peak"}
    assert all(r["ttft_s"] > 0 for r in rows if r["kind"] in ("single-prefill", "kvr-last-rank", "prefill-peak"))
    decode = [r for r in rows if r["kind"] == "decode-step"]
    # on a CPU the step runs eagerly and the row says the graph was not captured; on a GPU it has graph_s
    assert [r["batch"] for r in decode] == [1, 2] and all(r["eager_s"] > 0 for r in decode), decode
    assert all(r["graph"] == "not captured: no CUDA device" for r in decode)
    peak = {r["compiled"]: r for r in rows if r["kind"] == "prefill-peak"}
    assert set(peak) == {False, True} and peak[True]["compile_s"] > 0
    assert all(0 < r["share_of_matmul_peak"] and r["flops"] > 0 for r in peak.values())
    predictions = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert {r["mode"] for r in predictions if r["kind"] == "prediction-8gpu"} == {"kvr", "tsp", "cp-allgather",
                                                                                  "ring"}
    assert "PREDICTIONS" in (out / "summary.md").read_text()
    profile = json.loads((out / "profile.json").read_text())
    # the public figures' links (NVLink within a node, InfiniBand between nodes), none measured
    assert set(profile["links"]) == {"nvlink", "ib"} and "not measured" in profile["sources"]["links"]


def test_the_plan_for_one_h100_fits_the_default_budget(dry_run):
    done, _ = dry_run
    steps = dict(re.findall(r"^  (\S+)\s+([\d.]+) s(?: predicted)?$", done.stdout, re.M))
    budget = float(re.search(r"budget (\d+) s:", done.stdout).group(1))
    assert set(steps) == {"machine", "exactness", "calibrate", "prefill", "rank-part", "decode-graphs",
                          "prefill-peak", "predictions", "total"}
    assert float(steps["total"]) <= 0.8 * budget  # a fifth left for what the plan does not model


def test_a_budget_too_short_skips_steps_instead_of_overrunning(tmp_path):
    done, out = campaign(tmp_path, "--dry-run", "--budget-s", "3")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "exactness: skipped" in done.stdout and "calibrate: skipped" in done.stdout
    assert (out / "machine.json").exists() and (out / "summary.md").exists()


def test_bad_arguments_are_one_line_errors(tmp_path):
    done, _ = campaign(tmp_path, "--steps", "machine,warp")
    assert done.returncode == 2 and "unknown step(s) ['warp']" in done.stderr


def test_a_step_that_overruns_its_time_is_ended():
    import time

    from kvrunahead.bench.gpu.checks import no_later_than

    start = time.perf_counter()
    with pytest.raises(TimeoutError, match="still running after 1 s"), no_later_than(1.0):
        time.sleep(10)
    assert time.perf_counter() - start < 3


def test_the_campaigns_smollm2_shape_is_the_served_models():
    from kvrunahead.bench.gpu.plan import model_configs
    from kvrunahead.model.load import resolve_config

    ours, real = model_configs(False)["smollm2-135m"], resolve_config("smollm2-135m")
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "tie_word_embeddings")
    assert {k: getattr(ours, k) for k in keys} == {k: getattr(real, k) for k in keys}
    assert ours.rope_parameters["rope_theta"] == real.rope_parameters["rope_theta"]
    assert ours.rms_norm_eps == pytest.approx(real.rms_norm_eps, rel=1e-6)  # the GGUF holds it as a float32
