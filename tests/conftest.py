"""Shared fixtures: a tiny random Llama (unit tests) and the bundled model (end-to-end tests)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

# Tiny matmuls are dominated by thread hand-off on a 2-core machine; one thread is faster and stable.
torch.set_num_threads(1)


def tiny_llama(vocab_size: int = 48, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def tiny_model() -> LlamaForCausalLM:
    return tiny_llama()


class IdTokenizer:
    """The smallest tokenizer the engine needs: ids are tokens; pad 0, eos 1."""

    pad_token_id = 0
    eos_token_id = 1

    def batch_decode(self, ids, skip_special_tokens=True):
        return [
            " ".join(str(int(i)) for i in row if not (skip_special_tokens and int(i) in (0, 1)))
            for row in ids
        ]


@pytest.fixture
def id_tokenizer() -> IdTokenizer:
    return IdTokenizer()
