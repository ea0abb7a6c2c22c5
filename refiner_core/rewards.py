"""Judge-output parsing, rubric orientation and reward composition (pure functions)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from refiner_core.config import RewardConfig
from refiner_core.formats import check_citations, parse_answer
from refiner_core.ground_truth import Verdict

_JSON_OBJ_RE = re.compile(r"\{[^{}]*\}")


@dataclass(frozen=True)
class JudgeParse:
    raw_score: float | None  # on the judge's 0-2 scale
    failure: str | None

    @property
    def score(self) -> float | None:
        """0/1/2 -> 0/0.5/1; fractional scores (probability-weighted judges) map linearly."""
        return None if self.raw_score is None else self.raw_score / 2.0


def parse_judge_output(text: str) -> JudgeParse:
    """The first JSON object with a 'score' key; the score must be a number in [0, 2]."""
    for match in _JSON_OBJ_RE.finditer(text):
        try:
            obj = json.loads(match.group(0))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or "score" not in obj:
            continue
        value = obj["score"]
        if isinstance(value, bool):
            return JudgeParse(None, f"non_numeric: score {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            return JudgeParse(None, f"non_numeric: score {value!r}")
        if not 0.0 <= number <= 2.0:
            return JudgeParse(None, f"out_of_range: score {value!r} not in [0, 2]")
        return JudgeParse(number, None)
    return JudgeParse(None, "unparseable: no JSON object with a 'score' key")


def orient(score: float, kind: str) -> float:
    """Higher is always better: negative rubrics describe a mistake, so their score is flipped."""
    if kind == "positive":
        return score
    if kind == "negative":
        return 1.0 - score
    raise ValueError(f"rubric kind must be 'positive' or 'negative', got {kind!r}")


def rubric_score(scores: list[tuple[float | None, float]], on_failure: str) -> tuple[float, int, int]:
    """Weighted mean of oriented scores. Items are (oriented score or None on failure, weight).

    on_failure='zero' counts a failed rubric as 0; 'skip' leaves it out. Returns (score, scored, failed).
    """
    num = den = 0.0
    scored = failed = 0
    for value, weight in scores:
        if value is None:
            failed += 1
            if on_failure == "skip":
                continue
            value = 0.0
        else:
            scored += 1
        num += weight * value
        den += weight
    return (num / den if den > 0 else 0.0), scored, failed


def format_parts(response_text: str, valid_ids: list[str]) -> dict:
    parsed = parse_answer(response_text)
    check = check_citations(parsed, valid_ids)
    format_ok = parsed.has_answer and parsed.well_formed
    return {
        "has_answer": parsed.has_answer,
        "format_ok": format_ok,
        "format_score": 1.0 if format_ok else 0.0,
        "n_citations": check.n_citations,
        "n_invalid_citations": check.n_invalid,
        "citation_score": check.score if parsed.has_answer else 0.0,
    }


def compose_reward(parts: dict, rubric: float, finish_reason: str, w: RewardConfig,
                   verdict: Verdict | None = None) -> dict:
    """reward = verification_reward * judged + format_weight * format, where judged is
    rubric_weight*rubric + citation_weight*citation for judged prompts and the 0/1 correctness for prompts
    verified by their ground truth (`verdict`).

    Gating zeroes the judged part on bad format; the non-stop penalty replaces the whole reward.
    The same formula is the `rewards_recomputed` view in the catalog.
    """
    gated = w.gate_judge_score_with_format_bonus and not parts["format_ok"]
    verified = verdict.score if verdict is not None else None
    judged = (0.0 if gated else verified if verified is not None
              else w.rubric_weight * rubric + w.citation_weight * parts["citation_score"])
    reward = w.verification_reward * judged + w.format_weight * parts["format_score"]
    penalized = w.non_stop_penalty and finish_reason != "stop"
    if penalized:
        reward = w.non_stop_penalty_value
    return {
        **parts,
        "verifier": "judge" if verdict is None else "ground_truth",
        "correct": verified,
        "extracted_answer": None if verdict is None else verdict.extracted,
        "verify_method": None if verdict is None else verdict.method,
        "verify_detail": None if verdict is None else verdict.detail,
        "rubric_score": rubric,
        "finish_reason": finish_reason,
        "verification_reward": w.verification_reward,
        "rubric_weight": w.rubric_weight,
        "citation_weight": w.citation_weight,
        "format_weight": w.format_weight,
        "gated": gated,
        "non_stop_penalized": penalized,
        "non_stop_penalty": w.non_stop_penalty_value,
        "reward": reward,
    }
