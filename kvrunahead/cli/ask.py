"""``kvr-ask``: many questions about one shared context, the context prefilled once."""

from __future__ import annotations

import json
import sys

import click

from kvrunahead.cli import common
from kvrunahead.errors import InputError
from kvrunahead.model.load import MODEL_CHOICES
from kvrunahead.ranks.launcher import detect_launcher, spawn, world_size_hint

PROG = "kvr-ask"


def read_questions(path: str) -> list[str]:
    """One question per non-blank line."""
    questions = [line.strip() for line in common.read_prompt_file(path).splitlines() if line.strip()]
    if not questions:
        raise InputError(f"{path} holds no question (one per line)")
    return questions


def format_result(r) -> str:
    lines = [
        f"context      {r.context_tokens} tokens on {r.world_size} rank(s), partition "
        f"{','.join(map(str, r.boundaries))}: {r.context_s * 1e3:.1f} ms",
        f"questions    {len(r.answers)}, prefilled together: every first token {r.questions_s * 1e3:.1f} ms later "
        f"(TTFT {(r.context_s + r.questions_s) * 1e3:.1f} ms)",
        f"decode       {r.decode_steps} steps for all unfinished questions at once: {r.decode_s * 1e3:.1f} ms; "
        f"{len(r.answers)} answers in {r.total_s:.2f} s ({len(r.answers) / r.total_s:.2f} answers/s)",
    ]
    for i, a in enumerate(r.answers, 1):
        check = "" if a.matches is None else ("   [matches its standalone prompt]" if a.matches
                                              else f"   [DIFFERS: standalone gives {a.reference_text!r}]")
        lines += [f"Q{i:<3} {a.question}", f"A{i:<3} {a.text!r}{check}"]
    if r.verified is not None:
        worst = max(a.first_logit_diff for a in r.answers)
        same = sum(bool(a.matches) for a in r.answers)
        lines.append(f"verify       {'OK' if r.verified else 'MISMATCH'}: {same} of {len(r.answers)} answers equal "
                     f"their standalone prompts' (max |first-token logit diff| {worst:.3g}, atol {r.atol:.3g})")
    return "\n".join(lines)


@click.command(context_settings=common.SETTINGS)
@common.model_option(help=f"A preset ({', '.join(MODEL_CHOICES)}) or a local transformers model directory.")
@click.option("--context", "context_file", type=click.Path(exists=True, dir_okay=False), required=True,
              help="The shared context (UTF-8 text).")
@click.option("--questions", "questions_file", type=click.Path(exists=True, dir_okay=False), required=True,
              help="The questions, one per line.")
@click.option("--no-chat", is_flag=True,
              help="Raw text (context, a blank line, the question), not one user turn of the chat template.")
@click.option("--nproc", type=int, default=1, show_default=True,
              help="Start this many local ranks (when not launched by torchrun or mpirun); the context is "
                   "prefilled over them by KV-Runahead, the questions answered on the last.")
@click.option("--partition", default="auto", show_default=True, help="The context's partition, as in kvr-prefill.")
@common.kvr_attention_option(help="The context's chain attention, as in kvr-prefill.")
@common.dtype_option()
@common.attention_kernel_option()
@common.linears_option()
@common.compile_option()
@common.device_option()
@click.option("--threads", type=int, default=None, help="Intra-op threads per rank. Default: cores / local ranks.")
@click.option("--max-new-tokens", type=int, default=32, show_default=True,
              help="Greedy tokens per answer (first token included).")
@click.option("--verify", is_flag=True,
              help="Also answer each question from its own standalone prompt (context + question) and compare "
                   "tokens and first-token logits; exit 1 on any difference.")
@common.timeout_option(60.0, help="Seconds a rank waits on another's K,V before failing.")
@common.allow_long_context_option(help="Run beyond the trained positions without a RoPE extension.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the synthetic presets' weights.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
@click.option("-v", "--verbose", is_flag=True, help="Log progress to stderr.")
def main(context_file, questions_file, no_chat, nproc, max_new_tokens, verify, as_json, verbose, **options) -> None:
    """Answer many questions about one context, prefilling the context once (IPPD, PAT).

    The questions are prefilled together after the context, each at the positions it would have alone after it
    and seeing only the context and itself; decoding advances every unfinished question by one token per step,
    reading the context's K,V once per step for all of them. Each answer equals the greedy answer of its
    standalone prompt (--verify checks it).

    \b
      kvr-ask --context doc.txt --questions questions.txt
      kvr-ask --nproc 2 --context doc.txt --questions questions.txt --verify
    """
    common.quiet(verbose)
    launcher = detect_launcher()
    with common.failure_ending(PROG, rank=common.env_rank(), reraise=verbose):
        if max_new_tokens < 1:
            raise InputError("--max-new-tokens must be at least 1")
        context, questions = common.read_prompt_file(context_file), read_questions(questions_file)
        from kvrunahead.config import RunConfig
        from kvrunahead.decide.policy import prepare
        from kvrunahead.decode.shared_prefix import require_full_attention
        from kvrunahead.model.device import check_device
        from kvrunahead.model.load import load_tokenizer, resolve_config
        from kvrunahead.oneshot.ask import AskJob
        from kvrunahead.oneshot.on_engine import ask_on_world
        from kvrunahead.oneshot.runner import run
        from kvrunahead.prompt import question_prompts

        check_device(options["device"])
        context_ids, question_ids = question_prompts(load_tokenizer(options["model"]), context, questions,
                                                     chat=not no_chat)
        cfg = RunConfig(context_len=len(context_ids), **options)
        world_size = world_size_hint(launcher, nproc)
        common.check_nproc(nproc, launcher, world_size)
        try:
            require_full_attention(resolve_config(options["model"]))
        except NotImplementedError as e:
            raise InputError(str(e)) from None
        if launcher == "single" and nproc > 1:
            prepare(cfg, nproc)  # one clear error here rather than one per rank
            sys.exit(spawn(nproc, sys.argv[1:], module="kvrunahead.cli.ask", fork=True))
        job = AskJob(context_ids, question_ids, questions, max_new_tokens)
        result = run(cfg, launcher, world_size, lambda c, world: ask_on_world(c, world, job, verify))
    if result is None:
        return
    click.echo(json.dumps(result.to_dict()) if as_json else format_result(result))
    if result.verified is False:
        sys.exit(1)


if __name__ == "__main__":
    main()
