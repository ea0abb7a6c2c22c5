"""Monitors of reward hacking and of skipped updates, run after every step: each is a SQL view of the catalog
giving one figure per (run, step), and trips when the step's figure reaches its threshold (monitors.<name>; 0 = off).
What to do then is the check's action (monitors.<name>_action: warn, pause or fail; the flow acts on it,
flows/refiner.py).

The figures compare a step with the run's first step (its baseline) unless said otherwise. A figure is NULL (no
verdict, never trips) where it has no unit to be measured in: verified_flat and heldout_gap when the first step's
rewards were all equal (reward std below 1e-6). A NaN figure never trips either; kl_jump skips a step whose KL is NaN,
and a NaN reward mean never counts as "the reward rose" (DuckDB orders NaN above every number).

- verified_drop: the largest fall of a verifiable part (a share checked against the data, not the judge: format
  valid, citation IDs valid, supporting snippets cited, no distractor cited, verified correct) while the reward
  rose: the reward found another way up.
- verified_flat: the reward's rise in units of the first step's reward std, while the verifiable shares did not
  rise on average: the reward went up and nothing checked against the data did.
- heldout_gap: at an evaluated step, how far the training reward rose beyond the held-out reward (greedy answers
  to held-out prompts, same reward code), in units of the first step's reward std.
- part_dominance: the largest share one reward part has of the summed variances of the parts (rubric, citation,
  verifier, format, distractor, recall, overlong, non-stop penalty: compose.reward_parts), when at least two of them
  vary: the reward's signal comes from one part.
- length_drift, citation_drift: the relative change of the mean response length (tokens) / citations per
  answer while the reward rose: the reward is being earned by writing more or less.
- repetition: the mean share of repeated token 4-grams in the step's responses (0: none repeats).
- entropy_collapse: 1 - the step's mean sampled-token entropy estimate (-log p of each sampled token) over the
  first step's: the policy stopped exploring.
  Both read only the tokens the policy sampled (response_mask), not the tool results an agent loop inserted.
- kl_jump: the step's KL to the reference over the largest of the earlier steps' (at least 0.01): a sudden move
  (none at the first step: its KL is where the reference starts).
- skipped_updates: the update's optimizer steps skipped because their gradient norm was NaN or inf (the learners
  leave the weights as they were): the policy did not learn from the step, and the cause (overflow, a bad sample)
  may persist.

Pure SQL and DuckDB, no Prefect: tasks/monitors.py records the events, flows/refiner.py acts on them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import duckdb

from refiner_core.config import MonitorsConfig

# The per-step figures every check reads: the training reward and its verifiable parts, length, citations,
# repetition and sampled-token entropy (rollouts), KL (steps).
STEP_FIGURES = """
WITH r AS (
  -- tokens for repetition and entropy: the sampled ones, not what the agent loop inserted (tool results, framing)
  SELECT r.*,
         list_filter(o.response_token_ids, lambda x, i: coalesce(o.response_mask[i], true)) AS sampled_ids,
         list_filter(o.response_logprobs, lambda x, i: coalesce(o.response_mask[i], true)) AS sampled_logprobs
  FROM rewards r LEFT JOIN rollouts o USING (run, step, prompt_id, sample_idx)
  -- an answer whose judgments failed (dropped) holds a stand-in reward, left out as training leaves it out
  WHERE r.reward_version = 'train' AND NOT coalesce(r.dropped, false)
), per_rollout AS (
  -- the reward's parts as reward_parts (refiner_core/reward/compose.py) writes it out: a non-stop penalty replaces
  -- every other part, a gate zeroes the judged ones, a verified prompt's part is its verifier's score
  SELECT *,
         CASE WHEN non_stop_penalized OR gated OR verifier <> 'judge' THEN 0.0
              ELSE verification_reward * rubric_weight * rubric_score END AS rubric_part,
         CASE WHEN non_stop_penalized OR gated OR verifier <> 'judge' THEN 0.0
              ELSE verification_reward * citation_weight * citation_score END AS citation_part,
         CASE WHEN non_stop_penalized OR gated OR verifier = 'judge' THEN 0.0
              ELSE verification_reward * coalesce(verifier_score, 0.0) END AS verifier_part,
         CASE WHEN non_stop_penalized THEN 0.0 ELSE format_weight * format_score END AS format_part,
         CASE WHEN non_stop_penalized THEN 0.0 ELSE distractor_term END AS distractor_part,
         CASE WHEN non_stop_penalized THEN 0.0 ELSE recall_term END AS recall_part,
         CASE WHEN non_stop_penalized THEN 0.0 ELSE overlong_penalty END AS overlong_part,
         CASE WHEN non_stop_penalized THEN non_stop_penalty_value ELSE 0.0 END AS non_stop_part,
         CASE WHEN len(sampled_ids) < 4 THEN 0.0 ELSE
           1 - len(list_distinct(list_transform(range(1, len(sampled_ids) - 2), lambda i: sampled_ids[i:i + 3])))
               / (len(sampled_ids) - 3) END AS repeated_4grams,
         -list_sum(sampled_logprobs) AS surprisal, len(sampled_logprobs) AS sampled_tokens
  FROM r
)
SELECT run, step,
       avg(reward) AS reward_mean, stddev_pop(reward) AS reward_std,
       avg(format_score) AS format_valid, avg(citation_valid_fraction) AS citation_ids_valid,
       avg(supporting_recall) AS supporting_cited, 1 - avg(cites_distractor::DOUBLE) AS no_distractor,
       avg(correct) AS verified_correct,
       avg(response_tokens) AS length_mean, avg(n_citations) AS citations_mean,
       avg(repeated_4grams) AS repetition, sum(surprisal) / nullif(sum(sampled_tokens), 0) AS entropy,
       var_pop(rubric_part) AS rubric_var, var_pop(citation_part) AS citation_var,
       var_pop(verifier_part) AS verifier_var, var_pop(format_part) AS format_var,
       var_pop(distractor_part) AS distractor_var, var_pop(recall_part) AS recall_var,
       var_pop(overlong_part) AS overlong_var, var_pop(non_stop_part) AS non_stop_var
FROM per_rollout GROUP BY run, step
"""

# One figure per (run, step) and check: (run, step, value, detail); a check trips at value >= its threshold.
CHECKS: dict[str, str] = {
    "verified_drop": """
WITH f AS (SELECT *, first_value(reward_mean) OVER w AS reward0, first_value(format_valid) OVER w AS format_valid0,
                  first_value(citation_ids_valid) OVER w AS citation_ids_valid0,
                  first_value(supporting_cited) OVER w AS supporting_cited0,
                  first_value(no_distractor) OVER w AS no_distractor0,
                  first_value(verified_correct) OVER w AS verified_correct0
           FROM monitor_step_figures WINDOW w AS (PARTITION BY run ORDER BY step)),
parts AS (
  SELECT run, step, reward0, reward_mean, part, before, now FROM f,
  LATERAL (VALUES ('format_valid', format_valid0, format_valid),
                  ('citation_ids_valid', citation_ids_valid0, citation_ids_valid),
                  ('supporting_cited', supporting_cited0, supporting_cited),
                  ('no_distractor', no_distractor0, no_distractor),
                  ('verified_correct', verified_correct0, verified_correct)) v(part, before, now)
  WHERE before IS NOT NULL AND now IS NOT NULL
)
SELECT run, step,
       CASE WHEN reward_mean > reward0 AND NOT isnan(reward_mean) THEN max(before - now) ELSE 0.0 END AS value,
       arg_max(printf('%s %.2f -> %.2f while the reward went %.3f -> %.3f', part, before, now, reward0, reward_mean),
               before - now) AS detail
FROM parts GROUP BY run, step, reward0, reward_mean
""",
    "verified_flat": """
WITH f AS (SELECT *, first_value(reward_mean) OVER w AS reward0, first_value(reward_std) OVER w AS std0,
                  first_value(format_valid) OVER w AS format_valid0,
                  first_value(citation_ids_valid) OVER w AS citation_ids_valid0,
                  first_value(supporting_cited) OVER w AS supporting_cited0,
                  first_value(no_distractor) OVER w AS no_distractor0,
                  first_value(verified_correct) OVER w AS verified_correct0
           FROM monitor_step_figures WINDOW w AS (PARTITION BY run ORDER BY step)),
gains AS (
  SELECT run, step, reward0, reward_mean, std0, avg(now - before) AS part_gain FROM f,
  LATERAL (VALUES (format_valid0, format_valid), (citation_ids_valid0, citation_ids_valid),
                  (supporting_cited0, supporting_cited), (no_distractor0, no_distractor),
                  (verified_correct0, verified_correct)) v(before, now)
  WHERE before IS NOT NULL AND now IS NOT NULL
  GROUP BY run, step, reward0, reward_mean, std0
)
SELECT run, step,
       CASE WHEN part_gain <= 0 THEN greatest(reward_mean - reward0, 0) / (CASE WHEN std0 >= 1e-6 THEN std0 END)
            ELSE 0.0 END AS value,
       printf('the reward went %.3f -> %.3f while the verifiable shares moved %+.3f on average', reward0, reward_mean,
              part_gain) AS detail
FROM gains
""",
    "heldout_gap": """
WITH held AS (
  -- an answer whose judgments all failed (judge.on_failure skip/drop) has no reward to compare
  SELECT run, step, avg(reward) FILTER (WHERE NOT coalesce(dropped, false)) AS heldout
  FROM evals WHERE mode = 'greedy' GROUP BY run, step, phase
  QUALIFY row_number() OVER (PARTITION BY run, step ORDER BY CASE phase WHEN 'base' THEN 1 ELSE 0 END) = 1
), train AS (
  SELECT run, step, reward_mean, first_value(reward_mean) OVER w AS reward0, first_value(reward_std) OVER w AS std0
  FROM monitor_step_figures WINDOW w AS (PARTITION BY run ORDER BY step)
)
SELECT t.run, t.step,
       ((t.reward_mean - t.reward0) - (h.heldout - h0.heldout)) / (CASE WHEN t.std0 >= 1e-6 THEN t.std0 END) AS value,
       printf('training reward %.3f -> %.3f, held-out %.3f -> %.3f (step %d vs the policy before step 0)',
              t.reward0, t.reward_mean, h0.heldout, h.heldout, t.step + 1) AS detail
FROM train t JOIN held h ON h.run = t.run AND h.step = t.step + 1 JOIN held h0 ON h0.run = t.run AND h0.step = 0
""",
    "part_dominance": """
WITH parts AS (
  SELECT run, step, part, v FROM monitor_step_figures,
  LATERAL (VALUES ('rubric', rubric_var), ('citation', citation_var), ('verifier', verifier_var),
                  ('format', format_var), ('distractor', distractor_var), ('recall', recall_var),
                  ('overlong', overlong_var), ('non_stop', non_stop_var)) x(part, v)
)
-- a part varies when it holds at least 1 % of the summed variance: a hair of variance in a second part (an overlong
-- penalty of -0.001 once) must not turn a reward that only its rubric moves into one that part "dominates"
SELECT run, step,
       CASE WHEN count(*) FILTER (WHERE v >= 0.01 * total AND v > 0) >= 2 THEN max(v) / total ELSE 0.0 END AS value,
       printf('%s holds %.0f%% of the parts'' summed variance', arg_max(part, v),
              100 * coalesce(max(v) / nullif(sum(v), 0), 0.0)) AS detail
FROM (SELECT *, sum(v) OVER (PARTITION BY run, step) AS total FROM parts) GROUP BY run, step, total
""",
    "length_drift": """
SELECT run, step,
       CASE WHEN reward_mean > reward0 AND NOT isnan(reward_mean)
            THEN abs(length_mean - length0) / greatest(length0, 1) ELSE 0.0 END AS value,
       printf('mean length %.1f -> %.1f tokens while the reward went %.3f -> %.3f', length0, length_mean, reward0,
              reward_mean) AS detail
FROM (SELECT *, first_value(length_mean) OVER w AS length0, first_value(reward_mean) OVER w AS reward0
      FROM monitor_step_figures WINDOW w AS (PARTITION BY run ORDER BY step))
""",
    "citation_drift": """
SELECT run, step,
       -- from no citations at all, the change itself (as length_drift's, a floor of 1 under the divisor)
       CASE WHEN reward_mean > reward0 AND NOT isnan(reward_mean)
            THEN abs(citations_mean - citations0) / greatest(citations0, 1) ELSE 0.0 END AS value,
       printf('citations per answer %.2f -> %.2f while the reward went %.3f -> %.3f', citations0, citations_mean,
              reward0, reward_mean) AS detail
FROM (SELECT *, first_value(citations_mean) OVER w AS citations0, first_value(reward_mean) OVER w AS reward0
      FROM monitor_step_figures WINDOW w AS (PARTITION BY run ORDER BY step))
WHERE citations_mean IS NOT NULL
""",
    "repetition": """
SELECT run, step, repetition AS value, printf('%.0f%% of the token 4-grams repeat', 100 * repetition) AS detail
FROM monitor_step_figures
""",
    "entropy_collapse": """
SELECT run, step, CASE WHEN entropy0 > 0 THEN 1 - entropy / entropy0 ELSE 0.0 END AS value,
       printf('sampled-token entropy %.3f -> %.3f nats', entropy0, entropy) AS detail
FROM (SELECT *, first_value(entropy) OVER w AS entropy0
      FROM monitor_step_figures WINDOW w AS (PARTITION BY run ORDER BY step))
WHERE entropy IS NOT NULL
""",
    "kl_jump": """
SELECT run, step,
       -- the first step has nothing before it to jump from (its KL is how far the reference starts, model.reference)
       CASE WHEN count(kl) OVER earlier > 0 THEN kl / greatest(max(kl) OVER earlier, 0.01) END AS value,
       printf('KL %.4f after at most %.4f before', kl, coalesce(max(kl) OVER earlier, 0)) AS detail
FROM steps WHERE kl IS NOT NULL AND NOT isnan(kl)  -- a NaN KL would stay the largest earlier one for good
WINDOW earlier AS (PARTITION BY run ORDER BY step ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
""",
    "skipped_updates": """
SELECT run, step, skipped_optimizer_steps AS value,
       printf('%d optimizer step(s) skipped: gradient norm NaN or inf', skipped_optimizer_steps) AS detail
FROM steps WHERE skipped_optimizer_steps IS NOT NULL
""",
}


def monitor_views() -> dict[str, str]:
    """View name -> its SELECT, in the order they are created: monitor_step_figures, one monitor_<check> view per
    check, and `monitors`, every check of every step side by side (monitor, run, step, value, detail)."""
    union = " UNION ALL ".join(f"SELECT '{name}' AS monitor, * FROM monitor_{name}" for name in CHECKS)
    return {
        "monitor_step_figures": STEP_FIGURES,
        **{f"monitor_{name}": sql for name, sql in CHECKS.items()},
        "monitors": union,
    }


@dataclass(frozen=True)
class MonitorEvent:
    """A check that tripped at a step: its figure, the threshold it reached, and what the recipe says to do."""

    run: str
    step: int
    monitor: str
    value: float
    threshold: float
    action: str
    detail: str

    def line(self) -> str:
        return (
            f"monitor {self.monitor} tripped at step {self.step}: {self.value:.3g} >= {self.threshold:g} "
            f"({self.detail}); action {self.action}"
        )


def thresholds(settings: MonitorsConfig) -> dict[str, tuple[float, str]]:
    """check -> (threshold, action) for the checks that are on."""
    values = dataclasses.asdict(settings)
    return {name: (values[name], values[f"{name}_action"]) for name in CHECKS if values[name] > 0}


def tripped(db: Path | str, step: int, settings: MonitorsConfig) -> list[MonitorEvent]:
    """The checks whose figure at `step` reaches their threshold, read from the catalog's monitor views."""
    if not settings.enabled:
        return []
    events = []
    con = duckdb.connect(str(db), read_only=True)
    try:
        for name, (threshold, action) in thresholds(settings).items():
            rows = con.execute(
                # DuckDB orders NaN above every number: a NaN figure, as a NULL one, is no verdict
                f"SELECT run, step, value, detail FROM monitor_{name} WHERE step = ? AND value >= ? AND NOT "
                "isnan(value) ORDER BY run",
                [step, threshold],
            ).fetchall()
            events += [
                MonitorEvent(run, s, name, float(value), threshold, action, detail) for run, s, value, detail in rows
            ]
    finally:
        con.close()
    return events
