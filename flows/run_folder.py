"""The run folder of a flow run: named from a template, used by one run at a time, its children recorded.

`holds_run_folder` wraps the pipeline flow so that every way of running it (`refiner run`, a Prefect worker, a
scheduled or retried flow run) resolves the folder template, takes the folder's lock (refiner_core.runtime.runlock),
stops children and removes unfinished writes that an earlier, killed run left behind (refiner_core.runtime.procs,
refiner_core.store.storage), writes the recipe it runs to RUN_DIR/recipe.yaml and sends every log line to
RUN_DIR/logs/run-<time>.log: each run folder has what `refiner sql`, `show`, `plot` and `rescore` read.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from refiner_core.runtime.procs import PROCS_DIR_ENV, stop_leftovers
from refiner_core.runtime.runlock import format_run_dir, run_lock
from refiner_core.store.storage import remove_partial_writes

PROCS_SUBDIR = ".procs"
LOGS_SUBDIR = "logs"
RECIPE_FILE = "recipe.yaml"


def resolve_run_dir(run_dir: str) -> str:
    """Fill a run folder template ({deployment}, {date}, {flow_run_id}) from the current flow run."""
    if "{" not in run_dir:
        return run_dir
    from prefect.runtime import deployment, flow_run

    return format_run_dir(
        run_dir,
        deployment=deployment.name or "",
        scheduled=flow_run.scheduled_start_time,
        flow_run_id=flow_run.id or "",
    )


def stop_children_left_behind(folder: Path, warn) -> None:
    """Stop what an earlier run of this folder started and did not live to stop; record ours from now on."""
    for entry in stop_leftovers(folder / PROCS_SUBDIR):
        warn(
            f"stopped PID {entry['pid']} ({' '.join(entry['cmd'][:4])} ...) left running by an earlier run of "
            f"{folder} since {entry['started']}"
        )
    os.environ[PROCS_DIR_ENV] = str(folder / PROCS_SUBDIR)


def remove_writes_left_behind(folder: Path, warn) -> None:
    """Temporary files of a writer that was killed mid-write were never visible; now they go."""
    leftovers = remove_partial_writes(folder)
    if leftovers:
        warn(
            f"removed {len(leftovers)} unfinished write(s) left by an earlier run of {folder}: "
            + ", ".join(str(p.relative_to(folder)) for p in leftovers[:5])
        )


class RunLog(logging.FileHandler):
    """RUN_DIR/logs/run-<time>.log, on the root logger: every log line of a run, Prefect's and tracebacks included."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        path = folder / LOGS_SUBDIR / f"run-{time.strftime('%Y%m%d-%H%M%S')}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        super().__init__(path, encoding="utf-8")


def start_run_log(folder: Path) -> Path:
    """Send every log line from now on to a new log file of the run folder, formatted as on the terminal;
    returns its path. `refiner run` starts it before the flow so that its own errors land in it too."""
    return Path(_open_run_log(folder).baseFilename)


def _open_run_log(folder: Path) -> RunLog:
    from prefect.logging.handlers import PrefectConsoleHandler

    root = logging.getLogger()
    handler = RunLog(folder)
    consoles = [h for h in root.handlers if isinstance(h, PrefectConsoleHandler)]
    handler.setFormatter(
        consoles[0].formatter
        if consoles
        else logging.Formatter("%(asctime)s | %(levelname)-7s | %(name)s - %(message)s")
    )
    root.addHandler(handler)
    return handler


@contextmanager
def logging_to_run_folder(folder: Path) -> Iterator[Path]:
    """The block's log lines go to the run folder's log: the one already open on it, or a new one, closed after."""
    root = logging.getLogger()
    open_here = [h for h in root.handlers if isinstance(h, RunLog) and h.folder == folder]
    if open_here:
        yield Path(open_here[0].baseFilename)
        return
    handler = _open_run_log(folder)
    try:
        yield Path(handler.baseFilename)
    finally:
        root.removeHandler(handler)
        handler.close()


def write_recipe(folder: Path, recipe: dict) -> None:
    """The recipe the run runs with, every field resolved, model.precision 'auto' as the pipeline resolves it on
    this machine: `refiner rescore` starts from it."""
    import yaml

    from refiner_core.config import recipe_from_dict
    from refiner_core.runtime.hardware import resolved_recipe

    resolved, _ = resolved_recipe(recipe_from_dict(recipe))
    (folder / RECIPE_FILE).write_text(yaml.safe_dump(resolved.to_dict(), sort_keys=False))


def holds_run_folder(fn):
    """Decorator for a flow function taking `recipe` and `run_dir`: the body runs on the resolved folder, holding
    its lock, with the recipe written beside it and its log lines in the folder's log."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from prefect import get_run_logger
        from prefect.runtime import flow_run

        bound = signature.bind(*args, **kwargs)
        bound.arguments["run_dir"] = resolve_run_dir(bound.arguments["run_dir"])
        folder = Path(bound.arguments["run_dir"]).resolve()
        log = get_run_logger()
        previous = os.environ.get(PROCS_DIR_ENV)
        with (
            run_lock(folder, command=f"flow run {flow_run.name} ({flow_run.id})", warn=log.warning),
            logging_to_run_folder(folder),
        ):
            try:
                write_recipe(folder, bound.arguments["recipe"])
                stop_children_left_behind(folder, log.warning)
                remove_writes_left_behind(folder, log.warning)
                return fn(*bound.args, **bound.kwargs)
            finally:  # a process that runs several flows records each one's children in its own folder
                if previous is None:
                    os.environ.pop(PROCS_DIR_ENV, None)
                else:
                    os.environ[PROCS_DIR_ENV] = previous

    return wrapper
