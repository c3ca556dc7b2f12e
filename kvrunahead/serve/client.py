"""The engine behind asyncio: what the HTTP layer talks to, knowing nothing of ranks.

The engine loop runs in one background thread on the front rank (every collective stays on that thread); events
cross to the event loop with ``loop.call_soon_threadsafe`` onto one ``asyncio.Queue`` per request, as vLLM's
``AsyncLLM`` streams its outputs.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from collections.abc import AsyncIterator

from kvrunahead.net.faults import maybe_stall
from kvrunahead.serve.asking import asking
from kvrunahead.serve.engine import Engine
from kvrunahead.serve.sequence import (
    Answered,
    EngineDead,
    Event,
    Finished,
    Request,
    SamplingParams,
    TokenEvent,
    new_request_id,
)

log = logging.getLogger(__name__)


class AsyncEngineClient:
    def __init__(self, engine: Engine, model_id: str | None = None) -> None:
        self.engine = engine
        self.model_id = model_id or engine.config.run.model
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.draining = False
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._loop_error: str | None = None
        self.step_began_s: float | None = None  # the engine's heartbeat: when the step now running began (monotonic)
        self.step_ended_s = time.monotonic()  # and when the last one ended
        # in a copy of this thread's context: torch keeps dynamo's settings in context variables (a compiled model's
        # recompile limit and error handling, model/compiled.py), which a new thread would start without
        self._thread = threading.Thread(target=contextvars.copy_context().run, args=(self._run,), name="kvr-engine",
                                        daemon=True)
        self._thread.start()

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.engine.ctx.lm.eos_token_ids

    def decode(self, ids: list[int]) -> str:
        return self.engine.ctx.lm.decode(ids)

    @property
    def healthy(self) -> bool:
        """False once a rank died, the loop failed or the engine was shut down."""
        return self.engine.healthy and self._thread.is_alive() and self._loop_error is None

    @property
    def in_flight(self) -> int:
        return len(self._queues)

    def step_age_s(self) -> float:
        """Seconds since the engine last finished a step (an idle engine steps every ``heartbeat_s``)."""
        return time.monotonic() - self.step_ended_s

    def stuck(self) -> str | None:
        """Why the engine counts as stuck (a step it began has not ended within ``--timeout``), or None."""
        began, timeout_s = self.step_began_s, self.engine.config.run.timeout_s
        if began is None or time.monotonic() - began <= timeout_s:
            return None
        return f"the engine's step has run {time.monotonic() - began:.0f} s (--timeout {timeout_s:g})"

    def workers_down(self) -> str | None:
        """Why no new prompt is taken (the workers lost past the front's patience), or None."""
        return self.engine.recovery.overdue if self.engine.recovery is not None else None

    def recovery(self) -> dict:
        """The workers' restarts so far and, while a worker is lost, which, since when and why."""
        return self.engine.recovery.health() if self.engine.recovery is not None else {"restarts": 0}

    def begin_drain(self) -> None:
        """Take no new requests (SIGTERM); those in flight run to their end."""
        self.draining = True

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       ttft_target_s: float | None = None) -> AsyncIterator[TokenEvent | Finished]:
        """The request's events up to its Finished. The first ``__anext__`` raises QueueFull, EngineDead (dead or
        draining) or ValueError (bad parameters, prompt too long) before anything is queued. Closing the generator
        early (a client gone) cancels the request. ``ttft_target_s``: the TTFT it asks for (the LARS schedule's
        deadline; None: the default by its length)."""
        self._check_open()
        request = Request(request_id or new_request_id(), list(prompt_ids), params, ttft_target_s=ttft_target_s)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request.request_id] = (asyncio.get_running_loop(), queue)
        finished = False
        try:
            self.engine.add(request)
            self._wake.set()
            while not finished:
                event = await queue.get()
                finished = isinstance(event, Finished)
                yield event
        finally:
            self._queues.pop(request.request_id, None)
            if not finished:
                self.cancel(request.request_id)

    async def ask(self, context_ids: list[int], question_ids: list[list[int]], max_tokens: int,
                  request_id: str | None = None) -> Answered:
        """Many questions on one context, answered together; raises like ``generate`` before anything is queued.
        Cancelled when the caller stops waiting."""
        self._check_open()
        ask = asking(request_id or new_request_id(), context_ids, question_ids, max_tokens)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[ask.request_id] = (asyncio.get_running_loop(), queue)
        answered = None
        try:
            self.engine.add(ask)
            self._wake.set()
            answered = await queue.get()
            return answered
        finally:
            self._queues.pop(ask.request_id, None)
            if answered is None:
                self.cancel(ask.request_id)

    def _check_open(self) -> None:
        if self.draining:
            raise EngineDead("the server is draining")
        if not self.healthy:
            raise EngineDead(f"the engine has failed: {self.engine.error or self._loop_error}")

    def cancel(self, request_id: str) -> None:
        self.engine.cancel(request_id)
        self._wake.set()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the loop; it tells the workers to end and errs any request still in flight."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                if not engine.has_work():
                    self._wake.wait(engine.config.heartbeat_s)
                    self._wake.clear()
                self._dispatch(self._step())
        except Exception as e:  # noqa: BLE001 - a bug in the loop must still end every request
            log.exception("the engine loop failed")
            self._loop_error = f"{type(e).__name__}: {e}"
            self._dispatch(engine.fail_all(self._loop_error))
            return
        engine.shutdown()
        self._dispatch(engine.fail_all("the server shut down", on_purpose=True))

    def _step(self) -> list[Event]:
        self.step_began_s = time.monotonic()
        try:
            if self.engine.has_work():
                maybe_stall()
            return self.engine.step()
        finally:
            self.step_ended_s, self.step_began_s = time.monotonic(), None

    def _dispatch(self, events: list[Event]) -> None:
        for event in events:
            target = self._queues.get(event.request_id)
            if target is not None:
                loop, queue = target
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, event)
                except RuntimeError:  # the event loop has closed: nobody is listening any more
                    pass
