"""Turning a validated config (plus any objects the caller passed) into the parts of a run.

Order matters for the user: everything that can fail without a model (run directory, datasets,
reward names) is checked before the first model loads.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from grpo.config import EVAL_HOLDOUT, ConfigError, GRPOConfig
from grpo.data import PromptFormatter, load_rows, rows_from_dataset
from grpo.data.sources import split_holdout
from grpo.data.tasks import missing_reward_columns, reserved_column_message, scorer_for_rows, task_of_rows
from grpo.files import LogFileHandler, open_fd, write_text
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
from grpo.redact import RedactingFilter
from grpo.rewards import resolve_rewards
from grpo.rollout import RolloutEngine
from grpo.rollout.episodes import EpisodeRunner, SingleTurn, build_episodes
from grpo.run.console import StderrHandler
from grpo.run.preflight import check_model_paths, plan_resume
from grpo.run.runlock import LOCK_FILE, lock_run_dir
from grpo.run.sizes import check_context, check_memory

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


def run_dir_of(cfg: GRPOConfig) -> Path:
    """train.output_dir, else base_output_directory/run_name (run_name: a timestamp unless given)."""
    t = cfg.train
    if t.output_dir:
        return Path(t.output_dir)
    t.run_name = t.run_name or datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    return Path(t.base_output_directory) / t.run_name


def make_run_dir(cfg: GRPOConfig) -> Path:
    # Absolute from here on: a reward that calls os.chdir must not lose the run directory.
    run_dir = Path(os.path.abspath(run_dir_of(cfg)))
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"Output directory {run_dir} exists and is a file; pass another --output-dir.")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write_test.{os.getpid()}"  # one per process: torchrun ranks share run_dir
        os.close(open_fd(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"Cannot write to output directory {run_dir}: {e.strerror}. Pass a writable --output-dir."
        ) from e
    return run_dir


RUN_CONFIG = "config.yaml"
RUN_CONFIG_HEADER = "# Written by grpo train: the resolved config of this run (secrets redacted)\n"


# What a run replaces or truncates in its directory (besides config.yaml, checked on its own): in a
# directory that held no grpo run before, a file or folder by one of these names is the user's.
REPLACED_NAMES = ("metrics.jsonl", "samples.jsonl", "report", "final_model", "best_model", "profile")


def holds_a_run(run_dir: Path) -> bool:
    """Whether grpo has run in this directory before (its lock file, or a checkpoint, is there)."""
    return (run_dir / "run.lock").exists() or any(run_dir.glob("checkpoint-*"))


def refuse_users_files(run_dir: Path, held_a_run: bool) -> None:
    """A start must not replace the user's files with its own (`--config config.yaml --output-dir .` in a
    project folder): a config.yaml grpo did not write (no header line, and no run there before), and in a
    directory that held no run, a metrics.jsonl, report/, final_model/ ... are refused by name."""
    config = run_dir / RUN_CONFIG
    if config.is_file() and not config.is_symlink() and not _ours(config, held_a_run):
        raise ConfigError(
            f"{config} is not a config grpo wrote (your own file?), and grpo train writes the run's resolved "
            "config there. Pass another --output-dir (e.g. --output-dir runs/exp1), or move the file."
        )
    if held_a_run:
        return
    theirs = [name for name in REPLACED_NAMES if os.path.lexists(run_dir / name)]
    if theirs:
        raise ConfigError(
            f"{run_dir} holds {', '.join(theirs)}, which grpo did not write (no grpo run was started there), "
            "and a run would replace them with its own. Pass another --output-dir (e.g. --output-dir "
            "runs/exp1), or move them."
        )


def write_run_config(run_dir: Path, config_yaml: str) -> None:
    """RUN_DIR/config.yaml (a user's own config.yaml there was refused by `refuse_users_files`)."""
    write_text(run_dir / RUN_CONFIG, RUN_CONFIG_HEADER + config_yaml)


def _ours(path: Path, held_a_run: bool) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.readline() == RUN_CONFIG_HEADER.encode() or held_a_run
    except OSError:
        return False


def setup_logging(run_dir: Path | None = None) -> None:
    import datasets
    import transformers

    # Our own progress bar and log lines say what is happening; the libraries' per-file bars are noise.
    datasets.disable_progress_bars()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logger = logging.getLogger("grpo")
    # torchrun starts one process per device; rank 0 speaks for the job, the others only warn.
    logger.setLevel(logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING)
    logger.propagate = False
    if not any(
        isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
        for h in logger.handlers
    ):
        console = StderrHandler()
        console.setFormatter(logging.Formatter("%(message)s"))
        console.addFilter(RedactingFilter())
        logger.addHandler(console)
    if run_dir is not None:
        path = os.path.abspath(
            run_dir / "train.log"
        )  # not resolve(): a planted link is refused, not followed
        for h in [h for h in logger.handlers if isinstance(h, logging.FileHandler)]:
            logger.removeHandler(h)
            h.close()
        handler = LogFileHandler(path, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        handler.addFilter(RedactingFilter())
        logger.addHandler(handler)


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
            _remove_failed_start(run_dir)
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


STARTUP_FILES = frozenset({RUN_CONFIG, "train.log", LOCK_FILE})  # all a start writes before training


def _remove_failed_start(run_dir: Path) -> None:
    """A start that failed before training (bad data, a missing model) leaves no run directory behind when
    it created it: an empty timestamped directory would only be mistaken for a run. Anything else in it
    (a file another process put there) keeps it."""
    logger = logging.getLogger("grpo")
    for handler in [h for h in logger.handlers if isinstance(h, logging.FileHandler)]:
        if Path(handler.baseFilename).parent == run_dir.resolve():
            logger.removeHandler(handler)
            handler.close()
    if run_dir.is_dir() and all(p.name in STARTUP_FILES for p in run_dir.iterdir()):
        shutil.rmtree(run_dir, ignore_errors=True)


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


def load_data_and_rewards(
    cfg: GRPOConfig, train_dataset=None, eval_dataset=None, reward_funcs=None, reward_model=None, token=None
) -> tuple[list[dict], list[dict], list[Callable]]:
    """Training rows, evaluation rows and the reward functions, checked against each other: every column a
    reward needs is in the data. Needs no model, so a bad combination stops the run before one loads."""
    source = "train_dataset" if train_dataset is not None else (cfg.data.hf_path or cfg.data.dataset)
    train_rows = (
        rows_from_dataset(train_dataset, cfg.data.skip_invalid_rows)
        if train_dataset is not None
        else load_rows(cfg.data.hf_path or cfg.data.dataset, cfg.data, token=token)
    )
    has_model = reward_model is not None or cfg.algorithm.reward_model is not None
    chosen = reward_funcs is not None or "algorithm.reward_funcs" in cfg.explicit_keys
    try:
        funcs = resolve_rewards(
            reward_funcs
            if reward_funcs is not None
            else ([] if reward_model is not None else cfg.algorithm.reward_funcs)
        )
    except (ValueError, ImportError, TypeError) as e:  # an unknown name or a bad import path: say which
        raise ConfigError(f"algorithm.reward_funcs: {e}") from e
    columns = set(train_rows[0]) if train_rows else set()
    clash = reserved_column_message(source, {k for row in train_rows for k in row})
    if clash:
        raise ConfigError(clash)
    missing = missing_reward_columns(funcs, columns)
    task = task_of_rows(train_rows)
    if missing and task is not None and not chosen:
        # A local copy of a task's data (an IFEval .jsonl) is scored the way the task is.
        log.info(
            "%s has %s's columns (%s): rewards %s (set algorithm.reward_funcs to choose others).",
            source,
            task.name,
            ", ".join(task.columns),
            ", ".join(task.reward_funcs),
        )
        funcs = resolve_rewards(list(task.reward_funcs))
        cfg.algorithm.reward_funcs = list(task.reward_funcs)
        cfg.algorithm.reward_weights = list(task.reward_weights) if task.reward_weights else None
        if (
            train_dataset is None
            and "data.eval_dataset" not in cfg.explicit_keys
            and cfg.data.eval_dataset not in (None, EVAL_HOLDOUT)
        ):
            cfg.data.eval_dataset = source  # as the task's own preset does: IFEval evaluates on its prompts
        missing = missing_reward_columns(funcs, columns)
    if missing:
        raise ConfigError(_missing_columns_message(source, missing, columns, has_model))
    if _holds_out(cfg, train_dataset, eval_dataset, train_rows):
        train_rows, held_out = split_holdout(train_rows)
        return train_rows, _scorable(cfg, held_out, f"the held-out slice of {source}"), funcs
    return train_rows, _eval_rows(cfg, eval_dataset, token), funcs


def _evaluates(cfg: GRPOConfig) -> bool:
    t = cfg.train
    return bool(t.eval_before or t.eval_after or t.eval_steps)


def _holds_out(cfg: GRPOConfig, train_dataset, eval_dataset, train_rows: list[dict]) -> bool:
    """Whether evaluation runs on a held-out slice of the training rows: data.eval_dataset = holdout, or a
    train_dataset object given without an evaluation set while evaluation is on (the built-in default
    set, tiny_math's problems, would say nothing about it). A slice chosen for the user (not set by them)
    that cannot be scored (no answer column) turns evaluation off instead, said in the log."""
    if eval_dataset is not None or not _evaluates(cfg):
        return False
    chosen = "data.eval_dataset" in cfg.explicit_keys
    if train_dataset is not None and not chosen and cfg.data.eval_dataset:
        cfg.data.eval_dataset = EVAL_HOLDOUT
    if cfg.data.eval_dataset != EVAL_HOLDOUT:
        return False
    try:
        scorer_for_rows(train_rows)
    except ValueError as e:
        if chosen:
            raise ConfigError(f"data.eval_dataset = holdout: {e}") from e
        log.warning(
            "No evaluation: the training data cannot be scored as held-out accuracy (%s) Set "
            "data.eval_dataset to an evaluation set to have one.",
            e,
        )
        cfg.data.eval_dataset = None
        return False
    return True


def eval_set_name(cfg: GRPOConfig, train_source: str) -> str:
    """data.eval_dataset in words: its spec, or which training data a held-out slice comes from."""
    spec = cfg.data.eval_dataset
    return f"the held-out slice of {train_source}" if spec == EVAL_HOLDOUT else spec or "eval_dataset"


def describe_eval_set(cfg: GRPOConfig, name: str, eval_rows: list[dict], train_rows: int) -> str:
    """The evaluation set, its size and schedule, for the start-up log ('Evaluation: ...')."""
    t = cfg.train
    if not eval_rows:
        return "none (data.eval_dataset is unset or evaluation is off)"
    during = 0 < t.eval_steps < planned_steps(cfg, train_rows)
    when = [w for w, on in (("before", t.eval_before), (f"every {t.eval_steps} steps", during),
                            ("after training", t.eval_after)) if on]  # fmt: skip
    size = f"{len(eval_rows)} rows" + (
        f", not trained on; {train_rows} rows left to train on"
        if cfg.data.eval_dataset == EVAL_HOLDOUT
        else ""
    )
    return f"{name} ({size}), greedy pass@1, {', '.join(when)}"


def _missing_columns_message(
    source: str, missing: dict[str, list[str]], columns: set[str], has_model: bool
) -> str:
    needs = "; ".join(
        f"the reward {name} needs the column{'s' * (len(cols) > 1)} {', '.join(map(repr, cols))}"
        for name, cols in missing.items()
    )
    first = next(iter(missing.values()))[0]
    return (
        f"The dataset ({source}) has no {first!r} column: {needs} (the dataset has "
        f"{', '.join(sorted(columns))}). Add the column (SimplePromptDataset(prompts, {first}=[...]), or the "
        f"field {first!r} in every row; "
        f"data.answer_field names another column as the answer), "
        + (
            "or drop the rewards that need it (reward_funcs=[] keeps the reward model alone)."
            if has_model
            else "or score with a reward model (reward_model=... / --reward-model PATH) or rewards that need "
            f"no {first!r} (reward_funcs=[...], --reward-funcs NAME)."
        )
    )


def planned_steps(cfg: GRPOConfig, num_rows: int) -> int:
    """Optimizer steps of the run: train.steps, else num_epochs passes over num_rows prompts."""
    t = cfg.train
    steps = t.steps or max(1, round(t.num_epochs * -(-num_rows // t.prompts_per_step)))
    if cfg.distributed.weight_sync_steps > steps:
        raise ConfigError(
            f"inference_rollouts (distributed.weight_sync_steps) = {cfg.distributed.weight_sync_steps}"
            f" is more than the run's {steps} steps, so the rollout weights would never be updated."
            f" Use a value between 1 and {steps}."
        )
    return steps


def _eval_rows(cfg: GRPOConfig, eval_dataset, token) -> list[dict[str, Any]]:
    spec = cfg.data.eval_dataset
    if eval_dataset is not None:
        return _scorable(cfg, rows_from_dataset(eval_dataset, split="test"), "eval_dataset")
    if not spec or not _evaluates(cfg):
        return []
    try:
        rows = load_rows(spec, cfg.data, split="test", token=token)
    except ConfigError as e:  # say that it is the evaluation set, not the training data, that failed
        raise ConfigError(
            f"Could not load the evaluation set data.eval_dataset = {spec}: {str(e).rstrip('.')}. Set "
            "data.eval_dataset to "
            "another set, to 'holdout' (a slice of the training data), or to none (no evaluation)."
        ) from e
    return _scorable(cfg, rows, f"data.eval_dataset = {spec}")


def _scorable(cfg: GRPOConfig, rows: list[dict[str, Any]], what: str) -> list[dict[str, Any]]:
    try:
        if rows:
            scorer_for_rows(rows)  # found out now, not after the first training steps
    except ValueError as e:
        raise ConfigError(f"The evaluation set ({what}) cannot be scored: {e}") from e
    return rows[: cfg.data.eval_max_samples] if cfg.data.eval_max_samples else rows


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
