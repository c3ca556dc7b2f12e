"""What the HTTP layer answers: the two endpoints' response and stream-chunk shapes, the usage, the request's own
figures (the ``kvrunahead`` extension field) and the tokens' log-probabilities as OpenAI lays them out."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel

from kvrunahead.serve.http import protocol as p
from kvrunahead.serve.sequence import Finished, TokenEvent, TokenLogprob


def figures(done: Finished | None) -> p.KvrFigures | None:
    f = done.figures if done is not None else None
    if f is None:
        return None
    return p.KvrFigures(
        ttft_s=f.ttft_s, queue_s=f.queue_s, degree=f.degree, degree_source=f.degree_source,
        layout_basis=f.layout_basis,
        partition=p.Partition(boundaries=list(f.boundaries), source=f.partition_source),
        ranks=[p.RankFigures(**{k: r[k] for k in ("rank", "compute_s", "wait_s", "bytes_sent")}) for r in f.ranks],
        packed_with=f.packed_with, cached_tokens=f.cached_tokens, decode=f.decode,
        chunks=[p.ChunkFigures(**c) for c in f.chunks], retried=f.retried)


def usage(prompt_tokens: int, completion_tokens: int) -> p.Usage:
    return p.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


def sse(body: BaseModel | dict) -> str:
    return f"data: {body.model_dump_json() if isinstance(body, BaseModel) else json.dumps(body)}\n\n"


@dataclass
class Choice:
    """One choice as it is answered: its text so far (after the echoed prompt, where asked), its tokens'
    log-probabilities, how it ended."""

    index: int
    prompt: list[int]
    echo: str = ""
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None  # its prompt's tokens after the first, where echo asks
    done: Finished | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    def take_prompt_logprobs(self, event: TokenEvent | Finished) -> None:
        """Keep the prompt's log-probabilities the first event carries, where the prompt is echoed."""
        if self.echo and isinstance(event, TokenEvent) and event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs

    @property
    def completion_tokens(self) -> int:
        return self.done.completion_tokens if self.done is not None else 0


class Completions:
    """/v1/completions: ``text_completion`` objects, streamed as the same objects carrying the new text; each
    choice's ``logprobs`` in the legacy shape (tokens, token_logprobs, top_logprobs, text_offset)."""

    def __init__(self, token_text: Callable[[int], str], with_logprobs: bool) -> None:
        self.token_text, self.with_logprobs = token_text, with_logprobs

    def logprobs(self, items: list[TokenLogprob], offset: int, echoed: Choice | None = None
                 ) -> p.CompletionLogprobs | None:
        """The tokens' entries from text offset ``offset``; with the ``echoed`` choice's prompt first (its first
        token without a log-probability: nothing comes before it), as vLLM lists an echoed prompt."""
        if not self.with_logprobs:
            return None
        out = p.CompletionLogprobs()
        if echoed is not None and echoed.prompt_logprobs is not None:
            text = self.token_text(echoed.prompt[0])
            out.tokens.append(text)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(offset)
            offset += len(text)
            items = echoed.prompt_logprobs + items
        for item in items:
            text = self.token_text(item.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(item.logprob)
            # the chosen token among the likeliest, as vLLM lists it (a client tells a greedy choice by the max)
            out.top_logprobs.append({**{self.token_text(t): lp for t, lp in item.top}, text: item.logprob})
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def response(self, rid: str, model: str, choices: list[Choice]) -> BaseModel:
        return p.CompletionResponse(
            id=rid, model=model, kvrunahead=figures(choices[0].done),
            usage=usage(sum(c.prompt_tokens for c in choices), sum(c.completion_tokens for c in choices)),
            choices=[p.CompletionChoice(index=c.index, text=c.echo + c.text, finish_reason=c.done.finish_reason,
                                        logprobs=self._whole(c)) for c in choices])

    def _whole(self, c: Choice) -> p.CompletionLogprobs | None:
        if c.prompt_logprobs is not None:
            return self.logprobs(c.logprobs, 0, c)
        return self.logprobs(c.logprobs, len(c.echo))

    def chunk(self, rid: str, model: str, choice: Choice, text: str, items: list[TokenLogprob], offset: int,
              first: bool, use: p.Usage | None = None) -> BaseModel:
        echoed = choice if first and choice.echo else None  # the echo chunk comes first
        return p.CompletionResponse(id=rid, model=model, usage=use, choices=[
            p.CompletionChoice(index=choice.index, text=text, logprobs=self.logprobs(items, offset, echoed))])

    def last(self, rid: str, model: str, choice: Choice, items: list[TokenLogprob], offset: int,
             use: p.Usage | None = None) -> BaseModel:
        return p.CompletionResponse(id=rid, model=model, usage=use, kvrunahead=figures(choice.done), choices=[
            p.CompletionChoice(index=choice.index, text="", finish_reason=choice.done.finish_reason,
                               logprobs=self.logprobs(items, offset) if items else None)])

    def usage_chunk(self, rid: str, model: str, total: p.Usage) -> BaseModel:
        return p.CompletionResponse(id=rid, model=model, choices=[], usage=total)


class Chat:
    """/v1/chat/completions: ``chat.completion``, streamed as ``chat.completion.chunk`` deltas; each choice's
    ``logprobs.content`` one entry per token with its ``top`` likeliest alternatives."""

    def __init__(self, token_text: Callable[[int], str], with_logprobs: bool, top: int) -> None:
        self.token_text, self.with_logprobs, self.top = token_text, with_logprobs, top

    def _entry(self, token: int, logprob: float) -> dict:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def logprobs(self, items: list[TokenLogprob]) -> p.ChatLogprobs | None:
        if not self.with_logprobs:
            return None
        return p.ChatLogprobs(content=[
            p.TokenLogprobEntry(**self._entry(i.token_id, i.logprob),
                                top_logprobs=[p.TopLogprob(**self._entry(t, lp)) for t, lp in i.top[:self.top]])
            for i in items])

    def response(self, rid: str, model: str, choices: list[Choice]) -> BaseModel:
        return p.ChatCompletionResponse(
            id=rid, model=model, kvrunahead=figures(choices[0].done),
            usage=usage(sum(c.prompt_tokens for c in choices), sum(c.completion_tokens for c in choices)),
            choices=[p.ChatChoice(index=c.index, message=p.AssistantMessage(content=c.text),
                                  finish_reason=c.done.finish_reason, logprobs=self.logprobs(c.logprobs))
                     for c in choices])

    def chunk(self, rid: str, model: str, choice: Choice, text: str, items: list[TokenLogprob], offset: int,
              first: bool, use: p.Usage | None = None) -> BaseModel:
        delta = p.Delta(role="assistant" if first else None, content=text)
        return p.ChatCompletionChunk(id=rid, model=model, usage=use, choices=[
            p.ChatChunkChoice(index=choice.index, delta=delta, logprobs=self.logprobs(items))])

    def last(self, rid: str, model: str, choice: Choice, items: list[TokenLogprob], offset: int,
             use: p.Usage | None = None) -> BaseModel:
        return p.ChatCompletionChunk(id=rid, model=model, usage=use, kvrunahead=figures(choice.done), choices=[
            p.ChatChunkChoice(index=choice.index, delta=p.Delta(), finish_reason=choice.done.finish_reason,
                              logprobs=self.logprobs(items) if items else None)])

    def usage_chunk(self, rid: str, model: str, total: p.Usage) -> BaseModel:
        return p.ChatCompletionChunk(id=rid, model=model, choices=[], usage=total)
