"""Off-policy correction (algorithm/importance.py): importance weights, their ESS, and the sampler mismatch,
worked by hand on small tensors; no model."""

import math

import pytest
import torch

from grpo.algorithm.importance import (
    WeightSums,
    importance_metrics,
    importance_weights,
    kish_ess,
    mismatch_metrics,
    sampler_ess,
    weighted_advantages,
)


def test_advantages_are_weighted_by_pi_old_over_behaviour_truncated_and_ess_is_kish():
    # w = exp(old − behaviour) = 1.5 on column 0, and 3 → capped at 2 on column 1
    old = torch.zeros(8, 2)
    behaviour = torch.stack([torch.full((8,), -math.log(1.5)), torch.full((8,), -math.log(3.0))], 1)
    weighted, sums = weighted_advantages(torch.ones(8, 2), old, behaviour, torch.ones(8, 2), "tis", cap=2.0)
    assert torch.allclose(weighted[:, 0], torch.full((8,), 1.5))
    assert torch.allclose(weighted[:, 1], torch.full((8,), 2.0))
    assert sums.tokens == 16 and sums.clipped == 8
    stats = importance_metrics(sums)
    # Kish ESS = (Σw)² / (n Σw²) = (8·3.5)² / (16 · 8·(2.25 + 4)) = 784 / 800
    assert math.isclose(stats["is/ess"], 784 / 800, rel_tol=1e-6)
    assert math.isclose(stats["is/weight_mean"], 1.75, rel_tol=1e-6) and stats["is/clipped_frac"] == 0.5


def test_weight_sums_add_up_across_micro_batches():
    mask = torch.ones(4, 2)
    log_ratio = torch.tensor([[0.1, -0.2], [0.3, 0.0], [1.5, -1.0], [0.2, 0.4]])
    _, whole = weighted_advantages(torch.ones(4, 2), log_ratio, torch.zeros(4, 2), mask, "tis", cap=2.0)
    _, head = weighted_advantages(
        torch.ones(2, 2), log_ratio[:2], torch.zeros(2, 2), mask[:2], "tis", cap=2.0
    )
    _, tail = weighted_advantages(
        torch.ones(2, 2), log_ratio[2:], torch.zeros(2, 2), mask[2:], "tis", cap=2.0
    )
    parts = head + tail
    assert parts.tokens == whole.tokens == 8 and parts.clipped == whole.clipped == 1
    assert parts.w == pytest.approx(whole.w) and parts.w2 == pytest.approx(whole.w2)


def test_kish_ess_is_one_for_equal_weights_and_small_for_one_dominant_weight():
    assert kish_ess(sum_w=4 * 0.7, sum_w2=4 * 0.49, n=4) == pytest.approx(1.0)
    # weights 10, 0, 0, 0: (10)² / (4 · 100) = 1/4, one effective sample out of four
    assert kish_ess(10.0, 100.0, 4) == pytest.approx(0.25)
    assert importance_metrics(WeightSums()) == {}  # nothing weighted: no statistics


def test_sampler_ess_of_the_uncapped_token_weights():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    old = torch.tensor([[0.0, 0.0, 9.0]])
    sampler = torch.tensor([[0.0, -math.log(3.0), 0.0]])  # w = 1 and 3; the padding slot does not count
    assert sampler_ess(old, sampler, mask) == pytest.approx(16 / (2 * 10))
    assert sampler_ess(old, old, mask) == pytest.approx(1.0)
    assert math.isnan(sampler_ess(None, sampler, mask))


# -- correction modes and mismatch metrics, worked by hand ------------------------------------------
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


def test_unknown_or_disabled_mode_is_refused():
    with pytest.raises(ValueError, match="token_mask"):
        importance_weights(_LOG_RATIO, _MASK, "none", cap=2.0)


def test_mismatch_metrics_mean_max_and_k3_kl():
    sampler = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -7.0, 0.0]])
    learner = torch.tensor([[-1.1, -2.0, -0.2], [-0.3, -6.0, 5.0]])  # Δ = -0.1, 0, 0.3; 0, 1, (masked)
    out = mismatch_metrics(sampler, learner, _MASK)
    assert math.isclose(out["mismatch/logp_abs_mean"], 1.4 / 5, rel_tol=1e-6)
    assert math.isclose(out["mismatch/logp_abs_max"], 1.0, rel_tol=1e-6)
    # = (0.004837 + 0.049859 + 0.718282)/5
    k3 = sum(math.exp(d) - d - 1 for d in (-0.1, 0.0, 0.3, 0.0, 1.0)) / 5
    assert math.isclose(out["mismatch/kl"], k3, rel_tol=1e-5) and math.isclose(k3, 0.154596, rel_tol=1e-4)
    assert mismatch_metrics(sampler, learner, torch.zeros(2, 3)) == {}
