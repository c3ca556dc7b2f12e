"""A decode step of a Llama model's rows, run over its modules' weights without their forwards (vLLM's own model
code does the same): each row's token through the layers, its K,V written into its blocks of the rank's pool and
its query attending them with our kernel, in one pass over the weights.

transformers' forward around the same ops adds its module calls, its cache and mask plumbing and the attention
interface's dispatch, and writes its norms and rotary as several ops each (what that costs a step:
experiments/llama_step/README.md). Here the ops are transformers' own (its MLP, its rotary's sums, in float32 the
norm as one ``torch.rms_norm``), so the logits are the model's forward's within rounding, and on the hosts measured
equal to the bit (tests/test_llama_step.py).

Taken only where the model is transformers' Llama as loaded (``takes``): no hook on a module (a TP group's
all-reduce is one), SiLU, and every layer of Llama's classes. Anything else decodes through the model's forward
(serve/step/rows.mixed_forward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrunahead.kernels import attention as kernel
from kvrunahead.model.linears import GroupedLinear, PackedLinear
from kvrunahead.model.paged import PagedKV

CLASSES = {"model": "LlamaForCausalLM", "layer": "LlamaDecoderLayer", "attention": "LlamaAttention",
           "mlp": "LlamaMLP", "norm": "LlamaRMSNorm"}


def takes(model: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Whether ``model``'s decode rows in ``dtype`` run here: transformers' Llama as loaded, on our CPU kernel."""
    if type(model).__name__ != CLASSES["model"] or getattr(model.config, "hidden_act", None) != "silu":
        return False
    if getattr(model.config, "pretraining_tp", 1) != 1 or not kernel.usable(torch.empty(0, dtype=dtype)):
        return False
    layers = model.model.layers
    if any(type(layer).__name__ != CLASSES["layer"] or type(layer.self_attn).__name__ != CLASSES["attention"]
           or type(layer.mlp).__name__ != CLASSES["mlp"] for layer in layers):
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
    """``LlamaRMSNorm``'s result: in float32 ``torch.rms_norm`` (the same ops fused); else its own steps (it rounds
    the normalised row to the input's dtype before the weight)."""
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return torch.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    return norm(x)


def _rotate(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb`` on queries and keys at once (``[rows, heads, head_dim]``)."""
    half = qk.shape[-1] // 2
    return qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin


@torch.no_grad()
def decode_rows(model: torch.nn.Module, kv: PagedKV, owners: list[str], tokens: list[int], positions: list[int]
                ) -> list[torch.Tensor]:
    """Token ``tokens[j]`` of ``owners[j]`` at its next position ``positions[j]`` (the length its blocks hold)
    through ``model`` (``takes``); each row's next-token logits ``[vocab]``. Each row's K,V go into its blocks."""
    for owner, position in zip(owners, positions):
        if kv.length(owner) != position:
            raise RuntimeError(f"{owner}: its next position is {position} but its K,V hold {kv.length(owner)}")
    base, device, n = model.model, kv.device, len(owners)
    slots = torch.tensor([kv.grow(o) for o in owners], device=device)
    rows, pieces = kv.tables(owners)
    h = base.embed_tokens(torch.tensor([tokens], device=device))
    cos, sin = (t[0].unsqueeze(1) for t in base.rotary_emb(h, torch.tensor([positions], device=device)))
    h = h[0]
    for i, layer in enumerate(base.layers):
        attention = layer.self_attn
        d = attention.head_dim
        x = _rms_norm(layer.input_layernorm, h)
        qkv = _product([attention.q_proj, attention.k_proj, attention.v_proj], x)
        q_size = attention.q_proj.out_features
        heads, qk_size = q_size // d, q_size + attention.k_proj.out_features
        qk = _rotate(qkv[:, :qk_size].view(n, -1, d), cos, sin)
        kv.write_rows(i, slots, qk[:, heads:], qkv[:, qk_size:].view(n, -1, d))
        keys, values = kv.kernel_views(i)
        window = kv.layout.window(i)
        out = torch.ops.kvr.attention(qk[:, :heads].transpose(0, 1).unsqueeze(0).contiguous(), [keys], [values],
                                      rows, pieces, True, int(window or 0), float(attention.scaling), False)[0]
        h = h + _linear(attention.o_proj, out.reshape(n, -1))
        x = _rms_norm(layer.post_attention_layernorm, h)
        mlp = layer.mlp
        gate, up = _product([mlp.gate_proj, mlp.up_proj], x).split(mlp.gate_proj.out_features, dim=-1)
        h = h + _linear(mlp.down_proj, F.silu(gate) * up)
    return list(model.lm_head(_rms_norm(base.norm, h)))
