"""`refiner`: run a recipe, query a run's catalog, show the config fields, plot a run."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from refiner_core.config import ConfigError, describe, load_recipe

app = typer.Typer(add_completion=False, no_args_is_help=True, help="GRPO post-training pipeline for LLM policies.")

EXAMPLE_SQL = [
    "SELECT step, round(reward_mean, 3) AS reward, round(kl, 5) AS kl, round(loss, 4) AS loss FROM steps ORDER BY step",
    "SELECT rubric_id, avg(oriented_score) AS mean, count(*) FILTER (WHERE failure IS NOT NULL) AS failures "
    "FROM judge_scores GROUP BY rubric_id ORDER BY rubric_id",
    "SELECT prompt_id, sample_idx, reward, left(response_text, 60) AS response FROM rewards JOIN rollouts "
    "USING (run, step, prompt_id, sample_idx) WHERE step = 0 ORDER BY reward DESC LIMIT 5",
]


def _fail(message: str, code: int = 2) -> None:
    typer.secho(f"error: {message}", fg="red", err=True)
    raise typer.Exit(code)


@app.command()
def run(
    recipe: Path = typer.Argument(..., exists=True, dir_okay=False, help="Recipe YAML (see recipes/)."),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Run folder (default: <run.run_root>/<run.name>)."),
    overrides: list[str] = typer.Option([], "--set", help="Override a field: section.field=value (repeatable)."),
    refresh: bool = typer.Option(False, "--refresh", help="Ignore cached stage results and recompute everything."),
) -> None:
    """Run the pipeline for RECIPE. Rerunning resumes: finished stages are served from the cache."""
    try:
        cfg = load_recipe(recipe, overrides)
    except (ConfigError, OSError) as e:
        _fail(str(e))
    folder = (run_dir or Path(cfg.run.run_root) / cfg.run.name).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    if refresh:
        os.environ["PREFECT_TASKS_REFRESH_CACHE"] = "true"
    import torch

    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    import yaml

    (folder / "recipe.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    from flows.refiner import refiner_pipeline

    typer.echo(f"run folder: {folder}", err=True)
    try:
        state = refiner_pipeline(recipe=cfg.to_dict(), run_dir=str(folder), return_state=True)
    except KeyboardInterrupt:
        typer.secho("interrupted: run the same command again to resume from the unfinished stage", err=True)
        raise typer.Exit(130)
    if not state.is_completed():
        typer.secho(f"run failed ({state.name}): {state.message}", fg="red", err=True)
        typer.secho("fix the cause and run the same command again: finished stages are cached", err=True)
        raise typer.Exit(1)
    db = folder / "catalog.duckdb"
    me = sys.argv[0] if Path(sys.argv[0]).name == "refiner" else "refiner"
    typer.echo(f"\ncatalog: {db}\nexample queries:")
    for sql in EXAMPLE_SQL[:2]:
        typer.echo(f'  {me} sql {folder} "{sql}"')
    typer.echo(f"or from Python: duckdb.connect(\"{db}\", read_only=True)")


@app.command()
def sql(
    run_dir: Path = typer.Argument(..., help="Run folder (holding catalog.duckdb) or the catalog file itself."),
    query: str = typer.Argument(..., help="SQL to run, read-only. Tables: prompts, rubrics, rollouts, "
                                          "judge_scores, rewards, steps, quarantine, sft_examples, sft_stats, "
                                          "sft_metrics."),
    fmt: str = typer.Option("table", "--format", "-f", help="table | csv | json"),
    max_width: int = typer.Option(60, help="Cut table cells to this many characters (0 = no cut)."),
) -> None:
    """Run a read-only SQL query against a run's catalog."""
    import duckdb

    from refiner_core.storage import query as run_query

    db = run_dir if run_dir.suffix == ".duckdb" else run_dir / "catalog.duckdb"
    if not db.exists():
        _fail(f"no catalog at {db} (has the run finished a step?)")
    try:
        columns, rows = run_query(db, query)
    except duckdb.Error as e:
        _fail(str(e).splitlines()[0], code=1)
    if fmt == "json":
        typer.echo(json.dumps([dict(zip(columns, r)) for r in rows], default=str, indent=1))
    elif fmt == "csv":
        import csv

        writer = csv.writer(sys.stdout)
        writer.writerow(columns)
        writer.writerows(rows)
    elif fmt == "table":
        _print_table(columns, rows, max_width)
    else:
        _fail(f"--format must be table, csv or json, not {fmt!r}")


def _print_table(columns: list[str], rows: list[tuple], max_width: int) -> None:
    from rich.console import Console
    from rich.table import Table

    def cell(v) -> str:
        text = "NULL" if v is None else f"{v:.6g}" if isinstance(v, float) else str(v)
        return text if not max_width or len(text) <= max_width else text[: max_width - 1] + "…"

    table = Table(show_lines=False)
    for c in columns:
        table.add_column(c, overflow="fold")
    for r in rows:
        table.add_row(*(cell(v) for v in r))
    Console(width=max(120, sum(len(c) + 3 for c in columns))).print(table)
    typer.echo(f"({len(rows)} row{'s' if len(rows) != 1 else ''})", err=True)


@app.command()
def config(
    recipe: Optional[Path] = typer.Argument(None, exists=True, dir_okay=False, help="Recipe to resolve."),
    overrides: list[str] = typer.Option([], "--set", help="Override a field: section.field=value."),
    fields: bool = typer.Option(False, "--fields", help="List every field with its default and help text."),
) -> None:
    """Print the resolved config of a recipe (YAML), or document every field."""
    import yaml

    if fields:
        for name, default, help_text in describe():
            typer.echo(f"{name} = {default}\n    {help_text}")
        return
    try:
        cfg = load_recipe(recipe, overrides)
    except (ConfigError, OSError) as e:
        _fail(str(e))
    typer.echo(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


@app.command()
def plot(
    run_dir: Path = typer.Argument(..., help="Run folder."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="PNG path (default: RUN_DIR/curves.png)."),
) -> None:
    """Plot reward, KL, loss and response length per step to a PNG."""
    from refiner_core.plots import plot_steps
    from refiner_core.storage import query as run_query

    db = run_dir / "catalog.duckdb"
    if not db.exists():
        _fail(f"no catalog at {db}")
    columns, rows = run_query(db, "SELECT * FROM steps ORDER BY step")
    if not rows:
        _fail("the run has no finished steps yet", code=1)
    out = output or run_dir / "curves.png"
    plot_steps([dict(zip(columns, r)) for r in rows], out)
    typer.echo(str(out))


if __name__ == "__main__":
    app()
