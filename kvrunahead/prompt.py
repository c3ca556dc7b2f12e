"""Prompts of an exact token count, from shipped public-domain English text or the user's file."""

from __future__ import annotations

import re
from importlib import resources

QUESTION = "In one sentence, what is the text above about?"


class PromptError(ValueError):
    pass


def parse_tokens(text: str) -> int:
    """``4096``, ``4k``, ``16K`` or ``1M`` -> tokens (k = 1024, M = 1024 k)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", str(text))
    if not m:
        raise PromptError(f"cannot parse token count {text!r}: use a number like 2048, 2k or 1M")
    return int(m.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()]


def shipped_text() -> str:
    return resources.files("kvrunahead.data").joinpath("declaration.txt").read_text(encoding="utf-8")


def _fill(ids: list[int], n: int) -> list[int]:
    if not ids:
        raise PromptError("the prompt text is empty")
    reps = -(-n // len(ids))
    return (ids * reps)[:n]


def build_prompt(tokenizer, context_len: int | None, text: str | None = None, chat: bool = True) -> list[int]:
    """Token ids of a prompt of exactly ``context_len`` tokens (the text's own length when None).

    With a chat model the text is wrapped as a user turn that asks about it, and the document is
    cut (or repeated) so that the whole turn, template included, is exactly ``context_len`` tokens.
    """
    doc = shipped_text() if text is None else text
    doc_ids = tokenizer.encode(doc)
    template = getattr(tokenizer, "chat_template", None)
    if chat and template:
        marker = "\x00DOC\x00"
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{marker}\n\n{QUESTION}"}], add_generation_prompt=True, tokenize=False
        )
        head, tail = rendered.split(marker)
        head_ids = tokenizer.encode(head, add_special_tokens=False)
        tail_ids = tokenizer.encode(tail, add_special_tokens=False)
        doc_ids = tokenizer.encode(doc, add_special_tokens=False)
        if context_len is None:
            return head_ids + doc_ids + tail_ids
        room = context_len - len(head_ids) - len(tail_ids)
        if room >= 16:
            return head_ids + _fill(doc_ids, room) + tail_ids
        # Too short for the template: a plain text prefix of the requested length.
    # A plain prompt: the tokenizer's special tokens once at the start (Gemma's BOS), then the text, repeated
    # without them to the length asked.
    try:
        specials = tokenizer.encode("")
        doc_ids = tokenizer.encode(doc, add_special_tokens=False)
    except TypeError:  # a tokenizer without special tokens (the synthetic models' bytes)
        specials = []
    if context_len is None:
        return specials + doc_ids
    if context_len <= len(specials):
        return specials[:context_len]
    return specials + _fill(doc_ids, context_len - len(specials))


def question_prompts(tokenizer, context: str, questions: list[str], chat: bool = True) -> tuple[list[int],
                                                                                              list[list[int]]]:
    """Token ids of a shared context and of each question after it, so that ``context + question`` is that
    question's whole standalone prompt. With a chat model both sit in one user turn (the context, a blank line,
    the question) followed by the assistant's turn, whose opening ends every question's ids."""
    template = getattr(tokenizer, "chat_template", None)
    if chat and template:
        marker = "\x00CONTEXT\x00"
        head, tail = tokenizer.apply_chat_template([{"role": "user", "content": marker}],
                                                   add_generation_prompt=True, tokenize=False).split(marker)
        context_ids = tokenizer.encode(head + context, add_special_tokens=False)
        return context_ids, [tokenizer.encode(f"\n\n{q}{tail}", add_special_tokens=False) for q in questions]
    try:
        context_ids = tokenizer.encode(context)
        return context_ids, [tokenizer.encode(f"\n\n{q}", add_special_tokens=False) for q in questions]
    except TypeError:  # a tokenizer without special tokens (the synthetic models' bytes)
        return tokenizer.encode(context), [tokenizer.encode(f"\n\n{q}") for q in questions]


def chat_prompt(tokenizer, text: str, chat: bool = True) -> list[int]:
    """Token ids of ``text`` as the user's whole turn (with the model's chat template and the assistant's turn
    opened), or with ``chat=False`` the raw text after the tokenizer's own special tokens."""
    if not text:
        raise PromptError("the prompt text is empty")
    if chat and getattr(tokenizer, "chat_template", None):
        return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                              add_generation_prompt=True, tokenize=False),
                                add_special_tokens=False)
    return tokenizer.encode(text)
