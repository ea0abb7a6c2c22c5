from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task

from refiner_core.store.checkpoints import prune

CHECKPOINT_FOLDERS = ("checkpoints", "teacher", "reference")  # under RUN_DIR


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
