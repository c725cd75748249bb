from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture(autouse=True)
def _private_config_home(tmp_path_factory, monkeypatch):
    """No test reads the machine's own ~/.config/kvtop (kvtop attach's config file): a broken
    file there must not fail the suite, nor a theme switch in a test write to it."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("xdg-config")))


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


class RouterServer:
    """A router served as ``kvtop route`` serves it (router.app.start_server on a loopback
    socket), plus clients for it."""

    def __init__(self, app, runner, sock):
        from router.app import STATE

        self.app = app
        self.state = app[STATE]
        self.runner = runner
        self.host, self.port = sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.clients: list[RouterClient] = []

    def client(self) -> RouterClient:
        c = RouterClient(self)
        self.clients.append(c)
        return c

    async def close(self) -> None:
        for c in self.clients:
            await c.close()
        await self.runner.cleanup()


class RouterClient:
    """Enough of pytest-aiohttp's TestClient for the e2e tests: relative URLs and
    ``client.server.app``, over a plain aiohttp.ClientSession to the router."""

    def __init__(self, router: RouterServer):
        import aiohttp

        self.router = router
        self.server = router  # tests reach the app as client.server.app, as with TestClient
        self.host, self.port = router.host, router.port
        self.session = aiohttp.ClientSession(base_url=router.url)

    def request(self, method, path, **kw):
        return self.session.request(method, path, **kw)

    def get(self, path, **kw):
        return self.session.get(path, **kw)

    def post(self, path, **kw):
        return self.session.post(path, **kw)

    def put(self, path, **kw):
        return self.session.put(path, **kw)

    def patch(self, path, **kw):
        return self.session.patch(path, **kw)

    async def close(self) -> None:
        await self.session.close()


@pytest.fixture
async def router_server():
    """Serve ``create_app(cfg)`` exactly as router/cli.py ``serve()`` does; a factory
    app -> RouterServer. Everything started is stopped at teardown.

    Unlike serve() the backends are not probed first: tests that point the router at a dead
    backend need it to start healthy (serve() would mark it down before the first request)."""
    from router.app import STATE, start_server

    started: list[RouterServer] = []

    async def make(app) -> RouterServer:
        state = app[STATE]
        # serve() binds first; the port then names the discovery files, as it would for real
        sock = socket.create_server(("127.0.0.1", 0))
        state.config.host, state.config.port = "127.0.0.1", sock.getsockname()[1]
        try:
            runner = await start_server(app, sock)
        except BaseException:
            sock.close()
            raise
        router = RouterServer(app, runner, sock)
        started.append(router)
        return router

    yield make
    for router in reversed(started):
        await router.close()


@pytest.fixture
def router_client(router_server):
    """A client of a router served for real (``router_server``); a factory app -> client."""

    async def make(app) -> RouterClient:
        return (await router_server(app)).client()

    return make
