"""What the sampling stages share (rollout, the EMA teacher's rollout, eval): a step's prompts, the engine holding a
policy's weights (the run's live one, else one built from the checkpoint), sampling settings and the rollout
columns of a generation."""

from __future__ import annotations

import contextlib
from pathlib import Path

from refiner_core.config import EngineSettings
from refiner_core.data.schedule import refill_prompt_ids, step_prompt_ids, weighted_step_prompt_ids
from refiner_core.rollout.base import SamplingParams, make_engine
from refiner_core.rollout.sharded import ShardedEngine
from refiner_core.runtime import live_engines
from refiner_core.runtime.unsaved_weights import model_folder
from refiner_core.store.checkpoints import require_checkpoint
from refiner_core.store.storage import read_rows


def step_prompts(
    prompts: dict, step: int, rollout_cfg: dict, seed: int, chosen: list[str] | None = None
) -> tuple[list[str], list[list[int]]]:
    """The step's prompt IDs (unless `chosen` names them) and their token IDs: a question's twin view joins it in
    the same step, and every sampler of the step (the policy, an EMA teacher) answers the same ones."""
    by_id = {p["prompt_id"]: p for p in read_rows(prompts["prompts"]["path"])}
    train_ids = prompts["train_ids"]
    if chosen is None and prompts.get("train_weights"):  # data.weights_from: drawn by the difficulty ledger
        chosen = weighted_step_prompt_ids(
            train_ids,
            prompts["train_weights"],
            step,
            min(rollout_cfg["prompts_per_step"], len(train_ids)),
            seed,
            twin_of=_twins(by_id),
        )
    if chosen is None:
        chosen = step_prompt_ids(
            train_ids, step, min(rollout_cfg["prompts_per_step"], len(train_ids)), seed, twin_of=_twins(by_id)
        )
    return chosen, [by_id[p]["prompt_token_ids"] for p in chosen]


def refill_prompts(prompts: dict, step: int, round: int, used: list[str], count: int, seed: int) -> list[str]:
    """The fresh train prompts sampling round `round` of a step samples (refill_prompt_ids), drawn by the difficulty
    ledger's weights where the step's first round was (data.weights_from)."""
    by_id = {p["prompt_id"]: p for p in read_rows(prompts["prompts"]["path"])}
    return refill_prompt_ids(
        prompts["train_ids"], used, count, step, round, seed, _twins(by_id), prompts.get("train_weights") or None
    )


def _twins(prompt_rows: dict[str, dict]) -> dict[str, str]:
    return {p: row["twin_id"] for p, row in prompt_rows.items() if row.get("twin_id")}


def round_folder(step_folder: Path, round: int) -> Path:
    """Where a sampling round's files go: the step's folder for its first round, step=N/round=R/ for later ones."""
    return step_folder / f"round={round}" if round else step_folder


@contextlib.contextmanager
def sampling_engine(run_dir: str, engine_cfg: dict, policy: dict, dtype: str, precision: str, needed_by: str):
    """(engine, how it was got) holding `policy`'s weights for the block: the run's live engine
    (refiner_core.runtime.live_engines), else one built from the checkpoint (engine_cfg: an EngineSettings as a
    dict). Handed back after the block (kept for the run's next stage, asleep or closed: `live_engines.release`);
    closed where the block fails, since an engine that failed mid-sampling (a dead worker) is not kept and one
    kept by nobody would hold its GPU memory: the retry builds another."""
    require_checkpoint(model_folder(policy), needed_by)  # `needed_by`: who samples, for the error
    engine = EngineSettings(**engine_cfg)

    def build(path: str):
        if engine.num_engines > 1:  # Ray actors (run.ray_address; preflight checks it is set)
            return ShardedEngine(path, engine, dtype, precision, markers=str(Path(run_dir) / ".faults"))
        return make_engine(path, engine, dtype, precision)

    key = live_engines.engine_key(engine, model_folder(policy), dtype, precision)
    held, acquired = live_engines.rollout_engine(run_dir, key, policy, build, one_at_a_time=engine.num_engines > 1)
    try:
        yield held, acquired
    except BaseException:
        live_engines.discard(run_dir, held, acquired)
        raise
    live_engines.release(run_dir, held, acquired)  # closes it where keeping it fails (a worker that died since)


def sampling_params(rollout_cfg: dict, seed: int) -> SamplingParams:
    return SamplingParams(
        n=rollout_cfg["samples_per_prompt"],
        temperature=rollout_cfg["temperature"],
        top_p=rollout_cfg["top_p"],
        top_k=rollout_cfg["top_k"],
        min_p=rollout_cfg["min_p"],
        repetition_penalty=rollout_cfg["repetition_penalty"],
        max_new_tokens=rollout_cfg["max_new_tokens"],
        stop=tuple(rollout_cfg["stop"]),
        seed=seed,
    )


def response_columns(g) -> dict:
    """The rollout columns of a single-turn Generation (every token sampled, no tool round)."""
    return {
        "response_token_ids": g.token_ids,
        "response_logprobs": g.logprobs,
        "response_text": g.text,
        "response_mask": [True] * len(g.token_ids),
        "response_tokens": len(g.token_ids),
        "finish_reason": g.finish_reason,
        "tool_rounds": 0,
        "final_text": g.text,
    }
