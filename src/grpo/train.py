"""THE loop: prompts → rollout → rewards → advantages → (reference) → update → log/save/eval.

    CPU, the bundled tiny model and task:   grpo train
    2 CPU processes (gloo):                 torchrun --standalone --nproc_per_node 2 -m grpo train
    one GPU, a hub model on GSM8K:          grpo train --config gsm8k model=Qwen/Qwen2.5-0.5B-Instruct
    8 GPUs, FSDP2:                          torchrun --standalone --nproc_per_node 8 -m grpo train --config gsm8k \
                                                model=... strategy=fsdp2
    several nodes:                          torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d \
                                                --rdzv-endpoint HOST:29500 -m grpo train ...
    Ray rollout workers:                    grpo train rollout.mode=async rollout.replicas=2
    Python:                                 GRPOTrainer(model=..., config=GRPOConfig(...), train_dataset=...).train()
(docs/scaling.md has the device-role settings for each.)

Each step's stages are named and timed (`time/rollout`, `time/reward`, `time/reference`,
`time/update`); one step can be read top to bottom in `GRPOTrainer.train`.

Stopping: the first SIGINT/SIGTERM finishes the current step, saves a checkpoint and says how to
resume; a second one stops at once. `train.stop_after_nonfinite_steps` NaN/inf steps in a row also
save and stop (docs/reliability.md).
"""

from __future__ import annotations

import copy
import json
import logging
import signal
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from grpo import trl_compat
from grpo.algorithm.advantages import discounted_token_advantages, group_advantages, group_reward_stats
from grpo.algorithm.filters import (
    ScoredRollouts,
    concat_rounds,
    informative_prompts,
    overlong_penalty,
    select_groups,
    truncate_prompts,
)
from grpo.algorithm.importance import mismatch_metrics
from grpo.algorithm.loss import apply_truncation_mask
from grpo.config import GRPOConfig
from grpo.data import PromptStream, make_prompt_batch
from grpo.distributed import init_runtime
from grpo.distributed.checkpointing import load_policy_weights, save_policy_dir
from grpo.distributed.roles import apply_role_plan
from grpo.distributed.runtime import SilentLogger
from grpo.evaluation import EvalResult, evaluate
from grpo.learner import Learner
from grpo.records import PromptBatch, Rollouts, SamplingParams, TrainBatch
from grpo.rewards import score_completions
from grpo.rollout import build_engine
from grpo.run.assemble import RunParts, build_run, planned_steps
from grpo.run.checkpoint import (
    list_checkpoints,
    load_training_state,
    prune_checkpoints,
    rng_state,
    save_model_dir,
    seed_everything,
    set_rng_state,
)
from grpo.run.metrics import MetricsLogger, StageTimer, sample_records
from grpo.run.profiling import StepProfiler
from grpo.run.runlock import holding_run_lock

log = logging.getLogger("grpo")


class TrainingHalted(RuntimeError):
    """Training stopped itself (after saving a checkpoint) because it could not go on; the message says why."""


class GRPOTrainer:
    """GRPO on a causal LM. Models and tokenizer may be objects or names/paths; anything left out
    comes from `config`. `reward_model` (an object or path) scores completions; `reward_funcs` are
    callables, registered names or 'module:function' paths.

    TRL's call works too (docs/trl.md): `GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...),
    train_dataset=..., eval_dataset=..., processing_class=..., peft_config=LoraConfig(...))`; `args` is
    `config` and `processing_class` is `tokenizer` under TRL's names."""

    def __init__(
        self,
        model=None,
        ref_model=None,
        reward_model=None,
        tokenizer=None,
        config: GRPOConfig | None = None,
        train_dataset=None,
        reward_funcs=None,
        eval_dataset=None,
        *,
        args: GRPOConfig | None = None,
        processing_class=None,
        peft_config=None,
        callbacks=None,
        optimizers=(None, None),
        reward_processing_classes=None,
    ):
        if trl_compat.looks_like_rewards(
            ref_model
        ):  # TRL's positional order: (model, reward_funcs, args, ...)
            ref_model, reward_funcs = None, ref_model if reward_funcs is None else reward_funcs
            if isinstance(reward_model, GRPOConfig):
                reward_model, args = None, reward_model
        config = trl_compat.one_of("config", config, "args", args)
        tokenizer = trl_compat.one_of("tokenizer", tokenizer, "processing_class", processing_class)
        reward_funcs, reward_model = trl_compat.split_reward_models(reward_funcs, reward_model)
        trl_compat.refuse_trainer_args(
            callbacks=callbacks, optimizers=optimizers, reward_processing_classes=reward_processing_classes
        )
        self.cfg = (config or GRPOConfig()).validate()
        if peft_config is not None:
            self.cfg.update(trl_compat.lora_from_peft(peft_config)).validate()
        d = self.cfg.distributed
        self.rt = init_runtime(d.strategy, d.backend, d.timeout_s)  # one process unless torchrun started us
        self.roles = apply_role_plan(self.cfg, self.rt.rank, self.rt.world_size, self.rt.local_rank)
        if not self.rt.is_main:  # rank 0 speaks for the group, from the first header line on
            logging.getLogger("grpo").setLevel(logging.WARNING)
        self.parts: RunParts = build_run(
            self.cfg,
            model=model,
            ref_model=ref_model,
            reward_model=reward_model,
            tokenizer=tokenizer,
            train_dataset=train_dataset,
            reward_funcs=reward_funcs,
            eval_dataset=eval_dataset,
            rt=self.rt,
        )
        self.model, self.tokenizer = self.parts.policy, self.parts.tokenizer
        self.args, self.processing_class = self.cfg, self.tokenizer  # TRL's names for them
        self.stop_signal: int | None = None  # the first SIGINT/SIGTERM received
        self.step, self.total_steps = 0, 0
        self.nonfinite_total = 0

    def save_model(self, output_dir: str | Path | None = None) -> Path:
        """TRL's `trainer.save_model()`: the policy and tokenizer in `output_dir` (default: the run directory's
        final_model/), loadable with from_pretrained."""
        p = self.parts
        path = Path(output_dir) if output_dir is not None else p.run_dir / "final_model"
        return save_policy_dir(
            self.rt,
            path,
            p.policy,
            p.tokenizer,
            self.cfg.to_yaml(),
            None,
            merge_lora=self.cfg.lora.save_merged,
        )

    def reward_state(self, stream: PromptStream) -> trl_compat.RewardState:
        """TRL's `trainer_state` for reward functions: the step being scored (1-based) and the epoch."""
        return trl_compat.RewardState(
            global_step=self.step, epoch=float(stream.epoch), max_steps=self.total_steps
        )

    def evaluate(self) -> EvalResult | None:
        p, t = self.parts, self.cfg.train
        if not p.eval_rows:
            return None
        return evaluate(
            p.engine,
            p.formatter,
            p.eval_rows,
            batch_size=t.eval_batch_size,
            max_new_tokens=t.eval_max_new_tokens or self.cfg.effective_max_new_tokens,
            stop_strings=self.cfg.generation.stop_strings,
        )

    @holding_run_lock
    def train(self) -> dict[str, float]:
        cfg, p, rt = self.cfg, self.parts, self.rt
        g, t, a = cfg.generation, cfg.train, cfg.algorithm
        stream = PromptStream(p.train_rows, seed=t.seed, shuffle=cfg.data.shuffle)
        total_steps = planned_steps(cfg, len(p.train_rows))
        profiler = StepProfiler(cfg.distributed.profiler == "torch", p.run_dir, total_steps, rt.rank)
        self.total_steps = total_steps
        if rt.sharded and getattr(p.engine, "model", None) is p.policy:
            # FSDP2 leaves no rank with whole weights: colocated rollout samples from a full copy that
            # receives the new weights after every update.
            p.engine = build_engine(g.engine, copy.deepcopy(p.policy).to(p.compute_dtype), p.tokenizer)
        learner = Learner(p.policy, p.ref_model, cfg, total_steps * a.num_iterations, runtime=rt)
        sampling = SamplingParams(
            max_new_tokens=cfg.effective_max_new_tokens,
            temperature=g.temperature,
            top_k=g.top_k,
            top_p=g.top_p,
            stop_strings=g.stop_strings,
        )
        start_step = self._resume(learner, stream)
        remote = None  # Ray rollout actors (rollout.mode=sync|async); None: sample here, colocated
        if cfg.distributed.rollout_mode != "colocated":
            from grpo.rollout.ray import RayRollout

            remote = RayRollout(
                cfg,
                p,
                stream,
                sampling,
                rt,
                learner,
                version=start_step,
                chunk_prompts=_chunk(g.batch_size, g.num_generations),
            )
        log.info(
            "Sizes: %d prompts/step × %d generations = %d completions/step; micro-batch %d "
            "(%d forward/backward per optimizer step); %d optimizer step(s) per rollout; %d steps "
            "(%d prompts, %d steps/epoch).",
            t.prompts_per_step,
            g.num_generations,
            cfg.completions_per_step,
            learner.micro_batch_size,
            -(-cfg.completions_per_step // learner.micro_batch_size),
            a.num_iterations,
            total_steps,
            len(p.train_rows),
            stream.steps_per_epoch(t.prompts_per_step),
        )
        logger = (
            MetricsLogger(p.run_dir, cfg, cfg.to_dict(), start_step=start_step)
            if rt.is_main
            else SilentLogger()
        )
        summary: dict[str, float] = {}
        if t.eval_before and start_step == 0:
            summary.update(self._log_eval(logger, 0, "before"))
        bar = tqdm(
            total=total_steps,
            initial=start_step,
            disable=not t.progress_bar or not rt.is_main,
            desc="grpo",
            dynamic_ncols=True,
        )
        previous_handlers = self._install_signal_handlers()
        step = start_step
        try:
            while step < total_steps:
                if rt.any(self.stop_signal is not None):  # every rank stops at the same step
                    self.stop_signal = self.stop_signal or signal.SIGTERM
                    break
                step += 1
                self.step = step
                profiler.before_step(step)
                timer = StageTimer()
                step_start = time.perf_counter()
                scored, sampling_stats = self._collect(stream, sampling, timer, remote)
                prompts, rollouts, scores = scored.prompts, scored.rollouts, scored.scores
                group = rollouts.prompt_index  # [N] group id = the prompt it answers
                advantages = group_advantages(scored.rewards, group, a.advantage_scale, a.advantage_eps)
                batch = build_train_batch(prompts, rollouts, advantages, cfg, p.tokenizer.pad_token_id)
                if scored.lag > 0 or getattr(p.engine, "sampler_differs", False):
                    batch.behaviour_logprobs = rollouts.sampling_logprobs  # importance correction
                elif remote is None and a.num_iterations == 1 and _logprobs_match_policy(p.engine, sampling):
                    batch.old_logprobs = rollouts.sampling_logprobs  # π_old as sampled: nothing to recompute
                if p.ref_model is not None:
                    with timer("reference"):
                        batch.ref_logprobs = learner.reference_logprobs(batch)
                with timer("update"):
                    stats = learner.train_step(batch)
                with timer("weight_sync"):
                    if remote is not None:
                        remote.after_update(step)
                    elif rt.sharded:
                        p.engine.load_weights(rt.full_named_parameters(learner.policy))
                    if getattr(p.engine, "needs_weight_sync", False):  # an engine with its own copy (vllm)
                        p.engine.sync_weights(learner.policy)
                self.nonfinite_total += stats.skipped
                step_seconds = time.perf_counter() - step_start
                metrics = {
                    "reward": _nanmean(scored.rewards),
                    "reward_std": _nanstd(scored.rewards),
                    **{
                        f"reward/{n}": _nanmean(scores.per_function[:, j]) for j, n in enumerate(scores.names)
                    },
                    "reward/skipped": float(scores.skipped),
                    "reward/not_scored": float(scores.none_applicable),
                    **scores.logged,
                    **sampling_stats,
                    **group_reward_stats(scored.rewards, group),
                    "advantage/mean": advantages.mean().item(),
                    "advantage/std": advantages.std().item(),
                    "advantage/abs_max": advantages.abs().max().item(),
                    **stats.as_dict(),
                    **rollout_metrics(rollouts),
                    **mismatch_metrics(rollouts.sampling_logprobs, stats.old_logprobs, batch.completion_mask),
                    "nonfinite_steps_total": self.nonfinite_total,
                    "lr": learner.scheduler.get_last_lr()[0],
                    "epoch": stream.epoch,
                    "tokens_per_s": rollouts.completion_mask.sum().item() / step_seconds,
                    "time/step": step_seconds,
                    **timer.as_metrics(),
                    **(remote.metrics() if remote is not None else {}),
                }
                if "is/ess" not in metrics:  # on-policy: how far the sampler's log-probs are from π_old's
                    metrics["is/ess"] = sampler_ess(
                        stats.old_logprobs, rollouts.sampling_logprobs, batch.completion_mask
                    )
                metrics = rt.reduce_metrics(metrics)
                summary.update(metrics)
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward']:.3f}", kl=f"{metrics['kl']:.3g}")
                if step % t.logging_steps == 0 or step == total_steps:
                    logger.log(step, metrics, console=not t.progress_bar or step == total_steps)
                    logger.log_samples(step, sample_records(scored, advantages, t.log_samples))
                    if t.progress_bar:
                        bar.write(
                            f"step {step}: reward {metrics['reward']:.3f} ± {metrics['reward_std']:.3f} "
                            f"| kl {metrics['kl']:.4f} | len {metrics['completion_len/mean']:.1f} "
                            f"| {step_seconds:.2f}s"
                        )
                if t.eval_steps and step % t.eval_steps == 0 and step != total_steps:
                    summary.update(self._log_eval(logger, step, "during"))
                if t.save_steps and step % t.save_steps == 0 and step != total_steps:
                    self._save_checkpoint(step, learner, remote.data if remote is not None else stream)
                profiler.after_step(step)
                if 0 < t.stop_after_nonfinite_steps <= learner.nonfinite_in_a_row:
                    break
        except Exception as e:
            self._explain_failure(step, e)
            raise
        finally:
            profiler.close()
            bar.close()
            self._restore_signal_handlers(previous_handlers)
            if remote is not None:
                remote.close()
        data = remote.data if remote is not None else stream  # the data position of the last batch used
        if step < total_steps:  # stopped early: a signal, or non-finite steps
            handlers = self._install_signal_handlers()  # a second signal during this save: exit 130, said so
            try:
                where = self._save_checkpoint(step, learner, data)
            finally:
                self._restore_signal_handlers(handlers)
            logger.close()
            how = (
                f"Resume with the same command plus --resume latest (e.g. grpo train --resume latest "
                f"--output-dir {p.run_dir})."
            )
            if self.stop_signal is None:
                raise TrainingHalted(
                    f"{learner.nonfinite_in_a_row} steps in a row had a non-finite loss or gradient (last: step "
                    f"{step}); stopped with checkpoint {where}. Lower optim.learning_rate, check the reward "
                    f"functions for NaN/inf, or raise train.stop_after_nonfinite_steps. {how}"
                )
            log.warning(
                "Stopped at step %d of %d (signal %d); checkpoint %s. %s",
                step,
                total_steps,
                self.stop_signal,
                where,
                how,
            )
            return summary
        self._save_checkpoint(step, learner, data)
        # final_model/ is resumable like checkpoint-{step}/ (the seed's layout), except as merged LoRA weights,
        # which no longer hold the adapters the optimizer state belongs to, or as a bf16/fp16 export
        # (train.save_dtype), which no longer holds the float32 masters.
        merged = cfg.lora.enabled and cfg.lora.save_merged
        export = _SAVE_DTYPES.get(t.save_dtype)
        save_policy_dir(
            rt,
            p.run_dir / "final_model",
            p.policy,
            p.tokenizer,
            cfg.to_yaml(),
            None if merged or export else self._training_state(step, learner, data),
            merge_lora=cfg.lora.save_merged,
            dtype=export,
        )
        if t.eval_after:
            summary.update(self._log_eval(logger, step, "after"))
        logger.close()
        log.info("Done: %d steps; final model in %s", step, p.run_dir / "final_model")
        if t.report:
            self._write_report()
        return summary

    # -- side rooms: eval, checkpoints, resume, signals ------------------------------------------
    def _log_eval(self, logger: MetricsLogger, step: int, when: str) -> dict[str, float]:
        if not self.rt.is_main:
            return {}
        start = time.perf_counter()
        result = self.evaluate()
        if result is None:
            return {}
        metrics = {
            f"eval/accuracy_{when}": result.accuracy,
            "eval/accuracy": result.accuracy,
            "eval/n": float(result.n),
            "time/eval": time.perf_counter() - start,
            **{f"eval/{k}": v for k, v in result.extra.items()},
        }
        logger.log(step, metrics, console=False)
        log.info(
            "Held-out accuracy %s training: %.1f%% (%d problems, greedy)",
            when,
            100 * result.accuracy,
            result.n,
        )
        self._keep_best(step, metrics)
        return metrics

    def _keep_best(self, step: int, metrics: dict[str, float]) -> None:
        """best_model/: the policy at the best value so far of train.metric_for_best_model."""
        t, p = self.cfg.train, self.parts
        name = t.metric_for_best_model
        if not name or name not in metrics or self.rt.sharded:  # FSDP2: no rank holds whole weights here
            return
        value, best = metrics[name], getattr(self, "best_metric", None)
        if best is not None and (value <= best if t.greater_is_better else value >= best):
            return
        self.best_metric = value
        path = save_model_dir(p.run_dir / "best_model", p.policy, p.tokenizer, self.cfg.to_yaml(), None)
        (path / "best.json").write_text(json.dumps({"step": step, "metric": name, "value": value}) + "\n")
        log.info("New best %s = %.4g at step %d; saved %s", name, value, step, path)

    def _write_report(self) -> None:
        from grpo.run.report import write_report

        try:
            log.info("Report: %s", write_report(self.parts.run_dir))
        except Exception as error:  # noqa: BLE001 (a report must never cost a finished run)
            log.warning(
                "Could not write the run report: %r (retry with `grpo report %s`)", error, self.parts.run_dir
            )

    # -- rollout and rewards, with DAPO dynamic sampling -------------------------------------------
    def _rollout_round(
        self, stream: PromptStream, sampling: SamplingParams, timer: StageTimer, remote=None
    ) -> ScoredRollouts:
        p, cfg = self.parts, self.cfg
        g, a = cfg.generation, cfg.algorithm
        with timer("rollout"):
            if remote is None:
                indices, rows = self.rt.shard(*stream.next_rows(cfg.train.prompts_per_step))  # whole groups
                prompts = make_prompt_batch(indices, rows, p.formatter)
                rollouts = p.engine.generate(
                    prompts.prompt_token_ids,
                    g.num_generations,
                    sampling,
                    chunk_prompts=_chunk(g.batch_size, g.num_generations),
                )
                lag = 0
            else:  # Ray rollout actors; lag: learner steps between the sampling weights and now
                prompts, rollouts, lag = remote.next_batch()
            texts = p.tokenizer.batch_decode(rollouts.completion_ids, skip_special_tokens=True)
        with timer("reward"):
            group = rollouts.prompt_index  # [N]
            columns = {k: [v[i] for i in group] for k, v in prompts.columns.items()}
            columns.setdefault("completion_truncated", rollouts.truncated.tolist())
            reward_prompts, completions, extra = trl_compat.reward_inputs(prompts, rollouts, texts)
            for name, values in extra.items():
                columns.setdefault(name, values)
            scores = score_completions(
                p.reward_funcs,
                p.reward_weights,
                reward_prompts,
                completions,
                columns,
                timeout=a.reward_timeout,
                on_error=a.reward_on_error,
                extras={"trainer_state": self.reward_state(stream)},
            )
            shaping = overlong_penalty(
                rollouts.lengths, cfg.effective_max_new_tokens, a.overlong_buffer, a.overlong_penalty
            )  # [N]
        return ScoredRollouts(prompts, rollouts, texts, scores, scores.total + shaping, lag=lag)

    def _collect(
        self, stream: PromptStream, sampling: SamplingParams, timer: StageTimer, remote=None
    ) -> tuple[ScoredRollouts, dict[str, float]]:
        """One round, or (dynamic sampling) rounds until P prompts with reward spread are in hand."""
        a, want = self.cfg.algorithm, self.cfg.train.prompts_per_step
        kept, drawn, informative, rounds, last = [], 0, 0, 0, None
        while rounds < (a.dynamic_sampling_max_rounds if a.dynamic_sampling else 1):
            rounds += 1
            last = self._rollout_round(stream, sampling, timer, remote)
            spread = informative_prompts(last.rewards, last.rollouts.prompt_index, last.num_prompts)  # [P]
            drawn, informative = drawn + last.num_prompts, informative + int(spread.sum())
            if not a.dynamic_sampling:
                break
            if spread.any():
                kept.append(select_groups(last, spread))
            if sum(k.num_prompts for k in kept) >= want:
                break
        stats = {"groups/generated": float(drawn), "groups/informative_frac": informative / max(drawn, 1)}
        if not a.dynamic_sampling:
            return last, stats
        stats["dynamic_sampling/rounds"] = float(rounds)
        if not kept:  # nothing informative after every round: train on the last one (advantages all 0)
            return last, stats
        return truncate_prompts(concat_rounds(kept, self.parts.tokenizer.pad_token_id), want), stats

    def _training_state(self, step: int, learner: Learner, stream: PromptStream) -> dict:
        rngs = self.rt.gather_objects(rng_state())  # each rank's sampling noise, for an exact resume
        return {
            "step": step,
            "learner": learner.state_dict(),
            "rng": rngs[0] if len(rngs) == 1 else rngs,
            "data": stream.state_dict(),
            "nonfinite_in_a_row": learner.nonfinite_in_a_row,
            "nonfinite_total": self.nonfinite_total,
        }

    def _save_checkpoint(self, step: int, learner: Learner, stream: PromptStream) -> Path:
        p = self.parts
        state = self._training_state(step, learner, stream)
        path = save_policy_dir(
            self.rt, p.run_dir / f"checkpoint-{step}", p.policy, p.tokenizer, self.cfg.to_yaml(), state
        )
        if self.rt.is_main:
            prune_checkpoints(p.run_dir, self.cfg.train.save_total_limit, protect=(path, p.resume_from))
        return path

    def _explain_failure(self, step: int, error: Exception) -> None:
        found = list_checkpoints(self.parts.run_dir)
        where = (
            (
                f"the latest checkpoint is {found[-1][1]}; resume with: grpo train --resume latest "
                f"--output-dir {self.parts.run_dir} (same settings)"
            )
            if found
            else "no checkpoint was saved yet"
        )
        log.error(
            "Training stopped at step %d (rank %d): %s: %s. Nothing after the last checkpoint is kept; %s.",
            step,
            self.rt.rank,
            type(error).__name__,
            error,
            where,
        )

    def _resume(self, learner: Learner, stream: PromptStream) -> int:
        path = self.parts.resume_from  # verified, settings compared: preflight.plan_resume
        if path is None:
            if self.cfg.train.resume:
                log.info("No checkpoint in %s yet; starting from step 0.", self.parts.run_dir)
            seed_everything(self.cfg.train.seed)
            self.rt.seed(self.cfg.train.seed)  # several processes: different sampling noise per rank
            return 0
        state = load_training_state(path)
        load_policy_weights(self.rt, path, self.parts.policy, state)
        learner.load_state_dict(state["learner"])
        learner.nonfinite_in_a_row = state["nonfinite_in_a_row"]
        self.nonfinite_total = state["nonfinite_total"]
        stream.load_state_dict(state["data"], strict=not self.cfg.train.allow_config_change)
        rngs = state["rng"]
        set_rng_state(rngs[self.rt.rank] if isinstance(rngs, list) else rngs)
        log.info("Resumed from %s (step %d).", path, state["step"])
        return state["step"]

    def _install_signal_handlers(self):
        def request_stop(signum, frame):
            if self.stop_signal is not None:  # a second signal: stop now, without saving
                raise KeyboardInterrupt
            self.stop_signal = signum
            log.warning(
                "Signal %d: finishing this step, then saving a checkpoint (send it again to stop at "
                "once, without saving).",
                signum,
            )

        try:
            return {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        except ValueError:  # not the main thread: leave signals alone
            return {}

    @staticmethod
    def _restore_signal_handlers(previous) -> None:
        for s, handler in previous.items():
            signal.signal(s, handler)


def build_train_batch(
    prompts: PromptBatch, rollouts: Rollouts, advantages: torch.Tensor, cfg: GRPOConfig, pad_id: int
) -> TrainBatch:
    """Left-padded prompt | right-padded completion rows, with per-token advantages and masks."""
    group = rollouts.prompt_index  # [N]
    width = max(len(prompts.prompt_token_ids[i]) for i in group.tolist())
    n = rollouts.completion_ids.shape[0]
    prompt_ids = torch.full((n, width), pad_id, dtype=torch.long)  # [N, Lp]
    prompt_mask = torch.zeros((n, width), dtype=torch.long)
    for row, i in enumerate(group.tolist()):
        ids = prompts.prompt_token_ids[i]
        prompt_ids[row, width - len(ids) :] = torch.tensor(ids)
        prompt_mask[row, width - len(ids) :] = 1
    mask = rollouts.completion_mask  # [N, T]
    if cfg.algorithm.mask_truncated_completions:
        mask = apply_truncation_mask(mask, rollouts.truncated)
    return TrainBatch(
        input_ids=torch.cat([prompt_ids, rollouts.completion_ids], dim=1),  # [N, Lp + T]
        attention_mask=torch.cat([prompt_mask, rollouts.completion_mask.long()], dim=1),
        prompt_width=width,
        completion_mask=mask,
        advantages=discounted_token_advantages(advantages, mask, cfg.algorithm.gamma),  # [N, T]
        group_ids=group,
    )


def rollout_metrics(rollouts: Rollouts) -> dict[str, float]:
    lengths = rollouts.lengths.float()  # [N]
    return {
        "completion_len/mean": lengths.mean().item(),
        "completion_len/max": lengths.max().item(),
        "completion_len/min": lengths.min().item(),
        "truncated_frac": rollouts.truncated.float().mean().item(),
    }


def sampler_ess(
    old_logprobs: torch.Tensor | None, sampling_logprobs: torch.Tensor | None, mask: torch.Tensor
) -> float:
    """Kish effective sample size, as a fraction in (0, 1], of the token weights π_old / π_sampler: 1.0
    when the sampler's log-probs are the learner's (TorchRL logs this ESS in every mode)."""
    if old_logprobs is None or sampling_logprobs is None:
        return float("nan")
    width = min(old_logprobs.shape[1], sampling_logprobs.shape[1], mask.shape[1])
    m = mask[:, :width].float()  # [N, T]
    log_w = (old_logprobs[:, :width].float() - sampling_logprobs[:, :width].float()) * m  # [N, T]
    w = log_w.clamp(max=20).exp() * m  # [N, T]
    n = m.sum().clamp(min=1)
    return (w.sum().square() / (n * w.square().sum().clamp(min=1e-12))).item()


def _nanmean(x: torch.Tensor) -> float:
    return x.nanmean().item() if not torch.isnan(x).all() else float("nan")


def _nanstd(x: torch.Tensor) -> float:
    scored = x[~x.isnan()]  # [M] samples some reward function scored
    return scored.std().item() if scored.numel() > 1 else float("nan")


def _logprobs_match_policy(engine, sampling: SamplingParams) -> bool:
    """The engine's sampling log-probs are the learner's π_θ (same weights and precision, no filters)."""
    return (
        getattr(engine, "exact_logprobs", False)
        and not sampling.greedy
        and sampling.top_k == 0
        and sampling.top_p >= 1.0
    )


_SAVE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}  # train.save_dtype; float32: as trained


def _chunk(batch_size: int | None, n: int) -> int | None:
    return None if batch_size is None else max(1, batch_size // n)
