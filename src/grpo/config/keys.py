"""Names → fields: the aliases users type (seed projects' and TRL's), key resolution and value coercion.

A key is a dotted path (`optim.learning_rate`), a unique leaf name (`learning_rate`) or an alias
(`lr`, `optimizer.lr`, `kl_coef`); `-` and `_` are the same. Values from the command line arrive as
strings and are coerced to the field's type here, with a message naming the key when they do not fit.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from typing import Any

from grpo.config.errors import ConfigError
from grpo.config.schema import SECTIONS, Registry
from grpo.config.yaml_limits import YAMLSyntaxError, load_yaml

# Names used by the seed projects (plain PyTorch GRPO, MaxText/Tunix, TorchRL) → our dotted paths.
ALIASES: dict[str, str | tuple[str, ...]] = {
    # plain-PyTorch seed (GRPOConfig fields and train_grpo.py flags)
    "model_name": "model.name_or_path",
    "batch_size": "train.prompts_per_step",
    "num_epochs": "train.num_epochs",
    "learning_rate": "optim.learning_rate",
    "num_generations_per_prompt": "generation.num_generations",
    "num_generations": "generation.num_generations",
    "max_new_tokens": "generation.max_new_tokens",
    "temperature": "generation.temperature",
    "top_k": "generation.top_k",
    "top_p": "generation.top_p",
    "gradient_accumulation_steps": "train.gradient_accumulation_steps",
    "max_grad_norm": "optim.max_grad_norm",
    "warmup_steps": "optim.warmup_steps",
    "kl_coef": "algorithm.beta",
    "clip_range": ("algorithm.epsilon_low", "algorithm.epsilon_high"),
    "gamma": "algorithm.gamma",
    "logging_steps": "train.logging_steps",
    "save_steps": "train.save_steps",
    "output_dir": "train.output_dir",
    "use_wandb": "train.use_wandb",
    "wandb_project": "train.wandb_project",
    "wandb_run_name": "train.wandb_run_name",
    "device": "model.device",
    "steps": "train.steps",
    "seed": "train.seed",
    "resume": "train.resume",
    "resume_from_checkpoint": "train.resume",  # TRL (TrainingArguments): True = the newest checkpoint
    "reward_model": "algorithm.reward_model",
    "reward_funcs": "algorithm.reward_funcs",
    # MaxText / Tunix demo
    "tokenizer_path": "model.tokenizer_path",
    "load_parameters_path": "model.load_parameters_path",
    "base_output_directory": "train.base_output_directory",
    "hf_access_token": "model.hf_token",
    "hf_path": "data.hf_path",
    "hf_data_split": "data.hf_data_split",
    "hf_data_files": "data.hf_data_files",
    "per_device_batch_size": "train.prompts_per_step",
    "run_name": "train.run_name",
    "grpo_beta": "algorithm.beta",
    "grpo_epsilon": ("algorithm.epsilon_low", "algorithm.epsilon_high"),
    "max_prefill_predict_length": "data.max_prompt_length",
    "max_target_length": "generation.max_total_length",
    "checkpoint_period": "train.save_steps",
    "inference_rollouts": "distributed.weight_sync_steps",
    # TorchRL
    "optimizer.lr": "optim.learning_rate",
    "optimizer.weight_decay": "optim.weight_decay",
    "policy.kl_coef": "algorithm.beta",
    "env.dataset": "data.dataset",
    "model.name": "model.name_or_path",
    "train_model.num_devices": "distributed.train_devices",
    "ref_model.num_devices": "distributed.ref_devices",
    "inference_model.num_devices": "distributed.inference_devices",
    "train.checkpoint_frequency": "train.save_steps",
    "train_model.devices": "distributed.train_device_ids",
    "ref_model.devices": "distributed.ref_device_ids",
    "inference_model.devices": "distributed.inference_device_ids",
    "inference_model.gpu_memory_utilization": "generation.vllm_gpu_memory_utilization",
    "inference_model.max_model_len": "generation.vllm_max_model_len",
    "inference_model.tensor_parallel_size": "generation.vllm_tensor_parallel_size",
    "inference_model.enforce_eager": "generation.vllm_enforce_eager",
    "gpu_memory_utilization": "generation.vllm_gpu_memory_utilization",
    "vllm_importance_sampling_mode": "distributed.importance_correction",
    "vllm_importance_sampling_cap": "distributed.importance_cap",
    "rollout_correction.rollout_is_threshold": "distributed.importance_cap",
    "mode": "distributed.rollout_mode",
    "rollout.mode": "distributed.rollout_mode",
    "rollout.max_staleness": "distributed.max_staleness",
    "rollout.replicas": "distributed.inference_replicas",
    "train.weight_update_frequency": "distributed.weight_sync_steps",
    "weight_update_frequency": "distributed.weight_sync_steps",
    "train_model.lora.enabled": "lora.enabled",
    "train_model.lora.r": "lora.r",
    "train_model.lora.alpha": "lora.alpha",
    "train_model.lora.dropout": "lora.dropout",
    "train_model.lora.target_modules": "lora.target_modules",
    "env.num_envs": "train.prompts_per_step",  # TorchRL: prompts sampled at once
    "env.repeats": "generation.num_generations",  # TorchRL: completions per prompt
    "train.optim_batch_size": "train.micro_batch_size",
    # common spellings
    "lr": "optim.learning_rate",
    "epsilon": ("algorithm.epsilon_low", "algorithm.epsilon_high"),
    "model": "model.name_or_path",
}


# TorchRL's names under `env.` (its "environment" is the prompt stream) that mean other sections' settings,
# while this package's env.* section configures agent environments (env.tools, env.max_turns, ...). Each use
# is said in the log; no alias may be a field's own path (tests/unit/test_config.py checks), so a spelling
# never has two meanings.
TORCHRL_ENV_ALIASES = frozenset(k for k in ALIASES if k.startswith("env."))


def normalise_key(key: str) -> str:
    """A key as resolve_key reads it: no leading dashes, '-' == '_'."""
    return str(key).strip().lstrip("-").replace("-", "_")


# Seed settings with no counterpart, and what to use instead.
FOREIGN_KEYS = {
    "train.total_dialog_turns": "TorchRL's run length in dialog turns; here the run length is train.steps "
    "(optimizer steps of prompts_per_step × num_generations completions) or train.num_epochs.",
}

# TRL GRPOConfig names with the same meaning here, read only in a TRL-style config (config/trl.py), where
# they win over the seed names above: `run_name` is then the W&B run name, as in TRL.
TRL_ALIASES: dict[str, str | tuple[str, ...]] = {
    "learning_rate": "optim.learning_rate",
    "weight_decay": "optim.weight_decay",
    "adam_beta1": "optim.adam_beta1",
    "adam_beta2": "optim.adam_beta2",
    "adam_epsilon": "optim.adam_epsilon",
    "warmup_steps": "optim.warmup_steps",
    "max_grad_norm": "optim.max_grad_norm",
    "beta": "algorithm.beta",
    "num_iterations": "algorithm.num_iterations",
    "mask_truncated_completions": "algorithm.mask_truncated_completions",
    "reward_weights": "algorithm.reward_weights",
    "use_bias_correction_kl": "algorithm.use_bias_correction_kl",
    "sapo_temperature_pos": "algorithm.sapo_temperature_pos",
    "sapo_temperature_neg": "algorithm.sapo_temperature_neg",
    "num_generations": "generation.num_generations",
    "max_completion_length": "generation.max_new_tokens",
    "max_prompt_length": "data.max_prompt_length",
    "temperature": "generation.temperature",
    "top_p": "generation.top_p",
    "num_train_epochs": "train.num_epochs",
    "logging_steps": "train.logging_steps",
    "save_steps": "train.save_steps",
    "save_total_limit": "train.save_total_limit",
    "seed": "train.seed",
    "output_dir": "train.output_dir",
    "chat_template_kwargs": "data.chat_template_kwargs",
    "shuffle_dataset": "data.shuffle",
    "gradient_checkpointing": "model.gradient_checkpointing",
    "activation_checkpointing": "model.gradient_checkpointing",
    "trust_remote_code": "model.trust_remote_code",
    "entropy_coef": "algorithm.entropy_coef",
    "eval_steps": "train.eval_steps",
    "run_name": "train.wandb_run_name",
    "min_p": "generation.min_p",
    "vllm_gpu_memory_utilization": "generation.vllm_gpu_memory_utilization",
    "vllm_max_model_length": "generation.vllm_max_model_len",
    "vllm_tensor_parallel_size": "generation.vllm_tensor_parallel_size",
    "vllm_enable_sleep_mode": "generation.vllm_sleep",
    "vllm_importance_sampling_cap": "distributed.importance_cap",
}


def _leaf_index() -> dict[str, list[str]]:
    index: dict[str, list[str]] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            index.setdefault(f.name, []).append(f"{section}.{f.name}")
    return index


LEAVES = _leaf_index()


def all_paths() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def resolve_key(key: str, trl: bool = False) -> tuple[str, ...]:
    """Map a user-facing key (dotted path, unique leaf name or alias; '-' == '_') to dotted paths.
    `trl`: the key comes from a TRL-style config, where TRL's names come first."""
    k = normalise_key(key)
    if trl and k in TRL_ALIASES:
        return (TRL_ALIASES[k],)
    if k in ALIASES:
        target = ALIASES[k]
        return target if isinstance(target, tuple) else (target,)
    if "." in k and k in set(all_paths()):
        return (k,)
    if k in LEAVES and len(LEAVES[k]) == 1:
        return (LEAVES[k][0],)
    if k in LEAVES:
        raise ConfigError(f"'{key}' is ambiguous: write one of {', '.join(LEAVES[k])}.")
    if k in FOREIGN_KEYS:
        raise ConfigError(f"'{key}' has no counterpart here: {FOREIGN_KEYS[k]}")
    known = sorted(set(all_paths()) | set(LEAVES) | set(ALIASES))
    close = difflib.get_close_matches(k, known, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ConfigError(f"Unknown config key '{key}'.{hint} Run `grpo train --help` for every key.")


def field_of(path: str) -> dataclasses.Field:
    section, name = path.split(".")
    return {f.name: f for f in dataclasses.fields(SECTIONS[section])}[name]


def choices_of(path: str) -> tuple[str, ...] | None:
    """The values a field accepts, None for any; a registry's keys are looked up now."""
    choices = field_of(path).metadata.get("choices")
    return choices.keys() if isinstance(choices, Registry) else choices


@functools.cache
def section_hints(section: str) -> dict[str, Any]:
    """Field types of a section (evaluating string annotations is slow: once per process)."""
    return typing.get_type_hints(SECTIONS[section])


def hint_of(path: str) -> Any:
    section, name = path.split(".")
    return section_hints(section)[name]


def get_path(cfg: Any, path: str) -> Any:
    section, name = path.split(".")
    return getattr(getattr(cfg, section), name)


def set_path(cfg: Any, path: str, value: Any) -> None:
    section, name = path.split(".")
    setattr(getattr(cfg, section), name, value)


def coerce(path: str, value: Any) -> Any:
    """Convert `value` (possibly a string from the command line) to the field's type, or explain."""
    hint, optional = _without_none(hint_of(path))
    if path == "train.resume" and isinstance(value, bool):  # TRL's resume_from_checkpoint=True
        return "latest" if value else None
    if isinstance(value, str):
        value = _from_text(value, hint, optional, path)
    origin = typing.get_origin(hint)
    if value is None:
        if optional:
            return None
        empty = "; write [] for an empty list" if list in (hint, origin) else ""
        raise ConfigError(f"{path} cannot be empty (expected {_type_name(hint)}{empty}).")
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path} expects a mapping, e.g. {{enable_thinking: false}}, got {value!r}.")
        return dict(value)
    try:
        if origin is list:
            (item,) = typing.get_args(hint)
            if isinstance(value, str):
                value = [v for v in value.split(",") if v]
            if not isinstance(value, (list, tuple)):
                value = [value]
            return [_scalar(item, v) for v in value]
        return _scalar(hint, value)
    except (TypeError, ValueError, OverflowError) as e:
        raise ConfigError(f"{path} expects {_type_name(hint)}, got {value!r}.") from e


def _without_none(hint: Any) -> tuple[Any, bool]:
    """`X | None` → (X, True); any other hint → (hint, False)."""
    args = typing.get_args(hint)
    if type(None) in args and typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next(a for a in args if a is not type(None)), True
    return hint, False


def _from_text(text: str, hint: Any, optional: bool, path: str) -> Any:
    """A command-line string read as YAML would read it (`3`, `true`, `[a, b]`), unless the field is text."""
    if optional and text.strip().lower() in ("none", "null", "~", ""):
        return None
    if hint is str:
        return text
    try:
        return load_yaml(text, f"The value of {path}")
    except YAMLSyntaxError:  # e.g. an unbalanced bracket: left as text for the type check to name
        return text


def _scalar(hint: type, value: Any) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "on", "1", "false", "no", "off", "0"):
            return value.lower() in ("true", "yes", "on", "1")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ValueError(value)
    if hint is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(value)
        return int(value)
    if hint is float:
        if isinstance(value, bool):
            raise ValueError(value)
        return float(value)
    if hint is str:
        if isinstance(value, (dict, list)):
            raise ValueError(value)
        return str(value)
    raise TypeError(hint)


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", str(hint))
