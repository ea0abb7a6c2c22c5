"""Rubric orientation, format facts, and the one SQL definition of the reward."""

from __future__ import annotations

from refiner_core.config import RewardConfig, reward_weight_fields
from refiner_core.data.formats import check_citations, parse_answer
from refiner_core.schema import JUDGE_SCORES


def orient(score: float, kind: str) -> float:
    """Higher is always better: negative rubrics describe a mistake, so their score is flipped."""
    if kind == "positive":
        return score
    if kind == "negative":
        return 1.0 - score
    raise ValueError(f"rubric kind must be 'positive' or 'negative', got {kind!r}")


def format_parts(response_text: str, valid_ids: list[str], supporting_ids: list[str] | None = None) -> dict:
    """Format and citation facts of one response (reward_inputs columns). A distractor is a snippet of the tool
    output outside `supporting_ids`; the distractor and supporting-recall columns are NULL when the row labels none
    (None) or the response has no answer block (nothing was cited, so nothing was chosen)."""
    parsed = parse_answer(response_text)
    check = check_citations(parsed, valid_ids)
    format_ok = parsed.has_answer and parsed.well_formed
    distractors = recall = None
    if supporting_ids is not None and parsed.has_answer:
        supporting = set(supporting_ids)
        off_topic = set(valid_ids) - supporting
        distractors = sum(i in off_topic for i in parsed.cited_ids)
        recall = len(supporting & set(parsed.cited_ids)) / len(supporting)
    return {
        "has_answer": parsed.has_answer,
        "format_ok": format_ok,
        "format_score": 1.0 if format_ok else 0.0,
        "n_citations": check.n_citations,
        "n_invalid_citations": check.n_invalid,
        "citation_valid_fraction": check.score if parsed.has_answer else 0.0,
        "n_distractor_citations": distractors,
        "cites_distractor": None if distractors is None else distractors > 0,
        "supporting_recall": recall,
    }


def weight_row(run: str, step: int, version: str, weights: RewardConfig, on_failure: str) -> dict:
    """One reward_weights row: the settings a reward version is computed with."""
    settings = {column: getattr(weights, name) for name, column, _, _ in reward_weight_fields()}
    return {"run": run, "step": step, "reward_version": version, **settings, "on_failure": on_failure}


# The one definition of the reward. Reads three relations: reward_inputs (per rollout), judge_scores (per
# rollout and rubric) and reward_weights (per step and version); yields one row per (rollout, version). The
# judge stage runs it in memory over the step's rows, `refiner rescore` over stored ones with new weights, and
# the catalog's rewards_recomputed view over everything — so a SELECT shows exactly why a rollout got its reward.
REWARD_SQL = """
WITH rubric AS (
  SELECT s.run, s.step, s.prompt_id, s.sample_idx, w.reward_version,
         count(s.oriented_score) AS rubrics_scored,
         count(*) - count(s.oriented_score) AS rubrics_failed,
         CASE WHEN w.on_failure IN ('skip', 'drop')
              THEN sum(s.weight * s.oriented_score)
                   / nullif(sum(CASE WHEN s.oriented_score IS NOT NULL THEN s.weight END), 0)
              ELSE sum(s.weight * coalesce(s.oriented_score, 0)) / nullif(sum(s.weight), 0)
         END AS rubric_score
  FROM judge_scores s JOIN reward_weights w ON s.run = w.run AND s.step = w.step
  GROUP BY s.run, s.step, s.prompt_id, s.sample_idx, w.reward_version, w.on_failure
),
parts AS (
  SELECT i.*, w.* EXCLUDE (run, step),
         coalesce(r.rubric_score, 0.0) AS rubric_score,
         coalesce(r.rubrics_scored, 0) AS rubrics_scored,
         coalesce(r.rubrics_failed, 0) AS rubrics_failed,
         CASE w.citation_score_kind
              WHEN 'valid_ids' THEN i.citation_valid_fraction
              WHEN 'f1' THEN coalesce(claim_f1, 0.0)
              WHEN 'dr_tulu' THEN 0.6 * coalesce(claim_f1, 0.0) + 0.4 * i.citation_valid_fraction
         END AS citation_score,
         w.gate_judge_score_with_format_bonus AND i.verifier = 'judge' AND NOT i.format_ok AS gated,
         w.non_stop_penalty AND i.finish_reason <> 'stop' AS non_stop_penalized,
         CASE WHEN w.overlong_buffer > 0
              THEN greatest(-w.overlong_factor, least(0.0, -(i.response_tokens - (i.max_new_tokens - w.overlong_buffer))
                                                          / w.overlong_buffer * w.overlong_factor))
              ELSE 0.0 END AS overlong_penalty,
         CASE WHEN coalesce(i.cites_distractor, false) THEN -w.distractor_penalty ELSE 0.0 END AS distractor_term,
         w.supporting_recall_weight * coalesce(i.supporting_recall, 0.0) AS recall_term,
         -- 'drop': any failed judgment; 'skip': every judgment of a part failed, so nothing is left to average
         CASE w.on_failure
              WHEN 'drop' THEN coalesce(r.rubrics_failed, 0) > 0
                               OR w.citation_score_kind <> 'valid_ids' AND coalesce(i.claims_failed, 0) > 0
              WHEN 'skip' THEN coalesce(r.rubrics_failed, 0) > 0 AND r.rubrics_scored = 0
                               OR w.citation_score_kind <> 'valid_ids' AND coalesce(i.claims_failed, 0) > 0
                                  AND i.claims_failed = coalesce(i.claims_judged, i.claims)
              ELSE false END AS dropped
  FROM reward_inputs i
  JOIN reward_weights w ON i.run = w.run AND i.step = w.step
  -- failed claim judgments count 0 under 'zero', are left out under 'skip' and 'drop' (rows stored before
  -- citation_f1_judged existed have only citation_f1)
  CROSS JOIN LATERAL (SELECT CASE WHEN w.on_failure IN ('skip', 'drop')
                                  THEN coalesce(i.citation_f1_judged, i.citation_f1)
                                  ELSE i.citation_f1 END AS claim_f1)
  LEFT JOIN rubric r ON r.run = i.run AND r.step = i.step AND r.prompt_id = i.prompt_id
                    AND r.sample_idx = i.sample_idx AND r.reward_version = w.reward_version
),
judged AS (
  SELECT *,
         CASE WHEN gated THEN 0.0
              WHEN verifier <> 'judge' THEN verifier_score
              ELSE rubric_weight * rubric_score + citation_weight * citation_score
         END AS judged_score
  FROM parts
)
SELECT *,
       CASE WHEN non_stop_penalized THEN non_stop_penalty_value
            ELSE verification_reward * judged_score + format_weight * format_score + overlong_penalty + distractor_term
                 + recall_term
       END AS reward
FROM judged
ORDER BY run, step, reward_version, prompt_id, sample_idx
"""


def reward_parts(row: dict) -> dict[str, tuple[float, float]]:
    """A rewards row's reward as its weighted parts, name -> (weight, value), with sum(weight * value) == reward:
    REWARD_SQL's `judged_score` and `reward` written out, each part's value on its own scale and its weight the
    reward.* setting. grpo.reward_aggregation 'normalize_then_sum' normalises each value within its group. A
    non-stop penalty replaces every other part; a gate zeroes the judged ones."""
    kept = 0.0 if row["non_stop_penalized"] else 1.0
    judged = kept * (not row["gated"])
    judge = row["verifier"] == "judge"
    verification = row["verification_reward"]
    overlong_factor = row["overlong_factor"]
    return {
        "rubric": (verification * row["rubric_weight"], judged * judge * row["rubric_score"]),
        "citation": (verification * row["citation_weight"], judged * judge * row["citation_score"]),
        "verifier": (verification, judged * (not judge) * (row["verifier_score"] or 0.0)),
        "format": (row["format_weight"], kept * row["format_score"]),
        "overlong": (overlong_factor, kept * row["overlong_penalty"] / overlong_factor if overlong_factor else 0.0),
        "distractor": (row["distractor_penalty"], kept * -float(bool(row["cites_distractor"]))),
        "recall": (row["supporting_recall_weight"], kept * (row["supporting_recall"] or 0.0)),
        "non_stop": (1.0, (1.0 - kept) * row["non_stop_penalty_value"]),
    }


# What a step's rewards are computed from, one hash per (run, step): its reward_inputs and judge_scores rows
# (without how a judgment was obtained: latency, attempts, cache hit, tokens paid). A `refiner rescore` version
# records it.
STEP_INPUTS_HASH_SQL = f"""
SELECT run, step, hash(list(row_hash ORDER BY row_hash))::VARCHAR AS inputs_hash FROM (
  SELECT run, step, hash(i) AS row_hash FROM reward_inputs i
  UNION ALL
  SELECT run, step, hash(s) FROM (SELECT * EXCLUDE ({", ".join(JUDGE_SCORES.provenance)}) FROM judge_scores) s
) GROUP BY run, step
"""


def compute_rewards(inputs: list[dict], scores: list[dict], weights: list[dict]) -> list[dict]:
    """REWARD_SQL over in-memory rows (reward_inputs, judge_scores, reward_weights) -> rewards rows."""
    import duckdb

    from refiner_core.schema import JUDGE_SCORES, REWARD_INPUTS, REWARD_WEIGHTS, REWARDS, to_arrow

    con = duckdb.connect()
    try:
        relations = {
            "reward_inputs": to_arrow(REWARD_INPUTS, inputs),
            "judge_scores": to_arrow(JUDGE_SCORES, scores),
            "reward_weights": to_arrow(REWARD_WEIGHTS, weights),
        }
        for name, table in relations.items():
            con.register(name, table)
        return con.sql(REWARD_SQL).to_arrow_table().select(REWARDS.column_names).to_pylist()
    finally:
        con.close()
