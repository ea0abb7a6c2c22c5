"""Progress of long work: a tqdm bar on the terminal, and the same counts for whoever listens.

refiner_core knows nothing of Prefect: the stage wrapper (tasks/progress.py) listens and mirrors the bars to
the UI and to plain log lines. A bar counts even when tqdm draws nothing (no terminal), so listeners always see the
progress.

Watched work (a stage attempt, `Work`) owns the bars opened in its context, whatever thread updates them: its
listeners see only its bars, and a watchdog (refiner_core.runtime.watchdog) sees when they stop moving. Stalled
work is cancelled cooperatively: its next bar update, and `check_stalled()` in a waiting loop, raise `Stalled`;
hooks registered with `on_stall` unblock what it waits on, and `probing` adds what a liveness check says to the
report (a judge server that is down, a worker that exited)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from tqdm.auto import tqdm

_lock = threading.Lock()


class Stalled(RuntimeError):
    """Watched work made no progress for too long; the message says what it was doing and how far it got."""


class Work:
    """One watched piece of work (a stage attempt): its open bars, when any of them last moved, and, once it
    stalled, why. `thread`: the thread running it (the one a watchdog interrupts)."""

    def __init__(self, name: str, clock: Callable[[], float] = time.monotonic):
        self.name, self.clock = name, clock
        self.thread = threading.get_ident()
        self.started = self.last_progress = clock()
        self.open_bars: list[ProgressBar] = []
        self.last_bar: ProgressBar | None = None
        self.listeners: list[Listener] = []
        self.hooks: list[Callable[[], None]] = []
        self.probes: list[Callable[[], str]] = []
        self.stalled = ""  # the report, once the work stalled: every later bar update raises it

    def moved(self, bar: ProgressBar) -> None:
        with _lock:
            self.last_progress = self.clock()
            self.last_bar = bar
            if bar.closed_at is None and bar not in self.open_bars:
                self.open_bars.append(bar)
            elif bar.closed_at is not None and bar in self.open_bars:
                self.open_bars.remove(bar)
        for listener in list(self.listeners):
            try:
                listener(bar)
            except Exception:  # a listener's trouble (an unreachable UI) must not stop the work
                logging.getLogger(__name__).debug("progress listener failed", exc_info=True)

    def watched(self) -> bool:
        """Whether the work is showing progress now (a bar is open): only then can it stall."""
        return bool(self.open_bars)

    def quiet_seconds(self) -> float:
        return self.clock() - self.last_progress

    def report(self, stall_seconds: float) -> str:
        """What the work was doing and how far it got, and what the liveness probes say."""
        bar = self.open_bars[-1] if self.open_bars else self.last_bar
        doing = f"{bar.label or 'work'} at {bar.position()}" if bar is not None else "no progress shown yet"
        lines = [
            f"{self.name} stalled: no progress for {self.quiet_seconds():.0f} s (run.stall_seconds "
            f"{stall_seconds:g}) while {doing}, {self.clock() - self.started:.0f} s after it started"
        ]
        for probe in list(self.probes):
            try:
                said = probe()
            except Exception as e:  # a probe that fails says so, it does not hide the stall
                said = f"liveness check failed: {type(e).__name__}: {e}"
            if said:
                lines.append(said)
        return "; ".join(lines)


_WORK: ContextVar[Work | None] = ContextVar("progress_work", default=None)
_listeners: list[Listener] = []  # every bar, whichever work owns it


class ProgressBar(tqdm):
    """tqdm that reports every update to the listeners (the judge updates it from several threads) and to the work
    that opened it."""

    def __init__(self, *args, **kwargs):
        self.label = kwargs.get("desc") or ""
        self.done = kwargs.get("initial", 0)
        self.unit_name = kwargs.get("unit", "it")
        self.opened_at, self.closed_at = time.monotonic(), None
        self.work = _WORK.get()
        super().__init__(*args, **kwargs)
        self._tell()

    def update(self, n: float | None = 1):
        with _lock:
            self.done += n or 0
        self._tell()
        if self.work is not None and self.work.stalled:  # cancelled: the working thread stops here
            raise Stalled(self.work.stalled)
        return super().update(n)

    def close(self):
        if self.closed_at is None and hasattr(self, "done"):
            self.closed_at = time.monotonic()
            self._tell()
        return super().close()

    def rate(self) -> float:
        """Units per second since the bar opened."""
        return self.done / max(time.monotonic() - self.opened_at, 1e-9)

    def position(self) -> str:
        """'12/16 seq (75%)', or '12 seq' without a total."""
        if self.total:
            return f"{int(self.done)}/{int(self.total)} {self.unit_name} ({100 * self.done / self.total:.0f}%)"
        return f"{int(self.done)} {self.unit_name}"

    def _tell(self) -> None:
        for listener in list(_listeners):
            try:
                listener(self)
            except Exception:  # a listener's trouble (an unreachable UI) must not stop the work
                logging.getLogger(__name__).debug("progress listener failed", exc_info=True)
        if self.work is not None:
            self.work.moved(self)


Listener = Callable[[ProgressBar], None]


def progress_bar(total: int | None, desc: str, unit: str, disable: bool | None = None) -> ProgressBar:
    """The bar for long loops: drawn on a terminal (disable=None), always (False) or never (True), and always
    reported to listeners."""
    return ProgressBar(total=total, desc=desc, unit=unit, disable=disable, leave=False, dynamic_ncols=True)


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Call `listener` on every bar update inside the block, whichever work owns the bar."""
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)


@contextmanager
def working(work: Work) -> Iterator[Work]:
    """Bars opened inside the block (in this context) belong to `work`."""
    token = _WORK.set(work)
    try:
        yield work
    finally:
        _WORK.reset(token)


def check_stalled() -> None:
    """Raise Stalled when the current work stalled: for loops that wait without updating a bar."""
    work = _WORK.get()
    if work is not None and work.stalled:
        raise Stalled(work.stalled)


@contextmanager
def on_stall(hook: Callable[[], None]) -> Iterator[None]:
    """Inside the block, a stall of the current work calls `hook` (from the watchdog's thread) to unblock what the
    work waits on: stop sending requests, close a connection."""
    with _registered("hooks", hook):
        yield


@contextmanager
def probing(probe: Callable[[], str]) -> Iterator[None]:
    """Inside the block, a stall report of the current work includes what `probe()` says ('' = nothing wrong):
    a server that is down or a worker that exited is reported as such, not as a hang."""
    with _registered("probes", probe):
        yield


@contextmanager
def _registered(kind: str, fn) -> Iterator[None]:
    work = _WORK.get()
    if work is None:
        yield
        return
    with _lock:
        getattr(work, kind).append(fn)
    try:
        yield
    finally:
        with _lock:
            getattr(work, kind).remove(fn)
