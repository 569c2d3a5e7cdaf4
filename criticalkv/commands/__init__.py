"""Subcommands of the ``criticalkv`` CLI (each module defines ``register(subparsers)``)."""
