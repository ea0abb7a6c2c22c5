"""The judge's cost ledger: tokens priced at judge.price_per_mtok_in / _out, and judge.budget_usd checked before each
step. A stage's usage is {'requests', 'prompt_tokens', 'completion_tokens'} (tasks/judge.py, tasks/eval.py,
tasks/anchors.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from refiner_core.config import JudgeConfig


@dataclass
class Payer:
    """Who pays for the judgments made in this context: one judging stage of one run (`name`: run folder, stage,
    step, round or phase; the same in every attempt of it), in one attempt. The judge cache records both with each
    answer, so that a hit on an answer an earlier attempt of the same stage paid for (a retry, the rerun after a
    failure) still counts what was paid, once: else that spend would be in no stage's usage, and judge.budget_usd
    would never see it. A hit on one this attempt paid for counts nothing: it was counted when paid."""

    name: str
    attempt: str = field(default_factory=lambda: uuid.uuid4().hex)
    repaid: set[str] = field(default_factory=set)  # cache keys whose earlier payment this attempt counted

    def counts(self, key: str, entry: dict) -> bool:
        """Whether a cache hit on `entry` counts what it cost here (and from now on not again)."""
        earlier = entry.get("paid_by") == self.name and entry.get("paid_in") != self.attempt
        if not earlier or key in self.repaid:
            return False
        self.repaid.add(key)
        return True


PAYER: ContextVar[Payer | None] = ContextVar("judge_payer", default=None)


@contextmanager
def paying(name: str) -> Iterator[Payer]:
    """Judgments made in the block are paid by stage run `name`, in a new attempt."""
    payer = Payer(name)
    token = PAYER.set(payer)
    try:
        yield payer
    finally:
        PAYER.reset(token)


class JudgeBudgetExceeded(RuntimeError):
    """The next step's judge would take the run past judge.budget_usd; the run stops before it (resumable)."""


def usage_cost(usage: dict, judge: JudgeConfig) -> float:
    """Dollars of a usage at the judge's prices."""
    return (
        usage.get("prompt_tokens", 0) * judge.price_per_mtok_in
        + usage.get("completion_tokens", 0) * judge.price_per_mtok_out
    ) / 1e6


def check_budget(judge: JudgeConfig, spent: list[dict], step: int, upcoming: dict[str, float]) -> None:
    """Raise JudgeBudgetExceeded when what was spent (`spent`: every judging stage's usage so far: training steps,
    anchors and held-out evaluations) plus what step `step` will likely judge (`upcoming`: dollars by part, e.g. its
    rollouts at the dearest step so far, anchors and the held-out evaluation after it where due) exceeds
    judge.budget_usd (0 = no budget)."""
    if judge.budget_usd <= 0:
        return
    total = sum(usage_cost(u, judge) for u in spent)
    coming = sum(upcoming.values())
    if total + coming > judge.budget_usd:
        parts = ", ".join(f"{name} ${cost:.4f}" for name, cost in upcoming.items() if cost)
        raise JudgeBudgetExceeded(
            f"judge budget: ${total:.4f} of judge.budget_usd ${judge.budget_usd:g} spent over {step} step(s), "
            f"their anchors and held-out evaluations; step {step} would cost about ${coming:.4f}"
            + (f" ({parts}: the dearest of each so far)" if parts else "")
            + ", so the run stops before it. Raise judge.budget_usd and run the same command again to go on "
            "(finished stages are cached)"
        )


def likely_step_cost(
    step_costs: list[float], anchor_costs: list[float], eval_costs: list[float], anchors_due: bool, eval_due: bool
) -> dict[str, float]:
    """What a step will likely judge, in dollars by part: its rollouts as the dearest step so far, and where due,
    its anchors and the held-out evaluation after it as the dearest of each so far (nothing where none ran yet)."""
    upcoming = {"rollouts": max(step_costs, default=0.0)}
    if anchors_due:
        upcoming["anchors"] = max(anchor_costs, default=0.0)
    if eval_due:
        upcoming["held-out evaluation"] = max(eval_costs, default=0.0)
    return upcoming
