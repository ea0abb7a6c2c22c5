"""TRL's and verl's names for our settings: an unknown field that is one of them is answered with ours, and the
table in docs/recipes.md is the one the code uses."""

import re
import typing
from pathlib import Path

import pytest

from refiner_core.config import ConfigError, RecipeConfig, describe, load_recipe, recipe_from_dict
from refiner_core.peer_names import PEER_NAMES, PEER_VALUES, SHARED_NAME_VALUES

OURS = {name for name, _, _ in describe()}
DOCS = Path(__file__).resolve().parents[1] / "docs" / "recipes.md"


def test_each_peer_name_points_at_a_field_we_have_and_is_not_one_of_ours():
    leaves = {name.rsplit(".", 1)[-1] for name in OURS}
    assert {p.ours for p in PEER_NAMES.values()} <= OURS
    assert not set(PEER_NAMES) & leaves  # ours would be reported as unknown only in a wrong section


@pytest.mark.parametrize(
    ("setting", "answer"),
    [
        ("grpo.num_generations=8", "(TRL's num_generations is rollout.samples_per_prompt here)"),
        ("rollout.n=8", "(verl's n is rollout.samples_per_prompt here)"),
        ("num_generation=8", "(TRL's num_generations is rollout.samples_per_prompt here)"),  # a near miss
        ("grpo.kl_loss_type=low_var_kl", "(verl's kl_loss_type is grpo.kl_estimator here; kl = k1, mse = k2,"),
        # not a peer's name: our field of that name in other sections, then near misses in the section
        ("grpo.temperature=1", "(did you mean 'rollout.temperature' or 'judge.openai.temperature' or"),
        ("grpo.learnin_rate=1", "(did you mean 'grpo.learning_rate'?)"),
        ("judge.base_ur=x", "(did you mean 'judge.openai.base_url'?)"),
    ],
)
def test_an_unknown_field_is_answered_with_our_name(setting, answer):
    with pytest.raises(ConfigError) as raised:
        load_recipe(None, [setting])
    assert str(raised.value).startswith(f"unknown field {setting.split('=')[0]!r} {answer}")


def test_a_recipe_file_with_a_peer_name_is_answered_too():
    with pytest.raises(ConfigError, match=r"unknown field 'grpo\.clip_ratio_high' \(verl's clip_ratio_high is grpo\."):
        recipe_from_dict({"grpo": {"clip_ratio_high": 0.28}})


def test_the_docs_table_is_the_code_table():
    rows = re.findall(r"^\| (TRL|verl|TRL, verl): `(\w+)` \| `([\w.]+)` \| (.*?) ?\|$", DOCS.read_text(), re.M)
    assert [(peer, name, ours, note.strip()) for peer, name, ours, note in rows] == [
        (p.peer, name, p.ours, p.note) for name, p in PEER_NAMES.items()
    ]


def test_config_fields_names_each_field_as_trl_and_verl_do():
    from typer.testing import CliRunner

    from flows.cli import app

    lines = CliRunner().invoke(app, ["config", "--fields"]).output.splitlines()
    at = lines.index("rollout.samples_per_prompt = 4")
    assert lines[at + 2] == "    Elsewhere: TRL num_generations, verl n."
    assert not lines[lines.index("rollout.top_p = 1.0") + 2].startswith("    Elsewhere")  # same name both sides


@pytest.mark.parametrize(
    ("setting", "answer"),
    [
        ("grpo.advantage=grpo", "(verl's adv_estimator 'grpo' is 'group_std' here)"),
        ("grpo.loss_aggregation=grpo", "(TRL's loss_type 'grpo' is 'sequence_mean' here)"),
        ("grpo.kl_estimator=low_var_kl", "(verl's kl_loss_type 'low_var_kl' is 'k3' here)"),
        (
            "grpo.lr_scheduler_type=cosine_with_min_lr",
            "(TRL's lr_scheduler_type 'cosine_with_min_lr' is 'cosine' here)",
        ),
    ],
)
def test_a_peers_value_for_a_choice_is_answered_with_ours(setting, answer):
    with pytest.raises(ConfigError) as raised:
        load_recipe(None, [setting])
    assert str(raised.value).endswith(answer)
    with pytest.raises(ConfigError) as raised:
        load_recipe(None, ["grpo.advantage=groups"])
    assert str(raised.value).endswith("]") and "(" not in str(raised.value)  # no peer's value: the choices alone


def test_each_peer_value_is_a_choice_we_have_and_in_the_table():
    for setting, values in PEER_VALUES.items():
        choices = {str(c) for c in typing.get_args(_field_type(PEER_NAMES[setting].ours))}
        for value, ours in values.items():
            assert ours in choices and value not in choices
            assert f"{value} = {ours}" in PEER_NAMES[setting].note


def test_each_value_of_a_shared_name_is_a_choice_we_have_and_documented():
    docs = " ".join(DOCS.read_text().split())  # line breaks as spaces
    for field, (peer, values) in SHARED_NAME_VALUES.items():
        choices = {str(c) for c in typing.get_args(_field_type(field))}
        for value, ours in values.items():
            assert ours in choices and value not in choices
            assert f"{peer}'s `{field.rsplit('.', 1)[-1]}: {value}` is `{ours}`" in docs


def _field_type(dotted: str):
    section, name = dotted.split(".")
    cls = typing.get_type_hints(RecipeConfig)[section]
    return typing.get_type_hints(cls)[name]


def test_the_documented_answers_are_what_refiner_run_prints():
    from typer.testing import CliRunner

    from flows.cli import app

    shown = re.findall(r"^\$ refiner run (\S+) --set (\S+)\n(error: .*)$", DOCS.read_text(), re.M)
    assert len(shown) == 2
    for recipe, setting, printed in shown:
        result = CliRunner().invoke(app, ["run", str(DOCS.parents[1] / recipe), "--set", setting])
        assert (result.exit_code, result.output.strip()) == (2, printed)
