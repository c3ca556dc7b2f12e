"""One rank's forward on a transformers model: the last token's logits, a part without its LM head (or with it on
every position, scoring the prompt), greedy decode from a filled cache."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvrunahead.model.growing import grow_in_place


@functools.cache
def _keywords(cls: type) -> frozenset[str]:
    return frozenset(inspect.signature(cls.forward).parameters)


def forward_takes(module: torch.nn.Module, keyword: str) -> bool:
    """Whether ``module``'s forward takes ``keyword`` (read once per class: decode asks on every token)."""
    return keyword in _keywords(type(module))


def with_cache(module: torch.nn.Module, cache) -> dict:
    """``module``'s forward keyword for the KV cache, under the name its transformers version takes: 5.2x renamed
    ``past_key_values`` to ``cache``, and the old name warns until it is removed."""
    return {"cache" if forward_takes(module, "cache") else "past_key_values": cache}


def one_position(model: torch.nn.Module) -> dict:
    """The inputs of a one-position probe forward of ``model``'s base: a token id, or for a pipeline stage that does
    not embed (model/stage.py) a hidden state."""
    param = next(p for p in model.parameters() if p.is_floating_point())
    if not _embeds(model):
        return {"inputs_embeds": torch.zeros((1, 1, model.config.hidden_size), dtype=param.dtype, device=param.device)}
    return {"input_ids": torch.zeros((1, 1), dtype=torch.long, device=param.device)}


def _embeds(model: torch.nn.Module) -> bool:
    """Whether the model embeds token ids (a later pipeline stage's embedding is dropped)."""
    try:
        return model.base_model.get_input_embeddings() is not None
    except NotImplementedError:  # transformers finds no embedding module to return: it was dropped
        return False


@torch.no_grad()
def last_token_logits(model: torch.nn.Module, input_ids: torch.Tensor, cache=None, **kwargs) -> torch.Tensor:
    """Run the causal-LM head on the last position only, filling ``cache``; returns ``[vocab]`` logits."""
    if cache is not None:
        kwargs.update(with_cache(model, cache))
    if forward_takes(model, "logits_to_keep"):
        out = model(input_ids=input_ids, logits_to_keep=1, use_cache=True, **kwargs)
    else:
        out = model(input_ids=input_ids, use_cache=True, **kwargs)
    return out.logits[0, -1]


@torch.no_grad()
def forward_part(model: torch.nn.Module, input_ids: torch.Tensor, emit: bool, cache=None,
                 score: Scoring | None = None, **kwargs) -> torch.Tensor | None:
    """This rank's forward: the last token's logits when it emits the first token, else no LM head at all; with
    ``score``, the LM head on every position too (the prompt's log-probabilities, left in ``score``)."""
    if score is not None:
        return scored_part(model, input_ids, emit, score, cache, **kwargs)
    if emit:
        return last_token_logits(model, input_ids, cache, **kwargs)
    fill_cache(model, input_ids, cache, **kwargs)
    return None


SCORE_ROWS = 256  # positions per LM-head block while scoring: [256, vocab] float32 logits at a time, not [n, vocab]


@dataclass
class Scoring:
    """A part's positions scored against the tokens that follow them (a prompt's log-probabilities, as vLLM's
    ``prompt_logprobs``): ``targets[i]`` follows the part's position i (there may be one fewer target than
    positions: the prompt's last position predicts the first new token, not a prompt token). The forward fills in
    each target's log-probability (``logprobs``, float32 log-softmax of the raw logits, as a generated token's)
    and the ``top`` likeliest tokens' ids and log-probabilities at each position."""

    targets: list[int]
    top: int = 0
    logprobs: torch.Tensor | None = None  # [len(targets)]
    top_ids: torch.Tensor | None = None  # [len(targets), top]
    top_logprobs: torch.Tensor | None = None


def head_logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The causal-LM head on final hidden states, as the model's own forward applies it (Gemma's soft cap
    included)."""
    logits = model.get_output_embeddings()(hidden)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


@torch.no_grad()
def scored_part(model: torch.nn.Module, input_ids: torch.Tensor, emit: bool, score: Scoring, cache=None,
                **kwargs) -> torch.Tensor | None:
    """The decoder layers, then the LM head block by block over the scored positions; the last token's logits
    (when it emits) from the last position alone, as ``last_token_logits`` takes them, so the first token is the
    one an unscored forward gives."""
    out = model.base_model(input_ids=input_ids, use_cache=True, **with_cache(model.base_model, cache), **kwargs)
    hidden = out.last_hidden_state
    targets = torch.tensor(score.targets, dtype=torch.long, device=hidden.device)
    n, chosen, ids, values = targets.numel(), [], [], []
    for i in range(0, n, SCORE_ROWS):
        j = min(i + SCORE_ROWS, n)
        logprobs = torch.log_softmax(head_logits(model, hidden[0, i:j]).float(), dim=-1)
        chosen.append(logprobs.gather(1, targets[i:j, None])[:, 0])
        if score.top:
            best = logprobs.topk(score.top, dim=-1)
            ids.append(best.indices)
            values.append(best.values)
    score.logprobs = torch.cat(chosen).cpu() if chosen else torch.empty(0)
    score.top_ids = torch.cat(ids).cpu() if ids else torch.empty((n, 0), dtype=torch.long)
    score.top_logprobs = torch.cat(values).cpu() if values else torch.empty((n, 0))
    return head_logits(model, hidden[:, -1:, :])[0, -1] if emit else None


@torch.no_grad()
def fill_cache(model: torch.nn.Module, input_ids: torch.Tensor, cache, **kwargs) -> None:
    """The decoder layers alone (no LM head), appending the K,V of ``input_ids`` to ``cache``."""
    model.base_model(input_ids=input_ids, use_cache=True, **with_cache(model.base_model, cache), **kwargs)


@torch.no_grad()
def greedy_decode(
    model: torch.nn.Module,
    first_token: int,
    cache: DynamicCache,
    position: int,
    max_new_tokens: int,
    eos_token_ids: set[int],
) -> list[int]:
    """Greedy extension phase from a filled cache; ``position`` is the first token's position. The cache's full
    layers grow in place from here on (``grow_in_place``)."""
    tokens = [first_token]
    device = next(model.parameters()).device
    grow_in_place(cache)
    while len(tokens) < max_new_tokens and tokens[-1] not in eos_token_ids:
        ids = torch.tensor([[tokens[-1]]], device=device)
        pos = torch.tensor([[position + len(tokens) - 1]], device=device)
        logits = last_token_logits(model, ids, position_ids=pos, cache=cache)
        tokens.append(int(logits.argmax()))
    return tokens
