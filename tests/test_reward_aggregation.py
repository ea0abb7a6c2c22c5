"""grpo.reward_aggregation 'normalize_then_sum' (GDPO): hand-computed advantages, TRL's formula in float64, the
reward's parts summing to the reward for every branch of REWARD_SQL, flat groups by parts, and a run whose
advantages table holds GDPO's advantages of its rewards table."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from conftest import catalog_rows
from refiner_core.algo.advantages import group_advantages, informative_prompt_ids, normalize_then_sum
from refiner_core.config import RewardConfig, load_recipe
from refiner_core.peer_names import PEER_NAMES
from refiner_core.preflight import check_recipe
from refiner_core.reward.compose import compute_rewards, format_parts, reward_parts, weight_row
from refiner_core.reward.rescore import check_rescorable
from test_rewards import _inputs, _score_row

GDPO = ["grpo.reward_aggregation=normalize_then_sum"]


def _parts_rows(parts: list[dict], groups: list[str]) -> list[dict]:
    """Reward rows whose parts are given: {name: (weight, value)}, the reward their weighted sum."""
    return [
        {"prompt_id": g, "sample_idx": i, "reward": sum(w * v for w, v in p.values()), "parts": p}
        for i, (p, g) in enumerate(zip(parts, groups))
    ]


def _parts_of(row: dict) -> dict:
    return row["parts"]


def test_hand_computed_and_unlike_the_advantage_of_the_sum():
    # Parts x (weight 1) and y (weight 0.5). Group a: x 1, 0 -> z +1, -1; y 0, 0 -> 0. Group b: x 1, 1 -> 0;
    # y 2, 0 -> z +1, -1. Sums 1, -1, 0.5, -0.5: batch mean 0, std (ddof 0) sqrt(2.5 / 4) = 0.790569.
    parts = [{"x": (1.0, x), "y": (0.5, y)} for x, y in ((1, 0), (0, 0), (1, 2), (1, 0))]
    rows = _parts_rows(parts, ["a", "a", "b", "b"])
    gdpo = load_recipe(None, [*GDPO, "grpo.advantage_eps=0"]).grpo
    out, stats = group_advantages(rows, gdpo, _parts_of)
    expected = [1 / np.sqrt(0.625), -1 / np.sqrt(0.625), 0.5 / np.sqrt(0.625), -0.5 / np.sqrt(0.625)]
    assert [a["advantage"] for a in out] == pytest.approx(expected, abs=1e-12)
    assert [round(e, 6) for e in expected] == [1.264911, -1.264911, 0.632456, -0.632456]
    # the rewards 1, 0 and 2, 1 under the default: +-1 in both groups
    summed, _ = group_advantages(rows, load_recipe(None, ["grpo.advantage_eps=0"]).grpo, _parts_of)
    assert [a["advantage"] for a in summed] == pytest.approx([1, -1, 1, -1], abs=1e-12)
    assert stats["informative_groups"] == 2


@pytest.mark.parametrize("seed", range(4))
def test_equals_trls_normalize_then_sum_in_float64(seed):
    """TRL's GRPOTrainer._generate_and_score_completions, 'normalize_then_sum' branch (nanstd: ddof 1, eps 1e-4),
    on 5 groups of 4 with 3 parts; one part constant in a group."""
    gen = torch.Generator().manual_seed(seed)
    groups, size, k = 5, 4, 3
    rewards_per_func = torch.rand(groups * size, k, generator=gen, dtype=torch.float64)
    rewards_per_func[:size, 2] = 0.25
    reward_weights = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)

    grouped = rewards_per_func.view(-1, size, k)
    mean_k = grouped.mean(dim=1, keepdim=True)
    std_k = grouped.std(dim=1, keepdim=True)  # Bessel-corrected, as trl.trainer.utils.nanstd
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, k)
    rewards = (reward_k * reward_weights.unsqueeze(0)).sum(dim=1)
    trl = (rewards - rewards.mean()) / (rewards.std() + 1e-4)

    ours = normalize_then_sum(
        rewards_per_func.numpy(),
        np.tile(reward_weights.numpy(), (groups * size, 1)),
        np.repeat(np.arange(groups), size),
        1e-4,
        ddof=1,
    )
    np.testing.assert_allclose(ours, trl.numpy(), rtol=0, atol=1e-12)


def test_a_group_is_flat_only_when_every_part_is():
    # Group a: parts differ, sums equal (1 x 1 + 0.5 x 0 = 1 x 0 + 0.5 x 2), z-scores +-1 weighted 1 and 0.5:
    # 0.5 and -0.5 before whitening. Group b: every weighted part equal (z, weighted 0, is no signal).
    parts = [{"x": (1.0, 1.0), "y": (0.5, 0.0), "z": (0.0, 0.0)}, {"x": (1.0, 0.0), "y": (0.5, 2.0), "z": (0.0, 0.0)}]
    parts += [{"x": (1.0, 1.0), "y": (0.5, 1.0), "z": (0.0, float(i))} for i in range(2)]
    rows = _parts_rows(parts, ["a", "a", "b", "b"])
    gdpo = load_recipe(None, [*GDPO, "grpo.filter_zero_std_groups=true"]).grpo
    summed = load_recipe(None, ["grpo.filter_zero_std_groups=true"]).grpo
    out, stats = group_advantages(rows, gdpo, _parts_of)
    assert [a["trained"] for a in out] == [True, True, False, False] and stats["informative_groups"] == 1
    assert out[0]["advantage"] > 0 > out[1]["advantage"] and out[2]["advantage"] == out[3]["advantage"] == 0
    out, stats = group_advantages(rows, summed, _parts_of)
    assert not any(a["trained"] for a in out) and stats["informative_groups"] == 0
    assert informative_prompt_ids(rows, gdpo, _parts_of) == {"a"}
    assert informative_prompt_ids(rows, summed, _parts_of) == set()


SNIPPETS, SUPPORTING = ["S1", "S2", "D1"], ["S1", "S2"]
TEXTS = [
    "<answer><snippet id=S1,S2>a</snippet></answer>",
    "<answer><snippet id=S1,D1>a</snippet> <snippet id=X9>b</snippet></answer>",
    "<answer><snippet id=S1>unclosed</answer>",
    "no answer block",
]


def test_the_parts_sum_to_the_reward_on_every_branch_of_the_reward_sql():
    """Random settings and rows through REWARD_SQL (judge and verifier rows, gated, non-stop penalised, overlong,
    distractors, recall): the weighted parts sum to each row's reward."""
    rng = random.Random(0)
    checked = set()
    for trial in range(40):
        settings = RewardConfig(
            verification_reward=rng.choice([1.0, 10.0]),
            rubric_weight=rng.choice([0.0, 1.0]),
            citation_weight=rng.choice([0.0, 0.3]),
            citation_score=rng.choice(["valid_ids", "f1", "dr_tulu"]),
            format_weight=rng.choice([0.0, 1.0]),
            gate_judge_score_with_format_bonus=rng.random() < 0.5,
            non_stop_penalty=rng.random() < 0.5,
            non_stop_penalty_value=-1.0,
            overlong_buffer=rng.choice([0, 20]),
            overlong_factor=rng.choice([0.0, 1.0, 2.0]),
            distractor_penalty=rng.choice([0.0, 2.0]),
            supporting_recall_weight=rng.choice([0.0, 1.5]),
        )
        inputs, scores = [], []
        for i, (text, finish, tokens) in enumerate(itertools.product(TEXTS, ["stop", "length"], [10, 95])):
            extra = {"verifier": "ground_truth", "verifier_score": rng.random()} if i % 3 == 0 else {}
            labels = (SNIPPETS, SUPPORTING if rng.random() < 0.7 else None)
            row = {**format_parts(text, *labels), "citation_f1": rng.random(), **extra}
            inputs.append(_inputs(sample_idx=i, finish_reason=finish, response_tokens=tokens, **row))
            if not extra:
                scores += [_score_row(rng.choice([0.0, 0.5, 1.0, None]), sample_idx=i, rubric=f"r{j}") for j in (0, 1)]
        weights = [weight_row("r", 0, "train", settings, "zero")]
        for out in compute_rewards(inputs, scores, weights):
            parts = reward_parts(out)
            assert sum(w * v for w, v in parts.values()) == pytest.approx(out["reward"], abs=1e-12), (trial, out)
            checked |= {k for k in ("gated", "non_stop_penalized", "cites_distractor") if out[k]}
            checked |= {"overlong"} if out["overlong_penalty"] < 0 else set()
            checked |= {"verifier"} if out["verifier"] != "judge" else set()
    assert checked == {"gated", "non_stop_penalized", "cites_distractor", "overlong", "verifier"}


def test_preflight_wants_group_std_and_rescore_and_the_peer_name_take_it():
    problems = check_recipe(load_recipe(None, [*GDPO, "grpo.advantage=rloo"]))
    assert any(
        "grpo.reward_aggregation 'normalize_then_sum'" in p and "grpo.advantage=group_std" in p for p in problems
    )
    assert not any("reward_aggregation" in p for p in check_recipe(load_recipe(None, GDPO)))
    check_rescorable(load_recipe(None), load_recipe(None, GDPO), 0, [])
    assert PEER_NAMES["multi_objective_aggregation"].ours == "grpo.reward_aggregation"


def _version(run_dir, version: str) -> tuple[list[dict], list[float]]:
    """(rewards rows, advantages) of a reward version, in (prompt_id, sample_idx) order."""
    order = f"WHERE reward_version = '{version}' ORDER BY prompt_id, sample_idx"
    columns = [c for c, *_ in catalog_rows(run_dir, "DESCRIBE rewards")]
    rewards = [dict(zip(columns, r)) for r in catalog_rows(run_dir, f"SELECT * FROM rewards {order}")]
    return rewards, [a for (a,) in catalog_rows(run_dir, f"SELECT advantage FROM advantages {order}")]


def _z_in_groups(column: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """float64: (v - group mean) / (group std (ddof 0) + 1e-4); 0 in a group where v does not vary."""
    out = np.zeros(len(column))
    for g in set(groups):
        block = column[groups == g]
        out[groups == g] = (block - block.mean()) / (block.std() + 1e-4) * (np.ptp(block) > 0)
    return out


def _whiten(x: np.ndarray) -> np.ndarray:
    return (x - x.mean()) / (x.std() + 1e-4)


def _gdpo_by_hand(rewards: list[dict]) -> np.ndarray:
    """Each part z-scored in its group, weighted, summed, whitened over the batch."""
    groups = np.array([r["prompt_id"] for r in rewards])
    parts = [reward_parts(r) for r in rewards]
    summed = sum(w * _z_in_groups(np.array([p[n][1] for p in parts]), groups) for n, (w, _) in parts[0].items())
    return _whiten(summed)


def test_a_run_trains_on_gdpo_advantages_of_its_rewards_and_a_rescore_recomputes_them(
    prefect_server, tiny_recipe, tmp_path
):
    """Responses stopped at a random 'e' vary in length, so two parts vary: the judge's rubric score and the
    overlong penalty (a buffer over the whole budget)."""
    from flows.refiner import refiner_pipeline
    from refiner_core.reward.rescore import rescore_run

    recipe = {
        **tiny_recipe,
        "rollout": {**tiny_recipe["rollout"], "stop": ["e"]},
        "reward": {**tiny_recipe["reward"], "overlong_buffer": 32, "overlong_factor": 1.0},
        "grpo": {**tiny_recipe["grpo"], "steps": 1, "reward_aggregation": "normalize_then_sum"},
    }
    state = refiner_pipeline(recipe=recipe, run_dir=str(tmp_path), return_state=True)
    assert state.is_completed(), state.message
    rewards, advantages = _version(tmp_path, "train")
    assert {n for r in rewards for n, (_, v) in reward_parts(r).items() if v != reward_parts(rewards[0])[n][1]} == {
        "rubric",
        "overlong",
    }
    expected = _gdpo_by_hand(rewards)
    assert advantages == pytest.approx(list(expected), abs=1e-9)
    reward, groups = np.array([r["reward"] for r in rewards]), np.array([r["prompt_id"] for r in rewards])
    whole = _whiten(_z_in_groups(reward, groups))  # the reward as one part
    assert np.abs(expected - whole).max() > 0.05

    # a rescore that weighs the rubric part down: new rewards, GDPO advantages of their parts
    base = load_recipe(tmp_path / "recipe.yaml")
    rescore_run(tmp_path, base, load_recipe(tmp_path / "recipe.yaml", ["reward.rubric_weight=0.25"]), "rw")
    rescored, advantages = _version(tmp_path, "rw")
    assert [r["reward"] for r in rescored] != [r["reward"] for r in rewards]
    assert {reward_parts(r)["rubric"][0] for r in rescored} == {0.25 * rescored[0]["verification_reward"]}
    assert advantages == pytest.approx(list(_gdpo_by_hand(rescored)), abs=1e-9)
