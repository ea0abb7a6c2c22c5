"""Child processes that end with the run that started them.

Each server or launcher a run starts gets a parent-death signal (Linux `PR_SET_PDEATHSIG`): when the run's
process ends in any way, SIGKILL included, the kernel signals the child. Each is also recorded in the run folder
(`RUN_DIR/.procs/<pid>.json`, with its process group), so that where that signal is unavailable or a child
escaped it, the next run on the folder stops what is left (`stop_leftovers`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

PROCS_DIR_ENV = "REFINER_PROCS_DIR"  # where spawned children are recorded; set by the run for its folder
_PR_SET_PDEATHSIG = 1


def _load_prctl():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):  # not Linux: only the recorded PIDs protect against leftovers
        return None


_PRCTL = _load_prctl()  # looked up before any fork: the child runs no import machinery


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A `preexec_fn` that makes the child receive `sig` when the process that started it ends
    (None where the platform has no parent-death signal)."""
    if _PRCTL is None:
        return None
    parent = os.getpid()

    def arm() -> None:
        _PRCTL(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork and prctl: nobody will signal us
            os.kill(os.getpid(), sig)

    return arm


def process_identity(pid: int) -> str | None:
    """'boot id:start time' of a running process (start time in clock ticks since boot, from /proc), so a PID
    reused by an unrelated process is not mistaken for the one recorded; None if no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        state, start = stat.rsplit(")", 1)[1].split()[0], stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return f"pid:{pid}"  # no /proc: liveness only
    if state in ("Z", "X"):  # exited, not yet reaped by its parent
        return None
    return f"{_boot_id()}:{start}"


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def is_running(pid: int, identity: str | None) -> bool:
    """True while the process recorded as (pid, identity) is still the one running under that PID."""
    current = process_identity(pid)
    return current is not None and (identity is None or current == identity or current.startswith("pid:"))


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for a child to bind: another process may take it before the child does, so a
    caller that can bind the socket itself and hand it down should (flows/prefect_server.py)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def spawn(
    cmd: list[str],
    *,
    record_dir: str | Path | None = None,
    death_signal: int = signal.SIGKILL,
    new_session: bool = True,
    **popen_kwargs,
) -> subprocess.Popen:
    """Popen that ends with this process (parent-death signal) and, in its own session by default so its whole
    group can be signalled, is recorded in `record_dir` (default: $REFINER_PROCS_DIR, if set)."""
    proc = subprocess.Popen(
        cmd, preexec_fn=die_with_parent(death_signal), start_new_session=new_session, **popen_kwargs
    )
    record_dir = record_dir or os.environ.get(PROCS_DIR_ENV)
    if record_dir:
        record_child(record_dir, proc.pid, cmd, group=new_session)
    return proc


def record_child(record_dir: str | Path, pid: int, cmd: list[str], group: bool) -> Path:
    folder = Path(record_dir)
    folder.mkdir(parents=True, exist_ok=True)
    entry = {
        "pid": pid,
        "identity": process_identity(pid),
        "group": group,
        "host": socket.gethostname(),
        "parent": os.getpid(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cmd": cmd[:8],
    }
    path = folder / f"{pid}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entry))
    os.replace(tmp, path)
    return path


def forget_child(pid: int, record_dir: str | Path | None = None) -> None:
    """Drop the record of a child that was stopped or exited normally."""
    record_dir = record_dir or os.environ.get(PROCS_DIR_ENV)
    if record_dir:
        (Path(record_dir) / f"{pid}.json").unlink(missing_ok=True)


def stop_group(pid: int, group: bool = True, grace: float = 10.0) -> None:
    """SIGTERM the process (its whole group when it leads one), then SIGKILL what is left after `grace` s."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig) if group else os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            _reap(pid)
            if process_identity(pid) is None and not (group and _group_alive(pid)):
                return
            time.sleep(0.1)


def _reap(pid: int) -> None:
    """A child of ours that has exited stays a zombie (still 'running' to kill(pid, 0)) until it is waited for."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not our child: its own parent reaps it
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def stop_leftovers(record_dir: str | Path) -> list[dict]:
    """Stop the recorded children of earlier runs that are still running on this host (the record's PID and
    start time must both match) and drop their records; this process's own records stay. Returns the entries
    that were stopped."""
    folder = Path(record_dir)
    stopped = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            path.unlink(missing_ok=True)
            continue
        if entry.get("parent") == os.getpid() and entry.get("host") == socket.gethostname():
            continue  # this process's own children
        pid, group = entry["pid"], entry.get("group", False)
        # A group outlives its dead leader's PID: the kernel does not reuse a PID still naming a process group.
        # A record without an identity (the child had exited when it was recorded) cannot tell its process from
        # one that took the PID since: only its group, if it still has one, is stopped.
        identity = entry.get("identity")
        leftover = (identity is not None and is_running(pid, identity)) or (
            group and process_identity(pid) is None and _group_alive(pid)
        )
        if entry.get("host") == socket.gethostname() and leftover:
            stop_group(pid, group)
            stopped.append(entry)
        path.unlink(missing_ok=True)
    return stopped
