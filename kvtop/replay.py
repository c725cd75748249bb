"""Replay a trace against a router or a vLLM instance over HTTP and record every request.

Each trace request becomes a prompt on ``POST /v1/completions`` (tokens from the trace's
block hashes, so equal hash ids mean equal prefixes; sent as token ids, or with
``--prompt-format text`` as one 4-character word per token), streamed with usage, sent
open loop (at arrival / speed) or closed loop (each session's next turn its think time
after the previous answer ended, as agents behave). Results go to a JSONL file that
``kvtop report`` reads: a header line, then one line per request.

``--api`` sends each request as that client would instead: ``chat`` (system + tools +
tool-call turns on /v1/chat/completions), ``messages`` (Claude Code's Anthropic Messages on
/v1/messages: system blocks with cache_control, 20 tools, tool_use / tool_result turns,
``metadata.user_id`` carrying the session, stream true) or ``responses`` (/v1/responses:
instructions, tools, function_call / function_call_output items, ``prompt_cache_key``). The
trace's tokens become text (one word per token, as ``--prompt-format text``) cut at fixed token
positions (system, tools, then one message per ``TURN_TOKENS``), so a session's turns share
their prefix exactly as the trace's block hashes say.

  kvtop replay trace.jsonl --target http://127.0.0.1:8000 --arm lmetric --out lmetric.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import string
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from router.classes import route_class
from router.engine_metrics import ParseError, parse_prometheus
from store.results import RequestResult

RESULTS_VERSION = 1
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PROMPT_FORMATS = ("tokens", "text")
APIS = {"completions": "/v1/completions", "chat": "/v1/chat/completions",
        "messages": "/v1/messages", "responses": "/v1/responses"}
#: How --api lays a prompt's tokens out: the system prompt, 20 tools, then one message per turn.
SYSTEM_TOKENS, TOOLS, TOOL_TOKENS, TURN_TOKENS = 2048, 20, 64, 1024

# Text prompts: token id i becomes the word " abc" (a space and three letters, i mod 26**3).
# kvtop sim's stand-in tokenizer reads each such word as exactly one token, and kvtop's
# text fallback (4 characters a token) counts it exactly, so lengths, block boundaries and
# shared prefixes are those of the token-id prompt. A real BPE tokenizer splits them otherwise.
_LETTERS = string.ascii_lowercase
TEXT_VOCAB = len(_LETTERS) ** 3  # 17,576 distinct words
_WORDS = [" " + a + b + c for a in _LETTERS for b in _LETTERS for c in _LETTERS]


def ids_to_text(ids: Sequence[int]) -> str:
    """One 4-character word per token id (ids taken modulo 26**3)."""
    return "".join([_WORDS[i % TEXT_VOCAB] for i in ids])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", metavar="TRACE", help="trace file (any format kvtop's loader reads)")
    p.add_argument("--target", required=True, metavar="URL",
                   help="base URL of the router or instance, e.g. http://127.0.0.1:8000")
    p.add_argument("--speed", type=float, default=1.0, metavar="X",
                   help="divide every arrival time and think time by X (default 1)")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="replay only the first N requests by arrival")
    p.add_argument("--mode", choices=("open", "closed"), default="open",
                   help="open: send at arrival/speed; closed: a session's next turn is sent "
                        "think_time/speed after the previous answer ended (default open)")
    p.add_argument("--vocab-size", type=int, default=32000, metavar="V",
                   help="token ids are drawn below V; match the served model (default 32000; "
                        f"text prompts draw below {TEXT_VOCAB:,}, one word each)")
    p.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="tokens",
                   help="tokens: the prompt is a list of token ids (default); text: each id "
                        "becomes one 4-character word (' abc'), for routers that reject token "
                        "ids (sglang-router). Only kvtop sim's tokenizer reads one token per "
                        "word, and only there is kvtop's 4-characters-a-token estimate exact; a "
                        "real model's tokenizer gives other lengths and block boundaries")
    p.add_argument("--api", choices=tuple(APIS), default="completions",
                   help="completions: token-id or text prompts (default); chat, messages (Claude "
                        "Code's Anthropic Messages), responses (OpenAI Responses): the trace's "
                        "sessions as those agents send them, system + tools + tool-call turns, as text")
    p.add_argument("--out", default="results.jsonl", metavar="FILE",
                   help="results file, JSONL (default results.jsonl)")
    p.add_argument("--arm", default=None, metavar="LABEL",
                   help="label for this run in reports (default: the results file's name)")
    p.add_argument("--model", default=None,
                   help="model name in the request body (default: the target's first /v1/models)")
    p.add_argument("--session-header", default="X-Session-ID", metavar="NAME",
                   help="header that carries the trace's session id (default X-Session-ID)")
    p.add_argument("--max-concurrency", type=int, default=512, metavar="C",
                   help="at most C requests in flight; later sends wait (default 512, 0 = no cap)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="give up on one request after S seconds (default 600)")
    p.add_argument("--scrape", action="append", default=[], metavar="URL",
                   help="engine base URL whose /metrics prefix-cache counters are read before "
                        "and after the run (repeat for each engine)")
    p.add_argument("--duration", type=float, default=None, metavar="S",
                   help="send only requests due in the first S wall seconds, then wait for their "
                        "answers (a bounded run whose every request completes)")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def run(args: argparse.Namespace) -> int:
    from kvtop.cli import CliError

    if args.speed <= 0:
        raise CliError("--speed must be positive")
    if args.limit is not None and args.limit <= 0:
        raise CliError("--limit must be positive")
    if args.timeout <= 0:
        raise CliError("--timeout must be positive")
    if args.duration is not None and args.duration <= 0:
        raise CliError("--duration must be positive")
    if args.vocab_size < 1:
        raise CliError("--vocab-size must be positive")
    if args.max_concurrency < 0:
        raise CliError("--max-concurrency must be 0 (no cap) or more")
    # Fail before the run, not after it: a replay can take hours and its results would be lost.
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):
        raise CliError(f"cannot write --out {args.out}: {out_dir} is not a writable directory")
    requests = _load(args.trace, args.limit)
    cfg = ReplayConfig(
        target=args.target.rstrip("/"), speed=args.speed, mode=args.mode,
        vocab_size=args.vocab_size, prompt_format=args.prompt_format,
        arm=args.arm or _stem(args.out), model=args.model,
        session_header=args.session_header, max_concurrency=args.max_concurrency,
        timeout=args.timeout, scrape=[u.rstrip("/") for u in args.scrape], trace=args.trace,
        progress=not args.no_progress and sys.stderr.isatty(), duration=args.duration, api=args.api)
    result = asyncio.run(replay(requests, cfg))
    write_results(args.out, result)
    ok = sum(r["status"] == "ok" for r in result.records)
    wall = result.ended_at - result.started_at
    note = " (interrupted)" if result.interrupted else ""
    print(f"replay{note}: {len(result.records)} requests, {ok} ok, {len(result.records) - ok} "
          f"errors in {wall:.1f} s -> {args.out}", file=sys.stderr)
    return 130 if result.interrupted else 0


def _stem(path: str) -> str:
    base = os.path.basename(path)
    return base[:-len(".jsonl")] if base.endswith(".jsonl") else os.path.splitext(base)[0]


def _load(path: str, limit: int | None) -> list[Any]:
    from kvtop.cli import CliError

    if not os.path.exists(path):
        raise CliError(f"trace file not found: {path}")
    try:
        from kvtop.traces.loader import load_trace
    except ImportError as exc:  # pragma: no cover - only before the loader exists
        raise CliError(f"the trace loader is not available ({exc})") from exc
    try:
        requests = load_trace(path, on_error="skip")
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot read trace {path}: {exc}") from exc
    if not requests:
        raise CliError(f"trace {path} has no requests")
    requests = sorted(requests, key=lambda r: r.arrival)  # stable: file order among ties
    return requests[:limit] if limit else requests


# --- the replay engine ---------------------------------------------------------------------

@dataclass
class ReplayConfig:
    target: str
    speed: float = 1.0
    mode: str = "open"
    vocab_size: int = 32000
    #: "tokens" (token-id prompts) or "text" (one 4-character word per token, ids_to_text)
    prompt_format: str = "tokens"
    arm: str = "replay"
    model: str | None = None
    session_header: str = "X-Session-ID"
    max_concurrency: int = 512
    timeout: float = 600.0
    scrape: list[str] = field(default_factory=list)
    trace: str = ""
    progress: bool = False
    #: wall seconds during which requests are sent; None = the whole trace
    duration: float | None = None
    #: token synthesis; None = kvtop.traces.synth.tokens_for_request (tests inject their own)
    tokens: Callable[[Any, int], list[int]] | None = None
    #: completions | chat | messages | responses (the client API the requests are sent as)
    api: str = "completions"


@dataclass
class ReplayResult:
    header: dict[str, Any]
    records: list[dict[str, Any]]
    started_at: float
    ended_at: float
    interrupted: bool = False


class TargetUnreachable(Exception):
    pass


def _tokens_fn(cfg: ReplayConfig) -> Callable[[Any, int], list[int]]:
    if cfg.tokens is not None:
        return cfg.tokens
    from kvtop.traces.synth import tokens_for_request

    # Text prompts have one word per id below TEXT_VOCAB: draw there, so no two ids share a word.
    text = cfg.prompt_format == "text" or cfg.api != "completions"
    vocab = min(cfg.vocab_size, TEXT_VOCAB) if text else cfg.vocab_size

    def tokens(req: Any, index: int) -> list[int]:
        # The salt makes each request's tail unique, so two requests share exactly the
        # blocks whose hash ids they share and nothing more.
        return tokens_for_request(req, vocab_size=vocab,
                                  request_salt=f"{req.session}/{req.turn}/{index}")
    return tokens


async def replay(requests: Sequence[Any], cfg: ReplayConfig) -> ReplayResult:
    """Replay ``requests`` (sorted by arrival) against ``cfg.target``; never raises on a
    failed request (it becomes an error record). Raises ``kvtop.cli.CliError`` when the
    target or a scrape URL cannot be reached before the run starts."""
    import aiohttp

    from kvtop.cli import CliError

    if cfg.prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, "
                         f"not {cfg.prompt_format!r}")
    if cfg.api not in APIS:
        raise ValueError(f"api must be one of {tuple(APIS)}, not {cfg.api!r}")
    tokens = _tokens_fn(cfg)
    limit = cfg.max_concurrency
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit, ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout, sock_connect=min(10.0, cfg.timeout))
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        try:
            model = await _check_target(http, cfg)
            before = await _scrape_all(http, cfg.scrape)
        except TargetUnreachable as exc:
            raise CliError(str(exc)) from None
        runner = _Runner(http, cfg, requests, tokens, model)
        started_wall = time.time()
        interrupted = False
        try:
            await runner.run()
        except asyncio.CancelledError:  # Ctrl-C: asyncio.run cancels us; keep what we have
            interrupted = True
            await runner.cancel_inflight()
        ended_wall = time.time()
        after = None
        if not interrupted:
            try:
                after = await _scrape_all(http, cfg.scrape)
            except TargetUnreachable as exc:
                print(f"replay: warning: {exc}; no engine prefix-cache figures", file=sys.stderr)
    engine = _delta(before, after)
    header = {"kvtop_results": RESULTS_VERSION, "arm": cfg.arm, "target": cfg.target,
              "trace": cfg.trace, "mode": cfg.mode, "speed": cfg.speed,
              "prompt_format": cfg.prompt_format, "api": cfg.api,
              "started_at": started_wall, "ended_at": ended_wall,
              "engine_prefix_cache": engine}
    if interrupted:
        header["interrupted"] = True
    records = [r.as_record() for r in sorted(runner.records, key=lambda r: r.sent_at)]
    return ReplayResult(header, records, started_wall, ended_wall, interrupted)


async def _check_target(http: Any, cfg: ReplayConfig) -> str | None:
    """Reach the target once; return the model name to send (None = let the server pick)."""
    import aiohttp

    url = cfg.target + "/v1/models"
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
            body = await resp.json(content_type=None) if resp.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise TargetUnreachable(f"cannot reach target {cfg.target} ({_why(exc)})") from None
    except ValueError:
        body = None
    if cfg.model:
        return cfg.model
    try:
        return body["data"][0]["id"]
    except (TypeError, KeyError, IndexError):
        return None


def _why(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:200]


def parse_prefix_counters(text: str) -> dict[str, float]:
    """Sum vLLM's prefix-cache counters over all label sets in Prometheus text format; {}
    unless the page has both (or its lines for them do not parse)."""
    try:
        metrics = parse_prometheus(text, (PREFIX_QUERIES, PREFIX_HITS))
    except ParseError:
        return {}
    if PREFIX_QUERIES not in metrics or PREFIX_HITS not in metrics:
        return {}
    return {key: sum(v for _, v in metrics[name])
            for key, name in (("queries", PREFIX_QUERIES), ("hits", PREFIX_HITS))}


async def _scrape_all(http: Any, urls: list[str]) -> dict[str, float] | None:
    """Sum the counters over ``urls``; None when no URL exposes them (or none was given)."""
    import aiohttp

    if not urls:
        return None
    total = {"queries": 0.0, "hits": 0.0}
    found = False
    for base in urls:
        url = base if base.endswith("/metrics") else base + "/metrics"
        try:
            async with http.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
                text = await resp.text() if resp.status == 200 else ""
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise TargetUnreachable(f"cannot scrape {url} ({_why(exc)})") from None
        counters = parse_prefix_counters(text)
        if counters:
            found = True
            total["queries"] += counters["queries"]
            total["hits"] += counters["hits"]
    return total if found else None


def _delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict | None:
    if before is None or after is None:
        return None
    return {k: _num(after[k] - before[k]) for k in ("queries", "hits")}


def _num(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


class _Runner:
    """Sends the requests on schedule and collects one record per request sent."""

    def __init__(self, http: Any, cfg: ReplayConfig, requests: Sequence[Any],
                 tokens: Callable[[Any, int], list[int]], model: str | None):
        self.http, self.cfg, self.requests, self.tokens, self.model = http, cfg, requests, tokens, model
        self.records: list[RequestResult] = []
        self.sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        self.sent = self.done = self.errors = 0
        self.tasks: set[asyncio.Task] = set()
        self.t0 = 0.0
        self.arrival0 = min((r.arrival for r in requests), default=0.0)
        self.url = cfg.target + APIS[cfg.api]

    async def run(self) -> None:
        self.t0 = time.perf_counter()
        progress = asyncio.create_task(self._progress()) if self.cfg.progress else None
        try:
            if self.cfg.mode == "closed":
                await self._closed()
            else:
                await self._open()
        finally:
            if progress:
                progress.cancel()
                print(file=sys.stderr)

    def _past_duration(self, due: float) -> bool:
        """True once a send would fall after ``--duration``: stop sending, keep receiving."""
        return self.cfg.duration is not None and due > self.cfg.duration

    def _due(self, req: Any) -> float:
        return (req.arrival - self.arrival0) / self.cfg.speed

    async def _sleep_until(self, t: float) -> None:
        delay = t - (time.perf_counter() - self.t0)
        if delay > 0:
            await asyncio.sleep(delay)

    async def _open(self) -> None:
        for index, req in enumerate(self.requests):
            # Build the body before the wait, so synthesis and JSON encoding of a long prompt
            # happen in slack time instead of delaying this send and other streams' tokens.
            if self._past_duration(self._due(req)):
                break
            payload = self._payload(index, req)
            await self._sleep_until(self._due(req))
            if self.sem:
                await self.sem.acquire()  # a full pipe delays the send; sent_at shows by how much
            task = asyncio.create_task(self._send(index, req, payload, acquired=True))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        while self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)

    async def _closed(self) -> None:
        sessions: dict[str, list[tuple[int, Any]]] = {}
        for index, req in enumerate(self.requests):
            sessions.setdefault(str(req.session), []).append((index, req))
        coros = [self._session(sorted(turns, key=lambda it: (it[1].turn, it[1].arrival)))
                 for turns in sessions.values()]
        tasks = [asyncio.create_task(c) for c in coros]
        self.tasks.update(tasks)
        try:
            await asyncio.gather(*tasks)
        finally:
            self.tasks.difference_update(tasks)

    async def _session(self, turns: list[tuple[int, Any]]) -> None:
        prev_end: float | None = None
        for index, req in turns:
            if prev_end is None:
                due = self._due(req)
            elif req.think_time is not None:
                due = prev_end + max(0.0, float(req.think_time)) / self.cfg.speed
            else:
                # No think time in the trace: keep its schedule, never before the answer.
                due = max(prev_end, self._due(req))
            if self._past_duration(due):
                return
            await self._sleep_until(due)
            # Built after the wait: a payload per waiting session would hold too much memory.
            await self._send(index, req, self._payload(index, req), acquired=False)
            prev_end = time.perf_counter() - self.t0

    async def cancel_inflight(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)

    def _payload(self, index: int, req: Any) -> bytes:
        ids = self.tokens(req, index)
        if self.cfg.api != "completions":
            body = agent_body(self.cfg.api, ids, str(req.session), max(1, int(req.output_tokens)))
            if self.model:
                body["model"] = self.model
            return json.dumps(body, separators=(",", ":")).encode()
        body: dict[str, Any] = {
            "prompt": ids_to_text(ids) if self.cfg.prompt_format == "text" else ids,
            "max_tokens": max(1, int(req.output_tokens)),
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.model:
            body["model"] = self.model
        return json.dumps(body, separators=(",", ":")).encode()

    async def _send(self, index: int, req: Any, payload: bytes, *, acquired: bool
                    ) -> RequestResult:
        if self.sem and not acquired:
            await self.sem.acquire()
        try:
            return await self._request(index, req, payload)
        finally:
            if self.sem:
                self.sem.release()

    async def _request(self, index: int, req: Any, payload: bytes) -> RequestResult:
        import aiohttp

        cfg = self.cfg
        own_id = f"{cfg.arm}-{index}"
        headers = {"Content-Type": "application/json", "X-Request-Id": own_id}
        if cfg.api in ("completions", "chat"):  # messages and responses carry it in the body
            headers[cfg.session_header] = str(req.session)
        record = RequestResult(
            request_id=own_id, session=str(req.session), turn=req.turn,
            arrival=req.arrival, sent_at=None, input_tokens=int(req.input_tokens),
            output_tokens=int(req.output_tokens), status="error", http_status=None,
            error=None, route_class=route_class(int(req.input_tokens)), arm=cfg.arm)
        self.records.append(record)  # now, so Ctrl-C still finds it
        self.sent += 1
        start = time.perf_counter()
        record.sent_at = round(start - self.t0, 6)
        first: float | None = None
        usage: dict[str, Any] | None = None
        try:
            async with self.http.post(self.url, data=payload, headers=headers) as resp:
                record.http_status = resp.status
                record.instance = resp.headers.get("X-Kvtop-Instance")
                record.request_id = resp.headers.get("X-Kvtop-Request-Id") or own_id
                if resp.status != 200:
                    text = (await resp.text(errors="replace"))[:300]
                    record.error = f"HTTP {resp.status}: {text.strip()}" if text.strip() \
                        else f"HTTP {resp.status}"
                else:
                    async for line in resp.content:
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            continue  # read to the end, so the connection can be reused
                        if first is not None and b'"usage"' not in data \
                                and b'"error"' not in data:
                            continue  # after the first token only usage and errors matter
                        try:
                            event = json.loads(data)
                        except ValueError:
                            continue
                        if not isinstance(event, dict):
                            continue
                        if first is None and _has_token(event):
                            first = time.perf_counter()
                        u = event.get("usage")
                        if u is None and isinstance(event.get("response"), dict):
                            u = event["response"].get("usage")  # response.completed
                        if u:
                            usage = u
                        if event.get("error"):
                            record.error = _error_text(event["error"])
                        elif event.get("type") == "error":  # a Responses stream's error event
                            record.error = _error_text(event)
                    if record.error is None:
                        record.status = "ok"
        except asyncio.CancelledError:
            record.error = "cancelled"
            raise
        except asyncio.TimeoutError:
            record.error = f"timeout after {cfg.timeout:g} s"
        except (aiohttp.ClientError, OSError) as exc:
            record.error = _why(exc)
        finally:
            end = time.perf_counter()
            if record.status == "ok":
                record.e2e_ms = round((end - start) * 1000, 3)
                if first is not None:
                    record.ttft_ms = round((first - start) * 1000, 3)
                else:  # no text at all (e.g. empty output): the first token is the end
                    record.ttft_ms = record.e2e_ms
                if usage:
                    out = usage.get("completion_tokens", usage.get("output_tokens"))
                    if out is not None:
                        record.output_tokens = int(out)
                    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
                    cached = details.get("cached_tokens", usage.get("cache_read_input_tokens"))
                    if cached is not None:
                        record.cached_tokens = int(cached)
                n = record.output_tokens
                if n > 1:
                    record.tpot_ms = round((record.e2e_ms - record.ttft_ms) / (n - 1), 3)
                self.done += 1
            else:
                self.errors += 1
        return record

    async def _progress(self) -> None:
        total = len(self.requests)
        last_done, last_t = 0, time.perf_counter()
        while True:
            await asyncio.sleep(0.5)
            now = time.perf_counter()
            finished = self.done + self.errors
            rate = (finished - last_done) / (now - last_t)
            last_done, last_t = finished, now
            sys.stderr.write(
                f"\rsent {self.sent}/{total}  done {self.done}  errors {self.errors}  "
                f"in flight {self.sent - finished}  {rate:.1f} req/s  "
                f"t={now - self.t0:.0f}s   ")
            sys.stderr.flush()


def _has_token(event: dict) -> bool:
    """Does this stream event carry a piece of output? (each API's first-token event)"""
    choices = event.get("choices")
    if choices:
        return any(c.get("text") or (c.get("delta") or {}).get("content") for c in choices
                   if isinstance(c, dict))
    kind = event.get("type")
    if kind == "content_block_delta":  # Anthropic Messages
        d = event.get("delta") or {}
        return bool(d.get("text") or d.get("partial_json") or d.get("thinking"))
    if isinstance(kind, str) and kind.startswith("response.") and kind.endswith(".delta"):
        return bool(event.get("delta"))
    return False


def agent_body(api: str, ids: Sequence[int], session: str, max_tokens: int) -> dict[str, Any]:
    """A request body of ``api`` whose prompt is ``ids`` laid out as an agent's conversation:
    the first SYSTEM_TOKENS as the system prompt, then TOOLS tool descriptions of TOOL_TOKENS,
    then one message per TURN_TOKENS alternating tool calls and tool results (the last always
    the user's). Cut at fixed token positions, a turn's messages extend the previous turn's."""
    words = ids_to_text
    system = words(ids[:SYSTEM_TOKENS])
    at = SYSTEM_TOKENS
    tools = []
    for k in range(TOOLS):
        chunk = ids[at:at + TOOL_TOKENS]
        if not len(chunk):
            break
        tools.append({"name": f"tool_{k}", "description": words(chunk),
                      "schema": {"type": "object", "properties": {"command": {"type": "string"}},
                                 "required": ["command"]}})
        at += TOOL_TOKENS
    turns = [words(ids[s:s + TURN_TOKENS]) for s in range(at, len(ids), TURN_TOKENS)] or ["continue"]
    if len(turns) % 2 == 0:
        turns.append("continue")  # calls and results alternate; the user speaks last
    sid = _uuid_of(session)
    if api == "messages":
        msgs: list[dict] = [{"role": "user", "content": [{"type": "text", "text": turns[0]}]}]
        for k in range(1, len(turns), 2):
            msgs.append({"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{k}",
                                                            "name": f"tool_{k % max(1, len(tools))}",
                                                            "input": {"command": turns[k]}}]})
            msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{k}",
                                                      "content": turns[k + 1]}]})
        return {"max_tokens": max_tokens, "stream": True, "ignore_eos": True,  # the trace's length, exactly
                "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
                "tools": [{"name": t["name"], "description": t["description"], "input_schema": t["schema"]}
                          for t in tools],
                "messages": msgs,
                "metadata": {"user_id": f"user_{sid.replace('-', '')}_account_{sid}_session_{sid}"}}
    if api == "responses":
        items: list[dict] = [{"type": "message", "role": "user", "content": turns[0]}]
        for k in range(1, len(turns), 2):
            items.append({"type": "function_call", "call_id": f"call_{k}", "name": f"tool_{k % max(1, len(tools))}",
                          "arguments": json.dumps({"command": turns[k]})})
            items.append({"type": "function_call_output", "call_id": f"call_{k}", "output": turns[k + 1]})
        return {"max_output_tokens": max_tokens, "stream": True, "ignore_eos": True, "instructions": system,
                "input": items,
                "tools": [{"type": "function", "name": t["name"], "description": t["description"],
                           "parameters": t["schema"]} for t in tools],
                "prompt_cache_key": session}
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": turns[0]}]
    for k in range(1, len(turns), 2):
        msgs.append({"role": "assistant", "content": None, "tool_calls": [{
            "id": f"call_{k}", "type": "function",
            "function": {"name": f"tool_{k % max(1, len(tools))}", "arguments": json.dumps({"command": turns[k]})}}]})
        msgs.append({"role": "tool", "tool_call_id": f"call_{k}", "content": turns[k + 1]})
    return {"max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True, "messages": msgs,
            "tools": [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                        "parameters": t["schema"]}} for t in tools]}


def _uuid_of(session: str) -> str:
    import uuid

    return str(uuid.uuid5(uuid.NAMESPACE_URL, "kvtop-session:" + session))


def _error_text(err: Any) -> str:
    if isinstance(err, dict):
        return str(err.get("message") or err)[:300]
    return str(err)[:300]


def write_results(path: str, result: ReplayResult) -> None:
    """Header line, then one line per request; written whole via a temporary file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(result.header) + "\n")
        for record in result.records:
            f.write(json.dumps(record) + "\n")
    os.replace(tmp, path)
