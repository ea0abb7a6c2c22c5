"""Two evaluated policies compared on the held-out prompts both answered, with paired statistics.

A side is a run folder and, optionally, which of its evaluated policies: `RUN` (the last one evaluated), `RUN@N`
(after N GRPO updates; at 0 the SFT checkpoint when the run has one, else the base model), `RUN@base`, `RUN@sft`.
Every numeric or boolean column of `evals` is compared over the prompts both sides evaluated (greedy answers by
default): an exact McNemar test on the binary ones, with the prompts each change fixed or broke, and a seeded
paired bootstrap interval of the mean difference on the continuous ones (refiner_core.eval.stats). A continuous
column is significant by the exact sign-flip test while at most EXACT_SIGN_FLIP_PAIRS prompts differ (a bootstrap
interval from a few prompts is narrow by construction: [d, d] from one), beyond that when its bootstrap interval at
1 - alpha (the same resamples as the one shown, at `level`) excludes 0. Several pairs
of sides (e.g. one per seed) are pooled only when asked; the pooled units are (pair, prompt), the bootstrap resamples
within each pair, and prompts that several pairs evaluated are named, since their evaluations are not independent.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import duckdb

from refiner_core.config import reward_weight_fields
from refiner_core.eval.stats import (
    EXACT_SIGN_FLIP_PAIRS,
    discordant,
    fewest_pairs_to_reach,
    mcnemar_p,
    paired_bootstrap_ci,
    sign_flip_p,
)
from refiner_core.schema import EVALS
from refiner_core.store.storage import query


class CompareError(ValueError):
    """A side that names no evaluated policy, or nothing the two sides share."""


# evals columns that say which policy, prompt or setting a row is, not how the answer did
_IDENTITY = {"run", "step", "phase", "mode", "prompt_id", "sample_idx", "policy", "policy_hash", "temperature"}
_SETTINGS = {
    "max_new_tokens",
    "on_failure",
    "pass_rubric_score",  # `passed` depends on it
    *(column for _, column, _, _ in reward_weight_fields()),
}
_DUPLICATES = {"format_score"}  # format_ok as 1.0 / 0.0
# Binary columns and whether True is the better value (None: neither). `correct` and `label_correct` hold 1.0 / 0.0.
BINARY: dict[str, bool | None] = {
    "passed": True,
    "format_ok": True,
    "has_answer": True,
    "cites_distractor": False,
    "stopped": True,  # finish_reason = 'stop'
    "correct": True,
    "boxed": True,  # an agent's or a verified prompt's final answer holds a \boxed{}
    "label_correct": True,
    "gated": False,
    "non_stop_penalized": False,
    "dropped": False,
    "label_tied": None,
}
# Columns whose value a dropped answer (a judgment failed under judge.on_failure skip/drop) does not have: left
# out for it, as evaluate.summarize leaves it out of the score, reward and pass means (a judge outage is not a
# worse policy)
JUDGED = {"passed", "reward", "judged_score", "rubric_score", "citation_score"}
MAX_RESAMPLES = 10_000_000  # the bootstrap keeps a float per resample, and sorts them for its interval
FIRST = ("passed", "format_ok", "cites_distractor", "stopped", "reward", "rubric_score", "response_tokens")


def compared_columns() -> list[str]:
    """The evals columns compared, headline ones first: every boolean and numeric column but identity, settings and
    duplicates, and `stopped` (derived from finish_reason)."""
    numeric = [
        c.name
        for c in EVALS.columns
        if str(c.type) in ("bool", "double", "int64") and c.name not in _IDENTITY | _SETTINGS | _DUPLICATES
    ]
    names = [*numeric, "stopped"]
    return [n for n in FIRST if n in names] + [n for n in names if n not in FIRST]


@dataclass(frozen=True)
class Side:
    """One evaluated policy of a run folder."""

    spec: str
    run_dir: str
    run: str
    step: int
    phase: str
    mode: str
    rows: dict[str, list[dict]]  # prompt_id -> its eval rows of this mode
    # prompt_id -> the content hash of its source row (prompts.content_hash): two runs may use one ID for different
    # prompts (other data numbered 0..N); empty where the catalog records none
    contents: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.spec} ({self.phase} at step {self.step}, run {self.run})"


_SPEC = re.compile(r"^(?P<dir>.+?)(@(?P<at>\d+|base|sft|grpo))?$")


def parse_spec(spec: str) -> tuple[Path, str | None]:
    """'runs/a@3' -> (runs/a, '3'); 'runs/a' -> (runs/a, None)."""
    match = _SPEC.match(spec)
    if not match:
        raise CompareError(f"{spec!r}: expected RUN_DIR, RUN_DIR@STEP, RUN_DIR@base or RUN_DIR@sft")
    return Path(match["dir"]), match["at"]


def load_side(spec: str, mode: str = "greedy") -> Side:
    """The side `spec` names, with its eval rows of `mode`."""
    run_dir, at = parse_spec(spec)
    db = run_dir if run_dir.suffix == ".duckdb" else run_dir / "catalog.duckdb"
    if not db.is_file():
        raise CompareError(f"{spec}: no catalog at {db}")
    try:
        _, evaluated = query(db, "SELECT DISTINCT step, phase FROM evals WHERE mode = ? ORDER BY step, phase", [mode])
    except duckdb.Error as e:  # not a DuckDB file, or one without an evals table
        raise CompareError(f"{spec}: cannot read the catalog {db} ({e})") from None
    if not evaluated:
        raise CompareError(f"{spec}: the run has no {mode} held-out evaluation (eval.every, eval.greedy/samples)")
    step, phase = _choose(spec, at, [(s, p) for s, p in evaluated])
    try:
        columns, rows = query(
            db,
            "SELECT *, finish_reason = 'stop' AS stopped FROM evals WHERE mode = ? AND step = ? AND phase = ? "
            "ORDER BY prompt_id, sample_idx",
            [mode, step, phase],
        )
        by_prompt: dict[str, list[dict]] = {}
        for row in rows:
            r = dict(zip(columns, row))
            by_prompt.setdefault(r["prompt_id"], []).append(r)
        runs = sorted({r["run"] for answers in by_prompt.values() for r in answers})
        if len(runs) > 1:  # a catalog file of several runs: their answers would be averaged as one policy's
            raise CompareError(f"{spec}: the catalog holds the evaluations of {len(runs)} runs ({', '.join(runs)})")
        # a greedy prompt has one answer, a sampled one a row per sample: a pass would be averaged with a fail
        most = (lambda answers: 1) if mode == "greedy" else (lambda answers: len({r["sample_idx"] for r in answers}))
        repeated = [p for p, answers in by_prompt.items() if len(answers) > most(answers)]
        if repeated:
            raise CompareError(
                f"{spec}: {len(repeated)} prompts have more than one {mode} answer per sample in the catalog, e.g. "
                f"{sorted(repeated)[0]!r} (a merged or hand-built catalog?)"
            )
        return Side(spec, str(run_dir), runs[0], step, phase, mode, by_prompt, _contents(db, runs[0]))
    except duckdb.Error as e:  # a catalog from another version of the schema, missing a column read here
        raise CompareError(f"{spec}: cannot read the catalog {db} ({e})") from None


def _contents(db: Path, run: str) -> dict[str, str]:
    """prompt_id -> content hash of the run's prompts, from the catalog's prompts table where it has one."""
    _, found = query(db, "SELECT count(*) FROM information_schema.tables WHERE table_name = 'prompts'")
    if not found[0][0]:
        return {}
    _, rows = query(db, "SELECT prompt_id, content_hash FROM prompts WHERE run = ?", [run])
    return {prompt: digest for prompt, digest in rows if digest}


def shared_prompts(a: Side, b: Side) -> tuple[list[str], list[str]]:
    """(prompt IDs both sides evaluated, for the same prompt; IDs both evaluated that name different prompts). A
    prompt whose content one side does not record counts as the same."""
    ids = sorted(set(a.rows) & set(b.rows))
    known = [(p, a.contents.get(p), b.contents.get(p)) for p in ids]
    differ = [p for p, x, y in known if x is not None and y is not None and x != y]
    return [p for p in ids if p not in set(differ)], differ


def _choose(spec: str, at: str | None, evaluated: list[tuple[int, str]]) -> tuple[int, str]:
    order = {"base": 0, "sft": 1, "grpo": 2}
    options = ", ".join(f"@{s}" if p == "grpo" else f"@{p}" for s, p in evaluated)
    if at is None:
        return max(evaluated, key=lambda sp: (sp[0], order[sp[1]]))
    if at in order:
        found = [sp for sp in evaluated if sp[1] == at]
        if not found:
            raise CompareError(f"{spec}: no {at} policy was evaluated; evaluated: {options}")
        return max(found)
    found = [sp for sp in evaluated if sp[0] == int(at)]
    if not found:
        raise CompareError(f"{spec}: step {at} was not evaluated; evaluated: {options}")
    return max(found, key=lambda sp: order[sp[1]])  # at 0: the SFT checkpoint rather than the base model


@dataclass
class ColumnResult:
    column: str
    kind: str  # 'binary' or 'continuous'
    n: int  # pairs where both sides have a value
    a_mean: float | None
    b_mean: float | None
    diff: float | None
    p: float | None = None  # binary: exact McNemar p; continuous: exact sign-flip p (None: too many prompts differ)
    ci_low: float | None = None  # continuous: bootstrap interval of the mean of B - A
    ci_high: float | None = None
    became_true: list[str] = field(default_factory=list)
    became_false: list[str] = field(default_factory=list)
    fixed: list[str] | None = None  # binary with a better value: the units that changed towards it
    broken: list[str] | None = None
    significant: bool = False


@dataclass
class Comparison:
    pairs: list[tuple[str, str]]  # (A label, B label) of each pair
    mode: str
    units: int  # paired (pair, prompt) evaluations
    pooled: bool
    repeated_prompts: dict[str, int]  # prompt -> pairs that evaluated it (pooled only; > 1)
    only_a: list[str]  # prompts only side A evaluated ("ID (pair N)" when pooled)
    only_b: list[str]
    alpha: float
    level: float
    resamples: int
    seed: int
    columns: list[ColumnResult]
    # "max_new_tokens: A 8, B 16": eval settings that differ between the sides of a pair (a fork's evaluations
    # before its step are its parent's, made with the parent's settings): the differences may be theirs
    different_settings: list[str] = field(default_factory=list)
    # prompt IDs both sides evaluated whose prompts differ (their source rows' content): left out of the pairs
    different_prompts: list[str] = field(default_factory=list)

    @property
    def differs(self) -> bool:
        return any(c.significant for c in self.columns)

    def to_dict(self) -> dict:
        return {**asdict(self), "differs": self.differs}


def _value(side: Side, prompt_id: str, column: str) -> float | None:
    """A prompt's value of `column`: its one greedy answer's, or the mean over its sampled answers (None when no
    answer has one). A dropped answer has no judged value. A NaN or infinite value is refused: no test can say how
    it changed."""
    rows = side.rows[prompt_id]
    if column in JUDGED:
        rows = [r for r in rows if not r.get("dropped")]
    values = [float(r[column]) for r in rows if r.get(column) is not None]
    if not values:
        return None
    if not all(math.isfinite(v) for v in values):
        raise CompareError(f"{side.spec}: evals column {column} of prompt {prompt_id} is not a finite number")
    return sum(values) / len(values)


def compare(
    pairs: list[tuple[Side, Side]],
    *,
    pool: bool = False,
    alpha: float = 0.05,
    level: float = 0.95,
    resamples: int = 10_000,
    seed: int = 0,
) -> Comparison:
    """Paired statistics of every compared column over the prompts both sides of each pair evaluated. Several pairs
    need `pool`: their units are pooled, the bootstrap resampling within each pair."""
    if not pairs:
        raise CompareError("nothing to compare")
    if len(pairs) > 1 and not pool:
        raise CompareError(f"{len(pairs)} pairs given: pooling them is explicit (--pool), or compare each pair alone")
    if len({a.mode for a, b in pairs} | {b.mode for a, b in pairs}) != 1:
        raise CompareError("every side must be compared in the same mode")
    if not 1 <= resamples <= MAX_RESAMPLES or seed < 0:
        raise CompareError(
            f"resamples must lie in 1..{MAX_RESAMPLES:,} and the seed be non-negative; got {resamples} and {seed}"
        )
    units: list[tuple[int, str]] = []
    different_prompts: list[str] = []
    only: dict[str, list[str]] = {"a": [], "b": []}
    for index, (a, b) in enumerate(pairs):
        shared, differ = shared_prompts(a, b)
        if not shared:
            why = (
                f"the {len(differ)} IDs both evaluated name different prompts (other data under the same IDs)"
                if differ
                else "different held-out sets"
            )
            raise CompareError(f"{a.spec} and {b.spec} share no evaluated prompt ({why})")
        units += [(index, p) for p in shared]
        different_prompts += _in_pair(differ, index, len(pairs))
        only["a"] += _in_pair(set(a.rows) - set(b.rows), index, len(pairs))
        only["b"] += _in_pair(set(b.rows) - set(a.rows), index, len(pairs))
    per_prompt: dict[str, int] = {}
    for _, prompt in units:
        per_prompt[prompt] = per_prompt.get(prompt, 0) + 1
    name = (lambda u: u[1]) if len(pairs) == 1 else (lambda u: f"{u[1]} (pair {u[0] + 1})")
    binary_mode = pairs[0][0].mode == "greedy"  # sampled answers: per-prompt rates, compared as continuous
    results = []
    for column in compared_columns():
        a_values, b_values, kept = [], [], []
        for unit in units:
            a_side, b_side = pairs[unit[0]]
            x, y = _value(a_side, unit[1], column), _value(b_side, unit[1], column)
            if x is not None and y is not None:
                a_values.append(x)
                b_values.append(y)
                kept.append(unit)
        if not kept:
            continue  # no prompt has this column on both sides (e.g. verifier columns of a judged run)
        a_mean, b_mean = sum(a_values) / len(kept), sum(b_values) / len(kept)
        if column in BINARY and binary_mode:
            results.append(_binary(column, a_values, b_values, [name(u) for u in kept], alpha))
        else:
            strata = [u[0] for u in kept]
            ci = paired_bootstrap_ci(a_values, b_values, seed=seed, resamples=resamples, level=level, strata=strata)
            p = sign_flip_p(a_values, b_values)
            if p is None:  # decided at 1 - alpha, from the same seeded resamples as the interval shown at `level`
                significant = paired_bootstrap_ci(
                    a_values, b_values, seed=seed, resamples=resamples, level=1 - alpha, strata=strata
                ).excludes_zero
            else:
                significant = p < alpha
            results.append(
                ColumnResult(
                    column,
                    "continuous",
                    len(kept),
                    a_mean,
                    b_mean,
                    ci.mean_diff,
                    p=p,
                    ci_low=ci.low,
                    ci_high=ci.high,
                    significant=significant,
                )
            )
    first_a, first_b = pairs[0]
    different = [
        f"{column}: A {_shown(a_values)}, B {_shown(b_values)}" + (f" (pair {index + 1})" if len(pairs) > 1 else "")
        for index, (a, b) in enumerate(pairs)
        for column in sorted(_SETTINGS | {"temperature"})
        if (a_values := _setting(a, column)) != (b_values := _setting(b, column))
    ]
    return Comparison(
        pairs=[(a.label, b.label) for a, b in pairs],
        mode=first_a.mode,
        units=len(units),
        pooled=len(pairs) > 1,
        repeated_prompts={p: n for p, n in sorted(per_prompt.items()) if n > 1},
        only_a=only["a"],
        only_b=only["b"],
        alpha=alpha,
        level=level,
        resamples=resamples,
        seed=seed,
        columns=results,
        different_settings=different,
        different_prompts=different_prompts,
    )


def _in_pair(prompt_ids, index: int, pairs: int) -> list[str]:
    """Prompt IDs as a report names them: with their pair's number when several pairs are pooled."""
    return sorted(prompt_ids) if pairs == 1 else [f"{p} (pair {index + 1})" for p in sorted(prompt_ids)]


def _setting(side: Side, column: str) -> set:
    """The values of an eval setting over a side's rows."""
    return {row.get(column) for rows in side.rows.values() for row in rows}


def _shown(values: set) -> str:
    return "/".join(sorted(str(v) for v in values))


def _binary(column: str, a: list[float], b: list[float], names: list[str], alpha: float) -> ColumnResult:
    changed = discordant([x == 1.0 for x in a], [y == 1.0 for y in b])
    p = mcnemar_p(len(changed.became_true), len(changed.became_false))
    better = BINARY[column]
    fixed = broken = None
    if better is not None:
        fixed_idx, broken_idx = changed.fixed_broken(better)
        fixed, broken = [names[i] for i in fixed_idx], [names[i] for i in broken_idx]
    a_mean, b_mean = sum(a) / len(a), sum(b) / len(b)
    return ColumnResult(
        column,
        "binary",
        len(a),
        a_mean,
        b_mean,
        b_mean - a_mean,
        p=p,
        became_true=[names[i] for i in changed.became_true],
        became_false=[names[i] for i in changed.became_false],
        fixed=fixed,
        broken=broken,
        significant=p < alpha,
    )


def format_comparison(result: Comparison, list_prompts: int = 8) -> str:
    """The comparison as plain text: who is compared on what, one line per column, then the prompts behind each
    binary change (the first `list_prompts` of each list; 0 = all)."""
    lines = []
    for index, (a, b) in enumerate(result.pairs):
        prefix = f"pair {index + 1}: " if result.pooled else ""
        lines += [f"{prefix}A = {a}", f"{' ' * len(prefix)}B = {b}"]
    what = "greedy answers" if result.mode == "greedy" else "sampled answers (per-prompt means)"
    over = f"{result.units} paired prompt evaluations" + (
        f" pooled over {len(result.pairs)} pairs" if result.pooled else ""
    )
    lines.append(f"{what}, {over}")
    if result.only_a or result.only_b:
        lines.append(
            f"left out (evaluated by one side only): {len(result.only_a)} prompts of A, {len(result.only_b)} of B"
        )
    if result.different_prompts:
        lines.append(
            f"warning: {len(result.different_prompts)} prompt IDs name different prompts on the two sides (other "
            "data under the same IDs), left out: " + _names(result.different_prompts, list_prompts)
        )
    if result.different_settings:
        lines.append(
            "warning: the sides were evaluated with different settings, which may explain differences: "
            + "; ".join(result.different_settings)
        )
    if result.repeated_prompts:
        lines.append(
            f"{len(result.repeated_prompts)} prompts are in the held-out sets of several pairs (their evaluations "
            "are not independent): " + _names(list(result.repeated_prompts), list_prompts)
        )
    header = ("column", "kind", "n", "A", "B", "B - A", "test", "fixed", "broken")
    table = [header]
    for c in result.columns:
        if c.kind == "binary":
            test = f"McNemar p = {c.p:.3g}"
            a, b, d = f"{c.a_mean:.0%}", f"{c.b_mean:.0%}", f"{c.diff:+.0%}"
            fixed = str(len(c.fixed)) if c.fixed is not None else f"{len(c.became_true)} became true"
            broken = str(len(c.broken)) if c.broken is not None else f"{len(c.became_false)} became false"
        else:
            interval = f"CI [{c.ci_low:+.3g}, {c.ci_high:+.3g}]"
            test = interval if c.p is None else f"sign-flip p = {c.p:.3g}, {interval}"
            a, b, d = f"{c.a_mean:.4g}", f"{c.b_mean:.4g}", f"{c.diff:+.3g}"
            fixed = broken = ""
        table.append((c.column, c.kind, str(c.n), a, b, d, test + (" *" if c.significant else ""), fixed, broken))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines.append("")
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    lines.append(
        f"\ntest: exact McNemar p (binary); exact sign-flip p while at most {EXACT_SIGN_FLIP_PAIRS} prompts differ "
        f"and a {result.level:.0%} paired bootstrap interval of B - A ({result.resamples} resamples, seed "
        f"{result.seed}) (continuous)\n* = p < {result.alpha:g} (an exact p needs "
        f"{fewest_pairs_to_reach(result.alpha)} differing prompts for that), or with no p a "
        f"{100 * (1 - result.alpha):.4g}% bootstrap interval without 0 (from the same resamples)"
    )
    changes = [c for c in result.columns if c.kind == "binary" and (c.became_true or c.became_false)]
    if changes:
        lines.append("\nprompts behind each change:")
        for c in changes:
            if c.fixed is not None:
                parts = [f"fixed {_names(c.fixed, list_prompts)}" if c.fixed else "", ""]
                parts[1] = f"broken {_names(c.broken, list_prompts)}" if c.broken else ""
            else:
                parts = [
                    f"became true {_names(c.became_true, list_prompts)}" if c.became_true else "",
                    f"became false {_names(c.became_false, list_prompts)}" if c.became_false else "",
                ]
            lines.append(f"  {c.column}: " + "; ".join(p for p in parts if p))
    return "\n".join(lines)


def _names(names: list[str], limit: int) -> str:
    shown = names if not limit or len(names) <= limit else names[:limit]
    more = len(names) - len(shown)
    return ", ".join(shown) + (f", … ({more} more)" if more else "")
