"""Rubric normalisation: per-instance positive/negative rubrics plus the static set."""

from __future__ import annotations

import json
import re
from pathlib import Path

from refiner_core.data.text_safety import unusable_character

MAX_RUBRIC_WEIGHT = 1e6  # far above any rubric's share, far below a sum over thousands that could overflow


class RubricError(ValueError):
    pass


class MissingRubrics(RubricError):
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
    weight = checked_weight(item.get("weight"), f"{kind} rubric {index}")
    title = item.get("title")
    if title is None:
        title = description.strip()[:60]
    if not isinstance(title, str) or not title.strip():
        raise RubricError(f"{kind} rubric {index}: 'title' must be a non-empty string, got {title!r}"[:300])
    checked_text(description, f"{kind} rubric {index}: 'description'")
    checked_text(title, f"{kind} rubric {index}: 'title'")
    unknown = set(item) - {"description", "weight", "title"}
    if unknown:
        raise RubricError(f"{kind} rubric {index}: unknown keys {sorted(unknown)}")
    return {
        "rubric_id": f"{prefix}-{index}",
        "kind": kind,
        "source": "instance",
        "title": title,
        "description": description.strip(),
        "weight": weight,
    }


def checked_text(text: str, where: str) -> str:
    """A rubric's text as the judge will read it: no control character or lone surrogate (a rubric file or a
    generating model's answer is checked here as data rows are when they are read)."""
    problem = unusable_character(text)
    if problem:
        raise RubricError(f"{where} {problem}")
    return text


def checked_weight(weight, where: str) -> float:
    """A rubric weight: a positive number up to MAX_RUBRIC_WEIGHT, 1 when absent or None (a Parquet or hub list of
    structs reads a rubric without one as None). An infinite one, or finite ones whose sum overflows (two of 1e308),
    would make the weighted rubric score inf/inf, NaN, for every rollout of the prompt."""
    if weight is None:
        return 1.0
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= MAX_RUBRIC_WEIGHT:
        raise RubricError(f"{where}: 'weight' must be a number in (0, {MAX_RUBRIC_WEIGHT:g}], got {weight!r}"[:300])
    return float(weight)


def instance_rubrics(positive, negative, allow_empty: bool = False) -> list[dict]:
    """Parse a row's rubric lists (lists, or JSON strings of lists). Both missing or empty is an error unless
    `allow_empty` (the rubric stage may still generate them).

    Either field may instead hold one object {"positive": [...], "negative": [...]} (or its JSON text) with both
    lists: a data set's single rubric column, mapped to positive_rubrics, negative_rubrics or both."""
    lists = {"positive": _parsed(positive, "positive"), "negative": _parsed(negative, "negative")}
    objects = [value for value in lists.values() if isinstance(value, dict)]
    if objects:
        both = objects[0]
        unknown = set(both) - {"positive", "negative"}
        if unknown:
            raise RubricError(
                f"rubrics: expected a list or an object {{positive: [...], negative: [...]}}, got an "
                f"object with keys {sorted(both)}"
            )
        if any(value not in (None, both) for value in lists.values()):
            raise RubricError(
                "positive_rubrics and negative_rubrics: one holds an object of both lists, the other "
                "something else; give both lists in the object, or two lists"
            )
        lists = {kind: both.get(kind) for kind in lists}
    elif lists["positive"] and lists["positive"] == lists["negative"]:
        raise RubricError(  # every rubric both met and violated: any verdict scores 0.5
            "positive_rubrics and negative_rubrics hold the same list: a single rubric column mapped to both "
            "fields must hold an object {positive: [...], negative: [...]}"
        )
    out = []
    for kind, items in lists.items():
        items = [] if items is None else items
        if not isinstance(items, list):
            raise RubricError(f"{kind}_rubrics: expected a list, got {type(items).__name__}")
        out.extend(normalise_rubric(item, kind, i) for i, item in enumerate(items))
    if not out and not allow_empty:
        raise MissingRubrics("row has no positive or negative rubrics")
    return out


def _parsed(value, kind: str):
    """A rubric field's value, with JSON text decoded."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise RubricError(f"{kind}_rubrics: invalid JSON ({e.msg} at char {e.pos})") from None
    except (ValueError, RecursionError) as e:  # an integer past Python's digit limit, nesting too deep
        raise RubricError(f"{kind}_rubrics: unreadable JSON ({type(e).__name__}: {str(e)[:100]})") from None


_INSTANCE_ID_RE = re.compile(r"(pos|neg)-\d+")


def load_static_rubrics(path: Path) -> list[dict]:
    """The static rubric set, added to every prompt's: a JSON list of {rubric_id, kind, title, description,
    weight?}, IDs unique, and none an instance rubric's (pos-N, neg-N), since a rubric's scores are keyed by
    (prompt, rubric ID). A malformed file is a RubricError naming it and the rubric."""
    try:
        items = json.loads(Path(path).read_bytes())
    except ValueError as e:  # broken JSON, or bytes that are not UTF-8
        raise RubricError(f"{path}: not JSON: {e}") from None
    if not isinstance(items, list):
        raise RubricError(f"{path}: expected a list of rubric objects, got {type(items).__name__}")
    out, seen = [], set()
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise RubricError(
                f"{path}: static rubric {index}: expected an object {{rubric_id, kind, title, description, "
                f"weight?}}, got {type(item).__name__}"
            )
        kind, rubric_id = item.get("kind"), item.get("rubric_id")
        if not isinstance(rubric_id, str) or not rubric_id.strip():
            raise RubricError(f"{path}: static rubric {index} needs a 'rubric_id' string")
        where = f"{path}: static rubric {rubric_id!r}"
        unknown = set(item) - {"rubric_id", "kind", "title", "description", "weight"}
        if unknown:  # a misspelt 'weight' would silently weigh 1
            raise RubricError(f"{where}: unknown keys {sorted(unknown)}")
        if kind not in ("positive", "negative"):
            raise RubricError(f"{where} has kind {kind!r}")
        if rubric_id in seen:
            raise RubricError(f"{path}: static rubric ID {rubric_id!r} is given twice")
        if _INSTANCE_ID_RE.fullmatch(rubric_id):
            raise RubricError(f"{path}: static rubric ID {rubric_id!r} is an instance rubric's (pos-N, neg-N)")
        for key in ("title", "description"):
            if not isinstance(item.get(key), str) or not item[key].strip():
                raise RubricError(f"{where}: {key!r} must be a non-empty string, got {item.get(key)!r}")
        seen.add(rubric_id)
        out.append(
            {
                "rubric_id": rubric_id,
                "kind": kind,
                "source": "static",
                "title": checked_text(item["title"], f"{where}: 'title'"),
                "description": checked_text(item["description"], f"{where}: 'description'"),
                "weight": checked_weight(item.get("weight"), where),
            }
        )
    return out
