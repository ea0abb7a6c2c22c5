"""Weights never written to a checkpoint (run.save_every): the steps between saves leave their weights only in the
run's live learner, and the policy manifest names them as unsaved."""

from __future__ import annotations

from pathlib import Path

WRITTEN_AT_CLOSE = "weights_hash.txt"  # in a checkpoint written when the run ended: the unsaved hash it holds


def written_at_close(policy: dict) -> bool:
    """Whether weights a manifest names as never saved were written to its checkpoint when the run ended."""
    marker = Path(policy["path"]) / WRITTEN_AT_CLOSE
    return bool(policy.get("unsaved")) and marker.is_file() and marker.read_text().strip() == policy["hash"]


def is_unsaved(policy: dict) -> bool:
    """Weights that live only in the run's learner: `path` names the checkpoint they were not written to
    (unless the run wrote them there as it ended)."""
    return bool(policy.get("unsaved")) and not written_at_close(policy)


def model_folder(policy: dict) -> str:
    """The folder holding the policy's architecture and tokenizer: its checkpoint, or for weights never saved
    the checkpoint (or base model) they were trained from."""
    return policy["model"] if is_unsaved(policy) else policy["path"]
