"""A watchdog for watched work (refiner_core.runtime.progress.Work): while the work shows progress (a bar is open),
progress that stops for `stall_seconds` cancels it with a report of what it was doing and how far it got.

Cancelling is cooperative first: the work's next bar update and every `check_stalled()` raise `Stalled`, and the
hooks it registered (`on_stall`) unblock what it waits on. A thread busy in Python code that neither updates a bar
nor waits on anything with a hook (a loop polling a dead worker) gets `Stalled` raised in it asynchronously; one
blocked inside a single C call (a socket read) gets it when that call returns. Only while the work runs: once it
has ended, nothing is raised in its thread."""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable

from refiner_core.runtime.progress import Stalled, Work


class Watchdog:
    """Checks `work` every `interval` seconds from a daemon thread; `log(report)` is told of a stall."""

    def __init__(
        self,
        work: Work,
        stall_seconds: float,
        log: Callable[[str], None] | None = None,
        interval: float | None = None,
    ):
        self.work, self.stall_seconds, self.log = work, stall_seconds, log
        self.interval = interval if interval is not None else min(max(stall_seconds / 10, 0.05), 5.0)
        self.ended = threading.Event()
        self._lock = threading.Lock()
        self._raised_in_thread = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"watchdog-{work.name}")

    def __enter__(self) -> Watchdog:
        if self.stall_seconds > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:  # from here on nothing is raised in the work's thread
            self.ended.set()
            if self._raised_in_thread:  # raised too late to land: the work ended first
                _async_raise(self.work.thread, None)
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        while not self.ended.wait(self.interval):
            if self.work.watched() and self.work.quiet_seconds() >= self.stall_seconds:
                self._stall()
                return

    def _stall(self) -> None:
        report = self.work.report(self.stall_seconds)
        self.work.stalled = report
        if self.log is not None:
            self.log(report)
        for hook in list(self.work.hooks):
            try:
                hook()
            except Exception:
                logging.getLogger(__name__).warning("a stall hook failed", exc_info=True)
        with self._lock:
            if not self.ended.is_set():
                _async_raise(self.work.thread, Stalled)
                self._raised_in_thread = True


def _async_raise(thread_id: int, exception: type[BaseException] | None) -> None:
    """Raise `exception` in the thread at its next Python instruction (None: withdraw one not raised yet)."""
    pending = ctypes.py_object(exception) if exception is not None else None  # None is passed as NULL
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), pending)
