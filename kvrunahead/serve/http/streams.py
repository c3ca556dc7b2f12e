"""One request's way through the engine as the HTTP layer sees it: admitted (every prompt of a batch before any
is awaited, so that the engine packs them into one prefill), watched for its client's disconnect, answered whole
or streamed choice by choice, and counted once however it ends."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvrunahead.serve.http import protocol as p
from kvrunahead.serve.http import responses as r
from kvrunahead.serve.http.inputs import ApiError
from kvrunahead.serve.http.metrics import Metrics
from kvrunahead.serve.sequence import (
    Answered,
    EngineDead,
    Finished,
    QueueFull,
    SamplingParams,
    TokenEvent,
    WorkersDown,
)

DISCONNECT_POLL_S = 0.2  # how often a request waiting on the engine checks that its client is still there
RETRY_AFTER_S = 1  # what a client refused for a full queue is told to wait


class ClientGone(Exception):
    """The HTTP client disconnected while its request was in the engine."""


def unavailable(client) -> ApiError | None:
    if not client.healthy:
        return ApiError(503, "the engine has failed; the server is going down", type="server_error",
                        code="engine_dead", outcome="unavailable")
    if client.draining:
        return ApiError(503, "the server is shutting down and takes no new requests", type="server_error",
                        code="draining", outcome="unavailable")
    if (why := client.workers_down()) is not None:
        return workers_down(f"{why}: retry later")
    return None


def workers_down(message: str) -> ApiError:
    return ApiError(503, message, type="server_error", code="workers_down", outcome="unavailable",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


# --- one request through the engine ------------------------------------------------------------------------------

@dataclass
class Run:
    """One admitted request: its events from the engine, watched for its client's disconnect, and timed."""

    client: object
    metrics: Metrics
    request: Request
    rid: str
    events: AsyncIterator
    arrival_s: float
    first_token_s: float | None = None
    ended: bool = False

    async def next(self) -> TokenEvent | Finished:
        """The next event; ``ClientGone`` if the client disconnects first (checked every DISCONNECT_POLL_S)."""
        task = asyncio.ensure_future(_pull(self.events))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    event = task.result()
                    break
                if await self.request.is_disconnected():
                    raise ClientGone
        finally:
            task.cancel()
        if isinstance(event, TokenEvent) and self.first_token_s is None:
            self.first_token_s = time.monotonic()
        return event

    def end(self, done: Finished | None) -> None:
        """Count the request once, however it ended; a request that did not finish in the engine is cancelled
        there (its client went away), which frees its cache at the engine's next step."""
        if self.ended:
            return
        self.ended = True
        if done is None:
            self.client.cancel(self.rid)
        figures = done.figures if done is not None else None
        outcome = "cancelled" if done is None else "invalid" if done.bad_input else done.finish_reason
        self.metrics.finished(
            outcome,
            ttft_s=None if self.first_token_s is None else self.first_token_s - self.arrival_s,
            e2e_s=time.monotonic() - self.arrival_s,
            prompt_tokens=done.prompt_tokens if done is not None else 0,
            completion_tokens=done.completion_tokens if done is not None else 0,
            rank_bytes={r["rank"]: r["bytes_sent"] for r in figures.ranks} if figures else {},
            packed_with=figures.packed_with if figures else 1, cached_tokens=figures.cached_tokens if figures else 0,
            layout=(figures.degree, figures.layout_basis) if figures else None)


async def _pull(events: AsyncIterator):
    try:
        return await anext(events)
    except StopAsyncIteration:  # an engine stream must end with Finished: one that does not is the engine's fault
        raise EngineDead("the engine ended the request without finishing it") from None


def failure(done: Finished | Answered, client) -> ApiError:
    if done.finish_reason == "cancelled":
        return ApiError(503, "the request was cancelled: the server shut down before it finished",
                        type="server_error", code="cancelled", outcome="cancelled")
    if done.bad_input:  # found when the engine planned it (a partition this length cannot take)
        return ApiError(400, done.error, code="invalid_prompt")
    return ApiError(503 if not client.healthy else 500, f"the engine failed the request: {done.error}",
                    type="server_error", code="engine_error", outcome="error")


async def admit(client, metrics: Metrics, request: Request, ids: list[int], params: SamplingParams, rid: str,
                 arrival_s: float, ttft_target_s: float | None = None) -> tuple[Run, TokenEvent | Finished]:
    """Hand the request to the engine and wait for its first event; the client's generator raises QueueFull,
    EngineDead or ValueError at its first step, before anything is queued."""
    run = Run(client, metrics, request, rid, client.generate(ids, params, rid, ttft_target_s=ttft_target_s),
               arrival_s)
    try:
        with refusals(client):
            return run, await run.next()
    except ApiError:
        raise
    except BaseException:  # the client went away, or the server cancelled the request while it waited
        run.end(None)
        raise


@contextlib.contextmanager
def refusals(client):
    """The engine's refusals of a request before anything is queued, as the HTTP errors they are."""
    try:
        yield
    except QueueFull:
        raise queue_full(client) from None
    except ValueError as e:  # the engine's own check of the parameters or the prompt
        raise ApiError(400, str(e)) from None
    except WorkersDown as e:
        raise workers_down(str(e)) from None
    except EngineDead as e:
        raise unavailable(client) or ApiError(503, str(e), type="server_error", outcome="unavailable") from None


def queue_full(client) -> ApiError:
    return ApiError(429, "the queue of waiting requests is full: retry later", type="rate_limit_exceeded",
                    code="queue_full", outcome="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})


async def admit_all(client, metrics: Metrics, request: Request, prompts: list[list[int]],
                    params: list[SamplingParams], rid: str, arrival_s: float, ttft_target_s: float | None = None,
                    n: int = 1) -> list[tuple[Run, TokenEvent | Finished]]:
    """Every prompt of a request into the engine at once (the engine packs prompts waiting together into one
    prefill), each with its first event; where one is refused, the others are cancelled and the refusal raised.
    With ``n`` > 1 each prompt's other n - 1 choices go in once its prefill is done: they find its K,V in the prefix
    cache and prefill its last token alone (a seed given is the first choice's; the others take the next ones).
    The runs in the choices' order: prompt i's j-th choice at i * n + j."""
    ids = [rid] if len(prompts) * n == 1 else [f"{rid}-{i * n}" for i in range(len(prompts))]
    first = await _gathered(admit(client, metrics, request, one, par, i, arrival_s, ttft_target_s)
                            for one, par, i in zip(prompts, params, ids))
    if n == 1:
        return first
    try:
        more = await _gathered(admit(client, metrics, request, one, _seeded(par, j), f"{rid}-{i * n + j}", arrival_s,
                                     ttft_target_s)
                               for i, (one, par) in enumerate(zip(prompts, params)) for j in range(1, n))
    except BaseException:
        for run, _ in first:
            run.end(None)
        raise
    others = iter(more)  # prompt by prompt, in the order they were admitted
    return [run for one in first for run in (one, *itertools.islice(others, n - 1))]


def _seeded(params: SamplingParams, j: int) -> SamplingParams:
    return dataclasses.replace(params, seed=None if params.seed is None else params.seed + j)


async def _gathered(admissions) -> list[tuple[Run, TokenEvent | Finished]]:
    got = await asyncio.gather(*admissions, return_exceptions=True)
    failed = [g for g in got if isinstance(g, BaseException)]
    if failed:
        for g in got:
            if not isinstance(g, BaseException):
                g[0].end(None)
        raise failed[0]
    return got


async def whole(runs, choices: list[r.Choice], shape, model: str, rid: str) -> Response:
    """Every choice to its end, answered in one body."""
    try:
        for (run, event), choice in zip(runs, choices):
            choice.take_prompt_logprobs(event)
            while isinstance(event, TokenEvent):
                choice.text += event.text
                if event.logprob is not None:
                    choice.logprobs.append(event.logprob)
                event = await run.next()
            run.end(event)
            choice.done = event
            if event.finish_reason in ("cancelled", "error"):
                e = failure(event, run.client)
                return JSONResponse(p.error_body(e.message, e.type, e.param, e.code), status_code=e.status)
    except ClientGone:
        return Response(status_code=499)
    finally:
        for run, _ in runs:
            run.end(None)  # a no-op for a run that ended
    return JSONResponse(shape.response(rid, model, choices).model_dump(mode="json"))


async def stream(runs, choices: list[r.Choice], shape, model: str, rid: str,
                 stream_options: p.StreamOptions | None) -> AsyncIterator[str]:
    """Server-sent events, choice after choice (each chunk names its choice's ``index``): its echoed prompt, one
    chunk per token with text (carrying the log-probabilities of the tokens since the last chunk), the last chunk
    with the finish reason and the figures; then, where ``stream_options.include_usage`` asks, a chunk of no choices
    carrying the usage of all (OpenAI's: on that final chunk only), then ``data: [DONE]``. ``continuous_usage_stats``
    (vLLM's) puts its choice's usage so far on every chunk. A failure mid-stream is an error event (the status is
    already sent)."""
    continuous = bool(stream_options and stream_options.continuous_usage_stats)
    try:
        for (run, event), choice in zip(runs, choices):
            tokens, pending, offset, first = 0, [], 0, True
            choice.take_prompt_logprobs(event)
            if choice.echo:
                yield r.sse(shape.chunk(rid, model, choice, choice.echo, [], 0, first))
                offset, first = len(choice.echo), False
            while isinstance(event, TokenEvent):
                tokens += 1
                if event.logprob is not None:
                    pending.append(event.logprob)
                if event.text:
                    use = r.usage(choice.prompt_tokens, tokens) if continuous else None
                    yield r.sse(shape.chunk(rid, model, choice, event.text, pending, offset, first, use))
                    pending, offset, first = [], offset + len(event.text), False
                event = await run.next()
            run.end(event)
            choice.done = event
            if event.finish_reason in ("cancelled", "error"):
                e = failure(event, run.client)
                yield r.sse(p.error_body(e.message, e.type, e.param, e.code))
                yield "data: [DONE]\n\n"
                return
            use = r.usage(choice.prompt_tokens, event.completion_tokens) if continuous else None
            yield r.sse(shape.last(rid, model, choice, pending, offset, use))
        if stream_options and stream_options.include_usage:
            total = r.usage(sum(c.prompt_tokens for c in choices), sum(c.completion_tokens for c in choices))
            yield r.sse(shape.usage_chunk(rid, model, total))
        yield "data: [DONE]\n\n"
    except ClientGone:
        pass
    finally:  # also when the server closes this generator because the client went away while a chunk was sent
        for run, _ in runs:
            run.end(None)
