#!/usr/bin/env bash
# mypy over llmproxy's packages (settings in pyproject.toml's [tool.mypy]).
# mypy cannot follow the editable install's import hook, so it reads the packages through
# a tree of links, build/typecheck/llmproxy/<root> -> <root> (git ignores build/).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build/typecheck/llmproxy
for root in common proxy backend bench; do
  ln -sfn "../../../$root" "build/typecheck/llmproxy/$root"
done
exec "${PY:-python3}" -m mypy "$@"
