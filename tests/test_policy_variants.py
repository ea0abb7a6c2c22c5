"""Every policy-gradient variant against an independent float64 reference of the peer formula it claims to equal.

The references are written here, per sequence or per token, from the peers' source at these commits:
  TRL          huggingface/trl        f2cd57710ae345ea6428ae95363267fcf38a3dc8  trl/trainer/grpo_trainer.py,
                                                                                 trl/trainer/rloo_trainer.py
  verl         volcengine/verl        b178a3cd56f58b2d502255daba591e92833930a7  verl/trainer/ppo/core_algos.py,
                                                                                 verl/workers/actor/dp_actor.py
  open-instruct allenai/open-instruct e6c3044aa6201c8bfa4573c1b03142af599e730d  open_instruct/grpo_utils.py,
                                                                                 open_instruct/model_utils.py,
                                                                                 open_instruct/data_loader.py
Ours runs in float64; values and gradients must agree within 1e-6.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from refiner_core.algo.advantages import compute_advantages
from refiner_core.algo.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    Sequences,
    grpo_token_loss,
    high_entropy_tokens,
    importance_weights,
    off_policy_sequences,
)
from refiner_core.config import load_recipe
from refiner_core.grpo import build_train_samples, learner_settings
from refiner_core.learners.base import TrainSample
from refiner_core.learners.batching import collate_group, collate_rows
from refiner_core.learners.logprobs import token_logprobs, token_scores
from refiner_core.learners.torch_learner import TorchLearner, selection_seed

F64 = torch.float64
TOL = dict(rtol=1e-6, atol=1e-6)
EPS_LOW, EPS_HIGH = 0.2, 0.28
LENGTHS = [6, 4, 0, 3, 1]  # row 2 has no trained token
ADVANTAGES = [1.3, -0.8, 0.5, -1.6, 0.0]


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    B, T = len(LENGTHS), max(LENGTHS)
    mask = torch.zeros(B, T, dtype=F64)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1.0

    def noise(scale):
        return (torch.rand(B, T, generator=g, dtype=F64) - 0.5) * scale

    logp = -(torch.rand(B, T, generator=g, dtype=F64) * 2 + 0.05)
    old = logp + noise(1.2)  # ratios in [0.55, 1.8]: both clip bounds are crossed
    return {
        "logp": logp,
        "old": old,
        "ref": logp + noise(1.0),
        "rollout": old + noise(0.8),
        "mask": mask,
        "adv": torch.tensor(ADVANTAGES, dtype=F64),
        "entropy": torch.rand(B, T, generator=g, dtype=F64) * 3,
    }


def _ours(b, aggregation, batch_sequences=None, constant=1.0, **kw):
    """(value, d value / d logp[, d value / d entropy]) of our aggregated loss."""
    logp = b["logp"].clone().requires_grad_()
    entropy = b["entropy"].clone().requires_grad_() if "entropy_coef" in kw else None
    mask = b["mask"]
    if (quantile := kw.pop("top_entropy_quantile", None)) is not None:
        kw["policy_tokens"] = high_entropy_tokens(entropy, mask, quantile)
    out = grpo_token_loss(
        logp,
        b["old"],
        b["adv"][:, None],
        eps_low=EPS_LOW,
        eps_high=EPS_HIGH,
        sequences=Sequences.one_per_row(mask),
        entropy=entropy,
        **kw,
    )
    weights = AGGREGATIONS[aggregation](
        mask, mask.sum(-1, keepdim=True).expand_as(mask), mask.sum().item(), batch_sequences or mask.shape[0], constant
    )
    value = (out["loss"] * weights).sum()
    value.backward()
    return (value.detach(), logp.grad) + ((entropy.grad,) if entropy is not None else ())


def _peer(b, fn):
    """(value, gradient) of a reference written as fn(logp leaf, batch) -> scalar."""
    logp = b["logp"].clone().requires_grad_()
    value = fn(logp, b)
    value.backward()
    return value.detach(), logp.grad


def _assert_same(ours, peer):
    """Value and gradient with respect to logp, within TOL."""
    torch.testing.assert_close(ours[0], peer[0], **TOL)
    torch.testing.assert_close(ours[1], peer[1], **TOL)


def _tokens():
    """(row, column) of every trained token."""
    return [(i, t) for i in range(len(LENGTHS)) for t in range(LENGTHS[i])]


def _clip(x, low, high):
    return torch.clamp(x, low, high)


# --- policy losses -------------------------------------------------------------------------------------------
def _trl_dapo_k3(logp, b, beta):
    # TRL grpo_trainer.py _compute_loss, loss_type 'dapo': per token -min(rho A, clip(rho) A) + beta * k3, where
    # k3 = exp(ref - logp) - (ref - logp) - 1; summed over trained tokens / their count.
    total = 0.0
    for i, t in _tokens():
        rho, a = torch.exp(logp[i, t] - b["old"][i, t]), b["adv"][i]
        x = b["ref"][i, t] - logp[i, t]
        total = total - torch.minimum(rho * a, _clip(rho, 1 - EPS_LOW, 1 + EPS_HIGH) * a) + beta * (x.exp() - x - 1)
    return total / len(_tokens())


def _trl_dapo_bias_corrected_k3(logp, b, beta):
    # TRL grpo_trainer.py with use_bias_correction_kl, importance_sampling_level 'token': per_token_kl = k3 * coef_1,
    # coef_1 = exp(logp - old) in the graph; loss_type 'dapo' as above.
    total = 0.0
    for i, t in _tokens():
        rho, a = torch.exp(logp[i, t] - b["old"][i, t]), b["adv"][i]
        x = b["ref"][i, t] - logp[i, t]
        pg = -torch.minimum(rho * a, _clip(rho, 1 - EPS_LOW, 1 + EPS_HIGH) * a)
        total = total + pg + beta * (x.exp() - x - 1) * rho
    return total / len(_tokens())


def test_ratio_k3_equals_trl_bias_corrected_kl():
    b = _batch()
    ours = _ours(b, "token_mean", ref_logp=b["ref"], beta=0.05, kl_estimator="ratio_k3", kl_clamp=10.0)
    _assert_same(ours, _peer(b, lambda lp, bb: _trl_dapo_bias_corrected_k3(lp, bb, 0.05)))
    plain = _ours(b, "token_mean", ref_logp=b["ref"], beta=0.05, kl_estimator="k3", kl_clamp=10.0)
    assert (plain[1] - ours[1]).abs().max() > 1e-4  # rho moves the KL term here


def test_ppo_clip_with_k3_equals_trl_dapo():
    b = _batch()
    ours = _ours(b, "token_mean", ref_logp=b["ref"], beta=0.05, kl_estimator="k3", kl_clamp=10.0)
    peer = _peer(b, lambda lp, bb: _trl_dapo_k3(lp, bb, 0.05))
    _assert_same(ours, peer)
    assert peer[1].abs().max() > 0


def _verl_dual_clip(logp, b, c):
    # verl core_algos.py compute_policy_loss_vanilla: pg1 = max(-A rho, -A clip(rho)); for A < 0 the loss is
    # min(pg1, -A c); agg_loss 'token-mean' (sum / trained tokens).
    total = 0.0
    for i, t in _tokens():
        rho, a = torch.exp(logp[i, t] - b["old"][i, t]), b["adv"][i]
        pg1 = torch.maximum(-a * rho, -a * _clip(rho, 1 - EPS_LOW, 1 + EPS_HIGH))
        total = total + (torch.minimum(pg1, -a * c) if a < 0 else pg1)
    return total / len(_tokens())


def test_dual_clip_equals_verl_vanilla_with_clip_ratio_c():
    b = _batch()
    ours = _ours(b, "token_mean", policy_loss="dual_clip", dual_clip_c=1.1)
    peer = _peer(b, lambda lp, bb: _verl_dual_clip(lp, bb, 1.1))
    _assert_same(ours, peer)
    # the case exercises the dual bound: it differs from the plain clipped surrogate
    plain = _ours(b, "token_mean")
    assert (plain[1] - ours[1]).abs().max() > 1e-3


def _trl_two_sided(logp, b, delta):
    # TRL grpo_trainer.py loss_type 'dapo' with delta (INTELLECT-2's two-sided clip): coef_1 = clamp(rho, max=delta)
    # in the unclipped term only, per token -min(coef_1 A, clip(rho) A); sum / trained tokens.
    total = 0.0
    for i, t in _tokens():
        rho, a = torch.exp(logp[i, t] - b["old"][i, t]), b["adv"][i]
        total = total - torch.minimum(torch.clamp(rho, max=delta) * a, _clip(rho, 1 - EPS_LOW, 1 + EPS_HIGH) * a)
    return total / len(_tokens())


def test_dual_clip_equals_trl_two_sided_clip_delta():
    """TRL's delta caps rho in the unclipped term for both signs; where delta >= 1 + eps_high that changes only
    negative advantages, exactly as the dual clip with c = delta (peer_names maps delta to grpo.dual_clip_c)."""
    b = _batch(seed=3)  # negative advantages with rho up to 1.46 and 1.68
    ours = _ours(b, "token_mean", policy_loss="dual_clip", dual_clip_c=1.5)
    peer = _peer(b, lambda lp, bb: _trl_two_sided(lp, bb, 1.5))
    _assert_same(ours, peer)
    assert (_ours(b, "token_mean")[1] - ours[1]).abs().max() > 1e-3  # the cap binds in this batch


def _verl_kl_cov(logp, b, ratio, coef):
    # verl core_algos.py compute_policy_loss_kl_cov: pg = -A rho (no clip); over the valid tokens, detached,
    # cov = (A - mean A)(logp - mean logp); on the top max(1, int(n * kl_cov_ratio)) by cov, pg += ppo_kl_coef *
    # |logp - old|; agg_loss 'token-mean'.
    tokens = _tokens()
    adv = torch.stack([b["adv"][i] for i, _ in tokens])
    lp = torch.stack([logp[i, t].detach() for i, t in tokens])
    cov = (adv - adv.mean()) * (lp - lp.mean())
    top = set(torch.topk(cov, max(1, int(len(tokens) * ratio))).indices.tolist())
    total = 0.0
    for n, (i, t) in enumerate(tokens):
        log_ratio = logp[i, t] - b["old"][i, t]
        total = total - b["adv"][i] * torch.exp(log_ratio) + (coef * log_ratio.abs() if n in top else 0.0)
    return total / len(tokens)


def test_kl_cov_equals_verl():
    b = _batch()
    ours = _ours(b, "token_mean", policy_loss="kl_cov", kl_cov_ratio=0.2, kl_cov_coef=1.5)
    peer = _peer(b, lambda lp, bb: _verl_kl_cov(lp, bb, 0.2, 1.5))
    _assert_same(ours, peer)
    # two of the 14 trained tokens are penalised: the gradient differs from the plain -A rho (kl_cov_coef 0)
    plain = _ours(b, "token_mean", policy_loss="kl_cov", kl_cov_ratio=0.2, kl_cov_coef=0.0)
    assert ((plain[1] - ours[1]).abs() > 1e-6).sum() == 2


def _verl_clip_cov(logp, b, ratio, lb, ub, seed):
    # verl core_algos.py compute_policy_loss_clip_cov: pg1 = -A rho, pg2 = -A clip(rho); clip_by_origin = pg2 > pg1
    # on valid tokens; cov = (A - masked_mean A)(logp - masked_mean logp), -inf off the mask and where clipped; of
    # the tokens with lb < cov < ub, torch.randperm picks max(int(ratio * valid), 1) (verl from the global
    # generator, here one seeded with `seed`); their max(pg1, pg2) is multiplied by 0; agg_loss 'token-mean'.
    mask = b["mask"]
    adv = b["adv"][:, None].expand_as(mask)
    rho = torch.exp(logp - b["old"])
    pg1, pg2 = -adv * rho, -adv * _clip(rho, 1 - EPS_LOW, 1 + EPS_HIGH)
    clip_by_origin = (pg2 > pg1) & (mask > 0)

    def masked_mean(x):
        return (x * mask).sum() / mask.sum()

    cov = ((adv - masked_mean(adv)) * (logp - masked_mean(logp.detach()))).detach()
    cov[mask == 0] = -math.inf
    cov[clip_by_origin] = -math.inf
    clip_num = max(int(ratio * mask.sum().item()), 1)
    idx = torch.nonzero((cov < ub) & (cov > lb) & (mask > 0))
    idx = idx[torch.randperm(len(idx), generator=torch.Generator().manual_seed(seed))[: min(clip_num, len(idx))]]
    corr = torch.ones_like(adv)
    corr[idx[:, 0], idx[:, 1]] = 0
    return (torch.maximum(pg1, pg2) * corr * mask).sum() / mask.sum()


def test_clip_cov_equals_verl():
    b = _batch()
    # every token of positive covariance here is ratio-clipped already: the band reaches below 0
    knobs = dict(clip_cov_ratio=0.2, clip_cov_lb=-0.7, clip_cov_ub=5.0)
    mask, sequences = b["mask"], Sequences.one_per_row(b["mask"])
    cut = set()
    for seed in range(4):
        ours = _ours(b, "token_mean", policy_loss="clip_cov", selection_seed=seed, **knobs)
        _assert_same(ours, _peer(b, lambda lp, bb, seed=seed: _verl_clip_cov(lp, bb, 0.2, -0.7, 5.0, seed)))
        clipped = {
            loss: grpo_token_loss(
                b["logp"],
                b["old"],
                b["adv"][:, None],
                eps_low=EPS_LOW,
                eps_high=EPS_HIGH,
                policy_loss=loss,
                sequences=sequences,
                selection_seed=seed,
                **knobs,
            )["clipped"]
            * mask
            for loss in ("ppo_clip", "clip_cov")
        }
        # int(0.2 * 14) = 2 more tokens without a policy gradient than ppo_clip leaves
        extra = (clipped["clip_cov"] - clipped["ppo_clip"]).nonzero()
        assert len(extra) == 2
        cut.add(str(extra.tolist()))
    assert len(cut) > 1  # the seed chooses which
    again = _ours(b, "token_mean", policy_loss="clip_cov", selection_seed=3, **knobs)
    assert torch.equal(again[1], ours[1])


def test_the_learners_draw_follows_the_micro_batch_and_the_pass():
    ids = torch.tensor([[5, 6, 7], [8, 9, 0]])
    assert selection_seed({"input_ids": ids}, 0) == selection_seed({"input_ids": ids.clone()}, 0)  # any rank
    assert selection_seed({"input_ids": ids}, 0) != selection_seed({"input_ids": ids}, 1)  # each pass anew
    assert selection_seed({"input_ids": ids}, 0) != selection_seed({"input_ids": ids.flip(0)}, 0)


def _trl_dapo_top_entropy(logp, entropy, b, quantile, beta, coef):
    # TRL grpo_trainer.py with top_entropy_quantile q, loss_type 'dapo': threshold = torch.quantile(entropies of the
    # trained tokens, 1 - q); m = entropy >= threshold on trained tokens; per token -min(rho A, clip(rho) A) * m +
    # beta * k3, minus entropy_coef * H * m (the bonus on the same effective mask); sum / trained tokens.
    threshold = torch.quantile(torch.stack([entropy[i, t].detach() for i, t in _tokens()]), 1 - quantile)
    total = 0.0
    for i, t in _tokens():
        m = float(entropy[i, t].detach() >= threshold)
        rho, a = torch.exp(logp[i, t] - b["old"][i, t]), b["adv"][i]
        pg = -torch.minimum(rho * a, _clip(rho, 1 - EPS_LOW, 1 + EPS_HIGH) * a)
        x = b["ref"][i, t] - logp[i, t]
        total = total + pg * m + beta * (x.exp() - x - 1) - coef * entropy[i, t] * m
    return total / len(_tokens())


@pytest.mark.parametrize("quantile", [0.2, 0.5, 0.0])
def test_top_entropy_quantile_equals_trl(quantile):
    b = _batch()
    kw = dict(ref_logp=b["ref"], beta=0.05, kl_estimator="k3", kl_clamp=10.0, entropy_coef=0.03)
    value, grad_logp, grad_entropy = _ours(b, "token_mean", top_entropy_quantile=quantile, **kw)
    logp, entropy = b["logp"].clone().requires_grad_(), b["entropy"].clone().requires_grad_()
    peer = _trl_dapo_top_entropy(logp, entropy, b, quantile, 0.05, 0.03)
    peer.backward()
    torch.testing.assert_close(value, peer.detach(), **TOL)
    torch.testing.assert_close(grad_logp, logp.grad, **TOL)
    torch.testing.assert_close(grad_entropy, entropy.grad, **TOL)
    # the kept tokens: ceil-ish share of the 14 trained ones (linear quantile), the highest alone at 0
    kept = int((grad_entropy != 0).sum())
    assert kept == {0.2: 3, 0.5: 7, 0.0: 1}[quantile]


def _trl_gspo(logp, b):
    # TRL grpo_trainer.py, importance_sampling_level 'sequence' with loss_type 'grpo': s = exp(mean over trained
    # tokens of log rho), loss per sequence -min(s A, clip(s) A), averaged over all B sequences (an untrained one
    # contributes 0). The gradient flows through s itself.
    total = 0.0
    for i, n in enumerate(LENGTHS):
        if n == 0:
            continue
        s, a = torch.exp((logp[i, :n] - b["old"][i, :n]).mean()), b["adv"][i]
        total = total - torch.minimum(s * a, _clip(s, 1 - EPS_LOW, 1 + EPS_HIGH) * a)
    return total / len(LENGTHS)


def _trl_luspo(logp, b):
    # TRL grpo_trainer.py, loss_type 'luspo' with importance_sampling_level 'sequence': the sequence-level loss of
    # _trl_gspo on each of the sequence's trained tokens, (per_token_loss * mask).sum(-1).mean() over all B rows.
    total = 0.0
    for i, n in enumerate(LENGTHS):
        if n == 0:
            continue
        s, a = torch.exp((logp[i, :n] - b["old"][i, :n]).mean()), b["adv"][i]
        total = total - n * torch.minimum(s * a, _clip(s, 1 - EPS_LOW, 1 + EPS_HIGH) * a)
    return total / len(LENGTHS)


def test_gspo_with_sequence_sum_equals_trl_luspo():
    b = _batch()
    _assert_same(_ours(b, "sequence_sum", policy_loss="gspo"), _peer(b, _trl_luspo))
    # sum_constant with loss_constant 1 is the same aggregation
    _assert_same(_ours(b, "sum_constant", constant=1.0, policy_loss="gspo"), _peer(b, _trl_luspo))


def _verl_gspo(logp, b):
    # verl core_algos.py compute_policy_loss_gspo: per token s_t = sg[s] * pi_t / sg[pi_t] (log clamped at 10),
    # loss -max... as the clipped surrogate, agg 'seq-mean-token-mean' over the sequences with a trained token.
    seqs = [i for i, n in enumerate(LENGTHS) if n]
    total = 0.0
    for i in seqs:
        n, a = LENGTHS[i], b["adv"][i]
        log_s = (logp[i, :n] - b["old"][i, :n]).mean().detach()
        s_t = torch.exp(torch.clamp(logp[i, :n] - logp[i, :n].detach() + log_s, max=10.0))
        total = total + torch.maximum(-a * s_t, -a * _clip(s_t, 1 - EPS_LOW, 1 + EPS_HIGH)).mean()
    return total / len(seqs)


def test_gspo_equals_trl_sequence_level_and_verl_gspo():
    b = _batch()
    ours = _ours(b, "sequence_mean", policy_loss="gspo")
    peer = _peer(b, _trl_gspo)
    _assert_same(ours, peer)
    # verl counts only sequences with a trained token
    ours_verl = _ours(b, "sequence_mean", batch_sequences=sum(1 for n in LENGTHS if n), policy_loss="gspo")
    peer_verl = _peer(b, _verl_gspo)
    torch.testing.assert_close(ours_verl[0], peer_verl[0], **TOL)
    torch.testing.assert_close(ours_verl[1], peer_verl[1], **TOL)
    assert (ours[1] - _ours(b, "sequence_mean")[1]).abs().max() > 1e-3  # not the token-level surrogate


def _open_instruct_cispo(logp, b):
    # open-instruct grpo_utils.py compute_grpo_loss, loss_fn cispo: -A * min(sg[rho], 1 + clip_higher) * logp,
    # masked_mean with loss_denominator 'token'. TRL loss_type 'cispo' is the same with epsilon_high as the cap.
    total = 0.0
    for i, t in _tokens():
        rho = torch.exp(logp[i, t] - b["old"][i, t]).detach()
        total = total - b["adv"][i] * torch.clamp(rho, max=1 + EPS_HIGH) * logp[i, t]
    return total / len(_tokens())


def _verl_cispo(logp, b, clip_ratio_low):
    # verl core_algos.py compute_policy_loss_cispo: -sg[clip(rho, 1 - low, 1 + high)] * A * logp, token-mean.
    total = 0.0
    for i, t in _tokens():
        rho = torch.exp(logp[i, t] - b["old"][i, t]).detach()
        total = total - _clip(rho, 1 - clip_ratio_low, 1 + EPS_HIGH) * b["adv"][i] * logp[i, t]
    return total / len(_tokens())


def test_cispo_equals_open_instruct_trl_and_verl_with_no_lower_clip():
    b = _batch()
    ours = _ours(b, "token_mean", policy_loss="cispo")
    for peer in (_peer(b, _open_instruct_cispo), _peer(b, lambda lp, bb: _verl_cispo(lp, bb, 1.0))):
        _assert_same(ours, peer)
    # verl's default lower clip (1 - 0.2) is a different loss
    assert (ours[1] - _peer(b, lambda lp, bb: _verl_cispo(lp, bb, EPS_LOW))[1]).abs().max() > 1e-3


def _sapo_gate(rho, a, tau_pos, tau_neg):
    tau = tau_pos if a > 0 else tau_neg
    return torch.sigmoid(tau * (rho - 1)) * 4 / tau


def _trl_sapo(logp, b, tau_pos, tau_neg):
    # TRL grpo_trainer.py loss_type 'sapo': -A sigmoid(tau (rho - 1)) 4 / tau, tau = sapo_temperature_pos if A > 0
    # else _neg; aggregated as 'grpo' (per-sequence mean, then mean over all B sequences).
    total = 0.0
    for i, n in enumerate(LENGTHS):
        if n:
            rho, a = torch.exp(logp[i, :n] - b["old"][i, :n]), b["adv"][i]
            total = total + (-a * _sapo_gate(rho, a, tau_pos, tau_neg)).mean()
    return total / len(LENGTHS)


def _verl_sapo(logp, b, tau_pos, tau_neg):
    # verl core_algos.py compute_policy_loss_sapo: the same gate, 'seq-mean-token-mean' over sequences with a token.
    seqs = [i for i, n in enumerate(LENGTHS) if n]
    total = 0.0
    for i in seqs:
        rho, a = torch.exp(logp[i, : LENGTHS[i]] - b["old"][i, : LENGTHS[i]]), b["adv"][i]
        total = total + (-a * _sapo_gate(rho, a, tau_pos, tau_neg)).mean()
    return total / len(seqs)


def test_sapo_equals_trl_and_verl():
    b = _batch()
    ours = _ours(b, "sequence_mean", policy_loss="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05)
    peer = _peer(b, lambda lp, bb: _trl_sapo(lp, bb, 1.0, 1.05))
    _assert_same(ours, peer)
    ours_verl = _ours(b, "sequence_mean", batch_sequences=4, policy_loss="sapo", sapo_tau_pos=2.0, sapo_tau_neg=3.0)
    peer_verl = _peer(b, lambda lp, bb: _verl_sapo(lp, bb, 2.0, 3.0))
    torch.testing.assert_close(ours_verl[0], peer_verl[0], **TOL)
    torch.testing.assert_close(ours_verl[1], peer_verl[1], **TOL)


def _trl_vespo(logp, b, k_pos, lam_pos, k_neg, lam_neg):
    # TRL grpo_trainer.py get_gamma_weights and loss_type 'vespo': log w = sum over the sequence's trained tokens of
    # clamp(log rho, -20, 20), clamped to [log 1e-8, 20]; phi = exp(lam + k log w - lam w), no gradient, (k, lam) by
    # the sign of A (A >= 0: _pos); per token -phi A logp; aggregated as 'dapo' (token mean).
    total = 0.0
    for i, n in enumerate(LENGTHS):
        a = float(b["adv"][i])
        log_w = float(sum(_clip(logp[i, t] - b["old"][i, t], -20.0, 20.0).detach() for t in range(n)))
        log_w = min(max(log_w, math.log(1e-8)), 20.0)
        k, lam = (k_pos, lam_pos) if a >= 0 else (k_neg, lam_neg)
        phi = math.exp(lam + k * log_w - lam * math.exp(log_w))
        for t in range(n):
            total = total - phi * a * logp[i, t]
    return total / len(_tokens())


def test_vespo_equals_trl():
    b = _batch()
    knobs = dict(vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0)
    ours = _ours(b, "token_mean", policy_loss="vespo", **knobs)
    _assert_same(ours, _peer(b, lambda lp, bb: _trl_vespo(lp, bb, 2.0, 3.0, 3.0, 2.0)))
    # on-policy w = 1 and phi(1) = 1: the plain policy gradient -A logp, by hand
    on_policy = dict(b, old=b["logp"])
    value, _ = _ours(on_policy, "token_mean", policy_loss="vespo", **knobs)
    by_hand = sum(-b["adv"][i] * b["logp"][i, t] for i, t in _tokens()) / len(_tokens())
    torch.testing.assert_close(value, by_hand, **TOL)


def _trl_off_policy_masked(logp, entropy, b, beta, coef, threshold):
    # TRL grpo_trainer.py get_off_policy_mask: per sequence, the mean over trained tokens of sampling logp - logp
    # (detached); kept where A >= 0 or that mean <= threshold; the policy term times the mask, then + beta * k3;
    # loss_type 'dapo'; the entropy bonus - coef * H on every trained token (the mask does not reach it).
    total = 0.0
    for i, n in enumerate(LENGTHS):
        a = b["adv"][i]
        drift = sum(b["rollout"][i, t] - logp[i, t].detach() for t in range(n)) / max(n, 1)
        keep = float(a >= 0 or drift <= threshold)
        for t in range(n):
            rho = torch.exp(logp[i, t] - b["old"][i, t])
            x = b["ref"][i, t] - logp[i, t]
            pg = -torch.minimum(rho * a, _clip(rho, 1 - EPS_LOW, 1 + EPS_HIGH) * a)
            total = total + pg * keep + beta * (x.exp() - x - 1) - coef * entropy[i, t]
    return total / len(_tokens())


def test_off_policy_sequence_mask_equals_trl():
    b = _batch(seed=3)  # the second row (A < 0) has drifted less than the fourth, and keeps a policy gradient
    drift = {i: float((b["rollout"][i, :n] - b["logp"][i, :n]).mean()) for i, n in enumerate(LENGTHS) if n}
    threshold = (drift[1] + drift[3]) / 2  # between the two negative-advantage sequences': one of them is masked
    kept = off_policy_sequences(b["logp"], b["rollout"], b["adv"][:, None], Sequences.one_per_row(b["mask"]), threshold)
    assert [int(kept[i, 0]) for i in (0, 1, 3, 4)].count(0) == 1  # A >= 0 rows always stay
    kl = dict(ref_logp=b["ref"], beta=0.05, kl_estimator="k3", kl_clamp=10.0, entropy_coef=0.03)
    value, grad_logp, grad_entropy = _ours(b, "token_mean", kept_sequences=kept, **kl)
    entropy = b["entropy"].clone().requires_grad_()
    peer = _peer(b, lambda lp, bb: _trl_off_policy_masked(lp, entropy, bb, 0.05, 0.03, threshold))
    _assert_same((value, grad_logp), peer)
    torch.testing.assert_close(grad_entropy, entropy.grad, **TOL)  # the bonus is not masked
    assert (grad_logp - _ours(b, "token_mean", **kl)[1]).abs().max() > 1e-3


def test_entropy_bonus_equals_trl_and_verl_token_mean():
    # TRL grpo_trainer.py: loss - entropy_coef * sum(H * mask) / tokens (loss_type dapo); verl dp_actor.py:
    # policy_loss - entropy_coeff * agg_loss(entropy, 'token-mean'). Same formula under token-mean.
    b = _batch()
    coef = 0.03
    value, grad_logp, grad_entropy = _ours(b, "token_mean", entropy_coef=coef)
    n = len(_tokens())
    entropy_term = sum(b["entropy"][i, t] for i, t in _tokens()) / n
    peer = _peer(b, lambda lp, bb: _trl_dapo_k3(lp, bb, 0.0))
    torch.testing.assert_close(value, peer[0] - coef * entropy_term, **TOL)
    torch.testing.assert_close(grad_logp, peer[1], **TOL)
    torch.testing.assert_close(grad_entropy, -coef * b["mask"] / n, **TOL)


# --- KL estimators: values and gradients per token ---------------------------------------------------------
def _open_instruct_kl(logp, b, which):
    # open-instruct model_utils.py estimate_kl, d = logp - ref: [d, d^2/2, expm1(-d) + d, rho d] with
    # rho = exp(logp - old) in the graph; grpo_utils.py adds beta * kl per token; token mean here.
    total = 0.0
    for i, t in _tokens():
        d = logp[i, t] - b["ref"][i, t]
        rho = torch.exp(logp[i, t] - b["old"][i, t])
        total = total + [d, d * d / 2, torch.expm1(-d) + d, rho * d][which]
    return total / len(_tokens())


@pytest.mark.parametrize("name,which", [("k1", 0), ("k2", 1), ("k3", 2), ("ratio_k1", 3)])
def test_kl_estimators_equal_open_instruct(name, which):
    b = _batch()
    zero = dict(b, adv=torch.zeros_like(b["adv"]))  # policy term 0: the loss is the KL alone
    ours = _ours(zero, "token_mean", ref_logp=b["ref"], beta=1.0, kl_estimator=name, kl_clamp=40.0)
    peer = _peer(b, lambda lp, bb: _open_instruct_kl(lp, bb, which))
    _assert_same(ours, peer)


@pytest.mark.parametrize("name,which", [("k1+", 0), ("k2+", 1), ("k3+", 2)])
def test_straight_through_estimators_have_kn_value_and_k2_gradient(name, which):
    # verl core_algos.py kl_penalty with a '+' name (docs/algo/grpo.md; at b178a3c the name reaches
    # kl_penalty_forward unstripped and raises, fixed by verl PR #6058): kN's value, the gradient of d^2/2.
    b = _batch()
    zero = dict(b, adv=torch.zeros_like(b["adv"]))
    value, grad = _ours(zero, "token_mean", ref_logp=b["ref"], beta=1.0, kl_estimator=name, kl_clamp=40.0)
    torch.testing.assert_close(value, _open_instruct_kl(b["logp"], b, which), **TOL)
    torch.testing.assert_close(grad, _peer(b, lambda lp, bb: _open_instruct_kl(lp, bb, 1))[1], **TOL)


# --- expected gradients on an exact vocabulary ------------------------------------------------------------
V = 5


def _vocabulary(seed):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(V, generator=g, dtype=F64)
    return theta, torch.log_softmax(torch.randn(V, generator=g, dtype=F64), -1), torch.randn(V, generator=g, dtype=F64)


def _expected_gradient(estimator, theta, ref, old_logits=None):
    """d/dtheta of sum_y pi_old(y) * estimator(y): the estimator's expected gradient when single-token sequences
    are sampled from pi_old (pi_old = pi, detached, when old_logits is None)."""
    theta = theta.clone().requires_grad_()
    logp = torch.log_softmax(theta, -1)
    old = logp.detach() if old_logits is None else torch.log_softmax(old_logits, -1)
    out = grpo_token_loss(
        logp[None],
        old[None],
        torch.zeros(1, 1, dtype=F64),
        eps_low=0.2,
        eps_high=0.2,
        ref_logp=ref[None],
        beta=1.0,
        kl_estimator=estimator,
        kl_clamp=50.0,
    )
    expected = (old.exp() * out["kl"][0]).sum()
    (grad,) = torch.autograd.grad(expected, theta)
    return expected.detach(), grad


def _kl_gradients(theta, ref):
    """(value and gradient of KL(pi || ref), gradient of KL(ref || pi)), exactly."""
    theta = theta.clone().requires_grad_()
    logp = torch.log_softmax(theta, -1)
    forward = (logp.exp() * (logp - ref)).sum()
    (grad_forward,) = torch.autograd.grad(forward, theta, retain_graph=True)
    (grad_reverse,) = torch.autograd.grad((ref.exp() * (ref - logp)).sum(), theta)
    return forward.detach(), grad_forward, grad_reverse


@pytest.mark.parametrize(
    "estimator,follows",
    [
        ("k1", "zero"),
        ("k2", "forward"),
        ("k3", "reverse"),
        ("ratio_k1", "forward"),
        ("ratio_k3", "forward"),
        ("k1+", "forward"),
        ("k2+", "forward"),
        ("k3+", "forward"),
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_expected_gradient_on_policy(estimator, follows, seed):
    theta, ref, _ = _vocabulary(seed)
    kl, grad_forward, grad_reverse = _kl_gradients(theta, ref)
    value, grad = _expected_gradient(estimator, theta, ref)
    want = {"zero": torch.zeros(V, dtype=F64), "forward": grad_forward, "reverse": grad_reverse}[follows]
    torch.testing.assert_close(grad, want, rtol=1e-9, atol=1e-12)
    assert (grad_forward - grad_reverse).abs().max() > 1e-3  # the two KLs' gradients really differ here
    if estimator in ("k1", "k3", "ratio_k1", "ratio_k3", "k1+", "k3+"):  # unbiased values of KL(pi || ref)
        torch.testing.assert_close(value, kl, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_ratio_k1_expected_gradient_off_policy(seed):
    """E_old[grad(rho d)] = grad sum_y pi d = grad KL(pi || ref) for any pi_old (ratio_k3 too, its value
    unbiased off-policy); a detached rho (the earlier version) had expected gradient E_old[rho grad log pi] =
    grad sum_y pi = 0."""
    theta, ref, old_logits = _vocabulary(seed)
    kl, grad_forward, _ = _kl_gradients(theta, ref)
    _, grad = _expected_gradient("ratio_k1", theta, ref, old_logits)
    torch.testing.assert_close(grad, grad_forward, rtol=1e-9, atol=1e-12)
    value, grad = _expected_gradient("ratio_k3", theta, ref, old_logits)
    torch.testing.assert_close((value, grad), (kl, grad_forward), rtol=1e-9, atol=1e-12)
    theta = theta.clone().requires_grad_()
    logp, old = torch.log_softmax(theta, -1), torch.log_softmax(old_logits, -1)
    detached = (old.exp() * torch.exp(logp - old).detach() * (logp - ref)).sum()
    (grad_detached,) = torch.autograd.grad(detached, theta)
    assert grad_detached.abs().max() < 1e-12 < grad_forward.abs().max()


# --- importance sampling against the rollout engine ---------------------------------------------------------
def _trl_is_weights(b, mode, clip_min, clip_max):
    # TRL grpo_trainer.py (vllm_importance_sampling_mode): log ratio old - sampling per trained token, summed per
    # sequence for sequence_*; *_truncate clamps into [clip_min, clip_max], *_mask zeroes ratios outside.
    level, kind = mode.split("_")
    w = torch.zeros_like(b["mask"])
    for i, n in enumerate(LENGTHS):
        diffs = [b["old"][i, t] - b["rollout"][i, t] for t in range(n)]
        logs = [sum(diffs)] * n if level == "sequence" else diffs
        for t, x in enumerate(logs):
            r = math.exp(float(x))
            if kind == "truncate":
                w[i, t] = min(max(r, clip_min), clip_max)
            else:
                w[i, t] = r if clip_min <= r <= clip_max else 0.0
    return w


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_importance_weights_equal_trl(level, mode):
    b = _batch()
    floor, cap = 0.85, 1.2
    ours = importance_weights(
        b["old"], b["rollout"], Sequences.one_per_row(b["mask"]), level=level, mode=mode, floor=floor, cap=cap
    )
    want = _trl_is_weights(b, f"{level}_{mode}", floor, cap)
    torch.testing.assert_close(ours, want, **TOL)
    inside = (want > floor) & (want < cap)
    assert inside.any() and (b["mask"].bool() & ~inside).any()  # both branches of the bound are exercised
    # the weights multiply the policy term only; the loss's gradient is the weighted one
    value, grad = _ours(b, "token_mean", is_weights=ours)
    peer = _peer(b, lambda lp, bb: _weighted_dapo(lp, bb, want))
    torch.testing.assert_close(value, peer[0], **TOL)
    torch.testing.assert_close(grad, peer[1], **TOL)
    assert (grad - _peer(b, lambda lp, bb: _trl_dapo_k3(lp, bb, 0.0))[1]).abs().max() > 0


def _weighted_dapo(logp, b, weights):
    total = 0.0
    for i, t in _tokens():
        rho, a = torch.exp(logp[i, t] - b["old"][i, t]), b["adv"][i]
        total = total - torch.minimum(rho * a, _clip(rho, 1 - EPS_LOW, 1 + EPS_HIGH) * a) * weights[i, t]
    return total / len(_tokens())


# --- aggregations -----------------------------------------------------------------------------------------
def test_aggregations_against_trl_and_verl_formulas():
    b = _batch()
    loss = torch.rand(b["mask"].shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    mask, B, C = b["mask"], len(LENGTHS), 7.0

    def ours(name):
        w = AGGREGATIONS[name](mask, mask.sum(-1, keepdim=True).expand_as(mask), mask.sum().item(), B, C)
        return (loss * w).sum()

    tokens = _tokens()
    total = sum(loss[i, t] for i, t in tokens)
    # TRL loss_type dapo / verl token-mean: sum / trained tokens
    torch.testing.assert_close(ours("token_mean"), total / len(tokens), **TOL)
    # TRL loss_type grpo: per-sequence mean (0 for an untrained one), then mean over the B sequences
    per_seq = [sum(loss[i, t] for t in range(n)) / max(n, 1) for i, n in enumerate(LENGTHS)]
    torch.testing.assert_close(ours("sequence_mean"), sum(per_seq) / B, **TOL)
    # TRL loss_type dr_grpo: sum / (B * max_completion_length)
    torch.testing.assert_close(ours("sum_constant"), total / (B * C), **TOL)
    # verl seq-mean-token-sum-norm with one micro-batch: sum / C, N times ours
    torch.testing.assert_close(ours("sum_constant") * B, total / C, **TOL)


# --- advantages -------------------------------------------------------------------------------------------
REWARDS = [1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 9.0, 3.0, 0.5, 0.5, 0.5, 0.5]  # group c has zero std
GROUPS = ["a"] * 4 + ["b"] * 3 + ["solo"] + ["c"] * 4


def _by_group():
    out: dict[str, list[int]] = {}
    for k, g in enumerate(GROUPS):
        out.setdefault(g, []).append(k)
    return out


def test_rloo_equals_trl_and_verl():
    # TRL rloo_trainer.py: baseline = (group sum - r) / (G - 1), a one-member group gets 0 (0/0 -> nan -> 0).
    # verl compute_rloo_outcome_advantage: r G/(G-1) - mean G/(G-1) for G > 1 (a one-member group keeps r).
    ours = compute_advantages(REWARDS, GROUPS, "rloo", eps=1e-4)
    for members in _by_group().values():
        G = len(members)
        for k in members:
            others = [REWARDS[j] for j in members if j != k]
            trl = REWARDS[k] - sum(others) / len(others) if G > 1 else 0.0
            assert ours[k] == pytest.approx(trl, abs=1e-12)
            if G > 1:
                mean = sum(REWARDS[j] for j in members) / G
                assert ours[k] == pytest.approx(REWARDS[k] * G / (G - 1) - mean * G / (G - 1), abs=1e-12)
    assert np.all(ours[8:] == 0.0)


def _verl_whiten(values: list[float]) -> list[float]:
    # verl torch_functional.py masked_whiten over one-token responses: (v - mean) * rsqrt(unbiased var + 1e-8).
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / n * n / (n - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


def test_reinforce_pp_equals_verl_on_one_token_responses():
    # verl compute_reinforce_plus_plus_outcome_advantage with gamma 1: the return of a one-token response is its
    # reward, whitened over the batch's tokens.
    ours = compute_advantages(REWARDS, GROUPS, "reinforce_pp", eps=0.0, ddof=1)
    np.testing.assert_allclose(ours, _verl_whiten(REWARDS), rtol=1e-6, atol=1e-6)
    assert abs(ours[8]) > 0.1  # no group baseline: the zero-std group still has an advantage


def test_reinforce_pp_baseline_equals_verl_for_groups_of_two_or_more():
    # verl compute_reinforce_plus_plus_baseline_outcome_advantage: r - group mean, then masked_whiten.
    keep = [k for k, g in enumerate(GROUPS) if g != "solo"]
    rewards, groups = [REWARDS[k] for k in keep], [GROUPS[k] for k in keep]
    ours = compute_advantages(rewards, groups, "reinforce_pp_baseline", eps=0.0, ddof=1)
    mean = {g: np.mean([r for r, h in zip(rewards, groups) if h == g]) for g in groups}
    centred = [r - mean[g] for r, g in zip(rewards, groups)]
    np.testing.assert_allclose(ours, _verl_whiten(centred), rtol=1e-6, atol=1e-6)
    assert np.all(ours[-4:] == 0.0)  # zero-std group
    # it is not batch_std, which scales by the std of the raw rewards
    assert not np.allclose(ours, compute_advantages(rewards, groups, "batch_std", eps=0.0, ddof=1))


def test_group_normalisers_equal_trl_verl_and_open_instruct():
    by_group = _by_group()

    def group_stat(k, ddof):
        vals = [REWARDS[j] for j in by_group[GROUPS[k]]]
        return np.mean(vals), (np.std(vals, ddof=ddof) if len(vals) > ddof else 0.0)

    # TRL scale_rewards 'group' (nanstd: ddof 1, eps 1e-4); open-instruct 'standard' (np.std: ddof 0, eps 1e-8)
    for ddof, eps in ((1, 1e-4), (0, 1e-8)):
        ours = compute_advantages(REWARDS, GROUPS, "group_std", eps=eps, ddof=ddof)
        want = [(r - group_stat(k, ddof)[0]) / (group_stat(k, ddof)[1] + eps) for k, r in enumerate(REWARDS)]
        np.testing.assert_allclose(ours, want, rtol=1e-6, atol=1e-6)
    # TRL scale_rewards 'batch': group mean, std of all rewards (ddof 1), eps 1e-4
    ours = compute_advantages(REWARDS, GROUPS, "batch_std", eps=1e-4, ddof=1)
    want = [(r - group_stat(k, 1)[0]) / (np.std(REWARDS, ddof=1) + 1e-4) for k, r in enumerate(REWARDS)]
    np.testing.assert_allclose(ours, want, rtol=1e-6, atol=1e-6)
    # open-instruct 'centered' / TRL 'none' / verl norm_adv_by_std_in_grpo False: r - group mean
    ours = compute_advantages(REWARDS, GROUPS, "none", eps=1e-4)
    np.testing.assert_allclose(ours, [r - group_stat(k, 0)[0] for k, r in enumerate(REWARDS)], atol=1e-12)


# --- sequences in packed and shared-prompt batches ----------------------------------------------------------
def test_sequence_index_groups_packed_and_shared_prompt_tokens():
    a, b2, c = (
        TrainSample([1, 2], [5, 6, 7], 1.0, [-1.0, -2.0, -3.0]),
        TrainSample([1], [8], -1.0, [-4.0]),
        TrainSample([3, 4, 5], [9, 9], 0.5, [-5.0, -7.0], [True, False]),
    )
    packed = collate_rows([[a, b2], [c]], pad_id=0)
    seqs = Sequences(packed["sequence_index"], packed["mask"])
    means = seqs.mean(packed["rollout_logprobs"])
    trained = packed["mask"].bool()
    # a: -2 over 3 tokens, b: -4, c: only its first token is trained: -5
    assert sorted(set(means[trained].tolist())) == [-5.0, -4.0, -2.0]
    assert means[0][packed["advantages"][0] == 1.0].tolist() == [-2.0] * 3
    group = collate_group([a, TrainSample([1, 2], [4], 0.0, [-0.5])], pad_id=0)
    sums = Sequences(group["sequence_index"], group["mask"]).sum(group["rollout_logprobs"])
    assert sums[0, :3].tolist() == [-6.0] * 3 and sums[1, 0].item() == -0.5


def test_token_entropy_from_the_learner_logits(tiny_model_path):
    from refiner_core.models import load_model

    model = load_model(tiny_model_path)
    batch = collate_rows([[TrainSample([3, 4, 5], [6, 7, 8, 9], 0.0, [0.0] * 4)]], pad_id=0)
    with torch.no_grad():
        logp, entropy = token_scores(model, batch, 0.7, entropy=True)
        torch.testing.assert_close(logp, token_logprobs(model, batch, 0.7))
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[:, :-1] / 0.7
        want = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    scored = batch["mask"].bool()
    torch.testing.assert_close(entropy[scored], want[scored], rtol=1e-5, atol=1e-5)
    assert (entropy[scored] > 1.0).all()


# --- a recipe setting each option runs one update of the torch learner -----------------------------------------
OPTIONS = [
    ["grpo.policy_loss=dual_clip", "grpo.dual_clip_c=1.5"],
    ["grpo.policy_loss=gspo", "grpo.loss_aggregation=sequence_mean"],
    ["grpo.policy_loss=cispo"],
    ["grpo.policy_loss=sapo", "grpo.sapo_tau_neg=2.0"],
    ["grpo.kl_estimator=ratio_k1"],
    ["grpo.kl_estimator=k1+"],
    ["grpo.kl_estimator=k2+"],
    ["grpo.kl_estimator=k3+"],
    ["grpo.entropy_coef=0.01"],
    [
        "grpo.tis_cap=2.0",
        "grpo.tis_floor=0.5",
        "grpo.tis_level=sequence",
        "grpo.tis_mode=mask",
        "grpo.share_prompt=false",
        "grpo.pack_length=64",
    ],
    ["grpo.tis_cap=2.0", "grpo.tis_floor=0.8", "grpo.tis_mode=truncate"],
    ["grpo.advantage=rloo"],
    ["grpo.advantage=reinforce_pp"],
    ["grpo.advantage=reinforce_pp_baseline"],
    ["grpo.epochs=2", "grpo.mask_truncated=true"],
    ["grpo.policy_loss=kl_cov", "grpo.kl_cov_ratio=0.1"],
    ["grpo.policy_loss=clip_cov", "grpo.clip_cov_ratio=0.1", "grpo.clip_cov_lb=-10"],
    ["grpo.policy_loss=vespo", "grpo.off_policy_mask_threshold=0.01"],
    ["grpo.top_entropy_quantile=0.2", "grpo.share_prompt=false", "grpo.micro_batch_size=3"],
]


@pytest.mark.parametrize("overrides", OPTIONS, ids=lambda o: ",".join(x.split(".", 1)[1] for x in o))
def test_recipe_option_runs_one_update(tiny_model_path, overrides):
    from refiner_core.models import load_model

    grpo = load_recipe(None, [*overrides, "grpo.minibatches=2", "grpo.beta=0.05", "grpo.learning_rate=1e-3"]).grpo
    g = torch.Generator().manual_seed(0)
    rollouts, rewards = [], []
    for p in range(2):
        prompt = torch.randint(3, 2000, (5 + p,), generator=g).tolist()
        for k in range(4):
            response = torch.randint(3, 2000, (3 + k,), generator=g).tolist()
            rollouts.append(
                {
                    "prompt_id": str(p),
                    "sample_idx": k,
                    "prompt_token_ids": prompt,
                    "response_token_ids": response,
                    "response_logprobs": [-7.6] * len(response),
                    "finish_reason": "length" if k == 3 else "stop",
                }
            )
            rewards.append({"prompt_id": str(p), "sample_idx": k, "reward": float((k * (p + 1)) % 3)})
    samples, _, _ = build_train_samples(rollouts, rewards, grpo)
    assert len(samples) == (6 if grpo.mask_truncated else 8)
    torch.manual_seed(0)
    policy = load_model(tiny_model_path, trainable=True)
    before = [p.detach().clone() for p in policy.parameters()]
    learner = TorchLearner(policy, load_model(tiny_model_path), 0, learner_settings(grpo, 1.0, "fp32"))
    metrics = learner.train_step(samples)
    assert all(math.isfinite(metrics[k]) for k in ("loss", "pg_loss", "kl", "grad_norm"))
    assert metrics["grad_norm"] > 0
    assert any((p.detach() - q).abs().max() > 0 for p, q in zip(policy.parameters(), before))
    assert ("entropy" in metrics) == (grpo.entropy_coef != 0 or grpo.top_entropy_quantile < 1)


def test_defaults_keep_the_clipped_surrogate_and_token_truncation():
    grpo = load_recipe(None).grpo
    assert (
        grpo.policy_loss,
        grpo.kl_estimator,
        grpo.entropy_coef,
        grpo.tis_cap,
        grpo.tis_floor,
        grpo.tis_level,
        grpo.tis_mode,
        grpo.advantage,
    ) == ("ppo_clip", "k3", 0.0, 0.0, 0.0, "token", "truncate", "group_std")


def test_unknown_names_and_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="not one of"):
        load_recipe(None, ["grpo.policy_loss=ppo2"])
    grpo = load_recipe(None, ["grpo.policy_loss=dual_clip", "grpo.dual_clip_c=0.9"]).grpo
    with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
        learner_settings(grpo, 1.0, "fp32")
    grpo = load_recipe(None, ["grpo.tis_cap=2", "grpo.tis_floor=3"]).grpo
    with pytest.raises(ValueError, match="tis_floor"):
        learner_settings(grpo, 1.0, "fp32")
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3", "ratio_k1", "ratio_k3", "k1+", "k2+", "k3+"}
