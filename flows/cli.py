"""`refiner`: run a recipe, query a run's catalog, show the config fields, plot a run."""

from __future__ import annotations

import contextlib
import decimal
import json
import math
import os
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

import typer

from flows.supervisor import Terminated, interrupts_never_lost, run_in_folder
from refiner_core.config import ConfigError, describe, load_recipe
from refiner_core.data.text_safety import visible
from refiner_core.peer_names import peer_names_of
from refiner_core.preflight import check_recipe, check_values, recipe_warnings

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode="markdown",
    help="GRPO post-training pipeline for LLM policies.",
)


def _warn(message: str) -> None:
    typer.secho(f"warning: {visible(message)}", fg="yellow", err=True)


def _fail(message: str, code: int = 2) -> None:
    typer.secho(f"error: {visible(message)}", fg="red", err=True)  # messages quote data: no control characters
    raise typer.Exit(code)


@app.command()
def run(
    recipe: Path = typer.Argument(..., exists=True, dir_okay=False, help="Recipe YAML (see recipes/)."),
    run_dir: Path | None = typer.Option(
        None,
        "--run-dir",
        help="Run folder (default: <run.run_root>/<run.name>, or <run.run_root>/<recipe file "
        "name without .yaml> when run.name is ''). The run is named after it unless run.name "
        "is set.",
    ),
    overrides: list[str] = typer.Option([], "--set", help="Override a field: section.field=value (repeatable)."),
    refresh: bool = typer.Option(False, "--refresh", help="Ignore cached stage results and recompute everything."),
    debug: bool = typer.Option(False, "--debug", help="Also show Prefect's failure tracebacks on the terminal."),
) -> None:
    """Run the pipeline for RECIPE. Rerunning resumes: finished stages are served from the cache.

    Mistakes knowable before running (missing files or models, unknown data.fields names, mapped columns the
    source lacks, impossible values) are all reported at once, exit code 2. A failed run (exit 1) prints its
    cause; its full log, tracebacks included, is in RUN_DIR/logs/. Prefect's run history is kept in
    RUN_DIR/.prefect (run.prefect_home: run, the default) or in PREFECT_HOME, shared by all runs
    (--set run.prefect_home=shared). One run per folder: a folder in use by another run is refused at once
    (exit 3, naming its PID, host and start time). Ctrl-C exits 130, SIGTERM 143; processes the run started end
    with it however it ends."""
    try:
        cfg = load_recipe(recipe, overrides)
    except (ConfigError, OSError) as e:
        _fail(str(e))
    problems = check_recipe(cfg)
    if problems:
        _fail(_problems(recipe, problems, "nothing was run"))
    folder = (run_dir or Path(cfg.run.run_root) / (cfg.run.name or recipe.stem)).resolve()
    from refiner_core.runtime.hardware import resolved_recipe
    from refiner_core.store.forks import read_fork, recipe_leaves_fork

    fork = read_fork(folder)
    if fork is not None and (refused := recipe_leaves_fork(fork, resolved_recipe(cfg)[0].to_dict())):
        _fail(refused)
    _run_locked(cfg, folder, refresh, debug, f"refiner run {recipe}")


def _problems(recipe: Path | None, problems: list[str], when: str) -> str:
    return "\n  ".join(
        [f"{_named(recipe)}: {len(problems)} problem{'s' if len(problems) > 1 else ''}, {when}:", *problems]
    )


def _named(recipe: Path | None) -> str:
    return str(recipe) if recipe is not None else "the defaults (no recipe given)"


@contextlib.contextmanager
def _holding(folder: Path, command: str) -> Iterator[None]:
    """Hold the run folder's lock for the block: refused at once, exit 3, while another process (a run) holds it."""
    from refiner_core.runtime.runlock import BUSY_EXIT_CODE, RunFolderBusy, acquire, release

    try:
        acquire(folder, command=command, warn=_warn)
    except RunFolderBusy as e:
        _fail(str(e), code=BUSY_EXIT_CODE)
    try:
        yield
    finally:
        release(folder)


def _run_locked(cfg, folder: Path, refresh: bool, debug: bool, command: str, before=None) -> None:
    """Run the pipeline in `folder` holding its lock (exit 3 when another run holds it); `before` is called once
    the lock is held."""
    if folder.exists() and not folder.is_dir():
        _fail(f"cannot use {folder} as the run folder: it is a file")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file on the way to it, no permission, a read-only or missing mount
        _fail(f"cannot use {folder} as the run folder: {e.strerror or e}")
    with _holding(folder, command):
        try:
            if before is not None:
                before()
            with interrupts_never_lost():
                run_in_folder(cfg, folder, refresh, debug, warn=_warn)
        except Terminated:
            typer.secho("terminated: run the same command again to resume from the unfinished stage", err=True)
            raise typer.Exit(143) from None
        except KeyboardInterrupt:  # a Ctrl-C redelivered as the run ended
            typer.secho("interrupted: run the same command again to resume from the unfinished stage", err=True)
            raise typer.Exit(130) from None


def _warn_stale_rescores(run_dirs: list[Path]) -> None:
    from refiner_core.reward.rescore import stale_rescore_warnings

    for line in stale_rescore_warnings(run_dirs):
        _warn(line)


@app.command()
def sql(
    run_dirs: list[Path] = typer.Argument(
        ...,
        help="Run folder(s) holding catalog.duckdb, or catalog files. With "
        "several, each table holds the rows of all of them (column run).",
    ),
    query: str = typer.Argument(
        ...,
        help="SQL to run, read-only. Tables: prompts, rubrics, rollouts, "
        "judge_scores, reward_inputs, rewards, steps, quarantine, sft_examples, "
        "sft_stats, sft_metrics, … Views: reward_by_step, rubric_pass_rates, "
        "citation_quality, length_vs_reward, judge_failures, quarantine_summary.",
    ),
    fmt: str = typer.Option("table", "--format", "-f", help="table | csv | json"),
    max_width: int = typer.Option(60, min=0, help="Cut table cells to this many characters (0 = no cut)."),
    export_to: Path | None = typer.Option(
        None, "--export", help="Write the result to this .parquet or .csv file instead of printing it."
    ),
) -> None:
    """Run a read-only SQL query against the catalogs of one or several runs (no file access from SQL)."""
    import duckdb

    from refiner_core.publish.run_sql import CatalogError, QueryRefused, export, open_runs, run_query

    if fmt not in ("table", "csv", "json"):
        _fail(f"--format must be table, csv or json, not {fmt!r}")
    try:
        _warn_stale_rescores(run_dirs)
        con = open_runs(run_dirs)
    except CatalogError as e:
        _fail(str(e))
    except duckdb.Error as e:  # not a DuckDB file, or one another process holds open for writing
        _fail(f"cannot open the catalog: {e}")
    try:
        if export_to is not None:
            n = export(con, query, export_to)
            typer.echo(f"wrote {n} row{'s' if n != 1 else ''} to {export_to}", err=True)
            return
        columns, rows = run_query(con, query)
    except CatalogError as e:
        _fail(str(e))
    except (QueryRefused, duckdb.Error) as e:  # all of DuckDB's message: its hints and the caret under the error
        _fail(str(e), code=1)
    finally:
        con.close()
    repeated = sorted({c for c in columns if columns.count(c) > 1})
    if fmt == "json" and repeated:  # one key per column: the later value would replace the earlier one
        _fail(f"-f json: columns named {', '.join(repeated)} more than once; name each (SELECT x.col AS col_a, ...)")
    try:
        if fmt == "json":
            rows = [_json_value(r) for r in rows]
            typer.echo(json.dumps([dict(zip(columns, r)) for r in rows], default=str, indent=1, allow_nan=False))
        elif fmt == "csv":
            import csv

            # verbatim into a pipe or file; on a terminal, control characters are shown as escapes
            shown = (lambda v: visible(v) if isinstance(v, str) else v) if sys.stdout.isatty() else (lambda v: v)
            writer = csv.writer(sys.stdout)
            writer.writerow([shown(c) for c in columns])
            writer.writerows([shown(v) for v in r] for r in rows)
        else:
            _print_table(columns, rows, max_width)
        sys.stdout.flush()
    except BrokenPipeError:  # the reader had what it wanted (| head): no error, whatever the format
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more reaches the closed pipe


def _json_value(value):
    """VALUE with every NaN and infinity (in lists and structs too) as None: JSON has no such numbers, so they are
    written as null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, decimal.Decimal):  # DuckDB reads a literal 1.5 as DECIMAL: a JSON number, not a string
        return _json_value(float(value))
    if isinstance(value, dict):
        return {k: _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return value


def _dollars(cost: float | None) -> str:
    return "not priced (judge.price_per_mtok_in / _out)" if cost is None else f"${cost:.4f}"


PIPED_COLUMN_CELLS = 80
NARROWEST_COLUMN = 5  # cells a table column needs to show anything; fewer, and each column gets a line of its own


def _print_table(columns: list[str], rows: list[tuple], max_width: int) -> None:
    """Rows as a table as wide as the terminal (into a pipe or file: as wide as its cells, a column counted at most
    PIPED_COLUMN_CELLS wide, at least 120).
    Cells are Text, never markup, with control characters shown as escapes."""
    import shutil

    from rich.cells import cell_len
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    def cell(v) -> Text:
        if isinstance(v, float) and v == 0:
            v = 0.0  # a rounded tiny negative (loss -1e-9 to 4 places) reads 0, not -0
        text = "NULL" if v is None else f"{v:.6g}" if isinstance(v, float) else visible(str(v))
        return Text(text if not max_width or len(text) <= max_width else text[: max_width - 1] + "…")

    table = Table(show_lines=False)
    for c in columns:
        table.add_column(Text(visible(c)), overflow="fold")
    cells = [[cell(v) for v in r] for r in rows]
    for r in cells:
        table.add_row(*r)
    # COLUMNS, else the terminal's width; into a pipe or file, as wide as the cells need (no number folded), a
    # column counted at most PIPED_COLUMN_CELLS wide (long text folds) and the table at least 120
    needed = [
        min(max([cell_len(visible(c)), *(r[k].cell_len for r in cells)]), PIPED_COLUMN_CELLS)
        for k, c in enumerate(columns)
    ]
    width = shutil.get_terminal_size((max(120, sum(n + 3 for n in needed) + 1), 24)).columns
    if sum(min(n, NARROWEST_COLUMN) + 3 for n in needed) + 1 > width:
        # more columns than the width holds: rich would squeeze them to nothing (an empty table); one line per
        # column instead, a record at a time (psql's expanded display)
        names = [visible(c) for c in columns]
        pad = max(cell_len(n) for n in names)
        for i, r in enumerate(cells, 1):
            typer.echo(f"-[ row {i} ]" + "-" * max(0, min(width, 80) - 11 - len(str(i))))
            for name, value in zip(names, r):
                typer.echo(f"{name}{' ' * (pad - cell_len(name))} | {value.plain}")
    else:
        Console(width=width).print(table)
    typer.echo(f"({len(rows)} row{'s' if len(rows) != 1 else ''})", err=True)


@app.command()
def show(
    run_dir: Path = typer.Argument(..., help="Run folder."),
    width: int = typer.Option(100, min=0, help="Characters of the best and worst responses to show."),
) -> None:
    """A step-by-step summary of a run for the terminal: reward, KL, loss, length, stage seconds, the learning rate
    when it changed over the run, and the best and worst rollout of the last step."""
    import duckdb

    from refiner_core.publish.run_sql import CatalogError, fork_origin, monitor_events, open_runs, run_summary

    try:
        con = open_runs([run_dir])
    except CatalogError as e:
        _fail(str(e))
    except duckdb.Error as e:  # not a DuckDB file, or one another process holds open for writing
        _fail(f"cannot open the catalog: {e}")
    try:
        summary = run_summary(con)
        monitor_columns, monitors = monitor_events(con)
        origin = fork_origin(con)
    except duckdb.Error as e:
        _fail(str(e), code=1)
    finally:
        con.close()
    if not summary["steps"]:
        _fail("the run has no finished steps yet", code=1)
    _warn_stale_rescores([run_dir])
    typer.echo(f"run {run_dir}: {len(summary['steps'])} step{'s' if len(summary['steps']) != 1 else ''}")
    if origin:
        typer.echo(visible(origin))
    _print_table(summary["columns"], summary["steps"], 0)
    for name, (column, values) in summary["moving"].items():  # a schedule or a controller: where it went
        if len({value for _, value in values}) > 1:
            (first_step, first), (last_step, last) = values[0], values[-1]
            peak_step, peak = max(values, key=lambda row: row[1])
            peaked = f", peak {peak:g} at step {peak_step}" if peak_step not in (first_step, last_step) else ""
            typer.echo(f"{name}: {first:g} at step {first_step}{peaked}, {last:g} at step {last_step} (steps.{column})")
    for which in ("best", "worst"):
        if which in summary:
            r = summary[which]
            text = " ".join(visible(r["response_text"] or "").split())
            typer.echo(
                f"{which} of step {r['step']}: reward {r['reward']} ({visible(str(r['prompt_id']))} "
                f"#{r['sample_idx']}): {text[:width]}{'…' if len(text) > width else ''}"
            )
    judge, beyond = summary["judge"], summary.get("judge_beyond_steps")
    if judge and judge["requests"] is not None:
        typer.echo(
            f"judge over {judge['steps']} step(s): {judge['requests']} requests, {judge['prompt_tokens']} prompt + "
            f"{judge['completion_tokens']} completion tokens, {_dollars(judge['cost_usd'])}"
        )
    if beyond and beyond["stages"]:
        total = (
            ""
            if judge is None or judge["cost_usd"] is None
            else f"; the run's judge total ${judge['cost_usd'] + (beyond['cost_usd'] or 0):.4f}"
        )
        typer.echo(
            f"judge beyond the steps ({beyond['stage_names']}, {beyond['stages']} stage run(s)): {beyond['requests']} "
            f"requests, {beyond['prompt_tokens']} prompt + {beyond['completion_tokens']} completion tokens, "
            f"{_dollars(beyond['cost_usd'])}{total} (refiner sql RUN_DIR 'SELECT * FROM judge_spend')"
        )
    if monitors:
        typer.echo(f"monitors tripped ({len(monitors)}; refiner sql RUN_DIR 'SELECT * FROM monitor_events'):")
        _print_table(monitor_columns, monitors, 80)


@app.command()
def config(
    recipe: Path | None = typer.Argument(None, exists=True, dir_okay=False, help="Recipe to resolve."),
    overrides: list[str] = typer.Option([], "--set", help="Override a field: section.field=value."),
    fields: bool = typer.Option(
        False, "--fields", help="List every field with its default, help text and TRL's and verl's names for it."
    ),
    check: bool = typer.Option(
        False,
        "--check",
        help="Run the preflight checks `refiner run` runs (nothing starts); exit 2 on a problem, print warnings.",
    ),
) -> None:
    """Print the resolved config of a recipe (YAML), or document every field, or check it."""
    import yaml

    if fields:
        for name, default, help_text in describe():
            peers = peer_names_of(name)
            typer.echo(f"{name} = {default}\n    {help_text}" + (f"\n    Elsewhere: {peers}." if peers else ""))
        return
    try:
        cfg = load_recipe(recipe, overrides)
    except (ConfigError, OSError) as e:
        _fail(str(e))
    if check:
        problems = check_recipe(cfg)
        if problems:
            _fail(_problems(recipe, problems, "found before running"))
        for line in recipe_warnings(cfg):
            _warn(line)
        typer.echo(f"{_named(recipe)}: no problem found")
        return
    typer.echo(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


@app.command()
def plot(
    run_dir: Path = typer.Argument(..., help="Run folder."),
    output: Path | None = typer.Option(None, "-o", "--output", help="PNG path (default: RUN_DIR/curves.png)."),
) -> None:
    """Plot reward, KL, loss and response length per step (and held-out eval curves when the run has them) to a PNG."""
    import duckdb

    from refiner_core.publish.plots import eval_summary, plot_steps
    from refiner_core.store.storage import query as run_query

    db = run_dir / "catalog.duckdb"
    if not db.exists():
        _fail(f"no catalog at {db}")
    out = output or run_dir / "curves.png"
    if out.suffix.lower() != ".png":
        _fail(f"-o {out}: the plot is a PNG; name a .png file")
    try:
        columns, rows = run_query(db, "SELECT * FROM steps ORDER BY step")
        evals = eval_summary(db)
    except duckdb.Error as e:  # not a DuckDB file, or one another process holds open for writing
        _fail(f"cannot read the catalog: {e}")
    if not rows:
        _fail("the run has no finished steps yet", code=1)
    try:
        plot_steps([dict(zip(columns, r)) for r in rows], out, evals=evals)
    except OSError as e:  # a folder in the way, no permission
        _fail(f"-o {out}: {e.strerror or e}")
    typer.echo(str(out))


@app.command()
def rescore(
    run_dir: Path = typer.Argument(..., exists=True, file_okay=False, help="A run folder with scored steps."),
    overrides: list[str] = typer.Option(
        [], "--set", help="A reward setting: reward.field=value, grpo.advantage*, judge.on_failure (repeatable)."
    ),
    name: str | None = typer.Option(None, "--name", help="Version name (default: derived from the settings)."),
) -> None:
    """Recompute rewards and advantages of every scored step with new reward settings, without calling the judge.

    The new version is written beside training's ('train') under RUN_DIR/rescores/ and into the catalog's
    rewards, reward_weights and advantages tables (column reward_version); step_rewards compares versions.
    Settings that need new judgments are refused (exit 2) with what would be re-judged. It rewrites the run's
    catalog: a folder in use by a run is refused (exit 3), as `refiner run` refuses it."""
    from refiner_core.reward.rescore import RescoreError, rescore_run, settings_flags, version_settings

    recipe = run_dir / "recipe.yaml"
    if not recipe.exists():
        _fail(f"{run_dir} has no recipe.yaml: not a run folder")
    try:
        base = load_recipe(recipe)
        new = load_recipe(recipe, overrides)
        # the settings a run would refuse (the run's own environment, its data files and models, is not checked)
        problems = [p for p in check_values(new) if p not in set(check_values(base))]
        if problems:
            _fail(
                f"{len(problems)} problem(s) with the new settings, nothing was rescored:\n  " + "\n  ".join(problems)
            )
        with _holding(run_dir.resolve(), f"refiner rescore {run_dir}"):
            before = version_settings(run_dir, name) if name else None  # a derived name: the same settings
            if before is not None and before != settings_flags(base, new):
                _warn(f"replacing reward version {name!r}, computed with {before}")
            version, steps = rescore_run(run_dir.resolve(), base, new, name)
    except (ConfigError, RescoreError) as e:
        _fail(str(e))
    typer.echo(
        f"reward version {version!r}: {sum(s.rollouts for s in steps)} rollouts over {len(steps)} steps, 0 judge calls"
    )
    _print_table(
        ["step", "rollouts", "reward_mean (train)", f"reward_mean ({version})", "changed"],
        [(s.step, s.rollouts, round(s.train_reward_mean, 4), round(s.reward_mean, 4), s.changed) for s in steps],
        40,
    )
    compare = shlex.join(["refiner", "sql", str(run_dir), "SELECT * FROM step_rewards ORDER BY step, reward_version"])
    typer.echo(f"\ncompare: {compare}")


@app.command()
def push(
    run_dir: Path = typer.Argument(..., exists=True, file_okay=False, help="A run folder with checkpoints."),
    repo: str = typer.Option(..., "--repo", help="Hub model repo: ORG/NAME (created when missing)."),
    step: int | None = typer.Option(None, "--step", help="Step checkpoint (default: the newest one)."),
    sft: bool = typer.Option(False, "--sft", help="The SFT checkpoint (checkpoints/sft) instead of a step."),
    teacher: bool = typer.Option(
        False,
        "--teacher",
        help="The EMA teacher's checkpoint (teacher/step_NNNN; the newest unless --step) instead of the policy's.",
    ),
    private: bool = typer.Option(False, "--private", help="Create the repo private."),
    revision: str | None = typer.Option(None, "--revision", help="Branch to commit to (created when missing)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what would be uploaded; upload nothing."),
) -> None:
    """Publish a checkpoint (weights, config, tokenizer, model card; never the optimizer state) to the Hugging Face
    Hub. The token comes from HF_TOKEN or `hf auth login`. An incomplete checkpoint exits 2, a Hub error 1."""
    from refiner_core.publish.hub import PushError, choose_checkpoint, plan_push
    from refiner_core.publish.hub import push as push_plan

    if step is not None and sft:
        _fail("--step and --sft exclude each other")
    try:
        plan = plan_push(choose_checkpoint(run_dir, step, sft, teacher))
    except PushError as e:
        _fail(str(e))
    typer.echo(f"checkpoint: {plan.folder}")
    for name, size in plan.files:
        typer.echo(f"  {size:>12,}  {name}")
    typer.echo(f"  {plan.total_bytes:>12,}  total, {len(plan.files)} files")
    typer.echo("card metadata: " + json.dumps(plan.card_metadata, ensure_ascii=False))
    if dry_run:
        typer.echo(f"dry run: nothing uploaded to {repo}")
        return
    try:
        url = push_plan(plan, repo, private=private, revision=revision)
    except PushError as e:
        _fail(str(e), code=1)
    typer.echo(f"uploaded to {repo}: {url}")


@app.command()
def fork(
    parent: Path = typer.Argument(..., file_okay=False, help="The run folder to fork."),
    new: Path = typer.Argument(..., help="The fork's run folder (new, or a fork of PARENT at the same step)."),
    at: int = typer.Option(..., "--at", help="The first step the fork computes with its own settings."),
    overrides: list[str] = typer.Option([], "--set", help="A setting of the fork: section.field=value (repeatable)."),
    debug: bool = typer.Option(False, "--debug", help="Also show Prefect's failure tracebacks on the terminal."),
) -> None:
    """Fork a run at step N: NEW runs PARENT's recipe for steps 0..N-1, reusing PARENT's stages (hard-linked, not
    recomputed or copied: their cache keys match), then runs on from step N with the --set settings.

    A setting that the stages before step 0 read (data, rubrics, SFT, the base model, the seed, the precision)
    changes step 0's rollout: such a fork reuses no step and says why. Running the same command again resumes the
    fork, from its own checkpoint and recipe once the parent pruned step N or is gone. Exit codes as `refiner
    run`'s; 2 also for a fork that cannot be made (the parent has not finished step N-1, or pruned its checkpoint; one
    folder inside the other)."""
    from flows.run_folder import ForkError, plan_fork
    from refiner_core.store.forks import shared_disk, write_fork

    try:
        cfg, record = plan_fork(parent, new, at, overrides)
    except ForkError as e:
        _fail(str(e))
    problems = check_recipe(cfg)
    if problems:
        _fail("\n  ".join([f"the fork's recipe: {len(problems)} problem(s), nothing was run:", *problems]))
    changed = " ".join(f"--set {s}" for s in record.settings) or "no setting changed"
    if record.shares_steps and at:
        typer.echo(
            f"fork {record.run} of {record.parent_run} at step {at}: steps 0-{at - 1} with {record.parent_run}'s "
            f"recipe (reused where cached), steps {at}-{cfg.grpo.steps - 1} with {changed}",
            err=True,
        )
    else:
        typer.echo(f"fork {record.run} of {record.parent_run}: every step with {changed}", err=True)
    if record.note:
        _warn(record.note)
    _run_locked(cfg, Path(record.run_dir), False, debug, f"refiner fork {parent} --at {at}", lambda: write_fork(record))
    if not Path(record.parent_dir).is_dir():
        return
    disk = shared_disk(record.parent_dir, record.run_dir)
    typer.echo(
        f"\nfork disk: {_mib(disk['own'])} of its own ({disk['own'] / max(disk['parent'], 1):.1%} of the parent's "
        f"{_mib(disk['parent'])}), {_mib(disk['shared'])} hard-linked from {record.parent_dir}\n"
        f'compare the branches: refiner sql {record.parent_dir} {record.run_dir} "SELECT step, run, '
        'round(reward_mean, 3) AS reward, round(kl, 5) AS kl FROM steps ORDER BY step, run"'
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


@app.command()
def compare(
    sides: list[str] = typer.Argument(
        ...,
        help="A B: two evaluated policies, each RUN_DIR (its last evaluated policy), RUN_DIR@STEP, RUN_DIR@base or "
        "RUN_DIR@sft. With --pool, more pairs follow: A B A2 B2 ...",
    ),
    pool: bool = typer.Option(False, "--pool", help="Pool several pairs (e.g. one per seed) into one comparison."),
    mode: str = typer.Option("greedy", "--mode", help="greedy | sampled (per-prompt means of the sampled answers)."),
    alpha: float = typer.Option(
        0.05,
        "--alpha",
        help="Significance level of the exit code and the * marks (beyond 16 differing prompts: a continuous column "
        "differs when its bootstrap interval at 1 - alpha excludes 0).",
    ),
    level: float = typer.Option(0.95, "--level", help="Confidence level of the bootstrap intervals shown."),
    resamples: int = typer.Option(10_000, "--resamples", help="Bootstrap resamples."),
    seed: int = typer.Option(0, "--seed", min=0, help="Bootstrap seed."),
    as_json: bool = typer.Option(False, "--json", help="Print the comparison as JSON."),
    list_prompts: int = typer.Option(
        8, "--list", min=0, help="Prompts named per change in the table output (0 = all)."
    ),
) -> None:
    """Compare two evaluated policies (two runs, or two steps of one run) on the held-out prompts both evaluated.

    Every binary eval column gets an exact McNemar test and the prompts it fixed or broke, every continuous one a
    paired bootstrap interval of B - A (while at most 16 prompts differ, an exact sign-flip test decides whether it
    differs). Exit code, as diff's: 0 no column differs at --alpha, 1 some column does,
    2 trouble (a side names no evaluated policy or no readable catalog, the sides share no prompt, bad arguments)."""
    from refiner_core.publish.compare import CompareError, format_comparison, load_side
    from refiner_core.publish.compare import compare as compare_sides

    if mode not in ("greedy", "sampled"):
        _fail(f"--mode must be greedy or sampled, not {mode!r}")
    if len(sides) < 2 or len(sides) % 2:
        _fail(f"give sides in pairs (A B, with --pool A B A2 B2 ...); got {len(sides)}")
    if not 0 < alpha < 1 or not 0 < level < 1 or resamples < 1:
        _fail("--alpha and --level must lie in (0, 1), --resamples be positive")
    try:
        loaded = [load_side(spec, mode) for spec in sides]
        result = compare_sides(
            list(zip(loaded[::2], loaded[1::2])), pool=pool, alpha=alpha, level=level, resamples=resamples, seed=seed
        )
    except CompareError as e:
        _fail(str(e))
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=1))
    else:
        typer.echo(visible(format_comparison(result, list_prompts)))
    raise typer.Exit(1 if result.differs else 0)


judge_app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode="markdown",
    help="The rubric judge: serve a model over the OpenAI API, check how far it can be trusted.",
)
app.add_typer(judge_app, name="judge")


@judge_app.command("agreement")
def judge_agreement(
    run_dir: Path = typer.Argument(..., exists=True, file_okay=False, help="A run folder with stored judgments."),
    judge_config: Path | None = typer.Option(
        None,
        "--judge-config",
        exists=True,
        dir_okay=False,
        help="YAML with a judge: section (settings as in a recipe, laid over the run's): the judge to compare with.",
    ),
    labels: Path | None = typer.Option(
        None,
        "--labels",
        exists=True,
        dir_okay=False,
        help="JSONL, CSV or TSV (by suffix) of labels: step, prompt_id, sample_idx, rubric_id, and passed and/or "
        "score (oriented, 0-1).",
    ),
    sample: int = typer.Option(32, "--sample", help="--judge-config: stored rollouts re-judged (all their rubrics)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the sample."),
    name: str | None = typer.Option(None, "--name", help="The check's name (default: derived from its settings)."),
    as_json: bool = typer.Option(False, "--json", help="Print the agreement rows as JSON."),
) -> None:
    """How far a run's judge can be trusted: re-judge a seeded sample of its stored rollouts with another judge
    (--judge-config), or read a person's labels (--labels), and store per rubric group Cohen's kappa of the pass/fail
    verdicts, Spearman's rho of the scores, how well the judge's score separates the other side's passes from its
    fails, and the spread of the judge's own scores (catalog tables judge_agreement, judge_checks). Exit 2 on bad
    input (no catalog or recipe.yaml, neither or both of --judge-config and --labels, labels naming no stored
    judgment), 1 when the other side scored no pair (every judgment failed; with --json too), 3 while a run uses the
    folder (the check rewrites its catalog)."""
    from refiner_core.eval.judge_checks import ALL
    from refiner_core.publish.judge_agreement import AgreementError, check_judge

    try:
        with _holding(run_dir.resolve(), f"refiner judge agreement {run_dir}"):
            check = check_judge(
                run_dir.resolve(), judge_config=judge_config, labels=labels, sample=sample, seed=seed, name=name
            )
    except AgreementError as e:
        _fail(str(e))
    overall = next(a for a in check.agreement if a["rubric_group"] == ALL) if check.agreement else None
    usable, failed = (overall["pairs"], overall["failed"]) if overall else (0, 0)
    # stored judgments the run's own judge failed (NULL) that the other side scored: no pair either
    run_failed = check.pairs - usable - failed
    nothing_compared = (
        f"nothing was compared: of {check.pairs} pairs, {failed} got no score from {check.other} (see "
        f"judge_checks.other_failure) and {run_failed} none from the run's own judge (judge_checks.score NULL: its "
        "judgment failed in training)"
    )
    if as_json:
        typer.echo(json.dumps(check.agreement, indent=1, default=str))
        if usable == 0:
            _fail(nothing_compared, code=1)
        return
    typer.echo(
        f"check {check.name}: {usable} of {check.pairs} (rollout, rubric) pairs of {check.rollouts} rollouts judged by "
        f"both ({failed} got no score from {check.other}"
        + (f", {run_failed} none from the run's judge)" if run_failed else ")")
    )
    number = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    columns = [
        "rubric group",
        "pairs",
        "failed",
        "kappa",
        "spearman",
        "separation",
        "pass",
        "other pass",
        "score mean",
        "score std",
        "p10-p90",
    ]
    rows = [
        (
            a["rubric_group"],
            a["pairs"],
            a["failed"],
            number(a["kappa"], ".3f"),
            number(a["spearman"], ".3f"),
            number(a["separation_auc"], ".3f"),
            number(a["pass_rate"], ".0%"),
            number(a["other_pass_rate"], ".0%"),
            number(a["score_mean"], ".3f"),
            number(a["score_std"], ".4f"),
            "-" if a["score_p10"] is None else f"{a['score_p10']:.3f}-{a['score_p90']:.3f}",
        )
        for a in check.agreement
    ]
    _print_table(columns, rows, 40)
    typer.echo(
        f'stored: {check.folder}; refiner sql {run_dir} "SELECT * FROM judge_agreement WHERE check_name = '
        f"'{check.name}'\"",
    )
    if usable == 0:
        _fail(nothing_compared, code=1)


@judge_app.command("serve")
def judge_serve(
    model: str = typer.Argument(
        ..., help="Model spec as model.policy: 'tiny-qwen3', 'smollm2-135m-instruct', a folder."
    ),
    vllm_args: list[str] | None = typer.Argument(
        None,
        help="More arguments for vLLM's server, after --: `refiner judge serve MODEL -- --reasoning-parser qwen3`.",
        show_default=False,
    ),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="Port (0 = a free one)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    name: str = typer.Option(
        "",
        "--name",
        help="Served model name's prefix (default: the spec, or the folder's "
        "name); the checkpoint's content hash follows it: NAME-1a2b3c4d5e6f.",
    ),
    startup_timeout: float = typer.Option(600.0, "--startup-timeout", help="Seconds to wait for GET /health."),
    log: Path | None = typer.Option(None, "--log", dir_okay=False, help="Server log file (default: a temporary file)."),
    gpu_memory_utilization: float = typer.Option(
        0.0,
        "--gpu-memory-utilization",
        help="On a GPU: the share of its memory the server takes (0 = vLLM's default, 0.92: nothing left for a "
        "learner or rollout engine on that GPU).",
    ),
) -> None:
    """Start an OpenAI-compatible vLLM server for MODEL, wait until it is healthy, print its endpoint; Ctrl-C
    stops it."""
    from refiner_core.judges.serve import ServerStartError, start_server, stop_server

    typer.echo(f"starting the judge server for {model} on {host}:{port or '(free port)'} ...", err=True)
    try:
        server = start_server(
            model,
            host=host,
            port=port,
            served_name=name,
            startup_timeout=startup_timeout,
            log_path=log,
            gpu_memory_utilization=gpu_memory_utilization or None,
            extra_args=vllm_args,
        )
    except (ServerStartError, FileNotFoundError) as e:
        _fail(str(e), code=1)
    code = None
    try:
        with interrupts_never_lost():  # SIGTERM stops the server like Ctrl-C
            typer.echo(f"endpoint: {server.base_url}")
            typer.echo(f"model: {server.model_name}")
            typer.echo(f"pid: {server.pid}")
            typer.echo(f"log: {server.log_path}")
            typer.echo(
                f"use it: --set judge.engine=openai --set judge.openai.base_url={server.base_url} "
                f"--set judge.openai.api_model={server.model_name} --set judge.mode=json"
            )
            typer.echo("Ctrl-C stops the server.", err=True)
            sys.stdout.flush()
            code = server.proc.wait()
    except KeyboardInterrupt:
        typer.echo("stopping the judge server ...", err=True)
    finally:
        stop_server(server)
    if code is not None:
        _fail(f"the judge server exited with code {code}; log {server.log_path}", code=1)


if __name__ == "__main__":
    app()
