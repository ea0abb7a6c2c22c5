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


# --- Aggregations as per-token weights: the batch loss is sum(loss * weights) ---
# Each takes the response mask, the response-token count of every token's own sequence (rows may hold several
# packed sequences), and totals over the whole optimizer batch, so micro-batches accumulate to the exact
# batch aggregate whatever their layout.
def token_mean(mask: Tensor, sequence_tokens: Tensor, batch_tokens: float, batch_sequences: int,
               constant: float) -> Tensor:
    # Every response token weighs the same: long answers are not down-weighted (DAPO/open-instruct).
    return mask / max(batch_tokens, 1.0)


def sequence_mean(mask: Tensor, sequence_tokens: Tensor, batch_tokens: float, batch_sequences: int,
                  constant: float) -> Tensor:
    # Original GRPO: mean over sequences of per-sequence token means (has a length bias).
    return mask / (sequence_tokens.clamp(min=1) * batch_sequences)


def sum_constant(mask: Tensor, sequence_tokens: Tensor, batch_tokens: float, batch_sequences: int,
                 constant: float) -> Tensor:
    # Dr.GRPO: sum / (sequences x constant), as TRL's dr_grpo and verl's seq-mean-token-sum-norm; no length
    # normalisation, and dividing by the sequence count lets the learning rate carry across batch sizes.
    return mask / (batch_sequences * constant)


AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, float, int, float], Tensor]] = {
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
    """Per-token GRPO loss on [B, T] tensors; advantages are per token ([B, T], each token carries its own
    sequence's advantage) or anything that broadcasts to it.

    loss = max(-A*rho, -A*clip(rho, 1-eps_low, 1+eps_high)) [* is_weight] + beta * KL
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
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
