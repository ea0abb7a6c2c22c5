from __future__ import annotations

import os
from pathlib import Path

from prefect import get_run_logger

from refiner_core.data.prepare import rubrics_left_no_training_prompt
from refiner_core.data.rows import accepted_raw_rows
from refiner_core.data.rubric_fields import load_static_rubrics
from refiner_core.data.sources import load_rows, load_source
from refiner_core.models import refiner_home
from refiner_core.rubrics.generate import GenerationSettings, RubricGenerationError, generate_rubrics
from refiner_core.rubrics.join import join_rubrics
from refiner_core.schema import QUARANTINE, RUBRICS
from refiner_core.stage_settings import stage_view
from refiner_core.store.storage import read_rows, write_table
from tasks.catalog import fail_if_too_many_rejected
from tasks.prepare import fail_without_training_prompts
from tasks.stage import stage


@stage("ingest-rubrics")
def ingest_rubrics(
    *,
    run_dir: str,
    run: str,
    data_file: str,
    data: dict,
    rubric_file: str,
    rubric_cfg: dict,
    static_rubrics_file: str,
    prompts: dict,
) -> dict:
    """Stage 2: per-instance rubrics joined to the prepared prompts by ID (generated for rows that have none
    when an endpoint is configured) plus the static set -> rubrics, quarantine, usable train IDs."""
    log = get_run_logger()
    prompt_rows = read_rows(prompts["prompts"]["path"])
    static = [] if rubric_cfg["instance_rubrics_only"] else load_static_rubrics(Path(static_rubrics_file))
    if rubric_file:
        source, source_rows = rubric_file, load_rows(rubric_file, "auto", rubric_cfg.get("fields"))
    else:
        source = data_file
        source_rows = accepted_raw_rows(load_source(data_file, stage_view("source", data)))
    generated = {"calls": 0, "cached": 0, "failed_calls": 0}  # answers paid for, served from cache, no answer
    generate = None
    if rubric_cfg.get("generation_endpoint"):
        settings = GenerationSettings(
            endpoint=rubric_cfg["generation_endpoint"],
            model=rubric_cfg["generation_model"],
            cache_dir=Path(rubric_cfg["generation_cache"] or refiner_home() / "rubric-generation"),
            api_key=os.environ.get(rubric_cfg["generation_api_key_env"], ""),
            timeout_seconds=rubric_cfg["generation_timeout_seconds"],
            max_tokens=rubric_cfg["generation_max_tokens"],
            temperature=rubric_cfg["generation_temperature"],
        )

        def generate(prompt: dict) -> list[dict]:
            try:
                rubrics, cached = generate_rubrics(
                    prompt["question"], prompt["tool_output"], prompt["reference_answer"], settings
                )
            except RubricGenerationError as e:
                generated["failed_calls" if not e.answered else "cached" if e.from_cache else "calls"] += 1
                raise
            generated["cached" if cached else "calls"] += 1
            return rubrics

    joined, rejected = join_rubrics(
        prompt_rows,
        source_rows,
        static,
        separate_source=bool(rubric_file),
        generate=generate,
        max_per_prompt=rubric_cfg["max_per_prompt"],
    )
    rows = [{"run": run, "prompt_id": pid, **rubric} for pid, rubrics in joined.items() for rubric in rubrics]
    out = Path(run_dir) / "data"
    quarantine = [r.as_quarantine(run, "rubrics", source) for r in rejected]
    log.info(
        "ingest-rubrics: %d rubrics for %d/%d prompts (%d static per prompt), generated %s, rejected %d",
        len(rows),
        len(joined),
        len(prompt_rows),
        len(static),
        generated,
        len(rejected),
    )
    manifest = {
        "rubrics": {"path": str(out / "rubrics.parquet"), "hash": write_table(RUBRICS, rows, out / "rubrics.parquet")},
        "quarantine": {
            "path": str(out / "rubrics_quarantine.parquet"),
            "hash": write_table(QUARANTINE, quarantine, out / "rubrics_quarantine.parquet"),
        },
        "rows": len(rows),
        "generated": generated,
        "train_ids": [pid for pid in prompts["train_ids"] if pid in joined],
        # the held-out prompts it can score: the evaluation leaves out those it rejected, as training does
        "held_out_ids": sorted(
            p["prompt_id"] for p in prompt_rows if p["split"] == "validation" and p["prompt_id"] in joined
        ),
    }
    fail_if_too_many_rejected(
        run_dir,
        [prompts, manifest],
        rejected,
        len(prompt_rows),
        rubric_cfg["max_rejected_fraction"],
        n_rejected=len(prompt_rows) - len(joined),
    )
    if not manifest["train_ids"]:
        why = rubrics_left_no_training_prompt(len(prompts["train_ids"]), rejected)
        fail_without_training_prompts(run_dir, [prompts, manifest], why)
    return manifest
