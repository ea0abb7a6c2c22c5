#!/usr/bin/env bash
# What each device `run` call of the GPU check runs on the GPU machine (docs/engines.md, "GPU check"). The wheels
# travel in parts made by scripts/gpu_wheels.sh, one part per call (carry [".whl/parts/K"]), collected under /tmp,
# which lasts while the machine stays warm between calls (about 30 s: make the calls back to back).
#
#   bash scripts/gpu_check_remote.sh receive K     # keep part K (the first call also records the machine); exits 4
#                                                  # when an earlier part is gone (the machine was replaced)
#   bash scripts/gpu_check_remote.sh check [ARGS]  # keep the last part, install everything, run bench/gpu_check.py
#
# check verifies the parts against SHA256, installs the wheels into /tmp/site (pip --no-deps --target, as the
# machine's notes say), then runs the check with a time budget that ends inside the call's 600 s, teeing its JSON
# lines to $OUT/gpu_check.jsonl and the parts' logs to $OUT. Each check writes into a new folder under
# /tmp/gpu-check (the wheels live elsewhere), so a rerun on the warm machine starts its parts afresh.
set -euo pipefail
cd "$(dirname "$0")/.."
began=$(date +%s)
STORE=/tmp/gpu-check-wheels
OUT=${OUT:-/tmp/gpu-check-out}
mkdir -p "$STORE" "$OUT"

receive() {  # $1: the part's number when known (receive K)
  local found=0 k
  if [ "${1:-}" = 1 ]; then rm -f "$STORE"/wheels.tar.* "$STORE"/SHA256; fi  # a warm machine's older parts
  if [ -n "${1:-}" ] && [ "$1" -gt 1 ]; then
    for (( k = 0; k < $1 - 1; k++ )); do
      [ -e "$STORE/wheels.tar.$k" ] || {
        echo "part $((k + 1)) is not on this machine: it was replaced since (idle over about 30 s);" \
          "start again with receive 1" >&2
        exit 4
      }
    done
  fi
  for part in .whl/parts/*/wheels.tar.*; do
    [ -e "$part" ] || continue
    cp "$part" "$STORE/" && found=1
    echo "kept $(basename "$part") ($(du -m "$part" | cut -f1) MiB)"
  done
  for sums in .whl/parts/*/SHA256; do [ -e "$sums" ] && cp "$sums" "$STORE/"; done
  [ "$found" = 1 ] || { echo "no part carried: name .whl/parts/K in the run's carry" >&2; exit 2; }
  ls -l "$STORE"
}

machine() {  # once: what the machine is (costs a second)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  python3 -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)" \
    || true
  python3 -m pip list 2>/dev/null | grep -i -E "^(torch|transformers|triton|numpy|pyarrow|huggingface.hub|anyio|httpx|httpcore|click|rich|typer|uvloop|protobuf|jinja2|peft|accelerate|safetensors|tokenizers|typing.extensions|packaging|pyyaml|attrs|psutil|msgpack|einops|ninja|py-cpuinfo|cloudpickle) " || true
}

case "${1:-}" in
  receive)
    receive "${2:-}"
    if [ "${2:-}" = 1 ]; then machine | tee "$OUT/machine.txt"; fi
    ;;
  check)
    shift
    receive
    expected=$(cat "$STORE/SHA256")
    cat "$STORE"/wheels.tar.* > /tmp/gpu-check-wheels.tar
    actual=$(sha256sum /tmp/gpu-check-wheels.tar | cut -d' ' -f1)
    if [ "$expected" != "$actual" ]; then
      echo "the parts do not add up (sha256 $actual, expected $expected): a part is missing or the machine was" \
        "replaced between calls; send them again" >&2
      ls -l "$STORE" >&2
      exit 3
    fi
    mkdir -p /tmp/gpu-check-unpacked && tar -xf /tmp/gpu-check-wheels.tar -C /tmp/gpu-check-unpacked
    start=$(date +%s)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      /tmp/gpu-check-unpacked/*.whl
    echo "installed $(ls /tmp/gpu-check-unpacked | wc -l) wheels in $(( $(date +%s) - start )) s"
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
    # the table prints before the call's limit (BUDGET: that limit less 30 s; set it lower when less device time
    # is left than the call's timeout_s)
    budget=$(( ${BUDGET:-570} - ($(date +%s) - began) ))
    set +e
    python3 bench/gpu_check.py --budget "$budget" --keep /tmp/gpu-check "$@" | tee "$OUT/gpu_check.jsonl"
    code=${PIPESTATUS[0]}
    set -e
    # this check's own folder, which its last line names (earlier checks' folders beside it are not sent back)
    checked=$(sed -n 's/^files and logs: //p' "$OUT/gpu_check.jsonl" | tail -n 1)
    if [ -n "$checked" ]; then
      for log in "$checked"/*.log; do [ -e "$log" ] && cp "$log" "$OUT/part-$(basename "$log")"; done
      # part f's own run folder logs and the ranks' logs, one file (what comes back is counted in files)
      (cd "$checked" && find . -name '*.log' -not -path './*.log' -print0 | tar --null -czf "$OUT/run-logs.tgz" -T -) \
        || true
    fi
    exit "$code"
    ;;
  *)
    echo "usage: $0 receive K | check [bench/gpu_check.py arguments]" >&2
    exit 2
    ;;
esac
