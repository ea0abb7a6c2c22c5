"""refiner-grpo core: pure Python formats, rewards, GRPO math, schemas and engines (no Prefect here)."""

from __future__ import annotations

import hashlib
from pathlib import Path

__version__ = "0.1.0"

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent


def code_version() -> str:
    """Version plus a hash of the core and task sources: any code change invalidates stage caches."""
    digest = hashlib.sha256(__version__.encode())
    for package in ("refiner_core", "tasks"):
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            digest.update(path.relative_to(REPO_ROOT).as_posix().encode())
            digest.update(path.read_bytes())
    return f"{__version__}+{digest.hexdigest()[:12]}"
