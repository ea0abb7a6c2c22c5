"""The default model.precision ('auto') against fp32 on one recipe, side by side in one command.

`refiner run RECIPE --refresh` into a new folder twice: with the recipe's own precision (the default 'auto': bf16
where the hardware computes it natively, else fp32), then with `--set model.precision=fp32`. The judge and update
stages run their forward (and backward) passes under that precision; their wall seconds come from the steps table,
summed over the run's steps. Prints the CPU's capability, what 'auto' resolved to (RUN_DIR/recipe.yaml and the
run's "precision: ..." line) and default / fp32 per stage: below 1 means the default is faster.

    .venv/bin/python bench/precision_default.py --repeats 2             # tiny recipe, 2 steps; runs alternate
    .venv/bin/python bench/precision_default.py --set model.policy=smollm2-135m-instruct --set grpo.steps=1

bf16 does not pay on the tiny Qwen3 (hidden size 64): fp32 was faster there even on a CPU with AVX-512 BF16, while
SmolLM2-135M at the same recipe shapes was 3.6x faster under the default (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from refiner_core.runtime.hardware import cpu_bf16_features, cpuinfo_flags, native_bf16  # noqa: E402
from refiner_core.store.storage import query  # noqa: E402

PRECISION_LINE = re.compile(r"precision: \w+ \([^\n]*\)")
STAGES = ("rollout_seconds", "judge_seconds", "update_seconds")


def timed_run(recipe: str, run_dir: Path, overrides: list[str], env: dict) -> dict:
    """One `refiner run --refresh` (every stage computed): stage seconds summed over steps, the precision recorded
    in recipe.yaml, the run's precision line and its wall seconds."""
    cmd = [str(REPO / ".venv" / "bin" / "refiner"), "run", recipe, "--run-dir", str(run_dir), "--refresh"]
    for item in overrides:
        cmd += ["--set", item]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"refiner run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    sums = ", ".join(f"sum({s})" for s in STAGES)
    (totals,) = query(run_dir / "catalog.duckdb", f"SELECT {sums}, count(*) FROM steps")[1]
    line = PRECISION_LINE.search(done.stderr)
    return {
        **dict(zip(STAGES, totals[:3])),
        "steps": totals[3],
        "wall": wall,
        "line": line.group(0) if line else "?",
        "recorded": yaml.safe_load((run_dir / "recipe.yaml").read_text())["model"]["precision"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default=str(REPO / "recipes" / "tiny.yaml"))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--repeats", type=int, default=1, help="runs per side (alternating); medians are compared")
    args = p.parse_args()

    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo_flags(cpuinfo.read_text()) if cpuinfo.exists() else set()
    print(
        f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}; /proc/cpuinfo avx512_bf16 "
        f"{'avx512_bf16' in flags}, amx_bf16 {'amx_bf16' in flags}; torch probes: {cpu_bf16_features() or 'none'}; "
        f"native bf16: {native_bf16()}",
        flush=True,
    )
    sides = {"default": [], "fp32": []}
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    with tempfile.TemporaryDirectory(prefix="precision-default-") as tmp:
        env["PREFECT_HOME"] = str(Path(tmp) / "prefect-home")
        for i in range(args.repeats):
            for side, extra in (("default", []), ("fp32", ["model.precision=fp32"])):
                result = timed_run(args.recipe, Path(tmp) / f"{side}-{i}", args.overrides + extra, env)
                print(f"{side}: {result}", flush=True)
                sides[side].append(result)

    median = {
        side: {k: statistics.median(r[k] for r in runs) for k in (*STAGES, "wall")} for side, runs in sides.items()
    }
    for m in median.values():
        m["judge+update"] = m["judge_seconds"] + m["update_seconds"]
    print(
        f"\nrecipe {Path(args.recipe).name} {' '.join(args.overrides)}; {sides['default'][0]['steps']} steps, "
        f"{args.repeats} run(s) per side; default resolved to {sides['default'][0]['recorded']!r}: "
        f"{sides['default'][0]['line']}"
    )
    print(f"{'seconds (sum over steps)':<26} {'default':>9} {'fp32':>9} {'default/fp32':>13}")
    for key in ("rollout_seconds", "judge_seconds", "update_seconds", "judge+update", "wall"):
        d, f = median["default"][key], median["fp32"][key]
        print(f"{key:<26} {d:>9.2f} {f:>9.2f} {d / f:>13.2f}")


if __name__ == "__main__":
    main()
