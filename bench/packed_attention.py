"""SFT's forward and backward pass over packed rows, two ways side by side on one model: transformers' SDPA with the
block-diagonal mask it builds for a packed row (`packed_attention: mask`), and one causal SDPA per sequence
(`per_sequence`, refiner_core/learners/packed_attention.py). Same rows, same weights.

    .venv/bin/python bench/packed_attention.py [--model smollm2-135m-instruct|tiny-qwen3] [--pack 2048]
        [--sequences 4] [--rows 2] [--precision bf16|fp32] [--rounds 2] [--threads 2]

The default is the main job's SFT pack: 2048 tokens holding 4 conversations (a ~460-token prompt and its answer
each), bf16 autocast. Prints the seconds of each way per round (alternating, so a busy machine slows both), the
speed-up, and in fp32 how far apart the two ways are: the loss and the gradient (relative), and each packed
sequence's logits against the same sequence run alone (per_sequence: 0, bit for bit). Exit 1 if the fp32 loss or
gradient differ by more than 1e-4 relative, or per_sequence's packed logits are not those of the sequences alone.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from refiner_core.algo.packing import concat_pack  # noqa: E402
from refiner_core.learners.logprobs import autocast  # noqa: E402
from refiner_core.learners.packed_attention import apply_packed_attention  # noqa: E402
from refiner_core.models import load_model, resolve_model  # noqa: E402
from refiner_core.sft.train import collate_packed, summed_loss  # noqa: E402

WAYS = ("mask", "per_sequence")


def packs(vocab: int, rows: int, pack: int, sequences: int, seed: int = 0) -> list:
    """`rows` packs of `sequences` token sequences each filling most of `pack` tokens (lengths drawn ±15 %
    around an even share), the first quarter of each unlabelled like a prompt."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        share = pack // sequences
        lengths = [round(share * rng.uniform(0.85, 1.0)) for _ in range(sequences)]
        seqs = [[rng.randrange(100, vocab) for _ in range(n)] for n in lengths]
        out.append(concat_pack([(s, [k >= len(s) // 4 for k in range(len(s))]) for s in seqs]))
    return out


def fwd_bwd(model, batch, precision: str) -> tuple[float, float, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss, tokens = summed_loss(model, batch, precision)
    (loss / tokens).backward()
    seconds = time.perf_counter() - start
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return seconds, loss.item() / tokens, grad


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def alone_gap(model, row, precision: str) -> float:
    """Largest |logit| difference between the packed row and its sequences run one at a time."""
    batch = collate_packed([row], pad_id=0)
    starts = [i for i, p in enumerate(row.position_ids) if p == 0] + [len(row.position_ids)]
    with torch.no_grad(), autocast(precision, model.device):
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
        gaps = [
            (packed[a:b] - model(input_ids=batch["input_ids"][:, a:b], use_cache=False).logits[0]).abs().max()
            for a, b in zip(starts, starts[1:], strict=False)
        ]
    return float(max(gaps))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--model", default="smollm2-135m-instruct", help="tiny-qwen3, smollm2-135m-instruct or a folder"
    )
    parser.add_argument("--pack", type=int, default=2048, help="tokens per packed row (sft.pack_length)")
    parser.add_argument("--sequences", type=int, default=4, help="sequences per row")
    parser.add_argument("--rows", type=int, default=2, help="rows timed per round (micro-batches of one row)")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"), help="of the timed passes")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds of each way, alternating")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model, max_position_embeddings=max(2048, args.pack))
    models = {way: load_model(path, trainable=True) for way in WAYS}
    apply_packed_attention([models["per_sequence"]], "per_sequence")
    rows = packs(models["mask"].config.vocab_size, args.rows, args.pack, args.sequences)
    batches = [collate_packed([row], pad_id=0) for row in rows]

    fp32 = {way: fwd_bwd(models[way], batches[0], "fp32") for way in WAYS}
    loss_gap = abs(fp32["per_sequence"][1] - fp32["mask"][1]) / abs(fp32["mask"][1])
    grad_gap = relative(fp32["per_sequence"][2], fp32["mask"][2])
    gaps = {way: alone_gap(models[way], rows[0], "fp32") for way in WAYS}

    seconds = {way: [] for way in WAYS}
    for _ in range(args.rounds):
        for way in WAYS:
            seconds[way].append(sum(fwd_bwd(models[way], b, args.precision)[0] for b in batches))
    best = {way: min(s) for way, s in seconds.items()}
    report = {
        "model": args.model,
        "pack": args.pack,
        "sequences": args.sequences,
        "tokens": sum(len(r.input_ids) for r in rows),
        "precision": args.precision,
        "seconds": {way: [round(s, 2) for s in seconds[way]] for way in WAYS},
        "speedup": round(best["mask"] / best["per_sequence"], 2),
        "fp32_loss_relative_gap": loss_gap,
        "fp32_grad_relative_gap": grad_gap,
        "fp32_packed_vs_alone_max_logit_gap": gaps,
    }
    print(json.dumps(report))
    failed = loss_gap > 1e-4 or grad_gap > 1e-4 or gaps["per_sequence"] != 0.0
    if failed:
        print(
            "FAIL: the two ways disagree beyond rounding, or per_sequence's packed logits differ from the "
            "sequences alone",
            file=sys.stderr,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
