"""A decode step of a Llama's or a Gemma 3's rows, run over its modules' weights without their forwards (vLLM's own
model code does the same): each row's token through the layers, its K,V written into its blocks of the rank's pool
and its query attending them with our kernel (a sliding layer's window its parameter), in one pass over the weights.

transformers' forward around the same ops adds its module calls, its cache and mask plumbing and the attention
interface's dispatch, and writes its norms and rotary as several ops each (what that costs a step:
experiments/kv_pool/README.md). Here the ops are transformers' own (its MLP's activation, its rotary's sums, its
norms; a Llama's float32 norm as one ``torch.rms_norm``), so the logits are the model's forward's within rounding,
and on the hosts measured equal to the bit in bfloat16 (tests/test_direct_rows.py).

Taken only where the model is one of ``FAMILIES`` as transformers loads it (``takes``): no hook on a module (a TP
group's all-reduce is one), and every layer of the family's classes. Anything else decodes through the model's
forward (serve/step/rows.mixed_forward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvrunahead.kernels import attention as kernel
from kvrunahead.model.linears import GroupedLinear, PackedLinear
from kvrunahead.model.paged import PagedKV


@dataclass(frozen=True)
class Family:
    """The classes of one model family as transformers names them, and how one of its layers runs a row."""
    layer: str
    attention: str
    mlp: str
    gemma: bool  # Gemma 3: q/k norms, a norm after attention and around the MLP, a rotary per layer type


FAMILIES = {
    "LlamaForCausalLM": Family("LlamaDecoderLayer", "LlamaAttention", "LlamaMLP", gemma=False),
    "Gemma3ForCausalLM": Family("Gemma3DecoderLayer", "Gemma3Attention", "Gemma3MLP", gemma=True),
}


def takes(model: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Whether ``model``'s decode rows in ``dtype`` run here: one of ``FAMILIES`` as loaded, on our CPU kernel."""
    family = FAMILIES.get(type(model).__name__)
    config = model.config
    if family is None or not kernel.usable(torch.empty(0, dtype=dtype)):
        return False
    if getattr(config, "pretraining_tp", 1) != 1 or getattr(config, "attn_logit_softcapping", None) is not None:
        return False
    if any(type(layer).__name__ != family.layer or type(layer.self_attn).__name__ != family.attention
           or type(layer.mlp).__name__ != family.mlp for layer in model.model.layers):
        return False
    return not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def _linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if isinstance(module, PackedLinear) and x.dtype == module.weight.dtype:
        return torch.ops.mkldnn._linear_pointwise(x, module.packed, module.bias, "none", [], "")
    return F.linear(x, module.weight, module.bias)


def _product(members: list[torch.nn.Linear], x: torch.Tensor) -> torch.Tensor:
    """The ``members``' outputs side by side: one product where they are one packed group in this order."""
    first = members[0]
    if isinstance(first, GroupedLinear) and first.group.members == members and x.dtype == first.weight.dtype:
        return first.group.product(x)
    return torch.cat([_linear(m, x) for m in members], dim=-1)


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The norm's result: a ``LlamaRMSNorm`` in float32 as ``torch.rms_norm`` (the same ops fused); else its own
    steps (in bfloat16 it rounds the normalised row to the input's dtype before the weight; Gemma 3's scales by
    ``1 + weight``)."""
    if type(norm).__name__ == "LlamaRMSNorm" and x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return torch.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    return norm(x)


def _rotate(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb`` on queries and keys at once (``[rows, heads, head_dim]``)."""
    half = qk.shape[-1] // 2
    return qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin


def _rotary(base: torch.nn.Module, h: torch.Tensor, positions: torch.Tensor, family: Family) -> list[tuple]:
    """Each layer's ``(cos, sin)`` as ``[rows, 1, head_dim]``: one rotary for a Llama, one per layer type for a
    Gemma 3 (its sliding layers' base differs), each computed once for the step."""
    def per(*layer_type):
        return tuple(t[0].unsqueeze(1) for t in base.rotary_emb(h, positions, *layer_type))
    if not family.gemma:
        return [per()] * len(base.layers)
    types = base.config.layer_types
    made = {t: per(t) for t in set(types)}
    return [made[t] for t in types]


def _layer(layer: torch.nn.Module, h: torch.Tensor, i: int, kv: PagedKV, slots: torch.Tensor, tables: tuple,
           cos_sin: tuple, family: Family) -> torch.Tensor:
    """One layer on the step's rows ``h`` (``[rows, hidden]``): the rows' K,V into their blocks, their attention
    over them, the MLP; the next layer's input."""
    attention, mlp, n = layer.self_attn, layer.mlp, h.shape[0]
    d = attention.head_dim
    x = _rms_norm(layer.input_layernorm, h)
    qkv = _product([attention.q_proj, attention.k_proj, attention.v_proj], x)
    q_size = attention.q_proj.out_features
    heads, qk_size = q_size // d, q_size + attention.k_proj.out_features
    qk = qkv[:, :qk_size].view(n, -1, d)
    if family.gemma:
        qk = torch.cat((attention.q_norm(qk[:, :heads]), attention.k_norm(qk[:, heads:])), dim=1)
    qk = _rotate(qk, *cos_sin)
    kv.write_rows(i, slots, qk[:, heads:], qkv[:, qk_size:].view(n, -1, d))
    keys, values = kv.kernel_views(i)
    out = torch.ops.kvr.attention(qk[:, :heads].transpose(0, 1).unsqueeze(0).contiguous(), [keys], [values],
                                  *tables, True, int(kv.layout.window(i) or 0), float(attention.scaling), False)[0]
    out = _linear(attention.o_proj, out.reshape(n, -1))
    if family.gemma:
        h = h + layer.post_attention_layernorm(out)
        x = layer.pre_feedforward_layernorm(h)
    else:
        h = h + out
        x = _rms_norm(layer.post_attention_layernorm, h)
    gate, up = _product([mlp.gate_proj, mlp.up_proj], x).split(mlp.gate_proj.out_features, dim=-1)
    out = _linear(mlp.down_proj, mlp.act_fn(gate) * up)
    return h + (layer.post_feedforward_layernorm(out) if family.gemma else out)


@torch.no_grad()
def decode_rows(model: torch.nn.Module, kv: PagedKV, owners: list[str], tokens: list[int], positions: list[int]
                ) -> list[torch.Tensor]:
    """Token ``tokens[j]`` of ``owners[j]`` at its next position ``positions[j]`` (the length its blocks hold)
    through ``model`` (``takes``); each row's next-token logits ``[vocab]``. Each row's K,V go into its blocks."""
    for owner, position in zip(owners, positions):
        if kv.length(owner) != position:
            raise RuntimeError(f"{owner}: its next position is {position} but its K,V hold {kv.length(owner)}")
    base, device, family = model.model, kv.device, FAMILIES[type(model).__name__]
    slots = torch.tensor([kv.grow(o) for o in owners], device=device)
    tables = kv.tables(owners)
    h = base.embed_tokens(torch.tensor([tokens], device=device))
    rotary = _rotary(base, h, torch.tensor([positions], device=device), family)
    h = h[0]
    for i, layer in enumerate(base.layers):
        h = _layer(layer, h, i, kv, slots, tables, rotary[i], family)
    logits = model.lm_head(_rms_norm(base.norm, h))
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap is not None:  # transformers' order: divide, tanh, multiply
        logits = torch.tanh(logits / cap) * cap
    return list(logits)
