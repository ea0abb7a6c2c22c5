"""Held-out evaluation of a policy checkpoint.

The validation split of the prompts is answered by the recipe's own rollout engine (greedy, and/or k sampled
responses for pass@k) and scored by the same code that computes training rewards, so an eval number and a
training reward always mean the same thing. Every evaluation uses the same seed: two checkpoints differ only
by their weights.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from math import comb

from refiner_core.config import EvalConfig
from refiner_core.data.prepare import cap_prompts
from refiner_core.rollout.base import RolloutEngine, SamplingParams

PHASES = ("base", "sft", "grpo")
MODES = ("greedy", "sampled")
# Per-response counts of an agent evaluation (multi-turn tool calling), NULL for single responses.
AGENT_COLUMNS = ("turns", "tool_calls", "well_formed_calls", "tool_errors", "refused_calls", "tool_rounds")


@dataclass(frozen=True)
class EvalSettings:
    prompts: int
    greedy: bool
    samples: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    pass_k: int
    pass_rubric_score: float
    max_new_tokens: int
    stop: tuple[str, ...]

    @classmethod
    def from_config(
        cls,
        eval: EvalConfig,
        top_p: float,
        top_k: int,
        min_p: float,
        repetition_penalty: float,
        max_new_tokens: int,
        stop: Sequence[str],
    ) -> EvalSettings:
        """The eval section's settings, sampling with the rollout section's top_p, top_k, min_p, repetition penalty
        (greedy decoding too), stop strings and (unless eval.max_new_tokens sets its own) length limit."""
        return cls(
            prompts=eval.prompts,
            greedy=eval.greedy,
            samples=eval.samples,
            temperature=eval.temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            pass_k=eval.pass_k or eval.samples,
            pass_rubric_score=eval.pass_rubric_score,
            max_new_tokens=eval.max_new_tokens or max_new_tokens,
            stop=tuple(stop),
        )

    def sampling(self, seed: int) -> dict[str, SamplingParams]:
        """The sampling parameters of each mode evaluated."""
        modes = {}
        if self.greedy:
            modes["greedy"] = SamplingParams(
                n=1,
                temperature=0.0,
                repetition_penalty=self.repetition_penalty,
                max_new_tokens=self.max_new_tokens,
                stop=self.stop,
                seed=seed,
            )
        if self.samples:
            modes["sampled"] = SamplingParams(
                n=self.samples,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                repetition_penalty=self.repetition_penalty,
                max_new_tokens=self.max_new_tokens,
                stop=self.stop,
                seed=seed,
            )
        return modes


def eval_steps(total_steps: int, every: int) -> list[int]:
    """GRPO updates after which the policy is evaluated: 0 (the starting policy), every `every`-th, and the
    last; none when `every` is 0."""
    if every <= 0:
        return []
    return sorted({0, *range(every, total_steps + 1, every), total_steps})


def held_out_prompts(prompt_rows: list[dict], limit: int, kept: Collection[str]) -> list[dict]:
    """The validation split's prompts the rubric stage kept (`kept`, its manifest's held_out_ids: one it rejected
    has neither rubrics nor a ground truth to score it by), in prompt_id order, the first `limit` of them (0 = all),
    a twin pair taken or left whole (Co-rewarding-I: a view without its twin has no label, and would score 0): the
    same prompts at every evaluation of a run, and never trained on."""
    kept = set(kept)
    held_out = sorted(
        (p for p in prompt_rows if p["split"] == "validation" and p["prompt_id"] in kept), key=lambda p: p["prompt_id"]
    )
    return cap_prompts(held_out, limit)


def generate_responses(engine: RolloutEngine, prompts: list[dict], settings: EvalSettings, seed: int) -> list[dict]:
    """Rollout-shaped rows (with the eval `mode`) for every held-out prompt and mode."""
    rows = []
    for mode, params in settings.sampling(seed).items():
        generations = engine.generate([p["prompt_token_ids"] for p in prompts], params, desc=f"eval {mode}")
        for g in generations:
            prompt = prompts[g.prompt_index]
            rows.append(
                {
                    "mode": mode,
                    "prompt_id": prompt["prompt_id"],
                    "sample_idx": g.sample_idx,
                    "temperature": params.temperature,
                    "seed": params.seed,
                    "engine": engine.name,
                    "prompt_token_ids": prompt["prompt_token_ids"],
                    "response_token_ids": g.token_ids,
                    "response_logprobs": g.logprobs,
                    "response_text": g.text,
                    "response_tokens": len(g.token_ids),
                    "finish_reason": g.finish_reason,
                    "max_new_tokens": params.max_new_tokens,
                }
            )
    return rows


def passed(reward_row: dict, pass_rubric_score: float) -> bool:
    """A verified prompt passes when its answer is correct; a judged one when its answer is well formed, cites
    at least one snippet, cites no unknown ID, and the judge's rubric score reaches the threshold."""
    if reward_row["verifier"] != "judge":
        return reward_row["correct"] == 1.0
    return bool(
        reward_row["format_ok"]
        and reward_row["n_citations"] > 0
        and reward_row["n_invalid_citations"] == 0
        and reward_row["rubric_score"] >= pass_rubric_score
    )


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n responses of which c passed: 1 - C(n-c, k) / C(n, k) (Chen et al., 2021)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n; got n={n}, c={c}, k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def citation_validity(row: dict) -> float:
    """Fraction of the response's cited IDs that exist in the tool output (0 without an answer or a citation)."""
    return row["citation_valid_fraction"] if "citation_valid_fraction" in row else row["citation_score"]


def summarize(rows: list[dict], pass_k: int) -> list[dict]:
    """One row per (step, phase, mode): rates and means over the responses, pass@1 and pass@k over prompts."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["step"], PHASES.index(r["phase"]), r["phase"], r["mode"]), []).append(r)
    summary = []
    for (step, _, phase, mode), group in sorted(groups.items()):
        # a response whose judgments all failed under judge.on_failure skip/drop has no score: left out of the
        # score, reward and pass means, as out of an update (a judge outage is not a worse policy)
        scored = [r for r in group if not r.get("dropped")]
        by_prompt: dict[str, list[bool]] = {}
        for r in scored:
            by_prompt.setdefault(r["prompt_id"], []).append(bool(r["passed"]))
        n = len(group)
        labeled = [r["cites_distractor"] for r in group if r.get("cites_distractor") is not None]
        recalls = [r["supporting_recall"] for r in group if r.get("supporting_recall") is not None]
        k = min(pass_k, *(len(v) for v in by_prompt.values())) if pass_k and by_prompt else 1
        summary.append(
            {
                "step": step,
                "phase": phase,
                "mode": mode,
                "prompts": len({r["prompt_id"] for r in group}),
                "responses": n,
                "format_valid": sum(bool(r["format_ok"]) for r in group) / n,
                "citation_valid": sum(citation_validity(r) for r in group) / n,
                # Among responses to prompts that label their supporting snippets; None when none do.
                "cites_distractor": sum(labeled) / len(labeled) if labeled else None,
                "supporting_recall": _mean(recalls),
                "judge_score": _mean([r["rubric_score"] for r in scored if r["verifier"] == "judge"]),
                "reward": _mean([r["reward"] for r in scored if r["reward"] is not None]),
                "stopped": sum(r["finish_reason"] == "stop" for r in group) / n,
                "pass_at_1": _mean([pass_at_k(len(v), sum(v), 1) for v in by_prompt.values()]),
                "k": k,
                "pass_at_k": _mean([pass_at_k(len(v), sum(v), k) for v in by_prompt.values()]),
                **answer_summary(group),
            }
        )
    return summary


def answer_summary(group: list[dict]) -> dict:
    """Over one (step, phase, mode)'s responses to verified prompts: accuracy, the share answered in a \\boxed{},
    mean tokens; over its agent conversations: the share that called a tool, the shares of calls that were well
    formed and that failed, and assistant turns per answer. None where the group has no such response."""
    verified = [r for r in group if r.get("verifier") not in (None, "judge")]
    agent = [r for r in group if r.get("turns") is not None]
    calls = sum(r["tool_calls"] for r in agent)
    return {
        "accuracy": _mean([float(r["correct"] == 1.0) for r in verified]),
        "boxed": _mean([float(r["boxed"]) for r in verified if r.get("boxed") is not None]),
        "mean_tokens": _mean([r["response_tokens"] for r in group if r.get("response_tokens") is not None]),
        "tool_call_rate": _mean([float(r["tool_calls"] > 0) for r in agent]),
        "well_formed_calls": sum(r["well_formed_calls"] for r in agent) / calls if calls else None,
        "tool_errors": sum(r["tool_errors"] for r in agent) / calls if calls else None,
        "turns": _mean([r["turns"] for r in agent]),
    }


# Summary columns (header, summary key, rate?) of verified prompts and of agent conversations: shown where some
# evaluated row has the group's first one, so a refiner run's table stays as it was.
VERIFIED_COLUMNS = (("accuracy", "accuracy", True), ("boxed", "boxed", True))
AGENT_SUMMARY_COLUMNS = (
    ("turns", "turns", False),
    ("tool calls", "tool_call_rate", True),
    ("well-formed calls", "well_formed_calls", True),
    ("tool errors", "tool_errors", True),
)


def answer_columns(summary: list[dict]) -> list[tuple[str, str, bool]]:
    """The answer columns for these summary rows: accuracy and answered in a box where prompts were verified, the
    tool-use columns where conversations ran the agent loop, and then mean tokens."""
    shown = [
        column
        for group in (VERIFIED_COLUMNS, AGENT_SUMMARY_COLUMNS)
        if any(s.get(group[0][1]) is not None for s in summary)
        for column in group
    ]
    return shown + [("mean tokens", "mean_tokens", False)] if shown else []


def answer_cell(value: float | None, rate: bool) -> str:
    if value is None:
        return "-"
    return f"{value:.0%}" if rate else f"{value:.1f}"


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def eval_table(summary: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The held-out table's header and cells, one row per evaluated policy and mode: the one rendering behind the
    eval log's text table and the model card's markdown. The refiner's columns (format, citations, judge score)
    are left out when every row answered verified prompts only (a math or agent evaluation)."""
    refiner = any(s.get("accuracy") is None or s.get("judge_score") is not None for s in summary)
    extra = answer_columns(summary)
    header = ["step", "policy", "mode", "prompts"]
    if refiner:
        header += ["format-valid", "citations valid", "cites distractor", "supporting cited", "judge score"]
    header += ["reward", "stopped", "pass@1", "pass@k", *(name for name, _, _ in extra)]
    rows = []
    for s in summary:
        cells = [str(s["step"]), s["phase"], s["mode"], str(s["prompts"])]
        if refiner:
            cells += [
                answer_cell(s["format_valid"], True),
                answer_cell(s["citation_valid"], True),
                answer_cell(s.get("cites_distractor"), True),
                answer_cell(s.get("supporting_recall"), True),
                "-" if s["judge_score"] is None else f"{s['judge_score']:.3f}",
            ]
        cells += [
            "-" if s["reward"] is None else f"{s['reward']:.2f}",
            answer_cell(s.get("stopped"), True),
            answer_cell(s["pass_at_1"], True),
            "-" if s["pass_at_k"] is None else f"{s['pass_at_k']:.0%} (k={s['k']})",
            *(answer_cell(s.get(key), rate) for _, key, rate in extra),
        ]
        rows.append(cells)
    return header, rows


def format_table(summary: list[dict]) -> str:
    """The held-out table as fixed-width text (the eval stage's log)."""
    header, rows = eval_table(summary)
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in [header, *rows])


def markdown_table(summary: list[dict]) -> str:
    """The held-out table in markdown (model cards)."""
    header, rows = eval_table(summary)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


# Verifiers whose labels come from rollouts an evaluation does not sample: Co-rewarding-II's EMA teacher answers the
# step's training prompts only, so a held-out answer has no label and no reward (NULL; its `correct` against the
# ground truth, where the row has one, is the held-out figure), not the 0 of an empty label.
LABELLED_BY_ROLLOUTS_NOT_EVALUATED = ("co_rewarding_teacher",)


def score_responses(
    responses: list[dict],
    prompts_by_id: dict[str, dict],
    rubrics_by_prompt: dict[str, list[dict]],
    judge,
    weights,
    on_failure: str,
    max_response_chars: int,
    *,
    run: str,
    step: int,
    phase: str,
    policy: dict,
    pass_rubric_score: float,
) -> list[dict]:
    """Score eval responses with the training reward code and return `evals` rows. Modes are scored apart: a
    greedy and a sampled response can share a sample index."""
    from refiner_core.reward.ground_truth import answer_text, last_boxed
    from refiner_core.reward.score import score_rollouts
    from refiner_core.schema import EVALS

    rows = []
    for mode in MODES:
        batch = [
            {**r, "run": run, "step": step, "policy": policy["path"], "policy_hash": policy["hash"]}
            for r in responses
            if r["mode"] == mode
        ]
        if not batch:
            continue
        scored = score_rollouts(
            batch,
            prompts_by_id,
            rubrics_by_prompt,
            judge,
            weights,
            on_failure,
            max_response_chars,
            batch[0]["max_new_tokens"],
        )
        by_key = {(w["prompt_id"], w["sample_idx"]): w for w in scored.rewards}
        for r in batch:
            parts = by_key[(r["prompt_id"], r["sample_idx"])]
            row = {
                "run": run,
                "step": step,
                "phase": phase,
                "mode": mode,
                "prompt_id": r["prompt_id"],
                "sample_idx": r["sample_idx"],
                "policy": policy["path"],
                "policy_hash": policy["hash"],
                "temperature": r["temperature"],
                "response_text": r["response_text"],
                "response_tokens": r["response_tokens"],
                # an answer whose judgments failed (dropped) neither passes nor fails, as the summary counts it
                "passed": None if parts.get("dropped") else passed(parts, pass_rubric_score),
                "pass_rubric_score": pass_rubric_score,
                "boxed": None if parts["verifier"] == "judge" else last_boxed(answer_text(r)) is not None,
                **{name: r.get(name) for name in AGENT_COLUMNS},
            }
            row.update({name: parts[name] for name in EVALS.column_names if name not in row})
            if weights.verifier in LABELLED_BY_ROLLOUTS_NOT_EVALUATED:
                row["reward"] = None
            rows.append(row)
    return rows
