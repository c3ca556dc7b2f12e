"""A burst of many long requests at ``kvr-serve`` in a memory-capped cgroup: every request is answered or refused by
name, the server is alive after, and nothing is OOM-killed (its K,V pool, serve/kv_pool.py, admits, preempts or
refuses where the memory runs out).

The server starts as a user starts it (``kvr-serve --nproc 2`` and its defaults: the pool takes its share of the
memory the cgroup leaves), inside a cgroup of ``--memory`` (v1 or v2; root). ``--requests`` clients each ask at once
for ``n`` choices of ``max_tokens`` (``ignore_eos``). Every 2 s the cgroup's memory, the pool's use and the
preemptions are read. After ``--duration`` seconds the clients still waiting disconnect (their requests are
cancelled), and the server must answer ``/health`` and hold no request's K,V. One JSON row per run:

    python -m kvrunahead.bench.burst --memory 6G --requests 12 --n 16 --max-tokens 6000 --rows rows.jsonl
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import click
import httpx

from kvrunahead.provenance import command, machine

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
V1 = "/sys/fs/cgroup/memory"


def parse_size(text: str) -> int:
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)(?:i?B)?\s*", text.upper())
    if m is None:
        raise click.BadParameter(f"a size such as 6G or 512M, not {text!r}")
    return int(float(m.group(1)) * units[m.group(2)])


class Cgroup:
    """A memory cgroup of its own (v1 where its controller is mounted, else v2): its limit, usage, peak and the
    processes it OOM-killed."""

    def __init__(self, name: str, limit: int) -> None:
        v2_root = next((r for r in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
                        if "memory" in _read(f"{r}/cgroup.controllers", "").split()), None)
        if os.path.isdir(V1):
            self.path, self.v1 = f"{V1}/{name}", True
        elif v2_root is not None:
            self.path, self.v1 = f"{v2_root}/{name}", False
        else:
            raise click.ClickException("no memory cgroup controller to cap the server with (cgroup v1 or v2)")
        try:
            os.makedirs(self.path, exist_ok=True)
            self._write("memory.limit_in_bytes" if self.v1 else "memory.max", str(limit))
        except OSError as e:
            raise click.ClickException(f"cannot make a memory cgroup at {self.path} (root is needed): {e}") from None
        self.limit = limit

    def _write(self, name: str, value: str) -> None:
        with open(f"{self.path}/{name}", "w") as f:
            f.write(value)

    @property
    def procs_file(self) -> str:
        return f"{self.path}/cgroup.procs"

    def usage(self) -> int:
        return int(_read(f"{self.path}/{'memory.usage_in_bytes' if self.v1 else 'memory.current'}", "0"))

    def peak(self) -> int | None:
        text = _read(f"{self.path}/{'memory.max_usage_in_bytes' if self.v1 else 'memory.peak'}", "")
        return int(text) if text else None

    def oom_kills(self) -> int:
        text = _read(f"{self.path}/{'memory.oom_control' if self.v1 else 'memory.events'}", "")
        m = re.search(r"^oom_kill (\d+)$", text, re.M)
        return int(m.group(1)) if m else 0

    def remove(self) -> None:
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.1)


def _read(path: str, default: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


@contextmanager
def capped_server(cgroup: Cgroup, port: int, args: tuple[str, ...], log: Path):
    """``kvr-serve --nproc 2`` started inside ``cgroup``; yields (process, base URL, its start-up lines)."""
    serve = [sys.executable, "-m", "kvrunahead.cli.serve", "--nproc", "2", "--port", str(port), *args]
    shell = f'echo $$ > {cgroup.procs_file} && exec "$@"'
    proc = subprocess.Popen(["sh", "-c", shell, "sh", *serve], start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=open(log, "w"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise click.ClickException(f"kvr-serve exited {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise click.ClickException(f"kvr-serve not up within 600 s: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        yield proc, url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def burst(url: str, model: str, requests: int, n: int, max_tokens: int, duration_s: float, cgroup: Cgroup) -> dict:
    """Fire the requests at once and watch until they end or ``duration_s`` passes; what happened."""
    outcomes: list[dict] = []
    clients = [httpx.Client(timeout=httpx.Timeout(duration_s + 60, connect=30)) for _ in range(requests)]

    def one(i: int) -> None:
        body = {"model": model, "prompt": f"{PROMPT} ({i})", "n": n, "max_tokens": max_tokens, "temperature": 0.8,
                "seed": i, "ignore_eos": True}
        t0 = time.monotonic()
        try:
            r = clients[i].post(f"{url}/v1/completions", json=body)
            said = r.json().get("error", {}).get("message", "") if r.status_code >= 400 else ""
            tokens = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0
            outcomes.append({"status": r.status_code, "error": said[:300], "seconds": time.monotonic() - t0,
                             "completion_tokens": tokens})
        except httpx.HTTPError as e:  # cut at the end of the burst (closed) or by the server
            outcomes.append({"status": None, "error": f"{type(e).__name__}: {e}"[:300],
                             "seconds": time.monotonic() - t0, "completion_tokens": 0})

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(requests)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    peak_usage, peak_memory, samples = 0.0, 0, []
    while any(t.is_alive() for t in threads) and time.monotonic() - t0 < duration_s:
        time.sleep(2)
        try:
            text = httpx.get(f"{url}/metrics", timeout=10).text
        except httpx.HTTPError:
            continue
        usage = metric(text, "vllm:kv_cache_usage_perc") or 0.0
        peak_usage, peak_memory = max(peak_usage, usage), max(peak_memory, cgroup.usage())
        samples.append({"t": round(time.monotonic() - t0, 1), "memory": cgroup.usage(), "kv_usage": usage,
                        "running": metric(text, "vllm:num_requests_running"),
                        "waiting": metric(text, "vllm:num_requests_waiting"),
                        "preemptions": metric(text, "vllm:num_preemptions_total")})
    for client in clients:  # the requests still in flight are cancelled by their disconnect
        client.close()
    for t in threads:
        t.join(30)
    return {"outcomes": outcomes, "seconds": round(time.monotonic() - t0, 1), "peak_kv_usage": peak_usage,
            "peak_memory": peak_memory, "samples": samples}


@click.command()
@click.option("--memory", default="6G", show_default=True, help="The cgroup's memory limit.")
@click.option("--requests", type=int, default=12, show_default=True)
@click.option("--n", "n", type=int, default=16, show_default=True, help="Choices per request.")
@click.option("--max-tokens", type=int, default=6000, show_default=True)
@click.option("--duration", type=float, default=600, show_default=True,
              help="Seconds until the clients still waiting disconnect.")
@click.option("--model", default="smollm2-135m", show_default=True)
@click.option("--port", type=int, default=8411, show_default=True)
@click.option("--rows", type=click.Path(path_type=Path), default=None, help="Append the run's JSON row here.")
@click.argument("serve_args", nargs=-1)
def main(memory: str, requests: int, n: int, max_tokens: int, duration: float, model: str, port: int,
         rows: Path | None, serve_args: tuple[str, ...]) -> None:
    """Run one burst; print its row (and append it to ``--rows``). SERVE_ARGS go to kvr-serve."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: the server and its cgroup go too
    row = run(parse_size(memory), requests, n, max_tokens, duration, model, port, serve_args)
    text = json.dumps(row)
    click.echo(text)
    if rows is not None:
        with rows.open("a") as f:
            f.write(text + "\n")


def run(limit: int, requests: int, n: int, max_tokens: int, duration: float, model: str, port: int,
        serve_args: tuple[str, ...] = ()) -> dict:
    commit = _commit()  # the code the server runs: read before it starts
    cgroup = Cgroup(f"kvr-burst-{os.getpid()}", limit)
    log = Path(f"/tmp/kvr-burst-{os.getpid()}.log")
    try:
        with capped_server(cgroup, port, ("--model", model, *serve_args), log) as (proc, url):
            got = burst(url, model, requests, n, max_tokens, duration, cgroup)
            time.sleep(5)  # the cancelled requests freed at the engine's next steps
            try:
                health = httpx.get(f"{url}/health", timeout=30).status_code
                text = httpx.get(f"{url}/metrics", timeout=30).text
            except httpx.HTTPError as e:
                health, text = f"{type(e).__name__}: {e}", ""
            alive = proc.poll() is None
        said = next((line.strip() for line in log.read_text().splitlines() if "K,V cache:" in line), "")
        codes: dict[str, int] = {}
        for o in got["outcomes"]:
            codes[str(o["status"])] = codes.get(str(o["status"]), 0) + 1
        return {"command": command(), "machine": machine(), "commit": commit, "date": time.strftime("%F %T"),
                "memory_limit": limit, "requests": requests, "n": n, "max_tokens": max_tokens, "duration_s": duration,
                "pool": said, "statuses": codes, "answered": codes.get("200", 0),
                "refused": sum(v for k, v in codes.items() if k.startswith("4")),
                "server_errors": sum(v for k, v in codes.items() if k.startswith("5")),
                "cut_at_the_end": codes.get("None", 0), "alive_after": alive, "health_after": health,
                "kv_usage_after": metric(text, "vllm:kv_cache_usage_perc"),
                "preemptions": metric(text, "vllm:num_preemptions_total"),
                "oom_kills": cgroup.oom_kills(), "peak_memory": cgroup.peak() or got["peak_memory"],
                "peak_kv_usage": got["peak_kv_usage"], "seconds": got["seconds"], "outcomes": got["outcomes"],
                "samples": got["samples"]}
    finally:
        cgroup.remove()


def _commit() -> str:
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=root).stdout.strip()
    return (r.stdout.strip() or "unknown") + ("-dirty" if dirty else "")


if __name__ == "__main__":
    main()
