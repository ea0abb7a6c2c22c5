"""Group-relative advantages. One function per normaliser, chosen through ADVANTAGES; docs/grpo.md compares
them with the peers' options. grpo.reward_aggregation 'normalize_then_sum' (GDPO) normalises each part of the
reward in its group instead, then whitens the weighted sum over the batch.

The std's `ddof` is a setting (grpo.advantage_std_ddof): 0 divides by G (population std, as open-instruct), 1 by
G - 1 (sample std, as verl, which Co-rewarding builds on). A one-member group has std 0 under either. Batch
statistics count each response once (verl's REINFORCE++ whitens per token, weighting responses by length).

A group whose rewards are all equal (up to floating rounding) carries no signal and gets advantage exactly 0 under
every normaliser, and so does a whole batch of equal rewards under the batch ones, whatever advantage_eps is: with
eps 0, 0 / 0 would be NaN, and the rounding left in r - mean (the mean of six 0.1s is not 0.1) would become +-1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from refiner_core.algo.kl_reward import penalised_reward
from refiner_core.config import ExtensionError, GRPOConfig


class NonFiniteReward(ValueError):
    """A reward (or a part of it) that is NaN or infinite: not retried, the same rows would give it again."""


# Rewards closer than this, relative to their size, are equal up to floating rounding (0.1 + 0.2 and 0.3 differ by
# 1.9e-16 of it): a group of them teaches nothing.
TIE_RTOL = 1e-9


def _all_equal(values: np.ndarray) -> bool:
    """Whether the values are equal up to rounding (in every column, for a matrix)."""
    return np.all(np.ptp(values, axis=0) <= TIE_RTOL * np.abs(values).max(axis=0))


def _std(values: np.ndarray, ddof: int) -> float:
    return float(values.std(ddof=ddof)) if len(values) > ddof else 0.0


def _group_std(rewards: np.ndarray, groups: np.ndarray, ddof: int) -> np.ndarray:
    """Per row, the std (with `ddof`) of the row's group."""
    std = np.empty_like(rewards)
    for g in np.unique(groups):
        members = groups == g
        std[members] = _std(rewards[members], ddof)
    return std


def _centred(rewards: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """r - the mean of the row's group; exactly 0 across a group whose rewards are all equal."""
    centred = np.zeros_like(rewards)
    for g in np.unique(groups):
        members = groups == g
        if not _all_equal(rewards[members]):
            centred[members] = rewards[members] - rewards[members].mean()
    return centred


def _scaled(centred: np.ndarray, scale) -> np.ndarray:
    """centred / scale, and 0 where centred is 0: a flat group's std (or a flat batch's) is 0 too when eps is 0."""
    return np.divide(centred, scale, out=np.zeros_like(centred), where=centred != 0)


def group_std(rewards: np.ndarray, groups: np.ndarray, eps: float, ddof: int = 0) -> np.ndarray:
    """A_i = (r_i - mean_group) / (std_group + eps): the original GRPO normaliser. TRL scale_rewards 'group'
    (ddof 1, eps 1e-4), verl `grpo` (ddof 1, eps 1e-6), open-instruct advantage_normalization_type 'standard'
    (ddof 0, eps 1e-8)."""
    return _scaled(_centred(rewards, groups), _group_std(rewards, groups, ddof) + eps)


def batch_std(rewards: np.ndarray, groups: np.ndarray, eps: float, ddof: int = 0) -> np.ndarray:
    """(r - mean_group) / (std of the batch's rewards + eps): avoids blowing up near-constant groups. TRL
    scale_rewards 'batch' (ddof 1, eps 1e-4)."""
    return _scaled(_centred(rewards, groups), _std(rewards, ddof) + eps)


def mean_only(rewards: np.ndarray, groups: np.ndarray, eps: float, ddof: int = 0) -> np.ndarray:
    """Dr.GRPO: r - mean_group, no std division (removes the difficulty bias of per-group scaling); ddof does not
    apply. TRL scale_rewards 'none', verl norm_adv_by_std_in_grpo False, open-instruct 'centered'."""
    return _centred(rewards, groups)


def rloo(rewards: np.ndarray, groups: np.ndarray, eps: float, ddof: int = 0) -> np.ndarray:
    """RLOO: A_i = r_i - mean of the other G - 1 rewards of the group = G/(G-1) (r_i - mean); a one-member group
    gets 0. TRL RLOOTrainer (normalize_advantages False), verl `rloo` (which leaves a one-member group's reward
    as its advantage); eps and ddof do not apply."""
    sizes = np.array([np.count_nonzero(groups == g) for g in groups], dtype=np.float64)
    return _centred(rewards, groups) * sizes / np.maximum(sizes - 1, 1)  # a one-member group is flat: 0


def reinforce_pp(rewards: np.ndarray, groups: np.ndarray, eps: float, ddof: int = 0) -> np.ndarray:
    """REINFORCE++: no group baseline, A = (r - batch mean) / (batch std + eps). verl `reinforce_plus_plus` (gamma
    1, outcome reward) whitens per token instead: equal when every response has one token, with ddof 1 and
    eps 0 (verl adds 1e-8 to the variance)."""
    whole_batch = np.zeros(len(rewards))
    return _scaled(_centred(rewards, whole_batch), _std(rewards, ddof) + eps)


def reinforce_pp_baseline(rewards: np.ndarray, groups: np.ndarray, eps: float, ddof: int = 0) -> np.ndarray:
    """REINFORCE++ with baseline: c = r - group mean, A = c / (batch std of c + eps) (c's batch mean is 0 by
    construction). verl `reinforce_plus_plus_baseline`, which whitens c per token: equal for one-token responses,
    ddof 1, eps 0, and groups of two or more (verl keeps a one-member group's raw reward as c)."""
    centred = _centred(rewards, groups)
    return _scaled(centred, _std(centred, ddof) + eps)


ADVANTAGES: dict[str, Callable[..., np.ndarray]] = {
    "group_std": group_std,
    "batch_std": batch_std,
    "none": mean_only,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
}


def compute_advantages(rewards: Sequence[float], groups: Sequence, kind: str, eps: float, ddof: int = 0) -> np.ndarray:
    if kind not in ADVANTAGES:
        raise ValueError(f"unknown advantage {kind!r}; choose from {sorted(ADVANTAGES)}")
    if ddof not in (0, 1):
        raise ValueError(f"advantage std ddof must be 0 or 1, got {ddof!r}")
    values = np.asarray(rewards, dtype=np.float64)
    advantages = np.asarray(ADVANTAGES[kind](values, np.asarray(groups), eps, ddof), dtype=np.float64)
    if advantages.shape != values.shape or not np.isfinite(advantages).all():
        raise ExtensionError(
            f"grpo.advantage {kind!r} returned {advantages.shape[0] if advantages.ndim == 1 else advantages.shape} "
            f"values for {len(values)} rewards"
            + ("" if advantages.shape != values.shape else f", {int((~np.isfinite(advantages)).sum())} not finite")
            + ": an advantage function returns one finite value per reward, in order"
        )
    return advantages


def normalize_then_sum(
    values: np.ndarray, weights: np.ndarray, groups: np.ndarray, eps: float, ddof: int = 0
) -> np.ndarray:
    """GDPO: each reward part (a column of `values`) normalised within its group, weighted and summed, the sums
    whitened over the batch: s_i = sum_k w_ik (v_ik - mean_g v_k) / (std_g v_k + eps), A_i = (s_i - mean s) /
    (std s + eps). A part equal across its group adds exactly 0 (also with eps 0), and so does a batch of equal
    sums. TRL multi_objective_aggregation 'normalize_then_sum' (ddof 1, eps 1e-4)."""
    summed = np.zeros(len(values))
    for k in range(values.shape[1]):
        column = values[:, k]
        summed += _scaled(weights[:, k] * _centred(column, groups), _group_std(column, groups, ddof) + eps)
    if not len(summed) or _all_equal(summed):
        return np.zeros_like(summed)
    return (summed - summed.mean()) / (_std(summed, ddof) + eps)


PartsOf = Callable[[dict], dict[str, tuple[float, float]]]


def whole_reward(row: dict) -> dict[str, tuple[float, float]]:
    """The decomposition of a reward that has no parts: itself, with weight 1."""
    return {"reward": (1.0, row["reward"])}


def _with_kl_part(row: dict, parts_of: PartsOf) -> dict[str, tuple[float, float]]:
    """The row's parts, and under grpo.kl_reward_coef its KL penalty as one more: (-kl_coef, reward_kl)."""
    parts = parts_of(row)
    return parts if row.get("reward_kl") is None else {**parts, "kl": (-row["kl_coef"], row["reward_kl"])}


def _parts_matrix(rows: list[dict], parts_of: PartsOf) -> tuple[np.ndarray, np.ndarray]:
    """(weights, values), one row per reward row and one column per part."""
    parts = [_with_kl_part(r, parts_of) for r in rows]
    names = list(parts[0]) if parts else []
    pairs = np.array([[p[n] for n in names] for p in parts], dtype=np.float64).reshape(len(rows), len(names), 2)
    return pairs[..., 0], pairs[..., 1]


def _signal(kept: list[dict], grpo: GRPOConfig, parts_of: PartsOf) -> tuple[np.ndarray, np.ndarray | None]:
    """(the values whose spread within a group is its learning signal, one column each, and their weights): the
    reward (less its KL penalty, grpo.kl_reward_coef), or under 'normalize_then_sum' each part of it (the KL
    penalty one of them)."""
    if grpo.reward_aggregation == "normalize_then_sum":
        weights, values = _parts_matrix(kept, parts_of)
        weighed = (weights != 0).any(axis=0)  # a part weighted 0 (a penalty turned off) is no signal
        return values[:, weighed], weights[:, weighed]
    return np.asarray([penalised_reward(r) for r in kept], dtype=np.float64).reshape(len(kept), 1), None


def _reward_signal(kept: list[dict], grpo: GRPOConfig, parts_of: PartsOf) -> np.ndarray:
    """The values whose spread decides whether a group teaches anything: the reward (its parts under
    'normalize_then_sum') before any KL penalty. The penalty differs between any two responses, so read with it no
    group would ever be flat: rollout.dynamic_sampling decides on the reward, and so does the filter that drops
    the groups it replaced (verl's filter_groups metric 'acc')."""
    without_kl = [{k: v for k, v in r.items() if k not in ("reward_kl", "kl_coef")} for r in kept]
    return _signal(without_kl, grpo, parts_of)[0]


def _advantages(signal: np.ndarray, weights: np.ndarray | None, groups: list, grpo: GRPOConfig) -> np.ndarray:
    groups = np.asarray(groups)
    if weights is not None:
        return normalize_then_sum(signal, weights, groups, grpo.advantage_eps, grpo.advantage_std_ddof)
    return compute_advantages(signal[:, 0], groups, grpo.advantage, grpo.advantage_eps, grpo.advantage_std_ddof)


def zero_std_groups(values: Sequence, groups: Sequence) -> set:
    """Groups whose values are all equal up to rounding (every column, for a matrix of reward parts): their
    advantages are 0 and they teach nothing."""
    v, g = np.asarray(values, dtype=np.float64), np.asarray(groups)
    if not len(g):
        return set()
    v = v.reshape(len(g), -1)
    return {k for k in np.unique(g).tolist() if _all_equal(v[g == k])}


def group_advantages(
    rewards: list[dict], grpo: GRPOConfig, parts_of: PartsOf = whole_reward
) -> tuple[list[dict], dict]:
    """Per reward row (keyed by prompt_id, sample_idx): its group-relative advantage and whether it is trained.
    `parts_of` splits a row's reward into weighted parts for grpo.reward_aggregation 'normalize_then_sum'
    (reward.compose.reward_parts for rows of the rewards table). Rows carrying `reward_kl` and `kl_coef`
    (kl_reward.with_reward_kl) lose kl_coef x reward_kl first; the returned rows carry both (None without).

    Rows marked `dropped` (a failed judgment under judge.on_failure 'drop') take no part: their group's
    advantages come from the other samples. Groups whose rewards are all equal (before any KL penalty) are
    untrained under grpo.filter_zero_std_groups, and leave the batch before its statistics are taken (verl's DAPO
    filters before computing advantages): a kept group's advantages never depend on how many flat groups the step
    drew (batch_std, reinforce_pp_baseline and normalize_then_sum whiten over the batch)."""
    kept = [r for r in rewards if not r.get("dropped")]
    groups = [r["prompt_id"] for r in kept]
    signal, weights = _signal(kept, grpo, parts_of)
    for row, values in zip(kept, signal):
        if not np.isfinite(values).all():  # NaN would spread over the group's advantages and the weights
            raise NonFiniteReward(
                f"prompt {row['prompt_id']!r} sample {row['sample_idx']}: reward {row['reward']!r} (signal "
                f"{values.tolist()}) is not finite; nothing is trained on it"
            )
    flat = zero_std_groups(_reward_signal(kept, grpo, parts_of), groups)
    used = [i for i, g in enumerate(groups) if not (grpo.filter_zero_std_groups and g in flat)]
    adv = (
        _advantages(signal[used], None if weights is None else weights[used], [groups[i] for i in used], grpo)
        if used
        else np.array([])
    )
    advantage_of = {(kept[i]["prompt_id"], kept[i]["sample_idx"]): float(a) for i, a in zip(used, adv)}
    kept_advantages = [advantage_of.get((r["prompt_id"], r["sample_idx"]), 0.0) for r in kept]
    rows = [
        {
            "prompt_id": r["prompt_id"],
            "sample_idx": r["sample_idx"],
            "reward": r["reward"],
            "advantage": advantage_of.get((r["prompt_id"], r["sample_idx"]), 0.0),
            "reward_kl": r.get("reward_kl"),
            "kl_coef": r.get("kl_coef"),
            "trained": not r.get("dropped") and not (grpo.filter_zero_std_groups and r["prompt_id"] in flat),
        }
        for r in rewards
    ]
    stats = {
        "advantage_abs_mean": float(np.abs(kept_advantages).mean()) if kept else 0.0,
        "zero_std_group_fraction": len(flat) / max(len(set(groups)), 1),
        "informative_groups": len(set(groups) - flat),
        "dropped_groups": len(flat) if grpo.filter_zero_std_groups else 0,
    }
    return rows, stats


def informative_prompt_ids(rewards: list[dict], grpo: GRPOConfig, parts_of: PartsOf = whole_reward) -> set[str]:
    """Prompts whose group's rewards differ (under 'normalize_then_sum': whose parts differ; rows of failed
    judgments under 'drop' left out): the groups that carry a learning signal, which rollout.dynamic_sampling
    samples until the step has enough of."""
    kept = [r for r in rewards if not r.get("dropped")]
    groups = [r["prompt_id"] for r in kept]
    return set(groups) - zero_std_groups(_reward_signal(kept, grpo, parts_of), groups)
