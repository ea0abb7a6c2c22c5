"""Length-sorted batching against arrival order, side by side, for judge prompts of mixed lengths.

    .venv/bin/python bench/batch_order.py [--model tiny-qwen3|smollm2-135m-instruct] [--pairs 48]

Prints seconds for each order and the ratio arrival / sorted (> 1 means sorting pays), and checks that both
orders give the same scores.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from refiner_core import REPO_ROOT
from refiner_core.data import read_jsonl
from refiner_core.judge import _transformers_judge
from refiner_core.models import resolve_model
from refiner_core.prompts import judge_messages


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-qwen3")
    parser.add_argument("--pairs", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [r.data for r in read_jsonl(REPO_ROOT / "data" / "refiner" / "samples.jsonl")]
    rng = random.Random(0)
    conversations = []
    for row in rows:  # responses of very different lengths, as sampled rollouts are
        words = row["answer"].split()
        response = " ".join(words[: rng.randint(3, len(words))])
        conversations += [judge_messages(row["question"], response, r) for r in row["positive_rubrics"]]
    conversations = conversations[: args.pairs]
    judge = _transformers_judge(str(resolve_model(args.model, max_position_embeddings=2048)),
                                {"batch_size": 8, "max_new_tokens": 4, "mode": "expected_score"})
    judge.complete(conversations[:2])  # warm-up
    seconds, outputs = {}, {}
    for label, sort in (("arrival", False), ("sorted", True)):
        judge.engine.sort_by_length = sort
        t0 = time.perf_counter()
        outputs[label] = [json.loads(o)["score"] for o in judge.complete(conversations)]
        seconds[label] = time.perf_counter() - t0
    same = max(abs(a - b) for a, b in zip(outputs["arrival"], outputs["sorted"])) < 1e-3
    print(json.dumps({"model": args.model, "pairs": len(conversations), **{f"{k}_seconds": round(v, 3) for k, v in seconds.items()},
                      "ratio_arrival_over_sorted": round(seconds["arrival"] / seconds["sorted"], 2), "same_scores": same}))


if __name__ == "__main__":
    main()
