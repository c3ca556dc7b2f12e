"""Ranks on separate emulated hosts: one network namespace per rank, a veth pair from each to one bridge in the
root namespace, and a token-bucket rate cap (tc tbf) on both ends of every link, i.e. in both directions.

    host 0 (netns kvr<k>h0)          root namespace              host 1 (netns kvr<k>h1)
    kvreth 10.213.k.1 --tbf--> veth kvr<k>v0 ==bridge kvr<k>br== veth kvr<k>v1 --tbf--> kvreth 10.213.k.2
                      <--tbf--                                               <--tbf--

A transfer from host i to host j passes i's uplink cap and j's downlink cap, as through a switch. This kernel
has no netem, so the links add no delay; the caps are accurate to a few percent. Every object is named
``kvr<k>...``, so ``teardown_all`` can remove what any run left, and every path that creates something
removes it again (``Emulation`` is a context manager; SIGTERM and SIGHUP are turned into exits).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvrunahead.net.spec import NetError, format_rate

log = logging.getLogger(__name__)

IFNAME = "kvreth"  # the link's name inside every host namespace (GLOO_SOCKET_IFNAME)
SUBNET = "10.213"  # 10.213.<k>.0/24 for emulation k
_NS_RE = re.compile(r"^kvr(\d+)h(\d+)$")
_LINK_RE = re.compile(r"^kvr(\d+)(br|v\d+)(@\S+)?$")
_LOCK = "/run/kvrunahead-net.lock"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check)


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if check and res.returncode:
        raise NetError(f"{' '.join(cmd)} failed: {(res.stderr or res.stdout).strip()}")
    return res


def check_permission() -> None:
    """One line saying what is missing, where the emulation cannot be made here."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetError(f"network emulation needs iproute2's {' and '.join(missing)} (apt-get install -y iproute2)")
    if os.geteuid() != 0:
        raise NetError("network emulation needs root (CAP_NET_ADMIN) to create namespaces, veth links and tc caps; "
                       "run as root or use --net loopback")
    probe = f"kvrprobe{os.getpid()}"
    res = _ip("netns", "add", probe, check=False)
    if res.returncode:
        raise NetError(f"network emulation cannot create a network namespace here ({res.stderr.strip()}); "
                       "it needs CAP_SYS_ADMIN and CAP_NET_ADMIN")
    _ip("netns", "del", probe, check=False)


def tbf_args(rate_bytes_per_s: float) -> list[str]:
    """tc tbf parameters for a cap: the bucket holds at least a 64 KiB GSO segment (veth passes them whole)
    and 2 ms of traffic; the queue holds 50 ms of traffic before dropping."""
    bits = int(rate_bytes_per_s * 8)
    burst = max(128 * 1024, int(rate_bytes_per_s * 0.002))
    limit = max(4 * burst, int(rate_bytes_per_s * 0.05))
    return ["rate", f"{bits}bit", "burst", str(burst), "limit", str(limit)]


@dataclass
class Emulation:
    """``hosts`` emulated hosts on one bridge, every link capped at ``cap_bytes_per_s`` each way (None: no cap)."""

    hosts: int
    cap_bytes_per_s: float | None
    index: int | None = None  # k in the names; chosen free when None
    _created: list[tuple[str, str]] = field(default_factory=list)

    def namespace(self, host: int) -> str:
        return f"kvr{self.index}h{host}"

    def address(self, host: int) -> str:
        return f"{SUBNET}.{self.index}.{host + 1}"

    @property
    def bridge(self) -> str:
        return f"kvr{self.index}br"

    def veth(self, host: int) -> str:
        return f"kvr{self.index}v{host}"

    def exec_prefix(self, host: int) -> list[str]:
        """Prepend to a command to run it on ``host``."""
        return ["ip", "netns", "exec", self.namespace(host)]

    def describe(self) -> str:
        cap = "uncapped" if self.cap_bytes_per_s is None else f"capped at {format_rate(self.cap_bytes_per_s)} each way"
        return (f"{self.hosts} emulated hosts " + ", ".join(f"{self.namespace(h)}={self.address(h)}"
                                                           for h in range(self.hosts)) + f", links {cap}")

    def setup(self) -> Emulation:
        if self.hosts < 1 or self.hosts > 250:
            raise NetError(f"network emulation takes 1 to 250 hosts, got {self.hosts}")
        check_permission()
        with _locked():
            if self.index is None:
                self.index = _free_index()
            try:
                self._build()
            except BaseException:
                self.teardown()
                raise
        log.info("network emulation up: %s", self.describe())
        return self

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._created.append(("link", self.bridge))
        _ip("link", "set", self.bridge, "up")
        for h in range(self.hosts):
            ns, veth, peer = self.namespace(h), self.veth(h), f"kvr{self.index}p{h}"
            _ip("netns", "add", ns)
            self._created.append(("netns", ns))
            _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
            self._created.append(("link", veth))
            _ip("link", "set", peer, "netns", ns)
            _ip("-n", ns, "link", "set", peer, "name", IFNAME)
            _ip("-n", ns, "addr", "add", f"{self.address(h)}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            if self.cap_bytes_per_s is not None:
                self.set_cap(h, self.cap_bytes_per_s)

    def set_cap(self, host: int, rate_bytes_per_s: float, direction: str = "both") -> None:
        """(Re)cap ``host``'s link: ``up`` (what it sends), ``down`` (what it receives) or ``both``."""
        args = tbf_args(rate_bytes_per_s)
        if direction in ("up", "both"):
            _run(["tc", "-n", self.namespace(host), "qdisc", "replace", "dev", IFNAME, "root", "tbf", *args])
        if direction in ("down", "both"):
            _run(["tc", "qdisc", "replace", "dev", self.veth(host), "root", "tbf", *args])

    def set_link(self, host: int, up: bool) -> None:
        _ip("-n", self.namespace(host), "link", "set", IFNAME, "up" if up else "down")

    def teardown(self) -> None:
        """Remove what this emulation made; safe to call twice."""
        for kind, name in reversed(self._created):
            if kind == "netns":
                _ip("netns", "del", name, check=False)
        for kind, name in reversed(self._created):
            if kind == "link":
                _delete_link(name)
        self._created.clear()

    def __enter__(self) -> Emulation:
        return self.setup()

    def __exit__(self, *exc) -> None:
        self.teardown()


def _delete_link(name: str) -> None:
    # Deleting a namespace removes its veth end, and the root end follows a moment later; delete it ourselves
    # (either order) so that the bridge goes last and nothing is left.
    for _ in range(50):
        if _ip("link", "show", name, check=False).returncode:
            return
        _ip("link", "del", name, check=False)
        time.sleep(0.02)
    raise NetError(f"could not remove the link {name}")


def _free_index() -> int:
    used = {int(m.group(1)) for m in map(_LINK_RE.match, _links()) if m}
    used |= {int(m.group(1)) for m in map(_NS_RE.match, namespaces()) if m}
    for k in range(1, 251):
        if k not in used:
            return k
    raise NetError("no free emulation index (250 emulations exist): run kvr-net down --all")


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    with open(_LOCK, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def namespaces() -> list[str]:
    res = _ip("netns", "list", check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def _links() -> list[str]:
    res = _ip("-o", "link", "show", check=False)
    return [line.split(":")[1].strip() for line in res.stdout.splitlines() if line.count(":") >= 2]


def leftovers() -> list[str]:
    """Every namespace and link of this project that exists now (empty after every run)."""
    return ([f"netns {n}" for n in namespaces() if _NS_RE.match(n)]
            + [f"link {name.split('@')[0]}" for name in _links() if _LINK_RE.match(name)])


def teardown_all() -> list[str]:
    """Remove every namespace and link of this project, whichever run made them; returns what was removed."""
    found = leftovers()
    for n in namespaces():
        if _NS_RE.match(n):
            _ip("netns", "del", n, check=False)
    links = [name.split("@")[0] for name in _links() if _LINK_RE.match(name)]
    for name in sorted(links, key=lambda x: x.endswith("br")):  # the bridge last
        _delete_link(name)
    return found


@contextlib.contextmanager
def exits_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise SystemExit inside the block (Ctrl-C already raises), so that ``finally`` and
    ``with`` blocks run and remove the emulation."""
    def handler(signum, _frame):
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
