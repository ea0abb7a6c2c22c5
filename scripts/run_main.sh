#!/usr/bin/env bash
# Set up (if needed) and run the main job: the refiner pipeline on SmolLM2-135M-Instruct, an SFT warm start,
# 6 GRPO steps, and the held-out eval table of the base model, the SFT checkpoint and GRPO steps 3 and 6.
# Extra arguments go to `refiner run`, e.g. --set grpo.steps=3 or --run-dir /tmp/my-run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/refiner run recipes/refiner-smollm2.yaml "$@"
