"""Oracle: TRL 1.16 itself, fed the same model, prompts, completions and rewards as grpo, must give the same
advantages, loss and gradients (float32) for every setting both libraries have. Skipped without trl.

TRL's rollout (`_generate`) is replaced by fixed completions; everything after it is TRL's own code:
reward scoring and advantages (`_generate_and_score_completions`), the loss (`_compute_loss`) and its
backward.
Our side: `score_completions` → `group_advantages` → `build_train_batch` → `grpo_loss`, with the settings
that `GRPOConfig(**trl_kwargs)` (trl_compat) maps TRL's to.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

trl = pytest.importorskip("trl")

from grpo import GRPOConfig
from grpo.algorithm.advantages import group_advantages
from grpo.algorithm.loss import LossNorm, grpo_loss
from grpo.model.forward import token_logprobs
from grpo.model.loading import resolve_path
from grpo.records import PromptBatch, Rollouts
from grpo.rewards import score_completions
from grpo.stages import build_train_batch

G, T = 4, 6  # generations per prompt, max completion length
PROMPTS = ["Maya has 6 stamps. How many?", "2 + 3 = ?", "Hugo sells 4 of 9 marbles. How many are left?"]


def id_reward(completion_ids, **_):
    """Deterministic, varied, and None on one completion (left out of its group's baseline by both)."""
    return [None if sum(ids) % 11 == 0 else (sum(ids) * 7 % 13) / 13.0 for ids in completion_ids]


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_path("tiny-math-lm")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]  # different lengths: left padding matters
    vocab, eos = model.config.vocab_size, tokenizer.eos_token_id
    completions = []
    for i in range(len(PROMPTS) * G):
        length = 2 + i % (T - 1)  # 2..T tokens
        ids = torch.randint(5, vocab, (length,), generator=generator).tolist()
        if i % 3 == 0:
            ids[-1] = eos  # some end with eos, the others are cut off at their length
        completions.append(ids)
    completions[1] = [eos]  # a one-token completion
    return model, tokenizer, prompt_ids, completions


def _trl_run(setup, trl_kwargs, tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    model, tokenizer, prompt_ids, completions = setup
    n = len(completions)
    args = TRLConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=n,
        num_generations=G,
        max_completion_length=T,
        use_cpu=True,
        bf16=False,
        report_to="none",
        gradient_checkpointing=False,
        temperature=1.0,
        **trl_kwargs,
    )
    trainer = TRLTrainer(
        model=copy.deepcopy(model),
        reward_funcs=id_reward,
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]),
    )

    def fixed_generate(prompts):
        rows = [prompt_ids[PROMPTS.index(p)] for p in prompts]
        texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
        return rows, completions, None, texts, None, {}, None, None

    trainer._generate = fixed_generate
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS for _ in range(G)])
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in trainer.model.named_parameters() if p.grad is not None}
    return inputs["advantages"].detach(), loss.detach(), grads


def _our_run(setup, trl_kwargs):
    model, tokenizer, prompt_ids, completions = setup
    cfg = GRPOConfig(
        per_device_train_batch_size=len(completions), num_generations=G, max_completion_length=T, **trl_kwargs
    )
    a = cfg.algorithm
    policy = copy.deepcopy(model).train()
    n = len(completions)
    width = max(map(len, completions))
    ids = torch.full((n, width), tokenizer.pad_token_id)
    mask = torch.zeros((n, width))
    for row, c in enumerate(completions):
        ids[row, : len(c)], mask[row, : len(c)] = torch.tensor(c), 1.0
    group = torch.arange(len(PROMPTS)).repeat_interleave(G)
    rollouts = Rollouts(
        group_ids=group,
        completion_ids=ids,
        completion_mask=mask,
        sampling_logprobs=torch.zeros((n, width)),
        truncated=torch.tensor([c[-1] != tokenizer.eos_token_id for c in completions]),
    )
    prompts = PromptBatch(prompts=PROMPTS, prompt_token_ids=prompt_ids)
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    scores = score_completions(
        [id_reward], None, [PROMPTS[i] for i in group], texts, {"completion_ids": completions}
    )
    advantages = group_advantages(scores.total, group, a.advantage_scale, a.advantage_eps)
    batch = build_train_batch(
        prompts,
        rollouts,
        advantages,
        tokenizer.pad_token_id,
        gamma=a.gamma,
        mask_truncated=a.mask_truncated_completions,
    )
    logp, _ = token_logprobs(policy, batch, 1.0)
    ref = None
    if a.beta > 0:
        with torch.no_grad():
            ref, _ = token_logprobs(copy.deepcopy(model).eval(), batch, 1.0)
    out = grpo_loss(
        logp,
        logp.detach(),
        ref,
        batch.advantages,
        batch.completion_mask,
        variant=a.loss_variant,
        clip_low=a.epsilon_low,
        clip_high=a.epsilon_high,
        beta=a.beta,
        aggregation=a.loss_aggregation,
        norm=LossNorm.from_mask(batch.completion_mask, T),
        kl_bias_correction=a.use_bias_correction_kl,
        variant_options={
            "temperature_pos": a.sapo_temperature_pos,
            "temperature_neg": a.sapo_temperature_neg,
        },
    )
    out.loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in policy.named_parameters() if p.grad is not None}
    return advantages, out.loss.detach(), grads


SETTINGS = [
    {"loss_type": "dapo"},  # TRL's defaults: token_mean, group scaling, β = 0
    {"loss_type": "grpo", "beta": 0.04},
    {"loss_type": "grpo", "beta": 0.04, "use_bias_correction_kl": False},
    {"loss_type": "bnpo", "scale_rewards": "batch"},
    {"loss_type": "dr_grpo", "scale_rewards": "none", "beta": 0.04},
    {"loss_type": "dapo", "epsilon_high": 0.28, "beta": 0.04},
    {"loss_type": "dapo", "importance_sampling_level": "sequence", "beta": 0.04},
    {"loss_type": "grpo", "importance_sampling_level": "sequence", "scale_rewards": "none"},
    {"loss_type": "cispo", "epsilon_high": 5.0, "beta": 0.04},
    {"loss_type": "sapo", "beta": 0.04, "scale_rewards": "batch"},
    {"loss_type": "sapo", "sapo_temperature_pos": 2.0, "sapo_temperature_neg": 3.0},
]


@pytest.mark.slow
@pytest.mark.parametrize("trl_kwargs", SETTINGS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_same_advantages_loss_and_gradients_as_trl(setup, trl_kwargs, tmp_path):
    trl_adv, trl_loss, trl_grads = _trl_run(setup, trl_kwargs, tmp_path)
    adv, loss, grads = _our_run(setup, trl_kwargs)
    torch.testing.assert_close(adv, trl_adv, rtol=1e-5, atol=1e-6)
    assert loss.item() == pytest.approx(trl_loss.item(), rel=1e-5, abs=1e-7)
    assert grads.keys() == trl_grads.keys()
    scale = max(g.abs().max().item() for g in trl_grads.values())
    for name, grad in grads.items():
        torch.testing.assert_close(grad, trl_grads[name], rtol=1e-5, atol=1e-5 * scale, msg=name)
    assert not math.isclose(scale, 0.0)  # the comparison is not between two zero gradients
