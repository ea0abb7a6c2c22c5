import math

import pytest

from refiner_core.config import RewardConfig
from refiner_core.judges.base import parse_judge_output
from refiner_core.reward.compose import compute_rewards, format_parts, orient, weight_row

IDS = ["a1b2c3", "d4e5f6"]
GOOD = "<answer><snippet id=a1b2c3,d4e5f6>claim</snippet> and <snippet id=ffffff>bad</snippet></answer>"


@pytest.mark.parametrize(
    "text,raw,failure",
    [
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
        ('{"score": 2, "reason": "uses {braces}"}', 2.0, None),
        ('{"score": 2, "detail": {"score": 0, "seen": [1]}}', 2.0, None),  # a nested object is part of the verdict
        ('<think>Maybe {"score": 0}? No, it fully meets it.</think>\n{"score": 2}', 2.0, None),
        ('<think>The rubric asks for {"score": 0}, {"score": 1} or', None, "unparseable"),  # cut off while thinking
        ('It says {"score": 0}, {"score": 1} or {"score": 2}. {"score": 2}', None, "ambiguous"),
        ('{"score": 1} Again: {"score": "1"}', 1.0, None),  # a restated verdict that agrees
        ('{"score": 0, "score": 2}', None, "ambiguous"),  # a repeated key is two verdicts (a dict keeps the last)
        ('{"score": 2, "reason": "x", "score": 2}', 2.0, None),
        # a chat template that opened <think> in the prompt: only the close is in the reply, the drafts before it
        ('First {"score": 0}? No: it fully meets it.\n</think>\n\n{"score": 2}', 2.0, None),
        ('<think>a</think> Then <think>once more {"score": 1}', None, "unparseable"),  # a second block never closed
        ('{"score": 1' + "0" * 400 + "}", None, "out_of_range"),  # past float's range: no OverflowError
        ('{"score": 1, "n": ' + "9" * 5000 + "}", None, "unparseable"),  # past int's digit limit: no ValueError
        # a score object nested in an object that is not valid JSON is part of a broken verdict, not the verdict
        ('{"detail": {"score": 2}, "score": 0,}', None, "unparseable"),
        ('{"reason": "the rubric shows {"score": 2} as full", "score": 0}', None, "unparseable"),
        ('{"items": [{"score": 0}, {"score": 2}], "score": 1 oops} {"score": 1}', 1.0, None),
        ('{"reason": "cut off here, {"score": 2}', None, "unparseable"),  # never closed
        ('For the set {a, b}: {"score": 2}', 2.0, None),  # a brace in prose is no object
        ('{"reason": "a \\"quoted\\" {brace", "score": 2}', 2.0, None),
    ],
)
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


def _inputs(text=None, *, sample_idx=0, finish_reason="stop", response_tokens=10, max_new_tokens=100, **extra):
    """One reward_inputs row of a judged prompt (format facts from `text`)."""
    row = {
        "run": "r",
        "step": 0,
        "prompt_id": "p",
        "sample_idx": sample_idx,
        "verifier": "judge",
        "verifier_score": None,
        "correct": None,
        "extracted_answer": None,
        "verify_method": None,
        "verify_detail": None,
        "label_source": None,
        "pseudo_label": None,
        "label_votes": None,
        "label_voters": None,
        "label_tied": None,
        "label_correct": None,
        **format_parts(GOOD if text is None else text, IDS),
        "claims": None,
        "citation_precision": None,
        "citation_recall": None,
        "citation_f1": None,
        "claims_judged": None,
        "claims_failed": None,
        "citation_f1_judged": None,
        "finish_reason": finish_reason,
        "response_tokens": response_tokens,
        "max_new_tokens": max_new_tokens,
    }
    return {**row, **extra}


def _score_row(oriented, weight=1.0, sample_idx=0, rubric="r0"):
    return {
        "run": "r",
        "step": 0,
        "prompt_id": "p",
        "sample_idx": sample_idx,
        "rubric_id": rubric,
        "kind": "positive",
        "weight": weight,
        "judge": "j",
        "raw_output": "",
        "raw_score": None,
        "score": oriented,
        "oriented_score": oriented,
        "failure": None if oriented is not None else "unparseable",
        "latency_seconds": 0.0,
        "attempts": 1,
        "cache_hit": False,
        "judge_model": "j",
        "prompt_hash": "h",
        "prompt_tokens": 10,
        "completion_tokens": 1,
    }


def _rewards(inputs, scores, on_failure="zero", **weights):
    return compute_rewards(inputs, scores, [weight_row("r", 0, "train", RewardConfig(**weights), on_failure)])


def test_format_parts_counts_each_cited_id():
    parts = format_parts(GOOD, IDS)
    assert parts["has_answer"] and parts["format_ok"]
    assert (parts["n_citations"], parts["n_invalid_citations"]) == (3, 1)
    assert math.isclose(parts["citation_valid_fraction"], 2 / 3)
    missing = format_parts("no block", IDS)
    assert missing == {
        "has_answer": False,
        "format_ok": False,
        "format_score": 0.0,
        "n_citations": 0,
        "n_invalid_citations": 0,
        "citation_valid_fraction": 0.0,
        "n_distractor_citations": None,
        "cites_distractor": None,
        "supporting_recall": None,
    }


# Three snippets: S1 and S2 support the answer, D1 is the distractor.
SNIPPETS, SUPPORTING = ["S1", "S2", "D1"], ["S1", "S2"]


@pytest.mark.parametrize(
    "text,n_distractor,cites",
    [
        ("<answer><snippet id=S1>a</snippet> <snippet id=S2>b</snippet></answer>", 0, False),
        ("<answer><snippet id=S1,D1>a</snippet></answer>", 1, True),
        ("<answer><snippet id=D1>a</snippet> <snippet id=D1,S2>b</snippet></answer>", 2, True),
        ("<answer><snippet id=XX>invented</snippet></answer>", 0, False),  # an invalid ID is not a distractor
        ("<answer>no citation</answer>", 0, False),
        ("prose, no answer block, mentions D1", None, None),  # no answer: not counted either way
    ],
)
def test_distractor_citations_hand_counted(text, n_distractor, cites):
    parts = format_parts(text, SNIPPETS, SUPPORTING)
    assert (parts["n_distractor_citations"], parts["cites_distractor"]) == (n_distractor, cites)
    unlabeled = format_parts(text, SNIPPETS, None)  # a row without supporting_ids is never judged on distractors
    assert (unlabeled["n_distractor_citations"], unlabeled["cites_distractor"]) == (None, None)


def test_distractor_penalty_enters_the_reward_outside_the_multiplier():
    clean = format_parts("<answer><snippet id=S1>a</snippet></answer>", SNIPPETS, SUPPORTING)
    dirty = format_parts("<answer><snippet id=S1,D1>a</snippet></answer>", SNIPPETS, SUPPORTING)
    unlabeled = format_parts("<answer><snippet id=S1,D1>a</snippet></answer>", SNIPPETS, None)
    inputs = [_inputs(sample_idx=i, **parts) for i, parts in enumerate((clean, dirty, unlabeled))]
    scores = [_score_row(0.5, sample_idx=i) for i in range(3)]
    weights = dict(verification_reward=10.0, rubric_weight=1.0, citation_weight=0.2, format_weight=1.0)
    rows = _rewards(inputs, scores, distractor_penalty=2.0, **weights)
    # judged part: 1.0 * 0.5 + 0.2 * citation_valid_fraction (1.0 each) = 0.7; x10 = 7.0; + format 1.0 = 8.0
    assert [r["distractor_term"] for r in rows] == [0.0, -2.0, 0.0]
    assert [r["reward"] for r in rows] == pytest.approx([8.0, 6.0, 8.0])
    assert [r["distractor_penalty"] for r in rows] == [2.0] * 3
    off = _rewards(inputs, scores, **weights)  # the default penalty is 0: the reward is unchanged
    assert [r["reward"] for r in off] == pytest.approx([8.0, 8.0, 8.0])


@pytest.mark.parametrize("judge_score", [0.25, 0.5, 1.0])
def test_the_main_jobs_reward_puts_a_broken_format_below_a_cited_distractor(judge_score):
    """Without the gate, an answer with no block (or a forged one) cited nothing, so it escaped the distractor
    penalty and scored what a well-formed answer citing a distractor scored (5.0 each at a judge score of 0.5): GRPO
    could learn to break the format to avoid the penalty, and on one CPU the main job did."""
    from refiner_core import REPO_ROOT
    from refiner_core.config import load_recipe

    reward = load_recipe(REPO_ROOT / "recipes" / "refiner-smollm2.yaml").reward
    texts = {
        "clean": "<answer><snippet id=S1>a</snippet></answer>",
        "distractor": "<answer><snippet id=S1,D1>a</snippet></answer>",
        "no block": "prose that names S1",
        "forged": "<answer><answer id=S1>a</answer>",
    }
    inputs = [_inputs(sample_idx=i, **format_parts(t, SNIPPETS, SUPPORTING)) for i, t in enumerate(texts.values())]
    scores = [_score_row(judge_score, sample_idx=i) for i in range(len(texts))]
    rows = compute_rewards(inputs, scores, [weight_row("r", 0, "train", reward, "zero")])
    by_kind = dict(zip(texts, (r["reward"] for r in rows)))
    assert by_kind["clean"] > by_kind["distractor"] > max(by_kind["no block"], by_kind["forged"])


@pytest.mark.parametrize(
    ("text", "recall"),
    [
        ("<answer><snippet id=S1,S2>a</snippet></answer>", 1.0),  # both supporting snippets
        ("<answer><snippet id=S1>a</snippet> <snippet id=S1>b</snippet></answer>", 0.5),  # one, twice: still one
        ("<answer><snippet id=S2,D1>a</snippet></answer>", 0.5),  # a distractor adds nothing
        ("<answer>no citation</answer>", 0.0),
        ("no answer block <snippet id=S1>a</snippet>", None),  # nothing was chosen
    ],
)
def test_supporting_recall_hand_computed(text, recall):
    assert format_parts(text, SNIPPETS, SUPPORTING)["supporting_recall"] == recall
    assert format_parts(text, SNIPPETS, None)["supporting_recall"] is None  # unlabelled row


def test_supporting_recall_weight_enters_the_reward_outside_the_multiplier():
    labels = (SNIPPETS, SUPPORTING)
    both = format_parts("<answer><snippet id=S1,S2>a</snippet></answer>", *labels)
    one = format_parts("<answer><snippet id=S1>a</snippet></answer>", *labels)
    none = format_parts("no answer", *labels)
    inputs = [_inputs(sample_idx=i, **parts) for i, parts in enumerate((both, one, none))]
    scores = [_score_row(0.5, sample_idx=i) for i in range(3)]
    weights = dict(verification_reward=10.0, rubric_weight=1.0, citation_weight=0.2, format_weight=1.0)
    rows = _rewards(inputs, scores, supporting_recall_weight=2.0, **weights)
    assert [r["recall_term"] for r in rows] == [2.0, 1.0, 0.0]  # 2 x recall; NULL recall adds 0
    # 10 * (0.5 + 0.2 * valid fraction) + format + recall_term: 8.0 + 2.0, 8.0 + 1.0, 10 * 0.5 + 0 + 0
    assert [r["reward"] for r in rows] == pytest.approx([10.0, 9.0, 5.0])
    assert [r["reward"] for r in _rewards(inputs, scores, **weights)] == pytest.approx([8.0, 8.0, 5.0])


def test_rubric_mean_under_each_failure_treatment():
    scores = [_score_row(1.0, 2.0, rubric="a"), _score_row(0.5, 1.0, rubric="b"), _score_row(None, 1.0, rubric="c")]
    (zero,) = _rewards([_inputs()], scores, "zero", citation_weight=0.0)
    (skip,) = _rewards([_inputs()], scores, "skip", citation_weight=0.0)
    (drop,) = _rewards([_inputs()], scores, "drop", citation_weight=0.0)
    assert math.isclose(zero["rubric_score"], 2.5 / 4) and not zero["dropped"]  # (2*1 + 1*0.5 + 1*0) / 4
    assert math.isclose(skip["rubric_score"], 2.5 / 3) and not skip["dropped"]  # (2*1 + 1*0.5) / 3
    assert drop["dropped"] and math.isclose(drop["rubric_score"], 2.5 / 3)
    assert (zero["rubrics_scored"], zero["rubrics_failed"]) == (2, 1)
    # skip with every rubric failed: nothing is left to average, so the rollout leaves the update (a rubric
    # score of 0 would teach the policy the judge's failures); one scored rubric keeps it in
    (only_failed,) = _rewards([_inputs()], [_score_row(None, rubric="a"), _score_row(None, rubric="b")], "skip")
    assert only_failed["dropped"] and (only_failed["rubrics_scored"], only_failed["rubrics_failed"]) == (0, 2)
    (zero_all,) = _rewards([_inputs()], [_score_row(None)], "zero")
    assert not zero_all["dropped"] and zero_all["rubric_score"] == 0.0


@pytest.mark.parametrize(
    "claims,judged,failed,kind,dropped",
    [
        (3, 3, 3, "f1", True),
        (3, 3, 2, "f1", False),
        (3, 3, 3, "dr_tulu", True),
        (3, 3, 3, "valid_ids", False),
        (0, 0, 0, "f1", False),
        (3, 2, 2, "f1", True),  # both judged claims failed; the third is an uncited sentence, which needs no call
        (3, None, 2, "f1", False),  # rows stored before claims_judged: every claim counted as judged
    ],
)
def test_skip_drops_a_rollout_whose_claims_all_failed(claims, judged, failed, kind, dropped):
    """Under skip, a claim-level citation score with every judged claim's judgment failed has nothing to average
    (its uncited claims alone gave F1 0, and the rollout trained on the judge's failures); an answer without claims
    (F1 0 by definition) and valid_ids (no claim calls) stay in the update."""
    row = _inputs(claims=claims, claims_judged=judged, claims_failed=failed, citation_f1=0.0, citation_f1_judged=0.0)
    (out,) = _rewards([row], [_score_row(1.0)], "skip", citation_score=kind)
    assert out["dropped"] is dropped


def test_reward_hand_computed():
    (out,) = _rewards(
        [_inputs()],
        [_score_row(0.6)],
        verification_reward=10.0,
        rubric_weight=1.0,
        citation_weight=0.2,
        format_weight=0.5,
    )
    # 10 * (1.0*0.6 + 0.2*2/3) + 0.5*1
    assert math.isclose(out["reward"], 10 * (0.6 + 0.2 * 2 / 3) + 0.5)
    assert math.isclose(out["judged_score"], 0.6 + 0.2 * 2 / 3)
    assert not out["gated"] and not out["non_stop_penalized"] and out["reward_version"] == "train"


@pytest.mark.parametrize("kind,expected", [("valid_ids", 2 / 3), ("f1", 0.5), ("dr_tulu", 0.6 * 0.5 + 0.4 * 2 / 3)])
def test_citation_score_kinds(kind, expected):
    (out,) = _rewards(
        [_inputs(citation_f1=0.5)],
        [_score_row(0.0)],
        citation_score=kind,
        citation_weight=1.0,
        rubric_weight=0.0,
        verification_reward=1.0,
    )
    assert math.isclose(out["citation_score"], expected) and math.isclose(out["reward"], expected)


def test_gating_and_non_stop_penalty():
    bad = "<answer><snippet id=a1b2c3>unclosed</answer>"
    (out,) = _rewards([_inputs(bad)], [_score_row(0.9)], gate_judge_score_with_format_bonus=True, format_weight=1.0)
    assert out["gated"] and out["reward"] == 0.0
    (ungated,) = _rewards([_inputs(bad)], [_score_row(0.9)])
    # Ungated, an unclosed tag cites as its closed twin does (its ID counts, valid or invented): no better, no worse
    (closed,) = _rewards([_inputs("<answer><snippet id=a1b2c3>unclosed</snippet></answer>")], [_score_row(0.9)])
    assert ungated["n_citations"] == closed["n_citations"] == 1 and not ungated["format_ok"]
    assert math.isclose(ungated["reward"], closed["reward"]) and ungated["reward"] > 10 * 0.9
    (out,) = _rewards(
        [_inputs(finish_reason="length")], [_score_row(1.0)], non_stop_penalty=True, non_stop_penalty_value=-1.0
    )
    assert out["non_stop_penalized"] and out["reward"] == -1.0
    (out,) = _rewards([_inputs()], [_score_row(1.0)], non_stop_penalty=True, non_stop_penalty_value=-1.0)
    assert not out["non_stop_penalized"]


@pytest.mark.parametrize("length,penalty", [(50, 0.0), (60, 0.0), (61, -0.05), (70, -0.5), (79, -0.95), (80, -1.0)])
def test_overlong_penalty_at_the_buffer_edges(length, penalty):
    """L_max 80, buffer 20, factor 1: 0 up to 60 tokens, then linear down to -1 at 80 (DAPO)."""
    (out,) = _rewards(
        [_inputs(response_tokens=length, max_new_tokens=80)],
        [_score_row(0.0)],
        overlong_buffer=20,
        overlong_factor=1.0,
        citation_weight=0.0,
    )
    assert math.isclose(out["overlong_penalty"], penalty, abs_tol=1e-12)
    assert math.isclose(out["reward"], penalty, abs_tol=1e-12)
    (half,) = _rewards(
        [_inputs(response_tokens=length, max_new_tokens=80)],
        [_score_row(0.0)],
        overlong_buffer=20,
        overlong_factor=0.5,
        citation_weight=0.0,
    )
    assert math.isclose(half["overlong_penalty"], penalty / 2, abs_tol=1e-12)


# GRPO-TCR's published setting: L_max 10480, buffer 3000, factor 1.0 -> the penalty starts after 7480 tokens.
@pytest.mark.parametrize(
    "length, expected",
    [
        (0, 0.0),
        (7479, 0.0),
        (7480, 0.0),  # up to L_max - B: nothing
        (7481, -1 / 3000),
        (7780, -0.1),
        (8980, -0.5),  # linear in the buffer
        (10479, -2999 / 3000),
        (10480, -1.0),  # -f at L_max
        (10481, -1.0),
        (20000, -1.0),  # held at -f beyond (a capped sampler never gets there)
    ],
)
def test_overlong_penalty_published_setting(length, expected):
    (out,) = _rewards(
        [_inputs(response_tokens=length, max_new_tokens=10480)],
        [_score_row(0.0)],
        overlong_buffer=3000,
        overlong_factor=1.0,
        citation_weight=0.0,
    )
    assert out["overlong_penalty"] == pytest.approx(expected, abs=1e-12)


def test_verified_prompts_use_the_verifier_score():
    row = _inputs("The answer is \\boxed{42}", verifier="ground_truth", verifier_score=1.0, correct=1.0)
    (out,) = _rewards([row], [], verification_reward=10.0, format_weight=0.0)
    assert out["reward"] == 10.0 and out["rubrics_scored"] == 0
    # The format gate is about the <answer> block judged prompts are asked for; a verified one is not asked for it.
    assert not row["format_ok"]
    (gate_on,) = _rewards(
        [row], [], verification_reward=10.0, format_weight=0.0, gate_judge_score_with_format_bonus=True
    )
    assert not gate_on["gated"] and gate_on["reward"] == 10.0


def test_weights_are_one_row_per_version_and_versions_do_not_mix():
    weights = [
        weight_row("r", 0, "train", RewardConfig(citation_weight=0.0), "zero"),
        weight_row("r", 0, "v2", RewardConfig(citation_weight=0.0, verification_reward=1.0), "zero"),
    ]
    rows = compute_rewards([_inputs()], [_score_row(0.5)], weights)
    assert {r["reward_version"]: r["reward"] for r in rows} == {"train": 5.0, "v2": 0.5}


def test_reward_weights_are_listed_once_in_reward_config():
    """A new RewardConfig field with a column reaches the reward_weights table and every weight row unaided."""
    import dataclasses

    from refiner_core.config import reward_weight_fields
    from refiner_core.schema import REWARD_WEIGHTS

    columns = [column for _, column, _, _ in reward_weight_fields()]
    assert REWARD_WEIGHTS.column_names == ["run", "step", "reward_version", *columns, "on_failure"]
    recorded = {f.name for f in dataclasses.fields(RewardConfig)} - {name for name, _, _, _ in reward_weight_fields()}
    # choices that make the verifier's verdict (reward_inputs.verifier, verify_method), which `refiner rescore` refuses
    assert recorded == {"verifier", "final_answer"}
    row = weight_row("r", 3, "v", RewardConfig(distractor_penalty=1.5, citation_score="f1"), "skip")
    assert list(row) == REWARD_WEIGHTS.column_names
    assert (row["distractor_penalty"], row["citation_score_kind"], row["on_failure"]) == (1.5, "f1", "skip")
