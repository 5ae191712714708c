"""TRL's GRPOConfig → this package's config keys, so a TRL script runs by changing its import.

    from grpo import GRPOConfig, GRPOTrainer          # was: from trl import GRPOConfig, GRPOTrainer
    args = GRPOConfig(output_dir="out", per_device_train_batch_size=8, num_generations=8, loss_type="dapo")
    GRPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=[...], args=args, train_dataset=ds).train()

A config is read "TRL-style" when any keyword is one only TRL has (`per_device_train_batch_size`,
`max_completion_length`, `loss_type`, `scale_rewards`, `max_steps`, `report_to`, …, see TRL_ONLY):
then TRL 1.16's defaults apply to every setting both libraries have (β = 0, temperature 1, no top-k/p,
loss "dapo", bias-corrected KL, linear schedule, …) and TRL's names are translated as TRL means them
(its batch sizes count completions per device and micro-batch, not prompts). Plain renames are
keys.TRL_ALIASES; the settings that need more than a rename are converted here. A name that we cannot
honour is refused with the reason; names that change nothing here are accepted and listed in the log.
docs/trl.md has the whole table. The GRPOTrainer side (reward inputs, argument checks) is grpo.trl_compat.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from grpo.config.errors import TRLConfigError
from grpo.config.keys import TRL_ALIASES, choices_of, resolve_key

log = logging.getLogger("grpo")

# TRL 1.16.0's defaults for the settings both libraries have (trl/trainer/grpo_config.py and transformers'
# TrainingArguments), as our dotted keys.
TRL_DEFAULTS: dict[str, Any] = {
    "optim.learning_rate": 1e-6,
    "optim.weight_decay": 0.0,
    "optim.adam_beta1": 0.9,
    "optim.adam_beta2": 0.999,
    "optim.adam_epsilon": 1e-8,
    "optim.lr_scheduler": "linear",
    "optim.warmup_steps": 0,
    "optim.max_grad_norm": 1.0,
    "algorithm.beta": 0.0,
    "algorithm.epsilon_low": 0.2,
    "algorithm.epsilon_high": 0.2,
    "algorithm.loss_variant": "grpo",
    "algorithm.loss_aggregation": "token_mean",
    "algorithm.advantage_scale": "group",
    "algorithm.num_iterations": 1,
    "algorithm.mask_truncated_completions": False,
    "algorithm.use_bias_correction_kl": True,
    "algorithm.entropy_coef": 0.0,
    "algorithm.sapo_temperature_pos": 1.0,
    "algorithm.sapo_temperature_neg": 1.05,
    "generation.num_generations": 8,
    "generation.max_new_tokens": 512,
    "generation.temperature": 1.0,
    "generation.top_k": 0,
    "generation.top_p": 1.0,
    "train.num_epochs": 3.0,
    "train.logging_steps": 10,
    "train.save_steps": 500,
    "train.seed": 42,
    "data.shuffle": True,
    "data.chat_template_for_text": False,
    "model.gradient_checkpointing": True,
}

# TRL's vLLM settings that need more than a rename (see _vllm).
VLLM = {
    "use_vllm",
    "vllm_mode",
    "vllm_server_base_url",
    "vllm_server_host",
    "vllm_server_port",
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
}

# loss_type -> (our loss_variant, our loss_aggregation).
LOSS_TYPES: dict[str, tuple[str, str]] = {
    "grpo": ("grpo", "sequence_mean"),  # mean over each completion's tokens, then over completions
    "dapo": ("grpo", "token_mean"),  # every token of the optimisation batch weighs the same
    "bnpo": ("grpo", "token_mean"),  # TRL divides per micro-batch: the same with one micro-batch per step
    "dr_grpo": ("grpo", "constant"),  # normaliser completions × max_completion_length
    "cispo": ("cispo", "token_mean"),
    "sapo": ("sapo", "sequence_mean"),
}

# Accepted values that change nothing here (the setting's TRL default, or a knob with no counterpart that
# does not change training): name -> (accepted values, or None for any; why).
NO_EFFECT: dict[str, tuple[tuple | None, str]] = {
    "bf16": (None, "precision follows model.dtype: float32 master weights, bf16 compute on CUDA (auto)"),
    "tf32": (None, "precision follows model.dtype"),
    "remove_unused_columns": (None, "every dataset column reaches the reward functions"),
    "dataloader_num_workers": (None, "prompts are read in the training process"),
    "dataloader_pin_memory": (None, "prompts are read in the training process"),
    "dataloader_drop_last": (None, "the last batch of an epoch may be smaller"),
    "disable_dropout": (None, "dropout is whatever the model's config says"),
    "logging_dir": (None, "TensorBoard events go to the run directory"),
    "logging_first_step": (None, "logging follows logging_steps"),
    "logging_strategy": (("steps",), "logging follows logging_steps"),
    "save_strategy": (("steps", "no"), "checkpoints follow save_steps ('no': only the final model)"),
    "save_only_model": (None, "checkpoints always carry training_state.pt for --resume"),
    "eval_strategy": (("no", "steps"), "evaluation (held-out accuracy) runs every eval_steps when set"),
    "per_device_eval_batch_size": (None, "evaluation batches follow train.eval_batch_size"),
    "overwrite_output_dir": (None, "a run directory is reused as given"),
    "log_level": (None, "the grpo logger prints at INFO"),
    "log_completions": (
        None,
        "sample completions go to samples.jsonl every logging step (train.log_samples)",
    ),
    "num_completions_to_print": (None, "see log_completions"),
    "log_unique_prompts": (None, "see log_completions"),
    "optim": (("adamw_torch", "adamw_torch_fused"), "the optimizer is torch AdamW"),
    "lr_scheduler_kwargs": ((None, {}), "the schedules take no arguments"),
    "gradient_checkpointing_kwargs": (None, "checkpointing uses transformers' defaults"),
    "model_init_kwargs": ((None, {}), "set model.dtype / model.revision instead"),
    "push_to_hub": ((False,), "upload final_model/ yourself"),
    "hub_model_id": (None, "nothing is uploaded"),
    "top_entropy_quantile": ((1.0,), "training on high-entropy tokens only is not implemented"),
    "delta": ((None,), "INTELLECT-2's two-sided clipping is not implemented"),
    "repetition_penalty": ((1.0,), "repetition penalties are not implemented"),
    "generation_kwargs": ((None, {}), "use the generation.* settings"),
    "multi_objective_aggregation": (("sum_then_normalize",), "rewards are summed, then normalised"),
    "sync_ref_model": ((False,), "the reference model stays fixed (TR-DPO sync is not implemented)"),
    "ref_model_mixup_alpha": (None, "only with sync_ref_model"),
    "ref_model_sync_steps": (None, "only with sync_ref_model"),
    "off_policy_mask_threshold": ((None,), "off-policy sequence masking is not implemented"),
    "use_adaptive_entropy": ((False,), "the adaptive entropy controller is not implemented"),
    "num_generations_eval": ((None,), "evaluation is greedy, one completion per prompt (grpo eval --k)"),
    "use_liger_kernel": ((False,), "Liger kernels are not used"),
    "cache_implementation": (None, "the native engine keeps its own KV cache"),
    "pad_to_multiple_of": (None, "training packs rows without padding"),
    "disable_tqdm": (None, "see train.progress_bar"),
}

# Everything TRL-specific: one of these in GRPOConfig(...) makes the whole config TRL-style.
TRL_ONLY = {
    "per_device_train_batch_size",
    "max_completion_length",
    "loss_type",
    "scale_rewards",
    "importance_sampling_level",
    "steps_per_generation",
    "generation_batch_size",
    "num_train_epochs",
    "max_steps",
    "lr_scheduler_type",
    "report_to",
    "warmup_ratio",
    "use_bias_correction_kl",
    "shuffle_dataset",
    "activation_checkpointing",
    "use_cpu",
    "max_tool_calling_iterations",
    *NO_EFFECT,
    *VLLM,
} - {"disable_tqdm"}
TRL_NAMES = (
    TRL_ONLY
    | set(TRL_ALIASES)
    | {"epsilon", "epsilon_high", "top_k", "gradient_accumulation_steps", "disable_tqdm"}
)


_NO_COUNTERPART = "a vLLM setting with no counterpart here, or one of loss_type='vespo' (not implemented)"


# TRL names that set more than a renamed key (see _loss, _batch, _schedule, _vllm): name -> our keys.
DERIVED: dict[str, tuple[str, ...]] = {
    "per_device_train_batch_size": ("train.prompts_per_step", "train.micro_batch_size"),
    "gradient_accumulation_steps": ("train.prompts_per_step",),
    "steps_per_generation": ("train.prompts_per_step",),
    "generation_batch_size": ("train.prompts_per_step",),
    "num_generations": ("train.prompts_per_step",),
    "loss_type": ("algorithm.loss_variant", "algorithm.loss_aggregation", "algorithm.epsilon_high"),
    "importance_sampling_level": ("algorithm.loss_variant",),
    "epsilon": ("algorithm.epsilon_low", "algorithm.epsilon_high"),
    "epsilon_high": ("algorithm.epsilon_high",),
    "scale_rewards": ("algorithm.advantage_scale",),
    "lr_scheduler_type": ("optim.lr_scheduler",),
    "max_steps": ("train.steps",),
    "report_to": ("train.use_wandb",),
    "top_k": ("generation.top_k",),
    "use_cpu": ("model.device",),
    "disable_tqdm": ("train.progress_bar",),
    "save_strategy": ("train.save_steps",),
    "use_vllm": ("generation.engine", "distributed.importance_cap"),
    "vllm_mode": ("generation.vllm_server_url",),
    "vllm_server_base_url": ("generation.vllm_server_url",),
    "vllm_server_host": ("generation.vllm_server_url",),
    "vllm_server_port": ("generation.vllm_server_url",),
    "vllm_importance_sampling_correction": ("distributed.importance_correction",),
    "vllm_importance_sampling_mode": ("distributed.importance_correction",),
    "max_tool_calling_iterations": ("env.max_turns",),  # N rounds of tool calls: N + 1 turns
}


# Settings messages name the user's TRL way (beside TRL_ALIASES): our key -> TRL's name.
SPELLED = {
    "train.steps": "max_steps",
    "train.micro_batch_size": "per_device_train_batch_size",
    "train.gradient_accumulation_steps": "gradient_accumulation_steps",
    "optim.lr_scheduler": "lr_scheduler_type",
    "algorithm.advantage_scale": "scale_rewards",
    "generation.top_k": "top_k",
}


def trl_settings(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """A TRL-style config's settings as (TRL's defaults the user did not set, what the user set, {our key:
    the TRL name the user wrote}). The defaults count as a preset's (not "given": `num_train_epochs=3`
    beside the user's `max_steps` is not "both were given"), and messages name settings the user's way.
    TRL's gradient_accumulation_steps is in prompts_per_step already; our key of that name, which
    micro_batch_size overrides, is never reported as given."""
    out = translate(kwargs)
    touched = {key for name in kwargs for key in DERIVED.get(name, ())}
    names = {key: name for key, name in SPELLED.items() if name in kwargs}
    for name in kwargs:
        if name in TRL_ALIASES:
            touched.add(resolve_key(name, trl=True)[0])
            names.setdefault(resolve_key(name, trl=True)[0], name)
    own = {k for k in kwargs if k not in TRL_NAMES and not k.startswith(("vllm_", "vespo_"))}
    given = {k for k in out if k in touched or k in own} - {"train.gradient_accumulation_steps"}
    return (
        {k: v for k, v in out.items() if k not in given},
        {k: v for k, v in out.items() if k in given},
        names,
    )


def is_trl_style(kwargs: dict[str, Any]) -> bool:
    return any(k in TRL_ONLY or k.startswith(("vllm_", "vespo_")) for k in kwargs)


def translate(kwargs: dict[str, Any]) -> dict[str, Any]:
    """TRL GRPOConfig keywords (plus any of ours) → {our key: value}, TRL's defaults first."""
    out: dict[str, Any] = dict(TRL_DEFAULTS)
    rest = {k: v for k, v in kwargs.items() if k not in TRL_NAMES and not k.startswith(("vllm_", "vespo_"))}
    trl = {k: v for k, v in kwargs.items() if k not in rest}
    ignored = []
    for name, value in trl.items():
        if name in TRL_ALIASES:
            out[resolve_key(name, trl=True)[0]] = value
        elif name in VLLM:
            continue  # _vllm
        elif name in NO_EFFECT or name.startswith(("vllm_", "vespo_")):
            allowed, why = NO_EFFECT.get(name, (None, _NO_COUNTERPART))
            if allowed is not None and _plain(value) not in allowed:
                raise TRLConfigError(
                    f"GRPOConfig({name}={value!r}) is not supported: {why}. Leave it at "
                    f"{allowed[0]!r}; docs/trl.md lists every TRL setting."
                )
            ignored.append(name)
    _loss(trl, out)
    _batch(trl, out)
    _schedule(trl, out)
    _vllm(trl, out)
    if "top_k" in trl:
        out["generation.top_k"] = trl["top_k"] or 0  # TRL: None or 0 = off
    _tool_calling(trl, out)
    if trl.get("use_cpu"):
        out["model.device"] = "cpu"
    if "disable_tqdm" in trl:
        out["train.progress_bar"] = not trl["disable_tqdm"]
    if trl.get("save_strategy") == "no":
        out["train.save_steps"] = 0
    if ignored:
        log.info("TRL settings with no effect here (docs/trl.md says why): %s", ", ".join(sorted(ignored)))
    out.update(rest)
    return out


def _tool_calling(trl: dict[str, Any], out: dict[str, Any]) -> None:
    """max_tool_calling_iterations = N → env.max_turns = N + 1: TRL counts the rounds of tool calls, each
    followed by one more sampled turn, so N rounds are N + 1 assistant turns. None (TRL: no limit) keeps
    env.max_turns, as every episode here has a turn cap."""
    n = trl.get("max_tool_calling_iterations")
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise TRLConfigError(
            f"GRPOConfig(max_tool_calling_iterations={n!r}) must be a whole number ≥ 0 (rounds of tool calls "
            "per completion), or None."
        )
    out["env.max_turns"] = n + 1


def _vllm(trl: dict[str, Any], out: dict[str, Any]) -> None:
    """use_vllm → generation.engine=vllm (colocated, or a server); TRL's importance correction of the
    sampler/learner mismatch → distributed.importance_correction (same mode names), TRL's cap default 3."""
    if trl.get("use_vllm"):
        out["generation.engine"] = "vllm"
        if trl.get("vllm_mode", "colocate") == "server":
            host, port = trl.get("vllm_server_host", "0.0.0.0"), trl.get("vllm_server_port", 8000)
            url = (
                trl.get("vllm_server_base_url")
                or f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"
            )
            out["generation.vllm_server_url"] = url
        elif trl.get("vllm_mode", "colocate") != "colocate":
            raise TRLConfigError(f"vllm_mode must be 'colocate' or 'server', got {trl['vllm_mode']!r}.")
        out.setdefault("distributed.importance_cap", 3.0)
    if trl.get("vllm_importance_sampling_correction", True) is False:
        out["distributed.importance_correction"] = "none"
    elif "vllm_importance_sampling_mode" in trl:
        out["distributed.importance_correction"] = trl["vllm_importance_sampling_mode"]


def _plain(value: Any) -> Any:
    return getattr(value, "value", value)  # transformers' str enums (SaveStrategy.STEPS) → "steps"


def _loss(trl: dict[str, Any], out: dict[str, Any]) -> None:
    loss_type = trl.get("loss_type", "dapo")
    if loss_type not in LOSS_TYPES:
        raise TRLConfigError(
            f"loss_type={loss_type!r} is not supported (supported: {', '.join(LOSS_TYPES)}); "
            "luspo and vespo are not implemented."
        )
    variant, aggregation = LOSS_TYPES[loss_type]
    level = trl.get("importance_sampling_level", "token")
    if level == "sequence":
        if variant != "grpo":
            raise TRLConfigError(
                f"importance_sampling_level='sequence' with loss_type={loss_type!r} is not "
                "supported: the sequence-level ratio (GSPO) is implemented for the clipped "
                "losses (grpo, dapo, bnpo, dr_grpo) only."
            )
        variant = "gspo"
    elif level != "token":
        raise TRLConfigError(f"importance_sampling_level must be 'token' or 'sequence', got {level!r}.")
    out["algorithm.loss_variant"], out["algorithm.loss_aggregation"] = variant, aggregation
    if loss_type == "bnpo":
        log.info(
            "loss_type='bnpo' maps to token_mean, which normalises by the tokens of the whole step; TRL's "
            "bnpo normalises each micro-batch by its own tokens (equal with one micro-batch per step)."
        )
    epsilon = trl.get("epsilon", 0.2)
    high = trl.get("epsilon_high")
    high = epsilon if high is None else high
    out["algorithm.epsilon_low"] = epsilon
    if variant == "cispo":
        # TRL's cispo caps the ratio at epsilon_high itself (ScaleRL's ε_max, 5.0 recommended); ours at
        # 1 + ε_high.
        if high <= 1:
            raise TRLConfigError(
                f"loss_type='cispo' with epsilon_high={high}: TRL caps the importance ratio at "
                "epsilon_high itself, and a cap at or below 1 down-weights every on-policy "
                "token. Set epsilon_high > 1 (MiniMax-M1/ScaleRL use 5.0)."
            )
        high -= 1.0
    out["algorithm.epsilon_high"] = high
    scale = trl.get("scale_rewards", "group")
    scale = {True: "group", False: "none"}.get(scale, scale) if isinstance(scale, bool) else scale
    scales = choices_of("algorithm.advantage_scale")
    if scale not in scales:
        raise TRLConfigError(
            f"scale_rewards must be {', '.join(map(repr, scales))} (or True/False), got {scale!r}."
        )
    out["algorithm.advantage_scale"] = scale


def _batch(trl: dict[str, Any], out: dict[str, Any]) -> None:
    """TRL counts completions per device: a generation batch of per_device_train_batch_size × world ×
    steps_per_generation completions, one optimizer step per gradient_accumulation_steps micro-batches."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_device = trl.get("per_device_train_batch_size", 8)
    accumulation = trl.get("gradient_accumulation_steps", 1)
    per_generation = trl.get("steps_per_generation")
    if trl.get("generation_batch_size") is not None:
        if per_generation is not None:
            raise TRLConfigError(
                "generation_batch_size and steps_per_generation are mutually exclusive (as in TRL)."
            )
        per_generation, left = divmod(trl["generation_batch_size"], per_device * world)
        if left:
            raise TRLConfigError(
                f"generation_batch_size ({trl['generation_batch_size']}) must be a multiple of "
                f"per_device_train_batch_size × processes = {per_device * world}."
            )
    per_generation = accumulation if per_generation is None else per_generation
    if per_generation != accumulation:
        raise TRLConfigError(
            f"steps_per_generation={per_generation} with gradient_accumulation_steps={accumulation} reuses "
            "one generation batch for several optimizer steps, which grpo does not do: each rollout batch "
            "here is one optimizer step (num_iterations passes over it). Set steps_per_generation to "
            "gradient_accumulation_steps (or leave it unset), and use num_iterations for more updates per "
            "rollout."
        )
    completions = per_device * accumulation * world
    generations = trl.get("num_generations", TRL_DEFAULTS["generation.num_generations"])
    if completions % generations:
        raise TRLConfigError(
            f"The generation batch (per_device_train_batch_size × gradient_accumulation_steps × processes = "
            f"{per_device} × {accumulation} × {world} = {completions}) must be divisible by num_generations "
            f"({generations}), as in TRL."
        )
    out["train.prompts_per_step"] = completions // generations
    out["train.micro_batch_size"] = per_device
    out["train.gradient_accumulation_steps"] = accumulation


def _schedule(trl: dict[str, Any], out: dict[str, Any]) -> None:
    scheduler = _plain(trl.get("lr_scheduler_type", "linear"))
    if scheduler not in (*choices_of("optim.lr_scheduler"), "constant_with_warmup"):
        raise TRLConfigError(
            f"lr_scheduler_type={scheduler!r} is not supported: use linear, cosine or constant "
            "(each after warmup_steps of linear warmup)."
        )
    out["optim.lr_scheduler"] = "constant" if scheduler == "constant_with_warmup" else scheduler
    if trl.get("warmup_ratio"):
        raise TRLConfigError("warmup_ratio is not supported: give warmup_steps (optimizer steps) instead.")
    steps = trl.get("max_steps", -1)
    if steps is not None and steps > 0:
        out["train.steps"] = steps
    report_to = trl.get("report_to", "none")
    targets = {report_to} if isinstance(report_to, str) else set(report_to or [])
    unknown = targets - {"none", "all", "tensorboard", "wandb"}
    if unknown:
        raise TRLConfigError(
            f"report_to={sorted(unknown)} is not supported: metrics go to metrics.jsonl, "
            "TensorBoard and (report_to='wandb') Weights & Biases."
        )
    out["train.use_wandb"] = "wandb" in targets
