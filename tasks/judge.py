from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger

from refiner_core.judges.base import judge_backend
from refiner_core.reward.score import score_rollouts
from refiner_core.schema import CITATION_CLAIMS, JUDGE_SCORES, REWARD_INPUTS, REWARD_WEIGHTS, REWARDS
from refiner_core.stage_settings import stage_view
from refiner_core.store.storage import read_rows, write_rows
from tasks.judge_server import rubrics_by_prompt, stage_judge
from tasks.sampling import round_folder
from tasks.stage import stage


@stage("judge")
def judge(
    *,
    run_dir: str,
    step: int,
    rollouts: dict,
    prompts: dict,
    rubrics: dict,
    judge_model: dict,
    judge_cfg: dict,
    reward_cfg: dict,
    max_new_tokens: int,
    dtype: str,
    precision: str,
    teacher_rollouts: dict | None = None,
    round: int = 0,
) -> dict:
    """Stage 4: format/citation checks, rubric judge and verifiers -> judge_scores, reward inputs and (by SQL)
    rewards for the step's rollouts of sampling round `round` (scores/step=N/, later rounds in round=R/)."""
    log = get_run_logger()
    prompt_rows = {p["prompt_id"]: p for p in read_rows(prompts["prompts"]["path"])}
    if teacher_rollouts:  # Co-rewarding-II: the EMA teacher's responses vote each prompt's pseudo-label
        for t in read_rows(teacher_rollouts["teacher_rollouts"]["path"]):
            prompt_rows[t["prompt_id"]].setdefault("teacher_rollouts", []).append(t)
    rubric_rows = rubrics_by_prompt(rubrics)
    rollout_rows = read_rows(rollouts["rollouts"]["path"])
    # A step whose prompts are all verified (no rubrics) loads no judge model and starts no judge server.
    needs_judge = any(rubric_rows.get(r["prompt_id"]) for r in rollout_rows)
    scorer = stage_judge(run_dir, judge_model, judge_cfg, dtype, precision, log)[1] if needs_judge else None
    scored = score_rollouts(
        rollout_rows,
        prompt_rows,
        rubric_rows,
        scorer,
        stage_view("reward", reward_cfg),
        judge_cfg["on_failure"],
        judge_cfg["max_response_chars"],
        max_new_tokens,
    )
    scores, rewards = scored.judge_scores, scored.rewards
    out = round_folder(Path(run_dir) / "scores" / f"step={step}", round)
    failed = sum(s["failure"] is not None for s in scores)
    log.info(
        "judge step %d: %d rubric scores (%d failed: unparseable or no answer), reward mean %.3f",
        step,
        len(scores),
        failed,
        sum(r["reward"] for r in rewards) / max(len(rewards), 1),
    )
    if scored.citation_claims:
        log.info(
            "judge step %d: %d claims, mean citation F1 %.3f",
            step,
            len(scored.citation_claims),
            sum(r["citation_f1"] or 0.0 for r in scored.reward_inputs) / max(len(scored.reward_inputs), 1),
        )
    if not judge_backend(judge_cfg["engine"]).in_process:  # a served judge: its cache and requests
        log.info(
            "judge step %d: %d from the judge cache, %d requests, %d pairs retried",
            step,
            sum(bool(s["cache_hit"]) for s in scores),
            sum(s["attempts"] or 0 for s in scores),
            sum((s["attempts"] or 0) > 1 for s in scores),
        )
    usage = judge_usage(scores + scored.citation_claims)
    if usage["unknown"]:
        log.warning(
            "judge step %d: %d judgments came without a token count (the server sent no `usage`): "
            "their tokens are not in the cost ledger",
            step,
            usage["unknown"],
        )
    if getattr(scorer, "cache_off_reason", ""):
        log.warning("judge step %d: %s", step, scorer.cache_off_reason)
    tables = {
        "judge_scores": (JUDGE_SCORES, scores),
        "citation_claims": (CITATION_CLAIMS, scored.citation_claims),
        "reward_inputs": (REWARD_INPUTS, scored.reward_inputs),
        # the step's one row per reward version: its first round's (a later round's, the same, doubled every
        # reward the catalog's REWARD_SQL computes)
        "reward_weights": (REWARD_WEIGHTS, [] if round else scored.reward_weights),
        "rewards": (REWARDS, rewards),
    }
    manifest = {name: write_rows(table, rows, out / f"{name}.parquet") for name, (table, rows) in tables.items()}
    return {**manifest, "judge_failures": failed, "judge_usage": {**usage, "step": step, "round": round}}


def judge_usage(judgments: list[dict]) -> dict:
    """Requests and tokens of a step's judgments (judge_scores and citation_claims rows): what the step's judge
    cost. `unknown`: answered requests whose tokens nobody reported."""
    return {
        "requests": sum(j.get("attempts") or 0 for j in judgments),
        "prompt_tokens": sum(j["prompt_tokens"] or 0 for j in judgments),
        "completion_tokens": sum(j["completion_tokens"] or 0 for j in judgments),
        "unknown": sum(
            j["raw_output"] is not None and not j["cache_hit"] and j["prompt_tokens"] is None for j in judgments
        ),
    }
