"""Judge scoring: format/citation checks plus an LLM rubric judge, composed into rewards.

A judge turns chat-message lists into raw text completions. Judges register in JUDGES by "module:factory"
string: 'transformers' runs a model in-process, 'openai' calls an OpenAI-compatible server (cached, concurrent).
A judge may also offer `complete_detailed`, returning one `Completion` per conversation with its metadata
(latency, attempts, cache hit, transport failure); judges without it get defaults from `judge_completions`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from refiner_core.config import RewardConfig
from refiner_core.formats import parse_answer
from refiner_core.ground_truth import verify
from refiner_core.prompts import judge_messages
from refiner_core.registry import resolve
from refiner_core.rewards import compose_reward, format_parts, orient, parse_judge_output, rubric_score


class Judge(Protocol):
    name: str

    def complete(self, conversations: list[list[dict]]) -> list[str]: ...


@dataclass
class Completion:
    """One judge answer and how it was obtained. `text` is None when no answer came (then `failure` says why)."""

    text: str | None
    failure: str | None = None
    latency_seconds: float | None = None
    attempts: int = 1
    cache_hit: bool = False
    judge_model: str = ""
    prompt_hash: str = ""


class JudgeFailed(RuntimeError):
    """judge.on_failure 'fail': some (rollout, rubric) pair got no valid judgment."""


JUDGES: dict[str, str] = {"transformers": "refiner_core.judges.transformers_judge:make_transformers_judge",
                          "openai": "refiner_core.judges.openai_judge:make_openai_judge"}


def make_judge(kind: str, model_path: str, cfg: dict, dtype: str = "float32", precision: str = "fp32") -> Judge:
    """`precision` is the in-process judges' compute precision (model.precision); a served judge ignores it."""
    judge = resolve(JUDGES, "judge engine", kind)(model_path, cfg, dtype, precision=precision)
    if not getattr(judge, "model_name", ""):
        try:
            judge.model_name = str(model_path)
        except AttributeError:
            pass
    return judge


def judge_completions(judge: Judge, conversations: list[list[dict]]) -> list[Completion]:
    """The judge's `complete_detailed` when it has one; otherwise `complete`, timed as a whole (each row gets
    its share of the latency), one attempt, no cache."""
    if not conversations:
        return []
    detailed = getattr(judge, "complete_detailed", None)
    if detailed is not None:
        return detailed(conversations)
    from refiner_core.judges.cache import prompt_hash

    start = time.perf_counter()
    texts = judge.complete(conversations)
    share = (time.perf_counter() - start) / len(conversations)
    model = getattr(judge, "model_name", "") or judge.name
    return [Completion(t, None, share, 1, False, model, prompt_hash(c)) for t, c in zip(texts, conversations, strict=True)]


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
    outputs = judge_completions(judge, conversations)

    score_rows = []
    per_rollout: dict[tuple, list[tuple[float | None, float]]] = {}
    for (r, rubric), done in zip(pairs, outputs, strict=True):
        raw = done.text
        parsed = parse_judge_output(raw) if raw is not None else None
        if parsed is None or done.failure is not None:
            score, raw_score, failure = None, None, done.failure or "no_answer"
        else:
            score, raw_score, failure = parsed.score, parsed.raw_score, parsed.failure
        oriented = None if score is None else orient(score, rubric["kind"])
        key = (r["prompt_id"], r["sample_idx"])
        per_rollout.setdefault(key, []).append((oriented, rubric["weight"]))
        score_rows.append({
            "run": r["run"], "step": r["step"], "prompt_id": r["prompt_id"], "sample_idx": r["sample_idx"],
            "rubric_id": rubric["rubric_id"], "kind": rubric["kind"], "weight": rubric["weight"],
            "judge": judge.name, "raw_output": raw, "raw_score": raw_score, "score": score,
            "oriented_score": oriented, "failure": failure, "latency_seconds": done.latency_seconds,
            "attempts": done.attempts, "cache_hit": done.cache_hit, "judge_model": done.judge_model,
            "prompt_hash": done.prompt_hash,
        })
    failures = [s for s in score_rows if s["failure"] is not None]
    if on_failure == "fail" and failures:
        first = failures[0]
        raise JudgeFailed(f"{len(failures)} of {len(score_rows)} judgments failed (judge.on_failure='fail'); first: "
                          f"prompt {first['prompt_id']} sample {first['sample_idx']} rubric {first['rubric_id']}: "
                          f"{first['failure']}")

    reward_rows = []
    for r in rollouts:
        key = (r["prompt_id"], r["sample_idx"])
        rubric, scored, failed = rubric_score(per_rollout.get(key, []), on_failure)
        prompt = prompts[r["prompt_id"]]
        parts = format_parts(r["response_text"], prompt["snippet_ids"])
        verdict = None  # prompts with rubrics are judged; those with only a ground truth are verified
        if not rubrics.get(r["prompt_id"]) and prompt.get("ground_truth") is not None:
            verdict = verify(r["response_text"], prompt["ground_truth"])
        composed = compose_reward(parts, rubric, r["finish_reason"], weights, verdict)
        reward_rows.append({
            "run": r["run"], "step": r["step"], "prompt_id": r["prompt_id"], "sample_idx": r["sample_idx"],
            **composed, "rubrics_scored": scored, "rubrics_failed": failed,
        })
    return score_rows, reward_rows


def judged_text(response_text: str) -> str:
    """What the judge sees: the text inside <answer> when present, else the whole response."""
    parsed = parse_answer(response_text)
    return parsed.answer_text if parsed.has_answer else response_text
