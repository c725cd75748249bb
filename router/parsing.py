"""Request bodies -> RouteRequest, without stalling the event loop on a large one.

A body of a few hundred KB parses and hashes in milliseconds on the loop. A 60 MB one takes
0.2-0.7 s of CPU (``json.loads`` and the hashing hold the GIL, so a thread would not help),
during which /health, the event stream and every other request would wait. Bodies over
``OFFLOAD_BYTES`` are therefore parsed in a worker process (started on first use, one per
router): the loop only copies the bytes into the pipe and gets the small RouteRequest back.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from router.http import parse_json
from router.request import BadRequest, RouteRequest, Tokenizer, parse_request

#: Bodies larger than this are parsed in the worker process.
OFFLOAD_BYTES = 4 * 1024 * 1024

_worker_tokenizer: dict[str, Tokenizer] = {}


def _parse_in_worker(raw: bytes, endpoint: str, headers: dict[str, str], session_header: str,
                     block_size: int, tokenizer_path: str | None,
                     max_input_tokens: int | None) -> RouteRequest:
    tok = None
    if tokenizer_path:
        tok = _worker_tokenizer.get(tokenizer_path)
        if tok is None:
            tok = _worker_tokenizer[tokenizer_path] = Tokenizer(tokenizer_path)
    return parse_request(parse_json(raw), endpoint, headers=headers, session_header=session_header,
                         block_size=block_size, tokenizer=tok, max_input_tokens=max_input_tokens)


class BodyParser:
    """Parses request bodies for the proxy: small ones inline, large ones in a worker process."""

    def __init__(self, config, tokenizer: Tokenizer | None):
        self.config = config
        self.tokenizer = tokenizer
        self._pool: ProcessPoolExecutor | None = None
        self.offloaded = 0

    async def parse(self, raw: bytes, endpoint: str, headers: Any) -> tuple[Any | None, RouteRequest]:
        """(the parsed body, or None when it was parsed in the worker; the RouteRequest).
        Raises BadRequest."""
        cfg = self.config
        if len(raw) <= OFFLOAD_BYTES:
            body = parse_json(raw)
            return body, parse_request(body, endpoint, headers=headers, session_header=cfg.session_header,
                                       block_size=cfg.block_size, tokenizer=self.tokenizer,
                                       max_input_tokens=cfg.max_input_tokens)
        if self._pool is None:
            # spawn, not fork: the router has threads (the writer) that a fork would copy mid-flight
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        self.offloaded += 1
        hv = headers.get(cfg.session_header) if cfg.session_header else None
        try:
            return None, await asyncio.get_running_loop().run_in_executor(
                self._pool, _parse_in_worker, raw, endpoint, {cfg.session_header: hv} if hv else {},
                cfg.session_header, cfg.block_size, cfg.tokenizer, cfg.max_input_tokens)
        except BrokenProcessPool:  # the worker died (killed, out of memory): start a new one next time
            self._pool = None
            raise BadRequest("the router's body parser failed on this request; retry", status=503) from None

    @staticmethod
    def body(raw: bytes, parsed: Any | None) -> Any:
        """The parsed body when a leg needs it (the offload legs rewrite it)."""
        return parsed if parsed is not None else json.loads(raw)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
