"""Tensor parallelism (``--tp``): each rank a shard of the model cut by its own ``base_model_tp_plan``, TP groups
chained by KV-Runahead. On real ranks (gloo, one thread each; oversubscribed at 4 ranks, which exactness allows):
``kvr-prefill --verify`` equal to one process over one group and over a chain of groups, in float32 and bfloat16,
full-attention and hybrid; the peers over TP groups; ``kvr-serve --tp 2`` streaming kvr-prefill's greedy text to
the ``openai`` client; bad shapes refused in one line before any rank starts; the shard's weights and reads."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import time

import openai
import pytest
import torch

from tests.test_serve_cli import ENV, PROMPT, ROOT, _metric, serving

pytestmark = pytest.mark.timeout(600)


def _prefill(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrunahead.cli.prefill", "--json", *args], capture_output=True,
                          text=True, timeout=timeout, env=ENV, cwd=ROOT)


def _verified(*args: str, greedy: bool = True) -> dict:
    """``greedy``: the greedy tokens equal the reference's too (a half-precision run on a random preset may part
    from it at a near tie, which ``--verify`` judges by its half-precision check: ``ok``)."""
    r = _prefill("--verify", "--threads", "1", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    v = out["verification"]
    assert v["ok"] and v["first_token_match"] and (v["generated_match"] or not greedy), v
    return out


@pytest.mark.parametrize("model,dtype", [("tiny-llama", "float32"), ("tiny-gemma3", "float32"),
                                         ("tiny-llama", "bfloat16"), ("tiny-mistral", "float32"),
                                         ("tiny-phi3", "float32"), ("tiny-phi3", "bfloat16"),
                                         ("tiny-neox", "float32")])
def test_one_tp_group_of_two_verifies(model, dtype):
    out = _verified("--model", model, "--dtype", dtype, "--nproc", "2", "--tp", "2", "--ctx", "300",
                    "--max-new-tokens", "8")
    assert out["tp"] == 2 and out["world_size"] == 1


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma3", "tiny-neox"])
def test_kvr_chain_of_two_tp_groups_verifies(model):
    out = _verified("--model", model, "--nproc", "4", "--tp", "2", "--ctx", "400", "--partition", "0.6,0.4",
                    "--max-new-tokens", "8")
    assert out["tp"] == 2 and out["world_size"] == 2 and out["boundaries"] == [0, 240, 400]
    assert out["tp_collective"] == "shm"  # CPU ranks of one host: the shared-memory all-reduce
    assert out["ranks"][0]["bytes_sent"] > 0  # the first group's ranks handed their heads' K,V on


@pytest.mark.parametrize("mode", ["tp", "tsp", "ring", "cp-allgather"])
def test_the_peers_over_tp_groups_verify(mode):
    nproc, tp = ("4", "4") if mode == "tp" else ("4", "2")
    args = ("--tp", tp) if mode != "tp" else ()
    out = _verified("--model", "tiny-llama", "--mode", mode, "--nproc", nproc, *args, "--ctx", "300",
                    "--max-new-tokens", "4")
    assert out["tp"] == int(tp)


@pytest.mark.parametrize("model,dtype", [("tiny-llama", "float32"), ("tiny-gemma3", "bfloat16")])
def test_the_pipeline_of_tp_groups_verifies(model, dtype):
    """--mode spp --tp 2 at 4 ranks: two stages, each a TP group of two (Medha's layout), the chunks' hidden
    states handed lane by lane and every stage's heads of its layers' K,V gathered on the last group."""
    out = _verified("--model", model, "--dtype", dtype, "--mode", "spp", "--nproc", "4", "--tp", "2", "--ctx", "300",
                    "--chunk-tokens", "64", "--max-new-tokens", "6", greedy=dtype == "float32")
    layers = {"tiny-llama": 4, "tiny-gemma3": 6}[model]
    assert out["tp"] == 2 and out["world_size"] == 2 and out["stages"] == [0, layers // 2, layers]
    assert out["ranks"][0]["bytes_sent"] > 0


@pytest.mark.parametrize("model,dtype", [("tiny-llama", "float32"), ("tiny-gemma3", "bfloat16")])
def test_kvp_decode_over_tp_groups_verifies(model, dtype):
    """--decode kvp --tp 2 at 4 ranks: each group keeps its part of the cache, each TP rank its own heads of it;
    every decode step's partial outputs are merged lane by lane, then summed in the group as any layer's."""
    out = _verified("--model", model, "--dtype", dtype, "--decode", "kvp", "--nproc", "4", "--tp", "2", "--ctx",
                    "200", "--partition", "0,150,200", "--max-new-tokens", "8", greedy=dtype == "float32")
    assert out["tp"] == 2 and out["world_size"] == 2 and out["decode"] == "kvp"


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed (apt-get install openmpi-bin)")
def test_tp_over_mpi_verifies_with_mpi_s_all_reduce():
    """mpirun -n 4 kvr-prefill --tp 2 --transport mpi: a chain of two TP groups, the lanes on MPI's point to point
    and each group's sums on MPI's Allreduce, equal to one process (bfloat16 summed in float32 too)."""
    pytest.importorskip("mpi4py")
    for dtype in ("float32", "bfloat16"):
        args = ["--json", "--verify", "--threads", "1", "--model", "tiny-llama", "--dtype", dtype, "--tp", "2",
                "--transport", "mpi", "--ctx", "200", "--partition", "0,120,200", "--max-new-tokens", "4"]
        r = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "4", sys.executable, "-m",
                            "kvrunahead.cli.prefill", *args], capture_output=True, text=True, timeout=300, env=ENV,
                           cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("{")))
        assert out["launcher"] == "mpi" and out["tp_collective"] == "mpi" and out["world_size"] == 2
        assert out["verification"]["ok"] and out["verification"]["first_token_match"], out["verification"]


def test_a_compiled_tp_group_verifies():
    """--compile --tp 2: each rank's decoder stack of its shard through torch.compile, the group's all-reduces left
    out of the graph (the hooks run eagerly between its pieces)."""
    out = _verified("--model", "tiny-llama", "--compile", "--nproc", "2", "--tp", "2", "--ctx", "200",
                    "--max-new-tokens", "6")
    assert out["compiled"] and out["tp"] == 2


@pytest.mark.parametrize("args,says", [
    (("--nproc", "2", "--tp", "3"), "--tp 3 does not divide --nproc 2"),
    (("--nproc", "3", "--tp", "3"), "4 query heads in 2 K,V groups do not split over 3 ranks"),
    (("--nproc", "2", "--tp", "2", "--model", "tiny-falcon"), "falcon ships no tensor-parallel plan"),
    (("--nproc", "2", "--tp", "2", "--model", "tiny-bigcode"), "gpt_bigcode ships no tensor-parallel plan"),
    (("--nproc", "2", "--tp", "2", "--mode", "single"), "mode 'single' does not run over TP groups"),
])
def test_bad_tp_shapes_are_one_line_and_exit_2_before_any_rank_starts(args, says):
    args = args if "--model" in args else (*args, "--model", "tiny-llama")
    t0 = time.monotonic()
    r = _prefill(*args, "--ctx", "100", timeout=60)
    assert r.returncode == 2, r.stderr
    assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "rank" not in r.stderr.split(":")[0]  # said by the launcher, not by a rank
    assert time.monotonic() - t0 < 30


def test_kvr_serve_tp_2_streams_kvr_prefill_greedy_text_to_the_openai_client(tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPT)
    r = _prefill("--nproc", "2", "--tp", "2", "--model", "tiny-llama", "--prompt-file", str(prompt), "--no-chat",
                 "--max-new-tokens", "12")
    assert r.returncode == 0, r.stderr
    expected = json.loads(r.stdout)["generated_text"]
    with serving("--tp", "2", "--threads", "1") as server:
        api = openai.OpenAI(base_url=f"{server.url(timeout_s=200)}/v1", api_key="any", max_retries=0, timeout=120)
        stream = api.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=12, temperature=0,
                                        stream=True)
        assert "".join(c.choices[0].text for c in stream) == expected
        alone = [api.completions.create(model="tiny-llama", prompt=PROMPT[i:], max_tokens=10, temperature=0)
                 .choices[0].text for i in range(3)]
        from concurrent.futures import ThreadPoolExecutor  # the three at once: decode rows batched on the group
        with ThreadPoolExecutor(3) as pool:
            together = list(pool.map(lambda i: api.completions.create(
                model="tiny-llama", prompt=PROMPT[i:], max_tokens=10, temperature=0).choices[0].text, range(3)))
        assert together == alone
    assert any("TP group(s) of 2" in line for line in server.lines)


@pytest.mark.parametrize("nproc", ["2", "4"])
def test_packed_prompts_over_tp_groups_verify(tmp_path, nproc):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in (PROMPT[:90], PROMPT[10:200], "Hi.")))
    r = _prefill("--model", "tiny-llama", "--prompts", str(prompts), "--nproc", nproc, "--tp", "2", "--verify",
                 "--threads", "1", "--max-new-tokens", "6")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["world_size"] == int(nproc) // 2  # TP groups, not ranks holding the whole model
    assert all(p["matches"] for p in out["prompts"]) and len(out["steps"]) == 1


def _one_process_text(tmp_path, prompt: str, tokens: int) -> str:
    path = tmp_path / "prompt.txt"
    path.write_text(prompt)
    r = _prefill("--model", "tiny-llama", "--prompt-file", str(path), "--no-chat", "--max-new-tokens", str(tokens))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["generated_text"]


@pytest.mark.parametrize("nproc", [2, 4])
def test_the_prefix_cache_over_tp_groups_gives_one_process_text(tmp_path, nproc):
    """The server's prefix cache under --tp (its default size): a prompt again (answered whole from the cache,
    n choices of one prefill), a prompt starting the same way (its new tokens after the cached K,V, on one group
    or over the chain), each giving one process's greedy text; every TP rank keeps its own heads of each entry."""
    longer = PROMPT + "And then the fox ran away into the forest."
    expected = {p: _one_process_text(tmp_path, p, 10) for p in (PROMPT, longer)}
    with serving("--tp", "2", "--threads", "1", nproc=nproc) as server:
        url = server.url(timeout_s=200)
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="any", max_retries=0, timeout=120)
        ask = lambda p, **kw: api.completions.create(model="tiny-llama", prompt=p, max_tokens=10,  # noqa: E731
                                                     temperature=0, **kw)
        assert ask(PROMPT).choices[0].text == expected[PROMPT]
        cached = _metric(url, "kvr_prefix_cached_tokens_total")
        assert [c.text for c in ask(PROMPT, n=2).choices] == [expected[PROMPT]] * 2  # no prefill at all
        assert ask(longer).choices[0].text == expected[longer]  # the new tokens after the cached ones
        assert _metric(url, "kvr_prefix_cached_tokens_total") - cached >= 3 * 64
        again = ask(longer, stream=True)
        assert "".join(c.choices[0].text for c in again) == expected[longer]


def test_heads_split_by_kv_group_and_replicated_where_fewer():
    from kvrunahead.model.load import PRESETS
    from kvrunahead.model.tp import Share, shares

    llama = PRESETS["tiny-llama"]()  # 4 query heads, 2 K,V heads
    assert shares(llama, 2) == [Share((0, 2), (0, 1), (0, 64)), Share((2, 4), (1, 2), (64, 128))]
    assert [s.kv for s in shares(llama, 4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]  # each K,V head on two ranks
    odd = type(llama)(**{**llama.to_dict(), "num_attention_heads": 9, "num_key_value_heads": 3,
                         "hidden_size": 576})  # SmolLM2's heads: K,V groups of 3, split 2 and 1
    assert [s.q for s in shares(odd, 2)] == [(0, 6), (6, 9)]
    with pytest.raises(NotImplementedError, match="do not split over 4 ranks"):
        shares(odd, 4)


def test_a_shard_holds_its_share_of_the_weights_and_reads_only_it():
    from kvrunahead.model.load import load_model
    from kvrunahead.model.tp import TpSpec

    whole = load_model("tiny-llama", torch.float32, torch.device("cpu")).model
    shard = load_model("tiny-llama", torch.float32, torch.device("cpu"), tp=TpSpec(1, 2)).model
    size = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    shared = sum(p.numel() for n, p in whole.named_parameters() if "layers" not in n or "norm" in n)
    assert size(shard) <= (size(whole) - shared) / 2 + shared
    w, s = whole.model.layers[0], shard.model.layers[0]
    assert torch.equal(s.self_attn.q_proj.weight, w.self_attn.q_proj.weight[32:])  # heads 2, 3
    assert torch.equal(s.self_attn.o_proj.weight, w.self_attn.o_proj.weight[:, 32:])
    assert torch.equal(s.mlp.down_proj.weight, w.mlp.down_proj.weight[:, 64:])


@pytest.mark.parametrize("model,layer", [("tiny-phi3", "self_attn.qkv_proj"), ("tiny-phi3", "mlp.gate_up_proj"),
                                         ("tiny-neox", "attention.query_key_value")])
def test_a_fused_projection_is_cut_part_by_part(model, layer):
    from kvrunahead.model.load import load_model
    from kvrunahead.model.tp import TpSpec

    whole = load_model(model, torch.float32, torch.device("cpu")).model.base_model.layers[0].get_submodule(layer)
    got = load_model(model, torch.float32, torch.device("cpu"), tp=TpSpec(1, 2)).model.base_model.layers[0] \
        .get_submodule(layer)
    w = whole.weight  # tiny-phi3: 4 query heads of 16 in 2 K,V groups; tiny-neox: 4 heads; MLP 128 rows
    if layer == "self_attn.qkv_proj":  # q heads 2, 3; K,V head 1 of k, of v
        expected = torch.cat([w[32:64], w[64 + 16:64 + 32], w[96 + 16:96 + 32]])
    elif layer == "mlp.gate_up_proj":  # the second half of gate, of up
        expected = torch.cat([w[64:128], w[128 + 64:]])
    else:  # [q, k, v] of heads 2 and 3, one block
        expected = w[2 * 48:]
    assert torch.equal(got.weight, expected)


def test_the_safetensors_shard_read_equals_the_whole_tensor_cut(tmp_path):
    from safetensors.torch import save_file

    from kvrunahead.model.tp import safetensors_shard

    a, b = torch.randn(10, 7), torch.randn(6, 9).to(torch.bfloat16)
    save_file({"a": a, "b": b}, tmp_path / "model.safetensors")
    cuts = {"a": (0, ((3, 8),)), "b": (1, ((2, 5),))}
    got = dict(safetensors_shard(tmp_path)(lambda k: cuts[k]))
    assert torch.equal(got["a"], a[3:8]) and torch.equal(got["b"], b[:, 2:5])
    cuts = {"a": (0, ((0, 2), (5, 7))), "b": (1, ((0, 1), (4, 9)))}  # a fused projection's parts
    got = dict(safetensors_shard(tmp_path)(lambda k: cuts[k]))
    assert torch.equal(got["a"], torch.cat([a[:2], a[5:7]]))
    assert torch.equal(got["b"], torch.cat([b[:, :1], b[:, 4:]], 1))


def test_no_tp_rank_holds_the_whole_model_at_any_point():
    """The default model at --tp 2 without --verify: each rank's weights are its shard's (counted on the meta
    device), and its resident size never grew by more than those weights, their packed copies and the prefill's
    work; a rank that loaded the whole model (the reference, or a report) would grow by the whole model's."""
    from kvrunahead.model.load import DEFAULT_MODEL, resolve_config
    from kvrunahead.model.tp import ShardBuilder, TpSpec

    r = _prefill("--nproc", "2", "--tp", "2", "--ctx", "300", "--max-new-tokens", "4", "--threads", "1",
                 "--dtype", "float32")
    assert r.returncode == 0, r.stderr[-3000:]
    memory = json.loads(r.stdout)["memory"]
    assert [(m["rank"], m["group"], m["tp_rank"]) for m in memory] == [(0, 0, 0), (1, 0, 1)]
    config = resolve_config(DEFAULT_MODEL)
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM
        whole = AutoModelForCausalLM.from_config(config)
    full = {k: tuple(v.shape) for k, v in whole.state_dict().items()}
    whole_bytes = sum(p.numel() for p in {id(p): p for p in whole.parameters()}.values()) * 4
    linears = sum(m.weight.numel() for m in whole.modules() if isinstance(m, torch.nn.Linear)) * 4
    for m in memory:
        shard, _ = ShardBuilder(config, TpSpec(m["tp_rank"], 2)).cuts(torch.device("meta"), full)
        assert m["weight_bytes"] == sum(p.numel() for p in {id(p): p for p in shard.parameters()}.values()) * 4
        assert m["weight_bytes"] < whole_bytes
        grown = m["peak_resident_bytes"] - m["resident_before_load_bytes"]
        assert grown <= m["weight_bytes"] + m["packed_bytes"] + (96 << 20), m
        assert grown < whole_bytes + linears, m  # what the whole model and its packed linears would take


def _collective_rank(rank: int, port: int, kind: str, out) -> None:
    import io
    import os

    import torch.distributed as dist

    from kvrunahead.ranks.launcher import World
    from kvrunahead.ranks.mesh import ShmCollective, TorchCollective, chain_world

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    world = chain_world(World(rank, 2, rank, 2, "spawn"), 2)
    if kind == "shm":
        ShmCollective.SLOT_BYTES = 1024  # small slots: a larger tensor goes through in pieces
        collective = ShmCollective(world, f"test{port}", 30.0)
    else:  # torch.distributed's on the DeviceMesh's tp dimension (gloo here)
        collective = TorchCollective(world, torch.device("cpu"))
    torch.manual_seed(rank)
    got = {}
    for name, t in {"small": torch.randn(7), "pieces": torch.randn(3, 1000),
                    "bf16": torch.randn(600).to(torch.bfloat16)}.items():
        mine = t.clone()
        got[name] = (t, collective.all_reduce(mine).clone())
    for _ in range(500):  # many calls in a row: the two slot sets alternate while a rank runs ahead
        collective.all_reduce(torch.ones(3))
    # as bytes: a tensor put on a torch queue is shared through a file descriptor this process must outlive
    buffer = io.BytesIO()
    torch.save(got, buffer)
    out.put((rank, buffer.getvalue()))
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["shm", "torch"])
def test_the_tp_all_reduce_gives_both_ranks_the_sum_in_pieces_and_half_precision(kind):
    """The shared-memory all-reduce (in slot-sized pieces, in rank order) and torch.distributed's (gloo) give both
    ranks the same bits: the sum, a half-precision one rounded once (MPI's: test_tp_over_mpi)."""
    import io

    import torch.multiprocessing as mp

    from kvrunahead.ranks.launcher import free_port

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_collective_rank, args=(r, port, kind, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = {rank: torch.load(io.BytesIO(data)) for rank, data in (out.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(30)
    for name in ("small", "pieces", "bf16"):
        (a, sum0), (b, sum1) = results[0][name], results[1][name]
        assert torch.equal(sum0, sum1)  # the same bits on both ranks
        expected = (a.float() + b.float()).to(a.dtype)
        assert torch.equal(sum0, expected), name


def test_a_chain_of_tp_groups_is_partitioned_by_the_cost_model_priced_at_its_tp():
    from kvrunahead.config import RunConfig
    from kvrunahead.decide.policy import choose_partition
    from kvrunahead.model.load import resolve_config

    config = resolve_config("tiny-llama")
    partition, source, _ = choose_partition(RunConfig(model="tiny-llama", tp=2, threads=1), config, 2000, 2,
                                            "split", 2)
    # no table searched at --tp 2 (kvr-search --tp writes them; none is shipped): the cost model, named as such
    assert source.startswith("cost model") and partition.boundaries[-1] == 2000, source
    assert "no partition table for tiny-llama at world size 2 of TP groups of 2" in source, source


def test_kvr_serve_prefill_spp_over_tp_groups_gives_one_process_text(tmp_path):
    """kvr-serve --prefill spp --tp 2 at 4 ranks: a prompt through two stages of TP groups, whole and as a chunked
    prefill (the stages keeping their heads of their layers' K,V between the steps), streams one process's greedy
    text to the openai client; the front's group decodes."""
    longer = PROMPT + "And then the fox ran away into the forest."
    expected = {p: _one_process_text(tmp_path, p, 10) for p in (PROMPT, longer)}
    with serving("--prefill", "spp", "--tp", "2", "--degree", "2", "--chunk-tokens", "48", "--spp-chunk-tokens",
                 "16", "--prefix-cache-tokens", "0", "--threads", "1", nproc=4) as server:
        api = openai.OpenAI(base_url=f"{server.url(timeout_s=200)}/v1", api_key="any", max_retries=0, timeout=120)
        for p in (PROMPT, longer):
            c = api.completions.create(model="tiny-llama", prompt=p, max_tokens=10, temperature=0)
            assert c.choices[0].text == expected[p]
            said = c.model_extra["kvrunahead"]
            assert "spp: stages 0,2,4" in said["partition"]["source"] and len(said["chunks"]) > 1, said
        stream = api.completions.create(model="tiny-llama", prompt=longer, max_tokens=10, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream) == expected[longer]


def test_kvr_serve_decode_kvp_over_tp_groups_gives_one_process_text(tmp_path):
    """kvr-serve --decode kvp --tp 2 at 4 ranks: a prompt over the chain of groups, then as KV-parallel prefill
    chunks, each decoded on the groups' shards (each TP rank its heads), streams one process's greedy text."""
    longer = PROMPT + "And then the fox ran away into the forest."
    expected = {p: _one_process_text(tmp_path, p, 10) for p in (PROMPT, longer)}
    for chunk in ("0", "48"):
        with serving("--decode", "kvp", "--tp", "2", "--degree", "2", "--chunk-tokens", chunk,
                     "--prefix-cache-tokens", "0", "--threads", "1", nproc=4) as server:
            api = openai.OpenAI(base_url=f"{server.url(timeout_s=200)}/v1", api_key="any", max_retries=0,
                                timeout=120)
            c = api.completions.create(model="tiny-llama", prompt=longer, max_tokens=10, temperature=0)
            assert c.choices[0].text == expected[longer] and c.model_extra["kvrunahead"]["decode"] == "kvp"
            assert (len(c.model_extra["kvrunahead"]["chunks"]) > 1) == (chunk != "0"), c.model_extra
            stream = api.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=10, temperature=0,
                                            stream=True)
            assert "".join(c.choices[0].text for c in stream) == expected[PROMPT]


def test_kvr_search_tp_writes_a_table_keyed_on_its_degree_which_the_runtime_reads(tmp_path):
    """kvr-search --nproc 4 --tp 2 measures a chain of two TP groups and writes a table keyed on --tp 2 (its world
    size the groups); kvr-prefill --tp 2 takes its partition from it, finds it among the tables by its key, and a
    run at --tp 1 refuses it in one line."""
    from kvrunahead.decide.tables import Table, TableError, find_table, table_filename

    out = tmp_path / "t.json"
    r = subprocess.run([sys.executable, "-m", "kvrunahead.cli.search", "--nproc", "4", "--tp", "2", "--ctx", "256",
                        "--model", "tiny-llama", "--repeats", "1", "--warmup", "0", "--min-stride", "32", "--out",
                        str(out)], capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    table = Table.load(out)
    assert table.meta.tp == 2 and table.meta.world_size == 2 and len(table.entries) == 1
    entry = table.entries[0]
    assert "_p2_tp2_" in table_filename(table.meta.key)
    assert find_table(table.meta.key, tmp_path) == out
    with pytest.raises(TableError):
        find_table(dataclasses.replace(table.meta.key, tp=1), tmp_path)
    got = _prefill("--nproc", "4", "--tp", "2", "--ctx", "256", "--model", "tiny-llama", "--table", str(out),
                   "--threads", "1", "--max-new-tokens", "1")
    assert got.returncode == 0, got.stderr[-3000:]
    assert json.loads(got.stdout)["boundaries"] == entry.boundaries
    refused = _prefill("--nproc", "2", "--ctx", "256", "--model", "tiny-llama", "--table", str(out), timeout=60)
    assert refused.returncode == 2 and "made for --tp 2, not 1" in refused.stderr, refused.stderr
