"""The network of one job: emulated hosts with caps (or loopback) and the noise sidecar, up for the duration of a
``with`` block and gone after it on every path (normal exit, error, Ctrl-C, SIGTERM)."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvrunahead.net.emulation import IFNAME, Emulation, exits_on_signals
from kvrunahead.net.noise import Endpoint, SidecarHandle, sidecar
from kvrunahead.net.spec import NetSpec

log = logging.getLogger(__name__)


@dataclass
class Hosts:
    """Where each rank runs and how the ranks reach rank 0."""

    spec: NetSpec
    emulation: Emulation | None = None
    noise: SidecarHandle | None = None
    env: dict[str, str] = field(default_factory=dict)  # for every rank: gloo's interface

    def prefix(self, rank: int) -> list[str]:
        return self.emulation.exec_prefix(rank) if self.emulation else []

    def address(self, rank: int) -> str:
        return self.emulation.address(rank) if self.emulation else "127.0.0.1"

    @property
    def master_addr(self) -> str:
        return self.address(0)


@contextlib.contextmanager
def network(spec: NetSpec, hosts: int, noise_on: bool = True) -> Iterator[Hosts]:
    """``hosts`` emulated hosts (a cap in ``spec``) or loopback, and the sidecar where ``spec`` has noise
    (``noise_on`` False: it starts switched off, for a benchmark that turns it on run by run)."""
    with exits_on_signals(), contextlib.ExitStack() as stack:
        out = Hosts(spec)
        if spec.emulated:
            out.emulation = stack.enter_context(Emulation(hosts, spec.cap_bytes_per_s))
            # The hosts share one hostname that resolves to none of their addresses: c10d's reverse lookups warn
            # on every connection, which says nothing about the run.
            out.env = {"GLOO_SOCKET_IFNAME": IFNAME, "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL",
                                                                                              "ERROR")}
            log.info("%s", out.emulation.describe())
        if spec.noise and hosts > 1:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvr-noise-"))
            endpoints = [Endpoint(out.emulation.namespace(h) if out.emulation else None, out.address(h))
                         for h in range(hosts)]
            out.noise = stack.enter_context(sidecar(endpoints, spec.noise, workdir, start_on=noise_on))
            out.env["KVR_NOISE_CONTROL"] = out.noise.control_path
        yield out
