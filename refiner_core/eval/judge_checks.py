"""Checking the judge: stored judgments beside a second opinion (another judge, a person's labels, or the same judge
later), per rubric group, with agreement and spread figures.

A second opinion is paired with the run's judgment of the same (rollout, rubric). Verdicts are oriented scores at
or above a threshold (eval.pass_rubric_score); agreement is Cohen's kappa on the verdicts and Spearman's rho on the
scores; `separation_auc` says how well the run judge's score tells apart what the other side passes from what it
fails; the spread (standard deviation, 10th and 90th percentile) of the run judge's own scores says whether its
scores move at all. Rubric groups: a static rubric's title (the same rubric on every prompt), or 'instance
positive' / 'instance negative' (each prompt's own rubrics).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from refiner_core.config import RewardConfig
from refiner_core.eval.stats import cohen_kappa, separation_auc, spearman
from refiner_core.reward.score import score_rollouts

ALL = "all"


def rubric_group(rubric: dict) -> str:
    return rubric["title"] if rubric["source"] == "static" else f"instance {rubric['kind']}"


def sample_keys(keys: Iterable[tuple], count: int, seed: int) -> list[tuple]:
    """`count` of the keys (all when fewer), drawn by random.Random(seed) from their sorted order: the same sample
    for the same stored rollouts and seed."""
    ordered = sorted(set(keys))
    return ordered if count <= 0 or count >= len(ordered) else sorted(random.Random(seed).sample(ordered, count))


def rejudge(
    rollouts: list[dict],
    prompts: dict[str, dict],
    rubrics: dict[str, list[dict]],
    judge,
    max_response_chars: int,
) -> list[dict]:
    """judge_scores rows of `judge` for every rubric of the rollouts, built as training builds them (the same judge
    prompt and answer excerpt); claims are not judged."""
    weights = dataclasses.replace(RewardConfig(), citation_score="valid_ids")
    max_new_tokens = max((r.get("max_new_tokens") or 0 for r in rollouts), default=0)
    return score_rollouts(
        rollouts, prompts, rubrics, judge, weights, "skip", max_response_chars, max_new_tokens
    ).judge_scores


class SecondOpinion(NamedTuple):
    """The other side's judgment of one stored judgment: another judge's or a person's label."""

    score: float | None  # oriented score in [0, 1]; None when the other judge's judgment failed
    failure: str | None  # why it failed
    passed: bool | None = None  # a label's own pass/fail verdict; None: the score passes at the threshold


def check_rows(
    run: str,
    check_name: str,
    stored: list[dict],
    other: dict[tuple, SecondOpinion],
    groups: dict[tuple[str, str], str],
    threshold: float,
) -> list[dict]:
    """judge_checks rows: each stored judgment (a judge_scores row) that the other side judged, keyed by (step,
    prompt_id, sample_idx, rubric_id) in `other`: a label's own pass/fail verdict stands as given, else the score
    passes at `threshold`; `groups` maps (prompt_id, rubric_id) to its rubric group."""
    rows = []
    for s in stored:
        key = (s["step"], s["prompt_id"], s["sample_idx"], s["rubric_id"])
        if key not in other:
            continue
        opinion = other[key]
        if opinion.passed is not None:
            other_passed = opinion.passed
        else:
            other_passed = None if opinion.score is None else opinion.score >= threshold
        rows.append(
            {
                "run": run,
                "check_name": check_name,
                "step": s["step"],
                "prompt_id": s["prompt_id"],
                "sample_idx": s["sample_idx"],
                "rubric_id": s["rubric_id"],
                "rubric_group": groups[(s["prompt_id"], s["rubric_id"])],
                "score": s["oriented_score"],
                "other_score": opinion.score,
                "other_passed": other_passed,
                "other_failure": opinion.failure,
            }
        )
    return rows


def agreement_rows(
    checks: list[dict], *, other: str, threshold: float, sample_rollouts: int, seed: int, created_at: str
) -> list[dict]:
    """judge_agreement rows: one per rubric group of the checks, and one for all of them."""
    by_group: dict[str, list[dict]] = {ALL: list(checks)}
    for row in checks:
        by_group.setdefault(row["rubric_group"], []).append(row)
    out = []
    for group in [ALL, *sorted(g for g in by_group if g != ALL)]:
        rows = by_group[group]
        both = [r for r in rows if r["score"] is not None and r["other_score"] is not None]
        scores = [r["score"] for r in both]
        others = [r["other_score"] for r in both]
        passed = [s >= threshold for s in scores]
        other_passed = [r["other_passed"] for r in both]
        out.append(
            {
                "run": checks[0]["run"] if checks else "",
                "check_name": checks[0]["check_name"] if checks else "",
                "other": other,
                "rubric_group": group,
                "pairs": len(both),
                "failed": sum(r["other_score"] is None for r in rows),
                "threshold": threshold,
                "kappa": cohen_kappa(passed, other_passed),
                "spearman": spearman(scores, others),
                "separation_auc": separation_auc(scores, other_passed),
                "pass_rate": _mean([float(p) for p in passed]),
                "other_pass_rate": _mean([float(p) for p in other_passed]),
                "score_mean": _mean(scores),
                "score_std": float(np.std(scores)) if scores else None,
                "score_p10": float(np.quantile(scores, 0.1)) if scores else None,
                "score_p90": float(np.quantile(scores, 0.9)) if scores else None,
                "other_score_std": float(np.std(others)) if others else None,
                "sample_rollouts": sample_rollouts,
                "seed": seed,
                "created_at": created_at,
            }
        )
    return out


def anchor_rows(run: str, step: int, anchor_step: int, first: list[dict], again: list[dict]) -> list[dict]:
    """judge_anchors rows: the anchors' judgments at `step` (`again`, judge_scores rows) beside the ones they got
    at `anchor_step` (`first`)."""
    before = {(r["prompt_id"], r["sample_idx"], r["rubric_id"]): r["oriented_score"] for r in first}
    return [
        {
            "run": run,
            "step": step,
            "anchor_step": anchor_step,
            "prompt_id": r["prompt_id"],
            "sample_idx": r["sample_idx"],
            "rubric_id": r["rubric_id"],
            "score": r["oriented_score"],
            "first_score": before.get((r["prompt_id"], r["sample_idx"], r["rubric_id"])),
            "failure": r["failure"],
        }
        for r in again
    ]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
