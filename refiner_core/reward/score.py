"""A step's scoring: every (rollout, rubric) pair judged, claims judged when the citation score needs them,
verified prompts checked, and the rewards computed by REWARD_SQL."""

from __future__ import annotations

from dataclasses import dataclass

from refiner_core.config import RewardConfig
from refiner_core.data.formats import has_words, parse_answer
from refiner_core.data.prompts import claim_support_messages, judge_messages
from refiner_core.judges.base import Completion, Judge, judge_completions, parse_judge_output
from refiner_core.reward.citations import (
    NO_ANSWER_SCORES,
    NOT_JUDGED_SCORES,
    citation_scores,
    extract_claims,
    snippet_texts,
)
from refiner_core.reward.compose import compute_rewards, format_parts, orient, weight_row
from refiner_core.reward.verifiers import make_verifier, verdict_columns


class JudgeFailed(RuntimeError):
    """judge.on_failure 'fail': some (rollout, rubric) pair got no valid judgment."""


@dataclass
class Scored:
    """A step's judgments and the rewards computed from them (one list of table rows each)."""

    judge_scores: list[dict]
    citation_claims: list[dict]
    reward_inputs: list[dict]
    reward_weights: list[dict]
    rewards: list[dict]


def score_rollouts(
    rollouts: list[dict],
    prompts: dict[str, dict],
    rubrics: dict[str, list[dict]],
    judge: Judge,
    weights: RewardConfig,
    on_failure: str,
    max_response_chars: int,
    max_new_tokens: int,
    version: str = "train",
) -> Scored:
    """Judge every (rollout, rubric) pair (and every cited claim when the citation score needs it), verify the
    prompts without rubrics, and compute rewards by REWARD_SQL."""
    pairs, conversations = [], []
    for r in rollouts:
        prompt = prompts[r["prompt_id"]]
        answer = judged_text(r["response_text"])[:max_response_chars]
        for rubric in rubrics.get(r["prompt_id"], []):
            pairs.append((r, rubric))
            conversations.append(judge_messages(prompt["question"], answer, rubric["description"]))
    claims = _claims_to_judge(rollouts, prompts, rubrics) if weights.citation_score != "valid_ids" else []
    claim_conversations = [c["conversation"] for _, found in claims for c in found or () if c["conversation"]]
    outputs = judge_completions(judge, conversations + claim_conversations)
    rubric_outputs, claim_outputs = outputs[: len(conversations)], iter(outputs[len(conversations) :])

    score_rows = []
    for (r, rubric), done in zip(pairs, rubric_outputs, strict=True):
        score, raw_score, failure = _parsed(done)
        score_rows.append(
            {
                "run": r["run"],
                "step": r["step"],
                "prompt_id": r["prompt_id"],
                "sample_idx": r["sample_idx"],
                "rubric_id": rubric["rubric_id"],
                "kind": rubric["kind"],
                "weight": rubric["weight"],
                "judge": judge.name,
                "raw_output": done.text,
                "raw_score": raw_score,
                "score": score,
                "oriented_score": None if score is None else orient(score, rubric["kind"]),
                "failure": failure,
                "latency_seconds": done.latency_seconds,
                "attempts": done.attempts,
                "cache_hit": done.cache_hit,
                "judge_model": done.judge_model,
                "prompt_hash": done.prompt_hash,
                "prompt_tokens": done.prompt_tokens,
                "completion_tokens": done.completion_tokens,
            }
        )
    claim_rows, citation = _judged_claims(claims, claim_outputs)
    failures = [s for s in score_rows + claim_rows if s["failure"] is not None]
    if on_failure == "fail" and failures:
        first = failures[0]
        raise JudgeFailed(
            f"{len(failures)} of {len(score_rows) + len(claim_rows)} judgments failed "
            f"(judge.on_failure='fail'); first: prompt {first['prompt_id']} sample "
            f"{first['sample_idx']}: {first['failure']}"
        )

    verifier = make_verifier(weights.verifier, weights.final_answer)
    unjudged = [r for r in rollouts if not rubrics.get(r["prompt_id"])]
    verdicts = dict(
        zip(((r["prompt_id"], r["sample_idx"]) for r in unjudged), verifier(unjudged, prompts) if unjudged else [])
    )
    input_rows = []
    for r in rollouts:
        key = (r["prompt_id"], r["sample_idx"])
        verdict, prompt = verdicts.get(key), prompts[r["prompt_id"]]
        input_rows.append(
            {
                "run": r["run"],
                "step": r["step"],
                "prompt_id": r["prompt_id"],
                "sample_idx": r["sample_idx"],
                "verifier": "judge" if verdict is None else weights.verifier,
                **verdict_columns(verdict),
                **format_parts(r["response_text"], prompt["snippet_ids"], prompt.get("supporting_ids")),
                **citation.get(key, NOT_JUDGED_SCORES),
                "finish_reason": r["finish_reason"],
                "response_tokens": r["response_tokens"],
                "max_new_tokens": max_new_tokens,
            }
        )
    weight_rows = [
        weight_row(run, step, version, weights, on_failure)
        for run, step in sorted({(r["run"], r["step"]) for r in rollouts})
    ]
    return Scored(score_rows, claim_rows, input_rows, weight_rows, compute_rewards(input_rows, score_rows, weight_rows))


def _parsed(done: Completion) -> tuple[float | None, float | None, str | None]:
    """(score in [0, 1], raw 0-2 score, failure) of one judge answer."""
    if done.text is None or done.failure is not None:
        return None, None, done.failure or "no_answer"
    parsed = parse_judge_output(done.text)
    return parsed.score, parsed.raw_score, parsed.failure


def _claims_to_judge(
    rollouts: list[dict], prompts: dict[str, dict], rubrics: dict[str, list[dict]]
) -> list[tuple[dict, list[dict] | None]]:
    """(rollout, its claims) for each judged rollout; each claim carries the judge conversation rating it (None
    when no call is needed: uncited, citing only invented IDs, or saying nothing). No answer block: claims None."""
    claims = []
    for r in rollouts:
        prompt = prompts[r["prompt_id"]]
        if not rubrics.get(r["prompt_id"]):
            continue  # verified prompts have no snippets to cite
        found = extract_claims(r["response_text"], prompt["snippet_ids"])
        texts = snippet_texts(prompt["tool_output"])
        claims.append(
            (
                r,
                None
                if found is None
                else [
                    {
                        "claim": c,
                        "conversation": claim_support_messages(c.text, [(i, texts.get(i, "")) for i in c.valid_ids])
                        if c.valid_ids and has_words(c.text)
                        else None,
                    }
                    for c in found
                ],
            )
        )
    return claims


def _judged_claims(claims: list[tuple[dict, list[dict] | None]], outputs) -> tuple[list[dict], dict]:
    """citation_claims rows and per-rollout precision/recall/F1, consuming the claim judgments in order."""
    rows, scores = [], {}
    for r, found in claims:
        key = (r["prompt_id"], r["sample_idx"])
        if found is None:
            scores[key] = NO_ANSWER_SCORES
            continue
        supports, failed = [], []
        for idx, item in enumerate(found):
            claim, done = item["claim"], next(outputs) if item["conversation"] else None
            support, _, failure = _parsed(done) if done is not None else (0.0 if claim.cited_ids else None, None, None)
            supports.append(support)
            failed.append(failure is not None)
            rows.append(
                {
                    "run": r["run"],
                    "step": r["step"],
                    "prompt_id": r["prompt_id"],
                    "sample_idx": r["sample_idx"],
                    "claim_idx": idx,
                    "claim": claim.text,
                    "cited_ids": list(claim.cited_ids),
                    "valid_ids": list(claim.valid_ids),
                    "support": support if claim.cited_ids else None,
                    "raw_output": None if done is None else done.text,
                    "failure": failure,
                    "attempts": None if done is None else done.attempts,
                    "cache_hit": None if done is None else done.cache_hit,
                    "prompt_hash": None if done is None else done.prompt_hash,
                    "prompt_tokens": None if done is None else done.prompt_tokens,
                    "completion_tokens": None if done is None else done.completion_tokens,
                }
            )
        cited = [bool(item["claim"].cited_ids) for item in found]
        scores[key] = citation_scores(supports, cited, failed, [item["conversation"] is not None for item in found])
    return rows, scores


def judged_text(response_text: str) -> str:
    """What the judge sees: the text inside <answer> when present, else the whole response."""
    parsed = parse_answer(response_text)
    return parsed.answer_text if parsed.has_answer else response_text
