"""Group-relative advantages. One function per normaliser, chosen through ADVANTAGES.

The std's `ddof` is a setting (grpo.advantage_std_ddof): 0 divides by G (population std, as open-instruct), 1 by
G - 1 (sample std, as verl, which Co-rewarding builds on). A one-member group has std 0 under either.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np


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
    """A_i = (r_i - mean_group) / (std_group + eps): the original GRPO normaliser."""
    mean, std = _group_stats(rewards, groups, ddof)
    return (rewards - mean) / (std + eps)


def batch_std(rewards: np.ndarray, groups: np.ndarray, eps: float, ddof: int = 0) -> np.ndarray:
    """Group-centred, batch-scaled: avoids blowing up near-constant groups."""
    mean, _ = _group_stats(rewards, groups, ddof)
    return (rewards - mean) / (_std(rewards, ddof) + eps)


def mean_only(rewards: np.ndarray, groups: np.ndarray, eps: float, ddof: int = 0) -> np.ndarray:
    """Dr.GRPO: no std division (removes the difficulty bias of per-group scaling); ddof does not apply."""
    mean, _ = _group_stats(rewards, groups, ddof)
    return rewards - mean


ADVANTAGES: dict[str, Callable[..., np.ndarray]] = {
    "group_std": group_std,
    "batch_std": batch_std,
    "none": mean_only,
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
