"""The `refiner` CLI: exit codes, read-only SQL, config errors."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import duckdb
import pytest
import yaml
from typer.testing import CliRunner

from conftest import run_cli
from flows.cli import app
from refiner_core.publish.catalog import build_catalog
from refiner_core.schema import ALL_TABLES
from refiner_core.store.storage import write_table

runner = CliRunner()
REPO = Path(__file__).parents[1]


@pytest.fixture
def catalog_dir(tmp_path):
    steps = [
        {c: None for c in ALL_TABLES["steps"].column_names}
        | {
            "run": "r",
            "step": s,
            "reward_mean": 0.5 * s,
            "reward_std": 0.1,
            "kl": 0.01,
            "loss": 0.2,
            "response_length_mean": 10.0,
        }
        for s in range(3)
    ]
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


def test_a_rounded_tiny_negative_shows_as_zero_in_the_table_and_keeps_its_sign_in_json(catalog_dir):
    sql = "SELECT round(-1e-9, 4) AS loss, round(-0.00012::DOUBLE, 4) AS kl"
    table = runner.invoke(app, ["sql", str(catalog_dir), sql]).output.splitlines()
    assert table[3].split() == ["│", "0", "│", "-0.0001", "│"]
    (row,) = json.loads(runner.invoke(app, ["sql", str(catalog_dir), sql, "--format", "json"]).output)
    assert row == {"loss": 0.0, "kl": -0.0001} and math.copysign(1, row["loss"]) == -1


def test_sql_is_read_only(catalog_dir):
    result = runner.invoke(app, ["sql", str(catalog_dir), "DELETE FROM steps"])
    assert result.exit_code == 1
    assert "read-only" in result.output.lower()
    with duckdb.connect(str(catalog_dir / "catalog.duckdb"), read_only=True) as con:  # closed: the CLI opens it
        assert con.execute("SELECT count(*) FROM steps").fetchone()[0] == 3
    outside = catalog_dir / "exported.csv"
    for sql in (
        f"COPY steps TO '{outside}'",
        f"SELECT * FROM read_csv('{catalog_dir / 'steps.parquet'}')",
        f"ATTACH '{catalog_dir / 'other.duckdb'}' AS other",
    ):
        result = runner.invoke(app, ["sql", str(catalog_dir), sql])
        assert result.exit_code == 1 and result.output.startswith("error: "), (sql, result.output)
    assert not outside.exists() and not (catalog_dir / "other.duckdb").exists()


def test_sql_errors_have_exit_codes(catalog_dir, tmp_path):
    assert runner.invoke(app, ["sql", str(catalog_dir), "SELECT * FROM nope"]).exit_code == 1
    assert runner.invoke(app, ["sql", str(tmp_path / "missing"), "SELECT 1"]).exit_code == 2
    for nothing in ("", "  /* only a comment */ "):
        result = runner.invoke(app, ["sql", str(catalog_dir), nothing])
        assert (
            result.exit_code == 2
            and result.output == "error: no SQL statement given: the query is empty or only comments\n"
        )


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


def test_a_recipe_that_is_not_yaml_is_one_error_line(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("grpo:\n  steps: [1\n")
    for args in (["run", str(recipe)], ["config", str(recipe)]):
        result = runner.invoke(app, [*args, "--set", "grpo.steps=2"])
        assert result.exit_code == 2 and result.output == (
            f"error: {recipe}: not valid YAML: expected ',' or ']', but got '<stream end>' at line 3, column 1\n"
        )
    result = runner.invoke(app, ["config", str(REPO / "recipes" / "tiny.yaml"), "--set", "rollout.stop=[a,b"])
    assert result.exit_code == 2 and result.output.startswith("error: --set rollout.stop=[a,b: not valid YAML: ")
    recipe.write_text("- a list\n")
    result = runner.invoke(app, ["config", str(recipe)])
    assert result.exit_code == 2 and "a recipe is a mapping of sections" in result.output


def test_a_run_folder_that_cannot_be_one_is_one_error_line(tmp_path):
    (tmp_path / "a-file").write_text("")
    tiny = str(REPO / "recipes" / "tiny.yaml")
    for folder, why in ((tmp_path / "a-file", "it is a file"), (tmp_path / "a-file" / "run", "Not a directory")):
        result = runner.invoke(app, ["run", tiny, "--run-dir", str(folder)])
        assert (result.exit_code, result.output) == (2, f"error: cannot use {folder} as the run folder: {why}\n")


def test_plot_writes_png(catalog_dir):
    result = runner.invoke(app, ["plot", str(catalog_dir)])
    assert result.exit_code == 0, result.output
    png = catalog_dir / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def _eval_summary(step: int, phase: str, reward: float, format_valid: float) -> dict:
    return {"step": step, "phase": phase, "mode": "greedy", "reward": reward, "format_valid": format_valid}


@pytest.mark.parametrize(
    ("evals", "base_marker"),
    [
        # eval.every = grpo.steps: one base and one trained evaluation, whose base point was left out
        ([_eval_summary(0, "base", 0.2, 0.5), _eval_summary(2, "grpo", 0.9, 0.75)], [[0.0, 0.2]]),
        (
            [_eval_summary(0, "base", 0.2, 0.5), _eval_summary(1, "grpo", 0.5, 0.5), _eval_summary(2, "grpo", 0.9, 1)],
            [[0.0, 0.2]],
        ),
        ([_eval_summary(0, "base", 0.2, 0.5)], []),  # the base model alone is the line itself
    ],
)
def test_plot_marks_the_base_models_held_out_point_beside_the_trained_ones(evals, base_marker):
    from refiner_core.publish.plots import _draw

    steps = [{"run": "r", "step": s, "reward_mean": 1.0, "reward_std": 0.1, "kl": 0.0, "loss": 0.0,
              "response_length_mean": 10.0} for s in range(2)]  # fmt: skip
    figure = _draw(steps, evals)
    panels = {ax.get_title(): ax for ax in figure.axes}
    reward, format_valid = panels["eval: reward (training reward code)"], panels["eval: format-valid (%)"]
    trained = [e for e in evals if e["phase"] != "base"] or evals
    assert [list(line.get_xdata()) for line in reward.lines] == [[e["step"] for e in trained]]
    assert [c.get_offsets().tolist() for c in reward.collections] == ([base_marker] if base_marker else [])
    assert [c.get_offsets().tolist() for c in format_valid.collections] == ([[[0.0, 50.0]]] if base_marker else [])


def test_config_fields_lists_help():
    result = runner.invoke(app, ["config", "--fields"])
    assert result.exit_code == 0
    assert "grpo.kl_estimator = 'k3'" in result.output


def test_config_check_warns_of_a_reward_that_pays_for_breaking_the_format():
    recipe = str(REPO / "recipes" / "refiner-smollm2.yaml")
    escape = ["--set", "reward.gate_judge_score_with_format_bonus=false"]
    result = runner.invoke(app, ["config", recipe, "--check", *escape])
    assert result.exit_code == 0, result.output  # a warning, not a problem: the run may still be what is wanted
    assert "warning: reward.distractor_penalty = 3" in result.output
    assert "set reward.gate_judge_score_with_format_bonus=true" in " ".join(result.output.split())
    assert "warning" not in runner.invoke(app, ["config", recipe, "--check"]).output


def _help_lines(args: list[str]) -> list[str]:
    """The lines of a `--help` page on a terminal wide enough for any paragraph, boxes and markup removed."""
    result = runner.invoke(app, [*args, "--help"], env={"COLUMNS": "1000"})
    assert result.exit_code == 0, result.output
    return [" ".join(line.replace("│", " ").split()) for line in result.output.splitlines()]


@pytest.mark.parametrize("group", [[], ["judge"]])
def test_help_rewraps_each_docstring_paragraph(group):
    """A docstring's line breaks are the source's, not the terminal's: on a wide terminal every paragraph of a
    command's help is one line, in the command list and on the command's own page."""
    import click
    import typer.main

    command = typer.main.get_command(app)
    for name in group:
        command = command.commands[name]
    listing = _help_lines(group)
    for name, sub in command.commands.items():
        first, *rest = [" ".join(p.split()).replace("`", "") for p in sub.help.split("\n\n")]
        assert any(line.endswith(first) for line in listing), (name, first)
        if not isinstance(sub, click.Group):
            page = _help_lines([*group, name])
            assert all(paragraph in page for paragraph in [first, *rest]), name


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["data.fields={questoin: query}"], "data.fields: 'questoin' is not a field name (did you mean 'question'?)"),
        (
            ["data.fields={question: qery}"],
            "data.fields: question -> 'qery': no such column in data/refiner/samples.jsonl; "
            "its columns: id, question, reasoning",
        ),
        (["data.path=data/none.parquet"], "data.path: data/none.parquet (resolved to "),
        (["grpo.steps=0"], "grpo.steps = 0: must be at least 1"),
        (["model.policy=my-model"], "model.policy: 'my-model' is not 'tiny-qwen3' or 'smollm2-135m-instruct'"),
    ],
)
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
    failure = [
        line
        for line in lines[last_progress + 1 :]  # Prefect's own progress: its server, end-of-run hooks
        if "temporary server" not in line and "hook '" not in line.lower()
    ]
    assert len(failure) <= 4, failure
    assert failure[0] == (
        "error: run failed in judge[step=0]: RuntimeError: injected fault in stage 'judge' (step 0) "
        "from REFINER_FAIL_ONCE"
    )
    assert "Traceback" not in err and err.count("injected fault") == 1
    [log] = (run_dir / "logs").glob("run-*.log")
    assert str(log) in err
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "Task run 'prepare-data' - Finished" in text
    assert (run_dir / ".prefect" / "prefect.db").exists() and not (tmp_path / "prefect-home").exists()
    assert out == ""


def _catalog(folder: Path, tables: dict[str, list[dict]]) -> Path:
    """A catalog in FOLDER from a few hand-written rows per table (unnamed columns NULL)."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, rows in tables.items():
        path = folder / f"{name}.parquet"
        write_table(ALL_TABLES[name], [{c: None for c in ALL_TABLES[name].column_names} | r for r in rows], path)
        files[name] = [path]
    build_catalog(folder / "catalog.duckdb", files)
    return folder


def _steps(run: str, n: int) -> list[dict]:
    return [
        {
            "run": run,
            "step": s,
            "reward_mean": 0.5 * s,
            "reward_std": 0.1,
            "kl": 0.01,
            "loss": 0.2,
            "lr": 1e-6 * (s + 1),
            "entropy_coef": 0.005 * s,
            "response_length_mean": 10.0 + s,
            "rollout_seconds": 1.0,
            "judge_seconds": 2.0,
            "update_seconds": 3.0,
        }
        for s in range(n)
    ]


def test_sql_over_several_runs_has_a_run_column_and_stays_read_only(tmp_path):
    a = _catalog(tmp_path / "run-a", {"steps": _steps("a", 3)})
    b = _catalog(tmp_path / "run-b", {"steps": _steps("b", 2)})
    result = runner.invoke(
        app,
        [
            "sql",
            str(a),
            str(b),
            "SELECT run, count(*) AS n, max(step) AS last FROM steps GROUP BY run ORDER BY run",
            "-f",
            "json",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [{"run": "a", "n": 3, "last": 2}, {"run": "b", "n": 2, "last": 1}]
    result = runner.invoke(
        app,
        [
            "sql",
            str(a),
            str(b),
            "SELECT run, step, reward_mean FROM reward_by_step WHERE step = 1 ORDER BY run",
            "-f",
            "csv",
        ],
    )
    assert result.stdout.splitlines() == ["run,step,reward_mean", "a,1,0.5", "b,1,0.5"]
    outside = tmp_path / "copied.csv"
    for sql in (
        f"COPY steps TO '{outside}'",
        f"ATTACH '{tmp_path / 'x.duckdb'}' AS x",
        "SET enable_external_access = true",
        'CREATE TABLE "run-a".main.t AS SELECT 1',
        'DELETE FROM "run-b".main.steps',
        f"SELECT * FROM '{a}/steps.parquet'",
    ):
        result = runner.invoke(app, ["sql", str(a), str(b), sql])
        assert result.exit_code == 1, (sql, result.output)
    assert not outside.exists() and not (tmp_path / "x.duckdb").exists()
    assert duckdb.connect(str(b / "catalog.duckdb"), read_only=True).execute(
        "SELECT count(*) FROM steps"
    ).fetchone() == (2,)
    same_name = _catalog(tmp_path / "other" / "run-a", {"steps": _steps("a2", 1)})
    result = runner.invoke(app, ["sql", str(a), str(same_name), "SELECT 1"])
    assert result.exit_code == 2 and "several run folders are named run-a" in result.output


def test_sql_over_several_runs_gives_the_catalog_views_each_run_once(tmp_path):
    """The catalog's own views (step_rewards, the monitors) over three runs: each run's figures are the ones the
    run's catalog alone gives."""

    def run(name: str, reward: float) -> Path:
        key = {"run": name, "step": 0, "prompt_id": "p", "reward_version": "train", "reward": reward}
        rewards = [key | {"sample_idx": i, "verifier": "judge", "gated": False} for i in range(2)]
        inputs = [{"run": name, "step": 0, "prompt_id": "p", "sample_idx": i, "verifier": "judge"} for i in range(2)]
        weights = [{"run": name, "step": 0, "reward_version": "train", "on_failure": "zero"}]
        tables = {"rewards": rewards, "reward_inputs": inputs, "reward_weights": weights, "steps": _steps(name, 2)}
        return _catalog(tmp_path / name, tables)

    folders = [run(name, reward) for name, reward in (("a", 1.0), ("b", 5.0), ("c", 9.0))]
    queries = (
        "SELECT run, count(*) AS n, sum(rollouts) AS rollouts, avg(reward_mean) AS reward FROM step_rewards "
        "GROUP BY run ORDER BY run",
        "SELECT run, monitor, count(*) AS n FROM monitors GROUP BY ALL ORDER BY ALL",
        "SELECT run, count(*) AS n FROM monitor_kl_jump GROUP BY run ORDER BY run",
        "SELECT run, count(*) AS n FROM rewards_recomputed GROUP BY run ORDER BY run",
    )
    for sql in queries:
        alone = [row for folder in folders for row in _json(folder, sql)]
        assert alone and _json_runs(folders, sql) == alone, sql
    assert _json_runs(folders, queries[0]) == [
        {"run": name, "n": 1, "rollouts": 2, "reward": reward} for name, reward in (("a", 1.0), ("b", 5.0), ("c", 9.0))
    ]


def _json_runs(run_dirs, sql):
    result = runner.invoke(app, ["sql", *map(str, run_dirs), sql, "-f", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_run_folders_named_like_glob_patterns_publish_their_own_files(tmp_path):
    """DuckDB's read_parquet reads a path as a glob pattern: runs/exp[12] would publish the files of runs/exp1, and
    runs/run* those of every sibling it matches. The catalog, a rescore version written into it and a rescore's
    inputs hash all read exactly the files named."""
    from refiner_core.reward.rescore import inputs_hash
    from refiner_core.store.storage import replace_version_rows

    def write(folder: Path, name: str, rows: list[dict]) -> Path:
        path = folder / f"{name}.parquet"
        write_table(ALL_TABLES[name], [{c: None for c in ALL_TABLES[name].column_names} | r for r in rows], path)
        return path

    for name in ("exp1", "exp[12]", "runX", "run*"):
        folder = _catalog(tmp_path / name, {"steps": _steps(name, 1)})
        key = {"run": name, "step": 0, "prompt_id": f"q-{name}", "sample_idx": 0}
        write(folder / "scores" / "step=0", "reward_inputs", [key])
        write(folder / "scores" / "step=0", "judge_scores", [key | {"rubric_id": "pos-0", "oriented_score": 1.0}])
        write(folder / "rescores" / "v1", "rewards", [key | {"reward_version": "v1", "reward": 1.0}])
    for name in ("exp[12]", "run*"):
        db = tmp_path / name / "catalog.duckdb"
        replace_version_rows(db, {"rewards": [str(tmp_path / name / "rescores" / "v1" / "rewards.parquet")]}, "v1")
        con = duckdb.connect(str(db), read_only=True)
        assert con.execute("SELECT DISTINCT run FROM steps").fetchall() == [(name,)]
        assert con.execute("SELECT DISTINCT run FROM rewards").fetchall() == [(name,)]
        con.close()
    shutil.copytree(tmp_path / "exp[12]" / "scores", tmp_path / "plain" / "scores")
    step = Path("scores") / "step=0"
    assert inputs_hash(tmp_path / "exp[12]" / step) == inputs_hash(tmp_path / "plain" / step)


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_sql_export_writes_the_result_where_asked(catalog_dir, tmp_path, suffix):
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    out = tmp_path / "exports" / f"steps{suffix}"
    result = runner.invoke(
        app, ["sql", str(catalog_dir), "SELECT step, reward_mean FROM steps ORDER BY step", "--export", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert f"wrote 3 rows to {out}" in result.output
    table = pq.read_table(out) if suffix == ".parquet" else pcsv.read_csv(out)
    assert table.to_pydict() == {"step": [0, 1, 2], "reward_mean": [0.0, 0.5, 1.0]}
    bad = runner.invoke(app, ["sql", str(catalog_dir), "SELECT 1", "--export", str(tmp_path / "x.json")])
    assert bad.exit_code == 2 and "must end in .parquet or .csv" in bad.output


def test_sql_export_where_nothing_can_be_written_is_one_error_line(catalog_dir, tmp_path):
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-folder.csv").mkdir()
    for out, why in (
        (tmp_path / "a-file" / "steps.csv", f"cannot make its folder (File exists: {tmp_path / 'a-file'})"),
        (tmp_path / "a-file" / "sub" / "steps.parquet", "cannot make its folder (Not a directory: "),
        (tmp_path / "a-folder.csv", "cannot write it (Is a directory)"),
    ):
        result = runner.invoke(app, ["sql", str(catalog_dir), "SELECT step FROM steps", "--export", str(out)])
        assert result.exit_code == 2, result.output
        [line] = result.output.splitlines()
        assert line.startswith(f"error: --export {out}: {why}"), line
    assert list((tmp_path / "a-folder.csv").iterdir()) == [] and not (tmp_path / "a-folder.csv.tmp").exists()


def test_sql_json_writes_nan_and_infinity_as_null(catalog_dir):
    sql = "SELECT 'nan'::DOUBLE AS x, '-inf'::DOUBLE AS y, [1.5, 'nan'::DOUBLE] AS l, {'a': 'inf'::DOUBLE} AS s"
    result = runner.invoke(app, ["sql", str(catalog_dir), sql, "-f", "json"])
    assert result.exit_code == 0, result.output
    assert "NaN" not in result.stdout and "Infinity" not in result.stdout  # neither is JSON
    assert json.loads(result.stdout) == [{"x": None, "y": None, "l": [1.5, None], "s": {"a": None}}]


def test_sql_export_of_lists_to_csv_is_one_error_line_and_leaves_no_file(tmp_path):
    folder = _catalog(tmp_path / "run", {"prompts": [{"run": "r", "prompt_id": "q1", "snippet_ids": ["P1", "P2"]}]})
    exports = tmp_path / "exports"
    result = runner.invoke(app, ["sql", str(folder), "SELECT * FROM prompts", "--export", str(exports / "p.csv")])
    assert result.exit_code == 2, result.output
    [line] = result.output.splitlines()
    assert line.startswith(f"error: --export {exports / 'p.csv'}: ") and '"snippet_ids"' in line
    assert "write a .parquet file, or select such columns as text: CAST(column AS VARCHAR)" in line
    assert list(exports.iterdir()) == []  # neither the export nor its temporary file
    as_text = "SELECT prompt_id, CAST(snippet_ids AS VARCHAR) AS snippet_ids FROM prompts"
    result = runner.invoke(app, ["sql", str(folder), as_text, "--export", str(exports / "p.csv")])
    assert result.exit_code == 0, result.output
    assert (exports / "p.csv").read_text().splitlines() == ['"prompt_id","snippet_ids"', '"q1","[P1, P2]"']


@pytest.fixture
def judged_run(tmp_path):
    """One run, two steps: rubrics, judge scores (one failed), rollouts, rewards, reward inputs, quarantine."""
    key = lambda step, p, i: {"run": "r", "step": step, "prompt_id": p, "sample_idx": i}  # noqa: E731
    rollouts = [
        key(s, p, i) | {"response_tokens": 10 * (i + 1), "response_text": f"answer {s}{p}{i}"}
        for s in (0, 1)
        for p in ("p1", "p2")
        for i in (0, 1)
    ]
    rewards = [
        key(s, p, i) | {"reward_version": v, "reward": float(s + i) + (0.5 if p == "p2" else 0.0) + bonus}
        for s in (0, 1)
        for p in ("p1", "p2")
        for i in (0, 1)
        for v, bonus in (("train", 0), ("rescored", 9))
    ]
    inputs = [
        key(0, "p1", i)
        | {
            "has_answer": True,
            "format_ok": i == 0,
            "n_citations": 2 * i,
            "n_invalid_citations": i,
            "citation_valid_fraction": 0.5 * i,
        }
        for i in (0, 1)
    ]
    rubrics = [{"run": "r", "prompt_id": "p1", "rubric_id": "pos-0", "source": "instance", "title": "Names it"}]
    scores = [
        key(0, "p1", i) | {"rubric_id": "pos-0", "oriented_score": s, "failure": f}
        for i, s, f in ((0, 1.0, None), (1, 0.5, None))
    ] + [key(1, "p1", 0) | {"rubric_id": "pos-0", "oriented_score": 0.0, "failure": "http_503: busy"}]
    quarantine = [
        {"run": "r", "stage": "prepare", "source": "d.jsonl", "row_ref": f"line {n}", "reason": "control_characters"}
        for n in (3, 7)
    ]
    tables = {
        "steps": _steps("r", 2),
        "rollouts": rollouts,
        "rewards": rewards,
        "reward_inputs": inputs,
        "rubrics": rubrics,
        "judge_scores": scores,
        "quarantine": quarantine,
    }
    return _catalog(tmp_path / "judged", {k: v for k, v in tables.items() if k in ALL_TABLES})


def _json(run_dir, sql):
    result = runner.invoke(app, ["sql", str(run_dir), sql, "-f", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_predefined_views_by_hand(judged_run):
    assert _json(
        judged_run, "SELECT source, title, judged, mean_score, full_pass_rate, failed FROM rubric_pass_rates"
    ) == [
        {
            "source": "instance",
            "title": "Names it",
            "judged": 3,
            "mean_score": 0.5,
            "full_pass_rate": 1 / 3,
            "failed": 1,
        }
    ]
    assert _json(judged_run, "SELECT step, failure_kind, n FROM judge_failures") == [
        {"step": 1, "failure_kind": "http_503", "n": 1}
    ]
    assert _json(judged_run, "SELECT stage, reason, rows, example_row FROM quarantine_summary") == [
        {"stage": "prepare", "reason": "control_characters", "rows": 2, "example_row": "line 3"}
    ]
    assert _json(
        judged_run,
        "SELECT step, rollouts, format_ok_rate, citations_mean, invalid_citations, "
        "valid_id_fraction FROM citation_quality",
    ) == [
        {
            "step": 0,
            "rollouts": 2,
            "format_ok_rate": 0.5,
            "citations_mean": 1.0,
            "invalid_citations": 1,
            "valid_id_fraction": 0.5,  # one of the step's two cited IDs (the rollout citing none has no share)
        }
    ]
    # step 0: four rollouts, so four deciles of one: length 10 (training rewards 0, 0.5), 20 (1, 1.5); the
    # 'rescored' version (+9) is not the training reward and stays out
    deciles = _json(judged_run, "SELECT length_decile, tokens_mean, reward_mean FROM length_vs_reward WHERE step = 0")
    assert [d["length_decile"] for d in deciles] == [1, 2, 3, 4]
    assert [(d["tokens_mean"], d["reward_mean"]) for d in deciles[:2]] in (
        [(10.0, 0.0), (10.0, 0.5)],
        [(10.0, 0.5), (10.0, 0.0)],
    )
    assert sorted((d["tokens_mean"], d["reward_mean"]) for d in deciles[2:]) == [(20.0, 1.0), (20.0, 1.5)]


def test_show_summarises_steps_and_the_best_and_worst_rollout(judged_run):
    result = runner.invoke(app, ["show", str(judged_run)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"run {judged_run}: 2 steps")
    assert "rollout_s" in result.output and "update_s" in result.output
    assert "learning rate: 1e-06 at step 0, 2e-06 at step 1 (steps.lr)" in result.output
    assert "entropy coefficient: 0 at step 0, 0.005 at step 1 (steps.entropy_coef)" in (result.output)
    assert "best of step 1: reward 2.5 (p2 #1): answer 1p21" in result.output
    assert "worst of step 1: reward 1.0 (p1 #0): answer 1p10" in result.output
    assert runner.invoke(app, ["show", str(judged_run.parent / "nothing")]).exit_code == 2


def test_show_adds_the_judge_cost_and_the_monitors_that_tripped(tmp_path):
    steps = [
        s | {"judge_requests": 5, "judge_prompt_tokens": 150 * (s["step"] + 1), "judge_completion_tokens": 10}
        for s in _steps("r", 2)
    ]
    for s in steps:
        s["judge_cost_usd"] = (s["judge_prompt_tokens"] * 2.0 + s["judge_completion_tokens"] * 8.0) / 1e6
    event = {
        "run": "r",
        "step": 1,
        "monitor": "citation_drift",
        "value": 0.5,
        "threshold": 0.4,
        "action": "warn",
        "outcome": "warned",
        "detail": "citations per answer 2.00 -> 1.00",
    }
    run_dir = _catalog(tmp_path / "run", {"steps": steps, "monitor_events": [event]})
    result = runner.invoke(app, ["show", str(run_dir)], env={"COLUMNS": "200"})  # the detail cell unwrapped
    assert result.exit_code == 0, result.output
    assert "judge over 2 step(s): 10 requests, 450 prompt + 20 completion tokens, $0.0011" in result.output
    assert "monitors tripped (1;" in result.output and "citation_drift" in result.output
    assert "citations per answer 2.00 -> 1.00" in result.output


@pytest.mark.parametrize(
    ("prices", "cost"), [((0.0, 0.0), "not priced (judge.price_per_mtok_in / _out)"), ((2.0, 8.0), "$0.3040")]
)
def test_show_says_a_judge_without_prices_is_not_priced(tmp_path, prices, cost):
    """The recipe's default prices, 0 and 0, price nothing: judge_cost_usd stays NULL rather than $0."""
    steps = [_steps("r", 1)[0] | {"judge_requests": 40, "judge_prompt_tokens": 120000, "judge_completion_tokens": 8000}]
    path = tmp_path / "steps.parquet"
    write_table(ALL_TABLES["steps"], [{c: None for c in ALL_TABLES["steps"].column_names} | s for s in steps], path)
    build_catalog(tmp_path / "catalog.duckdb", {"steps": [path]}, judge_price=prices)
    assert _json(tmp_path, "SELECT judge_cost_usd FROM steps") == [
        {"judge_cost_usd": None if cost.startswith("not") else pytest.approx(0.304)}
    ]
    result = runner.invoke(app, ["show", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert f"judge over 1 step(s): 40 requests, 120000 prompt + 8000 completion tokens, {cost}\n" in result.output


def test_show_adds_the_held_out_evaluations_and_anchors_judge_cost_from_judge_spend(tmp_path):
    """judge_spend: a row per judging stage from its manifest's judge_usage, priced by the catalog; `refiner show`
    prints what the evaluations and anchors cost beside the steps, and the run's total. By hand at $2 / $8 per
    million: the step 0.24 + 0.064, anchors 0.06 + 0.008, evaluation 0.1."""
    from tasks.catalog import judge_spend_rows

    usage = {"requests": 40, "prompt_tokens": 120000, "completion_tokens": 8000, "unknown": 0}
    manifests = [
        {"stage": "judge", "judge_usage": usage | {"step": 0, "round": 0}},
        {
            "stage": "judge-anchors",
            "judge_usage": {"requests": 6, "prompt_tokens": 30000, "completion_tokens": 1000, "unknown": 0, "step": 0},
        },
        {
            "stage": "eval",
            "judge_usage": {"requests": 10, "prompt_tokens": 50000, "completion_tokens": 0, "step": 1, "phase": "grpo"},
        },
        {"stage": "rollout", "rollouts": {"path": "x.parquet", "hash": "h"}},  # no judging: no row
    ]
    rows = judge_spend_rows("r", manifests + manifests[:1])  # a stage reported twice costs once
    steps = [_steps("r", 1)[0] | {"judge_requests": 40, "judge_prompt_tokens": 120000, "judge_completion_tokens": 8000}]
    path = tmp_path / "steps.parquet"
    write_table(ALL_TABLES["steps"], [{c: None for c in ALL_TABLES["steps"].column_names} | s for s in steps], path)
    build_catalog(tmp_path / "catalog.duckdb", {"steps": [path]}, judge_price=(2.0, 8.0), rows={"judge_spend": rows})
    spent = _json(tmp_path, "SELECT stage, step, round, phase, unknown, cost_usd FROM judge_spend ORDER BY stage")
    assert spent == [
        {"stage": "eval", "step": 1, "round": 0, "phase": "grpo", "unknown": None, "cost_usd": pytest.approx(0.1)},
        {"stage": "judge", "step": 0, "round": 0, "phase": "", "unknown": 0, "cost_usd": pytest.approx(0.304)},
        {"stage": "judge-anchors", "step": 0, "round": 0, "phase": "", "unknown": 0, "cost_usd": pytest.approx(0.068)},
    ]
    result = runner.invoke(app, ["show", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "judge over 1 step(s): 40 requests, 120000 prompt + 8000 completion tokens, $0.3040\n" in result.output
    assert (
        "judge beyond the steps (eval, judge-anchors, 2 stage run(s)): 16 requests, 80000 prompt + 1000 completion "
        "tokens, $0.1680; the run's judge total $0.4720" in result.output
    )


def test_example_commands_quote_the_run_folder():
    import shlex

    from flows.supervisor import EXAMPLE_SQL, example_commands

    folder = Path("/tmp/runs/it's a run")
    commands = example_commands(folder)
    assert [shlex.split(c)[1:] for c in commands] == [["sql", str(folder), sql] for sql in EXAMPLE_SQL[:2]]


def test_a_fresh_prefect_home_is_made_and_holds_the_memo_store(tmp_path, monkeypatch):
    from flows.supervisor import prefect_home_ready

    home = tmp_path / "fresh" / ".prefect"
    monkeypatch.setenv("PREFECT_HOME", str(home))
    for name in ("PREFECT_SERVER_MEMO_STORE_PATH", "PREFECT_MEMO_STORE_PATH"):  # unset here, as before afterwards
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    prefect_home_ready()
    assert home.is_dir()
    assert os.environ["PREFECT_SERVER_MEMO_STORE_PATH"] == str(home / "memo_store.toml")


def test_show_summary_of_a_catalog_from_before_a_per_step_setting():
    """A catalog written before steps.entropy_coef existed: no entropy line, the rest as always."""
    import duckdb

    from refiner_core.publish.run_sql import run_summary

    con = duckdb.connect()
    columns = "step, reward_mean, reward_std, kl, loss, response_length_mean, rollout_seconds, judge_seconds"
    con.execute(
        f"CREATE TABLE steps AS SELECT * FROM (VALUES (0, 0.5, 0.1, 0.0, 0.1, 10.0, 1.0, 1.0, 1.0, 1e-3), "
        f"(1, 0.6, 0.1, 0.0, 0.1, 10.0, 1.0, 1.0, 1.0, 2e-3)) AS t({columns}, update_seconds, lr)"
    )
    con.execute("CREATE TABLE rewards (step INT, prompt_id TEXT, sample_idx INT, reward DOUBLE, reward_version TEXT)")
    con.execute("CREATE TABLE rollouts (step INT, prompt_id TEXT, sample_idx INT, response_text TEXT)")
    summary = run_summary(con)
    assert summary["moving"] == {
        "learning rate": ("lr", [(0, 1e-3), (1, 2e-3)]),
        "entropy coefficient": ("entropy_coef", []),
    }
    assert len(summary["steps"]) == 2 and summary["judge"] is None


def test_config_check_without_a_recipe_says_it_checked_the_defaults():
    result = runner.invoke(app, ["config", "--check"])
    assert result.exit_code == 0, result.output
    assert result.output.strip().endswith("the defaults (no recipe given): no problem found")  # was "None: ..."


def test_a_table_into_a_pipe_is_as_wide_as_its_cells(capsys, monkeypatch):
    """Into a pipe the width fell back to 120 columns, and a wide table (judge agreement's) folded a number across
    two lines ('0.477-0.5' then '28'); now each row is one line, whatever the cells need."""
    from flows.cli import _print_table

    monkeypatch.delenv("COLUMNS", raising=False)
    columns = [f"column_{k}" for k in range(12)]
    rows = [tuple(f"0.477-0.528_{k}" for k in range(12)), tuple(range(12))]
    _print_table(columns, rows, 0)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 + 2 + 1  # borders and header, two rows, the bottom border
    assert all(f"0.477-0.528_{k}" in lines[3] for k in range(12))
    wide = [tuple("研究回答引用片段" * 3 for _ in range(6))]  # two terminal cells a character
    _print_table(columns[:6], wide, 0)
    assert len(capsys.readouterr().out.splitlines()) == 3 + 1 + 1


def test_a_table_wider_than_the_terminal_shows_one_line_per_column(catalog_dir):
    """On an 80-column terminal `SELECT * FROM steps` (40 columns) printed a box of empty columns and exit 0: rich
    squeezed every column to nothing. Now each row is a record, one line per column; a narrow result stays a table."""
    every = runner.invoke(app, ["sql", str(catalog_dir), "SELECT * FROM steps ORDER BY step"], env={"COLUMNS": "80"})
    assert every.exit_code == 0
    lines = every.stdout.splitlines()
    assert lines[0].startswith("-[ row 1 ]-") and sum(line.startswith("-[ row ") for line in lines) == 3
    record = dict(line.split(" | ", 1) for line in lines[1 : 1 + len(ALL_TABLES["steps"].column_names)])
    assert {k.strip(): v for k, v in record.items()} == {
        **{c: "NULL" for c in ALL_TABLES["steps"].column_names},
        "run": "r",
        "step": "0",
        "reward_mean": "0",
        "reward_std": "0.1",
        "kl": "0.01",
        "loss": "0.2",
        "response_length_mean": "10",
    }
    narrow = runner.invoke(app, ["sql", str(catalog_dir), "SELECT step, kl FROM steps"], env={"COLUMNS": "80"})
    assert narrow.stdout.splitlines()[0].startswith("┏") and "0.01" in narrow.stdout


def test_json_refuses_a_column_name_given_twice_and_writes_decimals_as_numbers(catalog_dir):
    """-f json kept only the last of two columns of one name (x.kl, y.kl of a self-join); 1.5 (a DECIMAL) was "1.5"."""
    twice = "SELECT x.step, x.kl, y.kl FROM steps x JOIN steps y USING (step)"
    shown = runner.invoke(app, ["sql", str(catalog_dir), twice, "-f", "json"])
    assert shown.exit_code == 2 and "columns named kl more than once" in shown.output
    assert runner.invoke(app, ["sql", str(catalog_dir), twice, "-f", "csv"]).stdout.splitlines()[0] == "step,kl,kl"
    decimal = runner.invoke(app, ["sql", str(catalog_dir), "SELECT 1.5 AS k", "-f", "json"])
    assert json.loads(decimal.stdout) == [{"k": 1.5}]


def test_a_catalog_that_cannot_be_opened_is_one_error_line_for_sql_show_and_plot(catalog_dir):
    """A catalog another process holds open for writing, or a file that is no DuckDB database: tracebacks, exit 1."""
    held = duckdb.connect(str(catalog_dir / "catalog.duckdb"))  # read-write: the lock excludes every other process
    try:
        for command in (["sql", str(catalog_dir), "SELECT 1"], ["show", str(catalog_dir)], ["plot", str(catalog_dir)]):
            code, out, err, _ = run_cli(command, catalog_dir)
            assert code == 2 and "Conflicting lock is held" in err and "Traceback" not in err, err
    finally:
        held.close()
    (catalog_dir / "catalog.duckdb").write_bytes(b"no database")
    for command in (["sql", str(catalog_dir), "SELECT 1"], ["show", str(catalog_dir)], ["plot", str(catalog_dir)]):
        shown = runner.invoke(app, command)
        assert shown.exit_code == 2 and "not a valid DuckDB database file" in shown.output, shown.output


def test_plot_refuses_what_it_cannot_write_and_draws_steps_without_figures(catalog_dir, tmp_path):
    for out, why in ((tmp_path / "curves.pdf", "the plot is a PNG"), (tmp_path, "the plot is a PNG")):
        shown = runner.invoke(app, ["plot", str(catalog_dir), "-o", str(out)])
        assert shown.exit_code == 2 and why in shown.output, shown.output
    (tmp_path / "file").write_text("")
    shown = runner.invoke(app, ["plot", str(catalog_dir), "-o", str(tmp_path / "file" / "curves.png")])
    assert shown.exit_code == 2 and "error: -o" in shown.output and shown.exception.__class__ is SystemExit
    # a step with no reward figures (a catalog written before the columns): no point there, not a TypeError
    steps = [{"run": "r", "step": 0, "kl": 0.0, "loss": 0.1, "response_length_mean": 5.0}]
    plain = _catalog(tmp_path / "old", {"steps": steps})
    shown = runner.invoke(app, ["plot", str(plain), "-o", str(tmp_path / "old.png")])
    assert shown.exit_code == 0 and (tmp_path / "old.png").stat().st_size > 0, shown.output


def test_a_reader_that_closes_the_pipe_early_is_no_error_in_any_format(catalog_dir):
    import subprocess

    refiner = shutil.which("refiner") or str(Path(os.sys.executable).parent / "refiner")
    for fmt in ("csv", "json", "table"):
        proc = subprocess.Popen(
            [refiner, "sql", str(catalog_dir), "SELECT * FROM range(300000) t(i)", "-f", fmt],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        proc.stdout.readline()
        proc.stdout.close()  # as `| head -1` does
        assert proc.wait(timeout=120) == 0, (fmt, proc.stderr.read()[-2000:])


def test_show_names_no_moving_setting_where_it_is_nan(tmp_path):
    """A constant NaN learning rate read as a schedule ('learning rate: nan at step 0, nan at step 1'): NaN != NaN."""
    steps = [s | {"lr": math.nan, "entropy_coef": math.nan} for s in _steps("r", 2)]
    shown = runner.invoke(app, ["show", str(_catalog(tmp_path / "r", {"steps": steps}))])
    assert shown.exit_code == 0 and "learning rate" not in shown.output and "entropy coefficient" not in shown.output
