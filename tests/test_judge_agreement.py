"""`refiner judge agreement` on a constructed run whose kappa is known by hand: a real catalog, and a real judge
over the OpenAI API on loopback that re-judges the stored rollouts; labels files; the CLI's table and errors."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import duckdb
import pytest
import yaml
from typer.testing import CliRunner

from conftest import REPO
from fault_server import LoopbackServer
from flows.cli import app
from refiner_core.config import load_recipe
from refiner_core.publish.catalog import build_catalog
from refiner_core.publish.judge_agreement import AgreementError, check_judge, read_labels
from refiner_core.schema import ALL_TABLES
from refiner_core.store.storage import write_table

runner = CliRunner()
VERDICTS = [2, 2, 0, 1]  # what the loopback judge answers for rollouts 0-3: oriented 1, 1, 0, 0.5 -> T, T, F, T
STORED = [[0.9, 0.8, 0.2], [0.7, 0.6, 0.6], [0.1, 0.6, 0.3], [0.4, 0.5, 0.9]]  # the run's judge, rubric by rubric
RUBRICS = [  # (rubric_id, kind, source, title)
    ("static-citation-discipline", "positive", "static", "Citation Discipline"),
    ("pos-0", "positive", "instance", "Names Canberra."),
    ("neg-0", "negative", "instance", "Names Sydney."),
]


class VerdictJudge(LoopbackServer):
    """An OpenAI-compatible judge on loopback: reads 'verdict N' from the response it is shown and answers N for a
    positive criterion, 2 - N for a negative one (so every rubric of a rollout gets the oriented score N / 2)."""

    def __init__(self, junk: bool = False):
        self.requests = 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, obj: dict) -> None:
                body = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802
                self._send({"object": "list", "data": [{"id": "verdict-judge", "object": "model"}]})

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.requests += 1
                text = body["messages"][-1]["content"]
                verdict = int(re.search(r"verdict (\d)", text).group(1))
                score = 2 - verdict if "Must not name Sydney" in text else verdict
                content = "I think it is fine." if outer.junk else json.dumps({"score": score})
                message = {"role": "assistant", "content": content}
                self._send(
                    {
                        "object": "chat.completion",
                        "model": "verdict-judge",
                        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    }
                )

        self.junk = junk  # answer without a score: every judgment fails
        self.listen(Handler)


def _table(name: str, rows: list[dict], folder: Path) -> Path:
    table = ALL_TABLES[name]
    path = folder / f"{name}.parquet"
    write_table(table, [{c: None for c in table.column_names} | r for r in rows], path)
    return path


@pytest.fixture
def judged_run(tmp_path):
    return _judged_run(tmp_path / "run", STORED)


def _judged_run(run_dir: Path, stored: list[list[float | None]]) -> Path:
    (run_dir / "src").mkdir(parents=True)
    recipe = load_recipe(REPO / "recipes" / "tiny.yaml").to_dict()
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    key = {"run": "run", "step": 0, "prompt_id": "q1"}
    files = {
        "prompts": _table(
            "prompts",
            [
                {
                    "run": "run",
                    "prompt_id": "q1",
                    "split": "train",
                    "question": "Capital of Australia?",
                    "snippet_ids": ["S1"],
                    "tool_output": "<snippet id=S1>Canberra</snippet>",
                }
            ],
            run_dir / "src",
        ),
        "rubrics": _table(
            "rubrics",
            [
                {
                    "run": "run",
                    "prompt_id": "q1",
                    "rubric_id": rid,
                    "kind": kind,
                    "source": source,
                    "title": title,
                    "description": "Must not name Sydney." if kind == "negative" else title,
                    "weight": 1.0,
                }
                for rid, kind, source, title in RUBRICS
            ],
            run_dir / "src",
        ),
        "rollouts": _table(
            "rollouts",
            [
                {
                    **key,
                    "sample_idx": i,
                    "response_text": f"<answer>verdict {v}</answer>",
                    "response_tokens": 5,
                    "finish_reason": "stop",
                }
                for i, v in enumerate(VERDICTS)
            ],
            run_dir / "src",
        ),
        "reward_inputs": _table(
            "reward_inputs", [{**key, "sample_idx": i, "max_new_tokens": 32} for i in range(4)], run_dir / "src"
        ),
        "judge_scores": _table(
            "judge_scores",
            [
                {**key, "sample_idx": i, "rubric_id": rid, "kind": kind, "oriented_score": stored[i][j]}
                for i in range(4)
                for j, (rid, kind, _, _) in enumerate(RUBRICS)
            ],
            run_dir / "src",
        ),
    }
    build_catalog(run_dir / "catalog.duckdb", {name: [path] for name, path in files.items()})
    return run_dir


def test_agreement_with_another_judge_on_a_case_with_known_kappa(judged_run, tmp_path):
    with VerdictJudge() as server:
        config = tmp_path / "judge.yaml"
        config.write_text(
            yaml.safe_dump(
                {"judge": {"engine": "openai", "mode": "json", "openai": {"base_url": server.base_url, "cache": False}}}
            )
        )
        check = check_judge(judged_run, judge_config=config, sample=10, seed=0, name="loopback")
        assert server.requests == 12  # every rubric of the 4 rollouts, once
    rows = {a["rubric_group"]: a for a in check.agreement}
    everything = rows["all"]
    # 12 pairs: both pass 7, only the run's judge 1, only the other 2, neither 2 (threshold 0.5).
    # p_o = 9/12, p_e = (8 * 9 + 4 * 3) / 144 = 84/144, kappa = (108 - 84) / (144 - 84) = 0.4
    assert (everything["pairs"], everything["failed"]) == (12, 0)
    assert everything["kappa"] == pytest.approx(0.4, abs=1e-12)
    assert (everything["pass_rate"], everything["other_pass_rate"]) == (8 / 12, 9 / 12)
    # Citation Discipline alone: run T, T, F, F against T, T, F, T: p_o = 3/4, p_e = 1/2 -> kappa 0.5; the one
    # failed pair (0.1) scores below every passed one (0.9, 0.7, 0.4): separation 1
    static = rows["Citation Discipline"]
    assert static["kappa"] == pytest.approx(0.5, abs=1e-12) and static["separation_auc"] == 1.0
    assert static["score_std"] == pytest.approx(float(__import__("numpy").std([0.9, 0.7, 0.1, 0.4])), abs=1e-15)
    assert set(rows) == {"all", "Citation Discipline", "instance positive", "instance negative"}
    con = duckdb.connect(str(judged_run / "catalog.duckdb"), read_only=True)
    assert con.execute(
        "SELECT count(*), count(other_score) FROM judge_checks WHERE check_name = 'loopback'"
    ).fetchone() == (12, 12)
    assert con.execute("SELECT kappa FROM judge_agreement WHERE rubric_group = 'all'").fetchone()[0] == pytest.approx(
        0.4
    )
    con.close()


def test_labels_file_and_its_errors(judged_run, tmp_path):
    labels = tmp_path / "labels.csv"  # a person passes rollouts 0 and 1 on every rubric, fails 2 and 3
    labels.write_text(
        "step,prompt_id,sample_idx,rubric_id,passed\n"
        + "".join(f"0,q1,{i},{rid},{i < 2}\n" for i in range(4) for rid, *_ in RUBRICS)
    )
    result = runner.invoke(app, ["judge", "agreement", str(judged_run), "--labels", str(labels), "--json"])
    assert result.exit_code == 0, result.output
    everything = {a["rubric_group"]: a for a in json.loads(result.stdout)}["all"]
    # the run's verdicts: rollouts 0, 1: T T F, T T T (5 of the 6 labelled pass); rollouts 2, 3: F T F, F T T (3)
    # both pass 5, run only 3, label only 1, neither 3: p_o = 8/12, p_e = (8 * 6 + 4 * 6) / 144 = 1/2 -> kappa 1/3
    assert everything["kappa"] == pytest.approx(1 / 3, abs=1e-12)
    shown = runner.invoke(app, ["judge", "agreement", str(judged_run), "--labels", str(labels)])
    assert "check labels-labels: 12 of 12 (rollout, rubric) pairs of 4 rollouts judged by both (0 got no score" in (
        shown.output
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"step": 3, "prompt_id": "q1", "sample_idx": 0, "rubric_id": "pos-0", "score": 1}) + "\n")
    with pytest.raises(AgreementError, match="1 labels name no stored judgment"):
        check_judge(judged_run, labels=bad)
    bad.write_text(json.dumps({"step": 0, "prompt_id": "q1"}) + "\n")
    assert runner.invoke(app, ["judge", "agreement", str(judged_run), "--labels", str(bad)]).exit_code == 2
    assert runner.invoke(app, ["judge", "agreement", str(judged_run)]).exit_code == 2  # neither option
    empty = tmp_path / "empty.csv"
    empty.write_text("step,prompt_id,sample_idx,rubric_id,passed\n")  # what an export of no judgment gives
    with pytest.raises(AgreementError, match="the file holds no label"):
        check_judge(judged_run, labels=empty)
    with pytest.raises(AgreementError, match="--name '../escape': use 1-100 letters"):  # a folder of the run's
        check_judge(judged_run, labels=labels, name="../escape")
    spaced = tmp_path / "my labels (v2).csv"
    spaced.write_text(labels.read_text())
    assert check_judge(judged_run, labels=spaced).name == "labels-my-labels-v2"


@pytest.mark.parametrize(
    ("passed", "why"),
    [("", "passed '' is no verdict"), ("n/a", "passed 'n/a' is no verdict"), (None, "passed None is no verdict")],
)
def test_a_label_without_a_verdict_is_refused_not_read_as_a_fail(tmp_path, passed, why):
    """A blank cell, null or an unknown word was read as passed = false: a label not yet given counted as a fail."""
    record = {"step": 0, "prompt_id": "q1", "sample_idx": 0, "rubric_id": "pos-0", "passed": passed}
    jsonl = tmp_path / "labels.jsonl"
    jsonl.write_text(json.dumps({**record, "passed": True}) + "\n" + json.dumps({**record, "sample_idx": 1}) + "\n")
    with pytest.raises(AgreementError, match=f"record 2: .*{re.escape(why)}"):
        read_labels(jsonl)
    if passed is not None:
        csv_file = tmp_path / "labels.csv"
        csv_file.write_text(f"step,prompt_id,sample_idx,rubric_id,passed\n0,q1,0,pos-0,{passed}\n")
        with pytest.raises(AgreementError, match=f"record 1: .*{re.escape(why)}"):
            read_labels(csv_file)


def test_labels_read_common_spellings_a_byte_order_mark_and_refuse_a_second_label(tmp_path):
    words = ["pass", "FAIL", "y", "n", "t", "f", "Yes", "0", "1", "passed"]
    labels = tmp_path / "labels.csv"
    rows = "".join(f"0,q1,{i},pos-0,{w}\n" for i, w in enumerate(words))
    labels.write_bytes("\ufeffstep,prompt_id,sample_idx,rubric_id,passed\n".encode() + rows.encode())  # Excel's CSV
    assert [read_labels(labels)[(0, "q1", i, "pos-0")][0] for i in range(len(words))] == [
        1.0,
        0.0,
        1.0,
        0.0,
        1.0,
        0.0,
        1.0,
        0.0,
        1.0,
        1.0,
    ]
    labels.write_text("step,prompt_id,sample_idx,rubric_id,score\n0,q1,0,pos-0,1\n0,q1,1,pos-0,0\n0,q1,0,pos-0,0\n")
    with pytest.raises(AgreementError, match=r"record 3: labels the same judgment as record 1"):
        read_labels(labels)


def test_a_labels_verdict_stands_whatever_the_pass_threshold(judged_run, tmp_path):
    """eval.pass_rubric_score 0: every score passes, so a label's 'passed = false' (read as score 0.0) became a
    pass; the person failed rollouts 2 and 3 and the check said they passed all."""
    recipe = yaml.safe_load((judged_run / "recipe.yaml").read_text())
    recipe["eval"]["pass_rubric_score"] = 0.0
    (judged_run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    labels = tmp_path / "labels.csv"
    labels.write_text(
        "step,prompt_id,sample_idx,rubric_id,passed\n"
        + "".join(f"0,q1,{i},{rid},{i < 2}\n" for i in range(4) for rid, *_ in RUBRICS)
    )
    everything = {a["rubric_group"]: a for a in check_judge(judged_run, labels=labels).agreement}["all"]
    assert (everything["pass_rate"], everything["other_pass_rate"]) == (1.0, 0.5)
    assert everything["kappa"] == 0.0  # p_o = 1/2 = p_e: the run's judge passes everything


def test_pairs_the_runs_own_judge_failed_are_counted(tmp_path):
    """Stored judgments the run's judge failed (NULL) have no pair; the headline said only the other side's."""
    stored = [[0.9, None, 0.2], [0.7, 0.6, 0.6], [None, 0.6, 0.3], [0.4, 0.5, 0.9]]
    run = _judged_run(tmp_path / "run", stored)
    labels = tmp_path / "labels.csv"
    labels.write_text(
        "step,prompt_id,sample_idx,rubric_id,passed\n"
        + "".join(f"0,q1,{i},{rid},{i < 2}\n" for i in range(4) for rid, *_ in RUBRICS)
    )
    shown = runner.invoke(app, ["judge", "agreement", str(run), "--labels", str(labels)])
    assert shown.exit_code == 0, shown.output
    assert "10 of 12 (rollout, rubric) pairs of 4 rollouts judged by both (0 got no score from labels" in shown.output
    assert "2 none from the run's judge" in shown.output


def test_a_judge_that_scores_nothing_is_no_agreement(judged_run, tmp_path):
    """Every re-judgment unparseable: the headline counts no usable pair and the failures, and the exit is 1."""
    with VerdictJudge(junk=True) as server:
        config = tmp_path / "judge.yaml"
        config.write_text(
            yaml.safe_dump(
                {"judge": {"engine": "openai", "mode": "json", "openai": {"base_url": server.base_url, "cache": False}}}
            )
        )
        shown = runner.invoke(app, ["judge", "agreement", str(judged_run), "--judge-config", str(config)])
    assert shown.exit_code == 1, shown.output
    assert "0 of 12 (rollout, rubric) pairs of 4 rollouts judged by both (12 got no score from" in shown.output
    assert "nothing was compared: of 12 pairs, 12 got no score from judge openai" in shown.output


def test_a_labels_verdict_stands_beside_its_score(judged_run, tmp_path):
    """A label with both `passed` and `score`: its verdict was dropped and the score decided (0.6 >= 0.5: a pass),
    so rollouts 2 and 3, failed by the person, counted as passes. The verdict stands; the score is still paired."""
    labels = tmp_path / "labels.jsonl"
    records = [
        {
            "step": 0,
            "prompt_id": "q1",
            "sample_idx": i,
            "rubric_id": rid,
            "passed": i < 2,
            "score": 1.0 if i < 2 else 0.6,
        }
        for i in range(4)
        for rid, *_ in RUBRICS
    ]
    labels.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert read_labels(labels)[(0, "q1", 2, "pos-0")] == (0.6, None, False)
    mixed = tmp_path / "mixed.csv"  # a blank verdict beside a score: the score passes at the threshold
    mixed.write_text("step,prompt_id,sample_idx,rubric_id,passed,score\n0,q1,0,pos-0,,0.7\n0,q1,1,pos-0,no,0.7\n")
    assert read_labels(mixed) == {(0, "q1", 0, "pos-0"): (0.7, None, None), (0, "q1", 1, "pos-0"): (0.7, None, False)}
    check = check_judge(judged_run, labels=labels)
    everything = {a["rubric_group"]: a for a in check.agreement}["all"]
    # as test_labels_file_and_its_errors' verdicts: kappa 1/3, the person passes 6 of 12
    assert everything["other_pass_rate"] == 0.5
    assert everything["kappa"] == pytest.approx(1 / 3, abs=1e-12)
    con = duckdb.connect(str(judged_run / "catalog.duckdb"), read_only=True)
    assert con.execute(
        "SELECT DISTINCT other_score, other_passed FROM judge_checks WHERE sample_idx >= 2"
    ).fetchall() == [(0.6, False)]
    con.close()


def test_a_judge_that_scores_nothing_exits_1_with_json_too(judged_run, tmp_path):
    """--json printed the rows and exited 0 where the table exits 1: a script saw a check that compared nothing."""
    with VerdictJudge(junk=True) as server:
        config = tmp_path / "judge.yaml"
        config.write_text(
            yaml.safe_dump(
                {"judge": {"engine": "openai", "mode": "json", "openai": {"base_url": server.base_url, "cache": False}}}
            )
        )
        shown = runner.invoke(app, ["judge", "agreement", str(judged_run), "--judge-config", str(config), "--json"])
    assert shown.exit_code == 1, shown.output
    everything = {a["rubric_group"]: a for a in json.loads(shown.stdout)}["all"]
    assert (everything["pairs"], everything["failed"]) == (0, 12)
    assert "nothing was compared: of 12 pairs, 12 got no score from judge openai" in shown.stderr


def test_a_run_folder_without_its_recipe_is_a_usage_error(judged_run, tmp_path):
    """A folder with a catalog but no recipe.yaml raised FileNotFoundError: a traceback and exit 1, which means
    'no pair scored'."""
    (judged_run / "recipe.yaml").unlink()
    labels = tmp_path / "labels.csv"
    labels.write_text("step,prompt_id,sample_idx,rubric_id,passed\n0,q1,0,pos-0,yes\n")
    with pytest.raises(AgreementError, match=r"run has no recipe.yaml: not a run folder"):
        check_judge(judged_run, labels=labels)
    shown = runner.invoke(app, ["judge", "agreement", str(judged_run), "--labels", str(labels)])
    assert shown.exit_code == 2 and "recipe.yaml" in shown.output, shown.output


LABEL_HEADER = "step,prompt_id,sample_idx,rubric_id,passed\n"


def _label(**given) -> str:
    return json.dumps({"step": 0, "prompt_id": "q1", "sample_idx": 0, "rubric_id": "pos-0", "passed": True} | given)


@pytest.mark.parametrize(
    ("name", "content", "why"),
    [
        ("excel.csv", (LABEL_HEADER + "0,q1,0,pos-0,oui\u00e9\n").encode("cp1252"), "not UTF-8"),
        # a quote never closed: every later row went into one cell, without a word
        ("quote.csv", (LABEL_HEADER + '0,q1,0,pos-0,"yes\n0,q1,1,pos-0,no\n').encode(), "unexpected end of data"),
        ("wide.csv", (LABEL_HEADER + "0,q1,0,pos-0," + "y" * 200_000 + "\n").encode(), "field larger than"),
        ("fraction.jsonl", _label(step=0.7).encode(), "step 0.7 is not a whole number"),
        ("boolean.jsonl", _label(passed=None, score=True).encode(), "score True is not a number"),
        ("tabs.CSV", b"step\tprompt_id\n0\tq1\n", "needs step, prompt_id"),  # read as CSV whatever the suffix's case
    ],
)
def test_a_labels_file_that_cannot_be_read_whole_is_a_usage_error(judged_run, tmp_path, name, content, why):
    """Each of these was a traceback (exit 1, which means 'nothing compared'), a silently shorter file, or a value
    rounded down (step 0.7 read as step 0)."""
    labels = tmp_path / name
    labels.write_bytes(content)
    shown = runner.invoke(app, ["judge", "agreement", str(judged_run), "--labels", str(labels)])
    assert shown.exit_code == 2 and why in shown.output, shown.output


def test_whole_numbers_written_with_a_decimal_point_are_read(tmp_path):
    """A spreadsheet exports an integer column holding blanks as 1.0, 2.0: read as 1, 2 in CSV as in JSON."""
    labels = tmp_path / "labels.csv"
    labels.write_text(LABEL_HEADER + "1.0,q1,3.0,pos-0,yes\n")
    assert read_labels(labels) == {(1, "q1", 3, "pos-0"): (1.0, None, True)}
    labels.write_text(LABEL_HEADER + "1.5,q1,3,pos-0,yes\n")
    with pytest.raises(AgreementError, match="step '1.5' is not a whole number"):
        read_labels(labels)


def test_tsv_labels_and_a_suffix_in_capitals_are_read(tmp_path):
    for name, sep in (("labels.TSV", "\t"), ("labels.Csv", ",")):
        labels = tmp_path / name
        labels.write_text(
            sep.join(["step", "prompt_id", "sample_idx", "rubric_id", "passed"])
            + "\n"
            + sep.join(["0", "q1", "3", "pos-0", "no"])
            + "\n"
        )
        assert read_labels(labels) == {(0, "q1", 3, "pos-0"): (0.0, None, False)}


@pytest.mark.parametrize(
    ("judge", "why"),
    [
        ({"engine": "openai", "mode": "json", "openai": {"base_url": "http://127.0.0.1:9/v1"}}, "did not list its"),
        ({"engine": "transformers", "model": "/no/such/model"}, "no HF checkpoint (config.json) at /no/such/model"),
    ],
)
def test_a_judge_that_cannot_be_reached_or_loaded_is_a_usage_error(judged_run, tmp_path, judge, why):
    """A refused server (no api_model given, so the judge asks it for its models) and a missing model folder were
    tracebacks with exit 1."""
    config = tmp_path / "judge.yaml"
    config.write_text(yaml.safe_dump({"judge": judge}))
    shown = runner.invoke(app, ["judge", "agreement", str(judged_run), "--judge-config", str(config)])
    assert shown.exit_code == 2 and why in shown.output, shown.output
    config.write_bytes(b"judge:\n  model: caf\xe9\n")  # Latin-1, not UTF-8
    shown = runner.invoke(app, ["judge", "agreement", str(judged_run), "--judge-config", str(config)])
    assert shown.exit_code == 2 and "can't decode byte 0xe9" in shown.output, shown.output


def test_a_catalog_that_is_no_duckdb_file_is_a_usage_error(judged_run, tmp_path):
    (judged_run / "catalog.duckdb").write_bytes(b"not a database")
    labels = tmp_path / "labels.csv"
    labels.write_text(LABEL_HEADER + "0,q1,0,pos-0,yes\n")
    shown = runner.invoke(app, ["judge", "agreement", str(judged_run), "--labels", str(labels)])
    assert shown.exit_code == 2 and "not a valid DuckDB database file" in shown.output, shown.output


def test_nothing_compared_says_which_side_scored_nothing(tmp_path):
    """Labels for judgments the run's own judge failed: the error blamed the labels ('no pair got a score from
    labels'), whose every record was read."""
    run = _judged_run(tmp_path / "run", [[None] * 3, [None] * 3, [0.1, 0.6, 0.3], [0.4, 0.5, 0.9]])
    labels = tmp_path / "labels.csv"
    labels.write_text(LABEL_HEADER + "".join(f"0,q1,{i},{rid},yes\n" for i in range(2) for rid, *_ in RUBRICS))
    shown = runner.invoke(app, ["judge", "agreement", str(run), "--labels", str(labels)])
    assert shown.exit_code == 1
    assert "nothing was compared: of 6 pairs, 0 got no score from labels" in shown.stderr
    assert "6 none from the run's own judge" in shown.stderr


def test_a_sampled_rollout_that_cannot_be_rejudged_counts_as_failed(tmp_path):
    """Rollouts without their reward_inputs row were left out of the re-judging and of every count: the headline
    said '9 of 9 pairs of 4 rollouts', its stored judgments gone without a word."""
    run = _judged_run(tmp_path / "run", STORED)
    with duckdb.connect(str(run / "catalog.duckdb")) as con:
        con.execute("DELETE FROM reward_inputs WHERE sample_idx = 3")
    with VerdictJudge() as server:
        config = tmp_path / "judge.yaml"
        config.write_text(
            yaml.safe_dump(
                {"judge": {"engine": "openai", "mode": "json", "openai": {"base_url": server.base_url, "cache": False}}}
            )
        )
        check = check_judge(run, judge_config=config, sample=4)
    everything = {a["rubric_group"]: a for a in check.agreement}["all"]
    assert (check.pairs, everything["pairs"], everything["failed"]) == (12, 9, 3)
    with duckdb.connect(str(run / "catalog.duckdb"), read_only=True) as con:
        failures = con.execute(
            "SELECT DISTINCT sample_idx, other_failure FROM judge_checks WHERE other_failure IS NOT NULL"
        ).fetchall()
    assert failures == [(3, "not_rejudged: the catalog holds no rollouts / reward_inputs row")]


@pytest.mark.parametrize("args", [["--port", "70000"], ["--port", "-1"], ["--log", "."]])
def test_judge_serve_refuses_a_port_out_of_range_and_a_folder_for_its_log(args):
    shown = runner.invoke(app, ["judge", "serve", "tiny-qwen3", *args])
    assert shown.exit_code == 2, shown.output
