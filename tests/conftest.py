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


# The test files that take longest (wall time on two xdist workers), longest first. `make test` hands whole
# files to two workers in collection order (--dist loadfile); a long file collected last keeps one worker
# busy alone at the end while the other core idles (measured: test_distributed, test_fault_injection and
# test_faults ran last). Starting the long files first leaves the short ones to fill the gaps. A file not
# listed keeps its place after these; the list only orders, it selects nothing.
LONGEST_FIRST = (  # from `--durations=0` of a full run (2026-11-27), summed per file
    "integration/test_single_turn_unchanged.py",
    "integration/test_ray_gateway.py",
    "integration/test_train_e2e.py",
    "integration/test_rewards_e2e.py",
    "integration/test_ray.py",
    "integration/test_seed_commands.py",
    "integration/test_trl_compat.py",
    "integration/test_issue24_runs.py",
    "integration/test_first_run_output.py",
    "integration/test_distributed.py",
    "integration/test_big_vocab.py",
    "integration/test_lora.py",
    "integration/test_mixed_precision.py",
    "integration/test_agent_clients.py",
    "integration/test_gateway_e2e.py",
    "integration/test_agents_e2e.py",
    "integration/test_python_runs.py",
    "integration/test_fault_injection.py",
    "integration/test_faults.py",
    "integration/test_code_exec.py",
    "integration/test_hostile_inputs.py",
    "integration/test_reliability_resume.py",
    "unit/test_hybrid_decode.py",
    "integration/test_faults_isolation_run.py",
    "unit/test_train_property.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item):
        path = item.nodeid.split("::")[0].removeprefix("tests/")
        return rank.get(path, len(rank))

    items.sort(key=key)  # stable: each file's tests keep their order and stay together
