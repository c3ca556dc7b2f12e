"""A step's segments that every rank runs whole (serve/step/plans.py), each rank holding a different part of the
model or of the cache:

- pipelined (plans.Pipeline): Medha's stream pipeline in the engine. Each rank runs the segment's positions through
  its stage of the model (a view sharing the weights the rank holds, model/stage.py) in chunks handed stage to stage
  (modes/spp.py); a chunked prefill's stages keep their layers' K,V between its steps (``ctx.staged``); after the
  prompt's last chunk every stage sends the front its layers' K,V, so the front holds the whole cache and decodes
  as after any prefill.
- KV-parallel (plans.KvParallel): Medha's KVP for prefill chunks. Every rank runs the chunk through the whole
  model, attending its own shard of the positions before it (decode/kvp.py, the KVP decode's attention for a block
  of queries), and rank ``owner`` appends the chunk's K,V to its shard.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvrunahead.decode.kvp import empty_shards, kvp_forward
from kvrunahead.modes.spp import spp_prefill
from kvrunahead.serve.step.plans import STAGED, KvParallel, Pipeline


def pipelined(ctx, seg: Pipeline, attention: str) -> tuple[torch.Tensor | None, DynamicCache | None, dict]:
    """A pipelined segment on this rank (``ctx``: its rank.RankContext): its positions through this rank's
    stage in chunks (modes/spp.py), after the stage's K,V of the earlier chunks; kept staged for the next chunk, or
    sent to the front. Returns, on the front, the first token's logits and (kept there) the whole cache; on every
    rank, the bytes it sent by kind (the hidden states down the pipeline, its layers' K,V to the front)."""
    view = ctx.stage(seg.rope, seg.stages)
    cache = ctx.staged.pop(seg.request_id, None) if seg.held == STAGED else None
    ids = torch.tensor([seg.tokens], device=ctx.device)
    logits, cache = spp_prefill(view, ids, ctx.transport, seg.pipeline_chunk or len(seg.tokens), cache, seg.start,
                                attention)
    hidden = ctx.transport.stats.bytes_sent
    if seg.keep == STAGED:
        ctx.staged[seg.request_id] = cache
        return logits, None, {"hidden states": hidden}
    whole = gather_stages(ctx, seg, cache)
    return logits, whole, {"hidden states": hidden, "K,V to the front": ctx.transport.stats.bytes_sent - hidden}


def gather_stages(ctx, seg: Pipeline, cache: DynamicCache) -> DynamicCache | None:
    """Every stage's layers' K,V of [0, end) to the front (what a sliding layer keeps of them), one message per
    layer; the front's whole cache, its own stage's layers taken as they are."""
    lm, layout = ctx.model(seg.rope)
    first = seg.stages[ctx.rank]
    if ctx.rank != ctx.front:
        for i, layer in enumerate(cache.layers):
            ctx.transport.isend(torch.stack((layer.keys, layer.values)).contiguous(), ctx.front, tag=first + i)
        ctx.transport.drain()
        return None
    whole = DynamicCache(config=lm.model.config)
    received = []
    for r in range(ctx.world_size - 1):
        for layer in range(seg.stages[r], seg.stages[r + 1]):
            buf = torch.empty(layout.kv_shape(layer, layout.kept(layer, seg.end)), dtype=layout.dtype,
                              device=ctx.device)
            received.append((layer, ctx.transport.irecv(buf, r, tag=layer), buf))
    for layer, req, buf in received:
        ctx.transport.wait(req, f"the K,V of layer {layer} from its stage")
        whole.layers[layer].update(buf[0], buf[1])
        if layout.window(layer) is not None:
            whole.layers[layer].cumulative_length = seg.end  # seen so far, of which the window keeps the last
    for i, layer in enumerate(cache.layers):
        whole.layers[first + i] = layer
    return whole


def kv_parallel(ctx, seg: KvParallel, attention: str) -> tuple[torch.Tensor | None, object, dict]:
    """A KV-parallel chunk on this rank (``ctx``: its rank.RankContext; the chunk's attention is KVP's whatever
    ``attention``): its shard of the request, made empty by the first chunk, kept in ``ctx.shards`` for the next
    chunk and the decode. Returns, on the front, the last token's logits and the front's shard (no bytes by kind:
    the all-gathers of partial outputs are all it sends)."""
    model, layout = ctx.model(seg.rope)
    shard, _ = ctx.shards.get(seg.request_id) or (empty_shards(layout, ctx.device), seg.rope)
    ctx.shards[seg.request_id] = shard, seg.rope
    logits = kvp_forward(model.model, shard, ctx.transport, list(seg.tokens), owner=ctx.rank == seg.owner,
                         emit=ctx.rank == ctx.front)
    return logits, shard, {}

