"""Errors several packages raise and the command line reports as one line (see ``raylign.cli.main``)."""

from __future__ import annotations


class MissingPackageError(ImportError):
    """An optional package a setting needs is not installed; the message says how to install it."""
