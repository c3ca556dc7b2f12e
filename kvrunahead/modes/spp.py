"""Stream pipeline parallelism (Medha, medha.txt section 3): the layers cut into stages, one per rank, and the
chunks of one prompt pipelined through them.

Rank r holds the decoder layers of stage r (model/stage.py: the unmodified model cut to them) and nothing of the
others. The prompt is cut into chunks of ``chunk_tokens``; stage r runs chunk c as soon as it has chunk c's hidden
states from stage r-1, because all chunk c needs besides them is the K,V of chunks 0..c-1 *of its own layers*,
which its cache holds already: chunk c+1 enters stage 0 while chunk c is in stage 1. Each stage keeps its layers'
K,V of every chunk (an ordinary ``DynamicCache``: a chunk is the extension phase of the ones before it, so the
causal mask, the positions and a sliding layer's window come from the model itself), so the last stage ends with
the whole prompt's cache of its layers and emits the first token.

Per chunk a stage sends one message, ``[1, chunk, hidden]``: hidden states, never K,V. The receive of chunk c+1 is
posted before chunk c is computed, and each send is an ``isend`` that completes while the next chunk runs.

After the prompt's last chunk every stage sends its layers' K,V to the last rank (serve/step/segments.py), which then
holds the whole cache and decodes as after any prefill: the engine's decode, served or one-shot.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import DynamicCache

from kvrunahead.model.attention import attention_mode, require_attention_interface
from kvrunahead.model.forward import head_logits, with_cache
from kvrunahead.model.growing import grow_in_place
from kvrunahead.modes.kvr import SPLIT
from kvrunahead.ranks.transport import Transport

TAGS = 1024  # chunk c travels under tag c mod TAGS: messages of one pair and tag are matched in order


def chunks(n: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """The prompt's chunks, ``[a, e)``; the last one shorter where ``chunk_tokens`` does not divide ``n``."""
    if chunk_tokens < 1:
        raise ValueError(f"a chunk holds at least one token, got {chunk_tokens}")
    return [(a, min(a + chunk_tokens, n)) for a in range(0, n, chunk_tokens)]


class Pipe:
    """This stage's two neighbours: hidden states in from stage r-1 (receives posted ``lookahead`` chunks ahead),
    out to stage r+1."""

    def __init__(self, transport: Transport, hidden: int, dtype: torch.dtype, device: torch.device,
                 lookahead: int = 1) -> None:
        self.transport, self.hidden, self.dtype, self.device = transport, hidden, dtype, device
        self.lookahead = lookahead
        self._pending: dict[int, tuple] = {}

    @classmethod
    def of(cls, model: torch.nn.Module, transport: Transport) -> Pipe:
        """The pipe of ``model``'s stage: messages of its hidden size, in its weights' dtype, on their device."""
        param = next(p for p in model.parameters() if p.is_floating_point())
        return cls(transport, model.config.hidden_size, param.dtype, param.device)

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.transport.world_size - 1

    def post(self, index: int, tokens: int) -> None:
        if self.first or index in self._pending:
            return
        buf = torch.empty((1, tokens, self.hidden), dtype=self.dtype, device=self.device)
        self._pending[index] = (self.transport.irecv(buf, self.rank - 1, tag=index % TAGS), buf)

    def take(self, index: int) -> torch.Tensor:
        req, buf = self._pending.pop(index)
        self.transport.wait(req, f"the hidden states of chunk {index} from stage {self.rank - 1}")
        return buf

    def send(self, index: int, hidden: torch.Tensor) -> None:
        if not self.last:
            self.transport.isend(hidden.contiguous(), self.rank + 1, tag=index % TAGS)


def stage_forward(model: torch.nn.Module, cache: DynamicCache, start: int, ids: torch.Tensor | None = None,
                  hidden: torch.Tensor | None = None) -> torch.Tensor:
    """The stage's layers over positions [start, start + n): from token ids (the first stage) or the previous
    stage's hidden states; returns the hidden states it hands on (normalised on the last stage)."""
    n = ids.shape[1] if ids is not None else hidden.shape[1]
    device = ids.device if ids is not None else hidden.device
    position_ids = torch.arange(start, start + n, device=device).unsqueeze(0)
    base = model.base_model
    inputs = {"input_ids": ids} if ids is not None else {"inputs_embeds": hidden}
    out = base(**inputs, position_ids=position_ids, use_cache=True, **with_cache(base, cache))
    return out.last_hidden_state


@torch.no_grad()
def spp_prefill(model: torch.nn.Module, input_ids: torch.Tensor, transport: Transport, chunk_tokens: int,
                cache: DynamicCache | None = None, start: int = 0, attention: str = "masked"
                ) -> tuple[torch.Tensor | None, DynamicCache]:
    """This stage's part of a pipelined prefill of positions [start, start + n) (``input_ids`` ``[1, n]``: the
    tokens, which the first stage embeds; later stages read only their count). ``cache``: the stage's K,V of
    [0, start) (a chunked prefill's earlier steps), else a new one. Returns the last token's logits on the last
    stage (None elsewhere) and the stage's cache, which holds its layers' K,V of [0, start + n).

    ``attention``: "masked", the model's own SDPA, which attends a chunk after cached positions under an explicit
    mask over all of them; "split", KV-Runahead's split attention (modes/kvr.py), which is what a chunk after a
    cached prefix is: the prefix block in full, without a mask, the chunk's own block causally, merged by
    log-sum-exp (models that use transformers' attention interface)."""
    if attention == "split":
        require_attention_interface(model, "spp --kvr-attention split")
    with attention_mode(model, SPLIT, None) if attention == "split" else contextlib.nullcontext():
        return _pipeline(model, input_ids, transport, chunk_tokens, cache, start)


def _pipeline(model, input_ids, transport, chunk_tokens, cache, start):
    n = input_ids.shape[1]
    parts = [(a + start, e + start) for a, e in chunks(n, chunk_tokens)]
    cache = cache if cache is not None else DynamicCache(config=model.config)
    pipe = Pipe.of(model, transport)
    for c in range(min(pipe.lookahead, len(parts))):
        pipe.post(c, parts[c][1] - parts[c][0])
    logits = None
    for c, (a, e) in enumerate(parts):
        if pipe.first:
            hidden = stage_forward(model, cache, a, ids=input_ids[:, a - start:e - start])
        else:
            received = pipe.take(c)
            if c + pipe.lookahead < len(parts):  # posted before this chunk's compute: it arrives meanwhile
                nxt = parts[c + pipe.lookahead]
                pipe.post(c + pipe.lookahead, nxt[1] - nxt[0])
            hidden = stage_forward(model, cache, a, hidden=received)
        pipe.send(c, hidden)
        if c == 0:  # the full layers' K,V from here on written into room for the whole prompt, not concatenated
            grow_in_place(cache, room=start + n)
        if pipe.last and c == len(parts) - 1:
            logits = head_logits(model, hidden[:, -1:, :])[0, -1]
    transport.drain()
    return logits, cache
