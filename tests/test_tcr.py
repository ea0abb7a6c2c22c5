"""TCR and the DAPO overlong penalty against hand-computed values."""

from __future__ import annotations

import pytest

from refiner_core.reward.tcr import tool_call_reward


@pytest.mark.parametrize(
    "rounds, expected", [(0, -1.0), (1, -0.9), (2, -0.8), (3, -0.7), (4, -0.6), (5, -0.6), (16, -0.6)]
)
def test_wrong_answers_rise_by_a_tenth_per_tool_round_up_to_the_cap(rounds, expected):
    assert tool_call_reward(False, rounds) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("rounds", [0, 1, 2, 4, 9])
def test_correct_answers_score_one_whatever_the_rounds(rounds):
    assert tool_call_reward(True, rounds) == 1.0


def test_tool_use_orders_wrong_answers_but_never_reaches_a_right_one():
    wrong = [tool_call_reward(False, k) for k in range(8)]
    assert wrong == sorted(wrong) and max(wrong) < tool_call_reward(True, 0)
    with pytest.raises(ValueError):
        tool_call_reward(False, -1)


def test_tcr_verifier_reads_the_last_assistant_turn_and_counts_tool_rounds():
    from refiner_core.reward.verifiers import make_verifier

    verify_step = make_verifier("tcr")
    prompts = {"p": {"prompt_id": "p", "ground_truth": "42"}}
    transcript = "<tool_call>...</tool_call> tool: \\boxed{42} "  # the tool printed the right answer...
    rollouts = [
        {"prompt_id": "p", "response_text": transcript + "\\boxed{41}", "final_text": "\\boxed{41}", "tool_rounds": 2},
        {
            "prompt_id": "p",
            "response_text": transcript + "\\boxed{42}",
            "final_text": "So \\boxed{42}.",
            "tool_rounds": 1,
        },
        {"prompt_id": "p", "response_text": "no answer", "final_text": "no answer", "tool_rounds": 0},
        {"prompt_id": "p", "response_text": "\\boxed{7}", "final_text": "\\boxed{7}", "tool_rounds": 6},
        {"prompt_id": "p", "response_text": "\\boxed{42}"},  # a single-turn rollout: no agent columns
    ]
    rollouts = [r | {"finish_reason": "stop"} for r in rollouts]
    verdicts = verify_step(rollouts, prompts)
    assert [v.score for v in verdicts] == pytest.approx([-0.8, 1.0, -1.0, -0.6, 1.0])
    assert [v.correct for v in verdicts] == [0.0, 1.0, 0.0, 0.0, 1.0]  # ...but the final turn decides
    assert verdicts[0].extracted == "41" and verdicts[1].extracted == "42"
    with pytest.raises(ValueError, match="ground_truth"):
        verify_step([{"prompt_id": "q", "response_text": "x", "finish_reason": "stop"}], {"q": {"prompt_id": "q"}})


@pytest.mark.parametrize("verifier", ["ground_truth", "majority_vote"])
def test_other_verifiers_also_read_an_agents_final_turn(verifier):
    """A tool result that prints \\boxed{42} is not the agent's answer: the final assistant turn is, for the
    ground-truth verifier and for the majority vote alike."""
    from refiner_core.reward.verifiers import make_verifier

    prompts = {"p": {"prompt_id": "p", "ground_truth": "42"}}
    gave_up = {
        "response_text": "<tool_call>...</tool_call> \\boxed{42} I could not work it out.",
        "tool_rounds": 1,
        "finish_reason": "stop",
    }
    final = "I could not work it out."
    rollouts = [{"prompt_id": "p", "sample_idx": i, "final_text": final, **gave_up} for i in (0, 1)]
    verdicts = make_verifier(verifier)(rollouts, prompts)
    assert [v.score for v in verdicts] == [0.0, 0.0]  # read from the whole transcript: 1.0, 1.0
    assert all(v.extracted != "42" for v in verdicts)
