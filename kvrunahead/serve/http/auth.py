"""Who may call: ``--api-key`` as vLLM checks it, a Bearer token compared in constant time.

The OpenAI routes (``/v1/...``) and the tokenizer's (``/tokenize``, ``/detokenize``) need the key; ``/health``,
``/metrics`` and ``/version`` stay open, as vLLM leaves them (a load balancer's probe and a Prometheus scrape carry
no key). A missing or wrong key is a 401 in OpenAI's error shape, which the ``openai`` client raises as
``AuthenticationError``. A pure ASGI middleware: it never buffers a streamed response.
"""

from __future__ import annotations

import hmac
import json

from kvrunahead.serve.http import protocol as p

OPEN = ("/health", "/metrics", "/version")


def guarded(path: str) -> bool:
    return not (path in OPEN or path.startswith(tuple(o + "/" for o in OPEN)))


def bearer_matches(header: bytes | None, key: bytes) -> bool:
    """Whether ``Authorization`` is ``Bearer <key>``; the comparison takes the same time wherever it differs."""
    expected = b"Bearer " + key
    return hmac.compare_digest(header or b"", expected)


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str, on_refused=None) -> None:
        self.app, self.key, self.on_refused = app, api_key.encode(), on_refused

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or not guarded(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or ()).get(b"authorization")
        if bearer_matches(header, self.key):
            await self.app(scope, receive, send)
            return
        if self.on_refused is not None:
            self.on_refused()
        why = "no API key given" if header is None else "the API key given is not this server's"
        body = json.dumps(p.error_body(f"{why}: send 'Authorization: Bearer <key>' with the key kvr-serve was "
                                       "started with (--api-key or KVR_API_KEY)", "invalid_request_error",
                                       None, "invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
