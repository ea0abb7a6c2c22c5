"""Rubric normalisation: per-instance positive/negative rubrics plus the static set."""

from __future__ import annotations

import json
from pathlib import Path


class RubricError(ValueError):
    pass


def normalise_rubric(item, kind: str, index: int) -> dict:
    """A rubric is a non-empty string or {description, weight?, title?}; returns a full rubric dict."""
    prefix = "pos" if kind == "positive" else "neg"
    if isinstance(item, str):
        item = {"description": item}
    if not isinstance(item, dict):
        raise RubricError(f"{kind} rubric {index}: expected a string or an object, got {type(item).__name__}")
    description = item.get("description")
    if not isinstance(description, str) or not description.strip():
        raise RubricError(f"{kind} rubric {index}: 'description' must be a non-empty string")
    weight = item.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
        raise RubricError(f"{kind} rubric {index}: 'weight' must be a positive number, got {weight!r}")
    title = item.get("title") or description.strip()[:60]
    if not isinstance(title, str):
        raise RubricError(f"{kind} rubric {index}: 'title' must be a string")
    unknown = set(item) - {"description", "weight", "title"}
    if unknown:
        raise RubricError(f"{kind} rubric {index}: unknown keys {sorted(unknown)}")
    return {"rubric_id": f"{prefix}-{index}", "kind": kind, "source": "instance", "title": title,
            "description": description.strip(), "weight": float(weight)}


def instance_rubrics(positive, negative) -> list[dict]:
    """Parse a row's rubric lists (lists, or JSON strings of lists)."""
    out = []
    for kind, items in (("positive", positive), ("negative", negative)):
        if items is None:
            items = []
        if isinstance(items, str):
            try:
                items = json.loads(items)
            except json.JSONDecodeError as e:
                raise RubricError(f"{kind}_rubrics: invalid JSON ({e.msg} at char {e.pos})") from None
        if not isinstance(items, list):
            raise RubricError(f"{kind}_rubrics: expected a list, got {type(items).__name__}")
        out.extend(normalise_rubric(item, kind, i) for i, item in enumerate(items))
    if not out:
        raise RubricError("row has no positive or negative rubrics")
    return out


def load_static_rubrics(path: Path) -> list[dict]:
    items = json.loads(Path(path).read_text())
    out = []
    for item in items:
        kind = item.get("kind")
        if kind not in ("positive", "negative"):
            raise RubricError(f"{path}: static rubric {item.get('rubric_id')!r} has kind {kind!r}")
        out.append({"rubric_id": item["rubric_id"], "kind": kind, "source": "static", "title": item["title"],
                    "description": item["description"], "weight": float(item.get("weight", 1.0))})
    return out
