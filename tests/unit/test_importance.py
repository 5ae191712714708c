"""Off-policy correction for stale (async) rollouts: truncated per-token importance weights, worked by hand."""

import math

import torch

from grpo.config import GRPOConfig
from grpo.learner import Learner
from tests.conftest import tiny_llama
from tests.unit.test_learner import random_batch


def test_weights_are_pi_old_over_behaviour_truncated_and_ess_is_kish():
    cfg = GRPOConfig(batch_size=2, num_generations=4, gradient_accumulation_steps=1, importance_cap=2.0)
    learner = Learner(tiny_llama(), None, cfg, total_optimizer_steps=1)
    batch = random_batch(n=8, t=2)
    batch.completion_mask = torch.ones(8, 2)
    batch.advantages = torch.ones(8, 2)
    old = torch.zeros(8, 2)
    # behaviour log-probs: w = exp(old - behaviour) = 1.5 on column 0 and 3 → capped at 2 on column 1
    batch.behaviour_logprobs = torch.stack([torch.full((8,), -math.log(1.5)), torch.full((8,), -math.log(3.0))], 1)
    totals: dict[str, float] = {}
    weighted = learner._importance_weighted(batch, slice(0, 8), batch.rows(slice(0, 8)), old, totals)
    assert torch.allclose(weighted[:, 0], torch.full((8,), 1.5)) and torch.allclose(weighted[:, 1], torch.full((8,), 2.0))
    assert torch.equal(batch.advantages, weighted)  # written back for later passes (num_iterations > 1)
    from grpo.learner import _importance_stats

    stats = _importance_stats(totals)
    # Kish ESS = (Σw)² / (n Σw²) = (8·3.5)² / (16 · 8·(2.25 + 4)) = 784 / 800
    assert math.isclose(stats["is/ess"], 784 / 800, rel_tol=1e-6)
    assert math.isclose(stats["is/weight_mean"], 1.75, rel_tol=1e-6) and stats["is/clipped_frac"] == 0.5


def test_on_policy_batches_are_left_alone():
    cfg = GRPOConfig(batch_size=2, num_generations=4, gradient_accumulation_steps=1, beta=0.0)
    learner = Learner(tiny_llama(), None, cfg, total_optimizer_steps=1)
    stats = learner.train_step(random_batch())
    assert not any(k.startswith("is/") for k in stats.as_dict())
