"""``kvr-prefill``: KV-Runahead prefill of one prompt over several ranks."""

from __future__ import annotations

import json
import logging
import sys

import click

from kvrunahead.choices import DECODES, TRANSPORTS
from kvrunahead.cli import common
from kvrunahead.config import RunConfig
from kvrunahead.decide.policy import network_spec, prepare, tp_groups, with_tp_mode
from kvrunahead.errors import InputError
from kvrunahead.model.load import MODEL_CHOICES
from kvrunahead.modes import MODES
from kvrunahead.oneshot import on_engine
from kvrunahead.oneshot.runner import RunResult, run
from kvrunahead.prompt import PromptError, parse_tokens
from kvrunahead.ranks.launcher import detect_launcher, spawn, world_size_hint

log = logging.getLogger("kvrunahead")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def format_result(r: RunResult) -> str:
    sizes = [b - a for a, b in zip(r.boundaries, r.boundaries[1:])]
    lines = [
        f"model        {r.model}",
        f"mode         {r.mode}   world size {r.world_size}"
        + (f" (TP groups of {r.tp} ranks, all-reduce {r.tp_collective})" if r.tp > 1 else "")
        + f"   launcher {r.launcher}   backend {r.backend}"
        f"   transport {r.transport}" + (f"   all-gather {r.allgather}" if r.allgather else ""),
        f"network      {r.network}",
        f"device       {r.device}   dtype {r.dtype}{' (compiled)' if r.compiled else ''}   "
        f"threads/rank {r.threads_per_rank}"
        + ("   (OVERSUBSCRIBED: more threads than cores, timings not meaningful)" if r.oversubscribed else ""),
        f"context      {r.context_len} tokens" + (f"   ({r.rope_extension})" if r.rope_extension else ""),
    ]
    lines.append(f"attention    {r.kvr_attention + '   ' if r.kvr_attention else ''}kernel {r.attention_kernel}   "
                 f"linears {r.linears}")
    if r.stages:
        layers = ", ".join(f"[{a}, {b})" for a, b in zip(r.stages, r.stages[1:]))
        lines += [f"stages       layers {layers}, one per {'TP group' if r.tp > 1 else 'rank'}"
                  f"   chunks of {r.chunk_tokens} tokens pipelined through them",
                  f"             from {r.pipeline_source}"]
    else:
        lines += [f"partition    boundaries {','.join(map(str, r.boundaries))}   tokens {sizes}   "
                  f"ratios {[round(x, 3) for x in r.ratios]}",
                  f"             from {r.partition_source}"]
    lines += [
        f"TTFT         {r.ttft_s * 1e3:.1f} ms",
        "rank  tokens   compute ms   wait ms   send ms   sent         peak mem",
    ]
    for s in r.ranks:
        lines.append(
            f"{s.rank:>4}  {s.tokens:>6}   {s.compute_s * 1e3:>10.1f}   {s.wait_s * 1e3:>7.1f}   "
            f"{s.send_s * 1e3:>7.1f}   {_mib(s.bytes_sent):>10}   {_mib(s.peak_mem_bytes):>10}"
        )
    if r.full_chain_bytes is not None:
        kinds = {}
        for s in r.ranks:
            for kind, n in s.bytes_sent_by_kind.items():
                kinds[kind] = kinds.get(kind, 0) + n
        sent = sum(kinds.values())
        lines.append(
            f"chain sent   {_mib(sent)}: " + ", ".join(f"{kind} layers {_mib(n)}" for kind, n in sorted(kinds.items()))
            + f"   ({r.sliding_layers} sliding-window layers hand on their window only; with every layer "
            f"full the chain would send {_mib(r.full_chain_bytes)}: {sent / max(r.full_chain_bytes, 1):.1%} of it)"
        )
    if r.memory and r.tp > 1:
        lines += [f"memory       rank {m.rank} (group {m.group}, tp {m.tp_rank}): weights {_mib(m.weight_bytes)} "
                  f"(+ {_mib(m.packed_bytes)} packed), resident peak {_mib(m.peak_resident_bytes)} "
                  f"({_mib(m.resident_before_load_bytes)} before loading)" for m in r.memory]
    lines.append(f"first token  {r.first_token} {r.first_token_text!r}")
    lines.append(f"generated    {r.generated_text!r}")
    if r.decode_s is not None and len(r.generated_tokens) > 1:
        lines.append(f"decode       {r.decode}: {r.decode_s / (len(r.generated_tokens) - 1) * 1e3:.1f} ms per token "
                     f"after the first" + ("   (each rank attended its own part of the cache)"
                                           if r.decode == "kvp" else ""))
    v = r.verification
    if v is not None:
        grade = (f"{v.half.describe()}; against one {r.dtype} process: max |logit diff| "
                 f"{v.max_abs_logit_diff:.2e}" if v.half else f"max |logit diff| {v.max_abs_logit_diff:.2e} (atol "
                 f"{v.atol:g})")
        lines.append(
            f"verify       {'OK' if v.ok else 'MISMATCH'}: {grade}, "
            f"first token {'matches' if v.first_token_match else 'differs'}, "
            f"generated tokens {_continuation(v)}; "
            f"single-process TTFT {v.single_ttft_s * 1e3:.1f} ms at {r.threads_per_rank} thread(s)"
            + (f", {v.single_all_threads_ttft_s * 1e3:.1f} ms at {v.single_all_threads} threads (all ranks' "
               f"threads in one process)" if v.single_all_threads_ttft_s is not None else "")
        )
    return "\n".join(lines)


def _continuation(v) -> str:
    if v.generated_match:
        return "match"
    if v.parted_at is None:
        return "differ"
    tie = "a tie within the tolerance" if v.generated_within_rounding else "not a tie"
    return f"part at step {v.parted_at} (the two tokens' logits {v.parted_gap:.2e} apart: {tie})"


@click.command(context_settings=common.SETTINGS)
@common.model_option(help=f"A preset ({', '.join(MODEL_CHOICES)}) or a local transformers model directory.")
@click.option("--mode", type=click.Choice(list(MODES)), default="kvr", show_default=True,
              help="; ".join(f"{m.name}: {m.summary}" for m in MODES.values()) + ".")
@click.option("--transport", type=click.Choice(TRANSPORTS), default="torch", show_default=True,
              help="torch: gloo (CPU) or NCCL (GPU); mpi: mpi4py Isend/Irecv and Allgather (under mpirun).")
@click.option("--ctx", "ctx", default=None,
              help="Prompt length in tokens (2048, 2k, 16K). Default: 2k, or the whole --prompt-file.")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False),
              help="Text to use as the document instead of the shipped English text.")
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False),
              help='A batch: JSON lines, one {"prompt": "..."} each, every prompt a whole user turn. Prefilled '
                   "together (see --batching); each prompt's first token, TTFT and continuation are printed.")
@click.option("--batching", type=click.Choice(["packed", "sequential", "padded"]), default="packed",
              show_default=True,
              help="With --prompts. packed: the prompts end to end in one sequence per step, each seeing only "
                   "itself, cut over the ranks at prompt edges where that keeps the balance (Prepacking); "
                   "sequential: one prompt after another over the chain; padded: transformers' batched forward, "
                   "left-padded to the longest (one process).")
@click.option("--step-tokens", type=int, default=8192, show_default=True,
              help="With --prompts: most tokens in one packed step; a larger batch is bin-packed (first-fit "
                   "decreasing) into several.")
@click.option("--no-chat", is_flag=True, help="Use the raw text, not wrapped in the model's chat template.")
@click.option("--partition", default="auto", show_default=True,
              help="auto: interpolated from the partition table searched for this model, world size, dtype, "
                   "attention, device kind and network (partition_tables/, made by kvr-search), or where none "
                   "covers the context, the cost model's partition on this machine's profile (kvr-calibrate; else "
                   "the shipped CPU profile; on GPUs a FLOP estimate); 'table': a table or an "
                   "error; 'even'; boundaries (0,900,2048) or ratios (0.6,0.4), one part per rank.")
@click.option("--stages", default="auto", show_default=True,
              help="--mode spp: the layer boundaries of the stages, one per rank (0,15,30 for 30 layers on 2 "
                   "ranks); auto: stages of equal predicted time (the cost model; equal layer counts on GPUs).")
@click.option("--chunk-tokens", type=int, default=None,
              help="--mode spp: tokens per chunk moving through the pipeline (the last one may be shorter). "
                   "Default: the cost model's best on this machine (2048 on GPUs).")
@common.kvr_attention_option(
    help="kvr modes: split = prefix block in full + own block causally, merged by log-sum-exp, "
         "skipping the masked half of the diagonal block (needs a model using transformers' attention "
         "interface); masked = the model's SDPA over all prefix+own keys under the offset causal mask "
         "(the paper's); auto = split where the model allows it, else masked.")
@click.option("--table", type=click.Path(exists=True, dir_okay=False),
              help="Partition table to use (implies --partition table). Default: found in partition_tables/.")
@click.option("--force-table", is_flag=True,
              help="Use a table made for another model, dtype, attention, device kind or network (its part count "
                   "must still match the world size).")
@common.net_option(
    help="The network: 'loopback' (default on one host), 'cap=400MB/s' (with --nproc: every rank on an "
         "emulated host of its own, links capped at that rate each way; needs root), ',noise' added: "
         "the noise sidecar between random adjacent ranks (noise=RATE, interval=S, duty=F to set it). "
         "Recorded in the result; partition tables are matched on the cap. Under torchrun or mpirun "
         "the network is the launcher's (launch/torchrun_netns.sh emulates it) and --net labels it.")
@common.allgather_option(
    help="tsp and cp-allgather: 'native' is the library's all-gather, 'p2p' a ring of the point-to-point "
         "transfers the KV chain uses; auto: p2p on gloo and MPI (their all-gather is slower per byte), "
         "native on NCCL.")
@click.option("--nproc", type=int, default=1, show_default=True,
              help="Start this many local ranks (when not launched by torchrun or mpirun).")
@common.tp_option()
@common.dtype_option()
@common.attention_kernel_option()
@common.linears_option()
@common.compile_option()
@common.device_option(
    help="auto: one GPU per rank (by LOCAL_RANK) with NCCL when CUDA is present, else CPU with gloo.")
@click.option("--threads", type=int, default=None,
              help="Intra-op threads per rank. Default: OMP_NUM_THREADS, else cores / local ranks.")
@click.option("--max-new-tokens", type=int, default=16, show_default=True,
              help="Greedy tokens to generate on the last rank after the prefill (first token included).")
@click.option("--decode", type=click.Choice(DECODES), default="gathered", show_default=True,
              help="Where the tokens after the first are decoded: gathered = on the last rank, which the chain "
                   "leaves holding the whole cache; kvp = every rank keeps only its own part of the cache and "
                   "attends it, the partial outputs merged by log-sum-exp per layer (KV-cache parallelism).")
@click.option("--verify", is_flag=True,
              help="Also run the single-process prefill and compare logits and tokens; exit 1 on mismatch.")
@click.option("--atol", type=float, default=None,
              help="Logit tolerance for --verify. Default: 32 roundings of the dtype at the scale of the largest "
                   "logit (32 x eps x max |logit|: 3.8e-5 float32, 0.31 float16, 2.5 bfloat16 at logits of 10).")
@common.timeout_option(60.0,
    help="Seconds a rank waits on another's K,V or at start-up before failing. The start barrier and "
         "the end-of-run gather, where a rank waits for another's whole prefill, allow an hour.")
@common.allow_long_context_option(
    help="Run a context longer than the model's trained positions as it is. Without it such a context "
         "gets the rotary embedding extended by YaRN with the smallest whole factor that covers it "
         "(up to x4).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the synthetic presets' weights.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
@click.option("-v", "--verbose", is_flag=True, help="Log progress to stderr.")
def main(ctx, prompt_file, prompts_file, batching, step_tokens, no_chat, nproc, as_json, verbose,
         **options) -> None:
    """Prefill one long prompt with KV-Runahead over several ranks and print the time to first token.

    Each rank holds one part of the prompt; layer by layer it receives the K,V of everything before
    its part from the previous rank, appends its own and sends the result on. The last rank ends
    with the full KV cache, emits the first token and keeps decoding.

    \b
    Launch with any of:
      kvr-prefill --nproc 2 --ctx 4k
      torchrun --nproc-per-node 2 --no-python kvr-prefill --ctx 4k
      mpirun -n 2 kvr-prefill --ctx 4k

    \b
    A batch of prompts, packed into one chain prefill and each checked against one process:
      kvr-prefill --nproc 2 --prompts prompts.jsonl --verify
    """
    common.quiet(verbose)
    launcher = detect_launcher()
    with common.failure_ending("kvr-prefill", rank=common.env_rank(), reraise=verbose):
        if options["max_new_tokens"] < 1:
            raise InputError("--max-new-tokens must be at least 1")
        if prompts_file:
            batch = _run_batch(prompts_file, batching, step_tokens, ctx, prompt_file, no_chat, nproc, launcher,
                               options)
            if batch is not None:
                click.echo(json.dumps(batch.to_dict()) if as_json else format_batch(batch))
                if batch.verified is False:
                    sys.exit(1)
            return
        if batching != "packed" or step_tokens != 8192:
            raise InputError("--batching and --step-tokens apply to a batch: give --prompts")
        text = common.read_prompt_file(prompt_file) if prompt_file else None
        try:
            context_len = parse_tokens(ctx) if ctx is not None else (None if prompt_file else 2048)
        except PromptError as e:
            raise InputError(str(e)) from None
        world_size = world_size_hint(launcher, nproc)
        common.check_nproc(nproc, launcher, world_size)
        cfg = with_tp_mode(RunConfig(context_len=context_len, prompt_text=text, chat=not no_chat, **options),
                           world_size)
        groups = tp_groups(cfg, world_size)  # a bad TP shape: one line, before any rank starts
        if launcher == "single" and nproc > 1:
            prepare(cfg, groups)  # one clear error here rather than one per rank
            sys.exit(spawn(nproc, sys.argv[1:], net=network_spec(cfg), fork=True))
        if launcher == "single" and network_spec(cfg).emulated:
            raise InputError("--net cap=... emulates one host per rank: give --nproc 2 or more")
        result = run(cfg, launcher, world_size, on_engine.run_on_world)
    if result is None:
        return
    if result.partition_warning:
        click.echo(f"kvr-prefill: warning: {result.partition_warning}", err=True)
    click.echo(json.dumps(result.to_dict()) if as_json else format_result(result))
    if result.verification is not None and not result.verification.ok:
        sys.exit(1)


def _run_batch(prompts_file, batching, step_tokens, ctx, prompt_file, no_chat, nproc, launcher, options):
    from kvrunahead.oneshot.batch import check_batch, tokenize_prompts
    from kvrunahead.oneshot.on_engine import run_batch

    if ctx is not None or prompt_file:
        raise InputError("--prompts is a batch of whole prompts: --ctx and --prompt-file do not apply")
    texts = common.read_prompts_file(prompts_file)
    cfg = RunConfig(context_len=None, chat=not no_chat, **options)
    world_size = world_size_hint(launcher, nproc)
    common.check_nproc(nproc, launcher, world_size)
    check_batch(cfg, batching, world_size)
    tp_groups(cfg, world_size)  # a bad TP shape: one line, before any rank starts
    if launcher == "single" and nproc > 1:
        sys.exit(spawn(nproc, sys.argv[1:], net=network_spec(cfg), fork=True))
    return run_batch(cfg, launcher, world_size, tokenize_prompts(cfg, texts), batching, step_tokens)


def format_batch(b) -> str:
    """The report of a batch: the steps, then one line per prompt."""
    lines = [
        f"model        {b.model}",
        f"batching     {b.batching}   world size {b.world_size}   device {b.device}   dtype {b.dtype}   "
        f"threads/rank {b.threads_per_rank}" + ("   (OVERSUBSCRIBED)" if b.oversubscribed else ""),
        f"prompts      {len(b.prompts)}, {sum(p.prompt_tokens for p in b.prompts)} tokens "
        f"({min(p.prompt_tokens for p in b.prompts)}-{max(p.prompt_tokens for p in b.prompts)} each)",
    ]
    for i, s in enumerate(b.steps):
        cut = [f"{bd}" + (f" (cuts a prompt: {n} tokens handed on)" if n else "")
               for bd, n in zip(s.boundaries[1:-1], s.handed_on)]
        lines.append(f"step {i:<6} {len(s.prompts)} prompts, {s.boundaries[-1]} tokens; rank boundaries "
                     + ", ".join(["0", *cut, str(s.boundaries[-1])]))
    lines.append(f"prefill      {b.prefill_s * 1e3:.1f} ms until every prompt's first token")
    for r in b.ranks:
        lines.append(f"rank {r.rank:<6} {r.prefill_s * 1e3:.1f} ms, sent {_mib(r.bytes_sent)}, "
                     f"peak mem {_mib(r.peak_mem_bytes)}")
    lines.append("prompt  tokens  step  rank   TTFT ms  " + ("verify    " if b.atol is not None else "") + "generated")
    for p in b.prompts:
        check = "" if p.matches is None else f"{'ok' if p.matches else 'MISMATCH':<10}"
        lines.append(f"{p.index:>6}  {p.prompt_tokens:>6}  {p.step:>4}  {p.rank:>4}  {p.ttft_s * 1e3:>8.1f}  "
                     f"{check}{p.text[:60]!r}")
    if b.atol is not None:
        bad = [p for p in b.prompts if not p.matches]
        worst = max(p.first_logit_diff for p in b.prompts)
        lines.append(f"verify       {'OK' if not bad else 'MISMATCH'}: {len(b.prompts) - len(bad)}/{len(b.prompts)} "
                     f"prompts equal their single-process prefill and greedy tokens; max |logit diff| {worst:.2e} "
                     f"(atol {b.atol:g})")
        for p in bad:
            lines.append(f"  prompt {p.index}: logit diff {p.first_logit_diff:.2e}; alone it gives "
                         f"{p.reference_text!r}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
