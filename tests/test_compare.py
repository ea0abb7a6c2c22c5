"""`refiner compare` on real catalogs built from hand-made eval rows: which policy each side names, the paired
statistics of every column against values computed by hand, the prompts behind each change, pooling, the JSON
output and the exit codes."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from refiner_core.eval.stats import paired_bootstrap_ci, sign_flip_p
from refiner_core.publish.catalog import build_catalog
from refiner_core.publish.compare import CompareError, compare, compared_columns, load_side
from refiner_core.schema import EVALS
from refiner_core.store.storage import write_table

runner = CliRunner()
PROMPTS = [f"p{i}" for i in range(10)]


def _row(run: str, step: int, phase: str, prompt: str, passed: bool, distractor: bool | None, reward: float, tokens):
    return {c: None for c in EVALS.column_names} | {
        "run": run,
        "step": step,
        "phase": phase,
        "mode": "greedy",
        "prompt_id": prompt,
        "sample_idx": 0,
        "policy": f"{run}/checkpoints/step_{step:04d}",
        "policy_hash": "h",
        "temperature": 0.0,
        "response_text": "<answer>x</answer>",
        "response_tokens": tokens,
        "format_ok": True,
        "cites_distractor": distractor,
        "reward": reward,
        "finish_reason": "stop",
        "passed": passed,
    }


def _catalog(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    write_table(EVALS, rows, folder / "evals.parquet")
    build_catalog(folder / "catalog.duckdb", {"evals": [folder / "evals.parquet"]})
    return folder


A_PASSED = [True, True, False, False, False, False, False, False, False, False]
B_PASSED = [True, False, True, True, True, True, True, False, False, False]  # p2-p6 fixed, p1 broken
A_DISTRACTOR = [True, True, True, False, False, None, False, False, False, False]
B_DISTRACTOR = [False, False, True, False, True, None, False, False, False, False]  # p0, p1 fixed; p4 broken
A_REWARD = [1.0, 2.0, 0.5, 0.0, 1.5, 2.0, 0.25, 1.0, 0.75, 0.5]
B_REWARD = [1.5, 1.0, 2.5, 1.0, 2.0, 2.5, 0.25, 1.5, 0.5, 2.0]


@pytest.fixture
def runs(tmp_path):
    """Run a: base and sft at step 0, grpo at 2. Run b: grpo at 2 with other answers; its held-out set lacks p9
    and has an extra prompt q."""
    a = [_row("a", 0, phase, p, False, True, 0.0, 50) for phase in ("base", "sft") for p in PROMPTS]
    a += [
        _row("a", 2, "grpo", p, ok, d, r, 40)
        for p, ok, d, r in zip(PROMPTS, A_PASSED, A_DISTRACTOR, A_REWARD, strict=True)
    ]
    b = [
        _row("b", 2, "grpo", p, ok, d, r, 45)
        for p, ok, d, r in zip(PROMPTS, B_PASSED, B_DISTRACTOR, B_REWARD, strict=True)
        if p != "p9"
    ]
    b.append(_row("b", 2, "grpo", "q", True, False, 3.0, 45))
    return _catalog(tmp_path / "a", a), _catalog(tmp_path / "b", b)


def test_sides_name_the_evaluated_policy(runs):
    a, _ = runs
    assert (load_side(str(a)).step, load_side(str(a)).phase) == (2, "grpo")  # the last one evaluated
    assert load_side(f"{a}@0").phase == "sft"  # step 0: the SFT checkpoint rather than the base model
    assert load_side(f"{a}@base").phase == "base"
    with pytest.raises(CompareError, match="step 1 was not evaluated; evaluated: @base, @sft, @2"):
        load_side(f"{a}@1")
    with pytest.raises(CompareError, match="no catalog"):
        load_side(f"{a}/missing")


def test_paired_statistics_by_hand(runs):
    a, b = runs
    result = compare([(load_side(str(a)), load_side(str(b)))], resamples=2000, seed=3)
    by = {c.column: c for c in result.columns}
    assert result.units == 9 and result.only_a == ["p9"] and result.only_b == ["q"]
    passed = by["passed"]  # over p0-p8: A passes p0, p1; B passes p0, p2-p6
    assert (passed.n, passed.a_mean, passed.b_mean) == (9, 2 / 9, 6 / 9)
    assert (passed.fixed, passed.broken) == (["p2", "p3", "p4", "p5", "p6"], ["p1"])
    assert passed.p == float(2 * Fraction(1 + 6, 2**6))  # b = 5, c = 1: 2 * P(X <= 1), X ~ Bin(6, 1/2)
    distractor = by["cites_distractor"]  # lower is better; p5 has no label on either side: left out
    assert distractor.n == 8
    assert (distractor.fixed, distractor.broken) == (["p0", "p1"], ["p4"])
    assert distractor.p == 1.0
    reward = by["reward"]
    expected = paired_bootstrap_ci(A_REWARD[:9], B_REWARD[:9], seed=3, resamples=2000)
    assert reward.diff == pytest.approx(sum(B_REWARD[:9]) / 9 - sum(A_REWARD[:9]) / 9, abs=1e-12)
    assert (reward.ci_low, reward.ci_high) == (expected.low, expected.high)
    assert reward.p == sign_flip_p(A_REWARD[:9], B_REWARD[:9])  # 8 prompts differ: few enough for the exact test
    tokens = by["response_tokens"]  # +5 on every prompt: an interval of exactly [5, 5], p = 2 / 2^9
    assert (tokens.diff, tokens.ci_low, tokens.ci_high, tokens.p, tokens.significant) == (5.0, 5.0, 5.0, 2 / 512, True)
    assert "judged_score" not in by  # NULL on both sides: nothing to compare
    assert not {"temperature", "sample_idx", "format_score", "verification_reward"} & set(compared_columns())
    assert result.differs


def test_pooling_is_explicit_and_names_repeated_prompts(runs):
    a, b = runs
    pair = (load_side(str(a)), load_side(str(b)))
    with pytest.raises(CompareError, match="pooling them is explicit"):
        compare([pair, pair])
    pooled = compare([pair, (load_side(f"{a}@0"), load_side(str(b)))], pool=True, resamples=500)
    assert pooled.units == 18 and pooled.pooled
    assert pooled.repeated_prompts == {p: 2 for p in PROMPTS[:9]}
    assert "p2 (pair 1)" in {c.column: c for c in pooled.columns}["passed"].fixed


def test_pooled_pairs_each_name_the_prompts_one_side_left_out(runs, tmp_path):
    """Every pair's one-sided prompts are counted and named, not only the first pair's: the second side of pair 2
    evaluated 3 of A's 10 prompts."""
    a, b = runs
    c = _catalog(tmp_path / "c", [_row("c", 2, "grpo", p, True, False, 1.0, 40) for p in PROMPTS[:3]])
    pooled = compare([(load_side(str(a)), load_side(str(b))), (load_side(str(a)), load_side(str(c)))], pool=True)
    assert pooled.units == 9 + 3
    assert pooled.only_a == ["p9 (pair 1)"] + [f"{p} (pair 2)" for p in PROMPTS[3:]]
    assert pooled.only_b == ["q (pair 1)"]
    shown = runner.invoke(app, ["compare", str(a), str(b), str(a), str(c), "--pool", "--resamples", "200"])
    assert "left out (evaluated by one side only): 8 prompts of A, 1 of B" in shown.output, shown.output


def test_cli_table_json_and_exit_codes(runs):
    a, b = runs
    shown = runner.invoke(app, ["compare", str(a), str(b), "--resamples", "500"])
    assert shown.exit_code == 1, shown.output  # response_tokens differs on every prompt
    assert "McNemar p = 0.219" in shown.output and "fixed p2, p3, p4, p5, p6; broken p1" in shown.output
    assert "left out (evaluated by one side only): 1 prompts of A, 1 of B" in shown.output
    as_json = runner.invoke(app, ["compare", f"{a}@2", str(b), "--json", "--resamples", "500"])
    data = json.loads(as_json.stdout)
    assert data["differs"] is True and {c["column"] for c in data["columns"]} >= {"passed", "reward"}
    same = runner.invoke(app, ["compare", f"{a}@sft", f"{a}@base", "--resamples", "200"])
    assert same.exit_code == 0, same.output  # identical answers: no column differs
    assert runner.invoke(app, ["compare", f"{a}@7", str(b)]).exit_code == 2
    assert runner.invoke(app, ["compare", str(a)]).exit_code == 2
    assert runner.invoke(app, ["compare", str(a), str(b), str(a), str(b)]).exit_code == 2  # no --pool


@pytest.mark.parametrize(
    ("rewards_b", "p", "exit_code"),
    [
        ([1.2], 1.0, 0),  # one shared prompt: a bootstrap interval of [0.2, 0.2], yet no evidence
        ([1 + 1e-6, 1 + 2e-6, 1 + 3e-6], 2 / 8, 0),  # three tiny gains one way: the smallest p is 2 / 2^3
        ([1.5] * 5, 2 / 32, 0),  # five gains: still above 0.05
        ([1.5] * 6, 2 / 64, 1),  # six gains: 0.031
    ],
)
def test_a_continuous_column_differs_only_when_its_exact_p_can_say_so(tmp_path, rewards_b, p, exit_code):
    prompts = PROMPTS[: len(rewards_b)]
    a = _catalog(tmp_path / "a", [_row("a", 2, "grpo", q, True, False, 1.0, 40) for q in prompts])
    b = _catalog(tmp_path / "b", [_row("b", 2, "grpo", q, True, False, r, 40) for q, r in zip(prompts, rewards_b)])
    reward = {c.column: c for c in compare([(load_side(str(a)), load_side(str(b)))], resamples=500).columns}["reward"]
    assert reward.ci_low > 0  # the interval alone would call it a gain
    assert (reward.p, reward.significant) == (p, bool(exit_code))
    shown = runner.invoke(app, ["compare", str(a), str(b), "--resamples", "500"])
    assert shown.exit_code == exit_code, shown.output
    assert f"sign-flip p = {p:.3g}" in shown.output and "an exact p needs 6 differing prompts" in shown.output


def test_a_value_that_is_not_a_number_is_refused_by_name(runs, tmp_path):
    """A NaN reward made the exact sign-flip p 0 and the comparison 'differ' (exit 1); now it is named, exit 2."""
    a, _ = runs
    rows = [_row("n", 2, "grpo", p, True, False, 1.0, 40) for p in PROMPTS]
    rows[3]["reward"] = float("nan")
    n = _catalog(tmp_path / "n", rows)
    with pytest.raises(CompareError, match="evals column reward of prompt p3 is not a finite number"):
        compare([(load_side(str(a)), load_side(str(n)))])
    shown = runner.invoke(app, ["compare", str(a), str(n)])
    assert shown.exit_code == 2 and "reward of prompt p3" in shown.output, shown.output


def test_every_boolean_column_compared_is_tested_as_binary():
    import pyarrow as pa

    from refiner_core.publish.compare import BINARY, compared_columns
    from refiner_core.schema import EVALS

    booleans = {c.name for c in EVALS.columns if c.type == pa.bool_()}
    assert booleans & set(compared_columns()) <= set(BINARY)


def test_sides_evaluated_with_other_settings_are_named(tmp_path):
    """A fork's evaluations before its step are its parent's, made with the parent's eval settings: pairing them
    with the fork's later ones compares settings as well as policies, and the comparison says which."""
    a = _catalog(
        tmp_path / "a", [_row("a", 2, "grpo", p, True, False, 1.0, 8) | {"max_new_tokens": 8} for p in PROMPTS]
    )
    b_rows = [_row("b", 3, "grpo", p, True, False, 1.0, 16) | {"max_new_tokens": 16} for p in PROMPTS]
    b = _catalog(tmp_path / "b", [r | {"temperature": 0.5, "pass_rubric_score": 0.9} for r in b_rows])
    result = compare([(load_side(str(a)), load_side(str(b)))], resamples=200)
    assert result.different_settings == [  # `passed` depends on the threshold it was decided at
        "max_new_tokens: A 8, B 16",
        "pass_rubric_score: A None, B 0.9",
        "temperature: A 0.0, B 0.5",
    ]
    shown = runner.invoke(app, ["compare", str(a), str(b), "--resamples", "200"])
    assert "warning: the sides were evaluated with different settings" in shown.output
    assert "max_new_tokens: A 8, B 16" in shown.output
    same = compare([(load_side(str(a)), load_side(str(a)))], resamples=200)
    assert same.different_settings == []


def test_ids_that_name_different_prompts_are_not_paired(tmp_path):
    """Two runs on other data numbered alike (p0..p9 in both) would pair unrelated prompts: the prompts table's
    content hashes tell them apart, and those IDs are left out and named; with none left, nothing is compared."""
    from refiner_core.schema import PROMPTS as PROMPTS_TABLE

    def with_prompts(folder: Path, run: str, passed: list[bool], hashes: dict[str, str]) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        write_table(
            EVALS, [_row(run, 2, "grpo", p, ok, False, 1.0, 40) for p, ok in zip(PROMPTS, passed)], folder / "e.parquet"
        )
        prompts = [
            {c: None for c in PROMPTS_TABLE.column_names}
            | {"run": run, "prompt_id": p, "split": "validation", "content_hash": h}
            for p, h in hashes.items()
        ]
        write_table(PROMPTS_TABLE, prompts, folder / "p.parquet")
        build_catalog(folder / "catalog.duckdb", {"evals": [folder / "e.parquet"], "prompts": [folder / "p.parquet"]})
        return folder

    same = {p: f"c{p}" for p in PROMPTS}
    other = same | {"p3": "x3", "p4": "x4"}
    a = with_prompts(tmp_path / "a", "a", A_PASSED, same)
    b = with_prompts(tmp_path / "b", "b", B_PASSED, other)
    result = compare([(load_side(str(a)), load_side(str(b)))], resamples=200)
    assert result.different_prompts == ["p3", "p4"] and result.units == 8
    passed = {c.column: c for c in result.columns}["passed"]
    assert passed.fixed == ["p2", "p5", "p6"] and passed.broken == ["p1"]  # p3, p4 were fixed under other prompts
    shown = runner.invoke(app, ["compare", str(a), str(b), "--resamples", "200"])
    warning = "warning: 2 prompt IDs name different prompts on the two sides (other data under the same IDs)"
    assert f"{warning}, left out: p3, p4" in shown.output
    unknown = with_prompts(tmp_path / "c", "c", B_PASSED, {})  # a catalog without the hashes pairs by ID as before
    assert compare([(load_side(str(a)), load_side(str(unknown)))], resamples=200).units == 10
    unrelated = with_prompts(tmp_path / "d", "d", B_PASSED, {p: f"d{p}" for p in PROMPTS})
    with pytest.raises(CompareError, match=r"share no evaluated prompt \(the 10 IDs both evaluated name different"):
        compare([(load_side(str(a)), load_side(str(unrelated)))])
    assert runner.invoke(app, ["compare", str(a), str(unrelated)]).exit_code == 2


def test_a_dropped_answer_has_no_judged_value(runs, tmp_path):
    """An answer whose judgment failed under judge.on_failure drop stores reward 0 and passed false: it is left out
    of the judged columns, as the eval summary leaves it out (a judge outage is not a worse policy), and counted
    as `dropped` where both sides record it. Its format and length still compare."""
    a, _ = runs
    rows = [_row("d", 2, "grpo", p, ok, d, r, 40) for p, ok, d, r in zip(PROMPTS, A_PASSED, A_DISTRACTOR, A_REWARD)]
    for row in rows[:2]:  # p0 and p1: A passed them with rewards 1.0 and 2.0
        row.update(dropped=True, passed=False, reward=0.0, rubric_score=0.0, judged_score=0.0)
    for row in rows[2:]:
        row["dropped"] = False
    d = _catalog(tmp_path / "d", rows)
    by = {c.column: c for c in compare([(load_side(str(a)), load_side(str(d)))], resamples=200).columns}
    assert (by["reward"].n, by["reward"].diff, by["reward"].p) == (8, 0.0, 1.0)
    assert (by["passed"].n, by["passed"].broken) == (8, [])
    assert "rubric_score" not in by and "judged_score" not in by  # a's are NULL: nothing else to pair
    assert by["response_tokens"].n == 10 and by["format_ok"].n == 10


def test_alpha_decides_a_column_the_bootstrap_interval_decides(tmp_path):
    """20 prompts differ (too many for the exact test): B - A is +1 on 15, -1 on 5. A resample's mean is
    (2K - 20) / 20 with K ~ Bin(20, 3/4): P(K <= 10) = 0.014, so the 95 % interval lies above 0 and the 99 % one
    reaches it. --alpha 0.01 flagged the column all the same: significance came from the interval at --level."""
    prompts = [f"q{i:02d}" for i in range(20)]
    rewards_b = [2.0] * 15 + [0.0] * 5
    a = _catalog(tmp_path / "a", [_row("a", 2, "grpo", q, True, False, 1.0, 40) for q in prompts])
    b = _catalog(tmp_path / "b", [_row("b", 2, "grpo", q, True, False, r, 40) for q, r in zip(prompts, rewards_b)])
    at_95 = paired_bootstrap_ci([1.0] * 20, rewards_b, seed=0, resamples=2000, level=0.95)
    at_99 = paired_bootstrap_ci([1.0] * 20, rewards_b, seed=0, resamples=2000, level=0.99)
    assert at_95.low > 0 and at_99.low <= 0 < at_99.high
    sides = [(load_side(str(a)), load_side(str(b)))]
    for alpha, significant in ((0.05, True), (0.01, False)):
        reward = {c.column: c for c in compare(sides, alpha=alpha, resamples=2000).columns}["reward"]
        assert reward.p is None and reward.significant is significant, alpha
        assert (reward.ci_low, reward.ci_high) == (at_95.low, at_95.high)  # the interval shown stays at --level
    shown = runner.invoke(app, ["compare", str(a), str(b), "--alpha", "0.01", "--resamples", "2000"])
    assert shown.exit_code == 0, shown.output
    assert "with no p a 99% bootstrap interval without 0" in shown.output
    assert runner.invoke(app, ["compare", str(a), str(b), "--resamples", "2000"]).exit_code == 1


def test_a_catalog_that_is_no_duckdb_file_is_a_usage_error(runs, tmp_path):
    """A catalog.duckdb that DuckDB cannot open raised a traceback and exit 1, which means 'some column differs'."""
    a, _ = runs
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "catalog.duckdb").write_text("not a database\n")
    with pytest.raises(CompareError, match=r"broken@2: cannot read the catalog .*broken/catalog.duckdb"):
        load_side(f"{broken}@2")
    shown = runner.invoke(app, ["compare", str(a), str(broken)])
    assert shown.exit_code == 2 and "cannot read the catalog" in shown.output, shown.output


@pytest.mark.parametrize("listed", ["-1", "-8"])
def test_a_negative_list_length_is_refused(runs, listed):
    """--list -1 named every prompt but the last and then '(1 more)'."""
    a, b = runs
    shown = runner.invoke(app, ["compare", str(a), str(b), "--list", listed, "--resamples", "200"])
    assert shown.exit_code == 2, shown.output
    assert "--list" in shown.output and "greater than or equal to 0" in shown.output


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--seed", "-1"], "greater than or equal to 0"),
        (["--resamples", "10000000000"], "resamples must lie in 1..10,000,000"),
    ],
)
def test_a_seed_or_resamples_the_bootstrap_cannot_take_is_a_usage_error(runs, args, why):
    """--seed -1 raised numpy's ValueError and --resamples 1e10 a MemoryError: tracebacks with exit 1, which means
    'some column differs'."""
    a, b = runs
    shown = runner.invoke(app, ["compare", str(a), str(b), *args])
    assert shown.exit_code == 2 and why in shown.output, shown.output


@pytest.mark.parametrize(("table", "column"), [("evals", "finish_reason"), ("prompts", "content_hash")])
def test_a_catalog_missing_a_column_read_is_a_usage_error(runs, tmp_path, table, column):
    import duckdb

    a, b = runs
    with duckdb.connect(str(b / "catalog.duckdb")) as con:
        con.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    shown = runner.invoke(app, ["compare", str(a), str(b)])
    assert shown.exit_code == 2 and "cannot read the catalog" in shown.output and column in shown.output, shown.output


def test_more_than_one_greedy_answer_per_prompt_is_refused_not_averaged(tmp_path):
    """A prompt with two greedy answers (a pass and a fail) was half a pass in the table and a fail to McNemar."""
    rows = [_row("a", 2, "grpo", p, False, False, 0.0, 40) for p in PROMPTS]
    rows.append({**_row("a", 2, "grpo", "p0", True, False, 1.0, 40), "sample_idx": 1})
    twice = _catalog(tmp_path / "twice", rows)
    with pytest.raises(CompareError, match=r"1 prompts have more than one greedy answer per sample .* 'p0'"):
        load_side(str(twice))


def test_a_catalog_of_several_runs_is_refused_not_mixed(tmp_path):
    rows = [_row(run, 2, "grpo", p, run == "x", False, 0.0, 40) for run in ("x", "y") for p in PROMPTS]
    folder = tmp_path / "merged"
    folder.mkdir()
    write_table(EVALS, rows, folder / "evals.parquet")
    build_catalog(folder / "merged.duckdb", {"evals": [folder / "evals.parquet"]})
    with pytest.raises(CompareError, match=r"holds the evaluations of 2 runs \(x, y\)"):
        load_side(str(folder / "merged.duckdb"))
