"""vLLM's sampling parameters in the server's sampler: each adjustment against transformers' own logits processor
where it has one, or against the definition written out; the defaults leave greedy output as it was."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
)

from kvrunahead.serve.sampling import Sampler, adjusted, min_p, top_k
from kvrunahead.serve.sequence import SamplingParams

VOCAB = 50


def _logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_the_repetition_penalty_is_transformers_over_the_prompt_and_the_output():
    logits, prompt, output = _logits(), [3, 7, 7, 11], [7, 20]
    got = adjusted(logits, SamplingParams(repetition_penalty=1.3), prompt, output, set())
    want = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits[None].clone())[0]
    torch.testing.assert_close(got, want)


def test_frequency_and_presence_penalties_count_the_output_only():
    logits, output = _logits(1), [4, 4, 4, 9]
    got = adjusted(logits, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [4, 30], output, set())
    want = logits.clone()
    want[4] -= 3 * 0.5 + 0.25
    want[9] -= 0.5 + 0.25  # token 30, in the prompt only, keeps its logit
    torch.testing.assert_close(got, want)


def test_min_tokens_masks_the_end_tokens_as_transformers_does_then_lets_them_through():
    logits, ends = _logits(2), {5, 17}
    params = SamplingParams(min_tokens=3, stop_token_ids=[17])
    early = adjusted(logits, params, [1, 2], [8, 9], ends)
    want = MinNewTokensLengthLogitsProcessor(2, 5, sorted(ends))(torch.tensor([[1, 2, 8, 9]]), logits[None].clone())
    torch.testing.assert_close(early, want[0])
    torch.testing.assert_close(adjusted(logits, params, [1, 2], [8, 9, 10], ends), logits)


def test_logit_bias_adds_to_the_named_tokens():
    logits = _logits(3)
    got = adjusted(logits, SamplingParams(logit_bias={2: 100.0, 40: -5.5}), [], [], set())
    assert int(got.argmax()) == 2 and got[40] == logits[40] - 5.5
    assert torch.equal(got[3:40], logits[3:40])


def test_top_k_and_min_p_are_transformers_warpers():
    logits = _logits(4)
    torch.testing.assert_close(top_k(logits, 5), TopKLogitsWarper(5)(None, logits[None].clone())[0])
    probs = torch.softmax(logits, -1)
    warped = MinPLogitsWarper(0.1)(None, logits[None].clone().log_softmax(-1))[0]
    torch.testing.assert_close(min_p(probs, 0.1), torch.softmax(warped, -1))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, seed=1, top_k=3),
    SamplingParams(temperature=0.8, seed=1, min_p=0.2),
])
def test_sampling_draws_only_what_top_k_and_min_p_keep(params):
    logits = _logits(5)
    probs = torch.softmax(logits / 0.8, -1)
    allowed = set(logits.topk(3).indices.tolist()) if params.top_k else \
        {i for i, q in enumerate(probs.tolist()) if q >= 0.2 * float(probs.max())}
    sampler = Sampler(params)
    assert {sampler(logits) for _ in range(200)} <= allowed


def test_greedy_with_the_defaults_is_the_argmax_and_the_sampler_remembers_its_tokens():
    sampler = Sampler(SamplingParams(), prompt_ids=[1, 2], eos_token_ids={0})
    logits = _logits(6)
    assert not SamplingParams().adjusts_logits
    assert sampler(logits) == int(logits.argmax()) and sampler.output == [int(logits.argmax())]
    penalised = Sampler(SamplingParams(repetition_penalty=2.0), prompt_ids=[int(logits.argmax())])
    assert penalised(logits) != int(logits.argmax()) or logits.argmax() <= 0  # the prompt's token is penalised


def test_bad_values_are_refused_by_name():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3).check()
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0.0).check()


def test_the_engines_greedy_tokens_with_vllms_parameters_equal_transformers_generate():
    """A served request with repetition_penalty, or with a stop token held back by min_tokens, gives the tokens
    transformers' ``generate`` gives with the same settings (its own logits processors and end tokens)."""
    from kvrunahead.config import RunConfig
    from kvrunahead.ranks.launcher import World
    from kvrunahead.serve.config import EngineConfig
    from kvrunahead.serve.engine import Engine
    from kvrunahead.serve.sequence import Request, TokenEvent

    engine = Engine(EngineConfig(run=RunConfig(model="tiny-llama", threads=1)), World(0, 1, 0, 1, "single"))
    model = engine.ctx.lm.model
    prompt = [5, 9, 9, 14, 30, 9, 61, 5]

    def served(params: SamplingParams) -> list[int]:
        events, _ = engine.run_one(Request("r", prompt, params))
        return [e.token_id for e in events if isinstance(e, TokenEvent)]

    def generated(n: int, **kw) -> list[int]:
        return model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                              **kw)[0, len(prompt):].tolist()

    assert served(SamplingParams(max_tokens=12, repetition_penalty=1.5)) == generated(12, repetition_penalty=1.5)
    stop = served(SamplingParams(max_tokens=12))[2]  # the plain greedy run's third token ends the runs below
    early = served(SamplingParams(max_tokens=12, stop_token_ids=[stop]))
    held = served(SamplingParams(max_tokens=12, stop_token_ids=[stop], min_tokens=6))
    assert early == generated(12, eos_token_id=stop) and early[-1] == stop and len(early) <= 3
    assert held == generated(12, eos_token_id=stop, min_new_tokens=6) and len(held) > len(early)
