"""The refiner GRPO pipeline: prepare -> rubrics -> [SFT warm start] -> [rollout -> judge -> update] x steps ->
catalog."""

from __future__ import annotations

import shlex
from dataclasses import asdict
from pathlib import Path

from prefect import flow, get_run_logger

import tasks  # noqa: F401  (sets Prefect's environment before prefect is imported)
from flows.run_folder import holds_run_folder, resolve_run_dir, run_name
from refiner_core.algo.advantages import informative_prompt_ids
from refiner_core.config import (
    EVAL_ROLLOUT_FIELDS,
    FLOW_ONLY_EVAL_FIELDS,
    FLOW_ONLY_GRPO_FIELDS,
    FLOW_ONLY_JUDGE_FIELDS,
    FLOW_ONLY_ROLLOUT_FIELDS,
    LORA_FIELDS,
    ROLLOUT_ENGINE_FIELDS,
    SFT_PREPARE_FIELDS,
    SFT_TRAIN_FIELDS,
    SOURCE_FIELDS,
    drop,
    engine_settings,
    pick,
    recipe_from_dict,
)
from refiner_core.data.quarantine import quarantine_warning
from refiner_core.eval.evaluate import eval_steps, format_table
from refiner_core.judges.cost import check_budget, usage_cost
from refiner_core.preflight import resolve
from refiner_core.publish.ledger import ledger_catalogs
from refiner_core.publish.tracking import close_trackers
from refiner_core.runtime import cluster, live
from refiner_core.runtime.hardware import resolved_recipe
from refiner_core.store.forks import read_fork
from refiner_core.store.storage import read_rows
from tasks.anchors import judge_anchors
from tasks.artifacts import publish_step_artifacts
from tasks.catalog import publish_catalog
from tasks.checkpoints import prune_checkpoints
from tasks.eval import evaluate
from tasks.judge import judge
from tasks.judge_server import stop_judge_servers
from tasks.model import locate_model
from tasks.monitors import act_on_monitors, check_monitors
from tasks.prepare import prepare_data
from tasks.progress import configure as watch_stages
from tasks.rollout import rollout
from tasks.rubrics import ingest_rubrics
from tasks.sampling import refill_prompts
from tasks.sft import prepare_sft, sft_train
from tasks.stage import Submitted, settles_submitted_stages
from tasks.teacher import teacher_rollout, teacher_update
from tasks.update import grpo_update


def repo_path(path: str, fmt: str = "auto") -> str:
    """Local paths resolve from the repo (as preflight checked them); a hub dataset name is passed through."""
    return path if not path or fmt == "hub" else str(resolve(path))


def train_rewards(scores: list[dict]) -> list[dict]:
    """The training reward rows of a step's judged sampling rounds."""
    return [r for scored in scores for r in read_rows(scored["rewards"]["path"]) if r["reward_version"] == "train"]


def step_settings(cfg, conf: dict) -> tuple[bool, dict, dict, int]:
    """What a step's stages read of a recipe besides whole sections: whether an EMA teacher votes the labels, the
    rollout and update settings, and how many sampling rounds a step may take."""
    rollout_cfg = drop(conf["rollout"], FLOW_ONLY_ROLLOUT_FIELDS + ROLLOUT_ENGINE_FIELDS)
    grpo_cfg = drop(conf["grpo"], FLOW_ONLY_GRPO_FIELDS)
    if cfg.rollout.dynamic_sampling:  # groups replaced by more sampling are left out of the update
        grpo_cfg["filter_zero_std_groups"] = True
    max_rounds = 1 + cfg.rollout.dynamic_sampling_max_rounds if cfg.rollout.dynamic_sampling else 1
    return cfg.reward.verifier == "co_rewarding_teacher", rollout_cfg, grpo_cfg, max_rounds


def _flow_run_name() -> str:
    from prefect.runtime import flow_run

    cfg = recipe_from_dict(flow_run.parameters["recipe"])
    return f"{run_name(cfg.run.name, resolve_run_dir(flow_run.parameters['run_dir']))}: steps 0-{cfg.grpo.steps - 1}"


def close_live_engines(_flow, flow_run, _state) -> None:
    """The engines the run kept alive across its steps (run.keep_engines) are closed with it, then Ray is left
    (stopped if the run started it)."""
    live.close_owned(str(flow_run.id))
    cluster.disconnect()


def close_run_trackers(_flow, flow_run, _state) -> None:
    """The run.report_to trackers kept open across steps are closed (TensorBoard's file, the W&B run)."""
    close_trackers(flow_run.parameters["run_dir"])


# A judge server the run started (judge.serve), the engines and trackers it kept end with the run, however it ends.
_ENDS = [stop_judge_servers, close_live_engines, close_run_trackers]
_END_HOOKS = dict(on_completion=_ENDS, on_failure=_ENDS, on_crashed=_ENDS, on_cancellation=_ENDS)


@flow(name="refiner-grpo", log_prints=True, flow_run_name=_flow_run_name, **_END_HOOKS)
@holds_run_folder  # one run per folder; children of a killed earlier run are stopped
@settles_submitted_stages  # a failed step ends the run only once the rollouts sampled ahead have ended
def refiner_pipeline(recipe: dict, run_dir: str) -> dict:
    # model.precision 'auto' resolved on the machine that computes, before any cache key sees it
    cfg, precision_line = resolved_recipe(recipe_from_dict(recipe))
    log = get_run_logger()
    log.info(precision_line)
    watch_stages(cfg.run.stall_seconds, cfg.run.progress_every)  # the watchdog and plain-log progress of stages
    if cfg.run.keep_engines:  # engines live for the run (refiner_core.runtime.live) until the end hooks close them
        from prefect.runtime import flow_run

        live.open_run(run_dir, owner=str(flow_run.id))
    if cfg.run.ray_address:  # Ray places the rollout engines (rollout.num_engines); the end hooks leave it
        log.info(cluster.connect(cfg.run.ray_address))
    retry = {"retries": cfg.run.retries, "retry_delay_seconds": cfg.run.retry_delay_seconds}
    run, own = run_name(cfg.run.name, run_dir), cfg
    # A fork (refiner fork) runs each step before its fork step with the recipe its ancestor ran it with: their
    # stages are the ancestor's (Cached); the step loop switches recipes where they change.
    fork = read_fork(run_dir)
    segments = [(s["until"], recipe_from_dict(s["recipe"])) for s in fork.segments] if fork else []
    recipe_of = lambda step: next((r for until, r in segments if step < until), own)  # noqa: E731
    if segments:
        log.info("fork of %s at step %d: steps 0-%d run as they ran there", fork.parent_dir, fork.at, fork.at - 1)
    cfg = recipe_of(0)
    conf = cfg.to_dict()  # validated and complete: defaults filled in, so cache keys see every setting
    engine_cfg = asdict(engine_settings(cfg))  # the rollout engines: built once, fed each step's weights
    seed, dtype, precision = cfg.run.seed, cfg.model.dtype, cfg.model.precision
    model = lambda spec: locate_model(spec, cfg.model.max_position_embeddings, seed)  # noqa: E731
    base = model(cfg.model.policy)
    judge_model = model(cfg.judge.model) if cfg.judge.model else base
    common = {"run_dir": run_dir}
    judge_cfg = drop(conf["judge"], FLOW_ONLY_JUDGE_FIELDS)  # prices and budget: read here and by the catalog
    judge_price = (cfg.judge.price_per_mtok_in, cfg.judge.price_per_mtok_out)
    data_file = repo_path(cfg.data.path, cfg.data.format)

    ledgers = {  # data.skip_solved_from / data.weights_from: earlier runs' difficulty ledgers, by content
        f"{kind}_ledger_files": ledger_catalogs([repo_path(d) for d in folders])
        for kind, folders in (("skip", cfg.data.skip_solved_from), ("weight", cfg.data.weights_from))
        if folders
    }
    prompts = prepare_data.with_options(**retry)(
        **common, run=run, data_file=data_file, data=conf["data"], seed=seed, policy=base, **ledgers
    )
    rubrics = ingest_rubrics.with_options(**retry)(
        **common,
        run=run,
        data_file=data_file,
        data=pick(conf["data"], SOURCE_FIELDS),
        rubric_file=repo_path(cfg.rubrics.path),
        rubric_cfg=conf["rubrics"],
        static_rubrics_file=repo_path(cfg.rubrics.static_rubrics),
        prompts=prompts,
    )
    manifests = [prompts, rubrics]
    grpo_prompts = {**prompts, "train_ids": rubrics["train_ids"]}  # prompts left without rubrics are not trained

    evaluations: list[dict] = []
    eval_at = eval_steps(cfg.grpo.steps, cfg.eval.every)

    def evaluate_policy(policy: dict, step: int, phase: str) -> None:
        evaluations.append(
            evaluate.with_options(**retry)(
                **common,
                run=run,
                step=step,
                phase=phase,
                prompts=prompts,
                rubrics=rubrics,
                policy=policy,
                judge_model=judge_model,
                eval_cfg=drop(conf["eval"], FLOW_ONLY_EVAL_FIELDS),
                engine_cfg=engine_cfg,
                rollout_cfg=pick(conf["rollout"], EVAL_ROLLOUT_FIELDS),
                judge_cfg=judge_cfg,
                reward_cfg=conf["reward"],
                seed=seed,
                dtype=dtype,
                precision=precision,
            )
        )
        manifests.append(evaluations[-1])

    if eval_at and cfg.sft.enabled:  # base -> SFT -> GRPO in one table
        evaluate_policy(base, 0, "base")
    start = base
    if cfg.sft.enabled:  # warm start: GRPO policy and (default) KL reference begin at the SFT checkpoint
        sft_file = repo_path(cfg.sft.path, cfg.sft.format) if cfg.sft.path else data_file
        sft_data = prepare_sft.with_options(**retry)(
            **common,
            run=run,
            sft_file=sft_file,
            sft_cfg=pick(conf["sft"], SFT_PREPARE_FIELDS),
            seed=seed,
            policy=base,
            prompts=prompts,
        )
        warm = sft_train.with_options(**retry)(
            **common,
            run=run,
            sft_data=sft_data,
            policy=base,
            sft_cfg=pick(conf["sft"], SFT_TRAIN_FIELDS),
            seed=seed,
            dtype=dtype,
            precision=precision,
        )
        start = warm["policy"]
        manifests += [sft_data, warm]
        publish_catalog(**common, manifests=manifests, judge_price=judge_price)
    reference = model(cfg.model.reference) if cfg.model.reference else start
    if eval_at:
        evaluate_policy(start, 0, "sft" if cfg.sft.enabled else "base")

    policy = teacher = start  # the EMA teacher (Co-rewarding-II) starts as the starting policy
    teaching, rollout_cfg, grpo_cfg, max_rounds = step_settings(cfg, conf)
    ahead = cfg.grpo.async_steps
    if ahead and cfg.rollout.engine == "hf":
        log.warning(
            "grpo.async_steps %d with rollout.engine hf: the rollouts share this process and its cores "
            "with the learner, so sampling ahead gains little beyond overlapping a remote judge",
            ahead,
        )
    policies = [start]  # policies[n]: the policy after n updates
    step_costs: list[float] = []  # judge dollars of each step so far (judge.budget_usd)
    sampled_ahead: dict[int, Submitted] = {}

    def sample_ahead(step: int) -> None:
        """grpo.async_steps: the rollout of `step` runs beside the steps before it, with the policy after
        max(step - K, 0) updates; one rollout at a time, in step order, so one engine serves them all."""
        earlier = [sampled_ahead[step - 1]] if step - 1 in sampled_ahead else []
        sampled_ahead[step] = rollout.with_options(**retry).submit(
            wait_for=earlier,
            **common,
            run=run,
            step=step,
            prompts=grpo_prompts,
            policy=policies[max(step - ahead, 0)],
            engine_cfg=engine_cfg,
            rollout_cfg=rollout_cfg,
            seed=seed,
            dtype=dtype,
            precision=precision,
            round=0,
            round_prompt_ids=None,
        )

    for step in range(min(ahead + 1, cfg.grpo.steps) if ahead else 0):
        sample_ahead(step)
    for step in range(own.grpo.steps):
        if recipe_of(step) is not cfg:  # a fork's next segment (its own settings from its fork step on)
            cfg = recipe_of(step)
            conf = cfg.to_dict()
            engine_cfg = asdict(engine_settings(cfg))
            judge_cfg = drop(conf["judge"], FLOW_ONLY_JUDGE_FIELDS)
            teaching, rollout_cfg, grpo_cfg, max_rounds = step_settings(cfg, conf)
            eval_at = eval_steps(cfg.grpo.steps, cfg.eval.every)
            judge_model = model(cfg.judge.model) if cfg.judge.model else base
            reference = model(cfg.model.reference) if cfg.model.reference else start
        # run.save_every: steps in between keep their weights in the live learner; the EMA teacher and an eval
        # read the policy's checkpoint, and the last step's is the run's result
        save = teaching or (step + 1) % cfg.run.save_every == 0 or step + 1 in (cfg.grpo.steps, *eval_at)
        taught = (
            teacher_rollout.with_options(**retry)(
                **common,
                run=run,
                step=step,
                prompts=grpo_prompts,
                teacher=teacher,
                engine_cfg=engine_cfg,
                rollout_cfg=rollout_cfg,
                seed=seed,
                dtype=dtype,
                precision=precision,
            )
            if teaching
            else None
        )
        spent = [m["judge_usage"] for m in manifests if "judge_usage" in m]  # every judging stage so far
        check_budget(cfg.judge, spent, step_costs, step)  # stops before the step that would exceed it
        rolled, scored = [], []  # one manifest per sampling round
        for sampling_round in range(max_rounds):
            fresh = None
            if sampling_round:  # rollout.dynamic_sampling: fresh prompts in place of the all-equal groups
                needed = len(rolled[0]["prompt_ids"]) - len(informative_prompt_ids(train_rewards(scored)))
                used = [p for manifest in rolled for p in manifest["prompt_ids"]]
                fresh = refill_prompts(grpo_prompts, step, sampling_round, used, needed, seed) if needed > 0 else []
                if not fresh:  # the step is full, or the train split has no unused prompt left
                    break
            rolled.append(
                sampled_ahead[step].result()
                if ahead
                else rollout.with_options(**retry)(
                    **common,
                    run=run,
                    step=step,
                    prompts=grpo_prompts,
                    policy=policy,
                    engine_cfg=engine_cfg,
                    rollout_cfg=rollout_cfg,
                    seed=seed,
                    dtype=dtype,
                    precision=precision,
                    round=sampling_round,
                    round_prompt_ids=fresh,
                )
            )
            scored.append(
                judge.with_options(**retry)(
                    **common,
                    step=step,
                    rollouts=rolled[-1],
                    prompts=prompts,
                    rubrics=rubrics,
                    judge_model=judge_model,
                    judge_cfg=judge_cfg,
                    reward_cfg=conf["reward"],
                    max_new_tokens=cfg.rollout.max_new_tokens,
                    dtype=dtype,
                    precision=precision,
                    round=sampling_round,
                    **({"teacher_rollouts": taught} if teaching else {}),
                )
            )
        if step == 0:  # judge.anchor_every re-judges some of step 0's rollouts
            anchors = {"rollouts": rolled[0], "scores": scored[0], "step": 0}
        if cfg.judge.anchor_every and step % cfg.judge.anchor_every == 0:
            manifests.append(
                judge_anchors.with_options(**retry)(
                    **common,
                    run=run,
                    step=step,
                    anchors={**anchors, "count": cfg.judge.anchor_rollouts, "seed": seed},
                    prompts=prompts,
                    rubrics=rubrics,
                    judge_model=judge_model,
                    judge_cfg=judge_cfg,
                    dtype=dtype,
                    precision=precision,
                )
            )
        updated = grpo_update.with_options(**retry)(
            **common,
            run=run,
            step=step,
            rollouts=rolled,
            scores=scored,
            policy=policy,
            reference=reference,
            grpo_cfg=grpo_cfg,
            lora=pick(conf["model"], LORA_FIELDS),
            temperature=cfg.rollout.temperature,
            dtype=dtype,
            precision=precision,
            save=save,
            policy_lag=min(step, ahead),
        )
        policy = updated["policy"]
        policies.append(policy)
        step_costs.append(sum(usage_cost(m["judge_usage"], cfg.judge) for m in scored))
        if ahead and step + 1 + ahead < cfg.grpo.steps:
            sample_ahead(step + 1 + ahead)
        if teaching:
            moved = teacher_update.with_options(**retry)(
                **common, run=run, step=step, teacher=teacher, policy=policy, teacher_cfg=conf["teacher"]
            )
            teacher = moved["teacher"]
            manifests += [taught, moved]
        if step + 1 in eval_at:
            evaluate_policy(policy, step + 1, "grpo")
        if save:  # the newest written checkpoint keeps its optimizer state: a resume continues from it
            prune_checkpoints(
                **common, newest_step=step + 1, keep_last=own.run.keep_last, keep_every=own.run.keep_every
            )
        manifests += [*rolled, *scored, updated]
        publish_catalog(**common, manifests=manifests, judge_price=judge_price)  # inspectable after every step
        publish_step_artifacts(run_dir, run, step)
        events = check_monitors(**common, run=run, step=step, monitors_cfg=conf["monitors"])
        act_on_monitors(run_dir, step, events, cfg.monitors.pause_timeout_seconds)  # pause or fail, as configured
        log.info(
            "step %d done: %s",
            step,
            f"checkpoint {policy['path']}"
            if save
            else f"weights in the live learner (run.save_every {cfg.run.save_every})",
        )

    summary = [row for evaluated in evaluations for row in evaluated["summary"]]
    if summary:
        query = shlex.join(["refiner", "sql", run_dir, "SELECT * FROM evals"])
        log.info("held-out evaluation (%s):\n%s", query, format_table(summary))
    if quarantined := quarantine_warning(run_dir):
        log.warning(quarantined)
    return {
        "run_dir": run_dir,
        "catalog": str(Path(run_dir) / "catalog.duckdb"),
        "policy": policy["path"],
        "evals": summary,
    }
