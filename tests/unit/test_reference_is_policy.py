"""While the policy's weights are π_ref's, the update's own log-probs are π_ref's (reference_is_policy):
the reference forward is skipped, the KL term is exactly 0, and the update equals the one with the reference
forward's log-probs. It holds from a fresh start until an optimizer step moves a weight, and a checkpoint
carries it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo.config import GRPOConfig
from grpo.learner import Learner
from grpo.run.models import frozen_copy
from tests.conftest import tiny_llama
from tests.unit.test_learner import random_batch


def _learner(model, ref, **overrides):
    settings = {"batch_size": 2, "num_generations": 4, "max_new_tokens": 7, "beta": 0.04, "warmup_steps": 0}
    cfg = GRPOConfig(**{**settings, "learning_rate": 1e-3, **overrides}).validate()
    return Learner(model, ref, cfg, total_optimizer_steps=10)


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("iterations", [1, 2])
def test_own_logprobs_as_reference_train_as_the_reference_forward(iterations):
    runs = []
    for own in (True, False):
        model = tiny_llama()
        learner = _learner(model, frozen_copy(model, torch.float32), num_iterations=iterations)
        assert learner.reference_is_policy
        batch = dataclasses.replace(random_batch(), ref_logprobs=None)
        if not own:
            batch = dataclasses.replace(batch, ref_logprobs=learner.reference_logprobs(batch))
        stats = learner.train_step(batch)
        assert not learner.reference_is_policy  # the step moved the weights
        runs.append((stats, _weights(model)))
    (own, w_own), (ref, w_ref) = runs
    assert own.kl == 0.0 and ref.kl == pytest.approx(0.0, abs=1e-6)
    assert own.loss == pytest.approx(ref.loss, rel=1e-6, abs=1e-8)
    for name, w in w_own.items():
        torch.testing.assert_close(w, w_ref[name], rtol=1e-6, atol=1e-7)


def test_a_step_without_signal_keeps_the_weights_and_the_reference_skipped():
    model = tiny_llama()
    learner = _learner(model, frozen_copy(model, torch.float32))
    before = _weights(model)
    batch = random_batch()
    batch = dataclasses.replace(batch, ref_logprobs=None, advantages=torch.zeros_like(batch.advantages))
    stats = learner.train_step(batch)
    assert stats.kl == 0.0 and stats.grad_norm == 0.0
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert learner.reference_is_policy  # nothing moved: still π_ref
    # weight decay moves every weight even on a zero gradient
    model = tiny_llama()
    learner = _learner(model, frozen_copy(model, torch.float32), weight_decay=0.1)
    learner.train_step(batch)
    assert not learner.reference_is_policy


def test_a_reference_with_other_weights_is_not_the_policy():
    model = tiny_llama()
    other = frozen_copy(model, torch.float32)
    with torch.no_grad():
        next(other.parameters()).add_(1e-3)
    assert not _learner(model, other).reference_is_policy
    assert not _learner(model, tiny_llama(seed=1).requires_grad_(False)).reference_is_policy
    assert not _learner(model, None).reference_is_policy  # β = 0: no reference at all
    assert _learner(model, tiny_llama().requires_grad_(False)).reference_is_policy  # loaded alike: equal


def test_lora_at_its_zero_adapters_is_the_reference():
    from grpo.model.lora import ReferenceWithoutAdapters
    from tests.unit.test_native import lora_model

    model = lora_model("qwen2", ["q_proj"])  # its B random
    assert not _learner(model, ReferenceWithoutAdapters(model)).reference_is_policy
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.zero_()
    assert _learner(model, ReferenceWithoutAdapters(model)).reference_is_policy


def test_a_checkpoint_carries_it_and_an_older_one_reads_as_not():
    model = tiny_llama()
    learner = _learner(model, frozen_copy(model, torch.float32))
    state = learner.state_dict()
    assert state["reference_is_policy"] is True
    learner.reference_is_policy = False
    learner.load_state_dict(state)
    assert learner.reference_is_policy
    del state["reference_is_policy"]
    learner.load_state_dict(state)
    assert not learner.reference_is_policy
