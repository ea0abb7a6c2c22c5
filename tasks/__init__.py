"""Thin Prefect wrappers around refiner_core: read manifests, call the core, write files, return manifests."""

import os

from refiner_core.models import refiner_home

# Before prefect is imported anywhere: no telemetry (no network here), a patient temporary server,
# and cache records next to the results they describe, under the project's home.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", str(refiner_home() / "prefect-results"))
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")

if "DS_ACCELERATOR" not in os.environ:
    import torch

    if not torch.cuda.is_available():  # DeepSpeed would probe for an accelerator and warn on every import
        os.environ["DS_ACCELERATOR"] = "cpu"
