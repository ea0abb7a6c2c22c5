"""One GRPO update four ways, side by side: fp32 padded, bf16 autocast padded, bf16 autocast packed, and bf16
autocast with each group's prompt read once (grpo.share_prompt); and, with --only, the last with the KL in the
reward measured first (bf16_shared_kl_reward: the learner's sequence_kl, then the update reading the measure's
reference log-probs, as the update stage does; grpo.kl_reward_coef), or measured and then scored again by the
update (bf16_shared_kl_reward_scored_twice).

    .venv/bin/python bench/learner_speed.py [--model smollm2-135m-instruct|tiny-qwen3] [--sequences 16]
        [--group-size 4] [--prompt-tokens 460] [--response-tokens 85] [--pack-length 2048] [--threads 2]

Random token sequences in GRPO groups of --group-size responses sharing one prompt (the main job's shape by
default), prompt and response lengths spread +-15% around the given means, beta > 0 so the reference pass is
timed too. Prints wall and process-CPU seconds for each setting (CPU seconds are steadier on a shared machine),
the ratios to the first setting run (fp32 padded unless --only; > 1 means faster) and the tokens-per-computed-token
efficiency; the losses agree.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from refiner_core.config import GRPOConfig  # noqa: E402
from refiner_core.grpo import learner_settings  # noqa: E402
from refiner_core.learners.base import TrainSample  # noqa: E402
from refiner_core.learners.torch_learner import TorchLearner  # noqa: E402
from refiner_core.models import load_model, resolve_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--model", default="smollm2-135m-instruct", help="tiny-qwen3, smollm2-135m-instruct or a folder"
    )
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4, help="responses per shared prompt")
    parser.add_argument("--prompt-tokens", type=int, default=460)
    parser.add_argument("--response-tokens", type=int, default=85)
    parser.add_argument("--micro-batch-size", type=int, default=4, help="rows per pass when padded")
    parser.add_argument("--pack-length", type=int, default=2048, help="tokens per packed row (one row per pass)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated settings to run (the first is the baseline of "
        "the ratios), e.g. bf16_padded,bf16_shared; default: all four",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model, max_position_embeddings=2048)
    vocab = load_model(path).config.vocab_size
    rng = random.Random(0)

    def spread(mean: int) -> int:
        return rng.randint(int(mean * 0.85), int(mean * 1.15))

    samples = []
    for k in range(args.sequences):
        if k % args.group_size == 0:
            prompt = [rng.randrange(3, vocab) for _ in range(spread(args.prompt_tokens))]
        response = [rng.randrange(3, vocab) for _ in range(spread(args.response_tokens))]
        samples.append(TrainSample(prompt, response, rng.uniform(-1.5, 1.5), [-2.0] * len(response)))
    base = dict(  # the recipe's GRPO fields (defaults, then these)
        learning_rate=1e-6,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.001,
        kl_estimator="k3",
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        loss_aggregation="token_mean",
        loss_constant=1024.0,
        minibatches=1,
        tis_cap=0.0,
        share_prompt=False,  # the bf16_shared case turns it on
    )

    def settings_for(precision: str, **grpo):
        return learner_settings(GRPOConfig(**{**base, **grpo}), 1.0, precision)

    settings = {
        "fp32_padded": dict(precision="fp32", pack_length=0, micro_batch_size=args.micro_batch_size),
        "bf16_padded": dict(precision="bf16", pack_length=0, micro_batch_size=args.micro_batch_size),
        "bf16_packed": dict(precision="bf16", pack_length=args.pack_length, micro_batch_size=1),
        "bf16_shared": dict(precision="bf16", pack_length=0, micro_batch_size=1, share_prompt=True),
    }
    optional = {  # --only names them
        "bf16_shared_kl_reward": dict(settings["bf16_shared"], kl_reward_coef=0.001),
        "bf16_shared_kl_reward_scored_twice": dict(settings["bf16_shared"], kl_reward_coef=0.001),
    }
    if args.only:
        known = {**settings, **optional}
        unknown = set(args.only.split(",")) - set(known)
        if unknown:
            parser.error(f"--only: unknown {sorted(unknown)}; choose from {sorted(known)}")
        settings = {k: known[k] for k in args.only.split(",")}
    results = {}
    for label, chosen in settings.items():
        policy, reference = load_model(path, trainable=True), load_model(path)
        # Warm-up on two short sequences with lr 0 (a throwaway optimizer), so first-call costs are not timed.
        short = [
            TrainSample(s.prompt_ids[:32], s.response_ids[:8], s.advantage, s.rollout_logprobs[:8]) for s in samples[:2]
        ]
        TorchLearner(policy, reference, 0, settings_for(**{**chosen, "learning_rate": 0.0})).train_step(short)
        policy.zero_grad(set_to_none=True)
        learner = TorchLearner(policy, reference, 0, settings_for(**chosen))
        t0, c0 = time.perf_counter(), time.process_time()
        batch = samples
        if chosen.get("kl_reward_coef"):
            measured = learner.sequence_kl(samples)
            if not label.endswith("scored_twice"):
                batch = [dataclasses.replace(s, **m.carried()) for s, m in zip(samples, measured)]
        metrics = learner.train_step(batch)
        results[label] = {
            "seconds": time.perf_counter() - t0,
            "cpu_seconds": time.process_time() - c0,
            "loss": metrics["loss"],
            "packing_efficiency": metrics["packing_efficiency"],
        }
        print(
            f"{label}: {results[label]['seconds']:.1f} s ({results[label]['cpu_seconds']:.1f} CPU s)",
            file=sys.stderr,
            flush=True,
        )
    baseline = next(iter(results))
    fp32, fp32_cpu = results[baseline]["seconds"], results[baseline]["cpu_seconds"]
    print(
        json.dumps(
            {
                "model": args.model,
                "sequences": len(samples),
                "tokens": sum(len(s.prompt_ids) + len(s.response_ids) for s in samples),
                **{f"{k}_seconds": round(v["seconds"], 2) for k, v in results.items()},
                **{
                    f"ratio_{baseline}_over_{k}": round(fp32 / v["seconds"], 2)
                    for k, v in results.items()
                    if k != baseline
                },
                **{
                    f"cpu_ratio_{baseline}_over_{k}": round(fp32_cpu / v["cpu_seconds"], 2)
                    for k, v in results.items()
                    if k != baseline
                },
                **{f"{k}_efficiency": round(v["packing_efficiency"], 3) for k, v in results.items()},
                "losses": {k: round(v["loss"], 5) for k, v in results.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
