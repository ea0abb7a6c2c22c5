"""Each prepared prompt's rubrics: from the data rows or a rubric file of their own, else generated, plus the static
set; rows that give none are rejections (the quarantine's). Above rubrics.py (one rubric's normalisation), data.py
(rows and rejections) and rubric_gen.py (generation), which import nothing of this."""

from __future__ import annotations

import json

from refiner_core.data.rows import Rejection
from refiner_core.data.rubric_fields import RubricError, instance_rubrics
from refiner_core.rubrics.generate import RubricGenerationError


def join_rubrics(
    prompts: list[dict],
    source_rows: list,
    static: list[dict],
    separate_source: bool,
    generate=None,
    max_per_prompt: int = 64,
) -> tuple[dict[str, list[dict]], list]:
    """Instance rubrics per prompt ID (plus the static set) and the rejections.

    `source_rows` are RawRows whose data carry id / positive_rubrics / negative_rubrics. With
    `separate_source` they come from a rubric file of their own, so unreadable rows, unknown IDs and
    duplicates are rejected here; otherwise they are the data rows, already vetted by prepare-data.
    A prompt with neither rubrics nor a ground truth gets them from `generate(prompt) -> rubrics` (may raise
    RubricGenerationError); a prompt with a ground truth and no rubrics maps to [] (verified, not judged). A
    prompt with more than `max_per_prompt` instance rubrics is rejected (each is a judge call per rollout).
    """
    by_id = {p["prompt_id"]: p for p in prompts}
    found: dict[str, list[dict]] = {}
    source_of: dict[str, object] = {}  # the RawRow each prompt's rubrics came from
    invalid: set[str] = set()
    rejected: list[Rejection] = []
    for raw in source_rows:
        if raw.data is None:
            if separate_source:
                reason, _, detail = raw.error.partition(": ")
                rejected.append(Rejection(raw.row_ref, reason, detail, raw.raw))
            continue
        pid = raw.data.get("id")
        pid = str(pid) if isinstance(pid, int) and not isinstance(pid, bool) else pid
        if pid not in by_id:
            if separate_source:
                reason, detail = (
                    ("missing_field", "field 'id' is missing")
                    if pid is None
                    else ("unknown_prompt_id", f"id {pid!r} is not a prepared prompt")
                )
                rejected.append(Rejection(raw.row_ref, reason, detail, raw.raw))
            continue
        if pid in source_of:
            if separate_source:
                rejected.append(Rejection(raw.row_ref, "duplicate_id", f"rubrics for {pid!r} already seen", raw.raw))
            continue
        source_of[pid] = raw
        try:
            found[pid] = instance_rubrics(
                raw.data.get("positive_rubrics"), raw.data.get("negative_rubrics"), allow_empty=True
            )
        except RubricError as e:
            invalid.add(pid)
            rejected.append(Rejection(raw.row_ref, "invalid_rubrics", str(e), raw.raw))
    out: dict[str, list[dict]] = {}
    for pid, prompt in by_id.items():
        if pid in invalid:
            continue
        rubrics = found.get(pid, [])
        ref, raw_text = _source_row(pid, prompt, source_of)
        if not rubrics and prompt.get("ground_truth") is not None:
            out[pid] = []  # judged by its ground truth, not by rubrics (and not by the refiner's static set)
            continue
        if not rubrics and generate is not None:
            try:
                rubrics = generate(prompt)
            except RubricGenerationError as e:
                rejected.append(Rejection(ref, e.reason, e.detail, raw_text))
                continue
        if not rubrics:
            rejected.append(
                Rejection(
                    ref,
                    "missing_rubrics",
                    "no positive or negative rubrics, no ground_truth, and "
                    "no generation endpoint configured (rubrics.generation_endpoint)",
                    raw_text,
                )
            )
            continue
        if len(rubrics) > max_per_prompt:
            detail = (
                f"{len(rubrics)} instance rubrics, over rubrics.max_per_prompt = {max_per_prompt} (each is a judge "
                "call per rollout): raise it if they are meant"
            )
            rejected.append(Rejection(ref, "too_many_rubrics", detail, raw_text))
            continue
        out[pid] = rubrics + static
    return _drop_lone_twins(out, by_id, source_of, rejected)


def _drop_lone_twins(
    out: dict[str, list[dict]], by_id: dict[str, dict], source_of: dict, rejected: list[Rejection]
) -> tuple[dict[str, list[dict]], list[Rejection]]:
    """A prompt whose twin (its question's other view, prepare-data kept only whole pairs) was rejected here goes
    too, as 'unknown_twin': alone it could never get a pseudo-label, and a pair is one unit of the schedule."""
    reasons = {r.row_ref: r.reason for r in rejected}
    lone = {pid for pid in out if (twin := by_id[pid].get("twin_id")) is not None and twin not in out}
    for pid in sorted(lone):
        twin = by_id[pid]["twin_id"]
        ref, raw_text = _source_row(pid, by_id[pid], source_of)
        why = reasons.get(_source_row(twin, by_id[twin], source_of)[0], "no rubrics")
        rejected.append(Rejection(ref, "unknown_twin", f"twin_id {twin!r} was rejected here ({why})", raw_text))
    return {pid: rubrics for pid, rubrics in out.items() if pid not in lone}, rejected


def _source_row(pid: str, prompt: dict, source_of: dict) -> tuple[str, str]:
    """(row reference, raw text) a rejection of the prompt names: the row its rubrics came from, else the prompt."""
    origin = source_of.get(pid)
    if origin is not None:
        return origin.row_ref, origin.raw
    return f"id {pid}", json.dumps(_prompt_view(prompt), default=str)


def _prompt_view(prompt: dict) -> dict:
    return {k: prompt.get(k) for k in ("prompt_id", "question", "reference_answer")}
