"""The parts of a worker's loss, one at a time (the whole, on real ranks: tests/test_serve_recovery.py): a request
run again after its stream sent tokens goes on where it was, sampled or greedy; a decode row cut back after a
forward that failed part way decodes as if it never ran; the launcher starts a failed or reported generation of
workers again, and ends with the front; the front's patience."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from kvrunahead.config import RunConfig
from kvrunahead.ranks.launcher import World
from kvrunahead.ranks.recovery import RecoveryDir
from kvrunahead.ranks.supervise import supervise_recovering
from kvrunahead.serve.config import EngineConfig
from kvrunahead.serve.engine import Engine
from kvrunahead.serve.recovery import Held, Recovery
from kvrunahead.serve.sequence import Finished, Request, SamplingParams, TokenEvent

PROMPT = list(range(30, 70))


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(run=RunConfig(model="tiny-llama", threads=1), max_queue=4), World(0, 1, 0, 1, "single"))


def _recovery(engine: Engine) -> Recovery:
    """The front's recovery as a launcher that brings workers back would give it (a one-process engine has none)."""
    return Recovery(None, engine.ctx, engine.config.run, engine.world, engine.rank_setup, Held(
        engine.scheduler, engine.decoder, engine.heartbeat, engine.samplers, engine._finish))


def _run(engine: Engine, request: Request, each_step=None) -> tuple[list[int], Finished]:
    tokens: list[int] = []
    for step in range(500):
        for e in engine.step():
            if isinstance(e, TokenEvent) and e.request_id == request.request_id:
                tokens.append(e.token_id)
            elif isinstance(e, Finished) and e.request_id == request.request_id:
                return tokens, e
        if each_step is not None:
            each_step(step)
    raise AssertionError("the request did not finish")


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                                    SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)])
def test_a_request_run_again_goes_on_after_the_tokens_its_stream_sent(engine, params):
    """After 6 tokens the request runs again from its prompt (as a KV-parallel decode does when a worker is lost):
    its stream gets no token twice, the tokens it had are fed back (a sampled stream keeps the ones it sent), and
    a greedy stream is exactly the undisturbed one."""
    first = Request("alone", PROMPT, params)
    engine.add(first)
    alone, _ = _run(engine, first)
    request = Request("again", PROMPT, params)
    engine.add(request)

    def rerun(step: int) -> None:
        seq = next((s for s in engine.scheduler.running if s.request_id == "again"), None)
        if seq is not None and len(seq.output_ids) == 6 and not seq.retried:
            assert _recovery(engine).rerun(seq, "test") == []

    tokens, done = _run(engine, request, rerun)
    assert len(tokens) == 24 and done.completion_tokens == 24 and done.figures.retried == 1
    if params.temperature == 0:
        assert tokens == alone


def test_a_decode_row_cut_back_after_a_failed_forward_decodes_as_if_it_never_ran(engine):
    """A forward that fails part way has appended the row's token to some layers: cut back to the positions the
    request had, its decode is the undisturbed one."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    first = Request("plain", PROMPT, params)
    engine.add(first)
    plain, _ = _run(engine, first)
    request = Request("cut", PROMPT, params)
    engine.add(request)
    cut: list[int] = []

    def half_a_forward(step: int) -> None:
        seq = next((s for s in engine.scheduler.running if s.request_id == "cut"), None)
        if seq is None or len(seq.output_ids) != 4 or cut:
            return
        cut.append(seq.next_position)
        kv = engine.decoder.own["cut"]  # the front's pool
        slot = torch.tensor([kv.grow("cut")])  # the forward took the row's position
        for layer in range(kv.layout.num_layers // 2 + 1):  # and the layers before the failure wrote their K,V
            keys = torch.randn(1, kv.layout.heads[layer], 1, kv.layout.head_dim[layer], dtype=kv.dtype)
            kv.write(layer, slot, keys, torch.randn_like(keys))
        engine.decoder.rollback("cut", seq.next_position)
        assert kv.length("cut") == seq.next_position

    tokens, _ = _run(engine, request, half_a_forward)
    assert cut and tokens == plain


def _sleeper(code: int | None = None, after_s: float = 0.0) -> subprocess.Popen:
    body = f"import time; time.sleep({after_s}); raise SystemExit({code})" if code is not None else \
        "import time; time.sleep(600)"
    return subprocess.Popen([sys.executable, "-c", body])


def test_the_launcher_starts_a_failed_or_reported_generation_again_and_ends_with_the_front(tmp_path):
    """Worker 0 exits 3: its generation is killed (worker 1 too) and generation 1 started and announced; the front
    reports generation 1 lost: generation 2; the front's exit ends the launcher with its code, no rank left."""
    folder = RecoveryDir(tmp_path)
    started: list[tuple[int, int]] = []
    spawned: list[subprocess.Popen] = []

    def start(gen: int) -> tuple[list[subprocess.Popen], int]:
        port = 40000 + gen
        started.append((gen, port))
        if gen == 1:
            for rank in (0, 1):
                folder.say_ready(1, rank)
            folder.say_joined(1)
            folder.report_lost(1, 0, "test: stopped")  # the front finds generation 1's rank 0 silent
        news = [_sleeper(), _sleeper()]
        spawned.extend(news)
        return news, port

    procs = [_sleeper(3, 0.5), _sleeper(), _sleeper(7, 4.0)]  # two workers, the front (rank 2) ends last with 7
    first_survivor = procs[1]
    t0 = time.monotonic()
    code = supervise_recovering(procs, 2, folder, start, grace_s=2.0)
    assert code == 7 and time.monotonic() - t0 < 15
    assert [g for g, _ in started] == [1, 2]
    assert folder.started(1).lost == (0,) and folder.started(1).port == started[0][1]
    assert folder.started(2) is not None and folder.started(3) is None
    assert first_survivor.returncode is not None  # killed with its generation
    assert all(p.poll() is not None for p in spawned + procs)


def test_the_launcher_gives_up_after_generations_that_never_get_ready(tmp_path):
    """Generations whose workers fail before they are ready: after three in a row the front is told to drain."""
    folder = RecoveryDir(tmp_path)
    front = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                              "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\ntime.sleep(600)"])
    procs = [_sleeper(1, 0.2), front]
    code = supervise_recovering(procs, 1, folder, lambda gen: ([_sleeper(1, 0.2)], 40000 + gen), grace_s=2.0)
    assert code == 1 and folder.started(3) is not None and folder.started(4) is None  # a worker failed: non-zero


def test_generations_ready_but_never_met_by_the_front_count_as_failed_starts(tmp_path):
    """Workers that load and say ready, then end, while the front never joins them: three such generations and
    the launcher gives up (a ready that the front never met is no start)."""
    folder = RecoveryDir(tmp_path)
    front = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                              "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\ntime.sleep(600)"])

    def start(gen: int) -> tuple[list[subprocess.Popen], int]:
        folder.say_ready(gen, 0)
        return [_sleeper(1, 0.5)], 40000 + gen

    code = supervise_recovering([_sleeper(1, 0.2), front], 1, folder, start, grace_s=2.0)
    assert code == 1 and folder.started(3) is not None and folder.started(4) is None


def test_a_front_silent_past_its_timeout_ends_every_rank(tmp_path):
    """The front beats, then stops beating (SIGSTOP): after its --timeout the launcher kills every rank, the
    stopped front too, and returns FRONT_SILENT."""
    from kvrunahead.ranks.supervise import FRONT_SILENT

    folder = RecoveryDir(tmp_path)
    worker = _sleeper()
    front = subprocess.Popen([sys.executable, "-c", "import os, signal, sys\n"
                              f"from kvrunahead.ranks.recovery import RecoveryDir\n"
                              f"RecoveryDir({str(tmp_path)!r})._write('front', {{'pid': os.getpid(), 'rank': 1, "
                              "'timeout_s': 1.5, 'at': 0})\nos.kill(os.getpid(), signal.SIGSTOP)"])
    t0 = time.monotonic()
    code = supervise_recovering([worker, front], 1, folder, lambda gen: ([_sleeper()], 0), grace_s=2.0)
    assert code == FRONT_SILENT and time.monotonic() - t0 < 10
    assert worker.poll() is not None and front.poll() is not None
