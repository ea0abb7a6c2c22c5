"""grpo.lr_scheduler_type: hand-computed rates, transformers' schedules step for step, and the learner's rate."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.optimization import (
    get_constant_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

from conftest import learner_settings
from refiner_core.algo.schedules import LR_SCHEDULES, entropy_coef_at, learning_rate_at
from refiner_core.config import load_recipe
from refiner_core.learners.base import TrainSample
from refiner_core.learners.torch_learner import TorchLearner


def _rates(*overrides: str, steps: int, decay_steps: int | None = None) -> list[float]:
    grpo = load_recipe(None, ["grpo.learning_rate=0.01", *overrides]).grpo
    return [learning_rate_at(s, grpo, decay_steps) / 0.01 for s in range(steps)]


def test_hand_computed_rates():
    assert _rates("grpo.lr_warmup_steps=4", steps=6) == pytest.approx([0, 0.25, 0.5, 0.75, 1, 1])
    half = 0.1 + 0.9 * 0.5  # the cosine's midpoint, between 1 and min_lr_ratio 0.1
    cosine = [
        "grpo.lr_scheduler_type=cosine",
        "grpo.lr_warmup_steps=2",
        "grpo.lr_decay_steps=6",
        "grpo.min_lr_ratio=0.1",
    ]
    assert _rates(*cosine, steps=9) == pytest.approx(
        [0, 0.5, 1, 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2, half, 0.1 + 0.9 * (1 + math.cos(3 * math.pi / 4)) / 2]
        + [0.1] * 3  # held after the decay (verl's cosine would rise again)
    )
    linear = ["grpo.lr_scheduler_type=linear", "grpo.lr_decay_steps=4", "grpo.min_lr_ratio=0.2"]
    assert _rates(*linear, steps=6) == pytest.approx([1, 0.8, 0.6, 0.4, 0.2, 0.2])
    # lr_decay_steps 0: the run's length decides (the update stage gets it from grpo.steps)
    assert _rates("grpo.lr_scheduler_type=linear", steps=3, decay_steps=4) == pytest.approx([1, 0.75, 0.5])
    with pytest.raises(ValueError, match="the decay must end after the warmup"):
        _rates("grpo.lr_scheduler_type=cosine", steps=1)  # no decay length: preflight refuses such a recipe


def _verl_cosine(step, warmup, total, min_ratio):
    # verl torch_functional.get_cosine_schedule_with_warmup (num_cycles 0.5, init_lr_ratio 0)
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return max(min_ratio, math.cos(math.pi * 0.5 * 2.0 * progress) * (1 - min_ratio) * 0.5 + (1 + min_ratio) * 0.5)


@pytest.mark.parametrize(
    "kind,warmup,total,min_ratio",
    [("constant", 3, 8, 0.0), ("linear", 2, 9, 0.0), ("cosine", 0, 7, 0.0), ("cosine", 3, 12, 0.2)],
)
def test_equal_to_transformers_and_verl_step_for_step(kind, warmup, total, min_ratio):
    """transformers' LambdaLR schedules stepped once per GRPO step, as verl steps its scheduler once per update."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = {
        "constant": lambda: get_constant_schedule_with_warmup(optimizer, warmup),
        "linear": lambda: get_linear_schedule_with_warmup(optimizer, warmup, total),
        "cosine": lambda: get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, total, min_lr_rate=min_ratio),
    }[kind]()
    theirs = []
    for _ in range(total + 1):
        theirs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    ours = [LR_SCHEDULES[kind](s, warmup, total, min_ratio) for s in range(total + 1)]
    assert ours == pytest.approx(theirs, abs=1e-12)
    if kind == "cosine":
        assert ours == pytest.approx([_verl_cosine(s, warmup, total, min_ratio) for s in range(total + 1)], abs=1e-12)


def test_the_learner_trains_at_the_rate_and_entropy_bonus_it_is_given(tiny_model_path):
    """train_step(samples, lr, entropy_coef) is the step of a learner built with that learning rate and entropy
    coefficient; AdamW's state carries. With adaptive_entropy the learner measures the entropy the bonus acts on."""
    from refiner_core.models import load_model

    samples = [TrainSample([1, 2, 3], list(range(10, 13 + k)), adv, [-1.0] * (3 + k)) for k, adv in enumerate([1, -1])]
    weights, rates, measured = [], [], []
    for built_with, given, adaptive in (((1e-2, 0.0), (3e-3, 0.05), True), ((3e-3, 0.05), (None, None), False)):
        torch.manual_seed(0)
        policy = load_model(tiny_model_path, trainable=True)
        settings = learner_settings(
            beta=0.0, learning_rate=built_with[0], entropy_coef=built_with[1], adaptive_entropy=adaptive
        )
        learner = TorchLearner(policy, None, 0, settings)
        metrics = [learner.train_step(samples, *given) for _ in range(2)]
        rates.append([m["lr"] for m in metrics])
        measured.append([(m["entropy"], m.get("bonus_entropy")) for m in metrics])
        weights.append(torch.cat([p.detach().flatten() for p in policy.parameters()]))
    torch.testing.assert_close(weights[0], weights[1], rtol=0, atol=0)
    assert rates == [[3e-3, 3e-3], [3e-3, 3e-3]]
    assert [e for e, _ in measured[0]] == [e for e, _ in measured[1]]
    assert [b for _, b in measured[0]] == [e for e, _ in measured[0]]  # every token takes the bonus here
    assert [b for _, b in measured[1]] == [None, None]


def _controlled(entropies, **grpo):
    """(controller coefficient, applied) per step for the measured entropy of each step before it."""
    cfg = load_recipe(None, [f"grpo.{k}={v}" for k, v in {"adaptive_entropy": "true", **grpo}.items()]).grpo
    state, out = None, []
    for entropy in entropies:
        bonus = entropy_coef_at(state, cfg)
        out.append((round(bonus["coef"], 9), round(bonus["applied"], 9)))
        state = {"coef": bonus["coef"], "entropy": entropy}
    return out


def test_the_adaptive_entropy_coefficient_by_hand():
    # TRL's controller: up by delta while the entropy is at or below the target, applied only then; down otherwise
    knobs = dict(entropy_coef=0.02, entropy_target=0.5, entropy_coef_delta=0.01, entropy_coef_max=0.04)
    assert _controlled([0.4, 0.5, 0.3, 0.3, 0.9, 0.9, 0.9, 0.9, 0.2], **knobs) == [
        (0.02, 0.0),  # nothing measured yet: no bonus
        (0.03, 0.03),  # 0.4 <= 0.5
        (0.04, 0.04),  # 0.5 <= 0.5
        (0.04, 0.04),  # capped at entropy_coef_max
        (0.04, 0.04),
        (0.03, 0.0),  # 0.9 > 0.5: down, and off
        (0.02, 0.0),
        (0.01, 0.0),
        (0.0, 0.0),  # entropy_coef_min 0
    ]
    fixed = load_recipe(None, ["grpo.entropy_coef=0.02"]).grpo
    assert (
        entropy_coef_at(None, fixed)
        == entropy_coef_at({"coef": 9, "entropy": 9}, fixed)
        == {
            "coef": 0.02,
            "applied": 0.02,
        }
    )
