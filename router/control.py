"""Control API under /kvtop/v1 (being built; see issue "Control plane")."""

from aiohttp import web


def setup(app: web.Application) -> None:
    return None
