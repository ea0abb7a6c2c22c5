"""Advantage std with ddof 0 (open-instruct) or 1 (verl): hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from refiner_core.algo.advantages import compute_advantages, group_advantages
from refiner_core.config import load_recipe
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
