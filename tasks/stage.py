"""The stage decorator: retries, and a cache key from content hashes, config and the code version."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Any, Callable

from prefect import task
from prefect.context import TaskRunContext

from refiner_core import code_version
from refiner_core.data import TooManyRejected
from refiner_core.storage import dir_hash, file_hash, json_hash

CODE_VERSION = code_version()


def _content(value: Any, key: str) -> Any:
    """Parameters named *_file enter the key by content, so an edited input file (or a save_to_disk folder)
    invalidates the stage."""
    if key.endswith("_file") and isinstance(value, str) and value and Path(value).is_file():
        return {"path": value, "content": file_hash(value)}
    if key.endswith("_file") and isinstance(value, str) and value and Path(value).is_dir():
        return {"path": value, "content": dir_hash(value)}
    return value


def stage_cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    material = {k: _content(v, k) for k, v in sorted(parameters.items())}
    return f"{context.task.name}-{json_hash([CODE_VERSION, material])}"


def inject_faults(stage_name: str, step: int | None, run_dir: str) -> None:
    """Deliberate failures for exercising recovery: REFINER_FAIL_ONCE raises once, REFINER_KILL_ONCE kills
    the process once (no cleanup, like SIGKILL). Both take comma-separated 'stage' or 'stage@step'."""
    here = {stage_name, f"{stage_name}@{step}"}
    for variable, action in (("REFINER_FAIL_ONCE", "raise"), ("REFINER_KILL_ONCE", "kill")):
        wanted = {s.strip() for s in os.environ.get(variable, "").split(",") if s.strip()}
        hit = wanted & here
        if not hit:
            continue
        marker = Path(run_dir) / ".faults" / f"{action}-{sorted(hit)[0]}"
        if marker.exists():
            continue
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        if action == "kill":
            os._exit(137)
        raise RuntimeError(f"injected fault in stage {stage_name!r} (step {step}) from {variable}")


def retry_unless_bad_data(task, task_run, state) -> bool:
    """Retries help with flaky resources, not with rejected input: the same rows would fail again."""
    return not isinstance(getattr(state, "data", None), TooManyRejected)


def stage(name: str) -> Callable:
    """A cached, retryable pipeline stage. The wrapped function returns a JSON-able manifest."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args, **kwargs):
            inject_faults(name, kwargs.get("step"), kwargs["run_dir"])
            t0 = time.time()
            manifest = fn(*args, **kwargs)
            manifest["seconds"] = round(time.time() - t0, 3)
            manifest["stage"] = name
            return manifest

        return task(
            run,
            name=name,
            cache_key_fn=stage_cache_key,
            persist_result=True,
            retries=2,
            retry_delay_seconds=2,
            retry_condition_fn=retry_unless_bad_data,
            task_run_name=_run_name(name),
        )

    return decorate


def _run_name(name: str) -> Callable[[], str]:
    def render() -> str:
        from prefect.runtime import task_run

        step = task_run.parameters.get("step")
        return name if step is None else f"{name}[step={step}]"

    return render
