from __future__ import annotations

import shutil
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path

from prefect import get_run_logger

from refiner_core.agent.rollout import agent_rollouts
from refiner_core.agent.rollout import rollout_row as agent_rollout_row
from refiner_core.agent.rollout import turn_rows as agent_turn_rows
from refiner_core.models import load_tokenizer
from refiner_core.rollout.base import SamplingParams, part_ranges
from refiner_core.runtime.unsaved_weights import model_folder
from refiner_core.schema import ROLLOUTS, TURNS
from refiner_core.stage_settings import stage_view
from refiner_core.store.faults import stage_fault
from refiner_core.store.storage import json_hash, read_rows, write_rows, write_table
from tasks.sampling import response_columns, round_folder, sampling_engine, sampling_params, step_prompts
from tasks.stage import CODE_VERSION, stage

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
    path = round_folder(Path(run_dir) / "rollouts" / f"step={step}", round) / "rollouts.parquet"

    def to_rows(outputs: list[tuple[int, int, dict]]) -> list[dict]:
        """rollouts rows of (prompt index in the step, sample index, response columns)."""
        now = datetime.now(UTC)
        return [
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

    params = sampling_params(rollout_cfg, seed * 100_003 + step + round * ROUND_SEED_OFFSET)
    agent, turns = stage_view("rollout", rollout_cfg).agent, None

    # The step's checkpoint folder carries the policy's newest weights to whichever engine samples.
    with sampling_engine(run_dir, engine_cfg, policy, dtype, precision, f"rollout step {step}") as (engine, acquired):
        log.info("rollout step %d: %s", step, acquired.describe())
        if acquired.how in ("built", "fresh") and getattr(engine, "placement", ""):  # Ray's engines: where each went
            log.info("rollout step %d: %s", step, engine.placement)
        if agent.enabled:  # multi-turn tool calling; the tools check their sandbox before anything is sampled
            tokenizer = load_tokenizer(model_folder(policy))
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
            rows = sample_in_parts(
                engine,
                prompt_ids,
                params,
                per_part=rollout_cfg["groups_per_part"] or max(1, engine_cfg["batch_size"] // params.n),
                folder=parts_folder(  # every input its rows hold: run name, policy path, prompt tokens
                    path.parent,
                    [CODE_VERSION, run, policy, chosen, prompt_ids, asdict(params), engine_cfg, dtype, precision],
                ),
                to_rows=to_rows,
                step=step,
                markers=Path(run_dir) / ".faults",
                log=log,
            )
    if turns is not None:
        rows = to_rows(outputs)
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
    written = write_rows(ROLLOUTS, rows, path)
    for stale in path.parent.glob(f"{PARTS_PREFIX}*"):  # every part is in rollouts.parquet now
        shutil.rmtree(stale, ignore_errors=True)
    manifest = {
        "rollouts": written,
        "rows": len(rows),
        "prompt_ids": chosen,
        "weight_sync_seconds": acquired.sync_seconds,
    }
    if turns is not None:
        turns_path = path.with_name("turns.parquet")
        manifest["turns"] = write_rows(TURNS, turns, turns_path)
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


PARTS_PREFIX = ".parts-"


def parts_folder(step_folder: Path, inputs: list) -> Path:
    """Where a rollout's parts go: named by a hash of what decides their rows (code, run, policy, prompts, sampling
    and engine settings), so that parts of other inputs are never reused; those are removed."""
    folder = step_folder / f"{PARTS_PREFIX}{json_hash(inputs)[:16]}"
    for other in step_folder.glob(f"{PARTS_PREFIX}*"):
        if other != folder:
            shutil.rmtree(other, ignore_errors=True)
    return folder


def sample_in_parts(
    engine,
    prompt_ids: list[list[int]],
    params: SamplingParams,
    *,
    per_part: int,
    folder: Path,
    to_rows,
    step: int,
    markers: Path,
    log,
) -> list[dict]:
    """The step's rollouts rows, sampled `per_part` prompts at a time, each part written to `folder` as it is done;
    parts already there (an earlier attempt was killed after writing them) are read, not sampled again. A part is
    seeded by its place in the step (prompt_offset), so the samples do not depend on which parts were reused. A part
    is named by its prompts' range (part-START-END): an attempt with another `per_part` reuses only parts of the
    same range, never one that holds other groups."""
    ranges = part_ranges(len(prompt_ids), per_part)
    rows, reused = [], []
    for k, (start, end) in enumerate(ranges):
        part = folder / f"part-{start:04d}-{end:04d}.parquet"
        if part.is_file():
            rows += read_rows(part)
            reused.append(k)
            continue
        desc = f"rollout step {step}" + (f" part {k + 1}/{len(ranges)}" if len(ranges) > 1 else "")
        generations = engine.generate(prompt_ids[start:end], replace(params, prompt_offset=start), desc=desc)
        part_rows = to_rows([(start + g.prompt_index, g.sample_idx, response_columns(g)) for g in generations])
        write_table(ROLLOUTS, part_rows, part)
        stage_fault("rollout", step, markers, phase=f"part{k}")
        rows += part_rows
    if reused:
        log.info(
            "rollout step %d: %d of %d parts (%d of %d groups) were written by an earlier attempt and are kept; "
            "sampled the other %d",
            step,
            len(reused),
            len(ranges),
            sum(ranges[k][1] - ranges[k][0] for k in reused),
            len(prompt_ids),
            len(ranges) - len(reused),
        )
    return rows
