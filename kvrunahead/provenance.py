"""What every measured result records beside it: the machine, the software and the commit that made it."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path


def environment(model: str, transport: str, threads: int, network: str) -> dict:
    import torch
    import transformers

    cpu = platform.processor() or ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
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
