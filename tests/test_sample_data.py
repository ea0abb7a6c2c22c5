"""The sample rows' supporting-snippet labels, and how validation treats labels that cannot be right."""

import json
from pathlib import Path

import pytest

from refiner_core.data.formats import parse_answer, tool_snippet_ids
from refiner_core.data.rows import parse_jsonl_line, validate_rows

SAMPLES = Path(__file__).resolve().parents[1] / "data" / "refiner" / "samples.jsonl"
ROWS = [json.loads(line) for line in SAMPLES.read_text(encoding="utf-8").splitlines()]


def test_every_supporting_id_is_one_of_the_rows_snippets():
    for row in ROWS:
        snippets = tool_snippet_ids(row["tool_output"])
        assert row["supporting_ids"], row["id"]
        assert set(row["supporting_ids"]) <= set(snippets), row["id"]
        assert len(set(row["supporting_ids"])) == len(row["supporting_ids"]), row["id"]


def test_reference_answers_cite_only_supporting_snippets():
    for row in ROWS:
        assert set(parse_answer(row["answer"]).cited_ids) == set(row["supporting_ids"]), row["id"]


def test_nearly_every_row_has_a_distractor_to_avoid():
    with_distractor = [r for r in ROWS if set(tool_snippet_ids(r["tool_output"])) - set(r["supporting_ids"])]
    assert len(with_distractor) >= len(ROWS) - 1  # ref-048 cites all three of its snippets


@pytest.mark.parametrize(
    "labels,reason",
    [
        (["zzzzzz"], "unknown_supporting_id"),
        ([], "unknown_supporting_id"),
        ("a1f3c2", "wrong_type"),
        ([1], "wrong_type"),
    ],
)
def test_bad_labels_are_quarantined_with_a_reason(labels, reason):
    row = {**ROWS[0], "supporting_ids": labels}
    validated = validate_rows([parse_jsonl_line(1, json.dumps(row).encode())])
    assert validated.rows == []
    assert [r.reason for r in validated.rejected] == [reason]


def test_rows_without_labels_are_accepted():
    row = {k: v for k, v in ROWS[0].items() if k != "supporting_ids"}
    validated = validate_rows([parse_jsonl_line(1, json.dumps(row).encode())])
    assert [r["id"] for r in validated.rows] == [row["id"]] and validated.rejected == []
