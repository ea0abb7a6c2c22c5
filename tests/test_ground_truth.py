"""Ground-truth verification: answer extraction and equivalence, by hand-computed cases."""

from __future__ import annotations

import pytest

from refiner_core.reward.ground_truth import final_answer, last_boxed, normalize, verify


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces kept
        (r"first \boxed{1} then \boxed{2}", "2"),  # the last box counts
        (r"\fbox{7}", "7"),
        ("no box here", None),
        (r"\boxed{unclosed", None),
        (r"so \boxed {42}.", "42"),  # a space before the brace is the same box in LaTeX
        (r"\fbox {1/2} then \boxed{3} and \boxed  {4}", "4"),
        (r"\boxedx{5}", None),  # another command
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_final_answer_falls_back_to_answer_block_then_text():
    assert final_answer("x <answer> 12 </answer>") == "12"
    assert final_answer("  13 \n") == "13"
    assert final_answer("   ") is None


@pytest.mark.parametrize("a, b", [("1,000", "1000"), ("$5$", "5"), ("2.50", "2.5"), ("Paris.", "paris"), ("3.0", "3")])
def test_normalize_equal(a, b):
    assert normalize(a) == normalize(b)


def test_normalize_keeps_sign_and_percent():
    assert normalize("-4") != normalize("4")
    assert normalize("5%") != normalize("5")


def test_verify_correct_wrong_and_no_answer():
    assert verify(r"The sum is \boxed{35}", "35").score == 1.0
    wrong = verify(r"\boxed{36}", "35")
    assert wrong.score == 0.0 and wrong.extracted == "36"
    none = verify("", "35")
    assert none.score == 0.0 and none.method == "no_answer" and none.extracted is None


def test_verify_equivalent_forms():
    """0.5 and \\frac{1}{2} are the same answer: math-verify decides it (a plain string match could not)."""
    verdict = verify(r"\boxed{0.5}", r"\frac{1}{2}")
    assert verdict.method == "math_verify", verdict.detail
    assert verdict.score == 1.0
    assert verify(r"\boxed{\frac{2}{4}}", "0.5").score == 1.0
    assert verify(r"\boxed{0.6}", r"\frac{1}{2}").score == 0.0


def test_verify_text_answers_fall_back_to_normalized_match_and_say_so():
    verdict = verify("<answer>Paris</answer>", "paris")
    assert verdict.score == 1.0
    assert verdict.method in ("math_verify", "normalized_match")
    if verdict.method == "normalized_match":
        assert verdict.detail


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            r"\boxed{\frac{\sqrt{2}}{2}} and then {x}",
            r"\frac{\sqrt{2}}{2}",
        ),  # two levels of nesting; later braces ignored
        (r"\boxed{1} \fbox{2} \boxed{ 3 }", "3"),  # several boxes of both kinds: the last, stripped
        (r"\boxed{a} then \boxed{unclosed {", None),  # the last box is unclosed: no answer (not an earlier box)
    ],
)
def test_last_boxed_nesting_and_several_boxes(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    "response, truth, score",
    [
        (r"\boxed{\dfrac{3}{4}}", "0.75", 1.0),
        (r"\boxed{1/2}", "0.5", 1.0),
        (r"\boxed{14.0}", "14", 1.0),
        (r"\boxed{-7}", "-7", 1.0),
        (r"\boxed{7}", "-7", 0.0),  # the sign matters
        (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),  # equal values, different forms
    ],
)
def test_math_verify_equivalences(response, truth, score):
    verdict = verify(response, truth)
    assert verdict.method == "math_verify" and verdict.score == score


def test_an_empty_box_is_wrong_not_an_error():
    verdict = verify(r"\boxed{}", "3")
    assert verdict.score == 0.0 and verdict.method == "normalized_match" and verdict.detail
