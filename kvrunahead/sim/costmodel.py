"""The time of every per-layer step on one rank: a model's shape (``shape``) on a device (``profile``).

Per layer, a rank with n tokens runs its Q,K,V projections, its attention over k keys, and the output
projection and MLP; the emitting rank ends with the LM head on its last token. Attention is priced by the
query-key pairs its kernel computes: a flash kernel skips the masked half of a causal diagonal block, an
explicit mask (the paper's KVR, TSP, cp-allgather) computes every pair of its rectangle. A sliding-window layer
keeps and hands on only the last ``window - 1`` positions of the prefix, and attends in blocks of ``window``
queries against the keys each block's window reaches (modes/kvr.py ``window_attention``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvrunahead.sim.profile import AttentionCost, HardwareProfile, LinkProfile, key_doublings
from kvrunahead.sim.shape import ModelShape


@dataclass(frozen=True)
class CostModel:
    """``tp`` > 1: one rank of a TP group (``over_tp``): its shard's shape, and two all-reduces of every token's
    hidden state per layer (after attention and after the MLP) on ``tp_link_label``'s link."""

    shape: ModelShape
    profile: HardwareProfile
    link_label: str | None = None
    tp: int = 1
    tp_link_label: str | None = None

    def over_tp(self, tp: int, link_label: str | None = None) -> CostModel:
        """The cost of one rank of a TP group of ``tp`` ranks, its all-reduces on ``link_label``'s link."""
        if self.tp != 1:
            raise ValueError("over_tp takes the whole model's cost")
        return dataclasses.replace(self, shape=self.shape.tp_shard(tp), tp=tp, tp_link_label=link_label)

    def allreduce_s(self, tokens: float) -> float:
        """One all-reduce of ``tokens`` hidden states over the TP group: a ring's 2 (tp - 1) steps, each moving
        1/tp of the bytes at the link's rate after its latency."""
        if self.tp == 1 or tokens <= 0:
            return 0.0
        link = self.profile.link(self.tp_link_label)
        nbytes = tokens * self.shape.hidden * self.shape.dtype_bytes
        steps = 2 * (self.tp - 1)
        return steps * (link.latency_s + nbytes / self.tp / link.bandwidth_Bps)

    @property
    def layers(self) -> int:
        return self.shape.layers

    @property
    def link(self) -> LinkProfile:
        return self.profile.link(self.link_label)

    def _matmul_s(self, flops_per_token: float, tokens: float) -> float:
        if tokens <= 0:
            return 0.0
        p = self.profile
        return flops_per_token * (tokens + p.matmul_half_tokens) / p.matmul_flops_per_s

    def qkv_s(self, tokens: float) -> float:
        """Layer overhead plus the Q,K,V projections: what a rank does before it needs the prefix K,V."""
        return self.profile.layer_s + self._matmul_s(self.shape.qkv_flops_per_token, tokens)

    def other_s(self, tokens: float) -> float:
        """Output projection and MLP (with TP, their two all-reduces)."""
        return self._other_matmul_s(tokens) + 2 * self.allreduce_s(tokens)

    def _other_matmul_s(self, tokens: float) -> float:
        return self._matmul_s(self.shape.other_flops_per_token, tokens)

    def _kernel_s(self, kernel: AttentionCost, queries: float, keys: float, pairs: float) -> float:
        s = self.shape
        per_pair = (s.flops_per_pair / kernel.flops_per_s + s.heads * kernel.score_bytes / self.profile.memory_Bps
                    + kernel.pair_growth_s * key_doublings(keys))
        return kernel.call_s + kernel.query_s * queries + kernel.key_s * keys + per_pair * pairs

    def causal_s(self, tokens: float) -> float:
        """A diagonal block: ``tokens`` queries against themselves under the causal mask."""
        kernel = self.profile.attention["causal"]
        pairs = tokens * (tokens + 1) / 2 if kernel.skips_masked else tokens * tokens
        return self._kernel_s(kernel, tokens, tokens, pairs)

    def full_s(self, queries: float, keys: float) -> float:
        """A block where every key is visible to every query (a prefix, an earlier ring block), log-sum-exp."""
        return self._kernel_s(self.profile.attention["full"], queries, keys, queries * keys)

    def masked_s(self, queries: float, keys: float) -> float:
        """SDPA with an explicit mask: every pair of the rectangle is computed."""
        return self._kernel_s(self.profile.attention["masked"], queries, keys, queries * keys)

    def kept(self, positions: float, layer: int) -> float:
        """How many of ``positions`` earlier positions ``layer`` keeps, attends and hands on: all, or the last
        ``window - 1`` of a sliding-window layer."""
        window = self.shape.window(layer)
        return positions if window is None else min(positions, window - 1)

    def kvr_attention_s(self, attention: str, tokens: float, prefix: float, layer: int = 0) -> float:
        """KV-Runahead's attention for a part of ``tokens`` after ``prefix`` (flops.py's pair counts) in
        ``layer``."""
        window = self.shape.window(layer)
        if window is not None:
            return self.window_attention_s(attention, int(tokens), int(self.kept(prefix, layer)), window)
        if prefix == 0:
            return self.causal_s(tokens)  # rank 0's mask is the plain causal one, in both formulations
        if attention == "split":
            return self.causal_s(tokens) + self.full_s(tokens, prefix)
        return self.masked_s(tokens, prefix + tokens)

    def window_attention_s(self, attention: str, tokens: int, kept: int, window: int) -> float:
        """A sliding-window layer: with split attention each block of ``window`` queries against the keys its
        window reaches under an explicit band mask; with the model's own (masked) attention, one masked call over
        the kept prefix and the part."""
        if attention != "split":
            return self.masked_s(tokens, kept + tokens)
        if tokens <= 0:
            return 0.0

        def block(a: int) -> float:  # the queries [a, a + window) of the part
            e = min(a + window, tokens)
            return self.masked_s(e - a, kept + e - max(0, kept + a - window + 1))

        whole = tokens // window  # every whole block after the first costs the same: its window, and one before
        last = whole * window
        return (block(0) + max(whole - 1, 0) * block(window)
                + (block(last) if 0 < last < tokens else 0.0))

    def copy_s(self, nbytes: float) -> float:
        return nbytes / self.profile.memory_Bps

    def transfer_cpu_s(self, nbytes: float) -> float:
        """Compute a rank loses to a transfer it sends or receives (the copies run on its cores)."""
        return nbytes * self.link.compute_s_per_byte

    def kv_bytes(self, tokens: float) -> float:
        return tokens * self.shape.kv_bytes_per_token

    def lm_head_s(self) -> float:
        s, p = self.shape, self.profile
        return max(2.0 * s.hidden * s.vocab / p.matmul_flops_per_s, s.lm_head_bytes / p.memory_Bps)

    def decode_step_s(self, contexts: list[int], parts: int = 1) -> float:
        """One decode step of ``len(contexts)`` requests, each new token attending its context: on one rank
        (``parts`` 1), or KV-cache parallel over ``parts`` ranks, each attending its share of every context and
        exchanging (output, log-sum-exp) per layer with the others (decode/kvp.py), latency-bound. A step of a
        few tokens is bound by reading the weights and the K,V, not by its FLOPs: each part takes the longer."""
        s = self.shape
        b = len(contexts)
        exchange = 0.0
        if parts > 1:
            nbytes = b * s.heads * (s.head_dim + 1) * 4
            exchange = (parts - 1) * (self.link.latency_s + nbytes / self.link.bandwidth_Bps)
        # a new token attends the positions its layer keeps before it, and itself
        attend = sum(self.decode_attention_s(-(-(self.kept(c - 1, layer) + 1) // parts))
                     for layer in range(self.layers if s.sliding else 1) for c in contexts)
        if not s.sliding:
            attend *= self.layers  # every layer attends the same keys
        return self.layers * (self.decode_linear_s(b) + exchange) + attend + b * self.lm_head_s()

    def decode_linear_s(self, tokens: int) -> float:
        """One layer's projections and MLP for ``tokens`` decoding tokens: the weights read once, or the FLOPs."""
        s = self.shape
        return (max(self.qkv_s(tokens) + self._other_matmul_s(tokens),
                    s.layer_params * s.dtype_bytes / self.profile.memory_Bps) + 2 * self.allreduce_s(tokens))

    def decode_attention_s(self, context: int) -> float:
        """One layer's attention of one new token over ``context`` keys: the profile's decode kernel where it has
        one (``kvr-calibrate`` times it over each layer's K,V in turn, as a decode step reads them), else the
        prefix kernel for one query; at least the K,V read once at the memory rate."""
        kernel = self.profile.attention.get("decode")
        compute = self._kernel_s(kernel, 1, context, context) if kernel else self.full_s(1, context)
        return max(compute, self.kv_bytes(context) / self.profile.memory_Bps)

    def rank_layer_s(self, attention: str, tokens: float, prefix: float, layer: int = 0) -> float:
        """One KVR layer of one rank without waiting: projections, concatenation, attention, MLP."""
        copy = self.copy_s(self.kv_bytes(self.kept(prefix, layer) + tokens)) if prefix else 0.0
        return (self.qkv_s(tokens) + copy + self.kvr_attention_s(attention, tokens, prefix, layer)
                + self.other_s(tokens))

    def spp_layer_s(self, attention: str, tokens: float, prefix: float, layer: int = 0) -> float:
        """One layer of a pipeline stage on a chunk of ``tokens`` after ``prefix`` positions its cache holds
        (modes/spp.py): the chunk's attention is KV-Runahead's over a held prefix (split, or the model's own
        masked), and its K,V are written into the cache's room (no copy of the prefix)."""
        return (self.qkv_s(tokens) + self.kvr_attention_s(attention, tokens, prefix, layer)
                + self.copy_s(self.kv_bytes(tokens)) + self.other_s(tokens))

    def hidden_bytes(self, tokens: float) -> float:
        """A chunk's hidden states, what one pipeline stage hands the next."""
        return tokens * self.shape.hidden * self.shape.dtype_bytes

