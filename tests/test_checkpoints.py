"""Checkpoint retention by hand-computed cases, on real folders."""

from __future__ import annotations

from pathlib import Path

from refiner_core.store.checkpoints import forget_pruned, prune, pruned_paths, retained_steps, step_checkpoints


def test_retained_steps():
    steps = [1, 2, 3, 4, 5]
    assert retained_steps(steps, 5, keep_last=2, keep_every=0) == {4, 5}
    assert retained_steps(steps, 5, keep_last=1, keep_every=2) == {2, 4, 5}
    assert retained_steps(steps, 3, keep_last=1, keep_every=0) == {3, 4, 5}  # later steps are not judged
    assert retained_steps(steps, 5, keep_last=0, keep_every=0) == set(steps)  # 0 keeps every checkpoint


def _checkpoint(folder: Path, step: int) -> Path:
    path = folder / f"step_{step:04d}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"w" * 10)
    (path / "optimizer.pt").write_bytes(b"o" * 20)
    return path


def test_prune_keeps_weights_of_kept_steps_and_optimizer_state_of_the_newest_only(tmp_path):
    (tmp_path / "sft").mkdir()
    for step in range(1, 6):
        _checkpoint(tmp_path, step)
    removed = prune(tmp_path, newest=5, keep_last=2, keep_every=0)
    assert sorted(Path(p).name for p in removed) == ["step_0001", "step_0002", "step_0003"]
    assert sorted(step_checkpoints(tmp_path)) == [4, 5]
    assert (tmp_path / "sft").is_dir()
    assert not (tmp_path / "step_0004" / "optimizer.pt").exists()
    assert (tmp_path / "step_0004" / "model.safetensors").exists()
    assert (tmp_path / "step_0005" / "optimizer.pt").exists()
    assert pruned_paths(tmp_path) == set(removed)
    forget_pruned(tmp_path, Path(removed[0]))
    assert pruned_paths(tmp_path) == set(removed[1:])


def test_a_kill_while_pruning_leaves_the_folders_listed_as_pruned(tmp_path, monkeypatch):
    """The folders were deleted before they were listed: a kill in between left a checkpoint gone but unlisted,
    which a rerun took for damaged and recomputed from the checkpoint before it (pruned too: the run failed for
    good; kept: its optimizer state was gone and the rerun diverged). Now they are listed first; the next prune
    removes what is left of them."""
    from refiner_core.store import checkpoints

    for step in range(1, 6):
        _checkpoint(tmp_path, step)

    def killed(path, *args, **kwargs):
        raise KeyboardInterrupt  # the process ends here

    monkeypatch.setattr(checkpoints.shutil, "rmtree", killed)
    try:
        prune(tmp_path, newest=5, keep_last=2, keep_every=0)
    except KeyboardInterrupt:
        pass
    assert pruned_paths(tmp_path) == {str(tmp_path / f"step_{s:04d}") for s in (1, 2, 3)}
    monkeypatch.undo()
    prune(tmp_path, newest=5, keep_last=2, keep_every=0)
    assert sorted(step_checkpoints(tmp_path)) == [4, 5]
