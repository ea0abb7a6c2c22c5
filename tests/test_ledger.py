"""Two tiny runs: the first re-judges anchor rollouts every step (judge.anchor_every: judge_anchors, judge_drift); the
second takes the difficulty ledger back in, dropping the prompts the first always or never solved
(data.skip_solved_from) and drawing its prompts by weights from a third, hand-made run's ledger (data.weights_from)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import duckdb
import pytest

from conftest import REPO
from refiner_core.config import load_recipe
from refiner_core.data.schedule import weighted_step_prompt_ids
from refiner_core.publish.catalog import build_catalog
from refiner_core.publish.ledger import MIN_WEIGHT, prompt_weight, select_prompts
from refiner_core.publish.run_sql import CatalogError, open_runs, run_query
from refiner_core.schema import REWARDS, ROLLOUTS
from refiner_core.store.storage import write_table

# the hand-made run: prompt -> verdicts of its rollouts (pass rates 1/2, 1/4, 1, 0)
HAND_MADE = {"ref-001": [1, 1, 0, 0], "ref-002": [1, 0, 0, 0], "ref-003": [1, 1, 1, 1], "ref-004": [0, 0, 0, 0]}


def _run(recipe: dict, run_dir: Path) -> None:
    from flows.refiner import refiner_pipeline

    state = refiner_pipeline(recipe=recipe, run_dir=str(run_dir), return_state=True)
    assert state.is_completed(), state.message


def _query(run_dirs: list[Path], sql: str) -> list[tuple]:
    con = open_runs(run_dirs)
    try:
        return run_query(con, sql)[1]
    finally:
        con.close()


def _hand_made_run(folder: Path, with_dropped: bool = False) -> Path:
    """A catalog whose rewards table says which rollouts solved their prompt (a judged answer passes when it is
    format-valid, cites, invents no ID and scores at least 0.5); `with_dropped`: and rollouts whose judgments
    failed (judge.on_failure skip), two more of ref-002 and two of ref-005, which has no other."""
    rows = [
        {c: None for c in REWARDS.column_names}
        | {
            "run": "hand",
            "step": 0,
            "prompt_id": prompt,
            "sample_idx": i,
            "reward_version": "train",
            "verifier": "judge",
            "format_ok": True,
            "n_citations": 1,
            "n_invalid_citations": 0,
            "rubric_score": 0.9 if solved else 0.1,
        }
        for prompt, verdicts in HAND_MADE.items()
        for i, solved in enumerate(verdicts)
    ]
    dropped = {c: None for c in REWARDS.column_names} | {"run": "hand", "step": 0, "reward_version": "train"}
    dropped |= {"verifier": "judge", "format_ok": True, "n_citations": 1, "n_invalid_citations": 0, "dropped": True}
    if with_dropped:
        rows += [dropped | {"prompt_id": p, "sample_idx": i} for p in ("ref-002", "ref-005") for i in (4, 5)]
    folder.mkdir(parents=True)
    write_table(REWARDS, rows, folder / "rewards.parquet")
    build_catalog(folder / "catalog.duckdb", {"rewards": [folder / "rewards.parquet"]})
    return folder


def test_ledger_figures_and_selection_by_hand(tmp_path):
    """Rollouts whose judgments failed count neither way (ref-005 had only those: it read never solved, and
    data.skip_solved_from left it out of the next run)."""
    hand = _hand_made_run(tmp_path / "hand", with_dropped=True)
    ledger = {
        r[0]: r
        for r in _query([hand], "SELECT prompt_id, pass_rate, always_solved, never_solved FROM prompt_difficulty")
    }
    assert ledger == {
        "ref-001": ("ref-001", 0.5, False, False),
        "ref-002": ("ref-002", 0.25, False, False),
        "ref-003": ("ref-003", 1.0, True, False),
        "ref-004": ("ref-004", 0.0, False, True),
    }
    assert (prompt_weight(0.5), prompt_weight(0.25), prompt_weight(1.0)) == (1.0, 0.75, MIN_WEIGHT)
    entries = {
        p: {"rollouts": 4, "pass_rate": r[1], "always_solved": r[2], "never_solved": r[3]} for p, r in ledger.items()
    }
    kept, weights, rows = select_prompts("b", ["ref-001", "ref-003", "ref-004", "ref-009"], entries, entries, "hand")
    assert kept == ["ref-001", "ref-009"] and weights == {"ref-001": 1.0, "ref-009": 1.0}
    assert [r["skipped"] for r in rows] == [None, "always solved", "never solved", None]
    # weighted draws: seeded per step, never the same prompt twice in a step, heavier prompts drawn more often
    ids = [f"p{i}" for i in range(10)]
    heavy = {p: (1.0 if p == "p0" else 0.05) for p in ids}
    draws = [weighted_step_prompt_ids(ids, heavy, step, 3, seed=1) for step in range(200)]
    assert all(len(set(d)) == 3 for d in draws)
    assert draws[5] == weighted_step_prompt_ids(ids, heavy, 5, 3, seed=1)
    assert sum("p0" in d for d in draws) > 190  # p0 weighs 20x any other prompt


def test_a_twin_pair_is_skipped_only_whole():
    """One view always solved, its twin not: both stay (the view left alone would never get its pseudo-label)."""
    entry = {"rollouts": 4, "pass_rate": 1.0, "always_solved": True, "never_solved": False}
    never = {**entry, "pass_rate": 0.0, "always_solved": False, "never_solved": True}
    ledger = {"q1": entry, "q3": entry, "q3r": never, "q4": entry}
    twin_of = {"q1": "q1r", "q1r": "q1", "q2": "q2r", "q2r": "q2", "q3": "q3r", "q3r": "q3", "q4": None}
    kept, _, rows = select_prompts("b", list(twin_of), ledger, {}, "a", twin_of=twin_of)
    assert kept == ["q1", "q1r", "q2", "q2r"]
    assert [r["skipped"] for r in rows] == [None] * 4 + ["always solved", "never solved", "always solved"]


def test_a_run_counts_as_solved_what_its_own_eval_would_pass(tmp_path):
    """prompt_history reads each run's eval.pass_rubric_score from the recipe beside its catalog: at 0.95 no rollout
    of the hand-made run (rubric scores 0.9 / 0.1) solved its prompt; a run without a recipe keeps the default 0.5."""
    strict = _hand_made_run(tmp_path / "strict")
    (strict / "recipe.yaml").write_text("eval:\n  pass_rubric_score: 0.95\n")
    default = _hand_made_run(tmp_path / "default")
    for folder in (strict, default):  # each catalog's rows carry its own run name
        con = duckdb.connect(str(folder / "catalog.duckdb"))
        con.execute("UPDATE rewards SET run = ?", [folder.name])
        con.close()
    rows = _query(
        [strict, default], "SELECT run, sum(solved), sum(rollouts) FROM prompt_history GROUP BY run ORDER BY run"
    )
    assert rows == [("default", 7, 16), ("strict", 0, 16)]
    ledger = _query([strict], "SELECT bool_and(never_solved) FROM prompt_difficulty")
    assert ledger == [(True,)]


def _stepped_run(
    folder: Path, run: str, steps: int, fork_of: tuple[Path, str, int] | None = None, reused: Iterable[int] = ()
) -> Path:
    """A catalog holding the hand-made verdicts at each of `steps` steps under `run`, and a rollouts file per step
    (rollouts/step=N/rollouts.parquet, as tasks/rollout.py writes it). With `fork_of` (parent folder, parent run,
    fork step) its folder is that parent's fork, and the rollouts files of the steps in `reused` are hard links to
    the parent's, as a fork's stages served from its parent's cache adopt them (tasks/stage.py)."""
    from refiner_core.store.forks import Fork, write_fork

    _hand_made_run(folder)
    con = duckdb.connect(str(folder / "catalog.duckdb"))
    con.execute("UPDATE rewards SET run = ?", [run])
    for step in range(1, steps):
        con.execute("INSERT INTO rewards SELECT * REPLACE (? AS step) FROM rewards WHERE step = 0", [step])
    con.close()
    for step in range(steps):
        path = folder / "rollouts" / f"step={step}" / "rollouts.parquet"
        path.parent.mkdir(parents=True)
        if step in reused:
            os.link(fork_of[0] / path.relative_to(folder), path)
        else:
            rows = [
                {c: None for c in ROLLOUTS.column_names} | {"run": run, "step": step, "prompt_id": p, "sample_idx": i}
                for p, verdicts in HAND_MADE.items()
                for i in range(len(verdicts))
            ]
            write_table(ROLLOUTS, rows, path)
    if fork_of is not None:
        parent, parent_run, at = fork_of
        write_fork(Fork(str(folder.resolve()), run, str(parent.resolve()), parent_run, at, [], True, "", []))
    return folder


def test_a_forks_steps_its_parent_holds_count_once_in_the_ledger(tmp_path):
    """A fork's catalog holds its parent's steps before the fork step under its own name, and the fork step's
    rollout too where the fork changed only how it trains: with the parent (or a fork of the same parent listed
    before it) in the session, those steps are one set of rollouts, not two."""
    from refiner_core.publish.run_sql import copied_steps

    parent = _stepped_run(tmp_path / "p", "p", 4)
    fork = _stepped_run(tmp_path / "f", "f", 4, (parent, "p", 2), reused=range(3))
    nested = _stepped_run(tmp_path / "ff", "ff", 5, (fork, "f", 3), reused=range(4))  # 0-2 are p's, 3 is f's
    sibling = _stepped_run(tmp_path / "s", "s", 4, (parent, "p", 1), reused=range(2))
    catalogs = [d / "catalog.duckdb" for d in (parent, fork, nested, sibling)]
    assert copied_steps(catalogs) == [
        {"run": "f", "lo": 0, "hi": 3},
        {"run": "ff", "lo": 0, "hi": 4},
        {"run": "s", "lo": 0, "hi": 2},
    ]
    # without the parent, the first fork keeps the steps it copied and the sibling leaves out what they share
    assert copied_steps([fork / "catalog.duckdb", sibling / "catalog.duckdb"]) == [{"run": "s", "lo": 0, "hi": 2}]
    steps = "SELECT DISTINCT steps, rollouts FROM prompt_difficulty"
    assert _query([parent, fork], steps) == [(4 + 1, 4 * (4 + 1))]
    assert _query([parent, fork, nested, sibling], steps) == [(4 + 1 + 1 + 2, 4 * (4 + 1 + 1 + 2))]
    assert _query([fork], steps) == [(4, 16)]  # alone, a fork's ledger is every step it holds


def test_a_forks_step_counts_once_exactly_where_it_reused_the_parents_rollouts(tmp_path):
    """Only the fork record's step was read: steps before it were the parent's, the fork step the fork's own. A fork
    that changes only the update (learning rate) reuses the fork step's rollout too, and counted it twice."""
    from refiner_core.publish.run_sql import copied_steps

    parent = _stepped_run(tmp_path / "p", "p", 3)
    update_only = _stepped_run(tmp_path / "lr", "lr", 3, (parent, "p", 1), reused=[0, 1])
    resampled = _stepped_run(tmp_path / "hot", "hot", 3, (parent, "p", 1), reused=[0])  # its step-1 rollout differs
    at_zero = _stepped_run(tmp_path / "z", "z", 2, (parent, "p", 0), reused=[0])  # the same step-0 rollout
    unlinked = _stepped_run(tmp_path / "nfs", "nfs", 3, (parent, "p", 1), reused=[0, 1])
    for step in (0, 1):  # on another file system: no hard link, its catalog read the parent's files
        (unlinked / "rollouts" / f"step={step}" / "rollouts.parquet").unlink()
    forks = [update_only, resampled, at_zero, unlinked]
    assert copied_steps([d / "catalog.duckdb" for d in (parent, *forks)]) == [
        {"run": "lr", "lo": 0, "hi": 2},
        {"run": "hot", "lo": 0, "hi": 1},
        {"run": "z", "lo": 0, "hi": 1},
        {"run": "nfs", "lo": 0, "hi": 2},
    ]
    steps = "SELECT DISTINCT steps, rollouts FROM prompt_difficulty"
    assert _query([parent, update_only], steps) == [(3 + 1, 4 * (3 + 1))]
    assert _query([parent, resampled], steps) == [(3 + 2, 4 * (3 + 2))]
    assert _query([parent, *forks], steps) == [(3 + 1 + 2 + 1 + 1, 4 * (3 + 1 + 2 + 1 + 1))]


def test_step_rewards_leaves_dropped_rollouts_out_of_the_advantage_as_steps_does(tmp_path):
    """A dropped rollout (judge.on_failure drop) is stored with advantage 0 and took no part in its group."""
    from refiner_core.algo.advantages import group_advantages
    from refiner_core.config import GRPOConfig

    folder = _hand_made_run(tmp_path / "dropped")
    con = duckdb.connect(str(folder / "catalog.duckdb"))
    con.execute("UPDATE rewards SET dropped = (sample_idx = 0), reward = rubric_score + sample_idx")
    rewards = [
        dict(zip(("prompt_id", "sample_idx", "reward", "dropped"), r))
        for r in con.execute("SELECT prompt_id, sample_idx, reward, dropped FROM rewards ORDER BY ALL").fetchall()
    ]
    rows, stats = group_advantages(rewards, GRPOConfig())
    con.executemany(
        "INSERT INTO advantages (run, step, reward_version, prompt_id, sample_idx, reward, advantage, trained) "
        "VALUES ('hand', 0, 'train', ?, ?, ?, ?, ?)",
        [[r["prompt_id"], r["sample_idx"], r["reward"], r["advantage"], r["trained"]] for r in rows],
    )
    con.close()
    [(figure, dropped)] = _query([folder], "SELECT advantage_abs_mean, dropped_rollouts FROM step_rewards")
    assert dropped == 4 and figure == pytest.approx(stats["advantage_abs_mean"], rel=1e-12)
    assert stats["advantage_abs_mean"] > 0


def test_two_folders_holding_one_run_name_are_refused(tmp_path):
    """Every view tells runs apart by name: two runs named alike would be averaged as one."""
    first = _stepped_run(tmp_path / "n1", "exp", 1)
    second = _stepped_run(tmp_path / "n2", "exp", 1)
    with pytest.raises(CatalogError, match=r"n1/catalog.duckdb and .*n2/catalog.duckdb both hold run 'exp'"):
        open_runs([first, second])


@pytest.fixture(scope="module")
def anchored(prefect_server, tiny_model_path, tmp_path_factory):
    recipe = load_recipe(REPO / "recipes" / "tiny.yaml", ["judge.anchor_every=1", "judge.anchor_rollouts=2"]).to_dict()
    run_dir = tmp_path_factory.mktemp("anchored").resolve()
    _run(recipe, run_dir)
    return run_dir


def test_anchor_rollouts_are_rejudged_every_step(anchored):
    rows = _query(
        [anchored],
        "SELECT a.step, count(*), count(DISTINCT (a.prompt_id, a.sample_idx)), "
        "bool_and(a.first_score = s.oriented_score) FROM judge_anchors a JOIN judge_scores s ON s.step = 0 "
        "AND (s.prompt_id, s.sample_idx, s.rubric_id) = (a.prompt_id, a.sample_idx, a.rubric_id) "
        "GROUP BY a.step ORDER BY a.step",
    )
    rubrics = _query(
        [anchored],
        "SELECT count(*) FROM judge_scores WHERE step = 0 AND (prompt_id, sample_idx) IN "
        "(SELECT (prompt_id, sample_idx) FROM judge_anchors WHERE step = 0)",
    )[0][0]
    assert rows == [(0, rubrics, 2, True), (1, rubrics, 2, True)]  # the same anchors, beside their step-0 scores
    drift = _query([anchored], "SELECT step, judgments, mean_abs_drift FROM judge_drift ORDER BY step")
    assert [(s, n) for s, n, _ in drift] == [(0, rubrics), (1, rubrics)]
    assert all(d is not None and 0 <= d < 0.05 for _, _, d in drift)  # one judge, fixed weights: scores barely move


def test_a_run_takes_the_ledger_of_earlier_runs_back_in(anchored, tmp_path):
    hand = _hand_made_run(tmp_path / "hand")
    recipe = load_recipe(
        REPO / "recipes" / "tiny.yaml", [f"data.skip_solved_from=[{anchored}]", f"data.weights_from=[{hand}]"]
    ).to_dict()
    run_dir = tmp_path / "next"
    _run(recipe, run_dir)
    ledger = _query([anchored], "SELECT prompt_id FROM prompt_difficulty WHERE always_solved OR never_solved")
    dropped = {p for (p,) in ledger}
    assert dropped  # the tiny random model solves nothing: every prompt it sampled is never solved
    selection = dict(_query([run_dir], "SELECT prompt_id, skipped FROM prompt_selection"))
    assert {p for p, why in selection.items() if why} == dropped
    sampled = {p for (p,) in _query([run_dir], "SELECT DISTINCT prompt_id FROM rollouts")}
    assert sampled and not sampled & dropped
    weights = dict(_query([run_dir], "SELECT prompt_id, weight FROM prompt_selection WHERE skipped IS NULL"))
    assert {p: weights[p] for p in HAND_MADE if p in weights} == {
        p: w
        for p, w in {"ref-001": 1.0, "ref-002": 0.75, "ref-003": MIN_WEIGHT, "ref-004": MIN_WEIGHT}.items()
        if p in weights
    }
    kept = sorted(weights)
    for step in (0, 1):
        drawn = {p for (p,) in _query([run_dir], f"SELECT DISTINCT prompt_id FROM rollouts WHERE step = {step}")}
        assert drawn == set(weighted_step_prompt_ids(kept, weights, step, 4, seed=42))
    con = duckdb.connect(str(run_dir / "catalog.duckdb"), read_only=True)
    assert con.execute("SELECT count(*) FROM prompt_selection").fetchone()[0] == len(selection)
    con.close()


def test_anchor_judgments_count_in_the_judge_budget(anchored):
    """The judge-anchors stage reports the requests and tokens of its judgments, as the judge stage does: the
    run's judge budget (judge.budget_usd, over every judging stage's judge_usage) includes them."""
    import os

    from prefect._internal.result_records import ResultRecord

    results = Path(os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"])
    manifests = [ResultRecord.deserialize(f.read_bytes()).result for f in results.glob("judge-anchors-*")]
    mine = [m for m in manifests if m["judge_anchors"]["path"].startswith(str(anchored))]
    judgments = _query([anchored], "SELECT step, count(*) FROM judge_anchors GROUP BY step ORDER BY step")
    assert sorted(
        (int(Path(m["judge_anchors"]["path"]).parent.name[5:]), m["judge_usage"]["requests"]) for m in mine
    ) == [(step, count) for step, count in judgments]
    # the catalog's judge_spend: each anchor re-judging beside each step's rollout judging (steps.judge_requests)
    spend = _query([anchored], "SELECT stage, step, requests FROM judge_spend ORDER BY stage, step")
    by_step = _query([anchored], "SELECT step, judge_requests FROM steps ORDER BY step")
    assert [(stage, step, n) for stage, step, n in spend] == [("judge", s, n) for s, n in by_step] + [
        ("judge-anchors", step, count) for step, count in judgments
    ]
