"""Length-sorted batching against arrival order, side by side, for judge prompts of mixed lengths.

    .venv/bin/python bench/batch_order.py [--model tiny-qwen3|smollm2-135m-instruct] [--pairs 48]

Prints seconds for each order and the ratio arrival / sorted (> 1 means sorting pays), and checks that both
orders give the same scores.
"""

from __future__ import annotations

import json
import time

from common import setup

from refiner_core.config import JudgeConfig
from refiner_core.judges.transformers_judge import make_transformers_judge


def main() -> None:
    args, path, conversations = setup(default_pairs=48)
    judge = make_transformers_judge(
        path, JudgeConfig(batch_size=8, max_new_tokens=4, mode="expected_score", share_prefix=False)
    )  # plain batches: the order is what is measured
    judge.complete(conversations[:2])  # warm-up
    seconds, scores = {}, {}
    for label, sort in (("arrival", False), ("sorted", True)):
        judge.engine.sort_by_length = sort
        t0 = time.perf_counter()
        scores[label] = [json.loads(o)["score"] for o in judge.complete(conversations)]
        seconds[label] = time.perf_counter() - t0
    same = max(abs(a - b) for a, b in zip(scores["arrival"], scores["sorted"])) < 1e-3
    print(
        json.dumps(
            {
                "model": args.model,
                "pairs": len(conversations),
                **{f"{k}_seconds": round(v, 3) for k, v in seconds.items()},
                "ratio_arrival_over_sorted": round(seconds["arrival"] / seconds["sorted"], 2),
                "same_scores": same,
            }
        )
    )


if __name__ == "__main__":
    main()
