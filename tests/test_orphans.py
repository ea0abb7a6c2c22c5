"""No orphans: processes a run starts end with it however it ends, or the next run on the folder stops them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from conftest import REPO, run_cli
from refiner_core.runtime import scratch
from refiner_core.runtime.procs import process_identity, stop_leftovers
from test_runlock import start_cli, wait_for_log

SPAWN_AND_WAIT = textwrap.dedent("""
    import subprocess, sys, time
    from refiner_core.runtime.procs import spawn
    child = spawn(["sleep", "300"], record_dir=sys.argv[1], stdout=subprocess.DEVNULL)
    print(child.pid, flush=True)
    time.sleep(300)
""")

SPAWN_PLAIN_AND_EXIT = textwrap.dedent("""
    import subprocess, sys
    from refiner_core.runtime.procs import record_child
    child = subprocess.Popen(["sleep", "300"], start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)  # no parent-death signal
    record_child(sys.argv[1], child.pid, ["sleep", "300"], group=True)
    print(child.pid, flush=True)
""")


def tagged_processes(tag: str) -> list[int]:
    """PIDs of live processes whose environment holds REFINER_TEST_TAG=tag (every descendant of a run inherits it)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if f"REFINER_TEST_TAG={tag}".encode() in environ.split(b"\0") and process_identity(int(proc.name)):
            found.append(int(proc.name))
    return found


def wait_until_gone(pids_fn, timeout: float = 5.0) -> list[int]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        left = pids_fn()
        if not left:
            return []
        time.sleep(0.2)
    return pids_fn()


def test_child_dies_with_its_sigkilled_parent(tmp_path):
    parent = subprocess.Popen(
        [sys.executable, "-c", SPAWN_AND_WAIT, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    child = int(parent.stdout.readline())
    assert process_identity(child) is not None
    assert json.loads((tmp_path / f"{child}.json").read_text())["parent"] == parent.pid
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert wait_until_gone(lambda: [child] if process_identity(child) else []) == []


def test_next_run_stops_recorded_leftovers(tmp_path):
    """A recorded child that escaped the parent-death signal is stopped, group and all; a record whose PID now
    belongs to another process is only dropped."""
    out = subprocess.run(
        [sys.executable, "-c", SPAWN_PLAIN_AND_EXIT, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    leftover = int(out)
    assert process_identity(leftover) is not None, "the plain child outlives its parent"
    unrelated = subprocess.Popen(["sleep", "300"])
    (tmp_path / f"{unrelated.pid}.json").write_text(
        json.dumps(
            {
                "pid": unrelated.pid,
                "identity": "another-boot:1",
                "group": False,
                "host": os.uname().nodename,
                "parent": 1,
                "started": "earlier",
                "cmd": ["sleep"],
            }
        )
    )
    unknown = subprocess.Popen(["sleep", "300"])  # a record made after its child had exited holds no identity
    (tmp_path / f"{unknown.pid}.json").write_text(
        json.dumps({"pid": unknown.pid, "identity": None, "group": False, "host": os.uname().nodename, "parent": 1})
    )
    try:
        stopped = stop_leftovers(tmp_path)
        assert unknown.poll() is None, "a PID whose process cannot be told from the recorded one is not signalled"
        assert [e["pid"] for e in stopped] == [leftover]
        assert wait_until_gone(lambda: [leftover] if process_identity(leftover) else []) == []
        assert unrelated.poll() is None, "a reused PID must not be signalled"
        assert not list(tmp_path.glob("*.json"))
    finally:
        for process in (unrelated, unknown):
            process.kill()
            process.wait()


TORCHRUN_PARENT = textwrap.dedent("""
    import signal, subprocess, sys, time
    from refiner_core.runtime.procs import die_with_parent
    # as the DeepSpeed learner launches its ranks: own session, SIGTERM when the parent dies
    subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1",
                      "--log-dir", sys.argv[2], "--nproc_per_node", "2", sys.argv[1]], start_new_session=True,
                     preexec_fn=die_with_parent(signal.SIGTERM))
    time.sleep(300)
""")


def test_torchrun_and_its_ranks_end_with_a_sigkilled_parent(tmp_path):
    tag = uuid.uuid4().hex
    rank = tmp_path / "rank.py"
    rank.write_text("import sys, time\nprint('rank up', flush=True)\ntime.sleep(300)\n")
    log = tmp_path / "torchrun.log"
    with open(log, "w") as out:
        parent = subprocess.Popen(
            [sys.executable, "-c", TORCHRUN_PARENT, str(rank), str(tmp_path / "elastic")],  # not a /tmp folder
            cwd=REPO,
            env={**os.environ, "REFINER_TEST_TAG": tag},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.time() + 120
        while log.read_text().count("rank up") < 2 and time.time() < deadline:
            time.sleep(0.2)
        assert len(tagged_processes(tag)) == 4, log.read_text()  # parent, torchrun, two ranks
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert wait_until_gone(lambda: tagged_processes(tag), timeout=15) == []
    finally:
        for pid in tagged_processes(tag):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("how", ["SIGKILL from outside", "REFINER_KILL_ONCE"])
def test_killed_run_leaves_no_process_behind(tmp_path, how):
    """SIGKILL of `refiner run` (no cleanup code runs): its temporary Prefect server and anything else it started
    are gone within seconds. The next run on the folder takes over the stale lock and removes the killed run's
    temporary folders, each with a warning."""
    tag = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    args = ["run", str(REPO / "recipes" / "tiny.yaml"), "--run-dir", str(run_dir), "--set", "run.retries=0"]
    env = {"REFINER_TEST_TAG": tag}
    if how == "REFINER_KILL_ONCE":
        env["REFINER_KILL_ONCE"] = "rollout@0"
    proc, err = start_cli(args, tmp_path, "killed", env)
    try:
        if how == "REFINER_KILL_ONCE":
            assert proc.wait(timeout=300) == 137, err.read_text()[-3000:]
            assert "Task run 'prepare-data' - Finished" in err.read_text()
        else:
            wait_for_log(proc, err, "Beginning flow run")
            deadline = time.time() + 60  # and until the flow has made its temporary folders
            while not (run_dir / scratch.RECORD).exists() and time.time() < deadline and proc.poll() is None:
                time.sleep(0.1)
            assert len(tagged_processes(tag)) >= 2, "the run and its temporary Prefect server"
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        assert wait_until_gone(lambda: tagged_processes(tag)) == [], "processes of the killed run still running"
    finally:
        for pid in tagged_processes(tag):
            os.kill(pid, signal.SIGKILL)
    killed_pid = proc.pid
    # its temporary folders stay, recorded in the run folder; weights exported to /dev/shm would be there
    left = scratch.Scratch(**json.loads((run_dir / scratch.RECORD).read_text()))
    left_folders = left.folders
    assert left.disk in left_folders
    Path(left.ram or left.disk, "exported-weights").write_bytes(bytes(1 << 20))

    code, out, err_text, _ = run_cli(args, tmp_path, env={"REFINER_FAIL_ONCE": "rollout@0"})
    assert code == 1, err_text[-3000:]
    assert f"warning: run folder {run_dir.resolve()}: taking over a stale lock of PID {killed_pid}" in err_text
    assert f"removed temporary files left by an earlier run of {run_dir.resolve()}: {left.disk} (" in err_text
    assert "MB)" in err_text
    # the killed run's folders are gone, and the failed run removed its own as it ended
    assert not any(Path(folder).exists() for folder in left_folders)
    assert not (run_dir / scratch.RECORD).exists()


@pytest.mark.slow
def test_sigkilled_run_takes_its_vllm_judge_server_with_it(tmp_path):
    """judge.openai.serve: the run's own vLLM judge server (and its engine process) ends when the run is SIGKILLed;
    the files it leaves are in the run's temporary folder."""
    import httpx

    from refiner_core.runtime.procs import free_port

    tag, port = uuid.uuid4().hex, free_port()
    args = [
        "run",
        str(REPO / "recipes" / "tiny.yaml"),
        "--run-dir",
        str(tmp_path / "run"),
        "--set",
        "grpo.steps=1",
        "--set",
        "judge.engine=openai",
        "--set",
        "judge.openai.serve=true",
        "--set",
        "judge.mode=json",
        "--set",
        f"judge.openai.base_url=http://127.0.0.1:{port}/v1",
        "--set",
        "judge.openai.api_model=tiny-judge",
    ]
    proc, err = start_cli(args, tmp_path, "served", {"REFINER_TEST_TAG": tag})
    try:
        wait_for_log(proc, err, "judge server healthy", timeout=420)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        assert len(tagged_processes(tag)) >= 3, "the run, its Prefect server and the vLLM server"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert wait_until_gone(lambda: tagged_processes(tag), timeout=30) == [], "the judge server outlived its run"
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
        # the server's sockets are in the run's temporary folder, which the next run would remove
        left = scratch.Scratch(**json.loads((tmp_path / "run" / scratch.RECORD).read_text()))
        assert any(path.is_socket() for path in Path(left.disk).iterdir())
        folders = left.folders
        assert [folder for folder, _ in scratch.remove(tmp_path / "run")] == folders
        assert not any(Path(folder).exists() for folder in folders)
    finally:
        for pid in tagged_processes(tag):
            os.kill(pid, signal.SIGKILL)


VLLM_ENGINE_AND_WAIT = textwrap.dedent("""
    import os, sys, time
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the engine core in its own process, as on a GPU
    from refiner_core.config import EngineSettings
    from refiner_core.rollout.vllm_engine import make_vllm_engine
    engine = make_vllm_engine(sys.argv[1], EngineSettings.of(engine="vllm", batch_size=4), progress=False)
    print("ENGINE PROCESSES", *engine.processes, flush=True)
    time.sleep(600)
""")


def test_a_vllm_engines_own_processes_are_stopped_by_the_next_run_after_a_sigkill(tmp_path, tiny_model_path):
    """Where vLLM runs its engine core apart (on a GPU), those processes get no parent-death signal: a run killed
    outright left them holding the GPU's memory share, and the next run's engine could not be built. They are
    recorded for the run folder, so the next run stops them."""
    records = tmp_path / "procs"
    owner = subprocess.Popen(
        [sys.executable, "-c", VLLM_ENGINE_AND_WAIT, str(tiny_model_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "REFINER_PROCS_DIR": str(records)},
    )
    try:
        said = next(line for line in owner.stdout if line.startswith("ENGINE PROCESSES"))
        engine_processes = [int(p) for p in said.split()[2:]]
        assert engine_processes, "the engine core runs in a process of its own"
        assert sorted(int(p.stem) for p in records.glob("*.json")) == sorted(engine_processes)
    finally:
        owner.kill()
        owner.wait()
    time.sleep(2)
    assert any(process_identity(pid) for pid in engine_processes), "they outlive their killed owner"
    stopped = stop_leftovers(records)
    assert sorted(e["pid"] for e in stopped) <= sorted(engine_processes) and stopped
    assert wait_until_gone(lambda: [p for p in engine_processes if process_identity(p)]) == []
