import dataclasses
import math

import pytest

from refiner_core.config import RewardConfig
from refiner_core.rewards import compose_reward, format_parts, orient, parse_judge_output, rubric_score

IDS = ["a1b2c3", "d4e5f6"]
GOOD = "<answer><snippet id=a1b2c3,d4e5f6>claim</snippet> and <snippet id=ffffff>bad</snippet></answer>"


@pytest.mark.parametrize("text,raw,failure", [
    ('{"score": 2}', 2.0, None),
    ('Sure! {"score": 1} done', 1.0, None),
    ('{"score": "0"}', 0.0, None),
    ('{"score": 1.5}', 1.5, None),
    ('{"score": 3}', None, "out_of_range"),
    ('{"score": -1}', None, "out_of_range"),
    ('{"score": "high"}', None, "non_numeric"),
    ('{"score": true}', None, "non_numeric"),
    ('{"grade": 2}', None, "unparseable"),
    ("score: 2", None, "unparseable"),
    ('{"score": 2', None, "unparseable"),
    ("", None, "unparseable"),
])
def test_parse_judge_output(text, raw, failure):
    parsed = parse_judge_output(text)
    assert parsed.raw_score == raw
    if failure is None:
        assert parsed.failure is None and parsed.score == raw / 2
    else:
        assert parsed.failure.startswith(failure) and parsed.score is None


def test_score_scale_maps_0_1_2_to_0_half_1():
    assert [parse_judge_output(f'{{"score": {k}}}').score for k in (0, 1, 2)] == [0.0, 0.5, 1.0]


def test_negative_rubrics_are_flipped():
    assert orient(1.0, "positive") == 1.0
    assert orient(1.0, "negative") == 0.0
    assert orient(0.25, "negative") == 0.75
    with pytest.raises(ValueError):
        orient(0.5, "neutral")


def test_rubric_score_weighted_and_failure_policies():
    items = [(1.0, 2.0), (0.5, 1.0), (None, 1.0)]
    # zero: (2*1 + 1*0.5 + 1*0) / 4
    assert rubric_score(items, "zero") == (2.5 / 4, 2, 1)
    # skip: (2*1 + 1*0.5) / 3
    assert rubric_score(items, "skip") == (2.5 / 3, 2, 1)
    assert rubric_score([(None, 1.0)], "skip") == (0.0, 0, 1)


def test_format_parts_counts_each_cited_id():
    parts = format_parts(GOOD, IDS)
    assert parts["has_answer"] and parts["format_ok"]
    assert (parts["n_citations"], parts["n_invalid_citations"]) == (3, 1)
    assert math.isclose(parts["citation_score"], 2 / 3)
    missing = format_parts("no block", IDS)
    assert missing == {"has_answer": False, "format_ok": False, "format_score": 0.0, "n_citations": 0,
                       "n_invalid_citations": 0, "citation_score": 0.0}


def test_compose_reward_hand_computed():
    w = RewardConfig(verification_reward=10.0, rubric_weight=1.0, citation_weight=0.2, format_weight=0.5)
    parts = format_parts(GOOD, IDS)
    out = compose_reward(parts, rubric=0.6, finish_reason="stop", w=w)
    # 10 * (1.0*0.6 + 0.2*2/3) + 0.5*1
    assert math.isclose(out["reward"], 10 * (0.6 + 0.2 * 2 / 3) + 0.5)
    assert not out["gated"] and not out["non_stop_penalized"]


def test_gating_and_non_stop_penalty():
    bad = format_parts("<answer><snippet id=a1b2c3>unclosed</answer>", IDS)
    gated = dataclasses.replace(RewardConfig(), gate_judge_score_with_format_bonus=True, format_weight=1.0)
    out = compose_reward(bad, rubric=0.9, finish_reason="stop", w=gated)
    assert out["gated"] and out["reward"] == 0.0
    ungated = compose_reward(bad, rubric=0.9, finish_reason="stop", w=RewardConfig())
    # An unclosed tag is no citation at all: only complete <snippet>...</snippet> pairs count.
    assert bad["n_citations"] == 0
    assert math.isclose(ungated["reward"], 10 * 0.9)
    penal = dataclasses.replace(RewardConfig(), non_stop_penalty=True, non_stop_penalty_value=-1.0)
    out = compose_reward(format_parts(GOOD, IDS), rubric=1.0, finish_reason="length", w=penal)
    assert out["non_stop_penalized"] and out["reward"] == -1.0
    assert not compose_reward(format_parts(GOOD, IDS), 1.0, "stop", penal)["non_stop_penalized"]
