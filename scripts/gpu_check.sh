#!/usr/bin/env bash
# The torch engine's GPU check, one command: bash scripts/gpu_check.sh [run flags...]
# Writes gpu_check.json and gpu_check.md into $OUT (required) and prints the Markdown.
# Needs scripts/gpu_check/arch (from scripts/gpu_check_prepare.sh); installs
# scripts/gpu_check/wheels, when present and python lacks a package of them (or
# GPU_CHECK_FORCE_WHEELS=1), into a temporary folder (no index, no deps).
# Runs this checkout's sources as the llmproxy package (nothing installed system-wide).
# Default: CUDA, bf16 and fp16, shapes 135m and 1.7b; the run ends near --budget-s
# (default 420 s: parts that would end later are skipped and recorded so);
# flags after the script's name go to `python -m llmproxy.bench.gpu_check.cli run`
# (e.g. --device cpu --dtypes float32 --shapes 135m --concurrency 1,4,8 --n-predict 16).
# Env: PYTHON (default python3), GPU_CHECK_CARRY (default scripts/gpu_check).
# Exit status: the check's (0: every part ran, no request failed).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
PYTHON="${PYTHON:-python3}"
carry="${GPU_CHECK_CARRY:-$here/gpu_check}"
out="${OUT:?set OUT to the folder for gpu_check.json and gpu_check.md}"
[ -f "$carry/arch/config.json" ] || { echo "missing $carry/arch: run scripts/gpu_check_prepare.sh first" >&2; exit 2; }

tmp="$(mktemp -d -t llmproxy-gpu-check-env.XXXXXX)"
trap 'rm -rf "$tmp"' EXIT
path="$tmp/src"
# the wheels go in only where something is missing (the device image), or when forced
need="import pydantic_settings, structlog, gguf"
if compgen -G "$carry/wheels/*.whl" >/dev/null \
  && { [ "${GPU_CHECK_FORCE_WHEELS:-0}" = 1 ] || ! "$PYTHON" -c "$need" 2>/dev/null; }; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --target "$tmp/site" "$carry"/wheels/*.whl
  path="$tmp/site:$path"
fi
mkdir -p "$tmp/src/llmproxy"
ln -s "$repo/proxy" "$tmp/src/llmproxy/proxy"
ln -s "$repo/backend" "$tmp/src/llmproxy/backend"
export PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ "$(uname -s)" = Linux ] && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader || true
fi
rc=0
"$PYTHON" -m llmproxy.bench.gpu_check.cli run --out "$out" --arch-dir "$carry/arch" "$@" || rc=$?
exit "$rc"
