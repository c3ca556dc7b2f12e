"""A soak of ``kvr-serve --nproc 2`` as a user starts it (its defaults): mixed ShareGPT load near capacity with
cancels, disconnects and hostile inputs, each rank's memory, descriptors and threads, /dev/shm and TTFT watched
throughout (kvrunahead/bench/soak.py). Rows are appended to rows.jsonl beside it as they come (command, host,
commit in the header row); the plot is soak.png.

    python experiments/soak/soak.py                      # 30 minutes, SmolLM2-135M
    python experiments/soak/soak.py --profile short --model tiny-llama
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import httpx

from kvrunahead.bench import soak

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def _host() -> str:
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
        name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name")), "")
    except OSError:
        name = ""
    return f"{name or platform.processor()}, {os.cpu_count()} vCPU"


def _commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return r.stdout.strip() or "unknown"


def serve(model: str, port: int, args: tuple[str, ...], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvrunahead.cli.serve", "--nproc", "2", "--model", model, "--port", str(port), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"kvr-serve exited {proc.returncode}: see {log}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("kvr-serve not up within 600 s")


@click.command()
@click.option("--profile", type=click.Choice(["full", "short"]), default="full", show_default=True)
@click.option("--minutes", type=float, default=None, help="Override the profile's duration.")
@click.option("--model", default="smollm2-135m", show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=HERE / "rows.jsonl",
              show_default=True)
@click.argument("serve_args", nargs=-1)
def main(profile: str, minutes: float | None, model: str, out: Path, serve_args: tuple[str, ...]) -> None:
    chosen = soak.FULL if profile == "full" else soak.SHORT
    if minutes is not None:
        chosen = dataclasses.replace(chosen, minutes=minutes)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    texts = soak.sharegpt_prompts(400, chosen.max_prompt_tokens)
    proc = serve(model, port, serve_args, Path(tempfile.gettempdir()) / f"soak_server_{port}.log")
    header = {"command": " ".join(sys.argv), "host": _host(), "commit": _commit(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": model,
              "serve_args": list(serve_args)}
    try:
        rows = soak.run(f"http://127.0.0.1:{port}", model, proc.pid, texts, chosen, out, header)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(120)
    soak.plot(rows, out.with_name("soak.png") if out.name == "rows.jsonl" else out.with_suffix(".png"))
    click.echo(json.dumps(rows[-1], indent=1))


if __name__ == "__main__":
    main()
