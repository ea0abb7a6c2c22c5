"""Refiner rows: loading, validation with quarantine, prompt rendering and token limits."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from refiner_core.formats import check_citations, parse_answer, tool_snippet_ids
from refiner_core.prompts import refiner_messages, render_prompt
from refiner_core.rubrics import RubricError, instance_rubrics

REQUIRED_TEXT_FIELDS = ("id", "question", "reasoning", "tool_output")
RAW_LIMIT = 4096


@dataclass
class RawRow:
    row_ref: str  # line number in the source
    raw: str  # the text as read (for quarantine)
    data: dict | None  # parsed object, None when it did not parse
    error: str | None = None


@dataclass
class Rejection:
    row_ref: str
    reason: str
    detail: str
    raw: str

    def as_quarantine(self, run: str, stage: str, source: str) -> dict:
        return {"run": run, "stage": stage, "source": source, "row_ref": self.row_ref, "reason": self.reason,
                "detail": self.detail, "raw": self.raw[:RAW_LIMIT]}


@dataclass
class Validated:
    rows: list[dict] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)


def read_jsonl(path: Path) -> list[RawRow]:
    """Read JSONL bytes line by line; undecodable or unparseable lines become RawRows with an error."""
    rows = []
    for n, line in enumerate(Path(path).read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            rows.append(RawRow(f"line {n}", line.decode("utf-8", errors="replace"), None, f"non_utf8: {e.reason}"))
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            rows.append(RawRow(f"line {n}", text, None, f"invalid_json: {e.msg} at char {e.pos}"))
            continue
        if not isinstance(obj, dict):
            rows.append(RawRow(f"line {n}", text, None, f"not_an_object: got {type(obj).__name__}"))
            continue
        rows.append(RawRow(f"line {n}", text, obj))
    return rows


def content_hash(row: dict) -> str:
    keys = ("question", "reasoning", "tool_output", "answer")
    return hashlib.blake2b(json.dumps([row.get(k) for k in keys]).encode(), digest_size=12).hexdigest()


def check_row(row: dict) -> tuple[str, str] | None:
    """(reason, detail) when the row cannot be used, else None."""
    for key in REQUIRED_TEXT_FIELDS:
        if key not in row or row[key] is None:
            return "missing_field", f"field {key!r} is missing"
        if not isinstance(row[key], str):
            return "wrong_type", f"field {key!r} must be a string, got {type(row[key]).__name__}"
        if not row[key].strip():
            return "empty_field", f"field {key!r} is empty"
    ids = tool_snippet_ids(row["tool_output"])
    if not ids:
        return "no_snippets", "tool_output contains no <snippet id=...> blocks"
    answer = row.get("answer", "")
    if answer not in (None, ""):
        if not isinstance(answer, str):
            return "wrong_type", f"field 'answer' must be a string, got {type(answer).__name__}"
        parsed = parse_answer(answer)
        if not parsed.has_answer or not parsed.well_formed:
            return "bad_answer_format", "; ".join(parsed.problems)
        check = check_citations(parsed, ids)
        if check.n_invalid:
            return "unknown_snippet_id", f"answer cites IDs absent from tool_output: {sorted(set(check.invalid_ids))}"
    try:
        instance_rubrics(row.get("positive_rubrics"), row.get("negative_rubrics"))
    except RubricError as e:
        return "invalid_rubrics", str(e)
    return None


def validate_rows(raw_rows: list[RawRow]) -> Validated:
    out = Validated()
    seen_ids: set[str] = set()
    seen_hashes: set[str] = set()
    for raw in raw_rows:
        if raw.data is None:
            reason, _, detail = raw.error.partition(": ")
            out.rejected.append(Rejection(raw.row_ref, reason, detail, raw.raw))
            continue
        problem = check_row(raw.data)
        if problem is None and raw.data["id"] in seen_ids:
            problem = ("duplicate_id", f"id {raw.data['id']!r} already seen")
        digest = content_hash(raw.data) if problem is None else ""
        if problem is None and digest in seen_hashes:
            problem = ("duplicate_content", "same question, reasoning, tool output and answer as an earlier row")
        if problem:
            out.rejected.append(Rejection(raw.row_ref, *problem, raw.raw))
            continue
        seen_ids.add(raw.data["id"])
        seen_hashes.add(digest)
        out.rows.append({**raw.data, "content_hash": digest, "row_ref": raw.row_ref})
    return out


def split_of(prompt_id: str, validation_fraction: float, seed: int) -> str:
    """Deterministic per-row split: stable when rows are added or removed."""
    if validation_fraction <= 0:
        return "train"
    h = int(hashlib.blake2b(f"{seed}:{prompt_id}".encode(), digest_size=8).hexdigest(), 16)
    return "validation" if (h % 10_000) / 10_000 < validation_fraction else "train"


def prepare_prompts(rows: list[dict], tokenizer, run: str, max_prompt_tokens: int, max_reference_tokens: int,
                    validation_fraction: float, seed: int) -> tuple[list[dict], list[Rejection]]:
    """Render chat prompts and drop rows over the token limits (each drop is a counted, recorded rejection)."""
    prompts, rejected = [], []
    for row in rows:
        text, ids = render_prompt(tokenizer, refiner_messages(row["question"], row["reasoning"], row["tool_output"]))
        answer = row.get("answer") or ""
        ref_tokens = len(tokenizer(answer, add_special_tokens=False)["input_ids"]) if answer else 0
        raw = json.dumps({k: v for k, v in row.items() if k not in ("content_hash", "row_ref")})
        if len(ids) > max_prompt_tokens:
            rejected.append(Rejection(row["row_ref"], "prompt_too_long",
                                      f"{len(ids)} prompt tokens > max_prompt_tokens {max_prompt_tokens}", raw))
            continue
        if ref_tokens > max_reference_tokens:
            rejected.append(Rejection(row["row_ref"], "reference_too_long",
                                      f"{ref_tokens} answer tokens > max_reference_tokens {max_reference_tokens}", raw))
            continue
        prompts.append({
            "run": run, "prompt_id": row["id"], "split": split_of(row["id"], validation_fraction, seed),
            "question": row["question"], "reasoning": row["reasoning"], "tool_output": row["tool_output"],
            "snippet_ids": tool_snippet_ids(row["tool_output"]), "reference_answer": answer,
            "prompt_text": text, "prompt_token_ids": ids, "prompt_tokens": len(ids),
            "reference_tokens": ref_tokens, "content_hash": row["content_hash"],
        })
    return prompts, rejected


def step_prompt_ids(train_ids: list[str], step: int, per_step: int, seed: int) -> list[str]:
    """Prompts for a GRPO step: a seeded shuffle per epoch, cycled, so every prompt is seen equally."""
    if not train_ids:
        raise ValueError("no training prompts")
    out: list[str] = []
    start = step * per_step
    for k in range(start, start + per_step):
        epoch, pos = divmod(k, len(train_ids))
        order = sorted(train_ids)
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        out.append(order[pos])
    return out
