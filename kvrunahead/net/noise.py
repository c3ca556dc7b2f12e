"""The noise sidecar (paper section 5, fig. 11): bidirectional bulk traffic between one random pair of adjacent
ranks, the pair redrawn every interval, on connections of its own (not the model's process groups), so that it
competes with the K,V for the capped links and not for the model's communicator.

It runs as one process (``python -m kvrunahead.net.noise``) with a thread per ordered pair of ranks; a thread
that serves a rank on an emulated host enters that host's network namespace first (setns applies to the calling
thread only), so one process reaches every host. It sends at a bounded rate in paced chunks, never more than
``max_s`` seconds or ``max_bytes`` bytes, and reports what it moved and the CPU it used (on 2 cores it must not
compete with the ranks for the CPU).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvrunahead.net.spec import NetError, NoiseSpec

log = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
MAX_S = 4 * 3600.0  # the sidecar never outlives this, whatever happens to its parent
FINISH_S = 3.0  # a stopping sidecar's wait for its threads (one blocked in a send or receive is a daemon)
SIDECAR_STOP_S = 15.0  # the parent's wait for the stopped sidecar to write its report


@dataclass(frozen=True)
class Endpoint:
    """Where one rank lives: its namespace (None: this one) and the address its traffic goes to."""

    namespace: str | None
    address: str


@dataclass
class NoiseReport:
    rate_bytes_per_s: float  # asked, per direction
    interval_s: float
    duty: float
    wall_s: float
    active_s: float  # time with a pair sending
    bytes_sent: int
    bytes_received: int
    bytes_per_direction: dict[str, int] = field(default_factory=dict)  # "0>1": bytes
    active_s_per_direction: dict[str, float] = field(default_factory=dict)
    cpu_s: float = 0.0
    pairs_drawn: int = 0
    parts: int = 1  # sidecar runs added up (a resumed benchmark world runs it once per part)

    def to_json(self) -> str:
        """The report with its derived figures (cpu_share, achieved_rate), as written next to benchmark rows."""
        return json.dumps({**asdict(self), "cpu_share": self.cpu_share, "achieved_rate": self.achieved_rate()})

    @classmethod
    def from_json(cls, text: str) -> NoiseReport:
        """A report as ``to_json`` wrote it (the derived figures are dropped: they follow from the rest)."""
        data = json.loads(text)
        return cls(**{f: data[f] for f in cls.__dataclass_fields__ if f in data})

    def __add__(self, other: NoiseReport) -> NoiseReport:
        """The sidecar of one world run in two parts: its bytes, times and CPU summed."""
        def add(a: dict, b: dict) -> dict:
            return {k: a.get(k, 0) + b.get(k, 0) for k in sorted(a.keys() | b.keys())}

        return NoiseReport(self.rate_bytes_per_s, self.interval_s, self.duty, self.wall_s + other.wall_s,
                           self.active_s + other.active_s, self.bytes_sent + other.bytes_sent,
                           self.bytes_received + other.bytes_received,
                           add(self.bytes_per_direction, other.bytes_per_direction),
                           add(self.active_s_per_direction, other.active_s_per_direction),
                           self.cpu_s + other.cpu_s, self.pairs_drawn + other.pairs_drawn, self.parts + other.parts)

    @property
    def cpu_share(self) -> float:
        """CPU seconds per wall second: the share of one core the sidecar used."""
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    def achieved_rate(self) -> float:
        """Bytes per second of each direction while it was sending (median over directions that sent)."""
        rates = sorted(self.bytes_per_direction[d] / t for d, t in self.active_s_per_direction.items() if t > 0)
        return rates[len(rates) // 2] if rates else 0.0

    def describe(self) -> str:
        return (f"noise sidecar: {self.bytes_sent / 1e6:.1f} MB sent over {self.active_s:.1f} s active of "
                f"{self.wall_s:.1f} s, {self.achieved_rate() / 1e6:.1f} MB/s per direction while active "
                f"(asked {self.rate_bytes_per_s / 1e6:.1f}), CPU {self.cpu_share:.1%} of one core")


def enter_namespace(name: str | None) -> None:
    """Move the calling thread into the network namespace ``name`` (ip netns); None stays."""
    if name is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


class Sidecar:
    """The traffic itself, in this process; ``run_sidecar`` is the process around it."""

    def __init__(self, endpoints: list[Endpoint], spec: NoiseSpec, seed: int = 0, max_s: float = MAX_S,
                 max_bytes: int | None = None, enabled: bool = True) -> None:
        if len(endpoints) < 2:
            raise NetError("noise needs at least 2 ranks")
        self.endpoints, self.spec = endpoints, spec
        self.max_s = max_s
        self.max_bytes = max_bytes if max_bytes is not None else int(2 * spec.rate_bytes_per_s * max_s)
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.enabled = threading.Event()  # cleared: no pair is drawn (switched by the control socket)
        if enabled:
            self.enabled.set()
        self._ports: dict[int, int] = {}
        self._active: dict[tuple[int, int], threading.Event] = {}
        self._sent: dict[tuple[int, int], int] = {}
        self._active_s: dict[tuple[int, int], float] = {}
        self._received = 0
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._t0 = time.monotonic()
        self._active_total = 0.0
        self._pairs = 0

    # -- receivers: one listening socket per rank, in its namespace
    def _listen(self, rank: int, ready: threading.Barrier) -> None:
        ep = self.endpoints[rank]
        enter_namespace(ep.namespace)
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((ep.address, 0))
        srv.listen(16)
        srv.settimeout(0.2)
        self._ports[rank] = srv.getsockname()[1]
        ready.wait()
        while not self.stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            t = threading.Thread(target=self._drain, args=(conn,), daemon=True)
            t.start()
        srv.close()

    def _drain(self, conn: socket.socket) -> None:
        buf = bytearray(1 << 20)
        conn.settimeout(0.5)
        with conn:
            while not self.stop.is_set():
                try:
                    # MSG_TRUNC on TCP discards the bytes in the kernel: nothing is copied out.
                    n = conn.recv_into(buf, 0, socket.MSG_TRUNC)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if n == 0:
                    return
                with self._lock:
                    self._received += n

    # -- senders: one thread per ordered pair, sending paced chunks while its pair is drawn
    def _send(self, src: int, dst: int) -> None:
        enter_namespace(self.endpoints[src].namespace)
        active = self._active[(src, dst)]
        rate = self.spec.rate_bytes_per_s
        chunk = memoryview(bytes(int(min(1 << 20, max(4096, rate / 200)))))
        sock = None
        while not self.stop.is_set():
            if not active.wait(0.1):
                continue
            if sock is None:
                sock = socket.create_connection((self.endpoints[dst].address, self._ports[dst]), timeout=5)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            start, sent = time.monotonic(), 0
            while active.is_set() and not self.stop.is_set():
                # Paced: never ahead of rate x elapsed, so the rate holds however fast the link is.
                ahead = sent / rate - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(min(ahead, 0.05))
                    continue
                if self._total_sent() >= self.max_bytes:
                    self.stop.set()
                    break
                try:
                    sock.settimeout(1.0)
                    n = sock.send(chunk)
                except TimeoutError:
                    continue
                except OSError:
                    sock = None
                    break
                sent += n
                with self._lock:
                    self._sent[(src, dst)] = self._sent.get((src, dst), 0) + n
            with self._lock:
                self._active_s[(src, dst)] = self._active_s.get((src, dst), 0.0) + time.monotonic() - start
        if sock is not None:
            sock.close()

    def _total_sent(self) -> int:
        with self._lock:
            return sum(self._sent.values())

    def _control(self) -> None:
        """Draw a pair of adjacent ranks every interval; send for the duty cycle's share of it."""
        p = len(self.endpoints)
        pairs = [(i, i + 1) for i in range(p - 1)]
        while not self.stop.is_set() and time.monotonic() - self._t0 < self.max_s:
            if not self.enabled.wait(0.1):
                continue
            a, b = self.rng.choice(pairs)
            self._pairs += 1
            on_s = self.spec.interval_s * self.spec.duty
            self._active[(a, b)].set()
            self._active[(b, a)].set()
            t = time.monotonic()
            self.stop.wait(on_s)
            self._active[(a, b)].clear()
            self._active[(b, a)].clear()
            self._active_total += time.monotonic() - t
            self.stop.wait(self.spec.interval_s - on_s)
        self.stop.set()

    def start(self) -> None:
        p = len(self.endpoints)
        ready = threading.Barrier(p + 1)
        for r in range(p):
            self._spawn(self._listen, r, ready)
        ready.wait()
        for a in range(p):
            for b in (a - 1, a + 1):
                if 0 <= b < p:
                    self._active[(a, b)] = threading.Event()
                    self._spawn(self._send, a, b)
        self._spawn(self._control)

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        t.start()
        self._threads.append(t)

    def finish(self) -> NoiseReport:
        self.stop.set()
        deadline = time.monotonic() + FINISH_S  # one bound for all threads: the parent waits SIDECAR_STOP_S for all
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        usage = resource.getrusage(resource.RUSAGE_SELF)
        with self._lock:
            return NoiseReport(
                rate_bytes_per_s=self.spec.rate_bytes_per_s, interval_s=self.spec.interval_s, duty=self.spec.duty,
                wall_s=time.monotonic() - self._t0, active_s=self._active_total,
                bytes_sent=sum(self._sent.values()), bytes_received=self._received,
                bytes_per_direction={f"{a}>{b}": n for (a, b), n in self._sent.items()},
                active_s_per_direction={f"{a}>{b}": t for (a, b), t in self._active_s.items()},
                cpu_s=usage.ru_utime + usage.ru_stime, pairs_drawn=self._pairs)


def run_sidecar(endpoints: list[Endpoint], spec: NoiseSpec, report_path: str, control_path: str | None,
                seed: int = 0, max_s: float = MAX_S, enabled: bool = True) -> None:
    """The sidecar process: start, say "ready" on stdout, serve ``on``/``off`` on a unix socket, and on SIGTERM
    (or when stdin closes: the parent died) stop and write the report."""
    car = Sidecar(endpoints, spec, seed=seed, max_s=max_s, enabled=enabled)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    car.start()
    if control_path:
        threading.Thread(target=_serve_control, args=(car, control_path), daemon=True).start()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    print("ready", flush=True)
    while not done.is_set() and not car.stop.is_set():
        done.wait(0.2)
    report = car.finish()
    Path(report_path).write_text(report.to_json())


def _serve_control(car: Sidecar, path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)
    while not car.stop.is_set():
        conn, _ = srv.accept()
        with conn:
            cmd = conn.recv(64).decode().strip()
            if cmd == "on":
                car.enabled.set()
            elif cmd == "off":
                car.enabled.clear()
                # Wait for the pair in flight to finish its on-phase, so "off" means quiet.
                while any(e.is_set() for e in car._active.values()):
                    time.sleep(0.01)
            conn.sendall(b"ok\n")


def switch(control_path: str, on: bool) -> None:
    """Turn a running sidecar's traffic on or off (from any process on this machine; unix sockets cross network
    namespaces)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(control_path)
        s.sendall(b"on\n" if on else b"off\n")
        s.recv(8)


@contextlib.contextmanager
def sidecar(endpoints: list[Endpoint], spec: NoiseSpec, workdir: str, start_on: bool = True,
            seed: int = 0) -> Iterator[SidecarHandle]:
    """Run the sidecar process for the duration of the block; it is stopped on every path out of it."""
    handle = SidecarHandle(workdir, start_on)
    cmd = [sys.executable, "-m", "kvrunahead.net.noise", "--spec", json.dumps(asdict(spec)),
           "--endpoints", json.dumps([asdict(e) for e in endpoints]), "--report", handle.report_path,
           "--control", handle.control_path, "--seed", str(seed)] + ([] if start_on else ["--off"])
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    handle.proc = proc
    try:
        line = proc.stdout.readline().strip()
        if line != "ready":
            raise NetError(f"the noise sidecar did not start (exit {proc.wait()})")
        yield handle
    finally:
        handle.stop()


class SidecarHandle:
    def __init__(self, workdir: str, start_on: bool) -> None:
        self.report_path = os.path.join(workdir, f"noise-{os.getpid()}.json")
        self.control_path = os.path.join(workdir, f"noise-{os.getpid()}.sock")
        self.proc: subprocess.Popen | None = None
        self.report: NoiseReport | None = None

    def stop(self) -> NoiseReport | None:
        if self.proc is None:
            return self.report
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=SIDECAR_STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        with contextlib.suppress(OSError):
            proc.stdin.close()
        with contextlib.suppress(FileNotFoundError):
            text = Path(self.report_path).read_text()
            os.unlink(self.report_path)
            self.report = NoiseReport.from_json(text)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.control_path)
        return self.report


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="The noise sidecar (started by kvr-prefill, kvr-bench, kvr-net).")
    ap.add_argument("--spec", required=True)
    ap.add_argument("--endpoints", required=True)
    ap.add_argument("--report", required=True)
    ap.add_argument("--control")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-s", type=float, default=MAX_S)
    ap.add_argument("--off", action="store_true", help="start with the traffic off (turned on by the control socket)")
    a = ap.parse_args()
    spec = NoiseSpec(**json.loads(a.spec))
    endpoints = [Endpoint(**e) for e in json.loads(a.endpoints)]
    run_sidecar(endpoints, spec, a.report, a.control, a.seed, a.max_s, enabled=not a.off)


if __name__ == "__main__":
    main()
