"""One TSP rank's forward in one process against the simulator's sum for it (no link, no second rank).

TSP's last rank at context C computes C/2 queries against all C keys under an explicit mask (its rows of the full
score matrix), then its projections and MLP. This runs exactly that forward on the real model (the other rank's K,V
put in the cache first, as the all-gather leaves it) and the masked kernel alone, and prints the simulator's
per-layer terms beside them, so that a gap in ``own.py``'s TSP rows can be split into kernel, linear layers and
what only two ranks running at once add (run two copies pinned to one core each for that). ``--kernel-fit``: the
masked kernel timed at kvr-calibrate's shapes and fitted as it fits them, with and without the chunk shapes (fewer
than 256 queries) and with kvr-calibrate's growth term, and what each fit predicts for the longest rectangle.

  OMP_NUM_THREADS=1 python experiments/sim_validation/tsp_layer.py --profile kvrunahead/sim/profiles/cpu-t1.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvrunahead.calibrate.calibrate import ATTENTION_SHAPES, MASKED_MIN_QUERIES, _fit, _median_time
from kvrunahead.model.forward import fill_cache
from kvrunahead.model.load import load_model
from kvrunahead.sim.costmodel import CostModel
from kvrunahead.sim.profile import HardwareProfile, key_doublings
from kvrunahead.sim.shape import shape_from_config


def kernel_fit(attn, heads: int, kv_heads: int, dim: int, flops_per_pair: float) -> None:
    def masked(q: int, k: int):
        gen = torch.Generator().manual_seed(q * 31 + k)
        qt, kt, vt = (torch.randn(1, h, n, dim, generator=gen) for h, n in ((heads, q), (kv_heads, k), (kv_heads, k)))
        mask = (torch.arange(k)[None, :] <= torch.arange(k - q, k)[:, None])[None, None]
        return lambda: sdpa_attention_forward(attn, qt, kt, vt, mask, scaling=dim ** -0.5)

    with torch.no_grad():
        rows = [(q, k, _median_time(masked(q, k), 3)) for q, k in ATTENTION_SHAPES]
    for q, k, t in rows:
        print(f"masked {q:5d} x {k:5d}: {1e3 * t:8.1f} ms, {1e9 * t / (q * k):6.2f} ns per pair")
    q_last, k_last = max((q, k) for q, k, _ in rows)
    wholes = [r for r in rows if r[0] >= MASKED_MIN_QUERIES]
    for name, chosen, growth in (("all shapes", rows, False), ("256 queries or more", wholes, False),
                                 ("256 queries or more, with the growth per key doubling", wholes, True)):
        cols = [[1.0] * len(chosen), [q for q, _, _ in chosen], [k for _, k, _ in chosen],
                [q * k * flops_per_pair for q, k, _ in chosen]]
        if growth:
            cols.append([q * k * key_doublings(k) for q, k, _ in chosen])
        c, worst = _fit(cols, [t for _, _, t in chosen])
        at = c[0] + c[1] * q_last + c[2] * k_last + c[3] * q_last * k_last * flops_per_pair
        at += c[4] * q_last * k_last * key_doublings(k_last) if growth else 0.0
        measured = next(t for q, k, t in rows if (q, k) == (q_last, k_last))
        print(f"fit on {name}: {1e9 * c[3] * flops_per_pair:.2f} ns per pair, worst residual {100 * worst:.1f}%, "
              f"{q_last} x {k_last} predicted {at:.3f} s against {measured:.3f} s ({100 * (at / measured - 1):+.1f}%)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="kvrunahead/sim/profiles/cpu-t1.json")
    ap.add_argument("--ctx", type=int, default=12288, help="context C; the rank holds C/2 queries")
    ap.add_argument("--kernel-fit", action="store_true",
                    help="also time the masked kernel at kvr-calibrate's shapes and fit it")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = load_model("smollm2-135m", torch.float32, torch.device("cpu"), seed=0).model
    ctx, n = args.ctx, args.ctx // 2
    gen = torch.Generator().manual_seed(0)
    cache = DynamicCache(config=model.config)
    fill_cache(model, torch.randint(0, 1000, (1, ctx - n), generator=gen), cache)  # the gathered K,V
    pos = torch.arange(ctx - n, ctx)[None]
    mask = (torch.arange(ctx)[None, :] <= pos[0][:, None])[None, None]
    with torch.no_grad():
        t0 = time.perf_counter()
        fill_cache(model, torch.randint(0, 1000, (1, n), generator=gen), cache, position_ids=pos, attention_mask=mask)
        forward_s = time.perf_counter() - t0
        cfg = model.config
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        dim = cfg.hidden_size // heads
        q, k, v = (torch.randn(1, h, m, dim, generator=gen) for h, m in ((heads, n), (kv_heads, ctx), (kv_heads, ctx)))
        attn = model.base_model.layers[0].self_attn
        kernel_s = _median_time(lambda: sdpa_attention_forward(attn, q, k, v, mask, scaling=dim ** -0.5), 3)
    cm = CostModel(shape_from_config(cfg, "float32"), HardwareProfile.load(Path(args.profile)))
    if args.kernel_fit:
        kernel_fit(attn, heads, kv_heads, dim, cm.shape.flops_per_pair)
    sim = {"masked kernel": cm.masked_s(n, ctx), "projections, MLP, layer": cm.qkv_s(n) + cm.other_s(n),
           "cache copy": cm.copy_s(cm.kv_bytes(ctx))}
    layers = cm.layers
    real_kernel, real_rest = kernel_s, forward_s / layers - kernel_s
    print(f"TSP last rank at {ctx} tokens ({n} queries x {ctx} keys), {layers} layers, profile {args.profile}")
    print(f"forward      measured {forward_s:7.2f} s   simulated {layers * sum(sim.values()):7.2f} s")
    print(f"per layer    kernel measured {real_kernel:.3f} s, simulated {sim['masked kernel']:.3f} s; the rest "
          f"measured {real_rest:.3f} s, simulated {sim['projections, MLP, layer'] + sim['cache copy']:.3f} s")


if __name__ == "__main__":
    main()
