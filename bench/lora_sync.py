"""LoRA weight sync into a kept vLLM engine: the adapter alone (model.lora_sync 'adapter': vLLM's LoRA kernels on
the base) vs the merged weights loaded in place ('merged'), side by side in one process on SmolLM2-135M-Instruct.

Per step, after one train step of the torch learner with rank-R adapters: the bytes handed over, the sync time
(export + the engine taking them) and the time to sample the next batch (LoRA kernels cost sampling time, merged
weights cost none). Prints each mode's mean over --steps and the ratios.

    .venv/bin/python bench/lora_sync.py                    # rank 16, 3 steps, 8 prompts x 4 samples of 64 tokens
    .venv/bin/python bench/lora_sync.py --rank 64 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from refiner_core.config import EngineSettings, GRPOConfig, ModelConfig  # noqa: E402
from refiner_core.grpo import learner_settings  # noqa: E402
from refiner_core.learners.base import TrainSample  # noqa: E402
from refiner_core.learners.torch_learner import make_torch_learner  # noqa: E402
from refiner_core.models import load_tokenizer, resolve_model  # noqa: E402
from refiner_core.rollout.base import SamplingParams  # noqa: E402
from refiner_core.rollout.vllm_engine import make_vllm_engine  # noqa: E402
from refiner_core.store.checkpoints import folder_bytes  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--steps", type=int, default=3, help="train steps (each followed by a sync and a sample)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = str(resolve_model("smollm2-135m-instruct"))
    tokenizer = load_tokenizer(path)
    grpo = GRPOConfig(micro_batch_size=8, learning_rate=1e-3, beta=0.0)
    lora = ModelConfig(
        lora_rank=args.rank, lora_alpha=2.0 * args.rank, lora_dropout=0.0, lora_target_modules=["all-linear"]
    )
    learner = make_torch_learner(path, path, tokenizer, learner_settings(grpo, 1.0, "fp32", lora), None)
    prompts = [tokenizer(f"Write a short note about the number {i}.")["input_ids"] for i in range(8)]
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=64, seed=0)
    engines = {
        mode: make_vllm_engine(
            path,
            EngineSettings.of(engine="vllm", batch_size=32, adapter_rank=args.rank if mode == "adapter" else 0),
            progress=False,
        )
        for mode in ("adapter", "merged")
    }
    model_bytes = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    results: dict[str, dict[str, list[float]]] = {m: {"bytes": [], "sync": [], "sample": []} for m in engines}
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)
        samples = [
            TrainSample(p, torch.randint(3, 2000, (16,), generator=g).tolist(), adv, [-5.0] * 16)
            for p, adv in zip(prompts, [1.0, -1.0] * 4)
        ]
        learner.train_step(samples)
        for mode, engine in engines.items():
            t0 = time.perf_counter()
            if mode == "adapter":
                adapter = learner.adapter()
                engine.load_weights(adapter)
                size = folder_bytes(adapter.path)
            else:
                weights = learner.weights()
                engine.load_weights(weights)
                unique = {t.data_ptr(): t for t in weights.values()}.values()  # the tied output layer once
                size = sum(t.numel() * t.element_size() for t in unique)
            t1 = time.perf_counter()
            engine.generate(prompts, params)  # vLLM reads a new adapter here, the first time it is used
            t2 = time.perf_counter()
            results[mode]["bytes"].append(size)
            results[mode]["sync"].append(t1 - t0)
            results[mode]["sample"].append(t2 - t1)
    for engine in engines.values():
        engine.close()
    learner.close()
    mean = {m: {k: statistics.mean(v) for k, v in r.items()} for m, r in results.items()}
    print(
        f"SmolLM2-135M (weights file {model_bytes / 2**20:.0f} MiB), rank {args.rank}, {args.steps} steps, "
        f"{len(prompts)} prompts x {params.n} samples of {params.max_new_tokens} tokens, {args.threads} thread(s)"
    )
    print(f"{'mode':10} {'handed over':>12} {'sync s':>8} {'sample s':>9} {'sync+sample s':>14}")
    for mode, m in mean.items():
        print(
            f"{mode:10} {m['bytes'] / 2**20:9.1f} MiB {m['sync']:8.3f} {m['sample']:9.2f} "
            f"{m['sync'] + m['sample']:14.2f}"
        )
    a, b = mean["adapter"], mean["merged"]
    print(
        f"adapter / merged: bytes {a['bytes'] / b['bytes']:.3f}, sync {a['sync'] / b['sync']:.2f}x, "
        f"sample {a['sample'] / b['sample']:.2f}x, "
        f"sync+sample {(a['sync'] + a['sample']) / (b['sync'] + b['sample']):.2f}x"
    )


if __name__ == "__main__":
    main()
