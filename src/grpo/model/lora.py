"""LoRA through peft (`lora.enabled=true`, TorchRL's `train_model.lora.*`).

One copy of the base weights: the policy is the base model with adapters; the reference model is the
same module with the adapters switched off (`ReferenceWithoutAdapters`), so β > 0 costs no second
model. Only adapter tensors (names containing `lora_`) travel to rollout workers after the first
full sync. Checkpoints hold the adapters (a peft directory that `AutoModelForCausalLM.from_pretrained`
loads when peft is installed); `final_model/` holds the merged model, adapters folded in, as a plain
Hugging Face model (`lora.save_merged`).
"""

from __future__ import annotations

import copy

import torch

from grpo.config import LoraSettings

ADAPTER_MARK = "lora_"  # substring of every adapter parameter's name


def apply_lora(model, settings: LoraSettings):
    from peft import LoraConfig, TaskType, get_peft_model

    targets = settings.target_modules or None  # None: peft's default for the architecture
    if targets == ["all-linear"]:
        targets = "all-linear"
    config = LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
    )
    return get_peft_model(model, config)


def is_lora(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def lora_base(model):
    """The transformers model inside a peft wrapper (or inside `ReferenceWithoutAdapters`), else `model`.
    peft puts its adapters into that model's own modules, so calling its decoder directly runs them."""
    if isinstance(model, ReferenceWithoutAdapters):
        model = model.peft_model
    return model.get_base_model() if is_lora(model) else model


class ReferenceWithoutAdapters:
    """π_ref = the policy's base weights: calls the peft model with its adapters disabled.

    Duck-types what the learner needs from a model: call it, and `parameters()` for the device.
    """

    def __init__(self, peft_model):
        self.peft_model = peft_model

    def __call__(self, **inputs):
        with self.peft_model.disable_adapter():
            return self.peft_model(**inputs)

    def adapters_off(self):
        """Context in which the peft model (and its base's decoder, called directly) is π_ref."""
        return self.peft_model.disable_adapter()

    def parameters(self):
        return self.peft_model.parameters()

    def eval(self):
        return self


def adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter entries of a full state dict (model key names, for resume)."""
    return {k: v for k, v in state.items() if ADAPTER_MARK in k}


def merged_model(peft_model, full_state: dict[str, torch.Tensor]):
    """A plain transformers model with the adapters folded in, built from a full CPU state dict (so it
    works the same when the live model is sharded by FSDP2)."""
    from peft import get_peft_model

    base_config = peft_model.get_base_model().config
    base_cls = type(peft_model.get_base_model())
    base_cls = next((c for c in base_cls.__mro__ if not c.__name__.startswith("FSDP")), base_cls)
    with torch.device("cpu"):
        fresh = base_cls(copy.deepcopy(base_config))
    fresh = get_peft_model(fresh, copy.deepcopy(peft_model.peft_config["default"]))
    missing, unexpected = fresh.load_state_dict(full_state, strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise RuntimeError(
            f"LoRA merge: state does not match the model (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]})."
        )
    merged = fresh.merge_and_unload()
    if hasattr(merged, "tie_weights"):
        merged.tie_weights()
    # Merged in float32 whatever the frozen base is held in (bf16 under mixed precision); save_dtype casts.
    return merged.float()
