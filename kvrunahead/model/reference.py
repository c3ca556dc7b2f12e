"""The one-process reference a parallel run is checked against: the same prompt prefilled and greedily decoded
in one process, and the tolerance its first-token logits are held to."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvrunahead.model.compiled import eager
from kvrunahead.model.forward import forward_takes, greedy_decode, last_token_logits
from kvrunahead.model.linears import prepack, unpacked
from kvrunahead.model.load import LoadedModel

HALF = (torch.bfloat16, torch.float16)
ERROR_FACTOR = 2.0  # a half-precision run's logits may be this many times as far from float32 as one process's

ATOL_ULPS = 32  # logits may differ by this many roundings at the scale of the largest logit


def default_atol(dtype: torch.dtype, reference_logits: torch.Tensor) -> float:
    """The logit tolerance of a float32 run: 32 units of its rounding (eps) at the scale of the largest reference
    logit (half precision is graded against float32 instead: ``HalfGrade``). A chain or gather changes only the
    order of sums, so its logits differ from one full forward by a few roundings: on SmolLM2 at 2k over 2 ranks 8.1
    eps (many sums differ before one rounding shows)."""
    scale = max(1.0, float(reference_logits.float().abs().max()))
    return ATOL_ULPS * torch.finfo(dtype).eps * scale


@dataclass
class AloneCheck:
    """One prompt's tokens and first-token logits from a chained, packed or shared-context run, against the same
    prompt prefilled and greedily decoded alone in one process."""

    first_logit_diff: float
    atol: float
    matches: bool  # the greedy tokens equal and the first-token logits within ``atol``
    reference_text: str | None  # what the prompt alone gives, where the tokens differ


@torch.no_grad()
@eager()  # the reference is the eager model, compiled or not
def check_alone(lm: LoadedModel, ids: list[int], tokens: list[int], first_logits: torch.Tensor, dtype: torch.dtype,
                max_new_tokens: int) -> AloneCheck:
    device = next(lm.model.parameters()).device
    cache = DynamicCache(config=lm.model.config)
    logits = last_token_logits(lm.model, torch.tensor([ids], device=device), cache=cache)
    reference = greedy_decode(lm.model, int(logits.argmax()), cache, len(ids), max_new_tokens, lm.eos_token_ids)
    atol = default_atol(dtype, logits)
    diff = float((logits.float().cpu() - first_logits).abs().max())
    return AloneCheck(diff, atol, reference == tokens and diff <= atol,
                      None if reference == tokens else lm.decode(reference))


@torch.no_grad()
@eager()
def where_parted(model: torch.nn.Module, ids: list[int], reference: list[int], tokens: list[int]) -> tuple[int, float]:
    """The first step where two greedy continuations of ``ids`` differ, and the gap between the two tokens'
    logits there, from one reference forward over the prompt and the tokens both chose before it."""
    pairs = list(zip(reference, tokens))
    step = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
    if step == len(pairs):  # one ended (an end token) where the other went on
        return step, float("inf")
    device = next(model.parameters()).device
    logits = last_token_logits(model, torch.tensor([ids + reference[:step]], device=device),
                               cache=DynamicCache(config=model.config)).float()
    return step, float((logits[reference[step]] - logits[tokens[step]]).abs())


@dataclass
class HalfGrade:
    """A half-precision run against the same weights computed in float32, beside one half-precision process graded
    the same way: the float32 model is the truth both approximate, and one process's own rounding is the yardstick.

    - ``run_error``: max |first-token logits - float32's|; ``own_error``: the same for one half-precision process.
    - ``agreement``: the fraction of the run's generated tokens that are float32's top-1 after the same tokens
      (teacher-forced on the run's own continuation); ``own_agreement``: the same for one process's continuation.

    It passes when ``run_error <= ERROR_FACTOR * own_error`` (plus float32's own rounding at the logits' scale) and
    the run's agreement is at most one token short of one process's."""

    run_error: float
    own_error: float
    agreement: float
    own_agreement: float
    tokens: int
    floor: float

    @property
    def allowed_error(self) -> float:
        return ERROR_FACTOR * self.own_error + self.floor

    @property
    def ok(self) -> bool:
        return self.run_error <= self.allowed_error and self.agreement >= self.own_agreement - 1 / self.tokens - 1e-9

    def describe(self) -> str:
        return (f"against float32: logits off by {self.run_error:.3g} (one process: {self.own_error:.3g}, allowed "
                f"{self.allowed_error:.3g}), top-1 agreement {self.agreement:.0%} of {self.tokens} tokens (one "
                f"process: {self.own_agreement:.0%})")


def float32_twin(model: torch.nn.Module) -> torch.nn.Module:
    """The same weights in float32 (made once per model and kept on it: several prompts are graded against it)."""
    twin = getattr(model, "_kvrunahead_float32_twin", None)
    if twin is None:
        with unpacked(model):
            twin = copy.deepcopy(model).float().eval()
        prepack(twin)
        object.__setattr__(model, "_kvrunahead_float32_twin", twin)
    return twin


@torch.no_grad()
def teacher_forced(model: torch.nn.Module, ids: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits ``[len(tokens), vocab]`` (float32) at the positions that chose each of ``tokens`` after ``ids``: the
    first row is the prompt's first-token logits."""
    device = next(model.parameters()).device
    x = torch.tensor([ids + tokens[:-1]], device=device)
    if forward_takes(model, "logits_to_keep"):
        logits = model(input_ids=x, logits_to_keep=len(tokens), use_cache=False).logits[0]
    else:
        logits = model(input_ids=x, use_cache=False).logits[0, -len(tokens):]
    return logits.float().cpu()


@torch.no_grad()
@eager()
def grade_half(model: torch.nn.Module, ids: list[int], tokens: list[int], first_logits: torch.Tensor,
               own_tokens: list[int], own_first_logits: torch.Tensor) -> HalfGrade:
    """Grade a half-precision run (its ``tokens`` and first-token logits) and one half-precision process (its own)
    against ``model``'s float32 twin."""
    twin = float32_twin(model)
    truth = teacher_forced(twin, ids, tokens)
    own_truth = truth if own_tokens == tokens else teacher_forced(twin, ids, own_tokens)

    def agreement(t: torch.Tensor, toks: list[int]) -> float:
        return float((t.argmax(-1) == torch.tensor(toks)).float().mean())

    scale = max(1.0, float(truth[0].abs().max()))
    return HalfGrade(
        run_error=float((first_logits.float().cpu() - truth[0]).abs().max()),
        own_error=float((own_first_logits.float().cpu() - own_truth[0]).abs().max()),
        agreement=agreement(truth, tokens), own_agreement=agreement(own_truth, own_tokens), tokens=len(tokens),
        floor=ATOL_ULPS * torch.finfo(torch.float32).eps * scale)
