"""Stream pipeline parallelism (modes/spp.py) on p real ranks (gloo, CPU) against the single-process model: full,
hybrid sliding-window and all-sliding models, chunks that divide the prompt and chunks that do not, a chunk of one
token, the whole prompt as one chunk; the stages' own weights and their hidden-state traffic."""

import json

import pytest
import torch

from kvrunahead.model.load import load_model
from kvrunahead.model.stage import StageSpec
from kvrunahead.partition import balanced_cut
from tests.helpers import kvr_prefill, world_runs

CONTEXT = 150  # beyond the tiny sliding models' window of 64, so a stage's later chunks see a window that slid
NEW_TOKENS = 6
MODELS = {"tiny-llama": 64, "tiny-gemma3": 64, "tiny-mistral": 64}  # hidden sizes: full, hybrid, all sliding
CHUNKS = {"one-token": 1, "uneven": 37, "whole": CONTEXT, "auto": None}


def _config(model: str, dtype: str, chunk: int | None, **kw) -> dict:
    return dict(model=model, mode="spp", context_len=CONTEXT, dtype=dtype, device="cpu", max_new_tokens=NEW_TOKENS,
                verify=True, threads=1, atol=1e-4 if dtype == "float32" else None, chunk_tokens=chunk, **kw)


def _cases(p: int) -> list[dict]:
    cases = [{"name": f"{model}/{cname}/float32", "config": _config(model, "float32", chunk)}
             for model in MODELS for cname, chunk in CHUNKS.items()]
    cases += [{"name": f"{model}/uneven/bfloat16", "config": _config(model, "bfloat16", 37)} for model in MODELS]
    cases.append({"name": "yarn", "config": _config("tiny-llama-short", "float32", 37)})
    if p == 2:  # stages given, one layer against three
        cases.append({"name": "given-stages", "config": _config("tiny-llama", "float32", 37, stages="0,1,4")})
    return cases


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    return world_runs(_cases, tmp_path_factory, "spp")


@pytest.fixture(scope="module", params=[1, 2, 3, 4])
def world(request, worlds):
    return request.param, worlds(request.param)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("cname", list(CHUNKS))
def test_spp_matches_the_single_process_for_every_chunk_size(world, model, cname):
    """First-token logits within float32's tolerance and the same greedy tokens, whether the chunk is one token,
    one that does not divide the prompt, the whole prompt or the cost model's."""
    p, results = world
    r = results[f"{model}/{cname}/float32"]
    v = r["verification"]
    assert v["max_abs_logit_diff"] <= 1e-4 and v["first_token_match"], v
    assert v["generated_match"], (r["generated_tokens"], v["reference_tokens"])
    if CHUNKS[cname] is not None:
        assert r["chunk_tokens"] == CHUNKS[cname]
    layers = {"tiny-gemma3": 6}.get(model, 4)
    assert r["stages"][0] == 0 and r["stages"][-1] == layers and len(r["stages"]) == p + 1


@pytest.mark.parametrize("model", list(MODELS))
def test_spp_in_bfloat16_matches_within_its_rounding(world, model):
    assert world[1][f"{model}/uneven/bfloat16"]["verification"]["ok"]


def test_spp_beyond_the_trained_positions_matches_the_same_yarn_extension(world):
    r = world[1]["yarn"]
    assert r["rope_extension"].startswith("RoPE extended by YaRN")
    assert r["verification"]["ok"] and r["verification"]["generated_match"]


@pytest.mark.parametrize("model", list(MODELS))
def test_every_stage_but_the_last_sends_each_chunk_s_hidden_states_once(world, model):
    """Per chunk one message of [chunk, hidden] float32 from stage r to r+1: the whole prompt's hidden states once
    per stage boundary, whatever the chunk; then its layers' K,V to the last stage, which decodes (the same K,V
    whatever the chunk). The last stage sends nothing."""
    p, results = world
    per_stage = CONTEXT * MODELS[model] * 4
    kv = None
    for cname in CHUNKS:
        r = results[f"{model}/{cname}/float32"]
        kinds = r["bytes_sent_by_kind"]
        assert [k.get("hidden states", 0) for k in kinds] == [per_stage] * (p - 1) + [0], kinds
        assert kv in (None, [k.get("K,V to the front", 0) for k in kinds])
        kv = [k.get("K,V to the front", 0) for k in kinds]
        assert all(x > 0 for x in kv[:-1]) and kv[-1] == 0
        assert r["bytes_sent"] == [h + k for h, k in zip([per_stage] * (p - 1) + [0], kv)]


def test_stages_as_given_are_run_and_still_exact(worlds):
    r = worlds(2)["given-stages"]
    assert r["stages"] == [0, 1, 4]
    assert r["verification"]["ok"] and r["verification"]["generated_match"]


def test_a_stage_loads_only_its_layers_and_the_embedding_only_where_it_embeds_or_emits():
    whole = load_model("tiny-llama", torch.float32, torch.device("cpu"))
    stage = load_model("tiny-llama", torch.float32, torch.device("cpu"), stage=StageSpec(2, 4, 4)).model
    assert len(stage.model.layers) == 2 and stage.model.embed_tokens is None  # untied: the head is its own
    theirs = dict(whole.model.named_parameters())
    for name, param in stage.named_parameters():
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            assert torch.equal(param, theirs[f"model.layers.{int(i) + 2}.{rest}"]), name
    first = load_model("tiny-llama", torch.float32, torch.device("cpu"), stage=StageSpec(0, 2, 4)).model
    assert first.lm_head is None and isinstance(first.model.norm, torch.nn.Identity)
    count = sum(p.numel() for p in stage.parameters()) + sum(p.numel() for p in first.parameters())
    assert count == sum(p.numel() for p in whole.model.parameters())


def test_the_real_model_s_stage_reads_its_layers_from_the_weights_file():
    """SmolLM2 ties its LM head to the embedding: the last stage holds both, a middle one neither."""
    whole = load_model("smollm2-135m", torch.float32, torch.device("cpu")).model
    last = load_model("smollm2-135m", torch.float32, torch.device("cpu"), stage=StageSpec(20, 30, 30)).model
    middle = load_model("smollm2-135m", torch.float32, torch.device("cpu"), stage=StageSpec(10, 20, 30)).model
    assert torch.equal(last.lm_head.weight, whole.lm_head.weight)
    assert torch.equal(last.model.layers[9].mlp.down_proj.weight, whole.model.layers[29].mlp.down_proj.weight)
    assert middle.model.embed_tokens is None and middle.lm_head is None
    assert torch.equal(middle.model.layers[0].self_attn.q_proj.weight, whole.model.layers[10].self_attn.q_proj.weight)


def test_the_balanced_cut_minimises_the_slowest_stage():
    assert balanced_cut([1, 1, 1, 1], 2).boundaries == (0, 2, 4)
    assert balanced_cut([4, 1, 1, 1, 1], 2).boundaries == (0, 1, 5)
    assert balanced_cut([1, 1, 1, 1, 1, 5], 3).boundaries in ((0, 3, 5, 6), (0, 2, 5, 6))
    assert max(sum([3, 1, 2, 2, 5, 1][a:b]) for a, b in [(0, 2), (2, 4), (4, 6)]) == 6


@pytest.mark.parametrize("args, said", [
    (["--mode", "kvr", "--chunk-tokens", "64"], "--chunk-tokens and --stages apply to --mode spp"),
    (["--mode", "spp", "--chunk-tokens", "0"], "--chunk-tokens must be at least 1"),
    (["--mode", "spp", "--stages", "0,3"], "--stages"),
    (["--mode", "spp", "--stages", "0.5,0.5"], "not ratios"),
    (["--mode", "spp", "--nproc", "5"], "stage of at least one layer per rank"),
    (["--mode", "spp", "--model", "tiny-falcon"], "spp cuts a model's decoder layers into stages"),
])
def test_bad_pipeline_input_is_one_line_and_exit_2_before_any_rank_starts(args, said):
    model = [] if "--model" in args else ["--model", "tiny-llama"]
    nproc = [] if "--nproc" in args else ["--nproc", "2"]
    proc = kvr_prefill(*model, *nproc, "--ctx", "64", *args, timeout_s=60)
    assert proc.returncode == 2, proc.stderr
    assert said in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("model", ["tiny-phi3", "tiny-neox"])
def test_spp_cuts_a_held_out_family_by_its_own_pipeline_plan(model):
    """Families outside the ones spp was built on (Phi-3, GPT-NeoX: another base prefix, embedding and final
    norm) are cut by their base_model_pp_plan and verify as one process."""
    proc = kvr_prefill("--model", model, "--mode", "spp", "--nproc", "2", "--ctx", "120", "--chunk-tokens", "50",
                       "--verify", "--json", "--threads", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["verification"]["ok"] and out["stages"] == [0, 2, 4]


def test_kvr_prefill_reports_the_stages_and_the_chunk(tmp_path):
    proc = kvr_prefill("--model", "tiny-gemma3", "--mode", "spp", "--nproc", "2", "--ctx", "100",
                       "--chunk-tokens", "30", "--verify", "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["chunk_tokens"] == 30 and r["decode"] == "gathered" and r["verification"]["ok"]
    assert r["pipeline_source"].startswith("chunk as given; cost model")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("p,chunk,spp_chunk", [(2, 0, 0), (2, 0, 7), (2, 13, 5), (3, 1, 0), (3, 17, 4)])
def test_a_served_prompt_through_the_pipeline_answers_as_one_process(tmp_path, p, chunk, spp_chunk):
    """kvr-serve --prefill spp: a whole prompt (chunk 0) or a chunked prefill (a step's chunk pipelined in
    ``spp_chunk``-token pieces, the stages keeping their layers' K,V between the steps) gives the first-token logits
    and greedy tokens of the prompt whole in one process, a short request decoding between the chunks; no stage
    keeps anything once the prompts end."""
    from tests.test_serve_engine import ranks_ran

    prompts = [list(range(3, 150)), [5] + list(range(100, 140))]  # the first beyond the sliding window of 64
    scenario = {"name": "chunked", "run": {"model": "tiny-gemma3" if chunk == 0 else "tiny-llama", "threads": 1},
                "degree": str(p), "chunk_tokens": chunk, "max_tokens": 6, "prompts": prompts,
                "short": list(range(7, 20)), "prefill": "spp", "spp_chunk_tokens": spp_chunk}
    ranks = ranks_ran(scenario, tmp_path, p)
    r = ranks[-1]
    assert r["tokens"] == r["ref_tokens"]
    assert max(r["max_abs_logit_diff"]) <= 1e-4
    assert all("spp: stages" in s for s in r["sources"]), r["sources"]
    if chunk:
        for ids, chunks in zip(prompts, r["chunks"]):
            assert [c["start"] for c in chunks] == list(range(0, len(ids), chunk))
    assert all(x["partial_left"] == 0 for x in ranks)


@pytest.mark.timeout(300)
def test_a_pipelined_prefill_chunked_by_a_small_step_budget_answers_as_one_process(tmp_path):
    """--step-budget-ms sizes the chunks with the cost model (here 1 ms: the shortest chunks, 16 tokens), each
    chunk pipelined through the stages in 5-token pieces: the one-process logits and greedy tokens."""
    from tests.test_serve_engine import ranks_ran

    prompts = [list(range(3, 90))]
    scenario = {"name": "chunked", "run": {"model": "tiny-llama", "threads": 1}, "degree": "2", "chunk_tokens": 0,
                "step_budget_ms": 1.0, "max_tokens": 6, "prompts": prompts, "short": list(range(7, 20)),
                "prefill": "spp", "spp_chunk_tokens": 5}
    ranks = ranks_ran(scenario, tmp_path, 2)
    r = ranks[-1]
    assert r["tokens"] == r["ref_tokens"] and max(r["max_abs_logit_diff"]) <= 1e-4
    chunks = r["chunks"][0]
    assert len(chunks) >= 4 and chunks[-1]["end"] == len(prompts[0]) and "spp: stages" in r["sources"][0]
    assert all(x["partial_left"] == 0 for x in ranks)


@pytest.mark.timeout(600)
def test_kvr_serve_prefill_spp_answers_a_4k_prompt_with_kvr_prefill_s_text():
    """The real SmolLM2 at 4k over two ranks: the openai client's greedy completion through the pipeline is the
    text ``kvr-prefill`` prints for the same prompt (the chain's prefill there)."""
    import subprocess
    import sys

    from kvrunahead.config import RunConfig
    from kvrunahead.decide.policy import prepare
    from tests.test_serve_cli import ENV, ROOT, _api, serving

    r = subprocess.run([sys.executable, "-m", "kvrunahead.cli.prefill", "--nproc", "2", "--ctx", "4k",
                        "--max-new-tokens", "12", "--json"], capture_output=True, text=True, timeout=400, env=ENV,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    expected = json.loads(r.stdout)["generated_text"]
    ids = prepare(RunConfig(context_len=4096), 2).ids
    with serving("--prefill", "spp", "--degree", "2", model="smollm2-135m") as server:
        c = _api(server.url(timeout_s=300)).with_options(timeout=300).completions.create(
            model="smollm2-135m", prompt=ids, max_tokens=12, temperature=0)
    assert c.choices[0].text == expected
    said = c.model_extra["kvrunahead"]
    assert said["partition"]["source"].startswith("spp: stages 0,15,30") and said["degree"] == 2, said


@pytest.mark.parametrize("args, said", [
    (["--stages", "0,2,4"], "--stages and --spp-chunk-tokens apply to --prefill spp"),
    (["--prefill", "spp", "--decode", "kvp"], "--decode kvp needs the chain"),
    (["--prefill", "spp", "--stages", "0,5"], "--stages"),
    (["--prefill", "spp", "--spp-chunk-tokens", "-3"], "--spp-chunk-tokens must be 0 (off) or more"),
])
def test_kvr_serve_pipeline_flags_that_cannot_run_are_one_line_and_exit_2(args, said):
    import subprocess
    import sys

    from tests.test_serve_cli import ENV, ROOT

    r = subprocess.run([sys.executable, "-m", "kvrunahead.cli.serve", "--model", "tiny-llama", "--nproc", "2",
                        *args], capture_output=True, text=True, timeout=120, env=ENV, cwd=ROOT)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and said in r.stderr, r.stderr


def _cpu_cost():
    from kvrunahead.model.load import resolve_config
    from kvrunahead.sim.costmodel import CostModel
    from kvrunahead.sim.profile import resolve_profile
    from kvrunahead.sim.shape import shape_from_config

    return CostModel(shape_from_config(resolve_config("smollm2-135m"), "float32"), resolve_profile("cpu", 1)[0])


def test_the_simulated_pipeline_overlaps_chunks_and_sends_each_chunk_s_hidden_states_once():
    """One chunk: the stages run one after the other (no overlap), the second waiting the whole first; many
    chunks: they overlap, the second stage waits for the first chunk only (the pipeline's fill). Per stage boundary
    the whole prompt's hidden states cross once, whatever the chunk."""
    from kvrunahead.sim.simulate import SimError, simulate

    cost, n = _cpu_cost(), 4096
    whole = simulate(cost, "spp", n, 2, stages=(0, 15, 30), chunk_tokens=n)
    piped = simulate(cost, "spp", n, 2, stages=(0, 15, 30), chunk_tokens=256)
    assert whole.ranks[1].wait_s >= 0.9 * whole.ranks[0].compute_s
    assert piped.ttft_s < 0.75 * whole.ttft_s and piped.ranks[1].wait_s < 0.2 * piped.ranks[0].compute_s
    assert piped.link_bytes == {"0->1": n * 576 * 4} == whole.link_bytes
    with pytest.raises(SimError, match="not a cut of 30 layers"):
        simulate(cost, "spp", n, 2, stages=(0, 30, 30))


def test_the_pipeline_plan_balances_the_stages_and_takes_the_chunk_it_predicts_fastest():
    from kvrunahead.sim.optimize import CHUNK_CHOICES, plan_pipeline
    from kvrunahead.sim.simulate import simulate_spp

    cost = _cpu_cost()
    plan = plan_pipeline(cost, 8192, 3)
    assert plan.stages == (0, 10, 20, 30)
    timed = {c: simulate_spp(cost, 8192, plan.stages, c).ttft_s for c in CHUNK_CHOICES if c < 8192}
    assert plan.chunk_tokens == min(timed, key=timed.get) and plan.ttft_s == min(timed.values())


def test_kvr_plan_compares_the_pipeline_with_the_chain_and_the_peers():
    import subprocess

    r = subprocess.run(["kvr-plan", "--ctx", "16k", "--profile", "a100-nvlink", "--max-ranks", "4", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    options = json.loads(r.stdout)[0]["options"]
    spp = [o for o in options if o["mode"] == "spp"]
    assert [o["ranks"] for o in sorted(spp, key=lambda o: o["ranks"])] == [2, 4]
    assert all(o["chunk_tokens"] in (128, 256, 512, 1024, 2048, 4096, 8192) and o["boundaries"][-1] == 32
               for o in spp)
