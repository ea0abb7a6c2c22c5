"""A run's temporary files in folders of its own, recorded in its run folder (`RUN_DIR/.temporary-folders.json`), so
that what a killed run leaves there (weights exported for the rollout engine in RAM-backed /dev/shm, DeepSpeed's
job folder, vLLM's rendezvous file and sockets, torch elastic's folders) is removed by the next run of that folder,
and a run that ends removes its own.

While a run holds them, TMPDIR (and `tempfile.tempdir`, and VLLM_RPC_BASE_PATH, which vLLM reads first) names its
folder on disk, so every process it starts keeps its temporary files there, and REFINER_RAM_DIR its folder in
/dev/shm where /dev/shm is writable. Ray's session folder, whose socket paths must stay short, sits beside the one
on disk (`short_folder`). Torch's compile cache, which defaults to the temporary directory but is meant to outlast
a run, stays where it was.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import re
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from refiner_core.store.checkpoints import folder_bytes

RECORD = ".temporary-folders.json"
PREFIX = "refiner-run-"
RAM_DIR_ENV = "REFINER_RAM_DIR"
VLLM_SOCKETS_ENV = "VLLM_RPC_BASE_PATH"  # vLLM's engine sockets, never removed by vLLM: in the run's folder too
SHARED_MEMORY = Path("/dev/shm")


@dataclass(frozen=True)
class Scratch:
    """The temporary folders of one run: on disk, and in RAM (None where /dev/shm is not writable)."""

    disk: str
    ram: str | None
    host: str

    @property
    def folders(self) -> list[str]:
        """Its folders that exist, those made beside the one on disk (short_folder) included."""
        beside = sorted(str(p) for p in Path(self.disk).parent.glob(f"{Path(self.disk).name}-*"))
        return [p for p in (self.disk, *beside, self.ram) if p and os.path.lexists(p)]


def ram_dir() -> str | None:
    """Where exported weights for an engine go to stay off the disk: the run's folder in /dev/shm, else /dev/shm
    itself when writable (outside a run), else None (the temporary directory)."""
    held = os.environ.get(RAM_DIR_ENV)
    if held and os.path.isdir(held):
        return held
    return str(SHARED_MEMORY) if os.access(SHARED_MEMORY, os.W_OK) else None


def short_folder(name: str) -> str:
    """A new folder for Unix sockets, whose paths must stay short (Ray's session): inside a run, beside its
    temporary folder on disk rather than in it (<that folder>-NAME, removed with it); outside a run, a new
    temporary folder."""
    held = _held_disk_folder()
    if held is None:
        return tempfile.mkdtemp(prefix=f"refiner-{name}-")
    folder = held.with_name(f"{held.name}-{name}")
    folder.mkdir(mode=0o700)
    return str(folder)


def _held_disk_folder() -> Path | None:
    """The temporary folder on disk of the run this process is in (in_use), else None."""
    here = Path(tempfile.gettempdir())
    return here if here.name.startswith(PREFIX) else None


def create(run_dir: Path) -> Scratch:
    """New temporary folders for a run, recorded in RUN_DIR before any process writes into them."""
    held = _held_disk_folder()
    disk = tempfile.mkdtemp(prefix=PREFIX, dir=held.parent if held else None)
    ram = tempfile.mkdtemp(prefix=PREFIX, dir=SHARED_MEMORY) if os.access(SHARED_MEMORY, os.W_OK) else None
    scratch = Scratch(disk, ram, socket.gethostname())
    partial = run_dir / f"{RECORD}.{os.getpid()}"
    partial.write_text(json.dumps(asdict(scratch)))
    partial.replace(run_dir / RECORD)
    return scratch


def remove(run_dir: Path) -> list[tuple[str, int]]:
    """Remove the folders recorded in RUN_DIR (a run's, once it has ended or been killed) and the record; returns
    (folder, bytes) of each folder removed. Only folders this code creates are touched: named refiner-run-*, owned
    by this user, not a link, on this host."""
    record = run_dir / RECORD
    try:
        scratch = Scratch(**json.loads(record.read_text()))
    except FileNotFoundError:
        return []
    except (ValueError, TypeError):  # not a record this code wrote: nothing in it is removed
        record.unlink(missing_ok=True)
        return []
    removed = []
    if scratch.host == socket.gethostname():
        for folder in scratch.folders:
            if _ours(folder):
                size = folder_bytes(folder)
                shutil.rmtree(folder, ignore_errors=True)
                removed.append((folder, size))
    record.unlink(missing_ok=True)
    return removed


@contextlib.contextmanager
def in_use(scratch: Scratch) -> Iterator[None]:
    """Inside, this process and those it starts keep their temporary files in SCRATCH's folders."""
    names = ("TMPDIR", VLLM_SOCKETS_ENV, RAM_DIR_ENV, "TORCHINDUCTOR_CACHE_DIR")
    saved_env = {name: os.environ.get(name) for name in names}
    saved_tempdir = tempfile.tempdir
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", _torch_compile_cache())
    os.environ["TMPDIR"] = os.environ[VLLM_SOCKETS_ENV] = tempfile.tempdir = scratch.disk
    if scratch.ram:
        os.environ[RAM_DIR_ENV] = scratch.ram
    try:
        yield
    finally:
        tempfile.tempdir = saved_tempdir
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def describe(removed: list[tuple[str, int]]) -> str:
    return ", ".join(f"{folder} ({_human(size)})" for folder, size in removed)


def _torch_compile_cache() -> str:
    """Where torch keeps its compile cache when TORCHINDUCTOR_CACHE_DIR is unset, as torch names it:
    <temporary directory>/torchinductor_<user>."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def _ours(folder: str) -> bool:
    path = Path(folder)
    try:
        info = path.lstat()
    except OSError:
        return False
    return (
        path.is_absolute()
        and path.name.startswith(PREFIX)
        and stat.S_ISDIR(info.st_mode)
        and info.st_uid == os.getuid()
    )


def _human(size: float) -> str:
    for unit in ("B", "KB", "MB"):
        if size < 1024:
            return f"{size:.0f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"
