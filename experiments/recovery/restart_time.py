"""Seconds from a rank's ``kill -9`` to ``kvr-serve`` answering over every rank again (SmolLM2-135M, ``--nproc 2`` by
default): by default the front outlives a worker and joins the workers started again (``/health`` says ``ok``
again), while a streamed request decodes on the front (its tokens counted while the rank is down);
``--no-recover``: ``--restarts`` starts the whole server again. Appends one JSON row per run to rows.jsonl beside
it (command, host, commit).

    python experiments/recovery/restart_time.py --runs 3
    python experiments/recovery/restart_time.py --runs 3 --no-recover
"""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import click
import httpx

from kvrunahead.bench.soak import rank_pids

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def _host() -> str:
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()


def _ok(url: str, restarts: int = 0) -> bool:
    """Serving over every rank: 200, not degraded (a lost worker's front answers 200 too), and past ``restarts``
    generations of workers joined (the front has noticed the loss and joined the new workers)."""
    try:
        r = httpx.get(f"{url}/health", timeout=5)
        return r.status_code == 200 and r.json().get("status") == "ok" and r.json().get("restarts", 0) >= restarts
    except httpx.TransportError:
        return False


def _stream(url: str, body: dict, times: list[float]) -> None:
    """A streamed completion: each text chunk's arrival into ``times``; an error ends it."""
    with httpx.Client(timeout=600) as http, http.stream("POST", f"{url}/v1/completions",
                                                        json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text":"' in line and '"text":""' not in line:
                times.append(time.monotonic())


@click.command()
@click.option("--model", default="smollm2-135m", show_default=True)
@click.option("--nproc", type=int, default=2, show_default=True)
@click.option("--timeout", "timeout_s", type=float, default=20.0, show_default=True)
@click.option("--runs", type=int, default=3, show_default=True)
@click.option("--kill-rank", type=int, default=0, show_default=True)
@click.option("--recover/--no-recover", default=True, show_default=True)
def main(model: str, nproc: int, timeout_s: float, runs: int, kill_rank: int, recover: bool) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kvrunahead.cli.serve", "--model", model, "--nproc", str(nproc), "--port", str(port),
           "--timeout", str(timeout_s), "--restarts", str(runs), "--recover" if recover else "--no-recover"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    proc = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True,
                            stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    try:
        deadline = time.monotonic() + 600
        while not _ok(url):
            assert time.monotonic() < deadline and proc.poll() is None, "the server did not start"
            time.sleep(0.2)
        text = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        for run in range(runs):
            times: list[float] = []
            streaming = threading.Thread(target=_stream, args=(url, {**body, "max_tokens": 600, "ignore_eos": True},
                                                               times), daemon=True)
            streaming.start()
            while len(times) < 3:
                time.sleep(0.02)
            victim = rank_pids(proc.pid)[kill_rank]
            t0 = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            # with recovery the front answers throughout: back once it has joined one more generation of workers
            joined = httpx.get(f"{url}/health", timeout=5).json().get("restarts", 0) + 1 if recover else 0
            while not (rank_pids(proc.pid).get(kill_rank) not in (None, victim) and _ok(url, joined)):
                assert time.monotonic() < t0 + 600 and proc.poll() is None, "the server did not come back"
                time.sleep(0.1)
            back = time.monotonic()
            back_s = back - t0
            again = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
            streaming.join(600)
            row = {"run": run, "back_s": round(back_s, 2), "same_text": again == text, "recover": recover,
                   "tokens_while_down": sum(t0 < t < back for t in times), "stream_tokens": len(times),
                   "model": model,
                   "nproc": nproc, "timeout_s": timeout_s, "kill_rank": kill_rank, "host": _host(),
                   "commit": commit.strip(), "command": " ".join(["python", *sys.argv]),
                   "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            print(json.dumps(row), flush=True)
            with (HERE / "rows.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


if __name__ == "__main__":
    main()
