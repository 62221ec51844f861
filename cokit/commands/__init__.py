"""Subcommands of the ``cokit`` CLI, one module each."""
