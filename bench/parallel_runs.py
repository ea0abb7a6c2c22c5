"""Two runs on one machine at once: torch's default threads (one per core, in each run) against one thread each.

Starts two `refiner run RECIPE --refresh` children side by side, each in a new folder, both reporting to one
temporary Prefect server started here (so its start-up is timed in neither), and waits for both. Rounds alternate
the two settings; the second sets OMP_NUM_THREADS=1 in both children, as tests/conftest.py's `run_cli` does for
the run children of the test suite, whose pytest-xdist workers (one per core) wait on them while the other worker's
test runs beside them. Prints each round's wall seconds and one-thread / default: below 1 means one thread each
is faster.

    .venv/bin/python bench/parallel_runs.py                 # tiny recipe, 2 rounds
    .venv/bin/python bench/parallel_runs.py --runs 1        # one run alone: what the default threads are for

A single run on an idle machine is what torch's default suits; with as many runs (or workers) as cores, each
run's OpenMP threads contend with the others' (docs/benchmarks.md, "The test suite"). `run.num_threads` sets
it per recipe for the flow process.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flows.prefect_server import start_temporary_server, stop_temporary_server  # noqa: E402

SETTINGS = {"default threads": {}, "one thread each": {"OMP_NUM_THREADS": "1"}}


def side_by_side(recipe: str, folder: Path, runs: int, env: dict) -> float:
    """Wall seconds of `runs` children of `refiner run --refresh` started at once; exits on a failed run."""
    children = []
    t0 = time.perf_counter()
    for i in range(runs):
        cmd = [sys.executable, "-m", "flows.cli", "run", recipe, "--run-dir", str(folder / f"run{i}"), "--refresh"]
        log = open(folder / f"run{i}.log", "w")
        children.append((subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    codes = [proc.wait() for proc, _ in children]
    wall = time.perf_counter() - t0
    for _, log in children:
        log.close()
    if any(codes):
        failed = next(i for i, c in enumerate(codes) if c)
        sys.exit(f"run {failed} failed ({codes[failed]}):\n{(folder / f'run{failed}.log').read_text()[-3000:]}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "tiny.yaml"))
    parser.add_argument("--runs", type=int, default=2, help="runs started at once")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each setting, alternating")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="parallel-runs-"))
    os.environ.pop("OMP_NUM_THREADS", None)
    os.environ["PREFECT_HOME"] = str(work / "prefect")  # the server's database and the runs' settings
    base = dict(os.environ)
    server, api_url = start_temporary_server(work / "server")
    walls: dict[str, list[float]] = {name: [] for name in SETTINGS}
    try:
        for round_ in range(args.rounds):
            for name, extra in SETTINGS.items():
                folder = work / f"{name.replace(' ', '-')}-{round_}"
                folder.mkdir()
                env = {**base, **extra, "PREFECT_API_URL": api_url}
                walls[name].append(side_by_side(args.recipe, folder, args.runs, env))
                print(f"round {round_}: {args.runs} run(s) at once, {name}: {walls[name][-1]:.1f} s", flush=True)
    finally:
        stop_temporary_server(server, work / "server")
        shutil.rmtree(work, ignore_errors=True)
    default, one = (statistics.median(walls[name]) for name in SETTINGS)
    print(
        f"{os.cpu_count()} cores, {args.runs} run(s) at once, median of {args.rounds}: default threads "
        f"{default:.1f} s, one thread each {one:.1f} s; one thread / default = {one / default:.2f}"
    )


if __name__ == "__main__":
    main()
