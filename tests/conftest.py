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
