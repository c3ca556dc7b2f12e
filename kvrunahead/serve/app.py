"""The HTTP layer: a thin FastAPI app over an ``AsyncEngineClient`` (it knows nothing of ranks).

POST /v1/completions (the raw prompt, as ``kvr-prefill --no-chat``), POST /v1/chat/completions (the model's chat
template), POST /v1/ask, GET /v1/models, GET /version, GET /health, GET /metrics. Errors are OpenAI's body with the
status a client of vLLM or SGLang expects: 400 for bad input, 404 for a model it does not serve, 413 for a body
over ``--max-request-bytes``, 415 for one that is not JSON, 429 with Retry-After when the queue is full, 503 while
draining or once the engine is dead, 500 when the engine failed a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from kvrunahead.prompt import question_prompts
from kvrunahead.serve import inputs
from kvrunahead.serve import protocol as p
from kvrunahead.serve.inputs import ApiError
from kvrunahead.serve.metrics import Metrics
from kvrunahead.serve.sequence import (
    Answered,
    EngineDead,
    Finished,
    QueueFull,
    SamplingParams,
    TokenEvent,
    new_request_id,
)
from kvrunahead.version import __version__

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.2  # how often a request waiting on the engine checks that its client is still there
RETRY_AFTER_S = 1  # what a client refused for a full queue is told to wait


class ClientGone(Exception):
    """The HTTP client disconnected while its request was in the engine."""


def _unavailable(client) -> ApiError | None:
    if not client.healthy:
        return ApiError(503, "the engine has failed; the server is going down", type="server_error",
                        code="engine_dead", outcome="unavailable")
    if client.draining:
        return ApiError(503, "the server is shutting down and takes no new requests", type="server_error",
                        code="draining", outcome="unavailable")
    return None


def _figures(figures) -> p.KvrFigures | None:
    if figures is None:
        return None
    return p.KvrFigures(
        ttft_s=figures.ttft_s, queue_s=figures.queue_s, degree=figures.degree, degree_source=figures.degree_source,
        partition=p.Partition(boundaries=list(figures.boundaries), source=figures.partition_source),
        ranks=[p.RankFigures(**{k: r[k] for k in ("rank", "compute_s", "wait_s", "bytes_sent")})
               for r in figures.ranks], packed_with=figures.packed_with, cached_tokens=figures.cached_tokens,
        decode=figures.decode, chunks=[p.ChunkFigures(**c) for c in figures.chunks])


def _usage(done: Finished) -> p.Usage:
    return p.Usage(prompt_tokens=done.prompt_tokens, completion_tokens=done.completion_tokens,
                   total_tokens=done.prompt_tokens + done.completion_tokens)


def _sse(body: BaseModel | dict) -> str:
    return f"data: {body.model_dump_json() if isinstance(body, BaseModel) else json.dumps(body)}\n\n"


# --- the two endpoints' shapes -----------------------------------------------------------------------------------

class _Completions:
    """/v1/completions: ``text_completion`` objects, streamed as the same objects carrying the new text."""

    def response(self, rid: str, model: str, text: str, done: Finished) -> BaseModel:
        return p.CompletionResponse(id=rid, model=model, usage=_usage(done), kvrunahead=_figures(done.figures),
                                    choices=[p.CompletionChoice(text=text, finish_reason=done.finish_reason)])

    def chunk(self, rid: str, model: str, text: str, first: bool, usage: p.Usage | None = None) -> BaseModel:
        return p.CompletionResponse(id=rid, model=model, choices=[p.CompletionChoice(text=text)], usage=usage)

    def last(self, rid: str, model: str, done: Finished, usage: p.Usage | None = None) -> BaseModel:
        return p.CompletionResponse(id=rid, model=model, usage=usage, kvrunahead=_figures(done.figures),
                                    choices=[p.CompletionChoice(text="", finish_reason=done.finish_reason)])

    def usage_chunk(self, rid: str, model: str, done: Finished) -> BaseModel:
        return p.CompletionResponse(id=rid, model=model, choices=[], usage=_usage(done))


class _Chat:
    """/v1/chat/completions: ``chat.completion``, streamed as ``chat.completion.chunk`` deltas."""

    def response(self, rid: str, model: str, text: str, done: Finished) -> BaseModel:
        return p.ChatCompletionResponse(
            id=rid, model=model, usage=_usage(done), kvrunahead=_figures(done.figures),
            choices=[p.ChatChoice(message=p.AssistantMessage(content=text), finish_reason=done.finish_reason)])

    def chunk(self, rid: str, model: str, text: str, first: bool, usage: p.Usage | None = None) -> BaseModel:
        delta = p.Delta(role="assistant" if first else None, content=text)
        return p.ChatCompletionChunk(id=rid, model=model, choices=[p.ChatChunkChoice(delta=delta)], usage=usage)

    def last(self, rid: str, model: str, done: Finished, usage: p.Usage | None = None) -> BaseModel:
        return p.ChatCompletionChunk(id=rid, model=model, usage=usage, kvrunahead=_figures(done.figures),
                                     choices=[p.ChatChunkChoice(delta=p.Delta(), finish_reason=done.finish_reason)])

    def usage_chunk(self, rid: str, model: str, done: Finished) -> BaseModel:
        return p.ChatCompletionChunk(id=rid, model=model, choices=[], usage=_usage(done))


# --- one request through the engine ------------------------------------------------------------------------------

@dataclass
class _Run:
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
            packed_with=figures.packed_with if figures else 1, cached_tokens=figures.cached_tokens if figures else 0)


async def _pull(events: AsyncIterator):
    try:
        return await anext(events)
    except StopAsyncIteration:  # an engine stream must end with Finished: one that does not is the engine's fault
        raise EngineDead("the engine ended the request without finishing it") from None


def _failure(done: Finished | Answered, client) -> ApiError:
    if done.finish_reason == "cancelled":
        return ApiError(503, "the request was cancelled: the server shut down before it finished",
                        type="server_error", code="cancelled", outcome="cancelled")
    if done.bad_input:  # found when the engine planned it (a partition this length cannot take)
        return ApiError(400, done.error, code="invalid_prompt")
    return ApiError(503 if not client.healthy else 500, f"the engine failed the request: {done.error}",
                    type="server_error", code="engine_error", outcome="error")


async def _admit(client, metrics: Metrics, request: Request, ids: list[int], params: SamplingParams, rid: str,
                 arrival_s: float, ttft_target_s: float | None = None) -> tuple[_Run, TokenEvent | Finished]:
    """Hand the request to the engine and wait for its first event; the client's generator raises QueueFull,
    EngineDead or ValueError at its first step, before anything is queued."""
    run = _Run(client, metrics, request, rid, client.generate(ids, params, rid, ttft_target_s=ttft_target_s),
               arrival_s)
    try:
        with _refusals(client):
            return run, await run.next()
    except ApiError:
        raise
    except BaseException:  # the client went away, or the server cancelled the request while it waited
        run.end(None)
        raise


@contextlib.contextmanager
def _refusals(client):
    """The engine's refusals of a request before anything is queued, as the HTTP errors they are."""
    try:
        yield
    except QueueFull:
        raise _queue_full(client) from None
    except ValueError as e:  # the engine's own check of the parameters or the prompt
        raise ApiError(400, str(e)) from None
    except EngineDead as e:
        raise _unavailable(client) or ApiError(503, str(e), type="server_error", outcome="unavailable") from None


def _queue_full(client) -> ApiError:
    return ApiError(429, "the queue of waiting requests is full: retry later", type="rate_limit_exceeded",
                    code="queue_full", outcome="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})


async def _whole(run: _Run, first, shape, model: str) -> Response:
    parts, event = [], first
    try:
        while isinstance(event, TokenEvent):
            parts.append(event.text)
            event = await run.next()
    except ClientGone:
        run.end(None)
        return Response(status_code=499)
    except BaseException:
        run.end(None)
        raise
    run.end(event)
    if event.finish_reason in ("cancelled", "error"):
        e = _failure(event, run.client)
        return JSONResponse(p.error_body(e.message, e.type, e.param, e.code), status_code=e.status)
    return JSONResponse(shape.response(run.rid, model, "".join(parts), event).model_dump(mode="json"))


async def _stream(run: _Run, first, shape, model: str, stream_options: p.StreamOptions | None,
                  n_prompt: int) -> AsyncIterator[str]:
    """Server-sent events: one chunk per token with text, the last chunk with the finish reason and the figures,
    then, where ``stream_options.include_usage`` asks, a chunk of no choices carrying the usage (OpenAI's: the usage
    on that final chunk only), then ``data: [DONE]``. ``continuous_usage_stats`` (vLLM's) puts the usage so far on
    every chunk. A failure mid-stream is an error event (the status is already sent)."""
    event, sent, tokens = first, False, 0
    continuous = bool(stream_options and stream_options.continuous_usage_stats)
    try:
        while isinstance(event, TokenEvent):
            tokens += 1
            if event.text:
                usage = p.Usage(prompt_tokens=n_prompt, completion_tokens=tokens, total_tokens=n_prompt + tokens)
                yield _sse(shape.chunk(run.rid, model, event.text, first=not sent, usage=usage if continuous else None))
                sent = True
            event = await run.next()
        run.end(event)
        if event.finish_reason in ("cancelled", "error"):
            e = _failure(event, run.client)
            yield _sse(p.error_body(e.message, e.type, e.param, e.code))
        else:
            yield _sse(shape.last(run.rid, model, event, usage=_usage(event) if continuous else None))
            if stream_options and stream_options.include_usage:
                yield _sse(shape.usage_chunk(run.rid, model, event))
        yield "data: [DONE]\n\n"
    except ClientGone:
        pass
    finally:  # also when the server closes this generator because the client went away while a chunk was sent
        run.end(None)


# --- the routes --------------------------------------------------------------------------------------------------

async def _body(request: Request, limit: int) -> bytes:
    """The request's JSON body, refused before it is read whole where it is over ``limit`` bytes (413) or not JSON
    by its Content-Type (415)."""
    kind = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if kind != "application/json":
        raise ApiError(415, f"the body must be JSON (Content-Type: application/json), not {kind!r}",
                       code="unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the body is {int(declared)} bytes; this server takes at most {limit} "
                       "(--max-request-bytes)", code="request_too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise ApiError(413, f"the body is over {limit} bytes (--max-request-bytes)", code="request_too_large")
    return bytes(body)


async def _parse(request: Request, model: type[BaseModel], limit: int) -> BaseModel:
    body = await _body(request, limit)
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        message, param = p.describe_validation(e.errors(include_url=False))
        raise ApiError(400, message, param=param) from None


async def _serve(client, metrics: Metrics, request: Request, req, ids: list[int], max_tokens: int | None,
                 shape, rid: str, arrival_s: float) -> Response:
    inputs.check_token_ids(client.tokenizer, req)
    params = inputs.sampling(req, len(ids), max_tokens, client.max_model_len)
    if (refusal := _unavailable(client)) is not None:
        raise refusal
    try:
        run, first = await _admit(client, metrics, request, ids, params, rid, arrival_s, req.ttft_target_s)
    except ClientGone:
        return Response(status_code=499)
    if req.stream:
        return StreamingResponse(_stream(run, first, shape, req.model, req.stream_options, len(ids)),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await _whole(run, first, shape, req.model)


def _check_model(client, name: str) -> None:
    if name != client.model_id:  # 404, as OpenAI and vLLM answer a model they do not serve
        raise ApiError(404, f"unknown model {name!r}: this server serves {client.model_id!r} (GET /v1/models)",
                       param="model", code="model_not_found")


DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024


def build_app(client, metrics: Metrics | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The OpenAI-compatible app over ``client`` (an ``AsyncEngineClient`` or anything with its interface); request
    bodies over ``max_request_bytes`` are refused (413) before they are read whole or tokenised."""
    metrics = metrics or Metrics()  # its queue gauges are the caller's to track (the app never sees the engine)
    app = FastAPI(title="kvr-serve", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        metrics.refused(e.outcome)
        return JSONResponse(p.error_body(e.message, e.type, e.param, e.code), status_code=e.status,
                            headers=e.headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival_s = time.monotonic()
        req = await _parse(request, p.CompletionRequest, max_request_bytes)
        _check_model(client, req.model)
        ids = await run_in_threadpool(inputs.token_ids, client.tokenizer, req.prompt)
        return await _serve(client, metrics, request, req, ids, req.max_tokens, _Completions(), new_request_id(),
                            arrival_s)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        arrival_s = time.monotonic()
        req = await _parse(request, p.ChatCompletionRequest, max_request_bytes)
        _check_model(client, req.model)
        ids = await run_in_threadpool(inputs.chat_ids, client.tokenizer, req.messages)
        rid = "chat" + new_request_id()
        return await _serve(client, metrics, request, req, ids, req.asked_max_tokens, _Chat(), rid, arrival_s)

    @app.post("/v1/ask")
    async def ask(request: Request) -> Response:
        req = await _parse(request, p.AskRequest, max_request_bytes)
        _check_model(client, req.model)
        context_ids, question_ids = await run_in_threadpool(question_prompts, client.tokenizer, req.context,
                                                            req.questions, req.chat)
        rid = new_request_id()
        with _refusals(client):
            done = await client.ask(context_ids, question_ids, req.max_tokens, rid)
        if done.error is not None:
            raise _failure(done, client)
        response = p.AskResponse.build(rid, client.model_id, req.questions, done, client.eos_token_ids, client.decode,
                                       len(context_ids) + sum(map(len, question_ids)))
        metrics.asked(len(response.answers), response.usage.prompt_tokens, response.usage.completion_tokens)
        return JSONResponse(response.model_dump(mode="json"))

    @app.get("/v1/models")
    async def models() -> dict:
        card = p.ModelCard(id=client.model_id, max_model_len=client.max_model_len)
        return p.ModelList(data=[card]).model_dump(mode="json")

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/health")
    async def health() -> JSONResponse:
        refusal = _unavailable(client)
        if refusal is not None:
            return JSONResponse({"status": refusal.code}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return app
