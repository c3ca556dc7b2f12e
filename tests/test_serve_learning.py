"""The degree corrected by the server's own timings (serve/learning.py): a bucket explores each layout the prior
leaves open a few times, then runs the one its timings say is faster, with a bounded share retimed; the timings
persist per setting and export as the measured table pair the degree policy reads first."""

import json
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvrunahead.cli.learned import main as learned_main
from kvrunahead.config import RunConfig
from kvrunahead.decide.policy import table_key
from kvrunahead.decide.tables import Table
from kvrunahead.model.load import resolve_config
from kvrunahead.serve import learning
from kvrunahead.serve.degree import DegreePolicy, layout_learner
from kvrunahead.serve.learning import MIN_TIMINGS, REFRESH_EVERY, LayoutLearner, bucket_of

NAMES = {1: "1 rank", 2: "the chain of 2"}


def _serve(learner: LayoutLearner, n: int, prices: dict[int, float], truth: dict[int, float], requests: int,
           rng: random.Random) -> list:
    """``requests`` prompts of ``n`` tokens: each layout's true seconds with 5% noise, taught back."""
    choices = []
    for _ in range(requests):
        c = learner.choose(n, prices)
        choices.append(c)
        learner.learn(n, c.degree, truth[c.degree] * rng.uniform(0.95, 1.05), prices[c.degree], (0, n))
    return choices


def test_a_prior_the_timings_contradict_is_overruled_after_a_few_explorations():
    learner = LayoutLearner({"k": 1}, None, NAMES)
    prices = {1: 1.05, 2: 1.0}  # the prior: the chain 5% ahead
    truth = {1: 0.9, 2: 1.0}  # the host: one rank 10% ahead
    choices = _serve(learner, 1024, prices, truth, 60, random.Random(0))
    explored = choices[:2 * MIN_TIMINGS]
    assert [c.degree for c in explored].count(1) == MIN_TIMINGS and all(c.basis == "exploring" for c in explored)
    assert explored[0].degree == 2  # a tie in timings goes to the prior's choice
    settled = choices[2 * MIN_TIMINGS:]
    assert all(c.basis in ("learned", "exploring") for c in settled)
    learned = [c for c in settled if c.basis == "learned"]
    assert all(c.degree == 1 for c in learned) and "learned: 1 rank" in learned[0].why
    retimed = [c for c in settled if c.basis == "exploring"]
    assert 0 < len(retimed) <= len(settled) / REFRESH_EVERY + 1 and all(c.degree == 2 for c in retimed)
    assert "at 862-1217 tokens" in learned[0].why


def test_a_clear_loser_is_not_retimed_and_a_layout_the_prior_rules_out_is_never_explored():
    learner = LayoutLearner({}, None, NAMES)
    choices = _serve(learner, 2048, {1: 1.0, 2: 1.0}, {1: 2.0, 2: 1.0}, 40, random.Random(1))
    assert [c.degree for c in choices[2 * MIN_TIMINGS:]] == [2] * (40 - 2 * MIN_TIMINGS)  # 2x slower: not retimed
    assert learner.choose(100, {1: 0.1, 2: 0.2}) is None  # the chain priced 2x one rank: the prior decides


def test_an_untimed_bucket_does_not_explore_for_a_prefill_that_will_not_be_timed():
    learner = LayoutLearner({}, None, NAMES)
    assert learner.choose(3000, {1: 1.0, 2: 1.1}, explore=False) is None
    _serve(learner, 3000, {1: 1.0, 2: 1.1}, {1: 2.0, 2: 1.0}, 2 * MIN_TIMINGS, random.Random(2))
    assert learner.choose(3000, {1: 1.0, 2: 1.1}, explore=False).degree == 2


def test_buckets_are_two_per_doubling_with_the_round_lengths_inside():
    assert [bucket_of(n) for n in (430, 431, 608, 609, 1023, 1024, 1025, 1536, 16384)] == [362, 512, 512, 724, 1024,
                                                                                           1024, 1024, 1448, 16384]
    assert learning.bucket_range(1024) == "862-1217" and learning.bucket_range(1217) == "862-1217"
    assert learning.bucket_range(1218) == "1218-1722"


def test_the_timings_persist_and_another_setting_starts_afresh(tmp_path, caplog):
    path = tmp_path / "learned.json"
    first = LayoutLearner({"model": "a"}, path, NAMES)
    _serve(first, 1024, {1: 1.0, 2: 1.0}, {1: 0.5, 2: 1.0}, 10, random.Random(3))
    first.flush()  # written on a thread of its own
    again = LayoutLearner({"model": "a"}, path, NAMES)
    assert again.timings() == first.timings() == 10
    assert again.choose(1024, {1: 1.0, 2: 1.0}).basis == "learned"  # no exploration after a restart
    other = LayoutLearner({"model": "b"}, path, NAMES)
    assert other.timings() == 0 and "another setting" in caplog.text
    assert (tmp_path / "learned.json.old").exists() and not path.exists()


@pytest.fixture
def shipped_profiles_only(tmp_path, monkeypatch):
    monkeypatch.setenv("KVR_CACHE", str(tmp_path))


def _learning_policy(spec: str) -> DegreePolicy:
    cfg = RunConfig(threads=1)
    config = resolve_config(cfg.model)
    learner = layout_learner(spec, cfg, config, 2, 2, "split", 1, 2, pipeline=False)
    return DegreePolicy(cfg, config, 2, 2, "split", 1, "auto", 2, learner=learner)


def test_the_policy_follows_its_timings_and_exports_them_as_the_table_pair(shipped_profiles_only, tmp_path):
    policy = _learning_policy("auto")
    n = 4096
    prior = policy.choose(n)
    assert prior.degree == 2 and prior.basis == "exploring"  # the cost model prefers the chain at 4k on this profile
    for _ in range(3 * MIN_TIMINGS):
        choice = policy.choose(n)
        policy.learn(n, choice.degree, {1: 5.0, 2: 6.0}[choice.degree], (0, 2100, n) if choice.degree == 2
                     else (0, n))
    choice = policy.choose(n)
    assert (choice.degree, choice.basis) == (1, "learned")
    assert "learned: 1 rank 5.000 s" in choice.source and "the prior: cost model" in choice.source
    policy.learner.flush()
    files = list((tmp_path / "learned").glob("*.json"))  # --learn auto: in the cache folder, named by setting
    assert len(files) == 1 and "smollm2-135m_p2_float32_cpu_split" in files[0].name

    r = CliRunner().invoke(learned_main, [str(files[0]), "--export", str(tmp_path / "tables")])
    assert r.exit_code == 0, r.output
    assert f"| {bucket_of(n)} | 1 |" in r.output and f"| {bucket_of(n)} | 2 |" in r.output
    cfg = RunConfig(threads=1)
    config = resolve_config(cfg.model)
    for degree, threads, bounds, seconds in ((1, 2, [0, n], 5.0), (2, 1, [0, 2100, n], 6.0)):
        table = Table.load(tmp_path / "tables" / f"smollm2-135m_p{degree}_float32_cpu_split_served.json")
        want = table_key(cfg, config, 2, "split", 2)
        assert table.meta.key.world_size == degree and table.meta.threads_per_rank == threads
        assert table.meta.key.model == want.model and table.meta.key.config_hash == want.config_hash
        assert table.meta.source == "measured" and table.entries[0].boundaries == bounds
        assert table.entries[0].ttft_s == pytest.approx(seconds)


def test_kvr_learned_refuses_what_it_cannot_read_in_one_line(tmp_path, shipped_profiles_only):
    r = CliRunner().invoke(learned_main, [])
    assert r.exit_code == 2 and "no learned timings" in r.output
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": 1}))
    r = CliRunner().invoke(learned_main, [str(bad)])
    assert r.exit_code == 2 and r.output.strip().startswith("kvr-learned: error: cannot read")
    assert learning.FORMAT == 1


def test_off_learns_nothing_and_forced_degrees_are_not_corrected(shipped_profiles_only):
    assert layout_learner("off", RunConfig(), None, 2, 2, "split", 1, 2, False) is None
    policy = _learning_policy("auto")
    policy.forced = 2
    assert policy.choose(1024).basis == "forced"


def test_the_partition_moves_to_the_ranks_measured_balance():
    learner = LayoutLearner({}, None, NAMES)

    def work(prefix, tokens):
        return tokens * (1 + (prefix + tokens / 2) / 1000)  # a causal rank's work grows with what it attends to

    bounds = (0, 2000, 4000)
    busy = (work(0, 2000) * 1.0, work(2000, 2000) * 1.5)  # rank 1 runs 1.5x slower per unit of work
    for _ in range(3):
        learner.learn(4000, 2, 1.0, 1.0, bounds, busy)
    rates, runs = learner.rates(3900, 2, work)  # another length of the same bucket
    assert runs == 3 and rates == pytest.approx([1.0, 1.5])
    cut = learning.boundaries_at_rates(rates, work, 4000, learning.QUANTUM)
    assert cut[1] % learning.QUANTUM == 0 and cut[1] > 2000  # rank 0 takes more
    assert work(0, cut[1]) == pytest.approx(1.5 * work(cut[1], 4000 - cut[1]), rel=0.01)
    assert learner.rates(1000, 2, work) is None  # another bucket: nothing learned there


@pytest.mark.timeout(300)
def test_a_served_chain_learns_its_partition_and_stays_exact(tmp_path):
    from tests.test_serve_engine import ranks_ran

    prompts = [[(7 * i + 13 * k) % 500 + 3 for k in range(600)] for i in range(3)]
    path = tmp_path / "learned.json"
    scenario = {"name": "learned", "run": {"model": "tiny-llama", "threads": 1}, "learn": str(path),
                "prompts": prompts, "max_tokens": 4}
    runs = ranks_ran(scenario, tmp_path)[1]["runs"]
    assert "learned" not in runs[0]["source"]
    for k, run in enumerate(runs[1:], 1):
        assert run["source"].startswith(f"learned: balanced at the ranks' rates in {k} served prefill(s)")
    for run in runs:
        assert run["tokens"] == run["ref"] and len(run["busy"]) == 2
    saved = json.loads(path.read_text())["buckets"][str(bucket_of(600))]["2"]
    assert len(saved) == 3 and all(len(row[4]) == 2 for row in saved)


DATA = Path(__file__).parent / "data"


def _smollm2_work():
    from kvrunahead.sim.flops import layer_cost

    cost = layer_cost(resolve_config("smollm2-135m"))
    return lambda prefix, tokens: cost.rank_flops(prefix, tokens, "split")


def test_the_short_prompt_file_that_ended_a_server_cuts_every_short_prompt_within_it(tmp_path):
    """tests/data/learned-short-prompt.json: what a server's own traffic left, its 5-token bucket timed over the
    chain at [0, 4, 5]; the partition its rates derive for each prompt of that bucket and the other short ones lies
    within the prompt (it once cut a 5-token prompt at -3: the 8-token quantum wider than a part)."""
    data = json.loads((DATA / "learned-short-prompt.json").read_text())
    path = tmp_path / "learned.json"
    path.write_text(json.dumps(data))
    learner = LayoutLearner(data["key"], path, NAMES)
    assert learner.ignored == [] and learner.timings() == 16
    work = _smollm2_work()
    for n in range(2, 48):
        found = learner.rates(n, 2, work)
        if found is None:
            continue
        cut = learning.boundaries_at_rates(found[0], work, n, learning.QUANTUM)
        assert cut[0] == 0 < cut[1] < cut[2] == n, (n, cut)


def test_a_learned_file_is_checked_on_load_and_what_cannot_serve_is_ignored_with_a_warning(tmp_path, caplog):
    good = [5, 0.2, 30.0, [0, 3, 5], [0.1, 0.1]]
    bad = [[5, 0.2, 30.0, [0, -3, 5], [0.1, 0.1]],  # a cut below zero
           [5, float("nan"), 30.0, [0, 3, 5], []],  # not a time
           [5, -1.0, 30.0, [0, 3, 5], []],
           [9, 0.2, 30.0, [0, 3, 9], []],  # another bucket's length
           [5, 0.2, 30.0, [0, 3, 4], []],  # boundaries of another length
           [5, 0.2, 30.0, [0, 3, 5], [0.1]],  # one compute time for two ranks
           ["5", 0.2, 30.0, [0, 3, 5], []],
           [5, 0.2]]
    key = {"model": "m"}
    path = tmp_path / "learned.json"
    path.write_text(json.dumps({"format": 1, "key": key, "buckets": {
        "5": {"2": [good, *bad], "1": [[5, 0.1, 20.0, [0, 5], []]], "7": [[5, 0.1, 20.0, [0, 5], []]]}}}))
    learner = LayoutLearner(key, path, NAMES)
    assert learner.timings() == 2 and len(learner.ignored) == len(bad) + 1  # degree 7 is not run here
    assert f"ignored {len(bad) + 1} learned timing(s) that cannot serve" in caplog.text
    assert "[0, -3, 5]" in caplog.text
    learner.learn(5, 1, 0.1, 0.01, (0, 5))  # the next save keeps only what can serve
    learner.flush()
    saved = json.loads(path.read_text())["buckets"]["5"]
    assert saved["2"] == [good] and len(saved["1"]) == 2 and "7" not in saved
    for garbage in ("[1, 2]", '{"format": 1, "key": {"model": "m"}, "buckets": [1]}', "{", '"x"'):
        path.write_text(garbage)
        assert LayoutLearner(key, path, NAMES).timings() == 0  # started afresh, never raised


def test_learn_refuses_a_path_it_could_not_write_and_a_failed_save_is_kept_in_memory(tmp_path, caplog):
    learning.check_path("off", tmp_path)
    learning.check_path("auto", tmp_path / "not" / "yet")
    learning.check_path(str(tmp_path / "new" / "learned.json"), tmp_path)
    with pytest.raises(ValueError, match="a folder, not a file"):
        learning.check_path(str(tmp_path), tmp_path)
    (tmp_path / "plain").write_text("")
    with pytest.raises(ValueError, match="not a folder this server can write in"):
        learning.check_path(str(tmp_path / "plain" / "learned.json"), tmp_path)
    learner = LayoutLearner({}, tmp_path / "plain" / "learned.json", NAMES)
    learner.learn(1024, 1, 1.0, 1.0, (0, 1024))  # the folder is a file: not saved, still learnt
    learner.flush()
    assert learner.timings() == 1 and "kept in memory" in caplog.text


def test_kvr_serve_refuses_a_learn_folder_before_any_rank_starts(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "kvrunahead.cli.serve", "--model", "tiny-llama", "--learn",
                        str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"kvr-serve: error: --learn {tmp_path}: a folder, not a file; give a file's path, auto or off"], r.stderr


def test_kvr_learned_reset_forgets_a_setting_and_the_listing_names_what_was_ignored(tmp_path, shipped_profiles_only):
    path = tmp_path / "learned" / "a.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"format": 1, "key": {"model": "smollm2-135m", "dtype": "float32", "world_size": 2,
                                                     "threads": 1, "solo_threads": 2, "bandwidth": "loopback",
                                                     "prefill": "chain"},
                                "buckets": {"5": {"2": [[5, 0.2, 30.0, [0, -3, 5], []]]}}}))
    r = CliRunner().invoke(learned_main, [])
    assert r.exit_code == 0 and "ignored 1 timing(s) that cannot serve" in r.output and "[0, -3, 5]" in r.output
    r = CliRunner().invoke(learned_main, ["--reset", "--export", str(tmp_path)])
    assert r.exit_code == 2 and "one at a time" in r.output
    r = CliRunner().invoke(learned_main, ["--reset"])
    assert r.exit_code == 0 and r.output.strip() == f"reset {path}" and not path.exists()
    r = CliRunner().invoke(learned_main, [str(path), "--reset"])
    assert r.exit_code == 2 and "no learned timings at" in r.output
