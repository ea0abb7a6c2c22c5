"""`refiner judge agreement`: a run's stored judgments checked against another judge or a person's labels.

Another judge (`--judge-config FILE`: a recipe fragment whose `judge:` section is laid over the run's) re-judges
every rubric of a seeded sample of the run's stored rollouts, with the same judge prompts training used; labels
(`--labels FILE`, JSONL, CSV or TSV: step, prompt_id, sample_idx, rubric_id and `passed` and/or `score`, an oriented
score in [0, 1]) give the second opinion themselves. The pairs go to RUN_DIR/judge_checks/NAME/judge_checks.parquet,
the agreement per rubric group (refiner_core.eval.judge_checks) to judge_agreement.parquet, both into the catalog.
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import duckdb
import yaml

from refiner_core.config import ConfigError, JudgeConfig, load_recipe, moved_to_sections, recipe_from_dict
from refiner_core.eval.judge_checks import (
    SecondOpinion,
    agreement_rows,
    check_rows,
    rejudge,
    rubric_group,
    sample_keys,
)
from refiner_core.publish.run_sql import catalog_path
from refiner_core.schema import JUDGE_AGREEMENT, JUDGE_CHECKS
from refiner_core.store.storage import folder_name, folder_name_problem, json_hash, query, replace_rows, write_table

CHECKS_DIR = "judge_checks"


class AgreementError(ValueError):
    """A check that cannot run as asked: no catalog, a bad judge config or labels file."""


@dataclass
class Check:
    name: str
    other: str
    agreement: list[dict]
    pairs: int
    rollouts: int
    folder: str


def _stored(db: Path) -> list[dict]:
    try:
        columns, rows = query(
            db,
            "SELECT s.run, s.step, s.prompt_id, s.sample_idx, s.rubric_id, s.oriented_score, r.source, r.title, "
            "r.kind FROM judge_scores s JOIN rubrics r USING (run, prompt_id, rubric_id) "
            "ORDER BY s.step, s.prompt_id, s.sample_idx, s.rubric_id",
        )
    except duckdb.Error as e:  # not a DuckDB file, one another process holds open for writing, no such table
        raise AgreementError(f"{db}: {e}") from None
    return [dict(zip(columns, r)) for r in rows]


PASS_WORDS = {"1", "true", "t", "yes", "y", "pass", "passed"}
FAIL_WORDS = {"0", "false", "f", "no", "n", "fail", "failed"}


def _verdict(passed) -> bool:
    """A label's `passed`: true/false, 1/0 or one of PASS_WORDS / FAIL_WORDS (any case). Anything else, a blank cell
    or null among them, is no verdict and refused, never read as a fail."""
    if isinstance(passed, bool) or (isinstance(passed, int | float) and passed in (0, 1)):
        return bool(passed)
    word = passed.strip().lower() if isinstance(passed, str) else None
    if word in PASS_WORDS | FAIL_WORDS:
        return word in PASS_WORDS
    raise ValueError(f"passed {passed!r} is no verdict: give true/false, yes/no, pass/fail or 1/0")


def _blank(value) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def _whole(value, field: str) -> int:
    """An integer field (step, sample_idx): a whole number, as a number or as text ('3', '3.0': a spreadsheet's
    export of a column with blanks), never a fraction rounded down or a bool."""
    number = float(value.strip()) if isinstance(value, str) else value
    if isinstance(number, bool) or not isinstance(number, int | float) or not float(number).is_integer():
        raise ValueError(f"{field} {value!r} is not a whole number")
    return int(number)


def _score(value) -> float:
    if isinstance(value, bool):  # JSON true would read as 1.0
        raise ValueError(f"score {value!r} is not a number: give it in [0, 1], or a verdict as passed")
    return float(value)


def _records(path: Path, text: str) -> list[dict]:
    """The labels file's records: CSV (or TSV) by its suffix in any case, else JSON lines."""
    suffix = path.suffix.lower()
    if suffix in (".csv", ".tsv"):
        # strict: a quote never closed is an error, not every later row swallowed into one cell
        reader = csv.DictReader(text.splitlines(), delimiter="\t" if suffix == ".tsv" else ",", strict=True)
        try:
            return list(reader)
        except csv.Error as e:
            raise AgreementError(f"--labels {path} line {reader.line_num}: {e}") from None
    try:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise AgreementError(f"--labels {path}: not JSON lines ({e}); a CSV or TSV file needs its suffix") from None


def read_labels(path: Path) -> dict[tuple, SecondOpinion]:
    """(step, prompt_id, sample_idx, rubric_id) -> its SecondOpinion from a JSONL, CSV or TSV labels file.
    A label's `passed` is its verdict whatever its score and eval.pass_rubric_score are (with a score too, the score
    is still paired for Spearman's rho); with `passed` only it scores 1.0 or 0.0; with a score only the score
    passes at eval.pass_rubric_score (verdict None). A record without a usable score or verdict, or a second label
    of the same judgment, is refused with its record number."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # a spreadsheet's CSV export may start with a byte-order mark
    except OSError as e:
        raise AgreementError(f"--labels {path}: {e}") from None
    except UnicodeDecodeError as e:
        raise AgreementError(
            f"--labels {path}: not UTF-8 ({e}); save it as UTF-8 (a spreadsheet's 'CSV UTF-8')"
        ) from None
    labels, first = {}, {}
    for n, record in enumerate(_records(path, text), 1):
        try:
            key = (
                _whole(record["step"], "step"),
                str(record["prompt_id"]),
                _whole(record["sample_idx"], "sample_idx"),
                str(record["rubric_id"]),
            )
            score, passed = record.get("score"), record.get("passed")
            # a blank `passed` beside a score (a CSV with both columns) is no verdict: the score passes at the threshold
            verdict = None if _blank(passed) and not _blank(score) else _verdict(passed)
            score = (1.0 if verdict else 0.0) if _blank(score) else _score(score)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise AgreementError(
                f"--labels {path} record {n}: needs step, prompt_id, sample_idx, rubric_id and passed or score ({e})"
            ) from None
        if not 0.0 <= score <= 1.0:
            raise AgreementError(f"--labels {path} record {n}: score {score} is not an oriented score in [0, 1]")
        if key in first:
            raise AgreementError(f"--labels {path} record {n}: labels the same judgment as record {first[key]} {key}")
        first[key] = n
        labels[key] = SecondOpinion(score, None, verdict)
    return labels


def _over(base: dict, given: dict) -> dict:
    """`given` over `base`, nested sections (judge.openai) merged key by key."""
    return {
        **base,
        **{
            k: _over(base[k], v) if isinstance(base.get(k), dict) and isinstance(v, dict) else v
            for k, v in given.items()
        },
    }


def other_judge(run_dir: Path, config: Path):
    """The judge a --judge-config file describes (its `judge:` section over the run's), and a description."""
    from refiner_core.judges.base import make_judge
    from refiner_core.models import resolve_model
    from refiner_core.runtime.hardware import resolved_recipe

    recipe, _ = resolved_recipe(load_recipe(run_dir / "recipe.yaml"))  # model.precision 'auto' as a run resolves it
    try:
        section = (yaml.safe_load(config.read_text(encoding="utf-8")) or {}).get("judge")
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError) as e:
        raise AgreementError(f"--judge-config {config}: {e}") from None
    if not isinstance(section, dict):
        raise AgreementError(f"--judge-config {config}: expected a 'judge:' section (judge settings as in a recipe)")
    try:
        section = moved_to_sections({"judge": section})["judge"]  # old flat names read as judge.openai.*
        # the file's settings over the run's, typed and checked like a recipe's
        settings = recipe_from_dict({"judge": _over(asdict(recipe.judge), section)}).judge
    except ConfigError as e:
        raise AgreementError(f"--judge-config {config}: {e}") from None
    spec = settings.model or recipe.model.policy
    try:
        path = (
            resolve_model(spec, recipe.model.max_position_embeddings, recipe.run.seed)
            if settings.engine != "openai"
            else spec
        )
        judge = make_judge(str(path), settings, recipe.model.dtype, recipe.model.precision)
    except (ValueError, OSError) as e:  # no such model; a server that refuses, or lists no models (ConnectionError)
        raise AgreementError(f"--judge-config {config}: {e}") from None
    what = settings.openai.api_model or settings.openai.base_url if settings.engine == "openai" else spec
    return judge, settings, f"judge {settings.engine} {what}, mode {settings.mode}"


def check_judge(
    run_dir: Path,
    *,
    judge_config: Path | None = None,
    labels: Path | None = None,
    sample: int = 32,
    seed: int = 0,
    name: str | None = None,
) -> Check:
    """Run one judge check on a run folder and store it (files and catalog)."""
    if (judge_config is None) == (labels is None):
        raise AgreementError("give either --judge-config FILE or --labels FILE")
    if name is not None and (problem := folder_name_problem(name, "--name")):
        raise AgreementError(problem)
    try:
        db = catalog_path(run_dir)
    except ValueError as e:
        raise AgreementError(str(e)) from None
    stored = _stored(db)
    if not stored:
        raise AgreementError(f"{run_dir} has no stored judgments (judge_scores is empty)")
    recipe_file = run_dir / "recipe.yaml"
    if not recipe_file.is_file():
        raise AgreementError(f"{run_dir} has no recipe.yaml: not a run folder (the check reads its pass threshold)")
    try:
        recipe = load_recipe(recipe_file)
    except ConfigError as e:
        raise AgreementError(str(e)) from None
    run = stored[0]["run"]
    groups = {(s["prompt_id"], s["rubric_id"]): rubric_group(s) for s in stored}
    if labels is not None:
        other = read_labels(labels)
        if not other:
            raise AgreementError(f"--labels {labels}: the file holds no label")
        known = {(s["step"], s["prompt_id"], s["sample_idx"], s["rubric_id"]) for s in stored}
        unknown = sorted(set(other) - known)
        if unknown:
            raise AgreementError(
                f"--labels {labels}: {len(unknown)} labels name no stored judgment of the run, e.g. {unknown[0]}"
            )
        rollouts = {k[:3] for k in other}
        name = name or folder_name(f"labels-{labels.stem}")
        description = f"labels {labels}"
    else:
        judge, settings, description = other_judge(run_dir, judge_config)
        rollouts = set(sample_keys({(s["step"], s["prompt_id"], s["sample_idx"]) for s in stored}, sample, seed))
        other = _rejudged(db, judge, settings, rollouts)
        for s in stored:  # a sampled judgment not re-judged (its rollout row is gone) counts as the other's failure
            key = (s["step"], s["prompt_id"], s["sample_idx"], s["rubric_id"])
            if key[:3] in rollouts and key not in other:
                other[key] = SecondOpinion(None, "not_rejudged: the catalog holds no rollouts / reward_inputs row")
        name = name or f"judge-{json_hash([asdict(settings), sample, seed])[:8]}"
    checks = check_rows(run, name, stored, other, groups, recipe.eval.pass_rubric_score)
    agreement = agreement_rows(
        checks,
        other=description,
        threshold=recipe.eval.pass_rubric_score,
        sample_rollouts=len(rollouts),
        seed=seed,
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    folder = run_dir / CHECKS_DIR / name
    written = {}
    for table, rows in ((JUDGE_CHECKS, checks), (JUDGE_AGREEMENT, agreement)):
        write_table(table, rows, folder / f"{table.name}.parquet")
        written[table.name] = [str(folder / f"{table.name}.parquet")]
    replace_rows(db, written, "check_name", name)
    return Check(name, description, agreement, len(checks), len(rollouts), str(folder))


def _rejudged(db: Path, judge, settings: JudgeConfig, keys: set[tuple]) -> dict[tuple, SecondOpinion]:
    columns, rows = query(
        db,
        "SELECT o.*, i.max_new_tokens FROM rollouts o JOIN reward_inputs i USING (run, step, prompt_id, sample_idx)",
    )
    rollouts = [
        r for r in (dict(zip(columns, row)) for row in rows) if (r["step"], r["prompt_id"], r["sample_idx"]) in keys
    ]
    columns, rows = query(db, "SELECT * FROM prompts")
    prompts = {r["prompt_id"]: r for r in (dict(zip(columns, row)) for row in rows)}
    columns, rows = query(db, "SELECT * FROM rubrics ORDER BY prompt_id, rubric_id")
    rubrics: dict[str, list[dict]] = {}
    for r in (dict(zip(columns, row)) for row in rows):
        rubrics.setdefault(r["prompt_id"], []).append(r)
    scores = rejudge(rollouts, prompts, rubrics, judge, settings.max_response_chars)
    return {
        (s["step"], s["prompt_id"], s["sample_idx"], s["rubric_id"]): SecondOpinion(s["oriented_score"], s["failure"])
        for s in scores
    }
