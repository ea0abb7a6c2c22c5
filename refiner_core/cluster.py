"""Ray for a run (run.ray_address): where the run's rollout engines are placed when there are several.

'' (the default) uses no Ray. 'local' starts a Ray instance on this machine for the run and stops it when the run
ends, as the temporary Prefect server; any other value is the address of a running cluster ('auto', 'ray://…'),
joined for the run and left at its end. Prefect stays the orchestrator: the stages run in the flow's process, and
Ray only places the engines (actors) they drive.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

_CONNECTED_HERE = []  # [True] while this module's connect() holds the connection (disconnect() ends only that)


def connect(address: str) -> str:
    """Join (or, for 'local', start) Ray for the run; returns a line saying what it is."""
    import ray

    if ray.is_initialized():
        return f"ray: already connected ({ray.get_runtime_context().gcs_address})"
    # Engine actors import this project: they run with the flow's working folder and Python path.
    runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in _python_path() if p)}}
    if address == "local":
        # Ray's session folder holds Unix sockets, whose paths must stay short (< 108 bytes)
        ray.init(include_dashboard=False, runtime_env=runtime_env, log_to_driver=True,
                 _temp_dir=tempfile.mkdtemp(prefix="refiner-ray-"))
        what = "started for the run on this machine"
    else:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        what = f"joined {address}"
    _CONNECTED_HERE[:] = [True]
    resources = ray.cluster_resources()
    return (f"ray: {what}: {len(ray.nodes())} node(s), {resources.get('CPU', 0):g} CPUs, "
            f"{resources.get('GPU', 0):g} GPUs")


def _python_path() -> list[str]:
    root = str(Path(__file__).resolve().parents[1])
    return [root, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]


def disconnect() -> None:
    """Leave Ray if connect() joined it (stopping it when that started it: 'local')."""
    if _CONNECTED_HERE and active():
        import ray

        ray.shutdown()
    _CONNECTED_HERE.clear()


def active() -> bool:
    """Whether this process is connected to Ray: several rollout engines then become Ray actors."""
    ray = sys.modules.get("ray")  # never imported by a run that does not use Ray
    return ray is not None and ray.is_initialized()


def gpus_available() -> float:
    import ray

    return ray.cluster_resources().get("GPU", 0.0)
