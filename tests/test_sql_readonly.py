"""`refiner sql` over one run or several: every statement that is not a read is refused, and no catalog or other
file changes, whatever the number of runs."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

from flows.cli import app
from refiner_core.publish.catalog import build_catalog
from refiner_core.publish.run_sql import QueryRefused, open_runs, run_query
from refiner_core.schema import ALL_TABLES
from refiner_core.store.storage import write_table

runner = CliRunner()

# Every kind of write, file access, attach/detach and setting change; {a} is the first run folder, {name} its
# name, {out} a folder no statement may create anything in.
REFUSED = [
    "DELETE FROM steps",
    "UPDATE steps SET reward_mean = 0",
    "INSERT INTO steps (run, step) VALUES ('x', 9)",
    "CREATE TABLE t AS SELECT 1 AS x",
    "CREATE TEMP TABLE t AS SELECT 1 AS x",
    "CREATE MACRO m(x) AS x + 1",
    "DROP TABLE steps",
    "ALTER TABLE steps ADD COLUMN x INTEGER",
    "COPY steps TO '{out}/copied.csv'",
    "COPY (SELECT 1) TO '{out}/copied.parquet' (FORMAT parquet)",
    "EXPORT DATABASE '{out}/exported'",
    "SELECT * FROM read_csv('{a}/plain.csv')",
    "SELECT * FROM '{a}/steps.parquet'",
    "SELECT * FROM read_text('{a}/plain.csv')",
    "ATTACH '{out}/other.duckdb' AS other",
    "ATTACH '{a}/catalog.duckdb' AS w",
    # the way to a writable catalog: detach a run, attach it again without READ_ONLY, delete
    "DETACH \"{name}\"; ATTACH '{a}/catalog.duckdb' AS w; DELETE FROM w.main.steps",
    "SELECT 1; DELETE FROM steps",
    "EXPLAIN ANALYZE DELETE FROM steps",
    "SET enable_external_access = true",
    "SET lock_configuration = false",
    "SET threads = 1",
    "RESET threads",
    "PRAGMA threads = 1",
    "SET VARIABLE x = 1",
    "USE memory",
    "INSTALL httpfs",
    "LOAD httpfs",
    "CHECKPOINT",
    "VACUUM",
    "BEGIN TRANSACTION",
    "UPDATE EXTENSIONS",  # a statement kind the Python API cannot name
]


def _catalog(folder: Path, run: str, n: int) -> Path:
    folder.mkdir(parents=True)
    rows = [
        {c: None for c in ALL_TABLES["steps"].column_names} | {"run": run, "step": s, "reward_mean": 0.5 * s}
        for s in range(n)
    ]
    write_table(ALL_TABLES["steps"], rows, folder / "steps.parquet")
    build_catalog(folder / "catalog.duckdb", {"steps": [folder / "steps.parquet"]})
    (folder / "plain.csv").write_text("a,b\n1,2\n")
    return folder


def _files(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("built")
    return [_catalog(root / f"run-{i}", f"r{i}", 2 + i) for i in range(2)]


@pytest.fixture(params=[1, 2], ids=["one-run", "two-runs"])
def runs(request, built, tmp_path) -> list[Path]:
    """Fresh copies of one or two run folders (run-0 with 2 steps, run-1 with 3)."""
    return [Path(shutil.copytree(folder, tmp_path / "runs" / folder.name)) for folder in built[: request.param]]


@pytest.mark.parametrize("statement", REFUSED)
def test_every_statement_but_select_is_refused(runs, tmp_path, statement):
    out = tmp_path / "out"
    out.mkdir()
    sql = statement.format(a=runs[0], name=runs[0].name, out=out)
    before = _files(tmp_path)
    result = runner.invoke(app, ["sql", *map(str, runs), sql])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("error: "), result.output
    assert _files(tmp_path) == before  # no catalog changed, nothing written
    counts = [
        duckdb.connect(str(r / "catalog.duckdb"), read_only=True).execute("SELECT count(*) FROM steps").fetchone()[0]
        for r in runs
    ]
    assert counts == [2 + i for i in range(len(runs))]


def test_export_refuses_the_same(runs, tmp_path):
    out = tmp_path / "steps.csv"
    result = runner.invoke(app, ["sql", *map(str, runs), "DELETE FROM steps", "--export", str(out)])
    assert result.exit_code == 1 and "refused" in result.output and "DELETE" in result.output
    assert not out.exists()


@pytest.mark.parametrize(
    "sql",
    [
        "SHOW TABLES",
        "DESCRIBE steps",
        "SUMMARIZE steps",
        "EXPLAIN SELECT * FROM steps",
        "EXPLAIN ANALYZE SELECT count(*) FROM steps",
        "SELECT 1; SELECT 2 AS two",
        "FROM steps SELECT max(step) AS last",
        "PIVOT (SELECT run, step FROM steps) ON step IN (0, 1) USING count(*)",
    ],
)
def test_reads_still_run(runs, sql):
    result = runner.invoke(app, ["sql", *map(str, runs), sql, "-f", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)


def test_the_engine_refuses_writes_even_past_the_statement_check(runs):
    """open_runs is read-only by itself: a catalog detached and attached again comes back read-only, and file
    access cannot be switched back on."""
    con = open_runs(runs)
    try:
        with pytest.raises(QueryRefused):
            run_query(con, "DELETE FROM steps")
        if len(runs) > 1:  # the way to a writable catalog, run without the statement check
            con.execute(f'DETACH "{runs[-1].name}"')
            con.execute("ATTACH ? AS w", [str(runs[-1] / "catalog.duckdb")])
            target = "w"
        else:
            target = con.execute("SELECT current_database()").fetchone()[0]
        with pytest.raises(duckdb.Error, match="read-only"):
            con.execute(f'DELETE FROM "{target}".main.steps')
        with pytest.raises(duckdb.Error, match="configuration has been locked"):
            con.execute("SET enable_external_access = true")
    finally:
        con.close()
