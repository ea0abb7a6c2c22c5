"""refiner-grpo core: pure Python formats, rewards, GRPO math, schemas and engines (no Prefect here)."""

from __future__ import annotations

import hashlib
from pathlib import Path

__version__ = "0.1.0"

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent

HASHED_PACKAGES = (PACKAGE_DIR, REPO_ROOT / "tasks")  # their sources are the code version


def code_version() -> str:
    """Version plus a hash of the core and task sources: any code change invalidates stage caches."""
    digest = hashlib.sha256(__version__.encode())
    for package in HASHED_PACKAGES:
        add_sources(digest, package)
    return f"{__version__}+{digest.hexdigest()[:12]}"


def add_sources(digest, root: Path) -> None:
    """Every .py file under `root` (or `root` itself, a module file) into `digest`: its path from root's parent,
    then its bytes."""
    for path in sorted(root.rglob("*.py")) if root.is_dir() else [root]:
        digest.update(path.relative_to(root.parent).as_posix().encode())
        digest.update(path.read_bytes())
