"""KL in the reward (grpo.kl_reward_coef; verl algorithm.use_kl_in_reward): each response's reward loses coef x
its summed KL to the reference before the advantages, and an adaptive controller (grpo.kl_reward_target; verl
AdaptiveKLController, after Ziegler et al. 2019) moves the coefficient once per step toward a target KL."""

from __future__ import annotations


def kl_coef_at(previous: dict | None, grpo) -> float:
    """The coefficient a step applies: the controller's after the last step, or grpo.kl_reward_coef at the
    first step and whenever the coefficient is fixed."""
    return previous["coef"] if previous is not None and grpo.kl_reward_target > 0 else grpo.kl_reward_coef


def kl_control_after(coef: float, reward_kl: float, responses: int, grpo) -> dict:
    """The controller's state after a step that applied `coef` and measured `reward_kl` (the mean over its
    `responses` of their per-token mean KL): coef x (1 + clip(reward_kl / target - 1, -0.2, 0.2) x responses /
    horizon), verl's update with n_steps the batch size. A fixed coefficient stays."""
    if grpo.kl_reward_target <= 0:
        return {"coef": coef}
    error = min(max(reward_kl / grpo.kl_reward_target - 1.0, -0.2), 0.2)
    return {"coef": coef * (1.0 + error * responses / grpo.kl_reward_horizon)}


def with_reward_kl(rewards: list[dict], kl_sums: dict, coef: float) -> list[dict]:
    """Reward rows carrying their response's summed KL (`reward_kl`, keyed by (prompt_id, sample_idx) in
    `kl_sums`; 0 for a response without tokens) and the coefficient (`kl_coef`): the advantages read
    reward - kl_coef x reward_kl."""
    return [{**r, "reward_kl": kl_sums.get((r["prompt_id"], r["sample_idx"]), 0.0), "kl_coef": coef} for r in rewards]


def penalised_reward(row: dict) -> float:
    """The reward the advantages read: the reward, less its KL penalty where the row carries one."""
    return row["reward"] - row["kl_coef"] * row["reward_kl"] if row.get("reward_kl") is not None else row["reward"]
