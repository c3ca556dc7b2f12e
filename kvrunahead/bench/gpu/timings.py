"""The GPU campaign's timings on one GPU: single prefills, the last rank of a chain, decode steps as CUDA graphs,
the 16k prefill against the dense peak."""

from __future__ import annotations

import contextlib
import functools
import statistics
import time

from kvrunahead.bench.gpu.plan import (
    CHAIN_RANKS,
    DECODE_BATCHES,
    DECODE_CONTEXT,
    PEAK_CONTEXT,
    SHEET_BF16_TFLOPS,
    Log,
    Setup,
    gpu_cost,
    model_configs,
    part_s,
    run_profile,
    write_row,
)

# ---------------------------------------------------------------- steps 4 and 5: timing on one GPU

def _build(config, setup: Setup):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if setup.tiny else torch.bfloat16
    torch.manual_seed(0)
    with torch.device(setup.device):  # random weights drawn on the device: real ones do not travel
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def _time(fn, repeats: int) -> tuple[float, list[float]]:
    from kvrunahead.calibrate.timing import timed_runs

    times = timed_runs(fn, repeats)
    return statistics.median(times), times


@contextlib.contextmanager
def _peak_memory(row: dict, device: str):
    import torch

    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    yield
    if device == "cuda":
        row["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)


def _measure(setup: Setup, log: Log, row: dict, fn, predicted_s: float, deadline: float) -> None:
    """Time ``fn`` into ``row`` (or say why not: out of memory, over the budget) and write the row."""
    import torch

    if log.elapsed() + (setup.repeats + 1) * predicted_s > deadline:
        row["skipped"] = "over the budget"
    else:
        try:
            with _peak_memory(row, setup.device):
                row["ttft_s"], row["times_s"] = _time(fn, setup.repeats)
            row["tokens_per_s"] = round(row["tokens"] / row["ttft_s"], 1)
        except torch.OutOfMemoryError as e:
            row["skipped"] = f"out of memory: {str(e).splitlines()[0][:160]}"
            torch.cuda.empty_cache()
    write_row(setup.out / "timings.jsonl", row)
    log(f"{row['kind']} {row['model']} {row['context']}: "
        + (f"{row['ttft_s']:.4f} s, {row['tokens_per_s']:.0f} tok/s, peak {row.get('peak_memory_gib', '-')} GiB"
           if "ttft_s" in row else row["skipped"]))


def step_prefill(setup: Setup, log: Log, deadline: float) -> None:
    """One prompt through the whole model on one GPU: the decoder layers without a cache (their K,V would hold
    64 GiB at 128k for Llama-7B: the time to compute them is what is measured), then the LM head on the last
    position."""
    import torch

    from kvrunahead.sim.simulate import simulate

    for name, config in model_configs(setup.tiny).items():
        model = _build(config, setup)
        cost = gpu_cost(config)
        for n in setup.contexts:
            ids = torch.randint(0, config.vocab_size, (1, n), device=setup.device)

            @torch.no_grad()
            def run(ids=ids, model=model):
                hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state
                return model.lm_head(hidden[:, -1:])

            row = {"kind": "single-prefill", "model": name, "context": n, "tokens": n, "device": setup.device,
                   "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}
            _measure(setup, log, row, run, simulate(cost, "single", n, 1).ttft_s, deadline)
            del ids
        del model
        _empty(setup.device)


def chain_part(context: int, config, profile) -> tuple[int, int]:
    """The last rank's part of an 8-rank KVR chain at ``context``: the partition the cost model finds on
    ``profile`` (the measured one where calibrate ran, else the built-in)."""
    from kvrunahead.sim.costmodel import CostModel
    from kvrunahead.sim.optimize import search_partition
    from kvrunahead.sim.shape import shape_from_config

    cost = CostModel(shape_from_config(config, "bfloat16", "part"), profile)
    b = search_partition(cost, context, CHAIN_RANKS, "split", None,
                         min_stride=min(max(16, context // 1024), context // (2 * CHAIN_RANKS))).boundaries
    return b[-2], b[-1]


def step_rank_part(setup: Setup, log: Log, deadline: float) -> None:
    """The last rank of an 8-GPU chain: its part's forward through the runtime's chain code (``kvr_prefill``,
    split attention), its prefix K,V already on the GPU (the no-communication bound: what the rank computes, not
    what it waits for). One random prefix tensor serves every layer (the attention reads it all the same; 32
    distinct ones would hold 56 GiB at 128k), and the rank keeps only its own part's K,V, as a server's ranks
    do."""
    import torch

    from kvrunahead.model.layout import probe_kv_layout
    from kvrunahead.modes.kvr import LocalPrefixLink, OwnPartLink, kvr_prefill
    from kvrunahead.ranks.transport import LocalTransport

    class LastRankLink(LocalPrefixLink):
        """The last rank, in one process: its prefix is local, nothing goes on, its cache keeps its own part."""

        @property
        def has_prev(self) -> bool:
            return self.prefix_len > 0

        keep = OwnPartLink.keep

    profile = run_profile(setup)
    for name, config in model_configs(setup.tiny).items():
        model = _build(config, setup)
        layout = probe_kv_layout(model)
        cost = gpu_cost(config)
        for n in setup.contexts:
            start, end = chain_part(n, config, profile)
            ids = torch.randint(0, config.vocab_size, (1, end - start), device=setup.device)
            prefix = torch.randn(layout.kv_shape(0, start), device=setup.device).to(layout.dtype)

            def run(ids=ids, start=start, prefix=prefix, model=model, layout=layout):
                link = LastRankLink(LocalTransport(), start, layout, torch.device(setup.device))
                link.prefixes = [prefix] * layout.num_layers
                return kvr_prefill(model, ids, link, "split")

            row = {"kind": "kvr-last-rank", "model": name, "context": n, "ranks": CHAIN_RANKS, "part": [start, end],
                   "tokens": end - start, "device": setup.device, "partition_profile": profile.name}
            predicted = part_s(cost, end - start, start)
            _measure(setup, log, row, run, predicted, deadline)
            del ids, prefix
        del model
        _empty(setup.device)


def _empty(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- step 6: decode steps as CUDA graphs

def step_decode_graphs(setup: Setup, log: Log, deadline: float) -> None:
    """One decode step of Llama-7B's shape (random bf16 weights) at each batch size, every row behind a
    512-token prompt in a static cache (transformers' ``StaticCache``: fixed addresses, what a graph needs): the
    eager step, then the same step captured once as a CUDA graph and replayed. Rows: time per output token of
    each and their ratio; the replay's logits against the eager step's. On a CPU (the dry run) the graph is not
    captured and the row says so."""
    config = model_configs(setup.tiny)["llama-7b"]
    model = _build(config, setup)
    context = 32 if setup.tiny else DECODE_CONTEXT
    for batch in (1, 2) if setup.tiny else DECODE_BATCHES:
        row = {"kind": "decode-step", "model": "llama-7b", "batch": batch, "context": context, "tokens": batch,
               "device": setup.device, "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}
        if log.elapsed() > deadline:
            row["skipped"] = "over the budget"
            write_row(setup.out / "timings.jsonl", row)
            continue
        try:
            row.update(_decode_graph_row(model, config, batch, context, setup))
        except Exception as e:  # noqa: BLE001 - a capture that fails is a finding: its row says why
            row["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        write_row(setup.out / "timings.jsonl", row)
        log(f"decode-step llama-7b batch {batch}: " + (
            f"eager {row['eager_s'] * 1e3:.2f} ms, graph "
            + (f"{row['graph_s'] * 1e3:.2f} ms ({row['speedup']:.2f}x)" if "graph_s" in row else row["graph"])
            if "eager_s" in row else row.get("failed", row.get("skipped", ""))))
        _empty(setup.device)
    del model
    _empty(setup.device)


def _decode_graph_row(model, config, batch: int, context: int, setup: Setup) -> dict:
    import torch
    from transformers import StaticCache

    device = setup.device
    with torch.no_grad():
        cache = StaticCache(config=config, max_cache_len=context + 64)  # every step writes the same slot
        prompt = torch.randint(0, config.vocab_size, (batch, context), device=device)
        model(input_ids=prompt, past_key_values=cache, cache_position=torch.arange(context, device=device),
              use_cache=True, logits_to_keep=1)
        ids = torch.randint(0, config.vocab_size, (batch, 1), device=device)
        position = torch.tensor([context], device=device)

        def step():
            return model(input_ids=ids, past_key_values=cache, cache_position=position, use_cache=True).logits

        eager_logits = step().float()
        out = {}
        out["eager_s"], out["eager_times_s"] = _time(step, setup.repeats)
        if device != "cuda":
            out["graph"] = "not captured: no CUDA device"
            return out
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        graph.replay()
        torch.cuda.synchronize()
        out["graph_max_abs_logit_diff"] = float((captured.float() - eager_logits).abs().max())
        out["graph_s"], out["graph_times_s"] = _time(graph.replay, setup.repeats)
        out["speedup"] = out["eager_s"] / out["graph_s"]
        del graph, captured
    return out


# ---------------------------------------------------------------- step 7: the 16k prefill against the dense peak

def step_prefill_peak(setup: Setup, log: Log, deadline: float) -> None:
    """Llama-7B's shape (random bf16 weights), one 16k prompt through the decoder layers and the LM head on its
    last position, eager and then compiled (``torch.compile`` of the decoder stack, inductor); its FLOPs counted
    as the cost model counts them (projections, MLP, causal attention pairs, one LM-head row). The peak: a
    8192-cube bf16 matmul timed on the device, and the data sheet's dense figure where the name is known."""
    import torch

    from kvrunahead.sim.flops import part_flops
    from kvrunahead.sim.simulate import simulate

    config = model_configs(setup.tiny)["llama-7b"]
    n = 256 if setup.tiny else PEAK_CONTEXT
    size = 256 if setup.tiny else 8192
    dtype = torch.float32 if setup.tiny else torch.bfloat16
    a = torch.randn(size, size, device=setup.device, dtype=dtype)
    b = torch.randn(size, size, device=setup.device, dtype=dtype)
    peak_s, _ = _time(functools.partial(torch.matmul, a, b), setup.repeats)
    measured_peak = 2.0 * size**3 / peak_s
    sheet = next((v for k, v in SHEET_BF16_TFLOPS.items() if setup.device == "cuda"
                  and k in torch.cuda.get_device_name()), None)
    del a, b
    log(f"prefill-peak: {size}^3 matmul {measured_peak / 1e12:.1f} TFLOP/s"
        + (f", data sheet {sheet:.0f}" if sheet else ""))
    model = _build(config, setup)
    flops = part_flops(config, 0, n, "split", lm_head_rows=1)
    ids = torch.randint(0, config.vocab_size, (1, n), device=setup.device)
    cost = gpu_cost(config)
    for compiled in (False, True):
        if compiled:
            model.base_model.compile(dynamic=False)

        @torch.no_grad()
        def run(ids=ids, model=model):
            hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state
            return model.lm_head(hidden[:, -1:])

        row = {"kind": "prefill-peak", "model": "llama-7b", "context": n, "tokens": n, "device": setup.device,
               "compiled": compiled, "flops": flops, "matmul_peak_flops_per_s": measured_peak,
               "sheet_peak_tflops": sheet}
        if log.elapsed() + (setup.repeats + 2) * simulate(cost, "single", n, 1).ttft_s + 90 * compiled > deadline:
            row["skipped"] = "over the budget"
        else:
            if compiled:
                t0 = time.perf_counter()
                run()  # the compile, outside the timing
                row["compile_s"] = time.perf_counter() - t0
            row["ttft_s"], row["times_s"] = _time(run, setup.repeats)
            row["flops_per_s"] = flops / row["ttft_s"]
            row["share_of_matmul_peak"] = row["flops_per_s"] / measured_peak
            if sheet:
                row["share_of_sheet_peak"] = row["flops_per_s"] / (sheet * 1e12)
        write_row(setup.out / "timings.jsonl", row)
        log(f"prefill-peak {'compiled' if compiled else 'eager'} {n}: " + (
            f"{row['ttft_s']:.4f} s, {row['flops_per_s'] / 1e12:.1f} TFLOP/s, "
            f"{row['share_of_matmul_peak']:.1%} of the matmul's"
            + (f", {row['share_of_sheet_peak']:.1%} of the sheet's" if sheet else "")
            if "ttft_s" in row else row["skipped"]))
    del model, ids
    _empty(setup.device)
