"""scripts/setup.sh refuses to start an install the disk cannot hold, with a message that says so."""

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run_setup(tmp_path: Path, free_kib: int, with_venv: bool) -> subprocess.CompletedProcess:
    project = tmp_path / "project"
    (project / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup.sh", project / "scripts" / "setup.sh")
    for name in ("requirements.lock", "pyproject.toml"):
        shutil.copy(REPO / name, project / name)
    if with_venv:
        (project / ".venv").mkdir()
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    # A df that reports `free_kib` available on every filesystem, in POSIX format.
    (fake_bin / "df").write_text(
        "#!/bin/sh\n"
        'echo "Filesystem 1024-blocks Used Available Capacity Mounted on"\n'
        f'echo "fake 100000000 1 {free_kib} 1% /"\n'
    )
    (fake_bin / "df").chmod(0o755)
    env = {
        "PATH": f"{fake_bin}:/usr/bin:/bin",
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
