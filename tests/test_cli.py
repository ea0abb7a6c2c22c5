"""The `refiner` CLI: exit codes, read-only SQL, config errors."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pytest
import yaml
from typer.testing import CliRunner

from conftest import run_cli
from flows.cli import app
from refiner_core.schema import ALL_TABLES
from refiner_core.storage import build_catalog, write_table

runner = CliRunner()
REPO = Path(__file__).parents[1]


@pytest.fixture
def catalog_dir(tmp_path):
    steps = [{c: None for c in ALL_TABLES["steps"].column_names} | {"run": "r", "step": s, "reward_mean": 0.5 * s,
              "reward_std": 0.1, "kl": 0.01, "loss": 0.2, "response_length_mean": 10.0} for s in range(3)]
    path = tmp_path / "steps.parquet"
    write_table(ALL_TABLES["steps"], steps, path)
    build_catalog(tmp_path / "catalog.duckdb", {"steps": [path]})
    return tmp_path


def test_sql_prints_table_and_json(catalog_dir):
    result = runner.invoke(app, ["sql", str(catalog_dir), "SELECT step, reward_mean FROM steps ORDER BY step"])
    assert result.exit_code == 0, result.output
    assert "reward_mean" in result.output and "(3 rows)" in result.output
    result = runner.invoke(app, ["sql", str(catalog_dir), "SELECT step FROM steps ORDER BY step", "--format", "json"])
    assert json.loads(result.stdout) == [{"step": 0}, {"step": 1}, {"step": 2}]


def test_sql_is_read_only(catalog_dir):
    result = runner.invoke(app, ["sql", str(catalog_dir), "DELETE FROM steps"])
    assert result.exit_code == 1
    assert "read-only" in result.output.lower()
    con = duckdb.connect(str(catalog_dir / "catalog.duckdb"), read_only=True)
    assert con.execute("SELECT count(*) FROM steps").fetchone()[0] == 3
    outside = catalog_dir / "exported.csv"
    for sql in (f"COPY steps TO '{outside}'", f"SELECT * FROM read_csv('{catalog_dir / 'steps.parquet'}')",
                f"ATTACH '{catalog_dir / 'other.duckdb'}' AS other"):
        result = runner.invoke(app, ["sql", str(catalog_dir), sql])
        assert result.exit_code == 1, sql
    assert not outside.exists() and not (catalog_dir / "other.duckdb").exists()


def test_sql_errors_have_exit_codes(catalog_dir, tmp_path):
    assert runner.invoke(app, ["sql", str(catalog_dir), "SELECT * FROM nope"]).exit_code == 1
    assert runner.invoke(app, ["sql", str(tmp_path / "missing"), "SELECT 1"]).exit_code == 2


def test_every_table_exists_even_when_empty(catalog_dir):
    result = runner.invoke(app, ["sql", str(catalog_dir), "SELECT count(*) AS n FROM quarantine", "-f", "csv"])
    assert result.exit_code == 0 and result.stdout.splitlines() == ["n", "0"]


def test_run_rejects_bad_config_before_doing_work(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("grpo:\n  lr: 1\n")
    result = runner.invoke(app, ["run", str(recipe), "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 2
    assert "unknown field 'grpo.lr'" in result.output
    assert not (tmp_path / "run").exists()


def test_plot_writes_png(catalog_dir):
    result = runner.invoke(app, ["plot", str(catalog_dir)])
    assert result.exit_code == 0, result.output
    png = catalog_dir / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_config_fields_lists_help():
    result = runner.invoke(app, ["config", "--fields"])
    assert result.exit_code == 0
    assert "grpo.kl_estimator = 'k3'" in result.output


@pytest.mark.parametrize("overrides,message", [
    (["data.fields={questoin: query}"], "data.fields: 'questoin' is not a field name (did you mean 'question'?)"),
    (["data.fields={question: qery}"], "data.fields: question -> 'qery': no such column in data/refiner/samples.jsonl; "
                                       "its columns: id, question, reasoning"),
    (["data.path=data/none.parquet"], "data.path: data/none.parquet (resolved to "),
    (["grpo.steps=0"], "grpo.steps = 0: must be at least 1"),
    (["model.policy=my-model"], "model.policy: 'my-model' is not 'tiny-qwen3' or 'smollm2-135m-instruct'"),
])
def test_config_mistakes_are_reported_before_prefect_starts(tmp_path, overrides, message):
    run_dir = tmp_path / "run"
    args = ["run", str(REPO / "recipes" / "tiny.yaml"), "--run-dir", str(run_dir)]
    code, out, err, seconds = run_cli(args + [a for o in overrides for a in ("--set", o)], tmp_path)
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 2 and lines[0] == f"error: {REPO / 'recipes' / 'tiny.yaml'}: 1 problem, nothing was run:"
    assert lines[1].startswith("  " + message)
    assert "prefect" not in (out + err).lower() and out == ""
    assert not run_dir.exists() and not (tmp_path / "prefect-home").exists()
    assert seconds < 20


def test_failed_run_prints_its_cause_once_and_logs_the_traceback(tmp_path):
    """A stage that fails: a few lines on the terminal, the traceback in RUN_DIR/logs. The run is named after its
    folder (<run_root>/<recipe stem> without --run-dir) and keeps its Prefect database in RUN_DIR/.prefect."""
    recipe = yaml.safe_load((REPO / "recipes" / "tiny.yaml").read_text())
    recipe["run"] = {"name": "", "run_root": str(tmp_path / "runs"), "retries": 0}
    recipe["grpo"]["steps"] = 1
    path = tmp_path / "my-run.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code, out, err, _ = run_cli(["run", str(path)], tmp_path, env={"REFINER_FAIL_ONCE": "judge@0"})
    assert code == 1, err[-3000:]
    run_dir = tmp_path / "runs" / "my-run"
    assert "Flow run 'my-run: steps 0-0'" in err
    lines = err.splitlines()
    last_progress = max(i for i, line in enumerate(lines) if "Task run 'rollout[step=0]' - Finished" in line)
    failure = [line for line in lines[last_progress + 1:] if "temporary server" not in line]
    assert len(failure) <= 4, failure
    assert failure[0] == ("error: run failed in judge[step=0]: RuntimeError: injected fault in stage 'judge' (step 0) "
                          "from REFINER_FAIL_ONCE")
    assert "Traceback" not in err and err.count("injected fault") == 1
    [log] = (run_dir / "logs").glob("run-*.log")
    assert str(log) in err
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "Task run 'prepare-data' - Finished" in text
    assert (run_dir / ".prefect" / "prefect.db").exists() and not (tmp_path / "prefect-home").exists()
    assert out == ""
