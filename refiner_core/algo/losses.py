"""GRPO per-token loss: a policy-gradient surrogate [* importance weight] + beta * KL - entropy_coef * entropy,
the policy terms optionally on the high-entropy tokens only, then aggregation. One function per variant, chosen
by name through POLICY_LOSSES, KL_ESTIMATORS, TIS_LEVELS, TIS_MODES and AGGREGATIONS; each docstring states its
formula and the peer option it equals (docs/grpo.md has the table, with the peer commits it was checked
against)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from refiner_core.config import ExtensionError

Tensor = torch.Tensor


class Sequences:
    """The sequences of a batch seen per token (a row may hold several packed sequences): `index[r, t]` numbers
    the sequence whose response token (r, t) is, and `mask` marks the trained tokens. Prompt and padding
    positions carry a spare index whose sums are 0."""

    def __init__(self, index: Tensor, mask: Tensor):
        self.index, self.mask = index, mask
        self.count = int(index.max()) + 1 if index.numel() else 1

    @classmethod
    def one_per_row(cls, mask: Tensor) -> Sequences:
        index = torch.arange(mask.shape[0], device=mask.device).unsqueeze(-1).expand_as(mask)
        return cls(index, mask)

    def sum(self, values: Tensor) -> Tensor:
        """Per token: the sum of `values` over the trained tokens of its sequence."""
        flat = (values * self.mask).flatten()
        totals = torch.zeros(self.count, dtype=flat.dtype, device=flat.device).index_add(0, self.index.flatten(), flat)
        return totals[self.index]

    def mean(self, values: Tensor) -> Tensor:
        """Per token: the mean of `values` over the trained tokens of its sequence (0 for an untrained one)."""
        return self.sum(values) / self.sum(torch.ones_like(values)).clamp(min=1)


# --- KL estimators of KL(pi_theta || pi_ref) per token, d = logp - ref_logp (Schulman's k1/k2/k3) ---
# Values estimate KL(pi || ref) under samples from pi; gradients differ. The docstrings give the expected
# gradient on-policy (samples from pi_old = pi), checked on an exact vocabulary in tests/test_policy_variants.py.
def kl_k1(d: Tensor, ratio: Tensor) -> Tensor:
    """k1 = d. Expected gradient E_pi[grad log pi] = 0: as a loss it pulls nowhere. verl `k1`/`kl`,
    open-instruct kl_estimator 0."""
    return d


def kl_k2(d: Tensor, ratio: Tensor) -> Tensor:
    """k2 = d^2 / 2; gradient d * grad log pi, expected gradient grad KL(pi || ref). verl `k2`/`mse`,
    open-instruct kl_estimator 1."""
    return 0.5 * d * d


def kl_k3(d: Tensor, ratio: Tensor) -> Tensor:
    """k3 = exp(-d) - 1 + d >= 0 (low variance, the GRPO default); gradient (1 - exp(-d)) grad log pi, expected
    gradient grad KL(ref || pi), the reverse KL's. TRL's estimator (beta), verl `k3`/`low_var_kl` (which also
    clamps d to +-20 and k3 to <= 10), open-instruct kl_estimator 2."""
    return torch.exp(-d) - 1.0 + d


def kl_ratio_k1(d: Tensor, ratio: Tensor) -> Tensor:
    """rho * d with rho = pi / pi_old kept in the graph: gradient rho (1 + d) grad log pi, whose expectation under
    pi_old is grad KL(pi || ref) exactly, on- and off-policy. open-instruct kl_estimator 3."""
    return ratio * d


def kl_ratio_k3(d: Tensor, ratio: Tensor) -> Tensor:
    """rho * k3 with rho = pi / pi_old kept in the graph: E_old[rho k3] = E_pi[k3] = KL(pi || ref) as a function of
    theta, so its value is unbiased and its expected gradient is grad KL(pi || ref), on- and off-policy (DeepSeek-V3.2's
    unbiased KL). TRL use_bias_correction_kl (importance_sampling_level token)."""
    return ratio * kl_k3(d, ratio)


def _k2_gradient(d: Tensor, value: Tensor) -> Tensor:
    """Straight through: the value of `value`, the gradient of k2 (expected gradient grad KL(pi || ref))."""
    k2 = kl_k2(d, d)
    return k2 - k2.detach() + value.detach()


def kl_k1_plus(d: Tensor, ratio: Tensor) -> Tensor:
    """k1's value, k2's gradient. verl `k1+` (as documented; at verl b178a3c every `+` name raises
    NotImplementedError, fixed by verl PR #6058)."""
    return _k2_gradient(d, kl_k1(d, ratio))


def kl_k2_plus(d: Tensor, ratio: Tensor) -> Tensor:
    """k2's value and gradient (k2 itself, through the straight-through path). verl `k2+`."""
    return _k2_gradient(d, kl_k2(d, ratio))


def kl_k3_plus(d: Tensor, ratio: Tensor) -> Tensor:
    """k3's value (non-negative, low variance), k2's gradient: expected gradient grad KL(pi || ref) instead of
    k3's grad KL(ref || pi). verl `k3+`/`low_var_kl+`."""
    return _k2_gradient(d, kl_k3(d, ratio))


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "ratio_k1": kl_ratio_k1,
    "ratio_k3": kl_ratio_k3,
    "k1+": kl_k1_plus,
    "k2+": kl_k2_plus,
    "k3+": kl_k3_plus,
}


# --- Policy-gradient surrogates: per token (loss, clipped indicator), rho = exp(logp - old_logp) ---
@dataclass(frozen=True)
class SurrogateParams:
    """The surrogates' knobs; a variant's own knob is None when another variant is chosen (their one default is
    the recipe's, config.GRPOConfig). The learners pass every knob but the clip range and the seed by its name in
    LearnerSettings (learners.base.surrogate_knobs): a new knob is a field here, there and in the config."""

    eps_low: float
    eps_high: float
    dual_clip_c: float | None = None
    sapo_tau_pos: float | None = None
    sapo_tau_neg: float | None = None
    kl_cov_ratio: float | None = None
    kl_cov_coef: float | None = None
    clip_cov_ratio: float | None = None
    clip_cov_lb: float | None = None
    clip_cov_ub: float | None = None
    vespo_k_pos: float | None = None
    vespo_lambda_pos: float | None = None
    vespo_k_neg: float | None = None
    vespo_lambda_neg: float | None = None
    selection_seed: int | None = None  # clip_cov's draw; the learner derives it from the micro-batch and pass

    def needed(self, *names: str) -> None:
        if missing := [n for n in names if getattr(self, n) is None]:
            raise ValueError(f"this policy loss needs {', '.join(missing)}")


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, p: SurrogateParams) -> tuple[Tensor, Tensor]:
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - p.eps_low, 1.0 + p.eps_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def ppo_clip(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, p: SurrogateParams, sequences: Sequences | None
) -> tuple[Tensor, Tensor]:
    """max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high)). TRL loss_type grpo/dapo/dr_grpo/bnpo (the
    aggregation is ours), open-instruct loss_fn dapo; verl `vanilla` with clip_ratio_c large enough never to bind
    (verl's default 3.0 applies the dual clip: see `dual_clip`)."""
    return _clipped_surrogate(torch.exp(logp - old_logp), advantages, p)


def dual_clip(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, p: SurrogateParams, sequences: Sequences | None
) -> tuple[Tensor, Tensor]:
    """ppo_clip, then for A < 0 also bounded by -A * c (c = dual_clip_c > 1): min(ppo_clip, -A c), so a token whose
    ratio grew far on a negative advantage stops pushing. verl `vanilla` with clip_ratio_c = c (verl clamps the
    log-ratio to +-20 first)."""
    p.needed("dual_clip_c")
    pg, clipped = ppo_clip(logp, old_logp, advantages, p, sequences)
    bound = -advantages * p.dual_clip_c
    lower = (advantages < 0) & (pg > bound)
    return torch.where(advantages < 0, torch.minimum(pg, bound), pg), torch.maximum(clipped, lower.float())


def gspo(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, p: SurrogateParams, sequences: Sequences | None
) -> tuple[Tensor, Tensor]:
    """GSPO: the ppo_clip surrogate on the sequence ratio s = exp(mean over the sequence's trained tokens of
    (logp - old_logp)), applied per token as s_t = sg[s] * pi_t / sg[pi_t] (value s, gradient s grad log pi_t),
    log s_t clamped at 10. verl `gspo`; TRL importance_sampling_level 'sequence' (loss_type grpo). Both average
    per sequence: with loss_aggregation 'sequence_mean' the loss and gradient equal theirs."""
    if sequences is None:
        raise ValueError("policy_loss 'gspo' needs the batch's sequences")
    sequence_log_ratio = sequences.mean(logp - old_logp).detach()
    ratio = torch.exp(torch.clamp(logp - logp.detach() + sequence_log_ratio, max=10.0))
    return _clipped_surrogate(ratio, advantages, p)


def cispo(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, p: SurrogateParams, sequences: Sequences | None
) -> tuple[Tensor, Tensor]:
    """CISPO: -sg[min(rho, 1 + eps_high)] * A * logp: every token keeps a gradient, its weight clipped instead.
    open-instruct loss_fn cispo (clip_higher = eps_high); TRL loss_type cispo with epsilon_high = 1 + eps_high
    (TRL's epsilon_high is the cap itself); verl `cispo` with clip_ratio_low = 1 (verl also clips from below at
    1 - clip_ratio_low)."""
    ratio = torch.exp(logp - old_logp)
    cap = 1.0 + p.eps_high
    return -torch.clamp(ratio, max=cap).detach() * advantages * logp, (ratio > cap).float()


def sapo(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, p: SurrogateParams, sequences: Sequences | None
) -> tuple[Tensor, Tensor]:
    """SAPO: -A * sigmoid(tau (rho - 1)) * 4 / tau, tau = sapo_tau_pos where A > 0 else sapo_tau_neg: a smooth gate
    in place of the hard clip (its gradient at rho = 1 is -A, as the clipped surrogate's). TRL loss_type sapo
    (sapo_temperature_pos/neg), verl `sapo` (tau_pos/tau_neg; verl clamps the log-ratio to +-20). No clipping:
    the clipped indicator is 0."""
    p.needed("sapo_tau_pos", "sapo_tau_neg")
    ratio = torch.exp(logp - old_logp)
    tau = torch.where(advantages > 0, ratio.new_tensor(p.sapo_tau_pos), ratio.new_tensor(p.sapo_tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    return -gate * advantages, torch.zeros_like(ratio)


def kl_cov(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, p: SurrogateParams, sequences: Sequences | None
) -> tuple[Tensor, Tensor]:
    """KL-Cov (Cui et al. 2025, the entropy mechanism of RL for reasoning models): the unclipped -A rho, plus
    kl_cov_coef * |log rho| on the kl_cov_ratio share (at least one) of the micro-batch's trained tokens whose
    covariance (A - mean A)(logp - mean logp) over those tokens, detached, is largest: the tokens whose update
    would collapse the entropy fastest are held near pi_old. verl `kl_cov` (kl_cov_ratio, ppo_kl_coef), also per
    micro-batch. The clipped indicator marks the penalised tokens."""
    p.needed("kl_cov_ratio", "kl_cov_coef")
    if sequences is None:
        raise ValueError("policy_loss 'kl_cov' needs the batch's sequences")
    log_ratio = logp - old_logp
    pg = -advantages * torch.exp(log_ratio)
    trained = sequences.mask.flatten() > 0
    where = trained.nonzero().squeeze(-1)
    penalised = torch.zeros_like(trained)
    if len(where):
        adv = advantages.expand_as(logp).detach().flatten()[where]
        lp = logp.detach().flatten()[where]
        covariance = (adv - adv.mean()) * (lp - lp.mean())
        top = torch.topk(covariance, max(1, int(len(where) * p.kl_cov_ratio))).indices
        penalised[where[top]] = True
    penalised = penalised.view_as(logp)
    return torch.where(penalised, pg + p.kl_cov_coef * log_ratio.abs(), pg), penalised.to(pg.dtype)


def clip_cov(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, p: SurrogateParams, sequences: Sequences | None
) -> tuple[Tensor, Tensor]:
    """Clip-Cov (Cui et al. 2025, the paper of kl_cov): ppo_clip, then the policy term of max(1, int(clip_cov_ratio
    * trained tokens)) tokens is cut (loss and gradient 0; they stay in the aggregation's denominator), drawn
    uniformly among the micro-batch's trained, unclipped tokens whose covariance (A - mean A)(logp - mean logp),
    means over the trained tokens, lies in (clip_cov_lb, clip_cov_ub). verl `clip_cov` (clip_cov_ratio,
    clip_cov_lb, clip_cov_ub), also per micro-batch; verl draws from the global generator, ours from one seeded
    with `selection_seed`, so a rerun draws the same tokens. The clipped indicator marks every token without a
    policy gradient: ratio-clipped or cut."""
    p.needed("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "selection_seed")
    if sequences is None:
        raise ValueError("policy_loss 'clip_cov' needs the batch's sequences")
    pg, clipped = ppo_clip(logp, old_logp, advantages, p, sequences)
    trained = sequences.mask > 0
    if not trained.any():
        return pg, clipped
    adv = advantages.expand_as(logp).detach()
    lp = logp.detach()
    covariance = (adv - adv[trained].mean()) * (lp - lp[trained].mean())
    band = trained & (clipped == 0) & (covariance > p.clip_cov_lb) & (covariance < p.clip_cov_ub)
    candidates = band.flatten().nonzero().squeeze(-1)  # row-major, as verl's torch.nonzero
    count = max(int(p.clip_cov_ratio * trained.sum().item()), 1)
    draw = torch.randperm(len(candidates), generator=torch.Generator().manual_seed(p.selection_seed))
    cut = torch.zeros(logp.numel(), dtype=torch.bool, device=logp.device)
    cut[candidates[draw[:count].to(candidates.device)]] = True
    cut = cut.view_as(logp)
    return torch.where(cut, torch.zeros_like(pg), pg), torch.maximum(clipped, cut.to(clipped.dtype))


def vespo(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, p: SurrogateParams, sequences: Sequences | None
) -> tuple[Tensor, Tensor]:
    """VESPO (variational sequence-level soft policy optimization): -sg[phi(w)] A logpi per token, a smooth
    asymmetric weight of the sequence ratio in place of the clip. log w = sum over the sequence's trained tokens
    of log rho (each clamped to +-20), clamped to [log 1e-8, 20]; phi(w) = exp(lambda + k log w - lambda w), so
    phi(1) = 1, with (k, lambda) = (vespo_k_pos, vespo_lambda_pos) where A >= 0, else the _neg pair (lambda at
    least 1e-4). TRL loss_type vespo (aggregated as dapo: our token_mean); with tis_cap the importance weights
    multiply the loss as for every variant, where TRL folds vLLM's ratio into w. The clipped indicator is 0."""
    p.needed("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")
    if sequences is None:
        raise ValueError("policy_loss 'vespo' needs the batch's sequences")
    with torch.no_grad():
        log_w = sequences.sum(torch.clamp(logp - old_logp, -20.0, 20.0)).clamp(math.log(1e-8), 20.0)
        nonneg = advantages.expand_as(logp) >= 0
        k = torch.where(nonneg, logp.new_tensor(p.vespo_k_pos), logp.new_tensor(p.vespo_k_neg))
        lam = torch.where(nonneg, logp.new_tensor(p.vespo_lambda_pos), logp.new_tensor(p.vespo_lambda_neg))
        lam = lam.clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return -phi * advantages * logp, torch.zeros_like(logp)


POLICY_LOSSES: dict[
    str, Callable[[Tensor, Tensor, Tensor, SurrogateParams, Sequences | None], tuple[Tensor, Tensor]]
] = {
    "ppo_clip": ppo_clip,
    "dual_clip": dual_clip,
    "gspo": gspo,
    "cispo": cispo,
    "sapo": sapo,
    "kl_cov": kl_cov,
    "clip_cov": clip_cov,
    "vespo": vespo,
}


def high_entropy_tokens(entropy: Tensor, mask: Tensor, quantile: float) -> Tensor:
    """1 on the trained tokens whose entropy is at least the (1 - quantile) quantile of the micro-batch's trained
    tokens' entropies (torch.quantile, linear), else 0: the top `quantile` share ("Beyond the 80/20 rule", Wang et
    al. 2025: 0.2); 0 keeps only the highest. Detached. TRL get_high_entropy_mask (top_entropy_quantile), which
    takes the quantile over each micro-batch of all ranks."""
    values = entropy.detach()[mask > 0]
    if not len(values):
        return torch.zeros_like(mask)
    return ((entropy.detach() >= torch.quantile(values, 1.0 - quantile)) & (mask > 0)).to(mask.dtype)


def off_policy_sequences(
    logp: Tensor, sampler_logp: Tensor, advantages: Tensor, sequences: Sequences, threshold: float
) -> Tensor:
    """0 on the tokens of a sequence with A < 0 whose mean over its trained tokens of log pi_sampler - log pi_theta
    (detached) exceeds `threshold`, 1 elsewhere: a negative sample the policy has already moved far from is not
    pushed down further. DeepSeek-V3.2's off-policy sequence masking (eq. 9, delta = threshold); TRL
    off_policy_mask_threshold, which reads the sampler's (vLLM's) log-probs as here."""
    divergence = sequences.mean(sampler_logp - logp.detach())
    return ((advantages.expand_as(logp) >= 0) | (divergence <= threshold)).to(logp.dtype)


# --- Truncated / masked importance sampling against the rollout engine (pi_old / pi_rollout), detached ---
def tis_token(log_ratio: Tensor, sequences: Sequences) -> Tensor:
    """One ratio per token. TRL vllm_importance_sampling_mode token_*, verl rollout_is 'token', open-instruct
    rho_* (per token)."""
    return log_ratio


def tis_sequence(log_ratio: Tensor, sequences: Sequences) -> Tensor:
    """One ratio per sequence, the product of its trained tokens' ratios, on each of them. TRL
    vllm_importance_sampling_mode sequence_*, verl rollout_is 'sequence' (open-instruct's rho_mask_sequence_level
    uses the geometric mean instead: equal for one-token sequences only)."""
    return sequences.sum(log_ratio)


def tis_truncate(ratio: Tensor, floor: float, cap: float) -> Tensor:
    """clamp(ratio, floor, cap) (floor 0: no lower bound). TRL *_truncate (clip_min, clip_max); verl rollout_is
    with rollout_is_threshold = cap when floor is 0 (verl has no lower bound); open-instruct
    rho_clamp_lower/upper_bound with rho_mask_* off (token level)."""
    return torch.clamp(ratio, min=floor if floor > 0 else None, max=cap)


def tis_mask(ratio: Tensor, floor: float, cap: float) -> Tensor:
    """ratio where floor <= ratio <= cap, else 0. A token weighted 0 (under tis_level 'sequence', every token of
    its sequence) loses its policy-gradient term only: it still counts in the aggregation's denominator and still
    carries its KL and entropy terms. TRL *_mask (clip_min, clip_max) and open-instruct rho_mask_lower/upper_bound
    (token level, with rho_clamp_* off or no tighter) do the same. verl rollout_is with rollout_rs token_k1 /
    seq_sum_k1 (rollout_rs_threshold '1/cap_1/floor') gives the same weights but takes the token out of its
    response mask, so out of the denominator, the KL and the entropy too."""
    return torch.where((ratio >= floor) & (ratio <= cap), ratio, torch.zeros_like(ratio))


TIS_LEVELS: dict[str, Callable[[Tensor, Sequences], Tensor]] = {"token": tis_token, "sequence": tis_sequence}
TIS_MODES: dict[str, Callable[[Tensor, float, float], Tensor]] = {"truncate": tis_truncate, "mask": tis_mask}


def importance_weights(
    old_logp: Tensor, rollout_logp: Tensor, sequences: Sequences, *, level: str, mode: str, floor: float, cap: float
) -> Tensor:
    """Per-token weights on the policy-gradient term only, correcting for the rollout engine's numerics (detached;
    0 off the response mask). The loss is aggregated over the response mask whatever the weights, so a weight of
    0 removes the token's policy gradient and nothing else."""
    log_ratio = TIS_LEVELS[level](old_logp.detach() - rollout_logp, sequences)
    return TIS_MODES[mode](torch.exp(log_ratio), floor, cap) * sequences.mask


# --- Aggregations as per-token weights: the batch loss is sum(loss * weights) ---
# Each takes the response mask, the response-token count of every token's own sequence (rows may hold several
# packed sequences), and totals over the whole optimizer batch, so micro-batches accumulate to the exact
# batch aggregate whatever their layout. N = sequences in the optimizer step, |y_i| = trained tokens of
# sequence i, l = per-token loss.
def token_mean(
    mask: Tensor, sequence_tokens: Tensor, batch_tokens: float, batch_sequences: int, constant: float
) -> Tensor:
    """sum_i,t l / sum_i |y_i|: every response token weighs the same, long answers are not down-weighted. TRL
    loss_type dapo (global token count), verl token-mean, open-instruct loss_denominator 'token'."""
    return mask / max(batch_tokens, 1.0)


def sequence_mean(
    mask: Tensor, sequence_tokens: Tensor, batch_tokens: float, batch_sequences: int, constant: float
) -> Tensor:
    """(1/N) sum_i (1/|y_i|) sum_t l: original GRPO (has a length bias). TRL loss_type grpo (N counts a sequence
    with no trained token; TRL averages per micro-batch, equal for equal micro-batches); verl
    seq-mean-token-mean (whose N leaves such a sequence out)."""
    return mask / (sequence_tokens.clamp(min=1) * batch_sequences)


def sum_constant(
    mask: Tensor, sequence_tokens: Tensor, batch_tokens: float, batch_sequences: int, constant: float
) -> Tensor:
    """sum_i,t l / (N * C), C = loss_constant: Dr.GRPO without length normalisation; dividing by N lets the
    learning rate carry across batch sizes. TRL loss_type dr_grpo (C = max_completion_length). Not verl's
    seq-mean-token-sum-norm, which is sum / C per micro-batch, scaled by 1/grad_accum by its dp_actor."""
    return mask / (batch_sequences * constant)


def sequence_sum(
    mask: Tensor, sequence_tokens: Tensor, batch_tokens: float, batch_sequences: int, constant: float
) -> Tensor:
    """(1/N) sum_i sum_t l: each sequence's token losses summed, then averaged over sequences (sum_constant with
    C = 1); a long answer weighs in proportion to its length. With gspo, LUSPO: TRL loss_type luspo (N counts a
    sequence with no trained token, averaged per micro-batch as for grpo); verl seq-mean-token-sum."""
    return mask / batch_sequences


AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, float, int, float], Tensor]] = {
    "token_mean": token_mean,
    "sequence_mean": sequence_mean,
    "sum_constant": sum_constant,
    "sequence_sum": sequence_sum,
}


def policy_terms(name: str, logp: Tensor, old_logp: Tensor, advantages, params, sequences) -> tuple[Tensor, Tensor]:
    """POLICY_LOSSES[name]'s (per-token loss, clipped mask), held to its contract: two tensors of logp's shape (a
    per-sequence [B, 1] broadcast, or a lone tensor unpacked row by row, would train on wrong values silently)."""
    out = POLICY_LOSSES[name](logp, old_logp, advantages, params, sequences)
    pair = isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, Tensor) for t in out)
    if not pair or {tuple(t.shape) for t in out} != {tuple(logp.shape)}:
        got = [tuple(t.shape) for t in out] if pair else type(out).__name__
        raise ExtensionError(
            f"grpo.policy_loss {name!r} returned {got}: a policy loss returns (per-token loss, clipped mask), two "
            f"tensors of the log-probs' shape {tuple(logp.shape)}"
        )
    return out


def grpo_token_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    *,
    eps_low: float,
    eps_high: float,
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    kl_estimator: str | None = None,
    kl_clamp: float | None = None,
    is_weights: Tensor | None = None,
    policy_loss: str = "ppo_clip",
    sequences: Sequences | None = None,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    policy_tokens: Tensor | None = None,
    kept_sequences: Tensor | None = None,
    **knobs,
) -> dict[str, Tensor]:
    """Per-token GRPO loss on [B, T] tensors; advantages are per token ([B, T], each token carries its own
    sequence's advantage) or anything that broadcasts to it.

    loss = (POLICY_LOSSES[policy_loss] [* is_weight] [* kept_sequence] - entropy_coef * entropy) [* policy_token]
           + beta * KL_ESTIMATORS[kl_estimator]

    policy_tokens (0/1, high_entropy_tokens) choose the tokens the policy terms apply to, kept_sequences (0/1,
    off_policy_sequences) those the policy-gradient term alone applies to, as TRL's; the KL term stays on all.
    `knobs` are the variants' own (SurrogateParams' fields).

    A knob only one term reads (the KL's estimator and clamp, a variant's own) is None unless that term is on:
    their one default is the recipe's (config.GRPOConfig), and a term switched on without its knob is an error.
    """
    ratio = torch.exp(logp - old_logp)
    params = SurrogateParams(eps_low, eps_high, **knobs)
    pg, clipped = policy_terms(policy_loss, logp, old_logp, advantages, params, sequences)
    if is_weights is not None:
        pg = pg * is_weights
    if kept_sequences is not None:
        pg = pg * kept_sequences
    if policy_tokens is not None:
        pg = pg * policy_tokens
    out = {"pg": pg, "ratio": ratio, "clipped": clipped}
    loss = pg
    if beta > 0.0 and ref_logp is not None:
        if kl_estimator is None or kl_clamp is None:
            raise ValueError("a KL term (beta > 0) needs kl_estimator and kl_clamp")
        d = torch.clamp(logp - ref_logp, -kl_clamp, kl_clamp)
        out["kl"] = KL_ESTIMATORS[kl_estimator](d, ratio)
        loss = loss + beta * out["kl"]
    else:
        out["kl"] = torch.zeros_like(pg)
    if entropy is not None:
        out["entropy"] = entropy
        if entropy_coef != 0.0:
            bonus = entropy if policy_tokens is None else entropy * policy_tokens
            loss = loss - entropy_coef * bonus
    out["loss"] = loss
    return out
