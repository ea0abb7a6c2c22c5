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


NUMBER_LIKE_TEXT = ["007", "0123", "1:30", "1_000", "0x1F", "1.10", "2026-01-02", "yes"]


@pytest.mark.parametrize("text", NUMBER_LIKE_TEXT)
def test_a_text_setting_keeps_the_text_yaml_1_1_reads_as_a_number(text, tmp_path):
    """YAML 1.1 reads these unquoted as 7, 83 (octal), 90 (sexagesimal), 1000, 31, 1.1, a date and True: a run
    named so would land in another folder, a judge cache namespace would be another's."""
    cfg = load_recipe(None, [f"run.name={text}", f"judge.openai.cache_namespace={text}", f"model.policy={text}"])
    assert (cfg.run.name, cfg.judge.openai.cache_namespace, cfg.model.policy) == (text, text, text)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"run:\n  name: {text}\njudge:\n  openai:\n    cache_namespace: {text}\n")
    cfg = load_recipe(recipe)
    assert (cfg.run.name, cfg.judge.openai.cache_namespace) == (text, text)
    assert type(cfg.run.name) is str and dataclasses.asdict(cfg)["run"]["name"] == text


def test_refiner_config_shows_a_run_name_as_given():
    from typer.testing import CliRunner

    from flows.cli import app

    result = CliRunner().invoke(app, ["config", "recipes/tiny.yaml", "--set", "run.name=0123"])
    assert result.exit_code == 0, result.output
    assert "  name: '0123'" in result.output.splitlines()  # run.name, quoted by YAML as the text it is


def test_other_settings_still_read_yaml(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("run:\n  seed: 0x10\n  keep_engines: no\ngrpo:\n  steps: 1_000\nrollout:\n  temperature: 1\n")
    cfg = load_recipe(recipe, ["sft.enabled=yes", "grpo.learning_rate=1e-5"])
    assert (cfg.run.seed, cfg.run.keep_engines, cfg.grpo.steps, cfg.sft.enabled) == (16, False, 1000, True)
    assert cfg.rollout.temperature == 1.0 and isinstance(cfg.rollout.temperature, float)
    assert cfg.grpo.learning_rate == 1e-5


def test_list_items_are_typed(tmp_path):
    cfg = load_recipe(None, ["grpo.adam_betas=[0.9, 1e-3]", "rollout.stop=[</answer>, no, 0123]"])
    assert cfg.grpo.adam_betas == [0.9, 1e-3] and all(type(b) is float for b in cfg.grpo.adam_betas)
    assert cfg.rollout.stop == ["</answer>", "no", "0123"]  # YAML 1.1 reads `no` as false, 0123 as 83
    recipe = tmp_path / "r.yaml"
    recipe.write_text("grpo:\n  adam_betas: [0.9, 1e-3]\nrollout:\n  stop: [</answer>, no]\n")
    cfg = load_recipe(recipe)
    assert cfg.grpo.adam_betas == [0.9, 1e-3] and cfg.rollout.stop == ["</answer>", "no"]
    with pytest.raises(ConfigError, match=r"grpo.adam_betas\[1\]: expected float, got 'high'"):
        load_recipe(None, ["grpo.adam_betas=[0.9, high]"])
    with pytest.raises(ConfigError, match=r"grpo.adam_betas\[1\]: expected float, got True"):
        load_recipe(None, ["grpo.adam_betas=[0.9, true]"])


@pytest.mark.parametrize(
    "override", ["grpo.clip_cov_lb=nan", "grpo.learning_rate=.inf", "grpo.adam_betas=[0.9, .nan]", "grpo.beta=-inf"]
)
def test_a_number_setting_is_finite(override):
    """NaN passes every range check (each comparison is false) and poisons what it enters; infinity is no setting."""
    with pytest.raises(ConfigError, match="expected a finite number"):
        load_recipe(None, [override])


@pytest.mark.parametrize(
    "override,stored",
    [("rollout.sleep_level=2.0", 2), ("rollout.sleep_level=2", 2), ("grpo.advantage_std_ddof=1.0", 1)],
)
def test_a_fixed_choice_number_is_its_choice(override, stored):
    """2.0 is the choice 2, stored as the int: the stage cache key of the same setting does not change."""
    section, name = override.split("=")[0].split(".")
    value = getattr(getattr(load_recipe(None, [override]), section), name)
    assert value == stored and type(value) is int


@pytest.mark.parametrize("override", ["rollout.sleep_level=true", "grpo.advantage_std_ddof=yes"])
def test_a_bool_is_no_fixed_choice_number(override, tmp_path):
    with pytest.raises(ConfigError, match="True is not one of"):
        load_recipe(None, [override])
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rollout:\n  sleep_level: on\n")
    with pytest.raises(ConfigError, match=r"rollout.sleep_level: True is not one of \[0, 1, 2\]"):
        load_recipe(recipe)


def test_set_fills_a_section_left_empty(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  policy: tiny-qwen3\neval:\n  # every: 3\n")
    assert load_recipe(recipe, ["eval.every=2"]).eval.every == 2
    recipe.write_text("eval: 3\n")
    with pytest.raises(ConfigError, match="'eval' is not a section"):
        load_recipe(recipe, ["eval.every=2"])
