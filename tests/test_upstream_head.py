"""The data plane passes the client's headers upstream as the bytes they came in
(router/forward.py ``upstream_head``), less the hop-by-hop ones, with the router's request id."""

from __future__ import annotations

import pytest

from router import proxy
from router.app import STATE, Backend, RouterConfig, create_app
from router.forward import upstream_head, upstream_headers


RAW = ((b"Host", b"router:8000"), (b"Content-Type", b"application/json"), (b"Content-Length", b"12"),
       (b"Connection", b"keep-alive"), (b"accept-encoding", b"gzip"), (b"X-Request-Id", b"client-id"),
       (b"X-Tag", b"a"), (b"x-tag", b"b"), (b"X-Note", "café".encode()), (b"Expect", b"100-continue"))


class _Multi:
    """The client's headers as aiohttp's multidict gives them (``items`` keeps repeats)."""

    def __init__(self, raw):
        self.raw = raw

    def items(self):
        return [(k.decode(), v.decode()) for k, v in self.raw]


def test_the_lines_are_the_pairs_on_the_wire():
    """Byte for byte what ``upstream_headers`` says, for ASCII values: hop-by-hop headers and
    the client's X-Request-Id dropped (whatever their case), repeats kept in order."""
    ascii_raw = [(k, v) for k, v in RAW if k != b"X-Note"]
    pairs = [(k.decode(), v.decode()) for k, v in ascii_raw
             if k.lower() not in (b"host", b"content-length", b"connection", b"accept-encoding",
                                  b"x-request-id", b"expect")] + [("X-Request-Id", "rid")]
    assert pairs == upstream_headers(_Multi(ascii_raw), "rid")
    assert upstream_head(ascii_raw, "rid") == "".join(f"{k}: {v}\r\n" for k, v in pairs).encode()
    assert upstream_head(ascii_raw, "rid") == (b"Content-Type: application/json\r\nX-Tag: a\r\n"
                                               b"x-tag: b\r\nX-Request-Id: rid\r\n")


async def test_a_utf8_header_value_reaches_the_backend_unchanged(router_client, fake_backends, tmp_path):
    """It once went up decoded and re-encoded as Latin-1 ('café' arrived as b'caf\\xe9')."""
    fakes = await fake_backends(1)
    cfg = RouterConfig(backends=[Backend("i0", fakes[0][1])], db=None, state_dir=str(tmp_path / "state"))
    client = await router_client(create_app(cfg))
    r = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2},
                          headers={"X-Note": "café", "X-Request-Id": "mine"})
    assert r.status == 200
    seen = {k.lower(): v for k, v in fakes[0][0].seen[-1]["headers"].items()}
    assert seen["x-note"] == "café"
    assert seen["x-request-id"] == r.headers["X-Kvtop-Request-Id"] != "mine"


@pytest.mark.parametrize("max_tokens, back_before_write", [(3, False), (80_000, True)], ids=["small", "large"])
async def test_when_the_upstream_connection_goes_back(router_client, fake_backends, tmp_path, monkeypatch,
                                                      max_tokens, back_before_write):
    """A small answer's connection returns to the pool after the client's write (off the
    answer's path); a large one's (over 64 KB, whose write may wait for the client to read) at
    once, so a slow client does not hold a backend connection. Both are reused after."""
    fakes = await fake_backends(1)
    url = fakes[0][1]
    cfg = RouterConfig(backends=[Backend("i0", url)], db=None, state_dir=str(tmp_path / "state"))
    app = create_app(cfg)
    client = await router_client(app)
    state = app[STATE]
    idle_at_write = []
    real = proxy.send_whole

    async def spy(request, status, headers, body):
        idle_at_write.append(len(state.upstream._idle.get(url, [])))
        return await real(request, status, headers, body)
    monkeypatch.setattr(proxy, "send_whole", spy)
    for _ in range(2):
        r = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": max_tokens})
        assert r.status == 200 and len(await r.read()) > max_tokens
    assert idle_at_write == [int(back_before_write)] * 2
    assert len(state.upstream._idle[url]) == 1  # one connection, back and reused
