"""Prefect artifacts for the UI after every step: the steps so far as a table, the step's best and worst rollout
as markdown, and the run's curves as an image inside a markdown artifact (RUN_DIR/curves.png, redrawn each step,
embedded as a data: URI so the UI shows it from any machine). Keys are per run, so the UI keeps each artifact's
history across steps and runs. Model output is shown as text in code blocks: the UI renders markdown and HTML,
and a rollout's own images, links or tags must not be."""

from __future__ import annotations

import re
from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from refiner_core.plots import eval_summary, plot_steps_embedded
from refiner_core.run_sql import open_runs, run_query, run_summary
from refiner_core.text_safety import markdown_code_block, markdown_inline

EXCERPT_CHARS = 600


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
    create_markdown_artifact(rollouts_markdown(run, step, summary), key=artifact_key(run, "rollouts"),
                             description=f"{run}: best and worst rollout of step {step}")
    db = Path(run_dir) / "catalog.duckdb"
    curves = Path(run_dir) / "curves.png"
    image = plot_steps_embedded([dict(zip(columns, r)) for r in steps], curves, evals=eval_summary(db))
    create_markdown_artifact(f"![{markdown_inline(run)} curves]({image})\n\n"
                             f"file: {markdown_inline(str(curves.resolve()))}", key=artifact_key(run, "curves"),
                             description=f"{run}: reward, KL, loss and length per step")
    get_run_logger().info("artifacts: %s, %s, %s", artifact_key(run, "steps"), artifact_key(run, "rollouts"),
                          artifact_key(run, "curves"))


def rollouts_markdown(run: str, step: int, summary: dict) -> str:
    """The best and worst rollout of run_summary as markdown; their text (its first EXCERPT_CHARS characters) and
    prompt IDs are shown literally."""
    lines = [f"### {markdown_inline(run)}, step {step}"]
    for which in ("best", "worst"):
        if which in summary:
            r = summary[which]
            text = r["response_text"] or ""
            lines += [f"**{which}**: reward {r['reward']} (prompt {markdown_inline(str(r['prompt_id']))}, "
                      f"sample {r['sample_idx']})", "", markdown_code_block(text[:EXCERPT_CHARS])]
            if len(text) > EXCERPT_CHARS:
                lines.append(f"*… {len(text) - EXCERPT_CHARS} more characters*")
            lines.append("")
    return "\n".join(lines)
