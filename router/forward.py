"""Upstream calls: send the client's bytes unchanged, pass the answer back, time it.

Streaming responses are relayed chunk by chunk as they arrive. The first token is found
by scanning the raw SSE bytes for the first event carrying a non-empty piece of output (each
API's pattern is in router/apis.py); nothing is decoded or re-encoded on the way through. The
engine's ``usage`` is the last usage object in the stream: chat and completions (when the
client asked for it), Anthropic's ``message_delta``, the Responses API's ``response.completed``.
It is captured as it passes, however large the event around it (a Responses stream's last
event echoes the whole response, tools and instructions: over 16 KB for any real agent), so
the scan holds a few kilobytes whatever the stream's size.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any

import orjson

# A data event carrying a non-empty text piece: completions' "text", chat's "content" or
# "reasoning_content". Chat streams open with an empty-content role delta, which must not count.
_TOKEN_RE = re.compile(rb'"(?:text|content|reasoning_content)":\s*"(?!")')
_TAIL_BYTES = 16384
#: A usage key outside a JSON string (inside one every quote is escaped), with its object's "{".
_USAGE_KEY = re.compile(rb'"usage"\s*:\s*\{')
#: A usage object is a few hundred bytes; a larger capture is not one (a tool's schema property
#: named "usage", say) and is given up.
_USAGE_MAX_BYTES = 8192
#: Bytes kept between chunks to find a key split across them, and a done marker's line start.
_KEY_CARRY = 32
_LINE_CARRY = 96
_USAGE_KEYS = ("prompt_tokens", "completion_tokens", "input_tokens", "output_tokens")


@functools.lru_cache(maxsize=16)
def _done_hints(done_re: re.Pattern) -> tuple[bytes, ...]:
    """Words one of which a closing event must hold: a substring test per chunk costs a tenth of
    the anchored regex, which then runs only on the chunks that pass. () means always search."""
    src = done_re.pattern
    return tuple(w for w in (b"DONE", b"message_stop", b"completed", b"incomplete", b"failed") if w in src)
# The closing event itself, at the start of a line: "[DONE]" inside generated text is inside a
# JSON string, where a newline is escaped, so it can never match this.
_DONE_RE = re.compile(rb"(?:^|\n)data:\s*\[DONE\]")

#: Request headers not forwarded upstream (hop-by-hop, or recomputed by the client library).
HOP_HEADERS = frozenset(h.lower() for h in (
    "Host", "Content-Length", "Connection", "Keep-Alive", "Transfer-Encoding", "TE", "Trailer",
    "Upgrade", "Proxy-Authorization", "Proxy-Connection", "Accept-Encoding",
    # the router holds the whole body already; passed on, the backend's interim
    # "100 Continue" would be one more answer on a pooled connection
    "Expect",
))


@dataclass(slots=True)
class StreamScan:
    """Incremental scan of an SSE byte stream for the first token and the final usage.
    ``token_re`` and ``done_re`` are the API's (router/apis.py); the defaults are OpenAI's."""

    token_re: re.Pattern = _TOKEN_RE
    done_re: re.Pattern = _DONE_RE
    first_token: bool = False
    #: the stream's first bytes (where a Responses stream names its response id)
    head: bytes = b""
    events: int = 0
    _carry: bytes = b""
    #: the last usage object seen whole (see ``usage``)
    _usage: dict | None = None
    #: a usage object being captured across chunks: its bytes, brace depth, in a string, after "\"
    _cap: bytearray | None = None
    _depth: int = 0
    _in_str: bool = False
    _esc: bool = False
    _unscanned: list = field(default_factory=list)
    _unscanned_bytes: int = 0
    _key_carry: bytes = b""
    _key_pending: bool = False
    _hints: tuple | None = None
    #: the start of the current line (at most _LINE_CARRY bytes; "\0" once it is longer)
    _line: bytes = b""
    _done: bool = False

    def feed(self, chunk: bytes) -> bool:
        """Account ``chunk``; return True if it holds the stream's first token."""
        self.events += chunk.count(b"data:")
        if len(self.head) < 4096:
            self.head += chunk[:4096 - len(self.head)]
        # Usage and the closing event are scanned in batches of about _TAIL_BYTES (a substring
        # test over 16 KB costs what one over a chunk does), and at the end.
        self._unscanned.append(chunk)
        self._unscanned_bytes += len(chunk)
        if self._unscanned_bytes >= _TAIL_BYTES:
            self._scan()
        if self.first_token:
            return False
        buf = self._carry + chunk
        # Only whole events are judged, so a token split across chunks is found once whole.
        cut = buf.rfind(b"\n\n")
        if cut < 0:
            self._carry = buf[-_TAIL_BYTES:]
            return False
        whole, self._carry = buf[:cut], buf[cut + 2:]
        if self.token_re.search(whole):
            self.first_token = True
            self._carry = b""
            return True
        return False

    def finish(self) -> bool:
        """At end of stream: True if the unterminated last event held the first token."""
        if not self.first_token and self._carry and self.token_re.search(self._carry):
            self.first_token = True
            return True
        return False

    # -- usage, captured as it passes ----------------------------------------------------
    def _scan(self) -> None:
        if not self._unscanned:
            return
        buf = self._unscanned[0] if len(self._unscanned) == 1 else b"".join(self._unscanned)
        self._unscanned.clear()
        self._unscanned_bytes = 0
        self._scan_usage(buf)
        if not self._done:
            self._scan_done(buf)

    def _scan_usage(self, chunk: bytes) -> None:
        if self._cap is not None:
            rest = self._capture(chunk, 0)
            if rest is None:
                return
            buf, pos = chunk, rest
        else:
            carry = self._key_carry
            if not self._key_pending and b'"usage' not in chunk and b'"usage' not in carry + chunk[:6]:
                # the common case, two substring tests: keep what may start a key split here
                self._key_carry = chunk[-6:] if len(chunk) >= 6 else (carry + chunk)[-6:]
                return
            buf, pos = carry + chunk, 0
        while True:
            m = _USAGE_KEY.search(buf, pos)
            if m is None:
                break
            self._cap = bytearray()
            self._depth, self._in_str, self._esc = 0, False, False
            rest = self._capture(buf, m.end() - 1)
            if rest is None:
                self._key_carry = b""
                return
            pos = rest
        self._key_carry = carry = buf[max(pos, len(buf) - _KEY_CARRY):]
        # a key at the very end whose "{" may come in the next chunk ("usage":null is not one)
        k = carry.rfind(b'"usage')
        self._key_pending = k >= 0 and not carry[k + 6:].strip(b'": \t\r\n')

    def _capture(self, buf: bytes, i: int) -> int | None:
        """Go on with the usage object from ``buf[i]``; the index just past it once whole,
        None when ``buf`` ended inside it. Bytes are judged one at a time, but only a usage
        object's few hundred of them."""
        cap = self._cap
        depth, in_str, esc = self._depth, self._in_str, self._esc
        n = len(buf)
        start = i
        while i < n:
            c = buf[i]
            i += 1
            if in_str:
                if esc:
                    esc = False
                elif c == 0x5C:  # backslash
                    esc = True
                elif c == 0x22:
                    in_str = False
            elif c == 0x22:
                in_str = True
            elif c == 0x7B:
                depth += 1
            elif c == 0x7D:
                depth -= 1
                if depth == 0:
                    cap += buf[start:i]
                    self._cap = None
                    try:
                        obj = json.loads(bytes(cap))
                    except ValueError:
                        return i
                    if isinstance(obj, dict) and any(isinstance(obj.get(k), int) for k in _USAGE_KEYS):
                        self._usage = obj
                    return i
            if len(cap) + (i - start) > _USAGE_MAX_BYTES:
                self._cap = None  # not a usage object
                return i
        cap += buf[start:n]
        self._depth, self._in_str, self._esc = depth, in_str, esc
        return None

    def _scan_done(self, chunk: bytes) -> None:
        line = self._line
        hints = self._hints
        if hints is None:
            hints = self._hints = _done_hints(self.done_re)
        buf = line + chunk if line else chunk
        hit = not hints
        for h in hints:
            if h in buf:
                hit = True
                break
        if hit and self.done_re.search(buf):
            self._done = True
            return
        nl = chunk.rfind(b"\n")
        if nl >= 0:
            rest = chunk[nl:]
        elif line == b"\0":
            return
        else:
            rest = buf
        self._line = rest if len(rest) <= _LINE_CARRY else b"\0"  # "\0": not a line start

    def usage(self) -> dict[str, Any] | None:
        """The last ``usage`` object of the stream with token counts in it, if any (at the top
        level of an event, or inside the ``response`` of a Responses API event)."""
        self._scan()
        return self._usage

    @property
    def saw_done(self) -> bool:
        """True once the stream's closing event (``data: [DONE]``, ``message_stop``,
        ``response.completed``) has passed through."""
        self._scan()
        return self._done

    @property
    def held_bytes(self) -> int:
        """Bytes the scan holds between chunks beyond the 4 KB head: bounded, whatever the
        stream (the first-token carry, at most _TAIL_BYTES; chunks not yet scanned, under
        _TAIL_BYTES plus the last chunk; a usage object, at most _USAGE_MAX_BYTES)."""
        return (len(self._carry) + len(self._key_carry) + len(self._line) + self._unscanned_bytes
                + (len(self._cap) if self._cap is not None else 0))

    @property
    def data_events(self) -> int:
        """Data events other than the closing ``[DONE]`` (a rough token count)."""
        done = 1 if self.saw_done else 0
        return max(0, self.events - done)


def usage_of(body: bytes) -> dict[str, Any] | None:
    """``usage`` of a non-streaming JSON response, or None. orjson first (a third of json's
    time on an answer); what it refuses (an integer past 64 bits, NaN) goes through json."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):
            return None
    return _usage_in(obj)


def _usage_in(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, dict):
        return None
    u = obj.get("usage")
    if u is None and isinstance(obj.get("response"), dict):  # Responses API events
        u = obj["response"].get("usage")
    return u if isinstance(u, dict) else None


def cached_tokens(usage: dict[str, Any] | None) -> int | None:
    """Prompt tokens the engine served from its prefix cache, in any of the APIs' shapes."""
    if not usage:
        return None
    for key in ("prompt_tokens_details", "input_tokens_details"):
        details = usage.get(key)
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            return details["cached_tokens"]
    v = usage.get("cache_read_input_tokens")  # Anthropic Messages
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def completion_tokens(usage: dict[str, Any] | None) -> int | None:
    """Generated tokens: ``completion_tokens`` (OpenAI chat/completions) or ``output_tokens``
    (Anthropic Messages, OpenAI Responses)."""
    if not usage:
        return None
    for key in ("completion_tokens", "output_tokens"):
        v = usage.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


_HOP_RAW = frozenset(h.encode() for h in HOP_HEADERS) | {b"x-request-id"}


def upstream_head(raw_headers: Any, request_id: str) -> bytes:
    """``upstream_headers`` as header lines in the wire's form, from the client's raw header
    bytes (aiohttp's ``request.raw_headers``): passed on byte for byte, nothing decoded and
    encoded again (a UTF-8 value once reached the backend re-encoded as Latin-1)."""
    return b"".join([k + b": " + v + b"\r\n" for k, v in raw_headers if k.lower() not in _HOP_RAW]
                    + [b"X-Request-Id: " + request_id.encode("latin-1") + b"\r\n"])


def upstream_headers(headers: Any, request_id: str) -> list[tuple[str, str]]:
    """The client's headers to pass on, as pairs (a repeated header stays repeated), with
    ``X-Request-Id`` set to the router's id."""
    out = [(k, v) for k, v in headers.items()
           if (kl := k.lower()) not in HOP_HEADERS and kl != "x-request-id"]
    out.append(("X-Request-Id", request_id))
    return out
