"""Off-policy correction for stale (async) rollouts: truncated per-token importance weights, worked by hand."""

import math

import torch

from grpo.config import GRPOConfig
from grpo.learner import Learner, importance_weights, mismatch_metrics
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
    batch.behaviour_logprobs = torch.stack(
        [torch.full((8,), -math.log(1.5)), torch.full((8,), -math.log(3.0))], 1
    )
    totals: dict[str, float] = {}
    weighted = learner._importance_weighted(batch, slice(0, 8), batch.rows(slice(0, 8)), old, totals)
    assert torch.allclose(weighted[:, 0], torch.full((8,), 1.5)) and torch.allclose(
        weighted[:, 1], torch.full((8,), 2.0)
    )
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


# -- correction modes and mismatch metrics (pure functions), worked by hand -------------------------
# Two completions, three token slots; row 1 has two tokens. Token ratios π_old/π_behaviour:
# row 0: 1.5, 3.0, 0.5; row 1: 2.5, 0.8, (padding)
_RATIOS = torch.tensor([[1.5, 3.0, 0.5], [2.5, 0.8, 1.0]])
_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
_LOG_RATIO = _RATIOS.log() * _MASK


def test_token_truncate_caps_each_token_and_tis_is_its_name():
    w, over = importance_weights(_LOG_RATIO, _MASK, "token_truncate", cap=2.0)
    assert torch.allclose(w, torch.tensor([[1.5, 2.0, 0.5], [2.0, 0.8, 0.0]]))
    assert over.tolist() == [[False, True, False], [True, False, False]]
    assert torch.equal(importance_weights(_LOG_RATIO, _MASK, "tis", cap=2.0)[0], w)


def test_token_mask_zeroes_tokens_above_the_cap():
    w, _ = importance_weights(_LOG_RATIO, _MASK, "token_mask", cap=2.0)
    assert torch.allclose(w, torch.tensor([[1.5, 0.0, 0.5], [0.0, 0.8, 0.0]]))


def test_sequence_modes_use_the_product_of_token_ratios():
    # row 0: 1.5 · 3 · 0.5 = 2.25; row 1: 2.5 · 0.8 = 2.0 (the padding slot does not count)
    w, over = importance_weights(_LOG_RATIO, _MASK, "sequence_truncate", cap=2.1)
    assert torch.allclose(w, torch.tensor([[2.1, 2.1, 2.1], [2.0, 2.0, 0.0]]), atol=1e-6)
    assert over.tolist() == [[True, True, True], [False, False, False]]
    w, _ = importance_weights(_LOG_RATIO, _MASK, "sequence_mask", cap=2.1)
    assert torch.allclose(w, torch.tensor([[0.0, 0.0, 0.0], [2.0, 2.0, 0.0]]), atol=1e-6)


def test_sequence_weight_of_a_long_completion_does_not_overflow():
    log_ratio = torch.full((1, 4000), 0.5)  # product e^2000: inf in float32
    w, over = importance_weights(log_ratio, torch.ones(1, 4000), "sequence_truncate", cap=3.0)
    assert torch.allclose(w, torch.full((1, 4000), 3.0)) and bool(over.all())


def test_mismatch_metrics_mean_max_and_k3_kl():
    sampler = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -7.0, 0.0]])
    learner = torch.tensor([[-1.1, -2.0, -0.2], [-0.3, -6.0, 5.0]])  # Δ = -0.1, 0, 0.3; 0, 1, (masked)
    out = mismatch_metrics(sampler, learner, _MASK)
    assert math.isclose(out["mismatch/logp_abs_mean"], 1.4 / 5, rel_tol=1e-6)
    assert math.isclose(out["mismatch/logp_abs_max"], 1.0, rel_tol=1e-6)
    k3 = (
        sum(math.exp(d) - d - 1 for d in (-0.1, 0.0, 0.3, 0.0, 1.0)) / 5
    )  # = (0.004837 + 0.049859 + 0.718282)/5
    assert math.isclose(out["mismatch/kl"], k3, rel_tol=1e-5) and math.isclose(k3, 0.154596, rel_tol=1e-4)
    assert mismatch_metrics(sampler, learner, torch.zeros(2, 3)) == {}
