"""GRPO per-token loss: clipped surrogate + beta * KL, then aggregation. One function per variant."""

from __future__ import annotations

from typing import Callable

import torch

Tensor = torch.Tensor


# --- KL estimators of KL(pi_theta || pi_ref) per token, d = logp - ref_logp (Schulman's k1/k2/k3) ---
def kl_k1(d: Tensor, ratio: Tensor) -> Tensor:
    return d


def kl_k2(d: Tensor, ratio: Tensor) -> Tensor:
    return 0.5 * d * d


def kl_k3(d: Tensor, ratio: Tensor) -> Tensor:
    # exp(-d) - 1 + d >= 0 with low variance: the GRPO default.
    return torch.exp(-d) - 1.0 + d


def kl_ratio_k1(d: Tensor, ratio: Tensor) -> Tensor:
    # Importance-weighted k1 for off-policy passes (rho * d); rho is detached so it only reweights.
    return ratio.detach() * d


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "ratio_k1": kl_ratio_k1,
}


# --- Aggregations of a [B, T] per-token loss under a response mask ---
def token_mean(loss: Tensor, mask: Tensor, constant: float) -> Tensor:
    # Every response token weighs the same: long answers are not down-weighted (DAPO/open-instruct).
    return (loss * mask).sum() / mask.sum().clamp(min=1)


def sequence_mean(loss: Tensor, mask: Tensor, constant: float) -> Tensor:
    # Original GRPO: mean over sequences of per-sequence token means (has a length bias).
    per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq.mean()


def sum_constant(loss: Tensor, mask: Tensor, constant: float) -> Tensor:
    # Dr.GRPO: a fixed divisor, so neither length nor batch composition rescales a token's gradient.
    return (loss * mask).sum() / constant


AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, float], Tensor]] = {
    "token_mean": token_mean,
    "sequence_mean": sequence_mean,
    "sum_constant": sum_constant,
}


def grpo_token_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    *,
    eps_low: float,
    eps_high: float,
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    kl_clamp: float = 10.0,
    is_weights: Tensor | None = None,
) -> dict[str, Tensor]:
    """Per-token GRPO loss on [B, T] tensors; advantages are [B] (one per sequence).

    loss = max(-A*rho, -A*clip(rho, 1-eps_low, 1+eps_high)) [* is_weight] + beta * KL
    """
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(-1)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    pg = torch.maximum(unclipped, clipped)
    if is_weights is not None:
        pg = pg * is_weights
    out = {"pg": pg, "ratio": ratio, "clipped": (clipped > unclipped).float()}
    if beta > 0.0 and ref_logp is not None:
        d = torch.clamp(logp - ref_logp, -kl_clamp, kl_clamp)
        kl = KL_ESTIMATORS[kl_estimator](d, ratio)
        out["kl"] = kl
        out["loss"] = pg + beta * kl
    else:
        out["kl"] = torch.zeros_like(pg)
        out["loss"] = pg
    return out
