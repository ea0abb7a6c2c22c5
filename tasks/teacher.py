"""Co-rewarding-II stages: the EMA teacher samples the step's prompts, and follows the policy after each update."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from prefect import get_run_logger

from refiner_core.algo.ema import alpha_at, is_update_step
from refiner_core.schema import TEACHER_ROLLOUTS, TEACHER_UPDATES
from refiner_core.store.storage import write_rows, write_table
from tasks.checkpoints import write_average
from tasks.sampling import response_columns, sampling_engine, sampling_params, step_prompts
from tasks.stage import stage

TEACHER_SEED_OFFSET = 500_009  # the teacher's samples never repeat the policy's, even while their weights agree


@stage("teacher-rollout")
def teacher_rollout(
    *,
    run_dir: str,
    run: str,
    step: int,
    prompts: dict,
    teacher: dict,
    engine_cfg: dict,
    rollout_cfg: dict,
    seed: int,
    dtype: str,
    precision: str,
) -> dict:
    """G responses of the teacher to the same prompts the policy answers at this step -> teacher_rollouts."""
    log = get_run_logger()
    chosen, prompt_ids = step_prompts(prompts, step, rollout_cfg, seed)
    params = sampling_params(rollout_cfg, seed * 100_003 + step + TEACHER_SEED_OFFSET)
    with sampling_engine(run_dir, engine_cfg, teacher, dtype, precision, f"teacher-rollout step {step}") as (
        engine,
        acquired,
    ):
        log.info("teacher-rollout step %d: %s", step, acquired.describe())
        generations = engine.generate(prompt_ids, params, desc=f"teacher rollout step {step}")
    now = datetime.now(UTC)
    rows = [
        {
            "run": run,
            "step": step,
            "prompt_id": chosen[g.prompt_index],
            "sample_idx": g.sample_idx,
            "policy": teacher["path"],
            "policy_hash": teacher["hash"],
            "engine": engine.name,
            "temperature": params.temperature,
            "seed": params.seed,
            "prompt_token_ids": prompt_ids[g.prompt_index],
            **response_columns(g),
            "created_at": now,
        }
        for g in generations
    ]
    path = Path(run_dir) / "teacher_rollouts" / f"step={step}" / "teacher_rollouts.parquet"
    log.info("teacher-rollout step %d: %d prompts x %d samples from %s", step, len(chosen), params.n, teacher["path"])
    return {"teacher_rollouts": write_rows(TEACHER_ROLLOUTS, rows, path)}


@stage("teacher-update")
def teacher_update(*, run_dir: str, run: str, step: int, teacher: dict, policy: dict, teacher_cfg: dict) -> dict:
    """After update `step` (policy = checkpoint step+1): every update_interval-th step, teacher <- alpha * policy +
    (1 - alpha) * teacher into RUN_DIR/teacher/step_NNNN; otherwise the teacher stays. One teacher_updates row."""
    done = step + 1
    alpha = alpha_at(done, teacher_cfg["alpha_start"], teacher_cfg["alpha_end"], teacher_cfg["schedule_steps"])
    updated = is_update_step(done, teacher_cfg["update_interval"])
    if updated:
        teacher = write_average(run_dir, run, "teacher", done, teacher, policy, alpha)
    get_run_logger().info(
        "teacher-update step %d: alpha %.3g, %s",
        step,
        alpha,
        f"teacher now {teacher['path']}" if updated else "not an update step",
    )
    row = {
        "run": run,
        "step": step,
        "alpha": alpha,
        "updated": updated,
        "teacher": teacher["path"],
        "teacher_hash": teacher["hash"],
    }
    path = Path(run_dir) / "teacher_updates" / f"step={step}" / "teacher_updates.parquet"
    return {
        "teacher": teacher,
        "teacher_updates": {"path": str(path), "hash": write_table(TEACHER_UPDATES, [row], path)},
    }
