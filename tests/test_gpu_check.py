"""bench/gpu_check.py --cpu: the GPU check's fast parts run here on small shapes, so the script a GPU machine runs
is not first tried there. d: the bf16 matmul peak and a learner step's tokens/s and MFU; e: weight-sync seconds
through the engine's own transport, with a check that the engine holds what was sent, and the delta row that
one machine without two GPUs cannot run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

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
    assert stdout.rstrip().splitlines()[-1].startswith("files and logs:")  # the table comes last, then the folder
    checked = Path(stdout.rstrip().splitlines()[-1].split(": ", 1)[1])  # this invocation's, under --keep
    assert checked.parent == tmp_path and (checked / "d.log").exists() and (checked / "e.log").exists()


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


def _gpu_check():
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_check

    return gpu_check


def test_a_rerun_into_the_same_keep_folder_gives_its_parts_new_folders(tmp_path, monkeypatch, capsys):
    """scripts/gpu_check_remote.sh passes --keep /tmp/gpu-check to every check, and `check --parts b,c` reruns parts
    on the warm machine: each invocation's parts get new, empty folders, so parts b and c make their run folders
    again (mkdir, as they do) and no part finds an earlier run's files. A stand-in for the parts' processes makes
    its run folder as b and c do; both invocations' folders stay under --keep."""
    gpu_check = _gpu_check()
    given: list[Path] = []

    def part_stand_in(cmd, log, timeout):
        part, folder = cmd[cmd.index("--child") + 1], Path(cmd[cmd.index("--root") + 1])
        assert not any(folder.iterdir()), f"part {part} was given {folder}, which holds an earlier run's files"
        (folder / f"{part}-run").mkdir()
        given.append(folder)
        log.write_text("")
        return 0, [{"part": part, "ok": True}]

    monkeypatch.setattr(gpu_check, "run_part", part_stand_in)
    for _ in range(2):
        monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--cpu", "--parts", "b,c", "--keep", str(tmp_path)])
        assert gpu_check.main() == 0
    named = [line.split(": ", 1)[1] for line in capsys.readouterr().out.splitlines() if line.startswith("files and")]
    assert len(given) == 4 and len(set(given)) == 4 and all(folder.exists() for folder in given)
    assert len(set(named)) == 2 and all(Path(folder).parent == tmp_path for folder in named)
    assert [folder.parent for folder in given] == [Path(named[0])] * 2 + [Path(named[1])] * 2


def test_the_flow_parts_read_only_what_their_own_run_logged(tmp_path, monkeypatch):
    """Part f reads the rollout stage's lines from the run's log: an earlier run's lines in the same folder (here in
    the log file this run appends to, as a run started in the same second does) must not stand in for them. The
    run is stood in for by one that succeeds and logs no rollout line: the part fails."""
    import types

    duckdb = pytest.importorskip("duckdb")
    gpu_check = _gpu_check()
    run = tmp_path / "colocated-run"
    (run / "logs").mkdir(parents=True)
    log = run / "logs" / "run-20260101-000000.log"
    synced = "engine woken from sleep in 0.4 s, weights synced in place from the learner's memory in 0.2 s"
    log.write_text(
        "model precision: bf16\nrollout step 0: engine built from the checkpoint\n"
        + "".join(f"rollout step {k}: {synced}\n" for k in (1, 2))
    )
    con = duckdb.connect(str(run / "catalog.duckdb"))
    for table in ["prompts", "rubrics", "judge_scores", "reward_inputs", "advantages"]:
        con.execute(f"CREATE TABLE {table} AS SELECT 1 AS x")
    con.execute("CREATE TABLE rollouts AS SELECT [-1.0, -2.0]::DOUBLE[] AS response_logprobs")
    con.execute("CREATE TABLE rewards AS SELECT 1.0::DOUBLE AS reward")
    con.execute(
        "CREATE TABLE steps AS SELECT * FROM (VALUES (0, 0.1, 0.0, 0.5, 0.3, 0, 9), (1, 0.1, 0.0, 0.5, 0.3, 0, 9), "
        "(2, 0.1, 0.0, 0.5, 0.3, 0, 9)) t(step, loss, kl, grad_norm, reward_mean, skipped_optimizer_steps, "
        "response_tokens)"
    )
    con.close()

    def run_logging_no_rollout(cmd, **kwargs):
        with log.open("a") as appended:
            appended.write("model precision: bf16\nevery stage served from the cache\n")
        return types.SimpleNamespace(returncode=0, stdout="", stderr="")

    lines = []
    monkeypatch.setattr(gpu_check.subprocess, "run", run_logging_no_rollout)
    monkeypatch.setattr(gpu_check, "small_model", lambda root, cpu: root / "model")
    monkeypatch.setattr(gpu_check, "device_name", lambda cpu: "stand-in")
    monkeypatch.setattr(gpu_check, "emit", lambda part, **fields: lines.append({"part": part, **fields}))
    gpu_check.part_f(tmp_path, cpu=False)
    assert lines[-1]["rollouts"] == [] and lines[-1]["ok"] is False


class _EngineStandIn:
    """What parts b and c use of a vllm engine, on this CPU: `transport` and `sleep_level` as a GPU build would
    report them, sleep and wake, weights from a state dict or a checkpoint folder; as its log-probs, the sums of
    the weights it holds, in bf16 as vLLM holds them."""

    def __init__(self, path, sleep_level: int, transport: str, sleeps: bool):
        from safetensors.torch import load_file

        self.transport, self.sleep_level = transport, sleep_level if sleeps else 0
        self.asleep, self.weights_hash = False, None
        self.load_weights({k: v for f in sorted(Path(path).glob("*.safetensors")) for k, v in load_file(f).items()})

    def load_weights(self, state) -> None:
        import torch

        self.sums = [
            float(t.to(torch.bfloat16).float().sum()) for k, t in sorted(state.items()) if k != "lm_head.weight"
        ]

    def memory_bytes(self) -> tuple[int, int]:
        return 1, 0  # it holds more than it leaves free: released, it sleeps where it can, else it is closed

    def sleep(self) -> None:
        self.asleep = True

    def wake_up(self, tags) -> None:
        time.sleep(0.001)
        self.asleep = self.asleep and "kv_cache" not in tags

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    ("part", "transport", "sleeps", "passes"),
    [
        ("b", "ipc", False, True),
        ("b", "host", False, False),  # the engine fell back to host memory
        ("c", "ipc", True, True),
        ("c", "ipc", False, False),  # built without sleep mode: it never slept
        ("c", "host", True, False),
    ],
)
def test_on_a_gpu_parts_b_and_c_pass_only_over_cuda_ipc_and_c_only_asleep(
    part, transport, sleeps, passes, tmp_path, monkeypatch
):
    """Parts b and c on their GPU branch, the engine stood in for (its transport and whether it sleeps as a GPU
    build may report them) and the torch learner in for DeepSpeed's: the weights must have travelled over CUDA IPC,
    and part c's engine must have slept at each release and been woken at each stage. On CPU (`--cpu`), where vLLM
    takes weights through host memory and cannot sleep, parts b and c pass without either."""
    import torch

    from refiner_core.learners import deepspeed_learner, torch_learner
    from refiner_core.rollout import vllm_engine

    gpu_check = _gpu_check()

    def make_engine(path, settings, **kwargs):
        return _EngineStandIn(path, settings.sleep_level, transport, sleeps)

    lines = []
    monkeypatch.setattr(vllm_engine, "make_vllm_engine", make_engine)
    monkeypatch.setattr(deepspeed_learner, "make_deepspeed_learner", torch_learner.make_torch_learner)
    tiny = gpu_check.small_model(tmp_path, cpu=True)  # the GPU's model, with head_dim 128, is vLLM's concern
    monkeypatch.setattr(gpu_check, "small_model", lambda root, cpu: tiny)
    monkeypatch.setattr(gpu_check, "prompt_logprobs", lambda engine, tokens: engine.sums)
    monkeypatch.setattr(gpu_check, "device_name", lambda cpu: "stand-in")
    monkeypatch.setattr(gpu_check, "emit", lambda part, **fields: lines.append({"part": part, **fields}))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *args: (0, 0))
    gpu_check.RUN[part](tmp_path, cpu=False)
    [verdict] = [x for x in lines if x.get("check") != "round"]
    assert verdict["transport"] == transport and verdict["max_logprob_gap_vs_fresh"] == 0.0
    assert verdict["ok"] is passes


def test_parts_naming_no_known_part_are_refused(tmp_path):
    """A --parts with a typo, upper case or nothing in it ran nothing and exited 0: now an error naming the unknown
    letters and the known ones, before anything runs."""
    for parts, unknown in [("B,C", "B, C"), ("g", "g"), ("a,x", "x"), ("", None)]:
        done = subprocess.run(
            [sys.executable, "bench/gpu_check.py", "--cpu", "--parts", parts, "--keep", str(tmp_path / "keep")],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, (parts, done.stdout, done.stderr)
        said = f"unknown part(s) {unknown}" if unknown else "no part named"
        assert f"{said} (the parts: a, b, c, d, e, f)" in done.stderr
        assert not (tmp_path / "keep").exists()


def test_a_part_named_twice_runs_once(tmp_path):
    """--parts b,b,c: b once, then c (here neither starts: a --budget of 1 s leaves each its 'not run' line)."""
    done = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--cpu", "--parts", "b,b,c", "--budget", "1", "--keep", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 1 and [x["part"] for x in lines] == ["b", "c"]
    assert all(x["ok"] is False and x["error"].startswith("not run") for x in lines)
