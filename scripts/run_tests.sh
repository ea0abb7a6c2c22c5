#!/usr/bin/env bash
# Set up (if needed) and run the test suite, one pytest worker per core (a test file stays on one worker, so its
# module fixtures run once). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -n auto --dist loadfile "$@"
