"""The models a run loads besides the policy and its reference: the policy's config (read before any
weight, for the preflights), a frozen copy, and a reward model."""

from __future__ import annotations

import torch

from grpo.config import GRPOConfig
from grpo.model.loading import load_causal_lm, prepare_tokenizer, resolve_path


def model_config_of(cfg: GRPOConfig, model):
    """The policy's config without its weights: a given model's own, else config.json (local or hub);
    None when it cannot be read (loading the model then says why)."""
    if model is not None and not isinstance(model, str):
        return getattr(model, "config", None)
    from transformers import AutoConfig

    from grpo.model.loading import hub_kwargs, resolve_path

    try:
        return AutoConfig.from_pretrained(
            resolve_path(cfg.model.load_parameters_path or cfg.model.name_or_path), **hub_kwargs(cfg)
        )
    except Exception:  # noqa: BLE001 (offline, gated, unknown architecture: the model load reports it)
        return None


def frozen_copy(policy, dtype: torch.dtype):
    import copy

    return copy.deepcopy(policy).to(dtype).eval().requires_grad_(False)


def model_reward(spec, tokenizer, cfg: GRPOConfig, device):
    from grpo.rewards.model import reward_from_model

    if not isinstance(spec, str):
        return reward_from_model(spec, tokenizer)
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    path = resolve_path(spec)
    kw = {"token": cfg.hf_token(), "trust_remote_code": cfg.model.trust_remote_code}
    arch = (AutoConfig.from_pretrained(path, **kw).architectures or [""])[0]
    if arch.endswith("ForSequenceClassification"):
        model = AutoModelForSequenceClassification.from_pretrained(path, use_safetensors=True, **kw)
    else:
        model = load_causal_lm(spec, cfg, device, trainable=False)
    model.to(device).eval().requires_grad_(False)
    return reward_from_model(model, prepare_tokenizer(AutoTokenizer.from_pretrained(path, **kw)))
