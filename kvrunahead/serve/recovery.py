"""The front outlives a worker: what it knows of a lost rank, and how it meets the workers started in its place.

When a step fails because a worker died, stopped past ``--timeout`` or was cut off, the engine (serve/engine.py)
keeps its requests: the decodes whose K,V the front holds go on, every other request waits or runs again from its
prompt. ``Recovery`` tells the launcher (ranks/recovery.py), follows the generations it starts, and, once every
worker of the newest one has loaded the model, joins them (ranks/setup.rejoin): the partition, the learned timings
and the prefix cache are the front's and stay. It reports the state to ``/health`` and ``/metrics``.

Only a server whose ranks ``kvr-serve --nproc`` started itself, of whole-model ranks (no ``--tp``), recovers: under
torchrun or mpirun the launcher ends every rank when one fails, and a TP peer's shard is not on the front.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass

from kvrunahead.ranks.recovery import RecoveryDir
from kvrunahead.ranks.setup import rejoin
from kvrunahead.serve.kv_pool import Held, run_again
from kvrunahead.serve.scheduler import Step
from kvrunahead.serve.sequence import Event, Sequence, WorkersDown

log = logging.getLogger(__name__)

RERUNS = 2  # the times a request runs again from its prompt after a worker's loss before it ends with an error
NAP_S = 0.02  # the engine loop's pause while its prefills wait for the workers and no decode runs

RANK_IN = re.compile(r"\brank (\d+) (?:has not responded|is gone)|from rank (\d+)|to rank (\d+)")


@dataclass
class Lost:
    """A worker generation lost: since when, which rank where it is known, and why."""

    since_s: float  # time.time()
    since_monotonic: float
    why: str
    rank: int | None = None


class Recovery:
    def __init__(self, folder: RecoveryDir | None, ctx, cfg, world, setup, held: Held) -> None:
        self.folder, self.ctx, self.cfg, self.world, self.setup, self.held = folder, ctx, cfg, world, setup, held
        self.generation = 0  # the workers' generation the front has joined
        self.lost: Lost | None = None
        self.restarts = 0  # generations joined after a loss
        self.down_s: list[float] = []  # seconds from each loss to serving over every rank again
        # how long prefills wait for the workers: then they end with an error, and new prompts get a 503
        self.patience_s = max(60.0, 3 * cfg.timeout_s)
        # the launcher ends the server if the front falls silent
        self.beating = folder.beat(ctx.rank, cfg.timeout_s) if folder is not None else None

    @property
    def overdue(self) -> str | None:
        """Why no prompt can wait any longer: the workers lost longer ago than the patience; else None."""
        if self.lost is None or time.monotonic() - self.lost.since_monotonic <= self.patience_s:
            return None
        rank = f"rank {self.lost.rank}" if self.lost.rank is not None else "a worker rank"
        return (f"{rank} was lost {time.monotonic() - self.lost.since_monotonic:.0f} s ago and the workers are not "
                f"back ({self.lost.why})")

    def tick(self) -> list[Event]:
        """Each engine step while a worker is lost: join the workers started again where they are ready (the
        prefills go on), else end the prompts that have waited past the patience."""
        if self.lost is None:
            return []
        if self.poll():
            self.held.scheduler.hold_prefills = self.held.heartbeat.off = False
            return []
        if (overdue := self.overdue) is not None:
            return [self.held.finish(seq, "error", overdue) for seq in self.held.scheduler.take_waiting()]
        if not self.held.scheduler.running:
            time.sleep(NAP_S)  # the prefills wait for the workers and nothing else runs: no spinning meanwhile
        return []

    def check_open(self) -> None:
        """Raise WorkersDown where no new prompt can wait for the workers (lost past the patience)."""
        if (overdue := self.overdue) is not None:
            raise WorkersDown(f"{overdue}: retry later")

    def lose_workers(self, e: BaseException, step: Step | None) -> list[Event]:
        """A step failed on the workers: the front serves on. The decodes whose K,V it holds go on (a row that rode
        in the failed forward cut back to where it was); the prefills in flight, the chunked ones between their
        chunks and the KV-parallel decodes run again from their prompts once the workers are back (a stream goes
        on after the tokens it has sent); every other prefill waits for them."""
        lost, held = self.lose(e), self.held
        held.scheduler.hold_prefills = held.heartbeat.off = True  # nothing goes to the workers until they are back
        why = f"rank {lost.rank if lost.rank is not None else '?'} was lost ({lost.why})"
        again = list(step.prefills) if step is not None else []
        again += [seq for seq in held.scheduler.take_prefilling() if seq not in again]
        again += [seq for seq in list(held.scheduler.running) if seq.request_id in self.ctx.shards]
        for request_id in [*self.ctx.shards, *self.ctx.partial, *self.ctx.staged]:
            self.ctx.forget(request_id)
        for seq in held.scheduler.running:
            if seq not in again and seq.answers is None:
                held.decoder.rollback(seq.request_id, seq.next_position)
        return [e for seq in again for e in self.rerun(seq, why)]

    def rerun(self, seq: Sequence, why: str) -> list[Event]:
        """``seq`` again from its prompt, the tokens it has sent fed back rather than chosen again (the engine's
        ``_next``), so that its stream goes on where it was; an error once it has run ``RERUNS`` times."""
        if seq.retried >= RERUNS:
            return [self.held.finish(seq, "error", f"{why}; the request ran {seq.retried + 1} times and lost its "
                                                   "ranks each time")]
        seq.retried += 1
        run_again(self.held, seq)
        return []

    def lose(self, e: BaseException) -> Lost:
        """A step failed on the workers: note it and ask the launcher for a new generation."""
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
        rank = _rank_in(str(e), self.ctx.rank)
        if self.lost is None:
            self.lost = Lost(time.time(), time.monotonic(), why, rank)
        log.warning("a worker is lost (%s); serving the decodes the front holds and starting the workers again", why)
        self.folder.report_lost(self.generation, rank, why)
        return self.lost

    def poll(self) -> bool:
        """Follow the launcher's generations; join the newest once all its workers are ready. True on joining."""
        newest = self.generation
        while self.folder.started(newest + 1) is not None:
            newest += 1
        if newest == self.generation:
            return False
        started = self.folder.started(newest)
        if self.lost.rank is None and started.lost:
            self.lost.rank = started.lost[0]
        workers = [r for r in range(self.ctx.world_size) if r != self.ctx.rank]
        if not self.folder.all_ready(newest, workers):
            return False
        self.generation = newest
        try:
            self.ctx.transport = rejoin(self.cfg, self.world, self.setup, started.port)
        except Exception as e:  # noqa: BLE001 - a worker of the new generation gone before the rendezvous ended
            self.lose(e)
            return False
        self.folder.say_joined(newest)
        self.down_s.append(time.monotonic() - self.lost.since_monotonic)
        self.restarts += 1
        log.warning("serving over all %d ranks again (generation %d), %.1f s after the loss", self.ctx.world_size,
                    newest, self.down_s[-1])
        self.lost = None
        return True

    def health(self) -> dict:
        """What ``/health`` says beyond its status."""
        if self.lost is None:
            return {"restarts": self.restarts}
        return {"restarts": self.restarts, "degraded": {
            "rank": self.lost.rank, "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.lost.since_s)),
            "seconds": round(time.monotonic() - self.lost.since_monotonic, 1), "why": self.lost.why}}


def _rank_in(message: str, me: int) -> int | None:
    """The peer a failure's message names, where it names one other than this rank."""
    for m in RANK_IN.finditer(message):
        rank = int(next(g for g in m.groups() if g is not None))
        if rank != me:
            return rank
    return None
