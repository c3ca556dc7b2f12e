"""Faults never hang a job: every wait on another rank is bounded.

Two kinds of wait, two bounds:
- a wait for data in flight (a layer's K,V, an all-gather, a send draining) is bounded by ``--timeout``: no
  data for that long means the peer is stopped, gone, or its link is down or starved;
- a wait for another rank's whole prefill (the start barrier, the end-of-run gather: at 16k rank 0 may finish
  minutes before rank 1) may last long, so it is bounded by the peers' heartbeats instead: every rank bumps a
  counter in the rendezvous store every second, and a peer whose counter has not moved for ``--timeout``
  seconds (SIGSTOP, a frozen host, a link down) ends the wait.
Either way the rank raises ``PeerTimeout`` with one line naming itself and what it waited for; the CLIs turn
that into a non-zero exit, and the launchers end the other ranks.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time

import torch.distributed as dist

from kvrunahead.errors import PeerTimeout

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
PATIENT_S = 24 * 3600.0  # the patient group's own timeout; the heartbeats end its waits long before


_STATE: dict = {}


def start_heartbeat(timeout_s: float) -> None:
    """Begin bumping this rank's counter in the rendezvous store (after ``init_process_group``)."""
    stop_heartbeat()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    rank = dist.get_rank()
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            try:
                store.add(f"kvr/hb/{rank}", 1)
            except Exception:  # noqa: BLE001 - the store's host is gone (rank 0 done, the last rank verifying, or
                return  # a fault); the waits report it, and beating on would only repeat torch's warning each second
            stop.wait(HEARTBEAT_S)

    thread = threading.Thread(target=beat, name="kvr-heartbeat", daemon=True)
    thread.start()
    _STATE.update(stop=stop, thread=thread, store=store, rank=rank, timeout_s=timeout_s,
                  world_size=dist.get_world_size())


def stop_heartbeat() -> None:
    if "stop" in _STATE:
        _STATE["stop"].set()
    _STATE.clear()


def patient_group():
    """A gloo group whose collectives may wait a whole prefill; made by every rank in the same order."""
    if "patient" not in _STATE:
        _STATE["patient"] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=PATIENT_S))
    return _STATE["patient"]


def wait_for_peers(work, what: str, timeout_s: float | None = None) -> None:
    """Wait for ``work`` (an async collective) as long as every peer is alive; fail once one has been silent for
    ``timeout_s``."""
    wait_until(work.is_completed, what, timeout_s)
    work.wait()


def wait_until(done, what: str, timeout_s: float | None = None) -> None:
    """Poll ``done()`` as long as every peer is alive (sleeping from 0.1 ms up to 10 ms between looks); fail once
    one has been silent for ``timeout_s``."""
    timeout_s = timeout_s if timeout_s is not None else _STATE.get("timeout_s", 60.0)
    store, me = _STATE.get("store"), _STATE.get("rank", dist.get_rank())
    peers = [r for r in range(dist.get_world_size()) if r != me]
    last = {r: (None, time.monotonic()) for r in peers}
    next_check = time.monotonic()
    pause = 1e-4
    while not done():
        now = time.monotonic()
        if store is not None and now >= next_check:
            next_check = now + HEARTBEAT_S
            for r in peers:
                try:
                    count = store.add(f"kvr/hb/{r}", 0)
                except Exception as e:  # noqa: BLE001
                    raise PeerTimeout(f"rank {me}: the rendezvous store stopped answering ({type(e).__name__}) "
                                      f"while waiting for {what}") from None
                seen, since = last[r]
                if count != seen:
                    last[r] = (count, now)
                elif now - since > timeout_s:
                    raise PeerTimeout(f"rank {me}: rank {r} has not responded for {now - since:.0f} s (no heartbeat:"
                                      f" stopped, frozen or cut off) while waiting for {what}")
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


def patient_barrier(what: str = "the other ranks") -> None:
    """All ranks meet; waits as long as the others are alive, then leaves them in step (a plain barrier after the
    polled one, so that the ranks start a timed region together)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    group = patient_group()
    wait_for_peers(dist.barrier(group=group, async_op=True), what)
    dist.barrier(group=group)


def gather_objects(obj, what: str) -> list:
    """Every rank's ``obj``, after waiting for all ranks as long as they are alive."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    patient_barrier(what)
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=patient_group())
    return out


def forget() -> None:
    """Drop the patient group and the heartbeat (before the process group is destroyed)."""
    stop_heartbeat()
    _STATE.pop("patient", None)
