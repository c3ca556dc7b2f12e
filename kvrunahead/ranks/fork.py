"""Ranks forked from the launcher rather than started afresh: a launcher that has already imported torch and
transformers (seconds of CPU per process) hands every rank those imports for free, as vLLM's workers are forked
where it is safe. A fork is safe only from a process with one thread: no OpenMP pool, no tokenizer threads, no
lock held by a thread the child would not have. The BLAS pools numpy and scipy start on import end themselves at
a fork (their own fork handlers), so a first fork that does nothing clears them; a thread that outlives it
(torch's OpenMP pool, once an operation ran here) keeps the launcher from forking. Elsewhere, and on an emulated
host (a rank runs inside its namespace by a command prefix), the rank is started as a new process."""

from __future__ import annotations

import atexit
import ctypes
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback
import weakref
from collections.abc import Callable


def can_fork() -> bool:
    """Whether this process has one thread once the pools that end at a fork have ended."""
    if _threads() > 1:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    return _threads() == 1


def _threads() -> int:
    """This process's threads (Linux's count of its tasks); 0 where it cannot be read."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


PR_SET_NAME = 15
RANK_NAME = "kvr-rank-"  # a forked rank's process name: this, then its rank


class ForkedRank:
    """A forked rank, with what the supervisor uses of a ``subprocess.Popen``."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_rank(module: str, argv: list[str], env: dict[str, str], before: Callable[[], None]) -> ForkedRank:
    """Run ``python -m module *argv`` with environment ``env`` in a child of this process; ``before`` runs first in
    the child (as a Popen's ``preexec_fn``). The child is named ``kvr-rank-R`` (R: its ``RANK``; what
    ``ps -o comm`` and ``top`` show; its command line and its /proc environ stay the launcher's). It keeps none of
    the launcher's exit work: its ``atexit`` functions and finalizers (a temporary folder the launcher removes) are
    dropped, and it ends with ``os._exit`` after its own, so that nothing the launcher holds is torn down twice."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return ForkedRank(pid)
    code = 1
    try:
        before()
        name = f"{RANK_NAME}{env.get('RANK', '')}".encode()[:15]
        ctypes.CDLL(None).prctl(PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(env)
        atexit._clear()
        for finalizer in list(weakref.finalize._registry):
            finalizer.detach()
        sys.argv = [module, *argv]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
