"""Shared fixtures: a tiny random Llama (unit tests) and the bundled model (end-to-end tests)."""

from __future__ import annotations

import os
import resource

# Before torch loads: GNU OpenMP reads this once, at library load, in this process and in every process the
# tests start (subprocesses, torchrun, Ray, vLLM inherit the environment). By default an OpenMP thread that
# finishes its share of an op spins for its next one instead of sleeping; the tiny models' ops are short,
# so a 2-thread process (the presets, torch's default, vLLM's engine) keeps a core busy spinning between
# them, taken from the other worker and the vLLM tests. Measured on this 2-core host at load ~4.5
# (2026-11-27): a 2-step tiny_math preset run used 10.4 and 10.1 CPU-s with PASSIVE against 14.6 and 12.2
# without; a loop of small matmuls on 2 threads 4.4 CPU-s against 88.8. Results do not change: only how
# an idle thread waits. A value set outside (CI, a developer) is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:  # imported where a model is built: a pytest process that builds none (test_suite_order.py's
    # child run) skips transformers' ~3 CPU-s of imports
    from transformers import LlamaForCausalLM

# Tiny matmuls are dominated by thread hand-off on a 2-core machine; one thread is faster and stable.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def one_torch_thread_after_each_test():
    """A run in this process sets torch's threads from its config (the presets say 2) and nothing sets them
    back: every later test of this worker would then run on 2 threads, beside the other worker and the
    vLLM tests on a 2-core machine."""
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


# GRPO_TEST_CPU=FILE: each test phase's CPU seconds (this process plus the children it waited for: `grpo`
# subprocesses, torchrun jobs) appended to FILE as "nodeid, phase, seconds, wall, worker, start" lines
# (tab-separated), from every xdist worker. worker: xdist's id ("main" without xdist); start: the phase's
# epoch seconds, so a run's schedule can be drawn (which worker ran what when, whether one sat idle at the
# end). --durations gives wall time only, which on a shared 2-core host measures the load as much as the
# test; CPU seconds say what a test costs. Processes the test did not wait for (Ray's daemons and actors, a
# vLLM engine's core) are not counted.
CPU_LOG = os.environ.get("GRPO_TEST_CPU")


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


if CPU_LOG:
    import time

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        item.stash[_cpu_key] = []
        yield
        with open(CPU_LOG, "a", encoding="utf-8") as out:  # one short write per test: lines stay whole
            out.write(
                "".join(
                    f"{item.nodeid}\t{p}\t{c:.2f}\t{w:.2f}\t{_WORKER}\t{t:.2f}\n"
                    for p, c, w, t in item.stash[_cpu_key]
                )
            )

    _WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")

    def _phase(item, phase):
        cpu, wall, start = _cpu_seconds(), time.monotonic(), time.time()
        yield
        item.stash[_cpu_key].append((phase, _cpu_seconds() - cpu, time.monotonic() - wall, start))

    _cpu_key = pytest.StashKey[list]()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(item):
        yield from _phase(item, "setup")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(item):
        yield from _phase(item, "call")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(item, nextitem):
        yield from _phase(item, "teardown")


def tiny_llama(vocab_size: int = 48, seed: int = 0) -> LlamaForCausalLM:
    from transformers import LlamaConfig, LlamaForCausalLM

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


# The test files that take longest, longest first: the order of a one-process run, and of xdist's workers with
# --no-loadscope-reorder (not `make test`'s default: the Makefile says why). Wall seconds of each file in a
# full `make test` (GRPO_TEST_CPU log, 2026-11-28 03:59, c1af4f4, load 2.5-6 with others' jobs; CPU-s beside):
# a worker is held for the wall time, waits included, so the files that wait most on Ray actors and
# subprocesses (test_ray.py: 168 s for 27 CPU-s) start first, beside the vLLM tests, and the short files come
# last, where they even out the two workers. A file not listed keeps its place after these; the list only
# orders, it selects nothing.
LONGEST_FIRST = (
    "integration/test_ray.py",  # 168 s wall, 27 CPU-s
    "integration/test_seed_commands.py",  # 131, 49
    "integration/test_gateway_e2e.py",  # 129, 47
    "integration/test_ray_gateway.py",  # 121, 28
    # torch.compile's files at their cold-cache cost (a clean machine's, as CI's: 147 s wall, 54 CPU-s on
    # 2026-11-28 01:40; 11 s when inductor's cache in /tmp has the graphs): listed by the cold cost, else,
    # cold, they start last and hold one worker alone at the end (62 s in session 10's second run)
    "unit/test_hybrid_decode.py",
    "integration/test_train_e2e.py",  # 95, 43
    "integration/test_single_turn_unchanged.py",  # 90, 46
    "integration/test_first_run_output.py",  # 74, 38
    "integration/test_distributed.py",  # 63, 65 (a torchrun job: two processes)
    "unit/test_native_rollout.py",  # cold cache: 61, 25 (warm: 16, 6)
    "integration/test_big_vocab.py",  # 59, 22
    "integration/test_lora.py",  # 54, 22
    "unit/test_compiled_block.py",  # cold cache: 49, 38 (warm: 13, 5)
    "integration/test_fault_injection.py",  # 53, 21
    "unit/test_train_property.py",  # 49, 19
    "integration/test_agents_e2e.py",  # 45, 21
    "integration/test_code_exec.py",  # 42, 15
    "integration/test_issue24_runs.py",  # 39, 16
    "integration/test_rewards_e2e.py",  # 36, 19
    "integration/test_mixed_precision.py",  # 36, 18
    "integration/test_agent_clients.py",  # 36, 19
    "unit/test_gateway.py",  # 31, 5
    "integration/test_trl_compat.py",  # 29, 13
    "integration/test_secrets.py",  # 27, 12
    "unit/test_gateway_ahead.py",  # 26, 5
    "unit/test_gateway_agent_workers.py",  # 25, 6
    "unit/test_run_settings.py",  # 24, 12
    "integration/test_faults_isolation_run.py",  # 23, 11
    "unit/test_suite_order.py",  # 22, 13
    "integration/test_faults.py",  # 18, 8
    "unit/test_gateway_hostile_http.py",  # 17, 2
    "integration/test_files_and_links.py",  # 16, 5
    "integration/test_hostile_inputs.py",  # 14, 4
    "unit/test_memory.py",  # 14, 6
    "integration/test_trl_oracle.py",  # 14, 5
    "unit/test_turn_kv.py",  # 13, 4
    "integration/test_reliability_resume.py",  # 13, 4
    "integration/test_python_runs.py",  # 13, 6
    "unit/test_numbers_and_settings.py",  # 13, 4
    "integration/test_turn_credit_run.py",  # 12, 9
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item):
        path = item.nodeid.split("::")[0].removeprefix("tests/")
        return rank.get(path, len(rank))

    items.sort(key=key)  # stable: each file's tests keep their order and stay together
