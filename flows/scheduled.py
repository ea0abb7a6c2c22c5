"""The flow that deployments schedule (prefect.yaml): run a recipe file in a run folder named by a template.

The recipe is read when the run starts, so an edited recipe applies from the next scheduled run on. The run
folder comes from `run_dir`, a template (see refiner_core.runtime.runlock.format_run_dir): the default,
`runs/{deployment}/{date}-{flow_run_id}`, gives every scheduled run its own folder, and a retried flow run
(`prefect flow-run retry ID`) keeps its ID and scheduled time, so it resumes its folder with finished stages
`Cached`; a template without fields (`runs/nightly`) makes every run resume one folder. With a folder per run,
a run first stops what killed runs in the folders beside its own left behind (their child processes and
temporary files), which no later run of those folders would. A run that failed, crashed or was cancelled logs the
command that retries it.
"""

from __future__ import annotations

import os
from pathlib import Path

from prefect import flow, get_run_logger

import tasks  # noqa: F401  (sets Prefect's environment before prefect is imported)
from flows.refiner import refiner_pipeline
from flows.run_folder import clean_up_after_dead_neighbours, resolve_run_dir
from refiner_core.config import ConfigError, load_recipe
from refiner_core.preflight import check_recipe, resolve

DEFAULT_RUN_DIR = "runs/{deployment}/{date}-{flow_run_id}"
ENTRYPOINT = "flows/scheduled.py:run_recipe"


def _flow_run_name() -> str:
    from prefect.runtime import flow_run

    recipe = os.path.basename(flow_run.parameters["recipe_file"]).removesuffix(".yaml")
    return f"{recipe}: {os.path.basename(resolve_run_dir(flow_run.parameters.get('run_dir', DEFAULT_RUN_DIR)))}"


def retry_command(flow_run_id, deployment_id) -> str:
    """The command that reruns a flow run with its ID, parameters and scheduled time, so in its own folder."""
    entrypoint = "" if deployment_id else f" --entrypoint {ENTRYPOINT}"  # a flow run started without a deployment
    return f"prefect flow-run retry {flow_run_id}{entrypoint}"


def _log_retry_after_a_stop(flow, flow_run, state) -> None:
    """on_crashed / on_cancellation: a run that ended with no exception of its own to log (its process killed, the
    run cancelled) gets its retry command too, logged by the worker that watched it when the process is gone."""
    from prefect.logging.loggers import flow_run_logger

    flow_run_logger(flow_run, flow).error(
        "the run %s; retry it in its run folder, finished stages cached: %s",
        "crashed" if state.is_crashed() else "was cancelled",
        retry_command(flow_run.id, flow_run.deployment_id),
    )


@flow(
    name="refiner-recipe",
    flow_run_name=_flow_run_name,
    on_crashed=[_log_retry_after_a_stop],
    on_cancellation=[_log_retry_after_a_stop],
)
def run_recipe(recipe_file: str, run_dir: str = DEFAULT_RUN_DIR, overrides: list[str] | None = None) -> dict:
    """Run RECIPE_FILE (relative to the repository, or absolute) with `--set`-style OVERRIDES in the run folder
    RUN_DIR names (a template: {deployment}, {date}, {flow_run_id})."""
    try:
        return _run_recipe(recipe_file, run_dir, overrides)
    except Exception:
        from prefect.runtime import deployment, flow_run

        get_run_logger().error(
            "the run failed; once its cause is fixed (an edited recipe file applies), retry it in "
            "its run folder, finished stages cached: %s",
            retry_command(flow_run.id, deployment.id),
        )
        raise


def _run_recipe(recipe_file: str, run_dir: str, overrides: list[str] | None) -> dict:
    cfg = load_recipe(resolve(recipe_file), overrides or [])
    problems = check_recipe(cfg)
    if problems:
        raise ConfigError(f"{recipe_file}: {len(problems)} problem(s), nothing was run:\n  " + "\n  ".join(problems))
    if cfg.run.num_threads:
        import torch

        torch.set_num_threads(cfg.run.num_threads)
    # A worker has read Prefect's settings before this module set the results folder `refiner run` uses
    # (tasks/__init__), and a subflow stores results where its parent does: the pipeline is given the folder, so
    # stage caches are shared between scheduled runs and `refiner run` on the same folder.
    pipeline = refiner_pipeline.with_options(result_storage=Path(os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"]))
    folder = resolve_run_dir(run_dir)
    if "{" in run_dir:  # a folder per run: what a killed earlier run left beside it, no later run of its own removes
        clean_up_after_dead_neighbours(Path(folder).resolve(), get_run_logger().warning)
    return pipeline(recipe=cfg.to_dict(), run_dir=folder)
