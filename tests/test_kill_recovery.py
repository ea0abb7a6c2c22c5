"""A run killed (no cleanup, like SIGKILL) in every stage, at its start, mid-write and after its outputs are in
place, then rerun each time: the finished run's tables equal an uninterrupted run's row for row."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, catalog_rows, run_cli

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
KEYS = {
    "prompts": "prompt_id",
    "rubrics": "prompt_id, rubric_id",
    "rollouts": "step, prompt_id, sample_idx",
    "judge_scores": "step, prompt_id, sample_idx, rubric_id",
    "reward_inputs": "step, prompt_id, sample_idx",
    "rewards": "step, prompt_id, sample_idx, reward_version",
    "advantages": "step, prompt_id, sample_idx, reward_version",
    "steps": "step",
}
SAME_VALUES = {  # columns that do not name the run, its folder or a time
    "prompts": "prompt_id, split, prompt_token_ids",
    "rollouts": "step, prompt_id, sample_idx, policy_hash, response_token_ids, response_logprobs",
    "judge_scores": "step, prompt_id, sample_idx, rubric_id, raw_output, score",
    "rewards": "step, prompt_id, sample_idx, reward_version, reward",
    "steps": "step, reward_mean, response_tokens",
}


def _api_env() -> dict:
    from prefect.settings import PREFECT_API_URL

    return {"PREFECT_API_URL": PREFECT_API_URL.value()}  # the session's server: no start-up per invocation


def _values(run_dir, table: str, columns: str) -> list[tuple]:
    return catalog_rows(run_dir, f"SELECT {columns} FROM {table} ORDER BY {KEYS[table]}")


@pytest.mark.slow
def test_kills_in_every_stage_then_reruns_equal_an_uninterrupted_run(prefect_server, tmp_path):
    recipe = str(REPO / "recipes" / "tiny.yaml")
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    code, _, err, _ = run_cli(["run", recipe, "--run-dir", str(reference)], tmp_path, _api_env())
    assert code == 0, err[-3000:]

    env = {**_api_env(), "REFINER_KILL_ONCE": ",".join(KILLS)}
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
