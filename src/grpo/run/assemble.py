"""Turning a validated config (plus any objects the caller passed) into the parts of a run: RunParts.

Order matters for the user: everything that can fail without a model (run directory, datasets,
reward names) is checked before the first model loads.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from grpo.config import ConfigError, GRPOConfig
from grpo.config.settings import RunSettings, is_multi_turn
from grpo.data import PromptFormatter, rows_from_dataset
from grpo.model.loading import (
    float32_masters,
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
from grpo.run import provenance
from grpo.run.datasets import describe_eval_set, eval_set_name, load_data_and_rewards, planned_steps
from grpo.run.models import frozen_copy, model_config_of, model_reward
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
from grpo.run.sizes import check_context, check_memory, model_context
from grpo.run.startup import cpu_threads, start_decisions

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
    settings: RunSettings | None = None  # what the start decided (config/settings.py); the run reads it


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
    agent=None,
    decided: Mapping[str, Any] | None = None,
) -> RunParts:
    """The parts of a run from the validated `cfg`, which is only read: its start-up decisions are in
    `RunParts.settings` (config/settings.py). `decided`: decisions made before assembly (the device plan's
    shared Ray cluster, `RolePlan.decisions()`)."""
    given = {"data.dataset": train_dataset, "data.eval_dataset": eval_dataset, "env.tools": tools or None,
             "algorithm.reward_funcs": reward_funcs, "algorithm.reward_model": reward_model,
             "env.environment": environment, "model.name_or_path": model}  # fmt: skip
    provenance.refuse_unrebuildable(cfg, given)  # a CLI --resume of a run built in Python
    decided = {
        **(decided or {}),
        **start_decisions(cfg, os.environ, model=model, tokenizer=tokenizer, ref_model=ref_model),
    }
    skip = cfg.data.skip_invalid_rows
    decided |= provenance.record_objects(
        train_rows=None if train_dataset is None else rows_from_dataset(train_dataset, skip),
        eval_rows=None if eval_dataset is None else rows_from_dataset(eval_dataset, split="test"),
        reward_funcs=reward_funcs, reward_model=reward_model, tools=tools, environment=environment,
    )  # fmt: skip
    early = RunSettings.resolve(cfg, decided, is_multi_turn(cfg, tools, environment, agent))
    threads, why = cpu_threads(cfg, os.environ)
    if threads:
        torch.set_num_threads(threads)
        log.info("CPU threads: %d (%s).", threads, why)
    torch.manual_seed(cfg.train.seed)
    created = not run_dir_of(early.config).exists()
    run_dir = make_run_dir(early.config)
    held_a_run = holds_a_run(run_dir)  # looked at before the lock file is created
    refuse_users_files(run_dir, held_a_run)  # before the lock too, which leaves run.lock behind
    # Before anything in run_dir is read or written: a second run on a live directory stops here.
    lock = lock_run_dir(run_dir, rt)
    try:
        parts = _build_parts(
            early,
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
            agent=agent,
        )
    except BaseException:
        lock.release()
        if created and (rt is None or rt.is_main):
            remove_failed_start(run_dir)
        raise
    parts.lock = lock
    return parts


def _build_parts(
    early: RunSettings,
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
    agent=None,
) -> RunParts:
    setup_logging(run_dir)
    # Cheap checks first: paths, the checkpoint to resume from, data and reward names, before any
    # weights are read.
    cfg = early.config
    resume_from = plan_resume(cfg, run_dir, clean_up=is_main)
    if resume_from is not None:  # absolute, like run_dir: a reward's os.chdir must not move it
        resume_from = Path(os.path.abspath(resume_from))
    check_model_paths(
        cfg,
        model_given=model is not None and not isinstance(model, str),
        tokenizer_given=tokenizer is not None and not isinstance(tokenizer, str),
    )
    data = load_data_and_rewards(cfg, train_dataset, eval_dataset, reward_funcs, reward_model, cfg.hf_token())
    settings = early.extend(data.decided)  # resolved: from here on the run reads settings.config
    cfg, train_rows, eval_rows, funcs = settings.config, data.train_rows, data.eval_rows, data.reward_funcs
    if is_main:  # rank 0 writes for the group; after the data, which may settle the rewards and eval set
        write_run_config(run_dir, settings.to_yaml())
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
    model_config = model_config_of(cfg, model)
    if model_config is not None:  # before any weight is read: positions and memory the run needs
        settings = dataclasses.replace(settings, model_context=model_context(model_config))
        fitted = check_context(settings, model_config, lambda: formatter.longest(train_rows))
        if fitted:  # config.yaml shows the budget the run uses
            settings = settings.extend(fitted)
            cfg = settings.config
            if is_main:
                write_run_config(run_dir, settings.to_yaml())
        gpu = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        check_memory(settings, model_config, torch.finfo(compute).bits // 8, gpu)
    episodes = build_episodes(
        cfg, formatter, tools=tools, environment=environment, rollout_func=rollout_func, agent=agent,
        max_tokens=settings.completion_limit,
    )  # fmt: skip
    episodes.check_prompts(train_rows)
    policy = _policy(cfg, model, device, compute)
    ref = _reference(cfg, ref_model, model, policy, device, compute)

    reward_spec = reward_model if reward_model is not None else cfg.algorithm.reward_model
    if reward_spec is not None:
        funcs.append(
            model_reward(
                reward_spec,
                tokenizer,
                cfg,
                resolve_device(cfg.algorithm.reward_model_device or cfg.model.device),
            )
        )
    agents = agent or cfg.env.agent or cfg.env.agent_command  # an agent may give its episodes' rewards
    if not funcs and not (tools or environment or cfg.env.environment or agents):
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
    # What Runtime.sharded will say: one process shards nothing, whatever the strategy.
    sharded = cfg.distributed.strategy == "fsdp2" and int(os.environ.get("WORLD_SIZE", "1")) > 1
    log.info(precision_summary(compute, ref_dtype, cfg.train.save_dtype, sharded))
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
        settings=settings,
    )


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
        ref = load_reference(cfg, device) if (ref_model or model is None) else frozen_copy(policy, compute)
    else:
        ref = ref_model.to(device=device, dtype=compute).eval().requires_grad_(False)
    from grpo.distributed.roles import place_reference

    return place_reference(ref, cfg.distributed.ref_device, device)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # tokenizers' fork warning in DataLoader-free runs
