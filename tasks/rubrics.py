from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger

from refiner_core.data import read_jsonl
from refiner_core.rubrics import instance_rubrics, load_static_rubrics
from refiner_core.schema import RUBRICS
from refiner_core.storage import read_rows, write_table
from tasks.stage import stage


@stage("ingest-rubrics")
def ingest_rubrics(*, run_dir: str, run: str, data_file: str, static_rubrics_file: str, prompts: dict,
                   instance_rubrics_only: bool) -> dict:
    """Stage 2: per-instance rubrics of every prepared prompt plus the static set -> rubrics."""
    log = get_run_logger()
    prompt_ids = {p["prompt_id"] for p in read_rows(prompts["prompts"]["path"])}
    static = [] if instance_rubrics_only else load_static_rubrics(Path(static_rubrics_file))
    rows = []
    for raw in read_jsonl(Path(data_file)):
        if raw.data is None or raw.data.get("id") not in prompt_ids:
            continue  # rejected rows are already in quarantine from prepare-data
        pid = raw.data["id"]
        prompt_ids.discard(pid)  # first occurrence wins, as in prepare-data
        for rubric in instance_rubrics(raw.data.get("positive_rubrics"), raw.data.get("negative_rubrics")) + static:
            rows.append({"run": run, "prompt_id": pid, **rubric})
    path = Path(run_dir) / "data" / "rubrics.parquet"
    log.info("ingest-rubrics: %d rubrics (%d static per prompt)", len(rows), len(static))
    return {"rubrics": {"path": str(path), "hash": write_table(RUBRICS, rows, path)}, "rows": len(rows)}
