from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from prefect import get_run_logger

from refiner_core.data import step_prompt_ids
from refiner_core.rollout.base import SamplingParams, make_engine
from refiner_core.schema import ROLLOUTS
from refiner_core.storage import read_rows, write_table
from tasks.stage import stage


@stage("rollout")
def rollout(*, run_dir: str, run: str, step: int, prompts: dict, policy: dict, rollout_cfg: dict, seed: int,
            dtype: str, precision: str) -> dict:
    """Stage 3: sample G responses for each of the step's prompts -> rollouts/step=N/rollouts.parquet."""
    log = get_run_logger()
    by_id = {p["prompt_id"]: p for p in read_rows(prompts["prompts"]["path"])}
    train_ids = prompts["train_ids"]
    per_step = min(rollout_cfg["prompts_per_step"], len(train_ids))
    chosen = step_prompt_ids(train_ids, step, per_step, seed)
    # The step's checkpoint folder carries the policy's newest weights to whichever engine samples.
    engine = make_engine(rollout_cfg["engine"], policy["path"], rollout_cfg["batch_size"], dtype, precision,
                         tensor_parallel_size=rollout_cfg["tensor_parallel_size"],
                         gpu_memory_utilization=rollout_cfg["gpu_memory_utilization"])
    params = SamplingParams(
        n=rollout_cfg["samples_per_prompt"], temperature=rollout_cfg["temperature"], top_p=rollout_cfg["top_p"],
        max_new_tokens=rollout_cfg["max_new_tokens"], stop=tuple(rollout_cfg["stop"]), seed=seed * 100_003 + step,
    )
    generations = engine.generate([by_id[p]["prompt_token_ids"] for p in chosen], params, desc=f"rollout step {step}")
    engine.close()  # free the engine's memory before the judge and learner stages
    now = datetime.now(timezone.utc)
    rows = [{
        "run": run, "step": step, "prompt_id": chosen[g.prompt_index], "sample_idx": g.sample_idx,
        "policy": policy["path"], "policy_hash": policy["hash"], "engine": engine.name,
        "temperature": params.temperature, "seed": params.seed,
        "prompt_token_ids": by_id[chosen[g.prompt_index]]["prompt_token_ids"],
        "response_token_ids": g.token_ids, "response_logprobs": g.logprobs, "response_text": g.text,
        "response_tokens": len(g.token_ids), "finish_reason": g.finish_reason, "created_at": now,
    } for g in generations]
    path = Path(run_dir) / "rollouts" / f"step={step}" / "rollouts.parquet"
    stopped = sum(r["finish_reason"] == "stop" for r in rows)
    log.info("rollout step %d: %d prompts x %d samples, %d/%d stopped, mean %.1f tokens", step, len(chosen),
             params.n, stopped, len(rows), sum(r["response_tokens"] for r in rows) / max(len(rows), 1))
    return {"rollouts": {"path": str(path), "hash": write_table(ROLLOUTS, rows, path)}, "rows": len(rows)}
