"""Judge scoring: format/citation checks plus an LLM rubric judge, composed into rewards.

A judge turns chat-message lists into raw text completions. Judges register in JUDGES by "module:factory"
string: 'transformers' runs a model in-process.
"""

from __future__ import annotations

from typing import Protocol

from refiner_core.config import RewardConfig
from refiner_core.formats import parse_answer
from refiner_core.prompts import judge_messages
from refiner_core.registry import resolve
from refiner_core.rewards import compose_reward, format_parts, orient, parse_judge_output, rubric_score


class Judge(Protocol):
    name: str

    def complete(self, conversations: list[list[dict]]) -> list[str]: ...


JUDGES: dict[str, str] = {"transformers": "refiner_core.judges.transformers_judge:make_transformers_judge"}


def make_judge(kind: str, model_path: str, cfg: dict, dtype: str = "float32") -> Judge:
    return resolve(JUDGES, "judge engine", kind)(model_path, cfg, dtype)


def score_rollouts(
    rollouts: list[dict],
    prompts: dict[str, dict],
    rubrics: dict[str, list[dict]],
    judge: Judge,
    weights: RewardConfig,
    on_failure: str,
    max_response_chars: int,
) -> tuple[list[dict], list[dict]]:
    """Judge every (rollout, rubric) pair and compose rewards. Returns (judge_score rows, reward rows)."""
    pairs = []
    conversations = []
    for r in rollouts:
        prompt = prompts[r["prompt_id"]]
        answer = judged_text(r["response_text"])[:max_response_chars]
        for rubric in rubrics.get(r["prompt_id"], []):
            pairs.append((r, rubric))
            conversations.append(judge_messages(prompt["question"], answer, rubric["description"]))
    outputs = judge.complete(conversations) if conversations else []

    score_rows = []
    per_rollout: dict[tuple, list[tuple[float | None, float]]] = {}
    for (r, rubric), raw in zip(pairs, outputs, strict=True):
        parsed = parse_judge_output(raw)
        oriented = None if parsed.score is None else orient(parsed.score, rubric["kind"])
        key = (r["prompt_id"], r["sample_idx"])
        per_rollout.setdefault(key, []).append((oriented, rubric["weight"]))
        score_rows.append({
            "run": r["run"], "step": r["step"], "prompt_id": r["prompt_id"], "sample_idx": r["sample_idx"],
            "rubric_id": rubric["rubric_id"], "kind": rubric["kind"], "weight": rubric["weight"],
            "judge": judge.name, "raw_output": raw, "raw_score": parsed.raw_score, "score": parsed.score,
            "oriented_score": oriented, "failure": parsed.failure,
        })

    reward_rows = []
    for r in rollouts:
        key = (r["prompt_id"], r["sample_idx"])
        rubric, scored, failed = rubric_score(per_rollout.get(key, []), on_failure)
        parts = format_parts(r["response_text"], prompts[r["prompt_id"]]["snippet_ids"])
        composed = compose_reward(parts, rubric, r["finish_reason"], weights)
        reward_rows.append({
            "run": r["run"], "step": r["step"], "prompt_id": r["prompt_id"], "sample_idx": r["sample_idx"],
            **composed, "rubrics_scored": scored, "rubrics_failed": failed,
        })
    return score_rows, reward_rows


def judged_text(response_text: str) -> str:
    """What the judge sees: the text inside <answer> when present, else the whole response."""
    parsed = parse_answer(response_text)
    return parsed.answer_text if parsed.has_answer else response_text
