"""Majority-vote pseudo-labels (Co-rewarding): a question's label is the final answer most rollouts of its label
source give, and a rollout is rewarded for matching it, with no ground truth involved.

- A vote is the content of a response's last `\\boxed{}`; a response without one casts no vote.
- Votes are counted by the equivalence a rollout is later matched to its label with (ground_truth.match:
  math-verify where it reads both, else the same normalised text), so `14`, `14.0` and `$14$` are one answer, and
  so are `0.5` and `\\frac{1}{2}`, while `(1,2)` and `[1,2]` are two. A vote joins the first answer it equals, in
  voting order; the label is the first-cast text of the winner.
- Ties are broken deterministically: among equally voted answers, the one cast first (lowest sample index) wins;
  `label_tied` records that a tie was broken.
- No vote at all gives an empty label (NULL), and every rollout it would label gets reward 0.
- A rollout matches the label by the same equivalence as ground-truth verification (math-verify, else the
  normalised match, recorded in verify_method). Its `correct` column is still checked against the ground truth
  when the prompt has one (NULL otherwise), and `label_correct` says whether the label itself was right.
"""

from __future__ import annotations

from dataclasses import dataclass

from refiner_core.reward.ground_truth import Verdict, answer_text, last_boxed, match, normalize, verify_row


@dataclass(frozen=True)
class Vote:
    label: str | None  # the winning answer as first cast; None when no rollout cast a vote
    votes: int  # votes for the label
    voters: int  # rollouts that cast a vote (gave a \boxed{} answer)
    tied: bool  # the label won a tie (broken by the earliest vote)


def vote_of(response: str) -> str | None:
    """A response's vote: its last \\boxed{} content, None when it has none (or an empty one)."""
    answer = last_boxed(response)
    return answer if answer is not None and normalize(answer) else None


def majority_vote(votes: list[str | None]) -> Vote:
    """Majority over votes given in sample order (None = no vote); ties go to the answer cast first."""
    tally: list[list] = []  # one [count, first position, text as first cast] per distinct answer
    for position, vote in enumerate(votes):
        if vote is None or not normalize(vote):
            continue
        entry = next((e for e in tally if same_answer(vote, e[2])), None)
        if entry is None:
            tally.append([1, position, vote])
        else:
            entry[0] += 1
    if not tally:
        return Vote(None, 0, 0, False)
    best = max(tally, key=lambda e: (e[0], -e[1]))
    return Vote(best[2], best[0], sum(e[0] for e in tally), sum(e[0] == best[0] for e in tally) > 1)


def same_answer(vote: str, other: str) -> bool:
    """Whether a vote is the answer `other` (a label as first cast): as a rollout is matched to its label. A
    normalised-text shortcut took `(1,2)` for `[1,2]`, which the match then told apart."""
    return match(vote, other).score == 1.0


@dataclass(frozen=True)
class LabelledVerdict(Verdict):
    """A verdict against a pseudo-label. `correct` is agreement with the ground truth, None when there is none."""

    label_source: str = ""  # 'twin' (Co-rewarding-I) or 'teacher' (Co-rewarding-II)
    pseudo_label: str | None = None
    label_votes: int = 0
    label_voters: int = 0
    label_tied: bool = False
    label_correct: float | None = None  # the label against the ground truth; None without either


def verdict_against_label(
    row: dict, vote: Vote, source: str, truth: str | None, final_answer: str = "last_expression"
) -> LabelledVerdict:
    """Score 1 when the rollout's \\boxed{} answer matches the label, 0 otherwise (and always 0 for an empty one);
    `correct`: its final answer against the ground truth, read as reward.final_answer says."""
    answer = vote_of(answer_text(row))
    if vote.label is None:
        score, method, detail = 0.0, "no_label", f"no {source} rollout gave a \\boxed{{}} answer"
    elif answer is None:
        score, method, detail = 0.0, "no_answer", None
    else:
        matched = match(answer, vote.label)
        score, method, detail = matched.score, matched.method, matched.detail
    return LabelledVerdict(
        score=score,
        extracted=answer,
        method=method,
        detail=detail,
        correct=None if truth is None else verify_row(row, truth, final_answer).score,
        label_source=source,
        pseudo_label=vote.label,
        label_votes=vote.votes,
        label_voters=vote.voters,
        label_tied=vote.tied,
        label_correct=None if truth is None or vote.label is None else match(vote.label, truth).score,
    )


def label_rollouts(
    rollouts: list[dict],
    label_votes: dict[str, Vote],
    prompts: dict[str, dict],
    source: str,
    final_answer: str = "last_expression",
) -> list[LabelledVerdict]:
    """One verdict per rollout against its prompt's label (`label_votes[prompt_id]`; missing = empty label)."""
    empty = Vote(None, 0, 0, False)
    return [
        verdict_against_label(
            r, label_votes.get(r["prompt_id"], empty), source, prompts[r["prompt_id"]].get("ground_truth"), final_answer
        )
        for r in rollouts
    ]


def votes_by_prompt(rollouts: list[dict]) -> dict[str, Vote]:
    """The majority vote of each prompt's rollouts (in sample order)."""
    by_prompt: dict[str, list[dict]] = {}
    for r in rollouts:
        by_prompt.setdefault(r["prompt_id"], []).append(r)
    return {
        pid: majority_vote([vote_of(answer_text(r)) for r in sorted(rows, key=lambda r: r["sample_idx"])])
        for pid, rows in by_prompt.items()
    }
