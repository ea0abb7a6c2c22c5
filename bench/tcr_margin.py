"""What GRPO-TCR adds beyond the SFT cold start, measured against the noise of the held-out eval.

Runs recipes/tcr-smollm2.yaml (cold start, then GRPO-TCR) once per seed into its own folder (a finished folder is
`Cached` and costs seconds) and compares, on the held-out questions answered greedily with the agent loop, the
cold-start checkpoint (step 0) with the policy after each evaluated GRPO step:

- per seed: accuracy, the share answered in a \\boxed{}, the share that called the tool, the share of calls that
  were well formed, turns and tokens per answer (the base model's tool-call rate beside them); an exact McNemar
  test over the questions on accuracy (b = questions the GRPO policy answers right and the cold start wrong,
  c = the reverse) and on the tool-call rate (b = started calling the tool, c = stopped);
- over the seeds, at the last step: the margins and both McNemar tests with the questions of every seed pooled.

The seed changes everything a run draws: the held-out split, the cold start's order, GRPO's samples.

    .venv/bin/python bench/tcr_margin.py [--seeds 42 7] [--runs-root runs/tcr-margin] [--set K=V ...] [--reuse]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.main_margin import greedy_evals, run_recipe  # noqa: E402  (after the repository is on sys.path)
from refiner_core.eval.stats import mcnemar_p  # noqa: E402

RECIPE = REPO / "recipes" / "tcr-smollm2.yaml"
COLUMNS = "passed, boxed, tool_calls, well_formed_calls, turns, response_tokens"


def compare(before: dict[str, dict], after: dict[str, dict]) -> dict:
    """Rates before and after over the questions both answered, and the discordant questions of accuracy and of
    calling the tool."""
    prompts = sorted(set(before) & set(after))
    right = [(bool(before[p]["passed"]), bool(after[p]["passed"])) for p in prompts]
    called = [(before[p]["tool_calls"] > 0, after[p]["tool_calls"] > 0) for p in prompts]

    def rate(rows: dict[str, dict], test) -> float:
        return sum(bool(test(rows[p])) for p in prompts) / max(len(prompts), 1)

    def well_formed(rows: dict[str, dict]) -> float | None:
        calls = sum(rows[p]["tool_calls"] for p in prompts)
        return sum(rows[p]["well_formed_calls"] for p in prompts) / calls if calls else None

    out = {"prompts": len(prompts)}
    for name, rows in (("before", before), ("after", after)):
        out[f"accuracy_{name}"] = rate(rows, lambda r: r["passed"])
        out[f"boxed_{name}"] = rate(rows, lambda r: r["boxed"])
        out[f"called_{name}"] = rate(rows, lambda r: r["tool_calls"] > 0)
        out[f"well_formed_{name}"] = well_formed(rows)
        out[f"turns_{name}"] = sum(rows[p]["turns"] for p in prompts) / max(len(prompts), 1)
        out[f"tokens_{name}"] = sum(rows[p]["response_tokens"] for p in prompts) / max(len(prompts), 1)
    out["right_gained"] = sum(a and not b for b, a in right)
    out["right_lost"] = sum(b and not a for b, a in right)
    out["calls_gained"] = sum(a and not b for b, a in called)
    out["calls_lost"] = sum(b and not a for b, a in called)
    return out


def _pct(value: float | None) -> str:
    return "  -" if value is None else f"{value:>3.0%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[42, 7])
    ap.add_argument("--runs-root", type=Path, default=REPO / "runs" / "tcr-margin")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V", help="recipe override")
    ap.add_argument(
        "--reuse", action="store_true", help="read finished run folders as they are, without running the recipe"
    )
    args = ap.parse_args()

    per_seed, seconds, base_called = {}, {}, {}
    for seed in args.seeds:
        run_dir = args.runs_root / f"seed-{seed}"
        reuse = args.reuse and (run_dir / "catalog.duckdb").is_file()
        seconds[seed] = float("nan") if reuse else run_recipe(RECIPE, run_dir, seed, args.overrides)
        evals = greedy_evals(run_dir, COLUMNS)
        cold = evals[("sft", 0)]
        base = evals.get(("base", 0), {})
        base_called[seed] = sum(r["tool_calls"] > 0 for r in base.values()) / max(len(base), 1) if base else None
        per_seed[seed] = {step: compare(cold, rows) for (phase, step), rows in sorted(evals.items()) if phase == "grpo"}

    print(f"\nheld-out greedy conversations, cold start (step 0) against each GRPO step; recipe {RECIPE.name}")
    print(
        "seed  step  questions  base calls  accuracy     boxed        calls tool   well-formed  turns       "
        "tokens        right +/-  McNemar p  calls +/-  McNemar p  wall s"
    )
    for seed, steps in per_seed.items():
        for step, c in steps.items():
            p_right = mcnemar_p(c["right_gained"], c["right_lost"])
            p_calls = mcnemar_p(c["calls_gained"], c["calls_lost"])
            print(
                f"{seed:<4}  {step:<4}  {c['prompts']:<9}  {_pct(base_called[seed]):<10}  "
                f"{_pct(c['accuracy_before'])} -> {_pct(c['accuracy_after'])}  "
                f"{_pct(c['boxed_before'])} -> {_pct(c['boxed_after'])}  "
                f"{_pct(c['called_before'])} -> {_pct(c['called_after'])}  "
                f"{_pct(c['well_formed_before'])} -> {_pct(c['well_formed_after'])}  "
                f"{c['turns_before']:.2f} -> {c['turns_after']:.2f}  "
                f"{c['tokens_before']:>4.0f} -> {c['tokens_after']:<4.0f}  "
                f"{c['right_gained']:>3} / {c['right_lost']:<3}  {p_right:<9.3g}  "
                f"{c['calls_gained']:>3} / {c['calls_lost']:<3}  {p_calls:<9.3g}  "
                f"{seconds[seed]:.0f}"
            )
    last = {seed: steps[max(steps)] for seed, steps in per_seed.items() if steps}
    margins = [c["accuracy_after"] - c["accuracy_before"] for c in last.values()]
    gained, lost = sum(c["right_gained"] for c in last.values()), sum(c["right_lost"] for c in last.values())
    started, stopped = sum(c["calls_gained"] for c in last.values()), sum(c["calls_lost"] for c in last.values())
    print(
        f"\nlast step, {len(margins)} seeds: accuracy moved by "
        + ", ".join(f"{m:+.0%}" for m in margins)
        + f" points; pooled over {sum(c['prompts'] for c in last.values())} held-out questions: "
        f"{gained} right only after GRPO, {lost} only before, exact McNemar p = {mcnemar_p(gained, lost):.3g}; "
        f"tool calls started on {started}, stopped on {stopped}, p = {mcnemar_p(started, stopped):.3g}"
    )


if __name__ == "__main__":
    main()
