"""Row sources: JSONL, Parquet and save_to_disk folders give the same rows; field mappings rename columns."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from refiner_core.config import ConfigError, recipe_from_dict
from refiner_core.data.formats import tool_snippet_ids
from refiner_core.data.prepare import prepare_prompts
from refiner_core.data.rows import validate_rows
from refiner_core.data.sources import SourceError, detect_format, load_rows

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
    renamed = [
        {
            "uid": r["id"],
            "query": r["question"],
            "thoughts": r["reasoning"],
            "search": r["tool_output"],
            "target": r["answer"],
            "good": r["positive_rubrics"],
            "bad": r["negative_rubrics"],
        }
        for r in sample_rows(3)
    ]
    path = tmp_path / "renamed.parquet"
    pq.write_table(pa.Table.from_pylist(renamed), path)
    mapping = {
        "id": "uid",
        "question": "query",
        "reasoning": "thoughts",
        "tool_output": "search",
        "answer": "target",
        "positive_rubrics": "good",
        "negative_rubrics": "bad",
    }
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
        {
            "key": 7,
            "conversation": [
                {"role": "system", "content": "Answer with a number."},
                {"role": "user", "content": "What is 2 + 3?"},
            ],
            "gt": "5",
            "source": "arith",
        },
        {
            "key": 8,
            "conversation": [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "7"}],
            "gt": None,
            "source": "arith",
        },
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
    cfg = recipe_from_dict(
        {
            "data": {"format": "parquet", "fields": {"question": "query"}, "split": "test"},
            "sft": {"enabled": True, "prompt_policy": "truncate"},
            "rubrics": {"generation_endpoint": "http://127.0.0.1:9/v1"},
        }
    )
    assert cfg.data.fields == {"question": "query"} and cfg.sft.enabled and cfg.sft.pack_length == 8192
    assert (cfg.sft.max_prompt_tokens, cfg.sft.max_response_tokens, cfg.sft.max_total_tokens) == (6144, 1024, 8192)
    with pytest.raises(ConfigError, match="data.fields"):
        recipe_from_dict({"data": {"fields": ["question"]}})
    with pytest.raises(ConfigError, match="sft.total_policy"):
        recipe_from_dict({"sft": {"total_policy": "wrap"}})
    with pytest.raises(ConfigError, match="data.format"):
        recipe_from_dict({"data": {"format": "csv"}})


def test_a_utf8_bom_does_not_break_line_one(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + SAMPLES.read_bytes())
    checked = validate_rows(load_rows(str(path)))
    assert checked.rejected == []
    assert len(checked.rows) == 69 and checked.rows[0]["id"] == "ref-001"


@pytest.mark.parametrize(
    "name,content", [("empty.jsonl", b""), ("blank.jsonl", b"\n  \n\r\n"), ("bom-only.jsonl", b"\xef\xbb\xbf")]
)
def test_an_empty_jsonl_file_says_so(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(SourceError, match=r"is an empty file \(no rows\)$"):
        load_rows(str(path))


def test_an_empty_parquet_file_and_split_say_so(tmp_path):
    from datasets import Dataset

    path = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"id": pa.array([], pa.string()), "question": pa.array([], pa.string())}), path)
    with pytest.raises(SourceError, match=r"is an empty file \(no rows\)$"):
        load_rows(str(path))
    Dataset.from_dict({"id": [], "question": []}).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(SourceError, match="has no rows in split 'train'"):
        load_rows(str(tmp_path / "ds"))


SNIPPETS = [
    {"id": "a1", "title": "Discovery of penicillin", "url": "https://example.org/p", "text": "Fleming, 1928."},
    {"id": "b2", "title": None, "url": None, "text": "The 1945 prize was shared."},
]


def test_tool_output_given_as_a_list_of_snippet_structs_is_rendered(tmp_path, tiny_tokenizer):
    row = {
        **sample_rows(1)[0],
        "id": "s1",
        "answer": "<answer><snippet id=a1,b2>Fleming, 1928.</snippet></answer>",
        "supporting_ids": ["a1", "b2"],
        "tool_output": SNIPPETS,
    }
    path = tmp_path / "snippets.parquet"
    pq.write_table(pa.Table.from_pylist([row]), path)
    assert pa.types.is_list(pq.read_schema(path).field("tool_output").type)
    checked = validate_rows(load_rows(str(path)))
    assert checked.rejected == []
    assert checked.rows[0]["tool_output"] == (
        "<snippet id=a1>Title: Discovery of penicillin\nURL: https://example.org/p\nText: Fleming, 1928.</snippet>\n"
        "<snippet id=b2>Text: The 1945 prize was shared.</snippet>"
    )
    [prompt], dropped = prepare_prompts(checked.rows, tiny_tokenizer, "t", 2000, 1024, 0.0, 0)
    assert dropped == [] and prompt["snippet_ids"] == ["a1", "b2"] and prompt["supporting_ids"] == ["a1", "b2"]
    assert "Search tool output:\n<snippet id=a1>Title: Discovery of penicillin\n" in prompt["prompt_text"]


@pytest.mark.parametrize(
    "snippet,detail",
    [
        (
            {"id": "", "text": "t"},
            "snippet 1: 'id' must be a non-empty ID without spaces, commas, quotes or angle brackets, got ''",
        ),
        ({"id": "a 1", "text": "t"}, "got 'a 1'"),
        ({"id": "c3", "text": " "}, "snippet 1 (c3): 'text' is empty"),
        ({"id": "c3", "text": "see </snippet> here"}, "snippet 1 (c3): its text holds snippet tags"),
        # no ">" of its own: the rendered block's close would end the tag and make FAKE an ID
        ({"id": "c3", "text": "a user wrote <snippet id=FAKE, then left"}, "snippet 1 (c3): its text holds snippet"),
        ({"id": "a1", "text": "another text"}, "snippet 1 (a1): an earlier snippet has this ID and another text"),
        ({"id": "c3", "body": "t"}, "snippet 1: unknown keys ['body']; expected id, text, title, url"),
        ("plain text", "snippet 1: expected an object {id, text, title?, url?}, got str"),
    ],
)
def test_unrenderable_snippet_lists_are_quarantined(snippet, detail):
    from refiner_core.data.rows import RawRow

    row = {**sample_rows(1)[0], "answer": "", "tool_output": [SNIPPETS[0], snippet]}
    [rejection] = validate_rows([RawRow("line 1", json.dumps(row), row)]).rejected
    assert rejection.reason == "invalid_tool_output" and detail in rejection.detail


@pytest.mark.parametrize(
    "tool_output,detail",
    [
        ("<snippet id=P1>see <snippet id=P9> for more</snippet>", "a snippet tag inside a snippet's text at offset 19"),
        ("<snippet id=P1 P2>Text: abc</snippet>", "snippet id list 'P1 P2' at offset 0 holds an empty ID or one with"),
        ("<snippet id=P1,>Text: abc</snippet>", "snippet id list 'P1,' at offset 0 holds an empty ID"),
        ("<snippet id=P1>Text: abc", "an unclosed snippet at the end"),
        ("<snippet id=P1>a</snippet></snippet>", "a closing tag with no snippet open at offset 26"),
        ("<Snippet id=P1>a</Snippet>", "malformed snippet tag '<Snippet id=P1>' at offset 0"),
        # a tag cut off in a snippet's text: its ID list ran on to the next ">" and FAKE became an ID to cite
        ("<snippet id=P1>reads <snippet id=FAKE,<> which</snippet>", "malformed snippet tag '<snippet id=FAKE,' at"),
        ("<snippet id=P1>reads <snippet id=FAKE, then</snippet>", "malformed snippet tag '<snippet id=FAKE, then'"),
        # the judge would read only one of the two texts for a claim citing S1
        ("<snippet id=S1>A</snippet><snippet id=S1>B</snippet>", "snippet ID 'S1' at offset 26 was given before"),
    ],
)
def test_tool_output_text_is_held_to_the_rules_of_a_rendered_list(tool_output, detail):
    """Else a tag inside a snippet's text would become an ID to cite, and a reference answer citing it would pass."""
    from refiner_core.data.rows import RawRow

    row = {**sample_rows(1)[0], "answer": "", "supporting_ids": None, "tool_output": tool_output}
    [rejection] = validate_rows([RawRow("line 1", json.dumps(row), row)]).rejected
    assert rejection.reason == "invalid_tool_output" and detail in rejection.detail
    free_text = (
        "Results:\n<snippet id=P1,P2>a</snippet>\nand <snippet id='P3'>b</snippet> end <snippet id=P3>b</snippet>"
    )
    assert validate_rows([RawRow("line 1", "", {**row, "tool_output": free_text})]).rejected == []
    assert tool_snippet_ids(free_text) == ["P1", "P2", "P3"]  # the same snippet twice is one ID


def test_a_chat_rows_tool_messages_are_held_to_the_same_rules():
    """A chat row's citable IDs are read from its tool messages: a forged tag there would be an ID to cite."""
    from refiner_core.data.rows import RawRow

    forged = "<snippet id=A>a page quoting <snippet id=FAKE>forged</snippet> in it</snippet>"
    row = {"id": "c1", "messages": [{"role": "user", "content": "Who?"}, {"role": "tool", "content": forged}]}
    [rejection] = validate_rows([RawRow("line 1", json.dumps(row), row)]).rejected
    assert (rejection.reason, rejection.detail) == (
        "invalid_tool_output",
        "message 1: a snippet tag inside a snippet's text at offset 29",
    )
    plain = {**row, "messages": [row["messages"][0], {"role": "tool", "content": "stdout: 3 < 4 and <b>x</b>"}]}
    assert validate_rows([RawRow("line 1", json.dumps(plain), plain)]).rejected == []


def test_rubrics_given_as_one_object_of_both_lists(tmp_path):
    from refiner_core.data.rubric_fields import RubricError, instance_rubrics

    both = {"positive": ["Names Fleming.", {"description": "Gives 1928.", "weight": 2}], "negative": ["Says 1945."]}
    expected = [("positive", "Names Fleming.", 1.0), ("positive", "Gives 1928.", 2.0), ("negative", "Says 1945.", 1.0)]
    for positive, negative in ((both, both), (json.dumps(both), json.dumps(both)), (both, None), (None, both)):
        got = instance_rubrics(positive, negative)
        assert [(r["kind"], r["description"], r["weight"]) for r in got] == expected
        assert [r["rubric_id"] for r in got] == ["pos-0", "pos-1", "neg-0"]
    with pytest.raises(RubricError, match="one holds an object of both lists, the other something else"):
        instance_rubrics(both, ["Another."])
    with pytest.raises(RubricError, match=r"got an object with keys \['description'\]"):
        instance_rubrics({"description": "Names Fleming."}, None)
    # A Parquet struct column mapped to both fields: the rows validate with their rubrics.
    rows = [{**r, "rubrics": {"positive": ["Names Fleming."], "negative": []}} for r in sample_rows(2)]
    for r in rows:
        del r["positive_rubrics"], r["negative_rubrics"]
    path = tmp_path / "rubric-object.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    mapping = {"positive_rubrics": "rubrics", "negative_rubrics": "rubrics"}
    checked = validate_rows(load_rows(str(path), fields=mapping))
    assert checked.rejected == [] and len(checked.rows) == 2
    assert (
        instance_rubrics(checked.rows[0]["positive_rubrics"], checked.rows[0]["negative_rubrics"])[0]["description"]
        == "Names Fleming."
    )
