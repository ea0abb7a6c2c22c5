"""The garbage collector's share of a run, with the heap as it is and frozen once the libraries are imported
(refiner_core/runtime/heap.py, as `refiner run` and each DeepSpeed rank do), side by side in one process.

Every flow runs in this process against one temporary Prefect server, each into a new run folder (no cache hit):
a warm-up run first (imports, the model, Prefect's first flow), then unfrozen and frozen runs taking turns
(`gc.unfreeze()` between them). GC seconds are summed from `gc.callbacks`.

    .venv/bin/python bench/heap_freeze.py                        # tiny recipe, 2 steps, 2 runs of each
    .venv/bin/python bench/heap_freeze.py --repeats 3 --set grpo.steps=3
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from prefect_home import use_own_prefect_home  # noqa: E402

use_own_prefect_home("heap-freeze-bench")  # before prefect is imported


class CollectorClock:
    """Seconds spent in collections, and how many were full (generation 2), while `gc.callbacks` holds it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._start
        self.full += info["generation"] == 2


def measure(recipe: dict, run_dir: Path) -> dict:
    from flows.refiner import refiner_pipeline

    clock = CollectorClock()
    gc.callbacks.append(clock)
    start = time.perf_counter()
    try:
        state = refiner_pipeline(recipe=recipe, run_dir=str(run_dir), return_state=True)
    finally:
        gc.callbacks.remove(clock)
    wall = time.perf_counter() - start
    if not state.is_completed():
        sys.exit(f"the run in {run_dir} failed: {state.message}")
    return {"wall": wall, "gc": clock.seconds, "full": clock.full, "tracked": len(gc.get_objects())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default=str(REPO / "recipes" / "tiny.yaml"))
    p.add_argument("--set", dest="overrides", action="append", default=[], help="section.field=value (repeatable)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each kind, taking turns")
    args = p.parse_args()

    from prefect.testing.utilities import prefect_test_harness

    from refiner_core.config import load_recipe
    from refiner_core.runtime.heap import freeze_heap

    recipe = load_recipe(Path(args.recipe), args.overrides).to_dict()
    rows: dict[str, list[dict]] = {"as is": [], "frozen": []}
    with prefect_test_harness(server_startup_timeout=180), tempfile.TemporaryDirectory(prefix="runs-") as root:
        measure(recipe, Path(root) / "warm-up")
        for k in range(args.repeats):
            for kind in rows:
                gc.unfreeze()
                if kind == "frozen":
                    freeze_heap()
                rows[kind].append(measure(recipe, Path(root) / f"{kind.replace(' ', '-')}-{k}"))
                r = rows[kind][-1]
                print(f"  {kind:7s} run {k}: {r['wall']:6.1f} s, GC {r['gc']:5.2f} s ({r['full']} full)", flush=True)
    gc.unfreeze()

    print(f"\n{Path(args.recipe).name} {' '.join(args.overrides)}; mean of {args.repeats} runs each")
    print(f"{'heap':8s} {'wall s':>7s} {'GC s':>6s} {'full GCs':>8s} {'objects walked':>15s}")
    for kind, runs in rows.items():
        print(
            f"{kind:8s} {statistics.mean(r['wall'] for r in runs):7.1f} {statistics.mean(r['gc'] for r in runs):6.2f}"
            f" {statistics.mean(r['full'] for r in runs):8.1f} {statistics.mean(r['tracked'] for r in runs):15,.0f}"
        )
    before, after = (statistics.mean(r["wall"] for r in rows[k]) for k in rows)
    print(f"frozen / as is wall: {after / before:.2f}")


if __name__ == "__main__":
    main()
