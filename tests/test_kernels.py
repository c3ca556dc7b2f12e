"""The CPU attention kernel (kvrunahead/kernels) against float64 math, for every shape family the engine hands it,
on every instruction set this CPU has; its fallback where it cannot be built; a compiled graph that carries it.

The bound is derived from the roundings, not from the largest logit. With ``A = sum_j p_j |v_j|`` (what the output
is a weighted mean of) and ``S`` the largest ``scale * sum_t |q_t k_t|`` over the row's visible keys (how large the
score sums get before their rounding):
- the scores are float32 dot products: each off by at most ``d * u32 * S``, which moves every weight by that
  relative amount, twice over (numerator and normalisation): ``2 d u32 S A``;
- bfloat16 inputs: the probabilities are rounded to bfloat16 for the P.V products (relative ``u16``) and summed
  unrounded: ``2 u16 A``;
- the output's own rounding: ``u_out |o|``;
with u the unit roundoff (half of eps), and twice the whole for the float32 sums' own order.
"""

from __future__ import annotations

import fcntl
import math
import os
import subprocess
import sys

import pytest
import torch

from kvrunahead import kernels
from kvrunahead.kernels import attention as kernel

pytestmark = pytest.mark.skipif(not kernels.build(), reason="the CPU attention kernel could not be built here")

U32 = 2.0 ** -24
U16 = 2.0 ** -8


def _isas() -> list[str]:
    """The vector path at each instruction set this CPU has, then the tile path (prefill rows through ATen's
    batch-reduce GEMM) where it has AVX2."""
    if not kernels.build():
        return ["portable"]
    host = torch.ops.kvr.isa()
    order = ["portable", "avx2", "avx512", "avx512bf16"]
    return order[: order.index(host) + 1] + (["tiles"] if host != "portable" else [])


@pytest.fixture(params=_isas())
def isa(request, monkeypatch):
    if request.param == "tiles":
        monkeypatch.delenv("KVR_ATTENTION_ISA", raising=False)
        monkeypatch.setenv("KVR_ATTENTION_TILES", "1")
    else:
        monkeypatch.setenv("KVR_ATTENTION_ISA", request.param)
        monkeypatch.setenv("KVR_ATTENTION_TILES", "0")
    return request.param


def test_the_tile_path_is_what_prefill_rows_take_where_it_is_on(monkeypatch):
    """KVR_ATTENTION_TILES turns it on and off in both dtypes; AMX tiles (bfloat16 in VNNI pairs) only where the
    CPU has them, and said so where it does not."""
    if torch.ops.kvr.isa() == "portable":
        pytest.skip("no AVX2 on this CPU: the tile path does not run here")
    monkeypatch.setenv("KVR_ATTENTION_TILES", "0")
    assert kernels.path("float32") == kernels.path("bfloat16") == kernels.isa()
    monkeypatch.setenv("KVR_ATTENTION_TILES", "1")
    amx = kernels.path("bfloat16") == "amx"
    assert kernels.path("float32") == "brgemm" and kernels.path("bfloat16") in ("amx", "brgemm")
    monkeypatch.setenv("KVR_ATTENTION_TILES", "yes")
    with pytest.raises(RuntimeError, match="neither 0 nor 1"):
        kernels.path("float32")
    if not amx:
        pytest.skip("no AMX on this CPU: the tile path's bfloat16 runs oneDNN's kernels on plain blocks here, and "
                    "its VNNI packing for AMX is not exercised")


def reference(q, rows, causal, window, scale):
    """float64 attention of ``rows`` (kernel.Row) of ``q``; returns output [B, n, heads, d], lse [B, heads, n],
    A and S per query (see the module's docstring), with -inf lse and zero output where a query sees nothing."""
    b_, heads, n, d = q.shape
    out = torch.zeros(b_, n, heads, d, dtype=torch.float64)
    lse = torch.full((b_, heads, n), -math.inf, dtype=torch.float64)
    mass = torch.zeros(b_, n, heads, 1, dtype=torch.float64)
    size = torch.zeros(b_, n, heads, 1, dtype=torch.float64)
    for row in rows:
        ks, vs, pos = [], [], []
        for p in row.pieces:
            hi = p.keys.shape[2] if p.hi is None else p.hi
            ks.append(p.keys[p.batch, :, p.lo:hi].double())
            vs.append(p.values[p.batch, :, p.lo:hi].double())
            pos.append(torch.arange(p.position, p.position + hi - p.lo))
        k, v, kpos = torch.cat(ks, 1), torch.cat(vs, 1), torch.cat(pos)
        group = heads // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        qq = q[row.batch, :, row.q_lo:row.q_hi].double()
        qpos = torch.arange(row.position, row.position + row.q_hi - row.q_lo)
        seen = torch.ones(len(qpos), len(kpos), dtype=torch.bool)
        if causal:
            seen &= kpos[None, :] <= qpos[:, None]
        if window:
            seen &= kpos[None, :] > qpos[:, None] - window
        s = (qq @ k.transpose(1, 2) * scale).masked_fill(~seen, -math.inf)
        sz = (qq.abs() @ k.abs().transpose(1, 2) * scale).masked_fill(~seen, 0).amax(-1, keepdim=True)
        row_lse = torch.logsumexp(s, -1)
        p = torch.softmax(s, -1).nan_to_num(0.0)
        out[row.batch, row.q_lo:row.q_hi] = (p @ v).transpose(0, 1)
        mass[row.batch, row.q_lo:row.q_hi] = (p @ v.abs()).amax(-1, keepdim=True).transpose(0, 1)
        size[row.batch, row.q_lo:row.q_hi] = sz.transpose(0, 1)
        lse[row.batch, :, row.q_lo:row.q_hi] = row_lse
    return out, lse, mass, size


def check(q, rows, causal=True, window=None, scale=None, out_float=True):
    scale = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    out, lse = kernel.varlen(q, rows, causal, window, scale, out_float)
    assert out.dtype == (torch.float32 if out_float else q.dtype)
    ref, ref_lse, mass, size = reference(q, rows, causal, window, scale)
    d = q.shape[-1]
    u_in = U16 if q.dtype == torch.bfloat16 else 0.0
    u_out = U32 if out_float or q.dtype == torch.float32 else U16
    bound = 2 * ((2 * d * U32 * size + 2 * u_in) * mass + u_out * ref.abs()) + 1e-30
    err = (out.double() - ref).abs()
    worst = float((err / bound).max())
    assert worst <= 1.0, f"output off by {worst:.2f} of its bound (largest error {float(err.max()):.3g})"
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), "a query that sees no key must have lse -inf, and only those"
    lse_bound = 2 * (2 * d * U32 * size.squeeze(-1).transpose(1, 2) + 4 * U32 * ref_lse.abs()) + 1e-30
    lse_err = (lse.double() - ref_lse).abs()[seen]
    assert float((lse_err / lse_bound[seen]).max()) <= 1.0
    assert not out[~seen.transpose(1, 2)].any()
    return worst


def qkv(b, heads, kv_heads, n, m, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, n, d, generator=g).to(dtype)
    k = torch.randn(b, kv_heads, m, d, generator=g).to(dtype)
    v = torch.randn(b, kv_heads, m, d, generator=g).to(dtype)
    return q, k, v


def whole(q, k, v, q_pos=0, k_pos=0):
    return [kernel.Row(b, 0, q.shape[2], q_pos, [kernel.Piece(k, v, k_pos, b)]) for b in range(q.shape[0])]


DTYPES = [torch.float32, torch.bfloat16]
# heads, K,V heads, head size: SmolLM2's GQA, MHA, MQA, Gemma 3's 256, the tiny models' 16, a size no vector fits,
# and a group larger than a work item's query vectors (the portable loop)
HEADS = [(9, 3, 64), (4, 4, 32), (8, 1, 16), (4, 1, 256), (2, 1, 24), (128, 1, 16)]  # and a group past 96


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,d", HEADS)
def test_a_causal_prefill_matches_the_math(isa, dtype, heads, kv_heads, d):
    q, k, v = qkv(1, heads, kv_heads, 150, 150, d, dtype)
    check(q, whole(q, k, v), causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_chain_rank_attends_its_received_prefix_then_its_own_tokens_as_two_pieces(isa, dtype):
    q, own_k, own_v = qkv(1, 9, 3, 70, 70, 64, dtype, seed=1)
    _, pre_k, pre_v = qkv(1, 9, 3, 1, 190, 64, dtype, seed=2)
    rows = [kernel.Row(0, 0, 70, 190, [kernel.Piece(pre_k, pre_v, 0), kernel.Piece(own_k, own_v, 190)])]
    check(q, rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("queries,keys", [(128, 1100), (33, 700)])
def test_a_chunk_after_a_long_prefix(isa, dtype, queries, keys):
    q, k, v = qkv(1, 9, 3, queries, keys, 64, dtype, seed=3)
    check(q, whole(q, k, v, q_pos=keys - queries))


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_rows_of_unequal_caches_in_one_varlen_call(isa, dtype):
    lengths = [150, 1, 900, 64, 65, 333, 17, 1550]
    q = torch.randn(1, 9, len(lengths), 64).to(dtype)
    rows = []
    for i, n in enumerate(lengths):
        _, k, v = qkv(1, 9, 3, 1, n, 64, dtype, seed=10 + i)
        rows.append(kernel.Row(0, i, i + 1, n - 1, [kernel.Piece(k, v, 0)]))
    check(q, rows)


@pytest.mark.parametrize("dtype", DTYPES)
def test_forks_read_their_shared_prompt_in_place_then_their_own_tokens(isa, dtype):
    _, pk, pv = qkv(1, 9, 3, 1, 300, 64, dtype, seed=4)  # one prompt's K,V (batch 1), shared by every fork
    q = torch.randn(1, 9, 4, 64).to(dtype)
    rows = []
    for i, own in enumerate([1, 5, 2, 9]):
        _, ok, ov = qkv(1, 9, 3, 1, own, 64, dtype, seed=20 + i)
        rows.append(kernel.Row(0, i, i + 1, 300 + own - 1, [kernel.Piece(pk, pv, 0), kernel.Piece(ok, ov, 300)]))
    check(q, rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 40])
def test_a_row_in_many_short_runs_is_scored_in_blocks_across_them(isa, dtype, window):
    """A paged row's keys are runs of 16 slots scattered in one tensor: a block of keys spans runs that follow each
    other in position, and ends where the next run does not (a gap in positions, causal and window bounds)."""
    _, k, v = qkv(1, 9, 3, 1, 640, 64, dtype, seed=30)
    order = torch.randperm(40, generator=torch.Generator().manual_seed(3)).tolist()  # slots of 40 runs of 16
    q = torch.randn(1, 9, 3, 64).to(dtype)
    runs = [kernel.Piece(k, v, 16 * i, 0, 16 * b, 16 * b + 16) for i, b in enumerate(order[:30])]  # positions 0-479
    gap = [kernel.Piece(k, v, 16 * (i + 40), 0, 16 * b, 16 * b + 16) for i, b in enumerate(order[30:])]  # 640-799
    rows = [kernel.Row(0, 0, 1, 479, runs),  # 30 runs, one after another
            kernel.Row(0, 1, 2, 799, runs + gap),  # then a jump of 160 positions
            kernel.Row(0, 2, 3, 300, runs[:25])]  # causal: the runs past position 300 partly or wholly unseen
    check(q, rows, window=window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 16, 50, 400])
def test_a_sliding_window_band_at_any_offset(isa, dtype, window):
    q, k, v = qkv(1, 4, 1, 90, 240, 256, dtype, seed=5)
    check(q, whole(q, k, v, q_pos=150), window=window)


@pytest.mark.parametrize("dtype", DTYPES)
def test_full_visibility_and_a_batch_of_entries_sharing_one_keys_tensor(isa, dtype):
    q, k, v = qkv(3, 8, 2, 5, 40, 48, dtype, seed=6)
    check(q, whole(q, k, v), causal=False)
    shared = [kernel.Row(b, 0, 5, 0, [kernel.Piece(k, v, 0, 0)]) for b in range(3)]
    check(q, shared, causal=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_query_that_sees_no_key_gives_zero_and_minus_infinity(isa, dtype):
    q, k, v = qkv(1, 4, 2, 6, 10, 32, dtype, seed=7)
    rows = whole(q, k, v, q_pos=0, k_pos=3)  # queries 0-2 come before every key
    check(q, rows)
    out, lse = kernel.varlen(q, rows)
    assert torch.isinf(lse[..., :3]).all() and (out[:, :3] == 0).all()
    # and queries in no row at all
    out, lse = kernel.varlen(q, [kernel.Row(0, 2, 4, 10, [kernel.Piece(k, v, 0)])])
    assert torch.isinf(lse[..., :2]).all() and (out[:, 4:] == 0).all() and torch.isfinite(lse[..., 2:4]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_inputs_are_read_in_place(isa, dtype):
    """q as transformers leaves it (``[B, n, heads, d]`` transposed), K,V slices of a larger cache."""
    q = torch.randn(1, 80, 9, 64).to(dtype).transpose(1, 2)
    room_k = torch.randn(1, 3, 500, 64).to(dtype)
    room_v = torch.randn(1, 3, 500, 64).to(dtype)
    k, v = room_k[:, :, :200], room_v[:, :, :200]
    assert not q.is_contiguous() and not k.is_contiguous()
    check(q, whole(q, k, v, q_pos=120))


def test_bfloat16_out_is_the_rounded_float32_out(isa):
    q, k, v = qkv(1, 9, 3, 64, 64, 64, torch.bfloat16, seed=8)
    f32 = kernel.block(q, k, v)[0]
    b16 = kernel.block(q, k, v, out_float=False)[0]
    assert b16.dtype == torch.bfloat16 and torch.equal(b16, f32.to(torch.bfloat16))
    check(q, whole(q, k, v), out_float=False)


def test_threads_split_the_work_and_change_nothing():
    q, k, v = qkv(2, 9, 3, 300, 300, 64, torch.float32, seed=9)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.block(q, k, v)
        torch.set_num_threads(2)
        two = kernel.block(q, k, v)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 3000])
def test_a_long_rows_keys_are_split_across_threads_and_merged_by_their_log_sum_exp(isa, dtype, window):
    """A decode row after 9000 positions in three pieces is 3 work items for 2 threads: its keys go in parts, each
    part's output weighed by its log-sum-exp; so do two rows beside a short one, and the result is the math's."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for lengths in ([9000], [5000, 17, 2600]):
            q = torch.randn(1, 9, len(lengths), 64).to(dtype)
            rows = []
            for i, n in enumerate(lengths):
                _, k, v = qkv(1, 9, 3, 1, n, 64, dtype, seed=20 + i)
                cuts = [0, n // 3, 2 * n // 3 + 1, n]
                rows.append(kernel.Row(0, i, i + 1, n - 1, [kernel.Piece(k, v, cuts[j], 0, cuts[j], cuts[j + 1])
                                                            for j in range(3)]))
            check(q, rows, window=window)
            check(q, rows, window=window, out_float=False)
    finally:
        torch.set_num_threads(before)


def test_the_bound_catches_a_key_off_by_one_position():
    """The test's bound is tight enough to fail: the keys one position late (a causal offset off by one) is caught."""
    q, k, v = qkv(1, 9, 3, 40, 40, 64, torch.float32, seed=11)
    scale = 0.125
    wrong = kernel.varlen(q, whole(q, k, v, k_pos=1), scale=scale)[0]
    ref, _, mass, size = reference(q, whole(q, k, v), True, None, scale)
    bound = 2 * ((2 * 64 * U32 * size) * mass + U32 * ref.abs())
    assert float(((wrong.double() - ref).abs() / bound).max()) > 1.0


def test_bad_input_is_refused_with_what_is_wrong():
    q, k, v = qkv(1, 4, 2, 4, 8, 16, torch.float32)
    with pytest.raises(RuntimeError, match="outside"):
        kernel.varlen(q, [kernel.Row(0, 0, 4, 0, [kernel.Piece(k, v, 0, 0, 0, 9)])])
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel.block(q.double(), k.double(), v.double())
    with pytest.raises(RuntimeError, match="not a multiple"):
        kernel.block(torch.randn(1, 3, 4, 16), k, v)


def test_a_compiled_graph_carries_the_op_whole():
    q, k, v = qkv(1, 9, 3, 32, 32, 64, torch.float32)
    rows = torch.tensor([[0, 0, 32, 0, 0, 1]])
    pieces = torch.tensor([[0, 0, 0, 32, 0]])
    kernel.varlen(q, whole(q, k, v))  # registers the op's fake

    def f(q, k, v):
        out, lse = torch.ops.kvr.attention(q, [k], [v], rows, pieces, True, 0, 0.125, True)
        return out * 2, lse

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    out, lse = compiled(q, k, v)
    ref = f(q, k, v)
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])


def test_the_ours_and_torch_choices_run_the_same_attention(monkeypatch):
    from kvrunahead.modes.attention import attend_with_lse, positional_attention_with_lse

    q, k, v = qkv(1, 9, 3, 50, 50, 64, torch.float32, seed=12)
    got = {}
    for name in ("ours", "torch"):
        monkeypatch.setenv(kernels.ENV, name)
        got[name] = (attend_with_lse(q, k, v, True, 0.125), positional_attention_with_lse(q, k, v, 30, 0, 8, 0.125))
    for (a, la), (b, lb) in zip(got["ours"], got["torch"]):
        assert torch.allclose(a, b, atol=1e-5) and torch.allclose(la, lb, atol=1e-5)


def test_without_a_compiler_the_tools_fall_back_to_torch_and_say_so_once(tmp_path):
    """A fresh cache folder and no compiler: the build fails, is logged once, and a model still runs."""
    script = (
        "import logging, torch\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from kvrunahead.model.load import load_model\n"
        "from kvrunahead.modes.attention import attend_with_lse\n"
        "lm = load_model('tiny-llama', torch.float32, torch.device('cpu'))\n"
        "print('implementation', lm.model.config._attn_implementation)\n"
        "q = torch.randn(1, 4, 8, 16)\n"
        "for _ in range(3): attend_with_lse(q, q[:, :2], q[:, :2], True, None)\n"
        "print('logits', lm.model(torch.tensor([[1, 2, 3]])).logits.shape)\n"
    )
    env = {**os.environ, "KVR_CACHE": str(tmp_path), "CXX": str(tmp_path / "no-such-compiler")}
    env.pop(kernels.ENV, None)
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "implementation sdpa" in run.stdout and "logits torch.Size([1, 3," in run.stdout
    assert run.stderr.count("could not be built") == 1, run.stderr


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 1, 50])
@pytest.mark.parametrize("positions", [1, 2])
def test_a_few_positions_take_the_narrow_path_with_offsets_and_windows(isa, dtype, window, positions):
    """Up to 6 query vectors (a decode row's grouped heads) run keys-as-lanes: partial blocks, keys after the
    queries, a window that starts inside a block."""
    q, k, v = qkv(1, 9 if positions == 1 else 6, 3, positions, 230, 64, dtype, seed=13)
    check(q, whole(q, k, v, q_pos=170), window=window)
    check(q, whole(q, k, v, q_pos=100, k_pos=5), window=window)


def test_a_build_killed_midway_holds_no_later_load():
    """A process killed while torch built the kernel leaves torch's lock file in the build folder; the next load
    goes on (under the folder's flock no live process holds that file) instead of waiting on it forever."""
    if not kernels.build():
        pytest.skip(f"the CPU attention kernel is not built here: {kernels.why_not_built()}")
    folder = kernels.cache_dir()
    baton = folder / kernels.TORCH_BATON
    with open(folder / kernels.BUILD_LOCK, "w") as held:  # as a build killed midway leaves it: no live holder
        fcntl.flock(held, fcntl.LOCK_EX)
        baton.touch()
    try:
        r = subprocess.run([sys.executable, "-c", "from kvrunahead import kernels; print(kernels.build())"],
                           capture_output=True, text=True, timeout=300)
    finally:
        baton.unlink(missing_ok=True)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr[-2000:]
