"""Paired statistics for comparing two policies on the same prompts, and agreement between two raters.

Pure functions over plain lists: the exact McNemar test (two-sided binomial tail at 1/2, from exact integer
counts), the exact paired sign-flip permutation test of the mean difference (while its sign patterns can be
enumerated), a seeded paired bootstrap confidence interval of the mean difference (optionally resampled within
strata, e.g. one stratum per seed when pairs of runs are pooled), the prompts a change fixed or broke, Cohen's kappa
on pass/fail labels and Spearman's rank correlation on scores (average ranks for ties).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

BOOTSTRAP_BLOCK_DRAWS = 2**26  # 1 GiB of indices and values at a time


def binomial_tail(n: int, k: int) -> Fraction:
    """P(X <= k) for X ~ Binomial(n, 1/2), exactly."""
    if n < 0 or k < 0:
        raise ValueError(f"binomial_tail needs n, k >= 0; got n={n}, k={k}")
    # C(n, i + 1) = C(n, i) (n - i) / (i + 1), exactly: each term from the last (comb() anew per term was quadratic
    # in big-integer work: 30 s for 10,000 discordant pairs each way)
    term, total = 1, 1
    for i in range(min(k, n)):
        term = term * (n - i) // (i + 1)
        total += term
    return Fraction(total, 2**n)


def mcnemar_p_exact(b: int, c: int) -> Fraction:
    """Exact two-sided McNemar p-value as a fraction: b and c discordant pairs, each direction equally likely under
    no change; p = min(1, 2 P(X <= min(b, c))) with X ~ Binomial(b + c, 1/2). No discordant pair: 1."""
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be >= 0; got b={b}, c={c}")
    if b + c == 0:
        return Fraction(1)
    return min(Fraction(1), 2 * binomial_tail(b + c, min(b, c)))


def mcnemar_p(b: int, c: int) -> float:
    """mcnemar_p_exact as a float."""
    return float(mcnemar_p_exact(b, c))


@dataclass(frozen=True)
class Discordant:
    """Indices of the pairs whose binary value changed from A to B."""

    became_true: list[int]
    became_false: list[int]

    def fixed_broken(self, higher_is_better: bool) -> tuple[list[int], list[int]]:
        """(fixed, broken): the changes towards the better value, and away from it."""
        if higher_is_better:
            return self.became_true, self.became_false
        return self.became_false, self.became_true


def discordant(a: Sequence[bool], b: Sequence[bool]) -> Discordant:
    """The pairs whose value differs between A and B."""
    if len(a) != len(b):
        raise ValueError(f"paired values need equal lengths; got {len(a)} and {len(b)}")
    return Discordant(
        [i for i, (x, y) in enumerate(zip(a, b)) if not x and y],
        [i for i, (x, y) in enumerate(zip(a, b)) if x and not y],
    )


def _differences(a: Sequence[float], b: Sequence[float]) -> np.ndarray:
    """b - a pair by pair in float64; a NaN or infinite value has no difference to test, so it is refused."""
    if len(a) != len(b):
        raise ValueError(f"paired values need equal lengths; got {len(a)} and {len(b)}")
    diff = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)
    if not np.isfinite(diff).all():
        raise ValueError(f"paired values must be finite; pair {int(np.argmin(np.isfinite(diff)))} is not")
    return diff


EXACT_SIGN_FLIP_PAIRS = 16  # the most differing pairs sign_flip_p enumerates: 2^16 sign patterns


def sign_flip_p(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Exact two-sided paired permutation p-value of mean(b - a). Under no difference each pair's difference is as
    likely negated, so p is the share of the 2^m sign patterns of the m nonzero differences whose sum is at least as
    far from 0 as the observed one. At least 2 / 2^m: with few differing pairs no p is small (1 for one pair).
    None when m > EXACT_SIGN_FLIP_PAIRS (too many patterns to enumerate)."""
    diff = _differences(a, b)
    diff = diff[diff != 0]
    m = len(diff)
    if m > EXACT_SIGN_FLIP_PAIRS:
        return None
    flipped = (np.arange(2**m)[:, None] >> np.arange(m)) & 1
    sums = np.abs((1 - 2 * flipped) @ diff)
    tolerance = 1e-9 * np.abs(diff).sum()  # one sum added in another order may round below the observed one
    return int(np.count_nonzero(sums >= abs(diff.sum()) - tolerance)) / 2**m


def fewest_pairs_to_reach(alpha: float) -> int:
    """The fewest differing pairs with which an exact McNemar or sign-flip p (at least 2 / 2^m) can be below alpha."""
    m = 1
    while 2 / 2**m >= alpha:
        m += 1
    return m


@dataclass(frozen=True)
class BootstrapCI:
    """Mean of B - A over the pairs and its percentile bootstrap interval at `level`."""

    mean_diff: float
    low: float
    high: float
    level: float
    resamples: int

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


def paired_bootstrap_ci(
    a: Sequence[float],
    b: Sequence[float],
    *,
    seed: int = 0,
    resamples: int = 10_000,
    level: float = 0.95,
    strata: Sequence[Hashable] | None = None,
) -> BootstrapCI:
    """Percentile bootstrap CI of mean(b - a): the pairs are resampled with replacement (numpy's default_rng(seed),
    one integers() draw of shape (resamples, n) per stratum, strata in order of first appearance), so a pair's
    two values always move together. With `strata` each resample draws as many pairs from every stratum as it
    holds (pooled seeds keep their sizes)."""
    diff = _differences(a, b)
    if not len(diff):
        raise ValueError("the bootstrap needs at least one pair")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1); got {level}")
    labels = list(strata) if strata is not None else [0] * len(diff)
    if len(labels) != len(diff):
        raise ValueError(f"strata need one label per pair; got {len(labels)} for {len(diff)} pairs")
    groups: dict[Hashable, list[int]] = {}
    for i, label in enumerate(labels):
        groups.setdefault(label, []).append(i)
    rng = np.random.default_rng(seed)
    sums = np.zeros(resamples, dtype=np.float64)
    for members in groups.values():
        values = diff[members]
        # resamples drawn a block of rows at a time, BOOTSTRAP_BLOCK_DRAWS indices at most (16 bytes each with
        # their values): one block, the same draws as ever, unless the stratum is very large
        rows = max(1, BOOTSTRAP_BLOCK_DRAWS // len(values))
        for start in range(0, resamples, rows):
            draws = rng.integers(0, len(values), size=(min(rows, resamples - start), len(values)))
            sums[start : start + len(draws)] += values[draws].sum(axis=1)
    means = sums / len(diff)
    tail = (1 - level) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return BootstrapCI(float(diff.mean()), float(low), float(high), level, resamples)


def cohen_kappa(a: Sequence[bool], b: Sequence[bool]) -> float | None:
    """Cohen's kappa of two raters' pass/fail labels: (p_o - p_e) / (1 - p_e). None when undefined (no pair, or
    both raters give one and the same label to every item: p_e = 1)."""
    if len(a) != len(b):
        raise ValueError(f"paired labels need equal lengths; got {len(a)} and {len(b)}")
    n = len(a)
    if n == 0:
        return None
    observed = sum(bool(x) == bool(y) for x, y in zip(a, b)) / n
    pa, pb = sum(map(bool, a)) / n, sum(map(bool, b)) / n
    expected = pa * pb + (1 - pa) * (1 - pb)
    if expected == 1:
        return None
    return (observed - expected) / (1 - expected)


def average_ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for i in order[start : end + 1]:
            ranks[i] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's rank correlation: Pearson's correlation of the average ranks. None when undefined (fewer than two
    pairs, or one side constant)."""
    if len(x) != len(y):
        raise ValueError(f"paired scores need equal lengths; got {len(x)} and {len(y)}")
    if len(x) < 2:
        return None
    rx, ry = np.asarray(average_ranks(x)), np.asarray(average_ranks(y))
    dx, dy = rx - rx.mean(), ry - ry.mean()
    denominator = float(np.sqrt((dx * dx).sum() * (dy * dy).sum()))
    if denominator == 0:
        return None
    return float((dx * dy).sum() / denominator)


def separation_auc(scores: Sequence[float], labels: Sequence[bool]) -> float | None:
    """How well `scores` separate the items labelled True from those labelled False: the probability that a random
    True item scores higher than a random False one, ties counting 1/2 (the ROC AUC, Mann-Whitney U / (n1 n0)).
    0.5 is no separation. None when either label is absent."""
    if len(scores) != len(labels):
        raise ValueError(f"paired values need equal lengths; got {len(scores)} and {len(labels)}")
    positives = [s for s, y in zip(scores, labels) if y]
    negatives = [s for s, y in zip(scores, labels) if not y]
    if not positives or not negatives:
        return None
    ranks = average_ranks(list(scores))
    rank_sum = sum(r for r, y in zip(ranks, labels) if y)
    u = rank_sum - len(positives) * (len(positives) + 1) / 2
    return u / (len(positives) * len(negatives))
