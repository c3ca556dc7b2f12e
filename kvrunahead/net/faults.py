"""Fault injection for tests and drills: ``KVRUNAHEAD_INJECT_FAULT=RANK:LAYER[:ACTION[:RUN]]`` makes rank RANK act
as it reaches layer LAYER of the KV chain in its RUN-th prefill (default the first), so that a benchmark or a
search can be cut after some results. Actions:

- ``raise``: an exception in the cache update (a rank that fails);
- ``exit``: the process dies at once;
- ``stop``: SIGSTOP itself, a rank that stops responding without dying (a frozen host);
- ``linkdown``: take its emulated host's link down (``--net cap=...`` only);
- ``cap=RATE``: cap its emulated host's uplink at RATE, e.g. ``cap=1kB/s`` (near zero).

``KVRUNAHEAD_INJECT_STALL=STEP:SECONDS`` makes a server's engine sleep SECONDS in its STEP-th step that has work (a
step stuck on the front, which ``/health`` reports once it runs past ``--timeout``).

A drill's fault strikes the ranks first started: a worker ``kvr-serve`` starts in a lost one's place
(``KVR_GENERATION`` > 0, ranks/recovery.py) runs without it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from kvrunahead.net.emulation import IFNAME, tbf_args
from kvrunahead.net.spec import parse_rate

FAULT_ENV = "KVRUNAHEAD_INJECT_FAULT"


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True)
class Fault:
    rank: int
    layer: int
    action: str = "raise"
    run: int = 1


def parse_fault(text: str | None) -> Fault | None:
    if not text:
        return None
    parts = text.split(":")
    try:
        return Fault(int(parts[0]), int(parts[1]), parts[2] if len(parts) > 2 else "raise",
                     int(parts[3]) if len(parts) > 3 else 1)
    except (IndexError, ValueError):
        raise ValueError(f"{FAULT_ENV}={text!r}: use RANK:LAYER[:ACTION[:RUN]]") from None


_HITS: dict[tuple[int, int], int] = {}
STALL_ENV = "KVRUNAHEAD_INJECT_STALL"
_STEPS = [0]


def maybe_stall() -> None:
    """Sleep where ``KVRUNAHEAD_INJECT_STALL`` names this step (counted over the calls); called by the engine loop
    before each step that has work."""
    text = os.environ.get(STALL_ENV)
    if not text:
        return
    _STEPS[0] += 1
    step, seconds = text.split(":")
    if _STEPS[0] == int(step):
        print(f"{STALL_ENV}: step {step} sleeps {seconds} s", file=sys.stderr, flush=True)
        time.sleep(float(seconds))


def fault_from_env() -> Fault | None:
    if os.environ.get("KVR_GENERATION", "0") != "0":  # started again after a loss: the drill's fault struck once
        return None
    return parse_fault(os.environ.get(FAULT_ENV))


def maybe_inject(fault: Fault | None, rank: int, layer: int) -> None:
    """Act if ``fault`` names this rank, layer and run; called by the KV chain as each layer starts."""
    if fault is None or (fault.rank, fault.layer) != (rank, layer):
        return
    _HITS[(rank, layer)] = _HITS.get((rank, layer), 0) + 1
    if _HITS[(rank, layer)] != fault.run:
        return
    print(f"{FAULT_ENV}: rank {rank} at layer {layer} of run {fault.run}: {fault.action}", file=sys.stderr, flush=True)
    if fault.action == "raise":
        raise InjectedFault(f"fault injected on rank {rank} at layer {layer}")
    if fault.action == "exit":
        os._exit(3)
    if fault.action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        return

    # The rank runs inside its emulated host's namespace, where it may change its own link.
    if fault.action == "linkdown":
        subprocess.run(["ip", "link", "set", IFNAME, "down"], check=True)
    elif fault.action.startswith("cap="):
        rate = parse_rate(fault.action.removeprefix("cap="))
        subprocess.run(["tc", "qdisc", "replace", "dev", IFNAME, "root", "tbf", *tbf_args(rate)], check=True)
    else:
        raise ValueError(f"{FAULT_ENV}: unknown action {fault.action!r}")
