"""A run's temporary folders (refiner_core.runtime.scratch): every process of the run keeps its temporary files in
them, a run that ends removes them, and those of a killed run are removed by the next run of its folder."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from conftest import REPO
from refiner_core.runtime import scratch


@pytest.fixture
def run_dir(tmp_path) -> Path:
    folder = tmp_path / "run"
    folder.mkdir()
    return folder


def test_inside_the_process_and_its_children_use_the_run_folders(run_dir):
    outside = tempfile.gettempdir()
    held = scratch.create(run_dir)
    assert json.loads((run_dir / scratch.RECORD).read_text())["disk"] == held.disk
    assert Path(held.disk).parent == Path(outside) and Path(held.disk).name.startswith("refiner-run-")
    inductor, sockets = os.environ.get("TORCHINDUCTOR_CACHE_DIR"), os.environ.get(scratch.VLLM_SOCKETS_ENV)
    with scratch.in_use(held):
        assert tempfile.gettempdir() == held.disk == os.environ["TMPDIR"] == os.environ[scratch.VLLM_SOCKETS_ENV]
        ray = Path(scratch.short_folder("ray"))  # sockets' paths stay short: beside the folder, not in it
        assert ray == Path(f"{held.disk}-ray") and ray.is_dir()
        if held.ram:
            assert scratch.ram_dir() == held.ram and Path(held.ram).parent == Path("/dev/shm")
        # torch's compile cache outlasts the run: named outside the run's folder
        assert not os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(held.disk)
        child = subprocess.run(
            [sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"], capture_output=True, text=True
        )
        assert child.stdout.strip() == held.disk
    assert tempfile.gettempdir() == outside and os.environ.get("TORCHINDUCTOR_CACHE_DIR") == inductor
    assert os.environ.get(scratch.VLLM_SOCKETS_ENV) == sockets  # the session's, or none
    assert scratch.RAM_DIR_ENV not in os.environ
    folders = held.folders
    assert folders == [held.disk, str(ray), *([held.ram] if held.ram else [])]
    assert scratch.remove(run_dir) == [(folder, 0) for folder in folders]
    assert not any(Path(folder).exists() for folder in folders) and not (run_dir / scratch.RECORD).exists()
    assert scratch.remove(run_dir) == []  # nothing recorded any more


KILLED_WRITER = textwrap.dedent("""
    import os, sys, tempfile
    from pathlib import Path
    from refiner_core.runtime import scratch
    held = scratch.create(Path(sys.argv[1]))
    with scratch.in_use(held):
        exported = Path(tempfile.mkdtemp(prefix="refiner-weights-", dir=scratch.ram_dir()))
        (exported / "model.safetensors").write_bytes(os.urandom(1 << 20))
        Path(tempfile.mkdtemp(prefix="refiner-deepspeed-"), "launch.log").write_text("ranks up")
        print("written", flush=True)
        os.kill(os.getpid(), 9)
""")


def test_folders_of_a_killed_process_are_removed_with_their_sizes(run_dir):
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(run_dir)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL and proc.stdout == "written\n", proc.stderr
    left = scratch.Scratch(**json.loads((run_dir / scratch.RECORD).read_text()))
    folders = left.folders
    weights = next(Path(left.ram or left.disk).glob("refiner-weights-*/model.safetensors"))
    assert weights.stat().st_size == 1 << 20
    removed = dict(scratch.remove(run_dir))
    assert set(removed) == set(folders) and len(folders) == (2 if left.ram else 1)
    assert sum(removed.values()) == (1 << 20) + len("ranks up")
    assert not weights.exists() and not any(Path(folder).exists() for folder in folders)
    assert "MB)" in scratch.describe(list(removed.items()))


def test_only_folders_this_code_made_are_removed(run_dir, tmp_path):
    """A record naming a folder of another name, a link, or a folder on another host removes nothing."""
    keep = tmp_path / "refiner-data"  # not refiner-run-*
    keep.mkdir()
    target = Path(tempfile.mkdtemp(prefix="refiner-run-"))  # a folder this code could have made ...
    link = tmp_path / "refiner-run-link"
    link.symlink_to(target)  # ... reached through a link
    (target / "file").write_text("x")
    try:
        for disk, ram, host in [
            (str(keep), None, socket.gethostname()),
            (str(link), None, socket.gethostname()),
            (str(target), None, "another-host"),
        ]:
            (run_dir / scratch.RECORD).write_text(json.dumps({"disk": disk, "ram": ram, "host": host}))
            assert scratch.remove(run_dir) == []
            assert not (run_dir / scratch.RECORD).exists()
        (run_dir / scratch.RECORD).write_text("{not json")
        assert scratch.remove(run_dir) == [] and not (run_dir / scratch.RECORD).exists()
        assert keep.is_dir() and (target / "file").exists() and link.is_symlink()
    finally:
        shutil.rmtree(target)


LOCK_HOLDER = textwrap.dedent("""
    import sys, time
    from refiner_core.runtime.runlock import run_lock
    with run_lock(sys.argv[1], command="a live run"):
        print("locked", flush=True)
        time.sleep(60)
""")


def test_a_run_with_a_folder_of_its_own_cleans_up_after_killed_runs_beside_it(tmp_path):
    """Scheduled runs get a folder each (runs/{deployment}/{date}-{flow_run_id}), so the cleanup a run does of its
    own folder never reached what a killed one left in its folder: /dev/shm weights stayed for good. A new run
    removes them from every folder beside its own whose run is dead, and leaves a live run's alone."""
    from flows.run_folder import clean_up_after_dead_neighbours

    deployment = tmp_path / "runs" / "nightly"
    killed, live, new = deployment / "20261205-0100-a", deployment / "20261205-0200-b", deployment / "20261205-0300-c"
    for folder in (killed, live):
        folder.mkdir(parents=True)
        (folder / "recipe.yaml").write_text("run: {}\n")
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(killed)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left = scratch.Scratch(**json.loads((killed / scratch.RECORD).read_text())).folders
    in_use = scratch.create(live)
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, str(live)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "locked\n"
        warned = []
        clean_up_after_dead_neighbours(new, warned.append)
        assert left and not any(Path(f).exists() for f in left)
        assert [w.split(":")[0] for w in warned] == [f"removed temporary files left by the killed run of {killed}"]
        assert all(Path(f).exists() for f in in_use.folders)  # the live run's
    finally:
        holder.kill()
        holder.wait()
        scratch.remove(live)


def test_a_neighbour_folder_it_cannot_write_is_left_as_it_is(tmp_path):
    """A neighbour this user may not lock (another user's run, a read-only archive) is warned of and skipped: the
    run goes on. Run as root, the folder is made unwritable by a file where the lock's guard file would go."""
    from flows.run_folder import clean_up_after_dead_neighbours

    archived = tmp_path / "runs" / "nightly" / "old"
    archived.mkdir(parents=True)
    (archived / "recipe.yaml").write_text("run: {}\n")
    (archived / ".lock.guard").mkdir()  # opening it for appending fails (IsADirectoryError), as a read-only one would
    warned = []
    clean_up_after_dead_neighbours(tmp_path / "runs" / "nightly" / "new", warned.append)
    assert [w.split(":")[0] for w in warned] == [f"left {archived} as it is"]
