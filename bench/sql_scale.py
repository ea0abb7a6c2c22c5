"""`refiner sql` at scale: a synthetic catalog of many rollouts (default 1 M, with 10 judge scores each), then the
time of every query of docs/catalog.md and predefined view, as opened by `refiner sql` (read-only, file access off).

Each query's time is also given as a ratio to a baseline measured in the same command, a hash aggregation of
all rollouts by prompt (`SELECT prompt_id, count(*) FROM rollouts GROUP BY prompt_id`), so figures from machines
of different speeds and loads compare. Target: every view under 1 s at 1 M rollouts.

    .venv/bin/python bench/sql_scale.py                     # 1 M rollouts, 10 M judge scores
    .venv/bin/python bench/sql_scale.py --rollouts 100000   # a quick look
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import duckdb

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from refiner_core.publish.run_sql import VIEWS, open_runs  # noqa: E402
from refiner_core.schema import ALL_TABLES, duckdb_ddl  # noqa: E402

BASELINE = "SELECT prompt_id, count(*) FROM rollouts GROUP BY prompt_id"
DOCUMENTED_QUERIES = {
    "steps": "SELECT step, round(reward_mean, 3) AS reward, round(kl, 5) AS kl, response_length_mean FROM steps "
    "ORDER BY step",
    "rubrics by source": "SELECT r.source, r.title, round(avg(s.oriented_score), 3) AS mean, count(*) FILTER "
    "(WHERE s.failure IS NOT NULL) AS failed FROM judge_scores s JOIN rubrics r USING (run, "
    "prompt_id, rubric_id) GROUP BY ALL ORDER BY 1, 2",
    "lowest rubrics": "SELECT prompt_id, rubric_id, round(avg(oriented_score), 3) AS mean FROM judge_scores "
    "GROUP BY ALL ORDER BY mean LIMIT 10",
    "best rollouts": "SELECT w.prompt_id, w.sample_idx, round(w.reward, 3) AS reward, left(o.response_text, 60) AS "
    "response FROM rewards w JOIN rollouts o USING (run, step, prompt_id, sample_idx) WHERE "
    "w.step = 0 AND w.reward_version = 'train' ORDER BY w.reward DESC LIMIT 5",
    "verifiers": "SELECT verifier, verify_method, count(*) AS n, avg(correct) AS accuracy FROM rewards GROUP BY ALL",
    "quarantine": "SELECT reason, count(*) FROM quarantine GROUP BY reason",
}


def build(db: Path, rollouts: int, scores_per_rollout: int, steps: int, samples: int) -> dict[str, int]:
    """Every table of the schema, the big ones filled with seeded pseudo-random rows."""
    prompts = max(1, rollouts // (steps * samples))
    con = duckdb.connect(str(db))
    con.execute("SELECT setseed(0.42)")
    for table in ALL_TABLES.values():
        con.execute(duckdb_ddl(table))
    con.execute(f"""INSERT INTO steps BY NAME SELECT 'bench' AS run, s AS step, random() AS reward_mean,
        random() AS reward_std, random() / 100 AS kl, random() AS loss, 100 + 50 * random() AS response_length_mean,
        30 * random() AS rollout_seconds, 10 * random() AS judge_seconds, 40 * random() AS update_seconds
        FROM range({steps}) t(s)""")
    con.execute(f"""INSERT INTO prompts BY NAME SELECT 'bench' AS run, 'p' || p AS prompt_id, 'train' AS split,
        'question ' || p AS question FROM range({prompts}) t(p)""")
    con.execute(f"""INSERT INTO rubrics BY NAME SELECT 'bench' AS run, 'p' || p AS prompt_id, 'r' || k AS rubric_id,
        CASE WHEN k < 7 THEN 'instance' ELSE 'static' END AS source, 'Rubric ' || k AS title, 1.0 AS weight
        FROM range({prompts}) a(p), range({scores_per_rollout}) b(k)""")
    con.execute(f"""CREATE TEMP TABLE keys AS SELECT i // ({prompts} * {samples}) AS step,
        'p' || ((i // {samples}) % {prompts}) AS prompt_id, i % {samples} AS sample_idx,
        (20 + 280 * random())::INT AS tokens FROM range({steps * prompts * samples}) t(i)""")
    con.execute("""INSERT INTO rollouts BY NAME SELECT 'bench' AS run, step, prompt_id, sample_idx,
        repeat('claim ', tokens // 8) AS response_text, tokens AS response_tokens,
        CASE WHEN tokens > 290 THEN 'length' ELSE 'stop' END AS finish_reason FROM keys""")
    con.execute(f"""INSERT INTO judge_scores BY NAME SELECT 'bench' AS run, step, prompt_id, sample_idx,
        'r' || k AS rubric_id, (floor(3 * random()) / 2) AS oriented_score,
        CASE WHEN random() < 0.01 THEN 'http_503: busy' END AS failure FROM keys, range({scores_per_rollout}) b(k)""")
    con.execute("""INSERT INTO reward_inputs BY NAME SELECT 'bench' AS run, step, prompt_id, sample_idx,
        random() < 0.9 AS has_answer, random() < 0.8 AS format_ok, (5 * random())::INT AS n_citations,
        (random() < 0.1)::INT AS n_invalid_citations, random() AS citation_valid_fraction FROM keys""")
    con.execute("""INSERT INTO rewards BY NAME SELECT 'bench' AS run, step, prompt_id, sample_idx,
        'train' AS reward_version, 'judge' AS verifier, 10 * random() AS reward FROM keys""")
    con.execute("""INSERT INTO quarantine BY NAME SELECT 'bench' AS run, 'prepare' AS stage, 'data.jsonl' AS source,
        'line ' || i AS row_ref, CASE WHEN i % 3 = 0 THEN 'control_characters' ELSE 'invalid_json' END AS reason
        FROM range(1000) t(i)""")
    counts = {
        t: con.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0]
        for t in ("rollouts", "judge_scores", "rewards", "rubrics", "steps")
    }
    con.close()
    return counts


def timed(con, sql: str, repeats: int) -> float:
    """Median wall time of the query, its result fetched."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        con.execute(sql).fetchall()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=1_000_000)
    parser.add_argument("--scores-per-rollout", type=int, default=10, help="judge scores (rubrics) per rollout")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to build the catalog (default: a temp dir)")
    args = parser.parse_args()
    folder = args.dir or Path(tempfile.mkdtemp(prefix="sql-scale-"))
    folder.mkdir(parents=True, exist_ok=True)
    db = folder / "catalog.duckdb"
    db.unlink(missing_ok=True)
    t0 = time.perf_counter()
    counts = build(db, args.rollouts, args.scores_per_rollout, args.steps, args.samples)
    print(
        f"catalog {db}: {', '.join(f'{v:,} {k}' for k, v in counts.items())}; built in "
        f"{time.perf_counter() - t0:.1f} s, {db.stat().st_size / 2**20:.0f} MiB"
    )
    t0 = time.perf_counter()
    con = open_runs([folder])
    print(f"opened as `refiner sql` does (read-only, views defined) in {time.perf_counter() - t0:.3f} s")
    threads = con.execute("SELECT current_setting('threads')").fetchone()[0]
    base = timed(con, BASELINE, args.repeats)
    print(f"baseline ({BASELINE}): {base:.3f} s; DuckDB threads: {threads}\n")
    print(f"{'query':<24} {'seconds':>8} {'x baseline':>11}")
    worst = 0.0
    for name, sql in [*DOCUMENTED_QUERIES.items(), *((f"view {v}", f'SELECT * FROM "{v}"') for v in VIEWS)]:
        seconds = timed(con, sql, args.repeats)
        if name.startswith("view"):
            worst = max(worst, seconds)
        print(f"{name:<24} {seconds:8.3f} {seconds / base:11.1f}")
    con.close()
    print(f"\nslowest view: {worst:.3f} s ({'within' if worst < 1 else 'over'} the 1 s target)")


if __name__ == "__main__":
    main()
