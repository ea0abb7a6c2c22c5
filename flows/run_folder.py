"""The run folder of a flow run: named from a template, used by one run at a time, its children recorded.

`holds_run_folder` wraps the pipeline flow so that every way of running it (`refiner run`, a Prefect worker, a
scheduled or retried flow run) resolves the folder template, takes the folder's lock (refiner_core.runtime.runlock),
stops children and removes unfinished writes and temporary folders that an earlier, killed run left behind
(refiner_core.runtime.procs, refiner_core.store.storage, refiner_core.runtime.scratch), gives the run temporary
folders of its own (removed by `remove_run_temporary_files` once its engines are closed), writes the recipe it runs
to RUN_DIR/recipe.yaml (and the code version its stage caches are keyed by to RUN_DIR/code_version) and sends every
log line to RUN_DIR/logs/run-<time>.log: each run folder has what `refiner sql`, `show`, `plot`, `rescore` and
`fork` read.

`plan_fork` checks and records a fork (`refiner fork`): a new folder that runs its parent's recipe up to a step and
its own settings from there, reusing the parent's stages through their cache keys (refiner_core.store.forks).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from refiner_core import code_version
from refiner_core.runtime import scratch
from refiner_core.runtime.procs import PROCS_DIR_ENV, stop_leftovers
from refiner_core.runtime.runlock import RunFolderBusy, format_run_dir, run_lock
from refiner_core.store.storage import remove_partial_writes

PROCS_SUBDIR = ".procs"
LOGS_SUBDIR = "logs"
RECIPE_FILE = "recipe.yaml"
CODE_VERSION_FILE = "code_version"
_TEMPORARY_FILES: dict[str, Path] = {}  # flow run ID -> its run folder, which records its temporary folders


def resolve_run_dir(run_dir: str) -> str:
    """Fill a run folder template ({deployment}, {date}, {flow_run_id}) from the current flow run."""
    if "{" not in run_dir:
        return run_dir
    from prefect.runtime import deployment, flow_run

    return format_run_dir(
        run_dir,
        deployment=deployment.name or "",
        scheduled=flow_run.scheduled_start_time,
        flow_run_id=flow_run.id or "",
    )


def stop_children_left_behind(folder: Path, warn) -> None:
    """Stop what an earlier run of this folder started and did not live to stop; record ours from now on."""
    for entry in stop_leftovers(folder / PROCS_SUBDIR):
        warn(
            f"stopped PID {entry['pid']} ({' '.join(entry['cmd'][:4])} ...) left running by an earlier run of "
            f"{folder} since {entry['started']}"
        )
    os.environ[PROCS_DIR_ENV] = str(folder / PROCS_SUBDIR)


def remove_writes_left_behind(folder: Path, warn) -> None:
    """Temporary files of a writer that was killed mid-write were never visible; now they go (a folder it was
    replacing is put back)."""
    leftovers = remove_partial_writes(folder)
    if leftovers:
        warn(
            f"cleaned up {len(leftovers)} unfinished write(s) left by an earlier run of {folder}: "
            + ", ".join(str(p.relative_to(folder)) for p in leftovers[:5])
        )


def remove_temporary_files_left_behind(folder: Path, warn) -> None:
    """Temporary folders of a run that was killed (weights in /dev/shm among them) go with the next run."""
    removed = scratch.remove(folder)
    if removed:
        warn(f"removed temporary files left by an earlier run of {folder}: {scratch.describe(removed)}")


def clean_up_after_dead_neighbours(folder: Path, warn) -> None:
    """What killed runs left in the folders beside `folder` (child processes, temporary folders with weights in
    /dev/shm): the cleanup each run does of its own folder never reaches them when every run has a folder of its
    own (a scheduled run's runs/{deployment}/{date}-{flow_run_id}). A folder whose run is alive is left alone."""
    if not folder.parent.is_dir():
        return
    for neighbour in sorted(p for p in folder.parent.iterdir() if p.is_dir() and p != folder):
        if not (neighbour / RECIPE_FILE).is_file():
            continue  # no run folder
        try:
            with run_lock(neighbour, command=f"cleanup by the run of {folder}"):
                for entry in stop_leftovers(neighbour / PROCS_SUBDIR):
                    warn(f"stopped PID {entry['pid']} ({' '.join(entry['cmd'][:4])} ...) left running by {neighbour}")
                removed = scratch.remove(neighbour)
                if removed:
                    warn(f"removed temporary files left by the killed run of {neighbour}: {scratch.describe(removed)}")
        except RunFolderBusy:  # its run is alive: its files are in use
            continue
        except OSError as e:  # not ours to clean (another user's, read-only): never a reason to stop this run
            warn(f"left {neighbour} as it is: {type(e).__name__}: {e}")


def remove_run_temporary_files(_flow, flow_run, _state) -> None:
    """A flow's end hook, after those closing its engines: the run's temporary folders go."""
    folder = _TEMPORARY_FILES.pop(str(flow_run.id), None)
    if folder is not None:
        scratch.remove(folder)


class RunLog(logging.FileHandler):
    """RUN_DIR/logs/run-<time>.log, on the root logger: every log line of a run, Prefect's and tracebacks included."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        path = folder / LOGS_SUBDIR / f"run-{time.strftime('%Y%m%d-%H%M%S')}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        super().__init__(path, encoding="utf-8")


def start_run_log(folder: Path) -> Path:
    """Send every log line from now on to a new log file of the run folder, formatted as on the terminal;
    returns its path. `refiner run` starts it before the flow so that its own errors land in it too."""
    return Path(_open_run_log(folder).baseFilename)


def _open_run_log(folder: Path) -> RunLog:
    from prefect.logging.handlers import PrefectConsoleHandler

    root = logging.getLogger()
    handler = RunLog(folder)
    consoles = [h for h in root.handlers if isinstance(h, PrefectConsoleHandler)]
    handler.setFormatter(
        consoles[0].formatter
        if consoles
        else logging.Formatter("%(asctime)s | %(levelname)-7s | %(name)s - %(message)s")
    )
    root.addHandler(handler)
    return handler


@contextmanager
def logging_to_run_folder(folder: Path) -> Iterator[Path]:
    """The block's log lines go to the run folder's log: the one already open on it, or a new one, closed after."""
    root = logging.getLogger()
    open_here = [h for h in root.handlers if isinstance(h, RunLog) and h.folder == folder]
    if open_here:
        yield Path(open_here[0].baseFilename)
        return
    handler = _open_run_log(folder)
    try:
        yield Path(handler.baseFilename)
    finally:
        root.removeHandler(handler)
        handler.close()


def write_recipe(folder: Path, recipe: dict) -> None:
    """The recipe the run runs with, every field resolved, model.precision 'auto' as the pipeline resolves it on
    this machine: `refiner rescore` starts from it."""
    import yaml

    from refiner_core.config import recipe_from_dict
    from refiner_core.runtime.hardware import resolved_recipe

    resolved, _ = resolved_recipe(recipe_from_dict(recipe))
    (folder / RECIPE_FILE).write_text(yaml.safe_dump(resolved.to_dict(), sort_keys=False))
    (folder / CODE_VERSION_FILE).write_text(code_version() + "\n")  # what a fork's reuse depends on


def holds_run_folder(fn):
    """Decorator for a flow function taking `recipe` and `run_dir`: the body runs on the resolved folder, holding
    its lock, with the recipe written beside it and its log lines in the folder's log."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from prefect import get_run_logger
        from prefect.runtime import flow_run

        bound = signature.bind(*args, **kwargs)
        folder = Path(resolve_run_dir(bound.arguments["run_dir"])).resolve()
        # Stage keys hold run_dir: one spelling of the folder (a worker's relative path, `refiner run`'s absolute
        # one) lets every entry point reuse the others' results.
        bound.arguments["run_dir"] = str(folder)
        log = get_run_logger()
        previous = os.environ.get(PROCS_DIR_ENV)
        with (
            run_lock(folder, command=f"flow run {flow_run.name} ({flow_run.id})", warn=log.warning),
            logging_to_run_folder(folder),
        ):
            try:
                write_recipe(folder, bound.arguments["recipe"])
                stop_children_left_behind(folder, log.warning)
                remove_writes_left_behind(folder, log.warning)
                remove_temporary_files_left_behind(folder, log.warning)
                temporary = scratch.create(folder)
                _TEMPORARY_FILES[str(flow_run.id)] = folder
                with scratch.in_use(temporary):
                    return fn(*bound.args, **bound.kwargs)
            finally:  # a process that runs several flows records each one's children in its own folder
                if previous is None:
                    os.environ.pop(PROCS_DIR_ENV, None)
                else:
                    os.environ[PROCS_DIR_ENV] = previous

    return wrapper


class ForkError(ValueError):
    """A fork that cannot be made as asked: nothing was written."""


# LoRA settings a saved adapter fixes: a fork that trains on from one keeps them
LORA_SHAPE_FIELDS = ("model.lora_rank", "model.lora_alpha", "model.lora_dropout", "model.lora_target_modules")


def plan_fork(parent: Path, new: Path, at: int, overrides: list[str]):
    """The fork of run folder `parent` at step `at` into `new` with `overrides` (--set): its resolved recipe and its
    record (refiner_core.store.forks.Fork), checked but not yet written. Raises ForkError when the parent has not
    finished step at-1 or kept no checkpoint of it, when the fork would compute no step, or when `new` holds
    another run."""
    from datetime import UTC, datetime

    from refiner_core.config import ConfigError, load_recipe, recipe_from_dict
    from refiner_core.reward.rescore import changed_settings
    from refiner_core.runtime.hardware import resolved_recipe
    from refiner_core.store.checkpoints import step_checkpoints
    from refiner_core.store.forks import Fork, changed_before_steps, read_fork, recipe_leaves_fork, trunk_segments

    parent, new = parent.resolve(), new.resolve()
    existing = read_fork(new)
    # The same command again resumes the fork: once the fork holds its own (hard-linked) checkpoint of step `at`,
    # the parent may have pruned its copy since, or be gone.
    resuming = existing is not None and (existing.parent_dir, existing.at) == (str(parent), at)
    if not (parent / RECIPE_FILE).is_file():
        if resuming:
            return _fork_without_parent(new, existing, overrides)
        raise ForkError(f"{parent} has no {RECIPE_FILE}: not a run folder")
    if new == parent:
        raise ForkError("the fork needs a folder of its own")
    if new.is_relative_to(parent) or parent.is_relative_to(new):
        where = "is inside" if new.is_relative_to(parent) else "holds"
        raise ForkError(
            f"{new} {where} the parent's folder {parent}: choose a folder neither inside nor around it (reusing the "
            "parent's files and counting the fork's disk tell the two runs' files apart by their folders)"
        )
    try:
        base = load_recipe(parent / RECIPE_FILE)
        if resuming and (new / RECIPE_FILE).is_file():
            # the recipe the fork recorded, the command's settings over it: not the parent's as it is now (a parent
            # extended or changed since the fork started would carry the fork along)
            cfg, _ = resolved_recipe(load_recipe(new / RECIPE_FILE, list(overrides)))
        else:
            named = any(o.split("=", 1)[0].strip() == "run.name" for o in overrides)
            cfg, _ = resolved_recipe(load_recipe(parent / RECIPE_FILE, [*([] if named else ["run.name="]), *overrides]))
    except ConfigError as e:
        raise ForkError(str(e)) from None
    if at < 0:
        raise ForkError(f"--at {at}: a step is 0 or more (0 forks before the first update)")
    if at >= cfg.grpo.steps:
        raise ForkError(f"--at {at}: the fork would compute no step (grpo.steps {cfg.grpo.steps}); raise grpo.steps")
    if base.grpo.async_steps or cfg.grpo.async_steps:
        raise ForkError("forks of runs that sample ahead (grpo.async_steps) are not supported")
    # resuming needs the fork step's checkpoint only while the fork has not trained from it (its own keep_last
    # may have pruned its copy since)
    holds_it = resuming and (at in step_checkpoints(new / "checkpoints") or at in _finished_steps(new))
    if at > 0 and not holds_it:
        done = _finished_steps(parent)
        if at - 1 not in done:
            raise ForkError(
                f"{parent} has not finished step {at - 1} (finished: {_ranges(done) or 'none'}): fork at a step "
                "up to one after its last finished step"
            )
        kept = step_checkpoints(parent / "checkpoints")
        if at not in kept:
            raise ForkError(
                f"{parent}/checkpoints/step_{at:04d} (the policy after step {at - 1}) was pruned (run.keep_last, "
                f"run.keep_every): fork at a step whose checkpoint is kept: --at {', '.join(map(str, sorted(kept)))}"
            )
    if existing is not None and not resuming:
        raise ForkError(f"{new} is already a fork of {existing.parent_dir} at step {existing.at}")
    if new.exists() and not new.is_dir():
        raise ForkError(f"{new} is a file: choose a new folder")
    if existing is None and new.exists() and any(new.iterdir()):
        raise ForkError(f"{new} exists and holds another run: choose a new folder")
    # A resumed fork's settings are told against its parent's recipe as the fork recorded it (the parent may have
    # gone on since); one that shares no step recorded none, and its record stands.
    if resuming and not existing.shares_steps:
        changed_names, settings, changed = [], list(existing.settings), ["a setting the stages before step 0 read"]
    else:
        against = recipe_from_dict(existing.segments[-1]["recipe"]) if resuming and existing.segments else base
        changed_names = changed_settings(against, cfg)
        settings = [f"{name}={_flag_value(cfg.to_dict(), name)}" for name in changed_names if name != "run.name"]
        changed = changed_before_steps(against.to_dict(), cfg.to_dict())
    adapters = [name for name in changed_names if name in LORA_SHAPE_FIELDS]
    if adapters and at > 0 and not changed:
        raise ForkError(
            f"{', '.join(adapters)} changed: the fork trains on from the parent's policy at step {at}, and what it"
            " trains there (full weights or adapters, their rank, scaling, dropout and modules) cannot change; fork "
            "at 0 to train with the new settings from the start"
        )
    notes = []
    if changed:
        notes.append(
            f"{', '.join(changed)} changed: the stages before step 0 read "
            f"{'these settings' if len(changed) > 1 else 'it'}, so step 0's rollout differs and no step of "
            f"{parent.name} is reused; the fork computes every step with its own recipe"
        )
    recorded = (parent / CODE_VERSION_FILE).read_text().strip() if (parent / CODE_VERSION_FILE).is_file() else None
    if recorded is None:
        notes.append(f"{parent.name} records no code version: its stages are reused only if the code is unchanged")
    elif recorded != code_version():
        notes.append(
            f"{parent.name} ran code version {recorded}, this is {code_version()}: stage cache keys hold the code "
            "version, so none of its stages can be reused and the fork recomputes them"
        )
    if resuming and (refused := recipe_leaves_fork(existing, cfg.to_dict())):
        raise ForkError(refused)
    if resuming:  # its steps before `at` run with the recipes it recorded, whatever the parent has run since
        segments = existing.segments
    else:
        segments = trunk_segments(read_fork(parent), base.to_dict(), at) if not changed else []
    first = segments[0]["recipe"] if segments else None  # the recipe step 0 and its evaluation ran with
    if first is not None and cfg.eval.every and not first.get("eval", {}).get("every"):
        notes.append(
            f"eval.every {cfg.eval.every}: {parent.name} evaluated no policy before its first update, and the fork "
            "runs that as its parent did, so heldout_gap has no baseline in the fork and stays empty"
        )
    fork = Fork(
        run_dir=str(new),
        run=run_name(cfg.run.name, str(new)),
        parent_dir=str(parent),
        parent_run=run_name(base.run.name, str(parent)),
        at=at,
        settings=settings,
        shares_steps=not changed,
        note="; ".join(notes),
        segments=segments,
        created_at=existing.created_at if existing else datetime.now(UTC).isoformat(timespec="seconds"),
    )
    return cfg, fork


def _fork_without_parent(new: Path, fork, overrides: list[str]):
    """A fork whose parent folder is gone, resumed by the same command: with the recipe it recorded, which the
    command's settings must leave as it is, and its steps before the fork step with the recipes its record holds."""
    import dataclasses

    from refiner_core.config import ConfigError, load_recipe
    from refiner_core.reward.rescore import changed_settings
    from refiner_core.runtime.hardware import resolved_recipe

    if not (new / RECIPE_FILE).is_file():
        raise ForkError(f"{fork.parent_dir} is gone and the fork {new} never ran: there is nothing to fork from")
    try:
        recorded = load_recipe(new / RECIPE_FILE)
        cfg, _ = resolved_recipe(load_recipe(new / RECIPE_FILE, list(overrides)))
    except ConfigError as e:
        raise ForkError(str(e)) from None
    moved = changed_settings(recorded, cfg)
    if moved:
        raise ForkError(
            f"{fork.parent_dir} is gone, so {new} resumes only with the recipe it recorded, and the command changes "
            f"{', '.join(moved)}: run it with the --set settings it was forked with"
        )
    note = f"{fork.parent_dir} is gone: the fork resumes with the recipe it recorded"
    return cfg, dataclasses.replace(fork, note=note)


def run_name(name: str, run_dir: str) -> str:
    """run.name, or else the run folder's name: runs in different folders can be told apart."""
    return name or Path(run_dir).name


def _flag_value(recipe: dict, dotted: str) -> str:
    import json

    value = recipe
    for key in dotted.split("."):  # judge.openai.base_url: a nested section's field
        value = value[key]
    return value if isinstance(value, str) else json.dumps(value)


def _finished_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.parent.name.split("=")[1]) for p in run_dir.glob("metrics/step=*/steps.parquet"))


def _ranges(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else ", ".join(map(str, steps))
