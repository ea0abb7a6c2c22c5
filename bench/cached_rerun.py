"""A cached rerun's wall time as a fraction of the fresh run's, side by side in one command.

`refiner run RECIPE` into a new folder (fresh), then the same command again (every stage `Cached`), each timed
end to end as a user runs it: a child process, imports, Prefect's API, the cache checks, the catalog publish.
Two ways to reach Prefect's API are measured:
  temporary  each `refiner run` starts its own server (the default when PREFECT_API_URL is unset)
  running    a server that is already up (`prefect server start`, a worker's server): PREFECT_API_URL is set
Target: cached rerun <= 5 % of the fresh run. The fixed cost of a rerun (seconds) does not grow with the run,
so the fraction depends on the run's size: the tiny recipe (about a minute fresh) is the hardest case.

    .venv/bin/python bench/cached_rerun.py                                    # tiny recipe, both servers
    .venv/bin/python bench/cached_rerun.py --recipe recipes/refiner-smollm2.yaml --server running
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flows.prefect_server import start_temporary_server, stop_temporary_server  # noqa: E402

STAGE_STATE = re.compile(r"Task run '([^']+)' - Finished in state (\w+)")
NEVER_CACHED = ("publish-catalog", "prune-checkpoints", "locate-model")  # cheap bookkeeping, run every time


def timed_run(recipe: str, run_dir: Path, overrides: list[str], env: dict) -> tuple[float, dict[str, str]]:
    """Wall seconds of one `refiner run`, and the final state of each task run it logged."""
    cmd = [str(REPO / ".venv" / "bin" / "refiner"), "run", recipe, "--run-dir", str(run_dir)]
    for item in overrides:
        cmd += ["--set", item]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"refiner run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds, dict(STAGE_STATE.findall(done.stderr))


def measure(recipe: str, overrides: list[str], env: dict, label: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="cached-rerun-") as tmp:
        run_dir = Path(tmp) / "run"
        fresh, _ = timed_run(recipe, run_dir, overrides, env)
        cached, states = timed_run(recipe, run_dir, overrides, env)
    stages = {name: state for name, state in states.items() if not name.startswith(NEVER_CACHED)}
    recomputed = sorted(name for name, state in stages.items() if state != "Cached")
    return {"server": label, "fresh": fresh, "cached": cached, "stages": len(stages), "recomputed": recomputed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default=str(REPO / "recipes" / "tiny.yaml"))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--server", choices=("temporary", "running", "both"), default="both")
    args = p.parse_args()

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    results = []
    with tempfile.TemporaryDirectory(prefix="cached-rerun-home-") as home:
        env["PREFECT_HOME"] = home
        if args.server in ("temporary", "both"):
            results.append(measure(args.recipe, args.overrides, env, "temporary"))
        if args.server in ("running", "both"):
            os.environ["PREFECT_HOME"] = home
            server, url = start_temporary_server(Path(home) / "procs")
            try:
                results.append(measure(args.recipe, args.overrides, {**env, "PREFECT_API_URL": url}, "running"))
            finally:
                stop_temporary_server(server, Path(home) / "procs")

    print(f"recipe {Path(args.recipe).name} {' '.join(args.overrides)}")
    print(f"{'server':<10} {'fresh s':>8} {'cached s':>9} {'cached/fresh':>13}  stages cached")
    for r in results:
        cached_stages = r["stages"] - len(r["recomputed"])
        print(
            f"{r['server']:<10} {r['fresh']:>8.1f} {r['cached']:>9.1f} {r['cached'] / r['fresh']:>12.1%}  "
            f"{cached_stages}/{r['stages']}"
            + (f" (recomputed: {', '.join(r['recomputed'])})" if r["recomputed"] else "")
        )
    if any(r["recomputed"] for r in results):
        sys.exit(1)  # a rerun that recomputes is not a cached rerun


if __name__ == "__main__":
    main()
