"""The difficulty ledger taken back into a run: earlier runs' prompt_difficulty (refiner_core.publish.run_sql) drops
the prompts they always or never solved from the training split (data.skip_solved_from) and weights how often the
others are drawn (data.weights_from)."""

from __future__ import annotations

from pathlib import Path

from refiner_core.publish.run_sql import CatalogError, catalog_path, open_runs, run_query

MIN_WEIGHT = 0.05  # a prompt every rollout solved (or none did) is still drawn now and then


def ledger_catalogs(run_dirs: list[str]) -> list[str]:
    """The catalog files of the ledger's run folders (FileNotFoundError, not retried, when one has none)."""
    try:
        return [str(catalog_path(d)) for d in run_dirs]
    except CatalogError as e:
        raise FileNotFoundError(f"difficulty ledger: {e}") from None


def prompt_ledger(catalogs: list[str]) -> dict[str, dict]:
    """prompt_id -> its prompt_difficulty row over the given catalogs."""
    if not catalogs:
        return {}
    con = open_runs([Path(c) for c in catalogs])
    try:
        columns, rows = run_query(
            con,
            "SELECT prompt_id, runs, rollouts, solved, pass_rate, always_solved, never_solved FROM prompt_difficulty",
        )
    finally:
        con.close()
    return {r[0]: dict(zip(columns, r)) for r in rows}


def prompt_weight(pass_rate: float) -> float:
    """4 p (1 - p): 1 for a prompt solved half the time (the most spread in a group's rewards), MIN_WEIGHT at least."""
    return max(4 * pass_rate * (1 - pass_rate), MIN_WEIGHT)


def select_prompts(
    run: str,
    train_ids: list[str],
    skip_ledger: dict[str, dict],
    weight_ledger: dict[str, dict],
    sources: str,
    twin_of: dict[str, str | None] | None = None,
) -> tuple[list[str], dict[str, float], list[dict]]:
    """(training prompts kept, their weights (empty without a weight ledger), prompt_selection rows). A twin pair
    (`twin_of`: a question's two views, one unit of the schedule) is skipped only when both views are: a view left
    alone could never get its pseudo-label."""
    twin_of = twin_of or {}
    reasons = {prompt: _skip_reason(skip_ledger.get(prompt)) for prompt in train_ids}
    kept, weights, rows = [], {}, []
    for prompt in train_ids:
        skipped = reasons[prompt]
        if skipped is not None and reasons.get(twin_of.get(prompt), skipped) is None:
            skipped = None  # its twin stays, so it does
        seen = weight_ledger.get(prompt) or skip_ledger.get(prompt)
        weight = None
        if skipped is None:
            kept.append(prompt)
            if weight_ledger:
                entry = weight_ledger.get(prompt)
                weight = weights[prompt] = prompt_weight(entry["pass_rate"]) if entry else 1.0
        rows.append(
            {
                "run": run,
                "prompt_id": prompt,
                "ledger_runs": sources,
                "ledger_rollouts": seen["rollouts"] if seen else 0,
                "ledger_pass_rate": seen["pass_rate"] if seen else None,
                "skipped": skipped,
                "weight": weight,
            }
        )
    return kept, weights, rows


def _skip_reason(entry: dict | None) -> str | None:
    if entry is None:
        return None
    return "always solved" if entry["always_solved"] else "never solved" if entry["never_solved"] else None
