"""One run per run folder: `RUN_DIR/.lock` names the process using the folder (PID, host, start time).

A second run on a folder in use is refused at once with the holder's details (two runs writing the same
Parquet files would each see the other's outputs as damaged and recompute them). A lock left by a process that
is gone (its PID no longer runs on this host, or now belongs to another process) is stale: it is taken over
with a warning. The holder also keeps an flock on `RUN_DIR/.lock.held` while it runs, which the kernel drops
when the process dies: a holder whose PID this host cannot see (another PID namespace with the same host name, a
container) still counts as alive while it holds it. The check and the write happen under an flock on
`RUN_DIR/.lock.guard`, so two runs starting at the same moment cannot both win. Taking the lock again in the
process holding it is allowed (the CLI takes it, then the flow it runs does), and only the outermost release
removes it.

`format_run_dir` names the folder of a scheduled run from a template (deployment, scheduled date, flow run ID).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from refiner_core.runtime.procs import is_running, process_identity

LOCK_NAME = ".lock"
HELD_NAME = ".lock.held"  # flocked by the holder for as long as it lives
BUSY_EXIT_CODE = 3  # `refiner run` exit code when the run folder is used by another run

_depth: dict[str, int] = {}  # lock path -> nested acquisitions in this process
_held: dict[str, int] = {}  # lock path -> the open .lock.held whose flock this process holds


class RunFolderBusy(RuntimeError):
    """Another live process holds the run folder."""

    def __init__(self, run_dir: Path, holder: dict) -> None:
        self.run_dir, self.holder = run_dir, holder
        what = f" ({holder['command']})" if holder.get("command") else ""
        other_host = holder.get("host") != socket.gethostname()
        hint = (
            f"; if that run is gone, delete {run_dir / LOCK_NAME}"
            if other_host
            else "; wait for it to end or stop it, then run again"
        )
        super().__init__(
            f"run folder {run_dir} is in use by PID {holder.get('pid')} on host {holder.get('host')} "
            f"since {holder.get('started')}{what}{hint}"
        )


def read_holder(run_dir: str | Path) -> dict | None:
    """The lock's holder as recorded, or None when the folder is not locked."""
    try:
        return json.loads((Path(run_dir) / LOCK_NAME).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # torn or foreign content: treated like a lock nobody can be asked about
        return {"pid": None, "host": None, "started": None, "command": "unreadable lock file"}


def _holder_alive(holder: dict, folder: Path) -> bool:
    if holder.get("host") != socket.gethostname():
        return holder.get("host") is not None  # another machine's run cannot be checked: assume it lives
    running = isinstance(holder.get("pid"), int) and is_running(holder["pid"], holder.get("identity"))
    return running or _held_elsewhere(folder)


def _held_elsewhere(folder: Path) -> bool:
    """Whether a live process holds the folder's `.lock.held` flock."""
    try:
        os.close(_hold(folder))  # closing drops the flock this call took
    except BlockingIOError:
        return True
    return False


def _hold(folder: Path) -> int:
    """The open `.lock.held`, flocked by this process; BlockingIOError when another holds it."""
    fd = os.open(folder / HELD_NAME, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _is_me(holder: dict) -> bool:
    return (
        holder.get("host") == socket.gethostname()
        and holder.get("pid") == os.getpid()
        and holder.get("identity") == process_identity(os.getpid())
    )


@contextlib.contextmanager
def _guard(folder: Path) -> Iterator[None]:
    with open(folder / (LOCK_NAME + ".guard"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def acquire(run_dir: str | Path, command: str = "", warn: Callable[[str], None] | None = None) -> dict:
    """Take the run folder's lock or raise RunFolderBusy. Returns the holder record now in the lock."""
    folder = Path(run_dir).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    with _guard(folder):
        holder = read_holder(folder)
        if holder is not None and _is_me(holder):
            _depth[str(path)] = _depth.get(str(path), 0) + 1
            return holder
        if holder is not None and _holder_alive(holder, folder):
            raise RunFolderBusy(folder, holder)
        if holder is not None and warn is not None:
            warn(
                f"run folder {folder}: taking over a stale lock of PID {holder.get('pid')} on host "
                f"{holder.get('host')} since {holder.get('started')} (that process is no longer running)"
            )
        try:
            held = _hold(folder)
        except BlockingIOError:  # a live process holds it without its record (the record was removed)
            raise RunFolderBusy(folder, holder or {"command": f"its {LOCK_NAME} was removed"}) from None
        mine = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "identity": process_identity(os.getpid()),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": command,
        }
        tmp = path.with_name(f"{LOCK_NAME}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(mine))
        os.replace(tmp, path)
        _depth[str(path)] = 1
        _held[str(path)] = held
        return mine


def release(run_dir: str | Path) -> None:
    """Give the lock back; only the outermost release of this process removes the file."""
    folder = Path(run_dir).resolve()
    path = folder / LOCK_NAME
    depth = _depth.get(str(path), 0) - 1
    if depth > 0:
        _depth[str(path)] = depth
        return
    _depth.pop(str(path), None)
    held = _held.pop(str(path), None)
    try:
        if not folder.is_dir():
            return
        with _guard(folder):
            holder = read_holder(folder)
            if holder is not None and _is_me(holder):
                path.unlink(missing_ok=True)
    finally:
        if held is not None:
            os.close(held)  # drops the flock


@contextlib.contextmanager
def run_lock(run_dir: str | Path, command: str = "", warn: Callable[[str], None] | None = None) -> Iterator[dict]:
    """Hold the run folder for the duration of the block (see `acquire`)."""
    holder = acquire(run_dir, command, warn)
    try:
        yield holder
    finally:
        release(run_dir)


RUN_DIR_FIELDS = ("deployment", "date", "flow_run_id")


def format_run_dir(template: str, deployment: str, scheduled: datetime.datetime | None, flow_run_id: str) -> str:
    """The run folder for a flow run from a template such as 'runs/{deployment}/{date}-{flow_run_id}':
    {deployment} is the deployment's name ('manual' outside one), {date} the run's scheduled start in UTC
    (YYYYMMDD-HHMM), {flow_run_id} the first 8 characters of the flow run's ID ('local' outside one). A retry
    of a flow run keeps its ID and scheduled start, so it resumes its folder; a template without fields names
    one folder that every run of the deployment resumes."""
    when = (scheduled or datetime.datetime.now(datetime.UTC)).astimezone(datetime.UTC)
    values = {
        "deployment": folder_name(deployment or "manual"),
        "date": when.strftime("%Y%m%d-%H%M"),
        "flow_run_id": folder_name((str(flow_run_id) or "local")[:8]),
    }
    try:
        folder = template.format(**values)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"run_dir template {template!r}: {e!r}; its fields are {', '.join('{' + f + '}' for f in RUN_DIR_FIELDS)}"
        ) from None
    if "{" in folder or "}" in folder:  # the folder is filled in once; braces would read as fields where passed on
        raise ValueError(f"run_dir template {template!r} gives {folder!r}: a run folder's name holds no braces")
    return folder


def folder_name(value: str) -> str:
    """`value` as one folder name: characters other than letters, digits, '.', '_' and '-' become '_' (a deployment
    named 'a/b', '..' or 'nightly-{gpu}' would name another folder or a template field)."""
    name = re.sub(r"[^\w.-]", "_", value)
    return "_" * len(name) if set(name) <= {"."} else name
