"""The torch engine's device check (scripts/gpu_check.sh).

Run as ``python -m llmproxy.bench.gpu_check.cli prepare|run``.
"""
