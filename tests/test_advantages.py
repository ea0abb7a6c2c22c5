"""Advantage std with ddof 0 (open-instruct) or 1 (verl), and groups of equal rewards (advantage 0 whatever eps):
hand-computed cases."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from refiner_core.algo.advantages import compute_advantages, group_advantages, normalize_then_sum
from refiner_core.config import GRPOConfig, load_recipe
from refiner_core.reward.rescore import check_rescorable

# Group a: rewards 1, 0, 0, 1 -> mean 0.5, squared deviations sum 1.
#   ddof 0: std = sqrt(1/4) = 0.5            -> advantages +-1
#   ddof 1: std = sqrt(1/3) = 0.57735...     -> advantages +-sqrt(3)/2 = +-0.866025...
# Group b: rewards 2, 4, 9 -> mean 5, deviations -3, -1, 4, squared sum 26.
#   ddof 0: std = sqrt(26/3) = 2.943920...   -> -1.019049, -0.339683, 1.358732
#   ddof 1: std = sqrt(13)   = 3.605551...   -> -0.832050, -0.277350, 1.109400
REWARDS = [1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 9.0]
GROUPS = ["a", "a", "a", "a", "b", "b", "b"]


def test_group_std_ddof0_and_ddof1_hand_computed():
    ddof0 = compute_advantages(REWARDS, GROUPS, "group_std", eps=0.0, ddof=0)
    ddof1 = compute_advantages(REWARDS, GROUPS, "group_std", eps=0.0, ddof=1)
    np.testing.assert_allclose(ddof0, [1, -1, -1, 1, -1.019049, -0.339683, 1.358732], atol=1e-6)
    np.testing.assert_allclose(
        ddof1, [0.866025, -0.866025, -0.866025, 0.866025, -0.832050, -0.277350, 1.109400], atol=1e-6
    )
    # the two differ by exactly sqrt((G-1)/G) per group
    np.testing.assert_allclose(ddof1[:4] / ddof0[:4], math.sqrt(3 / 4))
    np.testing.assert_allclose(ddof1[4:] / ddof0[4:], math.sqrt(2 / 3))


def test_default_is_ddof0_and_eps_is_added_to_the_std():
    np.testing.assert_allclose(
        compute_advantages([1.0, 0.0], ["g", "g"], "group_std", eps=0.5), [0.5 / (0.5 + 0.5), -0.5 / (0.5 + 0.5)]
    )
    np.testing.assert_allclose(
        compute_advantages([1.0, 0.0], ["g", "g"], "group_std", eps=0.5, ddof=1),
        [0.5 / (math.sqrt(0.5) + 0.5), -0.5 / (math.sqrt(0.5) + 0.5)],
    )


def test_batch_std_uses_ddof_over_the_whole_batch():
    # groups centred: a -> +-0.5, b -> -3, -1, 4; batch std of the raw rewards 1,0,0,1,2,4,9
    r = np.array(REWARDS)
    centred = np.array([0.5, -0.5, -0.5, 0.5, -3, -1, 4])
    for ddof in (0, 1):
        expected = centred / math.sqrt(((r - r.mean()) ** 2).sum() / (len(r) - ddof))
        np.testing.assert_allclose(compute_advantages(REWARDS, GROUPS, "batch_std", 0.0, ddof=ddof), expected)


def test_one_member_group_has_std_zero_under_ddof1_not_nan():
    adv = compute_advantages([3.0, 1.0, 2.0], ["solo", "p", "p"], "group_std", eps=1e-4, ddof=1)
    assert adv[0] == 0.0 and not np.isnan(adv).any()
    np.testing.assert_allclose(adv[1:], [-0.5 / (math.sqrt(0.5) + 1e-4), 0.5 / (math.sqrt(0.5) + 1e-4)])


def test_ddof_outside_0_1_is_an_error():
    with pytest.raises(ValueError, match="ddof must be 0 or 1"):
        compute_advantages(REWARDS, GROUPS, "group_std", 0.0, ddof=2)


def test_group_advantages_reads_the_config_field():
    rows = [{"prompt_id": g, "sample_idx": i, "reward": r} for i, (r, g) in enumerate(zip(REWARDS, GROUPS))]
    grpo = load_recipe(None, ["grpo.advantage_std_ddof=1", "grpo.advantage_eps=0"]).grpo
    out, _ = group_advantages(rows, grpo)
    assert [round(a["advantage"], 6) for a in out[:4]] == [0.866025, -0.866025, -0.866025, 0.866025]
    grpo0 = load_recipe(None, ["grpo.advantage_eps=0"]).grpo
    assert grpo0.advantage_std_ddof == 0
    out0, _ = group_advantages(rows, grpo0)
    assert [round(a["advantage"], 6) for a in out0[:4]] == [1.0, -1.0, -1.0, 1.0]


def test_recipe_rejects_other_ddof_values_and_rescore_accepts_the_change():
    with pytest.raises(ValueError, match="advantage_std_ddof"):
        load_recipe(None, ["grpo.advantage_std_ddof=2"])
    check_rescorable(load_recipe(None), load_recipe(None, ["grpo.advantage_std_ddof=1"]), 0, [])


# Group a: six rewards 0.1, equal but with a mean that is not 0.1 in floating point (r - mean = 1.4e-17, and with
# eps 0 that rounding alone would be divided by a std of the same size). Group b: 0, 1, 0, 1 (mean 0.5, std 0.5).
# Group c: 1, 1, equal exactly (std exactly 0: 0 / 0 with eps 0). Batch: 12 rewards, sum 4.6, sum of squares 4.06.
TIED = [0.1] * 6 + [0.0, 1.0, 0.0, 1.0] + [1.0, 1.0]
TIED_GROUPS = ["a"] * 6 + ["b"] * 4 + ["c"] * 2
BATCH_STD = math.sqrt(4.06 / 12 - (4.6 / 12) ** 2)  # ddof 0: 0.437480...
B_SIGNS = np.array([-1.0, 1.0, -1.0, 1.0])


# Group b's advantages per normaliser, with eps; groups a and c get exactly 0.
GROUP_B = {
    "group_std": lambda eps: 0.5 * B_SIGNS / (0.5 + eps),
    "batch_std": lambda eps: 0.5 * B_SIGNS / (BATCH_STD + eps),
    "none": lambda eps: 0.5 * B_SIGNS,
    "rloo": lambda eps: 0.5 * B_SIGNS * 4 / 3,  # r - the mean of the other three
    # c = r - group mean: +-0.5 in b, 0 elsewhere; its batch std is sqrt(4 x 0.25 / 12)
    "reinforce_pp_baseline": lambda eps: 0.5 * B_SIGNS / (math.sqrt(1 / 12) + eps),
}


@pytest.mark.parametrize("kind", list(GROUP_B))
def test_equal_groups_get_exactly_0_with_eps_0_and_the_others_are_unchanged(kind):
    for eps in (0.0, 1e-4):
        adv = compute_advantages(TIED, TIED_GROUPS, kind, eps)
        assert np.all(adv[:6] == 0.0) and np.all(adv[10:] == 0.0), (kind, eps, adv)
        np.testing.assert_allclose(adv[6:10], GROUP_B[kind](eps), rtol=1e-12)


def test_reinforce_pp_keeps_equal_groups_apart_from_the_batch_mean():
    """No group baseline: an all-equal group is not flat for REINFORCE++, only a flat batch is."""
    adv = compute_advantages(TIED, TIED_GROUPS, "reinforce_pp", 0.0)
    np.testing.assert_allclose(adv, (np.array(TIED) - 4.6 / 12) / BATCH_STD, rtol=1e-12)


@pytest.mark.parametrize("kind", ["group_std", "batch_std", "none", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
@pytest.mark.parametrize("rewards", [[1.0] * 12, [0.1] * 12, [0.1 + 0.2, 0.3, 0.3] * 4])
def test_a_batch_of_equal_rewards_gets_0_in_every_variant_whatever_eps(kind, rewards):
    """Exact ties (0 / 0 with eps 0), ties whose mean rounds (the mean of six 0.1s is 0.1 - 1.4e-17, and so is the
    std) and rewards equal up to rounding (0.1 + 0.2 is 0.30000000000000004) all carry no signal."""
    for eps in (0.0, 1e-4):
        for ddof in (0, 1):
            adv = compute_advantages(rewards, ["x"] * 6 + ["y"] * 6, kind, eps, ddof)
            assert adv.tolist() == [0.0] * 12, (eps, ddof)


def test_a_reward_part_equal_up_to_rounding_adds_0_to_the_sum():
    """normalize_then_sum with eps 0: part x is 0.3 four times, once computed as 0.1 + 0.2, and adds 0; part y
    (0, 1, 0, 1) gives +-1, and the sums +-1 whiten to themselves (mean 0, std 1)."""
    values = np.array([[0.1 + 0.2, 0.0], [0.3, 1.0], [0.3, 0.0], [0.3, 1.0]])
    adv = normalize_then_sum(values, np.ones_like(values), np.array(["g"] * 4), eps=0.0)
    np.testing.assert_allclose(adv, B_SIGNS, rtol=1e-12)


def test_group_advantages_count_a_group_equal_up_to_rounding_as_flat():
    rows = [{"prompt_id": g, "sample_idx": i, "reward": r} for i, (r, g) in enumerate(zip(TIED, TIED_GROUPS))]
    rows += [{"prompt_id": "d", "sample_idx": i, "reward": r} for i, r in enumerate([0.1 + 0.2, 0.3, 0.3])]
    grpo = load_recipe(None, ["grpo.advantage_eps=0", "grpo.filter_zero_std_groups=true"]).grpo
    out, stats = group_advantages(rows, grpo)
    assert [o["advantage"] for o in out] == pytest.approx([0.0] * 6 + B_SIGNS.tolist() + [0.0] * 5, abs=1e-12)
    assert [o["prompt_id"] for o in out if o["trained"]] == ["b"] * 4
    assert stats["zero_std_group_fraction"] == 0.75 and stats["informative_groups"] == 1
    assert stats["advantage_abs_mean"] == pytest.approx(4 / 15)


def _group(prompt_id: str, rewards: list[float], **extra) -> list[dict]:
    return [{"prompt_id": prompt_id, "sample_idx": i, "reward": r, **extra} for i, r in enumerate(rewards)]


@pytest.mark.parametrize(
    ("advantage", "aggregation"),
    [("batch_std", "sum"), ("reinforce_pp_baseline", "sum"), ("group_std", "normalize_then_sum")],
)
def test_filtered_flat_groups_leave_the_batch_before_its_statistics(advantage, aggregation):
    """Under grpo.filter_zero_std_groups (rollout.dynamic_sampling) an all-equal group is dropped, and takes no
    part in the batch-wide whitening either: the kept group's advantages are what they are alone (before, three
    dropped flat groups moved them from +-1.00 to +-1.03 under batch_std and +-2.00 under reinforce_pp_baseline)."""
    grpo = dataclasses.replace(
        GRPOConfig(), advantage=advantage, reward_aggregation=aggregation, filter_zero_std_groups=True
    )
    informative = _group("A", [0.0, 1.0, 0.0, 1.0])
    flat = _group("B", [0.0] * 4) + _group("C", [1.0] * 4) + _group("D", [0.0] * 4)
    alone, _ = group_advantages(informative, grpo)
    mixed, stats = group_advantages(informative + flat, grpo)
    assert [r["advantage"] for r in mixed if r["prompt_id"] == "A"] == pytest.approx([r["advantage"] for r in alone])
    assert all(r["advantage"] == 0.0 and not r["trained"] for r in mixed if r["prompt_id"] != "A")
    assert stats["dropped_groups"] == 3 and stats["advantage_abs_mean"] == pytest.approx(
        sum(abs(r["advantage"]) for r in alone) / 16
    )


def test_a_group_flat_in_reward_is_flat_whatever_its_kl_penalty():
    """grpo.kl_reward_coef: every response's KL differs, so read with its penalty no group is ever flat, and the
    groups dynamic sampling replaced (flat in reward) were trained beside their replacements on the penalty's
    noise, scaled up to unit advantages. Flatness is the reward's: such a group is dropped under the filter; off
    the filter it still learns from the KL penalty."""
    kl = [0.10, 0.25, 0.05, 0.40]
    penalised = [
        {**r, "reward_kl": kl[r["sample_idx"]], "kl_coef": 0.001}
        for r in _group("A", [0.0, 1.0, 0.0, 1.0]) + _group("B", [1.0] * 4)
    ]
    filtered, stats = group_advantages(penalised, dataclasses.replace(GRPOConfig(), filter_zero_std_groups=True))
    assert [r["trained"] for r in filtered if r["prompt_id"] == "B"] == [False] * 4
    assert stats["informative_groups"] == 1 and stats["dropped_groups"] == 1
    kept, _ = group_advantages(penalised, dataclasses.replace(GRPOConfig(), filter_zero_std_groups=False))
    b = [r["advantage"] for r in kept if r["prompt_id"] == "B"]
    assert all(r["trained"] for r in kept) and b[1] < b[0] < b[2]  # less KL, more advantage
