"""What the one server and its backend client must never do (issue "One routing pipeline").

Each case was a hole in the hand-written front and client: trailers merged into headers,
CONNECT answered twice, hostile backends growing the router without bound, bytes after an
answer glued onto it, ``https://`` backends accepted and then failing, and latencies that
started after the router's own admission wait.
"""

from __future__ import annotations

import asyncio
import json
import resource
import ssl
import subprocess
import time

import aiohttp
import pytest
from test_server import (TOKEN, WAIT_S, assert_json_error, completion, connect, read_response, rows,
                         start)
from test_server_edges import raw_backend, start_raw  # noqa: F401 (raw_backend: a fixture)

from router.app import Backend, RouterConfig, create_app


def chunked_post(path: str, body: bytes, trailers: list[str], *extra: str) -> bytes:
    head = (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n" + "".join(h + "\r\n" for h in extra) + "\r\n").encode()
    return head + b"%x\r\n%b\r\n0\r\n" % (len(body), body) + "".join(t + "\r\n" for t in trailers).encode() + b"\r\n"


async def test_trailers_never_steer_routing(router_server, fake_backends, tmp_path):
    router, _ = await start(router_server, fake_backends, tmp_path)
    reader, writer = await connect(router)
    writer.write(chunked_post("/v1/completions", completion(), ["X-Session-ID: from-a-trailer"]))
    resp = await read_response(reader)
    writer.close()
    assert resp.status == 200, resp.body
    (d,) = rows(router.state, "decisions")
    assert d["session_id"] != "from-a-trailer" and d["session_source"] != "header"


async def test_a_token_in_a_trailer_does_not_authorise(router_server, fake_backends, tmp_path):
    router, _ = await start(router_server, fake_backends, tmp_path)
    reader, writer = await connect(router)
    body = json.dumps({"name": "round_robin"}).encode()
    req = chunked_post("/kvtop/v1/policy", body, [f"Authorization: Bearer {TOKEN}"])
    writer.write(req.replace(b"POST ", b"PUT ", 1))
    resp = await read_response(reader)
    writer.close()
    assert resp.status == 401, resp.body
    assert router.state.slot.policy.name != "round_robin"


@pytest.mark.parametrize("trailers", [
    [f"X-T{k}: v" for k in range(400)],  # too many
    ["X-Big: " + "v" * 200_000],  # one too large
], ids=["count", "size"])
async def test_trailers_are_bounded(router_server, fake_backends, tmp_path, trailers):
    router, _ = await start(router_server, fake_backends, tmp_path)
    reader, writer = await connect(router)
    writer.write(chunked_post("/v1/completions", completion(), trailers))
    async with asyncio.timeout(WAIT_S):
        data = await reader.read()  # the server answers once, then closes
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith((b"HTTP/1.1 400", b"HTTP/1.0 400")), data[:200]
    assert b"application/json" in head and json.loads(body)["error"]["code"] == 400
    assert data.count(b"HTTP/1.") == 1  # one answer, no routed request behind it
    assert router.state.counts["requests"] == 0


async def test_connect_gets_exactly_one_answer(router_server, fake_backends, tmp_path):
    router, _ = await start(router_server, fake_backends, tmp_path)
    reader, writer = await connect(router)
    writer.write(b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
    await writer.drain()
    data = b""
    try:
        async with asyncio.timeout(2.0):
            while chunk := await reader.read(65536):
                data += chunk
    except TimeoutError:
        pass  # a kept-alive connection: what arrived in 2 s is the whole answer
    writer.close()
    assert data.count(b"HTTP/1.1 ") == 1, data
    status = int(data.split()[1])
    assert status in (400, 404, 405), data


# -- hostile backends ----------------------------------------------------------------------

def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def _endless_head(backend, writer) -> bool:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
    line = b"X-Filler: " + b"x" * 1000 + b"\r\n"
    for _ in range(200_000):  # 200 MB if nobody stops reading it
        writer.write(line * 64)
        await writer.drain()
    return False


async def _endless_body(backend, writer) -> bool:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    piece = b"x" * 65536
    for _ in range(20_000):  # 1.3 GB if buffered whole
        writer.write(b"%x\r\n%b\r\n" % (len(piece), piece))
        await writer.drain()
    return False


@pytest.mark.parametrize("script", [_endless_head, _endless_body], ids=["header-block", "body"])
async def test_endless_upstream_answer_is_a_bounded_502(router_server, raw_backend, tmp_path, script):
    before = _rss_mb()
    _, url = await raw_backend(script)
    router = await start_raw(router_server, url, tmp_path, max_answer_bytes=8 * 1024 * 1024,
                             read_timeout_s=5.0)
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as http:
        async with http.post(router.url + "/v1/completions", data=completion(),
                             timeout=aiohttp.ClientTimeout(total=20)) as r:
            body = await r.json()
    assert r.status == 502 and body["error"]["code"] == 502, body
    assert time.monotonic() - t0 < 5.0  # refused at the bound, not at a timeout
    assert _rss_mb() - before < 100
    router.state.writer.flush()
    outs = rows(router.state, "outcomes")
    assert outs and outs[-1]["status"] == "upstream_error"
    assert router.state.cluster.counters_zero()


async def _answer_then_garbage(backend, writer) -> bool:
    body = json.dumps({"choices": [{"text": "ok"}], "usage": {"completion_tokens": 1}}).encode()
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                 b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nEVIL!" % (len(body), body))
    await writer.drain()
    return True  # keep the connection: the router must not read the extra answer as the next one


async def test_bytes_after_an_answer_are_not_glued_to_any_answer(router_server, raw_backend, tmp_path):
    backend, url = await raw_backend(_answer_then_garbage)
    router = await start_raw(router_server, url, tmp_path)
    async with aiohttp.ClientSession() as http:
        for _ in range(3):
            async with http.post(router.url + "/v1/completions", data=completion()) as r:
                data = await r.read()
            assert r.status == 200 and b"EVIL" not in data and json.loads(data)["choices"][0]["text"] == "ok"
    assert backend.posts == 3


# -- TLS to a backend --------------------------------------------------------------------------

@pytest.fixture
def tls_files(tmp_path):
    """A self-signed certificate for 127.0.0.1 (the openssl CLI), as a CA bundle too."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    try:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                        "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"openssl could not make a test certificate: {exc}")
    return cert, key


async def test_https_backend_serves_a_request(router_server, tmp_path, tls_files, aiohttp_server):
    from fakevllm import FakeVLLM

    cert, key = tls_files
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(cert), str(key))
    fake = FakeVLLM("tls")
    server = await aiohttp_server(fake.app(), host="127.0.0.1", ssl=ctx)
    url = f"https://127.0.0.1:{server.port}"
    cfg = RouterConfig(backends=[Backend("i0", url)], db=str(tmp_path / "kvtop.db"),
                       state_dir=str(tmp_path / "state"), control_token=TOKEN, backend_ca_file=str(cert))
    router = await router_server(create_app(cfg))
    async with aiohttp.ClientSession() as http:
        async with http.post(router.url + "/v1/completions", data=completion(stream=True)) as r:
            text = await r.text()
    assert r.status == 200 and "[DONE]" in text
    assert fake.seen


async def test_https_backend_with_an_untrusted_certificate_is_a_502(router_server, tmp_path, tls_files,
                                                                      aiohttp_server):
    from fakevllm import FakeVLLM

    cert, key = tls_files
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(cert), str(key))
    server = await aiohttp_server(FakeVLLM("tls").app(), host="127.0.0.1", ssl=ctx)
    cfg = RouterConfig(backends=[Backend("i0", f"https://127.0.0.1:{server.port}")], db=str(tmp_path / "kvtop.db"),
                       state_dir=str(tmp_path / "state"), control_token=TOKEN, health_interval_s=0)
    router = await router_server(create_app(cfg))
    async with aiohttp.ClientSession() as http:
        async with http.post(router.url + "/v1/completions", data=completion()) as r:
            body = await r.json()
    assert r.status in (502, 503) and body["error"]["code"] == r.status


async def test_router_listens_with_tls(tmp_path, tls_files, fake_backends):
    """--tls-cert/--tls-key: the listener speaks HTTPS."""
    import socket

    from router.app import start_server, tls_context

    cert, key = tls_files
    fakes = await fake_backends(1)
    cfg = RouterConfig(backends=[Backend("i0", fakes[0][1])], db=None, state_dir=str(tmp_path / "state"),
                       control_token=TOKEN, tls_cert=str(cert), tls_key=str(key))
    app = create_app(cfg)
    sock = socket.create_server(("127.0.0.1", 0))
    cfg.port = sock.getsockname()[1]
    runner = await start_server(app, sock, tls_context(cfg.tls_cert, cfg.tls_key))
    try:
        client_ctx = ssl.create_default_context(cafile=str(cert))
        async with aiohttp.ClientSession() as http:
            async with http.post(f"https://127.0.0.1:{cfg.port}/v1/completions", data=completion(),
                                 ssl=client_ctx) as r:
                assert r.status == 200
            async with http.get(f"https://127.0.0.1:{cfg.port}/health", ssl=client_ctx) as r:
                assert r.status == 200
    finally:
        await runner.cleanup()


# -- latency truth -----------------------------------------------------------------------

async def test_logged_ttft_under_admission_fifo_is_the_clients(router_server, fake_backends, tmp_path):
    """Two requests queued by admission=fifo: the second waits for the first's prefill; the
    log's TTFT and E2E count that wait, as the client does, and record it on its own."""
    router, fakes = await start(router_server, fake_backends, tmp_path, policy="round_robin",
                                fake_kw={"first_delay": 0.5},
                                knobs={"admission": "fifo", "admission_budget_tokens": 1000})
    prompt = list(range(900))

    async def one(http, k):
        t0 = time.monotonic()
        body = json.dumps({"prompt": prompt, "max_tokens": 2, "stream": True}).encode()
        async with http.post(router.url + "/v1/completions", data=body,
                             headers={"X-Session-ID": f"s{k}", "Content-Type": "application/json"}) as r:
            assert r.status == 200
            ttft = None
            async for line in r.content:
                if ttft is None and line.startswith(b"data: {") and b'"text"' in line:
                    ttft = (time.monotonic() - t0) * 1000
            return r.headers["X-Kvtop-Request-Id"], ttft

    async with aiohttp.ClientSession() as http:
        got = await asyncio.gather(one(http, 0), one(http, 1))
    router.state.writer.flush()
    outs = {o["request_id"]: o for o in rows(router.state, "outcomes")}
    client = sorted((ttft, rid) for rid, ttft in got)
    assert client[1][0] > 900  # the second really waited for the first's prefill
    for ttft, rid in client:
        o = outs[rid]
        assert abs(o["ttft_ms"] - ttft) <= 20, (o["ttft_ms"], ttft)
    waited = outs[client[1][1]]
    assert waited["admission_wait_ms"] >= 400
    assert waited["e2e_ms"] >= waited["ttft_ms"] >= waited["admission_wait_ms"]
