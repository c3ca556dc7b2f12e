"""What a serving engine is set up with (``kvr-serve``'s options, ``kvr-prefill``'s one-shot engine), and the longest
request it takes."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrunahead.config import RunConfig
from kvrunahead.errors import InputError
from kvrunahead.model.rope import max_context, plan_extension
from kvrunahead.modes.packing import EDGE_SLACK


@dataclass
class EngineConfig:
    run: RunConfig = field(default_factory=RunConfig)  # model, partition, attention, transport, net, timeout, ...
    max_queue: int = 64
    max_model_len: int | None = None  # None: the longest context the model takes (RoPE extension included)
    kv_cache_memory_gib: float | None = None  # the front's K,V pool; None: VLLM_CPU_KVCACHE_SPACE or a share of free
    degree: str = "auto"  # auto, 1, or the world size
    learn: str = "off"  # the auto degree corrected by the server's timings: off, auto (kept in the cache) or a path
    heartbeat_s: float = 1.0
    pack_tokens: int = 8192  # waiting prompts packed into one prefill up to this many tokens; 0: one at a time
    pack_edge_slack: float = EDGE_SLACK  # how much of a part's work a packed cut may give up to sit on a prompt edge
    prefix_cache_tokens: int = 32768  # prompts' K,V kept for later prompts that start the same way; 0: none
    step_budget_ms: float = 0.0  # a longer prefill (as the cost model predicts it) runs in chunks; 0: never chunked
    chunk_tokens: int = 0  # chunks of this many tokens instead of the budget's (fixed chunking); 0: by the budget
    schedule: str = "fcfs"  # or lars (serve/scheduler.py)
    ttft_slo_s: float = 2.0  # LARS's default TTFT target: the larger of this and
    ttft_slo_factor: float = 4.0  # this many times the request's predicted prefill alone
    mixed_steps: bool = True  # decodes ride along every prefill step; False: a step is a prefill or a decode
    prefill_first: bool = False  # decodes wait until no prefill does (an offline batch: every first token first)
    prefill: str = "chain"  # a prompt over the ranks: the KV chain, or "spp", the stream pipeline (modes/spp.py)
    stages: str = "auto"  # spp: the stages' layer boundaries, or auto (the cost model's, per prompt length)
    spp_chunk_tokens: int = 0  # spp: tokens handed stage to stage at a time; 0: the cost model's


def model_len_limit(run: RunConfig, model_config, asked: int | None) -> int:
    """The most tokens a request may hold: ``--max-model-len``, else the longest context the model takes (its
    RoPE extension included). Raises InputError or ContextError for a limit the model cannot run."""
    limit = asked or max_context(model_config, run.allow_long_context) or 2048
    if limit < 2:
        raise InputError(f"--max-model-len must be at least 2, got {limit}")
    plan_extension(model_config, limit, run.allow_long_context, run.model)
    return limit
