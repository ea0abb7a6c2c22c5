"""Steps per hour, synchronous vs sampled one step ahead (grpo.async_steps 1), with a remote judge.

The tiny recipe with the OpenAI-compatible judge behind a loopback server that answers every request after
--latency seconds (tests/fault_server.py, faults off; judge.openai.cache off, so every run asks). With async_steps 1 the
rollout of step N+1 runs while step N is judged and trained. Every flow runs in this process against one temporary
Prefect server, each into a new run folder (no cache hit). Steps per hour count the step loop only: from the start
of the first rollout to the end of the last grpo-update (Prefect's task runs).

    .venv/bin/python bench/async_steps.py                          # hf engine, 4 steps, 1 s judge latency
    .venv/bin/python bench/async_steps.py --engine vllm --steps 6 --latency 2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
from prefect_home import use_own_prefect_home  # noqa: E402

use_own_prefect_home("async-steps-bench")  # before prefect is imported


def step_loop_seconds(flow_run_id) -> float:
    """From the first rollout's start to the last grpo-update's end."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])), limit=200)
    starts = [r.start_time for r in runs if r.name.startswith("rollout[") and r.start_time]
    ends = [r.end_time for r in runs if r.name.startswith("grpo-update[") and r.end_time]
    return (max(ends) - min(starts)).total_seconds()


def measure(recipe: dict, ahead: int, steps: int, run_dir: Path) -> float:
    """Steps per hour of one run."""
    from flows.refiner import refiner_pipeline

    run = {**recipe, "grpo": {**recipe["grpo"], "steps": steps, "async_steps": ahead}}
    state = refiner_pipeline(recipe=run, run_dir=str(run_dir), return_state=True)
    if not state.is_completed():
        sys.exit(f"async_steps {ahead}: the run failed: {state.message}")
    return steps * 3600 / step_loop_seconds(state.state_details.flow_run_id)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", default="hf", choices=("hf", "vllm"))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--latency", type=float, default=1.0, help="seconds the judge server takes per request")
    p.add_argument("--tis-cap", type=float, default=2.0, help="grpo.tis_cap of both runs")
    args = p.parse_args()

    import torch
    from prefect.testing.utilities import prefect_test_harness

    from fault_server import FaultServer
    from refiner_core.config import load_recipe

    with (
        FaultServer(latency=args.latency, faults=False) as server,
        prefect_test_harness(server_startup_timeout=180),
        tempfile.TemporaryDirectory(prefix="runs-") as root,
    ):
        recipe = load_recipe(
            REPO / "recipes" / "tiny.yaml",
            [
                f"rollout.engine={args.engine}",
                "judge.engine=openai",
                f"judge.openai.base_url={server.base_url}",
                "judge.openai.api_model=fault-judge",
                "judge.mode=json",
                "judge.openai.cache=false",
                "eval.every=0",
                f"grpo.tis_cap={args.tis_cap}",
            ],
        ).to_dict()
        measure(recipe, 0, 1, Path(root) / "warm-up")  # imports, the tiny model, the first flow
        sync = measure(recipe, 0, args.steps, Path(root) / "sync")
        print(f"  async_steps 0: {sync:.0f} steps/h", flush=True)
        ahead = measure(recipe, 1, args.steps, Path(root) / "async")
        print(f"  async_steps 1: {ahead:.0f} steps/h", flush=True)
        requests = server.requests

    print(
        f"\ntiny recipe, rollout.engine {args.engine}, {args.steps} steps, judge latency {args.latency} s per "
        f"request ({requests} requests), {torch.get_num_threads()} torch threads"
    )
    print(f"steps per hour: sync {sync:.0f}, async_steps 1 {ahead:.0f}, ratio {ahead / sync:.2f}x")


if __name__ == "__main__":
    main()
