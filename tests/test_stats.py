"""refiner_core/eval/stats.py against exact values: McNemar's p from hand-computed binomial tails and exact rationals,
the sign-flip p from hand-counted sign patterns and an exact rational enumeration, the seeded paired bootstrap
against a loop-by-loop float64 reference drawing the same numbers, Cohen's kappa and Spearman's rho on
hand-computed cases."""

from __future__ import annotations

import math
from fractions import Fraction
from itertools import product
from math import comb, sqrt

import numpy as np
import pytest

from refiner_core.eval.stats import (
    average_ranks,
    binomial_tail,
    cohen_kappa,
    discordant,
    fewest_pairs_to_reach,
    mcnemar_p,
    mcnemar_p_exact,
    paired_bootstrap_ci,
    separation_auc,
    sign_flip_p,
    spearman,
)


@pytest.mark.parametrize(
    ("b", "c", "expected"),
    [
        (0, 0, Fraction(1)),  # no discordant prompt: no evidence either way
        (3, 0, Fraction(1, 4)),  # 2 * (1/2)^3
        (0, 3, Fraction(1, 4)),  # symmetric
        (5, 1, Fraction(7, 32)),  # 2 * (1 + 6) / 64
        (12, 2, Fraction(2 * (1 + 14 + 91), 2**14)),  # the main job's pooled figure: 0.0129...
        (4, 4, Fraction(1)),  # the two-sided tail is capped at 1
    ],
)
def test_mcnemar_p_is_the_two_sided_binomial_tail(b, c, expected):
    assert mcnemar_p_exact(b, c) == expected
    assert mcnemar_p(b, c) == float(expected)


def test_mcnemar_p_matches_an_exact_rational_reference():
    for n in range(1, 40):
        for b in range(n + 1):
            tail = sum(Fraction(comb(n, i), 2**n) for i in range(min(b, n - b) + 1))
            assert mcnemar_p_exact(b, n - b) == min(Fraction(1), 2 * tail)
            assert mcnemar_p(b, n - b) == pytest.approx(float(min(Fraction(1), 2 * tail)), rel=1e-15, abs=0)


def test_binomial_tail_by_hand_and_bad_counts():
    assert binomial_tail(4, 1) == Fraction(1 + 4, 16)
    assert binomial_tail(3, 7) == 1  # k beyond n: the whole distribution
    with pytest.raises(ValueError):
        mcnemar_p(-1, 2)


def test_a_held_out_set_of_thousands_of_changed_prompts_gets_its_exact_p_at_once():
    """The tail summed comb(n, i) anew for every i: 30 s at 10,000 discordant pairs each way, once per binary
    column. Each term now comes from the last; the tail still equals the comb() sum exactly."""
    for n, k in ((2000, 700), (2001, 2001), (3000, 0)):
        assert binomial_tail(n, k) == Fraction(sum(comb(n, i) for i in range(min(k, n) + 1)), 2**n)
    assert mcnemar_p(20000, 20000) == 1.0
    # P(X <= 19000) for X ~ Bin(39000, 1/2) is 2.1e-7 (z = -5.06 with continuity correction: 2.1e-7 as well)
    assert mcnemar_p(20000, 19000) == pytest.approx(4.2168e-07, rel=1e-4)


def test_discordant_pairs_and_their_direction():
    before = [True, True, False, False, True, False]
    after = [False, True, True, False, False, True]
    d = discordant(before, after)
    assert (d.became_true, d.became_false) == ([2, 5], [0, 4])
    assert d.fixed_broken(higher_is_better=True) == ([2, 5], [0, 4])  # e.g. passed
    assert d.fixed_broken(higher_is_better=False) == ([0, 4], [2, 5])  # e.g. cites a distractor
    with pytest.raises(ValueError):
        discordant([True], [True, False])


@pytest.mark.parametrize(
    ("diffs", "expected"),
    [
        ([0.2], 1.0),  # one prompt: its difference and the negated one are equally far from 0
        ([1e-6, 2e-6, 3e-6], 2 / 8),  # all one way: only the observed pattern and its mirror, however small
        ([1.0] * 5, 2 / 32),
        ([1.0] * 6, 2 / 64),
        ([0.0, 0.0, 5.0], 1.0),  # prompts without a difference flip nothing
        ([0.0, 0.0], 1.0),
        ([3.0, -1.0, 2.0, 2.0], 4 / 16),  # sum 6; |6 - 2 s| >= 6 for flipped sums s = 0, -1, 6, 7
        ([1.0, 1.0, 1.0, -1.0], 10 / 16),  # sum 2; flipped sums <= 0 (5 patterns) or >= 2 (5)
        ([0.3, -0.1, -0.2, 0.5], 10 / 16),  # sum 0.5; 0.3 - 0.1 - 0.2 is 0 only up to rounding
        ([1.0] * 16, 2 / 2**16),
    ],
)
def test_sign_flip_p_by_hand(diffs, expected):
    assert sign_flip_p([0.0] * len(diffs), diffs) == expected
    assert sign_flip_p([1.0 + d for d in diffs], [1.0] * len(diffs)) == expected  # B - A negated: two-sided


def test_sign_flip_p_matches_an_exact_rational_enumeration():
    rng = np.random.default_rng(0)
    for _ in range(200):
        tenths = [int(k) for k in rng.integers(-5, 6, size=int(rng.integers(1, 9)))]
        exact = [Fraction(k, 10) for k in tenths if k]
        observed = abs(sum(exact))
        patterns = product((1, -1), repeat=len(exact))
        count = sum(abs(sum(s * d for s, d in zip(signs, exact))) >= observed for signs in patterns)
        assert sign_flip_p([0.0] * len(tenths), [k / 10 for k in tenths]) == count / 2 ** len(exact)


def test_sign_flip_p_enumerates_at_most_16_differing_pairs():
    assert sign_flip_p([0.0] * 20, [1.0] * 16 + [0.0] * 4) == 2 / 2**16
    assert sign_flip_p([0.0] * 17, [1.0] * 17) is None
    with pytest.raises(ValueError):
        sign_flip_p([1.0], [1.0, 2.0])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_value_that_is_not_a_number_has_no_p_nor_interval(bad):
    """A NaN difference fell out of the nonzero ones' sums and made p 0 (every pattern 'less extreme' than NaN)."""
    with pytest.raises(ValueError, match="pair 0 is not"):
        sign_flip_p([0.0, 0.0, 0.0], [bad, 0.0, 0.0])
    with pytest.raises(ValueError, match="pair 1 is not"):
        paired_bootstrap_ci([0.0, bad], [1.0, 1.0], resamples=10)


def test_fewest_pairs_an_exact_p_needs():
    assert fewest_pairs_to_reach(0.05) == 6  # 2/2^5 = 0.0625, 2/2^6 = 0.03125
    assert fewest_pairs_to_reach(0.0625) == 6  # p must be below alpha
    assert fewest_pairs_to_reach(0.01) == 8  # 2/2^7 = 0.0156, 2/2^8 = 0.0078
    assert fewest_pairs_to_reach(0.99) == 2  # one pair always gives p = 1


def _reference_bootstrap(a, b, seed, resamples, level, strata):
    """Loop by loop in float64, drawing the same integers as the implementation documents."""
    diff = [y - x for x, y in zip(a, b)]
    groups: dict = {}
    for i, s in enumerate(strata):
        groups.setdefault(s, []).append(i)
    rng = np.random.default_rng(seed)
    draws = {s: rng.integers(0, len(m), size=(resamples, len(m))) for s, m in groups.items()}
    means = []
    for r in range(resamples):
        total = 0.0
        for s, members in groups.items():
            for j in draws[s][r]:
                total += diff[members[j]]
        means.append(total / len(diff))
    tail = (1 - level) / 2
    return sum(diff) / len(diff), *np.quantile(np.array(means), [tail, 1 - tail])


@pytest.mark.parametrize("strata", [None, [0, 0, 0, 1, 1, 1, 1, 2]])
def test_paired_bootstrap_equals_a_loop_reference_with_the_same_seed(strata):
    a = [0.1, 0.4, 0.35, 0.8, 0.2, 0.55, 0.9, 0.05]
    b = [0.3, 0.4, 0.6, 0.7, 0.5, 0.65, 1.0, 0.45]
    got = paired_bootstrap_ci(a, b, seed=7, resamples=500, level=0.9, strata=strata)
    mean, low, high = _reference_bootstrap(a, b, 7, 500, 0.9, strata or [0] * len(a))
    assert got.mean_diff == pytest.approx(mean, abs=1e-15)
    assert (got.low, got.high) == (pytest.approx(low, abs=1e-12), pytest.approx(high, abs=1e-12))
    assert got.low <= got.mean_diff <= got.high
    again = paired_bootstrap_ci(a, b, seed=7, resamples=500, level=0.9, strata=strata)
    assert again == got  # seeded: the same interval every time
    assert paired_bootstrap_ci(a, b, seed=8, resamples=500, level=0.9, strata=strata) != got


def test_paired_bootstrap_edge_cases():
    same_shift = paired_bootstrap_ci([1.0, 2.0, 3.0], [1.5, 2.5, 3.5], resamples=200)
    assert (same_shift.mean_diff, same_shift.low, same_shift.high) == (0.5, 0.5, 0.5)  # every resample: +0.5
    assert same_shift.excludes_zero
    noise = paired_bootstrap_ci([0.0, 1.0, 0.0, 1.0], [1.0, 0.0, 1.0, 0.0], resamples=2000)
    assert noise.mean_diff == 0 and noise.low < 0 < noise.high and not noise.excludes_zero
    with pytest.raises(ValueError):
        paired_bootstrap_ci([], [])
    with pytest.raises(ValueError):
        paired_bootstrap_ci([1.0], [1.0, 2.0])


def test_cohen_kappa_on_hand_computed_cases():
    # 10 items, 8 agreements; each rater passes 5: p_o = 0.8, p_e = 0.5 -> kappa = 0.6
    a = [True, True, True, True, False, False, False, False, True, False]
    b = [True, True, True, False, False, False, False, True, True, False]
    assert cohen_kappa(a, b) == pytest.approx(0.6, abs=1e-15)
    # 20 items: 9 both pass, 3 only A, 2 only B, 6 both fail. p_o = 15/20, pA = 12/20, pB = 11/20,
    # p_e = (12*11 + 8*9) / 400 = 204/400 -> kappa = (300 - 204) / (400 - 204) = 96/196
    a = [True] * 9 + [True] * 3 + [False] * 2 + [False] * 6
    b = [True] * 9 + [False] * 3 + [True] * 2 + [False] * 6
    assert cohen_kappa(a, b) == pytest.approx(float(Fraction(96, 196)), abs=1e-15)
    assert cohen_kappa(a, a) == 1.0
    assert cohen_kappa([True, False], [False, True]) == -1.0
    assert cohen_kappa([True, True], [True, True]) is None  # p_e = 1: undefined
    assert cohen_kappa([], []) is None


def test_spearman_with_ties_by_hand():
    assert average_ranks([5, 6, 7, 8, 7]) == [1, 2, 3.5, 5, 3.5]
    # ranks x = 1..5, y = 1, 2, 3.5, 5, 3.5: sum dx*dy = 8, sum dx^2 = 10, sum dy^2 = 9.5
    assert spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(8 / sqrt(95), abs=1e-15)
    assert spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0, abs=1e-15)
    assert spearman([0.5, 0.5, 0.5], [0.1, 0.9, 0.4]) is None  # a constant side: undefined
    assert spearman([1.0], [2.0]) is None


def test_separation_auc_by_hand():
    # positives 0.9, 0.6, 0.5; negatives 0.5, 0.2: pairs won 2 + 2 + (1 + 0.5 tie) = 5.5 of 6
    assert separation_auc([0.9, 0.6, 0.5, 0.5, 0.2], [True, True, True, False, False]) == pytest.approx(5.5 / 6)
    assert separation_auc([0.5] * 4, [True, False, True, False]) == 0.5  # one score for all: no separation
    assert separation_auc([0.1, 0.9], [True, False]) == 0.0
    assert separation_auc([0.1, 0.9], [True, True]) is None


def test_a_bootstrap_too_large_for_one_block_draws_in_blocks_with_bounded_memory(monkeypatch):
    """A comparison of 30,000 prompts at 10,000 resamples drew 300 M indices at once (4.5 GiB). The draws now come
    a block of rows at a time; where one block holds them all, as for every comparison before, they are the same."""
    import refiner_core.eval.stats as stats

    rng = np.random.default_rng(3)
    a, b = rng.normal(size=40).tolist(), rng.normal(size=40).tolist()
    strata = [k % 3 for k in range(40)]
    whole = paired_bootstrap_ci(a, b, seed=5, resamples=1000, strata=strata)
    monkeypatch.setattr(stats, "BOOTSTRAP_BLOCK_DRAWS", 13 * 7)  # 7 rows of the largest stratum (14 pairs) a block
    blocked = paired_bootstrap_ci(a, b, seed=5, resamples=1000, strata=strata)
    assert blocked.mean_diff == whole.mean_diff and blocked.resamples == 1000
    # other draws, the same distribution: the intervals agree to the bootstrap's own noise
    assert blocked.low == pytest.approx(whole.low, abs=0.05) and blocked.high == pytest.approx(whole.high, abs=0.05)
    monkeypatch.setattr(stats, "BOOTSTRAP_BLOCK_DRAWS", 14 * 1000)  # one block holds them: the very same draws
    assert paired_bootstrap_ci(a, b, seed=5, resamples=1000, strata=strata) == whole
