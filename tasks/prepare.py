from __future__ import annotations

import shlex
from pathlib import Path
from typing import NoReturn

from prefect import get_run_logger

from refiner_core.config import ConfigError
from refiner_core.data.prepare import cap_prompts, no_training_prompts, prepare_prompts
from refiner_core.data.rows import TooManyRejected, prompt_hash, prompt_messages, validate_rows
from refiner_core.data.sources import load_source, source_identity
from refiner_core.models import context_length, load_tokenizer
from refiner_core.publish.ledger import prompt_ledger, select_prompts
from refiner_core.schema import PROMPT_SELECTION, PROMPTS, QUARANTINE
from refiner_core.stage_settings import stage_view
from refiner_core.store.storage import write_table
from tasks.catalog import fail_if_too_many_rejected, publish_quarantine
from tasks.stage import stage

__all__ = ["TooManyRejected", "prepare_data"]


@stage("prepare-data")
def prepare_data(
    *,
    run_dir: str,
    run: str,
    data_file: str,
    data: dict,
    seed: int,
    policy: dict,
    skip_ledger_files: list[str] | None = None,
    weight_ledger_files: list[str] | None = None,
) -> dict:
    """Stage 1: validate refiner rows, render chat prompts, apply token limits (data.max_prompt_tokens, the policy's
    context) -> prompts + quarantine. With the
    catalogs of data.skip_solved_from / data.weights_from (hashed by content into the cache key), the training
    split leaves out prompts those runs always or never solved, and carries sampling weights (prompt_selection)."""
    log = get_run_logger()
    source = stage_view("data", data)
    raw = load_source(data_file, source)
    checked = validate_rows(raw)
    tokenizer = load_tokenizer(policy["path"])
    prompts, dropped = prepare_prompts(
        checked.rows,
        tokenizer,
        run,
        data["max_prompt_tokens"],
        data["max_reference_tokens"],
        data["validation_fraction"],
        seed,
        context_length(policy["path"]),
    )
    prompts = cap_prompts(prompts, data["max_prompts"])
    hash_of = {r["id"]: prompt_hash(r) for r in checked.rows}
    asked_of = {r["id"]: [m["content"] for m in prompt_messages(r) if m["role"] == "user"] for r in checked.rows}
    rejected = checked.rejected + dropped
    quarantine = [r.as_quarantine(run, "prepare", data_file) for r in rejected]
    counts: dict[str, int] = {}
    for r in rejected:
        counts[r.reason] = counts.get(r.reason, 0) + 1
    out = Path(run_dir) / "data"
    manifest = {
        "prompts": {
            "path": str(out / "prompts.parquet"),
            "hash": write_table(PROMPTS, prompts, out / "prompts.parquet"),
        },
        "quarantine": {
            "path": str(out / "quarantine.parquet"),
            "hash": write_table(QUARANTINE, quarantine, out / "quarantine.parquet"),
        },
        "rows_in": len(raw),
        "rows_out": len(prompts),
        "rejected": counts,
        "train_ids": sorted(p["prompt_id"] for p in prompts if p["split"] == "train"),
        # what prepare-sft needs to leave the held-out prompts out of the warm start
        "source": source_identity(data_file, source),
        "held_out_prompt_hashes": {
            p["prompt_id"]: hash_of[p["prompt_id"]] for p in prompts if p["split"] == "validation"
        },
        "held_out_asked": {  # a chat prompt's user messages, in order (refiner rows: its question)
            p["prompt_id"]: asked_of[p["prompt_id"]] for p in prompts if p["split"] == "validation"
        },
    }
    fail_if_too_many_rejected(run_dir, [manifest], rejected, len(raw), data["max_rejected_fraction"])
    if not manifest["train_ids"]:
        fail_without_training_prompts(
            run_dir,
            [manifest],
            no_training_prompts(prompts, rejected, data["validation_fraction"], data["max_prompts"]),
        )
    if skip_ledger_files or weight_ledger_files:
        kept, weights, selection = select_prompts(
            run,
            manifest["train_ids"],
            prompt_ledger(skip_ledger_files or []),
            prompt_ledger(weight_ledger_files or []),
            ", ".join(dict.fromkeys([*data["skip_solved_from"], *data["weights_from"]])),
            twin_of={p["prompt_id"]: p["twin_id"] for p in prompts},
        )
        if not kept:
            raise ConfigError(
                f"data.skip_solved_from left no training prompt: all {len(selection)} were always or never solved "
                f"in {', '.join(data['skip_solved_from'])}"
            )
        path = out / "prompt_selection.parquet"
        manifest["prompt_selection"] = {"path": str(path), "hash": write_table(PROMPT_SELECTION, selection, path)}
        manifest["train_ids"] = kept
        if weights:
            manifest["train_weights"] = weights
        log.info(
            "prepare-data: difficulty ledger kept %d of %d training prompts (%d always solved, %d never solved)%s",
            len(kept),
            len(selection),
            sum(r["skipped"] == "always solved" for r in selection),
            sum(r["skipped"] == "never solved" for r in selection),
            f", weights {min(weights.values()):.2f}-{max(weights.values()):.2f}" if weights else "",
        )
    log.info("prepare-data: %d rows in, %d prompts out, rejected %s", len(raw), len(prompts), counts or "none")
    return manifest


def fail_without_training_prompts(run_dir: str, manifests: list[dict], why: str) -> NoReturn:
    """A ConfigError, not retried (the same data and settings leave the same split), saying `why` no prompt is left
    to train on, with the quarantine published and how to query it; not a retried error at the first rollout."""
    query = shlex.join(["refiner", "sql", str(run_dir), "SELECT * FROM quarantine"])
    raise ConfigError(f"{why}. The rejected rows: {query}; catalog {publish_quarantine(run_dir, manifests)}")
