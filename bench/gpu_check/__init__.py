"""The torch engine's device check (scripts/gpu_check.sh): ``python -m llmproxy.bench.gpu_check.cli``."""
