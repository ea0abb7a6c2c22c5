"""Forks: a run folder that shares its parent's stages up to a step and runs on with other settings.

`RUN_DIR/fork.json` makes a folder a fork: its parent folder and run name, the step it forks at, the settings it
changes, and the recipes its steps before the fork step run with: the parent's, and for a fork of a fork, before
the parent's own fork step, the grandparent's (`segments`). A fork's stage whose
cache key, with the fork's folder and run name read as an ancestor's, names a result the ancestor computed reuses
that result (tasks/stage.py); the files the result names are hard-linked into the fork (same relative path, no
copy) and the manifest is rebased onto them, so the fork folder holds every file its catalog reads and outlives its
parent. Where a hard link cannot be made (another file system), the manifest keeps naming the parent's file.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from refiner_core.config import BEFORE_STEPS_FIELDS
from refiner_core.store.checkpoints import mark_pruned, pruned_paths
from refiner_core.store.storage import write_json

FORK_FILE = "fork.json"


@dataclass(frozen=True)
class Fork:
    """What fork.json records."""

    run_dir: str  # the fork's folder, resolved
    run: str  # the fork's run name
    parent_dir: str  # the parent's folder, resolved
    parent_run: str
    at: int  # the first step the fork computes with its own settings; steps before it are the parent's
    settings: list[str]  # the --set flags that turn the parent's recipe into the fork's
    shares_steps: bool  # false: a setting the stages before step 0 read changed, so no step is the parent's
    note: str  # why no step is shared, or what may keep stages from being reused
    # [{'until': step, 'recipe': resolved recipe}]: the steps before each `until` (and after the previous one) run with
    # that recipe, as the ancestor that computed them did; steps from the last `until` on run with the fork's own
    segments: list[dict] = field(repr=False)
    created_at: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def read_fork(run_dir: str | Path) -> Fork | None:
    """The fork record of a run folder; None for a run that is no fork."""
    path = Path(run_dir) / FORK_FILE
    if not path.is_file():
        return None
    return Fork(**json.loads(path.read_text()))


def write_fork(fork: Fork) -> None:
    write_json(fork.to_dict(), Path(fork.run_dir) / FORK_FILE)


def trunk_segments(parent: Fork | None, parent_recipe: dict, at: int) -> list[dict]:
    """The segments of a fork at step `at` of a run whose fork record is `parent` (None: no fork) and whose own
    resolved recipe is `parent_recipe`: the parent's own segments before `at`, then its recipe up to `at`."""
    inherited = parent.segments if parent is not None and parent.shares_steps else []
    segments, start = [], 0
    for segment in inherited:
        if start < at:
            segments.append({"until": min(segment["until"], at), "recipe": segment["recipe"]})
        start = segment["until"]
    if at > start:
        segments.append({"until": at, "recipe": parent_recipe})
    return segments


def fork_rows(fork: Fork) -> list[dict]:
    """The fork's row of the catalog's `forks` table."""
    return [
        {
            "run": fork.run,
            "parent_run": fork.parent_run,
            "parent_dir": fork.parent_dir,
            "fork_step": fork.at,
            "settings": shlex.join([part for s in fork.settings for part in ("--set", s)]),
            "shares_steps": fork.shares_steps,
            "note": fork.note or None,
            "created_at": fork.created_at,
        }
    ]


def ancestors(run_dir: str | Path) -> list[tuple[str, str]]:
    """(folder, run name) of the run's parent, its parent's parent, ...; [] for a run that is no fork."""
    chain, seen = [], {str(Path(run_dir).resolve())}
    fork = read_fork(run_dir)
    while fork is not None and fork.parent_dir not in seen:
        chain.append((fork.parent_dir, fork.parent_run))
        seen.add(fork.parent_dir)
        fork = read_fork(fork.parent_dir)
    return chain


def _under(text: str, folder: str) -> bool:
    return text == folder or text.startswith(folder.rstrip("/") + "/")


def rebase(value: Any, old: str, new: str) -> Any:
    """`value` with every string that is the folder `old`, or a path below it, moved below `new`."""
    if isinstance(value, str):
        return new + value[len(old.rstrip("/")) :] if _under(value, old) else value
    if isinstance(value, dict):
        return {k: rebase(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [rebase(v, old, new) for v in value]
    return value


def link_into(source: Path, target: Path) -> bool:
    """Hard-link the file or folder tree `source` to `target` (folders are made, files linked); files already at
    `target` must be the same file. False when a file cannot be linked (another file system, a conflicting file):
    then nothing is changed for that file and the caller keeps naming `source`."""
    if source.is_file():
        if target.exists():
            return os.path.samefile(source, target)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, target)
        except OSError:
            return False
        return True
    if not source.is_dir():
        return False
    return all([link_into(child, target / child.name) for child in sorted(source.iterdir())])


def adopt(manifest: Any, run_dir: str) -> tuple[Any, list[str]]:
    """A stage result an ancestor computed, made the fork's: each path it names below an ancestor's folder is
    hard-linked to the same place below `run_dir` (the folder as the fork's manifests write it) and rebased there.
    Returns the manifest and the paths adopted (relative to the ancestor's folder). A path the ancestor no longer
    holds names the fork's copy where an earlier run of the fork linked it (or pruned it since), and a checkpoint
    the ancestor pruned names the fork's, listed pruned in the fork too (so it stays whole once the ancestor is
    deleted); other paths that do not exist (weights never saved) or cannot be linked keep naming the ancestor's
    file."""
    folders = [folder for folder, _ in ancestors(run_dir)]
    adopted: list[str] = []

    def visit(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: visit(v) for k, v in value.items()}
        if isinstance(value, list):
            return [visit(v) for v in value]
        if not isinstance(value, str):
            return value
        for folder in folders:
            if _under(value, folder) and value != folder:
                relative = value[len(folder.rstrip("/")) + 1 :]
                source, target = Path(value), Path(run_dir) / relative
                # gone from the ancestor (pruned, deleted) but linked by an earlier run of the fork: the fork's
                # copy (damaged_outputs still checks its hash), or the fork's since pruned by its own keep_last
                gone = not source.exists() and (target.exists() or str(target) in pruned_paths(target.parent))
                if not source.exists() and not gone and value in pruned_paths(source.parent):
                    mark_pruned(target.parent, target)  # pruned by the ancestor: the fork's copy is, too
                    gone = True
                if link_into(source, target) or gone:
                    adopted.append(relative)
                    return run_dir.rstrip("/") + "/" + relative
                return value
        return value

    return visit(manifest), adopted


def rollout_files(run_dir: str | Path) -> dict[int, tuple[int, int]]:
    """step -> (device, inode) of the run folder's rollouts file of that step (its first sampling round's,
    rollouts/step=N/rollouts.parquet as tasks/rollout.py writes it): a fork that adopted an ancestor's rollout holds
    the ancestor's file itself."""
    files = {}
    for path in Path(run_dir).glob("rollouts/step=*/rollouts.parquet"):
        status = path.stat()
        files[int(path.parent.name.removeprefix("step="))] = (status.st_dev, status.st_ino)
    return files


def changed_before_steps(parent: dict, fork: dict) -> list[str]:
    """Dotted names of the settings that the stages before the first step read and that differ between two resolved
    recipes (RecipeConfig.to_dict()). SFT settings count only when either recipe warm-starts with SFT."""
    changed = []
    for section, names in BEFORE_STEPS_FIELDS.items():
        if section == "sft" and not (parent["sft"]["enabled"] or fork["sft"]["enabled"]):
            names = ("enabled",)
        for name in names if names is not None else sorted(set(parent[section]) | set(fork[section])):
            if parent[section].get(name) != fork[section].get(name):
                changed.append(f"{section}.{name}")
    return changed


def recipe_leaves_fork(fork: Fork, recipe: dict) -> str | None:
    """Why a fork's folder cannot run with resolved `recipe` (RecipeConfig.to_dict()), or None: its steps before
    the fork step run with its ancestors' recipes (segments), so a setting the stages before step 0 read, changed
    from theirs, would never apply there (the run kept their data, split and SFT)."""
    if not fork.segments:
        return None
    changed = changed_before_steps(fork.segments[0]["recipe"], recipe)
    if not changed:
        return None
    return (
        f"{fork.run_dir} is a fork of {fork.parent_dir} at step {fork.at}, whose steps before it run with "
        f"{fork.parent_run}'s recipe, and {', '.join(changed)} changed from it: the stages before step 0 read "
        f"{'these' if len(changed) > 1 else 'it'}, so no step would be {fork.parent_run}'s. Fork into a new folder "
        f"with the change (refiner fork {fork.parent_dir} NEW --at {fork.at} --set ...), or run without it"
    )


def shared_disk(parent_dir: str | Path, fork_dir: str | Path) -> dict[str, int]:
    """Bytes of the fork folder's files: `shared` (hard links to files of the parent folder), `own` (the rest),
    and `parent` (every file of the parent folder), each file counted once."""
    parent_inodes: dict[tuple[int, int], int] = {}
    for path in Path(parent_dir).rglob("*"):
        if path.is_file() and not path.is_symlink():
            st = path.stat()
            parent_inodes[(st.st_dev, st.st_ino)] = st.st_size
    shared = own = 0
    seen: set[tuple[int, int]] = set()
    for path in Path(fork_dir).rglob("*"):
        if not path.is_file() or path.is_symlink():
            continue
        st = path.stat()
        inode = (st.st_dev, st.st_ino)
        if inode in seen:
            continue
        seen.add(inode)
        if inode in parent_inodes:
            shared += st.st_size
        else:
            own += st.st_size
    return {"shared": shared, "own": own, "parent": sum(parent_inodes.values())}
