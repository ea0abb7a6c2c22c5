"""The judge's cost ledger: tokens priced at judge.price_per_mtok_in / _out, and judge.budget_usd checked before each
step. A stage's usage is {'requests', 'prompt_tokens', 'completion_tokens'} (tasks/judge.py, tasks/eval.py)."""

from __future__ import annotations

from refiner_core.config import JudgeConfig


class JudgeBudgetExceeded(RuntimeError):
    """The next step's judge would take the run past judge.budget_usd; the run stops before it (resumable)."""


def usage_cost(usage: dict, judge: JudgeConfig) -> float:
    """Dollars of a usage at the judge's prices."""
    return (
        usage.get("prompt_tokens", 0) * judge.price_per_mtok_in
        + usage.get("completion_tokens", 0) * judge.price_per_mtok_out
    ) / 1e6


def check_budget(judge: JudgeConfig, spent: list[dict], step_costs: list[float], step: int) -> None:
    """Raise JudgeBudgetExceeded when what was spent (`spent`: every judging stage's usage so far, held-out
    evaluations included) plus the next step's likely cost (the dearest step so far; nothing before the first step)
    exceeds judge.budget_usd (0 = no budget)."""
    if judge.budget_usd <= 0:
        return
    total = sum(usage_cost(u, judge) for u in spent)
    next_step = max(step_costs, default=0.0)
    if total + next_step > judge.budget_usd:
        raise JudgeBudgetExceeded(
            f"judge budget: ${total:.4f} of judge.budget_usd ${judge.budget_usd:g} spent over {len(step_costs)} "
            f"step(s) and held-out evaluations; step {step} would cost about ${next_step:.4f} (the dearest step so "
            "far), so the run stops before it. Raise judge.budget_usd and run the same command again to go on "
            "(finished stages are cached)"
        )
