"""What a run quarantined, reported: counts per stage and reason from its catalog, and the end-of-run warning."""

from __future__ import annotations

import shlex
from pathlib import Path

from refiner_core.store.storage import query


def quarantine_counts(catalog: Path | str) -> dict[tuple[str, str], int]:
    """Rows in a run catalog's quarantine table per (stage, reason), e.g. {('prepare', 'non_utf8'): 2}."""
    _, rows = query(catalog, "SELECT stage, reason, count(*) FROM quarantine GROUP BY ALL ORDER BY ALL")
    return {(stage, reason): n for stage, reason, n in rows}


def quarantine_warning(run_dir: Path | str) -> str | None:
    """The end-of-run warning when the run's catalog holds quarantined rows (how many, per stage and reason, and
    how to see them); None when no row was quarantined."""
    catalog = Path(run_dir) / "catalog.duckdb"
    counts = quarantine_counts(catalog) if catalog.is_file() else {}
    if not counts:
        return None
    stages: dict[str, list[str]] = {}
    for (stage, reason), n in counts.items():
        stages.setdefault(stage, []).append(f"{reason} {n}")
    by_stage = "; ".join(f"{stage}: {', '.join(reasons)}" for stage, reasons in stages.items())
    return (
        f"{sum(counts.values())} rows quarantined ({by_stage}); see them: "
        f"{shlex.join(['refiner', 'sql', str(run_dir), 'SELECT * FROM quarantine'])}"
    )
