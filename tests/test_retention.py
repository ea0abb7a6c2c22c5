"""Bounded checkpoints on a real 5-step run: what stays on disk, cache hits over pruned folders, a kill mid-update."""

from __future__ import annotations

import duckdb

from conftest import REPO, run_cli


def _steps(run_dir) -> list[tuple]:
    con = duckdb.connect(str(run_dir / "catalog.duckdb"), read_only=True)
    try:
        return con.execute("SELECT step, checkpoint_bytes FROM steps ORDER BY step").fetchall()
    finally:
        con.close()


def test_keep_last_two_of_five_steps_with_a_kill_during_an_update(api_env, tmp_path):
    run_dir = tmp_path / "run"
    args = [
        "run",
        str(REPO / "recipes" / "tiny.yaml"),
        "--run-dir",
        str(run_dir),
        "--set",
        "grpo.steps=5",
        "--set",
        "run.keep_last=2",
        "--set",
        "rollout.max_new_tokens=8",
    ]
    code, out, err, _ = run_cli(args, tmp_path, {**api_env, "REFINER_KILL_ONCE": "grpo-update@3"})
    assert code == 137, err[-2000:]
    assert not (run_dir / "checkpoints" / "step_0004").exists()  # the killed update published nothing

    code, out, err, _ = run_cli(args, tmp_path, api_env)
    assert code == 0, err[-3000:]
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_0004", "step_0005"]
    assert (checkpoints / "step_0005" / "optimizer.pt").exists()  # what a resume needs
    assert not (checkpoints / "step_0004" / "optimizer.pt").exists()
    steps = _steps(run_dir)
    assert [s for s, _ in steps] == [0, 1, 2, 3, 4]  # the same rows as an uninterrupted run
    assert all(size > 0 for _, size in steps)
    con = duckdb.connect(str(run_dir / "catalog.duckdb"), read_only=True)
    assert con.execute("SELECT count(*), count(DISTINCT (step, prompt_id, sample_idx)) FROM rollouts").fetchone() == (
        5 * 4 * 4,
        5 * 4 * 4,
    )
    con.close()

    # The updates of steps 0-2 point at pruned folders: that is retention, not damage, so all stay Cached.
    code, out, err, _ = run_cli(args, tmp_path, api_env)
    assert code == 0, err[-3000:]
    log = out + err
    for step in range(5):
        for name in ("rollout", "judge", "grpo-update"):
            assert f"Task run '{name}[step={step}]' - Finished in state Cached" in log, (name, step)
    assert "recomputing" not in log

    # A rollout file deleted: its stage must be recomputed from step 1's checkpoint, which was pruned. It fails at
    # once saying so (it failed with a bare FileNotFoundError, and every rerun failed the same way).
    (run_dir / "rollouts" / "step=1" / "rollouts.parquet").unlink()
    code, out, err, _ = run_cli(args, tmp_path, api_env)
    assert code == 1
    assert (
        f"rollout step 1 must be recomputed (its inputs or outputs changed) from {checkpoints / 'step_0001'}, which "
        "the retention policy removed (run.keep_last, run.keep_every); rerun in a new run folder" in err
    ), err[-3000:]
    assert "Task run 'rollout[step=1]' - Retrying" not in out + err


def test_an_update_recomputed_from_a_pruned_checkpoint_says_so(prefect_server, tiny_recipe, tmp_path):
    """An update whose inputs changed must start again from its policy; when the retention policy removed that
    checkpoint, it fails saying so (not retried: the checkpoint stays gone) instead of a loader's error."""
    import json

    import pytest
    from prefect import flow

    from refiner_core.config import recipe_from_dict
    from refiner_core.runtime.hardware import resolved_recipe
    from refiner_core.stage_settings import stage_settings
    from tasks.update import grpo_update

    gone = tmp_path / "checkpoints" / "step_0001"
    gone.parent.mkdir(parents=True)
    (gone.parent / "pruned.json").write_text(json.dumps([str(gone)]))
    policy = {"path": str(gone), "hash": "h"}

    @flow
    def update_step_1():
        return grpo_update.task.fn(
            run_dir=str(tmp_path),
            run="r",
            step=1,
            rollouts=[],
            scores=[],
            policy=policy,
            reference=policy,
            grpo_cfg=stage_settings(resolved_recipe(recipe_from_dict(tiny_recipe))[0]).update,
            temperature=1.0,
            dtype="float32",
            precision="fp32",
        )

    with pytest.raises(FileNotFoundError, match=r"step_0001, which the retention policy removed \(run.keep_last"):
        update_step_1()
