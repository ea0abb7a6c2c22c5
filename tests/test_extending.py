"""docs/extending.md followed as written: a judge from outside the repository, named by its import path in a
recipe, scores a real run; a policy loss added to its table reaches the loss and the learner's settings; every
variant Literal of the config equals its dispatch table; a backend name that is neither registered nor importable
is refused up front."""

from __future__ import annotations

import os
import typing
from pathlib import Path

import pytest
import torch

from conftest import catalog_rows, run_cli
from refiner_core.algo.advantages import ADVANTAGES
from refiner_core.algo.losses import AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES, TIS_LEVELS, TIS_MODES, grpo_token_loss
from refiner_core.config import GRPOConfig
from refiner_core.runtime.registry import resolve

REPO = Path(__file__).resolve().parents[1]

# A judge package of the user's own, outside the repository: every rubric scores 1.5 on the 0-2 scale.
TOY_JUDGE = """
import json


class ConstantJudge:
    name = "constant"
    model_name = "toy-constant-judge"

    def complete(self, conversations):
        return [json.dumps({"score": 1.5}) for _ in conversations]


def make_judge(model_path, settings, dtype, precision="fp32"):
    return ConstantJudge()
"""


def test_the_page_names_files_that_exist():
    page = (REPO / "docs" / "extending.md").read_text()
    import re

    named = set(re.findall(r"`((?:refiner_core|tasks|flows|tests|docs|recipes)/[\w/.]+\.(?:py|md))", page))
    assert len(named) >= 15
    assert [p for p in sorted(named) if not (REPO / p).exists()] == []


@pytest.mark.slow
def test_a_judge_from_outside_the_repository_scores_a_run(api_env, tmp_path):
    package = tmp_path / "outside" / "my_judges"
    package.mkdir(parents=True)  # no __init__.py: a namespace package, as a folder on PYTHONPATH is
    (package / "constant.py").write_text(TOY_JUDGE)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "outside"), os.environ.get("PYTHONPATH", "")])}
    recipe = str(REPO / "recipes" / "tiny.yaml")

    code, out, err, _ = run_cli(
        ["config", recipe, "--check", "--set", "judge.engine=my_judges.constant:make_judge"], tmp_path, env=env
    )
    assert code == 0, err
    code, _, err, _ = run_cli(["config", recipe, "--check", "--set", "judge.engine=my_judges.constant:make"], tmp_path)
    assert code == 2 and "judge.engine = 'my_judges.constant:make': cannot import my_judges.constant" in err

    run_dir = tmp_path / "run"
    args = ["run", recipe, "--run-dir", str(run_dir), "--set", "judge.engine=my_judges.constant:make_judge"]
    code, out, err, _ = run_cli([*args, "--set", "grpo.steps=1"], tmp_path, env={**api_env, **env})
    assert code == 0, err
    rows = catalog_rows(run_dir, "SELECT raw_output, raw_score, kind, oriented_score FROM judge_scores")
    assert rows and {r[:2] for r in rows} == {('{"score": 1.5}', 1.5)}
    assert {(kind, oriented) for _, _, kind, oriented in rows} <= {("positive", 0.75), ("negative", 0.25)}

    # The user's code is part of the stages' keys, as the repository's is: edited, the judging runs again (its
    # judgments were taken from the cache, still scoring 1.5)
    (package / "constant.py").write_text(TOY_JUDGE.replace('{"score": 1.5}', '{"score": 0.5}'))
    code, out, err, _ = run_cli([*args, "--set", "grpo.steps=1"], tmp_path, env={**api_env, **env})
    assert code == 0, err
    rows = catalog_rows(run_dir, "SELECT DISTINCT raw_output, raw_score FROM judge_scores")
    assert rows == [('{"score": 0.5}', 0.5)]


def toy_reinforce(logp, old_logp, advantages, params, sequences):
    """Plain REINFORCE, -A * logp: no ratio, nothing clipped."""
    return -advantages * logp, torch.zeros_like(logp)


def test_a_policy_loss_added_to_its_table_reaches_the_loss_and_the_learner(monkeypatch):
    from conftest import learner_settings

    monkeypatch.setitem(POLICY_LOSSES, "toy_reinforce", toy_reinforce)
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([[1.0], [-2.0]], dtype=torch.float64)
    out = grpo_token_loss(
        logp, logp.detach() - 0.3, advantages, eps_low=0.2, eps_high=0.28, policy_loss="toy_reinforce"
    )
    assert out["loss"].tolist() == [[1.0, 2.0], [-1.0, -6.0]]  # -A * logp, by hand
    out["loss"].sum().backward()
    assert logp.grad.tolist() == [[-1.0, -1.0], [2.0, 2.0]]
    # the learners check a variant's name against the table itself, not a copy of its names
    assert learner_settings(policy_loss="toy_reinforce").policy_loss == "toy_reinforce"
    with pytest.raises(ValueError, match="unknown policy_loss 'toy_other'"):
        learner_settings(policy_loss="toy_other")


@pytest.mark.parametrize(
    "field,table",
    [
        ("policy_loss", POLICY_LOSSES),
        ("kl_estimator", KL_ESTIMATORS),
        ("loss_aggregation", AGGREGATIONS),
        ("tis_level", TIS_LEVELS),
        ("tis_mode", TIS_MODES),
        ("advantage", ADVANTAGES),
    ],
)
def test_each_variant_literal_equals_its_table(field, table):
    assert set(typing.get_args(typing.get_type_hints(GRPOConfig)[field])) == set(table)


def test_an_unknown_backend_is_refused_with_the_closest_name_and_an_import_path_is_taken():
    from refiner_core.rollout.base import ENGINES

    with pytest.raises(ValueError, match=r"rollout engine 'hff': unknown rollout engine \(did you mean 'hf'\?\)"):
        resolve(ENGINES, "rollout engine", "hff")
    assert resolve(ENGINES, "rollout engine", "refiner_core.rollout.hf_engine:make_hf_engine") is resolve(
        ENGINES, "rollout engine", "hf"
    )
