from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task

from refiner_core.storage import build_catalog


@task(name="publish-catalog", cache_policy=None, persist_result=False, retries=1)
def publish_catalog(*, run_dir: str, manifests: list[dict]) -> dict:
    """Rebuild runs/<run>/catalog.duckdb from the Parquet files named in this run's manifests.

    Not cached: it is cheap and always reflects exactly the files of the current invocation."""
    files: dict[str, list[str]] = {}
    for manifest in manifests:
        for table, entry in manifest.items():
            if isinstance(entry, dict) and "path" in entry and str(entry["path"]).endswith(".parquet"):
                files.setdefault(table, []).append(entry["path"])
    db = Path(run_dir) / "catalog.duckdb"
    counts = build_catalog(db, files)
    get_run_logger().info("catalog %s: %s", db, ", ".join(f"{k}={v}" for k, v in counts.items()))
    return {"catalog": str(db), "counts": counts}


def publish_quarantine(run_dir: str, manifests: list[dict]) -> str:
    """Called when a stage fails on too many rejected rows: a catalog holding at least the quarantine, so
    `refiner sql RUN_DIR "SELECT * FROM quarantine"` shows which rows and why."""
    files = [m["quarantine"]["path"] for m in manifests if isinstance(m.get("quarantine"), dict)]
    db = Path(run_dir) / "catalog.duckdb"
    build_catalog(db, {"quarantine": files})
    return str(db)
