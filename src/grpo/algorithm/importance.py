"""Off-policy correction: importance weights π_old / π_behaviour, their effective sample size, and how far
the sampler's log-probs are from the learner's. Pure tensor functions, no model.

Rollouts can come from a policy other than π_old: an older one (async rollouts lag the learner) or the same
weights under another engine's numerics (vLLM). Weighting each token's advantage by w = π_old / π_behaviour
keeps the surrogate an estimate of the gradient at π_old; capping w (truncated IS, Ionides 2008; "TIS" in
Yao et al. 2025) trades a little bias for bounded variance. See docs/algorithm.md.
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass

import torch
from torch import Tensor

__all__ = [
    "CORRECTIONS",
    "WeightSums",
    "importance_metrics",
    "importance_weights",
    "kish_ess",
    "mismatch_metrics",
    "sampler_ess",
    "weighted_advantages",
]

# distributed.importance_correction's choices: "tis" is token_truncate's short name; "none" turns the
# correction off (the learner then applies no weights).
CORRECTIONS = ("tis", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none")


def importance_weights(log_ratio: Tensor, mask: Tensor, mode: str, cap: float) -> tuple[Tensor, Tensor]:
    """Importance weights w = π_old / π_behaviour from log_ratio = log π_old − log π_behaviour [B, T] (0 off
    the mask), and where the raw weight exceeded `cap` [B, T] bool.

    token_* (tis = token_truncate): one weight per token, exp(log_ratio). sequence_*: one weight per
    completion, the product of its token ratios exp(Σ_t log_ratio), on each of its tokens. *_truncate:
    min(w, cap) (truncated IS); *_mask: w where w ≤ cap, else 0 (the token or sequence drops out).
    Computed in log space, so a long sequence's product cannot overflow."""
    if mode not in CORRECTIONS or mode == "none":
        raise ValueError(f"unknown importance correction {mode!r}; valid: {CORRECTIONS[:-1]}")
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


@dataclass(frozen=True)
class WeightSums:
    """Masked sums over importance weights, additive across micro-batches and processes."""

    w: float = 0.0  # Σ w
    w2: float = 0.0  # Σ w²
    clipped: float = 0.0  # tokens whose raw weight exceeded the cap
    tokens: float = 0.0  # Σ mask

    def __add__(self, other: WeightSums) -> WeightSums:
        return WeightSums(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


def weighted_advantages(
    advantages: Tensor, old: Tensor, behaviour: Tensor, mask: Tensor, mode: str, cap: float
) -> tuple[Tensor, WeightSums]:
    """Advantages [B, T] times w = π_old / π_behaviour (`importance_weights`), from log π_old and
    log π_behaviour [B, T], and the sums `importance_metrics` turns into statistics."""
    log_ratio = (old - behaviour) * mask  # [B, T]
    w, over = importance_weights(log_ratio, mask, mode, cap)  # [B, T] ×2
    sums = WeightSums(
        w=(w * mask).sum().item(),
        w2=(w.square() * mask).sum().item(),
        clipped=(over.float() * mask).sum().item(),
        tokens=mask.sum().item(),
    )
    return advantages * w, sums  # [B, T]


def kish_ess(sum_w: float, sum_w2: float, n: float) -> float:
    """Kish's effective sample size of n weights as a fraction of n: (Σw)² / (n Σw²) ∈ (0, 1], 1 when all
    weights are equal."""
    return sum_w**2 / (n * max(sum_w2, 1e-12))


def importance_metrics(sums: WeightSums) -> dict[str, float]:
    """is/ess (Kish), is/weight_mean and is/clipped_frac over the weighted tokens; {} when none were."""
    if not sums.tokens:
        return {}
    return {
        "is/ess": kish_ess(sums.w, sums.w2, sums.tokens),
        "is/weight_mean": sums.w / sums.tokens,
        "is/clipped_frac": sums.clipped / sums.tokens,
    }


def sampler_ess(old_logprobs: Tensor | None, sampling_logprobs: Tensor | None, mask: Tensor) -> float:
    """Kish effective sample size, as a fraction in (0, 1], of the token weights π_old / π_sampler [N, T]
    (uncapped, no correction applied): 1.0 when the sampler's log-probs are the learner's (TorchRL logs this
    ESS in every mode); NaN when either side is missing."""
    if old_logprobs is None or sampling_logprobs is None:
        return float("nan")
    width = min(old_logprobs.shape[1], sampling_logprobs.shape[1], mask.shape[1])
    m = mask[:, :width].float()  # [N, T]
    log_w = (old_logprobs[:, :width].float() - sampling_logprobs[:, :width].float()) * m  # [N, T]
    w = log_w.clamp(max=20).exp() * m  # [N, T]; e^20: far past any cap, and w² stays finite in float32
    return kish_ess(w.sum().item(), w.square().sum().item(), max(m.sum().item(), 1.0))


def mismatch_metrics(sampling_logprobs: Tensor, policy_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
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
