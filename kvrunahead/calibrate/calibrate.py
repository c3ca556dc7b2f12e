"""Measure a hardware profile on the local device through the runtime's own model code and kernels.

- Projections and MLP: the model's decoder layers over n tokens with the attention call replaced by a no-op
  (registered with transformers' AttentionInterface), divided by the layer count; fitted to
  ``layer_s + FLOPs(n) / matmul rate``.
- Attention: the kernels the modes call, on the model's head shapes: the model's SDPA path with the offset
  causal mask (KVR masked, TSP, cp-allgather), the causal diagonal block and the full prefix block with their
  log-sum-exp merge (KVR split, ring); each fitted to ``call + per query + per key + pairs x FLOPs / rate``, the
  explicit-mask one with its pairs' growth per key doubling and on whole parts only (``_cases``).
- Copies: the cache concatenation; links: ``kvrunahead.calibrate.linkbench`` on two ranks (in namespaces with a cap).
- Whole prefills of the model against the sum of their simulated steps, as a check (``fit["whole_prefill_N"]``).
- The link's compute cost: what a rank's matrix products lose while a block crosses the link (on one host the
  copies run on the same cores), per byte (``LinkProfile.compute_s_per_byte``).
With ``concurrent`` ranks the steps are timed while the others compute the same steps (shared memory bandwidth
and caches, as in a run). Every fit keeps its worst relative residual in ``profile.fit``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import platform
import re
import subprocess
import sys
from collections.abc import Callable

from kvrunahead.calibrate.linkbench import LINK_SIZES, measure_link
from kvrunahead.calibrate.timing import fit, median_time
from kvrunahead.net.spec import parse_net
from kvrunahead.provenance import environment
from kvrunahead.sim.costmodel import CostModel
from kvrunahead.sim.profile import AttentionCost, HardwareProfile, LinkProfile, key_doublings
from kvrunahead.sim.shape import ModelShape, shape_from_config
from kvrunahead.sim.simulate import simulate

# torch, transformers and the model rooms are imported inside the functions that measure: kvr-calibrate's CLI
# imports this module, and its --help and input checks answer without torch.
from kvrunahead.version import __version__

log = logging.getLogger(__name__)

NULL_ATTENTION = "kvrunahead_null"
# A few tokens (a chunk's part, a decode) cost the reading of the layer's weights, whatever their number: the
# smallest counts fix the per-layer constant of the fit.
LINEAR_TOKENS = (8, 32, 256, 1024, 2048, 4096, 8192, 16384)
LINEAR_LAYERS = 4  # decoder layers timed (the first ones of the model): per-layer cost at a fraction of the time
# (queries, keys) of the attention kernels: the parts and prefixes of 1k-16k prompts at p = 2-8.
# Prefills' blocks, and a chunked prefill's (serve/chunking.py): a few dozen queries against a long prefix, where
# the keys' cost no longer hides behind the pairs'.
ATTENTION_SHAPES = ((256, 256), (512, 512), (1024, 1024), (512, 2048), (2048, 2048), (1024, 4096),
                    (2048, 4096), (4096, 4096), (2048, 8192), (8192, 8192), (4096, 16384), (8192, 16384),
                    (32, 4096), (64, 8192), (32, 16384), (128, 16384), (16, 8192), (16, 16384))
MASKED_MIN_QUERIES = 256  # the explicit-mask kernel's fit leaves out the chunk shapes
# Keys of a decode step's attention (one new token against the cache): short chats to the KVP decode's contexts.
DECODE_KEYS = (1024, 4096, 16384, 32768)


def _null_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    import torch

    return torch.zeros_like(query).transpose(1, 2).contiguous(), None


def measure_linear(model, shape: ModelShape, repeats: int, tokens=LINEAR_TOKENS) -> tuple[float, float, float]:
    """(layer_s, matmul FLOP/s, worst residual) of the decoder layers without their attention kernel."""
    import torch

    from kvrunahead.model.attention import attention_mode, register

    register(NULL_ATTENTION, _null_attention)
    device = next(model.parameters()).device
    times = []
    base = model.base_model
    all_layers = base.layers
    used = min(LINEAR_LAYERS, len(all_layers))
    base.layers = all_layers[:used]  # the forward runs the layers it holds
    try:
        with torch.no_grad(), attention_mode(model, NULL_ATTENTION, None):
            for n in tokens:
                ids = torch.zeros((1, n), dtype=torch.long, device=device)
                times.append(median_time(lambda ids=ids: base(input_ids=ids, use_cache=False), repeats) / used)
                log.info("linear n=%d: %.4f s per layer", n, times[-1])
    finally:
        base.layers = all_layers
    flops = shape.qkv_flops_per_token + shape.other_flops_per_token
    coef, worst = fit([[1.0] * len(tokens), [flops * n for n in tokens]], times)
    return float(coef[0]), 1.0 / max(float(coef[1]), 1e-30), worst


def measure_attention(model, shape: ModelShape, repeats: int, shapes=ATTENTION_SHAPES) -> tuple[dict, dict]:
    """Each kernel's ``AttentionCost`` and worst residual."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvrunahead.model.attention import expand_kv
    from kvrunahead.modes.attention import attend_with_lse, merge_lse

    module = model.base_model.layers[0].self_attn
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    scale = shape.head_dim ** -0.5
    kernels: dict[str, AttentionCost] = {}
    worst: dict[str, float] = {}

    def tensors(q, k):  # drawn where they are used: a GPU's 128k-key blocks drawn on one host thread take minutes
        g = torch.Generator(device=device).manual_seed(q * 31 + k)
        return tuple(torch.randn(1, heads, n, shape.head_dim, generator=g, device=device, dtype=dtype)
                     for heads, n in ((shape.heads, q), (shape.kv_heads, k), (shape.kv_heads, k)))

    def causal(q, k):  # a diagonal block, as split and ring attend it (q == k)
        qt, kt, vt = tensors(q, q)
        return lambda: attend_with_lse(qt, expand_kv(kt, shape.heads), expand_kv(vt, shape.heads), True, scale)

    def full(q, k):  # a prefix block, merged by log-sum-exp into the rank's diagonal block
        qt, kt, vt = tensors(q, k)
        out = torch.zeros(1, shape.heads, q, shape.head_dim, dtype=torch.float32, device=device)
        lse = torch.zeros(1, shape.heads, q, dtype=torch.float32, device=device)

        def run():  # K,V with the model's heads, as split, ring and KVP pass them (never repeated per query head)
            o, s = attend_with_lse(qt, kt, vt, False, scale)
            return merge_lse(out, lse, o, s)
        return run

    def masked(q, k):  # the model's SDPA with the offset causal mask (queries are the last q of k positions)
        qt, kt, vt = tensors(q, k)
        qpos = torch.arange(k - q, k, device=device)[:, None]
        mask = (torch.arange(k, device=device)[None, :] <= qpos)[None, None]
        return lambda: sdpa_attention_forward(module, qt, kt, vt, mask, scaling=scale)

    pairs_of = {"causal": lambda q, k: q * (q + 1) / 2, "full": lambda q, k: q * k, "masked": lambda q, k: q * k}
    with torch.no_grad():
        for name, make in (("causal", causal), ("full", full), ("masked", masked)):
            cases = _cases(name, shapes)
            times = [median_time(make(q, k), repeats) for q, k in cases]
            cols = [[1.0] * len(cases), [q for q, _ in cases], [k for _, k in cases],
                    [pairs_of[name](q, k) * shape.flops_per_pair for q, k in cases]]
            if name == "masked":  # its pairs cost more as the rectangle grows: seconds per pair and key doubling
                cols.append([pairs_of[name](q, k) * key_doublings(k) for q, k in cases])
            coef, worst[name] = fit(cols, times)
            kernels[name] = AttentionCost(flops_per_s=1.0 / max(float(coef[3]), 1e-30), call_s=float(coef[0]),
                                          query_s=float(coef[1]), key_s=float(coef[2]), skips_masked=True,
                                          pair_growth_s=float(coef[4]) if len(coef) > 4 else 0.0)
            log.info("attention %s: %.3g FLOP/s, worst residual %.1f%%", name, kernels[name].flops_per_s,
                     100 * worst[name])
    return kernels, worst


def _cases(kernel: str, shapes) -> list[tuple[int, int]]:
    """The shapes a kernel is fitted on: the causal block at each query count; the explicit-mask kernel at whole
    parts only (TSP, cp-allgather and KVR masked call it on a rank's part; a chunk of a few dozen queries costs
    2-7x more per pair there and would drag the rate the long rectangles take); the prefix block at all."""
    if kernel == "causal":
        return sorted({(q, q) for q, _ in shapes})
    if kernel == "masked":
        return [(q, k) for q, k in shapes if q >= MASKED_MIN_QUERIES] or list(shapes)
    return list(shapes)


def measure_decode(model, shape: ModelShape, repeats: int, keys=DECODE_KEYS) -> tuple[AttentionCost, float]:
    """One new token's attention over n keys as a decode step runs it (transformers' SDPA, the model's K,V heads,
    no mask), every layer's K,V apart: a decode step reads each layer's cache from memory once, and a kernel timed
    on one layer's K,V over and over reads it from the caches instead (at 32k keys the two differ by about 2x
    here). Per layer: a fixed cost and a rate on the keys; the worst residual."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = model.base_model.layers[0].self_attn
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    scale = shape.head_dim ** -0.5
    q = torch.randn(1, shape.heads, 1, shape.head_dim, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    times = []
    with torch.no_grad():
        for n in keys:
            cache = torch.empty(shape.layers, 2, 1, shape.kv_heads, n, shape.head_dim, device=device,
                                dtype=dtype).uniform_(-1, 1)

            def step(cache=cache):
                for layer in cache:
                    sdpa_attention_forward(module, q, layer[0], layer[1], None, scaling=scale)
            times.append(median_time(step, repeats) / shape.layers)
            log.info("decode attention n=%d: %.4f ms per layer", n, 1e3 * times[-1])
            del cache
    coef, worst = fit([[1.0] * len(keys), [n * shape.flops_per_pair for n in keys]], times)
    return AttentionCost(flops_per_s=1.0 / max(float(coef[1]), 1e-30), call_s=float(coef[0])), worst


WHOLE_TOKENS = (1024, 4096)


def measure_whole(model, repeats: int, tokens=WHOLE_TOKENS) -> list[tuple[int, float]]:
    """Whole prefills of the model (its own SDPA, causal, LM head on the last token) at a few lengths."""
    import torch

    from kvrunahead.model.forward import last_token_logits

    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for n in tokens:
            ids = torch.zeros((1, n), dtype=torch.long, device=device)
            out.append((n, median_time(lambda ids=ids: last_token_logits(model, ids), repeats)))
    return out


def measure_copy(repeats: int, tokens: int = 8192, bytes_per_token: int = 1536, device: str = "cpu") -> float:
    """Bytes per second of the cache concatenation (prefix and own K,V into one tensor). On a GPU the tensors are
    64 times larger: 12 MB would stay in its L2 cache, which a long prompt's K,V does not."""
    import torch

    scale = 64 if device != "cpu" else 1
    a = torch.zeros(bytes_per_token * tokens * scale // 8, device=device)
    b = torch.zeros(bytes_per_token * tokens * scale // 8, device=device)
    return 2 * a.numel() * 4 / median_time(lambda: torch.cat((a, b)), repeats)


def _companion(model_name: str, dtype: str, threads: int, repeats: int, quick: bool) -> None:
    """Another rank while one is timed: the same measurements in the same order (so both ranks run the same
    step at the same time, as in a run), over and over until terminated. Starts on 'go' from stdin."""
    import torch

    from kvrunahead.model.load import load_model, resolve_config

    torch.set_num_threads(threads)
    model = load_model(model_name, getattr(torch, dtype), torch.device("cpu")).model
    shape = shape_from_config(resolve_config(model_name), dtype, model_name)
    linear, attention = _shapes(quick)
    print("ready", flush=True)
    sys.stdin.readline()
    while True:
        measure_linear(model, shape, repeats, linear)
        measure_attention(model, shape, repeats, attention)
        measure_decode(model, shape, repeats, DECODE_KEYS[:2] if quick else DECODE_KEYS)


# On a GPU the shapes of 4k-128k prompts, 8 times the CPU's: a GPU's kernels reach their rate only on large
# blocks (on an H100, the causal kernel fitted on 256-8k blocks predicted a 128k prefill 56% slow).
GPU_SCALE = 8
GPU_LINEAR_TOKENS = (*LINEAR_TOKENS, 32768, 65536)
GPU_WHOLE_TOKENS = (4096, 32768)


def _shapes(quick: bool, gpu: bool = False):
    if gpu:
        attention = tuple((q * GPU_SCALE, k * GPU_SCALE) for q, k in ATTENTION_SHAPES)
        return (GPU_LINEAR_TOKENS[:4], attention[:6]) if quick else (GPU_LINEAR_TOKENS, attention)
    return (LINEAR_TOKENS[:4], ATTENTION_SHAPES[:6]) if quick else (LINEAR_TOKENS, ATTENTION_SHAPES)


@contextlib.contextmanager
def companions(count: int, model_name: str, dtype: str, threads: int, repeats: int, quick: bool):
    """``count`` processes measuring the same steps beside the timed one, in step with it, as the other ranks
    of a run compute beside it (they share the machine's memory bandwidth and caches)."""
    procs = [subprocess.Popen([sys.executable, "-m", "kvrunahead.calibrate.calibrate", model_name, dtype, str(threads),
                               str(repeats), str(int(quick))], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for _ in range(count)]
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a companion rank of the calibration failed to start")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        yield
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()


def gpu_profile_name(device_name: str) -> str:
    """A measured GPU profile's name from the GPU's: ``h100-measured`` for 'NVIDIA H100 80GB HBM3'."""
    family = re.search(r"\b([ABHL]\d{1,3}S?|B200|GB200)\b", device_name.upper())
    return f"{family.group(1).lower() if family else 'gpu'}-measured"


def calibrate(model_name: str = "smollm2-135m", dtype: str = "float32", threads: int = 1,
              nets: tuple[str, ...] = ("loopback",), repeats: int = 3, quick: bool = False,
              on_step: Callable[[str], None] | None = None, concurrent: int = 1,
              device: str = "cpu") -> HardwareProfile:
    """Measure a profile; with ``concurrent`` > 1 the compute steps are timed while that many ranks compute
    in all (the others run the same layers), as in a run of that many ranks on this machine. On ``device``
    "cuda" one GPU is timed alone (every rank of a GPU node has its own) and no link is measured here (``nets``
    must be empty: one GPU has no peer; the caller takes a link from a built-in profile)."""
    import torch
    import transformers

    from kvrunahead.model.load import load_model, resolve_config

    gpu = device != "cpu"
    if gpu and (nets or concurrent > 1):
        raise ValueError("on a GPU the profile is measured on one GPU alone, without a link (no --net, --ranks 1)")
    step = on_step or (lambda s: None)
    torch.set_num_threads(threads)
    torch_dtype = getattr(torch, dtype)
    shape = shape_from_config(resolve_config(model_name), dtype, model_name)
    model = load_model(model_name, torch_dtype, torch.device(device)).model
    linear_tokens, attention_shapes = _shapes(quick, gpu)
    whole_tokens = GPU_WHOLE_TOKENS if gpu else WHOLE_TOKENS
    with companions(concurrent - 1, model_name, dtype, threads, repeats, quick):
        step(f"projections and MLP at {', '.join(map(str, linear_tokens))} tokens"
             + (f", {concurrent - 1} other rank(s) computing" if concurrent > 1 else ""))
        layer_s, matmul, linear_worst = measure_linear(model, shape, repeats, linear_tokens)
        step(f"attention kernels at {len(attention_shapes)} shapes")
        kernels, attention_worst = measure_attention(model, shape, repeats, attention_shapes)
        decode_keys = DECODE_KEYS[:2] if quick else DECODE_KEYS
        step(f"decode attention over {', '.join(map(str, decode_keys))} keys")
        kernels["decode"], attention_worst["decode"] = measure_decode(model, shape, repeats, decode_keys)
        step("memory copies")
        memory = measure_copy(repeats, device=device)
        step(f"whole prefills at {', '.join(map(str, whole_tokens))} tokens")
        whole = measure_whole(model, repeats, whole_tokens[:1] if quick else whole_tokens)
    links, link_worst = {}, {}
    for net in nets:
        label = parse_net(net).table_label  # as runs and tables name the network
        step(f"link on {label} (2 ranks)")
        links[label], link_worst[label], _ = measure_link(net, repeats, LINK_SIZES[:3] if quick else LINK_SIZES)
    env = environment(model_name, "torch", threads, next(iter(links), "loopback"))
    if gpu:
        name = torch.cuda.get_device_name()
        what = (f"{name}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB", gpu_profile_name(name),
                f"one GPU alone, {dtype}")
    else:
        what = (f"{env['cpu']}, {env['cores']} cores", f"cpu-t{threads}",
                f"{dtype}, {threads} thread(s) per rank, {concurrent} rank(s) computing")
    profile = HardwareProfile(
        name=what[1], device=what[0],
        matmul_flops_per_s=matmul, matmul_half_tokens=0.0, memory_Bps=memory, layer_s=layer_s,
        attention=kernels, threads=threads, dtype=dtype, device_kind="cuda" if gpu else "cpu",
        # --no-link: a placeholder the CLI replaces with the shipped (or built-in GPU) profile's links
        links=links or {"loopback": LinkProfile(2.5e9)}, default_link=next(iter(links), "loopback"),
        versions={"torch": torch.__version__, "transformers": transformers.__version__, "kvrunahead": __version__,
                  "python": platform.python_version(),
                  **({"cuda": str(torch.version.cuda)} if gpu else {})},
        sources={"calibrated": f"kvr-calibrate on {model_name} ({what[2]})",
                 "shape": json.dumps(shape.to_dict())},
        fit={"linear": round(linear_worst, 4), **{f"attention_{k}": round(v, 4) for k, v in attention_worst.items()},
             **{f"link_{k}": round(v, 4) for k, v in link_worst.items()}})
    # A check, not a correction: a whole prefill against the sum of its steps as the simulator adds them.
    cost = CostModel(shape, profile)
    for n, t in whole:
        profile.fit[f"whole_prefill_{n}"] = round(simulate(cost, "single", n, 1).ttft_s / t - 1, 4)
    return profile


if __name__ == "__main__":
    _companion(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), bool(int(sys.argv[5])))
