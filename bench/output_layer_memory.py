"""What grpo.logit_chunk_tokens costs and saves in the output layer alone: log-probs and entropies of --rows x
--positions targets through the output layer and the log-softmax, forward and backward, with the logits whole
(autograd over torch's own ops, as the learner computes them without chunks) and a chunk of positions at a time
(ChunkedOutputScores), each in a process of its own, side by side.

    .venv/bin/python bench/output_layer_memory.py [--rows 4] [--positions 1024] [--vocab 49152] [--hidden 576]
        [--chunks 1024 256] [--threads 2]

Random bf16-autocast inputs at SmolLM2's shape by default (V = 49152, h = 576; Qwen3's V is 151936). Prints per
setting the process's peak resident memory grown over one forward and backward, its CPU seconds and the largest
gap of a corner of the hidden states' gradient to the whole logits', then the ratios to the whole logits.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from refiner_core.learners.logprobs import ChunkedOutputScores, _scores  # noqa: E402


def one_pass(rows: int, positions: int, vocab: int, hidden_size: int, chunk: int) -> dict:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, positions, hidden_size, generator=g, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size, generator=g) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (rows, positions), generator=g)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.process_time()
    if chunk:
        logp, entropy = ChunkedOutputScores.apply(hidden, weight, None, targets, 0.7, True, chunk, torch.bfloat16)
    else:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = torch.nn.functional.linear(hidden, weight)
        logp, entropy = _scores(logits, targets, 0.7, True)
    (logp.sum() + 0.1 * entropy.sum()).backward()
    return {
        "peak_rss_growth_mib": round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024, 1),
        "cpu_seconds": round(time.process_time() - t0, 4),
        "grad": hidden.grad[0, :8, :8].flatten().tolist(),  # a corner of the hidden states' gradient
    }


RATIOS = {"peak_rss_growth": "peak_rss_growth_mib", "cpu_seconds": "cpu_seconds"}


def _ratio(value: float, baseline: float) -> float | None:
    """value / baseline, None where the baseline measured nothing (a shape too small to grow the process)."""
    return round(value / baseline, 3) if baseline > 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4, help="sequences in the micro-batch")
    parser.add_argument("--positions", type=int, default=1024, help="scored positions per sequence")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1024, 256], help="positions per chunk")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child >= 0:
        print(json.dumps(one_pass(args.rows, args.positions, args.vocab, args.hidden, args.child)))
        return
    results = {}
    for chunk in (0, *args.chunks):
        cmd = [sys.executable, __file__, "--child", str(chunk), *sys.argv[1:]]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results["whole" if chunk == 0 else f"chunks_of_{chunk}"] = json.loads(done.stdout.strip().splitlines()[-1])
    whole = results["whole"]
    reference = whole["grad"]
    for name, r in results.items():
        r["grad_gap"] = max(abs(a - b) for a, b in zip(r.pop("grad"), reference))
        print(f"{name}: {r}", file=sys.stderr, flush=True)
    ratios = {
        name: {figure: _ratio(r[key], whole[key]) for figure, key in RATIOS.items()}
        for name, r in results.items()
        if name != "whole"
    }
    shape = {"rows": args.rows, "positions": args.positions, "vocab": args.vocab, "hidden": args.hidden}
    print(json.dumps({**shape, **results, "to_whole": ratios}, indent=1))


if __name__ == "__main__":
    main()
