#!/usr/bin/env bash
# Set up (if needed) and run the test suite on one pytest worker more than there are cores (a test file stays on
# one worker, so its module fixtures run once): workers wait on their child processes, servers and schedules, and
# with one per core an eighth of the cores' time sat idle; the extra worker fills it
# (docs/benchmarks.md#the-test-suite). A worker peaks near 3.5 GiB, so there is at most one per 4 GiB of available
# memory. Extra arguments go to pytest (a `-n N` among them sets the workers).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
workers=$(($(nproc) + 1))
available_kib=$(free -k 2>/dev/null | awk '/^Mem:/ {print $7}')
if [[ -n "$available_kib" ]]; then  # without procps' free, no memory cap
    by_memory=$((available_kib / 1048576 / 4))
    workers=$((workers < by_memory ? workers : by_memory))
    workers=$((workers > 1 ? workers : 1))
fi
exec .venv/bin/python -m pytest -n "$workers" --dist loadfile "$@"
