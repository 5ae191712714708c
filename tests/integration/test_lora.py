"""LoRA: one copy of the base weights, reference = adapters off, adapters saved and resumed, merged export."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from grpo import GRPOConfig, GRPOTrainer
from grpo.model.forward import token_logprobs
from grpo.model.loading import bundled_model_path

pytestmark = pytest.mark.slow

SMALL = {
    "batch_size": 2,
    "num_generations": 4,
    "max_new_tokens": 16,
    "gradient_accumulation_steps": 2,
    "learning_rate": 5e-3,
    "warmup_steps": 0,
    "logging_steps": 1,
    "progress_bar": False,
    "seed": 5,
    "eval_dataset": None,
    "num_threads": 1,
    "beta": 0.04,
    "tensorboard": False,
    "lora.enabled": True,
    "lora.r": 4,
    "lora.alpha": 8,
    "train_model.lora.dropout": 0.0,
}


def shortness(prompts, completions, **_):
    return [-len(c) / 50 for c in completions]


def trainer(out, **overrides) -> GRPOTrainer:
    return GRPOTrainer(
        config=GRPOConfig(**{**SMALL, "output_dir": str(out), **overrides}), reward_funcs=[shortness]
    )


def test_lora_trains_adapters_over_one_copy_of_the_base(tmp_path):
    base = load_file(f"{bundled_model_path()}/model.safetensors")
    t = trainer(tmp_path / "run", steps=2, save_steps=1)
    policy, ref = t.parts.policy, t.parts.ref_model
    # One copy: the reference holds no tensors of its own; every non-adapter tensor is the base's.
    assert ref.peft_model is policy
    storages = {p.untyped_storage().data_ptr() for p in policy.parameters()}
    storages |= {p.untyped_storage().data_ptr() for p in ref.parameters()}
    assert len(storages) == len({p.data_ptr() for p in policy.parameters()})
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    t.train()
    # The base weights did not move; the adapters did, so the merged model differs from the base.
    for name, p in policy.named_parameters():
        if "lora_" not in name and "base_layer" not in name:
            key = name.removeprefix("base_model.model.")
            assert torch.equal(p.detach(), base[key]), name
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final_model")
    moved = [k for k, v in merged.state_dict().items() if k in base and not torch.equal(v, base[k])]
    assert moved and all("proj" in k for k in moved)
    assert (tmp_path / "run" / "final_model" / "adapter" / "adapter_config.json").is_file()
    # The merged export computes what the adapted policy computes; the reference what the base does.
    ids = torch.tensor([[5, 9, 17, 30, 2, 41, 7]])
    policy.eval()
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, policy(input_ids=ids).logits, atol=1e-4)
        plain = AutoModelForCausalLM.from_pretrained(bundled_model_path())
        assert torch.allclose(ref(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-6)
    # Checkpoints are adapter directories (from_pretrained loads them through peft).
    assert (tmp_path / "run" / "checkpoint-1" / "adapter_model.safetensors").is_file()
    AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint-1")


def test_lora_resume_continues_exactly(tmp_path):
    # Split after step 1: the checkpoint then holds AdamW moments, the scheduler and the data position after
    # a real update, as after step 2 (which the split sides took before: 6 steps in all, now 4).
    trainer(tmp_path / "straight", steps=2, save_steps=1).train()
    trainer(tmp_path / "split", steps=1, save_steps=1).train()
    trainer(tmp_path / "split", steps=2, save_steps=1, resume="latest").train()
    a = load_file(str(tmp_path / "straight" / "final_model" / "model.safetensors"))
    b = load_file(str(tmp_path / "split" / "final_model" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_reference_logprobs_are_the_base_models(tmp_path):
    t = trainer(tmp_path / "ref", steps=1)
    from grpo.records import PromptBatch, Rollouts
    from grpo.stages import build_train_batch

    prompts = PromptBatch(prompts=["a", "b"], prompt_token_ids=[[5, 6, 7], [8, 9]])
    rollouts = Rollouts(
        group_ids=torch.tensor([0, 0, 1, 1]),
        completion_ids=torch.randint(3, 50, (4, 5)),
        completion_mask=torch.ones(4, 5),
        sampling_logprobs=torch.zeros(4, 5),
        truncated=torch.zeros(4, dtype=torch.bool),
    )
    batch = build_train_batch(prompts, rollouts, torch.zeros(4), 0)
    with torch.no_grad():
        for p in t.parts.policy.parameters():
            if p.requires_grad:
                p.add_(0.05)  # adapters now change the policy
        got, _ = token_logprobs(t.parts.ref_model, batch, 1.0)
        want, _ = token_logprobs(AutoModelForCausalLM.from_pretrained(bundled_model_path()), batch, 1.0)
        moved, _ = token_logprobs(t.parts.policy, batch, 1.0)
    assert torch.allclose(got, want, atol=1e-5) and not torch.allclose(moved, want, atol=1e-3)
