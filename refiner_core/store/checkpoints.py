"""Checkpoint retention: which step checkpoints a run keeps, and pruning the rest.

A GRPO update k writes `checkpoints/step_{k+1:04d}` (weights + `optimizer.pt`). Only the newest checkpoint's
optimizer state is needed to continue training, so older ones keep their weights only; step checkpoints outside
`keep_last` / `keep_every` are removed. Removed folders are listed in `pruned.json`, so a cached stage that
names one is known to be pruned on purpose, not damaged.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
from pathlib import Path

from refiner_core.store.storage import write_json

# Optimizer state beside a checkpoint's weights (torch learner; DeepSpeed's sharded folder): needed only to
# continue training from that checkpoint, not to load the policy.
TRAINING_STATE_FILES = ("optimizer.pt", "deepspeed")
PRUNED_LIST = "pruned.json"
_STEP_DIR = re.compile(r"step_(\d{4,})$")


def step_checkpoints(folder: Path) -> dict[int, Path]:
    """{step number: folder} of the step checkpoints under `folder` (SFT and other folders are not steps)."""
    found = {}
    for child in Path(folder).iterdir() if Path(folder).is_dir() else ():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir():
            found[int(match.group(1))] = child
    return found


def retained_steps(steps: list[int], newest: int, keep_last: int, keep_every: int) -> set[int]:
    """Steps kept once `newest` is written: the last `keep_last` up to it (all when keep_last <= 0), every
    `keep_every`-th, and `newest`. Steps after `newest` (left by a longer earlier run) are kept."""
    if keep_last <= 0:
        return set(steps) | {newest}
    recent = sorted(s for s in steps if s <= newest)[-keep_last:]
    periodic = {s for s in steps if keep_every > 0 and s % keep_every == 0}
    return set(recent) | periodic | {newest} | {s for s in steps if s > newest}


def checkpoints_to_keep(keep_last: int, async_steps: int) -> int:
    """run.keep_last, at least the newest async_steps + 1 with grpo.async_steps: the rollouts sampled ahead of the
    step just written read the policies of its last async_steps updates and its newest one (0: keep every one)."""
    return max(keep_last, async_steps + 1) if keep_last and async_steps else keep_last


def prune(folder: Path, newest: int, keep_last: int, keep_every: int) -> list[str]:
    """Remove step checkpoints not retained, and the optimizer state of kept ones older than `newest` (later ones,
    left by a longer earlier run, keep theirs: extending the run again continues from them).
    Returns the removed folders (also appended to `pruned.json`)."""
    folder = Path(folder)
    checkpoints = step_checkpoints(folder)
    keep = retained_steps(list(checkpoints), newest, keep_last, keep_every)
    removed = [str(path) for step, path in sorted(checkpoints.items()) if step not in keep]
    if removed:  # listed before they go: a kill midway leaves listed folders the next prune removes, never one gone
        # but unlisted, which reads as damaged and is recomputed from a checkpoint that may be pruned too
        write_json(sorted(pruned_paths(folder) | set(removed)), folder / PRUNED_LIST)
    for step, path in sorted(checkpoints.items()):
        if step not in keep:
            shutil.rmtree(path)
        elif step < newest:
            for name in TRAINING_STATE_FILES:
                state = path / name
                shutil.rmtree(state) if state.is_dir() else state.unlink(missing_ok=True)
    return removed


def pruned_paths(folder: Path) -> set[str]:
    path = Path(folder) / PRUNED_LIST
    return set(json.loads(path.read_text())) if path.exists() else set()


def require_checkpoint(folder: str, needed_by: str) -> None:
    """FileNotFoundError, saying why, where the checkpoint `folder` that `needed_by` (e.g. 'rollout step 1') reads
    is gone: a stage recomputed (its inputs or outputs changed) after the retention policy pruned its checkpoint
    cannot be, in this folder."""
    if Path(folder).is_dir():
        return
    pruned = str(folder) in pruned_paths(Path(folder).parent)
    raise FileNotFoundError(
        f"{needed_by} must be recomputed (its inputs or outputs changed) from {folder}, which "
        + ("the retention policy removed (run.keep_last, run.keep_every)" if pruned else "no longer exists")
        + "; rerun in a new run folder, or keep every checkpoint (run.keep_last 0) in runs you mean to change"
    )


def mark_pruned(folder: Path, path: Path) -> None:
    """List `path` in `folder`'s pruned.json: a fork adopting a result whose checkpoint its parent had pruned holds
    it as pruned too, whether or not the parent's folder stays."""
    listed = pruned_paths(folder)
    if str(path) not in listed:
        Path(folder).mkdir(parents=True, exist_ok=True)
        write_json(sorted(listed | {str(path)}), Path(folder) / PRUNED_LIST)


def forget_pruned(folder: Path, path: Path) -> None:
    """A pruned checkpoint was written again (a recomputed update): it is no longer pruned."""
    listed = pruned_paths(folder)
    if str(path) in listed:
        write_json(sorted(listed - {str(path)}), Path(folder) / PRUNED_LIST)


def folder_bytes(path: Path | str) -> int:
    """Bytes of the files under PATH (a link counts as the file it names, links to folders are not followed); a
    file or folder removed while they are counted counts 0 (a killed run's temporary folder, its processes
    ending)."""
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                info = os.stat(os.path.join(root, name))
                total += info.st_size if stat.S_ISREG(info.st_mode) else 0
    return total
