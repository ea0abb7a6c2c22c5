"""GRPO on one screen: rewards -> group advantages -> train samples -> learner step.

`grpo_loop` is the whole algorithm in plain Python (in-process, shared weights); the Prefect flow runs the
same pieces as cached stages with files in between.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from refiner_core.algo.advantages import PartsOf, group_advantages, whole_reward
from refiner_core.algo.kl_reward import kl_coef_at, kl_control_after, with_reward_kl
from refiner_core.algo.schedules import entropy_coef_at, entropy_control_after, learning_rate_at
from refiner_core.config import DEEPSPEED_FLAT_NAMES, GRPOConfig, ModelConfig
from refiner_core.learners.base import LearnerSettings, SequenceKL, TrainSample
from refiner_core.rollout.base import Generation, RolloutEngine, SamplingParams
from refiner_core.stage_settings import input_fields

LORA_FIELDS = tuple(f.name for f in input_fields("lora"))  # the model section's fields the learner reads


def learner_settings(grpo: GRPOConfig, temperature: float, precision: str, model: ModelConfig | None = None):
    """The learner's view of the GRPO config (or the update stage's view of it): every knob's one default is the
    config's, grpo.deepspeed.* as the learner's own flat launch settings (DEEPSPEED_FLAT_NAMES). The sampling
    temperature comes from the rollout config, the compute precision and the LoRA settings (model.lora_*; None: full
    weights) from the model config."""
    lora = model if model is not None else ModelConfig()
    given = {
        "temperature": temperature,
        "precision": precision,
        "adam_betas": tuple(grpo.adam_betas),
        **{k: getattr(lora, k) for k in LORA_FIELDS},
        "lora_target_modules": tuple(lora.lora_target_modules),
        **{flat: getattr(grpo.deepspeed, name) for name, flat in DEEPSPEED_FLAT_NAMES.items()},
    }
    fields = {k: getattr(grpo, k) for k in LearnerSettings.__dataclass_fields__ if k not in given and k != "work_root"}
    return LearnerSettings(**fields, **given)


def build_train_samples(
    rollouts: list[dict], rewards: list[dict], grpo: GRPOConfig, parts_of: PartsOf = whole_reward
) -> tuple[list[TrainSample], list[dict], dict]:
    """Join rewards to rollouts and compute group advantages -> (train samples, advantage rows, stats). Rollouts
    with no response token, and under grpo.mask_truncated those cut off by the token budget, are not trained
    (stats['masked_truncated'] counts the latter); their rewards still count in their group's advantages.
    `parts_of`: how a reward row splits into parts (grpo.reward_aggregation)."""
    for rows, what in ((rollouts, "rollouts"), (rewards, "rewards")):
        seen = [(r["prompt_id"], r["sample_idx"]) for r in rows]
        if len(set(seen)) < len(seen):  # one key's advantage would stand for both rows
            twice = sorted({k for k in seen if seen.count(k) > 1})
            raise ValueError(f"{what}: (prompt_id, sample_idx) repeated, e.g. {twice[:3]}")
    keys = {(r["prompt_id"], r["sample_idx"]) for r in rewards}
    missing = [(r["prompt_id"], r["sample_idx"]) for r in rollouts if (r["prompt_id"], r["sample_idx"]) not in keys]
    if missing:
        raise ValueError(f"{len(missing)} rollouts have no reward, e.g. {missing[:3]}")
    advantages, stats = group_advantages(rewards, grpo, parts_of)
    by_key = {(a["prompt_id"], a["sample_idx"]): a for a in advantages}
    truncated = 0
    for r in rollouts:
        row = by_key[(r["prompt_id"], r["sample_idx"])]
        if not r["response_token_ids"]:  # no token to train on
            row["trained"] = False
        elif grpo.mask_truncated and r["finish_reason"] == "length":
            truncated += row["trained"]
            row["trained"] = False
    stats["masked_truncated"] = truncated
    samples = [
        _train_sample(r, a["advantage"])
        for r in rollouts
        if (a := by_key[(r["prompt_id"], r["sample_idx"])])["trained"]
    ]
    return samples, advantages, stats


def _train_sample(row: dict, advantage: float) -> TrainSample:
    return TrainSample(
        list(row["prompt_token_ids"]),
        list(row["response_token_ids"]),
        advantage,
        list(row["response_logprobs"]),
        list(row["response_mask"]) if row.get("response_mask") is not None else None,
        row.get("old_logprobs"),
        row.get("reference_logprobs"),
    )


class KLInReward(NamedTuple):
    rollouts: list[dict]  # carrying the per-token log-probs the measure read (the update reuses them)
    rewards: list[dict]  # carrying each response's summed KL and the coefficient applied
    metrics: dict  # {"kl_reward_coef", "reward_kl"}, the step's
    kl_control: dict  # the controller's state after this step


def kl_in_reward(
    rollouts: list[dict],
    rewards: list[dict],
    sequence_kl: Callable[[list[TrainSample]], list[SequenceKL]],
    kl_control: dict | None,
    grpo: GRPOConfig,
) -> KLInReward:
    """grpo.kl_reward_coef before the advantages. reward_kl is the mean over responses of their per-token mean
    KL, verl's current_kl. `sequence_kl`: the learner's, at the weights before the update; a response without a
    trained token has KL 0. Its per-token log-probs (pi_old, pi_ref) ride on the rollout rows into the train
    samples, so the update reads them instead of running those forwards again. `kl_control`: the controller's
    state after the previous step (None at the first)."""
    scored = [r for r in rollouts if r["response_token_ids"]]
    samples = [_train_sample(r, 0.0) for r in scored]
    measured = dict(zip(((r["prompt_id"], r["sample_idx"]) for r in scored), sequence_kl(samples) if samples else []))
    mean_kl = float(
        np.mean([m.total / s.trained_tokens for m, s in zip(measured.values(), samples) if s.trained_tokens] or [0.0])
    )
    coef = kl_coef_at(kl_control, grpo)
    carrying = [{**r, **m.carried()} if (m := measured.get((r["prompt_id"], r["sample_idx"]))) else r for r in rollouts]
    return KLInReward(
        carrying,
        with_reward_kl(rewards, {key: m.total for key, m in measured.items()}, coef),
        {"kl_reward_coef": coef, "reward_kl": mean_kl},
        kl_control_after(coef, mean_kl, len(rollouts), grpo),
    )


def grpo_loop(
    engine: RolloutEngine,
    learner,
    prompts: list[list[int]],
    reward_fn: Callable[[Generation], float],
    grpo: GRPOConfig,
    params: SamplingParams,
    steps: int,
    prompts_per_step: int,
    on_step: Callable[[int, dict], None] | None = None,
    sync: Callable[[], None] | None = None,
) -> list[dict]:
    """Plain GRPO. The engine samples from the learner's live weights: by sharing the model object (hf), or
    through `sync`, called after every update to push them (vllm: `lambda: engine.load_weights(learner.policy)`)."""
    history, entropy_control, kl_control = [], None, None  # grpo.adaptive_entropy's and kl_reward_target's state
    prompts_per_step = min(prompts_per_step, len(prompts))  # a prompt drawn twice in a step would be one group
    for step in range(steps):
        chosen = [(step * prompts_per_step + k) % len(prompts) for k in range(prompts_per_step)]
        step_params = dataclasses.replace(params, seed=params.seed + step)
        gens = engine.generate([prompts[i] for i in chosen], step_params)
        # Rows in the same shape the pipeline stores, so the same advantage code serves both.
        rollouts = [
            {
                "prompt_id": str(chosen[g.prompt_index]),
                "sample_idx": g.sample_idx,
                "prompt_token_ids": prompts[chosen[g.prompt_index]],
                "response_token_ids": g.token_ids,
                "response_logprobs": g.logprobs,
                "finish_reason": g.finish_reason,
            }
            for g in gens
        ]
        rewards = [
            {"prompt_id": r["prompt_id"], "sample_idx": r["sample_idx"], "reward": reward_fn(g)}
            for r, g in zip(rollouts, gens)
        ]
        kl = {}
        if grpo.kl_reward_coef > 0:
            rollouts, rewards, kl, kl_control = kl_in_reward(rollouts, rewards, learner.sequence_kl, kl_control, grpo)
        samples, _, stats = build_train_samples(rollouts, rewards, grpo)
        bonus = entropy_coef_at(entropy_control, grpo)
        lr = learning_rate_at(step, grpo, decay_steps=steps)
        metrics = learner.train_step(samples, lr, bonus["applied"]) if samples else {}
        entropy_control = entropy_control_after(entropy_control, bonus, metrics)
        if sync and samples:
            sync()
        record = {"step": step, "reward_mean": float(np.mean([r["reward"] for r in rewards])), **stats, **metrics, **kl}
        history.append(record)
        if on_step:
            on_step(step, record)
    return history
