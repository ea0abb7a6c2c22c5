from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger

from refiner_core.eval.judge_checks import anchor_rows, rejudge, sample_keys
from refiner_core.judges.cache import fresh_answers
from refiner_core.schema import JUDGE_ANCHORS
from refiner_core.store.storage import read_rows, write_table
from tasks.judge import judge_usage
from tasks.judge_server import rubrics_by_prompt, stage_judge
from tasks.stage import stage


@stage("judge-anchors")
def judge_anchors(
    *,
    run_dir: str,
    run: str,
    step: int,
    anchors: dict,
    prompts: dict,
    rubrics: dict,
    judge_model: dict,
    judge_cfg: dict,
    dtype: str,
    precision: str,
) -> dict:
    """judge.anchor_every: re-judge `anchors['count']` of step 0's rollouts (seeded) with the run's judge ->
    scores/step=N/judge_anchors.parquet, beside the judgments they got at step 0. Its own stage: switching anchors
    on or off leaves the training stages Cached."""
    log = get_run_logger()
    first_rollouts = read_rows(anchors["rollouts"]["rollouts"]["path"])
    first_scores = read_rows(anchors["scores"]["judge_scores"]["path"])
    judged = {(s["prompt_id"], s["sample_idx"]) for s in first_scores}
    chosen = set(sample_keys(judged, anchors["count"], anchors["seed"]))
    rollout_rows = [r for r in first_rollouts if (r["prompt_id"], r["sample_idx"]) in chosen]
    prompt_rows = {p["prompt_id"]: p for p in read_rows(prompts["prompts"]["path"])}
    rubric_rows = rubrics_by_prompt(rubrics)
    settings, scorer = stage_judge(run_dir, judge_model, judge_cfg, dtype, precision, log)
    with fresh_answers():  # the judge as it answers now, not step 0's answers from its cache
        again = rejudge(rollout_rows, prompt_rows, rubric_rows, scorer, settings.max_response_chars)
    first = [s for s in first_scores if (s["prompt_id"], s["sample_idx"]) in chosen]
    rows = anchor_rows(run, step, anchors["step"], first, again)
    moved = [
        abs(r["score"] - r["first_score"]) for r in rows if r["score"] is not None and r["first_score"] is not None
    ]
    log.info(
        "judge-anchors step %d: %d anchor judgments of %d rollouts, mean |score - step %d's| %.4f",
        step,
        len(rows),
        len(rollout_rows),
        anchors["step"],
        sum(moved) / max(len(moved), 1),
    )
    path = Path(run_dir) / "scores" / f"step={step}" / "judge_anchors.parquet"
    return {
        "judge_anchors": {"path": str(path), "hash": write_table(JUDGE_ANCHORS, rows, path)},
        "judge_usage": {**judge_usage(again), "step": step},  # judge.budget_usd counts these judgments too
    }
