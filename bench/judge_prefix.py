"""Judge (expected_score) with the shared prompt prefix read once per response, against plain batches.

    .venv/bin/python bench/judge_prefix.py [--model tiny-qwen3|smollm2-135m-instruct] [--pairs 56]

Prints seconds for each and the ratio plain / shared (> 1 means sharing pays), and checks the scores agree.
"""

from __future__ import annotations

import json
import time

from common import setup

from refiner_core.config import JudgeConfig
from refiner_core.judges.transformers_judge import make_transformers_judge


def main() -> None:
    args, path, conversations = setup(default_pairs=56)
    judge = make_transformers_judge(path, JudgeConfig(batch_size=16, max_new_tokens=4, mode="expected_score"))
    judge.complete(conversations[:2])  # warm-up
    seconds, scores = {}, {}
    for label, share in (("plain", False), ("shared", True)):
        judge.share_prefix = share
        t0 = time.perf_counter()
        scores[label] = [json.loads(o)["score"] for o in judge.complete(conversations)]
        seconds[label] = time.perf_counter() - t0
    diff = max(abs(a - b) for a, b in zip(scores["plain"], scores["shared"]))
    print(
        json.dumps(
            {
                "model": args.model,
                "pairs": len(conversations),
                **{f"{k}_seconds": round(v, 3) for k, v in seconds.items()},
                "ratio_plain_over_shared": round(seconds["plain"] / seconds["shared"], 2),
                "max_score_difference": round(diff, 5),
            }
        )
    )


if __name__ == "__main__":
    main()
