"""docs/extending.md followed as written: a judge from outside the repository, named by its import path in a
recipe, scores a real run; a policy loss added to its table reaches the loss and the learner's settings; every
variant Literal of the config equals its dispatch table; a backend name that is neither registered nor importable
is refused up front."""

from __future__ import annotations

import os
import re
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


def test_a_policy_loss_that_breaks_its_contract_is_an_error_not_a_broadcast(monkeypatch):
    """A variant returning the loss alone (unpacked row by row into loss and mask) or a per-sequence [B, 1] loss
    (broadcast over the tokens) trained on wrong values without a word; it is an error that quotes the contract."""
    from refiner_core.config import ExtensionError

    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], dtype=torch.float64)
    advantages = torch.tensor([[1.0], [-2.0]], dtype=torch.float64)
    broken = {
        "lone": lambda logp, old, adv, params, seq: -adv * logp,
        "per_sequence": lambda logp, old, adv, params, seq: (
            (-adv * logp).sum(1, keepdim=True),
            torch.zeros_like(logp),
        ),
        "floats": lambda logp, old, adv, params, seq: (1.0, 0.0),
    }
    for name, loss in broken.items():
        monkeypatch.setitem(POLICY_LOSSES, name, loss)
        with pytest.raises(ExtensionError, match=rf"grpo.policy_loss '{name}' returned .*two tensors of .* \(2, 2\)"):
            grpo_token_loss(logp, logp - 0.3, advantages, eps_low=0.2, eps_high=0.28, policy_loss=name)


def test_an_advantage_that_breaks_its_contract_and_a_reward_that_is_not_finite_are_errors(monkeypatch):
    """One value short gave the last response advantage 0; one per group gave wrong ones; NaN went on to the
    weights. Each is an error now, as is a NaN reward (a NaN loss every step, then a rollout that cannot sample)."""
    import numpy as np

    from refiner_core.algo.advantages import NonFiniteReward, group_advantages
    from refiner_core.config import ExtensionError

    rows = [{"prompt_id": p, "sample_idx": s, "reward": float(s)} for p in ("a", "b") for s in range(2)]
    broken = {
        "short": lambda r, g, eps, ddof: r[:-1] - r.mean(),
        "per_group": lambda r, g, eps, ddof: np.array([r[g == k].mean() for k in np.unique(g)]),
        "nan": lambda r, g, eps, ddof: r * np.nan,
    }
    for name, advantage in broken.items():
        monkeypatch.setitem(ADVANTAGES, name, advantage)
        with pytest.raises(ExtensionError, match=rf"grpo.advantage '{name}' returned .* for 4 rewards"):
            group_advantages(rows, GRPOConfig(advantage=name))
    with pytest.raises(NonFiniteReward, match=r"prompt 'b' sample 1: reward nan .* is not finite"):
        group_advantages([*rows[:3], {**rows[3], "reward": float("nan")}], GRPOConfig())


def test_a_verifier_that_breaks_its_contract_fails_the_step_instead_of_scoring_it(monkeypatch):
    """One verdict short left a rollout scored 'judge' with reward 0 (and trained on advantage -1.5); one too many
    were cut; a NaN score went into the rewards; floats failed deep in the stage. Each is now an error that names
    the verifier and its contract, and is not retried."""
    import sys
    import types

    from refiner_core.config import ExtensionError
    from refiner_core.reward.ground_truth import Verdict
    from refiner_core.reward.verifiers import make_verifier
    from tasks.stage import NOT_RETRYABLE

    rollouts = [{"prompt_id": "p", "sample_idx": s, "response_text": "1"} for s in range(2)]
    good = Verdict(1.0, "1", "exact")
    outside = types.ModuleType("toy_verifiers")
    cases = {
        "short": ([good], r"returned 1 verdicts for 2 rollouts"),
        "long": ([good] * 3, r"returned 3 verdicts for 2 rollouts"),
        "nan": ([good, Verdict(float("nan"), "1", "exact")], r"gave prompt 'p' sample 1 the score nan"),
        "floats": ([1.0, 0.0], r"returned float for prompt 'p' sample 0, not a Verdict"),
        "text": ([good, Verdict("1", "1", "exact")], r"gave prompt 'p' sample 1 the score '1'"),
    }
    for name, (verdicts, _) in cases.items():
        setattr(outside, name, lambda verdicts=verdicts: lambda rollouts, prompts: verdicts)
    outside.nothing = lambda: None
    monkeypatch.setitem(sys.modules, "toy_verifiers", outside)
    for name, (_, message) in cases.items():
        with pytest.raises(ExtensionError, match=rf"reward.verifier 'toy_verifiers:{name}' {message}"):
            make_verifier(f"toy_verifiers:{name}")(rollouts, {"p": {}})
    with pytest.raises(ExtensionError, match=r"its factory returned NoneType, not a function verify_step"):
        make_verifier("toy_verifiers:nothing")
    assert issubclass(ExtensionError, NOT_RETRYABLE)
    # numpy's numbers and a bool `correct` are numbers: kept as they worked before the check
    import numpy as np

    numeric = [Verdict(np.float32(1.0), "1", "exact", correct=True), Verdict(np.int64(0), "2", "exact")]
    outside.numeric = lambda: lambda rollouts, prompts: numeric
    assert make_verifier("toy_verifiers:numeric")(rollouts, {"p": {}}) == numeric


def test_an_outside_backends_data_files_enter_the_cache_keys_and_its_bytecode_does_not(tmp_path, monkeypatch):
    """A word list the outside verifier reads beside its code changed what it scores, and the stages stayed Cached:
    only the package's .py files were hashed. Every file of the package is now; caches and hidden folders are not."""
    from refiner_core.runtime import registry

    package = tmp_path / "toy_lexicon"
    (package / "__pycache__").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "verify.py").write_text("def make_verifier():\n    return None\n")
    (package / "words.json").write_text('["two"]')
    monkeypatch.syspath_prepend(str(tmp_path))

    def key() -> dict:
        registry._package_hash.cache_clear()  # one hash per process and package: a new run is a new process
        return registry.outside_sources({"reward": {"verifier": "toy_lexicon.verify:make_verifier"}})

    first = key()
    assert list(first) == ["toy_lexicon.verify"]
    (package / "__pycache__" / "verify.cpython-311.pyc").write_bytes(b"\0")
    (package / ".mypy_cache").mkdir()
    (package / ".mypy_cache" / "x").write_text("y")
    assert key() == first
    (package / "words.json").write_text('["two", "three"]')
    assert key() != first


def test_a_stage_table_missing_from_the_schema_fails_the_catalog_instead_of_vanishing(tmp_path):
    """A new stage's manifest entry whose table is not in ALL_TABLES was left out of the catalog without a word."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from refiner_core.publish.catalog import build_catalog

    path = tmp_path / "response_stats.parquet"
    pq.write_table(pa.table({"run": ["r"], "step": [0]}), path)
    with pytest.raises(ValueError, match=r"files of \['response_stats'\] name no table of refiner_core/schema.py"):
        build_catalog(tmp_path / "catalog.duckdb", {"response_stats": [str(path)]})
    assert not (tmp_path / "catalog.duckdb").exists()


def test_preflight_tries_the_updates_variants_on_a_dummy_batch(monkeypatch):
    """A variant added with a step forgotten (its knob left out of SurrogateParams, a wrong signature, a broken
    return) passed preflight and failed the first update, after a rollout and a judge, retried twice."""
    from refiner_core.config import load_recipe
    from refiner_core.preflight import variant_problems

    monkeypatch.setitem(POLICY_LOSSES, "forgot_knob", lambda logp, old, adv, params, seq: params.my_scale * logp)
    monkeypatch.setitem(POLICY_LOSSES, "two_args", lambda logp, adv: (logp, logp))
    monkeypatch.setitem(ADVANTAGES, "per_group", lambda r, g, eps, ddof: r[::2])
    cases = {
        ("policy_loss", "forgot_knob"): r"AttributeError: 'SurrogateParams' object has no attribute 'my_scale'",
        ("policy_loss", "two_args"): r"TypeError: .*takes 2 positional arguments but 5 were given",
        ("advantage", "per_group"): r"ExtensionError: grpo.advantage 'per_group' returned 2 values for 4 rewards",
    }
    for (field, name), message in cases.items():
        cfg = load_recipe("recipes/tiny.yaml", [])
        setattr(cfg.grpo, field, name)  # its Literal extended (step 2), as a recipe naming it would load
        [problem] = variant_problems(cfg)
        assert problem.startswith("grpo: the update fails on a dummy batch (") and re.search(message, problem)
    for name in ("ppo_clip", "gspo", "sapo", "clip_cov"):
        assert variant_problems(load_recipe("recipes/tiny.yaml", [f"grpo.policy_loss={name}"])) == []


def test_an_outside_factory_that_cannot_take_its_tables_call_fails_preflight(monkeypatch):
    """A factory checked only for being callable passed preflight and failed inside its stage, retried twice, with
    an error that did not name the backend (`sig() got an unexpected keyword argument 'precision'`)."""
    import sys
    import types

    from refiner_core.config import load_recipe
    from refiner_core.preflight import backend_problems

    outside = types.ModuleType("toy_backends")
    outside.judge_without_precision = lambda model_path, settings, dtype: None
    outside.judge = lambda model_path, settings, dtype, precision="fp32": None
    outside.verifier_with_answer = lambda final_answer="last_expression": None
    outside.verifier_wanting_rows = lambda rows: None
    outside.tool = lambda settings: None
    monkeypatch.setitem(sys.modules, "toy_backends", outside)

    def problems(*settings: str) -> list[str]:
        return backend_problems(load_recipe("recipes/tiny.yaml", list(settings)))

    [problem] = problems("judge.engine=toy_backends:judge_without_precision")
    assert problem.startswith(
        "judge.engine = 'toy_backends:judge_without_precision': its factory cannot be called as judge engine "
        "factories are, with (model_path, settings, dtype, precision=...): got an unexpected keyword argument"
    ), problem
    [problem] = problems("reward.verifier=toy_backends:verifier_wanting_rows")
    assert "cannot be called as verifier factories are, with (): missing a required argument: 'rows'" in problem
    assert problems("judge.engine=toy_backends:judge", "reward.verifier=toy_backends:verifier_with_answer") == []
