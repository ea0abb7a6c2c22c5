"""Weights never written to a checkpoint (run.save_every): the steps between saves leave their weights only in the
run's live learner, and the policy manifest names them as unsaved. This module is the one place that knows such a
manifest: its shape, the folder to read the architecture from, and when the weights are still intact."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from refiner_core.runtime.live_learner import learner_holds
from refiner_core.store.checkpoints import step_checkpoints

WRITTEN_AT_CLOSE = "weights_hash.txt"  # in a checkpoint written when the run ended: the unsaved hash it holds


@dataclass(frozen=True)
class UnsavedWeights:
    """Weights left in the live learner. A new process cannot have them: it recomputes them (tasks.stage), unless
    the run wrote them to their checkpoint as it ended."""

    path: str  # the step checkpoint they were not written to
    hash: str  # the content hash of their state dict (identity.weights_hash)
    model: str  # the checkpoint (or base model) they were trained from: their architecture and tokenizer

    def manifest(self) -> dict:
        """The policy manifest naming them (stage cache keys hash it: its keys and values never change)."""
        return {"path": self.path, "hash": self.hash, "model": self.model, "unsaved": True}

    @classmethod
    def named_by(cls, manifest: dict) -> UnsavedWeights | None:
        """The unsaved weights a manifest names, else None (a checkpoint on disk)."""
        if not manifest.get("unsaved"):
            return None
        return cls(manifest["path"], manifest["hash"], manifest["model"])

    def written_at_close(self) -> bool:
        """Whether the run wrote them to their checkpoint as it ended (`mark_written_at_close`)."""
        marker = Path(self.path) / WRITTEN_AT_CLOSE
        return marker.is_file() and marker.read_text().strip() == self.hash

    def mark_written_at_close(self, checkpoint: str | Path) -> None:
        """Record in the checkpoint folder being written that it holds these weights."""
        (Path(checkpoint) / WRITTEN_AT_CLOSE).write_text(self.hash)

    def saved_later(self) -> bool:
        """Whether a step checkpoint after the one they were not written to exists in its folder, and the stage
        that wrote it has its result recorded (`mark_recorded`): nothing after it needs them. A checkpoint written
        by an update killed before its result was recorded does not count: that update runs again, from them."""
        path = Path(self.path)
        step = int(path.name.removeprefix("step_"))
        return any(saved > step and recorded(folder) for saved, folder in step_checkpoints(path.parent).items())

    def intact(self, run_dir: str | Path) -> bool:
        """Whether a stage's manifest naming them can still be trusted: the run's live learner holds them, the run
        wrote them as it ended, or a later step checkpoint was saved from them by a recorded update. Else the
        update that made them is recomputed."""
        return learner_holds(run_dir, self.hash) or self.written_at_close() or self.saved_later()


def _record_mark(checkpoint: str | Path) -> Path:
    checkpoint = Path(checkpoint)  # beside the checkpoint: its content hash stays that of the weights
    return checkpoint.parent / f".{checkpoint.name}.recorded"


def mark_recorded(manifest: dict) -> None:
    """A stage's result is recorded: the checkpoint its manifest's `policy` names (when written) is one that
    `saved_later` may count."""
    policy = manifest.get("policy")
    if isinstance(policy, dict) and not policy.get("unsaved") and policy.get("path") and Path(policy["path"]).is_dir():
        _record_mark(policy["path"]).touch()


def recorded(checkpoint: str | Path) -> bool:
    return _record_mark(checkpoint).exists()


def forget_recorded(checkpoint: str | Path) -> None:
    """The checkpoint is being written again: no stage result stands for it until one is recorded."""
    _record_mark(checkpoint).unlink(missing_ok=True)


def is_unsaved(policy: dict) -> bool:
    """Weights that live only in the run's learner: `path` names the checkpoint they were not written to
    (unless the run wrote them there as it ended)."""
    unsaved = UnsavedWeights.named_by(policy)
    return unsaved is not None and not unsaved.written_at_close()


def model_folder(policy: dict) -> str:
    """The folder holding the policy's architecture and tokenizer: its checkpoint, or for weights never saved
    the checkpoint (or base model) they were trained from."""
    return policy["model"] if is_unsaved(policy) else policy["path"]
