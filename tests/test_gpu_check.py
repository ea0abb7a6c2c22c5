"""bench/gpu_check.py --cpu: the GPU check's fast parts run here on small shapes, so the script a GPU machine runs
is not first tried there. d: the bf16 matmul peak and a learner step's tokens/s and MFU; e: weight-sync seconds
through the engine's own transport, with a check that the engine holds what was sent, and the delta row that
one machine without two GPUs cannot run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.slow
def test_gpu_check_cpu_parts_print_one_json_line_per_result(tmp_path):
    pytest.importorskip("vllm")
    done = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--cpu", "--parts", "d,e", "--keep", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    peak = [x for x in lines if x["part"] == "d" and x.get("check") == "bf16 matmul peak"]
    shapes = [x for x in lines if x["part"] == "d" and "model" in x]
    assert len(peak) == 1 and peak[0]["tflops"] > 0
    assert shapes and all(x["tokens_per_second"] > 0 and 0 < x["mfu"] <= 1 for x in shapes)
    full = [x for x in lines if x["part"] == "e" and x.get("mode") == "full"]
    delta = [x for x in lines if x["part"] == "e" and x.get("mode") == "delta"]
    assert full and all(x["ok"] is True and x["transport"] == "host" and x["sync_seconds"] > 0 for x in full)
    assert len(delta) == 1 and delta[0]["ok"] is None and "NCCL" in delta[0]["not_run"]
    assert done.stdout.rstrip().splitlines()[-1].startswith("files and logs:")  # the table comes last
    assert (tmp_path / "d.log").exists() and (tmp_path / "e.log").exists()
