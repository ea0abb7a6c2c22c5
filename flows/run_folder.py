"""The run folder of a flow run: named from a template, used by one run at a time, its children recorded.

`holds_run_folder` wraps the pipeline flow so that every way of running it (`refiner run`, a Prefect worker, a
scheduled or retried flow run) resolves the folder template, takes the folder's lock (refiner_core.runlock), and
stops children and removes unfinished writes that an earlier, killed run left behind (refiner_core.procs,
refiner_core.storage).
"""

from __future__ import annotations

import functools
import inspect
import os
from pathlib import Path

from refiner_core.procs import PROCS_DIR_ENV, stop_leftovers
from refiner_core.runlock import format_run_dir, run_lock
from refiner_core.storage import remove_partial_writes

PROCS_SUBDIR = ".procs"


def resolve_run_dir(run_dir: str) -> str:
    """Fill a run folder template ({deployment}, {date}, {flow_run_id}) from the current flow run."""
    if "{" not in run_dir:
        return run_dir
    from prefect.runtime import deployment, flow_run

    return format_run_dir(run_dir, deployment=deployment.name or "", scheduled=flow_run.scheduled_start_time,
                          flow_run_id=flow_run.id or "")


def stop_children_left_behind(folder: Path, warn) -> None:
    """Stop what an earlier run of this folder started and did not live to stop; record ours from now on."""
    for entry in stop_leftovers(folder / PROCS_SUBDIR):
        warn(f"stopped PID {entry['pid']} ({' '.join(entry['cmd'][:4])} ...) left running by an earlier run of "
             f"{folder} since {entry['started']}")
    os.environ[PROCS_DIR_ENV] = str(folder / PROCS_SUBDIR)


def remove_writes_left_behind(folder: Path, warn) -> None:
    """Temporary files of a writer that was killed mid-write were never visible; now they go."""
    leftovers = remove_partial_writes(folder)
    if leftovers:
        warn(f"removed {len(leftovers)} unfinished write(s) left by an earlier run of {folder}: "
             + ", ".join(str(p.relative_to(folder)) for p in leftovers[:5]))


def holds_run_folder(fn):
    """Decorator for a flow function taking `run_dir`: the body runs on the resolved folder, holding its lock."""
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
        with run_lock(folder, command=f"flow run {flow_run.name} ({flow_run.id})", warn=log.warning):
            try:
                stop_children_left_behind(folder, log.warning)
                remove_writes_left_behind(folder, log.warning)
                return fn(*bound.args, **bound.kwargs)
            finally:  # a process that runs several flows records each one's children in its own folder
                if previous is None:
                    os.environ.pop(PROCS_DIR_ENV, None)
                else:
                    os.environ[PROCS_DIR_ENV] = previous

    return wrapper
