"""Subcommand implementations of the `asyncrl` CLI, one module each (imported lazily by cli.py)."""
