#!/usr/bin/env bash
# The wheels bench/gpu_check.py needs on the GPU machine that it lacks (Python 3.12, manylinux x86_64; it has torch
# 2.11.0+cu130, transformers 5.17, peft, accelerate, pyarrow, triton, numpy ...), downloaded into the git-ignored
# .whl/ and packed into parts that each fit one device `run` call (64 MiB with the working tree):
#
#   bash scripts/gpu_wheels.sh            # -> .whl/parts/1 .. .whl/parts/N, one file each, and .whl/parts/SHA256
#
# What and why (docs/engines.md, "GPU check"):
# - vLLM 0.26.0, the release built for torch 2.11 and CUDA 13, without the files the check never loads: FlashAttention
#   2's kernels (Hopper runs FlashAttention 3's, which stay), the MoE kernels (loaded only if present) and the Rust
#   frontend binary (used only with VLLM_USE_RUST_FRONTEND=1): 290 MiB -> about 100 MiB.
# - what vLLM 0.26's LLM path imports that the machine lacks, found by importing it with --no-deps in a venv holding
#   the machine's packages: pydantic, fastapi, msgspec, pyzmq, openai, xgrammar ... and ray, which 0.26's CUDA IPC
#   engine imports at the top (0.32 no longer does), without its Java jars and server binaries (`import ray` needs
#   neither): 76 MiB -> about 22 MiB.
# - DeepSpeed 0.19.8 (PyPI has only its source: built here into a pure-Python wheel, ops compiled on use) and hjson.
# - Part a runs the real flow: Prefect 3.7.5 with its dependency closure and DuckDB 2.0.0 (versions of
#   requirements.lock, which run together here).
set -euo pipefail
cd "$(dirname "$0")/.."
WHL=.whl
# A part and the working tree that travels with it (what git tracks or does not ignore) stay
# under a run's 64 MiB, with 2 MiB to spare.
TREE_MB=$(( ($(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1) >> 20) + 1 ))
PART_MB=${PART_MB:-$(( 62 - TREE_MB ))}
PY=${PY:-python3}
mkdir -p "$WHL/wheels" "$WHL/download"

VLLM=(vllm==0.26.0)
VLLM_DEPS=(
  annotated-types==0.8.0 apache-tvm-ffi==0.1.15.post2 cachetools==7.3.2 cbor2==6.2.1 fastapi==0.136.3
  httpcore2==2.16.2 httpx2==2.16.2 jiter==0.19.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
  llguidance==1.7.6 msgspec==0.22.0 openai==3.54.0 openai-harmony==0.0.8 opentelemetry-api==1.45.2
  partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pydantic==2.14.3 pydantic-core==2.50.4 pyzmq==27.3.0
  ray==2.60.0 referencing==0.37.0 rpds-py==2026.9.1 sniffio==1.3.1 starlette==1.10.0 truststore==0.10.5
  typing-inspection==0.4.5 xgrammar==0.2.8
)
DEEPSPEED_DEPS=(hjson==3.1.0)
FLOW_DEPS=(
  duckdb==2.0.0 prefect==3.7.5
  aiosqlite==0.22.1 alembic==1.20.1 amplitude-analytics==1.3.0 apprise==1.13.1 asgi-lifespan==2.1.0
  asyncpg==0.32.0 beartype==0.23.1 burner-redis==0.1.7 cffi==2.1.1 coolname==5.0.0 cronsim==2.8
  cryptography==50.0.2 cyclopts==5.4.0 dateparser==1.5.0 docker==7.2.0 docstring-parser==0.18.0
  exceptiongroup==1.3.1 graphviz==0.21 greenlet==3.5.6 griffe==2.4.1 griffecli==2.4.1 griffelib==2.4.1
  jinja2-humanize-extension==0.4.0 jsonpatch==1.47 jsonpointer==3.12 mako==1.4.3 oauthlib==4.0.1
  orjson==3.13.0 pendulum==3.3.0 py-key-value-aio==0.5.0 pycparser==3.12 pydantic-extra-types==2.11.1
  pydantic-settings==2.16.3 pydocket==0.27.0 python-dotenv==1.2.4 python-json-logger==4.2.0
  python-slugify==8.0.4 pytz==2026.6 readchar==4.2.2 redis==8.1.0 requests-oauthlib==2.0.0
  rfc3339-validator==0.1.4 rich-rst==2.2.0 ruamel-yaml==0.19.1 ruamel-yaml-clib==0.2.15 semver==3.1.1
  sqlalchemy==2.0.58 text-unidecode==1.3 toml==0.10.2 tzdata==2026.6 tzlocal==5.4.5 uncalled-for==0.6.1
  uvicorn==0.54.0 websockets==16.1.1
)

echo "downloading $(( ${#VLLM[@]} + ${#VLLM_DEPS[@]} + ${#DEEPSPEED_DEPS[@]} + ${#FLOW_DEPS[@]} )) wheels for CPython 3.12 manylinux x86_64" >&2
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --abi abi3 --abi none --platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64 \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any \
  -d "$WHL/download" "${VLLM[@]}" "${VLLM_DEPS[@]}" "${DEEPSPEED_DEPS[@]}" "${FLOW_DEPS[@]}"

if ! ls "$WHL"/download/deepspeed-0.19.8-*.whl >/dev/null 2>&1; then  # PyPI has the source only
  "$PY" -m pip download -q --no-deps --no-binary=:all: -d "$WHL/download" deepspeed==0.19.8
  DS_BUILD_OPS=0 .venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w "$WHL/download" \
    "$WHL/download/deepspeed-0.19.8.tar.gz"
fi

# Trim: each wheel rewritten without the named files (and their RECORD lines); names unchanged, so pip installs them.
.venv/bin/python - "$WHL/download" "$WHL/wheels" <<'EOF'
import shutil, sys, zipfile
from pathlib import Path

source, target = Path(sys.argv[1]), Path(sys.argv[2])
DROP = {
    "vllm-": ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/_moe_C_stable_libtorch.abi3.so", "vllm/vllm-rs"),
    "ray-": ("ray/jars/", "ray/core/src/ray/gcs/gcs_server", "ray/core/src/ray/raylet/raylet",
             "ray/dashboard/client/build/"),
}
for wheel in sorted(source.glob("*.whl")):
    out = target / wheel.name
    drop = next((d for prefix, d in DROP.items() if wheel.name.startswith(prefix)), None)
    if out.exists() and out.stat().st_mtime >= wheel.stat().st_mtime:
        continue
    if drop is None:
        shutil.copy2(wheel, out)
        continue
    gone = lambda name: any(name == d or (d.endswith("/") and name.startswith(d)) for d in drop)  # noqa: E731
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        for item in zin.infolist():
            if gone(item.filename):
                continue
            data = zin.read(item.filename)
            if item.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(keepends=True)
                                if not gone(line.split(b",")[0].decode()))
            zout.writestr(item, data, compress_type=item.compress_type)
    print(f"trimmed {wheel.name}: {wheel.stat().st_size >> 20} -> {out.stat().st_size >> 20} MiB", file=sys.stderr)
EOF

# Wheels of an earlier pin stay in .whl: two versions of one project would only fail pip on the GPU machine, after
# every part has travelled.
twice=$(ls "$WHL/wheels" | sed 's/-[0-9].*//' | tr '[:upper:]_.' '[:lower:]--' | sort | uniq -d)
if [ -n "$twice" ]; then
  echo "$WHL/wheels holds two versions of: $twice (left by an earlier pin); rm -rf $WHL and run this again" >&2
  exit 1
fi

# One tar of every wheel, cut into parts of PART_MB MiB: .whl/parts/K/wheels.tar.K (one folder per run call).
rm -rf "$WHL/parts" && mkdir -p "$WHL/parts"
tar -C "$WHL/wheels" -cf "$WHL/wheels.tar" .
sha256sum "$WHL/wheels.tar" | cut -d' ' -f1 > "$WHL/parts/SHA256"
split -b "${PART_MB}M" -d -a 1 "$WHL/wheels.tar" "$WHL/parts/wheels.tar."
for piece in "$WHL"/parts/wheels.tar.*; do
  k=$(( ${piece##*.} + 1 ))
  mkdir -p "$WHL/parts/$k" && mv "$piece" "$WHL/parts/$k/"
done
cp "$WHL/parts/SHA256" "$WHL/parts/$(ls -d "$WHL"/parts/*/ | wc -l)/"
rm "$WHL/wheels.tar"
echo "$(ls "$WHL/wheels" | wc -l) wheels, $(du -sm "$WHL/wheels" | cut -f1) MiB, in $(ls -d "$WHL"/parts/*/ | wc -l) parts:" >&2
du -sm "$WHL"/parts/*/ >&2
