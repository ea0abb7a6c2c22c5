"""GRPO-TCR rewards: the Tool Call Reward on top of the outcome. Pure functions.

TCR (as the public GRPO-TCR code): a correct answer scores +1; a wrong one -1, raised by 0.1 for every tool
round (an assistant turn whose tool calls ran), capped at -0.6. A wrong answer that used the tool thus scores
above one that did not, but never near a right one.

DAPO's overlong penalty, which the GRPO-TCR recipe adds, is part of the reward's SQL definition
(refiner_core/reward/compose.py REWARD_SQL, reward.overlong_buffer / overlong_factor).
"""

from __future__ import annotations


def tool_call_reward(
    correct: bool,
    tool_rounds: int,
    *,
    right: float = 1.0,
    wrong: float = -1.0,
    per_round: float = 0.1,
    wrong_cap: float = -0.6,
) -> float:
    if tool_rounds < 0:
        raise ValueError(f"tool_rounds must be >= 0, got {tool_rounds}")
    if correct:
        return right
    return min(wrong + per_round * tool_rounds, wrong_cap)


def tcr_verifier(final_answer: str = "last_expression"):
    """reward.verifier 'tcr': the final answer (the last assistant turn) against the prompt's ground truth by
    math-verify (ground_truth.verify_row), scored by tool_call_reward with the rollout's tool rounds. The verdict's
    score is the TCR value; `correct` keeps the outcome."""
    import dataclasses

    from refiner_core.reward.ground_truth import Verdict, verify_row

    def verify_step(rollouts: list[dict], prompts: dict[str, dict]) -> list[Verdict]:
        verdicts = []
        for r in rollouts:
            truth = prompts[r["prompt_id"]].get("ground_truth")
            if truth is None:
                raise ValueError(f"prompt {r['prompt_id']!r} has no ground_truth: the 'tcr' verifier needs one")
            outcome = verify_row(r, truth, final_answer)
            score = tool_call_reward(outcome.score == 1.0, int(r.get("tool_rounds") or 0))
            verdicts.append(dataclasses.replace(outcome, score=score, correct=outcome.score))
        return verdicts

    return verify_step
