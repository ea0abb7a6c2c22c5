"""Progress of long work: a tqdm bar on the terminal, and the same counts for whoever listens.

refiner_core knows nothing of Prefect: the stage wrapper (tasks/progress.py) listens and mirrors the bars to
the UI. A bar counts even when tqdm draws nothing (no terminal), so listeners always see the progress."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tqdm.auto import tqdm

Listener = Callable[[str, int, "int | None", str], None]  # (label, done, total, unit)

_listeners: list[Listener] = []
_lock = threading.Lock()


class ProgressBar(tqdm):
    """tqdm that reports every update to the listeners (the judge updates it from several threads)."""

    def __init__(self, *args, **kwargs):
        self.label = kwargs.get("desc") or ""
        self.done = kwargs.get("initial", 0)
        self.unit_name = kwargs.get("unit", "it")
        super().__init__(*args, **kwargs)
        self._tell()

    def update(self, n: float | None = 1):
        with _lock:
            self.done += n or 0
        self._tell()
        return super().update(n)

    def _tell(self) -> None:
        for listener in list(_listeners):
            try:
                listener(self.label, int(self.done), self.total, self.unit_name)
            except Exception:  # a listener's trouble (an unreachable UI) must not stop the work
                logging.getLogger(__name__).debug("progress listener failed", exc_info=True)


def progress_bar(total: int | None, desc: str, unit: str, disable: bool | None = None) -> ProgressBar:
    """The bar for long loops: drawn on a terminal (disable=None), always (False) or never (True), and always
    reported to listeners."""
    return ProgressBar(total=total, desc=desc, unit=unit, disable=disable, leave=False, dynamic_ncols=True)


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Call `listener` on every bar update inside the block."""
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)
