"""Answers per second for many questions on one context: kvr-ask's path (the context prefilled once, the questions
packed with virtual positions, the prefix read once per decode step) against transformers' generate one question
at a time, against one batched generate of the full prompts (left-padded), and against a prefix-cached batch (the
context prefilled once, its cache copied per question). SmolLM2-135M-Instruct, the shipped text (2051 tokens in its
chat turn) and the first N of questions_64.txt (the 16 shipped questions, then 48 more), 32 new tokens each, greedy,
float32, one process on both cores (2 threads). Rounds run the methods in turn (the order rotating), so drift hits
all alike; every round's answers are compared token for token with kvr-ask's.

With ``--context-tokens N`` the context is the shipped text's paragraphs repeated in order up to N tokens (the
8k runs: the questions stay about the same text). A method whose copies of the context cache would not fit in
memory (``--memory-gib``) is not run; its row says so.

Usage: python experiments/shared_context/run.py [--rounds 2] [--questions N] [--context-tokens N]
       [--methods kvr-ask,...] [--out DIR]
Resumable: a round already in DIR/rows.jsonl is not run again.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from kvrunahead.decode.shared_prefix import answer, context_prefixes
from kvrunahead.model.load import load_model
from kvrunahead.prompt import question_prompts, shipped_text
from kvrunahead.provenance import environment

NEW_TOKENS = 32


def ours(model, context, questions, eos) -> list[list[int]]:
    return [a.tokens for a in answer(model, context_prefixes(model, context), questions, NEW_TOKENS, eos)]


def one_at_a_time(model, context, questions, eos) -> list[list[int]]:
    out = []
    for q in questions:
        ids = torch.tensor([context + q])
        gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=sorted(eos),
                             pad_token_id=sorted(eos)[0])
        out.append(_cut(gen[0, ids.shape[1]:].tolist(), eos))
    return out


def batched(model, context, questions, eos) -> list[list[int]]:
    width = max(len(q) for q in questions)
    pad = sorted(eos)[0]
    ids = torch.tensor([[pad] * (width - len(q)) + context + q for q in questions])
    mask = torch.tensor([[0] * (width - len(q)) + [1] * (len(context) + len(q)) for q in questions])
    gen = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                         eos_token_id=sorted(eos), pad_token_id=pad)
    return [_cut(row[ids.shape[1]:].tolist(), eos) for row in gen]


def prefix_cached(model, context, questions, eos) -> list[list[int]]:
    """The context prefilled once, its cache copied per question (``batch_repeat_interleave``), the questions
    left-padded after it in one batched forward, then a batched greedy decode: a prefix-cached batch as a serving
    stack without shared-prefix attention runs it."""
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([context]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    n, width, pad = len(questions), max(map(len, questions)), sorted(eos)[0]
    cache.batch_repeat_interleave(n)
    ids = torch.tensor([[pad] * (width - len(q)) + q for q in questions])
    mask = torch.tensor([[1] * len(context) + [0] * (width - len(q)) + [1] * len(q) for q in questions])
    positions = (mask[:, len(context):].cumsum(-1) - 1).clamp(min=0) + len(context)
    out = [[] for _ in questions]
    done = [False] * n
    for _ in range(NEW_TOKENS):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                       use_cache=True, logits_to_keep=1).logits[:, -1]
        for row, t in enumerate(logits.argmax(-1).tolist()):
            if not done[row]:
                out[row].append(t)
                done[row] = t in eos
        if all(done):
            break
        ids = logits.argmax(-1, keepdim=True)
        mask = torch.cat((mask, torch.ones_like(mask[:, :1])), dim=1)
        positions = positions[:, -1:] + 1
    return out


def _cut(tokens: list[int], eos: set[int]) -> list[int]:
    """Up to and including the first end-of-sequence token (generate pads finished rows after it)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


COPIES = {"generate-batched", "prefix-cached-batch"}  # hold one copy of the context's cache per question


def context_text(tokenizer, tokens: int | None) -> str:
    """The shipped text, or its paragraphs repeated in order while the whole stays within ``tokens``."""
    text = shipped_text()
    if tokens is None:
        return text
    paragraphs, kept = text.split("\n\n"), []
    for paragraph in itertools.cycle(paragraphs):
        if len(tokenizer.encode("\n\n".join([*kept, paragraph]), add_special_tokens=False)) > tokens:
            return "\n\n".join(kept)
        kept.append(paragraph)


def cache_gib(config, tokens: int, copies: int) -> float:
    """K and V of every layer, float32, ``copies`` times ``tokens`` tokens."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4 * tokens * copies / 2**30


METHODS = {"kvr-ask": ours, "generate-one-at-a-time": one_at_a_time, "generate-batched": batched,
           "prefix-cached-batch": prefix_cached}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--context-tokens", type=int, default=None, help="repeat the text's paragraphs up to N tokens")
    ap.add_argument("--memory-gib", type=float, default=16.0,
                    help="skip a method whose copies of the context cache need more than this")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    ap.add_argument("--summary", action="store_true", help="only the summaries and the plot of the rows there are")
    ap.add_argument("--methods", default="kvr-ask,generate-one-at-a-time,generate-batched",
                    help=f"comma-separated, of {', '.join(METHODS)}")
    args = ap.parse_args()
    names = args.methods.split(",")
    if "kvr-ask" not in names or not set(names) <= set(METHODS):
        ap.error(f"--methods: kvr-ask and any of {', '.join(METHODS)}")
    if args.summary:
        rows_file = args.out / "rows.jsonl"
        for n, context in sorted({(r["questions"], r["context"]) for r in load_rows(rows_file)}):
            summary(rows_file, n, context)
        plot(rows_file)
        return
    torch.set_num_threads(2)
    lm = load_model("smollm2-135m", torch.float32, torch.device("cpu"))
    lines = (Path(__file__).parent / "questions_64.txt").read_text().splitlines()  # the 16 shipped ones first
    texts = [line for line in lines if line.strip()][: args.questions]
    context, questions = question_prompts(lm.tokenizer, context_text(lm.tokenizer, args.context_tokens), texts)
    env = environment("smollm2-135m", "local", 2, "none")
    rows_file = args.out / "rows.jsonl"
    rows = [json.loads(x) for x in rows_file.read_text().splitlines()] if rows_file.exists() else []
    done = {(r["round"], r["method"]) for r in rows if (r["questions"], r["context"]) == (len(questions), len(context))}
    args.out.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        for rnd in range(args.rounds):
            answers = {}
            for name in names[rnd % len(names):] + names[: rnd % len(names)]:
                if (rnd, name) in done:
                    continue
                need = cache_gib(lm.model.config, len(context) + max(map(len, questions)) + NEW_TOKENS, len(questions))
                if name in COPIES and need > args.memory_gib:
                    row = {**env, "round": rnd, "method": name, "questions": len(questions), "context": len(context),
                           "new_tokens": NEW_TOKENS, "skipped": f"its {len(questions)} copies of the context cache "
                           f"need {need:.1f} GiB (over --memory-gib {args.memory_gib:g})"}
                    print(f"round {rnd} {name:<24} skipped: {row['skipped']}", flush=True)
                    with rows_file.open("a") as f:
                        f.write(json.dumps(row) + "\n")
                    continue
                t0 = time.perf_counter()
                answers[name] = METHODS[name](lm.model, context, questions, lm.eos_token_ids)
                seconds = time.perf_counter() - t0
                row = {**env, "round": rnd, "method": name, "questions": len(questions), "context": len(context),
                       "new_tokens": NEW_TOKENS, "seconds": seconds, "answers_per_s": len(questions) / seconds,
                       "answers": answers[name]}
                print(f"round {rnd} {name:<24} {seconds:8.1f} s  {row['answers_per_s']:.3f} answers/s", flush=True)
                with rows_file.open("a") as f:
                    f.write(json.dumps(row) + "\n")
    summary(rows_file, len(questions), len(context))
    plot(rows_file)


def load_rows(rows_file: Path) -> list[dict]:
    return [json.loads(x) for x in rows_file.read_text().splitlines()]


def summary(rows_file: Path, n: int, context: int) -> None:
    """Median seconds per method, kvr-ask's speed-up over each (per round, then the median), and how many answers
    of each method equal kvr-ask's in the same round; a method not run says why."""
    rows = [r for r in load_rows(rows_file) if (r["questions"], r["context"]) == (n, context)]
    by = {(r["round"], r["method"]): r for r in rows if "skipped" not in r}
    lines = [f"# {n} questions, {context}-token context, {NEW_TOKENS} new tokens", "",
             "| method | rounds | median s | answers/s | kvr-ask's speed-up (median of rounds) | answers equal to "
             "kvr-ask's |", "|---|---|---|---|---|---|"]
    for name in METHODS:
        mine = sorted((r for (rnd, m), r in by.items() if m == name), key=lambda r: r["round"])
        if not mine:
            skipped = next((r["skipped"] for r in rows if r["method"] == name and "skipped" in r), None)
            if skipped:
                lines.append(f"| {name} | 0 | not run: {skipped} | | | |")
            continue
        ups = [by[(r["round"], "kvr-ask")]["answers_per_s"] / r["answers_per_s"] for r in mine
               if (r["round"], "kvr-ask") in by]
        same = [sum(a == b for a, b in zip(r["answers"], by[(r["round"], "kvr-ask")]["answers"])) for r in mine
                if (r["round"], "kvr-ask") in by]
        lines.append(f"| {name} | {len(mine)} | {statistics.median(r['seconds'] for r in mine):.1f} | "
                     f"{statistics.median(r['answers_per_s'] for r in mine):.3f} | "
                     f"{statistics.median(ups):.2f}x | {', '.join(f'{s}/{n}' for s in same)} |")
    (rows_file.parent / f"summary_ctx{context}_q{n}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def plot(rows_file: Path) -> None:
    """kvr-ask's speed-up over each method against the number of questions (medians of per-round ratios), one
    line per method and context length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in load_rows(rows_file) if "skipped" not in r]
    by = {(r["context"], r["questions"], r["round"], r["method"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for context in sorted({r["context"] for r in rows}):
        for name in METHODS:
            points = []
            for n in sorted({r["questions"] for r in rows if r["context"] == context}):
                ups = [by[(context, n, rnd, "kvr-ask")]["answers_per_s"] / r["answers_per_s"]
                       for (c, q, rnd, m), r in by.items()
                       if (c, q, m) == (context, n, name) and (context, n, rnd, "kvr-ask") in by]
                if ups and name != "kvr-ask":
                    points.append((n, statistics.median(ups)))
            if points:
                ax.plot(*zip(*points), marker="o", label=f"over {name}, {context}-token context")
    ax.axhline(1, color="grey", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("questions on one context")
    ax.set_ylabel("kvr-ask's answers/s ratio")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(rows_file.parent / "speedup.png", dpi=120)


if __name__ == "__main__":
    main()
