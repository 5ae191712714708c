"""LoRA through peft (`lora.enabled=true`, TorchRL's `train_model.lora.*`).

One copy of the base weights: the policy is the base model with adapters; the reference model is the
same module with the adapters switched off (`ReferenceWithoutAdapters`), so β > 0 costs no second
model. Only adapter tensors (names containing `lora_`) travel to rollout workers after the first
full sync. Checkpoints hold the adapters (a peft directory that `AutoModelForCausalLM.from_pretrained`
loads when peft is installed); `final_model/` holds the merged model, adapters folded in, as a plain
Hugging Face model (`lora.save_merged`; `merged_state` makes new tensors for the adapted weights only).
Training runs peft's forward (decoder + chunked LM head, model/forward.py); the native rollout engine
folds the active adapters into each generate call's weights (`adapted_linear`).
"""

from __future__ import annotations

import torch

from grpo.config import LoraSettings

ADAPTER_MARK = "lora_"  # substring of every adapter parameter's name
_PEFT_PREFIX = "base_model.model."  # what peft puts before the wrapped model's own parameter names
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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


def has_adapters(model) -> bool:
    """A peft model, or the adapters-off reference over one."""
    return is_lora(model) or isinstance(model, ReferenceWithoutAdapters)


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


def base_state(full_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base weights of a peft model's state dict under plain Hugging Face names, adapters left out
    (the same tensors, not copies)."""
    return {
        k.removeprefix(_PEFT_PREFIX).replace(".base_layer.", "."): v
        for k, v in full_state.items()
        if ADAPTER_MARK not in k
    }


def merged_state(peft_model, full_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The merged model's float32 state dict under plain Hugging Face names, from the peft model's full CPU
    state dict (so it works the same when the live model is sharded by FSDP2): W + scale · B A for each
    adapted layer, the other tensors as they are (shared, not copied, when already float32).

    Only the adapted layers get new tensors: merging through a fresh model, as peft's `merge_and_unload`
    needs, held a second copy of every weight (+4.6 GiB at the end of a Llama-3.2-1B run)."""
    config = peft_model.peft_config["default"]
    if getattr(config, "use_dora", False):  # DoRA rescales each column by a learned magnitude: not W + BA
        raise ValueError("Merging DoRA adapters is not supported; set lora.save_merged=false.")
    transpose = bool(getattr(config, "fan_in_fan_out", False))  # GPT-2's Conv1D stores W as [in, out]
    merged = {k: v.float() for k, v in base_state(full_state).items()}
    for name, module in peft_model.get_base_model().named_modules():
        scaling = getattr(module, "scaling", None)
        if not isinstance(scaling, dict) or "default" not in scaling:
            continue
        a = full_state[f"{_PEFT_PREFIX}{name}.lora_A.default.weight"].float()  # [r, in]
        b = full_state[f"{_PEFT_PREFIX}{name}.lora_B.default.weight"].float()  # [out, r]
        delta = (b @ a).T if transpose else b @ a
        merged[f"{name}.weight"] = merged[f"{name}.weight"] + delta * scaling["default"]
    return merged


def unfoldable_reason(peft_model) -> str | None:
    """Why `adapted_linear` cannot stand for this model's adapters (the native decoder then declines it)."""
    if any(getattr(c, "use_dora", False) for c in peft_model.peft_config.values()):
        return "DoRA adapters"
    for name, module in peft_model.get_base_model().named_modules():
        if hasattr(module, "base_layer") and not name.endswith(_PROJECTIONS):
            return f"a LoRA adapter on {name} (native: on the attention and MLP projections only)"
    return None


def adapted_linear(module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A projection's (weight, bias) as its forward computes with them: for a peft LoRA layer whose
    adapters are on, the weight is W + scale · B A (exact up to float rounding: x(W + sBA)ᵀ = xWᵀ +
    s(xAᵀ)Bᵀ). Rollout folds the adapters in per call this way (a [out, in] temporary per adapted layer,
    freed after use); a plain nn.Linear comes back as it is."""
    base = getattr(module, "base_layer", None)
    if base is None:
        return module.weight, module.bias
    weight = base.weight
    if module.disable_adapters or module.merged:
        return weight, base.bias
    for name in module.active_adapters:
        if name in module.lora_A:
            delta = module.lora_B[name].weight @ module.lora_A[name].weight  # [out, r] @ [r, in]
            weight = weight + delta.to(weight.dtype) * module.scaling[name]
    return weight, base.bias
