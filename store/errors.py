"""Errors every layer may raise: here, in the lowest layer, so none imports upward."""


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""
