"""The run registry: what a run keeps live across its steps (the rollout engines, the learner, the in-process
judges), one registry per run folder, opened by the flow and closed at its end.

A run opens its registry (`open_run`, keyed by run folder) and closes it at its end (`close_owned`, the flow's end
hooks): everything kept is closed then, and nothing is shared between two runs of one process. A stage of a run
with no open registry (run.keep_engines false, or a stage called outside a flow) builds its engines and closes them
as before. The registry is only memory: a new process starts empty and rebuilds from the checkpoints on disk.
What goes in the registry, and how it is handed out, is the business of the modules that keep each kind:
live_engines (rollout engines), live_learner (the learner) and live_judges (in-process judges).
"""

from __future__ import annotations

import atexit
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class LiveRun:
    """What one run keeps. Every value kept offers `close()`: the registry closes them with the run."""

    owner: str
    rollout: dict[str, Any] = field(default_factory=dict)  # key -> engine not in use (its .weights_hash says what)
    learner: Any = None  # a live_learner.KeptLearner, or None
    judges: dict[str, Any] = field(default_factory=dict)  # key -> a live_judges.KeptJudge
    lending: int = 0  # rollout engines copying the learner's weights now: the learner is not taken meanwhile
    in_use: dict[str, int] = field(default_factory=dict)  # key -> rollout engines of that key handed out now


_RUNS: dict[str, LiveRun] = {}
# A rollout (grpo.async_steps) may run in a worker thread beside an update: every registry change holds this, and
# taking the learner waits on it while an engine copies the learner's weights.
LOCK = threading.Condition()


def _folder(run_dir: str | Path) -> str:
    return str(Path(run_dir).resolve())


def open_run(run_dir: str | Path, owner: str = "") -> None:
    """Keep engines for the run in `run_dir` from now on (an earlier registry of that folder is closed first)."""
    close_run(run_dir)
    with LOCK:
        _RUNS[_folder(run_dir)] = LiveRun(owner)


def run_of(run_dir: str | Path) -> LiveRun | None:
    """The registry of the run in `run_dir`, or None when it keeps nothing."""
    with LOCK:
        return _RUNS.get(_folder(run_dir))


def close_run(run_dir: str | Path) -> None:
    with LOCK:
        run = _RUNS.pop(_folder(run_dir), None)
        if run is not None:  # a stage waiting for an engine in use (one_at_a_time) waits no more
            run.in_use.clear()
            LOCK.notify_all()
    if run is not None:
        _close(run)


def close_owned(owner: str) -> None:
    """Close the registries opened by `owner` (a flow run id)."""
    with LOCK:
        folders = [folder for folder, run in _RUNS.items() if run.owner == owner]
    for folder in folders:
        close_run(folder)


def close_all() -> None:
    with LOCK:
        folders = list(_RUNS)
    for folder in folders:
        close_run(folder)


atexit.register(close_all)


def _close(run: LiveRun) -> None:
    """Close everything the run keeps, each whatever the others do (an engine whose worker died must not keep the
    learner from writing weights no checkpoint holds); the first failure is raised once all were tried."""
    kept = [*run.rollout.values(), *run.judges.values(), *([run.learner] if run.learner is not None else [])]
    run.rollout.clear()
    run.judges.clear()
    run.learner = None
    failed: BaseException | None = None
    for value in kept:
        try:
            value.close()
        except BaseException as e:  # each is closed whatever came before
            failed = failed or e
    if failed is not None:
        raise failed


def open_runs() -> list[str]:
    """Run folders with a registry open in this process."""
    with LOCK:
        return list(_RUNS)
