"""Stage plumbing: cache keys from content, not timings or paths alone; damaged outputs are detected."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

from refiner_core.schema import STEPS
from refiner_core.storage import write_table
from tasks.stage import damaged_outputs, stage_cache_key


def _key(params: dict) -> str:
    return stage_cache_key(SimpleNamespace(task=SimpleNamespace(name="judge")), params)


def test_key_ignores_timings_but_not_content(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"id": 1}\n')
    upstream = {"rollouts": {"path": "x.parquet", "hash": "abc"}, "seconds": 1.5}
    base = _key({"run_dir": "r", "data_file": str(data), "rollouts": upstream})
    assert _key({"run_dir": "r", "data_file": str(data), "rollouts": {**upstream, "seconds": 99.0}}) == base
    assert _key({"run_dir": "r", "data_file": str(data),
                 "rollouts": {**upstream, "rollouts": {"path": "x.parquet", "hash": "abd"}}}) != base
    data.write_text('{"id": 2}\n')  # same path, new content
    assert _key({"run_dir": "r", "data_file": str(data), "rollouts": upstream}) != base


def test_key_is_stable_across_processes(tmp_path):
    params = {"run_dir": "r", "step": 3, "cfg": {"lr": 1e-5, "stop": ["</answer>"]}}
    code = ("import sys, json; from types import SimpleNamespace; from tasks.stage import stage_cache_key; "
            "print(stage_cache_key(SimpleNamespace(task=SimpleNamespace(name='judge')), json.loads(sys.argv[1])))")
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
    from refiner_core.checkpoints import prune
    from refiner_core.storage import dir_hash

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
