"""No request ends the server: ``kvr-serve`` as a user starts it takes a few hundred random requests (prompts of 1
to 64 tokens and a few long ones, as token ids and as text, single and in lists; ``n`` 1 to 4, temperature 0 and
1, log-probabilities, echo, stop strings, streams; a few hostile bodies) under the layouts that once planned a
prompt over more ranks than it had tokens for: ``--learn`` on a fresh file, and restarted on a learned file that
favours the chain for every short bucket and holds timings that cannot serve; ``--learn off``; ``--degree 1``, the
world size and ``auto``; 2 and 3 ranks; ``--step-budget-ms``. Every response is a 200 or a 4xx naming the problem,
every greedy text equals what one process generates, and the server is alive at the end (``/health``).

Bounded: each server takes 40 to 80 requests, 4 at a time, every request under a time limit, every process killed
at the end. Loopback only."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.helpers import greedy_text
from tests.test_serve_cli import serving

pytestmark = pytest.mark.timeout(900)

DATA = Path(__file__).parent / "data"
ISSUE_REQUEST = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 1.0, "n": 1}
WORDS = ("the", "capital", "of", "France", "is", "a", "city", "river", "where", "why", "quick", "brown", "fox",
         "jumps", "over", "lazy", "dog", ".", ",", "?", "\n", "Paris", "42", "é", "日本")


def _hostile(model: str, rng: random.Random, vocab: int) -> dict:
    return rng.choice([
        {"model": model, "prompt": ""},
        {"model": model, "prompt": [], "max_tokens": 2},
        {"model": model, "prompt": [vocab + 5], "max_tokens": 2},
        {"model": model, "prompt": [-1, 3], "max_tokens": 2},
        {"model": model, "prompt": [3] * 200_000, "max_tokens": 2},
        {"model": model, "prompt": "x", "max_tokens": 0},
        {"model": model, "prompt": "x", "n": 17},
        {"model": model, "prompt": "x", "temperature": -1},
        {"model": model, "prompt": "x", "logprobs": 99},
        {"model": "no-such-model", "prompt": "x"},
        {"model": model, "prompt": "x", "max_tokens": 10_000_000},
    ])


FUZZ_CASES = 18  # per server: every long length of a call comes once (the long prompt is case 5, then every 12th)


def _cases(model: str, rng: random.Random, count: int, vocab: int, long_tokens: tuple[int, ...]) -> list[dict]:
    """Request bodies, each with what the test expects: ``want`` a 200 (a greedy one with the text each choice
    must have, or a prefix it must keep under a stop string) or a 4xx."""
    cases = []
    for i in range(count):
        if rng.random() < 0.1:
            cases.append({"body": _hostile(model, rng, vocab), "want": "4xx"})
            continue
        n = long_tokens[i % len(long_tokens)] if long_tokens and i % 12 == 5 else rng.randint(1, 64)
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        k = rng.randint(1, 8)
        greedy = rng.random() < 0.6
        body = {"model": model, "max_tokens": k, "temperature": 0.0 if greedy else 1.0, "ignore_eos": True,
                "n": rng.choice([1, 1, 2, 3, 4]), "seed": i}
        if rng.random() < 0.25:
            body["logprobs"] = rng.choice([0, 2])
        if rng.random() < 0.15:
            body["echo"] = True
        if rng.random() < 0.15:
            body["stream"] = True
        case = {"body": body, "want": 200}
        shape = rng.random()
        if shape < 0.6:  # token ids: one process's greedy text is known exactly
            body["prompt"] = ids
            if greedy and not body.get("echo"):
                case["text"] = greedy_text(model, ids, k)
                stop = case["text"][1:3]
                if rng.random() < 0.2 and len(stop) == 2 and stop.isascii() and stop.isprintable():
                    body["stop"] = [stop]
                    case["text"], case["stopped_at"] = None, case["text"][:case["text"].find(stop)]
        elif shape < 0.8:
            body["prompt"] = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 24)))
        else:  # a list of prompts, one choice each per n
            body["prompt"] = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))]
                              for _ in range(rng.randint(2, 3))]
        cases.append(case)
    return cases


def _send(http: httpx.Client, url: str, case: dict) -> tuple[int, dict]:
    body = case["body"]
    if not body.get("stream"):
        r = http.post(f"{url}/v1/completions", json=body)
        return r.status_code, r.json()
    texts: dict[int, str] = {}
    with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.json()
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    if "error" in events[-1]:
        return 500, events[-1]
    for event in events:
        for c in event["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    return 200, {"choices": [{"index": i, "text": t} for i, t in sorted(texts.items())]}


def _check(case: dict, status: int, reply: dict) -> str | None:
    """What is wrong with a reply, or None."""
    body = case["body"]
    if case["want"] == "4xx":
        if not (400 <= status < 500 and reply.get("error", {}).get("message")):
            return f"want a named 4xx, got {status}: {reply}"
        return None
    if status != 200:
        return f"want 200, got {status}: {reply}"
    prompts = body["prompt"] if isinstance(body["prompt"], list) and isinstance(body["prompt"][0], list) else [0]
    choices = reply["choices"]
    if len(choices) != body["n"] * len(prompts):
        return f"{len(choices)} choices for n = {body['n']} and {len(prompts)} prompt(s)"
    for c in choices:
        if case.get("text") is not None and c["text"] != case["text"]:
            return f"greedy text {c['text']!r}, one process's {case['text']!r}"
        if "stopped_at" in case and not (case["stopped_at"] == c["text"] and body["stop"][0] not in c["text"]):
            return f"under stop {body['stop']}: {c['text']!r}, want {case['stopped_at']!r}"
    return None


def _fuzz(url: str, model: str, cases: list[dict]) -> list[str]:
    """Every case, 4 at a time; what went wrong, a line each."""
    with httpx.Client(timeout=180) as http, ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda case: _send(http, url, case), cases))
        wrong = [f"{json.dumps(case['body'])[:300]}: {why}" for case, (status, reply) in zip(cases, replies)
                 if (why := _check(case, status, reply))]
        health = http.get(f"{url}/health")
    if health.status_code != 200:
        wrong.append(f"/health {health.status_code}: {health.text}")
    return wrong


def _issue_request_four_times(url: str, model: str) -> list[str]:
    """The request that ended the server, four times in a row (a fresh file explores, then chains, then dies at the
    fourth), then twice at n = 2 greedy."""
    wrong = []
    with httpx.Client(timeout=180) as http:
        for body in [ISSUE_REQUEST] * 4 + [{**ISSUE_REQUEST, "n": 2, "temperature": 0}] * 2:
            r = http.post(f"{url}/v1/completions", json={**body, "model": model})
            if r.status_code != 200 or len(r.json()["choices"]) != body["n"]:
                wrong.append(f"the issue's request: {r.status_code} {r.text[:300]}")
    return wrong


def _favour_the_chain(path: Path, p: int) -> int:
    """Rewrite a learned file the server wrote (its own key kept): every bucket of 2 to 64 tokens timed 3 times on
    one rank and 3 times over the chain, the chain 10x cheaper and its ranks' rates a little apart both ways (rates
    far apart would move the partition so far that the prior itself rules the chain out); the shipped file of the
    short prompt that ended a server merged in; and timings that cannot serve. How many of those."""
    from kvrunahead.serve.learning import bucket_of

    data = json.loads(path.read_text())
    buckets: dict[str, dict[str, list]] = {}
    for t in range(p, 65):
        per = buckets.setdefault(str(bucket_of(t)), {"1": [], str(p): []})
        if per["1"]:
            continue
        cuts = [round(r * t / p) for r in range(p + 1)]
        for k in range(3):
            per["1"].append([t, 1.0, 10.0, [0, t], []])
            busy = [0.05 * (1 + 0.3 * ((r + k) % 2)) for r in range(p)]
            per[str(p)].append([t, 0.1, 1.0, cuts, busy])
    shipped = json.loads((DATA / "learned-short-prompt.json").read_text())["buckets"]
    if p == 2:
        for edge, per in shipped.items():
            for d, rows in per.items():
                buckets.setdefault(edge, {}).setdefault(d, []).extend(rows)
    junk = [[5, 0.2, 30.0, [0, -3, 5], [0.1, 0.1]], [5, float("nan"), 1.0, [0, 5], []], [5, 0.2, 1.0, [0, 9], []]]
    buckets["5"].setdefault(str(p), []).extend(junk)
    data["buckets"] = buckets
    path.write_text(json.dumps(data))
    return len(junk)


def _learned_once(args: tuple[str, ...], model: str, nproc: int, env: dict | None = None) -> None:
    """A server that answers one prompt (whose timing it saves under its own key), then is killed."""
    with serving(*args, model=model, nproc=nproc, env=env) as server:
        url = server.url(timeout_s=300)
        r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": list(range(10, 50)),
                                                       "max_tokens": 1}, timeout=120)
        assert r.status_code == 200, r.text


def test_smollm2_on_a_fresh_learned_file_then_restarted_on_a_poisoned_one_never_ends(tmp_path):
    """The issue's own setting: SmolLM2-135M over 2 ranks with the defaults, ``--learn`` a fresh file: the request
    that ended the server four times, then random ones; restarted on that file rewritten to favour the chain for
    every short bucket (the shipped file that ended a server merged in, timings that cannot serve added), it logs
    what it ignored and serves again."""
    model, learned = "smollm2-135m", tmp_path / "learned.json"
    rng = random.Random(67)
    wrong = []
    with serving("--learn", str(learned), model=model) as server:
        url = server.url(timeout_s=300)
        wrong += _issue_request_four_times(url, model)
        wrong += _fuzz(url, model, _cases(model, rng, FUZZ_CASES, 49152, (700, 1500)))
        assert not wrong, "\n".join(wrong)
        log = "".join(server.lines)
    assert "engine step failed" not in log and learned.exists(), log
    ignored = _favour_the_chain(learned, 2)
    before = _chain_timings(learned, 2)
    with serving("--learn", str(learned), model=model) as server:
        url = server.url(timeout_s=300)
        wrong += _issue_request_four_times(url, model)
        wrong += _fuzz(url, model, _cases(model, rng, FUZZ_CASES, 49152, (900,)))
        log = "".join(server.lines)
        assert server.proc.poll() is None, log
    assert not wrong, "\n".join(wrong)
    assert f"ignored {ignored} learned timing(s) that cannot serve" in log and "[0, -3, 5]" in log, log
    assert "another setting" not in log and "engine step failed" not in log, log
    assert _chain_timings(learned, 2) > before, "no short prompt was served over the chain after the restart"


def _chain_timings(path: Path, p: int) -> int:
    """The timings over the chain of p ranks a learned file holds for prompts of at most 64 tokens (those that
    cannot serve left out)."""
    from kvrunahead.serve.learning import timing_of

    count = 0
    for edge, per in json.loads(path.read_text())["buckets"].items():
        for row in per.get(str(p), []) if int(edge) <= 64 else []:
            try:
                timing_of(edge, p, row, {1, p})
                count += 1
            except (ValueError, TypeError, IndexError):
                pass
    return count


SERVERS = {  # name: (kvr-serve's flags, ranks, whether its learned file is seeded to favour the chain first)
    "3 ranks, the chain forced, learning off": (("--degree", "3", "--learn", "off"), 3, False),
    # the tiny model's prior rules its chain out below a few thousand tokens (10x one rank's price at 40 tokens), so
    # the learned choice of degree is fuzzed on SmolLM2 above; here the learned partitions of a seeded file are
    "3 ranks, the chain forced, learned file favouring the chain": (("--degree", "3"), 3, True),
    "2 ranks, the chain forced, chunked at 100 ms": (("--degree", "2", "--step-budget-ms", "100"), 2, True),
    "2 ranks, one rank forced": (("--degree", "1", "--learn", "off"), 2, False),
}


@pytest.mark.parametrize("name", list(SERVERS))
def test_random_requests_never_end_the_tiny_server(name, tmp_path):
    """tiny-llama under each of SERVERS, ``--learn auto`` in a cache folder of the test's own (seeded where it
    says: a server answers one prompt, then its file is rewritten to favour the chain for every short bucket)."""
    from kvrunahead.model.load import ByteTokenizer

    args, nproc, seeded = SERVERS[name]
    model, env = "tiny-llama", {"KVR_CACHE": str(tmp_path / "cache")}
    if seeded:
        _learned_once(args, model, nproc, env)
        (learned,) = (tmp_path / "cache" / "learned").glob("*.json")
        _favour_the_chain(learned, nproc)
        before = _chain_timings(learned, nproc)
    rng = random.Random(sum(map(ord, name)))
    with serving(*args, model=model, nproc=nproc, env=env) as server:
        url = server.url()
        wrong = _fuzz(url, model, _cases(model, rng, FUZZ_CASES, ByteTokenizer.VOCAB_SIZE, (600, 2000)))
        log = "".join(server.lines)
        assert server.proc.poll() is None, log
    assert not wrong, "\n".join(wrong) + "\n" + log[-3000:]
    assert "engine step failed" not in log, log
    if seeded:
        assert "ignored 3 learned timing(s) that cannot serve" in log, log
        assert _chain_timings(learned, nproc) > before, "no short prompt was served over the chain"
