"""The malformed-row corpus: every bad row is quarantined with its reason, every valid row survives, nothing
crashes, and a stage fails only above max_rejected_fraction with a message naming the rows."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from refiner_core.data.prepare import prepare_prompts
from refiner_core.data.rows import RawRow, TooManyRejected, accepted_raw_rows, check_rejected_fraction, validate_rows
from refiner_core.data.sources import load_rows

DATA = Path(__file__).parent / "data"
CORPUS = DATA / "malformed.jsonl"
EXPECTED = json.loads((DATA / "malformed.expected.json").read_text())


def run_checks(raw_rows, tokenizer):
    checked = validate_rows(raw_rows)
    prompts, dropped = prepare_prompts(
        checked.rows,
        tokenizer,
        "test",
        max_prompt_tokens=2000,
        max_reference_tokens=1024,
        validation_fraction=0.0,
        seed=0,
    )
    return prompts, checked.rejected + dropped


def test_corpus_covers_at_least_fifteen_kinds():
    assert len(EXPECTED["rejected"]) >= 15
    assert len({reason for reason, _ in EXPECTED["rejected"].values()}) >= 15
    assert b"caf\xe9 au lait" in CORPUS.read_bytes()  # a real non-UTF-8 byte, not an escape


def test_every_malformed_jsonl_row_is_quarantined_with_its_reason(tiny_tokenizer):
    prompts, rejected = run_checks(load_rows(str(CORPUS)), tiny_tokenizer)
    got = {r.row_ref: (r.reason, r.detail) for r in rejected}
    assert set(got) == set(EXPECTED["rejected"]), "exactly the malformed rows are rejected"
    for ref, (reason, detail_part) in EXPECTED["rejected"].items():
        assert got[ref][0] == reason, f"{ref}: {got[ref]}"
        assert detail_part in got[ref][1], f"{ref}: {got[ref]}"
    assert [p["prompt_id"] for p in prompts] == EXPECTED["valid_ids"]
    assert all(r.raw for r in rejected), "the raw text is kept for every rejected row"


def test_valid_rows_come_out_the_same_with_or_without_malformed_neighbours(tiny_tokenizer, tmp_path):
    lines = CORPUS.read_bytes().splitlines()
    clean = tmp_path / "clean.jsonl"
    clean.write_bytes(b"\n".join(line for n, line in enumerate(lines, 1) if f"line {n}" not in EXPECTED["rejected"]))
    clean_prompts, clean_rejected = run_checks(load_rows(str(clean)), tiny_tokenizer)
    mixed_prompts, _ = run_checks(load_rows(str(CORPUS)), tiny_tokenizer)
    assert clean_rejected == []
    assert clean_prompts == mixed_prompts


def _corpus_as_parquet(path: Path) -> dict[str, str]:
    """The corpus rows whose fields fit Parquet columns (question stored as bytes, rubrics as JSON text), plus
    a row whose question bytes are not UTF-8. Returns the expected reason per 'row N'."""
    records, expected = [], {}
    lines = CORPUS.read_bytes().splitlines()
    for n, line in enumerate(lines, 1):
        try:
            obj = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        if not isinstance(obj, dict) or "messages" in obj:
            continue
        if not all(
            isinstance(obj.get(k), (str, type(None))) for k in ("id", "question", "reasoning", "tool_output", "answer")
        ):
            continue  # wrong-type rows cannot share a typed column
        record = {k: obj.get(k) for k in ("id", "reasoning", "tool_output", "answer")}
        record["question"] = obj["question"].encode() if isinstance(obj.get("question"), str) else None
        for k in ("positive_rubrics", "negative_rubrics"):
            record[k] = None if k not in obj else obj[k] if isinstance(obj[k], str) else json.dumps(obj[k])
        if f"line {n}" in EXPECTED["rejected"]:
            expected[f"row {len(records)}"] = EXPECTED["rejected"][f"line {n}"][0]
        records.append(record)
    bad = dict(records[0], id="bad-bytes", question=b"caf\xe9?")
    expected[f"row {len(records)}"] = "non_utf8"
    records.append(bad)
    pq.write_table(pa.Table.from_pylist(records), path)
    return expected


def test_parquet_variant_is_quarantined_the_same_way(tiny_tokenizer, tmp_path):
    path = tmp_path / "malformed.parquet"
    expected = _corpus_as_parquet(path)
    assert len(set(expected.values())) >= 12
    prompts, rejected = run_checks(load_rows(str(path)), tiny_tokenizer)
    assert {r.row_ref: r.reason for r in rejected} == expected
    refiner_valid = [i for i in EXPECTED["valid_ids"] if i != "ok-chat"]
    assert [p["prompt_id"] for p in prompts] == refiner_valid


def test_run_fails_only_above_the_configured_fraction_and_names_the_rows(tiny_tokenizer):
    raw = load_rows(str(CORPUS))
    _, rejected = run_checks(raw, tiny_tokenizer)
    fraction = len(rejected) / len(raw)
    check_rejected_fraction(rejected, len(raw), fraction, "q.parquet")  # exactly at the limit: passes
    with pytest.raises(TooManyRejected) as err:
        check_rejected_fraction(rejected, len(raw), fraction - 0.01, "q.parquet")
    message = str(err.value)
    assert f"{len(rejected)}/{len(raw)} rows rejected" in message
    assert "line 2: non_utf8" in message and "line 3: invalid_json" in message
    assert "'unknown_snippet_id': 1" in message


def _run_counts(flow_state) -> dict[str, int]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_state.state_details.flow_run_id])),
            sort=TaskRunSort.EXPECTED_START_TIME_DESC,
            limit=50,
        )
    return {r.name: r.run_count for r in runs}


def test_prepare_stage_quarantine_is_queryable_with_refiner_sql(prefect_server, tiny_model_path, tmp_path):
    import dataclasses

    from prefect import flow
    from typer.testing import CliRunner

    from flows.cli import app
    from refiner_core.config import DataConfig
    from tasks.prepare import prepare_data

    policy = {"path": str(tiny_model_path), "hash": "tiny"}

    @flow
    def prepare_only(data: dict, run_dir: str):
        return prepare_data.with_options(retries=2, retry_delay_seconds=0)(
            run_dir=run_dir, run="q", data_file=str(CORPUS), data=data, seed=0, policy=policy
        )

    data = {**dataclasses.asdict(DataConfig()), "max_prompt_tokens": 2000, "max_rejected_fraction": 0.9}
    manifest = prepare_only(data, str(tmp_path / "ok"))
    assert manifest["rows_out"] == len(EXPECTED["valid_ids"])
    from refiner_core.publish.catalog import build_catalog

    build_catalog(tmp_path / "ok" / "catalog.duckdb", {"quarantine": [manifest["quarantine"]["path"]]})
    result = CliRunner().invoke(
        app,
        [
            "sql",
            str(tmp_path / "ok"),
            "SELECT row_ref, reason, stage FROM quarantine WHERE reason = 'non_utf8'",
            "--format",
            "json",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [{"row_ref": "line 2", "reason": "non_utf8", "stage": "prepare"}]

    # Above the limit the stage fails, says which rows and why, and the quarantine is still queryable.
    state = prepare_only({**data, "max_rejected_fraction": 0.2}, str(tmp_path / "bad"), return_state=True)
    assert state.is_failed()
    with pytest.raises(TooManyRejected, match=r"line 2: non_utf8 \(.*\).*refiner sql"):
        state.result()
    assert _run_counts(state) == {"prepare-data": 1}, "rejected data is not retried"
    result = CliRunner().invoke(
        app, ["sql", str(tmp_path / "bad"), "SELECT count(*) AS n FROM quarantine", "--format", "json"]
    )
    assert json.loads(result.stdout) == [{"n": len(EXPECTED["rejected"])}]


def test_later_stages_see_the_row_prepare_kept_when_an_id_repeats():
    lines = [line for line in (DATA.parent.parent / "data" / "refiner" / "samples.jsonl").read_text().splitlines()[:2]]
    first, second = json.loads(lines[0]), json.loads(lines[1])
    broken = {**first, "question": 42, "positive_rubrics": ["from the rejected line"]}
    good = {**second, "id": first["id"]}
    raw = [RawRow("line 1", json.dumps(broken), broken), RawRow("line 2", json.dumps(good), good)]
    kept = accepted_raw_rows(raw)
    assert [r.row_ref for r in kept] == ["line 2"]
    assert kept[0].data["positive_rubrics"] == second["positive_rubrics"]


@pytest.mark.parametrize(
    "field,text,code,offset",
    [
        ("question", "Who won?\x00", "U+0000", 8),  # NUL
        ("reasoning", "look \x1b[31mred", "U+001B", 5),  # a terminal escape sequence
        ("tool_output", None, "U+007F", None),  # DEL inside the tool output
        ("answer", "<answer>x\x85</answer>", "U+0085", 9),  # a C1 control (NEL)
    ],
)
def test_control_characters_are_quarantined_with_where_they_are(tiny_tokenizer, tmp_path, field, text, code, offset):
    """Written as JSON escapes (how they arrive in real files) and read back by the real JSONL loader."""
    good = json.loads((DATA.parent.parent / "data" / "refiner" / "samples.jsonl").read_text().splitlines()[0])
    bad = dict(good, id="bad")
    if field == "tool_output":
        bad["tool_output"] = good["tool_output"].replace("<snippet", "\x7f<snippet", 1)
        offset = good["tool_output"].index("<snippet")
    else:
        bad[field] = text
    tabs = dict(good, id="tabs-and-newlines", question="Line one\n\tindented\r\nline two?")
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (good, bad, tabs)) + "\n")  # json.dumps writes \u0000 etc.
    assert "\\u00" in path.read_text()
    prompts, rejected = run_checks(load_rows(str(path)), tiny_tokenizer)
    assert [(r.row_ref, r.reason, r.detail) for r in rejected] == [
        ("line 2", "control_characters", f"field {field!r} holds {code} at offset {offset}")
    ]
    assert [p["prompt_id"] for p in prompts] == [good["id"], "tabs-and-newlines"]
    assert all(chr(int(code[2:], 16)) not in p["prompt_text"] for p in prompts)


def test_control_characters_in_chat_messages_are_quarantined():
    row = {"id": "c1", "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4\x00"}]}
    [rejection] = validate_rows([RawRow("line 1", json.dumps(row), row)]).rejected
    assert (rejection.reason, rejection.detail) == (
        "control_characters",
        "field 'messages'[1]['content'] holds U+0000 at offset 1",
    )


class CountingTokenizer:
    """The real tokenizer, recording the length of every text it is asked to tokenize or render."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.lengths: list[int] = []

    def __call__(self, text, *args, **kwargs):
        self.lengths.append(len(text))
        return self._tokenizer(text, *args, **kwargs)

    def apply_chat_template(self, messages, *args, **kwargs):
        self.lengths.append(sum(len(m["content"]) for m in messages))
        return self._tokenizer.apply_chat_template(messages, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_a_huge_row_is_rejected_without_tokenizing_it(tiny_tokenizer):
    samples = [
        json.loads(line)
        for line in (DATA.parent.parent / "data" / "refiner" / "samples.jsonl").read_text().splitlines()[:2]
    ]
    huge = dict(samples[1], id="huge", reasoning="word " * 1_000_000)  # 5 MB
    long_answer = dict(samples[1], id="long-answer", answer="<answer>" + "x" * 2_000_000 + "</answer>")
    raw = [RawRow(f"line {n}", json.dumps(r), r) for n, r in enumerate([samples[0], huge, long_answer], 1)]
    counting = CountingTokenizer(tiny_tokenizer)
    prompts, rejected = prepare_prompts(validate_rows(raw).rows, counting, "t", 2000, 1024, 0.0, 0)
    assert [p["prompt_id"] for p in prompts] == [samples[0]["id"]]
    assert [(r.row_ref, r.reason) for r in rejected] == [
        ("line 2", "prompt_too_long"),
        ("line 3", "reference_too_long"),
    ]
    chars, _, rest = rejected[0].detail.partition(" ")
    assert 4_000_000 < int(chars) < 4_010_000  # the reasoning's 4 MB of non-space text, plus the other fields
    assert rest == "characters besides whitespace: more than max_prompt_tokens 2000 tokens can hold"
    assert counting.lengths and max(counting.lengths) < 100_000, "the huge rows were never tokenized"


def test_the_length_precheck_never_rejects_a_row_that_fits(tiny_tokenizer):
    """At a limit of exactly its token count a row is kept; one token less, the real count rejects it."""
    row = json.loads((DATA.parent.parent / "data" / "refiner" / "samples.jsonl").read_text().splitlines()[0])
    rows = validate_rows([RawRow("line 1", json.dumps(row), row)]).rows
    [prompt], _ = prepare_prompts(rows, tiny_tokenizer, "t", 100_000, 100_000, 0.0, 0)
    n = prompt["prompt_tokens"]
    assert prepare_prompts(rows, tiny_tokenizer, "t", n, prompt["reference_tokens"], 0.0, 0)[1] == []
    [too_long] = prepare_prompts(rows, tiny_tokenizer, "t", n - 1, 100_000, 0.0, 0)[1]
    assert (too_long.reason, too_long.detail) == ("prompt_too_long", f"{n} prompt tokens > max_prompt_tokens {n - 1}")


def test_a_run_that_quarantined_rows_ends_with_a_warning(tmp_path):
    from refiner_core.data.quarantine import quarantine_warning
    from refiner_core.data.rows import Rejection
    from refiner_core.publish.catalog import build_catalog
    from refiner_core.schema import QUARANTINE
    from refiner_core.store.storage import write_table

    prepare = [
        Rejection("line 2", "non_utf8", "d", "x"),
        Rejection("line 3", "invalid_json", "d", "x"),
        Rejection("line 9", "non_utf8", "d", "x"),
    ]
    rubrics = [Rejection("id r1", "missing_rubrics", "d", "x")]
    write_table(QUARANTINE, [r.as_quarantine("q", "prepare", "c.jsonl") for r in prepare], tmp_path / "q1.parquet")
    write_table(QUARANTINE, [r.as_quarantine("q", "rubrics", "c.jsonl") for r in rubrics], tmp_path / "q2.parquet")
    build_catalog(tmp_path / "catalog.duckdb", {"quarantine": [tmp_path / "q1.parquet", tmp_path / "q2.parquet"]})
    assert quarantine_warning(tmp_path) == (
        "4 rows quarantined (prepare: invalid_json 1, non_utf8 2; rubrics: missing_rubrics 1); "
        f"see them: refiner sql {tmp_path} 'SELECT * FROM quarantine'"
    )
    build_catalog(tmp_path / "catalog.duckdb", {"quarantine": []})
    assert quarantine_warning(tmp_path) is None
    assert quarantine_warning(tmp_path / "no-catalog-yet") is None


def _sample_row() -> dict:
    return json.loads((DATA.parent.parent / "data" / "refiner" / "samples.jsonl").read_text().splitlines()[0])


def test_a_lone_surrogate_escape_is_quarantined_before_it_reaches_the_tokenizer(tiny_tokenizer, tmp_path):
    """'\\ud800' is valid JSON and decodes to text no UTF-8 encoder (tokenizer, Parquet, terminal) accepts."""
    good = _sample_row()
    bad = dict(good, id="bad", question=good["question"] + " \ud800")
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (good, bad)) + "\n")  # written as the escape \ud800
    assert "\\ud800" in path.read_text()
    prompts, rejected = run_checks(load_rows(str(path)), tiny_tokenizer)
    offset = len(good["question"]) + 1
    assert [(r.row_ref, r.reason) for r in rejected] == [("line 2", "lone_surrogate")]
    assert rejected[0].detail.startswith(f"field 'question' holds U+D800 at offset {offset}")
    assert [p["prompt_id"] for p in prompts] == [good["id"]]
    chat = {"id": "c", "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "\udc00"}]}
    [rejection] = validate_rows([RawRow("line 1", json.dumps(chat), json.loads(json.dumps(chat)))]).rejected
    assert rejection.reason == "lone_surrogate" and "field 'messages'[1]['content'] holds U+DC00" in rejection.detail


def test_a_ground_truth_that_is_not_text_or_a_number_is_wrong_type(tiny_tokenizer):
    def row(rid: str, truth) -> RawRow:
        data = {"id": rid, "messages": [{"role": "user", "content": f"6*7? ({rid})"}], "ground_truth": truth}
        return RawRow(f"line {rid}", json.dumps(data), data)

    rows = [row("1", ["42"]), row("2", {"answer": "42"}), row("3", True), row("4", 42), row("5", 0.5)]
    rows += [row("6", float("nan")), row("7", float("inf"))]  # JSON writers' and Parquet's "missing": no answer
    checked = validate_rows(rows)
    assert [(r.row_ref, r.reason, r.detail) for r in checked.rejected] == [
        ("line 1", "wrong_type", "field 'ground_truth' must be a string or a number, got list"),
        ("line 2", "wrong_type", "field 'ground_truth' must be a string or a number, got dict"),
        ("line 3", "wrong_type", "field 'ground_truth' must be a string or a number, got bool"),
        ("line 6", "wrong_type", "field 'ground_truth' is nan, not a number"),
        ("line 7", "wrong_type", "field 'ground_truth' is inf, not a number"),
    ]
    prompts, _ = prepare_prompts(checked.rows, tiny_tokenizer, "t", 1000, 100, 0.0, 0)
    assert [(p["prompt_id"], p["ground_truth"]) for p in prompts] == [("4", "42"), ("5", "0.5")]


@pytest.mark.parametrize("weight", [float("inf"), float("nan"), 0, -1.0, True, "2"])
def test_a_rubric_weight_that_is_not_a_finite_positive_number_is_quarantined(weight):
    """An infinite weight made the weighted rubric score inf/inf: NaN for every rollout of the prompt."""
    row = dict(_sample_row(), positive_rubrics=[{"description": "cites a1", "weight": weight}, "is short"])
    [rejection] = validate_rows([RawRow("line 1", json.dumps(row), json.loads(json.dumps(row)))]).rejected
    assert rejection.reason == "invalid_rubrics"
    assert rejection.detail == f"positive rubric 0: 'weight' must be a number in (0, 1e+06], got {weight!r}"


def test_a_static_rubric_weight_that_is_not_finite_is_an_error(tmp_path):
    from refiner_core.data.rubric_fields import RubricError, load_static_rubrics

    rubric = {"rubric_id": "static-x", "kind": "positive", "title": "t", "description": "d"}
    path = tmp_path / "static.json"
    path.write_text(json.dumps([{**rubric, "weight": 2}]))
    assert [r["weight"] for r in load_static_rubrics(path)] == [2.0]
    path.write_text(json.dumps([{**rubric, "weight": float("inf")}]))  # json writes Infinity
    with pytest.raises(RubricError, match="static rubric 'static-x': 'weight' must be a number in \\(0, 1e\\+06\\]"):
        load_static_rubrics(path)
    path.write_text(json.dumps([{**rubric, "description": "d\x1b[2J"}]))
    with pytest.raises(RubricError, match=r"static rubric 'static-x': 'description' holds U\+001B at offset 1"):
        load_static_rubrics(path)
    # scores are keyed by (prompt, rubric ID): a repeated ID, or an instance rubric's, would merge two rubrics
    path.write_text(json.dumps([rubric, {**rubric, "kind": "negative"}]))
    with pytest.raises(RubricError, match="static rubric ID 'static-x' is given twice"):
        load_static_rubrics(path)
    path.write_text(json.dumps([{**rubric, "rubric_id": "pos-0"}]))
    with pytest.raises(RubricError, match=r"static rubric ID 'pos-0' is an instance rubric's \(pos-N, neg-N\)"):
        load_static_rubrics(path)


def test_one_list_in_both_rubric_fields_is_no_orientation():
    """A single rubric column mapped to both fields holding a plain list: every rubric would be positive and
    negative at once, and any verdict would score 0.5."""
    from refiner_core.data.rubric_fields import RubricError, instance_rubrics

    with pytest.raises(RubricError, match="positive_rubrics and negative_rubrics hold the same list"):
        instance_rubrics(["Says 1900"], ["Says 1900"])
    with pytest.raises(RubricError, match="hold the same list"):
        instance_rubrics('["Says 1900"]', ["Says 1900"])
    assert [r["kind"] for r in instance_rubrics(["Says 1928"], ["Says 1900"])] == ["positive", "negative"]
    assert instance_rubrics([], [], allow_empty=True) == []


def test_parquet_columns_json_has_no_type_for_reach_the_quarantine_as_text(tiny_tokenizer, tmp_path):
    """Timestamps, dates and decimals of a Parquet (or hub) source: the rows are prepared, and a rejected one's raw
    text holds them as text."""
    import datetime
    import decimal

    rows = [
        json.loads(line) for line in (DATA.parent.parent / "data/refiner/samples.jsonl").read_text().splitlines()[:3]
    ]
    for r in rows:
        r.update(
            created_at=datetime.datetime(2024, 1, 2, 3, 4, 5),
            day=datetime.date(2024, 1, 2),
            price=decimal.Decimal("1.50"),
            positive_rubrics=json.dumps(r["positive_rubrics"]),
            negative_rubrics=json.dumps(r["negative_rubrics"]),
        )
    rows[2]["answer"] = "<answer>" + "long " * 3000 + "</answer>"
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    checked = validate_rows(load_rows(str(path)))
    prompts, rejected = prepare_prompts(checked.rows, tiny_tokenizer, "t", 100_000, 1000, 0.0, 0)
    assert checked.rejected == [] and len(prompts) == 2
    [too_long] = rejected
    assert too_long.reason == "reference_too_long"
    raw = json.loads(too_long.raw)
    assert (raw["created_at"], raw["day"], raw["price"]) == ("2024-01-02 03:04:05", "2024-01-02", "1.50")
