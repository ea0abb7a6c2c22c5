from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from prefect import get_run_logger

from refiner_core.agent.rollout import agent_rollouts
from refiner_core.agent.rollout import rollout_row as agent_rollout_row
from refiner_core.agent.rollout import turn_rows as agent_turn_rows
from refiner_core.config import AgentConfig
from refiner_core.models import load_tokenizer
from refiner_core.runtime import live
from refiner_core.schema import ROLLOUTS, TURNS
from refiner_core.store.storage import write_table
from tasks.sampling import response_columns, rollout_engine, round_folder, sampling_params, step_prompts
from tasks.stage import stage

ROUND_SEED_OFFSET = 1_000_033  # a later sampling round of a step draws other random numbers than its first


@stage("rollout")
def rollout(
    *,
    run_dir: str,
    run: str,
    step: int,
    prompts: dict,
    policy: dict,
    engine_cfg: dict,
    rollout_cfg: dict,
    seed: int,
    dtype: str,
    precision: str,
    round: int = 0,
    round_prompt_ids: list[str] | None = None,
) -> dict:
    """Stage 3: sample G responses for each of the step's prompts -> rollouts/step=N/rollouts.parquet; a later
    sampling round (rollout.dynamic_sampling) samples the fresh prompts it is given -> rollouts/step=N/round=R/."""
    log = get_run_logger()
    chosen, prompt_ids = step_prompts(prompts, step, rollout_cfg, seed, round_prompt_ids)
    # The step's checkpoint folder carries the policy's newest weights to whichever engine samples.
    engine, acquired = rollout_engine(run_dir, engine_cfg, policy, dtype, precision)
    log.info("rollout step %d: %s", step, acquired.describe())
    try:  # an engine that failed mid-sampling (a dead worker) is not kept: the retry builds another
        params = sampling_params(rollout_cfg, seed * 100_003 + step + round * ROUND_SEED_OFFSET)
        agent, turns = AgentConfig(**rollout_cfg["agent"]), None
        if agent.enabled:  # multi-turn tool calling; the tools check their sandbox before anything is sampled
            tokenizer = load_tokenizer(live.model_folder(policy))
            conversations = agent_rollouts(
                engine,
                tokenizer,
                policy["path"],
                prompt_ids,
                chosen,
                params,
                agent,
                budget=rollout_cfg["max_new_tokens"],
                desc=f"rollout step {step}",
            )
            outputs = [(c.prompt_index, c.sample_idx, agent_rollout_row(c, tokenizer)) for c in conversations]
            turns = [
                row
                for c in conversations
                for row in agent_turn_rows(
                    c, {"run": run, "step": step, "prompt_id": chosen[c.prompt_index], "sample_idx": c.sample_idx}
                )
            ]
        else:
            outputs = [
                (g.prompt_index, g.sample_idx, response_columns(g))
                for g in engine.generate(prompt_ids, params, desc=f"rollout step {step}")
            ]
    except BaseException:
        engine.close()
        raise
    live.release(run_dir, engine, acquired)  # kept for the next step, or closed to free memory for the learner
    now = datetime.now(UTC)
    rows = [
        {
            "run": run,
            "step": step,
            "prompt_id": chosen[p],
            "sample_idx": s,
            "policy": policy["path"],
            "policy_hash": policy["hash"],
            "engine": engine.name,
            "temperature": params.temperature,
            "seed": params.seed,
            "prompt_token_ids": prompt_ids[p],
            **response,
            "created_at": now,
            "round": round,
        }
        for p, s, response in outputs
    ]
    path = round_folder(Path(run_dir) / "rollouts" / f"step={step}", round) / "rollouts.parquet"
    stopped = sum(r["finish_reason"] == "stop" for r in rows)
    log.info(
        "rollout step %d round %d: %d prompts x %d samples, %d/%d stopped, mean %.1f tokens",
        step,
        round,
        len(chosen),
        params.n,
        stopped,
        len(rows),
        sum(r["response_tokens"] for r in rows) / max(len(rows), 1),
    )
    manifest = {
        "rollouts": {"path": str(path), "hash": write_table(ROLLOUTS, rows, path)},
        "rows": len(rows),
        "prompt_ids": chosen,
        "weight_sync_seconds": acquired.sync_seconds,
    }
    if turns is not None:
        turns_path = path.with_name("turns.parquet")
        manifest["turns"] = {"path": str(turns_path), "hash": write_table(TURNS, turns, turns_path)}
        tool_rows = [t for t in turns if t["role"] == "tool"]
        log.info(
            "rollout step %d: %d tool calls (%d invalid, %d not ok), mean %.2f tool rounds",
            step,
            len(tool_rows),
            sum(t["failure"] is not None for t in tool_rows),
            sum(t["status"] != "ok" for t in tool_rows),
            sum(r["tool_rounds"] for r in rows) / max(len(rows), 1),
        )
    return manifest
