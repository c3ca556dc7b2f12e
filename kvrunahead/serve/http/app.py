"""The HTTP layer: a thin FastAPI app over an ``AsyncEngineClient`` (it knows nothing of ranks).

POST /v1/completions (the raw prompt, as ``kvr-prefill --no-chat``), POST /v1/chat/completions (the model's chat
template), POST /v1/ask, POST /tokenize and /detokenize, GET /v1/models, GET /version, GET /health, GET /metrics.
Errors are OpenAI's body with the status a client of vLLM or SGLang expects: 400 for bad input, 404 for a model it
does not serve, 413 for a body over ``--max-request-bytes``, 415 for one that is not JSON, 429 with Retry-After
when the queue is full, 503 while draining or once the engine is dead, 500 when the engine failed a request, 401
without the server's ``--api-key``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from kvrunahead.prompt import question_prompts
from kvrunahead.serve.http import inputs, streams
from kvrunahead.serve.http import protocol as p
from kvrunahead.serve.http import responses as r
from kvrunahead.serve.http.ask_shapes import AskRequest, AskResponse
from kvrunahead.serve.http.auth import ApiKeyMiddleware
from kvrunahead.serve.http.inputs import ApiError
from kvrunahead.serve.http.metrics import Metrics
from kvrunahead.serve.sequence import new_request_id
from kvrunahead.version import __version__

log = logging.getLogger(__name__)

# --- the routes --------------------------------------------------------------------------------------------------

async def _body(request: Request, limit: int) -> bytes:
    """The request's JSON body, refused where it is over ``limit`` bytes (413, before it is kept whole) or not JSON
    by its Content-Type (415). A body refused for its size is still read to its end (and dropped, up to
    ``DRAIN_BYTES`` for ``DRAIN_S``), so that a client still sending reads the 413 rather than a reset connection."""
    kind = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if kind != "application/json":
        raise ApiError(415, f"the body must be JSON (Content-Type: application/json), not {kind!r}",
                       code="unsupported_media_type")
    stream = request.stream()
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
        await _drain(stream)
        raise ApiError(413, f"the body is {int(declared)} bytes; this server takes at most {limit} "
                       "(--max-request-bytes)", code="request_too_large")
    body = bytearray()
    try:
        async for part in stream:
            body += part
            if len(body) > limit:
                await _drain(stream)
                raise ApiError(413, f"the body is over {limit} bytes (--max-request-bytes)", code="request_too_large")
    except ClientDisconnect:  # gone before its body was whole: nobody reads the answer; no fault is logged
        raise ApiError(400, "the client went away before its body was whole", code="client_disconnected") from None
    return bytes(body)


DRAIN_BYTES = 64 * 1024 * 1024
DRAIN_S = 10.0


async def _drain(stream) -> None:
    """Read and drop the rest of a refused body, at most ``DRAIN_BYTES`` for ``DRAIN_S``."""
    async def drop() -> None:
        seen = 0
        async for part in stream:
            seen += len(part)
            if seen > DRAIN_BYTES:
                return

    with contextlib.suppress(ClientDisconnect, TimeoutError):
        await asyncio.wait_for(drop(), DRAIN_S)


async def _parse(request: Request, model: type[BaseModel], limit: int) -> BaseModel:
    body = await _body(request, limit)
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        message, param = p.describe_validation(e.errors(include_url=False))
        raise ApiError(400, message, param=param) from None


async def _serve(client, metrics: Metrics, request: Request, req, prompts: list[list[int]], max_tokens: int | None,
                 shape, rid: str, arrival_s: float, echoes: list[str] | None = None) -> Response:
    inputs.check_token_ids(client.tokenizer, req)
    params = [inputs.sampling(req, len(ids), max_tokens, client.max_model_len) for ids in prompts]
    if (refusal := streams.unavailable(client)) is not None:
        raise refusal
    n, echoes = req.n or 1, echoes or [""] * len(prompts)
    try:
        runs = await streams.admit_all(client, metrics, request, prompts, params, rid, arrival_s, req.ttft_target_s, n)
    except streams.ClientGone:
        return Response(status_code=499)
    choices = [r.Choice(i, prompts[i // n], echoes[i // n]) for i in range(len(runs))]
    if req.stream:
        return StreamingResponse(streams.stream(runs, choices, shape, req.model, rid, req.stream_options),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await streams.whole(runs, choices, shape, req.model, rid)


def _token_text(client):
    """One token's text, as a response's log-probabilities name it."""
    return lambda token: client.decode([token])


def _check_model(client, name: str) -> None:
    if name != client.model_id:  # 404, as OpenAI and vLLM answer a model they do not serve
        raise ApiError(404, f"unknown model {name!r}: this server serves {client.model_id!r} (GET /v1/models)",
                       param="model", code="model_not_found")


def _tokenizer_routes(app: FastAPI, client, max_request_bytes: int) -> None:
    """vLLM's ``POST /tokenize`` (a prompt as /v1/completions tokenises it, or chat messages through the template)
    and ``POST /detokenize``."""

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        req = await _parse(request, p.TokenizeRequest, max_request_bytes)
        if req.model is not None:
            _check_model(client, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give either prompt or messages", param="prompt")
        if req.messages is not None:
            ids = await run_in_threadpool(inputs.chat_ids, client.tokenizer, req.messages, req.add_generation_prompt)
        else:
            ids = await run_in_threadpool(inputs.plain_ids, client.tokenizer, req.prompt, req.add_special_tokens)
        return {"count": len(ids), "max_model_len": client.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req = await _parse(request, p.DetokenizeRequest, max_request_bytes)
        if req.model is not None:
            _check_model(client, req.model)
        inputs.token_ids(client.tokenizer, req.tokens, param="tokens")  # in the vocabulary
        return {"prompt": client.decode(req.tokens)}


def _probe_routes(app: FastAPI, client, metrics: Metrics) -> None:
    """What monitors read, open without the API key: ``/version``, ``/health`` and ``/metrics``."""

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/health")
    async def health() -> JSONResponse:
        """What a load balancer reads: 200 ``ok`` while prompts are served, 200 ``degraded`` while a lost worker is
        brought back within the front's patience, 503 once prompts are refused (the engine dead, draining, the
        workers not back) or while a step has run past ``--timeout``."""
        recovery = client.recovery()
        refusal = streams.unavailable(client)
        if refusal is not None:
            return JSONResponse({"status": refusal.code, "message": refusal.message, **recovery}, status_code=503)
        if (stuck := client.stuck()) is not None:
            return JSONResponse({"status": "engine_stuck", "message": stuck, **recovery}, status_code=503)
        # a lost worker: still serving (its decodes go on, prefills wait for the workers), said with which rank
        return JSONResponse({"status": "degraded" if "degraded" in recovery else "ok", **recovery})

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)


DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024


def build_app(client, metrics: Metrics | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              api_key: str | None = None) -> FastAPI:
    """The OpenAI-compatible app over ``client`` (an ``AsyncEngineClient`` or anything with its interface); request
    bodies over ``max_request_bytes`` are refused (413) before they are read whole or tokenised; with ``api_key``,
    a request without it is refused (401, serve/http/auth.py)."""
    metrics = metrics or Metrics()  # its queue gauges are the caller's to track (the app never sees the engine)
    app = FastAPI(title="kvr-serve", docs_url=None, redoc_url=None)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, on_refused=lambda: metrics.refused("unauthorized"))

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
        prompts = [await run_in_threadpool(inputs.token_ids, client.tokenizer, one) for one in req.prompts]
        echoes = [one if isinstance(one, str) else client.decode(one) for one in req.prompts] if req.echo else None
        shape = r.Completions(_token_text(client), req.logprobs is not None)
        return await _serve(client, metrics, request, req, prompts, req.max_tokens, shape, new_request_id(),
                            arrival_s, echoes)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        arrival_s = time.monotonic()
        req = await _parse(request, p.ChatCompletionRequest, max_request_bytes)
        _check_model(client, req.model)
        ids = await run_in_threadpool(inputs.chat_ids, client.tokenizer, req.messages)
        shape = r.Chat(_token_text(client), req.logprobs, req.top_logprobs or 0)
        return await _serve(client, metrics, request, req, [ids], req.asked_max_tokens, shape,
                            "chat" + new_request_id(), arrival_s)

    @app.post("/v1/ask")
    async def ask(request: Request) -> Response:
        req = await _parse(request, AskRequest, max_request_bytes)
        _check_model(client, req.model)
        context_ids, question_ids = await run_in_threadpool(question_prompts, client.tokenizer, req.context,
                                                            req.questions, req.chat)
        rid = new_request_id()
        with streams.refusals(client):
            done = await client.ask(context_ids, question_ids, req.max_tokens, rid)
        if done.error is not None:
            raise streams.failure(done, client)
        response = AskResponse.build(rid, client.model_id, req.questions, done, client.eos_token_ids, client.decode,
                                       len(context_ids) + sum(map(len, question_ids)))
        metrics.asked(len(response.answers), response.usage.prompt_tokens, response.usage.completion_tokens)
        return JSONResponse(response.model_dump(mode="json"))

    @app.get("/v1/models")
    async def models() -> dict:
        card = p.ModelCard(id=client.model_id, max_model_len=client.max_model_len)
        return p.ModelList(data=[card]).model_dump(mode="json")

    _tokenizer_routes(app, client, max_request_bytes)

    _probe_routes(app, client, metrics)

    return app
