"""rollout.dynamic_sampling: all-equal groups are replaced by fresh prompts, round by round, up to a cap."""

from __future__ import annotations

import json
import math
from datetime import UTC
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import TINY_ON_CPU, math_rows_file
from refiner_core.config import load_recipe
from refiner_core.data.schedule import refill_prompt_ids, step_prompt_ids
from refiner_core.reward.ground_truth import Verdict
from test_pipeline import STAGES, _run

REPO = Path(__file__).resolve().parents[1]
SEED, PER_STEP, G, MAX_ROUNDS, N_PROMPTS, TIS_CAP = 42, 4, 2, 2, 12, 1.5
PROMPT_IDS = sorted(
    json.loads(line)["id"] for line in (REPO / "data/math/train.jsonl").read_text().splitlines()[:N_PROMPTS]
)
FIRST = step_prompt_ids(PROMPT_IDS, 0, PER_STEP, SEED)  # step 0's first round
# Step 0: one group of the first round has a signal, every fresh prompt has one -> a second round fills the step.
# Step 1: no group ever has one -> the cap ends it after 1 + MAX_ROUNDS rounds.
INFORMATIVE = {0: {FIRST[0]} | (set(PROMPT_IDS) - set(FIRST)), 1: set()}


def scripted_verifier():
    """Reward = sample_idx % 2 for the prompts INFORMATIVE names at a step (its group's rewards differ), else 0."""

    def verify_step(rollouts: list[dict], prompts: dict[str, dict]) -> list[Verdict]:
        return [
            Verdict(float(r["sample_idx"] % 2 if r["prompt_id"] in INFORMATIVE[r["step"]] else 0), None, "scripted")
            for r in rollouts
        ]

    return verify_step


def _recipe(data: Path, *extra: str) -> dict:
    return load_recipe(
        REPO / "recipes" / "gt-grpo-math.yaml",
        [
            *TINY_ON_CPU,
            f"data.path={data}",
            "data.validation_fraction=0",
            f"rollout.samples_per_prompt={G}",
            f"rollout.prompts_per_step={PER_STEP}",
            "rollout.max_new_tokens=6",
            "rollout.batch_size=32",
            "grpo.steps=2",
            "grpo.micro_batch_size=8",
            "eval.every=0",
            *extra,
        ],
    ).to_dict()


@pytest.fixture(scope="module")
def sampled_run(prefect_server, tmp_path_factory):
    from refiner_core.reward.verifiers import VERIFIERS

    folder = tmp_path_factory.mktemp("dynamic-sampling")
    data = math_rows_file(folder, N_PROMPTS)
    recipe = _recipe(
        data,
        "reward.verifier=scripted",
        "rollout.dynamic_sampling=true",
        f"rollout.dynamic_sampling_max_rounds={MAX_ROUNDS}",
        "grpo.entropy_coef=0.01",
        f"grpo.tis_cap={TIS_CAP}",
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(VERIFIERS, "scripted", "test_dynamic_sampling:scripted_verifier")
        state, tasks = _run(recipe, folder / "run")
        assert state.is_completed(), state.message
        rerun_state, rerun_tasks = _run(recipe, folder / "run")
        assert rerun_state.is_completed(), rerun_state.message
    return folder / "run", tasks, rerun_tasks, recipe


def _sql(run_dir: Path, sql: str) -> list[tuple]:
    """A query as `refiner sql RUN_DIR SQL` runs it."""
    from refiner_core.publish.run_sql import open_runs, run_query

    con = open_runs([run_dir])
    try:
        return run_query(con, sql)[1]
    finally:
        con.close()


def test_a_step_samples_fresh_prompts_until_its_batch_is_informative(sampled_run):
    run_dir, tasks, _, _ = sampled_run
    steps = _sql(
        run_dir,
        "SELECT step, sampling_rounds, informative_groups, dropped_groups, zero_std_group_fraction "
        "FROM steps ORDER BY step",
    )
    assert steps == [
        (0, 2, PER_STEP, PER_STEP - 1, pytest.approx((PER_STEP - 1) / (2 * PER_STEP - 1))),
        (1, 1 + MAX_ROUNDS, 0, PER_STEP * (1 + MAX_ROUNDS), 1.0),
    ]  # step 1 hit the cap
    assert {"rollout[step=0,round=1]", "judge[step=0,round=1]", "rollout[step=1,round=2]"} <= set(tasks)
    assert "rollout[step=0,round=2]" not in tasks  # the step was full after two rounds
    # Every sampled rollout is in the catalog, each round's prompts are fresh, and round 1 sampled what was missing.
    per_round = _sql(
        run_dir, "SELECT step, round, count(*), count(DISTINCT prompt_id) FROM rollouts GROUP BY ALL ORDER BY ALL"
    )
    assert per_round == [
        (0, 0, PER_STEP * G, PER_STEP),
        (0, 1, (PER_STEP - 1) * G, PER_STEP - 1),
        (1, 0, PER_STEP * G, PER_STEP),
        (1, 1, PER_STEP * G, PER_STEP),
        (1, 2, PER_STEP * G, PER_STEP),
    ]
    assert _sql(run_dir, "SELECT count(*) FROM rollouts") == [((2 * PER_STEP - 1 + 3 * PER_STEP) * G,)]
    assert _sql(
        run_dir, "SELECT step, count(DISTINCT prompt_id) = count(*) / 2 FROM rollouts GROUP BY step ORDER BY step"
    ) == [(0, True), (1, True)]
    assert _sql(
        run_dir,
        "SELECT count(*) FROM rewards r JOIN rollouts USING (run, step, prompt_id, sample_idx) "
        "WHERE r.reward_version = 'train'",
    ) == [((2 * PER_STEP - 1 + 3 * PER_STEP) * G,)]
    # The update trained on the informative groups of both rounds of step 0, and on nothing at step 1.
    sampled = {p for (p,) in _sql(run_dir, "SELECT DISTINCT prompt_id FROM rollouts WHERE step = 0")}
    trained = _sql(
        run_dir,
        "SELECT DISTINCT step, prompt_id FROM advantages WHERE trained AND reward_version = 'train' ORDER BY ALL",
    )
    assert trained == [(0, p) for p in sorted(sampled & INFORMATIVE[0])] and len(trained) == PER_STEP
    assert (run_dir / "rollouts/step=0/round=1/rollouts.parquet").is_file()
    assert (run_dir / "scores/step=0/round=1/rewards.parquet").is_file()
    # one weights row per step and version, so the catalog's reward SQL sees each rollout once (a row per round
    # doubled every recomputed reward of a two-round step)
    assert _sql(run_dir, "SELECT step, count(*) FROM reward_weights GROUP BY ALL ORDER BY ALL") == [(0, 1), (1, 1)]
    assert _sql(run_dir, "SELECT count(*) FROM rewards_recomputed") == _sql(run_dir, "SELECT count(*) FROM rewards")


def test_steps_record_entropy_and_importance_weight_when_the_loss_uses_them(sampled_run):
    """Step 0 trained (grpo.entropy_coef and grpo.tis_cap on): both figures; step 1 had no signal: NULL."""
    run_dir, _, _, _ = sampled_run
    [(entropy, weight), no_signal] = _sql(run_dir, "SELECT entropy, importance_weight_mean FROM steps ORDER BY step")
    vocab = json.loads(
        (Path(_sql(run_dir, "SELECT policy FROM rollouts WHERE step = 0 LIMIT 1")[0][0]) / "config.json").read_text()
    )["vocab_size"]
    assert 0 < entropy <= math.log(vocab)  # a near-uniform random model: close to log(vocab)
    assert 0 < weight <= TIS_CAP and weight == pytest.approx(1.0, abs=0.05)  # same numerics in hf and the learner
    assert no_signal == (None, None)


def test_a_rerun_is_cached_for_every_round(sampled_run):
    _, tasks, rerun_tasks, _ = sampled_run
    stages = {name for name in rerun_tasks if name.split("[")[0] in STAGES}
    assert stages == {name for name in tasks if name.split("[")[0] in STAGES}
    assert {rerun_tasks[name][0] for name in stages} == {"Cached"}, rerun_tasks


def test_a_rescore_covers_every_round(sampled_run):
    """A reward version recomputed from stored judgments reads every round's files, so it is not stale."""
    from refiner_core.config import recipe_from_dict
    from refiner_core.reward.rescore import rescore_run

    run_dir, _, _, recipe = sampled_run
    doubled = {**recipe, "reward": {**recipe["reward"], "verification_reward": 2.0}}
    _, summary = rescore_run(run_dir, recipe_from_dict(recipe), recipe_from_dict(doubled), "doubled")
    assert [(s.rollouts, s.reward_mean) for s in summary] == [
        ((2 * PER_STEP - 1) * G, pytest.approx(8 / 14)),
        (3 * PER_STEP * G, 0.0),
    ]
    assert _sql(
        run_dir, "SELECT step, rollouts, stale FROM step_rewards WHERE reward_version = 'doubled' ORDER BY step"
    ) == [(0, (2 * PER_STEP - 1) * G, False), (1, 3 * PER_STEP * G, False)]


def test_refill_draws_unused_prompts_deterministically_and_keeps_twins_together():
    ids = [f"p{i:02d}" for i in range(10)]
    used = ids[:4]
    drawn = refill_prompt_ids(ids, used, 3, step=5, sampling_round=1, seed=SEED)
    assert len(drawn) == 3 and not set(drawn) & set(used)
    assert drawn == refill_prompt_ids(ids, used, 3, step=5, sampling_round=1, seed=SEED)
    assert refill_prompt_ids(ids, used, 99, step=5, sampling_round=1, seed=SEED) != drawn  # all 6 left, in its order
    assert sorted(refill_prompt_ids(ids, used, 99, step=5, sampling_round=1, seed=SEED)) == ids[4:]
    twin_of = {p: f"{p}-r" for p in ids} | {f"{p}-r": p for p in ids}
    views = ids + [f"{p}-r" for p in ids]
    # `count` counts views, as the flow counts the groups a step misses (it drew twice as many: 2 questions for 2)
    paired = refill_prompt_ids(views, ["p00", "p00-r"], 4, step=0, sampling_round=1, seed=SEED, twin_of=twin_of)
    assert len(paired) == 4 and all(twin_of[p] in paired for p in paired) and "p00" not in paired
    assert (
        refill_prompt_ids(views, ["p00", "p00-r"], 2, step=0, sampling_round=1, seed=SEED, twin_of=twin_of)
        == (paired[:2])
    )
    odd = refill_prompt_ids(views, ["p00", "p00-r"], 3, step=0, sampling_round=1, seed=SEED, twin_of=twin_of)
    assert odd == paired  # a question's views stay together: one view more rather than one fewer


def test_rollout_files_without_a_round_column_stay_readable(tmp_path):
    """A catalog built from rollouts written before `round` existed, beside new ones: old rows read as NULL."""
    from datetime import datetime

    from refiner_core.publish.catalog import build_catalog
    from refiner_core.schema import ROLLOUTS, to_arrow
    from refiner_core.store.storage import query, write_table

    def row(prompt_id: str, sampling_round: int) -> dict:
        return {
            "run": "r",
            "step": 0,
            "prompt_id": prompt_id,
            "sample_idx": 0,
            "policy": "p",
            "policy_hash": "h",
            "engine": "hf",
            "temperature": 1.0,
            "seed": 1,
            "prompt_token_ids": [1],
            "response_token_ids": [2],
            "response_logprobs": [-0.5],
            "response_text": "x",
            "response_tokens": 1,
            "finish_reason": "stop",
            "response_mask": [True],
            "tool_rounds": 0,
            "final_text": "x",
            "created_at": datetime.now(UTC),
            "round": sampling_round,
        }

    old = tmp_path / "old.parquet"
    pq.write_table(to_arrow(ROLLOUTS, [row("a", 0)]).drop_columns(["round"]), old)
    new = tmp_path / "new.parquet"
    write_table(ROLLOUTS, [row("b", 1)], new)
    counts = build_catalog(tmp_path / "catalog.duckdb", {"rollouts": [old, new]})
    assert counts["rollouts"] == 2
    assert query(tmp_path / "catalog.duckdb", "SELECT prompt_id, round FROM rollouts ORDER BY prompt_id")[1] == [
        ("a", None),
        ("b", 1),
    ]


def test_refill_rounds_draw_by_the_ledgers_weights_as_the_first_round_does():
    """data.weights_from draws a step's prompts by weight; its refill rounds drew uniformly. Drawn by weight, fresh
    and seeded, they take the high-weight prompts the first round left far more often than a uniform draw."""
    from collections import Counter

    from refiner_core.data.schedule import weighted_step_prompt_ids

    ids = [f"p{i:02d}" for i in range(20)]
    weights = {p: (1.0 if i < 5 else 0.05) for i, p in enumerate(ids)}  # p00-p04: 20x as likely
    weighted, uniform = Counter(), Counter()
    for step in range(400):
        first = weighted_step_prompt_ids(ids, weights, step, 4, 42)
        refill = refill_prompt_ids(ids, first, 4, step, 1, 42, weights=weights)
        assert not set(refill) & set(first) and refill == refill_prompt_ids(ids, first, 4, step, 1, 42, weights=weights)
        weighted.update(p in ids[:5] for p in refill)
        uniform.update(p in ids[:5] for p in refill_prompt_ids(ids, first, 4, step, 1, 42))
    assert weighted[True] > 3 * uniform[True]  # measured 647 against 176 of 1600 draws
