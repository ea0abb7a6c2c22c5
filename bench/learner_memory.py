"""What grpo.gradient_checkpointing and grpo.logit_chunk_tokens trade: one GRPO update with the policy's layer
activations kept, with them recomputed in the backward pass, and recomputed with the logits computed --chunk
positions at a time, each in a process of its own, side by side.

    .venv/bin/python bench/learner_memory.py [--model smollm2-135m-instruct|tiny-qwen3] [--sequences 4]
        [--tokens 1024] [--chunk 256] [--threads 2]

Random sequences (half prompt, half response), padded rows of --sequences per micro-batch, fp32, share_prompt off.
Prints per setting: the bytes of the tensors autograd saved for the backward pass outside recomputed regions (exact,
counted once per storage, parameters left out: what the update keeps from the forward pass besides the layer
inputs recomputation holds), the process's peak resident memory grown over the update (what the machine saw, layer
inputs included), wall and CPU seconds; then the ratios to kept. The losses agree.
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

from refiner_core.config import GRPOConfig  # noqa: E402
from refiner_core.grpo import learner_settings  # noqa: E402
from refiner_core.learners.base import TrainSample  # noqa: E402
from refiner_core.learners.torch_learner import TorchLearner, recompute_activations  # noqa: E402
from refiner_core.models import load_model, resolve_model  # noqa: E402


class SavedBytes:
    """Counts the bytes autograd saves for backward while active (each storage once, parameters left out)."""

    def __init__(self, model):
        self.parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.parameters:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.storages.values())

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


def samples(vocab: int, count: int, tokens: int) -> list[TrainSample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for k in range(count):
        ids = torch.randint(3, vocab, (tokens,), generator=g).tolist()
        half = tokens // 2
        out.append(TrainSample(ids[:half], ids[half:], 1.0 if k % 2 else -0.5, [-2.0] * (tokens - half)))
    return out


def one_update(path: str, checkpointed: bool, chunk: int, count: int, tokens: int) -> dict:
    grpo = GRPOConfig(
        learning_rate=1e-5,
        beta=0.0,
        share_prompt=False,
        micro_batch_size=count,
        gradient_checkpointing=checkpointed,
        logit_chunk_tokens=chunk,
    )
    policy = load_model(path, trainable=True)
    recompute_activations(policy, checkpointed)
    learner = TorchLearner(policy, None, 0, learner_settings(grpo, 1.0, "fp32"))
    batch = samples(policy.config.vocab_size, count, tokens)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0, c0 = time.perf_counter(), time.process_time()
    with SavedBytes(policy) as saved:
        metrics = learner.train_step(batch)
    return {
        "saved_mib": round(saved.total / 2**20, 1),
        "peak_rss_growth_mib": round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024, 1),
        "seconds": round(time.perf_counter() - t0, 2),
        "cpu_seconds": round(time.process_time() - c0, 2),
        "loss": metrics["loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="smollm2-135m-instruct", help="tiny-qwen3, smollm2-135m-instruct or a folder"
    )
    parser.add_argument("--sequences", type=int, default=4, help="sequences, all in one micro-batch")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--chunk", type=int, default=256, help="positions per chunk of logits (the third setting)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = str(resolve_model(args.model, max_position_embeddings=max(2048, args.tokens)))
    if args.child:
        chunk = args.chunk if args.child == "chunked_logits" else 0
        print(json.dumps(one_update(path, args.child != "kept", chunk, args.sequences, args.tokens)))
        return
    results = {}
    for setting in ("kept", "checkpointed", "chunked_logits"):
        cmd = [sys.executable, __file__, "--child", setting, *sys.argv[1:]]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results[setting] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{setting}: {results[setting]}", file=sys.stderr, flush=True)
    kept = results["kept"]
    ratios = {
        setting: {
            "saved": round(r["saved_mib"] / kept["saved_mib"], 3),
            "peak_rss_growth": round(r["peak_rss_growth_mib"] / kept["peak_rss_growth_mib"], 3),
            "cpu_seconds": round(r["cpu_seconds"] / kept["cpu_seconds"], 3),
            "loss_gap": abs(r["loss"] - kept["loss"]),
        }
        for setting, r in results.items()
        if setting != "kept"
    }
    shape = {"model": args.model, "sequences": args.sequences, "tokens_per_sequence": args.tokens, "chunk": args.chunk}
    print(json.dumps({**shape, **results, "to_kept": ratios}, indent=1))


if __name__ == "__main__":
    main()
