"""What each stage reads of a recipe, cut once from the resolved recipe.

A stage's cache key holds exactly the settings it reads: a setting only the flow reads (grpo.steps, eval.every, the
judge's prices) leaves every finished stage Cached, and one stage's setting (sft.epochs) leaves the others Cached.
Which stage input reads a field is said on the field (`config.opt(..., read_by=...)`); without it the field goes to
the inputs its section goes to (SECTION_INPUTS). A stage receives its input as a plain dict (JSON: its cache key
hashes it) and reads it through `stage_view`, a frozen object with exactly those fields: reading a setting that is
not in its cache key fails instead of silently taking a default.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any

from refiner_core.config import RecipeConfig, SourceConfig, engine_settings


def _input(section: str, help: str, only: type | None = None) -> Any:
    """A StageSettings field: the stage input cut from recipe `section`; `only`: of that class's fields alone."""
    return field(metadata={"section": section, "only": only, "help": help})


@dataclass(frozen=True)
class StageSettings:
    """Every stage input of one recipe, each the plain dict of the settings that stage reads (`stage_settings`)."""

    data: dict = _input("data", "prepare-data: the data section.")
    source: dict = _input("data", "ingest-rubrics: where the data rows come from.", only=SourceConfig)
    rubrics: dict = _input("rubrics", "ingest-rubrics: the rubrics section.")
    sft_prepare: dict = _input("sft", "prepare-sft: the SFT rows and their limits.")
    sft_train: dict = _input("sft", "sft-train: the SFT optimizer settings.")
    engine: dict = _input("rollout", "rollout, teacher-rollout, evaluate: how the rollout engine is built.")
    rollout: dict = _input("rollout", "rollout, teacher-rollout: how a step's prompts are sampled.")
    eval_rollout: dict = _input("rollout", "evaluate: the sampling settings a held-out evaluation shares.")
    judge: dict = _input("judge", "judge, judge-anchors, evaluate: the judge.")
    reward: dict = _input("reward", "judge, evaluate: how rewards are composed.")
    update: dict = _input("grpo", "grpo-update: the GRPO update.")
    lora: dict = _input("model", "grpo-update: the model's LoRA settings.")
    eval: dict = _input("eval", "evaluate: one held-out evaluation.")
    teacher: dict = _input("teacher", "teacher-update: the EMA teacher.")
    monitors: dict = _input("monitors", "check-monitors: the reward-hacking monitors.")


# The stage inputs a section's fields go to when a field does not say (read_by).
SECTION_INPUTS: dict[str, tuple[str, ...]] = {
    "data": ("data",),
    "rubrics": ("rubrics",),
    "sft": ("sft_prepare",),
    "rollout": ("rollout",),
    "judge": ("judge",),
    "reward": ("reward",),
    "grpo": ("update",),
    "model": (),
    "eval": ("eval",),
    "teacher": ("teacher",),
    "monitors": ("monitors",),
}
SECTION_TYPES: dict[str, type] = typing.get_type_hints(RecipeConfig)  # section name -> its config class
_INPUTS = {f.name: f.metadata for f in dataclasses.fields(StageSettings)}


def input_fields(name: str) -> tuple[dataclasses.Field, ...]:
    """The fields of its section that stage input `name` reads, in the section's order."""
    meta = _INPUTS[name]
    section = meta["section"]
    if name == "engine":  # built by config.engine_settings, which adds the LoRA rank it takes adapters of
        return ()
    fields = dataclasses.fields(SECTION_TYPES[section])
    if meta["only"]:  # the fields the section has from that class (data's source fields)
        return tuple(f for f in fields if f.name in {g.name for g in dataclasses.fields(meta["only"])})
    return tuple(f for f in fields if name in f.metadata.get("read_by", SECTION_INPUTS[section]))


def stage_settings(cfg: RecipeConfig) -> StageSettings:
    """Cut every stage input out of a validated recipe (model.lora_sync resolved): once per run, or per fork
    segment. rollout.dynamic_sampling implies grpo.filter_zero_std_groups (docs/grpo.md); a decaying learning rate
    with grpo.lr_decay_steps 0 decays over grpo.steps."""
    conf = cfg.to_dict()
    cut = {
        name: {f.name: conf[meta["section"]][f.name] for f in input_fields(name)}
        for name, meta in _INPUTS.items()
        if name != "engine"
    }
    if cfg.rollout.dynamic_sampling:  # groups replaced by more sampling are left out of the update
        cut["update"]["filter_zero_std_groups"] = True
    if cfg.grpo.lr_scheduler_type != "constant" and not cfg.grpo.lr_decay_steps:  # the decay ends with the run
        cut["update"]["lr_decay_steps"] = cfg.grpo.steps
    return StageSettings(**cut, engine=dataclasses.asdict(engine_settings(cfg)))


def stage_view(name: str, values: dict) -> Any:
    """Stage input `name` as a frozen object with exactly its fields (nested sections built as their types).
    Raises ValueError when `values` lacks one or holds another: a stage must read what its cache key holds."""
    view = _view_type(name)
    expected = [f.name for f in dataclasses.fields(view)]
    if sorted(values) != sorted(expected):
        missing, extra = sorted(set(expected) - set(values)), sorted(set(values) - set(expected))
        raise ValueError(f"stage input {name!r}: missing {missing}, unexpected {extra}")
    hints = _hints(SECTION_TYPES[_INPUTS[name]["section"]])
    return view(
        **{
            k: hints[k](**v) if dataclasses.is_dataclass(hints[k]) and isinstance(v, dict) else v
            for k, v in values.items()
        }
    )


@functools.cache
def _view_type(name: str) -> type:
    section = SECTION_TYPES[_INPUTS[name]["section"]]
    hints = _hints(section)
    return dataclasses.make_dataclass(
        f"{section.__name__}[{name}]",
        [(f.name, hints[f.name], field(metadata=f.metadata)) for f in input_fields(name)],
        frozen=True,
    )


@functools.cache
def _hints(section: type) -> dict[str, Any]:
    return typing.get_type_hints(section)
