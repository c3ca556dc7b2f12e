"""uvicorn with the stop a server of an engine needs: drain on SIGTERM, go down when the engine dies.

uvicorn's own stop closes the listening socket at the first signal, so a client arriving during the drain would
get a refused connection rather than the 503 a load balancer reads as "go elsewhere"; here the first SIGTERM (or
SIGINT) only tells the engine client to take no new requests (the app answers 503), the requests in flight run
to their end up to the grace period, and only then does uvicorn stop. A second signal stops at once.
Knows nothing of ranks: the client says whether the engine lives.
"""

from __future__ import annotations

import asyncio
import logging
import time

import uvicorn

log = logging.getLogger(__name__)

FAILURE_FLUSH_S = 2.0  # once the engine died: how long the error responses in flight get to reach their clients
# One stop request often arrives twice: from a launcher that forwards it and from the process group or cgroup it
# was sent to (a terminal's Ctrl-C, systemd, GNU timeout). Repeats this close to the first are the same request.
REPEAT_S = 1.0


class DrainingServer(uvicorn.Server):
    """A uvicorn server over ``client``; after ``run()``, ``failure`` says why it stopped if the engine died."""

    def __init__(self, config: uvicorn.Config, client, grace_s: float, on_started=None) -> None:
        super().__init__(config)
        self.client, self.grace_s, self.on_started = client, grace_s, on_started
        self.drain_started = self.drain_deadline = None
        self.failed_at: float | None = None
        self.failure: str | None = None

    def handle_exit(self, sig: int, frame) -> None:
        # Not recorded in uvicorn's captured signals: it re-raises those once stopped, and the process would end
        # by the signal instead of exiting 0 after a clean drain.
        if self.drain_deadline is None:
            self.begin_drain()
        elif time.monotonic() - self.drain_started > REPEAT_S:
            log.warning("second signal: stopping now")
            self.should_exit = True

    def begin_drain(self) -> None:
        """Stop taking requests (503); let those in flight finish within the grace period."""
        if self.drain_deadline is None:
            log.warning("draining: no new requests; %d in flight get up to %.0f s", self.client.in_flight,
                        self.grace_s)
            self.client.begin_drain()
            self.drain_started = time.monotonic()
            self.drain_deadline = self.drain_started + self.grace_s

    @property
    def port(self) -> int | None:
        """The port listened on (the one the OS chose for port 0)."""
        for server in self.servers:
            for sock in server.sockets:
                return sock.getsockname()[1]
        return None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.on_started is not None:
            self.on_started(self)

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        now = time.monotonic()
        if self.failed_at is None and not self.client.healthy:
            self.failed_at = now
            self.failure = getattr(self.client, "error", None) or "the engine failed"
            log.error("the engine failed (%s): ending the requests in flight and stopping", self.failure)
        if self.failed_at is not None:
            return self.client.in_flight == 0 or now - self.failed_at > FAILURE_FLUSH_S
        if self.drain_deadline is None:
            return False
        if self.client.in_flight == 0:
            return True
        if now > self.drain_deadline:
            log.warning("grace period over: ending %d request(s) still in flight", self.client.in_flight)
            # The engine ends them with an error response each, which the server then sends before it stops.
            await asyncio.to_thread(self.client.shutdown)
            return True
        return False
