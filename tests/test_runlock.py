"""One run per run folder: the lock file, its holder, stale locks, the commands that rewrite a run's catalog, run
folder templates, a SIGTERM that is never lost, two real `refiner run`s."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import REPO, run_cli, sigint_default
from refiner_core.runtime.runlock import (
    BUSY_EXIT_CODE,
    LOCK_NAME,
    RunFolderBusy,
    acquire,
    format_run_dir,
    read_holder,
    release,
    run_lock,
)

HOLD_LOCK = textwrap.dedent("""
    import sys, time
    from refiner_core.runtime.runlock import acquire
    acquire(sys.argv[1], command="holder for a test")
    print("held", flush=True)
    time.sleep(120)
""")


def _hold_in_child(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(run_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_lock_is_taken_released_and_reentrant(tmp_path):
    with run_lock(tmp_path, command="outer") as holder:
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        assert read_holder(tmp_path)["command"] == "outer"
        with run_lock(tmp_path, command="inner"):  # the CLI holds it, then the flow it runs takes it again
            pass
        assert read_holder(tmp_path)["command"] == "outer", "an inner release must not drop the lock"
    assert read_holder(tmp_path) is None and not (tmp_path / LOCK_NAME).exists()


def test_second_process_is_refused_naming_the_holder(tmp_path):
    holder = _hold_in_child(tmp_path)
    try:
        t0 = time.time()
        with pytest.raises(RunFolderBusy) as err:
            acquire(tmp_path)
        assert time.time() - t0 < 2, "refused at once, not after waiting"
        message = str(err.value)
        assert f"in use by PID {holder.pid} on host {socket.gethostname()} since " in message
        assert "(holder for a test)" in message
        assert read_holder(tmp_path)["pid"] == holder.pid, "a refused acquire leaves the holder's lock alone"
    finally:
        holder.kill()
        holder.wait()


def test_stale_lock_of_a_killed_process_is_taken_over_with_a_warning(tmp_path):
    holder = _hold_in_child(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert read_holder(tmp_path)["pid"] == holder.pid  # SIGKILL left the lock behind
    warnings = []
    acquire(tmp_path, command="next run", warn=warnings.append)
    try:
        assert read_holder(tmp_path)["pid"] == os.getpid()
        assert len(warnings) == 1 and f"stale lock of PID {holder.pid}" in warnings[0]
    finally:
        release(tmp_path)


def test_reused_pid_does_not_keep_a_lock_alive(tmp_path):
    """A recorded PID that now belongs to another process (its start time differs) is stale."""
    (tmp_path / LOCK_NAME).write_text(
        json.dumps(
            {"pid": os.getppid(), "host": socket.gethostname(), "identity": "some-boot:123", "started": "earlier"}
        )
    )
    warnings = []
    with run_lock(tmp_path, warn=warnings.append):
        assert len(warnings) == 1


def test_lock_of_another_host_is_refused_with_a_hint(tmp_path):
    (tmp_path / LOCK_NAME).write_text(
        json.dumps(
            {
                "pid": 1,
                "host": "other-machine",
                "identity": "x:1",
                "started": "2026-11-22T08:00:00+0000",
                "command": "refiner run",
            }
        )
    )
    with pytest.raises(
        RunFolderBusy,
        match="in use by PID 1 on host other-machine since 2026-11-22T08:00:00"
        r"\+0000 \(refiner run\); if that run is gone, delete .*\.lock",
    ):
        acquire(tmp_path)


def test_the_flow_itself_refuses_a_folder_in_use(prefect_server, tiny_recipe, tmp_path):
    """What a Prefect worker runs is the flow, not `refiner run`: the flow takes the lock too."""
    from flows.refiner import refiner_pipeline

    run_dir = tmp_path / "run"
    holder = _hold_in_child(run_dir)
    try:
        state = refiner_pipeline(recipe=tiny_recipe, run_dir=str(run_dir), return_state=True)
        assert state.is_failed()
        with pytest.raises(RunFolderBusy, match=f"in use by PID {holder.pid} "):
            state.result()
        assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_NAME, LOCK_NAME + ".guard", LOCK_NAME + ".held"], (
            "no stage ran"
        )
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize(
    "command",
    [
        ["rescore", "{run}", "--set", "reward.citation_weight=0.5"],
        ["judge", "agreement", "{run}", "--labels", "{labels}"],
    ],
)
def test_commands_that_rewrite_the_catalog_refuse_a_folder_in_use(tmp_path, command):
    """`refiner rescore` and `refiner judge agreement` replace catalog.duckdb with a changed copy of it: beside a run
    publishing its catalog, one of the two would drop the rows the other just wrote. They take the run's lock."""
    from typer.testing import CliRunner

    from flows.cli import app
    from refiner_core.publish.catalog import build_catalog

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(REPO / "recipes" / "tiny.yaml", run_dir / "recipe.yaml")
    build_catalog(run_dir / "catalog.duckdb", {})
    catalog = (run_dir / "catalog.duckdb").read_bytes()
    labels = tmp_path / "labels.csv"
    labels.write_text("step,prompt_id,sample_idx,rubric_id,passed\n0,q1,0,pos-0,true\n")
    args = [arg.format(run=run_dir, labels=labels) for arg in command]
    holder = _hold_in_child(run_dir)
    try:
        result = CliRunner().invoke(app, args)
        assert result.exit_code == BUSY_EXIT_CODE, result.output
        assert result.output.startswith(f"error: run folder {run_dir} is in use by PID {holder.pid} ")
        assert read_holder(run_dir)["pid"] == holder.pid
    finally:
        holder.kill()
        holder.wait()
    assert (run_dir / "catalog.duckdb").read_bytes() == catalog
    result = CliRunner().invoke(app, args)  # the folder free: the command runs (nothing to rescore or check here)
    assert result.exit_code == 2, result.output
    assert read_holder(run_dir) is None, "the command gave the lock back"


def test_run_folder_template():
    when = datetime.datetime(2026, 11, 22, 3, 4, 59, tzinfo=datetime.timezone(datetime.timedelta(hours=2)))
    assert (
        format_run_dir(
            "runs/{deployment}/{date}-{flow_run_id}", "refiner-tiny", when, "0f3c2a9b-1111-2222-3333-444455556666"
        )
        == "runs/refiner-tiny/20261122-0104-0f3c2a9b"
    )
    assert format_run_dir("runs/nightly", "d", when, "abc") == "runs/nightly"
    assert format_run_dir("runs/{deployment}/{flow_run_id}", "", None, "") == "runs/manual/local"
    with pytest.raises(
        ValueError,
        match=r"run_dir template 'runs/\{name\}'.*\{deployment\}, \{date\}, "
        r"\{flow_run_id\}",
    ):
        format_run_dir("runs/{name}", "d", when, "abc")


def test_a_deployment_name_fills_one_folder_name_under_the_template():
    """Prefect allows '{', '}' and '..' in deployment names: 'nightly-{gpu}' failed every run (the subflow read the
    filled folder as a template again, KeyError 'gpu'), and '..' put the run folder above runs/ (and the neighbour
    clean-up then scanned the repository's folders). A brace the template itself leaves is refused."""
    template = "runs/{deployment}/{date}-{flow_run_id}"
    for deployment, folder in (
        ("nightly-{gpu}", "nightly-_gpu_"),
        ("..", "__"),
        (".", "_"),
        ("a/b", "a_b"),
        ("tiny 2", "tiny_2"),
        ("crème", "crème"),
    ):
        assert format_run_dir(template, deployment, None, "0f3c2a9b-11").split("/")[:2] == ["runs", folder]
    with pytest.raises(ValueError, match=r"gives 'runs/\{x\}/local': a run folder's name holds no braces"):
        format_run_dir("runs/{{x}}/{flow_run_id}", "d", None, "")


def start_cli(args: list[str], tmp_path: Path, name: str, env: dict | None = None) -> tuple[subprocess.Popen, Path]:
    """`refiner ARGS` started in the background, its stderr in TMP/NAME.err."""
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_LOGGING_LEVEL": "INFO", **(env or {})}
    err = tmp_path / f"{name}.err"
    with open(err, "w") as err_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err_file,
            start_new_session=True,
        )
    return proc, err


SIGTERM_IN_A_FINALIZER = textwrap.dedent("""
    import json, os, signal, sys, time, weakref
    from flows.supervisor import Terminated, _terminate, interrupts_never_lost


    class Resource:
        pass


    def sigterm_during_garbage_collection():
        # os.kill runs the handler before it returns: inside the weakref callback, where CPython drops its exception
        resource = Resource()
        weakref.finalize(resource, os.kill, os.getpid(), signal.SIGTERM)
        del resource


    def failing_finalizer():
        resource = Resource()
        weakref.finalize(resource, int, "not a number")
        del resource


    def wait_for_terminated(seconds=5.0):
        t0 = time.monotonic()
        try:
            time.sleep(seconds)
        except Terminated:
            return round(time.monotonic() - t0, 3)
        return None


    dropped = []
    sys.unraisablehook = lambda unraisable: dropped.append(type(unraisable.exc_value).__name__)
    outer_hook = sys.unraisablehook
    report = {}
    scenario = sys.argv[1]
    if scenario == "plain handler":
        signal.signal(signal.SIGTERM, _terminate)
        sigterm_during_garbage_collection()
        report["terminated_after"] = wait_for_terminated(1.0)
    elif scenario == "run":
        try:
            with interrupts_never_lost():
                failing_finalizer()
                sigterm_during_garbage_collection()
                report["terminated_after"] = wait_for_terminated()
                time.sleep(0.5)  # the run's cleanup: no second Terminated may interrupt it
                report["cleaned_up"] = True
        except Terminated:
            report["cleanup_interrupted"] = True
    elif scenario == "run with prefect's handler":
        from prefect.utilities.engine import capture_sigterm

        with interrupts_never_lost():
            t0 = time.monotonic()
            try:
                with capture_sigterm():
                    sigterm_during_garbage_collection()
                    time.sleep(5)
            except Terminated as terminated:
                report["terminated_after"] = round(time.monotonic() - t0, 3)
                report["from"] = type(terminated.__context__).__name__
    elif scenario == "run, SIGINT":
        resource = Resource()
        weakref.finalize(resource, os.kill, os.getpid(), signal.SIGINT)
        t0 = time.monotonic()
        try:
            with interrupts_never_lost():
                del resource  # Ctrl-C during garbage collection: its KeyboardInterrupt is dropped there
                time.sleep(5)
        except KeyboardInterrupt as interrupt:
            report["interrupted_after"] = round(time.monotonic() - t0, 3)
            report["terminated"] = isinstance(interrupt, Terminated)
    elif scenario == "run ending before the redelivery":
        try:
            with interrupts_never_lost():
                sigterm_during_garbage_collection()
        except Terminated:
            report["terminated_at_the_end"] = True
        time.sleep(0.5)  # a late SIGTERM would kill the process now (default handler)
    report["dropped"] = dropped
    report["restored"] = sys.unraisablehook is outer_hook and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    print(json.dumps(report))
""")


def _report_of(script: str, *args: str) -> dict:
    """The JSON report SCRIPT prints, run in a child process (its signal handlers are its own) with ARGS."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=sigint_default,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _sigterm_in_a_finalizer(scenario: str) -> dict:
    return _report_of(SIGTERM_IN_A_FINALIZER, scenario)


def test_sigterm_raised_inside_a_finalizer_is_lost_with_a_plain_handler():
    """What `interrupts_never_lost` exists for: CPython drops a handler's exception raised in a finalizer."""
    assert _sigterm_in_a_finalizer("plain handler") == {
        "terminated_after": None,
        "dropped": ["Terminated"],
        "restored": False,
    }


def test_sigterm_raised_inside_a_finalizer_still_ends_the_run_once():
    report = _sigterm_in_a_finalizer("run")
    assert report.get("terminated_after") is not None and report["terminated_after"] < 2, report
    assert report.get("cleaned_up") and "cleanup_interrupted" not in report, report
    assert report["dropped"] == ["ValueError"], "other finalizers' errors still reach the previous hook"
    assert report["restored"], "the previous unraisable hook and SIGTERM handler are back after the run"


def test_sigterm_dropped_while_prefects_handler_stands_in_still_ends_the_run():
    """A flow run installs Prefect's SIGTERM handler (TerminationSignal), which chains to the run's own."""
    report = _sigterm_in_a_finalizer("run with prefect's handler")
    assert report.get("terminated_after") is not None and report["terminated_after"] < 2, report
    assert report["from"] == "TerminationSignal" and report["dropped"] == [] and report["restored"], report


def test_ctrl_c_raised_inside_a_finalizer_still_interrupts_the_run():
    report = _sigterm_in_a_finalizer("run, SIGINT")
    assert report.get("interrupted_after") is not None and report["interrupted_after"] < 2, report
    assert report["terminated"] is False and report["dropped"] == [] and report["restored"], report


def test_sigterm_awaiting_redelivery_when_the_run_ends_is_raised_there():
    assert _sigterm_in_a_finalizer("run ending before the redelivery") == {
        "terminated_at_the_end": True,
        "dropped": [],
        "restored": True,
    }


SIGNALS_DURING_A_NATIVE_IMPORT = textwrap.dedent("""
    import json, os, signal, sys, threading, time
    from flows.supervisor import Terminated, _terminate, signals_deferred

    signal.signal(signal.SIGTERM, _terminate)
    importing = threading.Event()
    importing.set()

    def send():  # SIGTERM every 10 ms while torch._dynamo imports triton, whose C++ init calls into Python
        while importing.is_set():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)

    report = {}
    try:
        with signals_deferred():
            sender = threading.Thread(target=send, daemon=True)
            sender.start()
            time.sleep(0.05)
            import torch._dynamo
            importing.clear()
            sender.join()
            report["imported"] = True
    except Terminated:
        report["terminated"] = True
    print(json.dumps(report))
""")


def test_signals_during_a_native_import_are_delivered_after_it():
    """`refiner run` imports torch._dynamo (and so triton) with the signals deferred: SIGTERMs sent all through
    the import are recorded, and one Terminated is raised after it. Raised inside triton's init (which cannot
    unwind a Python exception through its C++ frames), one aborts the process: exit -6, measured by sending a
    single SIGTERM at 10 ms steps into the import."""
    assert _report_of(SIGNALS_DURING_A_NATIVE_IMPORT) == {"imported": True, "terminated": True}


def wait_for_log(proc: subprocess.Popen, err: Path, text: str, timeout: float = 180) -> None:
    """Until the process's stderr shows `text`; fails at once if it exits first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if text in err.read_text():
            return
        if proc.poll() is not None:
            raise AssertionError(f"exited with {proc.returncode} before logging {text!r}:\n{err.read_text()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"no {text!r} after {timeout} s:\n{err.read_text()[-3000:]}")


def test_two_refiner_runs_on_one_folder(tmp_path):
    """The second `refiner run` on a folder in use exits 3 at once naming the first; SIGTERM then ends the first
    cleanly (exit 143): its lock is released and its temporary Prefect server stopped."""
    run_dir = tmp_path / "run"
    # enough steps that the first run is still working when the second is refused and SIGTERM arrives
    args = ["run", str(REPO / "recipes" / "tiny.yaml"), "--run-dir", str(run_dir), "--set", "grpo.steps=40"]
    first, first_err = start_cli(args, tmp_path, "first")
    try:
        wait_for_log(first, first_err, "Beginning flow run")
        [server_record] = list((run_dir / ".procs").glob("*.json"))
        server_pid = json.loads(server_record.read_text())["pid"]
        assert read_holder(run_dir)["pid"] == first.pid

        code, out, err, seconds = run_cli(args, tmp_path)
        assert code == BUSY_EXIT_CODE, err[-2000:]
        assert f"error: run folder {run_dir} is in use by PID {first.pid} on host {socket.gethostname()}" in err
        assert f"(refiner run {REPO / 'recipes' / 'tiny.yaml'})" in err
        assert seconds < 30 and "Flow run" not in err

        first.send_signal(signal.SIGTERM)  # once: a SIGTERM is never lost
        assert first.wait(timeout=60) == 143, first_err.read_text()[-2000:]
        assert "terminated: run the same command again" in first_err.read_text()
        assert read_holder(run_dir) is None
        assert not list((run_dir / ".procs").glob("*.json"))
        assert not Path(f"/proc/{server_pid}").exists()
    finally:
        try:
            os.killpg(first.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_holder_whose_pid_this_host_cannot_see_still_holds_the_folder(tmp_path):
    """A run in another PID namespace with the same host name (a container on a shared volume) records a PID that
    is not running here; its flock on .lock.held says it lives. Once it is gone, the lock is stale."""
    holder = _hold_in_child(tmp_path)
    try:
        record = read_holder(tmp_path)
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        (tmp_path / LOCK_NAME).write_text(json.dumps({**record, "pid": int(dead.stdout)}))  # its PID, as seen here
        with pytest.raises(RunFolderBusy):
            acquire(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    warnings = []
    with run_lock(tmp_path, warn=warnings.append):
        assert len(warnings) == 1 and "stale lock" in warnings[0]
