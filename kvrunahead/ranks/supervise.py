"""Waiting on rank processes: the first failure decides the exit code, and no rank is left running; or, for a
server that outlives its workers (ranks/recovery.py), a worker's failure starts its generation's workers again."""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

from kvrunahead.ranks.recovery import RecoveryDir, Started

log = logging.getLogger(__name__)

GIVE_UP_AFTER = 3  # generations in a row that end before the front met them: the launcher stops
FRONT_SILENT = 3  # the exit code of a server whose front stopped beating
DEFAULT_FRONT_TIMEOUT_S = 60.0  # a front's patience where its beat does not say


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


def supervise_recovering(procs: list[subprocess.Popen], front: int, recovery: RecoveryDir,
                         start: Callable[[int], tuple[list[subprocess.Popen], int]], grace_s: float = 5.0) -> int:
    """Wait for a server's ranks while its front (``procs[front]``) lives and beats; return the front's exit code
    (the first non-zero one where the front ended cleanly and a worker did not).

    A worker that ends with an error, or that the front reports lost (``lost.G``: stopped past ``--timeout``, cut
    off), ends its whole generation: every worker of it is killed (a stopped one continued so that it can die) and
    ``start(generation)`` starts the next (its workers and rendezvous port), announced as ``gen.G``. Workers that
    end cleanly (the front's Shutdown after a drain) are not replaced. A generation counts as started once the
    front has met it (``joined.G``); after ``GIVE_UP_AFTER`` in a row that did not, the front is sent SIGTERM (it
    drains) and the server ends. A front that has not beaten for its ``--timeout`` (stopped, its host frozen) ends
    the server: every rank is killed and the exit code is ``FRONT_SILENT``.
    """
    gen, failed_starts = 0, 0
    workers = [i for i in range(len(procs)) if i != front]
    with forwarding_sigterm(procs):
        try:
            while procs[front].poll() is None:
                if (silent := _front_silent(recovery)) is not None:
                    log.error("%s; ending the server", silent)
                    _end(procs)
                    return FRONT_SILENT
                failed = [i for i in workers if procs[i].poll() not in (None, 0)]
                report = recovery.lost(gen)
                if failed or report is not None:
                    failed_starts = 0 if gen == 0 or recovery.joined(gen) else failed_starts + 1
                    if failed_starts >= GIVE_UP_AFTER:
                        log.error("%d generations of workers in a row ended before the front met them; "
                                  "stopping the server", failed_starts)
                        procs[front].send_signal(signal.SIGTERM)
                        break
                    what = ("; ".join(f"rank {i} ended (exit {procs[i].returncode})" for i in failed) if failed
                            else f"the front lost rank {report.get('rank', '?')} ({report.get('why', '')})")
                    _end(procs[i] for i in workers)
                    gen += 1
                    started, port = start(gen)
                    for i, p in zip(workers, started):
                        procs[i] = p
                    recovery.announce(Started(gen, port, tuple(failed)))
                    log.warning("%s; starting the workers again (generation %d)", what, gen)
                time.sleep(0.05)
        except (KeyboardInterrupt, SystemExit):
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)
                    p.send_signal(signal.SIGCONT)
    code = procs[front].wait()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()
    return code or next((p.returncode for p in procs if p.returncode), 0)


def _front_silent(recovery: RecoveryDir) -> str | None:
    """Why the front counts as lost (no beat for its ``--timeout``), or None."""
    heard = recovery.front_silence()
    if heard is None:
        return None
    silent_s, beat = heard
    timeout_s = float(beat.get("timeout_s") or DEFAULT_FRONT_TIMEOUT_S)
    if silent_s <= timeout_s:
        return None
    return (f"the front (rank {beat.get('rank', '?')}, pid {beat.get('pid', '?')}) has not beaten for "
            f"{silent_s:.0f} s (--timeout {timeout_s:g})")


def _end(procs) -> None:
    """Kill these ranks now, a stopped one too, and reap them."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.send_signal(signal.SIGCONT)
    for p in procs:
        p.wait()
