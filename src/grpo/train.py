"""THE loop: prompts → rollout → rewards → advantages → (reference) → update → log/save/eval.

    CPU, the bundled tiny model and task:   grpo train
    2 CPU processes (gloo):                 torchrun --standalone --nproc_per_node 2 -m grpo train
    one GPU, a hub model on GSM8K:          grpo train --config gsm8k model=Qwen/Qwen2.5-0.5B-Instruct
    8 GPUs, FSDP2:                          torchrun --standalone --nproc_per_node 8 -m grpo train \
                                                --config gsm8k model=... strategy=fsdp2
    several nodes:                          torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d \
                                                --rdzv-endpoint HOST:29500 -m grpo train ...
    Ray rollout workers:                    grpo train rollout.mode=async rollout.replicas=2
    Python:                                 GRPOTrainer(model=..., config=..., train_dataset=...).train()
(docs/scaling.md has the device-role settings for each.)

One step reads top to bottom in `run` (GRPOTrainer.train in trainer.py calls it): source.next_batch →
score → advantages → batch → reference → learner.train_step → source.sync_weights → log/eval/save,
each stage named and timed (`time/rollout`, `time/reward`, `time/reference`, `time/update`,
`time/weight_sync`). Where rollouts come from (this process, Ray actors) is the RolloutSource's business
(rollout/source.py); resume, checkpoints, signals and failure messages live in run/lifecycle.py.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Protocol

from grpo import records, trl_compat
from grpo.algorithm.advantages import estimate_advantages, informative_groups, per_row_advantages
from grpo.config import AlgorithmConfig, GRPOConfig
from grpo.config.settings import RunSettings
from grpo.data import PromptStream
from grpo.distributed.runtime import Runtime
from grpo.learner import Learner
from grpo.records import PromptBatch, Rollouts, ScoredRollouts
from grpo.rewards.isolation import RewardInterrupted
from grpo.rollout.source import RolloutSource
from grpo.run import lifecycle
from grpo.run.assemble import RunParts
from grpo.run.lifecycle import TrainingHalted
from grpo.run.metrics import StageTimer, StepReport, reduce_metrics, sampler_metrics, step_metrics
from grpo.run.profiling import StepProfiler
from grpo.stages import build_train_batch, score_rollouts


class Trainer(Protocol):
    """What the loop reads and sets on the GRPOTrainer that runs it (trainer.py imports this module)."""

    cfg: GRPOConfig
    parts: RunParts
    rt: Runtime
    settings: RunSettings
    stops: lifecycle.StopRequests
    step: int
    total_steps: int

    @property
    def stop_signal(self) -> int | None: ...

    def log_eval(self, report: StepReport, best: lifecycle.BestModel, step: int, when: str) -> dict: ...


__all__ = ["TrainingHalted", "build_train_batch", "collect", "run"]

log = logging.getLogger("grpo")


def _start_next_step(source: RolloutSource, more: bool) -> None:
    """Where another step follows, the source may start its episodes now, while this step updates (the agent
    gateway's agents: rollout/colocated.py start_next); the prompt stream's position stays this step's."""
    if more:
        getattr(source, "start_next", lambda: None)()


def run(trainer: Trainer, source: RolloutSource, stream: PromptStream) -> dict[str, float]:
    """The steps of `trainer`'s run, from its resume point to the final save, evaluation and report."""
    cfg, p, rt = trainer.cfg, trainer.parts, trainer.rt
    t, a, total_steps = cfg.train, cfg.algorithm, trainer.total_steps
    length_limit = trainer.settings.completion_limit  # the episode's for agents (config/settings.py)
    learner = Learner(
        p.policy, p.ref_model, cfg, total_steps * a.num_iterations, runtime=rt, completion_limit=length_limit
    )
    start_step, nonfinite_total = lifecycle.resume(cfg, p, rt, learner, stream)
    learner.attach_replay(source)  # μ = 1: the update may reuse the rollout's forward (model/replay.py)
    source.sync_weights(start_step, learner.policy)
    lifecycle.log_sizes(cfg, learner.describe_micro_batches(), total_steps, stream)
    report = StepReport(p.run_dir, cfg, rt, start_step, total_steps)
    profiler = StepProfiler(cfg.distributed.profiler == "torch", p.run_dir, total_steps, rt.rank)
    best = lifecycle.BestModel(cfg, p, rt)
    summary = trainer.log_eval(report, best, 0, "before") if t.eval_before and start_step == 0 else {}

    def score(prompts: PromptBatch, rollouts: Rollouts, texts: list[str], lag: int) -> ScoredRollouts:
        state = trl_compat.RewardState(global_step=step, epoch=float(stream.epoch), max_steps=total_steps)
        return score_rollouts(
            prompts, rollouts, texts, lag, funcs=p.reward_funcs, weights=p.reward_weights, algorithm=a,
            max_new_tokens=length_limit, trainer_state=state,
            env_rewards=(p.episodes.reward_names, cfg.env.reward_weight),
        )  # fmt: skip

    def checkpoint_state(step: int, data: dict | None = None) -> dict:
        return lifecycle.training_state(rt, step, learner, data or source.data_state(), nonfinite_total)

    step = trainer.step = start_step
    progress = lifecycle.Progress(start_step)
    data_at_stop = None  # the prompt position before a step a stop signal cut short
    with lifecycle.running(
        trainer.stops, p.run_dir, rt.rank, lambda: step, (profiler.close, report.close_bar)
    ):
        while step < total_steps and not trainer.stops.agreed(rt):  # every rank stops at the same step
            step = trainer.step = step + 1
            profiler.before_step(step)
            timer, step_start = StageTimer(), time.perf_counter()
            data_before = source.data_state()
            learner.before_rollout()
            scored, sampling_stats = collect(source, score, p.tokenizer, a, t.prompts_per_step, timer)
            if scored is None:  # a stop signal, and a reward call that would not finish: drop the step
                step, data_at_stop = step - 1, data_before
                break
            _start_next_step(source, more=step < total_steps)
            advantages = estimate_advantages(scored, a)  # [N], or [N, T] from a per-token estimator
            # The sampler's log-probs [N, T] are π_old itself when they are the learner's own (exact
            # engine, one pass), or a behaviour policy to correct for (stale weights, other kernels).
            sampled = scored.rollouts.sampling_logprobs
            off_policy = scored.lag > 0 or source.sampler_differs
            as_old = not off_policy and a.num_iterations == 1 and source.exact_logprobs
            batch = build_train_batch(
                scored.prompts, scored.rollouts, advantages, p.tokenizer.pad_token_id, gamma=a.gamma,
                mask_truncated=a.mask_truncated_completions, old_logprobs=sampled if as_old else None,
                behaviour_logprobs=sampled if off_policy else None,
            )  # fmt: skip
            if learner.ref_model is not None:
                with timer("reference"):  # none while the policy's weights are π_ref's: the update's own
                    if not learner.reference_is_policy:
                        batch = dataclasses.replace(batch, ref_logprobs=learner.reference_logprobs(batch))
            with timer("update"):
                stats = learner.train_step(batch)
            with timer("weight_sync"):
                source.sync_weights(step, learner.policy)
            nonfinite_total += stats.skipped
            advantages = per_row_advantages(advantages, batch.loss_mask)  # [N] for checks and metrics
            progress.step(step, scored.rewards, advantages, stats.skipped, stats.grad_norm)
            seconds = time.perf_counter() - step_start
            metrics = {
                **step_metrics(scored, advantages, sampling_stats, stats.as_dict()),
                **sampler_metrics(sampled, stats.old_logprobs, batch.loss_mask, stats.importance),
                "nonfinite_steps_total": nonfinite_total,
                "lr": learner.scheduler.get_last_lr()[0],
                "epoch": stream.epoch,
                "tokens_per_s": scored.rollouts.completion_mask.sum().item() / seconds,
                "time/step": seconds,
                **timer.as_metrics(),
                **source.metrics(),
            }
            metrics = reduce_metrics(rt, metrics)
            summary.update(metrics)
            report.step(step, metrics, scored, advantages)
            lifecycle.between_steps(
                t, step, total_steps,
                evaluate=lambda at: summary.update(trainer.log_eval(report, best, at, "during")),
                save=lambda at: lifecycle.save_checkpoint(cfg, p, rt, at, checkpoint_state(at)),
            )  # fmt: skip
            profiler.after_step(step)
            if 0 < t.stop_after_nonfinite_steps <= learner.nonfinite_in_a_row:
                break
    if step < total_steps:  # stopped early: a signal, or non-finite steps
        with trainer.stops.watching():  # a second signal during this save: exit 130, said so
            where = lifecycle.save_checkpoint(cfg, p, rt, step, checkpoint_state(step, data_at_stop))
        report.close()
        lifecycle.stopped_early(
            p.run_dir, step, total_steps, trainer.stop_signal, where, learner.nonfinite_in_a_row, summary
        )
        return summary
    with trainer.stops.watching():  # a signal now lets the final saves finish; a second one: exit 130
        last = lifecycle.save_checkpoint(cfg, p, rt, step, checkpoint_state(step))
        lifecycle.save_final(cfg, p, rt, lambda: checkpoint_state(step), same_as=last)
    last_eval = t.eval_after or (t.eval_steps and step % t.eval_steps == 0)  # the last step's, as TRL
    if last_eval and trainer.stop_signal is None:
        summary.update(trainer.log_eval(report, best, step, "after"))
    report.close()
    # the result line only after a step that changed the weights (lifecycle.Progress says why not)
    trained = progress.finish(step, p.run_dir / "final_model", trainer.stop_signal)
    # The report shows what the steps did, trained or not; not when a signal cut the final saves short.
    page = None
    if t.report and rt.is_main and trainer.stop_signal is None:
        page = lifecycle.write_report(p.run_dir)
    if trained:  # the whole run's: "before →" and the time of every piece a resume joined
        log.info(lifecycle.closing_line(p, summary, report.first_reward, page))
    return summary


Score = Callable[[PromptBatch, Rollouts, list[str], int], ScoredRollouts]


def collect(
    source: RolloutSource, score: Score, tokenizer, a: AlgorithmConfig, want: int, timer: StageTimer
) -> tuple[ScoredRollouts | None, dict[str, float]]:
    """One scored round, or (DAPO dynamic sampling) rounds until `want` prompts with reward spread are in
    hand. (None, {}) when a stop signal cut a reward call short (rewards/isolation.py)."""
    kept, drawn, informative, rounds, last = [], 0, 0, 0, None
    while rounds < (a.dynamic_sampling_max_rounds if a.dynamic_sampling else 1):
        rounds += 1
        with timer("rollout"):
            try:  # a tool or environment call in an episode, cut short by a stop signal (agents/workers.py)
                prompts, rollouts, lag = source.next_batch()
            except RewardInterrupted as stopped:
                log.warning("Stopping: %s, so it was killed and this step is dropped.", stopped)
                return None, {}
            texts = tokenizer.batch_decode(rollouts.completion_ids, skip_special_tokens=True)
        with timer("reward"):
            try:
                last = score(prompts, rollouts, texts, lag)
            except RewardInterrupted as stopped:
                log.warning("Stopping: %s, so it was killed and this step is dropped.", stopped)
                return None, {}
        spread = informative_groups(last, a)  # [P] DAPO: groups with reward spread (turn rewards: their own)
        drawn, informative = drawn + last.num_prompts, informative + int(spread.sum())
        if not a.dynamic_sampling:
            break
        if spread.any():
            kept.append(records.select_groups(last, spread))
        if sum(k.num_prompts for k in kept) >= want:
            break
    stats = {"groups/generated": float(drawn), "groups/informative_frac": informative / max(drawn, 1)}
    if not a.dynamic_sampling:
        return last, stats
    stats["dynamic_sampling/rounds"] = float(rounds)
    if not kept:  # nothing informative after every round: train on the last one (advantages all 0)
        return last, stats
    return records.first_groups(records.concat_rounds(kept, tokenizer.pad_token_id), want), stats
