"""Model engines. Each runs only inside a worker process (never in the web process)."""
