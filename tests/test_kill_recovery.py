"""A run killed (no cleanup, like SIGKILL) in every stage, at its start, mid-write and after its outputs are in
place, then rerun each time: the finished run's tables equal an uninterrupted run's row for row."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, RUN_TABLES, catalog_rows, run_cli, table_key

# In pipeline order; each fires once per run folder, so the run needs len(KILLS) + 1 invocations.
KILLS = [
    "write:step=0/rollouts.parquet",  # rollout: the Parquet file written, not yet renamed into place
    "judge@0:end",  # judge: every output in place, the task not yet recorded as done
    "write:checkpoints/step_0001",  # checkpoint: the folder written, not yet renamed into place
    "write:catalog.duckdb",  # catalog publish: the new database built, not yet in place
    "rollout@1",  # rollout: at its start
    "write:step=1/reward_inputs.parquet",  # judge: two of its five tables in place, the third mid-write
    "grpo-update@1:end",  # update: checkpoint and metrics in place, not recorded
]
KEYS = {table: table_key(table) for table in RUN_TABLES}  # table -> its key, to compare rows in order
SAME_VALUES = {  # columns that do not name the run, its folder or a time
    "prompts": "prompt_id, split, prompt_token_ids",
    "rollouts": "step, prompt_id, sample_idx, policy_hash, response_token_ids, response_logprobs",
    "judge_scores": "step, prompt_id, sample_idx, rubric_id, raw_output, score",
    "rewards": "step, prompt_id, sample_idx, reward_version, reward",
    "steps": "step, reward_mean, response_tokens",
}


def _values(run_dir, table: str, columns: str) -> list[tuple]:
    return catalog_rows(run_dir, f"SELECT {columns} FROM {table} ORDER BY {KEYS[table]}")


@pytest.mark.slow
def test_kills_in_every_stage_then_reruns_equal_an_uninterrupted_run(api_env, tmp_path):
    recipe = str(REPO / "recipes" / "tiny.yaml")
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    code, _, err, _ = run_cli(["run", recipe, "--run-dir", str(reference)], tmp_path, api_env)
    assert code == 0, err[-3000:]

    env = {**api_env, "REFINER_KILL_ONCE": ",".join(KILLS)}
    codes, logs = [], []
    for _ in range(len(KILLS) + 1):
        code, out, err, _ = run_cli(["run", recipe, "--run-dir", str(killed)], tmp_path, env)
        codes.append(code)
        logs.append(out + err)
        if code == 0:
            break
    assert codes == [137] * len(KILLS) + [0], logs[-1][-3000:]
    assert sorted(p.name for p in (killed / ".faults").iterdir()) == sorted(
        f"kill-{k}" for k in KILLS if not k.startswith("write:")
    )
    # the writers killed mid-write left hidden temporary files; the next run removed them
    assert sum("unfinished write(s) left by an earlier run" in log for log in logs) == 4
    assert not [p for p in killed.rglob("*.partial*")]

    for table, key in KEYS.items():
        assert catalog_rows(killed, f"SELECT count(*) = count(DISTINCT ({key})) FROM {table}") == [(True,)], table
        count = f"SELECT count(*) FROM {table}"
        assert catalog_rows(killed, count) == catalog_rows(reference, count), table
    for table, columns in SAME_VALUES.items():  # reruns reproduce what the killed runs had started
        assert _values(killed, table, columns) == _values(reference, table, columns), table

    policy, reference_policy = (
        load_file(str(d / "checkpoints" / "step_0002" / "model.safetensors")) for d in (killed, reference)
    )
    assert policy.keys() == reference_policy.keys()
    assert all(torch.allclose(policy[k], reference_policy[k], atol=1e-5) for k in policy)


# grpo.async_steps 1: the rollout of step N+1 runs beside the judge and update of step N. Killed at the update of
# step 1, at the start of the rollout of step 2 sampled ahead, after that rollout wrote the first of its two parts,
# and at the judge of step 2.
ASYNC_KILLS = ["grpo-update@1", "rollout@2", "rollout@2:part0", "judge@2"]
ASYNC = [
    "grpo.steps=3",
    "grpo.async_steps=1",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=2",
    "rollout.groups_per_part=2",
    "rollout.max_new_tokens=8",
    "run.progress_every=0.001",  # a part of 4 tiny sequences takes well over 1 ms, so each logs a progress line
]


def _example_commands(out: str) -> list[list[str]]:
    """The `refiner sql` commands a finished run printed, split as a shell splits them."""
    import shlex

    return [shlex.split(line) for line in out.splitlines() if line.startswith("  ") and " sql " in line]


@pytest.mark.slow
def test_async_runs_killed_beside_a_rollout_sampled_ahead_equal_an_uninterrupted_run(api_env, tmp_path):
    """Every kill is followed by a rerun; the tables, reward sum and final weights equal an uninterrupted run's, and
    the rollout killed after its first part samples only the second. The uninterrupted run also shows what a user
    sees on a first run in a fresh home, logging to a file: progress lines, no Prefect warning, and example
    commands that can be copied although its folder's name holds a space and a quote."""
    import subprocess
    import sys

    recipe = str(REPO / "recipes" / "tiny.yaml")
    sets = [a for s in ASYNC for a in ("--set", s)]
    reference, killed = tmp_path / "uninterrupted run's", tmp_path / "killed"
    home = tmp_path / "fresh-home"
    home.mkdir()
    code, out, err, _ = run_cli(["run", recipe, "--run-dir", str(reference), *sets], tmp_path, {"HOME": str(home)})
    assert code == 0, err[-3000:]
    assert "memo_store" not in err and "Traceback" not in err and "leaked" not in err  # nanobind's exit report
    assert any(f"rollout step {s} part" in line and "seq/s" in line for s in range(3) for line in err.splitlines())
    commands = _example_commands(out)
    assert len(commands) == 2 and all(words[2] == str(reference) for words in commands)
    for words in commands:  # each runs as printed
        done = subprocess.run([sys.executable, "-m", "flows.cli", *words[1:]], cwd=REPO, capture_output=True)
        assert done.returncode == 0, done.stderr[-2000:]

    env = {**api_env, "REFINER_KILL_ONCE": ",".join(ASYNC_KILLS)}
    codes, logs = [], []
    for _ in range(len(ASYNC_KILLS) + 1):
        code, out, err, _ = run_cli(["run", recipe, "--run-dir", str(killed), *sets], tmp_path, env)
        codes.append(code)
        logs.append(out + err)
        if code == 0:
            break
    assert codes == [137] * len(ASYNC_KILLS) + [0], logs[-1][-3000:]
    assert sorted(p.name for p in (killed / ".faults").iterdir()) == sorted(f"kill-{k}" for k in ASYNC_KILLS)
    resumed = [log for log in logs if "rollout step 2: 1 of 2 parts (2 of 4 groups) were written by an earlier" in log]
    assert len(resumed) == 1  # the run after the kill between the parts sampled only the second part
    assert not list(killed.rglob(".parts-*"))  # every part is in its rollouts.parquet

    for table, key in KEYS.items():
        assert catalog_rows(killed, f"SELECT count(*) = count(DISTINCT ({key})) FROM {table}") == [(True,)], table
        count = f"SELECT count(*) FROM {table}"
        assert catalog_rows(killed, count) == catalog_rows(reference, count), table
    for table, columns in SAME_VALUES.items():
        assert _values(killed, table, columns) == _values(reference, table, columns), table
    reward_sum = "SELECT sum(reward) FROM rewards WHERE reward_version = 'train'"
    assert catalog_rows(killed, reward_sum) == catalog_rows(reference, reward_sum)
    lags = "SELECT step, policy_lag FROM steps ORDER BY step"
    assert catalog_rows(killed, lags) == catalog_rows(reference, lags) == [(0, 0), (1, 1), (2, 1)]
    policy, reference_policy = (
        load_file(str(d / "checkpoints" / "step_0003" / "model.safetensors")) for d in (killed, reference)
    )
    assert policy.keys() == reference_policy.keys()
    assert all(torch.allclose(policy[k], reference_policy[k], atol=1e-5) for k in policy)
