"""A soak of ``kvr-serve``: mixed ShareGPT load near capacity for a long time, with cancels, disconnects and
hostile inputs among the requests, and the server's resources watched throughout.

Every ``sample_s`` each rank's resident memory, open file descriptors and threads, and the entries of /dev/shm,
are written as a row; every request as a row of its own (what it was, its status, its TTFT). Rows are appended as
they come (a cut-short soak keeps what it measured). ``checks`` grades a run: resident memory of every rank grows
at most 5% from the end of the first sixth to the end; no 5xx; file descriptors and /dev/shm flat over the same
span; TTFT p99 of the last sixth within 1.2x of the first sixth's (for 30 minutes: minute 5 to 30, the first and
last 5 minutes); once the load has ended, no K,V block of the front's pool held by a request (the pool's use is
sampled with the rest). ``plot`` draws the rows.
"""

from __future__ import annotations

import json
import random
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from kvrunahead.ranks.fork import RANK_NAME

KINDS = ("chat", "stream", "ids", "cancel", "disconnect", "hostile")
WEIGHTS = (0.3, 0.3, 0.1, 0.1, 0.1, 0.1)


@dataclass(frozen=True)
class Profile:
    minutes: float
    clients: int = 4  # concurrent clients, each sending its next request as soon as one ends (near capacity)
    sample_s: float = 10.0
    max_tokens: int = 96  # a reply's length: ShareGPT's answer's, capped here
    max_prompt_tokens: int = 1024
    seed: int = 0


FULL = Profile(30.0)
SHORT = Profile(1.0, clients=3, sample_s=2.0, max_tokens=24, max_prompt_tokens=256)


def sharegpt_prompts(count: int, max_tokens: int) -> list[tuple[str, int]]:
    """ShareGPT's first human turns (up to ``max_tokens``, estimated) and their answers' lengths, ``count`` of
    them."""
    from kvrunahead.bench.serve_bench import conversations, open_sharegpt, read_json_records

    with open_sharegpt() as f:
        records = read_json_records(f, limit=count * 3).items
    return [(c.prompt, c.reply_tokens or 64) for c in conversations(records, max_prompt_tokens=max_tokens)][:count]


def hostile_bodies(model: str) -> list[tuple[str, dict | bytes]]:
    """Requests the server must refuse with a 4xx and survive: (path, body)."""
    return [
        ("/v1/completions", {"model": "no-such-model", "prompt": "hi", "max_tokens": 4}),
        ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": -3}),
        ("/v1/completions", {"model": model, "prompt": [10 ** 9], "max_tokens": 4}),
        ("/v1/completions", {"model": model, "prompt": "hi", "temperature": -1}),
        ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 10 ** 9}),
        ("/v1/completions", {"model": model, "prompt": "", "max_tokens": 4}),
        ("/v1/completions", {"model": model, "prompt": "hi", "logprobs": 10 ** 4}),
        ("/v1/chat/completions", {"model": model, "messages": "not a list"}),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user"}]}),
        ("/v1/completions", b"{not json"),
        ("/v1/completions", b"\xff\xfe\x00garbage"),
    ]


class Load:
    """``clients`` threads sending the mix until ``stop``; each request's row goes to ``write``."""

    def __init__(self, url: str, model: str, prompts: list[tuple[str, int]], profile: Profile,
                 write: Callable[[dict], None], t0: float) -> None:
        self.url, self.model, self.prompts, self.profile, self.write, self.t0 = url, model, prompts, profile, write, t0
        self.stop = threading.Event()
        self.hostile = hostile_bodies(model)
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(profile.clients)]
        # a model without a chat template (the synthetic presets) is sent its prompts as completions
        probe = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
            "model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
        self.chat = probe.status_code == 200

    def _body(self, text: str, **fields) -> tuple[str, dict]:
        """The path and body asking for ``text``'s answer: chat where the model has a template."""
        if self.chat:
            return "/v1/chat/completions", {"model": self.model, "messages": [{"role": "user", "content": text}],
                                            **fields}
        return "/v1/completions", {"model": self.model, "prompt": text, **fields}

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def _client(self, index: int) -> None:
        rng = random.Random(self.profile.seed * 1000 + index)
        with httpx.Client(base_url=self.url, timeout=300) as http:
            while not self.stop.is_set():
                kind = rng.choices(KINDS, WEIGHTS)[0]
                row = {"kind": "request", "type": kind, "client": index, "t_s": round(time.monotonic() - self.t0, 3)}
                start = time.monotonic()
                try:
                    row.update(getattr(self, f"_{kind}")(http, rng))
                except Exception as e:  # noqa: BLE001 - a transport error, or one in this client: a row, not a stop
                    row.update(status=None, error=f"{type(e).__name__}: {e}")
                row["e2e_s"] = round(time.monotonic() - start, 4)
                self.write(row)

    def _prompt(self, rng: random.Random) -> tuple[str, int]:
        text, reply = rng.choice(self.prompts)
        return text, max(1, min(reply, self.profile.max_tokens))

    def _streamed(self, http: httpx.Client, path: str, body: dict, read_chunks: int | None = None) -> dict:
        """A streamed request: its status, TTFT (the first chunk with text) and chunks; ``read_chunks``: close
        the stream after that many (a client that cancels)."""
        start, ttft, chunks, error = time.monotonic(), None, 0, None
        with http.stream("POST", path, json={**body, "stream": True}) as r:
            if r.status_code != 200:
                r.read()
                return {"status": r.status_code, "error": r.text[:200]}
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"].get("message", "")[:200]
                    break
                choice = (event.get("choices") or [{}])[0]
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    chunks += 1
                    ttft = ttft if ttft is not None else time.monotonic() - start
                if read_chunks is not None and chunks >= read_chunks:
                    break  # leaving the block closes the connection: the server cancels the request
        out = {"status": 200, "ttft_s": None if ttft is None else round(ttft, 4), "chunks": chunks}
        if error is not None:
            out.update(status=500, error=error)
        return out

    def _chat(self, http: httpx.Client, rng: random.Random) -> dict:
        text, k = self._prompt(rng)
        path, body = self._body(text, max_tokens=k, temperature=0)
        r = http.post(path, json=body)
        body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
        out = {"status": r.status_code, "tokens": (body.get("usage") or {}).get("completion_tokens")}
        if r.status_code == 200:  # the server's own TTFT (a client waiting for the whole answer sees no first token)
            out["server_ttft_s"] = (body.get("kvrunahead") or {}).get("ttft_s")
        return out

    def _stream(self, http: httpx.Client, rng: random.Random) -> dict:
        text, k = self._prompt(rng)
        return self._streamed(http, *self._body(text, max_tokens=k, temperature=0.7, seed=rng.randrange(1 << 30)))

    def _ids(self, http: httpx.Client, rng: random.Random) -> dict:
        ids = [rng.randrange(4, 500) for _ in range(rng.randrange(8, 200))]  # in every model's vocabulary here
        r = http.post("/v1/completions", json={"model": self.model, "prompt": ids, "n": 2, "logprobs": 2,
                                               "max_tokens": rng.randrange(1, self.profile.max_tokens)})
        return {"status": r.status_code}

    def _cancel(self, http: httpx.Client, rng: random.Random) -> dict:
        text, _ = self._prompt(rng)
        return self._streamed(http, *self._body(text, max_tokens=400), read_chunks=rng.randrange(1, 4))

    def _disconnect(self, http: httpx.Client, rng: random.Random) -> dict:
        """A raw request whose client goes away before the answer (mid-body or right after sending it)."""
        text, _ = self._prompt(rng)
        body = json.dumps({"model": self.model, "prompt": text, "max_tokens": 200}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(head + (body if rng.random() < 0.5 else body[:len(body) // 2]))
            time.sleep(rng.random() * 0.5)
        return {"status": None}

    def _hostile(self, http: httpx.Client, rng: random.Random) -> dict:
        path, body = rng.choice(self.hostile)
        r = (http.post(path, content=body, headers={"Content-Type": "application/json"}) if isinstance(body, bytes)
             else http.post(path, json=body))
        return {"status": r.status_code, "case": self.hostile.index((path, body))}


def rank_pids(launcher_pid: int) -> dict[int, int]:
    """pid by rank of the ranks a ``kvr-serve --nproc`` launcher started: a forked rank by its process name
    (ranks/fork.py), a started one by the ``RANK`` of its environment."""
    out = {}
    for d in Path("/proc").iterdir():
        try:
            if not d.name.isdigit():
                continue
            stat = (d / "stat").read_text()
            if int(stat.rpartition(")")[2].split()[1]) != launcher_pid:
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            if name.startswith(RANK_NAME):
                out[int(name[len(RANK_NAME):])] = int(d.name)
            else:
                env = dict(kv.split("=", 1) for kv in (d / "environ").read_text().split("\0") if "=" in kv)
                out[int(env["RANK"])] = int(d.name)
        except (OSError, KeyError, IndexError, ValueError):
            continue
    return out


def _metric(url: str, name: str) -> float | None:
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    return next((float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith((name + " ", name + "{"))), None)  # a series, or the first of its labels


def sample(launcher_pid: int, t_s: float, url: str | None = None) -> dict:
    """One row of every rank's resources, /dev/shm's entries and (``url``) the front's prefix cache's bytes."""
    ranks = []
    for rank, pid in sorted(rank_pids(launcher_pid).items()):
        try:
            status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                          if ":" in line)
            ranks.append({"rank": rank, "pid": pid, "rss_mb": round(int(status["VmRSS"].split()[0]) / 1024, 1),
                          "threads": int(status["Threads"]), "fds": len(list(Path(f"/proc/{pid}/fd").iterdir()))})
        except (OSError, KeyError, ValueError):
            continue
    out = {"kind": "sample", "t_s": round(t_s, 2), "ranks": ranks, "shm": len(list(Path("/dev/shm").iterdir()))}
    if url is not None and (cached := _metric(url, "kvr_prefix_cache_bytes")) is not None:
        out["prefix_cache_mb"] = round(cached / 2 ** 20, 1)
    if url is not None and (usage := _metric(url, "vllm:kv_cache_usage_perc")) is not None:
        out["kv_usage"] = usage
        out["kv_request_blocks"] = _metric(url, 'kvr_kv_cache_blocks{state="requests"}')
    return out


def run(url: str, model: str, launcher_pid: int, prompts: list[tuple[str, int]], profile: Profile, out: Path,
        header: dict) -> list[dict]:
    """The soak against a server already up; its rows, appended to ``out`` as they come."""
    lock = threading.Lock()
    rows: list[dict] = []
    with open(out, "a") as f:
        def write(row: dict) -> None:
            with lock:
                rows.append(row)
                f.write(json.dumps(row) + "\n")
                f.flush()

        write({"kind": "header", **header, "profile": asdict(profile)})
        t0 = time.monotonic()
        load = Load(url, model, prompts, profile, write, t0)
        load.start()
        end = t0 + profile.minutes * 60
        try:
            while time.monotonic() < end:
                write(sample(launcher_pid, time.monotonic() - t0, url))
                time.sleep(min(profile.sample_s, max(0.0, end - time.monotonic())))
        finally:
            load.join()
        settled = time.monotonic() + 10  # the requests cancelled last are freed at the engine's next steps
        while (last := sample(launcher_pid, time.monotonic() - t0, url)).get("kv_request_blocks") and \
                time.monotonic() < settled:
            time.sleep(0.5)
        write(last)
        summary = checks(rows, profile)
        write({"kind": "summary", **summary})
    return rows


def _p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def checks(rows: list[dict], profile: Profile) -> dict:
    """The soak's targets, each with its numbers and whether it holds (see the module's note)."""
    span = profile.minutes * 60
    early, late = span / 6, span - span / 6
    samples = [r for r in rows if r["kind"] == "sample"]
    requests = [r for r in rows if r["kind"] == "request"]
    after_warm = [s for s in samples if s["t_s"] >= early]
    first, last = (after_warm[0], samples[-1]) if after_warm else (samples[0], samples[-1])
    out: dict = {"requests": len(requests), "by_type": {k: sum(r["type"] == k for r in requests) for k in KINDS}}
    growth = {}
    for r in first["ranks"]:
        end = next((e for e in last["ranks"] if e["rank"] == r["rank"]), None)
        if end is not None:
            growth[r["rank"]] = round(end["rss_mb"] / r["rss_mb"] - 1, 4)
    out["rss_growth"] = growth
    if "prefix_cache_mb" in first and "prefix_cache_mb" in last and growth:  # the front's, less what its cache holds
        front = max(growth)
        mb = [next(x["rss_mb"] for x in s["ranks"] if x["rank"] == front) - s["prefix_cache_mb"] for s in (first, last)]
        out["front_rss_growth_less_prefix_cache"] = round(mb[1] / mb[0] - 1, 4)
    out["rss_ok"] = bool(growth) and all(g <= 0.05 for g in growth.values())
    errors = [r for r in requests if (r.get("status") or 0) >= 500]
    out["server_errors"] = len(errors)
    out["server_errors_ok"] = not errors
    hostile = [r for r in requests if r["type"] == "hostile"]
    out["hostile_4xx_ok"] = all(400 <= (r.get("status") or 0) < 500 for r in hostile)
    window = [s for s in samples if s["t_s"] >= early]
    fds = {rank: [next(x["fds"] for x in s["ranks"] if x["rank"] == rank) for s in window
                  if any(x["rank"] == rank for x in s["ranks"])] for rank in growth}
    # a client's open connection is one descriptor of the front's: flat means within the clients' count
    out["fds"] = {rank: (v[0], max(v), v[-1]) for rank, v in fds.items() if v}
    out["fds_ok"] = all(end <= start + profile.clients + 2 for start, _, end in out["fds"].values())
    shm = [s["shm"] for s in window]
    out["shm"] = (shm[0], max(shm), shm[-1]) if shm else None
    out["shm_ok"] = bool(shm) and shm[-1] <= shm[0]
    # TTFT as streaming clients saw it (their requests run to the end: not the cancels)
    streamed = [r for r in requests if r["type"] == "stream" and r.get("ttft_s") is not None]
    ttft_first = [r["ttft_s"] for r in streamed if r["t_s"] < early]
    ttft_last = [r["ttft_s"] for r in streamed if r["t_s"] >= late]
    out["ttft_p50"] = (_p(ttft_first, 0.5), _p(ttft_last, 0.5))
    out["ttft_p99"] = (_p(ttft_first, 0.99), _p(ttft_last, 0.99))
    p99_first, p99_last = out["ttft_p99"]
    out["ttft_ratio"] = None if not (p99_first and p99_last) else round(p99_last / p99_first, 3)
    out["ttft_ok"] = out["ttft_ratio"] is not None and out["ttft_ratio"] <= 1.2
    # the K,V pool: its peak use, and no block left with a request once the load has ended
    out["kv_usage_peak"] = max((s["kv_usage"] for s in samples if "kv_usage" in s), default=None)
    out["kv_request_blocks_after"] = last.get("kv_request_blocks")
    out["kv_ok"] = out["kv_request_blocks_after"] in (None, 0)
    out["ok"] = all(out[k] for k in ("rss_ok", "server_errors_ok", "hostile_4xx_ok", "fds_ok", "shm_ok", "ttft_ok",
                                     "kv_ok"))
    return out


def plot(rows: list[dict], path: Path, window_s: float = 60.0) -> None:
    """Resident memory and descriptors per rank, /dev/shm's entries and TTFT p50/p99 per window, over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = [r for r in rows if r["kind"] == "sample"]
    requests = [r for r in rows if r["kind"] == "request" and r["type"] == "stream" and r.get("ttft_s") is not None]
    ranks = sorted({x["rank"] for s in samples for x in s["ranks"]})
    fig, axes = plt.subplots(4, 1, figsize=(8, 10), sharex=True)
    for rank in ranks:
        pts = [(s["t_s"] / 60, x) for s in samples for x in s["ranks"] if x["rank"] == rank]
        axes[0].plot([t for t, _ in pts], [x["rss_mb"] for _, x in pts], label=f"rank {rank} resident")
        axes[1].plot([t for t, _ in pts], [x["fds"] for _, x in pts], label=f"rank {rank} fds")
        axes[1].plot([t for t, _ in pts], [x["threads"] for _, x in pts], "--", label=f"rank {rank} threads")
    cached = [s for s in samples if "prefix_cache_mb" in s]
    if cached:
        axes[0].plot([s["t_s"] / 60 for s in cached], [s["prefix_cache_mb"] for s in cached], ":",
                     label="the front's prefix cache")
    axes[2].plot([s["t_s"] / 60 for s in samples], [s["shm"] for s in samples], label="/dev/shm entries")
    span = max((s["t_s"] for s in samples), default=0.0)
    edges = [i * window_s for i in range(int(span // window_s) + 2)]
    mids, p50, p99 = [], [], []
    for lo, hi in zip(edges, edges[1:]):
        ttfts = [r["ttft_s"] for r in requests if lo <= r["t_s"] < hi]
        if ttfts:
            mids.append((lo + hi) / 2 / 60)
            p50.append(statistics.median(ttfts))
            p99.append(_p(ttfts, 0.99))
    axes[3].plot(mids, p50, "o-", label="TTFT p50")
    axes[3].plot(mids, p99, "s-", label="TTFT p99")
    for ax, label in zip(axes, ("resident MB", "count", "entries", "seconds")):
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("minutes")
    fig.suptitle("kvr-serve soak: resources per rank and TTFT over time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
