"""What moves once per GRPO step: the learning rate, grpo.learning_rate times a multiplier of the step, one
function per grpo.lr_scheduler_type (LR_SCHEDULES) (as verl's actor, every optimizer step of a step shares its
rate, step 0 of a warmup trains at rate 0, and past `decay_steps` the rate holds); and the adaptive entropy
coefficient (grpo.adaptive_entropy)."""

from __future__ import annotations

import math
from collections.abc import Callable


def _warmup(step: int, warmup: int) -> float:
    return step / max(1, warmup)


def constant(step: int, warmup: int, decay_steps: int, min_ratio: float) -> float:
    """step / warmup during the warmup, then 1. verl get_constant_schedule_with_warmup, transformers
    constant_with_warmup."""
    return _warmup(step, warmup) if step < warmup else 1.0


def linear(step: int, warmup: int, decay_steps: int, min_ratio: float) -> float:
    """The warmup, then a straight line from 1 down to min_ratio at decay_steps. transformers
    get_linear_schedule_with_warmup (TRL's default lr_scheduler_type) when min_ratio is 0."""
    if step < warmup:
        return _warmup(step, warmup)
    left = max(0.0, (decay_steps - step) / max(1, decay_steps - warmup))
    return min_ratio + (1.0 - min_ratio) * left


def cosine(step: int, warmup: int, decay_steps: int, min_ratio: float) -> float:
    """The warmup, then half a cosine from 1 down to min_ratio at decay_steps. verl get_cosine_schedule_with_warmup
    (num_cycles 0.5; past num_training_steps its cosine would rise again), transformers
    get_cosine_schedule_with_warmup when min_ratio is 0."""
    if step < warmup:
        return _warmup(step, warmup)
    progress = min(1.0, (step - warmup) / max(1, decay_steps - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


LR_SCHEDULES: dict[str, Callable[[int, int, int, float], float]] = {
    "constant": constant,
    "linear": linear,
    "cosine": cosine,
}


def decays_after_warmup(kind: str, warmup: int, decay_steps: int) -> bool:
    """Whether a schedule is well formed: a constant one has no decay, a decaying one must end after its warmup."""
    return kind == "constant" or decay_steps > warmup


def learning_rate_at(step: int, grpo, decay_steps: int | None = None) -> float:
    """The learning rate of GRPO step `step` (0-based) under the grpo section (or the update stage's view of it);
    `decay_steps` stands in for grpo.lr_decay_steps when that is 0 (the run's grpo.steps)."""
    decay = grpo.lr_decay_steps or decay_steps or 0
    if not decays_after_warmup(grpo.lr_scheduler_type, grpo.lr_warmup_steps, decay):
        raise ValueError(
            f"lr_scheduler_type {grpo.lr_scheduler_type!r}: the decay must end after the warmup "
            f"({grpo.lr_warmup_steps} steps), not at step {decay}"
        )
    multiplier = LR_SCHEDULES[grpo.lr_scheduler_type](step, grpo.lr_warmup_steps, decay, grpo.min_lr_ratio)
    return grpo.learning_rate * multiplier


def entropy_coef_at(previous: dict | None, grpo) -> dict:
    """The entropy bonus of a GRPO step: {"coef": the controller's coefficient, "applied": the one the update
    uses}. Without grpo.adaptive_entropy both are grpo.entropy_coef. With it (Skywork-OR1's adaptive entropy
    control, as TRL use_adaptive_entropy, whose controller moves once per optimizer step): `previous` is the last
    step's {"coef", "entropy"} (its controller coefficient and the mean entropy it measured over the bonus's
    tokens); the coefficient moves by entropy_coef_delta, up where that entropy was at or below entropy_target,
    down otherwise, within [entropy_coef_min, entropy_coef_max], and applies only in the first case. The first
    step has measured nothing: entropy_coef, not applied."""
    if not grpo.adaptive_entropy:
        return {"coef": grpo.entropy_coef, "applied": grpo.entropy_coef}
    if previous is None:
        return {"coef": grpo.entropy_coef, "applied": 0.0}
    low = previous["entropy"] <= grpo.entropy_target
    if low:
        coef = min(previous["coef"] + grpo.entropy_coef_delta, grpo.entropy_coef_max)
    else:
        coef = max(previous["coef"] - grpo.entropy_coef_delta, grpo.entropy_coef_min)
    return {"coef": coef, "applied": coef if low else 0.0}


def entropy_control_after(previous: dict | None, bonus: dict, metrics: dict) -> dict | None:
    """The controller's state after a step that used `bonus` (entropy_coef_at's): its coefficient and the entropy
    the learner measured over the bonus's tokens (metrics' bonus_entropy). A step that measured nothing (nothing
    trained, or no adaptive_entropy) leaves the state as it was."""
    measured = metrics.get("bonus_entropy")
    return previous if measured is None else {"coef": bonus["coef"], "entropy": measured}
