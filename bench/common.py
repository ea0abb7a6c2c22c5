"""Shared set-up for the judge benchmarks: arguments, threads, and judge conversations from the sample data."""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from refiner_core import REPO_ROOT  # noqa: E402
from refiner_core.data.prompts import judge_messages  # noqa: E402
from refiner_core.data.rows import read_jsonl  # noqa: E402
from refiner_core.models import resolve_model  # noqa: E402


def setup(default_pairs: int) -> tuple[argparse.Namespace, str, list[list[dict]]]:
    """Parse --model/--pairs/--threads, set torch threads, resolve the model; returns (args, model path,
    conversations). Responses are cut to random lengths, as sampled rollouts are."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-qwen3", help="tiny-qwen3, smollm2-135m-instruct or a folder")
    parser.add_argument("--pairs", type=int, default=default_pairs, help="(response, rubric) pairs to judge")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    conversations = []
    for raw in read_jsonl(REPO_ROOT / "data" / "refiner" / "samples.jsonl"):
        row = raw.data
        words = row["answer"].split()
        response = " ".join(words[: rng.randint(3, len(words))])
        conversations += [
            judge_messages(row["question"], response, r) for r in row["positive_rubrics"] + row["negative_rubrics"]
        ]
    return args, str(resolve_model(args.model, max_position_embeddings=2048)), conversations[: args.pairs]
