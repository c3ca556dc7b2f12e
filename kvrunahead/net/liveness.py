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
import pickle
import threading
import time

import torch
import torch.distributed as dist

from kvrunahead.errors import PeerTimeout

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
PATIENT_S = 24 * 3600.0  # the patient group's own timeout; the heartbeats end its waits long before


_STATE: dict = {}


class Heard:
    """What a rank's heartbeat thread last heard of its peers: each peer's counter and when it last moved, or the
    store's error once it stopped answering. Read by the waits, which never call the store themselves: a store
    whose host is stopped answers no call, and a wait must not hang on it."""

    def __init__(self, peers: list[int]) -> None:
        self.moved = {r: (None, time.monotonic()) for r in peers}
        self.error: str | None = None

    def take(self, counts: dict[int, int]) -> None:
        now = time.monotonic()
        for r, count in counts.items():
            if count != self.moved[r][0]:
                self.moved[r] = (count, now)


def start_heartbeat(timeout_s: float) -> None:
    """Begin bumping this rank's counter in the rendezvous store, and reading the others', every second (after
    ``init_process_group``)."""
    stop_heartbeat()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    rank = dist.get_rank()
    stop = threading.Event()
    heard = Heard([r for r in range(dist.get_world_size()) if r != rank])

    def beat() -> None:
        while not stop.is_set():
            try:
                store.add(f"kvr/hb/{rank}", 1)
                heard.take({r: store.add(f"kvr/hb/{r}", 0) for r in heard.moved})
            except Exception as e:  # noqa: BLE001 - the store's host is gone (rank 0 done, the last rank verifying,
                heard.error = type(e).__name__  # or a fault); the waits report it, and beating on would only repeat
                return  # torch's warning each second
            stop.wait(HEARTBEAT_S)

    thread = threading.Thread(target=beat, name="kvr-heartbeat", daemon=True)
    thread.start()
    _STATE.update(stop=stop, thread=thread, heard=heard, rank=rank, timeout_s=timeout_s,
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
    one has been silent for ``timeout_s`` (since the wait began, at the most), as the heartbeat thread heard it."""
    timeout_s = timeout_s if timeout_s is not None else _STATE.get("timeout_s", 60.0)
    heard, me = _STATE.get("heard"), _STATE.get("rank", dist.get_rank())
    start = next_check = time.monotonic()
    pause = 1e-4
    while not done():
        now = time.monotonic()
        if heard is not None and now >= next_check:
            next_check = now + HEARTBEAT_S / 10
            if heard.error is not None:
                raise PeerTimeout(f"rank {me}: the rendezvous store stopped answering ({heard.error}) while waiting "
                                  f"for {what}")
            for r, (_, moved) in heard.moved.items():
                if now - max(moved, start) > timeout_s:
                    raise PeerTimeout(f"rank {me}: rank {r} has not responded for {now - max(moved, start):.0f} s "
                                      f"(no heartbeat: stopped, frozen or cut off) while waiting for {what}")
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


def patient_barrier(what: str = "the other ranks") -> None:
    """All ranks meet; waits as long as the others are alive, then leaves them in step (a second barrier after the
    polled one, so that the ranks start a timed region together)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    group = patient_group()
    wait_for_peers(dist.barrier(group=group, async_op=True), what)
    _met_again(dist.barrier(group=group, async_op=True), what)


def _met_again(work, what: str) -> None:
    """Wait for ``work``, a collective every rank has just met for (after a polled barrier), at most ``--timeout``:
    a rank stopped in between must not hang the others (the patient group's own timeout is a day)."""
    timeout_s = _STATE.get("timeout_s", 60.0)
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        why = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise PeerTimeout(f"rank {dist.get_rank()}: the other ranks did not meet again within {timeout_s:g} s while "
                          f"waiting for {what} ({why})") from None


def gather_objects(obj, what: str) -> list:
    """Every rank's ``obj``, after waiting for all ranks as long as they are alive (pickled, gathered as bytes on
    the patient group, each collective bounded as ``_met_again``)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    patient_barrier(what)
    group, p = patient_group(), dist.get_world_size()
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(p)]
    _met_again(dist.all_gather(sizes, torch.tensor([data.numel()]), group=group, async_op=True), what)
    most = max(int(n) for n in sizes)
    padded = torch.zeros(most, dtype=torch.uint8)
    padded[:data.numel()] = data
    out = [torch.empty(most, dtype=torch.uint8) for _ in range(p)]
    _met_again(dist.all_gather(out, padded, group=group, async_op=True), what)
    return [pickle.loads(o[:int(n)].numpy().tobytes()) for o, n in zip(out, sizes)]


def forget() -> None:
    """Drop the patient group and the heartbeat (before the process group is destroyed)."""
    stop_heartbeat()
    _STATE.pop("patient", None)
