"""Checks that run before any model is loaded: local model/tokenizer paths, and whether (and from where)
to resume, including whether the checkpoint's settings match this run's.

Each failure is a ConfigError that says what is wrong and how to fix it; docs/reliability.md lists
them all with the test that covers each.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from grpo.checkpoint.store import (
    CHECKPOINT_RE,
    find_resume_dir,
    list_checkpoints,
    read_saved_config,
    remove_partial_saves,
)
from grpo.config import BUNDLED_MODEL, BUNDLED_MODELS, ConfigError, GRPOConfig
from grpo.config.yaml_limits import load_yaml
from grpo.run.console import from_cli

log = logging.getLogger("grpo")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")

# Settings that may change between a checkpoint and its resume without changing what is trained:
# where things go, how often they are logged/saved/evaluated/reported, memory and speed knobs
# (micro-batching is loss-invariant), and the run length (extending a finished run is the usual reason
# to resume). Everything else is frozen unless train.allow_config_change=true, which then takes effect.
RESUME_SAFE_KEYS = frozenset(
    {
        "model.hf_token",
        "model.device",
        "model.gradient_checkpointing",
        "model.compile_training",
        "data.eval_dataset",
        "data.eval_max_samples",
        "generation.batch_size",
        "train.steps",
        "train.num_epochs",
        "train.micro_batch_size",
        "train.gradient_accumulation_steps",
        "train.micro_batch_tokens",
        "train.activation_memory_gb",
        "train.output_dir",
        "train.base_output_directory",
        "train.run_name",
        "train.logging_steps",
        "train.save_steps",
        "train.save_total_limit",
        "train.save_dtype",
        "train.resume",
        "train.allow_config_change",
        "train.stop_after_nonfinite_steps",
        "train.eval_before",
        "train.eval_after",
        "train.eval_steps",
        "train.eval_batch_size",
        "train.eval_max_new_tokens",
        "train.use_wandb",
        "train.wandb_project",
        "train.wandb_run_name",
        "train.tensorboard",
        "train.progress_bar",
        "train.num_threads",
        "distributed.profiler",
        # what is reported, kept or exported, and how rewards are guarded: nothing trained changes
        "train.report",
        "train.log_samples",
        "train.metric_for_best_model",
        "train.greater_is_better",
        "lora.save_merged",
        "generation.vllm_gpu_memory_utilization",
        "generation.vllm_kv_cache_gb",
        "algorithm.reward_timeout",
        "algorithm.reward_isolation",
        "distributed.timeout_s",
        "distributed.max_actor_restarts",
    }
)


def check_model_paths(cfg: GRPOConfig, *, model_given: bool, tokenizer_given: bool) -> None:
    """Every local model/tokenizer directory the config names exists, is readable, holds safetensors
    weights and needs no repository code unless model.trust_remote_code is on."""
    m = cfg.model
    models = {} if model_given else {"model.name_or_path": m.load_parameters_path or m.name_or_path}
    if m.ref_model_path and cfg.algorithm.beta > 0:
        models["model.ref_model_path"] = m.ref_model_path
    if cfg.algorithm.reward_model:
        models["algorithm.reward_model"] = cfg.algorithm.reward_model
    if m.load_parameters_path and not model_given:
        models["model.load_parameters_path"] = models.pop("model.name_or_path")
    for key, spec in models.items():
        path = _local_dir(key, spec)
        if path is not None:
            _check_model_dir(key, path, cfg.model.trust_remote_code)
    if not tokenizer_given:
        key = "model.tokenizer_path" if m.tokenizer_path else "model.name_or_path"
        path = _local_dir(key, m.tokenizer_path or m.name_or_path)
        if path is not None and not any((path / f).is_file() for f in TOKENIZER_FILES):
            raise ConfigError(
                f"{key} = {path}: no tokenizer files there (looked for {', '.join(TOKENIZER_FILES)}). "
                "Point model.tokenizer_path at a directory saved with tokenizer.save_pretrained."
            )


def _local_dir(key: str, spec: str) -> Path | None:
    """The directory `spec` names, or None for the bundled model and hub ids."""
    if spec in BUNDLED_MODELS:
        return None
    if "://" in spec:
        raise ConfigError(
            f"{key} = {spec}: cloud storage paths are not supported; copy the checkpoint locally "
            "(e.g. gsutil -m cp -r / aws s3 cp --recursive) and pass its directory."
        )
    path = Path(spec).expanduser()
    if not (_looks_local(spec) or path.exists()):
        return None  # a hub id (org/name): checked when it is downloaded
    if not path.exists():
        raise ConfigError(
            f"{key} = {spec}: no such file or directory. Pass a hub id (org/name), a directory "
            f"saved with save_pretrained, or '{BUNDLED_MODEL}'."
        )
    if not path.is_dir():
        raise ConfigError(
            f"{key} = {spec} is a file; pass the directory that holds config.json and the weights."
        )
    if not os.access(path, os.R_OK | os.X_OK):
        raise ConfigError(
            f"{key} = {spec} cannot be read (permission denied); fix its permissions or copy it."
        )
    return path


def _looks_local(spec: str) -> bool:
    """A path, not a hub id: hub ids are `name` or `org/name`, never `a/b/c`, and never named like our own
    output directories (a `checkpoint-6` pruned a moment ago is a missing directory, not a repo)."""
    name = spec.rstrip("/").rpartition("/")[2]
    return (
        spec.startswith((".", "/", "~"))
        or spec.count("/") >= 2
        or spec.endswith("/")
        or "\\" in spec
        or CHECKPOINT_RE.match(name) is not None
        or name in ("final_model", "best_model")
    )


def _check_model_dir(key: str, path: Path, trust_remote_code: bool) -> None:
    config = path / "config.json"
    if not config.is_file():
        raise ConfigError(f"{key} = {path} has no config.json, so it is not a saved model directory.")
    if not any(path.glob("*.safetensors")):
        pickles = sorted(p.name for pattern in PICKLE_WEIGHTS for p in path.glob(pattern))
        found = f"only {', '.join(pickles)}" if pickles else "no weight files"
        raise ConfigError(
            f"{key} = {path} has {found}: grpo loads weights from .safetensors files only, because "
            "a pickled checkpoint can run code when it is opened. If you trust the file, convert it "
            "once with AutoModelForCausalLM.from_pretrained(dir).save_pretrained(new_dir)."
        )
    try:
        settings = json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{key}: {config} is not valid JSON ({e}).") from e
    if not isinstance(settings, dict):
        raise ConfigError(
            f"{key}: {config} holds a JSON {type(settings).__name__}, not the object of settings "
            "save_pretrained writes; the directory is not a saved model."
        )
    auto_map = settings.get("auto_map")
    if auto_map and not trust_remote_code:
        raise ConfigError(
            f"{key} = {path} needs its own Python code to load (auto_map in config.json). Set "
            "model.trust_remote_code=true only if you trust that code."
        )


def plan_resume(cfg: GRPOConfig, run_dir: Path, clean_up: bool = True) -> Path | None:
    """The checkpoint this run continues from (verified, settings compatible), or None for a fresh start.
    `clean_up`: remove what an interrupted save left (rank 0 only: the others must not write)."""
    removed = remove_partial_saves(run_dir) if clean_up else []
    if removed:
        log.info("Removed %s, left by a save that was interrupted.", ", ".join(removed))
    if not cfg.train.resume:
        existing = list_checkpoints(run_dir)
        if existing and from_cli():  # Python asks at train(): trainer.train(resume_from_checkpoint=...)
            raise ConfigError(
                f"{run_dir} already holds a run ({', '.join(p.name for _, p in existing[-3:])}). "
                "Pass --resume latest to continue it, or another --output-dir to start afresh."
            )
        return None
    path = find_resume_dir(run_dir, cfg.train.resume)
    if path is None:
        return None
    saved = read_saved_config(path)
    differences = config_differences(load_yaml(saved, f"{path}/config.yaml") if saved else {}, cfg.to_dict())
    if differences and not cfg.train.allow_config_change:
        raise ConfigError(
            f"Cannot resume from {path}: these settings differ from the checkpoint's "
            f"({path / 'config.yaml'}): {'; '.join(differences)}. Resume with the checkpoint's "
            "values, start a new run in another --output-dir, or set "
            "train.allow_config_change=true to resume with the new values anyway."
        )
    if differences:
        log.warning("Resuming with settings that differ from the checkpoint's: %s.", "; ".join(differences))
    newer = [p.name for step, p in list_checkpoints(run_dir) if step > _step(path)]
    if newer:
        log.warning(
            "Resuming from %s although newer checkpoints exist (%s); they will be replaced as the "
            "run reaches their steps.",
            path.name,
            ", ".join(newer),
        )
    return path


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'section.key: saved → current' for every trajectory-changing setting that differs."""
    out = []
    for section, values in current.items():
        for key, value in values.items():
            path = f"{section}.{key}"
            old = (saved.get(section) or {}).get(key, value)
            if path not in RESUME_SAFE_KEYS and old != value:
                out.append(f"{path}: {old!r} → {value!r}")
    return out


def _step(path: Path) -> int:
    m = CHECKPOINT_RE.match(path.name)
    return int(m.group(1)) if m else 2**62  # final_model: the end of its run, no checkpoint is newer
