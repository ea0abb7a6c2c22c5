"""A stage's progress bars, mirrored to the Prefect UI as one progress artifact per task run.

The bars update from the work's own threads; a background thread sends the latest counts to the server every
`interval` seconds, so a slow or unreachable API never slows the work."""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from refiner_core.runtime.progress import listening


class UIProgress:
    def __init__(self, stage: str, interval: float = 2.0):
        self.stage, self.interval = stage, interval
        self.latest: tuple[str, int, int | None, str] | None = None
        self.sent: tuple | None = None
        self.artifact_id = None
        self.stopped = threading.Event()

    def listen(self, label: str, done: int, total: int | None, unit: str) -> None:
        self.latest = (label, done, total, unit)

    def _send(self) -> None:
        latest = self.latest
        if latest is None or latest == self.sent:
            return
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        label, done, total, unit = latest
        percent = 100.0 * min(done / total, 1.0) if total else 0.0
        description = f"{self.stage}: {label} {done}/{total if total is not None else '?'} {unit}"
        if self.artifact_id is None:
            self.artifact_id = create_progress_artifact(percent, description=description)
        else:
            update_progress_artifact(self.artifact_id, percent, description=description)
        self.sent = latest

    def loop(self) -> None:
        while not self.stopped.wait(self.interval):
            self.send()

    def send(self) -> None:
        """The latest counts to the UI, if they changed; a failure is logged at debug level, never raised."""
        try:
            self._send()
        except Exception:
            logging.getLogger("refiner").debug("progress artifact update failed", exc_info=True)


@contextmanager
def ui_progress(stage: str, interval: float = 2.0) -> Iterator[UIProgress]:
    """Mirror the bars of the block to the task run's progress artifact (created at the first bar)."""
    progress = UIProgress(stage, interval)
    # the sender runs in the task run's context, so the artifact belongs to this task run
    sender = threading.Thread(
        target=contextvars.copy_context().run, args=(progress.loop,), daemon=True, name=f"ui-progress-{stage}"
    )
    with listening(progress.listen):
        sender.start()
        try:
            yield progress
        finally:
            progress.stopped.set()
            sender.join()
            progress.send()  # the final counts
