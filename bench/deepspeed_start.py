"""The DeepSpeed learner's first launch on CPU in a new environment (a fresh clone, a CI machine: nothing in
TORCH_EXTENSIONS_DIR), side by side in one command with the op its ranks no longer compile.

DeepSpeed's CPU backend builds its shared-memory all-reduce (`ShareMemCommBuilder`) as each process group opens,
for its inference all-reduce only; the ranks mark it unavailable (refiner_core/learners/deepspeed_worker.py).
Each round times, each into its own empty extensions folder: that op's build alone (what every first launch
paid before), then a launch of the ranks with one GRPO train step and the close (what it pays now).

    .venv/bin/python bench/deepspeed_start.py                   # tiny model, 2 ranks, ZeRO-3, 2 rounds
    .venv/bin/python bench/deepspeed_start.py --ranks 1 --rounds 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BUILD_OP = (
    "from deepspeed.accelerator import get_accelerator\n"
    "get_accelerator().create_op_builder('ShareMemCommBuilder').load()\n"
)


def op_build_seconds(extensions: Path) -> float:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(extensions)}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", BUILD_OP], env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def launch_seconds(model: str, tokenizer, samples, ranks: int, extensions: Path) -> tuple[float, list[str]]:
    """A launch, one train step and the close; what it left in the extensions folder."""
    from refiner_core.config import DeepSpeedConfig, GRPOConfig
    from refiner_core.grpo import learner_settings
    from refiner_core.learners.deepspeed_learner import make_deepspeed_learner

    grpo = GRPOConfig(learning_rate=1e-3, micro_batch_size=2, deepspeed=DeepSpeedConfig(zero_stage=3, world_size=ranks))
    os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions)
    start = time.perf_counter()
    learner = make_deepspeed_learner(model, model, tokenizer, learner_settings(grpo, 1.0, "fp32"), None)
    try:
        learner.train_step(samples)
    finally:
        learner.close()
    built = sorted(p.name for p in extensions.iterdir()) if extensions.exists() else []
    return time.perf_counter() - start, built


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="DeepSpeed ranks on this machine")
    p.add_argument("--rounds", type=int, default=2, help="rounds of (the op's build, a launch)")
    args = p.parse_args()

    import torch

    from refiner_core.learners.base import TrainSample
    from refiner_core.models import load_tokenizer, resolve_model

    model = str(resolve_model("tiny-qwen3"))
    tokenizer = load_tokenizer(model)
    g = torch.Generator().manual_seed(0)
    samples = [
        TrainSample(
            torch.randint(3, 2000, (12,), generator=g).tolist(),
            torch.randint(3, 2000, (8,), generator=g).tolist(),
            adv,
            [-7.0] * 8,
        )
        for adv in (1.0, -1.0, 0.5, -0.5)
    ]
    builds, launches = [], []
    with tempfile.TemporaryDirectory(prefix="deepspeed-start-") as tmp:
        for r in range(args.rounds):
            builds.append(op_build_seconds(Path(tmp) / f"build-{r}"))
            seconds, built = launch_seconds(model, tokenizer, samples, args.ranks, Path(tmp) / f"launch-{r}")
            launches.append(seconds)
            print(
                f"round {r + 1}: the op's build {builds[-1]:.1f} s, a launch now {seconds:.1f} s, it compiled "
                f"{built or 'nothing'}",
                file=sys.stderr,
            )
    build, launch = statistics.median(builds), statistics.median(launches)
    print(
        f"{args.ranks} rank(s), ZeRO-3, first launch + one train step in a new environment (median of "
        f"{args.rounds}): now {launch:.1f} s; before, the same plus the op's build {build:.1f} s = "
        f"{launch + build:.1f} s; now / before = {launch / (launch + build):.2f}"
    )


if __name__ == "__main__":
    main()
