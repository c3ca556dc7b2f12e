"""Many questions on one shared context, in one process: IPPD's prefill (ippd.txt) and PAT's decode (pat.txt).

The context is prefilled once. The questions are then prefilled together as one packed sequence, each with the
position ids it would have alone after the context ("virtual" positions, IPPD section 3) and attending to the
context and to itself only; decoding advances one token of every unfinished question per step. Attention reads
the context's K,V once per step for all questions (PAT): the queries of every question stacked per K,V head in
one product against the shared prefix, each question's own tokens separately, the two merged by their
log-sum-exp. Nothing of the context is copied per question.

The model stays transformers': a ``SharedPrefixCache`` holds the context's K,V once and every question's own
K,V (left-padded, one row per question), and a registered attention function does the two-block attention.
Every answer equals, token for token, the greedy answer of the standalone prompt "context + question".
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvrunahead.kernels import attention as kernel
from kvrunahead.model.attention import attention_mode, current_state, register
from kvrunahead.model.forward import fill_cache, with_cache
from kvrunahead.model.layout import layer_windows
from kvrunahead.modes.attention import attend_with_lse, masked_attention_with_lse, merge_lse, refuse_softcap

IMPLEMENTATION = "kvrunahead_shared_prefix"


class SharedPrefixLayer(DynamicLayer):
    """One layer's cache: the shared prefix ``[2, 1, kv_heads, P, head_dim]`` once, and one row per question of
    its own K,V, left-padded, with ``valid`` marking the slots that hold a token."""

    def __init__(self, prefix: torch.Tensor, cache: SharedPrefixCache) -> None:
        super().__init__()
        self.prefix = prefix
        self.cache = cache
        self.valid: torch.Tensor | None = None  # [questions, slots] bool

    def get_seq_length(self) -> int:
        return self.prefix.shape[-2] + (self.keys.shape[-2] if self.is_initialized else 0)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:  # the packed questions: spread into left-padded rows
            self.lazy_initialization(key_states, value_states)
            lengths = self.cache.lengths
            width = max(lengths)
            shape = (len(lengths), key_states.shape[1], width, key_states.shape[-1])
            self.keys, self.values = key_states.new_zeros(shape), value_states.new_zeros(shape)
            self.valid = torch.zeros(len(lengths), width, dtype=torch.bool, device=key_states.device)
            for row, (start, n) in enumerate(zip(self.cache.starts, lengths)):
                self.keys[row, :, width - n:] = key_states[0, :, start:start + n]
                self.values[row, :, width - n:] = value_states[0, :, start:start + n]
                self.valid[row, width - n:] = True
            return key_states, value_states
        self.keys = torch.cat((self.keys, key_states), dim=-2)
        self.values = torch.cat((self.values, value_states), dim=-2)
        self.valid = torch.cat((self.valid, self.valid.new_ones(self.valid.shape[0], 1)), dim=1)
        return self.keys, self.values

    def keep(self, rows: torch.Tensor) -> None:
        self.keys, self.values, self.valid = self.keys[rows], self.values[rows], self.valid[rows]


class SharedPrefixCache(DynamicCache):
    """The context's K,V once per layer, and the questions' own K,V; ``packing`` is True while the packed
    questions are prefilled (one batch row holding every question), False while they decode (a row each)."""

    def __init__(self, prefixes: list[torch.Tensor], lengths: list[int]) -> None:
        self.lengths = list(lengths)
        self.starts = [0, *itertools.accumulate(lengths)][:-1]
        self.packing = True
        super(DynamicCache, self).__init__(layers=[SharedPrefixLayer(p, self) for p in prefixes])

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only these questions' rows (the others have finished)."""
        for layer in self.layers:
            layer.keep(rows)


def prefix_attention(query: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor, scale):
    """Every query row against the one shared prefix: all sequences' queries stacked per K,V head, so the prefix
    is read once for them all. ``query`` ``[B, heads, n, d]``, the prefix ``[1, kv_heads, P, d]``; returns the
    output ``[B, heads, n, d]`` and log-sum-exp ``[B, heads, n]``, float32."""
    b, heads, n, d = query.shape
    kv_heads = prefix_k.shape[1]
    group = heads // kv_heads
    stacked = query.reshape(b, kv_heads, group * n, d).transpose(0, 1).reshape(1, kv_heads, b * group * n, d)
    out, lse = attend_with_lse(stacked, prefix_k, prefix_v, causal=False, scale=scale)
    out = out.reshape(kv_heads, b, group * n, d).transpose(0, 1).reshape(b, heads, n, d)
    return out, lse.reshape(kv_heads, b, group * n).transpose(0, 1).reshape(b, heads, n)


def padded_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, scale):
    """One query per row against that row's own keys, ``valid`` ``[B, slots]`` marking the real ones (a decode
    step's short own block: its scores are small). Returns output and log-sum-exp, float32."""
    if kernel.usable(query):  # the valid slots are each row's last ones (left padding): read from the first
        first = (~valid).sum(dim=1).tolist()
        rows = [kernel.Row(b, 0, query.shape[2], 0, [kernel.Piece(keys, values, 0, b, lo)])
                for b, lo in enumerate(first)]
        out, lse = kernel.varlen(query, rows, causal=False, scale=scale)
        return out.transpose(1, 2), lse
    return masked_attention_with_lse(query, keys, values, valid[:, None, None, :], scale)


def shared_prefix_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Registered attention function: the shared prefix block and each question's own block, merged."""
    refuse_softcap(kwargs, "shared-prefix attention")
    cache: SharedPrefixCache = current_state()
    layer = cache.layers[module.layer_idx]
    out, lse = prefix_attention(query, layer.prefix[0], layer.prefix[1], scaling)
    if cache.packing and kernel.usable(query):  # each packed question attends to itself, causally: one call
        rows = [kernel.Row(0, start, start + n, 0, [kernel.Piece(key, value, 0, 0, start, start + n)])
                for start, n in zip(cache.starts, cache.lengths)]
        own_out, own_lse = kernel.varlen(query, rows, causal=True, scale=scaling)
        own_out = own_out.transpose(1, 2)
    elif cache.packing:  # each packed question attends to itself, causally
        outs, lses = [], []
        for start, n in zip(cache.starts, cache.lengths):
            o, s = attend_with_lse(query[:, :, start:start + n], key[:, :, start:start + n],
                                   value[:, :, start:start + n], causal=True, scale=scaling)
            outs.append(o)
            lses.append(s)
        own_out, own_lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
    else:
        own_out, own_lse = padded_attention(query, key, value, layer.valid, scaling)
    out, _ = merge_lse(own_out, own_lse, out, lse)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


register(IMPLEMENTATION, shared_prefix_attention)


def require_full_attention(config) -> None:
    if any(w is not None for w in layer_windows(config)):
        raise NotImplementedError("shared-context questions run on full-attention models only; this model has "
                                  "sliding-window layers")


@torch.no_grad()
def context_prefixes(model: torch.nn.Module, context_ids: list[int]) -> list[torch.Tensor]:
    """The context's K,V, ``[2, 1, kv_heads, P, head_dim]`` per layer, from one prefill."""
    require_full_attention(model.config)
    cache = DynamicCache(config=model.config)
    device = next(model.parameters()).device
    fill_cache(model, torch.tensor([context_ids], device=device), cache)
    return [torch.stack((layer.keys, layer.values)) for layer in cache.layers]


@dataclass
class Answer:
    tokens: list[int] = field(default_factory=list)  # greedy, the first one from the question's prefill
    first_logits: torch.Tensor | None = None  # [vocab], float32, on the CPU: what the first token was chosen from


class SharedContext:
    """Questions after one context, decoding together: ``prefill`` runs them packed (IPPD) and gives each one's
    first-token logits; ``step`` then advances every unfinished question by one token in one forward, the context
    read once for them all (PAT). The serving engine keeps one per shared-context request beside its decode batch
    (serve/step/batch_decode.py), so the questions' tokens are decode rows of its steps like any request's."""

    def __init__(self, model: torch.nn.Module, prefixes: list[torch.Tensor], questions: list[list[int]]) -> None:
        if not questions or any(not q for q in questions):
            raise ValueError("every question needs at least one token")
        self.model, self.questions = model, questions
        self.device = next(model.parameters()).device
        self.context_len = prefixes[0].shape[-2]
        self.cache = SharedPrefixCache(prefixes, [len(q) for q in questions])
        self.rows = list(range(len(questions)))  # the questions in the cache's rows, in order

    @torch.no_grad()
    def prefill(self) -> torch.Tensor:
        """The questions packed into one forward after the context: each one's next-token logits ``[n, vocab]``."""
        lengths = self.cache.lengths
        packed = torch.tensor([list(itertools.chain(*self.questions))], device=self.device)
        positions = torch.cat([torch.arange(self.context_len, self.context_len + n, device=self.device)
                               for n in lengths])[None]
        last = torch.tensor(list(itertools.accumulate(lengths)), device=self.device) - 1
        with attention_mode(self.model, IMPLEMENTATION, self.cache):
            logits = self.model(input_ids=packed, position_ids=positions, **with_cache(self.model, self.cache),
                                use_cache=True, logits_to_keep=last).logits[0]
        self.cache.packing = False
        return logits

    def position(self, question: int, generated: int) -> int:
        """Where a question's ``generated``-th answer token (0: the first) sits: after the context and itself."""
        return self.context_len + len(self.questions[question]) + generated

    @torch.no_grad()
    def step(self, tokens: dict[int, int], positions: dict[int, int]) -> dict[int, torch.Tensor]:
        """Feed each question in ``tokens`` (question index -> its last token) at its position; the questions not
        in it have finished and leave the batch for good. Each one's next-token logits ``[vocab]``."""
        going = [i for i, q in enumerate(self.rows) if q in tokens]
        if len(tokens) != len(going):
            raise ValueError("a question that left the batch cannot come back")
        if len(going) < len(self.rows):
            self.cache.keep(torch.tensor(going, device=self.device))
            self.rows = [self.rows[i] for i in going]
        ids = torch.tensor([[tokens[q]] for q in self.rows], device=self.device)
        pos = torch.tensor([[positions[q]] for q in self.rows], device=self.device)
        with attention_mode(self.model, IMPLEMENTATION, self.cache):
            logits = self.model(input_ids=ids, position_ids=pos, **with_cache(self.model, self.cache),
                                use_cache=True, logits_to_keep=1).logits[:, -1]
        return dict(zip(self.rows, logits))


def answer(model: torch.nn.Module, prefixes: list[torch.Tensor], questions: list[list[int]], max_new_tokens: int,
           eos_token_ids: set[int], on_first_tokens: Callable[[], None] | None = None) -> list[Answer]:
    """Greedy answers of every question after the context whose K,V are ``prefixes``: one packed prefill of the
    questions, then one decode step per token for all unfinished questions at once. ``on_first_tokens`` is
    called when every question's first token is chosen (its time to first token)."""
    shared = SharedContext(model, prefixes, questions)
    logits = shared.prefill()
    answers = [Answer(tokens=[int(row.argmax())], first_logits=row.float().cpu()) for row in logits]
    if on_first_tokens is not None:
        on_first_tokens()
    while True:
        going = {i: a.tokens[-1] for i, a in enumerate(answers)
                 if len(a.tokens) < max_new_tokens and a.tokens[-1] not in eos_token_ids}
        if not going:
            return answers
        step = shared.step(going, {i: shared.position(i, len(answers[i].tokens) - 1) for i in going})
        for i, row in step.items():
            answers[i].tokens.append(int(row.argmax()))
