"""What the main job's GRPO steps add beyond SFT, measured against the noise of the held-out eval.

Runs the main job (recipes/refiner-smollm2.yaml) once per seed into its own folder (a finished folder is `Cached`
and costs seconds) and compares, on the held-out prompts answered greedily, the SFT checkpoint (step 0) with the
policy after each evaluated GRPO step:

- per seed: the share of answers that cite a distractor snippet (one the row's supporting_ids leaves out), the
  share of supporting snippets cited and the citations per answer (citing less is another way to avoid
  distractors), format validity and pass@1, and an exact McNemar test over the prompts (b = prompts whose answer
  stopped citing a distractor, c = prompts whose answer started to; p = two-sided binomial tail of min(b, c) in
  b + c at 1/2);
- over the seeds: the margin on each (its spread), and the McNemar test with the prompts of every seed pooled.

The seed changes everything a run draws: the held-out split, SFT's shuffling, GRPO's sampling.

    .venv/bin/python bench/main_margin.py [--seeds 42 7] [--runs-root runs/main-margin] [--set K=V ...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RECIPE = REPO / "recipes" / "refiner-smollm2.yaml"

from refiner_core.eval.stats import mcnemar_p  # noqa: E402  (after the repository is on sys.path)

COLUMNS = "cites_distractor, supporting_recall, n_citations, format_ok, passed"


def greedy_evals(run_dir: Path, columns: str = COLUMNS) -> dict[tuple[str, int], dict[str, dict]]:
    """{(phase, step): {prompt_id: eval row}} of the run's greedy answers, with these evals columns."""
    from refiner_core.store.storage import query

    names, rows = query(
        run_dir / "catalog.duckdb", f"SELECT phase, step, prompt_id, {columns} FROM evals WHERE mode = 'greedy'"
    )
    out: dict[tuple[str, int], dict[str, dict]] = {}
    for row in rows:
        r = dict(zip(names, row))
        out.setdefault((r["phase"], r["step"]), {})[r["prompt_id"]] = r
    return out


def compare(sft: dict[str, dict], grpo: dict[str, dict]) -> dict:
    """Rates before and after over the prompts both answered; the distractor rates and the discordant prompts
    over those both answered with an answer block (cites_distractor is NULL without one: such a pair says nothing
    of distractors)."""
    prompts = sorted(set(sft) & set(grpo))
    labelled = [
        p for p in prompts if sft[p]["cites_distractor"] is not None and grpo[p]["cites_distractor"] is not None
    ]
    before = [bool(sft[p]["cites_distractor"]) for p in labelled]
    after = [bool(grpo[p]["cites_distractor"]) for p in labelled]

    def mean(rows: dict[str, dict], key: str) -> float:
        return sum(rows[p][key] for p in labelled) / max(len(labelled), 1)

    def rate(rows: dict[str, dict], key: str) -> float:
        return sum(bool(rows[p][key]) for p in prompts) / len(prompts)

    return {
        "prompts": len(prompts),
        "labelled": len(labelled),
        "distractor_before": sum(before) / max(len(labelled), 1),
        "distractor_after": sum(after) / max(len(labelled), 1),
        "recall_before": mean(sft, "supporting_recall"),
        "recall_after": mean(grpo, "supporting_recall"),
        "citations_before": mean(sft, "n_citations"),
        "citations_after": mean(grpo, "n_citations"),
        "format_before": rate(sft, "format_ok"),
        "format_after": rate(grpo, "format_ok"),
        "pass_before": rate(sft, "passed"),
        "pass_after": rate(grpo, "passed"),
        "fixed": sum(b and not a for b, a in zip(before, after)),
        "broken": sum(a and not b for b, a in zip(before, after)),
    }


def run_recipe(recipe: Path, run_dir: Path, seed: int, extra: list[str]) -> float:
    """`refiner run RECIPE` into run_dir with run.seed and the extra --set assignments; its wall seconds."""
    cmd = [
        sys.executable,
        "-m",
        "flows.cli",
        "run",
        str(recipe),
        "--run-dir",
        str(run_dir),
        "--set",
        f"run.seed={seed}",
    ]
    for assignment in extra:
        cmd += ["--set", assignment]
    start = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[42, 7])
    ap.add_argument("--runs-root", type=Path, default=REPO / "runs" / "main-margin")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V", help="recipe override")
    args = ap.parse_args()

    per_seed, seconds = {}, {}
    for seed in args.seeds:
        run_dir = args.runs_root / f"seed-{seed}"
        seconds[seed] = run_recipe(RECIPE, run_dir, seed, args.overrides)
        evals = greedy_evals(run_dir)
        sft = evals[("sft", 0)]
        per_seed[seed] = {step: compare(sft, rows) for (phase, step), rows in sorted(evals.items()) if phase == "grpo"}

    print(f"\nheld-out greedy answers, SFT checkpoint (step 0) against each GRPO step; recipe {RECIPE.name}")
    header = (
        "seed  step  prompts  labelled  cites distractor  supporting cited  citations    format-valid  pass@1     "
        "fixed/broken  McNemar p  wall s"
    )
    print(header)
    for seed, steps in per_seed.items():
        for step, c in steps.items():
            print(
                f"{seed:<4}  {step:<4}  {c['prompts']:<7}  {c['labelled']:<8}  "
                f"{c['distractor_before']:>4.0%} -> {c['distractor_after']:<4.0%}    "
                f"{c['recall_before']:>4.0%} -> {c['recall_after']:<4.0%}    "
                f"{c['citations_before']:>3.1f} -> {c['citations_after']:<4.1f}  "
                f"{c['format_before']:>4.0%} -> {c['format_after']:<4.0%}  "
                f"{c['pass_before']:>3.0%} -> {c['pass_after']:<4.0%}  "
                f"{c['fixed']:>2} / {c['broken']:<2}       {mcnemar_p(c['fixed'], c['broken']):<9.3g}  "
                f"{seconds[seed]:.0f}"
            )
    last = {seed: steps[max(steps)] for seed, steps in per_seed.items()}
    margins = [c["distractor_before"] - c["distractor_after"] for c in last.values()]
    fixed, broken = sum(c["fixed"] for c in last.values()), sum(c["broken"] for c in last.values())
    print(
        f"\nlast step, {len(margins)} seeds: distractor citations down by "
        + ", ".join(f"{m:.0%}" for m in margins)
        + f" points (mean {sum(margins) / len(margins):.1%}, spread {min(margins):.0%} to {max(margins):.0%}); "
        f"pooled over {sum(c['labelled'] for c in last.values())} labelled prompt evaluations: "
        f"{fixed} fixed, {broken} broken, "
        f"exact McNemar p = {mcnemar_p(fixed, broken):.3g}"
    )


if __name__ == "__main__":
    main()
