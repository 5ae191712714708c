"""The side rooms of a training run, kept out of the loop: resume, checkpoints, the best and final
models, stop signals, and what to say when a run stops early or fails.

Stopping: the first SIGINT/SIGTERM finishes the current step, saves a checkpoint and says how to
resume; a second one stops at once. `train.stop_after_nonfinite_steps` NaN/inf steps in a row also
save and stop (docs/reliability.md).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from grpo.checkpoint.policy import load_policy_weights, save_policy_dir
from grpo.checkpoint.store import (
    link_model_dir,
    list_checkpoints,
    load_training_state,
    prune_checkpoints,
    rng_state,
    save_model_dir,
    seed_everything,
    set_rng_state,
)
from grpo.config import ConfigError, GRPOConfig
from grpo.config.errors import clause
from grpo.config.settings import RunSettings
from grpo.data import PromptStream
from grpo.distributed.runtime import Runtime
from grpo.files import write_text
from grpo.ranges import check_range
from grpo.rewards.isolation import clear_stop, request_stop
from grpo.run.assemble import RunParts
from grpo.run.console import result_line, resume_hint
from grpo.run.preflight import plan_resume

log = logging.getLogger("grpo")

SAVE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}  # train.save_dtype; float32: as trained


class TrainingHalted(RuntimeError):
    """Training stopped itself (after saving a checkpoint) because it could not go on; the message says
    why."""


class TrainingStopped(KeyboardInterrupt):
    """A stop signal (Ctrl-C, SIGTERM) ended train() early, after saving a checkpoint: raised as TRL's
    trainer lets KeyboardInterrupt through, so the code after `trainer.train()` (save, evaluate, push) does
    not run as if training had finished. `signal`, `step`, `checkpoint` say where it stopped; `summary` is
    what train() would have returned."""

    def __init__(self, message: str, signal: int, step: int, checkpoint: Path, summary: dict[str, float]):
        super().__init__(message)
        self.signal, self.step, self.checkpoint, self.summary = signal, step, checkpoint, summary


class StopRequests:
    """SIGINT/SIGTERM while `watching()`: the first is recorded (the loop stops after the step), a second
    raises KeyboardInterrupt (stop now, without saving)."""

    def __init__(self) -> None:
        self.signal: int | None = None  # the first signal received

    def _request(self, signum, frame) -> None:
        del frame  # signal.signal's handler signature; where the signal landed does not matter
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signum
        request_stop()  # a reward call running in its own process gets a grace period, then is killed
        log.warning(
            "Signal %d: finishing this step, then saving a checkpoint (send it again to stop at once, "
            "without saving).",
            signum,
        )

    def agreed(self, rt: Runtime) -> bool:
        """Whether any rank got a stop signal; then every rank stops (with SIGTERM's code if it got none)."""
        if rt.any(self.signal is not None):
            self.signal = self.signal or signal.SIGTERM
            return True
        return False

    @contextmanager
    def watching(self) -> Iterator[None]:
        clear_stop()
        try:
            previous = {s: signal.signal(s, self._request) for s in (signal.SIGINT, signal.SIGTERM)}
        except ValueError:  # not the main thread: leave signals alone
            previous = {}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


@contextmanager
def running(
    stops: StopRequests,
    run_dir: Path,
    rank: int,
    step: Callable[[], int],
    closing: tuple[Callable[[], None], ...],
) -> Iterator[None]:
    """Around the step loop: signals watched, a failure explained (at the step it happened), and the
    `closing` functions called however the loop ends."""
    try:
        with stops.watching():
            yield
    except Exception as error:
        explain_failure(run_dir, rank, step(), error)
        raise
    finally:
        for close in closing:
            close()


def plan_train(
    settings: RunSettings, parts: RunParts, rt: Runtime, resume_from_checkpoint, first: bool
) -> RunSettings:
    """TRL's `trainer.train(resume_from_checkpoint=True | "path")`: the checkpoint to continue from, chosen
    (and its settings compared) now, and returned as the run's settings with `train.resume` decided (the
    config is not written to). Without it, the first train() of a Python run refuses a directory that
    already holds a run's checkpoints, saying how to continue it (the CLI refused at start-up)."""
    cfg = settings.config
    if parts.episodes.multi_turn:
        log_episode_lengths(cfg)
        warn_untaught_tools(cfg, parts.episodes)
    if resume_from_checkpoint not in (None, False):
        resume = "latest" if resume_from_checkpoint is True else str(resume_from_checkpoint)
        settings = settings.extend({"train.resume": resume})
        found = plan_resume(settings.config, parts.run_dir, clean_up=rt.is_main)
        parts.resume_from = None if found is None else Path(os.path.abspath(found))
        return settings
    existing = list_checkpoints(parts.run_dir)
    if first and parts.resume_from is None and not cfg.train.resume and existing:
        raise ConfigError(
            f"{parts.run_dir} already holds a run ({', '.join(p.name for _, p in existing[-3:])}). "
            "Continue it with trainer.train(resume_from_checkpoint=True) (or GRPOConfig(..., "
            "resume_from_checkpoint=True)), or pass another output_dir to start afresh."
        )
    return settings


BUNDLED_TOOL_MODEL = "tiny-tools-lm"
TAUGHT_TOOL = {"name": "calculator", "parameters": ["expression"]}  # all tiny-tools-lm was shown calling


def warn_untaught_tools(cfg: GRPOConfig, episodes) -> None:
    """The bundled tool model only ever calls calculator(expression): given other tools it calls that one
    anyway, every call fails as an unknown tool and nothing is learned. Say so before the first step, with
    the change that makes the user's own tool work with it."""
    from grpo.model.loading import bundled_model_path

    name = cfg.model.name_or_path
    if name != BUNDLED_TOOL_MODEL and os.path.abspath(name) != bundled_model_path(BUNDLED_TOOL_MODEL):
        return
    factory = getattr(episodes, "factory", None)
    if factory is None:  # an agent (or rollout_func) brings its own tools: grpo cannot see them at start-up
        return
    schemas = list(factory.fixed_schemas)
    for more in factory._schemas.values():  # an environment's methods
        schemas += more
    tools = {
        s["function"]["name"]: list(s["function"].get("parameters", {}).get("properties", {}))
        for s in schemas
    }
    if tools == {TAUGHT_TOOL["name"]: TAUGHT_TOOL["parameters"]}:
        return
    shown = ", ".join(f"{n}({', '.join(args)})" for n, args in tools.items()) or "none"
    one_text_argument = [n for n, args in tools.items() if args == ["expression"]]
    change = (
        f"{one_text_argument[0]}.__name__ = 'calculator' before passing tools=[{one_text_argument[0]}]"
        if one_text_argument
        else "def calculator(expression: str) -> str, with a docstring, that parses the expression and calls "
        "your tool, passed as tools=[calculator]"
    )
    log.warning(
        "%s (the bundled tool model) was only ever shown calling calculator(expression); it will call "
        "that, not your tools (%s): each call gets 'unknown tool', rewards stay flat and the weights barely "
        "move. To try your own tool with it, expose it under that name and argument: %s (docs/agents.md). "
        "Any chat model trained on tool calls (Qwen2.5-Instruct) calls the tools its prompt lists.",
        BUNDLED_TOOL_MODEL,
        shown,
        change,
    )


def log_episode_lengths(cfg: GRPOConfig) -> None:
    """Multi-turn: the completion cap is per assistant turn, not per episode (in TRL, max_completion_length
    caps the whole episode), so say both numbers in the user's words."""
    name = cfg.name_of("generation.max_new_tokens")
    trl = " (in TRL it caps the whole episode: set env.max_tokens to the same number for that)"
    how = "env.max_tokens" if cfg.env.max_tokens else f"env.max_turns {cfg.env.max_turns} × {name}"
    log.info(
        "Lengths: %s = %d tokens per assistant turn%s; an episode holds up to %d tokens after its prompt "
        "(%s), sampled and injected together.",
        name,
        cfg.effective_max_new_tokens,
        trl if name == "max_completion_length" else "",
        cfg.episode_max_tokens,
        how,
    )


def resume(cfg: GRPOConfig, parts: RunParts, rt: Runtime, learner, stream: PromptStream) -> tuple[int, int]:
    """Load the checkpoint preflight chose (weights, learner, data position, RNG), or seed a fresh run.
    Returns (the step to continue after, non-finite steps so far)."""
    path = parts.resume_from  # verified, settings compared: preflight.plan_resume
    parts.clock = (time.perf_counter(), 0.0)  # (this piece's start, seconds of the pieces before it)
    if path is None:
        if cfg.train.resume:
            log.info("No checkpoint in %s yet; starting from step 0.", parts.run_dir)
        seed_everything(cfg.train.seed)
        rt.seed(cfg.train.seed)  # several processes: different sampling noise per rank
        return 0, 0
    state = load_training_state(path)
    try:
        load_policy_weights(rt, path, parts.policy, state)
        learner.load_state_dict(state["learner"])
    except (RuntimeError, ValueError, KeyError) as err:  # shapes, names or optimizer groups that differ
        detail = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"{path} holds the weights of a different model than {cfg.model.name_or_path} ({detail}). "
            "train.allow_config_change lets settings change, not the model's architecture: resume with the "
            "model it was trained from, or start afresh in another --output-dir."
        ) from None
    learner.nonfinite_in_a_row = state["nonfinite_in_a_row"]
    stream.load_state_dict(state["data"], strict=not cfg.train.allow_config_change)
    rngs = state["rng"]
    set_rng_state(rngs[rt.rank] if isinstance(rngs, list) else rngs)
    parts.clock = (parts.clock[0], float(state.get("elapsed_s", 0.0)))
    log.info("Resumed from %s (step %d).", path, state["step"])
    return state["step"], state["nonfinite_total"]


def training_state(rt: Runtime, step: int, learner, data_state: dict, nonfinite_total: int) -> dict:
    """What a checkpoint holds besides the weights (every rank calls it: it gathers)."""
    rngs = rt.gather_objects(rng_state())  # each rank's sampling noise, for an exact resume
    return {
        "step": step,
        "learner": learner.state_dict(),
        "rng": rngs[0] if len(rngs) == 1 else rngs,
        "data": data_state,
        "nonfinite_in_a_row": learner.nonfinite_in_a_row,
        "nonfinite_total": nonfinite_total,
    }


def run_seconds(parts: RunParts) -> float:
    """Seconds the run has trained, over every piece a resume joined (checkpoints carry the sum)."""
    started, before = getattr(parts, "clock", (time.perf_counter(), 0.0))  # set by resume()
    return before + time.perf_counter() - started


def closing_line(
    parts: RunParts, summary: dict[str, float], first_reward: float | None, page: Path | None
) -> str:
    """The result line of the whole run: after a resume, 'before →' and the first reward come from the
    earlier pieces' metrics.jsonl, and the time is every piece's."""
    whole = dict(summary)
    if parts.resume_from is not None:
        earlier = _logged(parts.run_dir)
        before = next((r["eval/accuracy_before"] for r in earlier if "eval/accuracy_before" in r), None)
        if before is not None:
            whole.setdefault("eval/accuracy_before", before)
        during = [r["eval/accuracy_during"] for r in earlier if "eval/accuracy_during" in r]
        if during:  # the last evaluation during training may have been an earlier piece's
            whole.setdefault("eval/accuracy_during", during[-1])
        first_reward = next((r["reward"] for r in earlier if "reward" in r), first_reward)
    seconds, model = run_seconds(parts), parts.run_dir / "final_model"
    return result_line(whole, first_reward, seconds, model, page, eval_set=bool(parts.eval_rows))


def _logged(run_dir: Path) -> list[dict]:
    """metrics.jsonl's lines in order (a line cut short by a kill is skipped)."""
    rows = []
    try:
        lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    except OSError:
        return rows
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def save_checkpoint(cfg: GRPOConfig, parts: RunParts, rt: Runtime, step: int, state: dict) -> Path:
    state = {**state, "elapsed_s": run_seconds(parts)}
    path = save_policy_dir(
        rt, parts.run_dir / f"checkpoint-{step}", parts.policy, parts.tokenizer, cfg.to_yaml(), state
    )
    if rt.is_main:
        prune_checkpoints(parts.run_dir, cfg.train.save_total_limit, protect=(path, parts.resume_from))
    return path


def save_final(
    cfg: GRPOConfig, parts: RunParts, rt: Runtime, state: Callable[[], dict], same_as: Path | None = None
) -> None:
    """final_model/ is resumable like checkpoint-{step}/ (the seed's layout), except as merged LoRA weights,
    which no longer hold the adapters the optimizer state belongs to, or as a bf16/fp16 export
    (train.save_dtype), which no longer holds the float32 masters.

    `same_as`: the checkpoint just saved after the last step. Where final_model/ would hold exactly what it
    holds (not merged, not exported), it becomes a second name for its files (`store.link_model_dir`):
    the weights and optimizer state are written once at the end of a run, not twice (6 GB each on a
    0.5B model), and no rank gathers the weights again."""
    merged = cfg.lora.enabled and cfg.lora.save_merged
    export = SAVE_DTYPES.get(cfg.train.save_dtype)
    if same_as is not None and not (merged or export):
        if rt.is_main:
            link_model_dir(same_as, parts.run_dir / "final_model")
        rt.barrier()
        return
    timed = lambda: {**state(), "elapsed_s": run_seconds(parts)}  # noqa: E731
    save_policy_dir(
        rt,
        parts.run_dir / "final_model",
        parts.policy,
        parts.tokenizer,
        cfg.to_yaml(),
        None if merged or export else timed(),
        merge_lora=cfg.lora.save_merged,
        dtype=export,
    )


def stopped_early(
    run_dir: Path,
    step: int,
    total_steps: int,
    stop_signal: int | None,
    where: Path,
    nonfinite: int,
    summary: dict[str, float] | None = None,
):
    """After the checkpoint of a run that stopped before its last step: raise TrainingHalted (non-finite
    steps) or, after a warning saying how to resume, TrainingStopped (a signal)."""
    how = f"Resume it with: {resume_hint(run_dir)}."
    if stop_signal is None:
        raise TrainingHalted(
            f"{nonfinite} steps in a row had a non-finite loss or gradient (last: step {step}); stopped with "
            f"checkpoint {where}. Lower optim.learning_rate, check the reward functions for NaN/inf, or "
            f"raise train.stop_after_nonfinite_steps. {how}"
        )
    message = f"Stopped at step {step} of {total_steps} (signal {stop_signal}); checkpoint {where}. {how}"
    log.warning("%s", message)
    raise TrainingStopped(message, stop_signal, step, where, summary or {})


def between_steps(
    t, step: int, total_steps: int, evaluate: Callable[[], None], save: Callable[[], None]
) -> None:
    """The periodic evaluation and checkpoint after `step` (train.eval_steps, train.save_steps; 0 = never);
    the last step has its own."""
    if t.eval_steps and step % t.eval_steps == 0 and step != total_steps:
        evaluate(step)
    if t.save_steps and step % t.save_steps == 0 and step != total_steps:
        save(step)


class Progress:
    """What the steps of this invocation did, so a run that trained nothing never ends with the result line
    of a trained one (issue 24).

    A step *updates* when its gradient was non-zero and applied. When no step updated: if no reward was
    ever scored (every one None or skipped) or every update was skipped as non-finite, nothing could carry
    a signal and the run ends with an error; if rewards were scored but every group's were equal (a hard
    task, a smoke test), the run ends with a warning saying so instead of the result line."""

    def __init__(self, start_step: int):
        self.start_step, self.updated, self.unscored, self.skipped = start_step, 0, 0, 0

    def step(
        self, step: int, rewards: torch.Tensor, advantages: torch.Tensor, skipped: bool, grad_norm: float
    ):
        largest = float(advantages.abs().max()) if advantages.numel() else 0.0
        hint = "The rewards' spread broke the advantage arithmetic; rescale the rewards."
        check_range(largest, f"step {step}: an advantage", hint=hint, error=TrainingHalted)
        if rewards.isnan().all():
            self.unscored += 1
            log.warning(
                "Step %d: every reward was None (no reward function applied to any of the %d completions); "
                "this step trains nothing. Check that the rewards fit this dataset (its columns, the answer "
                "format), or add a reward that applies to every sample.",
                step,
                rewards.numel(),
            )
        self.skipped += skipped
        self.updated += not skipped and grad_norm > 0

    def finish(self, step: int, final_model: Path, stop_signal: int | None = None) -> bool:
        """True when a step updated the weights (the caller writes the report and the result line); otherwise
        an error or a warning (see the class). A signal during the final saves: they completed, the rest is
        skipped."""
        ran = step - self.start_step
        if stop_signal is not None:
            log.warning(
                "Signal %d arrived during the final save, which completed: %d steps, final model in %s; the "
                "evaluation after training and the report were skipped (grpo report RUN_DIR writes it).",
                stop_signal,
                step,
                final_model,
            )
            return False
        if ran == 0:
            log.info("Nothing to train: the run was already at step %d (final model: %s).", step, final_model)
            return False
        if self.updated:
            return True
        if self.unscored == ran or self.skipped == ran:
            why = (
                "every reward was None (or skipped) in every step"
                if self.unscored == ran
                else "every update was skipped as non-finite"
            )
            raise TrainingHalted(
                f"{ran} step(s) ran and none could train: {why}; the saved model is the starting one. Check "
                "the reward functions against a few completions (grpo train --dry-run shows the data they "
                "receive) and that they return a number for the samples they apply to."
            )
        log.warning(
            "Finished %d step(s), but none changed the weights: every group's completions got equal rewards "
            "(advantages 0), so %s holds the starting model. Raise generation.num_generations or "
            "generation.temperature for more spread, or use algorithm.dynamic_sampling=true to train only on "
            "groups with a spread.",
            ran,
            final_model,
        )
        return False


def explain_failure(run_dir: Path, rank: int, step: int, error: Exception) -> None:
    found = list_checkpoints(run_dir)
    where = (
        f"the latest checkpoint is {found[-1][1]}; resume with: {resume_hint(run_dir)}"
        if found
        else "no checkpoint was saved yet"
    )
    log.error(
        "Training stopped at step %d (rank %d): %s: %s. Nothing after the last checkpoint is kept; %s.",
        step,
        rank,
        type(error).__name__,
        clause(error),
        where,
    )


def log_sizes(cfg: GRPOConfig, micro_batching: str, total_steps: int, stream: PromptStream) -> None:
    t = cfg.train
    log.info(
        "Sizes: %d prompts/step × %d generations = %d completions/step; %s; %d optimizer step(s) per "
        "rollout; %d steps (%d prompts, %d steps/epoch).",
        t.prompts_per_step,
        cfg.generation.num_generations,
        cfg.completions_per_step,
        micro_batching,
        cfg.algorithm.num_iterations,
        total_steps,
        len(stream.rows),
        stream.steps_per_epoch(t.prompts_per_step),
    )


class BestModel:
    """best_model/: the policy at the best value so far of train.metric_for_best_model."""

    def __init__(self, cfg: GRPOConfig, parts: RunParts, rt: Runtime):
        self.cfg, self.parts, self.rt = cfg, parts, rt
        self.value: float | None = None

    def offer(self, step: int, metrics: dict[str, float]) -> None:
        t, p = self.cfg.train, self.parts
        name = t.metric_for_best_model
        if not name or name not in metrics or self.rt.sharded:  # FSDP2: no rank holds whole weights here
            return
        value = metrics[name]
        if self.value is not None and (value <= self.value if t.greater_is_better else value >= self.value):
            return
        self.value = value
        path = save_model_dir(p.run_dir / "best_model", p.policy, p.tokenizer, self.cfg.to_yaml(), None)
        write_text(path / "best.json", json.dumps({"step": step, "metric": name, "value": value}) + "\n")
        log.info("New best %s = %.4g at step %d; saved %s", name, value, step, path)


def write_report(run_dir: Path) -> Path | None:
    """report/index.html (its path; the run's closing line names it), or None with a warning."""
    from grpo.run.report import write_report as write

    try:
        return write(run_dir)
    except Exception as error:  # noqa: BLE001 (a report must never cost a finished run)
        log.warning("Could not write the run report: %r (retry with `grpo report %s`)", error, run_dir)
        return None
