"""GRPO math against hand-computed cases and a float64 reference."""

import math

import numpy as np
import pytest
import torch

from conftest import learner_settings
from refiner_core.algo.advantages import compute_advantages, zero_std_groups
from refiner_core.algo.losses import AGGREGATIONS, KL_ESTIMATORS, grpo_token_loss
from refiner_core.config import GRPOConfig, load_recipe
from refiner_core.grpo import build_train_samples
from refiner_core.learners.base import TrainSample
from refiner_core.learners.batching import collate
from refiner_core.learners.torch_learner import TorchLearner


def test_group_advantages_hand_computed():
    rewards = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    groups = ["a"] * 4 + ["b"] * 4
    adv = compute_advantages(rewards, groups, "group_std", eps=0.0 + 1e-12)
    # group a: mean 0.5, std (ddof 0) 0.5 -> +-1; group b: constant -> 0
    np.testing.assert_allclose(adv, [1, -1, -1, 1, 0, 0, 0, 0], atol=1e-9)
    assert zero_std_groups(rewards, groups) == {"b"}


def test_dropped_rollouts_leave_the_update_and_their_group_uses_the_others():
    """judge.on_failure 'drop': a rollout whose judgment failed takes no part; the group's advantages are those of
    the remaining samples, and an all-equal group is untrained under filter_zero_std_groups."""
    from refiner_core.algo.advantages import group_advantages

    rewards = [
        {"prompt_id": "a", "sample_idx": i, "reward": r, "dropped": d}
        for i, (r, d) in enumerate([(1.0, False), (3.0, False), (100.0, True)])
    ]
    rewards += [{"prompt_id": "b", "sample_idx": i, "reward": 2.0, "dropped": False} for i in range(2)]
    rows, stats = group_advantages(
        rewards,
        GRPOConfig(advantage="group_std", advantage_eps=1e-9, advantage_std_ddof=0, filter_zero_std_groups=True),
    )
    by = {(r["prompt_id"], r["sample_idx"]): r for r in rows}
    # mean 2, std 1: the dropped 100 is ignored
    assert by[("a", 0)]["advantage"] == pytest.approx(-1.0) and by[("a", 1)]["advantage"] == pytest.approx(1.0)
    assert by[("a", 2)]["advantage"] == 0.0 and not by[("a", 2)]["trained"]
    assert not by[("b", 0)]["trained"] and by[("a", 0)]["trained"]
    assert stats["zero_std_group_fraction"] == 0.5


def test_batch_std_and_dr_grpo():
    rewards = [3.0, 1.0, 0.0, 0.0]
    groups = [0, 0, 1, 1]
    np.testing.assert_allclose(compute_advantages(rewards, groups, "none", 1e-4), [1, -1, 0, 0])
    batch_std = np.std(rewards)
    np.testing.assert_allclose(
        compute_advantages(rewards, groups, "batch_std", 0.0), np.array([1, -1, 0, 0]) / batch_std
    )
    with pytest.raises(ValueError, match="unknown advantage"):
        compute_advantages(rewards, groups, "bogus", 0.0)


def test_kl_estimators_hand_computed():
    d = torch.tensor([0.0, 0.5, -1.0], dtype=torch.float64)
    ratio = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    torch.testing.assert_close(KL_ESTIMATORS["k1"](d, ratio), d)
    torch.testing.assert_close(KL_ESTIMATORS["k2"](d, ratio), torch.tensor([0.0, 0.125, 0.5], dtype=torch.float64))
    expected_k3 = torch.tensor([0.0, math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0], dtype=torch.float64)
    torch.testing.assert_close(KL_ESTIMATORS["k3"](d, ratio), expected_k3)
    torch.testing.assert_close(KL_ESTIMATORS["ratio_k1"](d, ratio), ratio * d)
    # k3 is non-negative everywhere and is an unbiased estimate of KL(p || q) under samples from p
    assert (KL_ESTIMATORS["k3"](torch.linspace(-5, 5, 101), torch.ones(101)) >= 0).all()
    p, q = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64), torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)
    exact = (p * (p / q).log()).sum()
    k3_mean = (p * KL_ESTIMATORS["k3"](p.log() - q.log(), torch.ones(3))).sum()
    torch.testing.assert_close(k3_mean, exact)


def _reference_loss(logp, old, ref, adv, mask, eps_low, eps_high, beta):
    """Straight float64 transcription of the GRPO objective, token by token."""
    total, count = 0.0, 0
    for b in range(len(logp)):
        for t in range(len(logp[0])):
            if not mask[b][t]:
                continue
            rho = math.exp(logp[b][t] - old[b][t])
            a = adv[b]
            pg = max(-a * rho, -a * min(max(rho, 1 - eps_low), 1 + eps_high))
            d = logp[b][t] - ref[b][t]
            total += pg + beta * (math.exp(-d) - 1 + d)
            count += 1
    return total / count


def test_clipped_loss_matches_float64_reference():
    g = torch.Generator().manual_seed(0)
    B, T = 3, 5
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logp + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 1.6  # ratios well outside the clip
    ref = logp + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5)
    adv = torch.tensor([1.5, -0.7, 0.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float64)
    out = grpo_token_loss(
        logp, old, adv[:, None], eps_low=0.2, eps_high=0.28, ref_logp=ref, beta=0.05, kl_estimator="k3", kl_clamp=10.0
    )
    got = _aggregate("token_mean", out["loss"], mask, 1.0).item()
    want = _reference_loss(logp.tolist(), old.tolist(), ref.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28, 0.05)
    assert math.isclose(got, want, rel_tol=1e-12)
    assert 0 < (out["clipped"] * mask).sum() < mask.sum()  # the case exercises both branches


def test_clip_hand_case_and_gradient_vanishes_when_clipped():
    logp = torch.tensor([[math.log(1.5)]], requires_grad=True)
    old = torch.zeros(1, 1)
    out = grpo_token_loss(logp, old, torch.tensor([2.0]), eps_low=0.2, eps_high=0.2)
    # rho = 1.5 > 1.2 with A > 0: loss = max(-3.0, -2.4) = -2.4, constant in logp
    assert math.isclose(out["loss"].item(), -2.4, rel_tol=1e-6)
    out["loss"].sum().backward()
    assert logp.grad.abs().item() == 0.0
    logp2 = torch.tensor([[math.log(1.1)]], requires_grad=True)
    out2 = grpo_token_loss(logp2, old, torch.tensor([2.0]), eps_low=0.2, eps_high=0.2)
    out2["loss"].sum().backward()
    assert math.isclose(logp2.grad.item(), -2.0 * 1.1, rel_tol=1e-6)  # d(-A*rho)/dlogp = -A*rho


def _aggregate(name, loss, mask, constant):
    """The aggregate of a padded batch with one sequence per row."""
    weights = AGGREGATIONS[name](
        mask, mask.sum(-1, keepdim=True).expand_as(mask), mask.sum().item(), mask.shape[0], constant
    )
    return (loss * weights).sum()


def test_aggregations_hand_computed():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert _aggregate("token_mean", loss, mask, 1.0).item() == pytest.approx(10 / 4)
    assert _aggregate("sequence_mean", loss, mask, 1.0).item() == pytest.approx((2 + 4) / 2)
    assert _aggregate("sum_constant", loss, mask, 8.0).item() == pytest.approx(10 / (2 * 8))


def test_dr_grpo_divides_by_sequences_times_constant():
    """TRL dr_grpo / verl seq-mean-token-sum-norm: 4 sequences x 10 unit losses, constant 10 -> 40 / (4 x 10)."""
    ones = torch.ones(4, 10)
    assert _aggregate("sum_constant", ones, ones, 10.0).item() == pytest.approx(1.0)
    # Packed layout: two rows holding 3 + 1 sequences give the same value (only the sequence count matters).
    assert (ones[:2] * AGGREGATIONS["sum_constant"](ones[:2], ones[:2], 20.0, 4, 10.0)).sum().item() == pytest.approx(
        0.5
    )


def test_collate_masks_only_response_positions():
    batch = collate([TrainSample([5, 6, 7], [8, 9], 1.0, [-0.1, -0.2]), TrainSample([5], [8], -1.0, [-0.3])], pad_id=0)
    # row 0: sequence 5 6 7 8 9 -> logits at positions 2, 3 predict 8, 9
    assert batch["mask"][0].tolist() == [0, 0, 1, 1]
    assert batch["targets"][0].tolist() == [6, 7, 8, 9]
    assert batch["mask"][1].tolist() == [1, 0, 0, 0]
    assert batch["rollout_logprobs"][0].tolist() == pytest.approx([0, 0, -0.1, -0.2])
    assert batch["advantages"][0].tolist() == [0, 0, 1, 1] and batch["advantages"][1].tolist() == [-1, 0, 0, 0]
    assert batch["sequence_tokens"].tolist() == [[0, 0, 2, 2], [1, 0, 0, 0]]
    # the padding tail restarts its positions so it forms no sequence with the real tokens
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 1, 0, 1, 2]]
    assert int(batch["real_tokens"]) == 7 and int(batch["sequences"]) == 2


def _settings(**kw):
    return learner_settings(**{"micro_batch_size": 8, **kw})


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "sum_constant"])
def test_micro_batching_equals_full_batch(tiny_model_path, aggregation):
    """Gradient accumulation over micro-batches must give the same update as one big batch."""
    from refiner_core.models import load_model

    samples = [
        TrainSample([1, 2, 3, 4][: 2 + k % 3], list(range(10, 13 + k)), adv, [-1.0] * (3 + k))
        for k, adv in enumerate([1.0, -0.5, 0.3, -0.8, 0.0])
    ]
    params = []
    for micro in (8, 2):
        torch.manual_seed(0)
        policy = load_model(tiny_model_path, trainable=True)
        reference = load_model(tiny_model_path)
        learner = TorchLearner(policy, reference, 0, _settings(micro_batch_size=micro, loss_aggregation=aggregation))
        metrics = learner.train_step(samples)
        # The accumulated gradient (kept after the step) is what must agree; Adam would amplify float noise.
        params.append(torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None]))
        assert metrics["response_tokens"] == sum(len(s.response_ids) for s in samples)
    assert params[0].abs().max() > 0
    torch.testing.assert_close(params[0], params[1], rtol=1e-4, atol=1e-7)


def test_epochs_pass_over_the_batch_again_against_the_first_pass_policy(tiny_model_path):
    """grpo.epochs 2 (TRL num_iterations, verl ppo_epochs): two optimizer steps over the same batch with pi_old
    frozen before the first, i.e. the update of minibatches 2 over the batch given twice. The second pass sees
    rho != 1, so with a tight clip some tokens are clipped."""
    from refiner_core.models import load_model

    samples = [
        TrainSample([1, 2, 3, 4][: 2 + k % 3], list(range(10, 13 + k)), adv, [-1.0] * (3 + k))
        for k, adv in enumerate([1.0, -0.5, 0.3, -0.8, 0.0])
    ]
    runs = {}
    for name, batch, kw in (
        ("epochs", samples, {"epochs": 2}),
        ("twice", samples + samples, {"minibatches": 2}),
        ("once", samples, {}),
    ):
        torch.manual_seed(0)
        policy = load_model(tiny_model_path, trainable=True)
        settings = _settings(clip_eps_low=0.01, clip_eps_high=0.01, **kw)
        metrics = TorchLearner(policy, load_model(tiny_model_path), 0, settings).train_step(batch)
        runs[name] = (metrics, torch.cat([p.detach().flatten() for p in policy.parameters()]))
    (epochs, weights), (twice, twice_weights) = runs["epochs"], runs["twice"]
    torch.testing.assert_close(weights, twice_weights, rtol=0, atol=1e-7)
    for key in ("loss", "pg_loss", "kl", "clip_fraction", "grad_norm"):
        assert epochs[key] == pytest.approx(twice[key], rel=1e-5, abs=1e-9), key
    assert runs["once"][0]["clip_fraction"] == 0 < epochs["clip_fraction"]
    assert (weights - runs["once"][1]).abs().max() > 1e-4  # the second pass moved the weights further


@pytest.mark.parametrize(
    "samples, minibatches, sizes", [(12, 5, [3, 3, 2, 2, 2]), (10, 4, [3, 3, 2, 2]), (3, 5, [1, 1, 1])]
)
def test_minibatches_are_that_many_optimizer_steps_of_even_size(tiny_model_path, samples, minibatches, sizes):
    """grpo.minibatches optimizer steps, the batch cut into parts whose sizes differ by at most one (ceil-sized
    parts ran 4 steps of 12 samples for 5, and 10 samples as 3, 3, 3, 1); fewer only where samples run out."""
    from refiner_core.models import load_model

    batch = [TrainSample([1, 2, 3], [10 + k, 11], 1.0 if k % 2 else -1.0, [-1.0, -1.0]) for k in range(samples)]
    learner = TorchLearner(
        load_model(tiny_model_path, trainable=True),
        None,
        0,
        _settings(micro_batch_size=1, minibatches=minibatches, beta=0.0),
    )
    layout = learner._layout(batch)
    assert [len(step) for step in layout] == sizes
    learner.train_step(batch)
    assert {int(state["step"]) for state in learner.optimizer.state.values()} == {len(sizes)}


def test_mask_truncated_trains_without_cut_off_responses_but_keeps_their_rewards_in_the_baseline():
    """Group p: rewards 0, 1, 0, 1, the last one cut off ('length'). Its mean 0.5 and std 0.5 (ddof 0) still
    include it: advantages -+0.5 / (0.5 + 1e-4) either way; only the truncated response leaves the update."""
    rollouts = [
        {
            "prompt_id": pid,
            "sample_idx": k,
            "prompt_token_ids": [1, 2],
            "response_token_ids": [3] * (k + 1),
            "response_logprobs": [-1.0] * (k + 1),
            "finish_reason": "length" if (pid, k) == ("p", 3) else "stop",
        }
        for pid in ("p", "q")
        for k in range(4)
    ]
    rewards = [
        {"prompt_id": r["prompt_id"], "sample_idx": r["sample_idx"], "reward": float(r["sample_idx"] % 2)}
        for r in rollouts
    ]
    off = build_train_samples(rollouts, rewards, load_recipe(None).grpo)
    on = build_train_samples(rollouts, rewards, load_recipe(None, ["grpo.mask_truncated=true"]).grpo)
    unit = 0.5 / (0.5 + 1e-4)
    assert [a["advantage"] for a in on[1]] == [a["advantage"] for a in off[1]] == pytest.approx([-unit, unit] * 4)
    assert [a["trained"] for a in on[1]] == [True, True, True, False, True, True, True, True]
    assert all(a["trained"] for a in off[1])
    assert (on[2]["masked_truncated"], off[2]["masked_truncated"]) == (1, 0)
    assert [len(s.response_ids) for s in on[0]] == [1, 2, 3, 1, 2, 3, 4]


def test_dr_grpo_gradient_does_not_grow_with_batch_size(tiny_model_path):
    """Under sum_constant the same sequences twice over give the same gradient: the lr carries across batch sizes."""
    from refiner_core.models import load_model

    samples = [
        TrainSample([1, 2, 3], list(range(10, 14 + k)), adv, [-1.0] * (4 + k)) for k, adv in enumerate([1.0, -0.5, 0.3])
    ]
    grads = []
    for batch in (samples, samples + samples):
        policy = load_model(tiny_model_path, trainable=True)
        TorchLearner(policy, None, 0, _settings(beta=0.0, loss_aggregation="sum_constant")).train_step(batch)
        grads.append(torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None]))
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-7)


def test_a_term_switched_on_without_its_knob_is_an_error_not_a_second_default():
    """The loss knobs have one default, the recipe's: a KL term or a variant asked for without its knob fails."""
    logp, old = torch.zeros(1, 2), torch.zeros(1, 2)
    with pytest.raises(ValueError, match="needs kl_estimator and kl_clamp"):
        grpo_token_loss(logp, old, torch.ones(1, 1), eps_low=0.2, eps_high=0.2, ref_logp=logp, beta=0.1)
    with pytest.raises(ValueError, match="needs dual_clip_c"):
        grpo_token_loss(logp, old, torch.ones(1, 1), eps_low=0.2, eps_high=0.2, policy_loss="dual_clip")
    with pytest.raises(ValueError, match="needs sapo_tau_pos, sapo_tau_neg"):
        grpo_token_loss(logp, old, torch.ones(1, 1), eps_low=0.2, eps_high=0.2, policy_loss="sapo")


class _OneTokenEngine:
    """Each sample's one token is 10 * (the prompt's place in the call) + its index: every response its own."""

    def generate(self, prompts, params, desc=""):
        from refiner_core.rollout.base import Generation

        return [
            Generation(p, s, [10 + 10 * p + s], [-1.0], "", "stop")
            for p in range(len(prompts))
            for s in range(params.n)
        ]


class _KeepingLearner:
    def train_step(self, samples, lr=None, bonus=None):
        self.samples = samples
        return {}


def test_a_prompt_is_drawn_once_per_step_and_a_repeated_key_is_an_error():
    """grpo_loop with more prompts per step than prompts: a prompt drawn twice gave two groups one key, and a
    response another's advantage (the lowest reward of its group trained up); build_train_samples refuses
    repeated keys."""
    from refiner_core.grpo import grpo_loop
    from refiner_core.rollout.base import SamplingParams

    learner = _KeepingLearner()
    grpo_loop(
        _OneTokenEngine(),
        learner,
        [[1, 2], [3, 4]],
        lambda g: float(g.token_ids[0]),
        GRPOConfig(),
        SamplingParams(n=2),
        steps=1,
        prompts_per_step=4,
    )
    trained = [(s.prompt_ids, s.response_ids[0], s.advantage) for s in learner.samples]
    assert [(p, r, round(a, 2)) for p, r, a in trained] == [
        ([1, 2], 10, -1.0),
        ([1, 2], 11, 1.0),
        ([3, 4], 20, -1.0),
        ([3, 4], 21, 1.0),
    ]
    rows = [{"prompt_id": "p", "sample_idx": 0, "reward": 1.0}] * 2
    with pytest.raises(ValueError, match=r"rewards: \(prompt_id, sample_idx\) repeated, e.g. \[\('p', 0\)\]"):
        build_train_samples([], rows, GRPOConfig())
