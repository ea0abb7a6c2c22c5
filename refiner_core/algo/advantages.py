"""Group-relative advantages. One function per normaliser, chosen through ADVANTAGES; docs/grpo.md compares
them with the peers' options.

The std's `ddof` is a setting (grpo.advantage_std_ddof): 0 divides by G (population std, as open-instruct), 1 by
G - 1 (sample std, as verl, which Co-rewarding builds on). A one-member group has std 0 under either. Batch
statistics count each response once (verl's REINFORCE++ whitens per token, weighting responses by length).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from refiner_core.config import GRPOConfig


def _std(values: np.ndarray, ddof: int) -> float:
    return float(values.std(ddof=ddof)) if len(values) > ddof else 0.0


def _group_stats(rewards: np.ndarray, groups: np.ndarray, ddof: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-row mean and std (with `ddof`) of the row's group."""
    mean, std = np.empty_like(rewards), np.empty_like(rewards)
    for g in np.unique(groups):
        members = groups == g
        mean[members] = rewards[members].mean()
        std[members] = _std(rewards[members], ddof)
    return mean, std


def group_std(rewards: np.ndarray, groups: np.ndarray, eps: float, ddof: int = 0) -> np.ndarray:
    """A_i = (r_i - mean_group) / (std_group + eps): the original GRPO normaliser. TRL scale_rewards 'group'
    (ddof 1, eps 1e-4), verl `grpo` (ddof 1, eps 1e-6), open-instruct advantage_normalization_type 'standard'
    (ddof 0, eps 1e-8)."""
    mean, std = _group_stats(rewards, groups, ddof)
    return (rewards - mean) / (std + eps)


def batch_std(rewards: np.ndarray, groups: np.ndarray, eps: float, ddof: int = 0) -> np.ndarray:
    """(r - mean_group) / (std of the batch's rewards + eps): avoids blowing up near-constant groups. TRL
    scale_rewards 'batch' (ddof 1, eps 1e-4)."""
    mean, _ = _group_stats(rewards, groups, ddof)
    return (rewards - mean) / (_std(rewards, ddof) + eps)


def mean_only(rewards: np.ndarray, groups: np.ndarray, eps: float, ddof: int = 0) -> np.ndarray:
    """Dr.GRPO: r - mean_group, no std division (removes the difficulty bias of per-group scaling); ddof does not
    apply. TRL scale_rewards 'none', verl norm_adv_by_std_in_grpo False, open-instruct 'centered'."""
    mean, _ = _group_stats(rewards, groups, ddof)
    return rewards - mean


def rloo(rewards: np.ndarray, groups: np.ndarray, eps: float, ddof: int = 0) -> np.ndarray:
    """RLOO: A_i = r_i - mean of the other G - 1 rewards of the group = G/(G-1) (r_i - mean); a one-member group
    gets 0. TRL RLOOTrainer (normalize_advantages False), verl `rloo` (which leaves a one-member group's reward
    as its advantage); eps and ddof do not apply."""
    mean, _ = _group_stats(rewards, groups, ddof)
    sizes = np.array([np.count_nonzero(groups == g) for g in groups], dtype=np.float64)
    return np.where(sizes > 1, (rewards - mean) * sizes / np.maximum(sizes - 1, 1), 0.0)


def reinforce_pp(rewards: np.ndarray, groups: np.ndarray, eps: float, ddof: int = 0) -> np.ndarray:
    """REINFORCE++: no group baseline, A = (r - batch mean) / (batch std + eps). verl `reinforce_plus_plus` (gamma
    1, outcome reward) whitens per token instead: equal when every response has one token, with ddof 1 and
    eps 0 (verl adds 1e-8 to the variance)."""
    return (rewards - rewards.mean()) / (_std(rewards, ddof) + eps)


def reinforce_pp_baseline(rewards: np.ndarray, groups: np.ndarray, eps: float, ddof: int = 0) -> np.ndarray:
    """REINFORCE++ with baseline: c = r - group mean, A = c / (batch std of c + eps) (c's batch mean is 0 by
    construction). verl `reinforce_plus_plus_baseline`, which whitens c per token: equal for one-token responses,
    ddof 1, eps 0, and groups of two or more (verl keeps a one-member group's raw reward as c)."""
    mean, _ = _group_stats(rewards, groups, ddof)
    centred = rewards - mean
    return centred / (_std(centred, ddof) + eps)


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
    return ADVANTAGES[kind](np.asarray(rewards, dtype=np.float64), np.asarray(groups), eps, ddof)


def zero_std_groups(rewards: Sequence[float], groups: Sequence) -> set:
    """Groups whose rewards are all equal: their advantages are 0 and they teach nothing."""
    r, g = np.asarray(rewards, dtype=np.float64), np.asarray(groups)
    return {k for k in np.unique(g).tolist() if np.ptp(r[g == k]) == 0}


def group_advantages(rewards: list[dict], grpo: GRPOConfig) -> tuple[list[dict], dict]:
    """Per reward row (keyed by prompt_id, sample_idx): its group-relative advantage and whether it is trained.

    Rows marked `dropped` (a failed judgment under judge.on_failure 'drop') take no part: their group's
    advantages come from the other samples. All-equal groups are untrained under grpo.filter_zero_std_groups."""
    kept = [r for r in rewards if not r.get("dropped")]
    values = [r["reward"] for r in kept]
    groups = [r["prompt_id"] for r in kept]
    adv = (
        compute_advantages(values, groups, grpo.advantage, grpo.advantage_eps, grpo.advantage_std_ddof)
        if kept
        else np.array([])
    )
    flat = zero_std_groups(values, groups)
    advantage_of = {(r["prompt_id"], r["sample_idx"]): float(a) for r, a in zip(kept, adv)}
    rows = [
        {
            "prompt_id": r["prompt_id"],
            "sample_idx": r["sample_idx"],
            "reward": r["reward"],
            "advantage": advantage_of.get((r["prompt_id"], r["sample_idx"]), 0.0),
            "trained": not r.get("dropped") and not (grpo.filter_zero_std_groups and r["prompt_id"] in flat),
        }
        for r in rewards
    ]
    stats = {
        "advantage_abs_mean": float(np.abs(adv).mean()) if len(adv) else 0.0,
        "zero_std_group_fraction": len(flat) / max(len(set(groups)), 1),
        "informative_groups": len(set(groups) - flat),
        "dropped_groups": len(flat) if grpo.filter_zero_std_groups else 0,
    }
    return rows, stats


def informative_prompt_ids(rewards: list[dict]) -> set[str]:
    """Prompts whose group's rewards differ (rows of failed judgments under 'drop' left out): the groups that
    carry a learning signal, which rollout.dynamic_sampling samples until the step has enough of."""
    kept = [r for r in rewards if not r.get("dropped")]
    groups = [r["prompt_id"] for r in kept]
    return set(groups) - zero_std_groups([r["reward"] for r in kept], groups)
