"""Importance sampling against the rollout engine (`grpo.tis_*`) against TRL's, verl's and open-instruct's own
formulas, in float64: every row of the table in docs/grpo.md.

Each peer function below re-implements what the peer's code computes at the commit docs/grpo.md names:
  TRL           huggingface/trl        f2cd57710ae345ea6428ae95363267fcf38a3dc8
  verl          volcengine/verl        b178a3cd56f58b2d502255daba591e92833930a7
  open-instruct allenai/open-instruct  e6c3044aa6201c8bfa4573c1b03142af599e730d
and returns (the weight on each token's policy-gradient term, the loss mask: the tokens that count in the
aggregation's denominator and carry the KL and entropy terms). Where the docs say "equal" both agree within 1e-12;
where they state a difference, the test asserts that difference.
"""

from __future__ import annotations

import math

import pytest
import torch

from refiner_core.algo.losses import AGGREGATIONS, TIS_MODES, Sequences, grpo_token_loss, importance_weights

F64 = torch.float64
EXACT = dict(rtol=1e-12, atol=1e-12)
LENGTHS = [9, 6, 1, 4, 0, 7, 3, 5, 1, 8, 2, 6]  # one row with no trained token, two one-token rows
BOUNDS = {"token": (0.85, 1.2), "sequence": (0.75, 1.5)}  # (tis_floor, tis_cap); open-instruct needs floor < 1 < cap


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pi_old log-probs, rollout log-probs, response mask); log r = old - rollout uniform in [-0.5, 0.5]."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(LENGTHS), max(LENGTHS)
    mask = torch.zeros(B, T, dtype=F64)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1.0
    old = -(torch.rand(B, T, generator=g, dtype=F64) * 3 + 0.05)
    rollout = old - (torch.rand(B, T, generator=g, dtype=F64) - 0.5)
    return old, rollout, mask


def _ours(old, rollout, mask, level, mode, floor, cap):
    """Our weights, and our loss mask: the learner aggregates every term over the response mask."""
    return importance_weights(
        old, rollout, Sequences.one_per_row(mask), level=level, mode=mode, floor=floor, cap=cap
    ), mask


def _ratios(old, rollout, mask, level):
    log_r = (old - rollout) * mask
    return torch.exp(log_r.sum(-1, keepdim=True).expand_as(mask) if level == "sequence" else log_r)


# --- TRL ----------------------------------------------------------------------------------------------------------
def _trl(old, sampling, mask, mode, clip_min, clip_max):
    # trl/trainer/grpo_trainer.py, GRPOTrainer._generate_and_score_completions (vllm_importance_sampling_mode):
    # diff = (old - sampling) * mask, summed per row for sequence_*; exp; *_truncate clamps into
    # [clip_min, clip_max]; *_mask fills ratios < clip_min or > clip_max with 0 (None = unbounded).
    # _compute_loss multiplies the policy term by it before adding beta * kl and aggregates over `mask`; the
    # entropy bonus uses `mask` (times the entropy mask) too.
    diff = (old - sampling) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        low = clip_min if clip_min is not None else -math.inf
        high = clip_max if clip_max is not None else math.inf
        ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    return ratio.expand_as(mask) * mask, mask


@pytest.mark.parametrize("with_floor", [True, False])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_trl_equals_every_row(level, mode, with_floor):
    old, rollout, mask = _batch()
    floor, cap = BOUNDS[level] if with_floor else (0.0, BOUNDS[level][1])
    ours, our_mask = _ours(old, rollout, mask, level, mode, floor, cap)
    trl, trl_mask = _trl(old, rollout, mask, f"{level}_{mode}", floor if floor > 0 else None, cap)
    torch.testing.assert_close(ours, trl, **EXACT)
    assert torch.equal(our_mask, trl_mask)
    r = _ratios(old, rollout, mask, level)[mask.bool()]
    assert (r > cap).any() and (r <= cap).any() and (not with_floor or (r < floor).any())  # every branch is hit


# --- verl ---------------------------------------------------------------------------------------------------------
VERL_SAFETY_BOUND = 20.0


def _verl_k1_keep(log_ratio, mask, option, spec):
    # verl/trainer/ppo/rollout_corr_helper.py, _parse_rollout_rs_thresholds: a *_k1 spec is "lower_upper", or
    # "upper" with lower = 1 / upper. compute_rollout_rejection_mask: k1 = -clamp(log r, +-20) (a statistic of
    # pi_rollout / pi_old), summed over the row's response tokens for seq_sum_k1; kept where
    # log(lower) <= statistic <= log(upper), broadcast to the row.
    if "_" in spec:
        lower, upper = (float(x) for x in spec.split("_", 1))
    else:
        upper = float(spec)
        lower = 1.0 / upper
    k1 = -torch.clamp(log_ratio, -VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)
    stat = {"token_k1": lambda: k1, "seq_sum_k1": lambda: (k1 * mask).sum(dim=-1, keepdim=True)}[option]()
    keep = (stat >= math.log(lower)) & (stat <= math.log(upper))
    return keep.expand_as(mask).to(mask.dtype)


def _verl(old, rollout, mask, rollout_is, rollout_is_threshold, rollout_rs=None, rollout_rs_threshold=None):
    # rollout_corr_helper.py, compute_rollout_correction_and_rejection_mask: log r = old - rollout.
    # compute_rollout_correction_weights: 'token' exp(clamp(log r, +-20)); 'sequence' exp(clamp(sum of log r over
    # the row, +-20)) on every token; times the response mask, then clamp(max=rollout_is_threshold), no lower bound.
    # compute_rollout_correction_and_add_to_batch replaces response_mask with the rejection mask; core_algos.py
    # compute_policy_loss_vanilla multiplies pg_losses by the weights and agg_loss sums them over that mask, and
    # dp_actor.py aggregates entropy and the KL loss over the same mask (so it is the denominator too).
    log_ratio = old - rollout
    if rollout_is == "token":
        w = torch.exp(torch.clamp(log_ratio, -VERL_SAFETY_BOUND, VERL_SAFETY_BOUND))
    else:
        total = (log_ratio * mask).sum(dim=-1, keepdim=True)
        w = torch.exp(torch.clamp(total, -VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)).expand_as(log_ratio)
    w = (w * mask).clamp(max=rollout_is_threshold)
    loss_mask = mask if rollout_rs is None else mask * _verl_k1_keep(log_ratio, mask, rollout_rs, rollout_rs_threshold)
    return w * loss_mask, loss_mask


def _verl_ratio_bounds(floor, cap):
    """The rollout_rs_threshold that keeps floor <= r <= cap: verl's k1 bounds apply to 1 / r."""
    return f"{1.0 / cap!r}_{1.0 / floor if floor > 0 else math.inf!r}"


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_verl_truncation_equals_ours_without_a_floor(level):
    old, rollout, mask = _batch()
    floor, cap = BOUNDS[level]
    verl, verl_mask = _verl(old, rollout, mask, level, cap)
    ours, _ = _ours(old, rollout, mask, level, "truncate", 0.0, cap)
    torch.testing.assert_close(verl, ours, **EXACT)
    assert torch.equal(verl_mask, mask)
    # verl has no lower bound: with tis_floor > 0 ours is larger exactly where r < floor
    with_floor, _ = _ours(old, rollout, mask, level, "truncate", floor, cap)
    below = (_ratios(old, rollout, mask, level) < floor) & mask.bool()
    assert below.any() and torch.equal(with_floor > verl, below)


@pytest.mark.parametrize("with_floor", [True, False])
@pytest.mark.parametrize(("level", "option"), [("token", "token_k1"), ("sequence", "seq_sum_k1")])
def test_verl_rejection_gives_our_mask_weights_but_drops_the_tokens(level, option, with_floor):
    old, rollout, mask = _batch()
    floor, cap = BOUNDS[level] if with_floor else (0.0, BOUNDS[level][1])
    verl, verl_mask = _verl(old, rollout, mask, level, cap, option, _verl_ratio_bounds(floor, cap))
    ours, our_mask = _ours(old, rollout, mask, level, "mask", floor, cap)
    torch.testing.assert_close(verl, ours, **EXACT)  # the same weight on every policy-gradient term
    # but a rejected token leaves verl's response mask: its denominator, KL and entropy; ours keeps it there
    assert torch.equal(our_mask, mask)
    assert torch.equal(verl_mask, mask * (ours > 0))
    assert (verl_mask != our_mask).any()


def test_verl_k1_bounds_apply_to_the_inverse_ratio():
    old, rollout, mask = _batch()
    floor, cap = 0.8, 1.5  # not reciprocal, so reading "lower_upper" as bounds on r shows
    as_written, _ = _verl(old, rollout, mask, "token", math.inf, "token_k1", f"{floor!r}_{cap!r}")
    inverse, _ = _ours(old, rollout, mask, "token", "mask", 1.0 / cap, 1.0 / floor)
    torch.testing.assert_close(as_written, inverse, **EXACT)
    assert (as_written != _ours(old, rollout, mask, "token", "mask", floor, cap)[0]).any()
    # one value c keeps [1/c, c]
    single, _ = _verl(old, rollout, mask, "token", math.inf, "token_k1", repr(cap))
    torch.testing.assert_close(single, _ours(old, rollout, mask, "token", "mask", 1.0 / cap, cap)[0], **EXACT)


# --- open-instruct ------------------------------------------------------------------------------------------------
def _open_instruct(old, vllm, mask, clamp_lower=0.0, clamp_upper=0.0, mask_lower=0.0, mask_upper=0.0, seq=False):
    # open_instruct/grpo_utils.py, compute_rho_correction: diff = clamp(old - vllm, +-10) on response tokens;
    # rho_effective = exp(diff), or with rho_mask_sequence_level exp(masked row mean of diff) on every token;
    # _rho_drop_masks drops rho_effective < rho_mask_lower_bound / > rho_mask_upper_bound (0 disables each);
    # weights = rho_effective clamped by rho_clamp_lower/upper_bound (0 disables each) where kept, else 0.
    # compute_grpo_loss multiplies pg_loss by them; grpo_fast.py step adds beta * kl and takes
    # masked_mean(., response_mask): dropped tokens keep the denominator and the KL term.
    response = mask.bool()
    diff = torch.where(response, (old - vllm).clamp(-10.0, 10.0), torch.zeros_like(old))
    rho = torch.exp(diff)
    if seq:
        mean = (diff * mask).sum(dim=-1, keepdim=True) / mask.sum(dim=-1, keepdim=True).clamp_min(1.0)
        rho = torch.exp(mean.expand_as(diff))
    dropped_low = (rho < mask_lower) & response if mask_lower > 0.0 else torch.zeros_like(response)
    dropped_high = (rho > mask_upper) & response if mask_upper > 0.0 else torch.zeros_like(response)
    in_range = response & ~dropped_low & ~dropped_high
    clamped = rho
    if clamp_lower > 0.0:
        clamped = torch.clamp(clamped, min=clamp_lower)
    if clamp_upper > 0.0:
        clamped = torch.clamp(clamped, max=clamp_upper)
    return torch.where(in_range, clamped, torch.zeros_like(clamped)), mask


@pytest.mark.parametrize("with_floor", [True, False])
def test_open_instruct_rho_clamp_equals_token_truncation(with_floor):
    old, rollout, mask = _batch()
    floor, cap = BOUNDS["token"] if with_floor else (0.0, BOUNDS["token"][1])
    oi, oi_mask = _open_instruct(old, rollout, mask, clamp_lower=floor, clamp_upper=cap)
    ours, our_mask = _ours(old, rollout, mask, "token", "truncate", floor, cap)
    torch.testing.assert_close(oi, ours, **EXACT)
    assert torch.equal(oi_mask, our_mask)


@pytest.mark.parametrize("with_floor", [True, False])
def test_open_instruct_rho_mask_equals_token_mask_when_its_clamp_does_not_bind(with_floor):
    old, rollout, mask = _batch()
    floor, cap = BOUNDS["token"] if with_floor else (0.0, BOUNDS["token"][1])
    ours, our_mask = _ours(old, rollout, mask, "token", "mask", floor, cap)
    for clamp_upper in (0.0, cap, 2.0):  # off, or no tighter than the mask (2.0 is its default)
        oi, oi_mask = _open_instruct(old, rollout, mask, clamp_upper=clamp_upper, mask_lower=floor, mask_upper=cap)
        torch.testing.assert_close(oi, ours, **EXACT)
        assert torch.equal(oi_mask, our_mask)  # dropped tokens stay in the denominator and the KL, as ours
    # a clamp under the cap caps the kept weights: min(ours, clamp)
    oi, _ = _open_instruct(old, rollout, mask, clamp_upper=1.1, mask_lower=floor, mask_upper=cap)
    torch.testing.assert_close(oi, ours.clamp(max=1.1), **EXACT)
    assert (oi != ours).any()


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_open_instruct_sequence_level_uses_the_geometric_mean(mode):
    old, rollout, mask = _batch()
    floor, cap = BOUNDS["sequence"]
    bounds = dict(clamp_lower=floor, clamp_upper=cap) if mode == "truncate" else dict(mask_lower=floor, mask_upper=cap)
    oi, _ = _open_instruct(old, rollout, mask, seq=True, **bounds)
    # its weight is the (clamped or masked) geometric mean exp(mean of log r) of the row, on every token
    geometric = torch.exp(Sequences.one_per_row(mask).mean(old - rollout))
    torch.testing.assert_close(oi, TIS_MODES[mode](geometric, floor, cap) * mask, **EXACT)
    # ours uses the product: equal on one-token rows only
    ours, _ = _ours(old, rollout, mask, "sequence", mode, floor, cap)
    one = torch.tensor([n == 1 for n in LENGTHS])
    torch.testing.assert_close(oi[one], ours[one], **EXACT)
    assert (oi[~one] != ours[~one]).any()


# --- extreme ratios: the peers' safety clamps ---------------------------------------------------------------------
def test_safety_clamps_of_verl_and_open_instruct():
    old, rollout, mask = _batch()
    rollout[0, 0], rollout[1, :6] = old[0, 0] + 12.0, old[1, :6] + 25.0 / 6  # log r = -12; row 1 sums to -25
    ours_token, _ = _ours(old, rollout, mask, "token", "truncate", 0.0, 1.25)
    trl, _ = _trl(old, rollout, mask, "token_truncate", None, 1.25)
    oi, _ = _open_instruct(old, rollout, mask, clamp_upper=1.25)
    torch.testing.assert_close(trl, ours_token, **EXACT)
    assert ours_token[0, 0].item() == pytest.approx(math.exp(-12.0), rel=1e-12)
    assert oi[0, 0].item() == pytest.approx(math.exp(-10.0), rel=1e-12)  # open-instruct clamps log r to +-10
    ours_seq, _ = _ours(old, rollout, mask, "sequence", "truncate", 0.0, 2.0)
    verl, _ = _verl(old, rollout, mask, "sequence", 2.0)
    assert ours_seq[1, 0].item() == pytest.approx(math.exp(-25.0), rel=1e-12)
    assert verl[1, 0].item() == pytest.approx(math.exp(-20.0), rel=1e-12)  # verl clamps the row's log r to +-20


# --- what a masked token does in our loss -------------------------------------------------------------------------
def test_a_masked_token_keeps_its_denominator_kl_and_entropy():
    old, rollout, mask = _batch()
    g = torch.Generator().manual_seed(1)
    logp = old + (torch.rand(old.shape, generator=g, dtype=F64) - 0.5) * 0.4
    ref = old + (torch.rand(old.shape, generator=g, dtype=F64) - 0.5) * 0.4
    entropy = torch.rand(old.shape, generator=g, dtype=F64) * 2
    sequences = Sequences.one_per_row(mask)
    weights = importance_weights(old, rollout, sequences, level="token", mode="mask", floor=0.8, cap=1.25)
    out = grpo_token_loss(
        logp,
        old,
        torch.ones_like(old),
        eps_low=0.2,
        eps_high=0.28,
        ref_logp=ref,
        beta=0.1,
        kl_estimator="k3",
        kl_clamp=10.0,
        is_weights=weights,
        sequences=sequences,
        entropy=entropy,
        entropy_coef=0.01,
    )
    masked = mask.bool() & (weights == 0)
    assert masked.any()
    assert torch.equal(out["pg"][masked], torch.zeros_like(out["pg"][masked]))  # no policy gradient
    kl_and_entropy = 0.1 * out["kl"] - 0.01 * entropy
    torch.testing.assert_close(out["loss"][masked], kl_and_entropy[masked], **EXACT)
    assert (kl_and_entropy[masked] != 0).all()
    # token_mean gives it the same share as every trained token: the denominator counts it
    share = AGGREGATIONS["token_mean"](mask, mask.sum(-1, keepdim=True).expand_as(mask), mask.sum().item(), 12, 1.0)
    assert torch.equal(share[masked], torch.full_like(share[masked], 1.0 / mask.sum().item()))
