"""The parser's worker process, called from the event loop over a socket pair: answers come
back to their own calls (in flight together, out of the order they were asked in nothing),
a worker's exception reaches the caller with its fields, a dead worker fails its calls as a
process pool would, and the BodyParser starts a new one."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from concurrent.futures.process import BrokenProcessPool
from types import SimpleNamespace

import pytest

from router.request import BadRequest
from router.worker import WorkerProcess


def _echo(x, delay=0.0):
    time.sleep(delay)
    return x, os.getpid()


def _refuse(message):
    raise BadRequest(message, "messages", status=413)


def _fail_to_load():
    raise ValueError("this answer cannot be read back")


class _Unreadable:
    """Pickles in the worker, fails to unpickle in the router."""

    def __init__(self, pad: int):
        self.pad = b"x" * pad

    def __reduce__(self):
        return (_fail_to_load, ())


def _unreadable(pad):
    return _Unreadable(pad)


@pytest.mark.parametrize("pad", [10, 2 * 1024 * 1024])  # decoded on the loop / in a thread
async def test_an_answer_that_cannot_be_read_fails_the_call_instead_of_hanging(pad):
    loop = asyncio.get_running_loop()
    w = await WorkerProcess.start()
    try:
        with pytest.raises(BrokenProcessPool):
            await asyncio.wait_for(loop.run_in_executor(w, _unreadable, pad), 30)
        assert w.broken  # the owner starts a new worker; this one reads EOF and exits
        w._proc.join(10)
        assert not w._proc.is_alive()
    finally:
        w.shutdown()


async def test_calls_answer_in_order_and_carry_exceptions():
    loop = asyncio.get_running_loop()
    w = await WorkerProcess.start()
    try:
        big = os.urandom(3 * 1024 * 1024)  # over one socket buffer's worth, both ways
        got = await asyncio.gather(*[loop.run_in_executor(w, _echo, k, 0.01) for k in range(5)],
                                   loop.run_in_executor(w, _echo, big))
        assert [g[0] for g in got[:5]] == list(range(5)) and got[5][0] == big
        assert {g[1] for g in got} == {w.pid} and w.pid != os.getpid()
        with pytest.raises(BadRequest) as exc:
            await loop.run_in_executor(w, _refuse, "too big")
        assert (exc.value.message, exc.value.param, exc.value.status) == ("too big", "messages", 413)
        # a cancelled call's answer is dropped; the next call gets its own
        slow = loop.run_in_executor(w, _echo, "late", 0.2)
        slow.cancel()
        assert (await loop.run_in_executor(w, _echo, "next"))[0] == "next"
    finally:
        w.shutdown()
    assert not w._proc.is_alive()
    with pytest.raises(BrokenProcessPool):
        w.submit(_echo, 1)


async def test_a_dead_worker_fails_its_calls_and_the_parser_starts_another(tmp_path):
    loop = asyncio.get_running_loop()
    w = await WorkerProcess.start()
    call = loop.run_in_executor(w, _echo, 1, 5.0)
    await asyncio.sleep(0.3)
    os.kill(w.pid, signal.SIGKILL)
    with pytest.raises(BrokenProcessPool):
        await asyncio.wait_for(call, 10)
    assert w.broken
    w.shutdown()

    from router.parsing import BodyParser

    cfg = SimpleNamespace(session_header="X-Session-ID", block_size=16, tokenizer=None,
                          max_input_tokens=None)
    parser = BodyParser(cfg, None)
    # token ids (their block hashes are the same in every process), over OFFLOAD_BYTES: the worker parses it
    raw = ("{\"prompt\": [" + ", ".join(str(1000000 + k) for k in range(600_000)) + "]}").encode()
    try:
        _, req = await parser.parse(raw, "completions", {})
        first = parser._pool.pid
        os.kill(first, signal.SIGKILL)
        await asyncio.sleep(0.3)  # the loop sees the socket close
        _, again = await parser.parse(raw, "completions", {})
        assert parser._pool.pid != first and parser.offloaded == 2
        assert (again.input_tokens, again.blocks) == (req.input_tokens, req.blocks) and req.input_tokens == 600_000
        # the hashes cross as one array('q') and reach the router's index as a list of ints
        assert type(req.blocks) is list and len(req.blocks) == 600_000 // 16
    finally:
        parser.close()


async def test_a_burst_of_big_text_bodies_leaves_the_loop_after_the_first():
    """Without a tokenizer, a 256 KB - 4 MB body is parsed on the loop when the loop is free of
    such work, and in the worker when the loop has just parsed another (a burst of cold turns)
    and the worker is ready: the loop then holds one at a time. Both give the same request. The
    worker is started after the first big body; small bodies never start it."""
    import json

    from router import parsing

    cfg = SimpleNamespace(session_header="X-Session-ID", block_size=16, tokenizer=None,
                          max_input_tokens=None)
    small = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    quiet = parsing.BodyParser(cfg, None)
    try:
        for _ in range(3):
            await quiet.parse(small, "chat", {})
        assert quiet._pool is None and quiet._warming is None   # small bodies: no worker
    finally:
        quiet.close()

    parser = parsing.BodyParser(cfg, None)
    text = "def handler(event):\n    return event['body']\n" * 8_000   # 360 KB
    raw = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 1}).encode()
    assert parsing.TEXT_INLINE_BYTES < len(raw) < parsing.OFFLOAD_BYTES
    try:
        body, first = await parser.parse(raw, "chat", {})
        assert body is not None and parser.offloaded == 0            # a free loop: here
        body, _ = await parser.parse(raw, "chat", {})
        assert body is not None and parser.offloaded == 0            # the worker is not ready yet: here
        await asyncio.wait_for(parser._warming, 60)                  # started after the first one
        assert parser._worker_ready()
        await asyncio.sleep(parsing.TEXT_BURST_S * 3)
        body, _ = await parser.parse(raw, "chat", {})
        assert body is not None and parser.offloaded == 0            # a lone turn: here
        body, burst = await parser.parse(raw, "chat", {})
        assert body is None and parser.offloaded == 1                # right after it: the worker
        assert (burst.input_tokens, burst.blocks) == (first.input_tokens, first.blocks)
        body, _ = await parser.parse(small, "chat", {})
        assert body is not None and parser.offloaded == 1            # small ones stay here
        await asyncio.sleep(parsing.TEXT_BURST_S * 3)
        body, later = await parser.parse(raw, "chat", {})
        assert body is not None and parser.offloaded == 1            # the burst is over: here again
        assert later.blocks == first.blocks

        # a body over 4 MB in the worker takes long: a burst does not queue behind it
        huge = ("{\"prompt\": [" + ", ".join(str(1000000 + k) for k in range(600_000)) + "]}").encode()
        big = asyncio.create_task(parser.parse(huge, "completions", {}))
        await asyncio.sleep(0)
        assert parser._huge_in_worker == 1
        await parser.parse(raw, "chat", {})
        body, _ = await parser.parse(raw, "chat", {})
        assert body is not None and parser.offloaded == 2            # here (the huge one counted)
        await big

        # the worker killed mid-burst: the body is parsed here, not refused
        await parser.parse(raw, "chat", {})
        os.kill(parser._pool._proc.pid, signal.SIGKILL)
        body, again = await parser.parse(raw, "chat", {})
        assert body is not None and again.blocks == first.blocks
    finally:
        parser.close()


async def test_close_cancels_the_worker_start():
    import json

    from router import parsing

    cfg = SimpleNamespace(session_header="X-Session-ID", block_size=16, tokenizer=None,
                          max_input_tokens=None)
    parser = parsing.BodyParser(cfg, None)
    raw = json.dumps({"prompt": "x" * (parsing.TEXT_INLINE_BYTES + 10), "max_tokens": 1}).encode()
    await parser.parse(raw, "completions", {})
    task = parser._warming
    assert task is not None
    parser.close()
    assert parser._warming is None
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_worker_that_cannot_start_is_a_503_not_a_crash(monkeypatch):
    """A body over 4 MB needs the worker; when no process can be started (EAGAIN, ENOMEM) the
    client gets a 503 to retry, not the 500 a bug gets."""
    from router import parsing

    async def no_process(*args, **kwargs):
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(parsing.WorkerProcess, "start", no_process)
    cfg = SimpleNamespace(session_header="X-Session-ID", block_size=16, tokenizer=None,
                          max_input_tokens=None)
    parser = parsing.BodyParser(cfg, None)
    raw = ("{\"prompt\": [" + ", ".join(str(1000000 + k) for k in range(600_000)) + "]}").encode()
    try:
        with pytest.raises(BadRequest) as info:
            await parser.parse(raw, "completions", {})
        assert info.value.status == 503 and "could not start" in str(info.value)
    finally:
        parser.close()
