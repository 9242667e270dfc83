"""``python -m llmproxy.proxy`` runs the ``llmproxy`` CLI."""

from llmproxy.proxy.cli import main

raise SystemExit(main())
