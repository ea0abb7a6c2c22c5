"""Verifiers: how a prompt without rubrics is scored (prompts with rubrics go to the LLM judge).

A verifier maps the step's rollouts (with their prompts) to one Verdict per rollout; it sees the whole step so
that batch-level verifiers (a majority vote over a group, a teacher's pseudo-label) fit the same interface.
Verifiers register in VERIFIERS by "module:factory" string and are chosen by `reward.verifier`.
"""

from __future__ import annotations

from typing import Callable

from refiner_core.ground_truth import Verdict, verify
from refiner_core.registry import resolve

Verifier = Callable[[list[dict], dict[str, dict]], list[Verdict]]


def ground_truth_verifier() -> Verifier:
    """The final answer of each response against its prompt's ground_truth (math-verify, recorded fallback)."""

    def verify_step(rollouts: list[dict], prompts: dict[str, dict]) -> list[Verdict]:
        verdicts = []
        for r in rollouts:
            truth = prompts[r["prompt_id"]].get("ground_truth")
            if truth is None:
                raise ValueError(f"prompt {r['prompt_id']!r} has neither rubrics nor a ground_truth: nothing can "
                                 "score its rollouts")
            verdicts.append(verify(r["response_text"], truth))
        return verdicts

    return verify_step


VERIFIERS: dict[str, str] = {"ground_truth": "refiner_core.verifiers:ground_truth_verifier",
                             "tcr": "refiner_core.agent.tcr:tcr_verifier"}


def make_verifier(name: str) -> Verifier:
    return resolve(VERIFIERS, "verifier", name)()
