"""``kvtop replay`` against a small real aiohttp server on 127.0.0.1 that streams like vLLM.

The fake backend runs in its own thread and event loop, so tests drive the replay exactly as
the CLI does (``asyncio.run``) and the server's clock is the same ``time.perf_counter``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
from aiohttp import web

from kvtop.cli import main
from kvtop.replay import ReplayConfig, ids_to_text, parse_prefix_counters, replay
from kvtop.sim.tokenizer import count_tokens
from kvtop.traces.loader import TraceRequest

TOKEN_DELAY_S = 0.005  # between streamed tokens
PREFILL_S = 0.02  # before the first token


class FakeVllm:
    """Streams ``max_tokens`` one-token chunks, then usage with half the prompt cached."""

    def __init__(self) -> None:
        self.received: list[dict] = []  # {t, session, prompt_len, body}
        self.queries = self.hits = 0
        self.loop = asyncio.new_event_loop()
        self.url = ""
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.completions)
        return app

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def start() -> None:
            self._runner = web.AppRunner(self._app())
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]
            self.url = f"http://127.0.0.1:{port}"
            self._ready.set()
        self.loop.run_until_complete(start())
        self.loop.run_forever()

    def start(self) -> "FakeVllm":
        self.thread.start()
        assert self._ready.wait(5)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=(
            "# TYPE vllm:prefix_cache_queries counter\n"
            f'vllm:prefix_cache_queries_total{{engine="0",model_name="fake-model"}} {self.queries}.0\n'
            f'vllm:prefix_cache_hits_total{{engine="0",model_name="fake-model"}} {self.hits}.0\n'))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        t = time.perf_counter()
        body = await request.json()
        session = request.headers.get("X-Session-ID")
        self.received.append({"t": t, "session": session, "prompt_len": len(body["prompt"]),
                              "body": body})
        if session == "bad":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        n_prompt = len(body["prompt"])
        cached = n_prompt // 2
        self.queries += n_prompt
        self.hits += cached
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "X-Kvtop-Instance": "fake0",
                                           "X-Kvtop-Request-Id": f"r{len(self.received)}"})
        await resp.prepare(request)
        try:
            await asyncio.sleep(PREFILL_S)
            for i in range(body["max_tokens"]):
                if i:
                    await asyncio.sleep(TOKEN_DELAY_S)
                chunk = {"choices": [{"index": 0, "text": "x", "finish_reason": None}]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            usage = {"choices": [], "usage": {"prompt_tokens": n_prompt,
                                              "completion_tokens": body["max_tokens"],
                                              "prompt_tokens_details": {"cached_tokens": cached}}}
            await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:  # the client went away (the interrupt test)
            pass
        return resp


@pytest.fixture
def fake():
    server = FakeVllm().start()
    yield server
    server.stop()


def req(arrival, session, turn=1, *, inp=300, out=4, think=None, hash_ids=None):
    return TraceRequest(arrival=arrival, session=session, turn=turn, input_tokens=inp,
                        output_tokens=out, hash_ids=hash_ids if hash_ids is not None else [1, 2],
                        block_size=64, think_time=think, parent=None, source="test")


def write_trace(path, requests):
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps({"arrival": r.arrival, "session": r.session, "turn": r.turn,
                                "input_tokens": r.input_tokens, "output_tokens": r.output_tokens,
                                "hash_ids": r.hash_ids, "block_size": r.block_size,
                                "think_time": r.think_time}) + "\n")
    return str(path)


def test_open_loop_sends_in_arrival_order_at_arrival_over_speed(fake):
    # Arrivals 1 s apart at speed 20: sends 50 ms apart. Given out of order on purpose.
    trace = [req(3.0, "d"), req(0.0, "a"), req(2.0, "c"), req(1.0, "b")]
    trace.sort(key=lambda r: r.arrival)  # what the CLI's loader step does
    result = asyncio.run(replay(trace, ReplayConfig(target=fake.url, speed=20, arm="t")))
    assert [r["session"] for r in fake.received] == ["a", "b", "c", "d"]
    sent = {r["session"]: r["sent_at"] for r in result.records}
    for session, arrival in zip("abcd", (0.0, 1.0, 2.0, 3.0)):
        # never early; late by at most a generous 40 ms on a loaded 2-core machine
        assert arrival / 20 - 0.002 <= sent[session] <= arrival / 20 + 0.04


def test_closed_loop_waits_for_the_answer_plus_think_time(fake):
    # Turn 2 and 3 have arrival 0: open loop would send them at once. Closed loop must send
    # each 0.2 s (think 2 s / speed 10) after the previous answer ended.
    trace = [req(0.0, "s", 1, out=5), req(0.0, "s", 2, out=5, think=2.0),
             req(0.0, "s", 3, out=1, think=1.0), req(0.05, "other", 1)]
    result = asyncio.run(replay(trace, ReplayConfig(target=fake.url, speed=10, mode="closed")))
    turns = {(r["session"], r["turn"]): r for r in result.records}
    assert all(r["status"] == "ok" for r in result.records)
    for turn, think in ((2, 2.0), (3, 1.0)):
        prev = turns[("s", turn - 1)]
        prev_end = prev["sent_at"] + prev["e2e_ms"] / 1000
        sent = turns[("s", turn)]["sent_at"]
        assert prev_end + think / 10 - 0.002 <= sent <= prev_end + think / 10 + 0.1
    # the other session did not wait for s
    assert turns[("other", 1)]["sent_at"] < turns[("s", 2)]["sent_at"]


def test_request_body_and_record_fields(fake):
    trace = [req(0.0, "a", inp=200, out=3, hash_ids=[7, 8, 9])]
    result = asyncio.run(replay(trace, ReplayConfig(target=fake.url, arm="arm1")))
    body = fake.received[0]["body"]
    assert fake.received[0]["prompt_len"] == 200  # synthesized from the hash ids, exact length
    assert body["max_tokens"] == 3 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["model"] == "fake-model"
    assert "session_id" not in body and fake.received[0]["session"] == "a"
    (r,) = result.records
    assert r["status"] == "ok" and r["instance"] == "fake0" and r["request_id"] == "r1"
    assert r["cached_tokens"] == 100 and r["route_class"] == "WARM" and r["arm"] == "arm1"
    # TTFT covers the prefill wait; TPOT = (e2e - ttft) / (3 - 1) spans two token gaps
    assert r["ttft_ms"] >= PREFILL_S * 1000 * 0.9
    assert r["tpot_ms"] == pytest.approx((r["e2e_ms"] - r["ttft_ms"]) / 2, abs=0.01)
    assert r["tpot_ms"] >= TOKEN_DELAY_S * 1000 * 0.9


def test_text_prompts_are_one_four_character_word_per_token(fake):
    # Blocks of 64: a and b share the blocks of hash ids 7 and 8, c shares nothing.
    trace = [req(0.0, "a", inp=200, hash_ids=[7, 8, 9]), req(0.01, "b", inp=150, hash_ids=[7, 8]),
             req(0.02, "c", inp=64, hash_ids=[5])]
    result = asyncio.run(replay(trace, ReplayConfig(target=fake.url, prompt_format="text")))
    assert result.header["prompt_format"] == "text"
    a, b, c = (next(r["body"]["prompt"] for r in fake.received if r["session"] == s)
               for s in "abc")
    assert all(isinstance(p, str) for p in (a, b, c))
    # 4 characters a token: kvtop's text estimate is exact, and the sim reads one token a word.
    assert (len(a), len(b), len(c)) == (800, 600, 256)
    assert count_tokens(a) == 200 and count_tokens(b) == 150
    assert a[:4 * 128] == b[:4 * 128]       # same hash ids -> same text
    assert a[4 * 128:4 * 129] != b[4 * 128:4 * 129]  # block 9 vs b's own tail
    assert a[:4 * 64] != c                  # different hash id -> different text


def test_text_prompt_words_are_distinct_per_id():
    assert ids_to_text([0, 1, 17_575, 17_576]) == " aaa aab zzz aaa"
    assert len({ids_to_text([i]) for i in range(17_576)}) == 17_576


def test_cli_writes_results_file_with_header_and_engine_counters(fake, tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [req(0.0, "a", inp=128), req(0.01, "b", inp=256),
                                               req(0.02, "bad", inp=64)])
    out = tmp_path / "res.jsonl"
    rc = main(["replay", trace, "--target", fake.url, "--out", str(out), "--no-progress",
               "--scrape", fake.url, "--arm", "lmetric@1"])
    assert rc == 0
    header, *records = [json.loads(line) for line in out.read_text().splitlines()]
    assert header["kvtop_results"] == 1 and header["arm"] == "lmetric@1"
    assert header["mode"] == "open" and header["speed"] == 1.0 and header["target"] == fake.url
    assert header["started_at"] <= header["ended_at"]
    # only the two ok requests reached the cache: 128 + 256 queried, half of each hit
    assert header["engine_prefix_cache"] == {"queries": 384, "hits": 192}
    assert len(records) == 3
    # store.results.RequestResult's fields that replay reports, in the file's order as ever
    keys = ["request_id", "session", "turn", "arrival", "sent_at", "input_tokens",
            "output_tokens", "status", "http_status", "error", "ttft_ms", "e2e_ms", "tpot_ms",
            "cached_tokens", "instance", "route_class", "arm"]
    assert all(list(r) == keys for r in records)
    bad = next(r for r in records if r["session"] == "bad")
    assert bad["status"] == "error" and bad["http_status"] == 500 and "boom" in bad["error"]
    assert bad["ttft_ms"] is None


def test_limit_bounds_the_run(fake, tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [req(i * 0.001, f"s{i}") for i in range(5)])
    out = tmp_path / "res.jsonl"
    assert main(["replay", trace, "--target", fake.url, "--out", str(out), "--limit", "2",
                 "--no-progress"]) == 0
    assert len(out.read_text().splitlines()) == 1 + 2
    assert [r["session"] for r in fake.received] == ["s0", "s1"]


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_duration_stops_sending_but_waits_for_answers(fake, mode):
    """A bounded run: nothing is sent after --duration, and what was sent completes (no request
    is cut off and reported as an error just because the run ended)."""
    trace = [req(0.0, "a", out=100), req(0.02, "b", 1, out=5), req(0.02, "b", 2, out=5, think=0.0),
             req(5.0, "late")]
    result = asyncio.run(replay(trace, ReplayConfig(target=fake.url, duration=0.2, mode=mode)))
    assert not result.interrupted
    assert {r["session"] for r in result.records} == {"a", "b"}
    assert all(r["status"] == "ok" for r in result.records)
    assert "late" not in [r["session"] for r in fake.received]


def test_interrupt_keeps_what_it_has(fake):
    trace = [req(0.0, "a", out=200), req(5.0, "late")]  # a streams for ~1 s; late never sent

    async def run_and_cancel():
        task = asyncio.create_task(replay(trace, ReplayConfig(target=fake.url)))
        await asyncio.sleep(0.3)
        task.cancel()  # what asyncio.run does on Ctrl-C
        return await task
    result = asyncio.run(run_and_cancel())
    assert result.interrupted and result.header["interrupted"] is True
    assert [(r["session"], r["error"]) for r in result.records] == [("a", "cancelled")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on exit: nothing listens there


@pytest.mark.parametrize("setup,message", [
    ("unreachable", "cannot reach target http://127.0.0.1:"),
    ("missing", "trace file not found"),
    ("empty", "has no requests"),
    # both were tracebacks: a ZeroDivisionError drawing token ids, and a FileNotFoundError
    # writing the results only after the whole run
    ("vocab0", "--vocab-size must be positive"),
    ("outdir", "cannot write --out"),
    # was silently "no cap"
    ("conc-1", "--max-concurrency must be 0"),
])
def test_user_errors_are_one_line_exit_2(tmp_path, capsys, setup, message):
    trace = str(tmp_path / "missing.jsonl")
    if setup != "missing":
        trace = write_trace(tmp_path / "t.jsonl", [] if setup == "empty" else [req(0, "a")])
    out = str(tmp_path / ("nodir/r.jsonl" if setup == "outdir" else "r.jsonl"))
    extra = {"vocab0": ["--vocab-size", "0"], "conc-1": ["--max-concurrency", "-1"]}.get(setup, [])
    rc = main(["replay", trace, "--target", f"http://127.0.0.1:{_free_port()}",
               "--out", out, "--no-progress", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1
    assert not (tmp_path / "r.jsonl").exists()


@pytest.mark.parametrize("text,expected", [
    ('vllm:prefix_cache_queries_total{engine="0"} 10.0\n'
     'vllm:prefix_cache_queries_total{engine="1"} 5.0\n'
     'vllm:prefix_cache_hits_total{engine="0"} 4.0\n', {"queries": 15.0, "hits": 4.0}),  # summed
    ("vllm:prefix_cache_queries_total 7 1700000000\nvllm:prefix_cache_hits_total 3\n",
     {"queries": 7.0, "hits": 3.0}),  # no labels, trailing timestamp
    ('vllm:prefix_cache_queries_created{engine="0"} 1.7e9\n', {}),  # not the counter
    ("# nothing here\n", {}),
])
def test_parse_prefix_counters(text, expected):
    assert parse_prefix_counters(text) == expected
