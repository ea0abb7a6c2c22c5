"""UnsavedWeights (refiner_core.runtime.unsaved_weights): the policy manifest naming weights left in the live learner
(run.save_every) keeps the shape stage cache keys and run folders already hold, and its weights are intact while the
live learner holds them, once the run wrote them as it ended, or once a later step checkpoint was saved by an
update whose result is recorded."""

from __future__ import annotations

import json

import torch

from refiner_core.runtime import live, live_learner
from refiner_core.runtime.identity import weights_hash
from refiner_core.runtime.unsaved_weights import (
    WRITTEN_AT_CLOSE,
    UnsavedWeights,
    forget_recorded,
    is_unsaved,
    mark_recorded,
    model_folder,
)


class Learner:
    """A learner that holds its weights in this process, as the torch learner does."""

    def __init__(self):
        self.closed = False

    def weights(self):
        return {"w": torch.arange(4, dtype=torch.bfloat16)}

    def close(self):
        self.closed = True


def _unsaved(tmp_path) -> UnsavedWeights:
    checkpoint = tmp_path / "run" / "checkpoints" / "step_0002"
    return UnsavedWeights(str(checkpoint), weights_hash(Learner().weights()), str(tmp_path / "base"))


def test_the_manifest_keeps_its_shape(tmp_path):
    unsaved = _unsaved(tmp_path)
    before = {"path": unsaved.path, "hash": unsaved.hash, "model": unsaved.model, "unsaved": True}  # as written so far
    manifest = unsaved.manifest()
    assert manifest == before and list(manifest) == list(before)
    assert json.dumps(manifest) == json.dumps(before)  # the same bytes in a result record and a cache key
    assert UnsavedWeights.named_by(manifest) == unsaved
    assert UnsavedWeights.named_by({"path": unsaved.path, "hash": "a-checkpoint-hash"}) is None
    assert UnsavedWeights.named_by({**before, "unsaved": False}) is None


def test_weights_never_written_read_their_architecture_from_the_model_they_were_trained_from(tmp_path):
    unsaved = _unsaved(tmp_path)
    assert is_unsaved(unsaved.manifest()) and model_folder(unsaved.manifest()) == unsaved.model
    saved = {"path": unsaved.path, "hash": "a-checkpoint-hash"}
    assert not is_unsaved(saved) and model_folder(saved) == unsaved.path


def test_the_weights_are_damaged_when_nothing_holds_them(tmp_path):
    unsaved = _unsaved(tmp_path)
    (tmp_path / "run" / "checkpoints" / "step_0001").mkdir(parents=True)  # an earlier checkpoint does not help
    assert not unsaved.written_at_close() and not unsaved.saved_later()
    assert not unsaved.intact(tmp_path / "run")


def test_the_weights_are_intact_while_the_live_learner_holds_them(tmp_path):
    unsaved, run_dir = _unsaved(tmp_path), tmp_path / "run"
    live.open_run(run_dir, owner="test")
    try:
        assert live_learner.keep_learner(run_dir, "key", Learner(), unsaved.hash)
        assert unsaved.intact(run_dir)
        live_learner.keep_learner(run_dir, "key", Learner(), "other weights")
        assert not unsaved.intact(run_dir)
    finally:
        live.close_run(run_dir)
    assert not unsaved.intact(run_dir)  # the run closed: its learner went with it


def test_the_weights_are_intact_once_the_run_wrote_them_as_it_ended(tmp_path):
    unsaved, run_dir = _unsaved(tmp_path), tmp_path / "run"
    checkpoint = tmp_path / "run" / "checkpoints" / "step_0002"
    checkpoint.mkdir(parents=True)
    (checkpoint / WRITTEN_AT_CLOSE).write_text("weights-of-another-run")
    assert not unsaved.written_at_close() and not unsaved.intact(run_dir) and is_unsaved(unsaved.manifest())
    unsaved.mark_written_at_close(checkpoint)
    assert (checkpoint / WRITTEN_AT_CLOSE).read_text() == unsaved.hash
    assert unsaved.written_at_close() and unsaved.intact(run_dir)
    assert not is_unsaved(unsaved.manifest()) and model_folder(unsaved.manifest()) == unsaved.path  # a checkpoint now


def test_the_weights_are_intact_once_a_later_checkpoint_was_saved_by_a_recorded_update(tmp_path):
    """A later checkpoint counts once the update that wrote it has its result recorded: one written by an update
    killed before that runs again, and needs these weights."""
    unsaved, run_dir = _unsaved(tmp_path), tmp_path / "run"
    later = run_dir / "checkpoints" / "step_0003"
    later.mkdir(parents=True)
    assert not unsaved.saved_later() and not unsaved.intact(run_dir)
    mark_recorded({"policy": {"path": str(unsaved.path), "hash": "h"}})  # not written: nothing is marked
    mark_recorded({"policy": {"path": "", "hash": "h"}})
    assert not unsaved.saved_later() and not list(later.parent.glob(".*"))
    mark_recorded({"policy": {"path": str(later), "hash": "h"}, "steps": {}})
    assert unsaved.saved_later() and unsaved.intact(run_dir)
    assert sorted(p.name for p in later.iterdir()) == []  # the mark lies beside it: the folder's hash is the same
    forget_recorded(later)  # written again by an update that has not finished
    assert not unsaved.saved_later()


def test_a_run_ending_between_saves_writes_what_its_learner_holds(tmp_path):
    """The registry closes the kept learner: the weights no checkpoint has are written first."""
    unsaved, run_dir = _unsaved(tmp_path), tmp_path / "run"
    learner = Learner()

    def save_at_close():
        checkpoint = tmp_path / "run" / "checkpoints" / "step_0002"
        checkpoint.mkdir(parents=True)
        unsaved.mark_written_at_close(checkpoint)
        return checkpoint

    live.open_run(run_dir, owner="test")
    live_learner.keep_learner(run_dir, "key", learner, unsaved.hash, save_at_close)
    live.close_run(run_dir)
    assert learner.closed and unsaved.written_at_close()
