"""Request bodies -> RouteRequest, without stalling the event loop.

Three costs, three places:

- A body of a few hundred KB parses (orjson) and, without a tokenizer, hashes in about a
  millisecond: on the loop. A bigger one (an agentic turn of 800 KB: a few ms) too, unless
  the loop ended parsing another less than ``TEXT_BURST_S`` (10 ms) ago: in a burst of cold
  turns the rest go to the worker process, so that the loop, and /health, wait for one at a
  time. Only while the worker is ready (started and answering: it is started in the background
  after the first big body), is not parsing a body over 4 MB and holds fewer than
  ``TEXT_WORKER_QUEUE`` of them; otherwise, and if it fails, the loop parses the body.
- With ``--tokenizer``, rendering the chat template and tokenizing a 200k-token prompt takes
  hundreds of milliseconds cold. Bodies over ``TOKENIZE_PROCESS_BYTES`` (64 KB) are parsed,
  rendered and tokenized in the worker process: their Python work (JSON, template, block
  hashing) holds the GIL, and in threads of the router's own process it delayed small
  requests and /health by tens of milliseconds while cold prompts arrived (bench_agentic's
  stall phase: tiny p99 82-94 ms -> 13-15 ms). The worker is called straight from the event
  loop over a socket pair (router/worker.py), not through a process pool's threads, which
  cost a returning 200k-token turn milliseconds of wake-ups. Its main thread, at normal
  priority, does a returning turn whole (~6-9 ms of CPU for a 215k-token turn: JSON, template,
  the new text's tokens, the new blocks, most of it the new tokens), and sends the router an
  early answer once the reused prefix is known, so the router routes while the new text is
  tokenized (docs/apis.md, "Exact tokens"); a cold prompt (its session
  has no previous turn there) is rendered, tokenized and hashed on one thread at nice
  ``WORKER_NICE``, so it takes one core, and only what the event loop leaves. Smaller bodies
  are tokenized in a thread of the router's own. Either way the session's previous turn is kept
  (bounded, least recently used out): its tokens up to a piece start inside the text the two
  turns share, and its block hashes for them, are taken as they are, and only the text after
  that is cut and tokenized (router/tokenizer.Tokenizer.ids_after; the tokenizer also keeps the
  pieces it has tokenized, so a system prompt shared by many sessions is tokenized once).
- Bodies over ``OFFLOAD_BYTES`` are parsed in that worker process (started on first use, one
  per router): ``json.loads`` and the hashing hold the GIL, so a thread would not help.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from collections.abc import Callable
from typing import Any

from router.body import ArenaRef, Chunks, Handoff, as_bytes, fetch
from router.http import parse_json
from router.request import BadRequest, Counted, Parsed, RouteRequest, count_prompt, read_body, route_request
from router.tokenizer import Tokenizer, load_tokenizer
from router.worker import WorkerProcess
from router.worker import partial as worker_partial

log = logging.getLogger("kvtop.route")

#: Bodies larger than this are parsed in the worker process.
OFFLOAD_BYTES = 4 * 1024 * 1024
#: Without a tokenizer, a body over this size is parsed on the loop unless the loop finished
#: parsing another less than ``TEXT_BURST_S`` ago (a burst) and the worker is ready for it.
#: One 830 KB agentic turn parses and hashes in a few ms on the loop (a worker round trip
#: adds ~1.7 ms), but six cold ones at once held the loop, and /health, 23-61 ms.
TEXT_INLINE_BYTES = 256 * 1024
TEXT_BURST_S = 0.01
#: At most this many burst bodies wait in the worker; past it, the loop parses the next.
TEXT_WORKER_QUEUE = 4
#: After the worker failed to start, bursts stay on the loop for this long before another try.
WARM_RETRY_S = 30.0
#: With a tokenizer, bodies larger than this are parsed, rendered and tokenized in the worker
#: process (which keeps its sessions' previous turns): the GIL of the event loop's process is
#: then never held by a big prompt's Python work (JSON, template, hashing), which on a busy host
#: delayed small requests and /health by tens of milliseconds.
TOKENIZE_PROCESS_BYTES = 64 * 1024
#: The worker's main thread runs at the router's own priority: a returning turn (a few ms of
#: work) must not wait behind other work on the host. A cold prompt's tokenizing (hundreds of
#: ms) and a body over OFFLOAD_BYTES run on one thread of nice WORKER_NICE, one core at a
#: time (the tokenizer's thread pool would take every core from the event loop).
WORKER_NICE = 10
#: Sessions whose previous turn (token ids, rendered text and its piece starts, block hashes)
#: is kept for the next one: ~1.8 MB for a 215k-token turn (ids 0.86, text 0.83, hashes 0.1),
#: so at most ~0.5 GB in the worker with every slot holding a session that long.
SESSION_TURNS = 256

_worker_tokenizer: dict[str, Tokenizer] = {}
_worker_turns: "OrderedDict[str, Counted]" = OrderedDict()
_worker_background: ThreadPoolExecutor | None = None


def _background() -> ThreadPoolExecutor:
    global _worker_background
    if _worker_background is None:
        _worker_background = ThreadPoolExecutor(1, thread_name_prefix="kvtop-parse-cold",
                                                initializer=_lower_priority)
    return _worker_background


def _ping() -> bool:
    """A call that makes the worker import this module (and what it imports) before a burst."""
    return True


def _parse_in_worker(raw: bytes | ArenaRef, endpoint: str, headers: dict[str, str], session_header: str,
                     block_size: int, tokenizer_path: str | None,
                     max_input_tokens: int | None, early: bool = False) -> RouteRequest:
    """In the worker's main thread: a returning turn here; a cold prompt's counting, and a body
    over OFFLOAD_BYTES whole, on the low-priority thread. ``early``: a returning turn's
    request goes to the router as soon as its shared prefix is counted (``_preview``)."""
    if (raw.size if isinstance(raw, ArenaRef) else len(raw)) > OFFLOAD_BYTES:
        return _background().submit(_parse, raw, endpoint, headers, session_header, block_size,
                                    tokenizer_path, max_input_tokens).result()
    return _parse(raw, endpoint, headers, session_header, block_size, tokenizer_path, max_input_tokens,
                  early)


def _preview(parsed: Parsed, prev: Counted, block_size: int,
             max_input_tokens: int | None) -> Callable[[int, str], None]:
    """``on_cut`` for a returning turn in the worker: send the router the request with the
    previous turn's first ``tokens`` ids (counted, and their block hashes, which are exact) and
    the new text after them estimated at the session's own characters per token, before that
    text is tokenized. Nothing is sent when the text could hold more tokens than the router
    allows (it must refuse such a request before it goes), or when no whole block is shared."""
    def on_cut(tokens: int, rest: str) -> None:
        if tokens < block_size or prev.pieces is None or not prev.pieces.text:
            return
        # a byte-level tokenizer makes at most one token per byte of text
        if max_input_tokens is not None and tokens + len(rest.encode("utf-8", "surrogatepass")) > max_input_tokens:
            return
        estimate = round(len(rest) * len(prev.tokens) / len(prev.pieces.text))
        blocks = prev.blocks[:tokens // block_size]
        req = route_request(parsed, Counted(tokens + estimate, blocks, "tokenizer"), blocks_as_list=False)
        req.tail_estimate = estimate
        worker_partial(req)
    return on_cut


def _parse(raw: bytes | ArenaRef, endpoint: str, headers: dict[str, str], session_header: str,
           block_size: int, tokenizer_path: str | None, max_input_tokens: int | None,
           early: bool = False) -> RouteRequest:
    raw = fetch(raw)
    tok = None
    if tokenizer_path:
        tok = _worker_tokenizer.get(tokenizer_path)
        if tok is None:
            tok = _worker_tokenizer[tokenizer_path] = load_tokenizer(tokenizer_path, parallel=False)
    parsed = read_body(parse_json(raw), endpoint, headers=headers, session_header=session_header)
    key = _turn_key(parsed) if tok is not None and parsed.prompt.tokens is None else None
    prev = _worker_turns.get(key) if key else None
    if tok is not None and prev is None and threading.current_thread() is threading.main_thread():
        # a cold prompt (no previous turn here): its rendering, tokenizing and hashing take
        # hundreds of ms, on the low-priority thread
        counted = _background().submit(count_prompt, parsed.prompt, block_size, tok).result()
    else:
        on_cut = (_preview(parsed, prev, block_size, max_input_tokens)
                  if early and prev is not None and prev.tokens is not None else None)
        counted = count_prompt(parsed.prompt, block_size, tok, prev, on_cut)
    if key:
        _worker_turns[key] = counted
        _worker_turns.move_to_end(key)
        while len(_worker_turns) > SESSION_TURNS:
            _worker_turns.popitem(last=False)
    return route_request(parsed, counted, max_input_tokens=max_input_tokens, blocks_as_list=False)


class BodyParser:
    """Parses request bodies for the proxy: small ones on the loop, tokenizing in threads,
    large ones in a worker process."""

    def __init__(self, config, tokenizer: Tokenizer | None):
        self.config = config
        self.tokenizer = tokenizer
        self._pool: WorkerProcess | None = None
        self._starting = asyncio.Lock()
        self._small: ThreadPoolExecutor | None = None
        self._inline_big_end = float("-inf")   # when the loop last ended parsing a big text body
        self._warming: asyncio.Task | None = None
        self._warm_retry_at = float("-inf")
        self._pinged: WorkerProcess | None = None   # the worker that answered a call since it started
        self._in_worker = 0          # bodies in the worker now
        self._huge_in_worker = 0     # of which over OFFLOAD_BYTES
        self._turns: OrderedDict[str, Counted] = OrderedDict()
        self._handoff = Handoff()
        self.offloaded = 0
        self.tokenized = 0
        #: router/supervise.py's Supervisor: a worker process that dies is reported to it
        self.supervisor = None

    async def parse(self, raw: bytes, endpoint: str, headers: Any, *,
                    early: bool = False) -> tuple[Any | None, RouteRequest]:
        """(the parsed body, or None when it was parsed in the worker; the RouteRequest).
        Raises BadRequest.

        ``early``: a returning turn parsed in the worker may come back before its new text is
        tokenized, its prefix counted and the rest estimated (``RouteRequest.tail_estimate``);
        ``RouteRequest.counting`` is then a future of the counted request (the same request
        but for ``input_tokens`` and ``blocks``), done a few milliseconds later."""
        cfg = self.config
        tok = self.tokenizer
        size = len(raw)
        huge = size > OFFLOAD_BYTES
        if tok is not None:
            inline = size <= TOKENIZE_PROCESS_BYTES
        elif size <= TEXT_INLINE_BYTES:
            inline = True
        else:   # 256 KB - 4 MB: here unless a burst finds the worker ready and not behind a huge body
            inline = not huge and not self._burst_to_worker()
        if inline:
            return await self._parse_here(raw, endpoint, headers)
        burst = tok is None and not huge
        self._in_worker += 1
        self._huge_in_worker += huge
        try:
            pool = await self._worker()
            self.offloaded += 1
            hv = headers.get(cfg.session_header) if cfg.session_header else None
            args = (endpoint, {cfg.session_header: hv} if hv else {}, cfg.session_header, cfg.block_size,
                    cfg.tokenizer, cfg.max_input_tokens)
            if early and self.tokenizer is not None:
                provisional, req, final = await self._handoff.run_partial(
                    asyncio.get_running_loop(), pool, _parse_in_worker, raw, *args, True)
                if provisional:
                    req.counting = final
                    # registered before the proxy's amend callback, so it runs first (asyncio
                    # runs a future's callbacks in order); it also retrieves a failed count's
                    # exception when the request was refused before the proxy registered one
                    final.add_done_callback(_blocks_as_list)
            else:
                req = await self._handoff.run(asyncio.get_running_loop(), pool, _parse_in_worker, raw, *args)
        except (BrokenProcessPool, OSError) as exc:
            # the worker died (killed, out of memory) or could not start: a new one next time
            if isinstance(exc, BrokenProcessPool) and self._pool is not None and self._pool.broken:
                self._pool = None
                if self.supervisor is not None:
                    self.supervisor.died("parser-worker", exc, kind="parser-worker",
                                         fallback="a new worker starts on next use", running=True)
            if burst:   # a body the loop can parse: parse it here rather than fail it
                log.warning("the body parser's worker failed (%s); parsing on the loop", exc)
                return await self._parse_here(raw, endpoint, headers)
            if isinstance(exc, OSError):   # no process to start (EAGAIN, ENOMEM): the host, not a bug
                raise BadRequest(f"the router could not start its body parser ({exc.strerror or exc}); retry",
                                 status=503) from None
            raise BadRequest("the router's body parser failed on this request; retry", status=503) from None
        finally:
            self._in_worker -= 1
            self._huge_in_worker -= huge
        if not isinstance(req.blocks, list):  # an array('q') from the worker: one buffer, not 13,000 ints
            req.blocks = req.blocks.tolist()
        return None, req

    async def _parse_here(self, raw: bytes | Chunks, endpoint: str, headers: Any) -> tuple[Any, RouteRequest]:
        """Parse on the loop (the template and tokens, when there are any, in a thread)."""
        cfg = self.config
        tok = self.tokenizer
        big_text = tok is None and len(raw) > TEXT_INLINE_BYTES
        try:
            body = parse_json(as_bytes(raw))
            parsed = read_body(body, endpoint, headers=headers, session_header=cfg.session_header)
            if tok is None or parsed.prompt.tokens is not None:
                counted = count_prompt(parsed.prompt, cfg.block_size)
            else:
                counted = await self._count(parsed)
            return body, route_request(parsed, counted, max_input_tokens=cfg.max_input_tokens)
        finally:
            if big_text:
                self._inline_big_end = time.monotonic()
                if (not self._worker_ready() and self._warming is None
                        and time.monotonic() >= self._warm_retry_at):   # ready for the next burst
                    self._warming = asyncio.get_running_loop().create_task(self._warm())

    def _worker_ready(self) -> bool:
        """The worker answered a call since it (re)started, and has not died since."""
        return self._pinged is not None and self._pinged is self._pool and not self._pool.broken

    def _burst_to_worker(self) -> bool:
        """A big text body that should go to the worker: the loop finished parsing another
        less than TEXT_BURST_S ago, and the worker is ready, not parsing a body over
        OFFLOAD_BYTES (which takes seconds) and holds fewer than TEXT_WORKER_QUEUE bodies."""
        return (time.monotonic() - self._inline_big_end <= TEXT_BURST_S and self._worker_ready()
                and not self._huge_in_worker and self._in_worker < TEXT_WORKER_QUEUE)

    async def _warm(self) -> None:
        """Start the worker and make one call (its start and imports take 0.1-1 s), so that
        a burst finds it ready; after a failure, not again for WARM_RETRY_S."""
        try:
            pool = await self._worker()
            await asyncio.get_running_loop().run_in_executor(pool, _ping)
            self._pinged = pool
        except Exception as exc:  # noqa: BLE001 - bursts stay on the loop; say why
            self._warm_retry_at = time.monotonic() + WARM_RETRY_S
            log.warning("could not start the body parser's worker process: %s", exc)
        finally:
            self._warming = None

    async def _worker(self) -> WorkerProcess:
        """The worker process, started on first use (and again after it died)."""
        async with self._starting:
            if self._pool is None or self._pool.broken:
                self._pool = await WorkerProcess.start()
            return self._pool

    async def _count(self, parsed: Parsed) -> Counted:
        """Render and tokenize in a thread, reusing the session's previous turn."""
        if self._small is None:
            self._small = ThreadPoolExecutor(1, thread_name_prefix="kvtop-tokenize-small")
        pool = self._small
        key = _turn_key(parsed)
        prev = self._turns.get(key) if key else None
        counted = await asyncio.get_running_loop().run_in_executor(
            pool, count_prompt, parsed.prompt, self.config.block_size, self.tokenizer, prev)
        self.tokenized += 1
        if key:
            self._turns[key] = counted
            self._turns.move_to_end(key)
            while len(self._turns) > SESSION_TURNS:
                self._turns.popitem(last=False)
        return counted

    @staticmethod
    def body(raw: bytes | Chunks, parsed: Any | None) -> Any:
        """The parsed body when a leg needs it (the offload legs rewrite it)."""
        return parsed if parsed is not None else json.loads(as_bytes(raw))

    def close(self) -> None:
        if self._warming is not None:
            self._warming.cancel()
            self._warming = None
        self._handoff.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._small is not None:
            self._small.shutdown(wait=False, cancel_futures=True)
            self._small = None


def _blocks_as_list(final: asyncio.Future) -> None:
    """The counted request arrived: its blocks as a list, like every request's."""
    if final.cancelled() or final.exception() is not None:
        return
    req = final.result()
    if not isinstance(req.blocks, list):
        req.blocks = req.blocks.tolist()


def _lower_priority() -> None:
    """The worker's thread for cold prompts and huge bodies runs at a lower CPU priority (Linux:
    per thread), so that on a busy host the event loop (/health, small requests, streams) and
    returning turns are scheduled first."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICE)
    except (AttributeError, OSError):  # not Linux, or not permitted: the default priority
        pass


def _turn_key(parsed: Parsed) -> str | None:
    """Whose previous turn to reuse: the client's session, else the first message's start
    (a session without an id still repeats its system prompt and first message)."""
    if parsed.session_id is not None:
        return f"{parsed.endpoint}:{parsed.session_id}"
    p = parsed.prompt
    if p.messages:
        first = p.messages[0].get("content")
        if isinstance(first, str) and first:
            return f"{parsed.endpoint}:m:{hash(first[:4096])}"
    if p.text:
        return f"{parsed.endpoint}:t:{hash(p.text[:4096])}"
    return None
