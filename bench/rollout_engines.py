"""Rollout throughput with one engine in this process vs N engines as Ray actors (rollout.num_engines), in one command.

The same prompts and sampling settings go to each; the figure is sampled tokens per second of one generate call
after a warm-up call (engines built and weights loaded before the clock starts). One engine uses all of this
process's torch threads; each Ray actor gets num_cpus=1, so Ray gives it one thread. On a machine with C cores
N <= C engines split the same cores: the ratio says what sharding costs or gains there, not what N GPUs would give.

    .venv/bin/python bench/rollout_engines.py                              # SmolLM2, hf, 1 vs 2 engines
    .venv/bin/python bench/rollout_engines.py --engine vllm --engines 2 --prompts 16
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from refiner_core import cluster  # noqa: E402
from refiner_core.config import EngineSettings  # noqa: E402
from refiner_core.models import resolve_model  # noqa: E402
from refiner_core.rollout.base import SamplingParams, make_engine  # noqa: E402
from refiner_core.rollout.sharded import ShardedEngine  # noqa: E402


def throughput(engine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    engine.generate(prompts[:2], params)  # warm-up: first-call allocations, compiled kernels
    start = time.perf_counter()
    tokens = sum(len(g.token_ids) for g in engine.generate(prompts, params))
    return tokens / (time.perf_counter() - start), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", default="smollm2-135m-instruct", help="smollm2-135m-instruct, tiny-qwen3 or a folder"
    )
    parser.add_argument("--engine", default="hf", choices=("hf", "vllm"))
    parser.add_argument("--engines", type=int, default=2, help="N, the Ray engines compared with one")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    path = str(resolve_model(args.model, max_position_embeddings=2048))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 40000) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
    # min_new_tokens is not an option: random prompts rarely end early, so both sides sample similar lengths
    params = SamplingParams(n=args.samples, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=1)
    batch = args.prompts * args.samples

    one = make_engine(path, EngineSettings.of(engine=args.engine, batch_size=batch))
    one_rate, one_tokens = throughput(one, prompts, params)
    one.close()
    print(f"1 engine in process: {one_tokens} tokens, {one_rate:.1f} tokens/s", flush=True)

    print(cluster.connect("local"), flush=True)
    try:
        sharded = ShardedEngine(
            path, EngineSettings.of(engine=args.engine, batch_size=batch, num_engines=args.engines), "float32", "fp32"
        )
        rate, tokens = throughput(sharded, prompts, params)
        sharded.close()
    finally:
        cluster.disconnect()
    print(f"{args.engines} Ray engines: {tokens} tokens, {rate:.1f} tokens/s")
    print(
        f"\n{args.model}, {args.engine}, {args.prompts} prompts x {args.samples} samples, <= {args.max_new_tokens} "
        f"new tokens: {args.engines} Ray engines / 1 engine = {rate / one_rate:.2f}x tokens per second"
    )


if __name__ == "__main__":
    main()
