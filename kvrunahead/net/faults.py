"""Fault injection for tests and drills: ``KVR_FAULT=rank=0,layer=3,action=stop`` makes rank 0 act when it reaches
layer 3 of the KV chain. Actions: ``stop`` (SIGSTOP itself: a rank that stops responding without dying),
``linkdown`` (take its emulated host's link down), ``cap=1kB/s`` (cap its host's uplink near zero), ``exit`` (die).
The link actions need the rank to run on an emulated host (``--net cap=...``)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

log = logging.getLogger(__name__)


def _parse(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split(",") if "=" in item)


_SPEC = _parse(os.environ.get("KVR_FAULT", ""))


def at_layer(rank: int, layer: int) -> None:
    """Called by the KV chain as each layer starts; does nothing unless KVR_FAULT names this rank and layer."""
    if not _SPEC or int(_SPEC.get("rank", -1)) != rank or int(_SPEC.get("layer", -1)) != layer:
        return
    action = _SPEC.get("action", "stop")
    print(f"KVR_FAULT: rank {rank} at layer {layer}: {action}", file=sys.stderr, flush=True)
    _SPEC.clear()  # once
    if action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "exit":
        os._exit(3)
    elif action == "linkdown":
        from kvrunahead.net.emulation import IFNAME

        subprocess.run(["ip", "link", "set", IFNAME, "down"], check=True)
    elif action == "cap":
        from kvrunahead.net.emulation import IFNAME, tbf_args
        from kvrunahead.net.spec import parse_rate

        rate = parse_rate(_SPEC.get("rate", "1kB/s"))
        subprocess.run(["tc", "qdisc", "replace", "dev", IFNAME, "root", "tbf", *tbf_args(rate)], check=True)
    else:
        raise ValueError(f"KVR_FAULT: unknown action {action!r}")
