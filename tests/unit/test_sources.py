"""Rollout sources and the loop's collect stage, with fake engines and sources (no model)."""

import torch

from grpo.algorithm.filters import informative_prompts
from grpo.config import AlgorithmConfig
from grpo.data import PromptStream
from grpo.distributed.runtime import Runtime
from grpo.records import PromptBatch, Rollouts, SamplingParams, ScoredRollouts
from grpo.rewards import RewardScores
from grpo.rollout.colocated import ColocatedRollout
from grpo.rollout.source import PromptFeed
from grpo.run.metrics import StageTimer
from grpo.train import collect


class FakeEngine:
    """One token per completion: the prompt's first id; records what the source asked of it."""

    exact_logprobs, sampler_differs, needs_weight_sync = True, False, False

    def __init__(self):
        self.calls, self.synced, self.loaded = [], [], []

    def generate(self, prompt_token_ids, n, sampling, chunk_prompts=None) -> Rollouts:
        self.calls.append((prompt_token_ids, n, chunk_prompts))
        ids = torch.tensor([[p[0]] for p in prompt_token_ids for _ in range(n)])
        return Rollouts(
            group_ids=torch.arange(len(prompt_token_ids)).repeat_interleave(n),
            completion_ids=ids,
            completion_mask=torch.ones(ids.shape),
            sampling_logprobs=torch.zeros(ids.shape),
            truncated=torch.zeros(len(ids), dtype=torch.bool),
        )

    def load_weights(self, named_tensors) -> None:
        self.loaded.append(list(named_tensors))

    def sync_weights(self, policy) -> None:
        self.synced.append(policy)


class Formatter:
    def encode(self, prompts, indices=None):
        return [[100 + int(p[1:])] for p in prompts]  # "q7" → [107]


def _source(engine, sampling=None, gather=None, per_step=2):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)]
    feed = PromptFeed(PromptStream(rows, seed=0, shuffle=False), Formatter(), Runtime(), per_step)
    sampling = sampling or SamplingParams(max_new_tokens=4)
    return ColocatedRollout(engine, feed, 3, sampling, chunk_prompts=1, gather=gather)


def test_colocated_rollout_draws_prompts_in_order_and_samples_them():
    engine = FakeEngine()
    source = _source(engine)
    prompts, rollouts, lag = source.next_batch()
    assert (prompts.prompts, prompts.columns, prompts.indices, lag) == (
        ["q0", "q1"],
        {"answer": ["0", "1"]},
        [0, 1],
        0,
    )
    assert engine.calls == [([[100], [101]], 3, 1)]  # G = 3 per prompt, one prompt per chunk
    assert rollouts.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    assert source.data_state()["position"] == 2
    prompts, _, _ = source.next_batch()
    assert prompts.prompts == ["q2", "q3"] and source.data_state()["position"] == 4
    assert source.metrics() == {}


def test_colocated_rollout_trusts_exact_logprobs_only_for_unfiltered_sampling():
    assert _source(FakeEngine()).exact_logprobs
    assert not _source(FakeEngine(), SamplingParams(max_new_tokens=4, top_p=0.9)).exact_logprobs
    assert not _source(FakeEngine(), SamplingParams(max_new_tokens=4, greedy=True)).exact_logprobs


def test_colocated_rollout_syncs_by_reference_or_pushes_gathered_weights():
    policy = torch.nn.Linear(2, 1)
    engine = FakeEngine()
    _source(engine).sync_weights(3, policy)
    assert engine.synced == [policy] and engine.loaded == []
    engine = FakeEngine()
    _source(engine, gather=lambda m: [(n, p.detach()) for n, p in m.named_parameters()]).sync_weights(
        3, policy
    )
    assert engine.synced == [] and [n for n, _ in engine.loaded[0]] == ["weight", "bias"]


class ScriptedSource:
    """Hands out scripted reward rows, one round per next_batch: rewards[p] are prompt p's G rewards."""

    exact_logprobs = sampler_differs = False

    def __init__(self, rounds: list[list[list[float]]]):
        self.rounds, self.drawn = list(rounds), 0

    def next_batch(self):
        rewards = self.rounds.pop(0)
        p, g = len(rewards), len(rewards[0])
        prompts = PromptBatch(prompts=[f"q{self.drawn + i}" for i in range(p)], prompt_token_ids=[[1]] * p)
        self.drawn += p
        ids = torch.tensor(
            [[int(10 * r) + 2] for group in rewards for r in group]
        )  # the reward, in the token
        rollouts = Rollouts(
            group_ids=torch.arange(p).repeat_interleave(g),
            completion_ids=ids,
            completion_mask=torch.ones(ids.shape),
            sampling_logprobs=torch.zeros(ids.shape),
            truncated=torch.zeros(len(ids), dtype=torch.bool),
        )
        return prompts, rollouts, 0


class Tokenizer:
    pad_token_id = 0

    def batch_decode(self, ids, skip_special_tokens=True):
        return [str(row[0].item()) for row in ids]


def _score(prompts, rollouts, texts, lag) -> ScoredRollouts:
    rewards = (rollouts.completion_ids[:, 0].float() - 2) / 10  # [N]
    scores = RewardScores(per_function=rewards[:, None], names=["r"], total=rewards, none_applicable=0)
    return ScoredRollouts(prompts, rollouts, texts, scores, rewards, lag=lag)


def test_collect_without_dynamic_sampling_takes_one_round_as_it_is():
    source = ScriptedSource([[[0.0, 0.0], [0.0, 1.0]]])
    scored, stats = collect(source, _score, Tokenizer(), AlgorithmConfig(), 2, StageTimer())
    assert scored.num_prompts == 2 and stats == {"groups/generated": 2.0, "groups/informative_frac": 0.5}


def test_collect_with_dynamic_sampling_fills_the_batch_with_informative_groups():
    a = AlgorithmConfig(dynamic_sampling=True, dynamic_sampling_max_rounds=4)
    source = ScriptedSource([[[0.0, 0.0], [0.0, 1.0]], [[1.0, 1.0], [0.5, 0.0]], [[0.0, 0.1], [0.2, 0.3]]])
    timer = StageTimer()
    scored, stats = collect(source, _score, Tokenizer(), a, 2, timer)
    assert scored.prompts.prompts == ["q1", "q3"]  # one informative group from each of two rounds
    assert scored.rollouts.group_ids.tolist() == [0, 0, 1, 1]
    assert scored.rewards.tolist() == [0.0, 1.0, 0.5, 0.0]
    assert scored.texts == ["2", "12", "7", "2"]
    assert informative_prompts(scored.rewards, scored.rollouts.group_ids, 2).all()
    assert stats == {"groups/generated": 4.0, "groups/informative_frac": 0.5, "dynamic_sampling/rounds": 2.0}
    assert len(source.rounds) == 1  # stopped as soon as the batch was full
    assert set(timer.seconds) == {"rollout", "reward"}
