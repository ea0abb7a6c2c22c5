"""Prefect artifacts for the UI after every step: the steps so far as a table, the step's best and worst rollout
as markdown, and the run's curves as an image inside a markdown artifact (RUN_DIR/curves.png, redrawn each step,
embedded as a data: URI so the UI shows it from any machine). Keys are per run, so the UI keeps each artifact's
history across steps and runs. Model output is shown as text in code blocks: the UI renders markdown and HTML,
and a rollout's own images, links or tags must not be. The same step also refreshes the model card of the checkpoint
it wrote and sends its metrics to the trackers of run.report_to."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from refiner_core.config import RunConfig
from refiner_core.data.text_safety import markdown_code_block, markdown_inline
from refiner_core.publish.model_card import RECIPE_FILE, write_model_card
from refiner_core.publish.plots import eval_summary, plot_steps_embedded
from refiner_core.publish.run_sql import open_runs, run_query, run_summary
from refiner_core.publish.tracking import report

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
    rollouts = rollouts_markdown(run, step, summary)
    create_markdown_artifact(
        rollouts, key=artifact_key(run, "rollouts"), description=f"{run}: best and worst rollout of step {step}"
    )
    db = Path(run_dir) / "catalog.duckdb"
    curves = Path(run_dir) / "curves.png"
    step_rows, evals = [dict(zip(columns, r)) for r in steps], eval_summary(db)
    image = plot_steps_embedded(step_rows, curves, evals=evals)
    create_markdown_artifact(
        f"![{markdown_inline(run)} curves]({image})\n\nfile: {markdown_inline(str(curves.resolve()))}",
        key=artifact_key(run, "curves"),
        description=f"{run}: reward, KL, loss and length per step",
    )
    get_run_logger().info(
        "artifacts: %s, %s, %s", artifact_key(run, "steps"), artifact_key(run, "rollouts"), artifact_key(run, "curves")
    )
    recipe_file = Path(run_dir) / RECIPE_FILE
    if recipe_file.is_file():  # a pipeline run's folder (flows/run_folder.py writes the resolved recipe)
        recipe = yaml.safe_load(recipe_file.read_text())
        refresh_model_cards(run_dir, run, step, recipe, step_rows, evals)
        report_step(run_dir, run, step, recipe, step_rows, evals, rollouts)


def refresh_model_cards(run_dir: str, run: str, step: int, recipe: dict, steps: list[dict], evals: list[dict]) -> None:
    """Rewrite the card of the checkpoint update `step` wrote with its steps row and held-out evaluation (evaluated
    after the update wrote the first card), and after step 0 the SFT checkpoint's card with its evaluation. Runs
    after every step, cached ones included; the card is not part of the checkpoint's hash."""
    row = next((r for r in steps if r["step"] == step), {})
    if row.get("checkpoint") and _written_here(Path(row["checkpoint"]), run_dir):
        write_model_card(
            row["checkpoint"],
            run_dir,
            kind="grpo",
            run=run,
            step=step + 1,
            metrics=row,
            evals=[e for e in evals if e["step"] == step + 1 and e["phase"] == "grpo"],
            judge_cost=judge_cost_to(steps, step),
        )
    sft = Path(run_dir) / "checkpoints" / "sft"
    if step == 0 and recipe["sft"]["enabled"] and _written_here(sft, run_dir):
        write_model_card(
            sft,
            run_dir,
            kind="sft",
            run=run,
            step=None,
            evals=[e for e in evals if e["step"] == 0 and e["phase"] == "sft"],
        )


def judge_cost_to(steps: list[dict], step: int) -> dict:
    """The judge ledger of steps 0..`step` (steps rows): requests, tokens and dollars summed."""
    upto = [r for r in steps if r["step"] <= step]
    columns = ("judge_requests", "judge_prompt_tokens", "judge_completion_tokens", "judge_cost_usd")
    return {"steps": len(upto), **{c: sum(r.get(c) or 0 for r in upto) for c in columns}}


def _written_here(checkpoint: Path, run_dir: str) -> bool:
    """A checkpoint folder this run wrote: inside its folder, its card no hard link to another run's (a fork's
    steps before its fork step are its parent's checkpoints, described by the parent's cards)."""
    card = checkpoint / "README.md"
    inside = checkpoint.resolve().is_relative_to(Path(run_dir).resolve())
    return checkpoint.is_dir() and inside and (not card.exists() or card.stat().st_nlink == 1)


def report_step(
    run_dir: str, run: str, step: int, recipe: dict, steps: list[dict], evals: list[dict], rollouts: str
) -> None:
    """Send the steps rows, eval results and this step's best and worst rollout to run.report_to's trackers
    (refiner_core.publish.tracking: what a tracker already has is not sent again; a failing tracker is a warning)."""
    log = get_run_logger()
    sent = report(
        run_dir, run, RunConfig(**recipe["run"]), steps=steps, evals=evals, rollouts={step: rollouts}, warn=log.warning
    )
    if sent:
        log.info("report_to: %s", ", ".join(f"{name} ({n} new)" for name, n in sent.items()))


def rollouts_markdown(run: str, step: int, summary: dict) -> str:
    """The best and worst rollout of run_summary as markdown; their text (its first EXCERPT_CHARS characters) and
    prompt IDs are shown literally."""
    lines = [f"### {markdown_inline(run)}, step {step}"]
    for which in ("best", "worst"):
        if which in summary:
            r = summary[which]
            text = r["response_text"] or ""
            lines += [
                f"**{which}**: reward {r['reward']} (prompt {markdown_inline(str(r['prompt_id']))}, "
                f"sample {r['sample_idx']})",
                "",
                markdown_code_block(text[:EXCERPT_CHARS]),
            ]
            if len(text) > EXCERPT_CHARS:
                lines.append(f"*… {len(text) - EXCERPT_CHARS} more characters*")
            lines.append("")
    return "\n".join(lines)
