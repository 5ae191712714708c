"""The next step's agents start while the learner updates (AgentRunner.start_ahead, start_next):
their first requests wait in the paused batcher and are sampled only once the step's run() resumes it (with
the new weights); an evaluation or close() in between discards them (nothing of them is sampled, scored or
counted); the prompt stream stays where it was until next_batch takes the pre-started prompts."""

from __future__ import annotations

import time

import pytest
import torch

from grpo.data import PromptStream
from grpo.distributed.runtime import Runtime
from grpo.gateway.batching import Batcher, Job
from grpo.gateway.runner import DISCARDED
from grpo.records import SamplingParams
from grpo.rewards.isolation import can_fork
from grpo.rollout.colocated import ColocatedRollout
from grpo.rollout.source import PromptFeed
from tests import gateway_agents as agents
from tests.unit.test_episodes import ScriptedEngine, calls_then_answers
from tests.unit.test_gateway import SAMPLING, batch, qwen  # noqa: F401 - qwen is a fixture
from tests.unit.test_gateway_agent_workers import alive, runner
from tests.unit.test_gateway_batching import Fake
from tests.unit.test_sources import FakeEngine, Formatter

WORKERS = [0, pytest.param(2, marks=pytest.mark.skipif(not can_fork(), reason="worker processes need fork"))]


class Versioned(ScriptedEngine):
    """Records the weights each engine call sampled with (`version`, set by the test as the learner would)."""

    version = 0

    def continue_rows(self, rows, sampling):
        self.seen = [*getattr(self, "seen", []), self.version]
        return super().continue_rows(rows, sampling)


def queued(run, count: int, timeout: float = 30.0) -> bool:
    """Whether `count` requests are queued in the (paused) batcher within `timeout`."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if len(run.gateway.batcher._pending) >= count:
            return True
        time.sleep(0.02)
    return False


def same(a, b) -> None:
    (p_a, r_a), (p_b, r_b) = a, b
    assert p_a.prompt_token_ids == p_b.prompt_token_ids
    for name in ("completion_ids", "loss_mask", "sampling_logprobs", "completion_mask"):
        assert torch.equal(getattr(r_a, name), getattr(r_b, name)), name
    assert [e.messages for e in r_a.episodes] == [e.messages for e in r_b.episodes]
    assert [e.final_reward for e in r_a.episodes] == [e.final_reward for e in r_b.episodes]
    assert [e.ended_by for e in r_a.episodes] == [e.ended_by for e in r_b.episodes]


def test_a_paused_batcher_starts_no_engine_call_until_resumed():
    engine = Fake()
    batcher = Batcher(engine, SamplingParams(max_new_tokens=4), lambda: (1, 0), window_s=0.01)
    try:
        batcher.pause()
        job = batcher.submit(Job([1], 1))
        time.sleep(0.3)
        assert engine.calls == [] and job.events.empty()
        batcher.resume()
        assert job.events.get(timeout=5)[0] == "done" and engine.calls == [1]
    finally:
        batcher.close()


def plain_steps(tokenizer, workers, *steps):
    """The steps' (batch, n) rollouts run one after another without starting ahead: what to compare with."""
    plain = runner(tokenizer, agents.calculator_agent, workers=workers, window_s=2.0)
    try:
        return [plain.run(ScriptedEngine(tokenizer, calls_then_answers), b, n, SAMPLING) for b, n in steps]
    finally:
        plain.close()


@pytest.mark.parametrize("workers", WORKERS)
def test_pre_started_episodes_are_sampled_with_the_new_weights_and_equal_a_plain_step(qwen, workers):  # noqa: F811
    step1, step2 = batch(["What is 12 * 34?"]), batch(["Compute 12 * 34.", "What is 12 * 34 exactly?"])
    _, expected = plain_steps(qwen, workers, (step1, 2), (step2, 2))
    run = runner(qwen, agents.calculator_agent, workers=workers, window_s=2.0, ahead=True)
    engine = Versioned(qwen, calls_then_answers)
    try:
        run.run(engine, step1, 2, SAMPLING)
        calls = len(engine.calls)
        assert run.start_ahead(engine, step2, 2, SAMPLING)
        assert queued(run, 4)  # every first request is in, rendered and tokenized ...
        time.sleep(0.3)
        assert len(engine.calls) == calls  # ... and none is sampled while the learner updates
        engine.version = 1  # the update ends: new weights
        got = run.run(engine, step2, 2, SAMPLING)
    finally:
        run.close()
    same(got, expected)
    assert engine.seen[calls:] and set(engine.seen[calls:]) == {1}
    assert engine.calls[calls] == 4  # the step's first engine call has all its first requests


@pytest.mark.parametrize("workers", WORKERS)
def test_an_evaluation_between_steps_discards_the_pre_started_episodes(qwen, workers):  # noqa: F811
    step1, step2 = batch(["What is 12 * 34?"]), batch(["Compute 12 * 34.", "What is 12 * 34 exactly?"])
    held_out = batch(["What is 12 * 34, held out?"])
    _, expected_eval, expected = plain_steps(qwen, workers, (step1, 2), (held_out, 1), (step2, 2))
    run = runner(qwen, agents.calculator_agent, workers=workers, window_s=2.0, ahead=True)
    engine = ScriptedEngine(qwen, calls_then_answers)
    try:
        run.run(engine, step1, 2, SAMPLING)
        calls = len(engine.calls)
        assert run.start_ahead(engine, step2, 2, SAMPLING)
        assert queued(run, 4)
        ahead = run._ahead.sessions
        got_eval = run.run(engine, held_out, 1, SAMPLING)
        assert engine.calls[calls] == 1  # the evaluation's call alone: no pre-started request joined it
        assert all(s.ended == DISCARDED for s in ahead) and run._ahead is None
        assert all(run.gateway.sessions.get(s.key) is None for s in ahead)  # their keys are now refused
        assert not run._notes and not getattr(run, "_said_error", False)  # nothing counted as a failure
        got = run.run(engine, step2, 2, SAMPLING)  # the step then runs its episodes afresh
    finally:
        run.close()
    same(got_eval, expected_eval)
    same(got, expected)


@pytest.mark.skipif(not can_fork(), reason="worker processes need fork")
def test_close_discards_pre_started_episodes_and_leaves_no_worker(qwen):  # noqa: F811
    run = runner(qwen, agents.calculator_agent, workers=2, window_s=2.0, ahead=True)
    engine = ScriptedEngine(qwen, calls_then_answers)
    try:
        run.run(engine, batch(["What is 12 * 34?"]), 2, SAMPLING)
        calls = len(engine.calls)
        assert run.start_ahead(engine, batch(["Compute 12 * 34."]), 2, SAMPLING)
        assert queued(run, 2)
        pids = run._pool.pids
    finally:
        started = time.monotonic()
        run.close()
    assert time.monotonic() - started < 10
    assert len(engine.calls) == calls  # the discarded requests were never sampled
    assert not any(alive(p) for p in pids)


def test_no_pre_start_after_a_stop_signal_or_before_the_first_step(qwen, monkeypatch):  # noqa: F811
    run = runner(qwen, agents.calculator_agent, workers=0, window_s=2.0, ahead=True)
    engine = ScriptedEngine(qwen, calls_then_answers)
    try:
        assert not run.start_ahead(engine, batch(["What is 12 * 34?"]), 2, SAMPLING)  # no gateway yet
        run.run(engine, batch(["What is 12 * 34?"]), 2, SAMPLING)
        monkeypatch.setattr("grpo.gateway.runner.stop_requested", lambda: True)
        assert not run.start_ahead(engine, batch(["Compute 12 * 34."]), 2, SAMPLING)
        assert run._ahead is None
    finally:
        run.close()


class AheadRunner:
    """An episode runner with start_ahead: records what it was asked to start and to run."""

    multi_turn, reward_names, renders_prompts = False, (), False

    def __init__(self):
        self.started, self.ran = [], []

    def start_ahead(self, engine, prompts, n, sampling) -> bool:
        self.started.append(prompts)
        return True

    def run(self, engine, prompts, n, sampling, chunk_prompts=None):
        self.ran.append(prompts)
        return prompts, engine.generate(prompts.prompt_token_ids, n, sampling)


def _source(episodes=None):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)]
    feed = PromptFeed(PromptStream(rows, seed=0, shuffle=True), Formatter(), Runtime(), 2)
    return ColocatedRollout(FakeEngine(), feed, 3, SamplingParams(max_new_tokens=4), episodes=episodes)


def test_start_next_leaves_the_stream_where_it_was_until_next_batch_takes_its_prompts():
    plain, ahead = _source(), _source(episodes := AheadRunner())
    for _ in range(4):  # across an epoch's end (5 rows, 2 a step)
        before = ahead.data_state()
        ahead.start_next()
        assert ahead.data_state() == before  # a checkpoint now resumes with the pre-started step's prompts
        assert ahead.feed.stream.epoch == before["epoch"]
        p_plain, _, _ = plain.next_batch()
        p_ahead, _, _ = ahead.next_batch()
        assert episodes.ran[-1] is episodes.started[-1]  # the very batch it started
        assert (p_ahead.prompts, p_ahead.indices) == (p_plain.prompts, p_plain.indices)
        assert ahead.data_state() == plain.data_state()


def test_start_next_does_nothing_for_a_runner_that_cannot_start_ahead():
    source = _source()  # single turn
    before = source.data_state()
    source.start_next()
    assert source._next is None and source.data_state() == before


def test_by_default_the_agents_start_ahead_only_where_the_update_leaves_a_core_idle(qwen, monkeypatch):  # noqa: F811
    run = runner(qwen, agents.calculator_agent, workers=0, window_s=2.0)
    monkeypatch.setattr("grpo.gateway.agent_pool.default_size", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert not run._ahead_pays()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert run._ahead_pays()
    assert not runner(qwen, agents.calculator_agent, workers=0, ahead=False)._ahead_pays()


@pytest.mark.parametrize("agent", [agents.calculator_agent, agents.async_agent], ids=["sync", "async"])
@pytest.mark.parametrize("workers", WORKERS)
def test_an_update_longer_than_the_episode_timeout_does_not_time_the_pre_started_episodes_out(
    qwen,  # noqa: F811 - the fixture
    workers,
    agent,
):
    step1, step2 = batch(["What is 12 * 34?"]), batch(["Compute 12 * 34."])
    run = runner(qwen, agent, workers=workers, window_s=0.5, ahead=True, timeout_s=1.5)
    engine = ScriptedEngine(qwen, calls_then_answers)
    try:
        run.run(engine, step1, 2, SAMPLING)
        assert run.start_ahead(engine, step2, 2, SAMPLING)
        assert queued(run, 2)
        time.sleep(2.5)  # the learner's update: longer than env.episode_timeout_s
        _, got = run.run(engine, step2, 2, SAMPLING)
    finally:
        run.close()
    # the episodes' clock started when the step did: they ran to their answers
    assert [e.ended_by for e in got.episodes] == ["answer", "answer"]
