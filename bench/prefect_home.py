"""A benchmark's own Prefect database and cache records, in a temporary folder removed at exit, and quiet logs.

Call `use_own_prefect_home` before prefect is imported: Prefect reads these settings at import. This module
imports nothing heavy, so a benchmark can call it first.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path


def use_own_prefect_home(name: str) -> Path:
    """Point PREFECT_HOME and Prefect's result storage at a new folder `NAME-*` under $TMPDIR; returns it."""
    home = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    atexit.register(shutil.rmtree, home, ignore_errors=True)  # registered before prefect's own exit handlers
    os.environ["PREFECT_HOME"] = str(home / "prefect")
    os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = str(home / "results")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    return home
