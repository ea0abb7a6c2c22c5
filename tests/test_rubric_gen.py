"""Rubric ingest (join by ID, string/object rubrics, static set) and rubric generation against a real
OpenAI-compatible HTTP server on 127.0.0.1: cached per row, timeouts and junk quarantined, never a crash."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from refiner_core.data.rows import RawRow
from refiner_core.data.sources import load_rows
from refiner_core.rubrics.generate import GenerationSettings, RubricGenerationError, generate_rubrics
from refiner_core.rubrics.join import join_rubrics
from refiner_core.stage_settings import input_fields

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "data" / "refiner" / "samples.jsonl"


class FakeOpenAI(BaseHTTPRequestHandler):
    """A deterministic chat-completions endpoint. The question decides the behaviour: TIMEOUT sleeps past the
    client's timeout, JUNK answers prose, BADSHAPE answers JSON of the wrong shape, ESCAPES a rubric holding a
    terminal escape, HUGEINT an integer past Python's digit limit, HEAVY a weight of 1e308, HTTP500 fails."""

    requests: list[dict] = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        user = body["messages"][-1]["content"]
        question = user.split("Question:\n", 1)[1].split("\n", 1)[0]
        if "TIMEOUT" in question:
            time.sleep(1.5)
        if "HTTP500" in question:
            self.send_response(500)
            self.end_headers()
            return
        if "JUNK" in question:
            content = "Sure! A good answer would be accurate and concise."
        elif "BADSHAPE" in question:
            content = json.dumps({"positive_rubrics": "be accurate"})
        elif "HUGEINT" in question:  # a number past Python's int digit limit: ValueError, not JSONDecodeError
            content = '{"positive_rubrics": [' + "9" * 5000 + '], "negative_rubrics": []}'
        elif "HEAVY" in question:  # a weight whose sum over two rubrics overflows to inf
            content = json.dumps({"positive_rubrics": [{"description": "a", "weight": 1e308}], "negative_rubrics": []})
        elif "ESCAPES" in question:  # a rubric that would clear the screen of whoever prints it
            content = json.dumps({"positive_rubrics": ["Accurate.\x1b[2J"], "negative_rubrics": []})
        else:
            content = (
                "```json\n"
                + json.dumps(
                    {
                        "positive_rubrics": [{"title": "Answers", "description": f"Answers: {question}", "weight": 2}],
                        "negative_rubrics": ["Cites a snippet that does not support the claim."],
                    }
                )
                + "\n```"
            )
        payload = json.dumps(
            {
                "id": "x",
                "object": "chat.completion",
                "model": body["model"],
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
                ],
            }
        ).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (timeout case)

    def log_message(self, *args):
        pass


@pytest.fixture
def endpoint():
    FakeOpenAI.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def settings(endpoint: str, cache: Path, **kw) -> GenerationSettings:
    return GenerationSettings(
        endpoint=endpoint, model="rubric-writer", cache_dir=cache, api_key="sekret", timeout_seconds=0.5, **kw
    )


def test_generated_rubrics_are_parsed_and_cached_per_row(endpoint, tmp_path):
    s = settings(endpoint, tmp_path / "cache")
    rubrics, cached = generate_rubrics("Who discovered penicillin?", "<snippet id=a>...</snippet>", "", s)
    assert not cached
    assert [(r["kind"], r["title"], r["weight"]) for r in rubrics] == [
        ("positive", "Answers", 2.0),
        ("negative", "Cites a snippet that does not support the claim.", 1.0),
    ]
    assert rubrics[0]["description"] == "Answers: Who discovered penicillin?"
    assert len(FakeOpenAI.requests) == 1
    request = FakeOpenAI.requests[0]
    assert request["path"] == "/v1/chat/completions" and request["auth"] == "Bearer sekret"
    assert request["body"]["model"] == "rubric-writer"

    again, cached = generate_rubrics("Who discovered penicillin?", "<snippet id=a>...</snippet>", "", s)
    assert cached and again == rubrics and len(FakeOpenAI.requests) == 1  # a rerun never pays twice
    generate_rubrics("Another question?", "<snippet id=a>...</snippet>", "", s)
    assert len(FakeOpenAI.requests) == 2


@pytest.mark.parametrize(
    "question, reason, cached_after",
    [
        ("TIMEOUT please", "rubric_generation_timeout", False),
        ("HTTP500 please", "rubric_generation_http_error", False),
        ("JUNK please", "rubric_generation_unparseable", True),
        ("BADSHAPE please", "rubric_generation_invalid", True),
        ("ESCAPES please", "rubric_generation_invalid", True),
        ("HUGEINT please", "rubric_generation_unparseable", True),
        ("HEAVY please", "rubric_generation_invalid", True),
    ],
)
def test_failures_become_reasons_not_crashes(endpoint, tmp_path, question, reason, cached_after):
    s = settings(endpoint, tmp_path / "cache")
    for _ in range(2):
        with pytest.raises(RubricGenerationError) as err:
            generate_rubrics(question, "<snippet id=a>x</snippet>", "", s)
        assert err.value.reason == reason
    # Transport failures are retried on the next attempt; a paid-for (junk) answer is not requested again.
    assert len(FakeOpenAI.requests) == (1 if cached_after else 2)


def test_unreachable_endpoint_is_a_reason_too(tmp_path):
    s = settings("http://127.0.0.1:9/v1", tmp_path / "cache")  # port 9 (discard): nothing listens
    with pytest.raises(RubricGenerationError) as err:
        generate_rubrics("q?", "<snippet id=a>x</snippet>", "", s)
    assert err.value.reason == "rubric_generation_http_error"


def _prompt(pid: str) -> dict:
    return {
        "prompt_id": pid,
        "question": f"question {pid}?",
        "tool_output": "<snippet id=a>x</snippet>",
        "reference_answer": "",
    }


def test_separate_rubric_file_is_joined_by_id_with_rejections(tmp_path):
    lines = [
        {"id": "p1", "positive_rubrics": ["Names Fleming."], "negative_rubrics": []},
        {
            "id": "p2",
            "positive_rubrics": [{"description": "Gives 1928.", "weight": 3, "title": "Year"}],
            "negative_rubrics": [{"description": "Says 1930."}],
        },
        {"id": "ghost", "positive_rubrics": ["Orphan."]},
        {"id": "p1", "positive_rubrics": ["Second copy."]},
        {"id": "p3", "positive_rubrics": '["unclosed"'},
    ]
    path = tmp_path / "rubrics.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + "{broken\n")
    static = [
        {
            "rubric_id": "static-x",
            "kind": "positive",
            "source": "static",
            "title": "X",
            "description": "x",
            "weight": 1.0,
        }
    ]
    joined, rejected = join_rubrics(
        [_prompt(p) for p in ("p1", "p2", "p3", "p4")], load_rows(str(path)), static, separate_source=True
    )
    assert sorted(joined) == ["p1", "p2"]
    assert [r["description"] for r in joined["p1"]] == ["Names Fleming.", "x"]
    assert [(r["rubric_id"], r["kind"], r["title"], r["weight"]) for r in joined["p2"][:2]] == [
        ("pos-0", "positive", "Year", 3.0),
        ("neg-0", "negative", "Says 1930.", 1.0),
    ]
    assert {(r.row_ref, r.reason) for r in rejected} == {
        ("line 3", "unknown_prompt_id"),
        ("line 4", "duplicate_id"),
        ("line 5", "invalid_rubrics"),
        ("line 6", "invalid_json"),
        ("id p4", "missing_rubrics"),
    }


def test_rubrics_that_would_crash_ingest_or_make_rewards_nan_are_quarantined(tmp_path):
    """Weights past 1e6 (two of 1e308 summed to inf: every reward of the prompt NaN; 10**400 crashed float()), JSON
    the decoder cannot read (an integer past Python's digit limit, nesting past its recursion limit: a crash, retried
    and cached), a blank title and more rubrics than rubrics.max_per_prompt are the row's rejections."""
    lines = [
        {
            "id": "p1",
            "positive_rubrics": [{"description": "a", "weight": 1e308}, {"description": "b", "weight": 1e308}],
        },
        {"id": "p2", "positive_rubrics": [{"description": "a", "weight": 10**400}]},
        {"id": "p3", "positive_rubrics": "[" + "1" * 5000 + "]"},
        {"id": "p4", "positive_rubrics": "[" * 5000 + "]" * 5000},
        {"id": "p5", "positive_rubrics": [{"description": "a", "title": "   "}]},
        {"id": "p6", "positive_rubrics": [f"Rubric {k}." for k in range(5)]},
        {"id": "p7", "positive_rubrics": [{"description": "a", "weight": 1e6}], "negative_rubrics": ["b", "c"]},
    ]
    path = tmp_path / "rubrics.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    prompts = [_prompt(f"p{k}") for k in range(1, 8)]
    joined, rejected = join_rubrics(prompts, load_rows(str(path)), [], separate_source=True, max_per_prompt=4)
    assert sorted(joined) == ["p7"] and [r["weight"] for r in joined["p7"]] == [1e6, 1.0, 1.0]
    reasons = [(r.row_ref, r.reason) for r in rejected]
    assert reasons == [(f"line {k}", "invalid_rubrics") for k in range(1, 6)] + [("line 6", "too_many_rubrics")]
    assert "(0, 1e+06]" in rejected[0].detail and "unreadable JSON" in rejected[2].detail
    assert "5 instance rubrics, over rubrics.max_per_prompt = 4" in rejected[5].detail


def test_a_prompt_whose_twin_is_rejected_goes_with_it(tmp_path):
    """A Co-rewarding pair is one unit: 'a' alone (its twin without rubrics or ground truth) could never be labelled."""
    path = tmp_path / "rubrics.jsonl"
    lines = [{"id": pid, "positive_rubrics": [f"Rubric of {pid}."]} for pid in ("a", "b", "b-r", "c")]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    twins = {"a": "a-r", "a-r": "a", "b": "b-r", "b-r": "b"}
    prompts = [{**_prompt(p), "twin_id": twins.get(p)} for p in ("a", "a-r", "b", "b-r", "c")]
    joined, rejected = join_rubrics(prompts, load_rows(str(path)), [], separate_source=True)
    assert sorted(joined) == ["b", "b-r", "c"]
    assert [(r.row_ref, r.reason) for r in rejected] == [("id a-r", "missing_rubrics"), ("line 1", "unknown_twin")]
    assert rejected[1].detail == "twin_id 'a-r' was rejected here (missing_rubrics)"


@pytest.mark.parametrize(
    ("text", "detail"),
    [
        ("Names \x1b]0;owned\x07Fleming.", "holds U+001B at offset 6 (a control character)"),
        ("Names\x00 Fleming.", "holds U+0000 at offset 5 (a control character)"),
        ("Names \ud800 Fleming.", "holds U+D800 at offset 6 (a lone UTF-16 surrogate)"),
    ],
)
def test_a_rubric_file_with_control_characters_is_quarantined(tmp_path, text, detail):
    """Rubric files are read as data rows are: a control character or a lone surrogate (JSON's "\\ud800") in a
    rubric's description or title quarantines the row, as in the data's own rubric fields, rather than reaching the
    judge's prompt and every terminal that prints it."""
    lines = [
        {"id": "p1", "positive_rubrics": [text]},
        {"id": "p2", "negative_rubrics": [{"description": "Wrong year.", "title": text}]},
        {"id": "p3", "positive_rubrics": ["Tab\tand newline\nare text."]},
    ]
    path = tmp_path / "rubrics.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    joined, rejected = join_rubrics([_prompt(p) for p in ("p1", "p2", "p3")], load_rows(str(path)), [], True)
    assert sorted(joined) == ["p3"]
    assert [(r.row_ref, r.reason, r.detail) for r in rejected] == [
        ("line 1", "invalid_rubrics", f"positive rubric 0: 'description' {detail}"),
        ("line 2", "invalid_rubrics", f"negative rubric 0: 'title' {detail}"),
    ]


def test_generation_fills_only_rows_without_rubrics(endpoint, tmp_path):
    s = settings(endpoint, tmp_path / "cache")
    rows = [
        RawRow("line 1", "{}", {"id": "p1", "positive_rubrics": ["Has one."]}),
        RawRow("line 2", "{}", {"id": "p2"}),
        RawRow("line 3", "{}", {"id": "p3"}),
    ]
    prompts = [_prompt("p1"), _prompt("p2"), {**_prompt("p3"), "question": "JUNK?"}]

    def generate(prompt):
        return generate_rubrics(prompt["question"], prompt["tool_output"], prompt["reference_answer"], s)[0]

    joined, rejected = join_rubrics(prompts, rows, [], separate_source=False, generate=generate)
    assert [r["description"] for r in joined["p1"]] == ["Has one."]
    assert joined["p2"][0]["description"] == "Answers: question p2?"
    assert [(r.row_ref, r.reason) for r in rejected] == [("line 3", "rubric_generation_unparseable")]
    assert len(FakeOpenAI.requests) == 2  # p1 already had rubrics: no call


def test_ingest_stage_generates_quarantines_and_never_pays_twice(
    prefect_server, tiny_model_path, endpoint, tmp_path, monkeypatch
):
    from prefect import flow

    from refiner_core.config import RecipeConfig
    from refiner_core.store.storage import read_rows
    from tasks.prepare import prepare_data
    from tasks.rubrics import ingest_rubrics

    rows = [json.loads(line) for line in SAMPLES.read_text().splitlines()[:5]]
    for r in rows[1:4]:
        del r["positive_rubrics"], r["negative_rubrics"]
    rows[2]["question"] = "JUNK " + rows[2]["question"]
    rows[3]["question"] = "TIMEOUT " + rows[3]["question"]
    data_file = tmp_path / "rows.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("RUBRIC_KEY", "sekret")
    conf = dataclasses.asdict(RecipeConfig())
    conf["data"]["max_prompt_tokens"] = 2000
    conf["rubrics"].update(
        generation_endpoint=endpoint,
        generation_model="rubric-writer",
        generation_api_key_env="RUBRIC_KEY",
        generation_timeout_seconds=0.5,
        generation_cache=str(tmp_path / "cache"),
        max_rejected_fraction=0.5,
    )
    policy = {"path": str(tiny_model_path), "hash": "tiny"}

    @flow
    def ingest(run_dir: str, rubric_cfg: dict):
        prompts = prepare_data.with_options(retries=0)(
            run_dir=run_dir, run="g", data_file=str(data_file), data=conf["data"], seed=0, policy=policy
        )
        return prompts, ingest_rubrics.with_options(retries=0)(
            run_dir=run_dir,
            run="g",
            data_file=str(data_file),
            data={f.name: conf["data"][f.name] for f in input_fields("source")},  # as the flow passes them
            rubric_file="",
            rubric_cfg=rubric_cfg,
            static_rubrics_file=str(REPO / conf["rubrics"]["static_rubrics"]),
            prompts=prompts,
        )

    prompts, manifest = ingest(str(tmp_path / "a"), conf["rubrics"])
    by_prompt: dict[str, list[dict]] = {}
    for r in read_rows(manifest["rubrics"]["path"]):
        by_prompt.setdefault(r["prompt_id"], []).append(r)
    ids = [r["id"] for r in rows]
    assert sorted(by_prompt) == sorted([ids[0], ids[1], ids[4]])
    assert by_prompt[ids[1]][0]["description"].startswith("Answers: ")  # generated
    assert sum(r["source"] == "static" for r in by_prompt[ids[0]]) == 3  # the static set, on by default
    quarantine = {r["row_ref"]: (r["stage"], r["reason"]) for r in read_rows(manifest["quarantine"]["path"])}
    assert quarantine == {
        "line 3": ("rubrics", "rubric_generation_unparseable"),
        "line 4": ("rubrics", "rubric_generation_timeout"),
    }
    assert set(manifest["train_ids"]) == {ids[0], ids[1], ids[4]} & set(prompts["train_ids"])
    assert manifest["generated"] == {"calls": 2, "cached": 0, "failed_calls": 1}  # the timeout was not an answer
    assert all(r["auth"] == "Bearer sekret" for r in FakeOpenAI.requests)
    paid = len(FakeOpenAI.requests)

    # Another run over the same rows, static set off: only the timed-out row is asked again.
    again = {**conf["rubrics"], "instance_rubrics_only": True}
    _, manifest = ingest(str(tmp_path / "b"), again)
    assert manifest["generated"] == {"calls": 0, "cached": 2, "failed_calls": 1}
    assert len(FakeOpenAI.requests) == paid + 1
    assert not any(r["source"] == "static" for r in read_rows(manifest["rubrics"]["path"]))
