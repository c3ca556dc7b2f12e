"""The noise sidecar's CPU share at the rates the README quotes (11 MB/s and 100 MB/s each way), the sidecar alone,
and how close it comes to the rate and the duty cycle asked (tests/test_network.py checks only that it never
exceeds them: how close depends on the machine and its load).

Each run starts the sidecar (``kvrunahead.net.noise.sidecar``, as kvr-prefill and kvr-bench start it) between two
endpoints for ``--seconds`` and records two figures:
  cpu_share         what the sidecar's own report says (NoiseReport.cpu_share: its process's user + system CPU
                    seconds per wall second since it started), the figure noise_*.json and kvr-prefill print;
  cpu_share_window  the same process's CPU over the window between its "ready" and its stop, read from
                    /proc/PID/stat by this script: without the interpreter's start-up, which a short run does not
                    amortize as a benchmark world of minutes does.
The settings, interleaved run by run so that drift in the machine's load spreads over all of them:
  off                      the sidecar started with its traffic off: what it costs to exist (threads polling)
  loopback,noise=11MB/s    two endpoints on 127.0.0.1 (no root needed)
  loopback,noise=100MB/s
  cap=22MB/s,noise         11 MB/s each way between two emulated hosts whose links are capped at 22 MB/s (root)
  cap=650MB/s,noise        100 MB/s each way at the 650 MB/s cap (root)
Pairs are redrawn every second and send for half of it (the defaults); with two endpoints the one pair always
sends. Without root the capped settings are left out and the script says so.

  bash experiments/sidecar_cpu/run.sh            # about 2.5 minutes; rows to experiments/sidecar_cpu/runs.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvrunahead.net.noise import Endpoint, sidecar
from kvrunahead.net.spec import NetError, NoiseSpec, parse_net
from kvrunahead.provenance import environment

HERE = Path(__file__).parent
SETTINGS = ["off", "loopback,noise=11MB/s", "loopback,noise=100MB/s", "cap=22MB/s,noise", "cap=650MB/s,noise"]
OFF_RATE = 100e6  # the rate the "off" sidecar would send at if switched on; it never is


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of every thread of ``pid`` so far (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(setting: str, endpoints: list[Endpoint], seconds: float) -> dict:
    off = setting == "off"
    noise = NoiseSpec(OFF_RATE) if off else parse_net(setting).noise
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d, sidecar(endpoints, noise, d, start_on=not off) as handle:
        pid = handle.proc.pid
        t0, c0 = time.monotonic(), process_cpu_s(pid)
        time.sleep(seconds)
        t1, c1 = time.monotonic(), process_cpu_s(pid)
    r = handle.report
    return {
        "setting": setting, "traffic": "off" if off else "on", "rate_asked_bytes_per_s": noise.rate_bytes_per_s,
        "interval_s": noise.interval_s, "duty": noise.duty, "seconds": seconds, "load_1min_before": load,
        "wall_s": r.wall_s, "active_s": r.active_s, "cpu_s": r.cpu_s, "cpu_share": r.cpu_share,
        "window_s": t1 - t0, "cpu_s_window": c1 - c0, "cpu_share_window": (c1 - c0) / (t1 - t0),
        "achieved_rate_bytes_per_s": r.achieved_rate(), "bytes_sent": r.bytes_sent,
        "bytes_received": r.bytes_received, "bytes_per_direction": r.bytes_per_direction,
        "pairs_drawn": r.pairs_drawn,
    }


def summarize(rows: list[dict]) -> str:
    lines = ["| setting | runs | cpu_share (report) median [min, max] | cpu_share_window median [min, max] | "
             "achieved MB/s each way | of the rate asked | active share (duty asked) |",
             "|---|---|---|---|---|---|---|"]
    for setting in dict.fromkeys(r["setting"] for r in rows):
        rs = [r for r in rows if r["setting"] == setting]

        def fig(key: str, rs: list[dict] = rs) -> str:
            xs = [r[key] for r in rs]
            return f"{statistics.median(xs):.2%} [{min(xs):.2%}, {max(xs):.2%}]"

        rate = statistics.median(r["achieved_rate_bytes_per_s"] for r in rs) / 1e6
        asked = statistics.median(r["rate_asked_bytes_per_s"] for r in rs) / 1e6
        active = statistics.median(r["active_s"] / r["wall_s"] for r in rs if r["wall_s"])
        share = f"{rate / asked:.0%}" if rs[0]["traffic"] == "on" else "-"
        lines.append(f"| {setting} | {len(rs)} | {fig('cpu_share')} | {fig('cpu_share_window')} | {rate:.1f} | "
                     f"{share} | {active:.0%} ({rs[0]['duty']:g}) |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--seconds", type=float, default=15.0, help="length of each run")
    ap.add_argument("--repeats", type=int, default=2, help="runs per setting, interleaved")
    ap.add_argument("--setting", action="append", dest="settings",
                    help="a --net form with noise, or off; repeat for several (default: " + ", ".join(SETTINGS) + ")")
    ap.add_argument("--out", default=str(HERE / "runs.jsonl"))
    ap.add_argument("--command", help="the command line to record (run.sh passes its own)")
    a = ap.parse_args()
    settings = a.settings or SETTINGS
    command = a.command or shlex.join(["python3", *sys.argv])

    caps = {}
    for s in settings:
        if s != "off" and parse_net(s).emulated:
            caps.setdefault(parse_net(s).cap_bytes_per_s, []).append(s)
    loopback = [Endpoint(None, "127.0.0.1")] * 2
    with contextlib.ExitStack() as stack:
        from kvrunahead.net.emulation import Emulation, check_permission, exits_on_signals

        stack.enter_context(exits_on_signals())  # SIGTERM (timeout) still removes the emulated hosts
        endpoints = {}
        if caps:
            try:
                check_permission()
            except NetError as e:
                print(f"leaving out {sum(caps.values(), [])}: {e}", file=sys.stderr)
                settings = [s for s in settings if s == "off" or not parse_net(s).emulated]
                caps = {}
        for cap, names in caps.items():
            emu = stack.enter_context(Emulation(2, cap))
            for s in names:
                endpoints[s] = [Endpoint(emu.namespace(h), emu.address(h)) for h in range(2)]
        runs = a.repeats * len(settings)
        print(f"{runs} runs of {a.seconds:g} s: about {runs * (a.seconds + 1) / 60:.1f} minutes", file=sys.stderr)
        env = environment("none", "none", 1, "loopback")
        machine = {k: env[k] for k in ("cpu", "cores", "torch", "transformers", "commit")}
        rows = []
        with open(a.out, "w") as out:
            for i in range(a.repeats):
                for s in settings:
                    row = {"command": command, "repeat": i, **measure(s, endpoints.get(s, loopback), a.seconds),
                           **machine, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    rows.append(row)
                    print(f"[{len(rows)}/{runs}] {s:24s} cpu {row['cpu_share']:.2%} (window "
                          f"{row['cpu_share_window']:.2%}), {row['achieved_rate_bytes_per_s'] / 1e6:.1f} MB/s",
                          file=sys.stderr)
    print(summarize(rows))


if __name__ == "__main__":
    main()
