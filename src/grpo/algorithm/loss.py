"""The GRPO objective: pure functions on per-token log-probs, no model, no optimiser.

    ℓ_t = -min(ρ_t Â_t, clip(ρ_t, 1 - ε_low, 1 + ε_high) Â_t) + β · KL_t,   ρ_t = π_θ / π_old

Each choice lives in one dict and a new variant is one more entry there:
POLICY_LOSSES (how the ratio is formed and clipped), KL_ESTIMATORS (k1/k2/k3),
LOSS_AGGREGATIONS (how per-token losses become one scalar). `make_policy_loss` binds every option of the
algorithm settings once, so the learner calls the loss with the tensors and the batch's normalisers only; a
policy loss's own keyword options are read from the settings fields named `<variant>_<option>` (SAPO's
`temperature_pos` from `algorithm.sapo_temperature_pos`).

Aggregations are written so that micro-batching is only a memory knob: every normaliser is a
*global* count of the whole optimisation batch (`LossNorm`), so a micro-batch returns its
additive contribution and the contributions of any split of the rows sum to the full-batch loss
(and their gradients to the full-batch gradient). See docs/algorithm.md for sources.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol, TypeVar

import torch
from torch import Tensor

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "LossNorm",
    "LossOutput",
    "PolicyLoss",
    "RatioStats",
    "apply_truncation_mask",
    "cispo_policy_loss",
    "clipped_surrogate",
    "grpo_loss",
    "kl_penalty",
    "make_policy_loss",
    "per_token_policy_loss",
    "sapo_policy_loss",
    "sequence_policy_loss",
]

_T = TypeVar("_T")


def _lookup(registry: Mapping[str, _T], name: str, what: str) -> _T:
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; valid: {sorted(registry)}")
    return registry[name]


# ---------------------------------------------------------------------------------------------
# KL(π_θ ‖ π_ref) per token, from samples of π_θ (Schulman, "Approximating KL divergence", 2020).
# Each estimator is a function of Δ = log π_ref - log π_θ only.


def _kl_k1(delta: Tensor) -> Tensor:
    return -delta  # [B, T] unbiased, but negative on some tokens: high variance


def _kl_k2(delta: Tensor) -> Tensor:
    return 0.5 * delta.square()  # [B, T] biased, low variance, always >= 0


def _kl_k3(delta: Tensor) -> Tensor:
    # exp(Δ) - Δ - 1: unbiased and always >= 0. expm1 keeps precision when Δ ≈ 0, the usual
    # case near the reference, where exp(Δ) - 1 would cancel catastrophically.
    return torch.expm1(delta) - delta  # [B, T]


KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "k1": _kl_k1,
    "k2": _kl_k2,
    "k3": _kl_k3,  # default, as in DeepSeekMath eq. 4
}


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref); logp, ref_logp: [B, T] -> [B, T]."""
    estimate = _lookup(KL_ESTIMATORS, estimator, "KL estimator")
    return estimate(ref_logp - logp)  # [B, T]


# ---------------------------------------------------------------------------------------------
# Policy-gradient surrogates.


class RatioStats(NamedTuple):
    """What a policy loss reports about its ratio, per token (undetached, unmasked)."""

    ratio: Tensor  # [B, T] the ratio the clip was applied to
    clipped_low: Tensor  # [B, T] bool: ρ < 1 - ε_low and Â < 0 (gradient cut by the clip)
    clipped_high: Tensor  # [B, T] bool: ρ > 1 + ε_high and Â > 0


class PolicyLoss(Protocol):
    """Contract of a POLICY_LOSSES entry. grpo_loss calls it with keywords only, so an entry that
    needs no sequence context (the token-level "grpo") may take `mask` last and optional; one that
    does (a sequence-level ratio, GSPO) uses it to average log-ratios over completion tokens. Options of
    one variant (SAPO's temperatures) arrive as further keywords, which the others ignore."""

    def __call__(
        self,
        *,
        logp: Tensor,
        old_logp: Tensor,
        advantages: Tensor,
        mask: Tensor,
        clip_low: float,
        clip_high: float,
        **options: float,
    ) -> tuple[Tensor, RatioStats]: ...


def clipped_surrogate(
    ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, RatioStats]:
    """PPO's pessimistic clipped objective per token, −min(ρ Â, clip(ρ, 1 − ε_low, 1 + ε_high) Â), for any
    ratio ρ [B, T] (per token, or one per sequence broadcast) and advantages Â [B, T]. Returns the loss
    [B, T] (unmasked) and RatioStats: which tokens the clip cut off from the gradient."""
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [B, T]
    # The clip only ever removes incentive, never adds it, so a token already moved past the trust region
    # in the advantage's direction gets no more gradient.
    loss = -torch.minimum(ratio * advantages, clipped_ratio * advantages)  # [B, T]
    clipped_low = (ratio < 1.0 - clip_low) & (advantages < 0)  # [B, T]
    clipped_high = (ratio > 1.0 + clip_high) & (advantages > 0)  # [B, T]
    return loss, RatioStats(ratio, clipped_low, clipped_high)


def per_token_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    mask: Tensor | None = None,
    **_options: float,
) -> tuple[Tensor, RatioStats]:
    """PPO's clipped surrogate on a per-token ratio (GRPO, DeepSeekMath eq. 3).

    logp, old_logp, advantages: [B, T]. Returns the per-token loss [B, T] (unmasked) and RatioStats.
    clip_high > clip_low is DAPO's clip-higher. `mask` is accepted for the PolicyLoss contract and
    not needed: every token's ratio stands alone.
    """
    del mask  # PolicyLoss contract; see the docstring
    return clipped_surrogate(torch.exp(logp - old_logp), advantages, clip_low, clip_high)  # [B, T]


def sequence_policy_loss(
    *,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    **_options: float,
) -> tuple[Tensor, RatioStats]:
    """GSPO (arXiv 2507.18071, eq. 5-7): PPO's clip on one length-normalised ratio per completion,

        s_i = exp( (1/|o_i|) Σ_t (log π_θ − log π_old) ),

    written on every token of the row, so aggregating with "sequence_mean" gives the paper's
    (1/G) Σ_i min(s_i Â_i, clip(s_i) Â_i). The advantage is the row's (first token's) value: GSPO has
    one advantage per sequence. Returns the per-token loss [B, T] and RatioStats with s_i broadcast.
    """
    length = mask.sum(-1).clamp(min=1)  # [B]
    log_ratio = ((logp - old_logp) * mask).sum(-1) / length  # [B] mean token log-ratio
    ratio = torch.exp(log_ratio)[:, None].expand_as(logp)  # [B, T] s_i on every token
    advantage = advantages[:, :1].expand_as(logp)  # [B, T]
    return clipped_surrogate(ratio, advantage, clip_low, clip_high)  # [B, T]


def cispo_policy_loss(
    *,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 4.0,
    **_options: float,
) -> tuple[Tensor, RatioStats]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): clip the importance weight, not the update,

        ℓ_t = −sg(min(ρ_t, 1 + ε_high)) · Â_t · log π_θ(o_t),

    a REINFORCE term weighted by the capped, detached ratio, so every token keeps a gradient (PPO's clip
    zeroes it for tokens past the trust region). No lower cap (clip_low is unused), as in MiniMax-M1's
    experiments and TRL's loss_type="cispo", whose `epsilon_high` is the cap itself (= our 1 + ε_high).
    Returns the per-token loss [B, T] and RatioStats (clipped_high: ρ above the cap, Â > 0).
    """
    del mask, clip_low  # PolicyLoss contract: CISPO caps from above only, per token
    ratio = torch.exp(logp - old_logp)  # [B, T]
    weight = ratio.clamp(max=1.0 + clip_high).detach()  # [B, T]
    loss = -weight * advantages * logp  # [B, T]
    clipped_high = (ratio > 1.0 + clip_high) & (advantages > 0)  # [B, T]
    return loss, RatioStats(ratio, torch.zeros_like(clipped_high), clipped_high)


def sapo_policy_loss(
    *,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    temperature_pos: float = 1.0,
    temperature_neg: float = 1.05,
    **_options: float,
) -> tuple[Tensor, RatioStats]:
    """SAPO (Soft Adaptive Policy Optimization, arXiv 2511.20347): a smooth gate in place of the clip,

        ℓ_t = −f(ρ_t) · Â_t,   f(ρ) = σ(τ (ρ − 1)) · 4 / τ,   τ = τ_pos if Â_t > 0 else τ_neg,

    f(1) = 2/τ and f'(ρ) = 4σ(1 − σ) = 1 at ρ = 1: on-policy the gradient is the plain policy gradient,
    off-policy it fades smoothly instead of dropping to zero. τ_neg > τ_pos fades negative-advantage
    tokens faster (the paper's asymmetric temperatures; TRL's defaults 1.05 and 1.0). clip_low and
    clip_high are unused. Returns the per-token loss [B, T] and RatioStats with no clipped tokens.
    """
    del mask, clip_low, clip_high  # PolicyLoss contract: SAPO's gate replaces the clip
    ratio = torch.exp(logp - old_logp)  # [B, T]
    tau = torch.where(advantages > 0, temperature_pos, temperature_neg)  # [B, T]
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau  # [B, T]
    loss = -gate * advantages  # [B, T]
    none = torch.zeros_like(ratio, dtype=torch.bool)  # [B, T]
    return loss, RatioStats(ratio, none, none)


POLICY_LOSSES: dict[str, PolicyLoss] = {
    "grpo": per_token_policy_loss,
    "gspo": sequence_policy_loss,
    "cispo": cispo_policy_loss,
    "sapo": sapo_policy_loss,
}


# ---------------------------------------------------------------------------------------------
# Aggregation: per-token losses -> this micro-batch's additive share of the batch loss.


@dataclass(frozen=True)
class LossNorm:
    """Normalisers counted over the whole optimisation batch, never over one micro-batch."""

    num_sequences: int  # completions in the batch, including fully masked ones
    num_tokens: int  # mask.sum() over the whole batch
    max_completion_length: int  # the configured generation limit (Dr. GRPO's constant)

    def __post_init__(self) -> None:
        if self.num_sequences < 1 or self.max_completion_length < 1 or self.num_tokens < 0:
            raise ValueError(f"invalid loss normalisers: {self}")

    @classmethod
    def from_mask(cls, mask: Tensor, max_completion_length: int | None = None) -> LossNorm:
        """Normalisers of a full batch mask [B, T]; the generation limit defaults to T."""
        return cls(
            num_sequences=mask.shape[0],
            num_tokens=int(mask.sum()),
            max_completion_length=mask.shape[-1] if max_completion_length is None else max_completion_length,
        )


def _sequence_mean(per_token: Tensor, mask: Tensor, norm: LossNorm) -> Tensor:
    # Paper GRPO: mean over each completion's tokens, then over completions. Long completions get
    # less weight per token (the length bias Dr. GRPO and DAPO point out).
    row_sum = (per_token * mask).sum(-1)  # [B]
    row_len = mask.sum(-1).clamp(min=1)  # [B] a fully masked row has sum 0: 0 / 1, not 0 / 0
    return (row_sum / row_len).sum() / norm.num_sequences  # []


def _token_mean(per_token: Tensor, mask: Tensor, norm: LossNorm) -> Tensor:
    # DAPO token-level loss: every completion token in the optimisation batch weighs the same (TRL's
    # loss_type="dapo"; TRL's "bnpo" divides by each micro-batch's own token count, equal with one
    # micro-batch).
    return (per_token * mask).sum() / max(norm.num_tokens, 1)  # []


def _constant(per_token: Tensor, mask: Tensor, norm: LossNorm) -> Tensor:
    # Dr. GRPO: a normaliser that depends on no sampled length, so no length bias at all.
    return (per_token * mask).sum() / (norm.num_sequences * norm.max_completion_length)  # []


LOSS_AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, LossNorm], Tensor]] = {
    "sequence_mean": _sequence_mean,
    "token_mean": _token_mean,
    "constant": _constant,
}


# ---------------------------------------------------------------------------------------------
# The whole objective.


@dataclass
class LossOutput:
    """One micro-batch's loss contribution and detached statistics kept as sums with counts,
    so the caller adds them across micro-batches (and processes) before dividing."""

    loss: Tensor  # [] differentiable contribution to the batch loss
    kl_sum: Tensor  # [] Σ mask·KL (0 without a reference)
    ratio_sum: Tensor  # [] Σ mask·ρ
    clipped_low_sum: Tensor  # [] masked tokens with ρ < 1 - ε_low, Â < 0
    clipped_high_sum: Tensor  # [] masked tokens with ρ > 1 + ε_high, Â > 0
    num_tokens: Tensor  # [] Σ mask, the count for all the sums above


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    variant: str = "grpo",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    aggregation: str = "sequence_mean",
    norm: LossNorm,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    kl_bias_correction: bool = False,
    variant_options: Mapping[str, float] | None = None,
) -> LossOutput:
    """Clipped surrogate + β·KL − c·entropy for one micro-batch; see the module docstring.

    logp:       [B, T] log π_θ of the completion tokens (the only input gradients flow into).
    old_logp:   [B, T] log-probs of the policy that generated the rollout (π_old).
    ref_logp:   [B, T] log π_ref, or None when beta == 0 (no reference model is loaded).
    advantages: [B, T] per-token advantages (a group advantage broadcast, or discounted).
    mask:       [B, T] 1 on completion tokens that count.
    norm:       normalisers of the whole optimisation batch (LossNorm.from_mask on the full mask).
    entropy:    [B, T] per-token entropy of π_θ (with gradient) when entropy_coef != 0: the bonus
                −c·H_t is added to every token's loss and aggregated like the rest.
    kl_bias_correction: multiply the KL term by the (differentiable) importance ratio ρ the policy loss
                formed, so its gradient is that of KL(π_θ ‖ π_ref) also off-policy (DeepSeek-V3.2,
                arXiv 2512.02556; TRL's use_bias_correction_kl). It changes the gradient on-policy too: ρ = 1
                but ∂ρ/∂θ = ρ ∂log π_θ/∂θ adds KL_t·∇log π_θ.
    variant_options: keyword options of the policy loss (SAPO: temperature_pos, temperature_neg).
    """
    if entropy_coef != 0 and entropy is None:
        raise ValueError(f"entropy_coef={entropy_coef} needs the per-token entropy")
    policy_loss = _lookup(POLICY_LOSSES, variant, "policy loss variant")
    estimate_kl = _lookup(KL_ESTIMATORS, kl_estimator, "KL estimator")
    aggregate = _lookup(LOSS_AGGREGATIONS, aggregation, "loss aggregation")
    if not (0.0 <= clip_low < 1.0 and clip_high >= 0.0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if ref_logp is None and beta != 0:
        raise ValueError(f"beta={beta} needs ref_logp; pass the reference log-probs or set beta=0")
    others = {"old_logp": old_logp, "ref_logp": ref_logp, "advantages": advantages, "mask": mask}
    for name, tensor in others.items():
        # A [B] advantage would broadcast along T without complaint (and silently wrongly if B == T).
        if tensor is not None and tensor.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, logp has {tuple(logp.shape)}")

    mask_f = mask.to(logp.dtype)  # [B, T]
    # π_old, π_ref and Â are constants of the objective: detaching here means a caller passing
    # old_logp = logp (num_iterations = 1) cannot leak a second gradient path through the ratio.
    per_token, ratio_stats = policy_loss(
        logp=logp,
        old_logp=old_logp.detach(),
        advantages=advantages.detach(),
        mask=mask_f,
        clip_low=clip_low,
        clip_high=clip_high,
        **(variant_options or {}),
    )  # [B, T]
    kl = estimate_kl(ref_logp.detach() - logp) if ref_logp is not None else torch.zeros_like(logp)  # [B, T]
    if beta != 0:
        penalty = kl * ratio_stats.ratio if kl_bias_correction else kl  # [B, T]
        per_token = per_token + beta * penalty  # [B, T]
    if entropy_coef != 0:
        per_token = per_token - entropy_coef * entropy  # [B, T] higher entropy lowers the loss
    loss = aggregate(per_token, mask_f, norm)  # []

    with torch.no_grad():
        return LossOutput(
            loss=loss,
            kl_sum=(kl * mask_f).sum(),  # []
            ratio_sum=(ratio_stats.ratio * mask_f).sum(),  # []
            clipped_low_sum=(ratio_stats.clipped_low * mask_f).sum(),  # []
            clipped_high_sum=(ratio_stats.clipped_high * mask_f).sum(),  # []
            num_tokens=mask_f.sum(),  # []
        )


# The arguments every policy loss takes (PolicyLoss); any other keyword parameter is the variant's option.
_CONTRACT = frozenset({"logp", "old_logp", "advantages", "mask", "clip_low", "clip_high"})


def variant_options(policy_loss: PolicyLoss) -> tuple[str, ...]:
    """The keyword options a policy loss declares beyond the shared contract (SAPO: its temperatures)."""
    return tuple(
        name
        for name, parameter in inspect.signature(policy_loss).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY and name not in _CONTRACT
    )


def make_policy_loss(algorithm) -> Callable[..., LossOutput]:
    """`grpo_loss` with every option of the algorithm settings (config's `algorithm` section) bound once:
    call it as `loss(logp, old_logp, ref_logp, advantages, mask, norm=..., entropy=...)`.

    A variant's own options come from the fields `<variant>_<option>`, so a new loss with options is its
    function, its POLICY_LOSSES entry and its fields; nothing in the learner changes."""
    variant = algorithm.loss_variant
    policy_loss = _lookup(POLICY_LOSSES, variant, "policy loss variant")
    missing = [
        f"{variant}_{name}"
        for name in variant_options(policy_loss)
        if not hasattr(algorithm, f"{variant}_{name}")
    ]
    if missing:
        raise ValueError(f"policy loss {variant!r} reads settings that do not exist: {', '.join(missing)}")
    return functools.partial(
        grpo_loss,
        variant=variant,
        clip_low=algorithm.epsilon_low,
        clip_high=algorithm.epsilon_high,
        beta=algorithm.beta,
        kl_estimator=algorithm.kl_estimator,
        aggregation=algorithm.loss_aggregation,
        entropy_coef=algorithm.entropy_coef,
        kl_bias_correction=algorithm.use_bias_correction_kl,
        variant_options={
            name: getattr(algorithm, f"{variant}_{name}") for name in variant_options(policy_loss)
        },
    )


def apply_truncation_mask(mask: Tensor, truncated: Tensor) -> Tensor:
    """Zero the mask rows of completions cut off by the length limit (DAPO's overlong filtering:
    a truncated answer's reward judges text the model never finished). mask [B, T], truncated [B]."""
    return mask.masked_fill(truncated.bool()[:, None], 0)  # [B, T]
