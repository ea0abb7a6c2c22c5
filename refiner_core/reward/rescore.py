"""Rescoring: new reward weights over a finished run's stored judgments, with no judge call.

Every reward version is REWARD_SQL over the same reward_inputs and judge_scores; only reward_weights differ.
A version lands beside training's ('train') under RUN_DIR/rescores/<version>/step=N/ and in the catalog, so
`SELECT ... GROUP BY reward_version` compares them. Settings that would need new judgments (judge.*, a citation
score whose claims were never judged, another verifier) are refused with the list of what would be re-judged.
Each version records, per step, a hash of the rows it was computed from (table rescores): when a later run of the
folder changes a step's judgments, the catalog's step_rewards marks the version stale there and `refiner sql` /
`refiner show` say which command brings it up to date.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

import duckdb

from refiner_core.algo.advantages import group_advantages
from refiner_core.config import RecipeConfig, RewardConfig, dotted_settings
from refiner_core.reward.compose import STEP_INPUTS_HASH_SQL, compute_rewards, reward_parts, weight_row
from refiner_core.schema import ADVANTAGES, JUDGE_SCORES, RESCORES, REWARD_INPUTS, REWARD_WEIGHTS, REWARDS, duckdb_ddl
from refiner_core.store.forks import read_fork
from refiner_core.store.storage import (
    folder_name_problem,
    insert_parquet,
    json_hash,
    query,
    read_rows,
    replace_version_rows,
    write_table,
)

RESCORABLE_GRPO = ("advantage", "advantage_eps", "advantage_std_ddof", "reward_aggregation", "filter_zero_std_groups")
RESCORABLE_JUDGE = ("on_failure",)
NEEDS_JUDGE_REWARD = ("verifier", "final_answer")  # they make the verdicts, not the weights


class RescoreError(ValueError):
    """The requested change cannot be made from stored judgments."""


@dataclass
class StepRescore:
    step: int
    rollouts: int
    train_reward_mean: float
    reward_mean: float
    changed: int  # rollouts whose reward differs from training's


def changed_settings(base: RecipeConfig, new: RecipeConfig) -> list[str]:
    """Dotted names of the settings that differ (a nested section's fields by their own: judge.openai.base_url)."""
    a, b = dotted_settings(base), dotted_settings(new)
    return sorted(name for name in b if a.get(name) != b[name])


def check_rescorable(base: RecipeConfig, new: RecipeConfig, judged_pairs: int, steps_without_claims: list[int]) -> None:
    """Refuse changes that stored judgments cannot answer, saying what would have to be judged again."""
    changed = changed_settings(base, new)
    allowed = (
        {f"reward.{n}" for n in RewardConfig.__dataclass_fields__ if n not in NEEDS_JUDGE_REWARD}
        | {f"grpo.{n}" for n in RESCORABLE_GRPO}
        | {f"judge.{n}" for n in RESCORABLE_JUDGE}
        | {"run.name"}
    )
    if not [c for c in changed if c != "run.name"]:
        raise RescoreError(
            "no --set changes a setting of the run: rescoring would repeat its rewards; give new values of "
            f"reward.*, {', '.join('grpo.' + n for n in RESCORABLE_GRPO)} or judge.on_failure"
        )
    problems = []
    judge = [c for c in changed if c.startswith("judge.") and c not in allowed]
    if judge:
        problems.append(
            f"{', '.join(judge)} {'changes' if len(judge) == 1 else 'change'} the judgments themselves: "
            f"{judged_pairs} (rollout, rubric) "
            "pairs would be re-judged; run the pipeline with these settings instead (`refiner run`)."
        )
    if "judge.on_failure" in changed and new.judge.on_failure == "fail":
        problems.append(
            "judge.on_failure='fail' stops a judge stage at its first failed judgment; a rescore judges nothing, "
            "so it has nothing to stop: choose zero, skip or drop (the stored failures are in judge_scores.failure)."
        )
    verifier = [c for c in changed if c.startswith("reward.") and c not in allowed]
    if verifier:
        problems.append(f"{', '.join(verifier)} changes how rollouts are verified; run the pipeline instead.")
    if new.reward.citation_score != "valid_ids" and steps_without_claims:
        problems.append(
            f"reward.citation_score={new.reward.citation_score!r} needs claim judgments that steps "
            f"{steps_without_claims} do not have (they were scored with 'valid_ids'); run the pipeline "
            "with it instead."
        )
    other = [
        c
        for c in changed
        if c.split(".")[0] not in ("reward", "grpo", "judge", "run")
        or (c.startswith("grpo.") and c not in allowed)
        or (c.startswith("run.") and c not in allowed)
    ]
    if other:
        problems.append(
            f"{', '.join(other)} would change training, not its rewards: rescoring only changes "
            f"reward.*, {', '.join('grpo.' + n for n in RESCORABLE_GRPO)} and judge.on_failure."
        )
    if problems:
        raise RescoreError("\n".join(problems))


def version_name(new: RecipeConfig) -> str:
    """A name derived from the settings a version is computed with, so the same settings give the same name."""
    grpo = {n: getattr(new.grpo, n) for n in RESCORABLE_GRPO}
    return "v-" + json_hash([new.to_dict()["reward"], new.judge.on_failure, grpo])[:8]


def version_settings(run_dir: Path, version: str) -> str | None:
    """The `--set` flags reward version `version` of the run was computed with (None: no such version)."""
    recorded = sorted((run_dir / "rescores" / version).glob("step=*/rescores.parquet"))
    return read_rows(recorded[0])[0]["settings"] if recorded else None


def settings_flags(base: RecipeConfig, new: RecipeConfig) -> str:
    """The `--set` flags that turn the run's recipe into `new`, as one shell-quoted line."""
    values, flags = dotted_settings(new), []
    for setting in changed_settings(base, new):
        value = values[setting]
        flags += ["--set", f"{setting}={value if isinstance(value, str) else json.dumps(value)}"]
    return shlex.join(flags)


def inputs_hash(score_dir: Path, run: str | None = None) -> str:
    """STEP_INPUTS_HASH_SQL over one step's stored reward_inputs and judge_scores, loaded into the catalog's table
    types (with `run` as their run, as a fork's catalog names them), so that it equals what the catalog computes
    from the same rows."""
    con = duckdb.connect()
    try:
        for table in (REWARD_INPUTS, JUDGE_SCORES):
            con.execute(duckdb_ddl(table))
            insert_parquet(con, table.name, round_files(score_dir, table.name), run)
        [(digest,)] = con.execute(f"SELECT inputs_hash FROM ({STEP_INPUTS_HASH_SQL})").fetchall()
        return digest
    finally:
        con.close()


def round_files(score_dir: Path, name: str) -> list[Path]:
    """A step's `name` files: its first sampling round's, then those of later rounds (rollout.dynamic_sampling)."""
    later = sorted(score_dir.glob(f"round=*/{name}.parquet"), key=lambda p: int(p.parent.name.split("=")[1]))
    return [score_dir / f"{name}.parquet", *later]


def read_step(score_dir: Path, name: str) -> list[dict]:
    return [row for path in round_files(score_dir, name) for row in read_rows(path)]


def _claims_judged(score_dir: Path) -> bool:
    """Whether a step's claims were judged: it was scored with a claim-level citation score (reward.citation_score
    f1 or dr_tulu), whether or not any answer held a claim; 'valid_ids' judges none."""
    kinds = {r["citation_score_kind"] for r in read_step(score_dir, "reward_weights")}
    return bool(kinds) and "valid_ids" not in kinds


def scored_steps(run_dir: Path, steps: int) -> list[int]:
    """Steps of a run of `steps` steps whose judge stage finished (their reward inputs exist), in order; the
    folder's later steps, left by a longer earlier run, are not the run's."""
    found = [int(p.parent.name.split("=")[1]) for p in run_dir.glob("scores/step=*/reward_inputs.parquet")]
    return sorted(step for step in found if step < steps)


def _with_trained_kl(rewards: list[dict], run_dir: Path, step: int) -> list[dict]:
    """Reward rows with the KL penalty training applied (grpo.kl_reward_coef: each response's reward_kl and the
    step's kl_coef, read from the step's training advantages), so the new advantages read the same penalty. A step
    whose update did not run, or a run without the KL in its reward, has none (advantages.reward_kl NULL)."""
    trained = run_dir / "metrics" / f"step={step}" / "advantages.parquet"
    kl = {(a["prompt_id"], a["sample_idx"]): a for a in read_rows(trained)} if trained.exists() else {}
    if not any(a.get("reward_kl") is not None for a in kl.values()):
        return rewards
    keyed = [kl.get((r["prompt_id"], r["sample_idx"]), {}) for r in rewards]
    return [{**r, "reward_kl": a.get("reward_kl"), "kl_coef": a.get("kl_coef")} for r, a in zip(rewards, keyed)]


def rescore_run(
    run_dir: Path, base: RecipeConfig, new: RecipeConfig, version: str | None = None
) -> tuple[str, list[StepRescore]]:
    """Write reward version `version` (default: derived from the settings) for every scored step."""
    if version is not None and (problem := folder_name_problem(version, "--name")):
        raise RescoreError(problem)
    steps = scored_steps(run_dir, base.grpo.steps)
    if not steps:
        raise RescoreError(f"{run_dir} has no scored step (no scores/step=*/reward_inputs.parquet)")
    score_files = {s: run_dir / "scores" / f"step={s}" for s in steps}
    without_claims = [s for s in steps if not _claims_judged(score_files[s])]
    pairs = sum(len(read_step(score_files[s], "judge_scores")) for s in steps)
    check_rescorable(base, new, pairs, without_claims)
    version = version or version_name(new)
    if version == "train":
        raise RescoreError("'train' is the version training used; choose another name")
    settings = settings_flags(base, new)
    out_root, summary = run_dir / "rescores" / version, []

    written: dict[str, list[str]] = {"rewards": [], "reward_weights": [], "advantages": [], "rescores": []}
    fork = read_fork(run_dir)  # a fork's catalog names every row after the fork, its parent's steps included
    for step in steps:
        inputs = read_step(score_files[step], "reward_inputs")
        scores = read_step(score_files[step], "judge_scores")
        if fork is not None:
            inputs = [{**r, "run": fork.run} for r in inputs]
            scores = [{**r, "run": fork.run} for r in scores]
        trained = {
            (r["prompt_id"], r["sample_idx"]): r["reward"]
            for r in read_step(score_files[step], "rewards")
            if r["reward_version"] == "train"
        }
        run = inputs[0]["run"] if inputs else new.run.name
        weights = [weight_row(run, step, version, new.reward, new.judge.on_failure)]
        rewards = compute_rewards(inputs, scores, weights)
        advantages, _ = group_advantages(_with_trained_kl(rewards, run_dir, step), new.grpo, reward_parts)
        advantage_rows = [{"run": run, "step": step, "reward_version": version, **a} for a in advantages]
        source = [
            {
                "run": run,
                "step": step,
                "reward_version": version,
                "settings": settings,
                "inputs_hash": inputs_hash(score_files[step], fork.run if fork else None),
            }
        ]
        out = out_root / f"step={step}"
        for name, table, rows in (
            ("rewards", REWARDS, rewards),
            ("reward_weights", REWARD_WEIGHTS, weights),
            ("advantages", ADVANTAGES, advantage_rows),
            ("rescores", RESCORES, source),
        ):
            write_table(table, rows, out / f"{name}.parquet")
            written[name].append(str(out / f"{name}.parquet"))
        changed = sum(
            1
            for r in rewards
            if (key := (r["prompt_id"], r["sample_idx"])) not in trained or abs(r["reward"] - trained[key]) > 1e-12
        )
        summary.append(
            StepRescore(
                step,
                len(rewards),
                sum(trained.values()) / max(len(trained), 1),
                sum(r["reward"] for r in rewards) / max(len(rewards), 1),
                changed,
            )
        )
    catalog = run_dir / "catalog.duckdb"
    if catalog.exists():
        replace_version_rows(catalog, written, version)
    return version, summary


def stale_rescore_warnings(run_dirs: list[Path]) -> list[str]:
    """One line per rescore version that a later run made stale (its steps' judgments changed), with the command
    that recomputes it. Opens each catalog on its own: call it while no other connection to them is open. Missing
    catalogs, and catalogs from before step_rewards.stale, give none."""
    warnings = []
    for run_dir in run_dirs:
        db = run_dir if run_dir.suffix == ".duckdb" else run_dir / "catalog.duckdb"
        if not db.exists():
            continue
        try:
            _, stale = query(
                db,
                "SELECT s.reward_version, list(s.step ORDER BY s.step), any_value(v.settings) "
                "FROM step_rewards s JOIN rescores v USING (run, step, reward_version) "
                "WHERE s.stale GROUP BY ALL ORDER BY 1",
            )
        except (duckdb.CatalogException, duckdb.BinderException):  # no rescores table, or no stale column
            continue
        for version, steps, settings in stale:
            command = " ".join(
                filter(None, [shlex.join(["refiner", "rescore", str(db.parent), "--name", version]), settings])
            )
            warnings.append(
                f"rescore version {version} is stale for {_step_ranges(steps)} (a later run changed "
                f"their judgments): rerun `{command}`"
            )
    return warnings


def _step_ranges(steps: list[int]) -> str:
    """[1, 2, 3, 5] -> 'steps 1-3, 5'; [4] -> 'step 4'."""
    ranges: list[list[int]] = []
    for step in steps:
        if ranges and step == ranges[-1][1] + 1:
            ranges[-1][1] = step
        else:
            ranges.append([step, step])
    text = ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in ranges)
    return f"step{'s' if len(steps) > 1 else ''} {text}"
