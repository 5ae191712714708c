"""Turning a validated config (plus any objects the caller passed) into the parts of a run: RunParts.

Order matters for the user: everything that can fail without a model (run directory, datasets,
reward names) is checked before the first model loads.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from grpo.config import ConfigError, GRPOConfig
from grpo.data import PromptFormatter
from grpo.model.loading import (
    float32_masters,
    load_causal_lm,
    load_policy,
    load_reference,
    load_tokenizer,
    precision_summary,
    prepare_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_path,
)
from grpo.rollout import RolloutEngine
from grpo.rollout.episodes import EpisodeRunner, SingleTurn, build_episodes
from grpo.run.datasets import describe_eval_set, eval_set_name, load_data_and_rewards, planned_steps
from grpo.run.preflight import check_model_paths, plan_resume
from grpo.run.rundir import (
    holds_a_run,
    make_run_dir,
    refuse_users_files,
    remove_failed_start,
    run_dir_of,
    setup_logging,
    write_run_config,
)
from grpo.run.runlock import lock_run_dir
from grpo.run.sizes import check_context, check_memory

# Callers import these from here too (the CLI, tests): run/datasets.py and run/rundir.py are their homes.
__all__ = [
    "RunParts",
    "build_run",
    "cpu_threads",
    "describe_eval_set",
    "eval_set_name",
    "load_data_and_rewards",
    "planned_steps",
    "resolve_path",
    "setup_logging",
]

log = logging.getLogger("grpo")


@dataclass
class RunParts:
    run_dir: Path
    device: torch.device
    policy: Any
    ref_model: Any | None
    tokenizer: Any
    formatter: PromptFormatter
    train_rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]
    reward_funcs: list[Callable]
    reward_weights: list[float] | None
    resume_from: Path | None = None  # a verified checkpoint whose settings match this run's
    compute_dtype: torch.dtype = torch.float32  # model.dtype resolved; trained weights stay float32
    lock: Any = None  # runlock.RunLock on run_dir, held while this run may write there
    episodes: EpisodeRunner = field(default_factory=SingleTurn)  # one turn, or tools / an environment
    # An engine the caller made (tests, embedding); None: the rollout source builds and owns its own.
    engine: RolloutEngine | None = None
    eval_name: str = ""  # the evaluation set in words (logs, closing line)


THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # what torch itself reads at start-up


def cpu_threads(cfg: GRPOConfig, environ) -> tuple[int | None, str]:
    """torch's CPU thread count for the run and where it comes from: train.num_threads when the user set
    it; else the environment's OMP_NUM_THREADS / MKL_NUM_THREADS, which a preset's value must not silently
    override (the tiny_math preset's 2 assumes an idle 2-core machine); else the preset's; else torch's
    own choice (None)."""
    n = cfg.train.num_threads
    if n and "train.num_threads" in cfg.explicit_keys:
        return n, "train.num_threads"
    for name in THREAD_ENV:
        value = environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value), f"{name}={value}" + (
                f"; the preset's train.num_threads = {n} is not used" if n and n != int(value) else ""
            )
    return n, "train.num_threads from the config; OMP_NUM_THREADS or train.num_threads=N changes it"


def build_run(
    cfg: GRPOConfig,
    *,
    model=None,
    ref_model=None,
    reward_model=None,
    tokenizer=None,
    train_dataset=None,
    reward_funcs=None,
    eval_dataset=None,
    rt=None,
    tools=None,
    environment=None,
    rollout_func=None,
) -> RunParts:
    threads, why = cpu_threads(cfg, os.environ)
    if threads:
        cfg.train.num_threads = threads  # what ran, in config.yaml and for Ray's workers
        torch.set_num_threads(threads)
        log.info("CPU threads: %d (%s).", threads, why)
    torch.manual_seed(cfg.train.seed)
    for key, value in (("tokenizer_path", tokenizer), ("name_or_path", model), ("ref_model_path", ref_model)):
        if isinstance(value, str):  # a name or path passed in place of an object
            setattr(cfg.model, key, value)
        elif value is not None:  # an object: config.yaml records where it came from, not the bundled default
            setattr(
                cfg.model, key, getattr(value, "name_or_path", None) or f"<{type(value).__name__} object>"
            )
    created = not run_dir_of(cfg).exists()
    run_dir = make_run_dir(cfg)
    held_a_run = holds_a_run(run_dir)  # looked at before the lock file is created
    refuse_users_files(run_dir, held_a_run)  # before the lock too, which leaves run.lock behind
    # Before anything in run_dir is read or written: a second run on a live directory stops here.
    lock = lock_run_dir(run_dir, rt)
    try:
        parts = _build_parts(
            cfg,
            run_dir,
            model=model,
            ref_model=ref_model,
            reward_model=reward_model,
            tokenizer=tokenizer,
            train_dataset=train_dataset,
            reward_funcs=reward_funcs,
            eval_dataset=eval_dataset,
            is_main=rt is None or rt.is_main,
            tools=tools,
            environment=environment,
            rollout_func=rollout_func,
        )
    except BaseException:
        lock.release()
        if created and (rt is None or rt.is_main):
            remove_failed_start(run_dir)
        raise
    parts.lock = lock
    return parts


def _build_parts(
    cfg: GRPOConfig,
    run_dir: Path,
    *,
    model,
    ref_model,
    reward_model,
    tokenizer,
    train_dataset,
    reward_funcs,
    eval_dataset,
    is_main: bool,
    tools=None,
    environment=None,
    rollout_func=None,
) -> RunParts:
    setup_logging(run_dir)
    # Cheap checks first: paths, the checkpoint to resume from, data and reward names, before any
    # weights are read.
    resume_from = plan_resume(cfg, run_dir, clean_up=is_main)
    if resume_from is not None:  # absolute, like run_dir: a reward's os.chdir must not move it
        resume_from = Path(os.path.abspath(resume_from))
    check_model_paths(
        cfg,
        model_given=model is not None and not isinstance(model, str),
        tokenizer_given=tokenizer is not None and not isinstance(tokenizer, str),
    )
    token = cfg.hf_token()

    train_rows, eval_rows, funcs = load_data_and_rewards(
        cfg, train_dataset, eval_dataset, reward_funcs, reward_model, token
    )
    if is_main:  # rank 0 writes for the group; after the data, which may settle the rewards and eval set
        write_run_config(run_dir, cfg.to_yaml())
    source = "train_dataset" if train_dataset is not None else (cfg.data.hf_path or cfg.data.dataset)
    eval_name = "eval_dataset" if eval_dataset is not None else eval_set_name(cfg, source)
    log.info("Evaluation: %s", describe_eval_set(cfg, eval_name, eval_rows, len(train_rows)))

    device = resolve_device(cfg.model.device)
    compute = resolve_dtype(cfg.model.dtype, device)
    if tokenizer is None or isinstance(tokenizer, str):
        tokenizer = load_tokenizer(cfg)
    else:
        tokenizer = prepare_tokenizer(tokenizer)
    # Prompts and episodes are checked before any weights are read.
    formatter = PromptFormatter(tokenizer, cfg.data)
    formatter.check_lengths(train_rows)
    model_config = _model_config(cfg, model)
    if model_config is not None:  # before any weight is read: positions and memory the run needs
        check_context(cfg, model_config, lambda: formatter.longest(train_rows))
        gpu = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        check_memory(cfg, model_config, torch.finfo(compute).bits // 8, gpu)
    episodes = build_episodes(cfg, formatter, tools=tools, environment=environment, rollout_func=rollout_func)
    episodes.check_prompts(train_rows)
    policy = _policy(cfg, model, device, compute)
    ref = _reference(cfg, ref_model, model, policy, device, compute)

    reward_spec = reward_model if reward_model is not None else cfg.algorithm.reward_model
    if reward_spec is not None:
        funcs.append(
            _model_reward(
                reward_spec,
                tokenizer,
                cfg,
                resolve_device(cfg.algorithm.reward_model_device or cfg.model.device),
            )
        )
    if not funcs and not (tools or environment or cfg.env.environment):
        raise ConfigError(
            "No reward: pass reward_funcs=[...] or reward_model=..., or set algorithm.reward_funcs."
        )
    weights = cfg.algorithm.reward_weights
    if weights is not None and len(weights) != len(funcs):
        raise ConfigError(f"algorithm.reward_weights has {len(weights)} entries for {len(funcs)} rewards.")
    if not funcs and not episodes.reward_names:  # environments that score add reward/<ClassName> columns
        raise ConfigError(
            "No reward: the environment gives none (no reward() method, no step rewards); pass reward_funcs="
            "[...] or set algorithm.reward_funcs."
        )
    n_params = sum(p.numel() for p in policy.parameters())
    log.info("Run directory: %s", run_dir)
    log.info(
        "Policy: %s (%.2fM parameters, %s, %s); reference: %s; rewards: %s",
        getattr(policy.config, "_name_or_path", "?"),
        n_params / 1e6,
        next(policy.parameters()).dtype,
        device,
        "none (beta = 0)"
        if ref is None
        else "the base weights, adapters off"
        if cfg.lora.enabled
        else f"frozen copy ({cfg.distributed.ref_device})",
        ", ".join([*(getattr(f, "__name__", type(f).__name__) for f in funcs), *episodes.reward_names]),
    )
    ref_dtype = None if ref is None else next(ref.parameters()).dtype
    log.info(precision_summary(compute, ref_dtype, cfg.train.save_dtype, cfg.distributed.strategy == "fsdp2"))
    return RunParts(
        run_dir,
        device,
        policy,
        ref,
        tokenizer,
        formatter,
        train_rows,
        eval_rows,
        funcs,
        weights,
        resume_from,
        compute,
        episodes=episodes,
        eval_name=eval_name,
    )


def _model_config(cfg: GRPOConfig, model):
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


def _policy(cfg: GRPOConfig, model, device: torch.device, compute: torch.dtype):
    """The trained model, float32 masters (loaded from cfg.model unless a module is given), with LoRA
    adapters when enabled."""
    if model is None or isinstance(model, str):
        policy = load_policy(cfg, device)
    else:
        policy = float32_masters(model.to(device).train())
    if cfg.lora.enabled:
        from grpo.model.lora import apply_lora

        policy = apply_lora(policy, cfg.lora)
        if compute != torch.float32:  # the frozen base is never stepped: hold it in the compute dtype
            for param in policy.parameters():
                if not param.requires_grad and param.is_floating_point():
                    param.data = param.data.to(compute)
    return policy


def _reference(cfg: GRPOConfig, ref_model, model, policy, device: torch.device, compute: torch.dtype):
    """The frozen reference of the KL term, on its configured device; None without one (beta = 0)."""
    if cfg.algorithm.beta <= 0:
        if ref_model is not None:
            log.info("algorithm.beta = 0: the reference model is not used (no KL term).")
        return None
    if cfg.lora.enabled:  # the base weights with the adapters off: no second copy
        from grpo.model.lora import ReferenceWithoutAdapters

        return ReferenceWithoutAdapters(policy)
    if ref_model is None or isinstance(ref_model, str):
        ref = load_reference(cfg, device) if (ref_model or model is None) else _frozen_copy(policy, compute)
    else:
        ref = ref_model.to(device=device, dtype=compute).eval().requires_grad_(False)
    from grpo.distributed.roles import place_reference

    return place_reference(ref, cfg.distributed.ref_device, device)


def _frozen_copy(policy, dtype: torch.dtype):
    import copy

    return copy.deepcopy(policy).to(dtype).eval().requires_grad_(False)


def _model_reward(spec, tokenizer, cfg: GRPOConfig, device):
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


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # tokenizers' fork warning in DataLoader-free runs
