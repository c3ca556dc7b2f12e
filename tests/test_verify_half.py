"""--verify in half precision: the run and one process in the same precision, both graded against the same weights in
float32 (model/reference.py's HalfGrade), where the old tolerance (32 eps x the largest logit) let a run pass that had
lost a token of its prompt."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvrunahead.model.forward import greedy_decode, last_token_logits
from kvrunahead.model.load import load_model
from kvrunahead.model.reference import default_atol, grade_half

NEW_TOKENS = 8


def _alone(lm, ids):
    cache = DynamicCache(config=lm.model.config)
    with torch.no_grad():
        logits = last_token_logits(lm.model, torch.tensor([ids]), cache=cache)
        tokens = greedy_decode(lm.model, int(logits.argmax()), cache, len(ids), NEW_TOKENS, lm.eos_token_ids)
    return logits.float(), tokens


def test_a_run_that_is_one_process_passes_and_one_that_lost_a_prompt_token_fails():
    """The lost token is the prompt's middle one: its first-token logits move by 0.02 where the old tolerance was
    0.25 (its greedy tokens the same), while one bfloat16 process is 0.004 from float32."""
    lm = load_model("tiny-llama", torch.bfloat16, torch.device("cpu"))
    ids = [(7 * i + 3) % 200 + 1 for i in range(60)]
    own_logits, own_tokens = _alone(lm, ids)

    same = grade_half(lm.model, ids, own_tokens, own_logits, own_tokens, own_logits)
    assert same.ok, same.describe()
    assert same.run_error == same.own_error and 0 < same.own_error  # bfloat16 really rounds
    assert same.tokens == len(own_tokens)

    # a chain that dropped a token of the prompt: what the old tolerance could not tell from rounding
    lost_logits, lost_tokens = _alone(lm, ids[:30] + ids[31:])
    lost = grade_half(lm.model, ids, lost_tokens, lost_logits, own_tokens, own_logits)
    assert not lost.ok, lost.describe()
    assert lost.run_error > lost.allowed_error
    old_atol = default_atol(torch.bfloat16, own_logits)
    assert float((lost_logits - own_logits).abs().max()) <= old_atol and lost_tokens == own_tokens  # the old passed


def test_the_agreement_statistic_counts_top1_tokens_against_float32():
    lm = load_model("tiny-llama", torch.bfloat16, torch.device("cpu"))
    ids = [(5 * i + 1) % 200 + 1 for i in range(40)]
    own_logits, own_tokens = _alone(lm, ids)
    wrong = [(t + 1) % 250 for t in own_tokens]  # every generated token off float32's top-1
    grade = grade_half(lm.model, ids, wrong, own_logits, own_tokens, own_logits)
    assert grade.agreement == 0.0 and grade.own_agreement > 0.5 and not grade.ok
