"""The watchdog and plain-log progress of stages: work whose bars stop moving for run.stall_seconds fails with what it
was doing and how far it got (a judge server that stopped answering, or went down, is reported as such), its
retry starts afresh; off a terminal, long work logs a progress line at most every run.progress_every seconds."""

from __future__ import annotations

import threading
import time

import pytest
from prefect import flow

from fault_server import FaultServer
from refiner_core.judges.openai_judge import OpenAIJudge
from refiner_core.runtime.http_chat import RetryPolicy
from refiner_core.runtime.progress import Stalled, Work, progress_bar, working
from refiner_core.runtime.watchdog import Watchdog
from tasks import progress
from tasks.progress import LogProgress, progress_line, watched_stage
from tasks.stage import stage


class Lines:
    def __init__(self):
        self.lines: list[str] = []

    def info(self, message: str) -> None:
        self.lines.append(message)

    error = warning = info


def test_work_that_stops_moving_is_stopped_with_what_it_was_doing():
    """A loop that keeps running Python but no longer updates its bar (a loop polling a worker that never answers)
    gets Stalled raised in it, with the bar's label and position."""
    work, reported = Work("rollout[step=3]"), []
    with pytest.raises(Stalled):
        with working(work), Watchdog(work, stall_seconds=0.3, log=reported.append, interval=0.05):
            bar = progress_bar(16, "rollout step 3", "seq", disable=True)
            bar.update(12)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # never moves again
                time.sleep(0.01)
    assert time.monotonic() < deadline
    [report] = reported
    assert report.startswith("rollout[step=3] stalled: no progress for ")
    assert "while rollout step 3 at 12/16 seq (75%)" in report and work.stalled == report


def test_work_that_keeps_moving_or_shows_no_bar_is_left_alone():
    work = Work("update")
    with working(work), Watchdog(work, stall_seconds=0.3, interval=0.05):
        time.sleep(0.6)  # loading models: no bar open, not watched
        bar = progress_bar(20, "update", "mb", disable=True)
        for _ in range(20):
            time.sleep(0.05)
            bar.update(1)
        bar.close()
        time.sleep(0.6)  # writing its files: the bar is closed
    assert work.stalled == ""


def test_a_stall_found_after_the_work_ended_raises_nothing_in_its_thread():
    """The watchdog checks, under its lock, that the work is still running before it raises in the work's thread."""
    work = Work("judge")
    dog = Watchdog(work, stall_seconds=0.1)
    progress_bar(2, "judge", "pair", disable=True)
    dog.ended.set()  # the work has left its block
    dog._stall()
    for _ in range(1000):  # an exception raised in this thread would land here
        pass
    assert work.stalled.startswith("judge stalled")


def _judge(server: FaultServer) -> OpenAIJudge:
    return OpenAIJudge(
        base_url=server.base_url,
        model="fault-judge",
        concurrency=4,
        timeout_seconds=60.0,  # far longer than the stall: the watchdog, not the timeout, ends the wait
        policy=RetryPolicy(0, 0.0, 0.0),
        progress=False,
    )


def _conversations(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"judge answer {i}"}] for i in range(n)]


@pytest.mark.parametrize("goes_down", [False, True], ids=["not-answering", "down"])
def test_a_judge_server_that_stops_answering_fails_the_stage_as_stalled(goes_down):
    """Chat completions hang (GET /models still answers): the judge stage fails after stall_seconds, long before the
    request timeout, saying the server is up but not answering; a server that also went down is reported down."""
    lines = Lines()
    progress.configure(stall_seconds=1.0, progress_every=0)
    try:
        with FaultServer(faults=False) as server:
            judge = _judge(server)
            assert [c.failure for c in judge.complete_detailed(_conversations(3))] == [None] * 3
            server.stopped.set()
            if goes_down:
                threading.Timer(0.3, server.httpd.server_close).start()  # the port closes while requests hang
            started = time.monotonic()
            with pytest.raises(Stalled) as stalled:
                with watched_stage("judge[step=1]", lines):
                    judge.complete_detailed(_conversations(8))
            elapsed = time.monotonic() - started
    finally:
        progress.configure(stall_seconds=1800.0, progress_every=30.0)
    assert elapsed < 15
    report = str(stalled.value)
    assert report.startswith("judge[step=1] stalled: no progress for ") and "judge at 0/8 pair (0%)" in report
    if goes_down:
        assert f"judge server at {server.base_url} is down: it refused the connection" in report
    else:
        assert f"judge server at {server.base_url} is up (GET /models: HTTP 200) but its chat completions" in report
    assert lines.lines == [report]  # logged once, as an error


@stage("stalls-once")
def stalls_once(*, run_dir: str, step: int) -> dict:
    """Its first attempt opens a bar and stops moving; the retry runs afresh and finishes."""
    marker = f"{run_dir}/attempts"
    with open(marker, "a") as f:
        f.write("attempt\n")
    bar = progress_bar(4, "stalling work", "item", disable=True)
    bar.update(1)
    if open(marker).read().count("attempt") == 1:
        while True:
            time.sleep(0.01)
    bar.update(3)
    bar.close()
    return {"attempts": open(marker).read().count("attempt")}


@flow
def runs_the_stalling_stage(run_dir: str) -> dict:
    return stalls_once.with_options(retries=1, retry_delay_seconds=0)(run_dir=run_dir, step=0)


def test_a_stalled_stage_is_retried_afresh(prefect_server, tmp_path):
    progress.configure(stall_seconds=0.5, progress_every=0)
    try:
        manifest = runs_the_stalling_stage(str(tmp_path))
    finally:
        progress.configure(stall_seconds=1800.0, progress_every=30.0)
    assert manifest["attempts"] == 2


def test_progress_lines_come_at_most_every_progress_every_seconds():
    now = [0.0]
    lines: list[str] = []
    log = LogProgress(30.0, lines.append, clock=lambda: now[0])
    bar = progress_bar(10, "eval step 3", "seq", disable=True)
    for t, done in ((0, 0), (10, 1), (31, 2), (40, 3), (62, 4)):
        now[0] = t
        bar.done = done
        log.listen(bar)
    assert len(lines) == 2  # at 31 s and 62 s
    bar.opened_at = time.monotonic() - 20.0  # 4 seq in 20 s: 0.2 seq/s, 6 left: 30 s
    assert progress_line(bar) == "eval step 3: 4/10 seq (40%), 0.2 seq/s, ETA 30 s"
    short = progress_bar(3, "short", "seq", disable=True)
    quick = LogProgress(30.0, lines.append, clock=lambda: now[0])
    for done in range(3):
        short.done = done
        quick.listen(short)
    assert len(lines) == 2  # work done sooner than progress_every logs nothing


def test_progress_lines_are_logged_off_a_terminal_only():
    for terminal, expected in ((False, True), (True, False)):
        lines = Lines()
        progress.configure(stall_seconds=0, progress_every=0.05, terminal=terminal)
        try:
            with watched_stage("sft", lines):
                bar = progress_bar(3, "sft", "step", disable=True)
                for _ in range(3):
                    time.sleep(0.1)
                    bar.update(1)
                bar.close()
        finally:
            progress.configure(stall_seconds=1800.0, progress_every=30.0)
        assert any(line.startswith("sft: ") and "step/s" in line for line in lines.lines) == expected
