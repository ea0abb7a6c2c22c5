import dataclasses

import pytest

from refiner_core.config import ConfigError, RecipeConfig, describe, load_recipe, parse_override


def test_every_field_has_help():
    rows = describe()
    assert len(rows) > 40
    assert all(help_text.strip() for _, _, help_text in rows)
    for f in dataclasses.fields(RecipeConfig):
        assert f.metadata["help"]


def test_recipe_overrides_and_types(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("grpo:\n  learning_rate: 1.0e-3\nrollout:\n  samples_per_prompt: 4\n")
    cfg = load_recipe(
        recipe,
        [
            "grpo.learning_rate=1e-5",
            "rollout.samples_per_prompt=8",
            "judge.mode=expected_score",
            "reward.non_stop_penalty=true",
            "rollout.stop=['</answer>', '</s>']",
        ],
    )
    assert cfg.grpo.learning_rate == 1e-5 and isinstance(cfg.grpo.learning_rate, float)
    assert cfg.rollout.samples_per_prompt == 8
    assert cfg.judge.mode == "expected_score"
    assert cfg.reward.non_stop_penalty is True
    assert cfg.rollout.stop == ["</answer>", "</s>"]
    assert cfg.grpo.beta == 0.001  # default kept


@pytest.mark.parametrize(
    "override,message",
    [
        ("grpo.learnin_rate=1", "did you mean 'grpo.learning_rate'"),
        ("grpo.kl_estimator=k9", "not one of"),
        ("rollout.samples_per_prompt=many", "expected int"),
        ("reward.non_stop_penalty=maybe", "expected true/false"),
        ("nosection.x=1", "unknown field 'nosection'"),
        ("grpo.steps", "section.field=value"),
    ],
)
def test_bad_overrides_are_clear_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe(None, [override])


def test_scientific_notation_is_a_float_only_where_a_float_is_wanted(tmp_path):
    assert parse_override("grpo.steps=4") == (["grpo", "steps"], 4)
    cfg = load_recipe(None, ["grpo.learning_rate=5e-6", "run.name=1e3"])
    assert cfg.grpo.learning_rate == 5e-6 and cfg.run.name == "1e3"
    recipe = tmp_path / "r.yaml"
    recipe.write_text("grpo:\n  learning_rate: 3e-4\nrun:\n  name: 2e5\n")  # YAML 1.1 reads both as strings
    cfg = load_recipe(recipe)
    assert cfg.grpo.learning_rate == 3e-4 and cfg.run.name == "2e5"
