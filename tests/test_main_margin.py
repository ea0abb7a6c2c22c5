"""bench/main_margin.py's statistics: the exact McNemar p-value against hand-computed binomial tails and a float64
reference, and the SFT-vs-GRPO comparison on hand-made eval rows (answers without an answer block are left out of
the distractor counts, not counted as fixed)."""

from __future__ import annotations

from fractions import Fraction
from math import comb

import pytest

from bench.main_margin import compare, mcnemar_p


@pytest.mark.parametrize(
    ("b", "c", "expected"),
    [
        (0, 0, 1.0),  # no discordant prompt: no evidence either way
        (3, 0, 0.25),  # 2 * (1/2)^3
        (0, 3, 0.25),  # symmetric
        (5, 1, 0.21875),  # 2 * (1 + 6) / 64
        (12, 2, 2 * (1 + 14 + 91) / 2**14),  # the main job's pooled figure: 0.0129...
        (4, 4, 1.0),  # the two-sided tail is capped at 1
    ],
)
def test_mcnemar_p_is_the_two_sided_binomial_tail(b, c, expected):
    assert mcnemar_p(b, c) == pytest.approx(expected, rel=1e-12)


def test_mcnemar_p_matches_an_exact_rational_reference():
    for n in range(1, 40):
        for b in range(n + 1):
            tail = sum(Fraction(comb(n, i), 2**n) for i in range(min(b, n - b) + 1))
            assert mcnemar_p(b, n - b) == pytest.approx(float(min(Fraction(1), 2 * tail)), rel=1e-12, abs=0)


def _rows(cites: dict[str, bool | None], recall: float = 1.0) -> dict[str, dict]:
    """Eval rows: an answer citing `recall` of 2 supporting snippets (and the distractor where cites is True)."""
    return {
        p: {
            "cites_distractor": v,
            "supporting_recall": None if v is None else recall,
            "n_citations": 0 if v is None else 2 * recall + v,
            "format_ok": v is not None,
            "passed": False,
        }
        for p, v in cites.items()
    }


def test_compare_counts_fixed_and_broken_over_labelled_pairs():
    sft = _rows({"a": True, "b": True, "c": False, "d": True, "e": False, "only-sft": True})
    grpo = _rows({"a": False, "b": True, "c": True, "d": None, "e": False}, recall=0.5)  # d lost its answer block
    got = compare(sft, grpo)
    assert (got["prompts"], got["labelled"]) == (5, 4)  # d is answered by both, but not labelled after GRPO
    assert (got["fixed"], got["broken"]) == (1, 1)  # a stopped citing a distractor, c started; d is neither
    assert (got["distractor_before"], got["distractor_after"]) == (0.5, 0.5)  # of a, b, c, e
    assert (got["format_before"], got["format_after"]) == (1.0, 0.8)  # over all 5: d's answer is not format-valid
    assert (got["recall_before"], got["recall_after"]) == (1.0, 0.5)
    assert (got["citations_before"], got["citations_after"]) == (2.5, 1.5)  # 2 * recall + distractor: a b c e
