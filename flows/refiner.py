"""The refiner GRPO pipeline: prepare -> [SFT warm start] -> for each step: rollout -> judge -> update -> eval ->
publish. `refiner_pipeline` is the whole tour; each leg is a function over the run's context and its step state."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from prefect import flow, get_run_logger

import tasks  # noqa: F401  (sets Prefect's environment before prefect is imported)
from flows.run_folder import holds_run_folder, remove_run_temporary_files, resolve_run_dir, run_name
from refiner_core.algo.advantages import informative_prompt_ids
from refiner_core.algo.ema import is_update_step
from refiner_core.config import ConfigError, RecipeConfig, recipe_from_dict
from refiner_core.data.quarantine import quarantine_warning
from refiner_core.eval.evaluate import eval_steps, format_table
from refiner_core.judges.cost import check_budget, likely_step_cost, usage_cost
from refiner_core.preflight import recipe_warnings, resolve
from refiner_core.publish.ledger import ledger_catalogs
from refiner_core.publish.tracking import close_trackers
from refiner_core.reward.compose import reward_parts
from refiner_core.runtime import cluster, live
from refiner_core.runtime.hardware import resolved_recipe
from refiner_core.stage_settings import StageSettings, stage_settings
from refiner_core.store.checkpoints import checkpoints_to_keep
from refiner_core.store.forks import read_fork, recipe_leaves_fork
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
from tasks.stage import Stage, Submitted, settles_submitted_stages
from tasks.teacher import teacher_rollout, teacher_update
from tasks.update import grpo_update, sync_reference


def _flow_run_name() -> str:
    from prefect.runtime import flow_run

    cfg = recipe_from_dict(flow_run.parameters["recipe"])
    return f"{run_name(cfg.run.name, resolve_run_dir(flow_run.parameters['run_dir']))}: steps 0-{cfg.grpo.steps - 1}"


def close_live_engines(_flow, flow_run, _state) -> None:
    """The engines the run kept alive across its steps (run.keep_engines) are closed with it, then Ray is left
    (stopped if the run started it)."""
    try:
        live.close_owned(str(flow_run.id))
    finally:  # an engine that failed to close leaves Ray to be stopped all the same
        cluster.disconnect()


def close_run_trackers(_flow, flow_run, _state) -> None:
    """The run.report_to trackers kept open across steps are closed (TensorBoard's file, the W&B run)."""
    close_trackers(flow_run.parameters["run_dir"])


# A judge server the run started (judge.openai.serve), the engines and trackers it kept end with the run, however it
# ends; then its temporary folders go.
_ENDS = [stop_judge_servers, close_live_engines, close_run_trackers, remove_run_temporary_files]
_END_HOOKS = dict(on_completion=_ENDS, on_failure=_ENDS, on_crashed=_ENDS, on_cancellation=_ENDS)


@flow(name="refiner-grpo", log_prints=True, flow_run_name=_flow_run_name, **_END_HOOKS)
@holds_run_folder  # one run per folder; children of a killed earlier run are stopped
@settles_submitted_stages  # a failed step ends the run only once the rollouts sampled ahead have ended
def refiner_pipeline(recipe: dict, run_dir: str) -> dict:
    run = open_run(recipe, run_dir)
    prepare(run)
    state = warm_start(run)
    for step in range(run.own.grpo.steps):
        run.enter_segment(step)  # a fork runs the steps before its fork step with its ancestors' recipes
        rolled, scored = rollout_and_judge(run, state, step)
        updated = update(run, state, step, rolled, scored)
        if step + 1 in run.eval_at:
            evaluate_policy(run, state.policy, step + 1, "grpo")
        publish_step(run, state, step, [*rolled, *scored, updated])
    return finish(run, state)


@dataclass
class RunContext:
    """What every stage call of one run shares. A fork (refiner fork) runs each step before its fork step with the
    recipe its ancestor ran it with, so those stages are the ancestor's (Cached): `cfg` and what derives from it
    are the current segment's; `own` is the run's own recipe (how many steps, checkpoint retention)."""

    dir: str
    name: str
    own: RecipeConfig
    segments: list[tuple[int, RecipeConfig]]  # (first step after it, recipe) of each ancestor's segment
    retry: dict
    cfg: RecipeConfig | None = None
    inputs: StageSettings | None = None  # what each stage reads of cfg
    base: dict | None = None  # the starting model's manifest
    judge_model: dict | None = None
    reference: dict | None = None  # the KL reference (model.reference, else the starting policy)
    start: dict | None = None  # the policy GRPO starts from (the SFT checkpoint with sft.enabled)
    prompts: dict | None = None
    rubrics: dict | None = None
    eval_at: tuple[int, ...] = ()
    manifests: list[dict] = field(default_factory=list)  # every stage's so far, for the catalog
    evaluations: list[dict] = field(default_factory=list)

    @property
    def teaching(self) -> bool:
        """An EMA teacher votes the labels (Co-rewarding-II)."""
        return self.cfg.reward.verifier == "co_rewarding_teacher"

    @property
    def max_rounds(self) -> int:
        """Sampling rounds a step may take (rollout.dynamic_sampling)."""
        return 1 + self.cfg.rollout.dynamic_sampling_max_rounds if self.cfg.rollout.dynamic_sampling else 1

    @property
    def grpo_prompts(self) -> dict:
        return {**self.prompts, "train_ids": self.rubrics["train_ids"]}  # prompts without rubrics are not trained

    def stage(self, task: Stage) -> Stage:
        return task.with_options(**self.retry)

    @property
    def data_file(self) -> str:
        return repo_path(self.cfg.data.path, self.cfg.data.format)

    def model(self, spec: str) -> dict:
        return locate_model(spec, self.cfg.model.max_position_embeddings, self.cfg.run.seed)

    def locate_reference(self) -> None:
        """The KL reference: model.reference, else the starting policy (once it is known)."""
        self.reference = self.model(self.cfg.model.reference) if self.cfg.model.reference else self.start

    def computes(self) -> dict:
        """The settings every computing stage takes: the run's seed, dtype and precision."""
        return {"seed": self.cfg.run.seed, "dtype": self.cfg.model.dtype, "precision": self.cfg.model.precision}

    def recipe_of(self, step: int) -> RecipeConfig:
        return next((recipe for until, recipe in self.segments if step < until), self.own)

    def use(self, cfg: RecipeConfig) -> None:
        """Make `cfg` the recipe the stages read from now on."""
        self.cfg, self.inputs = cfg, stage_settings(cfg)
        self.eval_at = eval_steps(cfg.grpo.steps, cfg.eval.every)
        self.judge_model = self.model(cfg.judge.model) if cfg.judge.model else self.base
        if self.start is not None:
            self.locate_reference()

    def enter_segment(self, step: int) -> None:
        if self.recipe_of(step) is not self.cfg:  # a fork's next segment (its own settings from its fork step on)
            self.use(self.recipe_of(step))


@dataclass
class StepState:
    """What the steps hand on: the policy (and EMA teacher), every policy so far (policies[n]: after n updates),
    each step's judge usages, the rollouts sampled ahead (grpo.async_steps) and the judge's anchors."""

    policy: dict
    teacher: dict
    policies: list[dict]
    step_usages: list[list[dict]] = field(default_factory=list)  # priced at the check, at the run's own prices
    sampled_ahead: dict[int, Submitted] = field(default_factory=dict)
    anchors: dict | None = None
    taught: dict | None = None  # this step's teacher rollouts
    reference: dict | None = None  # the KL reference after its last move (grpo.ref_sync_every); None: run.reference
    entropy_control: dict | None = None  # grpo.adaptive_entropy's state after the last update
    kl_control: dict | None = None  # grpo.kl_reward_target's state after the last update


def open_run(recipe: dict, run_dir: str) -> RunContext:
    # model.precision 'auto' resolved on the machine that computes, before any cache key sees it
    own, precision_line = resolved_recipe(recipe_from_dict(recipe))
    log = get_run_logger()
    log.info(precision_line)
    for line in recipe_warnings(own):
        log.warning(line)
    watch_stages(own.run.stall_seconds, own.run.progress_every)  # the watchdog and plain-log progress of stages
    if own.run.keep_engines:  # engines live for the run (refiner_core.runtime.live) until the end hooks close them
        from prefect.runtime import flow_run

        live.open_run(run_dir, owner=str(flow_run.id))
    if own.run.ray_address:  # Ray places the rollout engines (rollout.num_engines); the end hooks leave it
        log.info(cluster.connect(own.run.ray_address))
    fork = read_fork(run_dir)
    if fork is not None and (refused := recipe_leaves_fork(fork, own.to_dict())):
        raise ConfigError(refused)
    segments = [(s["until"], recipe_from_dict(s["recipe"])) for s in fork.segments] if fork else []
    if segments:
        log.info("fork of %s at step %d: steps 0-%d run as they ran there", fork.parent_dir, fork.at, fork.at - 1)
    retry = {"retries": own.run.retries, "retry_delay_seconds": own.run.retry_delay_seconds}
    run = RunContext(run_dir, run_name(own.run.name, run_dir), own, segments, retry)
    run.cfg = run.recipe_of(0)
    run.base = run.model(run.cfg.model.policy)
    run.use(run.cfg)
    if run.cfg.rollout.dynamic_sampling and not run.cfg.grpo.filter_zero_std_groups:
        log.info("rollout.dynamic_sampling: groups whose rewards are all equal are left out of the update")
    return run


def repo_path(path: str, fmt: str = "auto") -> str:
    """Local paths resolve from the repo (as preflight checked them); a hub dataset name is passed through."""
    return path if not path or fmt == "hub" else str(resolve(path))


def prepare(run: RunContext) -> None:
    """Prompts (data) and their rubrics."""
    cfg, inputs = run.cfg, run.inputs
    data_file = run.data_file
    ledgers = {  # data.skip_solved_from / data.weights_from: earlier runs' difficulty ledgers, by content
        f"{kind}_ledger_files": ledger_catalogs([repo_path(d) for d in folders])
        for kind, folders in (("skip", cfg.data.skip_solved_from), ("weight", cfg.data.weights_from))
        if folders
    }
    run.prompts = run.stage(prepare_data)(
        run_dir=run.dir,
        run=run.name,
        data_file=data_file,
        data=inputs.data,
        seed=cfg.run.seed,
        policy=run.base,
        **ledgers,
    )
    run.rubrics = run.stage(ingest_rubrics)(
        run_dir=run.dir,
        run=run.name,
        data_file=data_file,
        data=inputs.source,
        rubric_file=repo_path(cfg.rubrics.path),
        rubric_cfg=inputs.rubrics,
        static_rubrics_file=repo_path(cfg.rubrics.static_rubrics),
        prompts=run.prompts,
    )
    run.manifests += [run.prompts, run.rubrics]


def warm_start(run: RunContext) -> StepState:
    """The SFT warm start (sft.enabled): GRPO's policy and (by default) its KL reference begin at its checkpoint.
    The held-out table starts with the base model (and the SFT checkpoint)."""
    cfg, inputs = run.cfg, run.inputs
    if run.eval_at and cfg.sft.enabled:  # base -> SFT -> GRPO in one table
        evaluate_policy(run, run.base, 0, "base")
    run.start = run.base
    if cfg.sft.enabled:
        sft_file = repo_path(cfg.sft.path, cfg.sft.format) if cfg.sft.path else run.data_file
        sft_data = run.stage(prepare_sft)(
            run_dir=run.dir,
            run=run.name,
            sft_file=sft_file,
            sft_cfg=inputs.sft_prepare,
            seed=cfg.run.seed,
            policy=run.base,
            prompts=run.prompts,
        )
        warm = run.stage(sft_train)(
            run_dir=run.dir,
            run=run.name,
            sft_data={"sft_examples": sft_data["sft_examples"]},  # what it trains on: no stats in its cache key
            policy=run.base,
            sft_cfg=inputs.sft_train,
            **run.computes(),
        )
        run.start = warm["policy"]
        run.manifests += [sft_data, warm]
        publish_catalog(run_dir=run.dir, run=run.name, manifests=run.manifests, judge_price=judge_price(run))
    run.locate_reference()
    if run.eval_at:
        evaluate_policy(run, run.start, 0, "sft" if cfg.sft.enabled else "base")
    # the EMA teacher (Co-rewarding-II) starts as the starting policy
    state = StepState(policy=run.start, teacher=run.start, policies=[run.start])
    ahead = cfg.grpo.async_steps
    if ahead and cfg.rollout.engine == "hf":
        get_run_logger().warning(
            "grpo.async_steps %d with rollout.engine hf: the rollouts share this process and its cores "
            "with the learner, so sampling ahead gains little beyond overlapping a remote judge",
            ahead,
        )
    for step in range(min(ahead + 1, cfg.grpo.steps) if ahead else 0):
        sample_ahead(run, state, step)
    return state


def evaluate_policy(run: RunContext, policy: dict, step: int, phase: str) -> None:
    inputs = run.inputs
    run.evaluations.append(
        run.stage(evaluate)(
            run_dir=run.dir,
            run=run.name,
            step=step,
            phase=phase,
            prompts=run.prompts,
            rubrics=run.rubrics,
            policy=policy,
            judge_model=run.judge_model,
            eval_cfg=inputs.eval,
            engine_cfg=inputs.engine,
            rollout_cfg=inputs.eval_rollout,
            judge_cfg=inputs.judge,
            reward_cfg=inputs.reward,
            **run.computes(),
        )
    )
    run.manifests.append(run.evaluations[-1])


def sample_ahead(run: RunContext, state: StepState, step: int) -> None:
    """grpo.async_steps K: the rollout of `step` runs beside the steps before it, with the policy after
    max(step - K, 0) updates; one rollout at a time, in step order, so one engine serves them all."""
    earlier = [state.sampled_ahead[step - 1]] if step - 1 in state.sampled_ahead else []
    state.sampled_ahead[step] = run.stage(rollout).submit(
        wait_for=earlier,
        **_rollout_inputs(run, step),
        policy=state.policies[max(step - run.cfg.grpo.async_steps, 0)],
        round=0,
        round_prompt_ids=None,
    )


def _rollout_inputs(run: RunContext, step: int) -> dict:
    return {
        "run_dir": run.dir,
        "run": run.name,
        "step": step,
        "prompts": run.grpo_prompts,
        "engine_cfg": run.inputs.engine,
        "rollout_cfg": run.inputs.rollout,
        **run.computes(),
    }


def rollout_and_judge(run: RunContext, state: StepState, step: int) -> tuple[list[dict], list[dict]]:
    """The step's rollouts and their judgments, one manifest each per sampling round (rollout.dynamic_sampling
    samples fresh prompts in place of groups whose rewards are all equal); the judge's anchors where due."""
    cfg, inputs = run.cfg, run.inputs
    state.taught = (
        run.stage(teacher_rollout)(**_rollout_inputs(run, step), teacher=state.teacher) if run.teaching else None
    )
    spent = [m["judge_usage"] for m in run.manifests if "judge_usage" in m]  # every judging stage so far
    # the run's own prices and budget: a fork's steps shared with its parent ran under the parent's recipe, and
    # its judge total (refiner show, the catalog) prices them at its own
    prices = run.own.judge
    upcoming = likely_step_cost(
        [sum(usage_cost(u, prices) for u in usages) for usages in state.step_usages],
        [usage_cost(m["judge_usage"], prices) for m in run.manifests if m.get("stage") == "judge-anchors"],
        [usage_cost(m["judge_usage"], prices) for m in run.evaluations if "judge_usage" in m],
        anchors_due=anchors_due(cfg, step),
        eval_due=step + 1 in run.eval_at,
    )
    check_budget(prices, spent, step, upcoming)  # stops before the step that would exceed it
    rolled, scored = [], []
    for sampling_round in range(run.max_rounds):
        fresh = None
        if sampling_round:
            needed = len(rolled[0]["prompt_ids"]) - len(
                informative_prompt_ids(train_rewards(scored), cfg.grpo, reward_parts)
            )
            used = [p for manifest in rolled for p in manifest["prompt_ids"]]
            fresh = (
                refill_prompts(run.grpo_prompts, step, sampling_round, used, needed, cfg.run.seed) if needed > 0 else []
            )
            if not fresh:  # the step is full, or the train split has no unused prompt left
                break
        rolled.append(
            state.sampled_ahead[step].result()
            if cfg.grpo.async_steps
            else run.stage(rollout)(
                **_rollout_inputs(run, step), policy=state.policy, round=sampling_round, round_prompt_ids=fresh
            )
        )
        scored.append(
            run.stage(judge)(
                run_dir=run.dir,
                step=step,
                rollouts=rolled[-1],
                prompts=run.prompts,
                rubrics=run.rubrics,
                judge_model=run.judge_model,
                judge_cfg=inputs.judge,
                reward_cfg=inputs.reward,
                max_new_tokens=cfg.rollout.max_new_tokens,
                dtype=cfg.model.dtype,
                precision=cfg.model.precision,
                round=sampling_round,
                **({"teacher_rollouts": state.taught} if run.teaching else {}),
            )
        )
    if step == 0:  # judge.anchor_every re-judges some of step 0's rollouts
        state.anchors = {"rollouts": rolled[0], "scores": scored[0], "step": 0}
    if anchors_due(cfg, step):
        run.manifests.append(
            run.stage(judge_anchors)(
                run_dir=run.dir,
                run=run.name,
                step=step,
                anchors={**state.anchors, "count": cfg.judge.anchor_rollouts, "seed": cfg.run.seed},
                prompts=run.prompts,
                rubrics=run.rubrics,
                judge_model=run.judge_model,
                judge_cfg=inputs.judge,
                dtype=cfg.model.dtype,
                precision=cfg.model.precision,
            )
        )
    return rolled, scored


def anchors_due(cfg: RecipeConfig, step: int) -> bool:
    """judge.anchor_every: whether step `step` re-judges the anchors."""
    return bool(cfg.judge.anchor_every) and step % cfg.judge.anchor_every == 0


def train_rewards(scores: list[dict]) -> list[dict]:
    """The training reward rows of a step's judged sampling rounds."""
    return [r for scored in scores for r in read_rows(scored["rewards"]["path"]) if r["reward_version"] == "train"]


def syncs_reference(run: RunContext, step: int) -> bool:
    """grpo.ref_sync_every: whether the KL reference moves toward the policy after update `step`."""
    every = run.cfg.grpo.ref_sync_every
    return every > 0 and is_update_step(step + 1, every)


def saves_checkpoint(run: RunContext, step: int) -> bool:
    """run.save_every: steps in between keep their weights in the live learner; the EMA teacher, a reference sync
    and an eval read the policy's checkpoint, and the last step's is the run's result."""
    cfg = run.cfg
    return (
        run.teaching
        or syncs_reference(run, step)
        or (step + 1) % cfg.run.save_every == 0
        or step + 1 in (cfg.grpo.steps, *run.eval_at)
    )


def update(run: RunContext, state: StepState, step: int, rolled: list[dict], scored: list[dict]) -> dict:
    """The GRPO update (and the EMA teacher's); the next rollout to sample ahead starts."""
    cfg, ahead = run.cfg, run.cfg.grpo.async_steps
    reference = state.reference or run.reference  # the KL reference (grpo.ref_sync_every moves it)
    updated = run.stage(grpo_update)(
        run_dir=run.dir,
        run=run.name,
        step=step,
        rollouts=rolled,
        scores=scored,
        policy=state.policy,
        reference=reference,
        grpo_cfg=run.inputs.update,
        lora=run.inputs.lora,
        temperature=cfg.rollout.temperature,
        dtype=cfg.model.dtype,
        precision=cfg.model.precision,
        save=saves_checkpoint(run, step),
        policy_lag=min(step, ahead),
        entropy_control=state.entropy_control,
        kl_control=state.kl_control,
    )
    state.policy = updated["policy"]
    state.entropy_control = updated.get("entropy_control")
    state.kl_control = updated.get("kl_control")
    state.policies.append(state.policy)
    state.step_usages.append([m["judge_usage"] for m in scored])
    if ahead and step + 1 + ahead < cfg.grpo.steps:
        sample_ahead(run, state, step + 1 + ahead)
    if syncs_reference(run, step):
        synced = run.stage(sync_reference)(
            run_dir=run.dir,
            run=run.name,
            step=step,
            reference=reference,
            policy=state.policy,
            alpha=cfg.grpo.ref_mixup_alpha,
        )
        state.reference = synced["reference"]
        run.manifests.append(synced)
    if run.teaching:
        moved = run.stage(teacher_update)(
            run_dir=run.dir,
            run=run.name,
            step=step,
            teacher=state.teacher,
            policy=state.policy,
            teacher_cfg=run.inputs.teacher,
        )
        state.teacher = moved["teacher"]
        run.manifests += [state.taught, moved]
    return updated


def publish_step(run: RunContext, state: StepState, step: int, step_manifests: list[dict]) -> None:
    """Checkpoint retention, the catalog (inspectable after every step), the step's artifacts and the monitors."""
    cfg, saved = run.cfg, saves_checkpoint(run, step)
    if saved:  # the newest written checkpoint keeps its optimizer state: a resume continues from it
        prune_checkpoints(
            run_dir=run.dir,
            newest_step=step + 1,
            keep_last=checkpoints_to_keep(run.own.run.keep_last, run.own.grpo.async_steps),
            keep_every=run.own.run.keep_every,
        )
    run.manifests += step_manifests
    publish_catalog(run_dir=run.dir, run=run.name, manifests=run.manifests, judge_price=judge_price(run))
    publish_step_artifacts(run.dir, run.name, step)
    events = check_monitors(
        run_dir=run.dir,
        run=run.name,
        step=step,
        monitors_cfg=run.inputs.monitors,
        inherited=run.recipe_of(step) is not run.own,
    )
    act_on_monitors(run.dir, step, events, cfg.monitors.pause_timeout_seconds)  # pause or fail, as configured
    get_run_logger().info(
        "step %d done: %s",
        step,
        f"checkpoint {state.policy['path']}"
        + ("" if Path(state.policy["path"]).exists() else " (pruned since: run.keep_last, run.keep_every)")
        if saved
        else f"weights in the live learner (run.save_every {cfg.run.save_every})",
    )


def judge_price(run: RunContext) -> tuple[float, float]:
    """The run's own judge prices (a fork's, for its ancestors' steps too): read by the catalog, in no cache key."""
    return (run.own.judge.price_per_mtok_in, run.own.judge.price_per_mtok_out)


def finish(run: RunContext, state: StepState) -> dict:
    log = get_run_logger()
    summary = [row for evaluated in run.evaluations for row in evaluated["summary"]]
    if summary:
        query = shlex.join(["refiner", "sql", run.dir, "SELECT * FROM evals"])
        log.info("held-out evaluation (%s):\n%s", query, format_table(summary))
    if quarantined := quarantine_warning(run.dir):
        log.warning(quarantined)
    return {
        "run_dir": run.dir,
        "catalog": str(Path(run.dir) / "catalog.duckdb"),
        "policy": state.policy["path"],
        "evals": summary,
    }
