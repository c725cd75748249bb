"""Errors every layer may raise: here, in the lowest layer, so none imports upward."""


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


class QueryError(LookupError):
    """A question the decision log cannot answer as asked (missing file, unknown run, bad SQL).

    A LookupError, so callers such as ``kvtop report --db`` can catch it without importing store/.
    """
