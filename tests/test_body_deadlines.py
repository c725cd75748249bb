"""router/deadlines.py: bodies on their way fail at --client-timeout, one timer for all."""

from __future__ import annotations

import asyncio

from router.deadlines import BodyDeadlines


class _Stream:
    def __init__(self):
        self.exc = None

    def set_exception(self, exc):
        self.exc = exc


async def test_one_timer_for_many_reads_and_each_fails_at_its_deadline(monkeypatch):
    loop = asyncio.get_running_loop()
    d = BodyDeadlines(loop)
    timers = []
    real = loop.call_at

    def call_at(at, fn, *a, **kw):
        if fn == d._fire:
            timers.append(at)
        return real(at, fn, *a, **kw)
    monkeypatch.setattr(loop, "call_at", call_at)
    early, done, late = _Stream(), _Stream(), _Stream()
    d.add(early, 0.15, lambda: TimeoutError("early"))
    d.add(done, 0.15, lambda: TimeoutError("done"))
    await asyncio.sleep(0.1)
    d.add(late, 0.15, lambda: TimeoutError("late"))
    assert len(timers) == 1  # the later deadlines found the timer set sooner
    d.discard(done)  # its body arrived
    await asyncio.sleep(0.1)
    assert str(early.exc) == "early" and done.exc is None and late.exc is None
    assert len(timers) == 2  # fired once, set again for the one left
    await asyncio.sleep(0.1)
    assert str(late.exc) == "late" and d.waiting == {} and d.handle is None


async def test_a_shorter_timeout_moves_the_timer_earlier():
    d = BodyDeadlines(asyncio.get_running_loop())
    slow, quick = _Stream(), _Stream()
    d.add(slow, 30.0, lambda: TimeoutError("slow"))
    d.add(quick, 0.05, lambda: TimeoutError("quick"))
    await asyncio.sleep(0.15)
    assert str(quick.exc) == "quick" and slow.exc is None
    assert d.handle is not None and d.handle.when() > asyncio.get_running_loop().time() + 20
    d.discard(slow)
    d.handle.cancel()
