"""The refiner GRPO pipeline: prepare -> rubrics -> [rollout -> judge -> update] x steps -> catalog."""

from __future__ import annotations

from pathlib import Path

import tasks  # noqa: F401  (sets Prefect's environment before prefect is imported)
from prefect import flow, get_run_logger

from refiner_core import REPO_ROOT
from refiner_core.config import recipe_from_dict
from tasks.catalog import publish_catalog
from tasks.judge import judge
from tasks.model import locate_model
from tasks.prepare import prepare_data
from tasks.rollout import rollout
from tasks.rubrics import ingest_rubrics
from tasks.update import grpo_update


def repo_path(path: str) -> str:
    p = Path(path)
    return str(p if p.is_absolute() else (REPO_ROOT / p).resolve())


@flow(name="refiner-grpo", log_prints=True)
def refiner_pipeline(recipe: dict, run_dir: str) -> dict:
    cfg = recipe_from_dict(recipe)
    conf = cfg.to_dict()  # validated and complete: defaults filled in, so cache keys see every setting
    log = get_run_logger()
    retry = {"retries": cfg.run.retries, "retry_delay_seconds": cfg.run.retry_delay_seconds}
    run, seed, dtype = cfg.run.name, cfg.run.seed, cfg.model.dtype
    model = lambda spec: locate_model(spec, cfg.model.max_position_embeddings, seed)  # noqa: E731
    base = model(cfg.model.policy)
    reference = model(cfg.model.reference) if cfg.model.reference else base
    judge_model = model(cfg.judge.model) if cfg.judge.model else base
    common = {"run_dir": run_dir}

    prompts = prepare_data.with_options(**retry)(
        **common, run=run, data_file=repo_path(cfg.data.path), data=conf["data"], seed=seed, policy=base)
    rubrics = ingest_rubrics.with_options(**retry)(
        **common, run=run, data_file=repo_path(cfg.data.path), static_rubrics_file=repo_path(cfg.rubrics.static_rubrics),
        prompts=prompts, instance_rubrics_only=cfg.rubrics.instance_rubrics_only)
    manifests = [prompts, rubrics]

    policy = base
    for step in range(cfg.grpo.steps):
        rolled = rollout.with_options(**retry)(
            **common, run=run, step=step, prompts=prompts, policy=policy, rollout_cfg=conf["rollout"],
            seed=seed, dtype=dtype)
        scored = judge.with_options(**retry)(
            **common, step=step, rollouts=rolled, prompts=prompts, rubrics=rubrics, judge_model=judge_model,
            judge_cfg=conf["judge"], reward_cfg=conf["reward"], dtype=dtype)
        updated = grpo_update.with_options(**retry)(
            **common, run=run, step=step, rollouts=rolled, scores=scored, policy=policy, reference=reference,
            grpo_cfg=conf["grpo"], temperature=cfg.rollout.temperature, dtype=dtype, seed=seed)
        policy = updated["policy"]
        manifests += [rolled, scored, updated]
        publish_catalog(**common, manifests=manifests)  # inspectable after every step
        log.info("step %d done: checkpoint %s", step, policy["path"])

    return {"run_dir": run_dir, "catalog": str(Path(run_dir) / "catalog.duckdb"), "policy": policy["path"]}
