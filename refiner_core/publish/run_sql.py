"""Read-only SQL over the catalogs of one or several runs, with predefined views and exports.

The first catalog is the session's database, opened read-only, which makes DuckDB attach every other database
read-only too; further catalogs are attached under their run folder's name and every table they hold becomes
one view over all of them (`UNION ALL BY NAME`; each row keeps its `run` column), and the catalog's own views
(step_rewards, monitors, ...) are defined again over those, so the queries written for one run work across runs.
Then file access is switched off and the configuration locked, and `run_query` and `export` run SELECT
statements only: a query can neither write (`DELETE`, `COPY … TO`), attach, detach, change
a setting nor read other files, whether the session holds one run or several. `export` writes a result only
where the caller asks, from Python.
"""

from __future__ import annotations

import re
from pathlib import Path

import duckdb
import pyarrow as pa

from refiner_core.config import EvalConfig
from refiner_core.publish.catalog import catalog_views
from refiner_core.store.forks import ancestors, read_fork, rollout_files

# The oriented rubric score at which a judged answer passes, per run: its recipe's eval.pass_rubric_score (a session
# variable mapping each run name to it, set by open_runs), the default for a catalog without its recipe beside it.
PASS_SCORE_SQL = f"coalesce(getvariable('pass_rubric_scores')[run], {EvalConfig.pass_rubric_score!r})"

# Whether a training rollout solved its prompt, as an eval answer passes (refiner_core.eval.evaluate.passed at the
# run's eval.pass_rubric_score): training's rewards rows. A rollout whose judgments failed (dropped under
# judge.on_failure skip or drop) neither solved its prompt nor failed it: left out, as the eval summary leaves it.
SOLVED_SQL = (
    "SELECT run, step, prompt_id, CASE WHEN verifier = 'judge' THEN coalesce(format_ok AND n_citations > 0 AND "
    f"n_invalid_citations = 0 AND rubric_score >= {PASS_SCORE_SQL}, false) ELSE coalesce(correct = 1.0, false) "
    "END AS solved FROM rewards WHERE reward_version = 'train' AND NOT coalesce(dropped, false)"
)

# name -> (what it shows, SQL). Defined on the session, not in the catalog: older catalogs get them too.
VIEWS: dict[str, tuple[str, str]] = {
    "reward_by_step": (
        "Reward, KL, loss and response length per step.",
        "SELECT run, step, reward_mean, reward_std, kl, loss, response_length_mean FROM steps ORDER BY run, step",
    ),
    "rubric_pass_rates": (
        "Per rubric (source, title): judgments, mean oriented score, share fully met (1.0), failed judgments.",
        # aggregated per rubric before the join: 2.5x faster than joining every judgment (bench/sql_scale.py)
        "WITH s AS (SELECT run, prompt_id, rubric_id, count(*) AS judged, sum(oriented_score) AS total, "
        "count(oriented_score) AS scored, count(*) FILTER (WHERE oriented_score >= 1) AS met, "
        "count(*) FILTER (WHERE failure IS NOT NULL) AS failed FROM judge_scores GROUP BY ALL) "
        "SELECT s.run, r.source, r.title, sum(judged) AS judged, sum(total) / sum(scored) AS mean_score, "
        "sum(met) / sum(judged) AS full_pass_rate, sum(failed) AS failed "
        "FROM s JOIN rubrics r USING (run, prompt_id, rubric_id) GROUP BY ALL ORDER BY 1, 2, 3",
    ),
    "citation_quality": (
        "Per step: answers present, valid format, citations per response, share of the cited IDs that exist (NULL when "
        "none was cited).",
        "SELECT run, step, count(*) AS rollouts, avg(has_answer::INT) AS answer_rate, avg(format_ok::INT) AS "
        "format_ok_rate, avg(n_citations) AS citations_mean, sum(n_invalid_citations) AS invalid_citations, "
        # pooled over the step's cited IDs: a rollout citing nothing has no share (its reward input reads 0)
        "1 - sum(n_invalid_citations) / nullif(sum(n_citations), 0) AS valid_id_fraction FROM reward_inputs "
        "GROUP BY ALL ORDER BY 1, 2",
    ),
    "length_vs_reward": (
        "Per step and response-length decile: mean length and mean reward (the reward used for training).",
        "WITH r AS (SELECT run, step, prompt_id, sample_idx, reward FROM rewards WHERE reward_version = 'train'), "
        "j AS (SELECT o.run, o.step, o.response_tokens, r.reward, "
        "ntile(10) OVER (PARTITION BY o.run, o.step ORDER BY o.response_tokens) AS length_decile "
        "FROM rollouts o JOIN r USING (run, step, prompt_id, sample_idx)) "
        "SELECT run, step, length_decile, count(*) AS rollouts, avg(response_tokens) AS tokens_mean, "
        "avg(reward) AS reward_mean FROM j GROUP BY ALL ORDER BY 1, 2, 3",
    ),
    "judge_failures": (
        "Failed judgments by step and failure kind (the text before ':'), with an example.",
        "SELECT run, step, split_part(failure, ':', 1) AS failure_kind, count(*) AS n, any_value(failure) AS "
        "example FROM judge_scores WHERE failure IS NOT NULL GROUP BY ALL ORDER BY 1, 2, 4 DESC",
    ),
    "quarantine_summary": (
        "Rejected input rows per stage and reason, with an example row reference.",
        "SELECT run, stage, reason, count(*) AS rows, min(row_ref) AS example_row FROM quarantine "
        "GROUP BY ALL ORDER BY 1, 2, 4 DESC",
    ),
    "prompt_history": (
        "Per run, training prompt and step: rollouts sampled, how many solved it (verified: correct; judged: "
        "format-valid, citing, no invented ID, rubric score >= the run's eval.pass_rubric_score, as an eval pass), "
        "and the pass rate.",
        f"WITH r AS ({SOLVED_SQL}) SELECT run, prompt_id, step, count(*) AS rollouts, "
        "count(*) FILTER (WHERE solved) AS solved, avg(solved::INT) AS pass_rate FROM r GROUP BY ALL "
        "ORDER BY 1, 2, 3",
    ),
    "prompt_difficulty": (
        "The difficulty ledger: per training prompt over every run of the session, the runs and steps that sampled "
        "it, its pass rate, whether every rollout (always_solved) or none (never_solved) solved it, and its pass-rate "
        "history in (run, step) order; data.skip_solved_from and data.weights_from read it. A fork's steps whose "
        "rollouts another run of the session holds too (the files it reused from its parent) count once.",
        "SELECT prompt_id, count(DISTINCT run) AS runs, count(*) AS steps, sum(rollouts) AS rollouts, "
        "sum(solved) AS solved, sum(solved) / sum(rollouts) AS pass_rate, sum(solved) = sum(rollouts) AS "
        "always_solved, sum(solved) = 0 AS never_solved, list(round(pass_rate, 3) ORDER BY run, step) AS history "
        "FROM prompt_history h WHERE NOT EXISTS (SELECT 1 FROM (SELECT unnest(getvariable('copied_steps')) AS c) "
        "WHERE c.run = h.run AND h.step >= c.lo AND h.step < c.hi) GROUP BY prompt_id ORDER BY pass_rate, prompt_id",
    ),
    "judge_drift": (
        "judge.anchor_every: per step, the anchor rollouts' judgments against the ones they got at step 0: mean "
        "|difference| (drift), and the share whose verdict (oriented score >= eval.pass_rubric_score) flipped.",
        "SELECT run, step, count(*) AS judgments, avg(score) AS score_mean, avg(first_score) AS first_score_mean, "
        f"avg(abs(score - first_score)) AS mean_abs_drift, avg(((score >= {PASS_SCORE_SQL}) <> "
        f"(first_score >= {PASS_SCORE_SQL}))::INT) AS verdict_flips, count(*) FILTER (WHERE failure IS NOT NULL) "
        "AS failed FROM judge_anchors GROUP BY ALL ORDER BY 1, 2",
    ),
}


class CatalogError(ValueError):
    """A run folder without a catalog, or two runs with one name."""


class QueryRefused(ValueError):
    """A statement that is not a SELECT: the session only reads."""


def catalog_path(run_dir: str | Path) -> Path:
    path = Path(run_dir)
    db = path if path.suffix == ".duckdb" else path / "catalog.duckdb"
    if not db.exists():
        raise CatalogError(f"no catalog at {db} (has the run finished a step?)")
    return db


def open_runs(run_dirs: list[str | Path]) -> duckdb.DuckDBPyConnection:
    """A read-only session over the runs' catalogs, with file access off, the configuration locked and the
    predefined views defined. The same for one run and for several."""
    dbs = [catalog_path(d) for d in run_dirs]
    names = [(db.parent.name if db.name == "catalog.duckdb" else db.stem) for db in dbs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise CatalogError(
            f"several run folders are named {', '.join(repeated)}: each run is attached under its folder's name"
        )
    con = duckdb.connect(str(dbs[0]), read_only=True)
    try:
        _define_session(con, names, dbs)
    except BaseException:
        con.close()
        raise
    return con


def _define_session(con: duckdb.DuckDBPyConnection, names: list[str], dbs: list[Path]) -> None:
    catalogs = {con.execute("SELECT current_database()").fetchone()[0], *names[1:]}
    for name, db in zip(names[1:], dbs[1:]):
        try:
            con.execute(f'ATTACH ? AS "{_ident(name)}" (READ_ONLY)', [str(db)])
        except duckdb.BinderException as e:  # a folder named like the first catalog's file, or 'temp', 'system'
            raise CatalogError(f"cannot attach {db} as {name!r}: {e}") from e
    if len(dbs) > 1:
        # Tables only: a catalog's own views read bare table names, which here are the union views below, so
        # unioning them too would repeat every run's rows once per run. They are defined again over the unions.
        tables: dict[str, list[str]] = {}
        for catalog, table in con.execute(
            "SELECT table_catalog, table_name FROM information_schema.tables WHERE "
            "table_schema = 'main' AND table_type = 'BASE TABLE' ORDER BY table_name"
        ).fetchall():
            if catalog in catalogs:
                tables.setdefault(table, []).append(catalog)
        for table, in_catalogs in tables.items():
            union = " UNION ALL BY NAME ".join(
                f'SELECT * FROM "{_ident(c)}".main."{_ident(table)}"' for c in in_catalogs
            )
            con.execute(f'CREATE TEMP VIEW "{_ident(table)}" AS {union}')
        for name, sql in catalog_views().items():
            try:
                con.execute(f'CREATE TEMP VIEW "{name}" AS {sql}')
            except duckdb.Error:  # catalogs from before the tables it reads: the view is left out
                pass
    _set_run_variables(con, names, dbs)
    con.execute("SET enable_external_access = false")  # only the attached catalogs stay readable
    for name, (_, sql) in VIEWS.items():
        try:
            con.execute(f'CREATE TEMP VIEW "{name}" AS {sql}')
        except duckdb.Error:  # a catalog from before the tables it reads: the view is left out
            pass
    con.execute("SET lock_configuration = true")  # a query cannot switch file access back on


def recipe_settings(db: Path, section: str) -> dict:
    """A section of the resolved recipe a run wrote beside its catalog ({} for a catalog without one)."""
    import yaml

    recipe = Path(db).with_name("recipe.yaml")  # flows/run_folder.py's RECIPE_FILE
    return ((yaml.safe_load(recipe.read_text()) or {}).get(section) or {}) if recipe.is_file() else {}


def _set_run_variables(con: duckdb.DuckDBPyConnection, names: list[str], dbs: list[Path]) -> None:
    """The session variables the views read, after refusing two catalogs that hold one run name (every view tells
    runs apart by their `run` column): pass_rubric_scores, each run name -> the eval.pass_rubric_score of the recipe
    beside its catalog; copied_steps, the steps of a fork that another catalog of the session holds too."""
    current = con.execute("SELECT current_database()").fetchone()[0]
    holder: dict[str, Path] = {}
    scores: dict[str, float] = {}
    for index, db in enumerate(dbs):
        runs = _catalog_runs(con, current if index == 0 else names[index])
        for run in sorted(runs):
            if run in holder:
                raise CatalogError(
                    f"{holder[run]} and {db} both hold run {run!r} (run.name): a session tells runs apart by their "
                    "names, so query these one at a time"
                )
            holder[run] = db
        score = recipe_settings(db, "eval").get("pass_rubric_score")
        if score is not None:
            scores.update((run, float(score)) for run in runs)
    con.execute(
        "SET VARIABLE pass_rubric_scores = MAP(?::VARCHAR[], ?::DOUBLE[])", [list(scores), list(scores.values())]
    )
    con.execute("SET VARIABLE copied_steps = ?::STRUCT(run VARCHAR, lo BIGINT, hi BIGINT)[]", [copied_steps(dbs)])


def _catalog_runs(con: duckdb.DuckDBPyConnection, catalog: str) -> set[str]:
    runs: set[str] = set()
    for table in ("steps", "rewards", "judge_anchors"):
        try:
            runs.update(
                r for (r,) in con.execute(f'SELECT DISTINCT run FROM "{_ident(catalog)}".main.{table}').fetchall()
            )
        except duckdb.CatalogException:  # a catalog from before the table
            pass
    return runs


def copied_steps(dbs: list[Path]) -> list[dict]:
    """[{run, lo, hi}]: the steps [lo, hi) of a fork's run whose rollouts another catalog of the session holds too.
    A fork's stage served from an ancestor's cache hard-links the ancestor's files (refiner_core.store.forks.adopt),
    so a step is a copy where the fork's rollouts file of that step is the file an ancestor in the session holds, or
    one a fork listed before it holds (two forks of one parent). prompt_difficulty counts each such step once."""
    folders = [str(db.parent.resolve()) for db in dbs]
    files = {folder: rollout_files(folder) for folder in folders}
    lineage = {folder: {str(Path(a).resolve()) for a, _ in ancestors(folder)} for folder in folders}
    copied = []
    for index, folder in enumerate(folders):
        fork = read_fork(folder)
        if fork is None:
            continue
        own, dropped = files[folder], set()
        for position, other in enumerate(folders):
            if other in lineage[folder]:
                # up to the fork step, a file the fork lacks is the ancestor's: its catalog read that file where no
                # hard link could be made (another file system)
                dropped |= {
                    step
                    for step, file in files[other].items()
                    if own.get(step) == file or (step not in own and step <= fork.at)
                }
            elif position < index and folder not in lineage[other]:  # listed before it, and no fork of it
                dropped |= {step for step, file in files[other].items() if own.get(step) == file}
        copied += [{"run": fork.run, "lo": lo, "hi": hi} for lo, hi in _ranges(dropped)]
    return copied


def _ranges(steps: set[int]) -> list[tuple[int, int]]:
    ranges: list[tuple[int, int]] = []
    for step in sorted(steps):
        if ranges and ranges[-1][1] == step:
            ranges[-1] = (ranges[-1][0], step + 1)
        else:
            ranges.append((step, step + 1))
    return ranges


def check_read_only(con: duckdb.DuckDBPyConnection, sql: str) -> None:
    """Raise QueryRefused unless every statement of SQL is a SELECT (SHOW, DESCRIBE, SUMMARIZE, and PIVOT with
    an IN list, are) or an EXPLAIN of one; CatalogError when it holds none. A syntax error is raised as DuckDB
    reports it."""
    statements = con.extract_statements(sql)
    if not statements:
        raise CatalogError("no SQL statement given: the query is empty or only comments")
    for statement in statements:
        kind = _statement_kind(statement)
        if kind == duckdb.StatementType.SELECT or _explains_a_select(con, statement, kind):
            continue
        text, name = " ".join(statement.query.split()), kind.name if kind else "a statement of an unnamed kind"
        raise QueryRefused(
            f"refused: the catalog is read-only and only SELECT statements run (SHOW, DESCRIBE, "
            f"SUMMARIZE and EXPLAIN SELECT too), not {name}: "
            f"{text[:80]}{'…' if len(text) > 80 else ''}"
        )


def _statement_kind(statement) -> duckdb.StatementType | None:
    """The statement's kind; None for a kind DuckDB's Python API cannot name (`UPDATE EXTENSIONS`: '29 is not a
    valid StatementType'), which is refused like any other write."""
    try:
        return statement.type
    except ValueError:
        return None


_EXPLAIN = re.compile(r"EXPLAIN\s+(ANALYZE\s+)?", re.IGNORECASE)


def _explains_a_select(con: duckdb.DuckDBPyConnection, statement, kind: duckdb.StatementType | None) -> bool:
    # EXPLAIN ANALYZE runs what it explains: only a plain SELECT may follow. Options such as
    # `EXPLAIN (FORMAT json)` are not read, so such statements are refused.
    prefix = _EXPLAIN.match(statement.query) if kind == duckdb.StatementType.EXPLAIN else None
    if prefix is None:
        return False
    try:
        explained = con.extract_statements(statement.query[prefix.end() :])
    except duckdb.Error:
        return False
    return len(explained) == 1 and _statement_kind(explained[0]) == duckdb.StatementType.SELECT


def _ident(text: str) -> str:
    return text.replace('"', '""')


def run_query(con: duckdb.DuckDBPyConnection, sql: str) -> tuple[list[str], list[tuple]]:
    """Columns and rows of SQL's last statement; QueryRefused for anything but SELECT statements."""
    check_read_only(con, sql)
    cur = con.execute(sql)
    columns = [d[0] for d in cur.description] if cur.description else []
    return columns, cur.fetchall()


def export(con: duckdb.DuckDBPyConnection, sql: str, path: str | Path) -> int:
    """Write the query's result to PATH (.parquet or .csv); returns the row count."""
    path = Path(path)
    if path.suffix not in (".parquet", ".csv"):
        raise CatalogError(f"--export {path}: the file name must end in .parquet or .csv")
    check_read_only(con, sql)
    relation = con.sql(sql)
    if relation is None:
        raise CatalogError("--export needs a query that returns rows (a SELECT)")
    table: pa.Table = relation.to_arrow_table()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file on the way, no permission
        raise CatalogError(f"--export {path}: cannot make its folder ({e.strerror}: {e.filename})") from None
    tmp = path.with_name(path.name + ".tmp")
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            pq.write_table(table, tmp)
        else:
            import pyarrow.csv as pcsv

            pcsv.write_csv(table, tmp)
        tmp.replace(path)
    except pa.ArrowException as e:  # a type the format cannot hold: lists in CSV, intervals in either
        nested = [f'"{_ident(f.name)}"' for f in table.schema if pa.types.is_nested(f.type)]
        hint = "select such columns as text: CAST(column AS VARCHAR)"
        if path.suffix == ".csv" and nested:
            hint = f"a CSV file holds no lists or structs ({', '.join(nested)}): write a .parquet file, or {hint}"
        raise CatalogError(f"--export {path}: {e}; {hint}") from None
    except OSError as e:  # a folder at PATH, no permission, a full disk
        raise CatalogError(f"--export {path}: cannot write it ({e.strerror or e})") from None
    finally:  # a write that failed leaves no temporary file beside the export
        tmp.unlink(missing_ok=True)
    return table.num_rows


SHOW_STEPS = (
    "SELECT step, round(reward_mean, 3) AS reward, round(reward_std, 3) AS std, round(kl, 5) AS kl, "
    "round(loss, 4) AS loss, round(response_length_mean, 1) AS length, round(rollout_seconds, 1) AS "
    "rollout_s, round(judge_seconds, 1) AS judge_s, round(update_seconds, 1) AS update_s FROM steps "
    "ORDER BY step"
)
# Settings that may move from step to step, by what `refiner show` calls them: (steps column, its query).
SHOW_MOVING = {
    # a NaN is no setting (NaN != NaN: a constant NaN read as moving)
    "learning rate": ("lr", "SELECT step, lr FROM steps WHERE lr IS NOT NULL AND NOT isnan(lr) ORDER BY step"),
    "entropy coefficient": (
        "entropy_coef",
        "SELECT step, entropy_coef FROM steps WHERE entropy_coef IS NOT NULL AND NOT isnan(entropy_coef) ORDER BY step",
    ),
}
SHOW_EXTREMES = (
    "WITH r AS (SELECT step, prompt_id, sample_idx, reward FROM rewards WHERE reward_version = 'train') "
    "SELECT r.step, r.prompt_id, r.sample_idx, round(r.reward, 3) AS reward, o.response_text "
    "FROM r JOIN rollouts o USING (step, prompt_id, sample_idx) WHERE r.step = (SELECT max(step) FROM r) "
    "ORDER BY r.reward DESC, r.prompt_id, r.sample_idx"
)


SHOW_JUDGE_COST = (
    "SELECT count(*) AS steps, sum(judge_requests) AS requests, sum(judge_prompt_tokens) AS prompt_tokens, "
    "sum(judge_completion_tokens) AS completion_tokens, sum(judge_cost_usd) AS cost_usd FROM steps"
)
# the judging outside the steps' rollouts: held-out evaluations and the judge's anchors
SHOW_JUDGE_BEYOND_STEPS = (
    "SELECT count(*) AS stages, sum(requests) AS requests, sum(prompt_tokens) AS prompt_tokens, "
    "sum(completion_tokens) AS completion_tokens, sum(cost_usd) AS cost_usd, "
    "string_agg(DISTINCT stage, ', ' ORDER BY stage) AS stage_names FROM judge_spend WHERE stage <> 'judge'"
)
SHOW_MONITORS = (
    "SELECT step, monitor, round(value, 3) AS value, threshold, action, outcome, detail FROM monitor_events "
    "ORDER BY step, monitor"
)


def run_summary(con: duckdb.DuckDBPyConnection) -> dict:
    """Steps (reward, KL, loss, length, stage seconds), the settings that may move per step ('moving': {name:
    (steps column, (step, value) rows)}, SHOW_MOVING), the best and worst rollout of the last step, the judge's cost
    over the steps ('judge': None for a catalog without it) and beyond them ('judge_beyond_steps': held-out
    evaluations and anchors; None for a catalog without judge_spend) and the monitors that tripped."""
    columns, rows = run_query(con, SHOW_STEPS)
    moving = {name: (column, _rows(con, sql)) for name, (column, sql) in SHOW_MOVING.items()}
    _, ranked = run_query(con, SHOW_EXTREMES)
    extremes = {}
    if ranked:
        keys = ("step", "prompt_id", "sample_idx", "reward", "response_text")
        extremes = {"best": dict(zip(keys, ranked[0])), "worst": dict(zip(keys, ranked[-1]))}
    return {
        "columns": columns,
        "steps": rows,
        "moving": moving,
        **extremes,
        "judge": _optional(con, SHOW_JUDGE_COST),
        "judge_beyond_steps": _optional(con, SHOW_JUDGE_BEYOND_STEPS),
    }


def _rows(con: duckdb.DuckDBPyConnection, sql: str) -> list[tuple]:
    """The rows of SQL; none when the catalog predates a column it reads."""
    try:
        return run_query(con, sql)[1]
    except duckdb.BinderException:  # a catalog from before steps.entropy_coef
        return []


def _optional(con: duckdb.DuckDBPyConnection, sql: str) -> dict | None:
    """The one row of SQL as a dict; None when the catalog predates what it reads."""
    try:
        columns, rows = run_query(con, sql)
    except (duckdb.BinderException, duckdb.CatalogException):  # a catalog from before the judge ledger
        return None
    return dict(zip(columns, rows[0])) if rows else None


def monitor_events(con: duckdb.DuckDBPyConnection) -> tuple[list[str], list[tuple]]:
    """The monitors that tripped, every step ([] for a catalog from before them)."""
    try:
        return run_query(con, SHOW_MONITORS)
    except duckdb.CatalogException:
        return [], []


def fork_origin(con: duckdb.DuckDBPyConnection) -> str | None:
    """A line naming the run's parent and fork step when the run is a fork (`refiner fork`); None otherwise, and for
    catalogs from before forks."""
    try:
        rows = con.execute(
            "SELECT parent_run, parent_dir, fork_step, settings, shares_steps, note FROM forks ORDER BY run"
        ).fetchall()
    except duckdb.CatalogException:
        return None
    lines = []
    for parent, parent_dir, at, settings, shares, note in rows:
        changed = settings or "no setting changed"
        if shares:
            lines.append(
                f"fork of {parent} ({parent_dir}) at step {at}: steps 0-{at - 1} are {parent}'s, "
                f"steps from {at} ran with {changed}"
                if at
                else f"fork of {parent} ({parent_dir}) with {changed}"
            )
        else:
            lines.append(f"forked from {parent} ({parent_dir}) with {changed}; it shares no step with it")
        if note:
            lines.append(f"  note: {note}")
    return "\n".join(lines) or None
