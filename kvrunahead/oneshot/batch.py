"""A batch of prompts: packed over the KV chain (Prepacking), one prompt at a time over it (sequential), or, in one
process, transformers' usual padded batch; each prompt's first token, TTFT and greedy continuation, and with
``verify`` each checked against the prompt prefilled alone in one process. The packed and sequential batches run as
requests to the serving engine (oneshot/on_engine.py); this module holds the batch's checks, its report and the padded
baseline."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kvrunahead.config import RunConfig
from kvrunahead.errors import InputError
from kvrunahead.model.device import check_device, oversubscribed, peak_memory_bytes, reset_peak_memory
from kvrunahead.model.forward import with_cache
from kvrunahead.model.load import load_tokenizer, resolve_config
from kvrunahead.model.reference import check_alone
from kvrunahead.model.rope import plan_extension
from kvrunahead.modes.packed import why_not_packable
from kvrunahead.prompt import chat_prompt
from kvrunahead.ranks.launcher import World
from kvrunahead.ranks.setup import set_up_rank

BATCHINGS = ("packed", "sequential", "padded")
DEFAULT_STEP_TOKENS = 8192  # tokens per packed step: larger batches are bin-packed into several


@dataclass
class PromptResult:
    index: int
    prompt_tokens: int
    step: int  # the packed step that prefilled it
    rank: int  # the rank that emitted its first token
    ttft_s: float  # from the batch's start to its first token
    tokens: list[int]
    text: str
    first_logits: torch.Tensor | None = field(default=None, repr=False)
    matches: bool | None = None  # --verify: first token, greedy tokens and first logits (within atol) equal
    first_logit_diff: float | None = None
    reference_text: str | None = None


@dataclass
class StepReport:
    prompts: list[int]
    boundaries: list[int]
    handed_on: list[int]  # tokens each rank but the last hands on (0: its part ends on a prompt edge)


@dataclass
class RankReport:
    rank: int
    prefill_s: float  # this rank's packed steps, start to its last K,V sent / first token chosen
    bytes_sent: int
    peak_mem_bytes: int


@dataclass
class BatchResult:
    model: str
    batching: str
    world_size: int
    device: str
    dtype: str
    threads_per_rank: int
    oversubscribed: bool
    step_tokens: int
    steps: list[StepReport]
    ranks: list[RankReport]
    prompts: list[PromptResult]
    atol: float | None = None

    @property
    def prefill_s(self) -> float:
        """Until every prompt has its first token."""
        return max(p.ttft_s for p in self.prompts)

    @property
    def verified(self) -> bool | None:
        return None if self.atol is None else all(p.matches for p in self.prompts)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for p in d["prompts"]:
            p.pop("first_logits")
        return {**d, "prefill_s": self.prefill_s, "verified": self.verified,
                "mismatches": sum(not p.matches for p in self.prompts) if self.atol is not None else None}


def check_batch(cfg: RunConfig, batching: str, world_size: int) -> None:
    """One line (InputError) for a batch that cannot run as asked, before any rank starts."""
    if batching not in BATCHINGS:
        raise InputError(f"unknown batching {batching!r}: one of {', '.join(BATCHINGS)}")
    if batching == "padded" and world_size > 1:
        raise InputError("--batching padded is transformers' batched forward in one process: run it without --nproc")
    if cfg.mode != "kvr":
        raise InputError(f"a batch of prompts runs over the KV chain (mode kvr), not {cfg.mode}")
    if cfg.partition != "auto" or cfg.table is not None:
        raise InputError("a packed batch is cut step by step over its prompts' work: --partition and --table do "
                         "not apply to --prompts")
    check_device(cfg.device)
    config = resolve_config(cfg.model)
    why = why_not_packable(config) if batching != "padded" else None
    if why:
        raise InputError(f"{cfg.model}: {why}; use --batching padded")


def tokenize_prompts(cfg: RunConfig, texts: list[str]) -> list[list[int]]:
    """Each text as a whole user turn (the chat template unless ``cfg.chat`` is off)."""
    tokenizer = load_tokenizer(cfg.model)
    return [chat_prompt(tokenizer, text, cfg.chat) for text in texts]


def padded_on_world(cfg: RunConfig, world: World, prompts: list[list[int]]) -> BatchResult:
    """transformers' padded batch in one process (``--batching padded``): the baseline a packed batch is measured
    against, with its tokens and, with ``cfg.verify``, each prompt checked alone."""
    rope = plan_extension(resolve_config(cfg.model), max(map(len, prompts)) + cfg.max_new_tokens,
                          cfg.allow_long_context, cfg.model)
    rs = set_up_rank(cfg, world, rope)
    reset_peak_memory(rs.device)
    results = _padded(rs.lm, prompts, cfg.max_new_tokens)
    atol = verify_prompts(lambda n: rs.lm, prompts, results, cfg.max_new_tokens) if cfg.verify else None
    report = RankReport(world.rank, results[0].ttft_s, 0, peak_memory_bytes(rs.device))
    return BatchResult(cfg.model, "padded", 1, str(rs.device), str(rs.dtype).removeprefix("torch."), rs.threads,
                       oversubscribed(rs.threads, world.local_world_size), DEFAULT_STEP_TOKENS, [], [report], results,
                       atol)


@torch.no_grad()
def _padded(lm, prompts: list[list[int]], max_new_tokens: int) -> list[PromptResult]:
    """transformers' usual batched forward: the prompts left-padded to the longest, a padding mask, and the
    positions counted past the padding; then a batched greedy decode with the same mask grown per step."""
    model = lm.model
    device = next(model.parameters()).device
    longest = max(map(len, prompts))
    ids = torch.zeros((len(prompts), longest), dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for row, x in enumerate(prompts):
        ids[row, longest - len(x):] = torch.tensor(x, device=device)
        mask[row, longest - len(x):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    t0 = time.perf_counter()
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, **with_cache(model, cache),
                   use_cache=True, logits_to_keep=1).logits[:, -1]
    ttft_s = time.perf_counter() - t0
    first = logits.float().cpu()
    tokens = [[int(t)] for t in logits.argmax(-1)]
    done = [t[0] in lm.eos_token_ids for t in tokens]
    while not all(done) and len(tokens[0]) < max_new_tokens:
        step = torch.tensor([[t[-1]] for t in tokens], device=device)
        mask = torch.cat((mask, torch.ones_like(mask[:, :1])), dim=1)
        positions = positions[:, -1:] + 1
        nxt = model(input_ids=step, attention_mask=mask, position_ids=positions, **with_cache(model, cache),
                    use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1)
        for row, t in enumerate(nxt.tolist()):
            if not done[row]:
                tokens[row].append(t)
                done[row] = t in lm.eos_token_ids
            else:
                tokens[row].append(tokens[row][-1])  # a row past its end keeps a place; cut below
    out = []
    for row, x in enumerate(prompts):
        got = tokens[row]
        end = next((i + 1 for i, t in enumerate(got) if t in lm.eos_token_ids), len(got))
        out.append(PromptResult(row, len(x), 0, 0, ttft_s, got[:end], lm.decode(got[:end]), first[row]))
    return out


def verify_prompts(model_for: Callable[[int], object], prompts: list[list[int]], results: list[PromptResult],
                   max_new_tokens: int) -> float:
    """Each prompt of ``results`` prefilled and decoded alone in this process (``model_for(n)``: the loaded model
    for an n-token prompt, its RoPE variant); returns the largest tolerance."""
    atols = [0.0]
    for r in results:
        lm = model_for(r.prompt_tokens)
        dtype = next(lm.model.parameters()).dtype
        check = check_alone(lm, prompts[r.index], r.tokens, r.first_logits, dtype, max_new_tokens)
        r.first_logit_diff, r.matches, r.reference_text = check.first_logit_diff, check.matches, check.reference_text
        atols.append(check.atol)
    return max(atols)
