"""Tensor parallelism from checkpoints as users have them: every family ``--tp`` cuts, saved to a folder with
``save_pretrained`` (seeded random weights, a byte-level tokenizer) and read from it shard by shard, verifies
against one process at ``--tp 2``: on one TP group and on a chain of two. A family whose checkpoint names a tensor
otherwise than its model does (GPT-NeoX's ``embed_out``, transformers' ``lm_head``) once loaded a random output
layer here while the in-memory presets verified."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (
    Gemma3TextConfig,
    GPTNeoXConfig,
    LlamaConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from tests.test_tp import _verified

pytestmark = pytest.mark.timeout(600)

SMALL = dict(vocab_size=258, hidden_size=64, intermediate_size=128, num_attention_heads=4, max_position_embeddings=2048,
             bos_token_id=256, eos_token_id=257)
FAMILIES = {
    "llama": lambda: LlamaConfig(num_hidden_layers=3, num_key_value_heads=2, **SMALL),
    "qwen2": lambda: Qwen2Config(num_hidden_layers=3, num_key_value_heads=2, **SMALL),
    "gemma3": lambda: Gemma3TextConfig(num_hidden_layers=6, num_key_value_heads=1, head_dim=16, sliding_window=64,
                                       query_pre_attn_scalar=16, **SMALL),
    "phi3": lambda: Phi3Config(num_hidden_layers=3, num_key_value_heads=2, pad_token_id=0, **SMALL),
    "gpt_neox": lambda: GPTNeoXConfig(num_hidden_layers=3, rotary_pct=0.25, **SMALL),
    "gpt_neox_serial": lambda: GPTNeoXConfig(num_hidden_layers=3, rotary_pct=1.0, use_parallel_residual=False,
                                             attention_bias=False, **SMALL),
}


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer of 256 bytes and two special tokens (ids 256, 257), as GPT-2's bytes are spelled."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled = {b: chr(b) for b in printable}
    spelled.update({b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in spelled)})
    vocab = {spelled[b]: b for b in range(256)} | {"<s>": 256, "</s>": 257}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def saved(family: str, folder: Path) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[family]())
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def test_the_byte_tokenizer_round_trips():
    tok = byte_tokenizer()
    text = "hello, world é 日本"
    assert tok.decode(tok.encode(text)) == text and max(tok.encode(text)) < 256


@pytest.mark.parametrize("family", FAMILIES)
def test_a_saved_checkpoint_verifies_on_one_tp_group(family, tmp_path):
    out = _verified("--model", str(saved(family, tmp_path)), "--no-chat", "--nproc", "2", "--tp", "2", "--ctx", "300",
                    "--max-new-tokens", "6")
    assert out["tp"] == 2 and out["world_size"] == 1


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt_neox"])  # plain, sliding windows, fused q,k,v
def test_a_saved_checkpoint_verifies_on_a_chain_of_two_tp_groups(family, tmp_path):
    out = _verified("--model", str(saved(family, tmp_path)), "--no-chat", "--nproc", "4", "--tp", "2", "--ctx", "300",
                    "--partition", "0.6,0.4", "--max-new-tokens", "6")
    assert out["tp"] == 2 and out["world_size"] == 2


def test_a_neox_checkpoint_names_its_output_layer_otherwise_and_is_read_by_the_model_s_name(tmp_path):
    from kvrunahead.model.stage import safetensors_entries

    folder = saved("gpt_neox", tmp_path)
    header = json.loads((folder / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (folder / "model.safetensors").read_bytes()[:8], "little")])
    assert "embed_out.weight" in header  # as stored
    names = {key for _, _, key, _ in safetensors_entries(folder)}
    assert "lm_head.weight" in names and "embed_out.weight" not in names
