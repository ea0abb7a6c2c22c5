"""The hf engine's decode steps under bf16 autocast on a CPU, three ways side by side on one model: transformers' SDPA
attention with autocast casting every frozen weight at every step (the engine before either change), the engine's
own attention (`sdpa_cpu_decode_fp32`: a step with one query token runs torch's fp32 kernel on the same bf16-rounded
inputs), and that with each weight cast once per batch (`cached_weight_casts`, the engine as it is). Same prompts,
seeds and batches.

    .venv/bin/python bench/hf_decode.py [--model smollm2-135m-instruct|tiny-qwen3] [--prompts 4] [--samples 4]
        [--prompt-tokens 460] [--new-tokens 160] [--batch-size 16] [--rounds 2] [--threads 2]

The default is the main job's rollout: 4 prompts of about 460 tokens, 4 samples each, up to 160 new tokens, one
batch of 16. Prints the seconds of each setting per round (alternating, so a busy machine slows both), the ratios
(> 1: faster than the setting before it; `speedup`: the engine against the first), and how far each setting's
sampled log-probs are from a float64 forward pass over the same tokens (the accuracy the learner's importance ratio
sees). Exit 1 if the engine is further from float64 than transformers' attention by more than 0.01 nats on average,
or if caching the casts changed a sampled token or log-prob.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from refiner_core.models import load_model, load_tokenizer, resolve_model  # noqa: E402
from refiner_core.rollout.base import SamplingParams  # noqa: E402
from refiner_core.rollout.hf_engine import CPU_DECODE_ATTENTION, HFRolloutEngine  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--model", default="smollm2-135m-instruct", help="tiny-qwen3, smollm2-135m-instruct or a folder"
    )
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=460)
    parser.add_argument("--new-tokens", type=int, default=160)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds of each setting, alternating")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model, max_position_embeddings=2048)
    tokenizer = load_tokenizer(path)
    model = load_model(path)
    engine = HFRolloutEngine(model, tokenizer, batch_size=args.batch_size, precision="bf16")
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prompts = [
        [rng.randrange(100, vocab) for _ in range(round(args.prompt_tokens * rng.uniform(0.85, 1.15)))]
        for _ in range(args.prompts)
    ]
    params = SamplingParams(n=args.samples, temperature=1.0, max_new_tokens=args.new_tokens, seed=1)
    settings = {  # attention, cached casts
        "transformers_sdpa": ("sdpa", False),
        "decode_fp32": (CPU_DECODE_ATTENTION, False),
        "engine": (CPU_DECODE_ATTENTION, True),
    }
    seconds: dict[str, list[float]] = {name: [] for name in settings}
    generations = {}
    for _ in range(args.rounds):
        for name, (attention, cached) in settings.items():
            model.set_attn_implementation(attention)
            engine.cache_weight_casts = cached
            start = time.perf_counter()
            generations[name] = engine.generate(prompts, params, desc=name)
            seconds[name].append(time.perf_counter() - start)

    reference = load_model(path, dtype="float64")
    gaps = {name: gap_to_float64(reference, prompts, gens) for name, gens in generations.items()}
    best = {name: min(times) for name, times in seconds.items()}
    identical = [(g.token_ids, g.logprobs) for g in generations["decode_fp32"]] == [
        (g.token_ids, g.logprobs) for g in generations["engine"]
    ]
    tokens = {name: sum(len(g.token_ids) for g in gens) for name, gens in generations.items()}
    for name in settings:
        print(
            f"{name:20s} best {min(seconds[name]):6.2f} s of {[round(s, 2) for s in seconds[name]]}, "
            f"{tokens[name]} tokens, |log-prob - float64| mean {gaps[name]['mean']:.4f} max {gaps[name]['max']:.3f}"
        )
    rounded = {name: {"mean": round(g["mean"], 4), "max": round(g["max"], 3)} for name, g in gaps.items()}
    result = {
        "speedup": round(best["transformers_sdpa"] / best["engine"], 2),
        "attention_speedup": round(best["transformers_sdpa"] / best["decode_fp32"], 2),
        "cached_casts_speedup": round(best["decode_fp32"] / best["engine"], 2),
        "cached_casts_identical": identical,
        "gap_to_float64": rounded,
        "seconds": seconds,
        **vars(args),
    }
    print(json.dumps(result))
    return 1 if gaps["engine"]["mean"] > gaps["transformers_sdpa"]["mean"] + 0.01 or not identical else 0


def gap_to_float64(reference, prompts: list[list[int]], generations) -> dict[str, float]:
    """Mean and max |sampled log-prob - the token's log-prob under `reference`| (a float64 model) over every token."""
    gaps = []
    for gen in generations:
        prompt = prompts[gen.prompt_index]
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + gen.token_ids])).logits[0, len(prompt) - 1 : -1]
        exact = torch.log_softmax(logits, -1).gather(-1, torch.tensor(gen.token_ids)[:, None])[:, 0]
        gaps.append(np.abs(np.array(gen.logprobs) - exact.numpy()))
    joined = np.concatenate(gaps)
    return {"mean": float(joined.mean()), "max": float(joined.max())}


if __name__ == "__main__":
    sys.exit(main())
