from __future__ import annotations

from collections import Counter
from pathlib import Path

from prefect import get_run_logger

from refiner_core.data.rows import validate_rows
from refiner_core.data.sources import load_source, source_identity
from refiner_core.models import context_length, load_model, load_tokenizer
from refiner_core.publish.model_card import write_model_card
from refiner_core.schema import QUARANTINE, SFT_EXAMPLES, SFT_METRICS, SFT_STATS
from refiner_core.sft.data import SFTLimits, normalise_tool_rows, stats_rows
from refiner_core.sft.data import prepare_sft as prepare_sft_core
from refiner_core.sft.train import SFTSettings, packed_rows, train_sft
from refiner_core.stage_settings import stage_view
from refiner_core.store.storage import atomic_dir, dir_hash, read_rows, write_json, write_table
from tasks.catalog import fail_if_too_many_rejected
from tasks.stage import stage


@stage("prepare-sft")
def prepare_sft(
    *, run_dir: str, run: str, sft_file: str, sft_cfg: dict, seed: int, policy: dict, prompts: dict
) -> dict:
    """Validate SFT rows, render with assistant-only masks, apply limits, dedupe, split, pack -> sft_examples,
    sft_stats, quarantine (+ stats.json). Rows of held-out prompts (the validation split of `prompts`) are left out;
    tool-using conversations are rendered as the agent loop tokenizes them. A row is held out by its ID only when
    `sft_file` is the prompts' own source; from another file, by its prompt."""
    log = get_run_logger()
    sft = stage_view("sft_prepare", sft_cfg)
    raw = load_source(sft_file, sft)
    usable, tool_rejected = normalise_tool_rows(raw)  # tool-using conversations: calls as Hermes blocks, checked
    checked = validate_rows(usable)
    tokenizer = load_tokenizer(policy["path"])
    hashes = prompts["held_out_prompt_hashes"]
    asked = prompts.get("held_out_asked", {})
    held_out = [
        {**p, "prompt_hash": hashes[p["prompt_id"]], "asked": asked.get(p["prompt_id"])}
        for p in read_rows(prompts["prompts"]["path"])
        if p["split"] == "validation"
    ]
    prepared = prepare_sft_core(
        checked.rows,
        tokenizer,
        run,
        SFTLimits.from_config(sft),
        sft.validation_fraction,
        seed,
        sft.histogram_bins,
        held_out,
        same_source=prompts["source"] == source_identity(sft_file, sft),
        context=context_length(policy["path"]),
    )
    rejected = tool_rejected + checked.rejected + prepared.rejected
    invalid = tool_rejected + checked.rejected
    stats = {
        **prepared.stats,
        "rows_in": len(raw),
        "invalid_rows": len(invalid),
        "invalid": dict(sorted(Counter(r.reason for r in invalid).items())),
    }
    out = Path(run_dir) / "sft"
    manifest = {
        "sft_examples": {
            "path": str(out / "sft_examples.parquet"),
            "hash": write_table(SFT_EXAMPLES, prepared.examples, out / "sft_examples.parquet"),
        },
        "sft_stats": {
            "path": str(out / "sft_stats.parquet"),
            "hash": write_table(SFT_STATS, stats_rows(run, stats), out / "sft_stats.parquet"),
        },
        "quarantine": {
            "path": str(out / "quarantine.parquet"),
            "hash": write_table(
                QUARANTINE,
                [r.as_quarantine(run, "prepare-sft", sft_file) for r in rejected],
                out / "quarantine.parquet",
            ),
        },
        "stats_json": {"path": str(out / "stats.json"), "hash": write_json(stats, out / "stats.json")},
        "examples": len(prepared.examples),
        "packing": stats["packing"],
        "dropped": stats["dropped"],
        "held_out": stats["held_out"],
    }
    log.info(
        "prepare-sft: %d rows in (%d held out for evaluation, by %s), %d examples (%d train / %d validation), %d "
        "rejected %s, packing efficiency train %.1f%%",
        len(raw),
        stats["held_out_rows"],
        stats["held_out"],
        len(prepared.examples),
        stats["train_examples"],
        stats["validation_examples"],
        len(rejected),
        stats["dropped"],
        100 * stats["packing"]["train"]["efficiency"],
    )
    fail_if_too_many_rejected(run_dir, [manifest], rejected, len(raw), sft.max_rejected_fraction)
    if not stats["train_examples"]:
        raise ValueError(f"prepare-sft: no training examples left from {sft_file} (see {out / 'stats.json'})")
    return manifest


@stage("sft-train")
def sft_train(
    *, run_dir: str, run: str, sft_data: dict, policy: dict, sft_cfg: dict, seed: int, dtype: str, precision: str
) -> dict:
    """SFT warm start on the packed examples -> HF checkpoint (the GRPO starting point) + sft_metrics."""
    import torch

    log = get_run_logger()
    examples = read_rows(sft_data["sft_examples"]["path"])
    train = packed_rows([e for e in examples if e["split"] == "train"])
    validation = packed_rows([e for e in examples if e["split"] == "validation"])
    tokenizer = load_tokenizer(policy["path"])
    torch.manual_seed(seed)
    model = load_model(policy["path"], dtype, trainable=True)
    history = train_sft(
        model,
        train,
        validation,
        tokenizer.pad_token_id,
        SFTSettings.from_config(stage_view("sft_train", sft_cfg), seed),
        precision=precision,
    )

    final = Path(run_dir) / "checkpoints" / "sft"
    with atomic_dir(final) as build:
        model.save_pretrained(build)
        tokenizer.save_pretrained(build)
        write_model_card(build, run_dir, kind="sft", run=run, step=None, checkpoint=final)

    rows = [{"run": run, **h} for h in history]
    path = Path(run_dir) / "sft" / "sft_metrics.parquet"
    val = [h["loss"] for h in history if h["split"] == "validation"]
    log.info(
        "sft-train: %d packs, %d steps, validation loss %s",
        len(train),
        sum(h["split"] == "train" for h in history),
        " -> ".join(f"{v:.4f}" for v in val) or "n/a",
    )
    return {
        "policy": {"path": str(final), "hash": dir_hash(final)},
        "sft_metrics": {"path": str(path), "hash": write_table(SFT_METRICS, rows, path)},
        "validation_loss": val,
    }
