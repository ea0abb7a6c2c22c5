"""Row sources: JSONL, Parquet and save_to_disk folders give the same rows; field mappings rename columns."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from refiner_core.config import ConfigError, recipe_from_dict
from refiner_core.data import prepare_prompts, validate_rows
from refiner_core.sources import SourceError, detect_format, load_rows

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "data" / "refiner" / "samples.jsonl"


def sample_rows(n: int = 5) -> list[dict]:
    rows = [json.loads(line) for line in SAMPLES.read_text().splitlines()[:n]]
    for r in rows:  # uniform column types: rubric lists as JSON text
        r["positive_rubrics"] = json.dumps(r["positive_rubrics"])
        r["negative_rubrics"] = json.dumps(r["negative_rubrics"])
    return rows


def test_jsonl_parquet_and_save_to_disk_give_the_same_rows(tmp_path):
    from datasets import Dataset, DatasetDict

    rows = sample_rows()
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    single = tmp_path / "single"
    Dataset.from_list(rows).save_to_disk(str(single))
    splits = tmp_path / "splits"
    DatasetDict({"train": Dataset.from_list(rows[:2]), "test": Dataset.from_list(rows[2:])}).save_to_disk(str(splits))

    assert [detect_format(str(p)) for p in (jsonl, parquet, single)] == ["jsonl", "parquet", "disk"]
    expected = [r.data for r in load_rows(str(jsonl))]
    assert expected == rows
    assert [r.data for r in load_rows(str(parquet))] == expected
    assert [r.data for r in load_rows(str(single))] == expected
    assert [r.data for r in load_rows(str(splits), split="test")] == expected[2:]
    assert [r.row_ref for r in load_rows(str(parquet))] == [f"row {i}" for i in range(5)]
    with pytest.raises(SourceError, match="no split 'validation'"):
        load_rows(str(splits), split="validation")


def test_field_mapping_reads_refiner_rows_with_other_column_names(tmp_path, tiny_tokenizer):
    renamed = [{"uid": r["id"], "query": r["question"], "thoughts": r["reasoning"], "search": r["tool_output"],
                "target": r["answer"], "good": r["positive_rubrics"], "bad": r["negative_rubrics"]}
               for r in sample_rows(3)]
    path = tmp_path / "renamed.parquet"
    pq.write_table(pa.Table.from_pylist(renamed), path)
    mapping = {"id": "uid", "question": "query", "reasoning": "thoughts", "tool_output": "search", "answer": "target",
               "positive_rubrics": "good", "negative_rubrics": "bad"}
    checked = validate_rows(load_rows(str(path), fields=mapping))
    assert checked.rejected == []
    assert [r["question"] for r in checked.rows] == [r["query"] for r in renamed]
    # Without the mapping the same file is unusable, row by row, and says why.
    unmapped = validate_rows(load_rows(str(path)))
    assert [r.reason for r in unmapped.rejected] == ["missing_field"] * 3
    # A mapped column that does not exist is reported as missing, not silently taken from elsewhere.
    broken = validate_rows(load_rows(str(path), fields={**mapping, "question": "no_such_column"}))
    assert {r.detail for r in broken.rejected} == {"field 'question' (mapped from column 'no_such_column') is missing"}


def test_open_instruct_style_rows_become_prompts(tmp_path, tiny_tokenizer):
    rows = [
        {"key": 7, "conversation": [{"role": "system", "content": "Answer with a number."},
                                    {"role": "user", "content": "What is 2 + 3?"}],
         "gt": "5", "source": "arith"},
        {"key": 8, "conversation": [{"role": "user", "content": "Name a prime."},
                                    {"role": "assistant", "content": "7"}],
         "gt": None, "source": "arith"},
    ]
    path = tmp_path / "oi.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    mapping = {"id": "key", "messages": "conversation", "ground_truth": "gt", "dataset": "source"}
    checked = validate_rows(load_rows(str(path), fields=mapping))
    assert checked.rejected == []
    assert [r["id"] for r in checked.rows] == ["7", "8"]  # integer IDs are accepted as text
    prompts, dropped = prepare_prompts(checked.rows, tiny_tokenizer, "t", 2000, 1024, 0.0, 0)
    assert dropped == []
    assert prompts[0]["reference_answer"] == "5" and prompts[0]["question"] == "What is 2 + 3?"
    # The final assistant turn is the reference, not part of the prompt, and the prompt ends ready to generate.
    assert prompts[1]["reference_answer"] == "7"
    assert prompts[1]["prompt_text"].endswith("<|im_start|>assistant\n") and "7" not in prompts[1]["prompt_text"]


def test_a_missing_path_is_not_taken_for_a_hub_name(tmp_path):
    with pytest.raises(SourceError, match="does not exist"):
        load_rows(str(tmp_path / "nope.jsonl"))
    with pytest.raises(SourceError, match="format: hub"):  # a name without a suffix may be meant for the hub
        load_rows(str(tmp_path / "nope"))
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(SourceError, match="cannot tell the format"):
        load_rows(str(tmp_path / "rows.csv"))


def test_source_and_sft_config_fields_parse_and_reject_bad_values():
    cfg = recipe_from_dict({"data": {"format": "parquet", "fields": {"question": "query"}, "split": "test"},
                            "sft": {"enabled": True, "prompt_policy": "truncate"},
                            "rubrics": {"generation_endpoint": "http://127.0.0.1:9/v1"}})
    assert cfg.data.fields == {"question": "query"} and cfg.sft.enabled and cfg.sft.pack_length == 8192
    assert (cfg.sft.max_prompt_tokens, cfg.sft.max_response_tokens, cfg.sft.max_total_tokens) == (6144, 1024, 8192)
    with pytest.raises(ConfigError, match="data.fields"):
        recipe_from_dict({"data": {"fields": ["question"]}})
    with pytest.raises(ConfigError, match="sft.total_policy"):
        recipe_from_dict({"sft": {"total_policy": "wrap"}})
    with pytest.raises(ConfigError, match="data.format"):
        recipe_from_dict({"data": {"format": "csv"}})
