from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task

from refiner_core.algo.ema import ema_checkpoint
from refiner_core.publish.model_card import write_model_card
from refiner_core.store.checkpoints import TRAINING_STATE_FILES, prune
from refiner_core.store.storage import atomic_dir, dir_hash

CHECKPOINT_FOLDERS = ("checkpoints", "teacher", "reference")  # under RUN_DIR


def write_average(run_dir: str, run: str, kind: str, done: int, old: dict, policy: dict, alpha: float) -> dict:
    """alpha * policy + (1 - alpha) * old as the checkpoint RUN_DIR/<kind>/step_<done> (kind 'teacher' or
    'reference'), with its model card; returns its manifest."""
    final = Path(run_dir) / kind / f"step_{done:04d}"
    with atomic_dir(final) as build:
        ema_checkpoint(Path(old["path"]), Path(policy["path"]), alpha, build)
        write_model_card(build, run_dir, kind=kind, run=run, step=done, checkpoint=final, parent=old["path"])
    return {"path": str(final), "hash": dir_hash(final, TRAINING_STATE_FILES)}


@task(name="prune-checkpoints", cache_policy=None, persist_result=False, retries=1)
def prune_checkpoints(*, run_dir: str, newest_step: int, keep_last: int, keep_every: int) -> list[str]:
    """Apply the retention policy once step `newest_step`'s checkpoint is written: to the policy's checkpoints
    and to the EMA teacher's (Co-rewarding-II) and the moved KL reference's (grpo.ref_sync_every), whose newest one
    is all the next update reads.

    Not cached: it is cheap, and a changed keep_last must apply to a rerun whose updates are all cached."""
    removed = [
        path
        for folder in CHECKPOINT_FOLDERS
        for path in prune(Path(run_dir) / folder, newest_step, keep_last, keep_every)
    ]
    if removed:
        get_run_logger().info(
            "prune-checkpoints: removed %s", ", ".join(str(Path(p).relative_to(run_dir)) for p in removed)
        )
    return removed
