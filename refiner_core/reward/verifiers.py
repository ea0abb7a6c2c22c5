"""Verifiers: how a prompt without rubrics is scored (prompts with rubrics go to the LLM judge).

A verifier maps the step's rollouts (with their prompts) to one Verdict per rollout; it sees the whole step so
that batch-level verifiers (a majority vote over a group, a teacher's pseudo-label) fit the same interface.
Verifiers register in VERIFIERS by "module:factory" string and are chosen by `reward.verifier`; a factory taking
a `final_answer` argument gets reward.final_answer (where a response's answer is read from).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable

from refiner_core.config import ExtensionError
from refiner_core.reward.ground_truth import Verdict, verify_row
from refiner_core.reward.pseudo_labels import LabelledVerdict, label_rollouts, votes_by_prompt
from refiner_core.runtime.registry import resolve

Verifier = Callable[[list[dict], dict[str, dict]], list[Verdict]]


def ground_truth_verifier(final_answer: str = "last_expression") -> Verifier:
    """The final answer of each response against its prompt's ground_truth (math-verify, recorded fallback)."""

    def verify_step(rollouts: list[dict], prompts: dict[str, dict]) -> list[Verdict]:
        verdicts = []
        for r in rollouts:
            truth = prompts[r["prompt_id"]].get("ground_truth")
            if truth is None:
                raise ValueError(
                    f"prompt {r['prompt_id']!r} has neither rubrics nor a ground_truth: nothing can score its rollouts"
                )
            verdicts.append(verify_row(r, truth, final_answer))
        return verdicts

    return verify_step


def self_majority_verifier(final_answer: str = "last_expression") -> Verifier:
    """Each prompt's pseudo-label is the majority \\boxed{} answer of its own rollouts (TTRL-style self-consistency)."""

    def verify_step(rollouts: list[dict], prompts: dict[str, dict]) -> list[Verdict]:
        return label_rollouts(rollouts, votes_by_prompt(rollouts), prompts, "self", final_answer)

    return verify_step


def twin_majority_verifier(final_answer: str = "last_expression") -> Verifier:
    """Co-rewarding-I: a prompt's pseudo-label is the majority \\boxed{} answer of its twin's rollouts (the
    question's other view, `twin_id`, sampled in the same step); no twin in the step = empty label, reward 0."""

    def verify_step(rollouts: list[dict], prompts: dict[str, dict]) -> list[Verdict]:
        votes = votes_by_prompt(rollouts)
        label_of = {pid: votes[twin] for pid in votes if (twin := prompts[pid].get("twin_id")) in votes}
        return label_rollouts(rollouts, label_of, prompts, "twin", final_answer)

    return verify_step


def teacher_majority_verifier(final_answer: str = "last_expression") -> Verifier:
    """Co-rewarding-II: a prompt's pseudo-label is the majority \\boxed{} answer of the EMA teacher's rollouts of it
    (the judge stage hands them over as the prompt's `teacher_rollouts`); none = empty label, reward 0."""

    def verify_step(rollouts: list[dict], prompts: dict[str, dict]) -> list[Verdict]:
        asked = {r["prompt_id"] for r in rollouts}
        votes = votes_by_prompt([t for pid in asked for t in prompts[pid].get("teacher_rollouts") or ()])
        return label_rollouts(rollouts, votes, prompts, "teacher", final_answer)

    return verify_step


def verdict_columns(verdict: Verdict | None) -> dict:
    """The reward_inputs columns a verdict fills (all NULL for judged rollouts, label columns NULL for verifiers
    without a pseudo-label)."""
    labelled = isinstance(verdict, LabelledVerdict)
    if verdict is None:
        correct = None
    elif labelled:
        correct = verdict.correct  # agreement with the ground truth; None when the prompt has none
    else:
        correct = verdict.score if verdict.correct is None else verdict.correct
    return {
        "verifier_score": None if verdict is None else verdict.score,
        "correct": correct,
        "extracted_answer": None if verdict is None else verdict.extracted,
        "verify_method": None if verdict is None else verdict.method,
        "verify_detail": None if verdict is None else verdict.detail,
        "label_source": verdict.label_source if labelled else None,
        "pseudo_label": verdict.pseudo_label if labelled else None,
        "label_votes": verdict.label_votes if labelled else None,
        "label_voters": verdict.label_voters if labelled else None,
        "label_tied": verdict.label_tied if labelled else None,
        "label_correct": verdict.label_correct if labelled else None,
    }


VERIFIERS: dict[str, str] = {
    "ground_truth": "refiner_core.reward.verifiers:ground_truth_verifier",
    "majority_vote": "refiner_core.reward.verifiers:self_majority_verifier",
    "co_rewarding": "refiner_core.reward.verifiers:twin_majority_verifier",
    "co_rewarding_teacher": "refiner_core.reward.verifiers:teacher_majority_verifier",
    "tcr": "refiner_core.reward.tcr:tcr_verifier",
}


def make_verifier(name: str, final_answer: str = "last_expression") -> Verifier:
    """The verifier `name` builds, its verdicts checked against the contract: one Verdict per rollout, in order,
    each with a finite score (a verifier that breaks it fails the judge stage, not retried: the same code would)."""
    factory = resolve(VERIFIERS, "verifier", name)
    takes = "final_answer" in inspect.signature(factory).parameters
    verify_step = factory(final_answer=final_answer) if takes else factory()
    if not callable(verify_step):
        raise ExtensionError(
            f"reward.verifier {name!r}: its factory returned {type(verify_step).__name__}, not a function "
            "verify_step(rollouts, prompts) -> list[Verdict]"
        )

    def checked(rollouts: list[dict], prompts: dict[str, dict]) -> list[Verdict]:
        return checked_verdicts(name, verify_step(rollouts, prompts), rollouts)

    return checked


def checked_verdicts(name: str, verdicts, rollouts: list[dict]) -> list[Verdict]:
    """`verdicts` if they keep the verifier contract, else ExtensionError saying how they break it."""
    contract = "verify_step(rollouts, prompts) returns one Verdict per rollout, in order, each with a finite score"
    verdicts = list(verdicts) if isinstance(verdicts, (list, tuple)) else verdicts
    if not isinstance(verdicts, list) or len(verdicts) != len(rollouts):
        got = f"{len(verdicts)} verdicts" if isinstance(verdicts, list) else type(verdicts).__name__
        raise ExtensionError(f"reward.verifier {name!r} returned {got} for {len(rollouts)} rollouts: {contract}")
    for verdict, r in zip(verdicts, rollouts):
        where = f"prompt {r.get('prompt_id')!r} sample {r.get('sample_idx')}"
        if not isinstance(verdict, Verdict):
            raise ExtensionError(
                f"reward.verifier {name!r} returned {type(verdict).__name__} for {where}, not a Verdict: {contract}"
            )
        for field in ("score", "correct"):
            value = getattr(verdict, field)
            finite = isinstance(value, numbers.Real) and math.isfinite(value)  # numpy's scalars and bools included
            if not finite and not (field == "correct" and value is None):
                raise ExtensionError(
                    f"reward.verifier {name!r} gave {where} the {field} {value!r}: a Verdict's score (and correct, "
                    f"when set) is a finite number; {contract}"
                )
    return verdicts
