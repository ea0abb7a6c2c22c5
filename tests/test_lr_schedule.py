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
from refiner_core.algo.schedules import LR_SCHEDULES, learning_rate_at
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


def test_the_learner_trains_at_the_rate_it_is_given(tiny_model_path):
    """train_step(samples, lr) is the step of a learner built with that learning rate; AdamW's state carries."""
    from refiner_core.models import load_model

    samples = [TrainSample([1, 2, 3], list(range(10, 13 + k)), adv, [-1.0] * (3 + k)) for k, adv in enumerate([1, -1])]
    weights, rates = [], []
    for built_with, given in ((1e-2, 3e-3), (3e-3, None)):
        torch.manual_seed(0)
        policy = load_model(tiny_model_path, trainable=True)
        learner = TorchLearner(policy, None, 0, learner_settings(beta=0.0, learning_rate=built_with))
        rates.append([learner.train_step(samples, given)["lr"] for _ in range(2)])
        weights.append(torch.cat([p.detach().flatten() for p in policy.parameters()]))
    torch.testing.assert_close(weights[0], weights[1], rtol=0, atol=0)
    assert rates == [[3e-3, 3e-3], [3e-3, 3e-3]]
