"""The merged LoRA export (`lora.merged_state`) equals peft's own merge, without copying unadapted weights."""

from __future__ import annotations

import copy

import pytest
import torch

from grpo.config import LoraSettings
from grpo.model.lora import apply_lora, merged_state
from tests.conftest import tiny_llama


def adapted(targets: list[str]):
    policy = apply_lora(tiny_llama(), LoraSettings(r=4, alpha=8, dropout=0.0, target_modules=targets))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # peft starts B at 0 (the merge would be a no-op); make the adapters count
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return policy


@pytest.mark.parametrize("targets", [[], ["all-linear"]], ids=["peft-default", "all-linear"])
def test_merged_state_equals_peft_merge_and_unload(targets):
    policy = adapted(targets)
    full = policy.state_dict()
    got = merged_state(policy, full)
    want = copy.deepcopy(policy).merge_and_unload().state_dict()
    base = copy.deepcopy(policy).unload().state_dict()  # the weights without the adapters
    assert got.keys() == want.keys() == base.keys()
    changed = 0
    for key, value in want.items():
        assert torch.equal(got[key], value), key
        changed += not torch.equal(value, base[key])
    assert changed >= 4  # 2 layers × (q, v) at least: the adapters really moved the merged weights
    ids = torch.tensor([[5, 9, 3, 7, 11]])
    merged = tiny_llama()
    merged.load_state_dict(got)
    torch.testing.assert_close(merged(ids).logits, policy(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def test_merged_state_copies_only_the_adapted_weights():
    policy = adapted([])  # peft's default for Llama: q_proj and v_proj
    full = policy.state_dict()
    got = merged_state(policy, full)
    shared = {k for k, v in got.items() if any(v.data_ptr() == w.data_ptr() for w in full.values())}
    fresh = set(got) - shared
    assert fresh == {f"model.layers.{i}.self_attn.{m}_proj.weight" for i in range(2) for m in "qv"}


def test_merged_state_refuses_dora():
    policy = adapted([])
    policy.peft_config["default"].use_dora = True
    with pytest.raises(ValueError, match="DoRA"):
        merged_state(policy, policy.state_dict())
