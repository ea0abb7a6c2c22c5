"""The `refiner` CLI: exit codes, read-only SQL, config errors."""

from __future__ import annotations

import json

import duckdb
import pytest
from typer.testing import CliRunner

from flows.cli import app
from refiner_core.schema import ALL_TABLES
from refiner_core.storage import build_catalog, write_table

runner = CliRunner()


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
