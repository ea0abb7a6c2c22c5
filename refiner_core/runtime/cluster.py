"""Ray for a run (run.ray_address): where the run's rollout engines are placed when there are several.

'' (the default) uses no Ray. 'local' starts a Ray instance on this machine for the run and stops it when the run
ends, as the temporary Prefect server; any other value is the address of a running cluster ('auto', 'ray://…'),
joined for the run and left at its end. Prefect stays the orchestrator: the stages run in the flow's process, and
Ray only places the engines (actors) they drive.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import threading

from refiner_core import REPO_ROOT
from refiner_core.runtime.scratch import short_folder

# What connect() set up, for disconnect() to end: None while this module holds no connection; else the session
# folder of the Ray instance it started ('local'), or '' for a cluster it joined.
_held: str | None = None


def connect(address: str) -> str:
    """Join (or, for 'local', start) Ray for the run; returns a line saying what it is."""
    global _held
    import ray

    if ray.is_initialized():
        return f"ray: already connected ({ray.get_runtime_context().gcs_address})"
    # Engine actors import this project: they run with the flow's working folder and Python path.
    runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in _python_path() if p)}}
    # ray.init replaces the main thread's SIGTERM handler with its own sys.exit(15): the run's (exit code 143, a
    # line saying how to resume) is put back
    sigterm = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    try:
        if address == "local":
            # Ray's session folder holds Unix sockets, whose paths must stay short (< 108 bytes)
            session = short_folder("ray")
            try:  # address 'local': a new instance, never a cluster $RAY_ADDRESS names
                ray.init(
                    address="local",
                    include_dashboard=False,
                    runtime_env=runtime_env,
                    log_to_driver=True,
                    _temp_dir=session,
                )
            except BaseException:
                shutil.rmtree(session, ignore_errors=True)
                raise
            _held, what = session, "started for the run on this machine"
        else:
            ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
            _held, what = "", f"joined {address}"
    finally:
        if sigterm is not None:
            signal.signal(signal.SIGTERM, sigterm)
    resources = ray.cluster_resources()
    return (
        f"ray: {what}: {len(ray.nodes())} node(s), {resources.get('CPU', 0):g} CPUs, {resources.get('GPU', 0):g} GPUs"
    )


def _python_path() -> list[str]:
    return [str(REPO_ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]


def disconnect() -> None:
    """Leave Ray if connect() joined it (stopping it, and removing its session folder, when that started it)."""
    global _held
    if _held is not None and active():
        import ray

        ray.shutdown()
    if _held:
        shutil.rmtree(_held, ignore_errors=True)
    _held = None


def active() -> bool:
    """Whether this process is connected to Ray: several rollout engines then become Ray actors."""
    ray = sys.modules.get("ray")  # never imported by a run that does not use Ray
    return ray is not None and ray.is_initialized()


def gpus_available() -> float:
    import ray

    return ray.cluster_resources().get("GPU", 0.0)


ADDRESS = re.compile(r"^(local|auto|(ray://)?([A-Za-z0-9_.\-]+|\[[0-9A-Fa-f:.]+\]):\d{1,5})$")  # [IPv6]:PORT too


def address_problem(address: str) -> str | None:
    """Why `address` is no value of run.ray_address ('' | 'local' | 'auto' | HOST:PORT | ray://HOST:PORT), or None."""
    if address == "" or ADDRESS.match(address):
        return None
    return "must be '' (no Ray), 'local' (a Ray instance started for the run), 'auto', HOST:PORT or ray://HOST:PORT"
