"""Majority-vote pseudo-labels (Co-rewarding): votes, ties, empty labels, twin labels, and their columns."""

from __future__ import annotations

import json

import pytest

from refiner_core.config import RewardConfig
from refiner_core.data.schedule import step_prompt_ids
from refiner_core.reward.pseudo_labels import Vote, majority_vote, verdict_against_label, vote_of
from refiner_core.reward.verifiers import make_verifier, verdict_columns


def _row(text: str, finish_reason: str = "stop") -> dict:
    return {"response_text": text, "finish_reason": finish_reason}


@pytest.mark.parametrize(
    "votes, expected",
    [
        (["3", "4", "3", None], Vote("3", 2, 3, False)),
        (["5", "6", "6", "5"], Vote("5", 2, 4, True)),  # 2-2 tie: the answer cast first wins
        ([None, "6", "5", "5", "6"], Vote("6", 2, 4, True)),  # a non-vote does not count as "first"
        (["7", "8", "9"], Vote("7", 1, 3, True)),  # all different: a three-way tie, the first vote wins
        (["14.0", "$14$", "15"], Vote("14.0", 2, 3, False)),  # counted by normalised text, reported as first cast
        (["-4", "4", "4"], Vote("4", 2, 3, False)),  # the sign is part of the answer
        (["\\frac{1}{2}", "3", "0.5"], Vote("\\frac{1}{2}", 2, 3, False)),  # equal by math-verify: one answer
        (["0.5", "3", "3", "1/2"], Vote("0.5", 2, 4, True)),  # 2-2 tie of equivalence classes: first cast wins
        # an interval is not the tuple of its ends: counted apart, as the match tells them apart (a normalised-text
        # shortcut counted "(1,2)" 3 votes and gave the two "[1,2]" voters reward 0)
        (["(1,2)", "[1,2]", "[1,2]", "(3,4)", "(3,4)"], Vote("[1,2]", 2, 5, True)),
        (["1\\,000", "0", "0", "1\\,000", "1000"], Vote("1\\,000", 3, 5, False)),  # 1\,000 is 1000, not 1 x 0
        (["2\\pi", "2\\pi", "4", "2\\pi"], Vote("2\\pi", 3, 4, False)),  # LaTeX votes: the same answer as written
        (["(1, 2)", "(1,2)", "3"], Vote("(1, 2)", 2, 3, False)),
        ([None, None], Vote(None, 0, 0, False)),  # no vote: empty label
        ([], Vote(None, 0, 0, False)),
    ],
)
def test_majority_vote_hand_computed(votes, expected):
    assert majority_vote(votes) == expected


def test_a_vote_is_the_last_box_and_nothing_else():
    assert vote_of(r"first \boxed{1}, finally \boxed{2}") == "2"
    assert vote_of(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert vote_of("the answer is 3") is None  # no \boxed{}: no vote, even though a number is there
    assert vote_of(r"\boxed{}") is None and vote_of(r"\boxed{ $ }") is None


def test_empty_label_gives_reward_zero_even_to_a_correct_answer():
    verdict = verdict_against_label(_row(r"\boxed{3}"), Vote(None, 0, 0, False), "twin", truth="3")
    assert verdict.score == 0.0 and verdict.method == "no_label" and verdict.pseudo_label is None
    assert verdict.correct == 1.0 and verdict.label_correct is None  # right answer, but nothing to match


def test_label_match_uses_math_equivalence_and_reports_agreement_with_the_truth():
    verdict = verdict_against_label(_row(r"so \boxed{0.5}"), Vote(r"\frac{1}{2}", 3, 4, False), "twin", truth="0.75")
    assert verdict.score == 1.0 and verdict.method == "math_verify"
    assert verdict.correct == 0.0 and verdict.label_correct == 0.0  # matched a wrong label
    no_box = verdict_against_label(_row("0.5"), Vote("0.5", 3, 4, False), "twin", truth=None)
    assert no_box.score == 0.0 and no_box.method == "no_answer" and no_box.correct is None


def _rollouts(prompt_id: str, answers: list[str]) -> list[dict]:
    return [
        {
            "run": "r",
            "step": 0,
            "prompt_id": prompt_id,
            "sample_idx": i,
            "response_text": text,
            "finish_reason": "stop",
            "response_tokens": 5,
        }
        for i, text in enumerate(answers)
    ]


PROMPTS = {
    "q": {"prompt_id": "q", "twin_id": "q-r", "ground_truth": "3", "snippet_ids": [], "question": "1 + 2?"},
    "q-r": {"prompt_id": "q-r", "twin_id": "q", "ground_truth": "3", "snippet_ids": [], "question": "one plus two?"},
    "lone": {"prompt_id": "lone", "twin_id": "lone-r", "ground_truth": "5", "snippet_ids": [], "question": "2 + 3?"},
    "open": {"prompt_id": "open", "twin_id": "open-r", "ground_truth": None, "snippet_ids": [], "question": "x?"},
    "open-r": {"prompt_id": "open-r", "twin_id": "open", "ground_truth": None, "snippet_ids": [], "question": "y?"},
}


def test_twin_verifier_labels_each_view_by_the_other_views_majority():
    """q's rollouts vote 3, 3, 4; its twin's vote 4, 4, 3 and one abstains. Each view is scored against the
    other's majority: q against '4' (wrong), q-r against '3' (right)."""
    rollouts = (
        _rollouts("q", [r"\boxed{3}", r"\boxed{3}", r"\boxed{4}"])
        + _rollouts("q-r", [r"\boxed{4}", r"\boxed{4}", r"\boxed{3}", "no idea"])
        + _rollouts("lone", [r"\boxed{5}", r"\boxed{5}"])
    )  # its twin was not sampled: empty label
    verdicts = make_verifier("co_rewarding")(rollouts, PROMPTS)
    rows = [verdict_columns(v) for v in verdicts]
    assert [r["verifier_score"] for r in rows] == [0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert [r["correct"] for r in rows] == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    assert [r["pseudo_label"] for r in rows] == ["4"] * 3 + ["3"] * 4 + [None] * 2
    assert [(r["label_votes"], r["label_voters"]) for r in rows] == [(2, 3)] * 3 + [(2, 3)] * 4 + [(0, 0)] * 2
    assert [r["label_correct"] for r in rows] == [0.0] * 3 + [1.0] * 4 + [None] * 2
    assert {r["label_source"] for r in rows} == {"twin"}
    assert rows[6]["verify_method"] == "no_answer" and rows[7]["verify_method"] == "no_label"


def test_without_ground_truth_correct_is_null_and_rewards_still_come_from_the_label():
    from refiner_core.reward.score import score_rollouts

    class NoJudge:  # verified prompts must not reach a judge
        name = "none"

        def __getattr__(self, item):
            raise AssertionError(f"the judge was used ({item}) for prompts without rubrics")

    rollouts = _rollouts("open", [r"\boxed{2}", r"\boxed{9}"]) + _rollouts("open-r", [r"\boxed{9}", r"\boxed{9}"])
    scored = score_rollouts(
        rollouts,
        PROMPTS,
        {},
        NoJudge(),
        RewardConfig(verifier="co_rewarding", verification_reward=10.0, format_weight=0.0),
        "zero",
        2000,
        64,
    )
    rewards = {(r["prompt_id"], r["sample_idx"]): r for r in scored.rewards}
    assert [rewards[("open", i)]["reward"] for i in range(2)] == [0.0, 10.0]  # label '9' from the twin
    assert [rewards[("open-r", i)]["reward"] for i in range(2)] == [0.0, 0.0]  # label '2': open's 2-9 tie, first cast
    assert rewards[("open-r", 0)]["pseudo_label"] == "2"
    assert rewards[("open-r", 0)]["label_tied"] and not rewards[("open", 0)]["label_tied"]
    assert all(r["correct"] is None and r["label_correct"] is None for r in scored.rewards)
    assert all(r["verifier"] == "co_rewarding" for r in scored.reward_inputs)


def test_self_majority_verifier_labels_a_group_by_its_own_votes():
    rollouts = _rollouts("q", [r"\boxed{4}", r"\boxed{3}", r"\boxed{3}"])
    rows = [verdict_columns(v) for v in make_verifier("majority_vote")(rollouts, PROMPTS)]
    assert [r["verifier_score"] for r in rows] == [0.0, 1.0, 1.0]
    assert {r["pseudo_label"] for r in rows} == {"3"} and {r["label_source"] for r in rows} == {"self"}


def test_ground_truth_verdicts_leave_the_label_columns_null():
    rows = [verdict_columns(v) for v in make_verifier("ground_truth")(_rollouts("q", [r"\boxed{3}"]), PROMPTS)]
    assert rows[0]["correct"] == 1.0 and rows[0]["pseudo_label"] is None and rows[0]["label_source"] is None


def test_both_views_of_a_question_are_sampled_in_the_same_step():
    ids = [f"p{i}" for i in range(6)] + [f"p{i}-r" for i in range(6)] + ["solo"]
    twin_of = {**{f"p{i}": f"p{i}-r" for i in range(6)}, **{f"p{i}-r": f"p{i}" for i in range(6)}}
    seen = []
    for step in range(7):  # 7 questions, 3 per step: every epoch covers each question once
        chosen = step_prompt_ids(sorted(ids), step, 3, seed=5, twin_of=twin_of)
        questions = [p for p in chosen if not p.endswith("-r")]
        assert len(questions) == 3 and len(set(chosen)) == len(chosen)
        assert all(twin_of[p] in chosen for p in questions if p != "solo")  # the twin is always there too
        assert step_prompt_ids(sorted(ids), step, 3, seed=5, twin_of=twin_of) == chosen
        seen.append(questions)
    first_epoch = {q for s in seen[:3] for q in s}
    assert first_epoch == {f"p{i}" for i in range(6)} | {"solo"}
    # more questions asked for than exist: all of them, each with its twin
    assert sorted(step_prompt_ids(sorted(ids), 0, 13, seed=5, twin_of=twin_of)) == sorted(ids)


def test_twins_share_a_split_and_unpaired_views_are_quarantined(tiny_tokenizer):
    from refiner_core.data.prepare import prepare_prompts
    from refiner_core.data.rows import RawRow, validate_rows

    def row(rid, twin):
        return {
            "id": rid,
            "messages": [{"role": "user", "content": f"question {rid}"}],
            "ground_truth": "1",
            "twin_id": twin,
        }

    rows = [row("a", "a-r"), row("a-r", "a"), row("c", "missing"), row("d", "d"), row("e", "a"), row("plain", None)]
    raw = [RawRow(f"line {i + 1}", json.dumps(r), r) for i, r in enumerate(rows)]
    prompts, rejected = prepare_prompts(validate_rows(raw).rows, tiny_tokenizer, "r", 512, 64, 0.5, seed=3)
    assert sorted(p["prompt_id"] for p in prompts) == ["a", "a-r", "plain"]
    assert {r.row_ref: r.reason for r in rejected} == {
        "line 3": "unknown_twin",
        "line 4": "unknown_twin",
        "line 5": "unknown_twin",
    }
    assert "'missing' is not a prepared prompt" in rejected[0].detail and "names itself" in rejected[1].detail
    by_id = {p["prompt_id"]: p for p in prompts}
    assert by_id["a"]["twin_id"] == "a-r" and by_id["plain"]["twin_id"] is None
    for seed in range(8):  # whatever the seed, both views land in the same split
        again, _ = prepare_prompts(validate_rows(raw).rows, tiny_tokenizer, "r", 512, 64, 0.5, seed=seed)
        splits = {p["prompt_id"]: p["split"] for p in again}
        assert splits["a"] == splits["a-r"]


def test_max_prompts_takes_or_leaves_a_twin_pair_whole(tiny_tokenizer):
    """A view kept without its twin would have no pseudo-label: data.max_prompts never splits a pair."""
    from pathlib import Path

    from refiner_core.data.prepare import cap_prompts, prepare_prompts
    from refiner_core.data.rows import read_jsonl, validate_rows

    twins = Path(__file__).resolve().parents[1] / "data" / "math" / "twins.jsonl"
    rows = validate_rows(read_jsonl(twins)[:6]).rows
    prompts, _ = prepare_prompts(rows, tiny_tokenizer, "t", 4096, 4096, 0.0, 0)
    ids = [p["prompt_id"] for p in prompts]
    assert ids == ["math-0000", "math-0000-r", "math-0001", "math-0001-r", "math-0002", "math-0002-r"]
    for cap, kept in [(3, 2), (4, 4), (5, 4), (6, 6), (100, 6), (0, 6), (1, 0)]:
        capped = cap_prompts(prompts, cap)
        assert [p["prompt_id"] for p in capped] == ids[:kept], cap
    plain = [dict(p, twin_id=None) for p in prompts]
    assert cap_prompts(plain, 3) == plain[:3]


def test_a_box_that_equals_its_label_and_the_truth_as_latex_is_rewarded():
    """A box's content is an answer, not a response to find an answer in: read as a sentence, `2\\pi` was 2."""
    verdict = verdict_against_label(_row(r"So the area is \boxed{2\pi}"), Vote("2\\pi", 3, 4, False), "twin", "2\\pi")
    assert (verdict.score, verdict.correct, verdict.label_correct) == (1.0, 1.0, 1.0)
