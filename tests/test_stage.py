"""Stage plumbing: cache keys from content, not timings or paths alone; damaged outputs are detected; progress
bars reach listeners; a write killed mid-way is never visible."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import REPO
from refiner_core.schema import JUDGE_SCORES, ROLLOUTS, STEPS
from refiner_core.store.storage import write_rows, write_table
from tasks.stage import damaged_outputs, stage_cache_key


def _key(params: dict) -> str:
    return stage_cache_key(SimpleNamespace(task=SimpleNamespace(name="judge")), params)


def test_key_ignores_timings_but_not_content(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"id": 1}\n')
    upstream = {"rollouts": {"path": "x.parquet", "hash": "abc"}, "seconds": 1.5}
    base = _key({"run_dir": "r", "data_file": str(data), "rollouts": upstream})
    assert _key({"run_dir": "r", "data_file": str(data), "rollouts": {**upstream, "seconds": 99.0}}) == base
    assert (
        _key(
            {
                "run_dir": "r",
                "data_file": str(data),
                "rollouts": {**upstream, "rollouts": {"path": "x.parquet", "hash": "abd"}},
            }
        )
        != base
    )
    data.write_text('{"id": 2}\n')  # same path, new content
    assert _key({"run_dir": "r", "data_file": str(data), "rollouts": upstream}) != base


def test_key_ignores_when_rollouts_were_written_and_how_long_their_weight_sync_took(tmp_path):
    """A rollout that reruns with the same samples (another rollout.groups_per_part, say) writes them with another
    created_at after another weight sync: the stages after it keep their keys. Other samples change them."""
    path = tmp_path / "rollouts.parquet"

    def rollout(written_at: datetime, logprob: float, sync_seconds: float) -> dict:
        rows = [
            {c: None for c in ROLLOUTS.column_names}
            | {"run": "r", "step": 0, "prompt_id": "q1", "sample_idx": s, "response_logprobs": [logprob]}
            | {"created_at": written_at}
            for s in range(2)
        ]
        written = write_rows(ROLLOUTS, rows, path)
        return {"rollouts": written, "rows": 2, "weight_sync_seconds": sync_seconds, "seconds": 1.0}

    first = rollout(datetime(2026, 1, 1, tzinfo=UTC), -0.5, 0.12)
    again = rollout(datetime(2026, 1, 2, tzinfo=UTC), -0.5, 0.31)
    assert again["rollouts"]["hash"] != first["rollouts"]["hash"]  # the file differs: damage checks still see it
    assert _key({"run_dir": "r", "rollouts": again}) == _key({"run_dir": "r", "rollouts": first})
    other = rollout(datetime(2026, 1, 1, tzinfo=UTC), -0.25, 0.12)
    assert _key({"run_dir": "r", "rollouts": other}) != _key({"run_dir": "r", "rollouts": first})


def test_key_ignores_how_judgments_were_obtained(tmp_path):
    """A judge stage recomputed with the same verdicts (from the judge cache, after other latencies and retries)
    leaves the update after it cached; another verdict changes its key."""

    def judged(latency: float, attempts: int, cache_hit: bool, tokens: int | None, score: float) -> dict:
        row = {c: None for c in JUDGE_SCORES.column_names} | {
            "run": "r",
            "step": 0,
            "prompt_id": "q1",
            "sample_idx": 0,
            "rubric_id": "pos-0",
            "raw_output": '{"score": 2}',
            "score": score,
        }
        row |= {"latency_seconds": latency, "attempts": attempts, "cache_hit": cache_hit, "prompt_tokens": tokens}
        path = tmp_path / "judge_scores.parquet"
        usage = {"requests": attempts, "prompt_tokens": tokens or 0, "completion_tokens": 0, "unknown": 0}
        return {"judge_scores": write_rows(JUDGE_SCORES, [row], path), "judge_failures": 0, "judge_usage": usage}

    first = judged(1.7, 2, False, 120, 1.0)
    again = judged(0.0, 0, True, None, 1.0)
    assert again["judge_scores"]["hash"] != first["judge_scores"]["hash"]
    assert _key({"run_dir": "r", "scores": [again]}) == _key({"run_dir": "r", "scores": [first]})
    assert _key({"run_dir": "r", "scores": [judged(1.7, 2, False, 120, 0.5)]}) != _key(
        {"run_dir": "r", "scores": [first]}
    )


def test_key_is_stable_across_processes(tmp_path):
    params = {"run_dir": "r", "step": 3, "cfg": {"lr": 1e-5, "stop": ["</answer>"]}}
    code = (
        "import sys, json; from types import SimpleNamespace; from tasks.stage import stage_cache_key; "
        "print(stage_cache_key(SimpleNamespace(task=SimpleNamespace(name='judge')), json.loads(sys.argv[1])))"
    )
    import json

    other = subprocess.run([sys.executable, "-c", code, json.dumps(params)], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == _key(params)


def test_damaged_outputs(tmp_path):
    path = tmp_path / "steps.parquet"
    row = {c: None for c in STEPS.column_names} | {"run": "r", "step": 0}
    manifest = {"steps": {"path": str(path), "hash": write_table(STEPS, [row], path)}, "rows": 1}
    assert damaged_outputs(manifest, str(tmp_path)) == []
    write_table(STEPS, [row | {"loss": 1.0}], path)  # edited after the stage wrote it
    assert damaged_outputs(manifest, str(tmp_path)) == [str(path)]
    path.unlink()
    assert damaged_outputs(manifest, str(tmp_path)) == [str(path)]


def test_pruned_checkpoints_and_dropped_optimizer_state_are_not_damage(tmp_path):
    from refiner_core.store.checkpoints import prune
    from refiner_core.store.storage import dir_hash

    manifests = []
    for step in (1, 2, 3):
        folder = tmp_path / "checkpoints" / f"step_{step:04d}"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(bytes([step]) * 8)
        (folder / "optimizer.pt").write_bytes(b"adam")
        manifests.append({"policy": {"path": str(folder), "hash": dir_hash(folder, ("optimizer.pt",))}})
    prune(tmp_path / "checkpoints", newest=3, keep_last=2, keep_every=0)
    assert not (tmp_path / "checkpoints" / "step_0001").exists()
    assert not (tmp_path / "checkpoints" / "step_0002" / "optimizer.pt").exists()
    assert all(damaged_outputs(m, str(tmp_path)) == [] for m in manifests)
    (tmp_path / "checkpoints" / "step_0002" / "model.safetensors").write_bytes(b"edited")
    assert damaged_outputs(manifests[1], str(tmp_path)) == [manifests[1]["policy"]["path"]]
    # a pruned checkpoint whose folder is there again (written anew with other weights) is checked, not trusted
    again = tmp_path / "checkpoints" / "step_0001"
    again.mkdir()
    (again / "model.safetensors").write_bytes(b"other weights")
    assert damaged_outputs(manifests[0], str(tmp_path)) == [manifests[0]["policy"]["path"]]


def test_bars_report_to_listeners_even_when_not_drawn():
    from refiner_core.runtime.progress import listening, progress_bar

    seen = []
    with listening(lambda bar: seen.append((bar.label, int(bar.done), bar.total, bar.closed_at is not None))):
        bar = progress_bar(5, "rollout step 0", "seq", disable=True)  # as off a terminal
        bar.update(2)
        bar.update(3)
        bar.close()
    progress_bar(1, "after", "seq", disable=True).update(1)  # nobody listens any more
    assert seen == [("rollout step 0", d, 5, closed) for d, closed in [(0, False), (2, False), (5, False), (5, True)]]


def test_a_write_killed_before_its_rename_leaves_only_a_hidden_partial_file(tmp_path):
    """REFINER_KILL_ONCE=write:PATH ends the writer between writing and renaming; the destination never appears
    half written, the leftover is removed by remove_partial_writes, and the fault fires once."""
    final = tmp_path / "scores" / "step=1" / "rewards.parquet"
    script = (
        "import sys; from pathlib import Path; from refiner_core.schema import STEPS; "
        "from refiner_core.store.storage import write_table; write_table(STEPS, [], Path(sys.argv[1]))"
    )
    env = {**os.environ, "REFINER_KILL_ONCE": "write:step=1/rewards.parquet"}
    first = subprocess.run([sys.executable, "-c", script, str(final)], env=env, cwd=REPO)
    assert first.returncode == 137 and not final.exists()
    [leftover] = final.parent.glob(".rewards.parquet.*.partial")
    assert leftover.stat().st_size > 0
    from refiner_core.store.storage import remove_partial_writes

    assert remove_partial_writes(tmp_path) == [leftover] and not leftover.exists()
    second = subprocess.run([sys.executable, "-c", script, str(final)], env=env, cwd=REPO)
    assert second.returncode == 0 and final.exists()  # fired once: its marker is beside the destination
    assert remove_partial_writes(tmp_path) == []


def _replace_folder(final: Path, env: dict) -> subprocess.CompletedProcess:
    script = (
        "import sys; from pathlib import Path; from refiner_core.store.storage import atomic_dir\n"
        "with atomic_dir(Path(sys.argv[1])) as build:\n"
        "    (build / 'weights').write_text('new')\n"
    )
    return subprocess.run([sys.executable, "-c", script, str(final)], env=env, cwd=REPO)


@pytest.mark.parametrize("point,left", [("step_0002", 1), ("step_0002.replacing", 2)])
def test_a_folder_replacement_killed_midway_leaves_the_old_or_the_new_folder(tmp_path, point, left):
    """A recomputed checkpoint replaces its folder: killed before the new folder is in place (point
    'step_0002') or with the old one moved aside ('step_0002.replacing'), the next run's clean-up finds the old
    folder where it was; run again, the new one replaces it and nothing is left beside it."""
    from refiner_core.store.storage import remove_partial_writes

    final = tmp_path / "checkpoints" / "step_0002"
    final.mkdir(parents=True)
    (final / "weights").write_text("old")
    env = {**os.environ, "REFINER_KILL_ONCE": f"write:{point}"}
    assert _replace_folder(final, env).returncode == 137
    assert len(remove_partial_writes(tmp_path)) == left  # the new folder's build (and the old one, put back)
    assert (final / "weights").read_text() == "old"
    assert _replace_folder(final, env).returncode == 0
    assert (final / "weights").read_text() == "new"
    assert sorted(p.name for p in final.parent.iterdir() if not p.name.startswith(".fault")) == ["step_0002"]


def test_outputs_take_the_mode_the_umask_allows(tmp_path):
    """Atomic writes go through temporary files (0600) and folders (0700); what they leave is readable as a plain
    open() or mkdir() would leave it."""
    script = (
        "import os, sys; from pathlib import Path; os.umask(0o022)\n"
        "from refiner_core.store.storage import atomic_dir, write_json\n"
        "write_json({'a': 1}, Path(sys.argv[1]) / 'manifest.json')\n"
        "with atomic_dir(Path(sys.argv[1]) / 'step_0001') as build:\n"
        "    (build / 'weights').write_text('w')\n"
    )
    assert subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO).returncode == 0
    assert (tmp_path / "manifest.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "step_0001").stat().st_mode & 0o777 == 0o755
