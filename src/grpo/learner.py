"""The policy's optimisation step: micro-batched forward/backward of the GRPO loss, then AdamW.

A step sees one TrainBatch (P × G completions). It makes `num_iterations` optimizer steps over it;
each splits the rows into micro-batches whose loss contributions sum to the full-batch loss
(`LossNorm` carries the global normalisers), so `micro_batch_size` changes memory, not the update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from grpo.algorithm.loss import LossNorm, grpo_loss
from grpo.config import GRPOConfig
from grpo.distributed.runtime import Runtime
from grpo.model.decoder import NativeDecoder, unsupported_reason
from grpo.model.loading import autocast, resolve_dtype
from grpo.model.memory import release_large_frees
from grpo.model.packed import ChunkedTokenLogprobs, plain_lm_head, shared_prompt_logprobs
from grpo.records import TrainBatch


class NonFiniteWeightsError(RuntimeError):
    """The policy's weights hold NaN/inf after an optimizer step: training cannot go on from here."""


def token_logprobs(
    model,
    batch: TrainBatch,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    compute_dtype: torch.dtype | None = None,
):
    """log π(completion token | prefix) for every completion position: [N, T] (and entropy [N, T],
    differentiable when `entropy_grad`, for the entropy bonus).

    A plain Hugging Face model runs its decoder here and its LM head in row chunks (`ChunkedTokenLogprobs`,
    logits recomputed chunk by chunk in backward), so no [N, T, vocab] tensor exists: 0.6 GB per copy for
    16 × 64 tokens of a 151,936-token vocabulary. Wrapped models (DDP/FSDP2, peft), heads that rescale
    their logits, autocast, and the entropy bonus's differentiable entropy take the model's own
    full-logits forward."""
    width = batch.prompt_width
    t = batch.input_ids.shape[1] - width
    device = next(model.parameters()).device
    inputs = {
        "input_ids": batch.input_ids.to(device),
        "attention_mask": batch.attention_mask.to(device),
        "position_ids": batch.position_ids.to(device),
        "use_cache": False,
    }
    targets = batch.input_ids[:, width:].to(device)  # [N, T]
    # Under autocast the head's backward would mix dtypes: the model's own forward handles that case.
    mixed = compute_dtype not in (None, torch.float32) or torch.is_autocast_enabled(device.type)
    head = None if entropy_grad or mixed else plain_lm_head(model)
    if head is not None:
        hidden = model.get_decoder()(**inputs).last_hidden_state[:, width - 1 : -1]  # [N, T, d]
        n, d = hidden.shape[0], hidden.shape[-1]
        logp, entropy = ChunkedTokenLogprobs.apply(
            hidden.reshape(n * t, d), head.weight, targets.reshape(-1), temperature, with_entropy
        )  # [N·T]
        return logp.view(n, t), (entropy.view(n, t) if with_entropy else None)
    with autocast(device, compute_dtype):
        out = model(
            **inputs, logits_to_keep=t + 1
        )  # the lm head runs only where completion tokens are predicted
    logits = out.logits[:, :-1].float() / temperature  # [N, T, V]
    logp_all = torch.log_softmax(logits, dim=-1)  # [N, T, V]
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)  # [N, T]
    if not (with_entropy or entropy_grad):
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp_all.exp() * logp_all).sum(-1)  # [N, T]
    return logp, entropy


def logprob_function(
    model, native: bool, gradient_checkpointing: bool = False, compute_dtype: torch.dtype | None = None
):
    """`fn(batch, temperature, with_entropy)` for this model: the native shared-prompt forward when asked
    for and the architecture is supported, else the transformers forward; both compute in
    `compute_dtype` (None: the weights' dtype)."""
    if native and unsupported_reason(model) is None:
        decoder = NativeDecoder(model, compute_dtype)
        decoder.gradient_checkpointing = gradient_checkpointing
        return lambda batch, temperature, with_entropy=False: shared_prompt_logprobs(
            decoder, batch, temperature, with_entropy
        )
    return lambda batch, temperature, with_entropy=False: token_logprobs(
        model, batch, temperature, with_entropy, compute_dtype=compute_dtype
    )


def trim(batch: TrainBatch) -> TrainBatch:
    """Drop completion columns that are padding in every row of this micro-batch."""
    longest = int(batch.completion_mask.sum(-1).max().item()) if len(batch) else 0
    keep = batch.prompt_width + max(longest, 1)
    cols = slice(0, max(longest, 1))
    pick = lambda x: None if x is None else x[:, cols]
    return TrainBatch(
        input_ids=batch.input_ids[:, :keep],
        attention_mask=batch.attention_mask[:, :keep],
        prompt_width=batch.prompt_width,
        completion_mask=batch.completion_mask[:, cols],
        advantages=batch.advantages[:, cols],
        group_ids=batch.group_ids,
        ref_logprobs=pick(batch.ref_logprobs),
        old_logprobs=pick(batch.old_logprobs),
        behaviour_logprobs=pick(batch.behaviour_logprobs),
    )


def micro_batches(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def lr_lambda(warmup: int, total: int, schedule: str):
    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return 1.0 - progress
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return factor


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
        }


class Learner:
    def __init__(
        self, policy, ref_model, cfg: GRPOConfig, total_optimizer_steps: int, runtime: Runtime | None = None
    ):
        self.policy, self.ref_model, self.cfg = policy, ref_model, cfg
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
        forward_dtype = None if self.rt.sharded else self.compute_dtype
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
        self.micro_batch_size = cfg.resolved_micro_batch_size
        self.nonfinite_in_a_row = 0
        self._overflowed = False
        # The native forward reads parameters directly, skipping module hooks: DDP and FSDP2 rely on their
        # wrapper's forward, so several processes train through the transformers forward.
        native = cfg.generation.engine != "transformers" and not self.rt.active
        self._forward_dtype = forward_dtype
        self._policy_logprob_fn = logprob_function(
            self.model, native, cfg.model.gradient_checkpointing, forward_dtype
        )
        self._ref_logprob_fn = None if ref_model is None else logprob_function(ref_model, native)

    @torch.no_grad()
    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        t = batch.completion_mask.shape[1]
        out = torch.zeros(len(batch), t)
        for rows in micro_batches(len(batch), self.micro_batch_size):
            mb = trim(batch.rows(rows))
            logp, _ = self._ref_logprob_fn(mb, self.cfg.generation.temperature)
            out[rows, : logp.shape[1]] = logp.float().cpu()
        return out  # [N, T]

    def train_step(self, batch: TrainBatch) -> StepStats:
        a = self.cfg.algorithm
        rt = self.rt
        norm = LossNorm(
            num_sequences=int(rt.sum(len(batch))),
            num_tokens=int(rt.sum(batch.completion_mask.sum().item())),
            max_completion_length=self.cfg.effective_max_new_tokens,
        )
        # π_old may arrive as the engine's sampling log-probs (exact engine); else the first pass records it.
        old_given = batch.old_logprobs is not None
        if not old_given:
            batch.old_logprobs = torch.zeros_like(batch.completion_mask)
        totals: dict[str, float] = {}
        grad_norm, skipped, overflow = 0.0, False, False
        for iteration in range(a.num_iterations):
            first_pass, loss_finite = iteration == 0, True
            slices = micro_batches(len(batch), self.micro_batch_size)
            for k, rows in enumerate(slices):
                mb = trim(batch.rows(rows))
                rt.set_grad_sync(self.model, k == len(slices) - 1)  # all-reduce once, after the last
                if a.entropy_coef != 0:  # the bonus needs entropy with a gradient: the transformers forward
                    logp, entropy = token_logprobs(
                        self.model,
                        mb,
                        self.cfg.generation.temperature,
                        with_entropy=first_pass,
                        entropy_grad=True,
                        compute_dtype=self._forward_dtype,
                    )
                else:
                    logp, entropy = self._policy_logprob_fn(
                        mb, self.cfg.generation.temperature, with_entropy=first_pass
                    )
                device = logp.device
                if first_pass and not old_given:
                    # No update has happened yet in this step: the current policy *is* π_old.
                    old = logp.detach()
                    batch.old_logprobs[rows, : old.shape[1]] = old.float().cpu()
                    if mb.behaviour_logprobs is not None:
                        mb.advantages = self._importance_weighted(batch, rows, mb, old.float().cpu(), totals)
                else:
                    old = mb.old_logprobs.to(device)
                mask = mb.completion_mask.to(device)
                out = grpo_loss(
                    logp,
                    old,
                    None if mb.ref_logprobs is None else mb.ref_logprobs.to(device),
                    mb.advantages.to(device),
                    mask,
                    variant=a.loss_variant,
                    clip_low=a.epsilon_low,
                    clip_high=a.epsilon_high,
                    beta=a.beta,
                    kl_estimator=a.kl_estimator,
                    aggregation=a.loss_aggregation,
                    norm=norm,
                    entropy=entropy,
                    entropy_coef=a.entropy_coef,
                    kl_bias_correction=a.use_bias_correction_kl,
                    variant_options={
                        "temperature_pos": a.sapo_temperature_pos,
                        "temperature_neg": a.sapo_temperature_neg,
                    },
                )
                scaled = out.loss * rt.loss_scale
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
                loss_finite = loss_finite and math.isfinite(out.loss.item())
                if first_pass:
                    _add(
                        totals,
                        loss=out.loss.item(),
                        kl=out.kl_sum.item(),
                        ratio=out.ratio_sum.item(),
                        clip_low=out.clipped_low_sum.item(),
                        clip_high=out.clipped_high_sum.item(),
                        entropy=(entropy.detach() * mask).sum().item(),
                        tokens=out.num_tokens.item(),
                    )
            grad_norm, step_skipped = self._optimizer_step(loss_finite)
            skipped = skipped or step_skipped
            overflow = overflow or self._overflowed
        if rt.active:
            keys = sorted(totals)
            summed = rt.sum_tensor(torch.tensor([totals[k] for k in keys], dtype=torch.float64))
            totals = dict(zip(keys, summed.tolist(), strict=True))
        tokens = max(totals.get("tokens", 0.0), 1.0)
        return StepStats(
            loss=totals.get("loss", 0.0),
            kl=totals.get("kl", 0.0) / tokens,
            ratio_mean=totals.get("ratio", 0.0) / tokens,
            clip_low_frac=totals.get("clip_low", 0.0) / tokens,
            clip_high_frac=totals.get("clip_high", 0.0) / tokens,
            entropy=totals.get("entropy", 0.0) / tokens,
            grad_norm=grad_norm,
            skipped=skipped,
            importance=_importance_stats(totals),
            amp={}
            if self.scaler is None
            else {"amp/loss_scale": float(self.scaler.get_scale()), "amp/overflow": float(overflow)},
        )

    def _importance_weighted(
        self, batch: TrainBatch, rows: slice, mb: TrainBatch, old: torch.Tensor, totals: dict[str, float]
    ) -> torch.Tensor:
        """Rollouts from another policy (an older one in async mode; vLLM's numerics): weight each token's
        advantage by π_old / π_behaviour (`importance_weights`: per token or per sequence, truncated or
        masked at importance_cap), so the surrogate still estimates the gradient at π_old. The weighted
        advantages are written back for later passes."""
        d = self.cfg.distributed
        mask = mb.completion_mask  # [B, T]
        if d.importance_correction == "none":
            return mb.advantages
        log_ratio = (old - mb.behaviour_logprobs) * mask  # [B, T]
        w, over = importance_weights(log_ratio, mask, d.importance_correction, d.importance_cap)  # [B, T] ×2
        weighted = mb.advantages * w  # [B, T]
        batch.advantages[rows, : weighted.shape[1]] = weighted
        _add(
            totals,
            is_w=(w * mask).sum().item(),
            is_w2=(w.square() * mask).sum().item(),
            is_clipped=(over.float() * mask).sum().item(),
            is_tokens=mask.sum().item(),
        )
        return weighted

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
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
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
        }
        if self.scaler is not None:
            state["grad_scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.rt.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and "grad_scaler" in state:
            self.scaler.load_state_dict(state["grad_scaler"])


def importance_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, mode: str, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights w = π_old / π_behaviour from log_ratio = log π_old − log π_behaviour [B, T] (0 off
    the mask), and where the raw weight exceeded `cap` [B, T] bool.

    token_* (tis = token_truncate): one weight per token, exp(log_ratio). sequence_*: one weight per
    completion, the product of its token ratios exp(Σ_t log_ratio), on each of its tokens. *_truncate:
    min(w, cap) (truncated IS); *_mask: w where w ≤ cap, else 0 (the token or sequence drops out).
    Computed in log space, so a long sequence's product cannot overflow."""
    level, _, how = ("token_truncate" if mode == "tis" else mode).partition("_")
    log_w = log_ratio * mask  # [B, T]
    if level == "sequence":
        log_w = log_w.sum(-1, keepdim=True).expand_as(log_ratio)  # [B, T]
    log_cap = math.log(cap)
    over = log_w > log_cap  # [B, T]
    if how == "truncate":
        w = log_w.clamp(max=log_cap).exp()  # [B, T]
    else:
        w = torch.where(over, torch.zeros_like(log_w), log_w.exp())  # [B, T]
    return w * mask, over & (mask > 0)


def mismatch_metrics(
    sampling_logprobs: torch.Tensor, policy_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """How far the sampler's log-probs [N, T] are from the learner's π_old [N, T] on the masked tokens:
    mean and max |Δ| and the k3 estimate of KL(π_sampler ‖ π_old), E[exp(Δ) − Δ − 1] with
    Δ = log π_old − log π_sampler (tokens drawn from the sampler, so the estimate is unbiased)."""
    n = mask.sum()
    if n == 0:
        return {}
    delta = (policy_logprobs - sampling_logprobs) * mask  # [N, T]
    k3 = (torch.expm1(delta) - delta) * mask  # [N, T]; expm1: no rounding below 0 for tiny Δ
    return {
        "mismatch/logp_abs_mean": (delta.abs().sum() / n).item(),
        "mismatch/logp_abs_max": delta.abs().max().item(),
        "mismatch/kl": (k3.sum() / n).item(),
    }


def _importance_stats(totals: dict[str, float]) -> dict[str, float]:
    """Kish effective sample size of the token weights, as a fraction: (Σw)² / (n Σw²) ∈ (0, 1]."""
    n = totals.get("is_tokens", 0.0)
    if not n:
        return {}
    return {
        "is/ess": totals["is_w"] ** 2 / (n * max(totals["is_w2"], 1e-12)),
        "is/weight_mean": totals["is_w"] / n,
        "is/clipped_frac": totals["is_clipped"] / n,
    }


def _add(totals: dict[str, float], **values: float) -> None:
    for k, v in values.items():
        totals[k] = totals.get(k, 0.0) + v
