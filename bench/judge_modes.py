"""Judge cost: 'json' (generate + parse) against 'expected_score' (one forward pass), side by side.

    .venv/bin/python bench/judge_modes.py [--model tiny-qwen3|smollm2-135m-instruct] [--pairs 32]

Prints seconds per mode and the ratio json / expected_score (absolute times on a shared box are noise;
the ratio is the number to compare).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from refiner_core.data import read_jsonl
from refiner_core.judge import _transformers_judge
from refiner_core.models import resolve_model
from refiner_core.prompts import judge_messages
from refiner_core import REPO_ROOT


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-qwen3")
    parser.add_argument("--pairs", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [r.data for r in read_jsonl(REPO_ROOT / "data" / "refiner" / "samples.jsonl")]
    conversations = []
    for row in rows:
        for rubric in row["positive_rubrics"] + row["negative_rubrics"]:
            conversations.append(judge_messages(row["question"], row["answer"], rubric))
    conversations = conversations[: args.pairs]
    path = resolve_model(args.model, max_position_embeddings=2048)
    results = {}
    for mode in ("json", "expected_score"):
        judge = _transformers_judge(str(path), {"batch_size": 16, "max_new_tokens": 8, "mode": mode})
        judge.complete(conversations[:2])  # warm-up
        t0 = time.perf_counter()
        judge.complete(conversations)
        results[mode] = time.perf_counter() - t0
    print(json.dumps({"model": args.model, "pairs": len(conversations),
                      **{f"{k}_seconds": round(v, 3) for k, v in results.items()},
                      "ratio_json_over_expected": round(results["json"] / results["expected_score"], 2)}))


if __name__ == "__main__":
    main()
