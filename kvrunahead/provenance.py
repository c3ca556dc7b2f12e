"""What every measured result records beside it: the machine, the software and the commit that made it."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name, as Linux reports it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> str:
    """The host a number was measured on, read from the host: '2-vCPU Intel(R) Xeon(R) Processor, 24 GiB'."""
    try:
        gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        gib = 0.0
    return f"{os.cpu_count()}-vCPU {cpu_name()}, {gib:.0f} GiB"


def command() -> str:
    """This process's command line as it was typed: a console script by its name (``kvr-bench --ctx 4k``), else
    ``python`` and the script."""
    argv = sys.argv or [""]
    head = [Path(argv[0]).name] if Path(argv[0]).name.startswith("kvr-") else ["python", argv[0]]
    return shlex.join([*head, *argv[1:]])


def environment(model: str, transport: str, threads: int, network: str) -> dict:
    import torch
    import transformers

    cpu = cpu_name()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).parent).stdout.strip()
        commit = commit + ("-dirty" if dirty else "")
    except OSError:
        commit = "unknown"
    return {
        "model": model, "cpu": cpu, "cores": os.cpu_count(), "threads_per_rank": threads,
        "torch": torch.__version__, "transformers": transformers.__version__, "transport": transport,
        "network": network, "commit": commit or "unknown",
    }
