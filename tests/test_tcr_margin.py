"""bench/tcr_margin.py's comparison of the cold start with a GRPO step on hand-made held-out eval rows: rates over
the questions both answered, and the discordant questions its exact McNemar tests count."""

from __future__ import annotations

import pytest

from bench.main_margin import mcnemar_p
from bench.tcr_margin import compare


def row(passed: bool, calls: int, well_formed: int, boxed: bool = True, turns: int = 2, tokens: int = 60) -> dict:
    return {
        "passed": passed,
        "boxed": boxed,
        "tool_calls": calls,
        "well_formed_calls": well_formed,
        "turns": turns,
        "response_tokens": tokens,
    }


def test_compare_counts_questions_gained_and_lost():
    cold = {
        "a": row(False, 1, 1),
        "b": row(True, 1, 1),
        "c": row(False, 0, 0, boxed=False, turns=1, tokens=90),
        "d": row(False, 2, 1, turns=3, tokens=150),
        "only-cold": row(True, 1, 1),  # not evaluated after: left out
    }
    grpo = {
        "a": row(True, 1, 1),  # gained
        "b": row(False, 1, 1),  # lost
        "c": row(True, 1, 1),  # gained, and started calling
        "d": row(True, 0, 0, turns=1, tokens=30),  # gained, and stopped calling
    }
    c = compare(cold, grpo)
    assert c["prompts"] == 4
    assert (c["accuracy_before"], c["accuracy_after"]) == (0.25, 0.75)
    assert (c["right_gained"], c["right_lost"]) == (3, 1)
    assert (c["called_before"], c["called_after"]) == (0.75, 0.75)
    assert (c["calls_gained"], c["calls_lost"]) == (1, 1)
    assert c["well_formed_before"] == pytest.approx(3 / 4) and c["well_formed_after"] == 1.0
    assert (c["boxed_before"], c["boxed_after"]) == (0.75, 1.0)
    assert (c["turns_before"], c["turns_after"]) == (2.0, 1.75)
    assert (c["tokens_before"], c["tokens_after"]) == (90.0, 52.5)
    assert mcnemar_p(c["right_gained"], c["right_lost"]) == pytest.approx(2 * (1 + 4) / 16)


def test_no_call_at_all_has_no_well_formed_rate():
    c = compare({"a": row(False, 0, 0)}, {"a": row(False, 0, 0)})
    assert c["well_formed_before"] is None and c["well_formed_after"] is None
