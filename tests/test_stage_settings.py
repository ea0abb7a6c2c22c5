"""Each stage's settings are cut once from the recipe by the fields' own read_by: a setting only the flow reads is in
no stage's input (no cache key), every other setting is in the input of a stage that reads it, and a stage reads
its input through a frozen view holding exactly those fields."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from conftest import REPO
from refiner_core.config import (
    ROLLOUT_ENGINE_FIELDS,
    AgentConfig,
    DeepSpeedConfig,
    OpenAIJudgeConfig,
    load_recipe,
)
from refiner_core.stage_settings import (
    SECTION_INPUTS,
    SECTION_TYPES,
    StageSettings,
    input_fields,
    stage_settings,
    stage_view,
)


def _recipe(overrides=()):
    """A recipe as a run resolves it (model.lora_sync 'auto' is decided per run: 'merged' is one outcome)."""
    return load_recipe(None, ["model.lora_sync=merged", *overrides])


def _changed(value, hint):
    """A different valid-looking value of the same type."""
    if typing.get_origin(hint) is typing.Literal:
        return next(v for v in typing.get_args(hint) if v != value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 3
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, list):
        return [*value, "x"]
    if isinstance(value, dict):
        return {**value, "x": "y"}
    raise AssertionError(f"no changed value for {value!r}")


def _fields():
    """(section, field, type) of every recipe field the stage inputs are cut from (nested sections whole)."""
    for section in SECTION_INPUTS:
        hints = typing.get_type_hints(SECTION_TYPES[section])
        for f in dataclasses.fields(SECTION_TYPES[section]):
            yield section, f, hints[f.name]


def _changes():
    """(section, field, changed value) of every recipe field: one each, and for a nested section (rollout.agent,
    judge.openai, grpo.deepspeed) one per field of it, each changing that field alone."""
    for section, f, hint in _fields():
        value = getattr(getattr(_recipe(), section), f.name)
        if not dataclasses.is_dataclass(hint):
            yield section, f, _changed(value, hint)
            continue
        hints = typing.get_type_hints(hint)
        for g in dataclasses.fields(hint):
            yield section, f, dataclasses.replace(value, **{g.name: _changed(getattr(value, g.name), hints[g.name])})


def test_a_flow_only_setting_is_in_no_stage_input_and_every_other_is_in_one():
    base = stage_settings(_recipe())
    flow_only, read = [], []
    for section, f, value in _changes():
        cfg = _recipe()
        setattr(getattr(cfg, section), f.name, value)
        if section == "model" and f.name == "lora_sync":
            cfg.model.lora_sync = "adapter"  # resolved values only ('auto' is decided per run)
        changed = {
            name
            for name in StageSettings.__dataclass_fields__
            if getattr(stage_settings(cfg), name) != getattr(base, name)
        }
        (flow_only if f.metadata.get("read_by") == () else read).append((f"{section}.{f.name}", changed))
    assert {name for name, _ in flow_only} == {
        "grpo.steps",
        "grpo.async_steps",
        "grpo.ref_sync_every",
        "grpo.ref_mixup_alpha",
        "eval.every",
        "judge.price_per_mtok_in",
        "judge.price_per_mtok_out",
        "judge.budget_usd",
        "judge.anchor_every",
        "judge.anchor_rollouts",
        "rollout.dynamic_sampling",  # its one effect on a stage is filter_zero_std_groups (checked below)
        "rollout.dynamic_sampling_max_rounds",
        "sft.enabled",
    }
    for name, changed in flow_only:
        if name != "rollout.dynamic_sampling":
            assert changed == set(), name
    # a model field no stage input holds is read by the flow itself (which model, its precision, ...): those are
    # stage parameters of their own (policy manifests, dtype, precision), not cut from the section
    unread = sorted(name for name, changed in read if not changed)
    assert unread == [
        "model.dtype",
        "model.lora_sync",  # in the engine input only through the adapter rank it decides (vllm engines)
        "model.max_position_embeddings",
        "model.policy",
        "model.precision",
        "model.reference",
    ]


def test_backend_sections_go_whole_into_their_stage_inputs():
    """judge.openai goes to the judge input (judge, judge-anchors, evaluate) and grpo.deepspeed to the update input,
    each as one nested dict, which stage_view builds back into its section type."""
    inputs = stage_settings(_recipe(["judge.openai.concurrency=3", "grpo.deepspeed.world_size=2"]))
    assert inputs.judge["openai"]["concurrency"] == 3 and "concurrency" not in inputs.judge
    assert inputs.update["deepspeed"]["world_size"] == 2 and "world_size" not in inputs.update
    assert [name for name in StageSettings.__dataclass_fields__ if "openai" in getattr(inputs, name)] == ["judge"]
    assert [name for name in StageSettings.__dataclass_fields__ if "deepspeed" in getattr(inputs, name)] == ["update"]
    judge, update = stage_view("judge", inputs.judge), stage_view("update", inputs.update)
    assert isinstance(judge.openai, OpenAIJudgeConfig) and judge.openai.concurrency == 3
    assert isinstance(update.deepspeed, DeepSpeedConfig) and update.deepspeed.world_size == 2


def test_dynamic_sampling_turns_on_the_update_filter_and_says_so_in_the_update_input():
    cfg = _recipe(["rollout.dynamic_sampling=true"])
    assert stage_settings(cfg).update["filter_zero_std_groups"] is True
    assert stage_settings(_recipe()).update["filter_zero_std_groups"] is False


def test_a_decay_over_the_run_puts_the_runs_length_in_the_update_input():
    """lr_decay_steps 0 is grpo.steps, which only the flow reads otherwise: the update input gets the number, so a
    longer run recomputes its updates under a decaying rate, and a constant rate leaves them cached."""
    assert stage_settings(_recipe(["grpo.lr_scheduler_type=cosine", "grpo.steps=7"])).update["lr_decay_steps"] == 7
    fixed = ["grpo.lr_scheduler_type=cosine", "grpo.lr_decay_steps=5"]
    assert stage_settings(_recipe([*fixed, "grpo.steps=7"])).update == stage_settings(_recipe(fixed)).update
    assert stage_settings(_recipe(["grpo.steps=7"])).update == stage_settings(_recipe()).update


def test_the_inputs_cut_what_the_stages_read():
    assert [f.name for f in input_fields("engine")] == []  # built by engine_settings, with its adapter rank
    rollout = {f.name for f in input_fields("rollout")}
    assert not rollout & set(ROLLOUT_ENGINE_FIELDS) and "dynamic_sampling" not in rollout
    engine_marked = {
        f.name for f in dataclasses.fields(SECTION_TYPES["rollout"]) if f.metadata.get("read_by") == ("engine",)
    }
    assert engine_marked == set(ROLLOUT_ENGINE_FIELDS)
    assert [f.name for f in input_fields("eval_rollout")] == [
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "max_new_tokens",
        "stop",
        "agent",
    ]
    assert [f.name for f in input_fields("source")] == ["path", "format", "fields", "split", "hub_config"]
    sft = {f.name for f in input_fields("sft_prepare")} | {f.name for f in input_fields("sft_train")}
    assert sft == {f.name for f in dataclasses.fields(SECTION_TYPES["sft"])} - {"enabled"}
    assert not {f.name for f in input_fields("sft_prepare")} & {f.name for f in input_fields("sft_train")}
    assert [f.name for f in input_fields("lora")] == [
        "lora_rank",
        "lora_alpha",
        "lora_dropout",
        "lora_target_modules",
        "lora_save_merged",
    ]


def test_a_stage_reads_its_input_through_a_view_of_exactly_its_fields():
    inputs = stage_settings(load_recipe(REPO / "recipes" / "tiny.yaml", ["model.lora_sync=merged"]))
    update = stage_view("update", inputs.update)
    assert update.learning_rate == inputs.update["learning_rate"]
    with pytest.raises(AttributeError):
        update.steps  # noqa: B018  (flow-only: not in the update's cache key, so not readable there)
    with pytest.raises(dataclasses.FrozenInstanceError):
        update.learning_rate = 1.0
    evaluation = stage_view("eval_rollout", inputs.eval_rollout)
    assert (
        isinstance(evaluation.agent, AgentConfig) and evaluation.max_new_tokens == inputs.eval_rollout["max_new_tokens"]
    )
    with pytest.raises(ValueError, match=r"missing \['epochs'\], unexpected \['steps'\]"):
        stage_view("sft_train", {**{k: v for k, v in inputs.sft_train.items() if k != "epochs"}, "steps": 3})


def test_every_stage_input_is_plain_json_and_one_per_stage_field():
    inputs = dataclasses.asdict(stage_settings(_recipe()))
    import json

    assert json.loads(json.dumps(inputs)) == inputs  # cache keys hash them
    assert all(f.metadata["help"] for f in dataclasses.fields(StageSettings))


def test_the_code_version_changes_with_a_keyed_librarys_version(monkeypatch):
    """A stage computed under transformers X is not a cache hit under transformers Y: generation, tokenization
    and numerics may differ, so the upgraded run computes anew (its folder records the new code version)."""
    import importlib.metadata

    import refiner_core

    before = refiner_core.code_version()
    assert refiner_core.code_version() == before  # stable within a process and across
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "99.0" if name == "transformers" else real(name))
    assert refiner_core.library_versions()["transformers"] == "99.0"
    assert refiner_core.code_version() != before
