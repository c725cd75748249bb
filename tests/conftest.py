from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake_backends(aiohttp_server):
    """Start N fake vLLM instances on loopback; returns a factory -> [(FakeVLLM, url)]."""
    from fakevllm import FakeVLLM

    async def make(n=2, **kw):
        out = []
        for i in range(n):
            fake = FakeVLLM(f"f{i}", **kw)
            server = await aiohttp_server(fake.app(), host="127.0.0.1")
            out.append((fake, str(server.make_url("")).rstrip("/")))
        return out

    return make


class FrontRouter:
    """A router served as ``kvtop route`` serves it: the HTTP/1.1 front (router/front.py) on a
    loopback socket, the aiohttp application behind it on a private abstract Unix socket."""

    def __init__(self, app, front, runner, sock):
        from router.app import STATE

        self.app = app
        self.state = app[STATE]
        self.front = front
        self.runner = runner
        self.host, self.port = sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.clients: list[FrontClient] = []

    def client(self) -> FrontClient:
        c = FrontClient(self)
        self.clients.append(c)
        return c

    async def close(self) -> None:
        for c in self.clients:
            await c.close()
        # the order of router/cli.py serve(): the front first, so nothing new reaches the app
        await self.front.close()
        await self.runner.cleanup()


class FrontClient:
    """Enough of pytest-aiohttp's TestClient for the e2e tests: relative URLs and
    ``client.server.app``, over a plain aiohttp.ClientSession to the front."""

    def __init__(self, router: FrontRouter):
        import aiohttp

        self.router = router
        self.server = router  # tests reach the app as client.server.app, as with TestClient
        self.session = aiohttp.ClientSession(base_url=router.url)

    def request(self, method, path, **kw):
        return self.session.request(method, path, **kw)

    def get(self, path, **kw):
        return self.session.get(path, **kw)

    def post(self, path, **kw):
        return self.session.post(path, **kw)

    async def close(self) -> None:
        await self.session.close()


@pytest.fixture
async def front_router():
    """Serve ``create_app(cfg)`` the way router/cli.py ``serve()`` does; a factory
    app -> FrontRouter. Everything started is stopped at teardown.

    Unlike serve() the backends are not probed first: tests that point the router at a dead
    backend need it to start healthy (serve() would mark it down before the first request)."""
    import os
    import uuid

    from aiohttp import web

    from router.app import STATE
    from router.front import FrontServer

    started: list[FrontRouter] = []

    async def make(app) -> FrontRouter:
        state = app[STATE]
        # serve() binds first; the port then names the discovery files, as it would for real
        sock = socket.create_server(("127.0.0.1", 0))
        state.config.host, state.config.port = "127.0.0.1", sock.getsockname()[1]
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        try:
            await runner.setup()
            # unique per test: abstract names live in one namespace for the whole machine
            internal = f"\0kvtop-test-{os.getpid()}-{state.config.port}-{uuid.uuid4().hex}"
            await web.UnixSite(runner, internal).start()
            front = FrontServer(state, "unix:" + internal)
            await front.start(sock)
        except BaseException:
            sock.close()
            await runner.cleanup()
            raise
        router = FrontRouter(app, front, runner, sock)
        started.append(router)
        return router

    yield make
    for router in reversed(started):
        await router.close()


@pytest.fixture(params=["aiohttp", "front"])
def router_client(request):
    """Serve an app for the e2e tests through each serving path; a factory app -> client.

    "aiohttp": pytest-aiohttp's test server (the aiohttp handlers call ``proxy``);
    "front": the production path, router/front.py in front of the same app."""
    if request.param == "aiohttp":
        return request.getfixturevalue("aiohttp_client")
    make_router = request.getfixturevalue("front_router")

    async def make(app) -> FrontClient:
        return (await make_router(app)).client()

    return make
