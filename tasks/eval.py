from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger

from refiner_core.agent.rollout import agent_eval_responses
from refiner_core.config import ConfigError
from refiner_core.eval.evaluate import (
    EvalSettings,
    format_table,
    generate_responses,
    held_out_prompts,
    score_responses,
    summarize,
)
from refiner_core.models import load_tokenizer
from refiner_core.runtime.unsaved_weights import model_folder
from refiner_core.schema import EVALS
from refiner_core.stage_settings import stage_view
from refiner_core.store.storage import read_rows, write_table
from tasks.judge_server import rubrics_by_prompt, stage_judge
from tasks.sampling import sampling_engine
from tasks.stage import stage


@stage("eval")
def evaluate(
    *,
    run_dir: str,
    run: str,
    step: int,
    phase: str,
    prompts: dict,
    rubrics: dict,
    policy: dict,
    judge_model: dict,
    eval_cfg: dict,
    engine_cfg: dict,
    rollout_cfg: dict,
    judge_cfg: dict,
    reward_cfg: dict,
    seed: int,
    dtype: str,
    precision: str,
) -> dict:
    """Held-out prompts -> responses from the policy (the recipe's rollout engine) -> training reward code ->
    evals/step=N/<phase>.parquet and a summary (format-valid rate, citation validity, judge score, pass@k; for an
    agent recipe the same tool-calling loop as its rollouts, and its tool-use columns)."""
    log = get_run_logger()
    sampling = {k: v for k, v in rollout_cfg.items() if k != "agent"}
    agent = stage_view("eval_rollout", rollout_cfg).agent
    settings = EvalSettings.from_config(stage_view("eval", eval_cfg), **sampling)
    prompt_rows = read_rows(prompts["prompts"]["path"])
    chosen = held_out_prompts(prompt_rows, settings.prompts, rubrics["held_out_ids"])
    if not chosen:
        raise ConfigError(
            "eval.every > 0 needs held-out prompts, and the validation split has none the rubric stage kept: set "
            "data.validation_fraction > 0 (e.g. 0.2), or see why it rejected them: "
            "SELECT * FROM quarantine WHERE stage = 'rubrics'"
        )
    # the run's live engine; kept after, or closed to free memory before the judge loads
    with sampling_engine(run_dir, engine_cfg, policy, dtype, precision, f"eval step {step}") as (engine, acquired):
        log.info("eval step %d: %s", step, acquired.describe())
        if agent.enabled:
            tokenizer = load_tokenizer(model_folder(policy))
            responses = agent_eval_responses(engine, tokenizer, chosen, settings.sampling(seed), agent)
        else:
            responses = generate_responses(engine, chosen, settings, seed)

    rubric_rows = rubrics_by_prompt(rubrics)
    _, scorer = stage_judge(run_dir, judge_model, judge_cfg, dtype, precision, log)
    requests, tokens = getattr(scorer, "requests_made", 0), list(getattr(scorer, "tokens_used", (0, 0)))
    rows = score_responses(
        responses,
        {p["prompt_id"]: p for p in prompt_rows},
        rubric_rows,
        scorer,
        stage_view("reward", reward_cfg),
        judge_cfg["on_failure"],
        judge_cfg["max_response_chars"],
        run=run,
        step=step,
        phase=phase,
        policy=policy,
        pass_rubric_score=settings.pass_rubric_score,
    )
    summary = summarize(rows, settings.pass_k)
    log.info("eval step %d (%s policy), %d held-out prompts:\n%s", step, phase, len(chosen), format_table(summary))
    path = Path(run_dir) / "evals" / f"step={step}" / f"{phase}.parquet"
    used = list(getattr(scorer, "tokens_used", (0, 0)))  # what this evaluation's judgments cost (judge.budget_usd)
    usage = {
        "requests": getattr(scorer, "requests_made", 0) - requests,
        "prompt_tokens": used[0] - tokens[0],
        "completion_tokens": used[1] - tokens[1],
        "step": step,
        "phase": phase,
    }
    return {
        "evals": {"path": str(path), "hash": write_table(EVALS, rows, path)},
        "summary": summary,
        "judge_usage": usage,
    }
