"""Our GRPO step time vs TRL's GRPOTrainer, side by side, same model, prompts, reward and thread count.

    .venv/bin/python bench/grpo_vs_trl.py [--steps 5] [--threads 2] [--only ours|trl] [--quick]
        [--model smollm2-135m-instruct] [--micro-batch-size 8] [--pack-length 1024] [--trl-venv /tmp/venv-trl]

One step = 4 prompts x 8 samples x 64 new tokens (temperature 1, beta = 0, lr 5e-6): sampling, a cheap
word-count reward (bench/peer_trl_grpo.py:reward_text, the same on both sides), one optimizer step.
Ours: refiner_core.grpo.grpo_loop in this process, once per (engine, precision, layout) combination: the hf
engine samples from the learner's live policy object (under bf16 autocast with bf16), the vllm engine from its own
copy that load_weights refreshes after every update; the update lays sequences out padded, packed, or shared
(each group's prompt read once, grpo.share_prompt). TRL: bench/peer_trl_grpo.py in its own venv (created with pip on
first use), use_cpu=True, gradient checkpointing off (TRL's default is on; --trl-grad-ckpt keeps it).
Each side gets its best precision on this CPU, printed first: ours model.precision 'auto', TRL bf16=True where the
CPU computes bf16 natively (AVX-512 BF16 or AMX), else fp32 (emulated bf16 is ~100x slower per matmul).
Prints per-step JSON lines, then a table of median step seconds over steps 2..N, completion tokens/s, ours/TRL,
and the median process CPU seconds per step with its ratio (steadier than wall time on a shared machine), then
"best ours / TRL" on wall time (target <= 0.5). --quick swaps in the tiny Qwen3 built from a config.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from peer_trl_grpo import reward_text  # noqa: E402

from refiner_core import REPO_ROOT  # noqa: E402
from refiner_core.config import EngineSettings, GRPOConfig  # noqa: E402
from refiner_core.data.rows import read_jsonl  # noqa: E402
from refiner_core.grpo import grpo_loop, learner_settings  # noqa: E402
from refiner_core.learners.torch_learner import TorchLearner  # noqa: E402
from refiner_core.models import load_model, load_tokenizer, resolve_model  # noqa: E402
from refiner_core.rollout.base import SamplingParams  # noqa: E402
from refiner_core.rollout.hf_engine import HFRolloutEngine  # noqa: E402
from refiner_core.runtime.hardware import native_bf16, resolve_precision  # noqa: E402

GENERATIONS, PROMPTS_PER_STEP, NEW_TOKENS = 8, 4, 64
TRL_PINS = ["trl==1.16.*", "transformers==5.23.0", "datasets==5.2.0", "accelerate"]


def ensure_trl_venv(venv: Path) -> Path:
    """The TRL venv's python, creating the venv first if it is missing or cannot import trl. torch==2.13.0 (CPU)
    goes in first and stays pinned by a constraints file: an unpinned torch pulls a multi-GB CUDA build."""
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import trl"], capture_output=True).returncode == 0:
        return python

    def sh(*cmd) -> None:
        print("+", " ".join(map(str, cmd)), flush=True)
        subprocess.run(cmd, check=True)

    if not python.exists():
        sh(sys.executable, "-m", "venv", venv)
    sh(python, "-m", "pip", "install", "-q", "torch==2.13.0")
    constraints = venv / "constraints.txt"
    constraints.write_text("torch==2.13.0\n")
    sh(python, "-m", "pip", "install", "-q", "-c", constraints, *TRL_PINS)
    return python


def rendered_prompts(tokenizer, count: int) -> list[str]:
    """`count` user questions from data/refiner/samples.jsonl (cycled), rendered by the model's chat template."""
    questions = [row.data["question"] for row in read_jsonl(REPO_ROOT / "data" / "refiner" / "samples.jsonl")]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": questions[i % len(questions)]}], tokenize=False, add_generation_prompt=True
        )
        for i in range(count)
    ]


def summarise(name: str, steps: list[dict]) -> dict:
    """Median step seconds and completion tokens/s over steps 2..N (step 1 warms up)."""
    timed = steps[1:] or steps
    seconds = [s["seconds"] for s in timed]
    return {
        "name": name,
        "median_s": statistics.median(seconds),
        "median_cpu_s": statistics.median(s["cpu_seconds"] for s in timed),
        "tokens_per_s": sum(s["completion_tokens"] for s in timed) / sum(seconds),
        "steps": len(steps),
    }


LAYOUTS = ("pad", "pack", "share")  # one padded sequence per row / packed rows / each group's prompt read once


def our_combinations() -> list[dict]:
    """Our settings: the hf engine in fp32 padded (the plain baseline) and, in model.precision 'auto' (bf16 where
    native), packed or prompt-shared, and the vllm engine with packed or prompt-shared updates."""
    best = resolve_precision("auto")
    return [{"engine": "hf", "precision": "fp32", "layout": "pad"}] + [
        {"engine": e, "precision": best, "layout": lay} for e in ("hf", "vllm") for lay in ("pack", "share")
    ]


def run_ours(model_path: Path, prompts: list[list[int]], combo: dict, args) -> list[dict]:
    torch.manual_seed(0)
    tokenizer = load_tokenizer(model_path)
    policy = load_model(model_path, trainable=True)
    packed = combo["layout"] == "pack"
    grpo = GRPOConfig(
        beta=0.0,
        learning_rate=5e-6,
        pack_length=args.pack_length if packed else 0,
        micro_batch_size=1 if packed else args.micro_batch_size,
        share_prompt=combo["layout"] == "share",
    )
    learner = TorchLearner(policy, None, tokenizer.pad_token_id, learner_settings(grpo, 1.0, combo["precision"]))
    sync = None
    if combo["engine"] == "vllm":  # its own copy of the weights, refreshed after every update
        from refiner_core.rollout.vllm_engine import make_vllm_engine

        settings = EngineSettings.of(engine="vllm", batch_size=GENERATIONS * PROMPTS_PER_STEP)
        engine = make_vllm_engine(str(model_path), settings, "float32", combo["precision"], progress=False)
        sync = lambda: engine.load_weights(policy)  # noqa: E731
    else:
        engine = HFRolloutEngine(
            policy, tokenizer, batch_size=GENERATIONS * PROMPTS_PER_STEP, precision=combo["precision"]
        )
    params = SamplingParams(n=GENERATIONS, temperature=1.0, max_new_tokens=NEW_TOKENS, seed=1)
    steps, last = [], [time.perf_counter(), time.process_time()]
    name = "ours " + " ".join(f"{k}={v}" for k, v in combo.items())

    def on_step(step: int, record: dict) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        row = {
            "side": name,
            "step": step + 1,
            "seconds": round(now - last[0], 3),
            "cpu_seconds": round(cpu - last[1], 3),
            "completion_tokens": record.get("response_tokens", 0),
            "reward_mean": round(record["reward_mean"], 3),
            "update_s": round(record.get("update_seconds", 0.0), 3),
        }
        print(json.dumps(row), flush=True)
        steps.append(row)
        last[:] = [now, cpu]

    grpo_loop(
        engine,
        learner,
        prompts,
        lambda g: reward_text(g.text),
        grpo,
        params,
        steps=args.steps,
        prompts_per_step=PROMPTS_PER_STEP,
        on_step=on_step,
        sync=sync,
    )
    engine.close()
    return steps


def run_trl(model_path: Path, prompt_texts: list[str], args, bf16: bool) -> list[dict]:
    python = ensure_trl_venv(Path(args.trl_venv))
    with tempfile.TemporaryDirectory() as tmp:
        prompt_file = Path(tmp) / "prompts.json"
        prompt_file.write_text(json.dumps(prompt_texts))
        cmd = [
            str(python),
            str(BENCH / "peer_trl_grpo.py"),
            "--model",
            str(model_path),
            "--prompts",
            str(prompt_file),
            "--steps",
            str(args.steps),
            "--threads",
            str(args.threads),
            "--output-dir",
            str(Path(tmp) / "out"),
        ] + (["--grad-ckpt"] if args.trl_grad_ckpt else [])
        if not bf16:
            cmd.append("--fp32")
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(args.threads),
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": "",
            "PYTHONWARNINGS": "ignore::FutureWarning",
        }
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        steps = []
        for line in proc.stdout:
            line = line.strip()
            if not line.startswith('{"side"'):  # the Trainer also prints its log dicts (Python reprs)
                continue
            row = json.loads(line)
            print(line, flush=True)
            if "step" in row:
                steps.append(row)
        if proc.wait() != 0:
            raise RuntimeError(f"TRL side failed (exit {proc.returncode}): {' '.join(cmd)}")
    return steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--model", default="smollm2-135m-instruct", help="tiny-qwen3, smollm2-135m-instruct or a folder"
    )
    parser.add_argument("--steps", type=int, default=5, help="GRPO steps per side (median over steps 2..N)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, both sides")
    parser.add_argument("--only", choices=["ours", "trl"], help="run one side only")
    parser.add_argument("--quick", action="store_true", help="tiny Qwen3 from a config: a smoke test")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="our rows per pass when padded")
    parser.add_argument("--pack-length", type=int, default=1024, help="our tokens per packed row (1 row per pass)")
    parser.add_argument(
        "--combos",
        default="",
        help="ours to run, e.g. 'hf:auto:pack,vllm:bf16:share' "
        f"(engine:precision:layout, precision auto/bf16/fp32, layout one of {LAYOUTS}); default: all "
        "of our_combinations()",
    )
    parser.add_argument("--trl-grad-ckpt", action="store_true", help="TRL with its default gradient checkpointing")
    parser.add_argument("--trl-venv", default="/tmp/venv-trl", help="TRL's own venv, created if missing")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (step 1 is a warm-up)")
    torch.set_num_threads(args.threads)
    model_path = resolve_model("tiny-qwen3" if args.quick else args.model, max_position_embeddings=2048)
    tokenizer = load_tokenizer(model_path)
    prompt_texts = rendered_prompts(tokenizer, PROMPTS_PER_STEP * args.steps)
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in prompt_texts]
    print(
        f"model {model_path}; {args.steps} steps x {PROMPTS_PER_STEP} prompts x {GENERATIONS} samples x "
        f"{NEW_TOKENS} new tokens, beta 0, {args.threads} threads; prompt tokens "
        f"{min(map(len, prompts))}-{max(map(len, prompts))}",
        flush=True,
    )
    trl_bf16, why = native_bf16("cpu")  # TRL runs with use_cpu=True
    print(
        f"precision: ours {resolve_precision('auto')} (auto), TRL {'bf16' if trl_bf16 else 'fp32'}: {why} "
        f"(torch CPU capability {torch.backends.cpu.get_cpu_capability()})",
        flush=True,
    )

    results = []
    trl = None
    if args.only != "ours":
        trl = summarise(
            f"TRL GRPOTrainer {'bf16' if trl_bf16 else 'fp32'}", run_trl(model_path, prompt_texts, args, trl_bf16)
        )
    if args.only != "trl":
        combos = our_combinations()
        if args.combos:
            combos = [
                {"engine": e, "precision": resolve_precision(p), "layout": lay}
                for e, p, lay in (c.split(":") for c in args.combos.split(","))
            ]
            if any(c["layout"] not in LAYOUTS for c in combos):
                parser.error(f"--combos: layout must be one of {LAYOUTS}")
        for combo in combos:
            results.append(
                summarise(
                    "ours " + " ".join(f"{k}={v}" for k, v in combo.items()), run_ours(model_path, prompts, combo, args)
                )
            )

    rows = ([trl] if trl else []) + results
    print(f"\n{'combination':<36} {'median step s':>13} {'tokens/s':>9} {'ours/TRL':>9} {'cpu s':>7} {'cpu ratio':>9}")
    for r in rows:
        ratio = f"{r['median_s'] / trl['median_s']:.2f}" if trl and r is not trl else "-"
        cpu_ratio = f"{r['median_cpu_s'] / trl['median_cpu_s']:.2f}" if trl and r is not trl else "-"
        print(
            f"{r['name']:<36} {r['median_s']:>13.2f} {r['tokens_per_s']:>9.1f} {ratio:>9} "
            f"{r['median_cpu_s']:>7.1f} {cpu_ratio:>9}"
        )
    if trl and results:
        best = min(results, key=lambda r: r["median_s"])
        print(f"best ours / TRL = {best['median_s'] / trl['median_s']:.2f} (target <= 0.5): {best['name']}")


if __name__ == "__main__":
    main()
