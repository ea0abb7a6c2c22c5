"""Group-relative advantages. One function per normaliser, chosen through ADVANTAGES."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np


def _group_stats(rewards: np.ndarray, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row mean and std (ddof 0, as open-instruct) of the row's group."""
    mean, std = np.empty_like(rewards), np.empty_like(rewards)
    for g in np.unique(groups):
        members = groups == g
        mean[members] = rewards[members].mean()
        std[members] = rewards[members].std()
    return mean, std


def group_std(rewards: np.ndarray, groups: np.ndarray, eps: float) -> np.ndarray:
    """A_i = (r_i - mean_group) / (std_group + eps): the original GRPO normaliser."""
    mean, std = _group_stats(rewards, groups)
    return (rewards - mean) / (std + eps)


def batch_std(rewards: np.ndarray, groups: np.ndarray, eps: float) -> np.ndarray:
    """Group-centred, batch-scaled: avoids blowing up near-constant groups."""
    mean, _ = _group_stats(rewards, groups)
    return (rewards - mean) / (rewards.std() + eps)


def mean_only(rewards: np.ndarray, groups: np.ndarray, eps: float) -> np.ndarray:
    """Dr.GRPO: no std division (removes the difficulty bias of per-group scaling)."""
    mean, _ = _group_stats(rewards, groups)
    return rewards - mean


ADVANTAGES: dict[str, Callable[[np.ndarray, np.ndarray, float], np.ndarray]] = {
    "group_std": group_std,
    "batch_std": batch_std,
    "none": mean_only,
}


def compute_advantages(rewards: Sequence[float], groups: Sequence, kind: str, eps: float) -> np.ndarray:
    if kind not in ADVANTAGES:
        raise ValueError(f"unknown advantage {kind!r}; choose from {sorted(ADVANTAGES)}")
    return ADVANTAGES[kind](np.asarray(rewards, dtype=np.float64), np.asarray(groups), eps)


def zero_std_groups(rewards: Sequence[float], groups: Sequence) -> set:
    """Groups whose rewards are all equal: their advantages are 0 and they teach nothing."""
    r, g = np.asarray(rewards, dtype=np.float64), np.asarray(groups)
    return {k for k in np.unique(g).tolist() if np.ptp(r[g == k]) == 0}
