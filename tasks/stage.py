"""The stage decorator: retries, and a cache key from content hashes, config and the code version."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.context import TaskRunContext
from prefect.exceptions import MissingContextError

from refiner_core import code_version
from refiner_core.algo.advantages import NonFiniteReward
from refiner_core.config import ConfigError
from refiner_core.data.rows import TooManyRejected
from refiner_core.data.rubric_fields import RubricError
from refiner_core.data.sources import SourceError
from refiner_core.judges.cost import paying
from refiner_core.runtime.registry import outside_sources
from refiner_core.runtime.unsaved_weights import UnsavedWeights, is_unsaved, mark_recorded
from refiner_core.store.checkpoints import TRAINING_STATE_FILES, pruned_paths
from refiner_core.store.faults import stage_fault
from refiner_core.store.forks import adopt, ancestors, read_fork, rebase
from refiner_core.store.storage import dir_hash, file_hash, json_hash
from tasks.progress import watched_stage

CODE_VERSION = code_version()


def _content(value: Any, key: str) -> Any:
    """Parameters named *_file (and lists named *_files) enter the key by content, so an edited input file (or a
    save_to_disk folder) invalidates the stage."""
    if key.endswith("_file") and isinstance(value, str) and value and Path(value).is_file():
        return {"path": value, "content": file_hash(value)}
    if key.endswith("_file") and isinstance(value, str) and value and Path(value).is_dir():
        return {"path": value, "content": dir_hash(value)}
    if key.endswith("_files") and isinstance(value, list):  # e.g. the catalogs of another run's difficulty ledger
        return [_content(v, key[:-1]) for v in value]
    return value


# What manifests record of how their stages ran (how long, the rollout's weight sync, the judge's requests and
# tokens): not what they made.
PROVENANCE = ("seconds", "weight_sync_seconds", "judge_usage")


def _without_provenance(value: Any) -> Any:
    """Upstream manifests enter the key by their content hashes, not by how the stage ran: an output with a
    `rows_hash` (its rows without their provenance columns) enters by it, not by its file's hash."""
    if isinstance(value, dict):
        left_out = (*PROVENANCE, "hash") if "rows_hash" in value else PROVENANCE
        return {k: _without_provenance(v) for k, v in value.items() if k not in left_out}
    if isinstance(value, list):
        return [_without_provenance(v) for v in value]
    return value


def stage_cache_key(context: TaskRunContext, parameters: dict[str, Any], unkeyed: tuple[str, ...] = ()) -> str:
    """The stage's key: its name, the code version and its parameters, but for `unkeyed` ones, which change how a
    result is kept rather than what it is."""
    material = {k: _content(_without_provenance(v), k) for k, v in sorted(parameters.items()) if k not in unkeyed}
    if outside := outside_sources(material):  # a judge, engine, verifier or tool of the user's own, by import path
        material["outside_code"] = outside
    own = _key(context.task.name, material)
    return _ancestor_key(context, material, own) or own


def _key(name: str, material: dict[str, Any]) -> str:
    return f"{name}-{json_hash([CODE_VERSION, material])}"


def _ancestor_key(context: TaskRunContext, material: dict[str, Any], own: str) -> str | None:
    """In a fork (refiner fork), the key of a result an ancestor run computed with these inputs: the material with
    the fork's folder and run name read as the ancestor's. None when no ancestor has one, when the fork holds a
    result of its own under `own`, its key (computed before the ancestor got there), or the stage is being
    recomputed (--refresh, damaged outputs): a recomputed result is recorded under the fork's own key, never over
    an ancestor's."""
    run_dir = material.get("run_dir")
    fork = read_fork(run_dir) if isinstance(run_dir, str) else None
    if fork is None or context.task.refresh_cache or _refreshing_all():
        return None
    if context.result_store.exists(own) and not _damaged_record(context, own, run_dir):
        return None  # the fork computed it before an ancestor did: its own result stands, and what it fed
    for folder, run in ancestors(run_dir):
        mapped = rebase(material, run_dir, folder)
        if mapped.get("run") == fork.run:
            mapped["run"] = run
        key = _key(context.task.name, mapped)
        if context.result_store.exists(key):
            return key
    return None


def _damaged_record(context: TaskRunContext, key: str, run_dir: str) -> bool:
    """Whether the result stored under `key` names files since lost (an earlier run of the folder, removed): an
    ancestor's intact result of the same inputs serves before it is recomputed."""
    try:
        manifest = context.result_store.read(key).result
    except Exception:  # unreadable: as good as lost
        return True
    return not isinstance(manifest, dict) or bool(damaged_outputs(manifest, run_dir))


def _refreshing_all() -> bool:
    from prefect.settings import get_current_settings

    return bool(get_current_settings().tasks.refresh_cache)


# Errors a retry cannot fix: the same rows, files or settings would fail again.
NOT_RETRYABLE = (TooManyRejected, SourceError, ConfigError, RubricError, FileNotFoundError, NonFiniteReward)


def retry_unless_bad_data(task, task_run, state) -> bool:
    """Retries help with flaky resources, not with rejected input, missing files or impossible settings."""
    try:
        state.result()
    except NOT_RETRYABLE:
        return False
    except BaseException:
        return True
    return True


def damaged_outputs(manifest: dict, run_dir: str) -> list[str]:
    """Output files or folders of a manifest that are missing or no longer hash to what the stage wrote.
    Checkpoints removed by the retention policy are not damaged: they were pruned on purpose. Weights never
    written (run.save_every) are only intact while the run's live learner holds them, once the run wrote them as
    it ended, or once a later step checkpoint was saved from them (nothing after it needs them); else the update
    that made them is recomputed."""
    damaged = []
    for entry in manifest.values():
        if not (isinstance(entry, dict) and "path" in entry and "hash" in entry):
            continue
        if (unsaved := UnsavedWeights.named_by(entry)) is not None:  # before the pruned list: an earlier run of the
            if not unsaved.intact(run_dir):  # folder may have pruned a checkpoint of that name, not these weights
                damaged.append(f"{entry['path']} (never saved; no live learner holds it)")
            continue
        path = Path(entry["path"])
        if not path.exists() and entry["path"] in pruned_paths(path.parent):  # one there again is checked
            continue
        actual = dir_hash(path, TRAINING_STATE_FILES) if path.is_dir() else file_hash(path) if path.is_file() else None
        if actual != entry["hash"]:
            damaged.append(str(path))
    return damaged


class Stage:
    """A cached, retryable Prefect task whose cache hits are only trusted while their files are intact.

    A cached manifest names files; if they were deleted or changed since (a wiped run folder, a hand-edited
    Parquet file), the stage is recomputed instead of handing downstream stages a dangling manifest."""

    def __init__(self, prefect_task):
        self.task = prefect_task
        self.name = prefect_task.name

    def with_options(self, **options) -> Stage:
        return Stage(self.task.with_options(**options))

    def __call__(self, **kwargs) -> dict:
        return self._checked(self.task(**kwargs, return_state=True), kwargs)

    def submit(self, wait_for: list[Submitted] = (), **kwargs) -> Submitted:
        """Run the stage concurrently on the flow's task runner (same cache key, retries and damage check);
        `wait_for`: stages submitted earlier that must finish first. `.result()` gives the manifest."""
        future = self.task.submit(**kwargs, wait_for=[earlier.future for earlier in wait_for])
        submitted = Submitted(self, future, kwargs)
        if (running := _SUBMITTED.get()) is not None:
            running.append(submitted)
        return submitted

    def _checked(self, state, kwargs: dict) -> dict:
        manifest = state.result()  # raises the stage's exception when it failed
        if state.name == "Cached" and read_fork(kwargs["run_dir"]) is not None:  # maybe an ancestor's result
            manifest, adopted = adopt(manifest, kwargs["run_dir"])
            if adopted:
                _logger().info(
                    "%s%s: reused from %s (%d files hard-linked: %s)",
                    self.name,
                    "" if kwargs.get("step") is None else f"[step={kwargs['step']}]",
                    read_fork(kwargs["run_dir"]).parent_dir,
                    len(adopted),
                    ", ".join(adopted[:3]) + (", …" if len(adopted) > 3 else ""),
                )
        if state.name == "Cached":
            damaged = damaged_outputs(manifest, kwargs["run_dir"])
            policy = manifest.get("policy")
            if kwargs.get("save") and isinstance(policy, dict) and is_unsaved(policy):  # `save` is out of the key
                damaged.append(f"{policy['path']} (never saved; this run needs it written)")
            if damaged:
                _logger().warning(
                    "%s: cached result refers to missing or changed files (%s); recomputing",
                    self.name,
                    ", ".join(damaged[:3]),
                )
                manifest = self.task.with_options(refresh_cache=True)(**kwargs)
        mark_recorded(manifest)  # the result is stored: a checkpoint it wrote may stand for the weights before it
        return manifest


# The stages submitted by the flow function running in this context (settles_submitted_stages).
_SUBMITTED: ContextVar[list[Submitted] | None] = ContextVar("submitted_stages", default=None)


def settles_submitted_stages(fn: Callable) -> Callable:
    """Decorator for a flow function: it returns or raises only once every stage it submitted has ended. A step
    that fails while a rollout samples ahead (grpo.async_steps) would otherwise end the run with that rollout still
    running: the run folder given back and the run's engines closed while it uses them."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        submitted: list[Submitted] = []
        scope = _SUBMITTED.set(submitted)
        try:
            return fn(*args, **kwargs)
        finally:
            _SUBMITTED.reset(scope)
            for stage in submitted:
                stage.future.wait()

    return run


class Submitted:
    """A stage running on the task runner; `result()` waits for its manifest."""

    def __init__(self, stage: Stage, future, kwargs: dict):
        self.stage, self.future, self.kwargs = stage, future, kwargs

    def result(self) -> dict:
        self.future.wait()
        return self.stage._checked(self.future.state, self.kwargs)


def _logger():
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("refiner")


def stage(name: str, unkeyed: tuple[str, ...] = ()) -> Callable[[Callable], Stage]:
    """Decorator for a pipeline stage. The wrapped function takes keyword arguments (with `run_dir`) and
    returns a JSON-able manifest whose {path, hash} entries are the stage's outputs. `unkeyed`: parameters left
    out of its cache key (a result computed under any value of them serves every value)."""

    def decorate(fn: Callable) -> Stage:
        @functools.wraps(fn)
        def run(*args, **kwargs):
            step, markers = kwargs.get("step"), Path(kwargs["run_dir"]) / ".faults"
            stage_fault(name, step, markers)
            t0 = time.time()
            with watched_stage(_attempt_name(name, kwargs), _logger(), name), paying(_payer(name, kwargs)):
                manifest = fn(*args, **kwargs)
            stage_fault(name, step, markers, phase="end")
            manifest["seconds"] = round(time.time() - t0, 3)
            manifest["stage"] = name
            return manifest

        return Stage(
            task(
                run,
                name=name,
                cache_key_fn=functools.partial(stage_cache_key, unkeyed=unkeyed) if unkeyed else stage_cache_key,
                persist_result=True,
                retries=2,
                retry_delay_seconds=2,
                retry_condition_fn=retry_unless_bad_data,
                task_run_name=_run_name(name),
            )
        )

    return decorate


def _payer(name: str, kwargs: dict) -> str:
    """The stage run that pays for the judgments made in it (judges.cost.PAYER): the same in every attempt of it,
    in this process or the rerun's."""
    where = str(Path(kwargs["run_dir"]).resolve())
    return json_hash([where, name, kwargs.get("step"), kwargs.get("round"), kwargs.get("phase")])


def _attempt_name(name: str, kwargs: dict) -> str:
    step, sampling_round = kwargs.get("step"), kwargs.get("round")
    if step is None:
        return name
    return f"{name}[step={step},round={sampling_round}]" if sampling_round else f"{name}[step={step}]"


def _run_name(name: str) -> Callable[[], str]:
    def render() -> str:
        from prefect.runtime import task_run

        return _attempt_name(name, task_run.parameters)

    return render
