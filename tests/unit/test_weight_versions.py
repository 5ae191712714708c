"""Which weights sampled each token (rollout/weight_versions.py): a weight update that lands between two calls
of one agent's episode gives a row with two versions, the staleness logic reads its oldest token, and an
episode past max_staleness is dropped (reward NaN, nothing trained on). Also what travels to a Ray actor."""

from __future__ import annotations

import math
import pickle
import threading

import pytest
import torch

from grpo.agents import HermesParser
from grpo.gateway.runner import AgentRunner
from grpo.records import Episode, PromptBatch, Rollouts, SamplingParams
from grpo.rollout.weight_versions import VersionedEngine, drop_stale, mixed_rows, row_lags
from tests import gateway_agents as agents
from tests.chat_templates import family_tokenizer
from tests.unit.test_episodes import ScriptedEngine, calls_then_answers
from tests.unit.test_gateway import LIMITS, SAMPLING

AGENTS_FILE = "tests/gateway_agents.py:calculator_agent"


@pytest.fixture(scope="module")
def qwen():
    return family_tokenizer("qwen2.5")


class Loadable(ScriptedEngine):
    def load_weights(self, named_tensors) -> None:
        self.loaded = list(named_tensors)


def prompts(n: int) -> PromptBatch:
    return PromptBatch(prompts=["What is 12 * 34?"] * n, prompt_token_ids=[[1]] * n, indices=list(range(n)))


def test_a_weight_update_between_two_calls_of_an_episode_gives_its_row_two_versions(qwen):
    called, go = threading.Event(), threading.Event()

    def waits_between_calls(client, row):
        messages = agents.opening(row)
        reply = client.chat.completions.create(model="m", messages=messages, tools=agents.TOOLS).choices[0]
        called.set()
        assert go.wait(30)  # the learner's next weights land now, between this episode's two calls
        messages.append(reply.message)
        agents.run_tools(messages, reply.message.tool_calls)
        client.chat.completions.create(model="m", messages=messages, tools=agents.TOOLS)

    engine = VersionedEngine(Loadable(qwen, calls_then_answers))
    engine.load([], 0)

    def learner():
        assert called.wait(30)
        engine.load([("w", torch.zeros(1))], 1)  # takes the engine's lock: never inside an engine call
        go.set()

    thread = threading.Thread(target=learner)
    thread.start()
    run = AgentRunner(waits_between_calls, qwen, HermesParser(), LIMITS)
    try:
        _, r = run.run(engine, prompts(1), 1, SAMPLING)
    finally:
        run.close()
        thread.join()
    sampled = r.loss_mask[0].bool()  # [T]
    stamps = r.weight_version[0]  # [T]
    assert sorted(set(stamps[sampled].tolist())) == [0, 1] and (stamps[~sampled] == -1).all()
    first_turn = int(sampled.long().argmin())  # the first injected token ends the first turn
    assert (stamps[:first_turn] == 0).all() and r.episodes[0].turns == 2
    assert mixed_rows(r) == 1
    assert row_lags(r, 1).tolist() == [1]  # the oldest token, not the newest (0)
    assert engine.engine.loaded[0][0] == "w"


def test_in_one_process_the_rows_carry_no_versions(qwen):
    run = AgentRunner(agents.calculator_agent, qwen, HermesParser(), LIMITS)
    try:
        _, r = run.run(ScriptedEngine(qwen, calls_then_answers), prompts(1), 2, SAMPLING)
    finally:
        run.close()
    assert r.weight_version is None and row_lags(r, 3) is None and mixed_rows(r) == 0


def test_a_versioned_engine_stamps_the_sampled_tokens_of_each_call(qwen):
    engine = VersionedEngine(Loadable(qwen, calls_then_answers))
    engine.load([], 4)
    out = engine.generate([[1, 2]], 2, SamplingParams(max_new_tokens=5))
    assert out.weight_version.shape == out.completion_ids.shape
    assert (out.weight_version == torch.where(out.loss_mask > 0, 4, -1)).all()
    assert engine.calls == [2]  # the wrapped engine's own attributes read through


def rows(stamps: list[list[int]], episodes: list[Episode]) -> Rollouts:
    ids = torch.tensor(stamps)  # [N, T]
    mask = (ids >= 0).float()  # [N, T]
    return Rollouts(
        group_ids=torch.tensor([0] * len(stamps)),
        completion_ids=ids.clamp(min=0),
        completion_mask=torch.ones_like(mask),
        sampling_logprobs=-0.5 * mask,
        truncated=torch.zeros(len(stamps), dtype=torch.bool),
        loss_mask=mask,
        episodes=episodes,
        weight_version=ids,
    )


def test_an_episode_with_a_row_past_max_staleness_is_dropped_and_counted():
    old, fresh, forked = Episode([]), Episode([]), Episode([])
    # row 0: versions 3 then 5; row 1: 5 only; rows 2 and 3: one episode forked into two rows, one of them old
    r = rows([[3, -1, 5], [5, 5, -1], [5, -1, 5], [2, 5, -1]], [old, fresh, forked, forked])
    lags = row_lags(r, 5)
    assert lags.tolist() == [2, 0, 0, 3]
    kept, dropped = drop_stale(r, lags, max_staleness=1)
    assert dropped == 3  # both rows of the forked episode go: its rows share one reward
    assert kept.loss_mask.sum(-1).tolist() == [0.0, 2.0, 0.0, 0.0]
    assert (kept.sampling_logprobs[[0, 2, 3]] == 0).all()
    finals = [e.final_reward for e in kept.episodes]
    assert math.isnan(finals[0]) and finals[1] is None and math.isnan(finals[2])
    assert kept.episodes[2] is kept.episodes[3]  # still one episode record
    assert old.final_reward is None  # the records handed in are not written to


def test_an_agent_runner_travels_to_an_actor_and_loads_its_agent_there(qwen, monkeypatch, tmp_path):
    run = AgentRunner(AGENTS_FILE, qwen, HermesParser(), LIMITS)
    run.gateway = object()  # a live server stays where it is
    monkeypatch.chdir(tmp_path)  # the actor's working directory is not the driver's
    copy = pickle.loads(pickle.dumps(run))
    assert copy.gateway is None and copy.agent.__name__ == "calculator_agent"
    assert copy.agent_spec.startswith("/")


def test_an_agent_command_travels_with_the_directory_it_was_started_from(monkeypatch, tmp_path):
    from grpo.gateway.agent_command import AgentCommand

    monkeypatch.chdir(tmp_path)
    command = pickle.loads(pickle.dumps(AgentCommand("python agent.py", timeout_s=7)))
    assert command.cwd == str(tmp_path) and command.timeout_s == 7 and command.argv[1] == "agent.py"


def test_an_agent_that_cannot_reach_the_actors_is_refused_in_one_line(qwen):
    from grpo.config import ConfigError
    from grpo.rollout.ray import episodes_travel

    pytest.importorskip("ray")

    class Holding:
        def __init__(self):
            self.lock = threading.Lock()

        def __call__(self, client, row):
            return None

    run = AgentRunner(Holding(), qwen, HermesParser(), LIMITS)
    with pytest.raises(ConfigError, match=r"cannot be sent there") as e:
        episodes_travel(run)
    assert "\n" not in str(e.value) and "rollout_mode=colocated" in str(e.value)


def test_a_runner_sent_to_an_actor_makes_the_rows_it_makes_in_one_process(qwen):
    """What a Ray actor runs is the runner unpickled, over its VersionedEngine: the same ids, masks, logprobs,
    episodes and gateway metrics as in one process, plus each token's version."""
    results = []
    for travelled in (False, True):
        run = AgentRunner(AGENTS_FILE, qwen, HermesParser(), LIMITS, window_s=2.0)
        engine = ScriptedEngine(qwen, calls_then_answers)
        if travelled:
            run, engine = pickle.loads(pickle.dumps(run)), VersionedEngine(Loadable(qwen, calls_then_answers))
            engine.load([], 3)
        try:
            results.append((*run.run(engine, prompts(2), 2, SAMPLING), run.metrics()))
        finally:
            run.close()
    (p1, r1, m1), (p2, r2, m2) = results
    assert p1.prompt_token_ids == p2.prompt_token_ids
    for name in ("group_ids", "completion_ids", "completion_mask", "loss_mask", "sampling_logprobs"):
        assert torch.equal(getattr(r1, name), getattr(r2, name)), name
    assert [e.messages for e in r1.episodes] == [e.messages for e in r2.episodes]
    assert [e.ended_by for e in r1.episodes] == [e.ended_by for e in r2.episodes]
    assert {k: v for k, v in m1.items() if k != "gateway/engine_s"} == {
        k: v for k, v in m2.items() if k != "gateway/engine_s"
    }
    assert r1.weight_version is None and (r2.weight_version[r2.loss_mask > 0] == 3).all()
