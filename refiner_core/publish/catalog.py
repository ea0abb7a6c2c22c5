"""The run's DuckDB catalog: every schema table filled from the run's Parquet files, and the views over them that
recompute rewards by the one reward definition (rewards.REWARD_SQL). Above storage.py (files and DuckDB I/O) and
rewards.py, which know nothing of it."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from refiner_core.publish.monitors import monitor_views
from refiner_core.reward.compose import REWARD_SQL, STEP_INPUTS_HASH_SQL
from refiner_core.schema import ALL_TABLES, duckdb_ddl, to_arrow
from refiner_core.store.storage import catalog_copy, insert_parquet


def build_catalog(
    db_path: Path,
    parquet_files: dict[str, Iterable[Path]],
    judge_price: tuple[float, float] | None = None,
    run: str | None = None,
    rows: dict | None = None,
) -> dict[str, int]:
    """(Re)build the DuckDB catalog from the run's Parquet files, atomically. Returns row counts per table.

    Every table of the schema exists, even when empty, so queries never fail on a missing table. `judge_price`
    (dollars per million prompt and completion tokens) prices each step's judge tokens into steps.judge_cost_usd
    and each judging stage's into judge_spend.cost_usd; without it, or with both prices 0 (the recipe's default:
    none set), they stay NULL, not priced.
    `run`: the run column of every file's rows is this name (a fork's catalog: the steps it shares are its parent's
    files, written under the parent's name). `rows`: rows to add besides the files, by table name.
    """
    unknown = sorted(set(parquet_files) - set(ALL_TABLES))
    if unknown:  # rows the catalog would leave out without a word: a new table not yet in the schema
        raise ValueError(
            f"catalog: files of {unknown} name no table of refiner_core/schema.py (ALL_TABLES); add each table there"
        )
    counts: dict[str, int] = {}
    with catalog_copy(db_path, from_existing=False) as con:
        for name, table in ALL_TABLES.items():
            con.execute(duckdb_ddl(table))
            files = [str(p) for p in parquet_files.get(name, ())]
            missing = [f for f in files if not Path(f).exists()]
            if missing:  # never publish a catalog that silently lacks rows
                raise FileNotFoundError(f"catalog table {name!r}: missing {missing[:3]}; rerun with --refresh")
            if files:  # by name: files written before a column existed (rollouts.round) leave it NULL
                insert_parquet(con, name, files, run if "run" in table.column_names else None)
            if rows and rows.get(name):
                con.register("added_rows", to_arrow(table, rows[name]))
                con.execute(f'INSERT INTO "{name}" BY NAME SELECT * FROM added_rows')
                con.unregister("added_rows")
            counts[name] = con.execute(f'SELECT count(*) FROM "{name}"').fetchone()[0]
        if judge_price is not None and any(judge_price):
            for sql in _PRICE_JUDGE_TOKENS:
                con.execute(sql, list(judge_price))
        for name, sql in catalog_views().items():
            con.execute(f'CREATE VIEW "{name}" AS {sql}')
    return counts


def catalog_views() -> dict[str, str]:
    """The catalog's views, name -> SELECT, in the order they are created (a view may read the ones before it).
    `refiner sql` over several runs defines them again over the runs' tables together."""
    return {"rewards_recomputed": _REWARD_RECOMPUTE_VIEW, "step_rewards": _STEP_REWARDS_VIEW, **monitor_views()}


# Judge tokens at the recipe's prices (dollars per million tokens): each step's rollout judging, each judging stage.
_PRICE_JUDGE_TOKENS = (
    """
UPDATE steps SET judge_cost_usd = (coalesce(judge_prompt_tokens, 0) * ? + coalesce(judge_completion_tokens, 0) * ?)
                                  / 1e6
""",
    "UPDATE judge_spend SET cost_usd = (prompt_tokens * ? + completion_tokens * ?) / 1e6",
)


# rewards_recomputed: every reward version recomputed by the one reward definition from the stored inputs: equals
# rewards.reward.
_REWARD_RECOMPUTE_VIEW = f"""
SELECT run, step, prompt_id, sample_idx, reward_version, recomputed.reward AS reward_sql, stored.reward
FROM ({REWARD_SQL}) recomputed
JOIN rewards stored USING (run, step, prompt_id, sample_idx, reward_version)
"""

# step_rewards: the reward figures of `steps`, per reward version: training's and each rescore's, side by side
# (advantage_abs_mean, as steps', over the rollouts not dropped: a dropped one's advantage is a stored 0).
# `stale`: a rescore version computed from rows that a later run of the folder replaced (NULL: a version that recorded
# none).
_STEP_REWARDS_VIEW = f"""
WITH figures AS (
  SELECT run, step, reward_version, avg(r.reward) AS reward_mean, stddev_pop(r.reward) AS reward_std,
         avg(abs(a.advantage)) FILTER (WHERE NOT coalesce(r.dropped, false)) AS advantage_abs_mean,
         count(*) AS rollouts,
         count(*) FILTER (WHERE a.trained) AS trained_rollouts, count(*) FILTER (WHERE r.dropped) AS dropped_rollouts
  FROM rewards r LEFT JOIN advantages a USING (run, step, prompt_id, sample_idx, reward_version)
  GROUP BY run, step, reward_version
), current_inputs AS ({STEP_INPUTS_HASH_SQL})
SELECT f.*, CASE WHEN f.reward_version = 'train' THEN false WHEN v.reward_version IS NULL THEN NULL
                 ELSE v.inputs_hash IS DISTINCT FROM c.inputs_hash END AS stale
FROM figures f LEFT JOIN rescores v USING (run, step, reward_version) LEFT JOIN current_inputs c USING (run, step)
"""
