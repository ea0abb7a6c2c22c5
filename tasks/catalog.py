from __future__ import annotations

import shlex
from pathlib import Path

from prefect import get_run_logger, task

from refiner_core.data.rows import Rejection, TooManyRejected, check_rejected_fraction
from refiner_core.publish.catalog import build_catalog
from refiner_core.store.faults import stage_fault
from refiner_core.store.forks import fork_rows, read_fork


@task(name="publish-catalog", cache_policy=None, persist_result=False, retries=1)
def publish_catalog(
    *, run_dir: str, run: str, manifests: list[dict], judge_price: tuple[float, float] | None = None
) -> dict:
    """Rebuild runs/<run>/catalog.duckdb from the Parquet files named in this run's manifests, with what each
    judging stage spent (judge_spend, from its manifest); `judge_price` (judge.price_per_mtok_in / _out) prices
    the judge tokens.

    Not cached: it is cheap and always reflects exactly the files of the current invocation."""
    stage_fault("publish-catalog", None, Path(run_dir) / ".faults")
    files: dict[str, list[str]] = {}
    for manifest in manifests:
        for table, entry in manifest.items():
            if isinstance(entry, dict) and "path" in entry and str(entry["path"]).endswith(".parquet"):
                files.setdefault(table, []).append(entry["path"])
    for path in sorted(Path(run_dir).glob("rescores/*/step=*/*.parquet")):  # `refiner rescore` versions
        files.setdefault(path.stem, []).append(str(path))
    for path in sorted(Path(run_dir).glob("monitors/step=*/monitor_events.parquet")):  # the monitors' findings
        files.setdefault(path.stem, []).append(str(path))
    for path in sorted(Path(run_dir).glob("judge_checks/*/*.parquet")):  # `refiner judge agreement` checks
        files.setdefault(path.stem, []).append(str(path))
    db = Path(run_dir) / "catalog.duckdb"
    fork = read_fork(run_dir)  # a fork's catalog: every row is the fork's, its origin in `forks`
    rows = {"judge_spend": judge_spend_rows(run, manifests), "forks": fork_rows(fork) if fork else []}
    counts = build_catalog(db, files, judge_price, run=fork.run if fork else None, rows=rows)
    get_run_logger().info("catalog %s: %s", db, ", ".join(f"{k}={v}" for k, v in counts.items()))
    return {"catalog": str(db), "counts": counts}


def judge_spend_rows(run: str, manifests: list[dict]) -> list[dict]:
    """A judge_spend row per judging stage among the manifests (those reporting `judge_usage`)."""
    rows = {}
    for manifest in manifests:
        usage = manifest.get("judge_usage")
        if usage is None:
            continue
        row = {
            "run": run,
            "stage": manifest["stage"],
            "step": usage["step"],
            "round": usage.get("round", 0),
            "phase": usage.get("phase", ""),
            "requests": usage["requests"],
            "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"],
            "unknown": usage.get("unknown"),
            "cost_usd": None,  # priced by build_catalog
        }
        rows[(row["stage"], row["step"], row["round"], row["phase"])] = row  # a stage called twice: one cost
    return list(rows.values())


def publish_quarantine(run_dir: str, manifests: list[dict]) -> str:
    """Called when a stage fails on too many rejected rows: a catalog holding at least the quarantine, so
    `refiner sql RUN_DIR "SELECT * FROM quarantine"` shows which rows and why."""
    files = [m["quarantine"]["path"] for m in manifests if isinstance(m.get("quarantine"), dict)]
    db = Path(run_dir) / "catalog.duckdb"
    build_catalog(db, {"quarantine": files})
    return str(db)


def fail_if_too_many_rejected(
    run_dir: str,
    manifests: list[dict],
    rejected: list[Rejection],
    total: int,
    max_fraction: float,
    n_rejected: int | None = None,
) -> None:
    """check_rejected_fraction for a stage: on failure, publish the quarantine first and say how to query it.
    The last manifest is the failing stage's own (its quarantine file is named in the message)."""
    try:
        check_rejected_fraction(rejected, total, max_fraction, manifests[-1]["quarantine"]["path"], n_rejected)
    except TooManyRejected as e:
        raise TooManyRejected(
            f"{e} Query it: {shlex.join(['refiner', 'sql', str(run_dir), 'SELECT * FROM quarantine'])}; catalog "
            f"{publish_quarantine(run_dir, manifests)}"
        ) from None
