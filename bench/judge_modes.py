"""Judge cost: 'json' (prefilled, generate + parse) against 'expected_score' (one forward pass), side by side.

    .venv/bin/python bench/judge_modes.py [--model tiny-qwen3|smollm2-135m-instruct] [--pairs 32]

Prints seconds per mode and the ratio json / expected_score.
"""

from __future__ import annotations

import json
import time

from common import setup

from refiner_core.config import JudgeConfig
from refiner_core.judges.transformers_judge import make_transformers_judge


def main() -> None:
    args, path, conversations = setup(default_pairs=32)
    seconds = {}
    for mode in ("json", "expected_score"):
        judge = make_transformers_judge(path, JudgeConfig(batch_size=16, max_new_tokens=8, mode=mode))
        judge.complete(conversations[:2])  # warm-up
        t0 = time.perf_counter()
        judge.complete(conversations)
        seconds[mode] = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "model": args.model,
                "pairs": len(conversations),
                **{f"{k}_seconds": round(v, 3) for k, v in seconds.items()},
                "ratio_json_over_expected": round(seconds["json"] / seconds["expected_score"], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
