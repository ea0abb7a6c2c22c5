"""The learner a run keeps live across its steps (policy, reference and optimizer state in memory): taken by the
next update when it was built with the same settings and holds the weights the update starts from, lent to a rollout
engine that copies its weights, and, holding weights no checkpoint has (run.save_every), written out when the run
ends before a save."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refiner_core.runtime.identity import model_identity
from refiner_core.runtime.live import LOCK, LiveRun, run_of
from refiner_core.store.storage import json_hash

log = logging.getLogger(__name__)


@dataclass
class KeptLearner:
    key: str
    learner: Any
    weights_hash: str  # the checkpoint its in-memory weights were saved as
    # For weights never written (run.save_every): writes them to the checkpoint their manifest names, marked as
    # written at close (unsaved_weights), when the run ends before a save (SIGTERM, Ctrl-C, a failed stage).
    save_at_close: Callable[[], Any] | None = None
    # The update that made these weights (a hash of its inputs) and the manifest it returned: an attempt that failed
    # after it finished (its result never stored) is retried with that result, not from weights no longer held.
    made_by: str = ""
    result: dict | None = None
    # An update that trained these weights and then failed writing its outputs: what writing them needs, for its
    # retry (weights_hash is then empty: no checkpoint names these weights, no engine or other update takes them).
    trained: Any = None

    def close(self) -> None:
        """The run ends: weights no checkpoint holds are written first, then the learner is closed."""
        self._save_unsaved()
        self.learner.close()

    def _save_unsaved(self) -> None:
        """The run ends holding weights no checkpoint has: write them, so a rerun resumes from them rather than
        recomputing the updates since the last save. A failure here is logged, not raised: the run is ending
        anyway, and the rerun recomputes."""
        if self.save_at_close is None:
            return
        try:
            path = self.save_at_close()
            log.warning(
                "run ended between saves (run.save_every): weights %s written to %s", self.weights_hash[:20], path
            )
        except Exception as e:  # logged, not raised: the rerun recomputes those steps
            log.warning(
                "run ended between saves and its unsaved weights could not be written (%s: %s); a rerun "
                "recomputes the steps since the last checkpoint",
                type(e).__name__,
                e,
            )


def learner_key(kind: str, policy_path: str | Path, reference: dict, settings, dtype: str) -> str:
    return json_hash(
        [
            kind,
            model_identity(policy_path),
            reference["path"],
            reference["hash"],
            json.loads(json.dumps(dataclasses.asdict(settings), default=list)),
            dtype,
        ]
    )


def take_learner(run_dir: str | Path, key: str, policy_hash: str):
    """The run's live learner when it was built with `key` and its weights are the checkpoint `policy_hash`
    names, else None (build one); take_kept's learner."""
    kept = take_kept(run_dir, key, policy_hash)
    return kept.learner if kept else None


def take_kept(run_dir: str | Path, key: str, policy_hash: str, made_by: str = "") -> KeptLearner | None:
    """The run's live learner and its record when it was built with `key` and its weights are the checkpoint
    `policy_hash` names, or were trained by the update `made_by` names before writing its outputs failed (the
    record's `trained`); else None. It leaves the registry until `keep_learner` puts it back, so a step that fails
    halfway (weights half-updated) is never reused."""
    run = run_of(run_dir)
    if run is None:
        return None
    with LOCK:
        LOCK.wait_for(lambda: not run.lending)
        kept, run.learner = run.learner, None
    if kept is not None and kept.key == key:
        if kept.trained is None and kept.weights_hash == policy_hash:
            return kept
        if kept.trained is not None and made_by and kept.made_by == made_by:
            return kept
    if kept is not None:  # other settings or other weights: never used again
        kept.learner.close()
    return None


def finished_update(run_dir: str | Path, key: str, made_by: str) -> dict | None:
    """The manifest of the update `made_by` names when the run's live learner (built with `key`) holds its
    weights: an earlier attempt of that update finished, then failed before its result was stored."""
    run = run_of(run_dir)
    with LOCK:
        kept = run.learner if run is not None else None
        if kept is None or kept.key != key or not made_by or kept.made_by != made_by:
            return None
        return kept.result


def keep_learner(
    run_dir: str | Path,
    key: str,
    learner,
    weights_hash: str,
    save_at_close: Callable[[], Any] | None = None,
    made_by: str = "",
    result: dict | None = None,
    trained: Any = None,
) -> KeptLearner | None:
    """After the learner's weights were saved as the checkpoint `weights_hash` names: keep it for the next step
    (learners that hold their weights in this process, i.e. offer `weights()`). Returns its record, None where not
    kept. `save_at_close` writes weights that no checkpoint holds yet, should the run end first; `made_by` and
    `result`: the update that made the weights and its manifest (finished_update); `trained`: that update's training
    step, when writing its outputs failed (take_kept). A learner that says it is no longer alive (DeepSpeed ranks
    that exited) is not kept: a retry builds a new one."""
    run = run_of(run_dir)
    if run is None or not hasattr(learner, "weights") or not getattr(learner, "alive", True):
        return None
    kept = KeptLearner(key, learner, weights_hash, save_at_close, made_by, result, trained)
    with LOCK:
        run.learner = kept
    return kept


def keeps_learner(run_dir: str | Path, learner) -> bool:
    """Whether `keep_learner` would keep this learner: the run keeps engines and the learner's weights live here."""
    return run_of(run_dir) is not None and hasattr(learner, "weights")


def learner_holds(run_dir: str | Path, weights_hash: str) -> bool:
    """Whether the run's live learner holds these weights (the learner is out of the registry while it trains)."""
    run = run_of(run_dir)
    with LOCK:
        return run is not None and run.learner is not None and run.learner.weights_hash == weights_hash


@contextmanager
def lent_learner(run: LiveRun, weights_hash: str):
    """The live learner when it holds exactly the checkpoint `weights_hash` names, else None. Until the block
    ends no update takes it (`take_learner` waits), so its weights are not changed while they are copied."""
    with LOCK:
        kept = run.learner
        if kept is None or kept.weights_hash != weights_hash:
            kept = None
        else:
            run.lending += 1
    try:
        yield kept.learner if kept else None
    finally:
        if kept:
            with LOCK:
                run.lending -= 1
                LOCK.notify_all()
