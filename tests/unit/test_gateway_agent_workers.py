"""The agents in forked worker processes (env.agent_workers, gateway/agent_pool.py): the same episodes as on
threads in the trainer, their code in other processes, every fault ending its episode and not the run, and
nothing left behind (no process, no copy of the gateway's port)."""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch

from grpo.agents import HermesParser
from grpo.gateway.runner import AgentRunner
from grpo.rewards.isolation import can_fork, clear_stop, request_stop
from tests import gateway_agents as agents
from tests.unit.test_episodes import ScriptedEngine, calls_then_answers
from tests.unit.test_gateway import LIMITS, SAMPLING, batch, qwen  # noqa: F401 - qwen is a fixture

pytestmark = pytest.mark.skipif(not can_fork(), reason="worker processes need fork")


def runner(tokenizer, agent, **kw) -> AgentRunner:
    return AgentRunner(agent, tokenizer, HermesParser(), kw.pop("limits", LIMITS), **kw)


def one_step(tokenizer, agent, workers: int, questions=("What is 12 * 34?",), n=2, **kw):
    run = runner(tokenizer, agent, workers=workers, window_s=2.0, **kw)
    try:
        return run.run(ScriptedEngine(tokenizer, calls_then_answers), batch(list(questions)), n, SAMPLING)
    finally:
        run.close()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("agent", [agents.calculator_agent, agents.streaming_agent, agents.async_agent])
def test_episodes_in_workers_equal_the_episodes_on_threads(qwen, agent):  # noqa: F811
    questions = ("What is 12 * 34?", "Compute 12 * 34.", "What is 12 * 34 exactly?")
    threads = one_step(qwen, agent, 0, questions)
    workers = one_step(qwen, agent, 2, questions)
    for (p_a, r_a), (p_b, r_b) in ((threads, workers),):
        assert p_a.prompt_token_ids == p_b.prompt_token_ids
        for name in ("completion_ids", "loss_mask", "sampling_logprobs", "completion_mask"):
            assert torch.equal(getattr(r_a, name), getattr(r_b, name)), name
        assert [e.messages for e in r_a.episodes] == [e.messages for e in r_b.episodes]
        assert [e.final_reward for e in r_a.episodes] == [e.final_reward for e in r_b.episodes]


def test_the_agent_runs_in_another_process_and_its_closures_work(qwen):  # noqa: F811
    trainer = os.getpid()
    seen: list[int] = []  # appended in the worker: the trainer's list stays empty

    def where(client, row):
        agents.calculator_agent(client, row)
        seen.append(os.getpid())
        return float(os.getpid() != trainer) + 0.5 * float(row["tag"] == "closure")

    run = runner(qwen, where, workers=2)
    try:
        _, r = run.run(
            ScriptedEngine(qwen, calls_then_answers),
            batch(["What is 12 * 34?"], tag=["closure"]),
            4,
            SAMPLING,
        )
        pids = run._pool.pids
        assert len(pids) == 2 and trainer not in pids and all(alive(p) for p in pids)
    finally:
        run.close()
    assert [e.final_reward for e in r.episodes] == [1.5] * 4 and seen == []
    assert not any(alive(p) for p in pids)  # close() ends the workers


@pytest.mark.parametrize("workers", [2, 0], ids=["workers", "threads"])
def test_numpy_and_torch_scalars_are_rewards(qwen, workers):  # noqa: F811
    import numpy as np

    scores = [np.float32(0.5), torch.tensor(0.25), np.array(2.0), np.int64(3)]

    def scoring(client, row):
        agents.calculator_agent(client, row)
        return scores[int(row["tag"])]

    run = runner(qwen, scoring, workers=workers)
    try:
        _, r = run.run(
            ScriptedEngine(qwen, calls_then_answers),
            batch(["What is 12 * 34?"] * 4, tag=["0", "1", "2", "3"]),
            1,
            SAMPLING,
        )
    finally:
        run.close()
    assert [e.ended_by for e in r.episodes] == ["answer"] * 4
    assert [e.final_reward for e in r.episodes] == [0.5, 0.25, 2.0, 3.0]


@pytest.mark.parametrize(
    ("agent", "reason"),
    [
        (agents.raising_agent, "agent_error"),
        (agents.hanging_agent, "timeout"),
        (agents.silent_agent, "no_calls"),
        (lambda client, row: (agents.calculator_agent(client, row), "1.0")[1], "agent_error"),
    ],
    ids=["raises", "hangs", "silent", "not-a-number"],
)
def test_a_failing_agent_in_a_worker_ends_its_episode_not_the_run(qwen, agent, reason):  # noqa: F811
    def some_fail(client, row):  # the second prompt's episodes work: the run has seen the agent work
        return (agent if row["prompt"].startswith("What") else agents.calculator_agent)(client, row)

    run = runner(qwen, some_fail, workers=2, timeout_s=2.0)
    try:
        prompts = batch(["What is 12 * 34?", "Compute 12 * 34."])
        start = time.monotonic()
        _, r = run.run(ScriptedEngine(qwen, calls_then_answers), prompts, 2, SAMPLING)
        took = time.monotonic() - start
        # The next step runs (a killed worker is forked again) and its episodes work.
        _, again = run.run(ScriptedEngine(qwen, calls_then_answers), batch(["Compute 12 * 34."]), 2, SAMPLING)
    finally:
        run.close()
    assert [e.ended_by for e in r.episodes] == [reason, reason, "answer", "answer"]
    assert all(e.final_reward == 0.0 for e in r.episodes[:2]) and took < 2.0 + 3.0
    assert [e.ended_by for e in again.episodes] == ["answer", "answer"]


def test_an_agent_that_exits_its_process_fails_its_workers_episodes_not_the_run(qwen):  # noqa: F811
    def exits(client, row):
        agents.calculator_agent(client, row)
        if row["prompt"].startswith("What"):
            os._exit(3)  # on a thread in the trainer this would end the run

    run = runner(qwen, exits, workers=2)
    try:
        # Episodes are dealt out in turn: worker 0 runs the first and third, worker 1 the others.
        prompts = batch(["What is 12 * 34?", "Compute 12 * 34.", "Work out 12 * 34.", "Compute 34 * 12."])
        _, r = run.run(ScriptedEngine(qwen, calls_then_answers), prompts, 1, SAMPLING)
        _, again = run.run(ScriptedEngine(qwen, calls_then_answers), batch(["Compute 12 * 34."]), 2, SAMPLING)
    finally:
        run.close()
    ended = [e.ended_by for e in r.episodes]
    assert ended[0] == "agent_error" and ended[1] == ended[3] == "answer"
    assert ended[2] in ("agent_error", "answer")  # it went down with its worker unless it had ended first
    assert [e.ended_by for e in again.episodes] == ["answer", "answer"]  # its worker was forked again


def test_a_hung_agents_worker_is_killed_at_the_deadline(qwen):  # noqa: F811
    run = runner(qwen, agents.hanging_agent, workers=1, timeout_s=1.0)
    try:
        run.run(ScriptedEngine(qwen, calls_then_answers), batch(["What is 12 * 34?"]), 2, SAMPLING)
        assert run._pool.pids == []  # its agent threads cannot be stopped: the process went with them
    finally:
        run.close()


def test_a_stop_signal_ends_the_agents_step_within_the_grace(qwen, monkeypatch):  # noqa: F811
    import grpo.gateway.runner as runner_module

    monkeypatch.setattr(runner_module, "STOP_GRACE_S", 0.5)
    run = runner(qwen, agents.hanging_agent, workers=2, timeout_s=60.0)
    try:
        request_stop()
        start = time.monotonic()
        _, r = run.run(ScriptedEngine(qwen, calls_then_answers), batch(["What is 12 * 34?"]), 2, SAMPLING)
        took = time.monotonic() - start
    finally:
        clear_stop()
        run.close()
    assert [e.ended_by for e in r.episodes] == ["timeout", "timeout"] and took < 10.0


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            out.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return out


def test_no_worker_holds_the_gateways_listening_socket(qwen):  # noqa: F811
    run = runner(qwen, agents.calculator_agent, workers=2)
    try:
        run.run(ScriptedEngine(qwen, calls_then_answers), batch(["What is 12 * 34?"]), 2, SAMPLING)
        listening = os.readlink(f"/proc/self/fd/{run.server.httpd.fileno()}")
        assert listening.startswith("socket:")
        for pid in run._pool.pids:
            assert listening not in _socket_inodes(pid)  # else the port outlives the trainer's close
    finally:
        run.close()


def test_agent_workers_from_the_config_and_threads_for_an_agent_command(tmp_path):
    from grpo.config import ConfigError, load_config
    from grpo.gateway.agent_command import AgentCommand

    cfg = load_config("tiny_tools_agent", {"env.agent_workers": 3})
    assert cfg.env.agent_workers == 3 and load_config("tiny_tools_agent").env.agent_workers is None
    with pytest.raises(ConfigError, match=r"env\.agent_workers must be between 0"):
        load_config("tiny_tools_agent", {"env.agent_workers": -1})
    command = AgentRunner(AgentCommand("true"), None, HermesParser(), LIMITS, workers=2)
    assert command._agent_pool() is None  # an agent command is its own process already


def test_the_default_is_one_worker_per_core_at_most_eight(monkeypatch):
    from grpo.gateway import agent_pool

    for cores, expected in ((1, 1), (2, 2), (64, agent_pool.MAX_DEFAULT)):
        monkeypatch.setattr(agent_pool.os, "sched_getaffinity", lambda _, n=cores: set(range(n)))
        assert agent_pool.default_size() == expected


def test_a_row_that_cannot_reach_a_worker_stops_the_run_with_the_way_out(qwen):  # noqa: F811
    import threading

    from grpo.gateway.runner import AgentFailed

    run = runner(qwen, agents.calculator_agent, workers=2)
    try:
        with pytest.raises(AgentFailed, match=r"cannot be sent.*env\.agent_workers=0"):
            run.run(
                ScriptedEngine(qwen, calls_then_answers),
                batch(["What is 12 * 34?"], lock=[threading.Lock()]),
                2,
                SAMPLING,
            )
    finally:
        run.close()
