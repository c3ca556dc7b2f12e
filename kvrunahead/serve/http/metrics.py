"""The server's Prometheus metrics, in a registry of its own (two servers in one process never share counts).

The ``kvr_`` series are the server's own. Beside them, the names vLLM exports under ``vllm:`` where the meaning is
the same, labelled ``model_name`` as vLLM's are, so that a dashboard built for vLLM (its Grafana JSON reads these)
shows this server unchanged: TTFT, time per output token, end-to-end latency, requests running and waiting, prompt
and generation tokens. TTFT is what the client waits: from the request's arrival at the server to its first token,
queueing included. vLLM observes every gap between two output tokens; here a request's mean gap is observed once per
gap, so the histogram's sum and count (the dashboard's mean) are the same and its quantiles are per request.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds: from a few milliseconds (a short prompt on one rank) to minutes (a long prompt on a slow CPU chain).
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)

# The outcomes a request is counted under: how it finished, or why it was refused before it started.
OUTCOMES = ("stop", "length", "cancelled", "error", "invalid", "queue_full", "unavailable", "unauthorized")


class Metrics:
    """The histograms, gauges and counters of one server, rendered in Prometheus' text format."""

    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.vllm = VllmMetrics(r, model_name)
        self.ttft = Histogram("kvr_ttft_seconds", "Time from a request's arrival to its first token.",
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.tpot = Histogram("kvr_time_per_output_token_seconds",
                              "Time between a request's output tokens after the first (one observation per request).",
                              buckets=TPOT_BUCKETS_S, registry=r)
        self.e2e = Histogram("kvr_e2e_request_latency_seconds", "Time from a request's arrival to its last token.",
                             buckets=E2E_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter("kvr_prompt_tokens", "Prompt tokens of the requests served.", registry=r)
        self.generation_tokens = Counter("kvr_generation_tokens", "Tokens generated.", registry=r)
        self.queue_depth = Gauge("kvr_queue_depth", "Requests waiting for their prefill.", registry=r)
        self.running = Gauge("kvr_requests_running", "Requests admitted and not yet finished.", registry=r)
        self.requests = Counter("kvr_requests", "Requests by outcome.", ["outcome"], registry=r)
        self.rank_bytes = Counter("kvr_rank_bytes_sent", "Bytes each rank sent in the requests' prefills.", ["rank"],
                                  registry=r)
        self.packed = Counter("kvr_packed_requests", "Requests whose prompt was prefilled packed with others' "
                              "(Prepacking).", registry=r)
        self.pack_size = Histogram("kvr_packed_with", "Prompts in the packed prefill of each request (1: alone).",
                                   buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.cached_tokens = Counter("kvr_prefix_cached_tokens", "Prompt tokens taken from the prefix cache instead of "
                                     "prefilled.", registry=r)
        self.layouts = Counter("kvr_layout_choices", "Prefills by their degree (1: one rank or TP group; else the "
                               "chain or pipeline) and what chose it: fixed, forced, prior (tables or the cost "
                               "model), exploring or learned (the server's own timings).", ["degree", "basis"],
                               registry=r)
        self.ask_questions = Counter("kvr_ask_questions", "Questions answered by shared-context requests (/v1/ask).",
                                     registry=r)
        self.degraded = Gauge("kvr_degraded", "1 while a worker rank is lost and the front serves without it "
                              "(its decodes go on, prefills wait), else 0.", registry=r)
        self.rank_restarts = Counter("kvr_rank_restarts", "Times the workers were started again and joined after "
                                     "a worker rank was lost.", registry=r)
        self.prefix_bytes = Gauge("kvr_prefix_cache_bytes", "Bytes of K,V the prefix cache holds (bounded by "
                                  "--prefix-cache-tokens).", registry=r)
        self.step_age = Gauge("kvr_engine_step_age_seconds", "Seconds since the engine last finished a step (the "
                              "engine's heartbeat: an idle engine steps every second; /health says 503 once a step "
                              "has run past --timeout).", registry=r)
        self.kv_blocks = Gauge("kvr_kv_cache_blocks", "The front's K,V pool (--kv-cache-memory) in blocks of 16 "
                               "positions: total, used (by requests, forks and the prefix cache), free, and those "
                               "the requests hold (requests).", ["state"], registry=r)
        self._restarts: Callable[[], int] = lambda: 0
        self._preemptions: Callable[[], int] = lambda: 0
        for outcome in OUTCOMES:  # every outcome shows from the start, at zero
            self.requests.labels(outcome=outcome)

    def track(self, queue_depth: Callable[[], float], running: Callable[[], float],
              degraded: Callable[[], float] = lambda: 0.0, restarts: Callable[[], int] = lambda: 0,
              prefix_bytes: Callable[[], float] = lambda: 0.0, step_age: Callable[[], float] = lambda: 0.0,
              kv=None) -> None:
        """Read the gauges (and the restarts) from the engine at each scrape rather than keeping a second count of
        its state. ``kv``: the front's serve/kv_pool.KVRoom (its pool's use and its preemptions)."""
        self.queue_depth.set_function(queue_depth)
        self.running.set_function(running)
        self.vllm.waiting.set_function(queue_depth)
        self.vllm.running.set_function(running)
        self.degraded.set_function(degraded)
        self.prefix_bytes.set_function(prefix_bytes)
        self.step_age.set_function(step_age)
        self._restarts = restarts
        if kv is not None:
            pool = kv.pool
            self.vllm.kv_usage.set_function(lambda: pool.usage)
            self.kv_blocks.labels(state="total").set(pool.num_blocks)
            self.kv_blocks.labels(state="used").set_function(lambda: pool.used_blocks)
            self.kv_blocks.labels(state="free").set_function(lambda: pool.free_blocks)
            self.kv_blocks.labels(state="requests").set_function(kv.request_blocks)
            self._preemptions = lambda: kv.preemptions

    def refused(self, outcome: str) -> None:
        self.requests.labels(outcome=outcome).inc()

    def finished(self, outcome: str, *, ttft_s: float | None, e2e_s: float, prompt_tokens: int,
                 completion_tokens: int, rank_bytes: dict[int, int], packed_with: int = 1,
                 cached_tokens: int = 0, layout: tuple[int, str] | None = None) -> None:
        """One request that was admitted, however it ended."""
        self.requests.labels(outcome=outcome).inc()
        self._tokens(prompt_tokens, completion_tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            self.vllm.ttft.observe(ttft_s)
            self.pack_size.observe(packed_with)
            if layout is not None:
                self.layouts.labels(degree=str(layout[0]), basis=layout[1]).inc()
            self.cached_tokens.inc(cached_tokens)
            if packed_with > 1:
                self.packed.inc()
            if completion_tokens > 1:
                gap = (e2e_s - ttft_s) / (completion_tokens - 1)
                self.tpot.observe(gap)
                for _ in range(completion_tokens - 1):
                    self.vllm.tpot.observe(gap)
        if outcome in ("stop", "length"):
            self.e2e.observe(e2e_s)
            self.vllm.e2e.observe(e2e_s)
        for rank, n in rank_bytes.items():
            self.rank_bytes.labels(rank=str(rank)).inc(n)

    def asked(self, questions: int, prompt_tokens: int, completion_tokens: int) -> None:
        """One shared-context request answered."""
        self.requests.labels(outcome="stop").inc()
        self.ask_questions.inc(questions)
        self._tokens(prompt_tokens, completion_tokens)

    def _tokens(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.vllm.prompt_tokens.inc(prompt_tokens)
        self.vllm.generation_tokens.inc(completion_tokens)

    def render(self) -> tuple[bytes, str]:
        """The text exposition and its content type."""
        self.rank_restarts.inc(max(0, self._restarts() - self.rank_restarts._value.get()))
        self.vllm.preemptions.inc(max(0, self._preemptions() - self.vllm.preemptions._value.get()))
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class VllmMetrics:
    """The series vLLM exports whose meaning this server shares, under vLLM's names and ``model_name`` label."""

    def __init__(self, r: CollectorRegistry, model_name: str) -> None:
        label = {"labelnames": ["model_name"], "registry": r}

        def one(kind, name: str, doc: str, **kw):
            return kind(f"vllm:{name}", doc, **label, **kw).labels(model_name=model_name)

        self.ttft = one(Histogram, "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                        buckets=TTFT_BUCKETS_S)
        self.tpot = one(Histogram, "time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                        buckets=TPOT_BUCKETS_S)
        self.e2e = one(Histogram, "e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                       buckets=E2E_BUCKETS_S)
        self.running = one(Gauge, "num_requests_running", "Number of requests in model execution batches.")
        self.waiting = one(Gauge, "num_requests_waiting", "Number of requests waiting to be processed.")
        self.prompt_tokens = one(Counter, "prompt_tokens", "Number of prefill tokens processed.")
        self.kv_usage = one(Gauge, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = one(Counter, "num_preemptions", "Cumulative number of preemption from the engine.")
        self.generation_tokens = one(Counter, "generation_tokens", "Number of generation tokens processed.")
