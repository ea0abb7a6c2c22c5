"""Prefect artifacts for the UI after every step: the steps so far as a table, the step's best and worst rollout
as markdown, and a link to the run's curves (a PNG redrawn each step). Keys are per run, so the UI keeps each
artifact's history across steps and runs."""

from __future__ import annotations

import re
from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

from refiner_core.plots import eval_summary, plot_steps
from refiner_core.run_sql import open_runs, run_query, run_summary


def artifact_key(run: str, what: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{run}-{what}".lower()).strip("-")


def publish_step_artifacts(run_dir: str, run: str, step: int) -> None:
    con = open_runs([run_dir])
    try:
        summary = run_summary(con)
        columns, steps = run_query(con, "SELECT * FROM steps ORDER BY step")
    finally:
        con.close()
    rows = [dict(zip(summary["columns"], r)) for r in summary["steps"]]
    create_table_artifact(rows, key=artifact_key(run, "steps"), description=f"{run}: metrics of steps 0-{step}")
    lines = [f"### {run}, step {step}"]
    for which in ("best", "worst"):
        if which in summary:
            r = summary[which]
            text = " ".join((r["response_text"] or "").split())[:600].replace("<", "&lt;")
            lines += [f"**{which}**: reward {r['reward']} (prompt `{r['prompt_id']}`, sample {r['sample_idx']})",
                      "", f"> {text}", ""]
    create_markdown_artifact("\n".join(lines), key=artifact_key(run, "rollouts"),
                             description=f"{run}: best and worst rollout of step {step}")
    db = Path(run_dir) / "catalog.duckdb"
    curves = plot_steps([dict(zip(columns, r)) for r in steps], Path(run_dir) / "curves.png", evals=eval_summary(db))
    create_link_artifact(curves.resolve().as_uri(), link_text=f"{run} curves (PNG)", key=artifact_key(run, "curves"),
                         description=f"{run}: reward, KL, loss and length per step")
    get_run_logger().info("artifacts: %s, %s, %s", artifact_key(run, "steps"), artifact_key(run, "rollouts"),
                          artifact_key(run, "curves"))
