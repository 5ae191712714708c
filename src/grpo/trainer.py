"""GRPOTrainer: the Python surface of a run (TRL's constructor, `train`, `save_model`, `evaluate`).

    Python:                                 GRPOTrainer(model=..., config=..., train_dataset=...).train()
    the same from the shell:                grpo train ... (the commands for CPU, GPUs and nodes: train.py)

The constructor validates the config, joins the process group and assembles the run (run/assemble.py);
`train()` builds the rollout source and hands it to the loop in train.py, which reads top to bottom.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from pathlib import Path

from grpo import train as loop
from grpo import trl_compat
from grpo.checkpoint.policy import save_policy_dir
from grpo.config import GRPOConfig
from grpo.config.settings import RunSettings
from grpo.data import PromptStream
from grpo.distributed import init_runtime
from grpo.distributed.roles import apply_role_plan
from grpo.evaluation import EvalResult, evaluate
from grpo.records import SamplingParams
from grpo.rollout.source import RolloutSource, build_source
from grpo.run import console, lifecycle
from grpo.run.assemble import RunParts, build_run, planned_steps, setup_logging
from grpo.run.metrics import StepReport, eval_metrics
from grpo.run.runlock import holding_run_lock

__all__ = ["GRPOTrainer"]

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
    reset(row)/step(messages)); a dict of classes is routed by the dataset's `environment` column; or
    `agent=run`, your own agent code over an OpenAI-compatible gateway (grpo/gateway/runner.py)."""

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
        agent=None,
        **trl_only,  # TRL arguments with no counterpart: refused with the reason (trl_compat)
    ):
        setup_logging()  # the console from the first line on, as the CLI's (device roles, threads) ...
        console.begin_startup_log()  # ... and those lines in train.log too, once the run directory is known
        # TRL's positional order: (model, reward_funcs, args, ...)
        if trl_compat.looks_like_rewards(ref_model):
            ref_model, reward_funcs = None, ref_model if reward_funcs is None else reward_funcs
            if isinstance(reward_model, GRPOConfig):
                reward_model, args = None, reward_model
        config = trl_compat.one_of("config", config, "args", args)
        tokenizer = trl_compat.one_of("tokenizer", tokenizer, "processing_class", processing_class)
        reward_funcs, reward_model = trl_compat.split_reward_models(reward_funcs, reward_model)
        trl_compat.refuse_trainer_args(
            callbacks=callbacks,
            optimizers=optimizers,
            reward_processing_classes=reward_processing_classes,
            **trl_only,
        )
        self.cfg = (config or GRPOConfig()).validate()
        if peft_config is not None:  # on a copy: the caller's args stay as they were given
            self.cfg = copy.deepcopy(self.cfg).update(trl_compat.lora_from_peft(peft_config)).validate()
        d = self.cfg.distributed
        self.rt = init_runtime(d.strategy, d.backend, d.timeout_s)  # one process unless torchrun started us
        roles = apply_role_plan(self.cfg, self.rt.rank, self.rt.world_size, self.rt.local_rank)
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
            agent=agent,
            decided=roles.decisions(),
        )
        if rollout_func is not None:  # TRL's rollout_func(prompts, trainer) receives this trainer
            self.parts.episodes.trainer = self
        # What the start decided (run name, threads, rewards, eval set, the completion limit), frozen; the
        # caller's config is not written to: the run reads the resolved copy.
        self._settle(self.parts.settings)
        self.model, self.tokenizer = self.parts.policy, self.parts.tokenizer
        self.source: RolloutSource | None = (
            None  # while train() runs: where rollouts and evaluations come from
        )
        self.processing_class = self.tokenizer  # TRL's name for it
        self.stops = lifecycle.StopRequests()
        self.step, self.total_steps = 0, 0

    def _settle(self, settings: RunSettings) -> None:
        """The run reads these settings from now on (TRL's `args` is their config)."""
        self.settings = self.parts.settings = settings
        self.cfg = self.args = settings.config

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
            self.settings.turn_limit, g.temperature, g.top_k, g.top_p, stop_strings=g.stop_strings
        )

    def evaluate(self, progress: Callable[[int], object] | None = None) -> EvalResult | None:
        """Held-out accuracy through the rollout source (its engine and episodes, tools included): the one
        training samples from, or outside train() one made for this call."""
        p, t, g = self.parts, self.cfg.train, self.cfg.generation
        if not p.eval_rows:
            return None
        max_new_tokens = t.eval_max_new_tokens or self.settings.turn_limit
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
    def train(self, resume_from_checkpoint: bool | str | None = None) -> dict[str, float]:
        """The run, to its last step; returns the last step's metrics. `resume_from_checkpoint` (TRL's):
        True continues from the newest checkpoint in the output directory, a path from that checkpoint.
        A stop signal (Ctrl-C) saves a checkpoint, then raises grpo.TrainingStopped (a KeyboardInterrupt)."""
        p = self.parts
        self._settle(
            lifecycle.plan_train(self.settings, p, self.rt, resume_from_checkpoint, first=self.step == 0)
        )
        cfg = self.cfg
        stream = PromptStream(p.train_rows, seed=cfg.train.seed, shuffle=cfg.data.shuffle)
        self.total_steps = planned_steps(cfg, len(p.train_rows))
        # The source owns its engine: built here, before the learner shards the policy; closed at the end,
        # after the final evaluation, however the run ends.
        self.source = build_source(cfg, p, self.rt, stream, self._sampling())
        try:
            return loop.run(self, self.source, stream)
        finally:
            source, self.source = self.source, None
            try:
                source.close()
            finally:  # every environment instance, however the run ended
                p.episodes.close()

    def log_eval(
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
