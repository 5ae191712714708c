"""The learner's update does not depend on micro_batch_size, and π_old is the rollout policy."""

import math

import pytest
import torch

from grpo.config import GRPOConfig
from grpo.learner import Learner
from grpo.model.forward import token_logprobs
from grpo.records import TrainBatch
from tests.conftest import tiny_llama


def random_batch(n=8, prompt_width=5, t=7, vocab=48, seed=0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(2, prompt_width + 1, (n,), generator=g)
    comp_lens = torch.randint(1, t + 1, (n,), generator=g)
    ids = torch.randint(3, vocab, (n, prompt_width + t), generator=g)
    attn = torch.zeros(n, prompt_width + t, dtype=torch.long)
    mask = torch.zeros(n, t)
    for i in range(n):
        attn[i, prompt_width - prompt_lens[i] : prompt_width + comp_lens[i]] = 1
        mask[i, : comp_lens[i]] = 1
    ids = ids.masked_fill(attn == 0, 0)
    adv = torch.randn(n, generator=g)[:, None] * mask
    return TrainBatch(
        input_ids=ids,
        attention_mask=attn,
        prompt_width=prompt_width,
        completion_mask=mask,
        advantages=adv,
        group_ids=torch.arange(n) // 4,
        ref_logprobs=-torch.rand(n, t, generator=g) * 3 * mask,
    )


def gradient_after_step(
    aggregation: str,
    micro: int | None,
    beta: float,
    iterations: int = 1,
    engine: str = "native",
    micro_tokens: int | None = None,
):
    model = tiny_llama()
    cfg = GRPOConfig(
        batch_size=2,
        num_generations=4,
        micro_batch_size=micro,
        loss_aggregation=aggregation,
        beta=beta,
        max_new_tokens=7,
        learning_rate=1e-3,
        warmup_steps=0,
        max_grad_norm=0,
        num_iterations=iterations,
        temperature=0.9,
        engine=engine,
    )
    cfg.update({"train.micro_batch_tokens": micro_tokens})
    cfg.validate()
    learner = Learner(model, None, cfg, total_optimizer_steps=10)
    grads = {}
    # Capture the summed gradient just before the optimizer consumes it.
    learner.optimizer.register_step_pre_hook(
        lambda *_: grads.update(
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        )
    )
    stats = learner.train_step(random_batch())
    return stats, grads


@pytest.mark.parametrize("engine", ["native", "transformers"])
@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean", "constant"])
def test_loss_and_gradient_do_not_depend_on_micro_batch_size(aggregation, engine):
    ref_stats, ref_grads = gradient_after_step(aggregation, 8, beta=0.04, engine=engine)
    for micro in (1, 3, 4):
        stats, grads = gradient_after_step(aggregation, micro, beta=0.04, engine=engine)
        assert stats.loss == pytest.approx(ref_stats.loss, abs=1e-6)
        assert stats.kl == pytest.approx(ref_stats.kl, rel=1e-6)
        for name in ref_grads:
            assert torch.allclose(grads[name], ref_grads[name], atol=1e-6), (micro, name)


@pytest.mark.parametrize("engine", ["native", "transformers"])
def test_token_budget_micro_batches_leave_the_update_unchanged(engine):
    ref_stats, ref_grads = gradient_after_step("token_mean", 8, beta=0.04, engine=engine)
    # random_batch rows hold 3-12 tokens: 1 row per micro-batch, a few rows, and all 8 rows at once
    for tokens in (1, 20, 1000):
        stats, grads = gradient_after_step("token_mean", None, beta=0.04, engine=engine, micro_tokens=tokens)
        assert stats.loss == pytest.approx(ref_stats.loss, abs=1e-6)
        assert stats.kl == pytest.approx(ref_stats.kl, rel=1e-6)
        for name in ref_grads:
            assert torch.allclose(grads[name], ref_grads[name], atol=1e-6), (tokens, name)


@pytest.mark.parametrize("engine", ["native", "transformers"])
def test_row_knobs_under_a_token_budget_leave_the_update_unchanged(engine):
    """micro_batch_size 8 (gradient_accumulation_steps=1) with a small token budget runs cut pieces:
    the same loss and gradient as one micro-batch of all rows."""
    ref_stats, ref_grads = gradient_after_step("sequence_mean", 8, beta=0.04, engine=engine)
    for micro, tokens in ((8, 20), (3, 20), (8, 1)):
        stats, grads = gradient_after_step(
            "sequence_mean", micro, beta=0.04, engine=engine, micro_tokens=tokens
        )
        assert stats.loss == pytest.approx(ref_stats.loss, abs=1e-6)
        assert stats.kl == pytest.approx(ref_stats.kl, rel=1e-6)
        for name in ref_grads:
            assert torch.allclose(grads[name], ref_grads[name], atol=1e-6), (micro, tokens, name)


def test_native_and_transformers_learners_agree():
    ref_stats, ref_grads = gradient_after_step(
        "sequence_mean", 3, beta=0.04, iterations=2, engine="transformers"
    )
    stats, grads = gradient_after_step("sequence_mean", 3, beta=0.04, iterations=2, engine="native")
    assert stats.loss == pytest.approx(ref_stats.loss, abs=1e-6) and stats.kl == pytest.approx(
        ref_stats.kl, rel=1e-6
    )
    for name in ref_grads:  # the second pass follows an AdamW step, which magnifies float32 rounding
        assert (grads[name] - ref_grads[name]).abs().max() <= 1e-4 * ref_grads[name].abs().max(), name


def test_given_old_logprobs_are_used_as_pi_old():
    model = tiny_llama()
    cfg = GRPOConfig(batch_size=2, num_generations=4, max_new_tokens=7, warmup_steps=0).validate()
    batch = random_batch()
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, cfg.generation.temperature)
    batch.old_logprobs = (logp - 0.1) * batch.completion_mask  # as if sampled by a slightly different policy
    stats = Learner(model, None, cfg, total_optimizer_steps=1).train_step(batch)
    assert stats.ratio_mean == pytest.approx(torch.exp(torch.tensor(0.1)).item(), abs=1e-5)


def test_first_pass_ratio_is_one_and_later_passes_move_it():
    stats, _ = gradient_after_step("sequence_mean", 4, beta=0.0, iterations=1)
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-6)
    assert stats.clip_low_frac == 0 and stats.clip_high_frac == 0


def test_temperature_scales_the_policy_logprobs():
    model = tiny_llama()
    batch = random_batch()
    logp1, _ = token_logprobs(model, batch, temperature=1.0)
    logp2, _ = token_logprobs(model, batch, temperature=2.0)
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).logits
    manual = (logits[:, 4:-1] / 2.0).log_softmax(-1).gather(-1, batch.input_ids[:, 5:, None]).squeeze(-1)
    assert torch.allclose(logp2, manual, atol=1e-5)
    assert not torch.allclose(logp1, logp2)


def test_train_step_only_reads_its_batch_and_returns_pi_old():
    """π_old and the importance-weighted advantages stay inside the step, also over several passes."""
    model = tiny_llama()
    cfg = GRPOConfig(
        batch_size=2,
        num_generations=4,
        micro_batch_size=3,
        num_iterations=2,
        max_new_tokens=7,
        warmup_steps=0,
    ).validate()
    batch = random_batch()
    with torch.no_grad():
        pi_old, _ = token_logprobs(model, batch, cfg.generation.temperature)
    batch.behaviour_logprobs = (pi_old - 0.3) * batch.completion_mask  # an older sampler: IS weights e^0.3
    before = {k: v.clone() for k, v in vars(batch).items() if isinstance(v, torch.Tensor)}
    stats = Learner(model, None, cfg, total_optimizer_steps=2).train_step(batch)
    assert batch.old_logprobs is None
    assert all(torch.equal(getattr(batch, k), v) for k, v in before.items())
    assert torch.allclose(
        stats.old_logprobs * batch.completion_mask, pi_old * batch.completion_mask, atol=1e-5
    )
    assert stats.importance["is/weight_mean"] == pytest.approx(math.exp(0.3), rel=1e-4)


def test_on_policy_batches_have_no_importance_statistics():
    cfg = GRPOConfig(batch_size=2, num_generations=4, gradient_accumulation_steps=1, beta=0.0)
    stats = Learner(tiny_llama(), None, cfg, total_optimizer_steps=1).train_step(random_batch())
    assert not any(k.startswith("is/") for k in stats.as_dict())


@pytest.mark.parametrize(("entropy_coef", "kind"), [(0.0, "native"), (0.01, "transformers")])
def test_the_forward_is_chosen_once_and_the_entropy_bonus_takes_the_transformers_one(entropy_coef, kind):
    cfg = GRPOConfig(batch_size=2, num_generations=4, entropy_coef=entropy_coef, engine="native").validate()
    assert Learner(tiny_llama(), None, cfg, total_optimizer_steps=1).policy_forward.kind == kind
