"""The run directory: where it is, making and probing it, refusing to replace the user's files, config.yaml,
the log file, and removing what a failed start left behind."""

from __future__ import annotations

import logging
import os
import shutil
import sys
from datetime import datetime
from pathlib import Path

from grpo.config import ConfigError, GRPOConfig
from grpo.files import LogFileHandler, open_fd, write_text
from grpo.redact import RedactingFilter
from grpo.run.console import StderrHandler, take_startup_log
from grpo.run.runlock import LOCK_FILE


def decide_run_name(cfg: GRPOConfig) -> str | None:
    """train.run_name, a timestamp when unset; None when train.output_dir names the directory itself."""
    if cfg.train.output_dir:
        return None
    return cfg.train.run_name or datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


def run_dir_of(cfg: GRPOConfig) -> Path:
    """train.output_dir, else base_output_directory/run_name (a config whose run name is decided)."""
    t = cfg.train
    if t.output_dir:
        return Path(t.output_dir)
    return Path(t.base_output_directory) / (t.run_name or decide_run_name(cfg))


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
    import transformers

    # Our own progress bar and log lines say what is happening; the libraries' per-file bars are noise.
    # `datasets` is imported only where a dataset is read through it (data/sources.py): a run on bundled
    # or JSON data needs none installed. It reads this variable when it is imported.
    if (datasets := sys.modules.get("datasets")) is not None:
        datasets.disable_progress_bars()
    else:
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
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
        for record in take_startup_log():  # what the console showed before the run directory was known
            handler.handle(record)


STARTUP_FILES = frozenset({RUN_CONFIG, "train.log", LOCK_FILE})  # all a start writes before training


def remove_failed_start(run_dir: Path) -> None:
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
