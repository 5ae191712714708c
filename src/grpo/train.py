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

One step reads top to bottom in `GRPOTrainer.train`: source.next_batch → score → advantages → batch →
reference → learner.train_step → source.sync_weights → log/eval/save, each stage named and timed
(`time/rollout`, `time/reward`, `time/reference`, `time/update`, `time/weight_sync`). Where rollouts come
from (this process, Ray actors) is the RolloutSource's business (rollout/source.py); resume, checkpoints,
signals and failure messages live in run/lifecycle.py.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

from grpo import records, trl_compat
from grpo.algorithm.advantages import group_advantages
from grpo.algorithm.filters import informative_prompts
from grpo.config import AlgorithmConfig, GRPOConfig
from grpo.data import PromptStream
from grpo.distributed import init_runtime
from grpo.distributed.checkpointing import save_policy_dir
from grpo.distributed.roles import apply_role_plan
from grpo.evaluation import EvalResult, evaluate
from grpo.learner import Learner
from grpo.records import PromptBatch, Rollouts, SamplingParams, ScoredRollouts, build_train_batch
from grpo.rewards.isolation import RewardInterrupted
from grpo.rewards.rollouts import score_rollouts
from grpo.rollout.source import RolloutSource, build_source
from grpo.run import lifecycle
from grpo.run.assemble import RunParts, build_run, planned_steps
from grpo.run.console import result_line
from grpo.run.lifecycle import TrainingHalted
from grpo.run.metrics import (
    StageTimer,
    StepReport,
    eval_metrics,
    reduce_metrics,
    sampler_metrics,
    step_metrics,
)
from grpo.run.profiling import StepProfiler
from grpo.run.runlock import holding_run_lock

__all__ = ["GRPOTrainer", "TrainingHalted", "build_train_batch", "collect"]

log = logging.getLogger("grpo")


class GRPOTrainer:
    """GRPO on a causal LM. Models and tokenizer may be objects or names/paths; anything left out
    comes from `config`. `reward_model` (an object or path) scores completions; `reward_funcs` are
    callables, registered names or 'module:function' paths.

    TRL's call works too (docs/trl.md): `GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...),
    train_dataset=..., eval_dataset=..., processing_class=..., peft_config=LoraConfig(...))`; `args` is
    `config` and `processing_class` is `tokenizer` under TRL's names.

    Agents (docs/agents.md): `tools=[fn, ...]` (typed, documented functions the model may call) or
    `environment_factory=Cls` (TRL's form: reset(**row), public methods as tools; or the step form
    reset(row)/step(messages)); a dict of classes is routed by the dataset's `environment` column."""

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
        tools=None,
        environment_factory=None,
        rollout_func=None,
    ):
        # TRL's positional order: (model, reward_funcs, args, ...)
        if trl_compat.looks_like_rewards(ref_model):
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
        apply_role_plan(self.cfg, self.rt.rank, self.rt.world_size, self.rt.local_rank)
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
            tools=tools,
            environment=environment_factory,
            rollout_func=rollout_func,
        )
        if rollout_func is not None:  # TRL's rollout_func(prompts, trainer) receives this trainer
            self.parts.episodes.trainer = self
        self.model, self.tokenizer = self.parts.policy, self.parts.tokenizer
        self.source: RolloutSource | None = (
            None  # while train() runs: where rollouts and evaluations come from
        )
        self.args, self.processing_class = self.cfg, self.tokenizer  # TRL's names for them
        self.stops = lifecycle.StopRequests()
        self.step, self.total_steps = 0, 0

    @property
    def stop_signal(self) -> int | None:
        """The first SIGINT/SIGTERM received during train() (the CLI exits with 128 + it)."""
        return self.stops.signal

    def save_model(self, output_dir: str | Path | None = None) -> Path:
        """TRL's `trainer.save_model()`: the policy and tokenizer in `output_dir` (default: the run
        directory's final_model/), loadable with from_pretrained. An existing `output_dir` (the run
        directory itself, or any folder of yours) keeps everything else in it."""
        p, merge = self.parts, self.cfg.lora.save_merged
        path = Path(output_dir) if output_dir is not None else p.run_dir / "final_model"
        owned = output_dir is None or not path.exists()
        if output_dir is not None and owned and self.rt.is_main:
            path.parent.mkdir(parents=True, exist_ok=True)  # a new directory of the user's choosing
        return save_policy_dir(
            self.rt, path, p.policy, p.tokenizer, self.cfg.to_yaml(), None, merge_lora=merge, owned=owned
        )

    def _sampling(self) -> SamplingParams:
        g = self.cfg.generation
        return SamplingParams(
            self.cfg.effective_max_new_tokens, g.temperature, g.top_k, g.top_p, stop_strings=g.stop_strings
        )

    def evaluate(self, progress: Callable[[int], object] | None = None) -> EvalResult | None:
        """Held-out accuracy through the rollout source (its engine and episodes, tools included): the one
        training samples from, or outside train() one made for this call."""
        p, t, g = self.parts, self.cfg.train, self.cfg.generation
        if not p.eval_rows:
            return None
        max_new_tokens = t.eval_max_new_tokens or self.cfg.effective_max_new_tokens
        source = self.source
        if source is None:
            stream = PromptStream(p.eval_rows, seed=t.seed, shuffle=False)
            source = build_source(self.cfg, p, self.rt, stream, self._sampling())
            source.sync_weights(self.step, p.policy)
        try:
            return evaluate(
                source, p.formatter, p.eval_rows, batch_size=t.eval_batch_size, max_new_tokens=max_new_tokens,
                stop_strings=g.stop_strings, progress=progress,
            )  # fmt: skip
        finally:
            if source is not self.source:
                source.close()
                p.episodes.close()

    @holding_run_lock
    def train(self) -> dict[str, float]:
        cfg, p = self.cfg, self.parts
        stream = PromptStream(p.train_rows, seed=cfg.train.seed, shuffle=cfg.data.shuffle)
        self.total_steps = planned_steps(cfg, len(p.train_rows))
        # The source owns its engine: built here, before the learner shards the policy; closed at the end,
        # after the final evaluation, however the run ends.
        self.source = build_source(cfg, p, self.rt, stream, self._sampling())
        try:
            return self._train(self.source, stream)
        finally:
            source, self.source = self.source, None
            try:
                source.close()
            finally:  # every environment instance, however the run ended
                p.episodes.close()

    def _train(self, source: RolloutSource, stream: PromptStream) -> dict[str, float]:
        cfg, p, rt = self.cfg, self.parts, self.rt
        t, a, total_steps = cfg.train, cfg.algorithm, self.total_steps
        started = time.perf_counter()
        learner = Learner(p.policy, p.ref_model, cfg, total_steps * a.num_iterations, runtime=rt)
        start_step, nonfinite_total = lifecycle.resume(cfg, p, rt, learner, stream)
        source.sync_weights(start_step, learner.policy)
        lifecycle.log_sizes(cfg, learner.describe_micro_batches(), total_steps, stream)
        report = StepReport(p.run_dir, cfg, rt, start_step, total_steps)
        profiler = StepProfiler(cfg.distributed.profiler == "torch", p.run_dir, total_steps, rt.rank)
        best = lifecycle.BestModel(cfg, p, rt)
        summary = self._log_eval(report, best, 0, "before") if t.eval_before and start_step == 0 else {}

        length_limit = cfg.episode_max_tokens if source.multi_turn else cfg.effective_max_new_tokens

        def score(prompts: PromptBatch, rollouts: Rollouts, texts: list[str], lag: int) -> ScoredRollouts:
            state = trl_compat.RewardState(global_step=step, epoch=float(stream.epoch), max_steps=total_steps)
            return score_rollouts(
                prompts, rollouts, texts, lag, funcs=p.reward_funcs, weights=p.reward_weights, algorithm=a,
                max_new_tokens=length_limit, trainer_state=state,
                env_rewards=(p.episodes.reward_names, cfg.env.reward_weight),
            )  # fmt: skip

        def checkpoint_state(step: int, data: dict | None = None) -> dict:
            return lifecycle.training_state(rt, step, learner, data or source.data_state(), nonfinite_total)

        step = self.step = start_step
        progress = lifecycle.Progress(start_step)
        data_at_stop = None  # the prompt position before a step a stop signal cut short
        with lifecycle.running(
            self.stops, p.run_dir, rt.rank, lambda: step, (profiler.close, report.close_bar)
        ):
            while step < total_steps and not self.stops.agreed(rt):  # every rank stops at the same step
                step = self.step = step + 1
                profiler.before_step(step)
                timer, step_start = StageTimer(), time.perf_counter()
                data_before = source.data_state()
                scored, sampling_stats = collect(source, score, p.tokenizer, a, t.prompts_per_step, timer)
                if scored is None:  # a stop signal, and a reward call that would not finish: drop the step
                    step, data_at_stop = step - 1, data_before
                    break
                group_ids = scored.rollouts.group_ids  # [N]
                advantages = group_advantages(scored.rewards, group_ids, a.advantage_scale, a.advantage_eps)
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
                    with timer("reference"):
                        batch = dataclasses.replace(batch, ref_logprobs=learner.reference_logprobs(batch))
                with timer("update"):
                    stats = learner.train_step(batch)
                with timer("weight_sync"):
                    source.sync_weights(step, learner.policy)
                nonfinite_total += stats.skipped
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
                    evaluate=lambda at: summary.update(self._log_eval(report, best, at, "during")),
                    save=lambda at: lifecycle.save_checkpoint(cfg, p, rt, at, checkpoint_state(at)),
                )  # fmt: skip
                profiler.after_step(step)
                if 0 < t.stop_after_nonfinite_steps <= learner.nonfinite_in_a_row:
                    break
        if step < total_steps:  # stopped early: a signal, or non-finite steps
            with self.stops.watching():  # a second signal during this save: exit 130, said so
                where = lifecycle.save_checkpoint(cfg, p, rt, step, checkpoint_state(step, data_at_stop))
            report.close()
            lifecycle.stopped_early(
                p.run_dir, step, total_steps, self.stop_signal, where, learner.nonfinite_in_a_row
            )
            return summary
        with self.stops.watching():  # a signal now lets the final saves finish; a second one: exit 130
            lifecycle.save_checkpoint(cfg, p, rt, step, checkpoint_state(step))
            lifecycle.save_final(cfg, p, rt, lambda: checkpoint_state(step))
        last_eval = t.eval_after or (t.eval_steps and step % t.eval_steps == 0)  # the last step's, as TRL
        if last_eval and self.stop_signal is None:
            summary.update(self._log_eval(report, best, step, "after"))
        report.close()
        # the result line only after a step that changed the weights (lifecycle.Progress says why not)
        trained = progress.finish(step, p.run_dir / "final_model", self.stop_signal)
        # The report shows what the steps did, trained or not; not when a signal cut the final saves short.
        page = None
        if t.report and rt.is_main and self.stop_signal is None:
            page = lifecycle.write_report(p.run_dir)
        if trained:
            final = p.run_dir / "final_model"
            log.info(result_line(summary, report.first_reward, time.perf_counter() - started, final, page))
        return summary

    def _log_eval(
        self, report: StepReport, best: lifecycle.BestModel, step: int, when: str
    ) -> dict[str, float]:
        start = time.perf_counter()
        if not self.rt.is_main or not self.parts.eval_rows:
            return {}
        with report.evaluating(when, len(self.parts.eval_rows)) as progress:
            result = self.evaluate(progress)
        metrics = eval_metrics(result, when, time.perf_counter() - start)
        report.log(step, metrics, console=False)
        log.info(
            "Held-out accuracy %s training: %.1f%% (%d problems of %s, greedy)",
            when,
            100 * result.accuracy,
            result.n,
            self.parts.eval_name,
        )
        best.offer(step, metrics)
        return metrics


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
            prompts, rollouts, lag = source.next_batch()
            texts = tokenizer.batch_decode(rollouts.completion_ids, skip_special_tokens=True)
        with timer("reward"):
            try:
                last = score(prompts, rollouts, texts, lag)
            except RewardInterrupted as stopped:
                log.warning("Stopping: %s, so it was killed and this step is dropped.", stopped)
                return None, {}
        spread = informative_prompts(last.rewards, last.rollouts.group_ids, last.num_prompts)  # [P]
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
