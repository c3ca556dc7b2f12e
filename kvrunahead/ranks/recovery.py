"""A lost worker rank brought back while the front serves on: what the launcher and the front tell each other.

``kvr-serve --nproc N`` runs its ranks under a launcher that outlives them (ranks/supervise.py). When a worker rank
dies, stops past ``--timeout`` or is cut off, the front (which holds the server's requests) stays up; the launcher
ends that generation's workers, starts a new generation of them on a new rendezvous port, and the front joins them
once they have loaded the model. They talk through one folder (``KVR_RECOVERY_DIR``), one small file per fact, each
written whole (a rename) so that a reader never sees half of one:

- ``lost.G``: the front found generation G's workers gone (which rank, where it knows, and why): the launcher ends
  every worker of G (a stopped one too) and starts G + 1;
- ``gen.G``: the launcher started generation G on rendezvous port P (and which ranks it saw end);
- ``ready.G.R``: rank R of generation G has loaded the model and waits in the rendezvous: the front, which must not
  wait there itself while it serves, joins once every worker of G says so;
- ``joined.G``: the front met generation G (only then did G start: one the front never meets failed to start);
- ``front``: the front's beat, written every second by a thread of its own with its ``--timeout``: a front silent
  past it (stopped, or its host frozen) ends the server, as a lost worker ends its generation.

A rank knows its generation from ``KVR_GENERATION`` (0: the first, whose ranks join as they always do).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

DIR_ENV = "KVR_RECOVERY_DIR"
GENERATION_ENV = "KVR_GENERATION"
BEAT_S = 1.0  # how often the front beats


def generation() -> int:
    """This rank's generation (0 unless the launcher started it to replace a lost one)."""
    return int(os.environ.get(GENERATION_ENV, "0"))


@dataclass(frozen=True)
class Started:
    """A generation of workers as the launcher started it."""

    generation: int
    port: int
    lost: tuple[int, ...] = ()  # the ranks the launcher saw end before it (empty where the front found the loss)


class RecoveryDir:
    """The folder the launcher and the front tell each other about a lost worker through."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    @classmethod
    def from_env(cls) -> RecoveryDir | None:
        """The launcher's folder where this rank runs under one that brings workers back; else None."""
        path = os.environ.get(DIR_ENV)
        return cls(path) if path else None

    @classmethod
    def for_front(cls, front: bool, tp: int, world_size: int) -> RecoveryDir | None:
        """The folder through which a front outlives its workers: a front of whole-model ranks (a TP peer's shard
        is not on the front), more than one, under a launcher that brings workers back; else None."""
        return cls.from_env() if front and tp == 1 and world_size > 1 else None

    def _write(self, name: str, body: dict) -> None:
        tmp = self.path / f".{name}.{os.getpid()}"
        tmp.write_text(json.dumps(body))
        tmp.replace(self.path / name)

    def _read(self, name: str) -> dict | None:
        try:
            return json.loads((self.path / name).read_text())
        except (OSError, ValueError):
            return None

    # the front's side
    def report_lost(self, gen: int, rank: int | None, why: str) -> None:
        self._write(f"lost.{gen}", {"rank": rank, "why": why, "at": time.time()})

    def started(self, gen: int) -> Started | None:
        body = self._read(f"gen.{gen}")
        return None if body is None else Started(gen, int(body["port"]), tuple(body.get("lost", ())))

    def all_ready(self, gen: int, ranks: list[int]) -> bool:
        return all((self.path / f"ready.{gen}.{r}").exists() for r in ranks)

    def say_joined(self, gen: int) -> None:
        self._write(f"joined.{gen}", {"at": time.time()})

    def beat(self, rank: int, timeout_s: float) -> threading.Event:
        """Write the front's beat every ``BEAT_S`` from a thread of its own (a busy engine still beats; a stopped
        process does not); set the returned event to stop."""
        stop = threading.Event()

        def run() -> None:
            while not stop.is_set():
                self._write("front", {"pid": os.getpid(), "rank": rank, "timeout_s": timeout_s, "at": time.time()})
                stop.wait(BEAT_S)

        threading.Thread(target=run, name="kvr-front-beat", daemon=True).start()
        return stop

    # the launcher's side
    def lost(self, gen: int) -> dict | None:
        return self._read(f"lost.{gen}")

    def joined(self, gen: int) -> bool:
        return (self.path / f"joined.{gen}").exists()

    def front_silence(self) -> tuple[float, dict] | None:
        """How long the front has not beaten and its last beat (its rank, pid and ``--timeout``); None before its
        first beat."""
        try:
            at = (self.path / "front").stat().st_mtime
        except OSError:
            return None
        return time.time() - at, self._read("front") or {}

    def announce(self, started: Started) -> None:
        self._write(f"gen.{started.generation}", {"port": started.port, "lost": list(started.lost)})

    # a respawned worker's side
    def say_ready(self, gen: int, rank: int) -> None:
        self._write(f"ready.{gen}.{rank}", {"pid": os.getpid(), "at": time.time()})
