"""The loss mask (tokens the policy sampled) is not the attention mask (tokens that exist): injected tokens
(tool results, environment messages) are attended to and never trained on, and every per-row and per-token
field of the records follows rows / trim / select / concat."""

import dataclasses

import pytest
import torch

from grpo.config import GRPOConfig
from grpo.learner import Learner
from grpo.records import (
    Episode,
    PromptBatch,
    Rollouts,
    TrainBatch,
    concat_rollouts,
    take_rows,
)
from grpo.run.metrics import episode_metrics, sampler_metrics
from grpo.stages import build_train_batch
from tests.conftest import tiny_llama
from tests.unit.test_learner import random_batch

PAD = 0


def _with_injected(batch: TrainBatch, garbage: float) -> TrainBatch:
    """Columns 2-3 of every row become injected tokens (loss_mask 0) whose advantages, reference and
    behaviour log-probs hold `garbage`: nothing the loss reads may depend on them."""
    loss_mask = batch.completion_mask.clone()
    loss_mask[:, 2:4] = 0
    injected = (batch.completion_mask - loss_mask).bool()
    return dataclasses.replace(
        batch,
        loss_mask=loss_mask,
        advantages=batch.advantages.masked_fill(injected, garbage),
        ref_logprobs=batch.ref_logprobs.masked_fill(injected, -garbage),
        behaviour_logprobs=(batch.ref_logprobs * 0.9).masked_fill(injected, -garbage),
    )


def _step(batch: TrainBatch, aggregation: str = "token_mean"):
    model = tiny_llama()
    cfg = GRPOConfig(
        batch_size=2, num_generations=4, loss_aggregation=aggregation, beta=0.04, max_new_tokens=7,
        learning_rate=1e-3, warmup_steps=0, max_grad_norm=0, temperature=0.9,
    ).validate()  # fmt: skip
    learner = Learner(model, None, cfg, total_optimizer_steps=10)
    grads = {}
    learner.optimizer.register_step_pre_hook(
        lambda *_: grads.update(
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        )
    )
    return learner.train_step(batch), grads


@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean", "constant"])
def test_injected_tokens_never_reach_the_loss_kl_entropy_or_importance_weights(aggregation):
    batch = random_batch(seed=3)
    a_stats, a_grads = _step(_with_injected(batch, 5.0), aggregation)
    b_stats, b_grads = _step(_with_injected(batch, -40.0), aggregation)
    assert a_stats.loss == b_stats.loss and a_stats.kl == b_stats.kl and a_stats.entropy == b_stats.entropy
    assert a_stats.importance == b_stats.importance
    for name in a_grads:
        assert torch.equal(a_grads[name], b_grads[name]), name
    # A learner that read the attention mask instead would train on the injected tokens:
    broken = _with_injected(batch, 5.0)
    broken = dataclasses.replace(broken, loss_mask=broken.completion_mask)
    c_stats, _ = _step(broken, aggregation)
    assert abs(c_stats.loss - a_stats.loss) > 1e-3


def test_injected_tail_trains_like_the_completion_without_it():
    """Causal attention: tokens after the last sampled one change nothing, so a completion with an injected
    tail has exactly the update of the same completion cut before it (normalisers count sampled tokens)."""
    batch = random_batch(seed=5)
    lengths = batch.completion_mask.sum(-1).long()
    keep = (lengths - 2).clamp(min=1)  # the last two tokens of each row become injected
    cols = torch.arange(batch.completion_mask.shape[1])[None, :]
    sampled = (cols < keep[:, None]).float() * batch.completion_mask
    tail = dataclasses.replace(batch, loss_mask=sampled, advantages=batch.advantages * sampled)
    cut_attention = batch.attention_mask.clone()
    cut_attention[:, batch.prompt_width :] = sampled.long()
    cut = dataclasses.replace(
        batch, completion_mask=sampled, loss_mask=None, attention_mask=cut_attention,
        advantages=batch.advantages * sampled, input_ids=batch.input_ids.masked_fill(cut_attention == 0, PAD),
    )  # fmt: skip
    a_stats, a_grads = _step(tail)
    b_stats, b_grads = _step(cut)
    assert a_stats.loss == pytest.approx(b_stats.loss, abs=1e-6)
    assert a_stats.kl == pytest.approx(b_stats.kl, rel=1e-5)
    for name in a_grads:
        assert torch.allclose(a_grads[name], b_grads[name], atol=1e-6), name


def _episode_rollouts(n_groups=2, g=2, width=6, start=10, offset=0) -> Rollouts:
    n = n_groups * g
    ids = torch.arange(start, start + n * width).reshape(n, width)
    mask = torch.ones(n, width)
    mask[0, 4:] = 0
    loss = mask.clone()
    loss[:, 2:4] = 0  # a tool result between two turns
    return Rollouts(
        group_ids=torch.arange(n_groups).repeat_interleave(g),
        completion_ids=ids.masked_fill(mask == 0, PAD),
        completion_mask=mask,
        sampling_logprobs=-0.5 * loss,
        truncated=torch.tensor([False, True, False, False][:n]),
        loss_mask=loss,
        episodes=[
            Episode(messages=[{"role": "assistant", "content": f"r{i + offset}"}], turns=2) for i in range(n)
        ],
    )


def test_every_row_and_token_field_follows_rows_select_and_concat():
    r = _episode_rollouts()
    picked = take_rows(r, torch.tensor([3, 1]))
    assert picked.loss_mask.tolist() == [r.loss_mask[3].tolist(), r.loss_mask[1].tolist()]
    assert [e.messages[0]["content"] for e in picked.episodes] == ["r3", "r1"]
    joined = concat_rollouts([r, _episode_rollouts(width=8, start=100, offset=4)], [2, 2], PAD)
    assert joined.loss_mask.shape == (8, 8) and joined.loss_mask[:4, 6:].sum() == 0
    assert joined.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [e.messages[0]["content"] for e in joined.episodes] == [f"r{i}" for i in range(8)]
    # Every declared field went through: a field added to Rollouts needs no edit in these helpers.
    for f in dataclasses.fields(Rollouts):
        value = getattr(joined, f.name)
        if value is None:  # an optional field these rollouts do not fill (extra_fields: rollout_func's)
            continue
        assert (len(value) if isinstance(value, list) else value.shape[0]) == 8, f.name


def test_single_turn_records_share_one_mask_and_train_batch_carries_the_loss_mask():
    single = Rollouts(
        group_ids=torch.tensor([0, 0]), completion_ids=torch.tensor([[5, 6], [7, PAD]]),
        completion_mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]]), sampling_logprobs=torch.zeros(2, 2),
        truncated=torch.tensor([True, False]),
    )  # fmt: skip
    assert single.loss_mask is single.completion_mask
    one = take_rows(single, slice(0, 1))
    assert one.loss_mask is one.completion_mask  # still one tensor after cutting
    prompts = PromptBatch(prompts=["a", "b"], prompt_token_ids=[[3], [4, 4]])
    r = _episode_rollouts()
    batch = build_train_batch(prompts, r, torch.tensor([1.0, -1.0, 2.0, -2.0]), PAD, mask_truncated=True)
    assert batch.completion_mask[1].sum() == 0 and batch.loss_mask[1].sum() == 0  # truncated: both masked
    assert batch.loss_mask[0].tolist() == [1, 1, 0, 0, 0, 0]
    assert batch.attention_mask[0, batch.prompt_width :].tolist() == [1, 1, 1, 1, 0, 0]
    assert batch.advantages[0].tolist() == [1, 1, 0, 0, 0, 0]  # no credit on injected tokens
    trimmed = batch.rows(slice(0, 1)).trim()
    assert trimmed.loss_mask.shape == (1, 4) and trimmed.input_ids.shape == (1, batch.prompt_width + 4)


def test_sampler_mismatch_metrics_ignore_injected_tokens():
    r = _episode_rollouts()
    old = r.sampling_logprobs.clone()
    noisy = r.sampling_logprobs.masked_fill(r.loss_mask == 0, -30.0)  # the injected tokens' "log-probs"
    clean = sampler_metrics(r.sampling_logprobs, old, r.loss_mask, {})
    assert sampler_metrics(noisy, old, r.loss_mask, {}) == clean
    assert clean["mismatch/logp_abs_max"] == 0.0


def test_episode_metrics_count_turns_calls_errors_and_injected_tokens():
    r = _episode_rollouts()
    r.episodes[0].tool_calls, r.episodes[0].tool_errors = 2, {"timeout": 1}
    r.episodes[1].ended_by = "max_turns"
    m = episode_metrics(r)
    assert m["episode/turns"] == 2.0 and m["episode/tool_calls"] == 0.5
    assert m["episode/tool_errors/timeout"] == 0.25 and m["episode/truncated_frac"] == 0.25
    assert m["episode/sampled_tokens"] == (r.loss_mask.sum() / 4).item()
    assert m["episode/injected_tokens"] == ((r.completion_mask.sum() - r.loss_mask.sum()) / 4).item()


def test_the_lm_head_runs_on_sampled_tokens_only(monkeypatch):
    from grpo.model import packed
    from grpo.model.decoder import NativeDecoder

    batch = random_batch(seed=2)
    loss = batch.completion_mask.clone()
    loss[:, 1:3] = 0
    multi = dataclasses.replace(batch, loss_mask=loss)
    rows, apply = [], packed.ChunkedTokenLogprobs.apply
    monkeypatch.setattr(
        packed.ChunkedTokenLogprobs,
        "apply",
        lambda hidden, *args: rows.append(hidden.shape[0]) or apply(hidden, *args),
    )
    decoder = NativeDecoder(tiny_llama())
    full, _ = packed.shared_prompt_logprobs(decoder, batch, 1.0)
    part, _ = packed.shared_prompt_logprobs(decoder, multi, 1.0)
    assert rows == [int(batch.completion_mask.sum()), int(loss.sum())]
    sampled = loss.bool()
    assert torch.allclose(part[sampled], full[sampled], atol=1e-6)
    assert (part[~sampled] == 0).all()
