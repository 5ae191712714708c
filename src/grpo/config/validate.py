"""Every constraint that needs no model or hardware, checked before anything is loaded.

`validate` runs the checks below in order and stops at the first failure with a ConfigError that names
the key and the fix. Field types and `choices` are checked for every field at once; the rest is one short
function per concern. The device-role checks live here too (distributed/roles.py places the roles on the
hardware at start-up, when the device count is known).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import shlex
import shutil
from typing import TYPE_CHECKING

from grpo import plugins
from grpo.config.errors import ConfigError
from grpo.config.keys import choices_of, get_path
from grpo.config.schema import SECTIONS
from grpo.ranges import INT_LIMIT, MAX_SECONDS, REWARD_LIMIT, check_range

MIN_TEMPERATURE = 1e-3

if TYPE_CHECKING:
    from grpo.config.root import ConfigTree

CLOUD_SCHEMES = ("gs", "s3", "az", "abfs", "gcs")
DEVICE_RE = re.compile(r"^(auto|cpu|mps|meta|(cuda|xpu|npu|hpu)(:\d+)?)$")


def validate(cfg: ConfigTree) -> None:
    """Check every constraint that needs no model; raise ConfigError naming the key and the fix."""
    for check in (
        _fields,
        _sizes,
        _generation,
        _algorithm,
        _rewards,
        _optim_and_train,
        _batch_split,
        _unavailable,
        _weight_sync,
        _device_fractions,
        _rollout_placement,
        _learner_devices,
        _reference_devices,
        _ray_settings,
        _lora,
        _env,
        _runtime_values,
        _devices_and_names,
        _integers,
    ):
        check(cfg)


# Where the math (or the library a value is handed to) holds, beyond the type and the checks below:
# (low, high, low_open). Every number of every field also passes check_range: finite, and an int
# within ±INT_LIMIT (grpo/ranges.py).
RANGES = {
    "optim.learning_rate": (0.0, 1.0, True),  # AdamW's step is ~lr per parameter: above 1 it diverges
    "algorithm.reward_weights": (-REWARD_LIMIT, REWARD_LIMIT, False),  # Σ w·r is checked against it too
    "algorithm.overlong_penalty": (-REWARD_LIMIT, REWARD_LIMIT, False),
    "algorithm.entropy_coef": (-REWARD_LIMIT, REWARD_LIMIT, False),
    "algorithm.beta": (0.0, REWARD_LIMIT, False),
    "algorithm.reward_timeout": (0.0, MAX_SECONDS, True),  # threading's timeouts overflow past ~1e9 s
    "distributed.timeout_s": (0.0, MAX_SECONDS, True),
}


def _fields(cfg: ConfigTree) -> None:
    for section in SECTIONS:
        for f in dataclasses.fields(getattr(cfg, section)):
            path = f"{section}.{f.name}"
            choices = choices_of(path)
            value = getattr(getattr(cfg, section), f.name)
            if choices and value not in choices:
                raise ConfigError(f"{path} = {value!r} is not one of {', '.join(choices)}.")
            numbers = [v for v in (value if isinstance(value, list) else [value]) if _is_number(v)]
            if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
                raise ConfigError(f"{path} must be a finite number, got {value!r}.")
            if path in RANGES:
                low, high, low_open = RANGES[path]
                for v in numbers:
                    check_range(v, path, low, high, low_open=low_open, error=ConfigError)


def _integers(cfg: ConfigTree) -> None:
    """Last, after the checks with their own words: every integer setting within ±INT_LIMIT."""
    for section in SECTIONS:
        for f in dataclasses.fields(getattr(cfg, section)):
            value = getattr(getattr(cfg, section), f.name)
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, int) and not isinstance(v, bool):
                    check_range(v, f"{section}.{f.name}", -INT_LIMIT, INT_LIMIT, error=ConfigError)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _sizes(cfg: ConfigTree) -> None:
    for path in (
        "generation.num_generations",
        "generation.max_new_tokens",
        "train.prompts_per_step",
        "algorithm.num_iterations",
        "data.max_prompt_length",
        "train.logging_steps",
        "train.eval_batch_size",
        "algorithm.dynamic_sampling_max_rounds",
    ):
        if get_path(cfg, path) < 1:
            raise ConfigError(f"{path} must be at least 1, got {get_path(cfg, path)}.")
    for path in (
        "train.steps",
        "train.micro_batch_size",
        "train.gradient_accumulation_steps",
        "train.micro_batch_tokens",
        "train.save_total_limit",
        "data.eval_max_samples",
    ):
        value = get_path(cfg, path)
        if value is not None and value < 1:
            raise ConfigError(f"{path} must be at least 1 (or unset), got {value}.")


def _generation(cfg: ConfigTree) -> None:
    g = cfg.generation
    if g.num_generations < 2:
        raise ConfigError(
            "generation.num_generations must be at least 2: GRPO compares completions within "
            f"a group, and a group of {g.num_generations} has no spread."
        )
    if not g.temperature > 0:
        raise ConfigError(f"generation.temperature must be > 0 for sampling, got {g.temperature}.")
    if g.temperature < MIN_TEMPERATURE:  # logits / τ overflow float32 long before τ reaches 0
        raise ConfigError(
            f"generation.temperature must be at least {MIN_TEMPERATURE} (a smaller one divides the logits "
            f"past what float32 holds), got {g.temperature}; GRPO samples, usually at 0.6-1.0."
        )
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


def _algorithm(cfg: ConfigTree) -> None:
    a = cfg.algorithm
    if a.beta < 0:
        raise ConfigError(f"algorithm.beta must be >= 0, got {a.beta}.")
    if not (0 <= a.epsilon_low < 1) or a.epsilon_high < 0:
        raise ConfigError(
            f"clip ranges need 0 <= epsilon_low < 1 and epsilon_high >= 0, got "
            f"{a.epsilon_low} and {a.epsilon_high}."
        )
    if not 0 < a.gamma <= 1:
        raise ConfigError(f"algorithm.gamma must be in (0, 1], got {a.gamma}.")
    if not (a.sapo_temperature_pos >= MIN_TEMPERATURE and a.sapo_temperature_neg >= MIN_TEMPERATURE):
        # the gate is sigmoid(τ(ρ − 1))·4/τ: a τ near 0 makes it overflow float32, as logits / τ would
        raise ConfigError(
            f"algorithm.sapo_temperature_pos and sapo_temperature_neg must be at least {MIN_TEMPERATURE}, "
            f"got {a.sapo_temperature_pos} and {a.sapo_temperature_neg}."
        )
    if a.loss_variant == "gspo" and a.gamma != 1:
        raise ConfigError("algorithm.loss_variant=gspo has one advantage per sequence; it needs gamma = 1.")


def _rewards(cfg: ConfigTree) -> None:
    a = cfg.algorithm
    if not a.reward_funcs and not a.reward_model:
        raise ConfigError("No reward: set algorithm.reward_funcs and/or algorithm.reward_model.")
    if a.reward_weights is not None:
        # a scheme name stands for several functions; the registry is read by path (config imports no rewards)
        schemes = plugins.load("grpo.rewards.schemes:REWARD_SCHEMES")
        n_funcs = sum(len(schemes.get(f, [f])) for f in a.reward_funcs) + (1 if a.reward_model else 0)
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


def _optim_and_train(cfg: ConfigTree) -> None:
    o, t = cfg.optim, cfg.train
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


def _batch_split(cfg: ConfigTree) -> None:
    """The P × G completions of a step must split into whole micro-batches."""
    t, n, mb = cfg.train, cfg.completions_per_step, cfg.resolved_micro_batch_size
    gas = t.gradient_accumulation_steps
    if t.micro_batch_size is None and gas is not None and n % gas:
        raise ConfigError(
            f"Completions per step = prompts_per_step × num_generations = {t.prompts_per_step} × "
            f"{cfg.generation.num_generations} = {n}, which gradient_accumulation_steps = "
            f"{t.gradient_accumulation_steps} does not divide. Pick gradient_accumulation_steps from the "
            f"divisors of {n} ({', '.join(str(k) for k in range(1, n + 1) if n % k == 0)}) or set "
            "micro_batch_size."
        )
    if t.activation_memory_gb is not None and not t.activation_memory_gb > 0:
        raise ConfigError(
            f"train.activation_memory_gb must be a positive number of GB, got {t.activation_memory_gb}."
        )
    if mb is not None and (mb < 1 or mb > n):
        raise ConfigError(
            f"micro_batch_size must be between 1 and prompts_per_step × num_generations = {n}, got {mb}."
        )


def _unavailable(cfg: ConfigTree) -> None:
    """Settings that ask for what this installation cannot give: Pathways, cloud paths, wandb, xplane."""
    if cfg.distributed.use_pathways:
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
        value = get_path(cfg, path)
        if isinstance(value, str) and value.split("://", 1)[0].lower() in CLOUD_SCHEMES and "://" in value:
            raise ConfigError(
                f"{path} = {value}: cloud storage paths are not supported; copy the "
                f"{'checkpoint' if path.startswith('model.') else 'files'} locally (e.g. "
                "gsutil -m cp -r / aws s3 cp --recursive) and pass its directory."
            )
    no_cxx = not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++"))
    if cfg.model.compile_training and not cfg.model.device.startswith("cuda") and no_cxx:
        raise ConfigError(
            "model.compile_training=true needs a C++ compiler for torch.compile's CPU kernels and none was "
            "found (g++, clang++ or $CXX): install one (apt-get install g++) or leave "
            "model.compile_training unset."
        )
    if cfg.generation.compile_decode and not cfg.model.device.startswith("cuda") and no_cxx:
        raise ConfigError(
            "generation.compile_decode=true needs a C++ compiler for torch.compile's CPU kernels; none was "
            "found (g++, clang++ or $CXX): install one (apt-get install g++) or leave "
            "generation.compile_decode unset."
        )
    if cfg.train.use_wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "train.use_wandb is on but wandb is not installed: pip install 'grpo[wandb]' "
            "(or drop --use-wandb)."
        )
    if cfg.distributed.profiler == "xplane":
        raise ConfigError(
            "profiler=xplane is JAX/TPU's profiler; use profiler=torch for a torch.profiler "
            "trace, or profiler=none."
        )


def _weight_sync(cfg: ConfigTree) -> None:
    d, steps = cfg.distributed, cfg.train.steps
    if d.weight_sync_steps < 1:
        raise ConfigError(f"weight_sync_steps (inference_rollouts) must be >= 1, got {d.weight_sync_steps}.")
    if steps is not None and d.weight_sync_steps > steps:
        raise ConfigError(
            f"inference_rollouts (distributed.weight_sync_steps) = {d.weight_sync_steps} is more "
            f"than train.steps = {steps}, so the rollout weights would never be updated. Use a "
            f"value between 1 and {steps}."
        )


# -- device roles (docs/scaling.md; distributed/roles.py places them once the device count is known) -------


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _learners(cfg: ConfigTree) -> int:
    d = cfg.distributed
    return len(d.train_device_ids) if d.train_device_ids is not None else d.train_devices


def _shared_devices(cfg: ConfigTree) -> bool:
    """MaxText's fractions at 1.0 and 1.0: trainer and sampler share every device."""
    d = cfg.distributed
    return d.trainer_devices_fraction == 1.0 and d.sampler_devices_fraction == 1.0


def _device_fractions(cfg: ConfigTree) -> None:
    d = cfg.distributed
    if not (0 < d.trainer_devices_fraction <= 1 and 0 < d.sampler_devices_fraction <= 1):
        raise ConfigError("trainer_devices_fraction and sampler_devices_fraction must be in (0, 1].")
    if not _shared_devices(cfg) and d.trainer_devices_fraction + d.sampler_devices_fraction > 1.0 + 1e-9:
        raise ConfigError(
            f"trainer_devices_fraction ({d.trainer_devices_fraction}) + sampler_devices_fraction "
            f"({d.sampler_devices_fraction}) > 1: the two sets would overlap. Use 1.0 and 1.0 to "
            "share every device, or fractions that add up to at most 1."
        )


def _rollout_placement(cfg: ConfigTree) -> None:
    """Rollout on devices of its own needs Ray actors; tensor-parallel replicas are not supported."""
    d = cfg.distributed
    separate = {
        k: v
        for k, v in {
            "inference_replicas": d.inference_replicas,
            "inference_model.num_devices": d.inference_devices,
            "inference_model.devices": d.inference_device_ids,
            "sampler_devices_fraction": None if _shared_devices(cfg) else d.sampler_devices_fraction,
        }.items()
        if v not in (None, 1)
    }
    if separate and d.rollout_mode == "colocated":
        learners = _learners(cfg)
        settings = ", ".join(f"{k}={v}" for k, v in separate.items())
        launch = (
            f" With {learners} learner devices, launch one process per device: `torchrun --nproc_per_node "
            f"{learners} -m grpo train rollout.mode=async ...` (docs/scaling.md)."
            if learners != _world_size()
            else ""
        )
        raise ConfigError(
            f"{settings}: rollout on devices of its own runs in Ray actors; add rollout.mode=sync "
            f"(on-policy) or rollout.mode=async (overlapped with training).{launch}"
        )
    if d.inference_devices_per_replica != 1 or d.ici_tensor_parallelism not in (-1, 1):
        engine = cfg.generation.engine
        how = (
            "vLLM's own setting shards each engine: generation.vllm_tensor_parallel_size=N"
            if engine == "vllm"
            else f"generation.engine={engine} runs each replica on one device; shard sampling with vLLM "
            "(generation.engine=vllm generation.vllm_tensor_parallel_size=N)"
        )
        raise ConfigError(
            "inference_devices_per_replica / ici_tensor_parallelism > 1 ask for tensor-parallel rollout "
            f"replicas, which MaxText's keys cannot set here: {how}, or use more replicas "
            "(inference_replicas=N, or rollout.replicas=N)."
        )


def _learner_devices(cfg: ConfigTree) -> None:
    """One torchrun process per learner device; an FSDP degree is the process count."""
    d, learners, world = cfg.distributed, _learners(cfg), _world_size()
    if d.train_device_ids is not None:
        if len(set(d.train_device_ids)) != len(d.train_device_ids):
            raise ConfigError(f"train_model.devices {d.train_device_ids} lists a device twice.")
        if d.train_devices != 1 and d.train_devices != len(d.train_device_ids):
            raise ConfigError(
                f"train_model.num_devices={d.train_devices} but train_model.devices lists "
                f"{len(d.train_device_ids)}; give one of the two."
            )
    if learners != 1 and learners != world:
        raise ConfigError(
            f"The learner is asked for {learners} devices but runs as {world} process(es): one "
            f"process per learner device. Launch with `torchrun --nproc_per_node {learners} -m grpo "
            "train ...` (or leave train_model.num_devices at 1)."
        )
    fsdp_degree = d.ici_fsdp_parallelism
    if fsdp_degree not in (-1, 1) and (d.strategy != "fsdp2" or fsdp_degree != world):
        raise ConfigError(
            f"ici_fsdp_parallelism={fsdp_degree} means FSDP over that many learner processes: "
            f"set distributed.strategy=fsdp2 and launch `torchrun --nproc_per_node {fsdp_degree} "
            f"-m grpo train ...` (now {world} process(es), strategy {d.strategy})."
        )


def _reference_devices(cfg: ConfigTree) -> None:
    d, learners = cfg.distributed, _learners(cfg)
    if d.ref_devices not in (1, learners):
        raise ConfigError(
            f"ref_model.num_devices={d.ref_devices}: each learner process keeps one reference "
            f"replica, so use 1 or the learner's device count ({learners})."
        )
    if d.ref_device_ids is not None and len(d.ref_device_ids) != learners:
        raise ConfigError(
            f"ref_model.devices {d.ref_device_ids}: give one device per learner process ({learners})."
        )
    if not (d.ref_device in ("auto", "cpu", "offload") or d.ref_device.startswith("cuda")):
        raise ConfigError(f"distributed.ref_device={d.ref_device!r}: use auto, cpu, offload or cuda:N.")


def _ray_settings(cfg: ConfigTree) -> None:
    d = cfg.distributed
    if d.max_staleness < 0 or d.importance_cap < 1 or d.timeout_s <= 0 or d.max_actor_restarts < 0:
        raise ConfigError(
            "max_staleness and max_actor_restarts must be >= 0, importance_cap >= 1 and timeout_s > 0."
        )
    if d.rollout_mode != "colocated":
        # Weights reach the actors every weight_sync_steps steps, so a batch requested just before a push
        # is sampled with weights up to weight_sync_steps old (async adds one step in flight).
        worst = d.weight_sync_steps - (1 if d.rollout_mode == "sync" else 0)
        if d.max_staleness < worst:
            raise ConfigError(
                f"rollout.mode={d.rollout_mode} with weight_sync_steps={d.weight_sync_steps} samples "
                f"with weights up to {worst} step(s) old, but max_staleness={d.max_staleness}: every "
                f"such batch would be dropped. Raise max_staleness to {worst} or lower "
                "weight_sync_steps."
            )
        if importlib.util.find_spec("ray") is None:
            raise ConfigError(
                f"rollout.mode={d.rollout_mode} runs rollout workers on Ray, which is not installed: "
                "pip install 'grpo[ray]'."
            )


def _lora(cfg: ConfigTree) -> None:
    lora = cfg.lora
    if lora.enabled:
        if lora.r < 1 or lora.alpha <= 0 or not 0 <= lora.dropout < 1:
            raise ConfigError(
                f"LoRA needs r >= 1, alpha > 0 and 0 <= dropout < 1; got r={lora.r}, "
                f"alpha={lora.alpha}, dropout={lora.dropout}."
            )
        if importlib.util.find_spec("peft") is None:
            raise ConfigError("lora.enabled needs peft: pip install 'grpo[lora]'.")


# -- values torch or the file system would otherwise reject with a traceback deep inside start-up ----------


def _env(cfg: ConfigTree) -> None:
    e = cfg.env
    if e.max_turns < 1:
        raise ConfigError(f"env.max_turns must be at least 1, got {e.max_turns}.")
    if e.max_tokens is not None and e.max_tokens < 1:
        raise ConfigError(f"env.max_tokens must be at least 1 token (or unset), got {e.max_tokens}.")
    if not 0 < e.tool_timeout_s <= 86400:
        raise ConfigError(f"env.tool_timeout_s must be in (0, 86400] seconds, got {e.tool_timeout_s}.")
    if e.tool_max_chars < 1:
        raise ConfigError(f"env.tool_max_chars must be at least 1, got {e.tool_max_chars}.")
    _agent(e)


def _agent(e) -> None:
    """An agent run's settings, refused before the model loads (each used to fail every episode later, or, for
    an empty command, to train one-turn episodes without the agent)."""
    if e.agent_command is not None:
        try:
            argv = shlex.split(e.agent_command)
        except ValueError as err:
            raise ConfigError(
                f"env.agent_command cannot be split into words ({err}): check its quotes."
            ) from None
        if not argv:
            raise ConfigError(
                "env.agent_command is empty: give the program to run once per episode, e.g. "
                '--agent-command "python my_agent.py" (or leave it unset).'
            )
        program = argv[0]
        if program not in ("python", "python3") and shutil.which(program) is None:
            raise ConfigError(
                f"env.agent_command: cannot find the program {program!r} (not an executable file, nor on "
                "PATH): check its spelling, or give its path."
            )
    if (e.agent or e.agent_command) and (e.tools or e.environment):
        which = "env.tools" if e.tools else "env.environment"
        raise ConfigError(
            f"{which} and an agent (env.agent / env.agent_command) are both set: an agent runs its own tools "
            f"and sends their schemas with its requests, so {which} would not be used. Remove one."
        )
    if not 0 < e.episode_timeout_s <= 86400:
        raise ConfigError(f"env.episode_timeout_s must be in (0, 86400] seconds, got {e.episode_timeout_s}.")
    if e.agent_workers is not None and not 0 <= e.agent_workers <= 1024:
        raise ConfigError(
            f"env.agent_workers must be between 0 (the agents on threads in the trainer) and 1024, got "
            f"{e.agent_workers}; leave it unset for one worker process per core."
        )


def _runtime_values(cfg: ConfigTree) -> None:
    t, o, lo = cfg.train, cfg.optim, cfg.lora
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
    for path in ("train.num_threads", "train.eval_max_new_tokens"):
        value = get_path(cfg, path)
        if value is not None and value < 1:
            raise ConfigError(f"{path} must be at least 1 (or unset for the default), got {value}.")


def _devices_and_names(cfg: ConfigTree) -> None:
    for path in ("model.device", "algorithm.reward_model_device"):
        value = get_path(cfg, path)
        if value is not None and not DEVICE_RE.match(value):
            raise ConfigError(f"{path} = {value!r} is not a device; use auto, cpu, cuda or cuda:N.")
    name = cfg.train.run_name
    if name is not None and (name in ("", ".", "..") or "/" in name or "\\" in name):
        raise ConfigError(
            f"train.run_name = {name!r} must be a plain directory name (no '/', '..'): runs go in "
            "base_output_directory/run_name. To write somewhere else, set train.output_dir."
        )
