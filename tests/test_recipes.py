"""The refiner recipes: published settings, the scaled-down overrides of docs/recipes.md, and one scaled-down step."""

from __future__ import annotations

import re
import shlex

import duckdb
import pytest

from conftest import REPO, run_cli
from refiner_core.config import load_recipe
from refiner_core.preflight import check_recipe, recipe_warnings

RECIPES_PAGE = (REPO / "docs" / "recipes.md").read_text()
REFINER_RECIPES = ("refiner-answer-only", "refiner-instance-rubric")


def documented_scale_down() -> list[str]:
    """The `--set` overrides of the `scale_down=...` line in docs/recipes.md, as `section.field=value` strings."""
    found = re.search(r'^scale_down="([^"]*)"$', RECIPES_PAGE, re.MULTILINE)
    assert found, 'docs/recipes.md has no scale_down="..." line'
    words = shlex.split(found.group(1))
    assert words[::2] == ["--set"] * (len(words) // 2) and len(words) % 2 == 0, words
    return words[1::2]


# The settings REFERENCE.md section 1 publishes for setups A and B (Qwen3-4B on GPUs).
PUBLISHED = {
    "rollout.engine": "vllm",
    "grpo.learner": "deepspeed",
    "grpo.deepspeed.zero_stage": 3,
    "judge.engine": "openai",
    "rollout.max_new_tokens": 1024,
    "rollout.prompts_per_step": 32,
    "rollout.samples_per_prompt": 8,
    "rollout.temperature": 1.0,
    "run.seed": 42,
    "grpo.kl_estimator": "k3",
    "grpo.beta": 0.001,
    "grpo.learning_rate": 5e-6,
    "grpo.micro_batch_size": 1,
    "grpo.pack_length": 8192,
    "grpo.share_prompt": False,  # a micro-batch is one pack of up to pack_length tokens, not a whole group
    "reward.verification_reward": 10.0,
    "reward.non_stop_penalty": False,
    "reward.gate_judge_score_with_format_bonus": False,
    "rubrics.instance_rubrics_only": False,
}
PER_RECIPE = {
    "refiner-answer-only": {"reward.citation_weight": 0.5, "data.max_prompt_tokens": 8192 - 1024},
    "refiner-instance-rubric": {
        "reward.citation_weight": 0.2,
        "reward.citation_score": "f1",
        "data.max_prompt_tokens": 6144,
    },
}


@pytest.mark.parametrize("name", REFINER_RECIPES)
def test_recipe_has_the_published_settings(name):
    conf = load_recipe(REPO / "recipes" / f"{name}.yaml").to_dict()
    for dotted, expected in {**PUBLISHED, **PER_RECIPE[name]}.items():
        node = conf
        for key in dotted.split("."):  # grpo.deepspeed.zero_stage: a nested section's field
            node = node[key]
        assert node == expected, dotted


@pytest.mark.parametrize("name", REFINER_RECIPES)
def test_documented_scale_down_line_passes_preflight(name):
    assert f".venv/bin/refiner run recipes/{name}.yaml $scale_down" in RECIPES_PAGE
    cfg = load_recipe(REPO / "recipes" / f"{name}.yaml", documented_scale_down())
    assert check_recipe(cfg) == [] and recipe_warnings(cfg) == []
    assert (cfg.rollout.engine, cfg.grpo.learner, cfg.judge.engine) == ("hf", "torch", "transformers")
    # what the overrides leave alone is still the published recipe
    assert cfg.reward.citation_weight == PER_RECIPE[name]["reward.citation_weight"]
    assert (cfg.grpo.kl_estimator, cfg.grpo.beta, cfg.reward.verification_reward) == ("k3", 0.001, 10.0)


@pytest.mark.parametrize("name", REFINER_RECIPES)
def test_the_recipe_as_published_needs_its_checkpoint(name):
    problems = check_recipe(load_recipe(REPO / "recipes" / f"{name}.yaml"))
    assert len(problems) == 1 and problems[0].startswith("model.policy: 'models/qwen3-4b-refiner-sft'")


def test_main_job_recipe_passes_preflight_and_holds_prompts_out():
    cfg = load_recipe(REPO / "recipes" / "refiner-smollm2.yaml")
    assert check_recipe(cfg) == []
    assert cfg.sft.enabled and cfg.data.validation_fraction > 0
    assert 0 < cfg.eval.every < cfg.grpo.steps and cfg.grpo.steps % cfg.eval.every == 0  # a curve, ending at the last
    assert cfg.reward.distractor_penalty > 0  # the part of the reward GRPO learns beyond SFT


@pytest.mark.parametrize(
    "overrides, problem",
    [
        (
            ["eval.every=2"],
            "eval.every > 0 evaluates held-out prompts, and data.validation_fraction = 0 holds out none",
        ),
        (["eval.every=2", "data.validation_fraction=0.2", "eval.greedy=false"], "nothing to evaluate"),
        (["eval.samples=2", "eval.pass_k=4"], "eval.pass_k = 4: must be at most eval.samples (2)"),
        (["eval.pass_rubric_score=2"], "eval.pass_rubric_score = 2.0: must be between 0 and 1"),
    ],
)
def test_preflight_rejects_impossible_eval_settings(overrides, problem):
    problems = check_recipe(load_recipe(REPO / "recipes" / "tiny.yaml", overrides))
    assert any(problem in p for p in problems), problems


def test_instance_rubric_recipe_scaled_down_runs_one_step_on_the_tiny_model(tiny_model_path, api_env, tmp_path):
    tiny = [
        "model.policy=tiny-qwen3",
        "grpo.steps=1",
        "eval.every=1",
        "rollout.max_new_tokens=24",
        "rollout.prompts_per_step=2",
        "eval.prompts=3",
        "model.max_position_embeddings=2048",
        "data.max_prompt_tokens=2000",
    ]
    sets = [w for o in documented_scale_down() + tiny for w in ("--set", o)]
    run_dir = tmp_path / "run"
    code, out, err, _ = run_cli(
        ["run", "recipes/refiner-instance-rubric.yaml", "--run-dir", str(run_dir), *sets], tmp_path, api_env
    )
    assert code == 0, err[-3000:]
    assert "held-out evaluation" in out and "grpo" in out
    con = duckdb.connect(str(run_dir / "catalog.duckdb"), read_only=True)
    try:

        def one(sql):
            return con.execute(sql).fetchall()

        assert one("SELECT count(*), count(DISTINCT prompt_id) FROM rollouts") == [(8, 2)]
        assert one("SELECT DISTINCT citation_score_kind, citation_weight, verification_reward FROM rewards") == [
            ("f1", 0.2, 10.0)
        ]
        assert one("SELECT count(DISTINCT rubric_id) > 0 FROM rubrics WHERE source = 'static'") == [(True,)]
        assert one("SELECT step, phase, count(*) FROM evals GROUP BY ALL ORDER BY 1") == [
            (0, "base", 3),
            (1, "grpo", 3),
        ]
        assert one("SELECT step FROM steps") == [(0,)]
    finally:
        con.close()
