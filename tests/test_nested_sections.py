"""Backend-only fields live in their backend's nested section (judge.openai, grpo.deepspeed); their old flat names
(judge.base_url, grpo.world_size, grpo.deepspeed_offload_optimizer, ...) are still read from recipes, --set flags
and the recipe.yaml of older run folders, with one deprecation line per old name."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import yaml

from refiner_core import config
from refiner_core.config import (
    MOVED_FIELDS,
    ConfigError,
    DeepSpeedConfig,
    OpenAIJudgeConfig,
    RecipeConfig,
    checked_fields,
    describe,
    load_recipe,
    parse_override,
    recipe_from_dict,
)


@pytest.fixture
def deprecations(caplog):
    """The deprecation lines logged while the test runs (each old name is reported once per process: start afresh)."""
    config._reported.clear()
    caplog.set_level(logging.WARNING, logger="refiner_core.config")
    yield lambda: [r.getMessage() for r in caplog.records if "is deprecated" in r.getMessage()]
    config._reported.clear()


def _flat(recipe: dict) -> dict:
    """A resolved recipe as runs before the nested sections wrote it: every moved field under its old name."""
    flat = {section: dict(values) for section, values in recipe.items()}
    for old, new in MOVED_FIELDS.items():
        section, nested, name = new.split(".")
        flat[section][old.split(".")[1]] = recipe[section][nested][name]
    flat["judge"].pop("openai")
    flat["grpo"].pop("deepspeed")
    return flat


def test_every_openai_and_deepspeed_field_has_its_old_name():
    assert {new for new in MOVED_FIELDS.values()} == {
        *(f"judge.openai.{f.name}" for f in dataclasses.fields(OpenAIJudgeConfig)),
        *(f"grpo.deepspeed.{f.name}" for f in dataclasses.fields(DeepSpeedConfig)),
    }
    assert MOVED_FIELDS["grpo.deepspeed_offload_optimizer"] == "grpo.deepspeed.offload_optimizer"
    assert MOVED_FIELDS["judge.base_url"] == "judge.openai.base_url"
    # no old name is still a field of its section
    assert not {old.split(".")[1] for old in MOVED_FIELDS} & {
        f.name for cls in (config.JudgeConfig, config.GRPOConfig) for f in dataclasses.fields(cls)
    }


def test_an_old_flat_recipe_loads_into_the_nested_fields_with_one_line_per_old_name(tmp_path, deprecations):
    recipe = tmp_path / "old.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "judge": {"engine": "openai", "base_url": "http://127.0.0.1:9000/v1", "concurrency": 16},
                "grpo": {"world_size": 2, "zero_stage": 2, "deepspeed_offload_optimizer": True, "steps": 3},
            }
        )
    )
    cfg = load_recipe(recipe)
    assert (cfg.judge.openai.base_url, cfg.judge.openai.concurrency) == ("http://127.0.0.1:9000/v1", 16)
    assert cfg.grpo.deepspeed == DeepSpeedConfig(world_size=2, zero_stage=2, offload_optimizer=True)
    assert cfg.grpo.steps == 3 and cfg.judge.engine == "openai"
    assert sorted(deprecations()) == [
        "grpo.deepspeed_offload_optimizer is deprecated: write grpo.deepspeed.offload_optimizer",
        "grpo.world_size is deprecated: write grpo.deepspeed.world_size",
        "grpo.zero_stage is deprecated: write grpo.deepspeed.zero_stage",
        "judge.base_url is deprecated: write judge.openai.base_url",
        "judge.concurrency is deprecated: write judge.openai.concurrency",
    ]
    load_recipe(recipe)  # read again (a fork or rescore reads a folder's recipe twice): no second line
    assert len(deprecations()) == 5


def test_an_old_name_in_set_works_like_the_new_one(deprecations):
    assert parse_override("grpo.world_size=2") == (["grpo", "deepspeed", "world_size"], 2)
    assert deprecations() == ["grpo.world_size is deprecated: write grpo.deepspeed.world_size"]
    old = load_recipe(None, ["grpo.world_size=2", "judge.api_model=served", "grpo.deepspeed_offload_optimizer=true"])
    new = load_recipe(
        None,
        ["grpo.deepspeed.world_size=2", "judge.openai.api_model=served", "grpo.deepspeed.offload_optimizer=true"],
    )
    assert old == new and old.grpo.deepspeed.world_size == 2 and old.judge.openai.api_model == "served"
    assert len(deprecations()) == 3


def test_a_field_set_by_both_names_to_different_values_is_refused(tmp_path, deprecations):
    both = {"grpo": {"world_size": 2, "deepspeed": {"world_size": 4}}}
    with pytest.raises(ConfigError, match=r"grpo\.world_size \(2\) and grpo\.deepspeed\.world_size \(4\) are both set"):
        recipe_from_dict(both)
    recipe = tmp_path / "both.yaml"
    recipe.write_text(yaml.safe_dump({"judge": {"base_url": "http://a/v1", "openai": {"base_url": "http://b/v1"}}}))
    with pytest.raises(ConfigError, match=r"judge\.base_url .* and judge\.openai\.base_url .* are both set"):
        load_recipe(recipe)
    with pytest.raises(ConfigError, match=r"--set grpo\.world_size=2 and --set grpo\.deepspeed\.world_size=4"):
        load_recipe(None, ["grpo.world_size=2", "grpo.deepspeed.world_size=4"])
    with pytest.raises(ConfigError, match=r"--set judge\.cache=False and --set judge\.openai\.cache=True"):
        load_recipe(None, ["judge.openai.cache=true", "judge.cache=false"])
    # the same value under both names is no conflict
    assert recipe_from_dict({"grpo": {"world_size": 4, "deepspeed": {"world_size": 4}}}).grpo.deepspeed.world_size == 4
    assert load_recipe(None, ["grpo.world_size=4", "grpo.deepspeed.world_size=4"]).grpo.deepspeed.world_size == 4


def test_a_nested_recipe_round_trips_without_deprecation_lines(tmp_path, deprecations):
    cfg = load_recipe(None, ["judge.openai.concurrency=3", "judge.openai.more_base_urls=[http://x/v1]"])
    cfg.grpo.deepspeed.hostfile = "hosts.txt"
    conf = cfg.to_dict()
    assert conf["judge"]["openai"]["concurrency"] == 3 and conf["grpo"]["deepspeed"]["hostfile"] == "hosts.txt"
    assert recipe_from_dict(conf) == cfg
    saved = tmp_path / "recipe.yaml"
    saved.write_text(yaml.safe_dump(conf, sort_keys=False))
    assert load_recipe(saved) == cfg
    assert deprecations() == []


def test_an_old_run_folders_recipe_loads_and_takes_new_names_on_top(tmp_path, deprecations):
    """RUN_DIR/recipe.yaml of a run made before the nested sections holds every field, flat: it loads as it was, and
    a fork's or rescore's --set with a new name overrides its old one (no conflict: the flag wins)."""
    cfg = load_recipe(None, ["judge.openai.concurrency=5", "grpo.deepspeed.zero_stage=2"])
    saved = tmp_path / "recipe.yaml"
    saved.write_text(yaml.safe_dump(_flat(cfg.to_dict()), sort_keys=False))
    assert "world_size" in yaml.safe_load(saved.read_text())["grpo"]
    assert load_recipe(saved) == cfg
    assert len(deprecations()) == len(MOVED_FIELDS)
    forked = load_recipe(saved, ["judge.openai.concurrency=7", "grpo.zero_stage=1"])
    assert (forked.judge.openai.concurrency, forked.grpo.deepspeed.zero_stage) == (7, 1)


def test_a_fork_of_an_old_run_folder(tmp_path, deprecations):
    """`refiner fork` of a folder whose recipe.yaml is flat: the fork's settings name the nested fields."""
    from flows.run_folder import RECIPE_FILE, plan_fork

    parent = tmp_path / "parent"
    parent.mkdir()
    base = load_recipe(None, ["model.lora_sync=merged", "model.precision=fp32"])
    (parent / RECIPE_FILE).write_text(yaml.safe_dump(_flat(base.to_dict()), sort_keys=False))
    cfg, fork = plan_fork(parent, tmp_path / "fork", 0, ["judge.openai.concurrency=2", "grpo.world_size=3"])
    assert (cfg.judge.openai.concurrency, cfg.grpo.deepspeed.world_size) == (2, 3)
    assert sorted(fork.settings) == ["grpo.deepspeed.world_size=3", "judge.openai.concurrency=2"]
    assert load_recipe(None, fork.settings).judge.openai.concurrency == 2  # the recorded flags read back


def test_nested_fields_are_checked_listed_and_suggested(deprecations):
    from refiner_core.preflight import check_values

    cfg = load_recipe(None, ["judge.openai.concurrency=0", "judge.openai.timeout_seconds=0"])
    assert "judge.openai.concurrency" in {name for name, _, _ in checked_fields(cfg)}
    problems = check_values(cfg)
    assert "judge.openai.concurrency = 0: must be at least 1" in problems
    assert "judge.openai.timeout_seconds = 0.0: must be > 0" in problems
    listed = {name for name, _, _ in describe()}
    assert {"judge.openai.base_url", "grpo.deepspeed.offload_optimizer"} <= listed
    assert not {"judge.openai", "grpo.deepspeed", "judge.base_url", "grpo.world_size"} & listed
    with pytest.raises(
        ConfigError, match=r"unknown field 'judge\.base_ur' \(did you mean 'judge\.openai\.base_url'\?\)"
    ):
        load_recipe(None, ["judge.base_ur=x"])
    with pytest.raises(
        ConfigError, match=r"unknown field 'grpo\.zero_stag' \(did you mean 'grpo\.deepspeed\.zero_stage"
    ):
        recipe_from_dict({"grpo": {"zero_stag": 3}})
    with pytest.raises(
        ConfigError, match=r"unknown field 'grpo\.learnin_rate' \(did you mean 'grpo\.learning_rate'\?\)"
    ):
        recipe_from_dict({"grpo": {"learnin_rate": 3}})


def test_the_learner_gets_the_deepspeed_section_as_its_flat_settings():
    from refiner_core.grpo import learner_settings

    cfg = load_recipe(None, ["grpo.deepspeed.world_size=2", "grpo.deepspeed.offload_optimizer=true"])
    settings = learner_settings(cfg.grpo, 1.0, "fp32")
    assert (settings.world_size, settings.zero_stage, settings.deepspeed_offload_optimizer) == (2, 3, True)
    assert (settings.hostfile, settings.launch_over_ssh) == ("", True)


def test_the_model_card_of_an_old_run_folder_names_its_deepspeed_settings(deprecations):
    from refiner_core.publish.model_card import model_card

    cfg = load_recipe(None, ["grpo.learner=deepspeed", "grpo.deepspeed.world_size=4", "grpo.deepspeed.zero_stage=2"])
    for recipe in (cfg.to_dict(), _flat(cfg.to_dict())):
        card = model_card(recipe, kind="grpo", run="r", step=1, checkpoint="checkpoints/step_0001", parent="base")
        assert "deepspeed, ZeRO stage 2, 4 rank(s)" in card


def test_defaults_are_the_old_defaults():
    """One default per knob: the nested sections' defaults are those the flat fields had."""
    cfg = RecipeConfig()
    assert (cfg.judge.openai.base_url, cfg.judge.openai.concurrency, cfg.judge.openai.cache) == (
        "http://127.0.0.1:8000/v1",
        8,
        True,
    )
    assert cfg.grpo.deepspeed == DeepSpeedConfig(
        world_size=1, zero_stage=3, hostfile="", launch_over_ssh=True, offload_optimizer=False
    )


def test_a_backend_entry_names_the_nested_section_of_its_own_settings():
    """Backend.section is where the backend's settings live: each names a nested section of the recipe, and the
    openai judge's and deepspeed learner's name the sections their fields moved to."""
    from refiner_core.agent.tools.base import TOOLS
    from refiner_core.judges.base import JUDGES
    from refiner_core.learners.base import LEARNERS
    from refiner_core.reward.verifiers import VERIFIERS
    from refiner_core.rollout.base import ENGINES
    from refiner_core.runtime.registry import backend

    recipe = RecipeConfig()
    sections = {}
    for table in (JUDGES, LEARNERS, ENGINES, VERIFIERS, TOOLS):
        for name in table:
            if section := backend(table, name).section:
                value = recipe
                for key in section.split("."):
                    value = getattr(value, key)
                assert dataclasses.is_dataclass(value), section
                sections[name] = section
    assert sections == {"openai": "judge.openai", "deepspeed": "grpo.deepspeed"}
    moved_to = {new.rsplit(".", 1)[0] for new in MOVED_FIELDS.values()}
    assert moved_to == set(sections.values())
