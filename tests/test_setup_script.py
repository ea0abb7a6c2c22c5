"""scripts/setup.sh refuses to start an install the disk cannot hold, with a message that says so; scripts/run_tests.sh
sizes its pytest workers from the cores and the memory."""

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _executable(path: Path, body: str) -> None:
    """A shell script at `path` (its folder made) that stands in for a command."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def _run_setup(tmp_path: Path, free_kib: int, with_venv: bool) -> subprocess.CompletedProcess:
    project = tmp_path / "project"
    (project / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup.sh", project / "scripts" / "setup.sh")
    for name in ("requirements.lock", "pyproject.toml"):
        shutil.copy(REPO / name, project / name)
    if with_venv:
        (project / ".venv").mkdir()
    # A df that reports `free_kib` available on every filesystem, in POSIX format.
    _executable(
        tmp_path / "bin" / "df",
        f'echo "Filesystem 1024-blocks Used Available Capacity Mounted on"\necho "fake 100000000 1 {free_kib} 1% /"',
    )
    env = {
        "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin",
        "PYTHON": "false",  # stops the script at `python -m venv`, after the check under test
        "TMPDIR": str(tmp_path),
    }
    if shutil.which("bwrap"):
        env["PATH"] += f":{Path(shutil.which('bwrap')).parent}"
    return subprocess.run(
        ["bash", "scripts/setup.sh"], cwd=project, env=env, capture_output=True, text=True, timeout=60
    )


def test_a_fresh_install_on_a_nearly_full_disk_stops_with_a_clear_error(tmp_path):
    done = _run_setup(tmp_path, free_kib=2 * 1024 * 1024, with_venv=False)
    assert done.returncode == 1
    assert "2048 MiB free" in done.stderr and "needs about 6144 MiB" in done.stderr
    assert "installing pinned packages" not in done.stderr


def test_enough_disk_passes_the_check(tmp_path):
    done = _run_setup(tmp_path, free_kib=50 * 1024 * 1024, with_venv=False)
    assert "installing pinned packages" in done.stderr
    assert "MiB free" not in done.stderr


def test_refreshing_an_existing_venv_needs_less(tmp_path):
    done = _run_setup(tmp_path, free_kib=2 * 1024 * 1024, with_venv=True)
    assert "installing pinned packages" in done.stderr
    done = _run_setup(tmp_path / "again", free_kib=512 * 1024, with_venv=True)
    assert done.returncode == 1 and "needs about 1024 MiB" in done.stderr


def _run_tests_command(tmp_path: Path, cores: int, available_kib: int, *args: str) -> list[str]:
    """The pytest command line scripts/run_tests.sh runs, given `nproc` and `free` answers (a fake setup.sh and a
    .venv/bin/python that prints its arguments stand in for the real ones)."""
    project = tmp_path / "project"
    (project / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "run_tests.sh", project / "scripts" / "run_tests.sh")
    (project / "scripts" / "setup.sh").write_text("exit 0\n")
    _executable(project / ".venv" / "bin" / "python", 'echo "$@"')
    _executable(tmp_path / "bin" / "nproc", f"echo {cores}")
    _executable(  # procps' `free -k` layout
        tmp_path / "bin" / "free",
        "echo '               total        used        free      shared  buff/cache   available'\n"
        f"echo 'Mem:        99999999     1     1     1     1     {available_kib}'\n"
        "echo 'Swap:              0           0           0'",
    )
    done = subprocess.run(
        ["bash", "scripts/run_tests.sh", *args],
        cwd=project,
        env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_one_worker_more_than_cores_as_far_as_memory_allows(tmp_path):
    gib = 1024 * 1024
    assert _run_tests_command(tmp_path / "a", 2, 21 * gib)[:5] == ["-m", "pytest", "-n", "3", "--dist"]
    assert _run_tests_command(tmp_path / "b", 8, 13 * gib)[3] == "3"  # 4 GiB a worker
    assert _run_tests_command(tmp_path / "c", 2, 2 * gib)[3] == "1"  # never none
    extra = _run_tests_command(tmp_path / "d", 2, 21 * gib, "-q", "-n", "1")
    assert extra[-3:] == ["-q", "-n", "1"]  # pytest takes the last -n
