"""Deliberate faults, for exercising recovery in tests and drills; each fires once, then leaves a marker.

Three environment variables take comma-separated points:
  REFINER_FAIL_ONCE       raise an exception
  REFINER_INTERRUPT_ONCE  deliver SIGINT (what Ctrl-C sends)
  REFINER_KILL_ONCE       end the process at once with no cleanup, like SIGKILL
A point is a stage ('judge'), a stage at a step ('judge@1'), either with ':end' (fires once the stage's outputs
are written but before the orchestrator records it done), ':partN' (a rollout, once part N of its groups is
written), ':train' (a grpo-update, before its training step changes the weights) or ':trained' (a grpo-update,
once its training step returned, before its checkpoint and tables are written), or 'write:<path>'
(REFINER_KILL_ONCE only): an atomic write whose destination ends with <path> ('catalog.duckdb',
'step=1/rewards.parquet', 'step_0002') has its data on disk but not yet in place; 'write:<folder>.replacing'
('step_0002.replacing'): a folder being replaced has been moved aside, its replacement not yet renamed in.
Markers go to RUN_DIR/.faults, for a write beside its destination.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

ACTIONS = (("REFINER_FAIL_ONCE", "raise"), ("REFINER_INTERRUPT_ONCE", "interrupt"), ("REFINER_KILL_ONCE", "kill"))
KILLED_EXIT_CODE = 137  # what a shell reports for SIGKILL


def _wanted(variable: str) -> set[str]:
    return {s.strip() for s in os.environ.get(variable, "").split(",") if s.strip()}


def stage_fault(stage: str, step: int | None, markers: Path, phase: str = "start") -> None:
    """The faults asked for at this point of a stage (phase 'start' or 'end')."""
    here = {stage, f"{stage}@{step}"}
    if phase != "start":
        here = {f"{point}:{phase}" for point in here}
    for variable, action in ACTIONS:
        hit = _wanted(variable) & here
        if hit and _first_time(markers / f"{action}-{sorted(hit)[0]}"):
            if action == "kill":
                os._exit(KILLED_EXIT_CODE)
            if action == "interrupt":
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)  # the KeyboardInterrupt lands here
            at = "" if phase == "start" else f", at its {phase}"
            raise RuntimeError(f"injected fault in stage {stage!r} (step {step}{at}) from {variable}")


def write_fault(final: Path) -> None:
    """Called by atomic writes between writing the data and renaming it into place."""
    for point in _wanted("REFINER_KILL_ONCE"):
        tail = point.removeprefix("write:")
        if (
            tail != point
            and final.as_posix().endswith(f"/{tail}")
            and _first_time(final.parent / f".fault-kill-write-{final.name}")
        ):
            os._exit(KILLED_EXIT_CODE)


def _first_time(marker: Path) -> bool:
    if marker.exists():
        return False
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    return True
