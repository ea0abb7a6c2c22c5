"""Edges of reading and checking data: snippet IDs across a chat row's tool messages, text that is not UTF-8 in a
Parquet or save_to_disk text column, optional rubric weights read back as null, JSONL lines, malformed static rubric
files, duplicate chat rows written differently, an empty training split, the held-out prompts the rubric stage
kept, and atomic writes that reach the disk."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import REPO
from refiner_core.config import ConfigError
from refiner_core.data.prepare import prepare_prompts
from refiner_core.data.rows import RawRow, content_hash, read_jsonl, split_of, validate_rows
from refiner_core.data.rubric_fields import RubricError, instance_rubrics, load_static_rubrics
from refiner_core.data.sources import load_rows
from refiner_core.schema import QUARANTINE
from refiner_core.store.storage import atomic_dir, read_rows, write_json, write_table

SNIPPETS = "<snippet id=S1>Title: A\nText: alpha</snippet>\n<snippet id=S2>Text: beta</snippet>"


def refiner_row(i, **fields) -> dict:
    row = {
        "id": str(i),
        "question": f"What is q{i}?",
        "reasoning": "The agent searched.",
        "tool_output": SNIPPETS,
        "answer": "<answer><snippet id=S1>alpha</snippet></answer>",
        "positive_rubrics": ["Names alpha."],
        "negative_rubrics": ["Names gamma."],
    }
    return {**row, **fields}


def raw_rows(rows: list[dict]) -> list[RawRow]:
    return [RawRow(f"line {n}", json.dumps(r), r) for n, r in enumerate(rows, start=1)]


# Chat rows: the prompt's citable IDs are read from all its tool messages joined.


def _searches(second: str) -> dict:
    return {
        "id": "c1",
        "messages": [
            {"role": "user", "content": "Where is the Eiffel Tower and how heavy is it?"},
            {"role": "assistant", "content": "<tool_call>search('Eiffel Tower')</tool_call>"},
            {
                "role": "tool",
                "content": "<snippet id=S1>It is in Paris.</snippet>\n<snippet id=S2>Opened 1889.</snippet>",
            },
            {"role": "assistant", "content": "<tool_call>search('Eiffel Tower weight')</tool_call>"},
            {"role": "tool", "content": second},
        ],
        "positive_rubrics": ["Says the tower is in Paris."],
    }


def test_a_chat_row_whose_tool_messages_give_one_id_two_texts_is_invalid_tool_output():
    """A second search numbering its results from S1 again: S3 after the clash was silently not citable."""
    row = _searches("<snippet id=S2>It is 330 metres tall.</snippet>\n<snippet id=S3>It weighs 10,000 t.</snippet>")
    checked = validate_rows(raw_rows([row]))
    assert checked.rows == []
    [rejected] = checked.rejected
    assert (rejected.reason, rejected.detail) == (
        "invalid_tool_output",
        "message 4: snippet ID 'S2' was given in message 2 with another text",
    )


def test_a_snippet_given_again_with_its_text_in_a_later_tool_message_is_fine(tiny_tokenizer):
    row = _searches("<snippet id=S2>Opened 1889.</snippet>\n<snippet id=S3>It weighs 10,000 t.</snippet>")
    checked = validate_rows(raw_rows([row]))
    assert checked.rejected == []
    prompts, dropped = prepare_prompts(checked.rows, tiny_tokenizer, "t", 2000, 1024, 0.0, 0)
    assert dropped == []
    assert prompts[0]["snippet_ids"] == ["S1", "S2", "S3"]


def test_a_prompt_that_fills_the_policys_context_is_too_long(tiny_tokenizer):
    """Under data.max_prompt_tokens but filling the policy's context: no room for a response (vLLM refused such a
    prompt mid-run, failing the rollout stage at every retry)."""
    row = _searches("<snippet id=S2>Opened 1889.</snippet>")
    checked = validate_rows(raw_rows([row]))
    [prompt], _ = prepare_prompts(checked.rows, tiny_tokenizer, "t", 2000, 1024, 0.0, 0)
    tokens = prompt["prompt_tokens"]
    kept, dropped = prepare_prompts(checked.rows, tiny_tokenizer, "t", 2000, 1024, 0.0, 0, context=tokens + 1)
    assert len(kept) == 1 and dropped == []
    kept, [dropped] = prepare_prompts(checked.rows, tiny_tokenizer, "t", 2000, 1024, 0.0, 0, context=tokens)
    assert kept == [] and (dropped.reason, dropped.detail) == (
        "prompt_too_long",
        f"{tokens} prompt tokens leave no room for a response in the policy's context of {tokens} tokens",
    )


# Parquet and save_to_disk text columns holding bytes that are not UTF-8 (a writer that does not check).


def _unchecked_strings(values: list[bytes]) -> pa.Array:
    offsets = np.cumsum([0] + [len(v) for v in values]).astype(np.int32)
    return pa.Array.from_buffers(
        pa.string(), len(values), [None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(b"".join(values))]
    )


def _bad_utf8_tables() -> tuple[pa.Table, pa.Table]:
    """Refiner rows with Latin-1 bytes in row 1's question; chat rows with them in row 1's second message."""
    refiner = pa.table(
        {
            "id": ["0", "1", "2"],
            "question": _unchecked_strings([b"q0?", b"caf\xe9?", b"q2?"]),
            "reasoning": ["r"] * 3,
            "tool_output": [SNIPPETS] * 3,
        }
    )
    contents = _unchecked_strings([b"hello", b"hi", b"caf\xe9?", b"bye"])
    messages = pa.ListArray.from_arrays(
        pa.array([0, 1, 3, 4], pa.int32()),
        pa.StructArray.from_arrays([pa.array(["user"] * 4), contents], names=["role", "content"]),
    )
    chat = pa.table({"id": ["a", "b", "c"], "messages": messages})
    return refiner, chat


def test_parquet_text_that_is_not_utf8_quarantines_its_row(tmp_path):
    refiner, chat = _bad_utf8_tables()
    pq.write_table(refiner, tmp_path / "refiner.parquet")
    pq.write_table(chat, tmp_path / "chat.parquet")
    checked = validate_rows(load_rows(str(tmp_path / "refiner.parquet")))
    assert [r["id"] for r in checked.rows] == ["0", "2"]
    [bad] = checked.rejected
    assert (bad.row_ref, bad.reason, bad.detail) == (
        "row 1",
        "non_utf8",
        "field 'question' holds bytes that are not UTF-8",
    )
    assert json.loads(bad.raw)["question"] == "caf\ufffd?"  # the row as read, the bad byte shown as U+FFFD

    checked = validate_rows(load_rows(str(tmp_path / "chat.parquet")))  # a text nested in a list of structs
    assert [r["id"] for r in checked.rows] == ["a", "c"]
    assert [(r.row_ref, r.reason, r.detail) for r in checked.rejected] == [
        ("row 1", "non_utf8", "field 'messages' holds bytes that are not UTF-8")
    ]
    assert checked.rows[1]["messages"] == [{"role": "user", "content": "bye"}]

    category = refiner.set_column(1, "question", refiner.column("question").dictionary_encode())  # pandas category
    pq.write_table(category, tmp_path / "category.parquet")
    checked = validate_rows(load_rows(str(tmp_path / "category.parquet")))
    assert [r["id"] for r in checked.rows] == ["0", "2"] and [r.reason for r in checked.rejected] == ["non_utf8"]


def test_a_save_to_disk_text_that_is_not_utf8_quarantines_its_row(tmp_path):
    import datasets

    refiner, _ = _bad_utf8_tables()
    datasets.Dataset(refiner).save_to_disk(str(tmp_path / "ds"))
    checked = validate_rows(load_rows(str(tmp_path / "ds")))
    assert [r["id"] for r in checked.rows] == ["0", "2"]
    assert [(r.row_ref, r.reason) for r in checked.rejected] == [("row 1", "non_utf8")]


# Rubric weights: optional, and a list of structs reads an absent one back as null.


def test_a_parquet_rubric_without_a_weight_takes_weight_1(tmp_path):
    rows = [
        refiner_row(1, positive_rubrics=[{"description": "Names alpha.", "weight": 2.0}], negative_rubrics=[]),
        refiner_row(2, positive_rubrics=[{"description": "Names beta."}], negative_rubrics=[]),
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    raw = load_rows(str(tmp_path / "rows.parquet"))
    assert raw[1].data["positive_rubrics"] == [{"description": "Names beta.", "weight": None}]
    checked = validate_rows(raw)
    assert checked.rejected == []
    assert [r["weight"] for r in instance_rubrics(raw[1].data["positive_rubrics"], [])] == [1.0]


def test_a_static_rubric_with_a_null_weight_takes_weight_1(tmp_path):
    path = tmp_path / "static.json"
    path.write_text(
        json.dumps([{"rubric_id": "s", "kind": "positive", "title": "T", "description": "D", "weight": None}])
    )
    assert [r["weight"] for r in load_static_rubrics(path)] == [1.0]


# JSONL lines end at "\n" only, as the preflight and editors count them.


def test_a_carriage_return_inside_a_jsonl_line_does_not_split_it(tmp_path):
    lines = [
        json.dumps(refiner_row(1)).encode(),
        json.dumps(refiner_row(2)).replace("q2?", "q2\\r?").replace("\\r", "\r").encode(),  # a bare CR in a string
        json.dumps(refiner_row(3)).encode(),
        json.dumps({"id": "4"}).encode(),
    ]
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    raw = read_jsonl(path)
    assert [r.row_ref for r in raw] == ["line 1", "line 2", "line 3", "line 4"]
    checked = validate_rows(raw)
    assert [(r["id"], r["row_ref"]) for r in checked.rows] == [("1", "line 1"), ("3", "line 3")]
    assert [(r.row_ref, r.reason) for r in checked.rejected] == [
        ("line 2", "invalid_json"),  # JSON strings hold no raw control characters
        ("line 4", "missing_field"),
    ]


def test_crlf_line_ends_and_unicode_line_separators_in_jsonl(tmp_path):
    path = tmp_path / "rows.jsonl"
    second = json.dumps(refiner_row(2, question="a\u2028b\x85c?"), ensure_ascii=False).encode()
    path.write_bytes(json.dumps(refiner_row(1)).encode() + b"\r\n" + second + b"\r\n\r\n")
    raw = read_jsonl(path)
    assert [(r.row_ref, r.error) for r in raw] == [("line 1", None), ("line 2", None)]
    assert raw[1].data["question"] == "a\u2028b\x85c?"


# Static rubric files: a malformed one is a RubricError (not retried) that names the file and the rubric.


@pytest.mark.parametrize(
    "content, says",
    [
        ({"static-a": {"kind": "positive", "title": "t", "description": "d"}}, "expected a list of rubric objects"),
        (["static-a"], "static rubric 0: expected an object"),
        ([{"rubric_id": "static-a", "kind": "positive", "description": "d"}], "'static-a': 'title' must be"),
        (
            [{"rubric_id": "static-a", "kind": "positive", "title": "t", "description": None}],
            "'static-a': 'description'",
        ),
        (
            [{"rubric_id": "static-a", "kind": "positive", "title": " ", "description": "d"}],
            "'static-a': 'title' must be",
        ),
        (  # a misspelt weight would weigh 1
            [{"rubric_id": "static-a", "kind": "positive", "title": "t", "description": "d", "weigth": 5}],
            "'static-a': unknown keys ['weigth']",
        ),
    ],
)
def test_a_malformed_static_rubric_file_is_a_rubric_error_naming_the_rubric(tmp_path, content, says):
    path = tmp_path / "static.json"
    path.write_text(json.dumps(content))
    with pytest.raises(RubricError, match=str(path)) as err:
        load_static_rubrics(path)
    assert says in str(err.value)


def test_a_static_rubric_file_that_is_not_json_is_a_rubric_error(tmp_path):
    path = tmp_path / "static.json"
    path.write_text('[{"rubric_id": "a",')
    with pytest.raises(RubricError, match=rf"{path}: not JSON"):
        load_static_rubrics(path)


# Duplicate chat rows: the same conversation however its JSON is written.


def test_chat_rows_written_differently_are_duplicates():
    a = {"id": "a", "messages": [{"role": "user", "content": "2+2?"}], "ground_truth": "4"}
    b = {"id": "b", "messages": [{"content": "2+2?", "role": "user"}], "ground_truth": "4"}
    c = {"id": "c", "messages": [{"role": "user", "content": "2+2?"}], "ground_truth": 4}
    d = {"id": "d", "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    e = {**d, "id": "e", "ground_truth": ""}  # a blank ground truth is none: the final answer is the reference
    checked = validate_rows(raw_rows([a, b, c, d, e]))
    assert [r["id"] for r in checked.rows] == ["a", "d"]
    assert [(r.row_ref, r.reason) for r in checked.rejected] == [
        ("line 2", "duplicate_content"),
        ("line 3", "duplicate_content"),
        ("line 5", "duplicate_content"),
    ]


def test_chat_rows_that_differ_beyond_role_and_content_are_not_duplicates():
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "search", "arguments": "{}"}}]}
    other = {**call, "tool_calls": [{"function": {"name": "browse", "arguments": "{}"}}]}
    user = {"role": "user", "content": "Look it up."}
    rows = [
        {"id": "a", "messages": [user, call], "ground_truth": "4"},
        {"id": "b", "messages": [user, other], "ground_truth": "4"},
        {"id": "c", "messages": [{**user, "name": "ann"}, call], "ground_truth": "4"},
        {"id": "d", "messages": [user, call], "ground_truth": 4.0},  # "4.0" is the reference text, not "4"
    ]
    reordered = {**call, "tool_calls": [{"function": {"arguments": "{}", "name": "search"}}]}
    rows.append({"id": "e", "messages": [user, reordered], "ground_truth": "4"})  # a, nested keys in another order
    checked = validate_rows(raw_rows(rows))
    assert [r["id"] for r in checked.rows] == ["a", "b", "c", "d"]
    assert [(r.row_ref, r.reason) for r in checked.rejected] == [("line 5", "duplicate_content")]


def test_a_plain_chat_row_keeps_the_content_hash_earlier_catalogs_recorded():
    """refiner compare matches prompts of two runs by content hash: a row of role and content only, with a text
    ground truth, hashes as before."""
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    before = hashlib.blake2b(json.dumps([messages, "4"]).encode(), digest_size=12).hexdigest()
    assert content_hash({"id": "a", "messages": messages, "ground_truth": "4"}) == before


# The stages: an empty training split, and the held-out prompts the rubric stage kept.


def _stage_flow(tiny_model_path, rows: list[dict], tmp_path: Path, validation_fraction: float, seed: int):
    from prefect import flow

    from refiner_core.config import RecipeConfig
    from refiner_core.stage_settings import input_fields
    from tasks.prepare import prepare_data
    from tasks.rubrics import ingest_rubrics

    data_file = tmp_path / "rows.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    conf = dataclasses.asdict(RecipeConfig())
    data = {**conf["data"], "max_prompt_tokens": 2000, "validation_fraction": validation_fraction}
    policy = {"path": str(tiny_model_path), "hash": "tiny"}

    @flow
    def prepare(run_dir: str):
        prompts = prepare_data.with_options(retries=2, retry_delay_seconds=0)(
            run_dir=run_dir, run="e", data_file=str(data_file), data=data, seed=seed, policy=policy
        )
        return prompts, ingest_rubrics.with_options(retries=2, retry_delay_seconds=0)(
            run_dir=run_dir,
            run="e",
            data_file=str(data_file),
            data={f.name: data[f.name] for f in input_fields("source")},
            rubric_file="",
            rubric_cfg=conf["rubrics"],
            static_rubrics_file=str(REPO / conf["rubrics"]["static_rubrics"]),
            prompts=prompts,
        )

    return prepare(str(tmp_path / "run"), return_state=True)


def _task_runs(flow_state) -> dict[str, int]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_state.state_details.flow_run_id]))
        )
    return {r.name: r.run_count for r in runs}


def test_prepare_data_with_every_prompt_held_out_is_a_config_error(prefect_server, tiny_model_path, tmp_path):
    assert [split_of(str(i), 0.5, 12) for i in range(3)] == ["validation"] * 3
    state = _stage_flow(tiny_model_path, [refiner_row(i) for i in range(3)], tmp_path, 0.5, 12)
    assert state.is_failed()
    with pytest.raises(ConfigError) as err:
        state.result()
    message = str(err.value)
    assert "no training prompt" in message and "all 3 prepared prompts are in the validation split" in message
    assert "data.validation_fraction" in message and "data.max_prompts" in message
    assert "SELECT * FROM quarantine" in message
    assert _task_runs(state) == {"prepare-data": 1}, "a configuration error is not retried"


def test_ingest_rubrics_leaving_no_training_prompt_is_a_config_error(prefect_server, tiny_model_path, tmp_path):
    assert [split_of(str(i), 0.5, 2) for i in range(4)] == ["train", "validation", "validation", "validation"]
    rows = [refiner_row(0, positive_rubrics=None, negative_rubrics=None)] + [refiner_row(i) for i in (1, 2, 3)]
    state = _stage_flow(tiny_model_path, rows, tmp_path, 0.5, 2)  # 1 of 4 rejected: under max_rejected_fraction
    assert state.is_failed()
    with pytest.raises(ConfigError) as err:
        state.result()
    message = str(err.value)
    assert "no training prompt: ingest-rubrics rejected each of the 1 training prompts" in message
    assert "missing_rubrics 1" in message and "SELECT * FROM quarantine" in message
    assert _task_runs(state)["ingest-rubrics"] == 1
    assert (tmp_path / "run" / "catalog.duckdb").is_file()  # the query it names works


def test_the_rubric_stage_records_the_held_out_prompts_it_kept(prefect_server, tiny_model_path, tmp_path):
    from refiner_core.eval.evaluate import held_out_prompts

    ids = ["0", "1", "2", "3", "4", "nr"]
    assert [split_of(i, 0.5, 1) for i in ids] == ["train"] * 4 + ["validation"] * 2
    rows = [refiner_row(i) for i in ids[:5]] + [refiner_row("nr", positive_rubrics=None, negative_rubrics=None)]
    state = _stage_flow(tiny_model_path, rows, tmp_path, 0.5, 1)
    prompts, rubrics = state.result()
    assert rubrics["train_ids"] == ["0", "1", "2", "3"]
    assert rubrics["held_out_ids"] == ["4"]  # 'nr' was quarantined as missing_rubrics: nothing could score it
    chosen = held_out_prompts(read_rows(prompts["prompts"]["path"]), 0, rubrics["held_out_ids"])
    assert [p["prompt_id"] for p in chosen] == ["4"]


# Atomic writes reach the disk: the file's data before it takes the final name, the folder's entry after.


@pytest.fixture
def synced(monkeypatch) -> list[tuple[str, str]]:
    """("fsync", path) and ("replace", final path) in the order they happen (os.fsync and os.replace do their
    work as always)."""
    events: list[tuple[str, str]] = []
    fsync, replace, rename = os.fsync, os.replace, Path.rename

    def recording_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def recording_replace(src, dst, **kw):
        replace(src, dst, **kw)
        events.append(("replace", str(dst)))

    def recording_rename(self, target):
        out = rename(self, target)
        events.append(("replace", str(target)))
        return out

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    monkeypatch.setattr(Path, "rename", recording_rename)
    return events


def _row() -> dict:
    return {
        "run": "r",
        "stage": "prepare",
        "source": "s",
        "row_ref": "line 1",
        "reason": "x",
        "detail": "d",
        "raw": "{}",
    }


def test_write_table_and_write_json_sync_the_file_then_its_folder(tmp_path, synced):
    final = tmp_path / "out" / "quarantine.parquet"
    write_table(QUARANTINE, [_row()], final)
    [(_, temp), replaced, folder] = synced
    assert Path(temp).parent == final.parent and temp.endswith(".partial")
    assert replaced == ("replace", str(final)) and folder == ("fsync", str(final.parent))
    assert read_rows(final) == [_row()]

    synced.clear()
    write_json({"a": 1}, final.with_name("x.json"))
    assert [kind for kind, _ in synced] == ["fsync", "replace", "fsync"]
    assert synced[2] == ("fsync", str(final.parent))
    assert json.loads(final.with_name("x.json").read_text()) == {"a": 1}


def test_atomic_dir_syncs_its_files_before_the_rename_and_the_parent_after(tmp_path, synced):
    final = tmp_path / "ckpt"
    with atomic_dir(final) as build:
        (build / "sub").mkdir()
        (build / "sub" / "w.bin").write_bytes(b"w" * 100)
        (build / "config.json").write_text("{}")
    kinds = [kind for kind, _ in synced]
    at = kinds.index("replace")
    synced_before = {Path(p).name for kind, p in synced[:at] if kind == "fsync"}
    assert {"w.bin", "config.json", "sub", build.name} <= synced_before
    assert synced[at:] == [("replace", str(final)), ("fsync", str(tmp_path))]
    assert (final / "sub" / "w.bin").read_bytes() == b"w" * 100


def test_the_content_hash_compare_matches_prompts_by_stays_the_rows_content_as_written():
    """Dedupe reads a chat row's ground truth 4 as "4" and its messages whatever their key order (duplicate_key), but
    prompts.content_hash, which `refiner compare` matches two runs' prompts by, stays the hash of the row as written,
    as earlier versions computed it: a baseline run made before keeps its prompts shared."""
    import hashlib
    import json

    from refiner_core.data.rows import content_hash, duplicate_key

    messages = [{"content": "2+2?", "role": "user"}]
    row = {"id": "a", "messages": messages, "ground_truth": 4}
    as_written = hashlib.blake2b(json.dumps([messages, 4]).encode(), digest_size=12).hexdigest()
    assert content_hash(row) == as_written
    same = {"id": "b", "messages": [{"role": "user", "content": "2+2?"}], "ground_truth": "4"}
    assert duplicate_key(row) == duplicate_key(same) and content_hash(row) != content_hash(same)
