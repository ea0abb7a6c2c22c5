"""Scheduled runs on a real Prefect server: `prefect server start`, a process work pool, `prefect deploy --all`
from the repository's prefect.yaml, `prefect worker start`; a scheduled run of the tiny recipe completes by itself
in its own run folder, and `prefect flow-run retry` of a failed run reruns only its unfinished stages. Called
directly too, the flow that deployments run leaves a run folder like `refiner run`'s, and a failed run logs the
command that retries it."""

from __future__ import annotations

import datetime
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from conftest import REPO, run_cli
from flows.prefect_server import wait_healthy
from refiner_core.runtime.procs import free_port, spawn, stop_group

PREFECT = str(Path(sys.executable).parent / "prefect")
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
OVERRIDES = ["grpo.steps=1", "run.retries=0"]


@pytest.fixture
def prefect_stack(tmp_path):
    """A real Prefect server on a free loopback port with its own PREFECT_HOME; yields (env, start) where
    start(args, name) launches a long-running `prefect ARGS`. Every process started is stopped, group and all."""
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_LOGGING_LEVEL": "INFO",
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5",
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        # a run held back by its deployment's concurrency limit tries again after this (default 30 s)
        "PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS": "5",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    started = []

    def start(args: list[str], name: str) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "w")
        proc = spawn(
            [PREFECT, *args], record_dir=tmp_path / "procs", cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        started.append(proc)
        return proc

    try:
        for _ in range(3):  # `prefect server start` binds the port picked here seconds later: another may take it
            port = free_port()
            env["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
            server = start(["server", "start", "--host", "127.0.0.1", "--port", str(port)], "server")
            exit_code = wait_healthy(server, env["PREFECT_API_URL"], time.monotonic() + 180)
            if exit_code is None:
                break
            log = (tmp_path / "server.log").read_text()
            assert "already in use" in log, f"prefect server exited with {exit_code}:\n{log[-3000:]}"
        else:
            raise AssertionError("every port picked for the prefect server was taken before it bound it")
        yield env, start
    finally:
        for proc in reversed(started):
            stop_group(proc.pid, group=True, grace=10)
            proc.wait(timeout=30)


def prefect_cli(args: list[str], env: dict, timeout: int = 180) -> str:
    result = subprocess.run(
        [PREFECT, "--no-prompt", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"prefect {' '.join(args)}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def wait_final(client, flow_run_id, timeout: float = 420, after: datetime.datetime | None = None):
    """The flow run once it is in a final state (and, with `after`, entered it after that time)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        run = client.read_flow_run(flow_run_id)
        if run.state and run.state.type.value in FINAL and (after is None or run.state.timestamp > after):
            return run
        time.sleep(2)
    raise AssertionError(f"flow run {flow_run_id} not finished after {timeout} s: {run.state}")


def subflow_task_states(client, parent) -> dict[str, str]:
    """Stage name -> state name in the latest pipeline (sub)flow run of a refiner-recipe flow run."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId

    children = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent.id]))
    )
    latest = max(children, key=lambda r: r.created)
    tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[latest.id])))
    return {t.name: t.state.name for t in tasks if not t.name.startswith(("locate-model", "prune-checkpoints"))}


def retry_logged(client, flow_run_id, timeout: float = 30) -> str:
    """The retry command an error line of the flow run ends with (logs reach the server shortly after the state)."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.time() + timeout
    while time.time() < deadline:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        commands = [
            log.message[log.message.index("prefect flow-run retry") :]
            for log in logs
            if log.level == logging.ERROR and "prefect flow-run retry" in log.message
        ]
        if commands:
            return commands[0]
        time.sleep(1)
    raise AssertionError(f"flow run {flow_run_id} logged no retry command")


def run_folder(runs: Path, run) -> Path:
    date = run.expected_start_time.astimezone(datetime.UTC).strftime("%Y%m%d-%H%M")
    return runs / "refiner-tiny" / f"{date}-{str(run.id)[:8]}"


@pytest.fixture
def info_logs():
    """Prefect's INFO lines, as a worker logs them (the test session keeps WARNING; Prefect sets its loggers'
    levels again from the setting while a flow runs)."""
    from prefect.settings import PREFECT_LOGGING_LEVEL, temporary_settings

    prefect_logger = logging.getLogger("prefect")
    level = prefect_logger.level
    with temporary_settings(updates={PREFECT_LOGGING_LEVEL: "INFO"}):
        prefect_logger.setLevel(logging.INFO)
        yield
    prefect_logger.setLevel(level)


def test_a_deployment_run_leaves_a_run_folder_every_command_accepts(prefect_server, info_logs, tmp_path, monkeypatch):
    """A worker's run folder is relative to its working directory; `refiner run` on the same folder (by its
    absolute path) reuses every stage the scheduled run computed."""
    from flows.scheduled import run_recipe
    from refiner_core.config import load_recipe
    from refiner_core.runtime.hardware import resolved_recipe

    monkeypatch.chdir(tmp_path)
    run_recipe(recipe_file=str(REPO / "recipes" / "tiny.yaml"), run_dir="{deployment}/run", overrides=OVERRIDES)
    folder = tmp_path / "manual" / "run"
    ran_with, _ = resolved_recipe(load_recipe(REPO / "recipes" / "tiny.yaml", OVERRIDES))
    assert load_recipe(folder / "recipe.yaml").to_dict() == ran_with.to_dict()
    [log] = (folder / "logs").glob("run-*.log")
    assert "step 0 done" in log.read_text() and "Task run 'grpo-update[step=0]'" in log.read_text()
    for command in (
        ["rescore", str(folder), "--set", "reward.citation_weight=0.5", "--name", "cw05"],
        ["show", str(folder)],
        ["plot", str(folder), "-o", str(tmp_path / "curves.png")],
        ["sql", str(folder), "SELECT DISTINCT reward_version FROM step_rewards ORDER BY 1", "-f", "csv"],
    ):
        code, out, err, _ = run_cli(command, tmp_path)
        assert code == 0, f"refiner {command[0]}: {out}{err}"
    assert out.split() == ["reward_version", "cw05", "train"]
    overrides = [arg for override in OVERRIDES for arg in ("--set", override)]
    code, out, err, _ = run_cli(
        ["run", str(REPO / "recipes" / "tiny.yaml"), *overrides, "--run-dir", str(folder)], tmp_path
    )
    assert code == 0, err[-3000:]
    states = dict(re.findall(r"Task run '([^']+)' - Finished in state (\w+)", err))
    assert {states[stage] for stage in ("prepare-data", "rollout[step=0]", "judge[step=0]", "grpo-update[step=0]")} == {
        "Cached"
    }, states


def test_a_failed_run_logs_the_command_that_retries_it(prefect_server, tmp_path):
    from flows.scheduled import run_recipe

    # a handler of the flow-run logger itself: importing the flow may configure logging anew (caplog's handler on
    # the root logger would then be gone when this test runs first)
    records = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    flow_runs = logging.getLogger("prefect.flow_runs")
    flow_runs.addHandler(handler)
    try:
        state = run_recipe(
            recipe_file="recipes/tiny.yaml",
            run_dir=str(tmp_path / "run"),
            overrides=[*OVERRIDES, "data.path=no/such/file.jsonl"],
            return_state=True,
        )
    finally:
        flow_runs.removeHandler(handler)
    assert state.is_failed() and "nothing was run" in state.message
    command = f"prefect flow-run retry {state.state_details.flow_run_id} --entrypoint flows/scheduled.py:run_recipe"
    assert [r.levelname for r in records if command in r.getMessage()] == ["ERROR"]


def test_an_interrupted_run_logs_the_command_that_retries_it(prefect_server, tmp_path, monkeypatch):
    """Ctrl-C: the run crashes without an exception of its own to log; its on_crashed hook logs the retry (run in
    the flow's process here; a worker runs it for a process it saw killed, below)."""
    from flows.scheduled import run_recipe

    monkeypatch.setenv("REFINER_INTERRUPT_ONCE", "prepare-data")
    records = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    flow_runs = logging.getLogger("prefect.flow_runs")
    flow_runs.addHandler(handler)
    ignored = signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a terminal: xdist ignores it
    try:
        with pytest.raises(KeyboardInterrupt):
            run_recipe(recipe_file="recipes/tiny.yaml", run_dir=str(tmp_path / "run"), overrides=OVERRIDES)
    finally:
        signal.signal(signal.SIGINT, ignored)
        flow_runs.removeHandler(handler)
    [line] = [r.getMessage() for r in records if "prefect flow-run retry" in r.getMessage()]
    assert re.fullmatch(
        r"the run crashed; retry it in its run folder, finished stages cached: prefect flow-run retry "
        r"[0-9a-f-]{36} --entrypoint flows/scheduled\.py:run_recipe",
        line,
    ), line


@pytest.mark.slow
def test_scheduled_run_and_flow_run_retry_on_a_real_server(prefect_stack, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.client.schemas.schedules import IntervalSchedule
    from prefect.settings import PREFECT_API_URL, temporary_settings

    env, start = prefect_stack
    prefect_cli(["work-pool", "create", "refiner", "--type", "process"], env)
    out = prefect_cli(["deploy", "--all"], env, timeout=300)
    assert out.count("successfully created") == 7, out[-3000:]
    runs = tmp_path / "runs"
    parameters = {"run_dir": str(runs / "{deployment}" / "{date}-{flow_run_id}"), "overrides": OVERRIDES}

    with temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"]}), get_client(sync_client=True) as client:
        deployments = {d.name: d for d in client.read_deployments()}
        assert set(deployments) == {
            "refiner-smollm2",
            "refiner-tiny",
            "refiner-answer-only",
            "refiner-instance-rubric",
            "gt-grpo-math",
            "co-rewarding-1",
            "grpo-tcr",
        }
        for d in deployments.values():
            assert d.global_concurrency_limit.limit == 1, f"{d.name}: overlapping runs must wait"
            assert d.work_pool_name == "refiner" and d.entrypoint == "flows/scheduled.py:run_recipe"
            [schedule] = d.schedules
            assert schedule.active == (d.name in ("refiner-smollm2", "refiner-tiny")), d.name
        assert deployments["refiner-smollm2"].schedules[0].schedule.cron == "0 2 * * *"
        tiny = deployments["refiner-tiny"]

        # A short schedule (runs every 2 min from 25 s ahead) with this test's run folder and a one-step run. The
        # scheduler only creates runs still ahead of it, and a loaded machine can delay its passes past the first
        # one: the test takes the first run it created, on the schedule's grid, and then drops the schedule.
        interval = datetime.timedelta(minutes=2)
        due = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=25)
        [schedule_id] = [
            s.id
            for s in client.create_deployment_schedules(
                tiny.id,
                [
                    DeploymentScheduleCreate(
                        schedule=IntervalSchedule(interval=interval, anchor_date=due),
                        active=True,
                        parameters=parameters,
                    )
                ],
            )
        ]
        start(["worker", "start", "--pool", "refiner", "--limit", "1"], "worker")  # as docs/operations.md says

        def ours() -> list:
            return [
                r
                for r in client.read_flow_runs(
                    deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[tiny.id]))
                )
                if r.parameters.get("run_dir") == parameters["run_dir"]
            ]

        deadline, scheduled = time.time() + 180, []
        while not scheduled and time.time() < deadline:
            scheduled = ours()
            time.sleep(2)
        assert scheduled, "the scheduler created no run"
        first = min(scheduled, key=lambda r: r.expected_start_time)
        offset = (first.expected_start_time - due).total_seconds()
        period = interval.total_seconds()
        assert offset > -1 and min(offset % period, -offset % period) < 1, offset  # on the schedule's grid
        deadline = first.expected_start_time.timestamp() + 180
        while client.read_flow_run(first.id).state.type.value not in {"RUNNING", *FINAL}:
            assert time.time() < deadline, "the scheduled run did not start"
            time.sleep(1)
        # the API deletes the schedule's runs not started yet with it; they would start after this test's runs
        client.delete_deployment_schedule(tiny.id, schedule_id)
        # Requested while the scheduled run is going: the deployment's concurrency limit makes it wait. It fails
        # in judge (the fault fires once per run folder); `prefect flow-run retry` then finishes it below.
        # (idempotency keys: a client that retries a request the loaded server was slow to answer would make two)
        failing = client.create_flow_run_from_deployment(
            tiny.id,
            parameters=parameters,
            job_variables={"env": {"REFINER_FAIL_ONCE": "judge@0"}},
            idempotency_key=f"failing-{tmp_path}",
        )
        # and one of another deployment whose process is killed: it waits for the worker's one slot (the
        # deployments' own limits do not hold across deployments), then crashes with no exception of its own to
        # log; the worker sees it crash and logs the retry command
        crashing = client.create_flow_run_from_deployment(
            deployments["refiner-smollm2"].id,
            parameters={**parameters, "recipe_file": "recipes/tiny.yaml"},
            job_variables={"env": {"REFINER_KILL_ONCE": "prepare-data"}},
            idempotency_key=f"crashing-{tmp_path}",
        )
        done = wait_final(client, first.id)
        assert done.state.type.value == "COMPLETED", (tmp_path / "worker.log").read_text()[-4000:]
        folder = run_folder(runs, done)
        with duckdb.connect(str(folder / "catalog.duckdb"), read_only=True) as con:
            assert con.execute("SELECT count(*) FROM steps").fetchone()[0] == 1
            rollouts_uninterrupted = con.execute("SELECT count(*) FROM rollouts").fetchone()[0]
        assert rollouts_uninterrupted > 0
        assert not (folder / ".lock").exists(), "the worker's run released its folder"
        [log] = (folder / "logs").glob("run-*.log")  # a run folder like `refiner run`'s
        assert (folder / "recipe.yaml").exists() and "step 0 done" in log.read_text()

        failed = wait_final(client, failing.id)
        assert failed.start_time >= done.end_time, "two runs of one deployment overlapped"
        assert failed.state.type.value == "FAILED"
        assert "injected fault in stage 'judge'" in failed.state.message
        assert retry_logged(client, failing.id) == f"prefect flow-run retry {failing.id}"
        assert subflow_task_states(client, failed)["judge[step=0]"] == "Failed"
        crashed = wait_final(client, crashing.id)
        assert crashed.state.type.value == "CRASHED", crashed.state
        assert retry_logged(client, crashing.id) == f"prefect flow-run retry {crashing.id}"
        spans = sorted((r.start_time, r.end_time) for r in (done, failed, crashed))
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), f"runs overlapped on one worker: {spans}"
        # The worker sees the run's process exit (status 1) after the run's own final state, and reports a run that
        # is not final by then as crashed: a retry issued before that check would be marked crashed.
        worker_log, deadline = tmp_path / "worker.log", time.time() + 60
        while worker_log.read_text().count("prefect.flow_runs.runner - Process for flow run") < 3:  # the three runs
            assert time.time() < deadline, "the worker did not see the failed run's process exit"
            time.sleep(0.5)
        time.sleep(2)  # the worker's state check follows the exit line
        failed_at = client.read_flow_run(failing.id).state.timestamp
        prefect_cli(["flow-run", "retry", str(failing.id)], env)
        retried = wait_final(client, failing.id, after=failed_at)
        assert retried.state.type.value == "COMPLETED", (tmp_path / "worker.log").read_text()[-4000:]
        states = subflow_task_states(client, retried)
        assert {k: states[k] for k in ("prepare-data", "ingest-rubrics", "rollout[step=0]")} == {
            "prepare-data": "Cached",
            "ingest-rubrics": "Cached",
            "rollout[step=0]": "Cached",
        }, states
        assert states["judge[step=0]"] == "Completed" and states["grpo-update[step=0]"] == "Completed", states
        retried_folder = run_folder(runs, retried)
        assert retried_folder != folder and (retried_folder / ".faults" / "raise-judge@0").exists()
        failed_log, retried_log = sorted((retried_folder / "logs").glob("run-*.log"))
        assert "injected fault in stage 'judge'" in failed_log.read_text() and "step 0 done" in retried_log.read_text()
        with duckdb.connect(str(retried_folder / "catalog.duckdb"), read_only=True) as con:
            assert con.execute("SELECT count(*) FROM rollouts").fetchone()[0] == rollouts_uninterrupted
            assert (
                con.execute(
                    "SELECT count(*) FROM (SELECT DISTINCT run, step, prompt_id, sample_idx FROM rollouts)"
                ).fetchone()[0]
                == rollouts_uninterrupted
            )
        assert sorted(p.name for p in runs.joinpath("refiner-tiny").iterdir()) == sorted(
            [folder.name, retried_folder.name]
        )
        assert (runs / "refiner-smollm2").is_dir()  # the crashed run's folder, under its deployment's name
