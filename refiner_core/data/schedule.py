"""Which prompts each GRPO step trains on: shuffled epochs, refills for dynamic sampling, and draws weighted by the
difficulty ledger. Seeded by (seed, step), so a rerun of a step takes the same prompts."""

from __future__ import annotations

import math
import random


def step_prompt_ids(
    train_ids: list[str], step: int, per_step: int, seed: int, twin_of: dict[str, str] | None = None
) -> list[str]:
    """Prompts for a GRPO step: each epoch is a seeded shuffle cut into steps, so every prompt is seen once per
    epoch and a step never holds the same prompt twice (that would merge two GRPO groups). The last, short step
    of an epoch is topped up from the start of the same epoch's order.

    With `twin_of` (prompt ID -> its twin's, the question's other view), a question and its twin are one unit:
    `per_step` counts questions (at most all of them), and each brings both views into the same step."""
    if twin_of:
        train = set(train_ids)
        leads = [p for p in train_ids if not (twin_of.get(p) in train and twin_of[p] < p)]
        chosen = step_prompt_ids(leads, step, min(per_step, len(leads)), seed)
        return [q for p in chosen for q in (p, twin_of.get(p)) if q in train]
    if not 0 < per_step <= len(train_ids):
        raise ValueError(f"prompts per step must be in 1..{len(train_ids)} (the training prompts), got {per_step}")
    steps_per_epoch = math.ceil(len(train_ids) / per_step)
    epoch, index = divmod(step, steps_per_epoch)
    order = sorted(train_ids)
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    chosen = order[index * per_step : (index + 1) * per_step]
    return chosen + order[: per_step - len(chosen)]


def refill_prompt_ids(
    train_ids: list[str],
    used: list[str],
    count: int,
    step: int,
    sampling_round: int,
    seed: int,
    twin_of: dict[str, str] | None = None,
    weights: dict[str, float] | None = None,
) -> list[str]:
    """Fresh prompts for round `sampling_round` of a step (rollout.dynamic_sampling): `count` train prompts the
    step has not used yet, in a seeded order of their own, so a rerun draws the same ones. Fewer when the train
    split runs out. With `twin_of`, a question brings its twin view, as in step_prompt_ids: questions are taken
    until they bring `count` views (the groups a step misses are views, each with its own advantage). With
    `weights` (data.weights_from) they are drawn by weight, as the step's first round is (weighted_step_prompt_ids)."""
    taken = set(used)
    if twin_of:
        train = set(train_ids)
        leads = [p for p in train_ids if not (twin_of.get(p) in train and twin_of[p] < p)]
        used_leads = [p for p in leads if p in taken or twin_of.get(p) in taken]
        views: list[str] = []
        for p in refill_prompt_ids(leads, used_leads, len(leads), step, sampling_round, seed, weights=weights):
            if len(views) >= count:
                break
            views += [q for q in (p, twin_of.get(p)) if q in train]
        return views
    order = sorted(p for p in train_ids if p not in taken)
    if weights:
        return _by_weight(order, weights, random.Random(f"weighted refill {seed} {step} {sampling_round}"))[:count]
    random.Random(f"refill {seed} {step} {sampling_round}").shuffle(order)  # a str seed hashes by SHA-512: stable
    return order[:count]


def weighted_step_prompt_ids(
    train_ids: list[str],
    weights: dict[str, float],
    step: int,
    per_step: int,
    seed: int,
    twin_of: dict[str, str] | None = None,
) -> list[str]:
    """Prompts for a GRPO step drawn without replacement with probability proportional to their weight
    (data.weights_from; prompts without a weight count 1): each gets the key u ** (1 / w), u uniform from a
    generator seeded by (seed, step), and the `per_step` largest keys are taken (Efraimidis and Spirakis), so a
    step never holds a prompt twice and a rerun draws the same ones. With `twin_of`, a question and its twin are one
    unit carrying the lead view's weight, as in step_prompt_ids."""
    if twin_of:
        train = set(train_ids)
        leads = [p for p in train_ids if not (twin_of.get(p) in train and twin_of[p] < p)]
        chosen = weighted_step_prompt_ids(leads, weights, step, min(per_step, len(leads)), seed)
        return [q for p in chosen for q in (p, twin_of.get(p)) if q in train]
    if not 0 < per_step <= len(train_ids):
        raise ValueError(f"prompts per step must be in 1..{len(train_ids)} (the training prompts), got {per_step}")
    rng = random.Random(f"weighted {seed} {step}")  # a str seed hashes by SHA-512: stable across processes
    return _by_weight(sorted(train_ids), weights, rng)[:per_step]


def _by_weight(ids: list[str], weights: dict[str, float], rng: random.Random) -> list[str]:
    """`ids` in a weighted random order (Efraimidis and Spirakis): each gets the key u ** (1 / w), u uniform from
    `rng` drawn in the order given, and the largest keys come first; ids without a weight count 1."""
    keys = {p: rng.random() ** (1.0 / max(weights.get(p, 1.0), 1e-12)) for p in ids}
    return sorted(ids, key=lambda p: (-keys[p], p))
