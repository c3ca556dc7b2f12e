"""The cost model and simulator: hand-computed schedules, units, monotonicity, model-backed search, profiles."""

import dataclasses
import json
import math

import pytest
from click.testing import CliRunner

from kvrunahead.partition import Partition
from kvrunahead.search.model_backend import cost_model, predicted_busy
from kvrunahead.search.options import SearchOptions
from kvrunahead.sim.costmodel import CostModel
from kvrunahead.sim.links import Links, NoiseModel
from kvrunahead.sim.optimize import search_partition
from kvrunahead.sim.plan import plan, rank_counts
from kvrunahead.sim.profile import (
    AttentionCost,
    HardwareProfile,
    LinkProfile,
    ProfileError,
    builtin_profiles,
    resolve_profile,
)
from kvrunahead.sim.shape import PAPER_SHAPES, ModelShape
from kvrunahead.sim.simulate import SimError, simulate

# Unit costs: one token's projections take 1 s, its output projection and MLP 1 s, one computed query-key
# pair 1 s, one token's K,V (2 bytes) crosses a link in 1 s, copies are free, the LM head takes 1 s.
UNIT_SHAPE = ModelShape("unit", layers=1, hidden=1, heads=1, kv_heads=1, head_dim=1, qkv_params=1, other_params=1,
                        vocab=1, dtype_bytes=1)


def unit_profile(**link) -> HardwareProfile:
    kernel = AttentionCost(flops_per_s=4.0)  # flops_per_pair = 4 * heads * head_dim = 4
    return HardwareProfile("unit", "unit", matmul_flops_per_s=2.0, matmul_half_tokens=0.0, memory_Bps=1e30,
                           layer_s=0.0, attention={"causal": kernel, "full": kernel, "masked": kernel},
                           links={"unit": LinkProfile(**{"bandwidth_Bps": 2.0, **link})}, default_link="unit")


def unit_model(layers: int = 1, **link) -> CostModel:
    shape = ModelShape(**{**UNIT_SHAPE.to_dict(), "layers": layers})
    return CostModel(shape, unit_profile(**link))


def test_unit_costs_are_what_the_hand_computations_assume():
    m = unit_model()
    assert m.qkv_s(1) == 1 and m.other_s(1) == 1 and m.lm_head_s() == 1 and m.copy_s(100) < 1e-20
    assert m.causal_s(1) == 1 and m.causal_s(2) == 3 and m.full_s(1, 2) == 2 and m.masked_s(1, 2) == 2
    assert Links(m.link, 2).send(0, 1, 0.0, m.kv_bytes(1)) == 1


def test_two_ranks_one_layer_the_successor_waits_for_the_prefix():
    # rank 0: QKV 0-1, sends 1 token 1-2, attends+MLP 1-3. rank 1: QKV 0-1, waits 1-2, attends (causal 1 +
    # prefix 1) and MLP 2-5, LM head 5-6.
    r = simulate(unit_model(), "kvr", 2, 2, (0, 1, 2), "split")
    assert r.ttft_s == pytest.approx(6)
    assert r.ranks[1].wait_s == pytest.approx(1) and r.ranks[0].wait_s == 0
    assert r.ranks[0].bytes_sent == 2 and r.ranks[1].bytes_sent == 0


def test_two_ranks_two_layers_overlap_the_second_transfer():
    # Layer 2: rank 0 QKV 3-4, sends 4-5; rank 1 QKV 5-6 finds the prefix there (no wait), attends 6-8,
    # MLP 8-9, LM head 9-10. Only the first layer's transfer shows: nocomm takes 2 x 4 + 1 = 9.
    r = simulate(unit_model(layers=2), "kvr", 2, 2, (0, 1, 2), "split")
    assert r.ttft_s == pytest.approx(10)
    assert r.ranks[1].wait_s == pytest.approx(1)
    assert simulate(unit_model(layers=2), "kvr-nocomm", 2, 2, (0, 1, 2), "split").ttft_s == pytest.approx(9)


def test_latency_shows_once_and_a_busy_link_delays_the_next_message():
    # 1 s latency: layer 1's prefix arrives at 1 + 1 + 1 = 3 (rank 1 waits 1-3, attends 3-6); layer 2's is sent
    # at 4 and arrives at 6, when rank 1's QKV (6-7) has not even started: no wait. TTFT 6 + 4 + 1 = 11.
    r = simulate(unit_model(layers=2, latency_s=1.0), "kvr", 2, 2, (0, 1, 2), "split", record=True)
    assert r.ttft_s == pytest.approx(11) and r.ranks[1].wait_s == pytest.approx(2)
    # 3 s latency: layer 1's arrives at 5 (rank 1 waits 1-5, attends 5-8; the link is busy until 5); layer 2's
    # can start only at 5, when rank 1 has posted its receive and the link is free, and arrives at 9, exactly
    # when rank 1's QKV (8-9) ends: no second wait. TTFT 9 + 3 + 1 = 13.
    r = simulate(unit_model(layers=2, latency_s=3.0), "kvr", 2, 2, (0, 1, 2), "split", record=True)
    assert r.ttft_s == pytest.approx(13) and r.ranks[1].wait_s == pytest.approx(4)
    sends = [(s.start_s, s.end_s) for s in r.spans if s.kind == "send"]
    assert sends == [(1, 5), (5, 9)]


def test_three_ranks_the_prefix_grows_down_the_chain():
    # rank 1 waits 1-2, sends 2 tokens 2-4; rank 2 waits 1-4, attends causal 1 + prefix 2, MLP 1: 4-8, head 8-9.
    r = simulate(unit_model(), "kvr", 3, 3, (0, 1, 2, 3), "split")
    assert r.ttft_s == pytest.approx(9)
    assert [x.wait_s for x in r.ranks] == pytest.approx([0, 1, 3])
    assert [x.bytes_sent for x in r.ranks] == [2, 4, 0]
    assert r.link_bytes == {"0->1": 2, "1->2": 4}


def test_three_ranks_two_layers_the_chain_settles_into_overlap():
    # Layer 2: rank 0 sends 4-5, rank 1 (QKV 5-6) finds it and sends 6-8, rank 2 (QKV 8-9) finds that: the only
    # waits are layer 1's. Rank 2 attends 9-13, LM head 13-14.
    r = simulate(unit_model(layers=2), "kvr", 3, 3, (0, 1, 2, 3), "split")
    assert r.ttft_s == pytest.approx(14)
    assert [x.wait_s for x in r.ranks] == pytest.approx([0, 1, 3])
    assert r.link_bytes == {"0->1": 4, "1->2": 8}


def test_a_sender_waits_for_its_successor_to_post_the_receive():
    # rank 0 holds one token (3 s a layer), rank 1 three (QKV 3, attention 6 + 3 pairs, MLP 3: 15 s). Rank 1
    # posts its receive for layer l + 1 when layer l's prefix is in, after its QKV: at 3 for layer 2, at 18 for
    # layer 3. Rank 0 is ready to send layer 3's at 7 but the message leaves at 18.
    r = simulate(unit_model(layers=3), "kvr", 4, 2, (0, 1, 4), "split", record=True)
    sends = [(s.start_s, s.end_s) for s in r.spans if s.kind == "send"]
    assert sends == [(1, 2), (4, 5), (18, 19)]
    assert r.ranks[1].wait_s == 0


def test_masked_attention_computes_the_whole_rectangle():
    # rank 1 with 2 tokens after 1: split = causal(2) 3 + prefix 2 = 5 pairs; masked = 2 x 3 = 6 pairs.
    m = unit_model()
    assert m.kvr_attention_s("split", 2, 1) == 5 and m.kvr_attention_s("masked", 2, 1) == 6
    assert m.kvr_attention_s("masked", 2, 0) == m.causal_s(2)  # rank 0's mask is the plain causal one


def test_tsp_all_gathers_then_attends_to_full_rows():
    # both QKV 0-1, all-gather (1 ring step of 1 token) 1-2, masked 1x2 = 2 and MLP 1: 2-5, head 5-6.
    r = simulate(unit_model(), "tsp", 2, 2)
    assert r.ttft_s == pytest.approx(6)
    assert [x.wait_s for x in r.ranks] == pytest.approx([1, 1])
    assert r.link_bytes == {"0->1": 2, "1->0": 2}


def test_tsp_pads_the_all_gather_to_the_largest_part():
    # 5 tokens: parts of 2 and 3; both send 3 tokens (6 bytes, 3 s) once the slower QKV ends at 3: 3-6. Then
    # rank 0 scores 2 x 5 pairs (10 s) and rank 1 3 x 5 (15 s), MLP 2 and 3: rank 1 ends at 24, LM head 25.
    r = simulate(unit_model(), "tsp", 5, 2)
    assert r.ttft_s == pytest.approx(25) and r.link_bytes == {"0->1": 6, "1->0": 6}
    assert [x.wait_s for x in r.ranks] == pytest.approx([4, 3])


def test_all_gather_bytes_are_bytes_when_the_collective_is_slower():
    m = unit_model()
    m.profile.links["unit"] = LinkProfile(2.0, 0.0, "ring", 0.5)
    r = simulate(m, "tsp", 2, 2)
    assert r.link_bytes == {"0->1": 2, "1->0": 2}  # the same bytes
    assert r.ttft_s == pytest.approx(7)  # moved at half the rate: 2 s


def test_cp_allgather_attends_each_chunk_to_the_keys_it_sees():
    # 4 tokens, chunks of 1: rank 0 holds 0 and 3, rank 1 holds 1 and 2. QKV 0-2, all-gather (2 tokens) 2-4;
    # rank 0 scores 1 x 1 + 1 x 4 pairs, rank 1 1 x 2 + 1 x 3 (masked rectangles: 5 each), MLP 2: 4-11;
    # rank 0 holds the last token: LM head 11-12.
    r = simulate(unit_model(), "cp-allgather", 4, 2)
    assert r.ttft_s == pytest.approx(12)


def test_ring_passes_blocks_and_skips_the_masked_ones():
    # 4 tokens, chunks of 1: rank 0 holds 0 and 3, rank 1 holds 1 and 2. QKV 0-2; step 0 (own block: causal,
    # causal and one full pair) 2-5 while the blocks cross (2 s); step 1 (two visible pairs) 5-7; MLP 7-9;
    # rank 0 emits: head 9-10.
    r = simulate(unit_model(), "ring", 4, 2)
    assert r.ttft_s == pytest.approx(10)
    assert r.ranks[0].bytes_sent == 4 and r.ranks[1].bytes_sent == 4


def test_single_is_one_rank_over_everything():
    assert simulate(unit_model(), "single", 2, 1).ttft_s == pytest.approx(2 + 3 + 2 + 1)


def test_noise_slows_a_transfer_while_its_pair_is_loaded():
    # 10 B/s, noise 8 B/s on the only pair for the first half of every second: 10 bytes from t = 0 move
    # 1 byte (0-0.5 s), 5 (0.5-1), 1 (1-1.5) and the last 3 at full speed: done at 1.8 s.
    links = Links(LinkProfile(10.0), 2, NoiseModel(8.0, 1.0, 0.5))
    assert links.send(0, 1, 0.0, 10) == pytest.approx(1.8)
    assert Links(LinkProfile(10.0), 2).send(0, 1, 0.0, 10) == pytest.approx(1.0)


def test_messages_on_one_link_go_in_order():
    links = Links(LinkProfile(1.0), 2)
    assert links.send(0, 1, 0.0, 2) == 2 and links.send(0, 1, 1.0, 1) == 3 and links.send(1, 0, 1.0, 1) == 2


def test_bad_partitions_and_modes_are_refused():
    with pytest.raises(SimError, match="not a partition"):
        simulate(unit_model(), "kvr", 4, 2, (0, 4, 4))
    with pytest.raises(SimError, match="unknown mode"):
        simulate(unit_model(), "pipeline", 4, 2)


def test_a_causal_prefills_flops_per_token_agree_with_the_partition_estimate():
    """ModelShape's average per token (the network derivation's f(C)) and the FLOP estimate that prices a rank
    (kvrunahead.sim.flops) count the same work: one rank holding all C tokens scores C (C + 1) / 2 pairs."""
    from kvrunahead.model.load import resolve_config
    from kvrunahead.sim.flops import layer_cost
    from kvrunahead.sim.shape import shape_from_config

    config = resolve_config("tiny-llama")
    shape, cost = shape_from_config(config, "float32"), layer_cost(config)
    for c in (1, 512, 16384):
        assert c * shape.causal_flops_per_token(c) == pytest.approx(cost.rank_flops(0, c, "split"), rel=1e-12)
    llama = PAPER_SHAPES["llama-7b"]  # 2 FLOPs per parameter, 4 per pair and head dimension (QK^T, AV)
    assert llama.causal_flops_per_token(1) == 2 * llama.layer_params + 4 * 32 * 128


def test_a_cap_the_profile_did_not_measure_is_priced_from_the_nearest_measured_cap():
    from kvrunahead.sim.profile import SHIPPED_DIR

    cpu = HardwareProfile.load(SHIPPED_DIR / "cpu-t1.json")
    high, low = cpu.links["cap=650MB/s"], cpu.links["cap=22MB/s"]
    assert cpu.for_network("cap=650MB/s") == (cpu, "cap=650MB/s", "link cap=650MB/s")
    assert cpu.for_network(None)[1:] == ("loopback", "link loopback")
    p400, label, note = cpu.for_network("cap=400MB/s")
    assert label == "cap=400MB/s" and "cap=650MB/s rescaled" in note and "cap=400MB/s" not in cpu.links
    assert p400.link(label) == LinkProfile(high.bandwidth_Bps * 400 / 650, high.latency_s, high.allgather,
                                           high.allgather_efficiency, high.compute_s_per_byte)
    p13, _, note = cpu.for_network("cap=13MB/s")
    assert "cap=22MB/s rescaled" in note and p13.link("cap=13MB/s").bandwidth_Bps == pytest.approx(
        low.bandwidth_Bps * 13 / 22)
    gpu = builtin_profiles()["a100-nvlink"]  # no capped link measured: its default, and says so
    used, note = gpu.for_network("cap=400MB/s")[1:]
    assert used == gpu.default_link and note == f"link {used} (the profile measured none for cap=400MB/s)"


def test_without_a_table_a_capped_run_is_partitioned_on_its_cap(tmp_path, monkeypatch):
    from kvrunahead.config import RunConfig
    from kvrunahead.decide import tables
    from kvrunahead.decide.policy import prepare

    monkeypatch.setattr(tables, "TABLES_DIR", tmp_path)  # no table: the cost model decides
    monkeypatch.setenv("KVR_CACHE", str(tmp_path))  # the shipped profile, not one calibrated here
    source = prepare(RunConfig(model="tiny-llama", context_len=2048, net="cap=400MB/s", threads=1), 2).partition_source
    assert "link cap=400MB/s (the measured cap=650MB/s rescaled)" in source


def test_cost_model_units_and_monotonicity():
    a100 = builtin_profiles()["a100-nvlink-flash"]
    m = CostModel(PAPER_SHAPES["llama-7b"], a100)
    assert PAPER_SHAPES["llama-7b"].kv_bytes_per_token == 2 * 32 * 128 * 2  # K and V, fp16, per layer
    assert PAPER_SHAPES["falcon-7b"].kv_bytes_per_token == 2 * 1 * 64 * 2  # multi-query
    times = [m.qkv_s(n) for n in (1, 64, 1024, 8192)]
    assert times == sorted(times) and len(set(times)) == 4
    for attention in ("split", "masked"):
        by_prefix = [m.kvr_attention_s(attention, 1024, b) for b in (0, 1024, 4096, 16384)]
        assert by_prefix == sorted(by_prefix)
    assert m.kvr_attention_s("masked", 2048, 4096) > m.kvr_attention_s("split", 2048, 4096)
    # A 7B model's prefill of 8k tokens: seconds, not micro- or kiloseconds.
    assert 0.05 < simulate(m, "single", 8192, 1).ttft_s < 5


def test_model_search_finds_the_analytic_optimum():
    # Attention only (projections free, instant links): split attention costs rank 0 n0^2/2 and rank 1
    # n1 n0 + n1^2/2; they are equal at n0 = (1 + sqrt 2) n1, i.e. rank 0's share 1/sqrt(2).
    shape = ModelShape("attn", 64, 1, 1, 1, 1, 1, 1, 1, 1)
    kernel = AttentionCost(flops_per_s=4.0)
    prof = HardwareProfile("attn", "attn", 1e30, 0.0, 1e30, 0.0, {k: kernel for k in ("causal", "full", "masked")},
                           {"l": LinkProfile(1e30)}, "l")
    r = search_partition(CostModel(shape, prof), 4096, 2, "split", min_stride=16)
    assert r.boundaries[1] / 4096 == pytest.approx(1 / math.sqrt(2), abs=0.01)
    assert r.ttft_s < r.even_ttft_s


def test_model_search_scales_to_many_ranks():
    m = CostModel(PAPER_SHAPES["llama-7b"], builtin_profiles()["h100-nvlink"])
    r = search_partition(m, 1 << 17, 16, "split", min_stride=64)
    sizes = [b - a for a, b in zip(r.boundaries, r.boundaries[1:])]
    assert sizes[0] > sizes[-1]  # later ranks carry longer prefixes: fewer tokens
    assert r.ttft_s < 0.9 * r.even_ttft_s


def test_plan_considers_every_rank_count_and_mode():
    assert rank_counts(8) == [1, 2, 4, 8] and rank_counts(6) == [1, 2, 4, 6]
    m = CostModel(PAPER_SHAPES["llama-7b"], builtin_profiles()["a100-nvlink"])
    options = plan(m, 16384, 8, attention="masked")
    assert {(o.ranks, o.mode) for o in options} >= {(1, "single"), (8, "kvr"), (4, "tsp"), (2, "ring")}
    assert options[0].ranks == 8  # 16k on NVLink: the most ranks win
    # Appendix B's shape: on a link slow enough, a short prompt is fastest on fewer ranks than allowed.
    prof = builtin_profiles()["a100-pcie"]
    prof.links = {"pcie": LinkProfile(0.5e9, 10e-6, "native")}
    assert plan(CostModel(PAPER_SHAPES["llama-7b"], prof), 1024, 8, ("tsp",))[0].ranks < 8


def test_profile_round_trips(tmp_path):
    for name, prof in builtin_profiles().items():
        path = tmp_path / f"{name}.json"
        prof.save(path)
        assert HardwareProfile.load(path) == prof
    assert resolve_profile(str(tmp_path / "a100-nvlink.json"))[0].name == "a100-nvlink"


def test_malformed_profiles_are_refused(tmp_path):
    with pytest.raises(ProfileError, match="malformed"):
        HardwareProfile.from_dict({"name": "x"})
    data = builtin_profiles()["h100-nvlink"].to_dict()
    data["matmul_flops_per_s"] = -1.0
    with pytest.raises(ProfileError, match="not positive"):
        HardwareProfile.from_dict(data)
    with pytest.raises(ProfileError, match="no profile"):
        resolve_profile(str(tmp_path / "missing.json"))


def test_without_a_local_profile_the_shipped_cpu_profile_is_used(tmp_path, monkeypatch):
    monkeypatch.setenv("KVR_CACHE", str(tmp_path))
    prof, which = resolve_profile(None)
    assert which.startswith("the shipped CPU profile")
    assert prof.device_kind == "cpu" and prof.threads == 1 and set(prof.links) >= {"loopback", "cap=650MB/s"}
    local = tmp_path / "profiles" / "cpu-t1.json"
    prof.save(local)
    assert resolve_profile(None)[1] == f"this machine's profile {local}"


def test_refine_measures_the_seed_and_moves_to_a_better_neighbour():
    from kvrunahead.search.algorithm import refine

    calls = []

    def measure(b):
        calls.append(b)
        return (b[1] - 700) ** 2

    r = refine(measure, (0, 640, 2048), min_stride=64)
    assert r.boundaries == (0, 704, 2048) and len(calls) == 4


def test_kvr_search_model_backend_writes_a_table_without_ranks(tmp_path):
    from kvrunahead.cli.search import main

    out = tmp_path / "t.json"
    res = CliRunner().invoke(main, ["--backend", "model", "--nproc", "8", "--ctx", "16k", "--out", str(out),
                                    "--profile", "a100-nvlink-flash"])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["meta"]["source"] == "cost model: a100-nvlink-flash" and data["meta"]["world_size"] == 8
    assert data["meta"]["device_kind"] == "cuda"
    entry = data["entries"][0]
    # A measured table is never written to by a model-backed search.
    measured = tmp_path / "measured.json"
    data["meta"]["source"] = "measured"
    measured.write_text(json.dumps(data))
    res = CliRunner().invoke(main, ["--backend", "model", "--nproc", "8", "--ctx", "8k", "--out", str(measured),
                                    "--profile", "a100-nvlink-flash"])
    assert res.exit_code == 2 and "measured entries" in res.output
    assert len(entry["boundaries"]) == 9 and entry["ttft_s"] < entry["even_ttft_s"]
    # The model's balance at its answer, beside the TTFT, as a measured balance search records it.
    assert entry["criterion"] == "model" and len(entry["busy_s"]) == 8
    assert entry["balance"] == pytest.approx(max(entry["busy_s"]) / min(entry["busy_s"]), rel=1e-3)
    even = predicted_busy(cost_model(SearchOptions(context_lens=(16384,), profile="a100-nvlink-flash"), 8)[1],
                          Partition.even(16384, 8).boundaries, "split")
    assert entry["balance"] < max(even) / min(even)  # later ranks carry more at even: it moved toward balance


def test_refine_needs_the_model_backend():
    from kvrunahead.cli.search import main

    res = CliRunner().invoke(main, ["--refine", "--ctx", "1k"])
    assert res.exit_code == 2 and "--backend model" in res.output


def test_kvr_plan_cli(tmp_path):
    from kvrunahead.cli.sim import plan_main

    res = CliRunner().invoke(plan_main, ["--ctx", "32k", "--profile", "h100-nvlink", "--max-ranks", "8", "--json",
                                         "--timeline", str(tmp_path / "t.png")])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report[0]["recommended"]["ranks"] >= 2 and (tmp_path / "t.png").stat().st_size > 1000
    million = CliRunner().invoke(plan_main, ["--ctx", "1M", "--profile", "a100-nvlink", "--ranks", "2", "--json"])
    assert million.exit_code == 0 and json.loads(million.stdout)[0]["context_len"] == 1 << 20
    bad = CliRunner().invoke(plan_main, ["--ctx", "1k", "--profile", "tpu-v5"])
    assert bad.exit_code == 2 and "no profile" in bad.output


def test_kvr_calibrate_writes_a_profile_the_simulator_reads(tmp_path):
    from kvrunahead.cli.sim import calibrate_main

    out = tmp_path / "p.json"
    res = CliRunner().invoke(calibrate_main, ["--model", "tiny-llama", "--quick", "--repeats", "1", "--ranks", "1",
                                              "--out", str(out)])
    assert res.exit_code == 0, res.output
    prof = HardwareProfile.load(out)
    # What it measured is there and usable; how fast this machine is belongs to the profiles in experiments/, not
    # to a test on whatever machine runs it.
    assert 0 < prof.matmul_flops_per_s < math.inf and 0 < prof.memory_Bps < math.inf
    assert "whole_prefill_1024" in prof.fit
    assert all(0 < k.flops_per_s < math.inf for k in prof.attention.values())
    assert "decode" in prof.attention and "attention_decode" in prof.fit
    link = prof.links["loopback"]
    assert link.bandwidth_Bps > 0 and 0 < link.allgather_efficiency <= 1 and link.compute_s_per_byte >= 0
    assert prof.versions["torch"] and prof.date and "linear" in prof.fit
    # It predicts: a longer prompt takes longer, and the search returns a partition of the prompt.
    m = CostModel(PAPER_SHAPES["llama-7b"], prof)
    assert simulate(m, "single", 2048, 1).ttft_s > simulate(m, "single", 1024, 1).ttft_s > 0
    found = search_partition(m, 4096, 2, "split")
    assert found.ttft_s > 0 and found.boundaries[0] == 0 and found.boundaries[-1] == 4096


def test_kvr_calibrate_refuses_bad_input():
    from kvrunahead.cli.sim import calibrate_main

    res = CliRunner().invoke(calibrate_main, ["--threads", "0"])
    assert res.exit_code == 2 and "at least 1" in res.output
    res = CliRunner().invoke(calibrate_main, ["--device", "cuda", "--net", "cap=100MB/s"])
    assert res.exit_code == 2 and "one GPU alone" in res.output


def test_kvr_calibrate_on_a_machine_without_a_gpu_says_so_before_any_work():
    import torch

    from kvrunahead.cli.sim import calibrate_main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")

    res = CliRunner().invoke(calibrate_main, ["--device", "cuda"])
    assert res.exit_code == 2 and "--device cuda asked for" in res.output


def test_a_gpu_profile_is_named_by_its_gpu_and_keeps_the_builtin_nvlink_saying_so():
    from kvrunahead.calibrate.calibrate import gpu_profile_name
    from kvrunahead.sim.profile import keep_builtin_links

    assert gpu_profile_name("NVIDIA H100 80GB HBM3") == "h100-measured"
    assert gpu_profile_name("NVIDIA A100-SXM4-80GB") == "a100-measured"
    assert gpu_profile_name("Tesla T4") == "gpu-measured"
    shipped, _ = resolve_profile("h100-measured")  # the campaign's profile, shipped with the package
    assert shipped.device_kind == "cuda" and shipped.device.startswith("NVIDIA H100")
    keep_builtin_links(shipped)
    assert shipped.links == builtin_profiles()["h100-nvlink"].links and "not measured" in shipped.sources["links"]
    h200, _ = resolve_profile("h200-measured")  # the campaign's 8x calibration shapes, run on an H200
    assert h200.device_kind == "cuda" and h200.device.startswith("NVIDIA H200")


def test_a_search_under_noise_is_repeatable_and_prices_the_noise():
    m = CostModel(PAPER_SHAPES["llama-7b"], builtin_profiles()["a100-pcie"])
    noise = NoiseModel(5e9, 0.05, 0.5)
    a = search_partition(m, 8192, 4, "masked", noise, min_stride=64)
    b = search_partition(m, 8192, 4, "masked", noise, min_stride=64)
    quiet = search_partition(m, 8192, 4, "masked", None, min_stride=64)
    assert a.boundaries == b.boundaries and a.ttft_s == b.ttft_s
    assert a.ttft_s > quiet.ttft_s  # half the link's rate gone half the time costs something at 10 GB/s


def test_the_masked_kernels_pairs_cost_more_per_key_doubling_and_its_fit_leaves_out_chunks(tmp_path):
    from kvrunahead.calibrate.calibrate import ATTENTION_SHAPES, MASKED_MIN_QUERIES, _cases

    grows = AttentionCost(flops_per_s=4.0, pair_growth_s=0.5)  # a pair: 1 s, and 0.5 s more per key doubling
    prof = dataclasses.replace(unit_profile(), attention={**unit_profile().attention, "masked": grows})
    m = CostModel(UNIT_SHAPE, prof)
    assert m.masked_s(1, 256) == 256 and m.masked_s(1, 512) == 512 * 1.5 and m.masked_s(2, 1024) == 2048 * 2
    assert m.full_s(1, 1024) == 1024  # the other kernels have no growth
    path = tmp_path / "p.json"
    prof.save(path)
    assert HardwareProfile.load(path).attention["masked"].pair_growth_s == 0.5
    cases = _cases("masked", ATTENTION_SHAPES)
    assert cases and all(q >= MASKED_MIN_QUERIES for q, _ in cases)
    assert len(cases) < len(_cases("full", ATTENTION_SHAPES)) == len(ATTENTION_SHAPES)


def test_tp_halves_a_ranks_share_and_adds_two_ring_all_reduces_per_layer():
    shape = PAPER_SHAPES["llama-7b"]  # 32 heads, 32 K,V heads: an even cut
    cost = CostModel(shape, unit_profile(latency_s=0.5))
    tp = cost.over_tp(2, "unit")
    assert tp.shape.heads == 16 and tp.shape.kv_heads == 16 and tp.shape.qkv_params * 2 == shape.qkv_params
    # one all-reduce of 3 tokens over 2 ranks: 2 steps of latency and half the bytes at 2 B/s
    assert tp.allreduce_s(3) == 2 * (0.5 + 3 * 4096 * 2 / 2 / 2.0)
    assert tp.other_s(3) == pytest.approx(cost.other_s(3) / 2 + 2 * tp.allreduce_s(3), rel=1e-3)
    smol = dataclasses.replace(shape, heads=9, kv_heads=3)  # whole K,V groups: the busiest rank takes 2 of 3
    assert smol.tp_shard(2).heads == 6 and smol.tp_shard(2).kv_heads == 2
    mqa = PAPER_SHAPES["llama-7b-mqa"].tp_shard(8)  # one K,V head, replicated: 4 query heads each
    assert mqa.heads == 4 and mqa.kv_heads == 1


def test_the_plan_over_tp_groups_has_tp_over_every_rank_beside_it():
    cost = CostModel(PAPER_SHAPES["llama-7b"], builtin_profiles()["a100-nvlink-flash"])
    options = {o.label: o for o in plan(cost, 4096, 16, ("kvr", "ring"), ranks=[8, 16], tp=8)}
    assert {"single", "tp x8", "tp x16", "kvr x2 of tp8", "ring x2 of tp8"} <= set(options)
    assert options["kvr x2 of tp8"].ttft_s < options["tp x8"].ttft_s < options["single"].ttft_s
    assert options["tp x8"].weight_bytes < options["single"].weight_bytes / 4


@pytest.mark.parametrize("tokens,kept,window", [(1, 0, 4), (4, 0, 4), (5, 0, 4), (9, 3, 4), (12, 2, 4), (13, 0, 4),
                                                (1000, 63, 64), (1000, 17, 64), (64, 0, 64), (63, 63, 64)])
def test_a_sliding_layers_price_is_the_sum_over_its_blocks_of_queries(tokens, kept, window):
    """window_attention_s prices the part's blocks of ``window`` queries in closed form: the same as each block's
    masked call over the keys its window reaches, summed."""
    m = unit_model()
    blocks = sum(m.masked_s(min(a + window, tokens) - a, kept + min(a + window, tokens) - max(0, kept + a - window + 1))
                 for a in range(0, tokens, window))
    assert m.window_attention_s("split", tokens, kept, window) == pytest.approx(blocks, rel=1e-12)
