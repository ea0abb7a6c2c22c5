"""A stage's progress: its bars mirrored to the Prefect UI (one progress artifact per task run), as plain log lines
when no terminal draws them, and watched for stalls.

The bars update from the work's own threads; a background thread sends the latest counts to the server every
`interval` seconds, so a slow or unreachable API never slows the work. Only the stage's own bars count (a rollout
sampled ahead beside it has its own). The run's settings (run.stall_seconds, run.progress_every) are set once per
run by the flow (`configure`); they change no stage's result, so no cache key holds them."""

from __future__ import annotations

import contextvars
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from refiner_core.config import RunConfig
from refiner_core.runtime.progress import ProgressBar, Stalled, Work, working
from refiner_core.runtime.watchdog import Watchdog


@dataclass
class WatchSettings:
    stall_seconds: float = RunConfig.stall_seconds
    progress_every: float = RunConfig.progress_every
    terminal: bool | None = None  # None: whether stderr is a terminal (where tqdm draws the bars)


SETTINGS = WatchSettings()


def configure(stall_seconds: float, progress_every: float, terminal: bool | None = None) -> None:
    """The run's watch settings, for every stage it runs from now on."""
    global SETTINGS
    SETTINGS = WatchSettings(stall_seconds, progress_every, terminal)


class UIProgress:
    def __init__(self, stage: str, interval: float = 2.0):
        self.stage, self.interval = stage, interval
        self.latest: tuple[str, int, int | None, str] | None = None
        self.sent: tuple | None = None
        self.artifact_id = None
        self.stopped = threading.Event()

    def listen(self, bar: ProgressBar) -> None:
        self.latest = (bar.label, int(bar.done), bar.total, bar.unit_name)

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


class LogProgress:
    """A log line per open bar at most every `every` seconds: 'rollout step 3: 12/16 seq (75%), 0.8 seq/s, ETA
    5 s'. A bar done sooner than `every` logs nothing."""

    def __init__(self, every: float, log: Callable[[str], None], clock: Callable[[], float] = time.monotonic):
        self.every, self.log, self.clock = every, log, clock
        self.last: dict[int, float] = {}  # bar -> when its last line was logged (or it opened)

    def listen(self, bar: ProgressBar) -> None:
        now = self.clock()
        last = self.last.setdefault(id(bar), now)
        if bar.closed_at is not None:
            self.last.pop(id(bar), None)
            return
        if now - last < self.every:
            return
        self.last[id(bar)] = now
        self.log(progress_line(bar))


def progress_line(bar: ProgressBar) -> str:
    rate = bar.rate()
    left = (bar.total or 0) - bar.done
    eta = f", ETA {_duration(left / rate)}" if left > 0 and rate > 0 else ""
    return f"{bar.label or 'progress'}: {bar.position()}, {rate:.3g} {bar.unit_name}/s{eta}"


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 60} min {seconds % 60} s" if seconds >= 60 else f"{seconds} s"


@contextmanager
def watched_stage(
    name: str, log: logging.Logger | logging.LoggerAdapter, stage: str = "", interval: float = 2.0
) -> Iterator[Work]:
    """The block is one attempt (`name`, e.g. 'judge[step=3]') of `stage`: its bars go to the UI, to plain log lines
    off a terminal (at most every run.progress_every seconds) and to a watchdog that fails the attempt when they stop
    moving for run.stall_seconds (Stalled, with what it was doing and how far it got; retried like any failure)."""
    from prefect.context import TaskRunContext

    settings = SETTINGS
    work = Work(name)
    ui = UIProgress(stage or name, interval)
    if TaskRunContext.get() is not None:  # a stage called outside Prefect has no UI to mirror to
        work.listeners.append(ui.listen)
    terminal = sys.stderr.isatty() if settings.terminal is None else settings.terminal
    if settings.progress_every > 0 and not terminal:
        work.listeners.append(LogProgress(settings.progress_every, log.info).listen)
    # the sender runs in the task run's context, so the artifact belongs to this task run
    sender = threading.Thread(
        target=contextvars.copy_context().run, args=(ui.loop,), daemon=True, name=f"ui-progress-{name}"
    )
    sender.start()
    try:
        with working(work), Watchdog(work, settings.stall_seconds, log=log.error):
            yield work
    except Exception:
        if work.stalled:  # however the cancelled work ended (Stalled raised without its report, a closed
            raise Stalled(work.stalled) from None  # connection's error), the attempt failed as stalled
        raise
    else:
        if work.stalled:  # results made while cancelled (requests refused by a stall hook) are not kept
            raise Stalled(work.stalled)
    finally:
        ui.stopped.set()
        sender.join()
        ui.send()  # the final counts
