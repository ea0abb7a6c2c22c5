"""Prefect's temporary API server for one `refiner run`, started so that it cannot outlive the run.

Prefect starts the same server (uvicorn on `prefect.server.api.server:create_app`, SQLite under PREFECT_HOME) by
itself when PREFECT_API_URL is unset, but as a plain child: a run killed with SIGKILL leaves it running. Here it
gets a parent-death signal, its own session (Ctrl-C reaches the run first, which then stops the server) and a
record in RUN_DIR/.procs for the next run to find. Importing this module does not import prefect.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from refiner_core.runtime.procs import forget_child, spawn, stop_group

PORT_IN_USE_EXIT_CODE = 3  # uvicorn's exit code when its port was taken between our check and its bind


class TemporaryServerError(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_temporary_server(record_dir: Path) -> tuple[subprocess.Popen, str]:
    """Start the server process without waiting for it (it takes seconds: the caller can import meanwhile);
    returns (process, API URL) for `start_temporary_server(..., launched=)`."""
    app_dir = Path(importlib.util.find_spec("prefect").origin).parent.parent
    env = {
        **os.environ,
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": os.environ.get("PREFECT_SERVER_ANALYTICS_ENABLED", "false"),
    }
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "uvicorn",
        "--app-dir",
        str(app_dir),
        "--factory",
        "prefect.server.api.server:create_app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "error",
        "--lifespan",
        "on",
    ]
    proc = spawn(cmd, record_dir=record_dir, env=env, stdin=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}/api"


def start_temporary_server(
    record_dir: Path, timeout: float | None = None, launched: tuple[subprocess.Popen, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """Wait for GET /api/health of the server `launched` earlier, or of a new one; returns (process, API URL)."""
    timeout = timeout or float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180"))
    deadline = time.monotonic() + timeout
    while True:
        proc, url = launched or launch_temporary_server(record_dir)
        launched = None  # a retry after a port clash launches anew
        try:
            code = _wait_healthy(proc, url, deadline)
        except BaseException:  # timed out, or interrupted while waiting
            stop_temporary_server(proc, record_dir)
            raise
        if code is None:
            return proc, url
        forget_child(proc.pid, record_dir)
        if code != PORT_IN_USE_EXIT_CODE:
            raise TemporaryServerError(f"the temporary Prefect server exited with code {code} before answering")


def _wait_healthy(proc: subprocess.Popen, url: str, deadline: float) -> int | None:
    """None once the server answers; its exit code if it exits first."""
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            return code
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TemporaryServerError(
        f"the temporary Prefect server did not answer at {url} in time "
        "(raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)"
    )


def stop_temporary_server(proc: subprocess.Popen, record_dir: Path) -> None:
    """Send what Prefect still queues for the server (logs, events), then stop the server."""
    if "prefect" in sys.modules:
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        for worker in (APILogWorker, EventsWorker):
            worker.drain_all(timeout=10)
    # It exits on SIGTERM in well under a second; SQLite survives a kill should it hang, so it gets 3 s, as
    # Prefect gives its own 5 s.
    stop_group(proc.pid, group=True, grace=3.0)
    proc.poll()
    forget_child(proc.pid, record_dir)
