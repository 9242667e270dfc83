"""``python -m llmproxy.backend [flags]``: same as ``llmproxy backend [flags]``."""

from llmproxy.backend.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
