"""The policy's optimisation step: micro-batched forward/backward of the GRPO loss, then AdamW.

A step sees one TrainBatch (P × G completions), which it only reads. It makes `num_iterations` optimizer
steps over it; each splits the rows into micro-batches whose loss contributions sum to the full-batch loss
(`LossNorm` carries the global normalisers), so `micro_batch_size` changes memory, not the update. The
math is in algorithm/ (loss, importance weights, schedules) and the forward pass in model/forward.py.
"""

from __future__ import annotations

import logging
import math
from dataclasses import astuple, dataclass, field, replace

import torch

from grpo import kernels
from grpo.algorithm.importance import WeightSums, importance_metrics, weighted_advantages
from grpo.algorithm.loss import LossNorm, LossOutput, make_policy_loss
from grpo.algorithm.schedules import lr_lambda
from grpo.config import GRPOConfig
from grpo.config.errors import ConfigError
from grpo.distributed.runtime import Runtime
from grpo.model.compiled import compile_by_default
from grpo.model.forward import PolicyForward
from grpo.model.loading import resolve_dtype
from grpo.model.lora import ReferenceWithoutAdapters, has_adapters, lora_base
from grpo.model.memory import release_large_frees
from grpo.model.micro_batch import (
    FALLBACK_TOKENS,
    PaddedCost,
    activation_bytes_per_token,
    budget_tokens,
    default_activation_budget,
    plan_micro_batches,
    split_to,
)
from grpo.model.replay import Replay, ReplayTape
from grpo.records import TrainBatch

log = logging.getLogger("grpo")


class NonFiniteWeightsError(RuntimeError):
    """The policy's weights hold NaN/inf after an optimizer step: training cannot go on from here."""


@dataclass
class _LossSums:
    """The first pass's statistics as sums (with their token count), added over micro-batches and
    processes before they are divided."""

    loss: float = 0.0
    kl: float = 0.0
    ratio: float = 0.0
    clip_low: float = 0.0
    clip_high: float = 0.0
    entropy: float = 0.0
    tokens: float = 0.0

    def add(self, out: LossOutput, entropy_sum: float) -> None:
        self.loss += out.loss.item()
        self.kl += out.kl_sum.item()
        self.ratio += out.ratio_sum.item()
        self.clip_low += out.clipped_low_sum.item()
        self.clip_high += out.clipped_high_sum.item()
        self.entropy += entropy_sum
        self.tokens += out.num_tokens.item()


@dataclass
class StepStats:
    loss: float
    kl: float
    ratio_mean: float
    clip_low_frac: float
    clip_high_frac: float
    entropy: float
    grad_norm: float
    skipped: bool
    importance: dict[str, float] = field(default_factory=dict)  # off-policy correction, when applied
    amp: dict[str, float] = field(default_factory=dict)  # float16 loss scaling: scale, overflow
    replay: dict[str, float] = field(default_factory=dict)  # when replay is on: what the update replayed
    # [N, T] π_old as the step used it (the batch's own, or the first pass's log-probs); not a metric
    old_logprobs: torch.Tensor | None = field(default=None, repr=False)

    def as_dict(self) -> dict[str, float]:
        return {
            "loss": self.loss,
            "kl": self.kl,
            "ratio_mean": self.ratio_mean,
            "clip/low_frac": self.clip_low_frac,
            "clip/high_frac": self.clip_high_frac,
            "entropy": self.entropy,
            "grad_norm": self.grad_norm,
            "skipped_nonfinite": float(self.skipped),
            **self.importance,
            **self.amp,
            **self.replay,
        }


def _replay_metrics(tape: ReplayTape | None, recording) -> dict[str, float]:
    """replay/frac: the share of the step's micro-batches whose forward replayed the rollout (0 when the
    step recorded nothing: over its memory budget, or a second generate call), when replay is on."""
    if tape is None:
        return {}
    done = 0 if recording is None else recording.replayed + recording.missed
    return {"replay/frac": recording.replayed / done if done else 0.0}


def _same_weights(master: torch.Tensor, ref: torch.Tensor, compute: torch.dtype | None) -> bool:
    """The reference parameter `ref` is the policy's `master` as the update's forward computes with it."""
    if master.shape != ref.shape or (compute is not None and ref.dtype != compute):
        return False
    return torch.equal(master.detach().to(device=ref.device, dtype=ref.dtype), ref.detach())


class Learner:
    """AdamW on the policy's trainable parameters, stepped by the GRPO loss of one TrainBatch at a time."""

    def __init__(
        self,
        policy,
        ref_model,
        cfg: GRPOConfig,
        total_optimizer_steps: int,
        runtime: Runtime | None = None,
        completion_limit: int | None = None,
    ):
        self.policy, self.ref_model, self.cfg = policy, ref_model, cfg
        # Dr. GRPO's constant normaliser: the run's one completion limit (RunSettings; an episode's, agents)
        self.completion_limit = completion_limit or cfg.effective_max_new_tokens
        # Several processes: `model` is the DDP/FSDP2-wrapped policy that forward/backward go through,
        # and every count below is made global with the runtime's all-reduces.
        self.rt = runtime or Runtime()
        device = next(policy.parameters()).device
        if device.type == "cpu":  # glibc would keep freed activations resident (model/memory.py)
            release_large_frees()
        # Mixed precision (docs/algorithm.md, Precision): the parameters AdamW steps are float32 masters;
        # forward/backward compute in model.dtype. FSDP2 casts through its MixedPrecisionPolicy instead.
        self.compute_dtype = resolve_dtype(cfg.model.dtype, device)
        self.model = self.rt.wrap(policy, param_dtype=self.compute_dtype)
        # float16's 5 exponent bits underflow small gradients: scale the loss (Micikevicius et al. 2018).
        self.scaler = torch.amp.GradScaler(device.type) if self.compute_dtype == torch.float16 else None
        o = cfg.optim
        # CPU: the fused kernel updates each parameter in one pass. The default (foreach) path allocates
        # parameter-sized temporaries (√v̂ for every tensor at once: +1.8 GiB at a 0.5B model's peak) and
        # makes seven passes over the state (24 s vs 0.8 s per step there; docs/performance.md). The result
        # differs from foreach's by float32 rounding only. FSDP2's sharded parameters keep the default.
        fused = device.type == "cpu" and not self.rt.sharded
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=o.learning_rate,
            betas=(o.adam_beta1, o.adam_beta2),
            eps=o.adam_epsilon,
            weight_decay=o.weight_decay,
            fused=fused or None,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(o.warmup_steps, total_optimizer_steps, o.lr_scheduler)
        )
        self.nonfinite_in_a_row = 0
        self._overflowed = False
        self.loss = make_policy_loss(cfg.algorithm)  # every option bound once; called with tensors only
        # The native forward reads parameters directly, skipping module hooks: DDP and FSDP2 rely on their
        # wrapper's forward, so several processes train through the transformers forward.
        native = cfg.generation.engine != "transformers" and not self.rt.active
        compile_training = cfg.model.compile_training
        self.compile_blocks = native and (
            compile_by_default(device, total_optimizer_steps)
            if compile_training is None
            else compile_training
        )
        self.policy_forward = PolicyForward(
            self.model,
            native=native,
            compute_dtype=None if self.rt.sharded else self.compute_dtype,
            gradient_checkpointing=cfg.model.gradient_checkpointing,
            entropy_grad=cfg.algorithm.entropy_coef != 0,  # the bonus's gradient flows through the entropy
            compile_blocks=self.compile_blocks,
        )
        self.reference_forward = (
            None
            if ref_model is None
            else PolicyForward(ref_model, native=native, compile_blocks=self.compile_blocks)
        )
        # The row knobs' micro-batch (None: unset); whatever they say, the token budget caps every one.
        self.micro_batch_size = cfg.resolved_micro_batch_size
        self.micro_batch_tokens = self._token_budget(policy, device)
        self.replay_tape: ReplayTape | None = None  # set by attach_replay (model/replay.py)
        # While the policy's weights are still π_ref's (a fresh run until its first update that moves them),
        # π_ref's log-probs are the update's own: the reference forward is skipped and the KL term is
        # exactly 0 with an exactly-0 gradient, whatever kernels the update's forward runs (replay's decode
        # GEMM shapes included). A checkpoint carries it (state_dict), so a resumed run decides as the
        # uninterrupted one did.
        self.reference_is_policy = self._reference_equals_policy()

    def _reference_equals_policy(self) -> bool:
        """Whether π_ref's weights are the policy's now, checked once at the start (one read of each)."""
        ref = self.ref_model
        if ref is None or self.rt.sharded:  # FSDP2 shards: not compared (the reference forward runs)
            return False
        if isinstance(ref, ReferenceWithoutAdapters):  # the base with the adapters off: equal iff B = 0
            named = list(self.policy.named_parameters())
            if any("lora_magnitude" in name for name, _ in named):  # DoRA rescales even with B = 0
                return False
            equal = all(not p.detach().any() for name, p in named if "lora_B" in name)
        else:
            mine, theirs = dict(self.policy.named_parameters()), dict(ref.named_parameters())
            equal = (
                type(lora_base(self.policy)) is type(ref)
                and mine.keys() == theirs.keys()
                and all(_same_weights(mine[name], theirs[name], self.compute_dtype) for name in mine)
            )
        return not self.rt.any(not equal)  # every process decides the same

    # -- replay: the update reuses the rollout's forward (model/replay.py) ----------------------------
    def replay_refusal(self, source) -> str | None:
        """Why this run's update cannot replay `source`'s rollouts, or None when it can."""
        cfg, a = self.cfg, self.cfg.algorithm
        engine = getattr(source, "engine", None)
        chunk = getattr(source, "chunk_prompts", None)
        reasons = [
            (a.num_iterations != 1, f"algorithm.num_iterations is {a.num_iterations} (later passes run at "
             "updated weights; replay needs 1)"),
            (has_adapters(self.policy), "the policy trains LoRA adapters"),
            (a.entropy_coef != 0, "algorithm.entropy_coef is set (its gradient needs the "
             "transformers forward)"),
            (self.rt.active, "the learner runs in several processes"),
            (self.policy_forward.kind != "native", "the update runs the transformers forward, not the "
             "native one"),
            (self.compute_dtype not in (None, torch.float32), f"model.dtype computes in {self.compute_dtype} "
             "(replay needs float32)"),
            (cfg.model.gradient_checkpointing, "model.gradient_checkpointing is on"),
            (not hasattr(engine, "tape") or lora_base(engine.model) is not lora_base(self.policy),
             "the rollout is not the native engine sampling with the policy's own weights in this process"),
            (bool(getattr(source, "multi_turn", False)), "rollouts are multi-turn episodes (tools or an "
             "environment)"),
            (a.dynamic_sampling, "algorithm.dynamic_sampling draws several rollout rounds per step"),
            (chunk is not None and chunk < cfg.train.prompts_per_step, "generation.batch_size splits each "
             "rollout into several generate calls"),
        ]  # fmt: skip
        return next((why for failed, why in reasons if failed), None)

    def attach_replay(self, source) -> bool:
        """Give the source's engine the tape it records into when `train.replay_rollout_forward` says so:
        null (auto) where every condition holds on a CPU, true where they hold (else a ConfigError naming
        the one that fails), false never. Each step's recording still falls back to the recomputed forward
        when it would exceed its memory budget (model/replay.py)."""
        asked = self.cfg.train.replay_rollout_forward
        if asked is False:
            return False
        why = self.replay_refusal(source)
        if asked is None and why is None and next(self.policy.parameters()).device.type != "cpu":
            # measured on CPUs only, and its budget reads host memory (MemAvailable), not the GPU's
            why = "the policy is not on a CPU (auto replays on CPUs only)"
        if why is not None:
            if asked:
                raise ConfigError(
                    f"train.replay_rollout_forward=true, but {why}. Set it to null (auto) or false."
                )
            log.debug("Replay off: %s.", why)
            return False
        self.replay_tape = source.engine.tape = ReplayTape(cap_bytes=self._recording_cap())
        log.log(  # auto: quiet, as any default
            logging.INFO if asked else logging.DEBUG,
            "Replay: the update reuses the rollout's forward (train.replay_rollout_forward).",
        )
        return True

    def _recording_cap(self) -> int:
        """The most a step's recording may hold: it lives from the rollout through the update's peak, like
        a second micro-batch of activations, so it gets their budget: train.activation_memory_gb, else on
        a CPU 512 MiB (a host's memory is shared; the eos-off matrix cell records 0.48 GiB, Qwen2.5-0.5B
        at 16 × 64 tokens 1.7 GB: it recomputes), on a GPU a third of the memory free."""
        gb = self.cfg.train.activation_memory_gb
        if gb is not None:
            return int(gb * 2**30)
        return default_activation_budget(next(self.policy.parameters()).device)

    def before_rollout(self) -> None:
        """The step's rollout is next: the engine records it (when replay is on)."""
        if self.replay_tape is not None:
            self.replay_tape.arm()

    def _token_budget(self, policy, device: torch.device) -> int:
        t = self.cfg.train
        if t.micro_batch_tokens is not None:
            return t.micro_batch_tokens
        gradient_bytes = sum(p.numel() * 4 for p in policy.parameters() if p.requires_grad)  # float32 masters
        budget = (
            int(t.activation_memory_gb * 2**30)
            if t.activation_memory_gb is not None
            else default_activation_budget(device, gradient_bytes)
        )
        element_bytes = (self.compute_dtype or torch.float32).itemsize
        try:
            per_token = activation_bytes_per_token(
                policy.config,
                element_bytes,
                native=self.policy_forward.kind == "native",
                checkpointing=self.cfg.model.gradient_checkpointing,
                fused_norms=device.type == "cpu" and element_bytes == 4 and kernels.cpu_ops() is not None,
            )
            if self.policy_forward.full_logits:  # float32 logits, log-softmax and its exp per token
                per_token += 3 * 4 * policy.config.vocab_size
        except AttributeError:  # a config without the usual decoder sizes
            return FALLBACK_TOKENS
        return budget_tokens(budget, per_token, device)

    def micro_slices(self, batch: TrainBatch) -> list[slice]:
        """The row slices of `batch` that run as one forward/backward each: at most `micro_batch_size`
        rows when the row knobs set it, and always at most `micro_batch_tokens` (model/micro_batch.py)."""
        cost = PaddedCost(batch, shared_prompts=self.policy_forward.kind == "native")
        slices = plan_micro_batches(cost, self.micro_batch_tokens, self.micro_batch_size)
        if self.rt.active:  # every process runs as many passes as the one that needs the most
            parts = int(self.rt.all_reduce(torch.tensor([len(slices)]), "max").item())
            slices = split_to(slices, cost, parts)
        return slices

    def describe_micro_batches(self) -> str:
        n = self.cfg.completions_per_step
        rows = "" if self.micro_batch_size is None else f"at most {self.micro_batch_size} completions and "
        return (
            f"each optimizer step averages over all {n} completions; micro-batches of {rows}at most "
            f"{self.micro_batch_tokens:,} tokens (train.micro_batch_tokens; a longer completion runs alone)"
        )

    @torch.no_grad()
    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        t = batch.completion_mask.shape[1]
        out = torch.zeros(len(batch), t)
        for rows in self.micro_slices(batch):
            mb = batch.rows(rows).trim()
            logp, _ = self.reference_forward(mb, self.cfg.generation.temperature)
            out[rows, : logp.shape[1]] = logp.float().cpu()
        return out  # [N, T]

    def train_step(self, batch: TrainBatch) -> StepStats:
        """`num_iterations` optimizer steps on `batch`, which is only read. π_old is the batch's own
        (an exact engine's sampling log-probs) or the first pass's log-probs, and comes back in the stats."""
        a, d = self.cfg.algorithm, self.cfg.distributed
        rt = self.rt
        norm = LossNorm(
            num_sequences=int(rt.sum(len(batch))),
            num_tokens=int(rt.sum(batch.loss_mask.sum().item())),
            max_completion_length=self.completion_limit,
        )
        # The first pass fills π_old and, for rollouts of another policy, the importance-weighted
        # advantages; later passes (num_iterations > 1) read them from `work`, a copy of the batch's record.
        old_given = batch.old_logprobs is not None
        old_logprobs = batch.old_logprobs if old_given else torch.zeros_like(batch.completion_mask)  # [N, T]
        reweight = batch.behaviour_logprobs is not None and d.importance_correction != "none"
        advantages = batch.advantages.clone() if reweight else batch.advantages  # [N, T]
        # π_ref = the policy (reference_is_policy) and no reference log-probs given: the first pass's own,
        # detached, are π_ref's (exactly, not to rounding); later passes read them back from `work`.
        own_ref = self.reference_is_policy and self.ref_model is not None and batch.ref_logprobs is None
        ref_logprobs = torch.zeros_like(batch.completion_mask) if own_ref else batch.ref_logprobs  # [N, T]
        work = replace(batch, old_logprobs=old_logprobs, advantages=advantages, ref_logprobs=ref_logprobs)
        sums, weight_sums = _LossSums(), WeightSums()
        grad_norm, skipped, overflow = 0.0, False, False
        slices = self.micro_slices(batch)
        # Replay: the weights are those that sampled the batch during the first (the only) pass
        recording = None if self.replay_tape is None or a.num_iterations != 1 else self.replay_tape.take()
        for iteration in range(a.num_iterations):
            first_pass, loss_finite = iteration == 0, True
            for k, rows in enumerate(slices):
                mb = work.rows(rows).trim()
                rt.set_grad_sync(self.model, k == len(slices) - 1)  # all-reduce once, after the last
                replay = None if recording is None else Replay(recording, rows.start or 0)
                logp, entropy = self.policy_forward(
                    mb, self.cfg.generation.temperature, with_entropy=first_pass, replay=replay
                )
                device = logp.device
                mb_advantages = mb.advantages  # [B, T']
                if first_pass and not old_given:
                    # No update has happened yet in this step: the current policy *is* π_old.
                    old = logp.detach()  # [B, T']
                    old_logprobs[rows, : old.shape[1]] = old.float().cpu()
                    if reweight:
                        mb_advantages, sums_w = weighted_advantages(
                            mb.advantages,
                            old.float().cpu(),
                            mb.behaviour_logprobs,
                            mb.loss_mask,
                            d.importance_correction,
                            d.importance_cap,
                        )
                        advantages[rows, : mb_advantages.shape[1]] = mb_advantages
                        weight_sums = weight_sums + sums_w
                else:
                    old = mb.old_logprobs.to(device)
                mask = mb.loss_mask.to(device)
                if own_ref and first_pass:
                    ref = logp.detach()  # [B, T'] the weights are π_ref's: KL ≡ 0, its gradient exactly 0
                    ref_logprobs[rows, : ref.shape[1]] = ref.float().cpu()
                else:
                    ref = None if mb.ref_logprobs is None else mb.ref_logprobs.to(device)
                out = self.loss(logp, old, ref, mb_advantages.to(device), mask, norm=norm, entropy=entropy)
                scaled = out.loss * rt.loss_scale
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
                loss_finite = loss_finite and math.isfinite(out.loss.item())
                if first_pass:
                    sums.add(out, (entropy.detach() * mask).sum().item())
            grad_norm, step_skipped = self._optimizer_step(loss_finite)
            skipped = skipped or step_skipped
            overflow = overflow or self._overflowed
        if rt.active:  # one all-reduce for every statistic
            local = torch.tensor([*astuple(sums), *astuple(weight_sums)], dtype=torch.float64)
            summed = rt.sum_tensor(local).tolist()
            n = len(astuple(sums))
            sums, weight_sums = _LossSums(*summed[:n]), WeightSums(*summed[n:])
        tokens = max(sums.tokens, 1.0)
        return StepStats(
            loss=sums.loss,
            kl=sums.kl / tokens,
            ratio_mean=sums.ratio / tokens,
            clip_low_frac=sums.clip_low / tokens,
            clip_high_frac=sums.clip_high / tokens,
            entropy=sums.entropy / tokens,
            grad_norm=grad_norm,
            skipped=skipped,
            importance=importance_metrics(weight_sums),
            amp={}
            if self.scaler is None
            else {"amp/loss_scale": float(self.scaler.get_scale()), "amp/overflow": float(overflow)},
            old_logprobs=old_logprobs,
            replay=_replay_metrics(self.replay_tape, recording),
        )

    def _optimizer_step(self, loss_finite: bool = True) -> tuple[float, bool]:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.optim.max_grad_norm or float("inf")
        self._overflowed = False
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip and report the true gradient, not the scaled one
        grad_norm = self.rt.clip_grad_norm(params, max_norm)
        loss_finite = not self.rt.any(not loss_finite)  # every rank skips, or none
        if not (math.isfinite(grad_norm) and loss_finite):
            # A non-finite gradient would poison AdamW's moments for good: drop this update.
            self.optimizer.zero_grad(set_to_none=True)
            if self.scaler is not None:
                self.scaler.update()  # an inf was found while unscaling: the scale halves
                # A float16 gradient overflow with a finite loss is the scaler's normal working (too high a
                # scale), not a failed step, while the scale is still ≥ 1; below 1 the unscaled
                # gradient itself is non-finite, and it counts.
                if loss_finite and self.scaler.get_scale() >= 1.0:
                    self._overflowed = True
                    return grad_norm, False
            self.nonfinite_in_a_row += 1
            return grad_norm, True
        self.nonfinite_in_a_row = 0
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        # AdamW moves no weight on a zero gradient without weight decay (its moments stay 0, as they were
        # while the weights were π_ref's): a step with no signal keeps π_ref = the policy.
        moved = grad_norm != 0.0 or any(g["weight_decay"] != 0 for g in self.optimizer.param_groups)
        self.reference_is_policy = self.reference_is_policy and not moved
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.policy_forward.forget_casts()  # the masters moved: their compute-dtype casts are stale
        self._check_finite(params)
        return grad_norm, False

    def _check_finite(self, params: list[torch.Tensor]) -> None:
        """Stop the run if an update left NaN/inf weights (no finished run, no checkpoint, may hold them)."""
        local = [p.to_local() if hasattr(p, "to_local") else p for p in params]  # FSDP2: this rank's shard
        norms = [torch.linalg.vector_norm(p.detach()).to(local[0].device) for p in local]
        finite = not norms or bool(torch.stack(norms).isfinite().all())  # one host sync
        if self.rt.any(not finite):
            raise NonFiniteWeightsError(
                "The policy's weights became NaN/inf in an optimizer step; stopped before saving them. "
                "Checkpoints saved earlier are intact. Lower optim.learning_rate, keep "
                "optim.max_grad_norm set, or train in float32 or bfloat16 (model.dtype)."
            )

    def state_dict(self) -> dict:
        state = {
            "optimizer": self.rt.optimizer_state(self.model, self.optimizer),
            "scheduler": self.scheduler.state_dict(),
            "reference_is_policy": self.reference_is_policy,
        }
        if self.scaler is not None:
            state["grad_scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.rt.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.reference_is_policy = bool(state.get("reference_is_policy", False))  # older checkpoints: not
        if self.scaler is not None and "grad_scaler" in state:
            self.scaler.load_state_dict(state["grad_scaler"])
        self._use_configured_hyperparameters()

    def _use_configured_hyperparameters(self) -> None:
        """The checkpoint's optimizer and scheduler state carry the learning rate, betas, eps and weight
        decay they were saved with; this run's config wins (they are equal unless the resume was allowed
        to change them: train.allow_config_change). Moments and step counts stay as saved."""
        o, scheduler = self.cfg.optim, self.scheduler
        for group in self.optimizer.param_groups:
            group.update(
                initial_lr=o.learning_rate,
                betas=(o.adam_beta1, o.adam_beta2),
                eps=o.adam_epsilon,
                weight_decay=o.weight_decay,
            )
        scheduler.base_lrs = [o.learning_rate] * len(self.optimizer.param_groups)
        for group, factor in zip(self.optimizer.param_groups, scheduler.lr_lambdas, strict=True):
            group["lr"] = o.learning_rate * factor(scheduler.last_epoch)  # the schedule at the step reached
        scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]
