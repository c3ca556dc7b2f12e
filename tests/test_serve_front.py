"""The front's own faults end ``kvr-serve`` within a bound, and ``/health`` tells a load balancer the truth: a
front stopped with SIGSTOP (with and without a worker's recovery before) ends the server non-zero within
``--timeout`` + 30 s with one line naming it, and ``--restarts 1`` serves again; the launcher's own death ends every
rank; ``/health`` is 503 once prompts are refused (the workers not back within the front's patience) and while a
step runs past ``--timeout``, 200 again after. Real ``kvr-serve`` processes on loopback (tiny-llama)."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from kvrunahead.ranks.launcher import free_port
from kvrunahead.ranks.supervise import FRONT_SILENT
from tests.helpers import COMPILE_SLOWDOWN
from tests.test_serve_cli import MODEL, PROMPT, _api, _metric, serving

pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 5


def _health(url: str) -> tuple[int, dict]:
    r = httpx.get(f"{url}/health", timeout=5)
    return r.status_code, r.json()


def _until(what, timeout_s: float, server, poll_s: float = 0.2):
    """Poll ``what()`` until it returns something true; its value."""
    deadline = time.monotonic() + timeout_s * COMPILE_SLOWDOWN
    while time.monotonic() < deadline:
        try:
            if value := what():
                return value
        except httpx.TransportError:
            pass
        time.sleep(poll_s)
    raise AssertionError(f"not within {timeout_s} s: {''.join(server.lines)[-4000:]}")


def _greedy(url: str) -> str:
    return _api(url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text


def _recovered(server, url: str) -> None:
    """``kill -9`` of worker rank 0, then every rank serving again (/health ok over a new rank 0)."""
    first = server.ranks()[0]
    os.kill(first, signal.SIGKILL)
    _until(lambda: server.ranks().get(0) not in (None, first) and _health(url) == (200, _health(url)[1])
           and _health(url)[1]["status"] == "ok" and _health(url)[1]["restarts"] == 1, 60, server)


def _ends_naming_the_front(server, front_pid: int) -> None:
    t0 = time.monotonic()
    code = server.wait(TIMEOUT_S + 30)
    waited = time.monotonic() - t0
    said = [line for line in server.lines if "has not beaten" in line]
    assert code == FRONT_SILENT and waited <= TIMEOUT_S + 30, (code, waited, "".join(server.lines)[-3000:])
    assert len(said) == 1 and f"pid {front_pid}" in said[0] and "the front (rank 1" in said[0], said
    for pid in server.ranks().values():  # nothing of the server is left
        raise AssertionError(f"rank {pid} outlived the server")


@pytest.mark.parametrize("recovery_first", [False, True])
def test_a_stopped_front_ends_the_server_within_its_timeout(recovery_first):
    with serving("--timeout", str(TIMEOUT_S)) as server:
        url = server.url()
        assert _greedy(url)
        if recovery_first:
            _recovered(server, url)
        front = server.ranks()[1]
        os.kill(front, signal.SIGSTOP)
        _ends_naming_the_front(server, front)


def test_a_stopped_front_under_restarts_serves_again():
    port = free_port()
    with serving("--timeout", str(TIMEOUT_S), "--restarts", "1", port=port) as server:
        url = server.url()
        before = _greedy(url)
        front = server.ranks()[1]
        os.kill(front, signal.SIGSTOP)
        _until(lambda: server.ranks().get(1) not in (None, front) and _health(url)[0] == 200, TIMEOUT_S + 90,
               server)
        assert _greedy(url) == before
        assert sum("has not beaten" in line for line in server.lines) == 1, "".join(server.lines)
        os.kill(server.proc.pid, signal.SIGTERM)
        assert server.wait() == 0, "".join(server.lines)


def test_the_launcher_s_death_ends_every_rank():
    with serving("--timeout", str(TIMEOUT_S)) as server:
        server.url()
        ranks = server.ranks()
        assert len(ranks) == 2
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(10)

        def gone() -> bool:
            for pid in ranks.values():
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    continue
                with open(f"/proc/{pid}/stat") as f:  # a zombie waits for its reaper only
                    if f.read().split(") ")[1][0] != "Z":
                        return False
            return True
        _until(gone, 10, server)


def test_health_is_503_once_prompts_are_refused_and_ok_when_the_workers_are_back():
    """The launcher stopped (it cannot bring the workers back), worker rank 0 killed: /health says degraded (200)
    within the front's patience (60 s at this --timeout), then 503 ``workers_down`` as prompts get 503 too; once the
    launcher goes on the workers come back and /health says ok."""
    with serving("--timeout", str(TIMEOUT_S)) as server:
        url = server.url()
        before = _greedy(url)
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            os.kill(server.ranks()[0], signal.SIGKILL)
            assert _greedy(url) == before  # the front waits for the workers within its patience...
        except Exception:
            os.kill(server.proc.pid, signal.SIGCONT)
            raise
        code, body = _until(lambda: (s := _health(url))[1]["status"] != "ok" and s, 30, server)
        try:
            assert code == 200 and body["status"] == "degraded", body
            code, body = _until(lambda: (s := _health(url))[0] == 503 and s, 90, server, poll_s=1.0)
            assert body["status"] == "workers_down" and "the workers are not back" in body["message"], body
            refused = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                                 timeout=30)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "workers_down"
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        _until(lambda: _health(url) == (200, _health(url)[1]) and _health(url)[1]["status"] == "ok", 60, server)
        assert _greedy(url) == before


def test_health_is_503_while_a_step_runs_past_the_timeout():
    """A step stuck on the front (an injected sleep of 3 x --timeout in the first step with work): /health says
    503 ``engine_stuck`` while it runs and the engine's step age grows past --timeout; then 200 ok, and the
    request completes."""
    env = {"KVRUNAHEAD_INJECT_STALL": f"1:{3 * TIMEOUT_S}"}
    with serving("--timeout", str(TIMEOUT_S), nproc=1, env=env) as server:
        url = server.url()
        assert _health(url) == (200, {"status": "ok", "restarts": 0})
        done: list[str] = []
        asked = threading.Thread(target=lambda: done.append(_greedy(url)), daemon=True)
        asked.start()
        code, body = _until(lambda: (s := _health(url))[0] == 503 and s, 3 * TIMEOUT_S, server)
        assert body["status"] == "engine_stuck" and f"--timeout {TIMEOUT_S}" in body["message"], body
        assert _metric(url, "kvr_engine_step_age_seconds") > TIMEOUT_S
        asked.join(6 * TIMEOUT_S * COMPILE_SLOWDOWN)
        assert done, "".join(server.lines)
        assert _health(url)[0] == 200
