"""Prefect's temporary API server for one `refiner run`, started so that it cannot outlive the run.

Prefect starts the same server (uvicorn on `prefect.server.api.server:create_app`, SQLite under PREFECT_HOME) by
itself when PREFECT_API_URL is unset, but as a plain child: a run killed with SIGKILL leaves it running. Here it
gets a parent-death signal, its own session (Ctrl-C reaches the run first, which then stops the server) and a
record in RUN_DIR/.procs for the next run to find, and it serves on a socket this process bound and hands down:
a port found free and bound later by the child could be taken in between by any other process (the child would
fail, and the health check would knock on the stranger's door). Importing this module does not import prefect.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from refiner_core.runtime.procs import forget_child, spawn, stop_group

# uvicorn serving Prefect's app on the listening socket whose descriptor is argv[1], as `prefect server start` does
# on a port of its own (`uvicorn --fd` would take the descriptor for a Unix socket).
SERVE_ON_SOCKET = """
import socket, sys, uvicorn
sock = socket.socket(fileno=int(sys.argv[1]))
config = uvicorn.Config("prefect.server.api.server:create_app", factory=True, log_level="error", lifespan="on")
uvicorn.Server(config).run(sockets=[sock])
"""


class TemporaryServerError(RuntimeError):
    pass


def launch_temporary_server(record_dir: Path) -> tuple[subprocess.Popen, str]:
    """Start the server process without waiting for it (it takes seconds: the caller can import meanwhile);
    returns (process, API URL) for `start_temporary_server(..., launched=)`."""
    env = {
        **os.environ,
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": os.environ.get("PREFECT_SERVER_ANALYTICS_ENABLED", "false"),
    }
    with socket.socket() as sock:  # the child holds its own copy; connections queue until it serves
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        port = sock.getsockname()[1]
        proc = spawn(
            [sys.executable, "-c", SERVE_ON_SOCKET, str(sock.fileno())],
            record_dir=record_dir,
            env=env,
            stdin=subprocess.DEVNULL,
            pass_fds=(sock.fileno(),),
        )
    return proc, f"http://127.0.0.1:{port}/api"


def start_temporary_server(
    record_dir: Path, timeout: float | None = None, launched: tuple[subprocess.Popen, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """Wait for GET /api/health of the server `launched` earlier, or of a new one; returns (process, API URL)."""
    timeout = timeout or float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180"))
    proc, url = launched or launch_temporary_server(record_dir)
    try:
        code = wait_healthy(proc, url, time.monotonic() + timeout)
    except BaseException:  # timed out, or interrupted while waiting
        stop_temporary_server(proc, record_dir)
        raise
    if code is not None:
        forget_child(proc.pid, record_dir)
        raise TemporaryServerError(f"the temporary Prefect server exited with code {code} before answering")
    return proc, url


def wait_healthy(proc: subprocess.Popen, url: str, deadline: float) -> int | None:
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
