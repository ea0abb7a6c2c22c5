"""The temporary Prefect server of a `refiner run` holds its port from the moment it is launched."""

from __future__ import annotations

import errno
import socket

import httpx
import pytest

from flows.prefect_server import launch_temporary_server, start_temporary_server, stop_temporary_server


def test_port_is_held_from_launch_and_released_after_stop(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    records = tmp_path / "procs"
    launched = launch_temporary_server(records)
    port = int(launched[1].split(":")[2].split("/")[0])
    try:
        with socket.socket() as other, pytest.raises(OSError) as taken:  # another process's free-port pick
            other.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE
        proc, url = start_temporary_server(records, launched=launched)
        assert httpx.get(f"{url}/health", timeout=5).json() is True
    finally:
        stop_temporary_server(launched[0], records)
    assert launched[0].returncode is not None and not list(records.iterdir())
    with socket.socket() as other:  # no listener left (connections closing may linger: hence SO_REUSEADDR)
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", port))
        other.listen(1)
