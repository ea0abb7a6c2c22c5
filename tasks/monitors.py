"""The reward-hacking monitors after each step: the tripped checks (refiner_core/publish/monitors.py) become
monitor_events rows (RUN_DIR/monitors/step=N/monitor_events.parquet, also added to the catalog at once), a warning
line each and a Prefect artifact; the flow then acts on them (`act_on_monitors`: pause or fail).

An event already acted on in an earlier run of the folder (paused and resumed, or failed) is not acted on again:
running a run again after a monitor failed it goes on past that step, and the event stays on record even when a
raised threshold no longer trips it. Nor is one at a step a fork shares with its
parent (outcome 'inherited'): the parent ran that step, and acted on it or went on past it."""

from __future__ import annotations

import shlex
from datetime import UTC, datetime
from pathlib import Path

from prefect import get_run_logger, task

from refiner_core.data.text_safety import markdown_inline
from refiner_core.publish.monitors import tripped
from refiner_core.schema import MONITOR_EVENTS
from refiner_core.stage_settings import stage_view
from refiner_core.store.storage import read_rows, replace_rows, write_table
from tasks.artifacts import artifact_key

ACTED = ("resumed", "failed")  # outcomes of an event that was acted on: not again
INHERITED = "inherited"  # a pause or fail at a step a fork runs as its parent ran it: not acted on in the fork
PAUSE_POLL_SECONDS = 5


class MonitorTripped(RuntimeError):
    """A monitor whose action is 'fail' tripped; running the run again goes on past it."""


def events_path(run_dir: str, step: int) -> Path:
    return Path(run_dir) / "monitors" / f"step={step}" / "monitor_events.parquet"


@task(name="check-monitors", cache_policy=None, persist_result=False, retries=1)
def check_monitors(*, run_dir: str, run: str, step: int, monitors_cfg: dict, inherited: bool = False) -> list[dict]:
    """The monitors that tripped at `step`, as monitor_events rows (written, added to the catalog, logged and shown
    as an artifact). `inherited`: the step is a fork's parent's, whose pauses and fails are not acted on again. Not
    cached: it reads the catalog just published."""
    log = get_run_logger()
    path = events_path(run_dir, step)
    earlier = {r["monitor"]: r for r in read_rows(path)} if path.is_file() else {}
    now = datetime.now(UTC)
    rows = [
        {
            "run": e.run,
            "step": e.step,
            "monitor": e.monitor,
            "value": e.value,
            "threshold": e.threshold,
            "action": e.action,
            "outcome": _outcome(e.action, earlier.get(e.monitor), inherited),
            "detail": e.detail,
            "created_at": now,
        }
        for e in tripped(Path(run_dir) / "catalog.duckdb", step, stage_view("monitors", monitors_cfg))
    ]
    if not rows and not path.is_file():
        return []
    # An event acted on stays on record when it no longer trips (a threshold raised on a rerun): the run did pause
    # or fail there, and lowering the threshold again must not act a second time.
    now_tripped = {row["monitor"] for row in rows}
    acted_before = [r for m, r in earlier.items() if r["outcome"] in ACTED and m not in now_tripped]
    write_table(MONITOR_EVENTS, rows + acted_before, path)
    replace_rows(Path(run_dir) / "catalog.duckdb", {MONITOR_EVENTS.name: [str(path)]}, "step", step)
    for row in rows:
        log.warning(event_line(row))
    if rows:
        from prefect.artifacts import create_markdown_artifact

        create_markdown_artifact(
            events_markdown(run, step, rows),
            key=artifact_key(run, "monitors"),
            description=f"{run}: monitors tripped at step {step}",
        )
    return rows


def _outcome(action: str, earlier: dict | None, inherited: bool) -> str | None:
    """'warned', 'inherited', or what an earlier run of the folder did about the same event; None: still to be acted
    on."""
    if earlier is not None and earlier["outcome"] in ACTED:
        return earlier["outcome"]
    if action == "warn":
        return "warned"
    return INHERITED if inherited else None


def event_line(row: dict) -> str:
    if row["outcome"] == INHERITED:
        acted = " (a step the fork shares with its parent: not acted on again)"
    else:
        acted = f" (already {row['outcome']} in an earlier run)" if row["outcome"] in ACTED else ""
    return (
        f"monitor {row['monitor']} tripped at step {row['step']}: {row['value']:.3g} >= {row['threshold']:g} "
        f"({row['detail']}); action {row['action']}{acted}"
    )


def events_markdown(run: str, step: int, rows: list[dict]) -> str:
    lines = [
        f"### {markdown_inline(run)}: monitors tripped at step {step}",
        "",
        "| monitor | value | threshold | action | detail |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['monitor']} | {r['value']:.3g} | {r['threshold']:g} | {r['action']} | {markdown_inline(r['detail'])} |"
        for r in rows
    ]
    return "\n".join(lines)


def act_on_monitors(run_dir: str, step: int, rows: list[dict], pause_timeout: float) -> None:
    """From the flow: pause the flow run for each 'pause' event (until resumed from the UI or CLI), then fail the run
    for a 'fail' event; the outcome is recorded so that a later run of the folder does not act again."""
    from prefect.flow_runs import pause_flow_run
    from prefect.runtime import flow_run

    log = get_run_logger()
    todo = [r for r in rows if r["outcome"] not in (*ACTED, INHERITED)]
    for row in (r for r in todo if r["action"] == "pause"):
        api = _api_url()
        log.warning(
            "monitor %s: pausing the run at step %d; resume it from the Prefect UI or with `%s`",
            row["monitor"],
            step,
            shlex.join(["prefect", "flow-run", "resume", str(flow_run.id)])
            + (f" (PREFECT_API_URL={api})" if api else ""),
        )
        pause_flow_run(
            timeout=int(pause_timeout), poll_interval=PAUSE_POLL_SECONDS, key=f"monitor-{step}-{row['monitor']}"
        )
        record_outcome(run_dir, step, row["monitor"], "resumed")
    failing = [r for r in todo if r["action"] == "fail"]
    if failing:
        for row in failing:
            record_outcome(run_dir, step, row["monitor"], "failed")
        raise MonitorTripped(
            "; ".join(event_line({**r, "outcome": None}) for r in failing)
            + ". Run the same command again to go on past it (finished stages are cached), or change "
            "monitors.<check>_action / the threshold"
        )


def record_outcome(run_dir: str, step: int, monitor: str, outcome: str) -> None:
    path = events_path(run_dir, step)
    rows = [{**r, "outcome": outcome} if r["monitor"] == monitor else r for r in read_rows(path)]
    write_table(MONITOR_EVENTS, rows, path)
    replace_rows(Path(run_dir) / "catalog.duckdb", {MONITOR_EVENTS.name: [str(path)]}, "step", step)


def _api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or ""
