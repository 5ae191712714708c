"""The GRPOTrainer side of TRL compatibility: TRL's trainer arguments and what TRL passes reward functions.

TRL's GRPOConfig names and defaults are translated by the config (grpo.config.trl and keys.TRL_ALIASES);
this module holds what the trainer needs: `args=`/`processing_class=` as TRL spells them, reward models
among `reward_funcs`, a peft LoraConfig, refusing TRL trainer arguments with no counterpart, and the
reward-function inputs (`reward_inputs`, `RewardState`). docs/trl.md has the whole table.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from grpo.config import TRLConfigError
from grpo.records import PromptBatch, Rollouts

__all__ = [
    "RewardState",
    "TRLConfigError",
    "looks_like_rewards",
    "lora_from_peft",
    "one_of",
    "refuse_trainer_args",
    "reward_inputs",
    "split_reward_models",
]

_UNSUPPORTED_ARGS = {
    "callbacks": "transformers TrainerCallbacks have no hooks here; metrics go to metrics.jsonl, TensorBoard "
    "and W&B every train.logging_steps (docs/trl.md).",
    "optimizers": "the optimizer is AdamW with the optim.* settings (learning_rate, adam_beta1/2, "
    "weight_decay, lr_scheduler).",
    "reward_processing_classes": "a reward model given by path loads its own tokenizer; pass a "
    "SequenceClassifierReward for anything else (docs/rewards.md).",
    "quantization_config": "the policy trains as float32 master weights (quantized QLoRA training is not "
    "implemented); the nearest: peft_config=LoraConfig(...), which trains adapters only, with "
    "model.dtype=bfloat16 for the frozen base.",
}


def one_of(name: str, value, trl_name: str, trl_value):
    if value is not None and trl_value is not None:
        raise TRLConfigError(
            f"GRPOTrainer got both {name}= and {trl_name}= (the same thing under TRL's name); pass one."
        )
    return value if value is not None else trl_value


def looks_like_rewards(value) -> bool:
    """A reward function or a list of them where the seed's signature has ref_model (TRL's 2nd argument)."""
    if isinstance(value, list | tuple):
        return True
    return callable(value) and not isinstance(value, torch.nn.Module | str)


def split_reward_models(reward_funcs, reward_model):
    """TRL accepts one reward or a list, and reward models (a hub id/path or a model) among them: those
    become `reward_model` here (one is supported)."""
    if reward_funcs is None:
        return None, reward_model
    funcs = list(reward_funcs) if isinstance(reward_funcs, list | tuple) else [reward_funcs]
    from grpo.rewards import REWARD_FUNCTIONS, REWARD_SCHEMES

    def is_model(spec) -> bool:
        if isinstance(spec, torch.nn.Module):
            return True
        return (
            isinstance(spec, str)
            and ":" not in spec
            and spec not in REWARD_FUNCTIONS
            and spec not in REWARD_SCHEMES
            and ("/" in spec or Path(spec).is_dir())
        )

    models = [f for f in funcs if is_model(f)]
    if len(models) + (reward_model is not None) > 1:
        raise TRLConfigError(
            "More than one reward model: one is supported (reward_model= or one model among reward_funcs)."
        )
    return [f for f in funcs if not is_model(f)], (models[0] if models else reward_model)


def refuse_trainer_args(**given) -> None:
    """TRL GRPOTrainer arguments with no counterpart here: refused unless left at TRL's default, with the
    reason and the nearest equivalent. A name TRL does not have either is Python's TypeError, as ever."""
    for name, value in given.items():
        if name not in _UNSUPPORTED_ARGS:
            import difflib

            close = difflib.get_close_matches(name, [*_UNSUPPORTED_ARGS, *_TRAINER_ARGS], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"GRPOTrainer() got an unexpected keyword argument {name!r}{hint}")
        if value is None or (isinstance(value, tuple | list) and tuple(value) in ((), (None, None))):
            continue
        raise TRLConfigError(f"GRPOTrainer({name}=...) is not supported: {_UNSUPPORTED_ARGS[name]}")


# GRPOTrainer's own keyword arguments (for the did-you-mean of a mistyped one)
_TRAINER_ARGS = (
    "model", "ref_model", "reward_model", "tokenizer", "config", "train_dataset", "reward_funcs",
    "eval_dataset", "args", "processing_class", "peft_config", "tools", "environment_factory",
)  # fmt: skip


def lora_from_peft(peft_config: Any) -> dict[str, Any]:
    """A peft LoraConfig (TRL's `peft_config=`) → our lora.* keys."""
    if type(peft_config).__name__ != "LoraConfig":
        raise TRLConfigError(
            f"peft_config must be a peft.LoraConfig, got {type(peft_config).__name__}: other "
            "adapter types are not supported."
        )
    modules = peft_config.target_modules
    modules = [modules] if isinstance(modules, str) else sorted(modules or [])
    return {
        "lora.enabled": True,
        "lora.r": peft_config.r,
        "lora.alpha": float(peft_config.lora_alpha),
        "lora.dropout": float(peft_config.lora_dropout),
        "lora.target_modules": modules,
    }


@dataclass(frozen=True)
class RewardState:
    """What TRL passes reward functions as `trainer_state` (a transformers TrainerState), the fields they
    read."""

    global_step: int
    epoch: float
    max_steps: int

    @property
    def step(self) -> int:
        return self.global_step


def reward_inputs(prompts: PromptBatch, rollouts: Rollouts, texts: list[str]) -> tuple[list, list, dict]:
    """Prompts, completions and `completion_ids` as TRL gives reward functions: one entry per completion;
    a conversational prompt's completion is `[{"role": "assistant", "content": text}]`, plain text stays
    text. A multi-turn episode's completion is the list of messages it added (assistant turns with their
    tool calls, tool results, environment messages), and `environments` its environment objects (TRL)."""
    group = rollouts.group_ids.tolist()  # [N]
    reward_prompts = [prompts.prompts[i] for i in group]
    if rollouts.episodes is not None:
        completions = [[dict(m) for m in e.messages] for e in rollouts.episodes]
        extra = {"environments": [e.environment for e in rollouts.episodes]}
    else:
        completions = [
            [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text
            for prompt, text in zip(reward_prompts, texts, strict=True)
        ]
        extra = {}
    if rollouts.extra_fields is not None:  # a runner's own columns (TRL: rollout_func's extra keys)
        for key in dict.fromkeys(k for row in rollouts.extra_fields for k in row):
            extra[key] = [row.get(key) for row in rollouts.extra_fields]
    lengths = rollouts.lengths.tolist()  # [N]
    completion_ids = [ids[:n] for ids, n in zip(rollouts.completion_ids.tolist(), lengths, strict=True)]
    return reward_prompts, completions, {"completion_ids": completion_ids, **extra}
