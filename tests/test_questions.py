"""Many questions on one context (decode/shared_prefix.py): the two-block attention equals attention over a copy
of the prefix per sequence, and every answer equals the greedy answer of its standalone prompt."""

import pytest
import torch
from transformers import DynamicCache

from kvrunahead.decode.shared_prefix import answer, context_prefixes, padded_attention, prefix_attention
from kvrunahead.model.forward import greedy_decode, last_token_logits
from kvrunahead.model.load import load_model
from kvrunahead.modes.attention import merge_lse

CPU = torch.device("cpu")


def copied_prefix_attention(q, prefix_k, prefix_v, own_k, own_v, valid, scale):
    """The per-sequence reference: every sequence's own copy of the prefix before its keys, one masked softmax."""
    b, heads = q.shape[0], q.shape[1]
    k = torch.cat((prefix_k.expand(b, -1, -1, -1), own_k), dim=2).repeat_interleave(heads // own_k.shape[1], 1)
    v = torch.cat((prefix_v.expand(b, -1, -1, -1), own_v), dim=2).repeat_interleave(heads // own_v.shape[1], 1)
    mask = torch.cat((valid.new_ones(b, prefix_k.shape[2]), valid), dim=1)[:, None, None, :]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (4, 1)])
@pytest.mark.parametrize("sequences", [1, 5])
def test_the_shared_prefix_read_once_equals_a_copy_of_it_per_sequence(heads, kv_heads, sequences):
    torch.manual_seed(0)
    prefix, slots, dim = 37, 6, 16
    q = torch.randn(sequences, heads, 1, dim)
    pk, pv = torch.randn(1, kv_heads, prefix, dim), torch.randn(1, kv_heads, prefix, dim)
    own_k, own_v = torch.randn(sequences, kv_heads, slots, dim), torch.randn(sequences, kv_heads, slots, dim)
    valid = torch.arange(slots)[None, :] >= torch.arange(sequences)[:, None] % slots  # left padding, varied
    out, lse = prefix_attention(q, pk, pv, None)
    own_out, own_lse = padded_attention(q, own_k, own_v, valid, None)
    merged, _ = merge_lse(own_out, own_lse, out, lse)
    reference = copied_prefix_attention(q, pk, pv, own_k, own_v, valid, None)
    assert torch.allclose(merged, reference, atol=1e-5)


def standalone(model, context, question, new_tokens):
    """The greedy answer and first-token logits of the prompt "context + question" on its own."""
    ids = context + question
    cache = DynamicCache(config=model.config)
    logits = last_token_logits(model, torch.tensor([ids]), cache=cache)
    return greedy_decode(model, int(logits.argmax()), cache, len(ids), new_tokens, set()), logits


@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-neox", "tiny-bigcode"])
@pytest.mark.parametrize("lengths", [[5], [1, 3, 17, 60]], ids=["one", "mixed"])
def test_every_answer_equals_its_standalone_prompts_greedy_answer(model_name, lengths):
    """Questions of 1 token, of several, and one longer than the context; GQA, MHA and MQA."""
    torch.set_num_threads(1)
    model = load_model(model_name, torch.float32, CPU, seed=0).model
    gen = torch.Generator().manual_seed(1)
    context = torch.randint(0, 200, (40,), generator=gen).tolist()
    questions = [torch.randint(0, 200, (n,), generator=gen).tolist() for n in lengths]
    got = answer(model, context_prefixes(model, context), questions, max_new_tokens=8, eos_token_ids=set())
    for mine, question in zip(got, questions):
        tokens, logits = standalone(model, context, question, 8)
        assert mine.tokens == tokens
        assert torch.allclose(mine.first_logits, logits, atol=1e-4)


def test_questions_that_finish_early_leave_the_others_unchanged():
    model = load_model("tiny-llama", torch.float32, CPU, seed=0).model
    context, questions = list(range(30)), [[5, 6], [7], [8, 9, 10]]
    full = [a.tokens for a in answer(model, context_prefixes(model, context), questions, 6, set())]
    stop = full[1][1]  # the second question's second token ends it (and any other answer that produces it)
    early = [a.tokens for a in answer(model, context_prefixes(model, context), questions, 6, {stop})]
    for mine, whole in zip(early, full):
        cut = whole[: whole.index(stop) + 1] if stop in whole else whole
        assert mine == cut


def test_a_model_with_sliding_window_layers_is_refused():
    model = load_model("tiny-gemma3", torch.float32, CPU, seed=0).model
    with pytest.raises(NotImplementedError, match="sliding-window"):
        context_prefixes(model, list(range(10)))
