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


# The test files that take longest (summed --durations=0 of a full `make test`, 2026-11-27 16:10, load ~3.5),
# longest first: the order of a one-process run (and of xdist with --no-loadscope-reorder). A long file
# started last keeps one worker busy alone while the other core idles; started first, the short ones fill
# the gaps at the end. `make test` does not use it: xdist's default hands out files by their number of tests,
# which measured the same there (the Makefile has the numbers). A file not listed keeps its place after
# these; the list only orders, it selects nothing.
LONGEST_FIRST = (
    "integration/test_seed_commands.py",  # 172 s before the Ray-head test's refused join was shortened
    "integration/test_ray.py",  # 147
    "integration/test_single_turn_unchanged.py",  # 146
    "integration/test_train_e2e.py",  # 102
    "integration/test_ray_gateway.py",  # 90
    "integration/test_mixed_precision.py",  # 76
    "integration/test_first_run_output.py",  # 65 before the sweep's runs were made smaller
    "integration/test_gateway_e2e.py",  # 61
    "integration/test_distributed.py",  # 61
    "integration/test_code_exec.py",  # 58
    "integration/test_issue24_runs.py",  # 57
    "integration/test_agents_e2e.py",  # 51
    "integration/test_fault_injection.py",  # 46
    "integration/test_big_vocab.py",  # 44
    "integration/test_python_runs.py",  # 43
    "integration/test_agent_clients.py",  # 41
    "integration/test_rewards_e2e.py",  # 39
    "integration/test_trl_compat.py",  # 35
    "integration/test_lora.py",  # 31
    "unit/test_gateway.py",  # 30
    "integration/test_hostile_inputs.py",  # 29
    "integration/test_reliability_resume.py",  # 26
    "unit/test_train_property.py",  # 22
    "integration/test_files_and_links.py",  # 20
    "unit/test_hybrid_decode.py",  # 19
    "unit/test_gateway_agent_workers.py",  # 19
    "integration/test_faults_isolation_run.py",  # 18
    "unit/test_native_rollout.py",  # 18
    "unit/test_numbers_and_settings.py",  # 17
    "integration/test_faults.py",  # 15
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item):
        path = item.nodeid.split("::")[0].removeprefix("tests/")
        return rank.get(path, len(rank))

    items.sort(key=key)  # stable: each file's tests keep their order and stay together
