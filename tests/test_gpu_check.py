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


def _check_on_cpu(parts: str, folder) -> tuple[list[dict], str]:
    """`bench/gpu_check.py --cpu --parts PARTS`, which must pass: its JSON lines and its whole output."""
    done = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--cpu", "--parts", parts, "--keep", str(folder)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")], done.stdout


@pytest.mark.slow
def test_gpu_check_cpu_parts_print_one_json_line_per_result(tmp_path):
    pytest.importorskip("vllm")
    lines, stdout = _check_on_cpu("d,e", tmp_path)
    peak = [x for x in lines if x["part"] == "d" and x.get("check") == "bf16 matmul peak"]
    shapes = [x for x in lines if x["part"] == "d" and "model" in x and "check" not in x]
    [profile] = [x for x in lines if x["part"] == "d" and x.get("check") == "profile"]
    assert profile["micro_batch_size"] == 2 and 0 < profile["busy_share"] <= 1.05  # op times overlap a little
    assert profile["seconds_by_kind"]["matmul"] > 0 and len(profile["top"]) > 3
    seconds = [sec for _, sec, _ in profile["top"]]
    assert seconds == sorted(seconds, reverse=True) and sum(share for *_, share in profile["top"]) <= 1.001
    assert len(peak) == 1 and peak[0]["tflops"] > 0
    assert shapes and all(x["tokens_per_second"] > 0 and 0 < x["mfu"] <= 1 for x in shapes)
    assert [x["micro_batch_size"] for x in shapes] == [1, 2, 4, 4, 4] and len({x["model"] for x in shapes}) == 1
    assert [x["recomputed_activations"] for x in shapes] == [False, False, False, True, True]
    assert [x["logit_chunk_tokens"] for x in shapes] == [0, 0, 0, 0, 64]
    assert not any(x["compiled_layers"] for x in shapes)  # the compiled run is the GPU's
    assert all(x["hand_back_seconds"] >= 0 and x["step_after_hand_back_seconds"] > 0 for x in shapes)
    full = [x for x in lines if x["part"] == "e" and x.get("mode") == "full"]
    delta = [x for x in lines if x["part"] == "e" and x.get("mode") == "delta"]
    assert full and all(x["ok"] is True and x["transport"] == "host" and x["sync_seconds"] > 0 for x in full)
    assert len(delta) == 1 and delta[0]["ok"] is None and "NCCL" in delta[0]["not_run"]
    assert stdout.rstrip().splitlines()[-1].startswith("files and logs:")  # the table comes last
    assert (tmp_path / "d.log").exists() and (tmp_path / "e.log").exists()


@pytest.mark.slow
def test_gpu_check_cpu_runs_the_colocated_flow(tmp_path):
    """Part f on CPU: the tiny flow with a vllm engine and the deepspeed learner (ZeRO-3), three steps; the engine is
    built once and synced from the learner's memory at each later step (kept awake: vLLM cannot sleep on a CPU)."""
    pytest.importorskip("vllm")
    pytest.importorskip("deepspeed")
    [line] = [x for x in _check_on_cpu("f", tmp_path)[0] if x["part"] == "f"]
    assert line["ok"] is True and len(line["steps"]) == 3 and line["empty"] == []
    assert line["rollouts"][0] == "engine built from the checkpoint"
    assert all(
        r.startswith("engine kept, weights synced in place from the learner's memory") for r in line["rollouts"][1:]
    )


def test_part_d_needs_none_of_the_carried_wheels():
    """Part d (the learner's throughput) imports only what the GPU machine has (torch, transformers, pyarrow,
    pandas, PyYAML, psutil, tqdm): it can run there in one call, before or without the wheels the other parts need."""
    lacking = ["duckdb", "prefect", "vllm", "deepspeed", "datasets", "typer", "ray"]
    code = (
        f"import sys\nfor name in {lacking!r}:\n    sys.modules[name] = None\n"
        "sys.path.insert(0, 'bench')\nimport gpu_check\n"
        "from refiner_core.learners.torch_learner import TorchLearner, compile_decoder_layers\n"
        "from refiner_core.models import release_gpu_cache\n"
        "gpu_check.grpo_settings(True)\nprint('imported')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "imported", done.stderr[-2000:]


def test_train_flops_counts_what_the_learner_multiplies(tmp_path):
    """Part d's FLOPs against torch's own count of a real learner step (eager attention, whose matrix products the
    counter sees): the layers over every position, the output layer over the positions the learner keeps logits
    for (the response's + 1), and attention, which eager computes over the whole square (the formula counts the
    causal half)."""
    import dataclasses

    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen3ForCausalLM

    sys.path.insert(0, str(REPO / "bench"))
    import gpu_check

    from refiner_core.learners.base import TrainSample
    from refiner_core.learners.torch_learner import TorchLearner

    config = gpu_check.shape_config(gpu_check.CPU_SHAPES["qwen3-5m"], vocab=8192)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    settings = gpu_check.grpo_settings(True, micro_batch_size=1, pack_length=0, share_prompt=False)
    learner = TorchLearner(Qwen3ForCausalLM(config), None, 0, dataclasses.replace(settings, precision="fp32"))
    length, count, prompt = 96, 3, 40
    g = torch.Generator().manual_seed(1)
    samples = []
    for _ in range(count):
        ids = torch.randint(3, config.vocab_size, (length,), generator=g).tolist()
        samples.append(TrainSample(ids[:prompt], ids[prompt:], 1.0, [-2.0] * (length - prompt)))
    with FlopCounterMode(display=False) as counter:
        learner.train_step(samples)
    q = config.num_attention_heads * config.head_dim
    causal_half = 6 * config.num_hidden_layers * q * length**2 * count
    expected = gpu_check.train_flops(config, length, count, scored_tokens=length - prompt + 1) + causal_half
    assert counter.get_total_flops() == expected


def test_rank_totals_are_summed_on_the_engines_device(monkeypatch):
    """An NCCL process group (DeepSpeed on GPUs) has no backend for CPU tensors: the ranks' totals are all-reduced on
    the engine's device (here 'meta', standing in for 'cuda')."""
    import types

    import torch
    import torch.distributed as dist

    from refiner_core.learners.deepspeed_worker import DeepSpeedRankLearner

    reduced = []
    monkeypatch.setattr(dist, "all_reduce", lambda t: reduced.append(t.device))
    learner = DeepSpeedRankLearner.__new__(DeepSpeedRankLearner)
    learner.engine, learner.padding_tokens = types.SimpleNamespace(device=torch.device("meta")), 0
    with pytest.raises(NotImplementedError):  # a meta tensor has no values to read back
        learner._reduce({"loss": 1.0, "computed_tokens": 4.0})
    assert reduced == [torch.device("meta")]


def test_the_wheel_parts_stay_out_of_git():
    """The device copies every file git does not ignore: an unignored .whl/ (214 MiB) would travel with each call,
    over its 64 MiB, and `carry` names ignored paths only."""
    for path in (".whl/parts/1/wheels.tar.0", ".whl/wheels/vllm-0.26.0-cp38-abi3-manylinux_2_31_x86_64.whl"):
        ignored = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO)
        assert ignored.returncode == 0, f"{path} is not ignored by git"


def test_a_part_received_on_a_replaced_machine_stops_that_call(tmp_path):
    """The wheels travel one part per call and wait in /tmp while the machine stays warm: a machine replaced between
    calls (idle too long) was noticed only by the last call, after every part had travelled again for nothing.
    receive K now stops at once (exit 4) when an earlier part is gone, and receive 1 clears a warm machine's old
    parts. The script runs here in a copy of its folder layout, its store moved under tmp_path."""
    import shutil

    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    script = (REPO / "scripts" / "gpu_check_remote.sh").read_text()
    store = tmp_path / "store"
    (tree / "scripts" / "gpu_check_remote.sh").write_text(
        script.replace("STORE=/tmp/gpu-check-wheels", f"STORE={store}")
    )

    def receive(k: int) -> subprocess.CompletedProcess:
        parts = tree / ".whl" / "parts"
        shutil.rmtree(parts, ignore_errors=True)
        (parts / str(k)).mkdir(parents=True)
        (parts / str(k) / f"wheels.tar.{k - 1}").write_bytes(bytes(k) * 1000)
        env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")}
        return subprocess.run(["bash", "scripts/gpu_check_remote.sh", "receive", str(k)], cwd=tree, env=env,
                              capture_output=True, text=True)  # fmt: skip

    replaced = receive(2)
    assert replaced.returncode == 4 and "start again with receive 1" in replaced.stderr
    store.mkdir(exist_ok=True)
    (store / "wheels.tar.5").write_bytes(b"an older check's part")
    assert receive(1).returncode == 0 and receive(2).returncode == 0
    assert sorted(p.name for p in store.iterdir()) == ["wheels.tar.0", "wheels.tar.1"]
