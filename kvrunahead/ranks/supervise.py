"""Waiting on rank processes: the first failure decides the exit code, and no rank is left running."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Iterator


@contextlib.contextmanager
def forwarding_sigterm(procs: list[subprocess.Popen]) -> Iterator[None]:
    """A SIGTERM to the launcher goes to every rank, which decides what it means (kvr-serve's front drains), rather
    than ending the launcher alone and leaving the ranks running without it."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return

    def forward(sig: int, frame) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def supervise(procs: list[subprocess.Popen], grace_s: float = 5.0) -> int:
    """Wait for the ranks; return the first non-zero exit code.

    When one rank fails the others get ``grace_s`` to notice on their own, then are terminated (a stopped rank
    is continued so that it can die), so a failure never leaves the launcher waiting.
    """
    with forwarding_sigterm(procs):
        code = _wait(procs, grace_s)
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return code or next((p.returncode for p in procs if p.returncode), 0)


def _wait(procs: list[subprocess.Popen], grace_s: float) -> int:
    failed_at = None
    code = 0
    try:
        # Poll every rank each round (any() would stop at the first one still running and never see a later
        # rank's failure).
        while [p.poll() for p in procs].count(None):
            bad = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if bad and failed_at is None:
                failed_at, code = time.monotonic(), bad[0]
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGTERM)
                        p.send_signal(signal.SIGCONT)
                break
            time.sleep(0.05)
    except (KeyboardInterrupt, SystemExit) as e:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
                p.send_signal(signal.SIGCONT)
        code = 130 if isinstance(e, KeyboardInterrupt) else (e.code if isinstance(e.code, int) else 1)
    return code
