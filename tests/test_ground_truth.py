"""Ground-truth verification: answer extraction and equivalence, by hand-computed cases."""

from __future__ import annotations

import pytest

from refiner_core.reward.ground_truth import final_answer, last_boxed, normalize, verify, verify_row


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


@pytest.mark.parametrize(
    "response, truth, score",
    [
        # digit groups: math-verify alone read 1\,000 as 1 x 0 = 0 and 12\,345 as 357
        (r"\boxed{1000}", r"1\,000", 1.0),
        (r"\boxed{0}", r"1\,000", 0.0),
        (r"\boxed{357}", r"12\,345", 0.0),
        (r"\boxed{12\,345}", "12345", 1.0),
        (r"\boxed{1 000}", "1000", 1.0),
        (r"\boxed{1\ 000}", r"1,\!000", 1.0),
        (r"\boxed{(1, 200)}", "(1,200)", 1.0),  # a tuple's comma and space are not a digit group
        # scientific notation: the e of 1e-05 read as Euler's number
        (r"\boxed{0.00001}", "1e-05", 1.0),
        (r"\boxed{1e3}", "1000", 1.0),
        (r"\boxed{1.2e6}", "1200000", 1.0),
        (r"\boxed{2.5E-05}", "0.000025", 1.0),
        (r"\boxed{1e-05}", "e - 5", 0.0),
        (r"\boxed{10000000000000000}", "1e+16", 1.0),
        ("The answer is 1e5.", "100000", 1.0),  # a sentence's last number, its period after it
        (r"\boxed{10 20 300}", "10 20300", 0.0),  # a list of numbers is not one number in groups
        (r"\boxed{a_1 100}", "a_1100", 0.0),
    ],
)
def test_numbers_as_a_person_writes_them(response, truth, score):
    assert verify(response, truth).score == score


def test_a_response_cut_off_in_its_last_box_has_no_answer_not_an_earlier_one():
    cut = r"so the answer is \boxed{13}. Wait, recount: the answer is \boxed{1"
    verdict = verify(cut, "13")
    assert (verdict.score, verdict.method, verdict.extracted) == (0.0, "no_answer", None)
    assert verify(cut + "4}", "14").score == 1.0


@pytest.mark.parametrize(
    "response, truth",
    [(r"2\pi", r"2\pi"), ("(1, 2)", "(1,2)"), ("2, 3", "2,3"), (r"3\sqrt{2}", r"3\sqrt{2}"), ("(2, -1)", "(2,-1)")],
)
def test_a_bare_unboxed_answer_is_still_read_as_math(response, truth):
    """Read as a sentence alone, `2\\pi` is its last number, 2: a response is right when either reading is."""
    assert verify(response, truth).score == 1.0


@pytest.mark.parametrize("ending", ["", ".", "!"])
@pytest.mark.parametrize("sentence", ["You end up with 14", "We get 14", "The result is 14", "Total: 14"])
def test_an_unboxed_response_is_read_for_its_last_number_with_or_without_a_period(sentence, ending):
    """Wrapped in $...$ as a bare answer, the sentence was one product of letters: 'We get 14' scored 0 and
    'We get 14.' scored 1."""
    assert verify(sentence + ending, "14").score == 1.0
    assert verify(sentence + ending, "15").score == 0.0


def test_an_answer_math_verify_cannot_finish_falls_back_within_its_time_limit():
    """sympy evaluates 10^{10^{10}} exactly and never returns, holding the interpreter: the comparison runs in a
    child process that the kernel stops at its limit; the verdict falls back to the normalised match and says why,
    and the next comparison gets a new child."""
    import time

    from refiner_core.reward.math_verify_worker import MathVerifier

    verifier = MathVerifier(limit=2)
    try:
        started = time.monotonic()
        decided, detail = verifier.decide(r"$10^{10^{10}}$", "$10$")
        assert decided is None and "no verdict within 2 s" in detail
        assert time.monotonic() - started < 30
        assert verifier.decide("$0.5$", r"$\frac{1}{2}$") == (True, None)
    finally:
        verifier.close()
    verdict = verify(r"\boxed{-\$5}", "-5")  # the normalised match drops an escaped dollar too
    assert verdict.score == 1.0


def test_a_fork_made_while_another_thread_compares_gets_a_verifier_of_its_own():
    """The forked copy held the lock taken and waited for good on the parent's comparison."""
    import os
    import threading
    import time

    from refiner_core.reward.math_verify_worker import MathVerifier

    verifier = MathVerifier(limit=3)
    try:
        slow = threading.Thread(target=verifier.decide, args=(r"$10^{10^{10}}$", "$10$"))
        slow.start()
        time.sleep(0.5)  # inside the slow comparison, holding the lock
        pid = os.fork()
        if pid == 0:  # the forked copy: one comparison of its own, then out
            signal_alarm = __import__("signal").alarm
            signal_alarm(20)
            os._exit(0 if verifier.decide("$1$", "$1$") == (True, None) else 1)
        _, status = os.waitpid(pid, 0)
        slow.join()
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        verifier.close()


def test_a_line_a_library_prints_in_the_child_is_not_taken_for_a_reply():
    import json
    import subprocess
    import sys

    script = (
        "import refiner_core.reward.math_verify_worker as w; decide = w.decide; "
        "w.decide = lambda t, g: (print('noise'), decide(t, g))[1]; w.serve(5)"
    )
    request = json.dumps({"target": "$0.5$", "gold": "$\\frac{1}{2}$"}) + "\n"
    done = subprocess.run([sys.executable, "-c", script], input=request, capture_output=True, text=True, timeout=60)
    assert done.stdout.splitlines() == [json.dumps({"decided": True, "detail": None})]
    assert "noise" in done.stderr


@pytest.mark.parametrize(
    ("text", "finish", "last_expression", "marked"),
    [
        ("I tried 3, 5 and 7 but none of them works.", "stop", 1.0, 0.0),  # listing candidates: only marked refuses
        ("Step 1: let me first compute 3 + 4 = 7", "length", 0.0, 0.0),  # cut off mid-reasoning: no answer
        ("So 3 + 4 = 7", "stop", 1.0, 0.0),
        (r"so \boxed{7}", "length", 1.0, 1.0),  # a closed box is the answer, cut off or not
        ("<answer>7</answer>", "stop", 1.0, 1.0),
        (r"\boxed{5}. Alternatively 7", "stop", 0.0, 0.0),  # the box is the answer, not the last number
    ],
)
def test_reward_final_answer_reads_unmarked_text_only_where_it_says(text, finish, last_expression, marked):
    """reward.final_answer: 'marked' reads only a box or an <answer> block (the reference's GT-GRPO);
    'last_expression' also a response that marks none, but only one that stopped on its own."""
    row = {"response_text": text, "finish_reason": finish}
    assert verify_row(row, "7", "last_expression").score == last_expression
    verdict = verify_row(row, "7", "marked")
    assert verdict.score == marked
    if marked == 0.0 and last_expression == 1.0:
        assert (verdict.method, verdict.extracted) == ("no_answer", None)


def test_the_verifiers_read_the_answer_where_the_recipe_says():
    from refiner_core.reward.tcr import tcr_verifier
    from refiner_core.reward.verifiers import make_verifier

    rollouts = [{"prompt_id": "p", "sample_idx": 0, "response_text": "so it is 7", "finish_reason": "stop"}]
    prompts = {"p": {"ground_truth": "7"}}
    assert [v.score for v in make_verifier("ground_truth", "last_expression")(rollouts, prompts)] == [1.0]
    assert [v.score for v in make_verifier("ground_truth", "marked")(rollouts, prompts)] == [0.0]
    assert [v.correct for v in tcr_verifier("marked")(rollouts, prompts)] == [0.0]
    labelled = make_verifier("majority_vote", "marked")(rollouts, prompts)
    assert [v.correct for v in labelled] == [0.0]  # its correctness column reads as the reward does


def test_rescore_refuses_a_new_final_answer_reading():
    """reward.final_answer makes the verdicts stored in reward_inputs: a rescore cannot change it."""
    from refiner_core.config import load_recipe
    from refiner_core.reward.rescore import RescoreError, check_rescorable

    with pytest.raises(RescoreError, match=r"reward.final_answer changes how rollouts are verified"):
        check_rescorable(load_recipe(None), load_recipe(None, ["reward.final_answer=marked"]), 0, [])
