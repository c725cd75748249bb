"""Upstream calls: send the client's bytes unchanged, pass the answer back, time it.

Streaming responses are relayed chunk by chunk as they arrive. The first token is found
by scanning the raw SSE bytes for the first event carrying a non-empty piece of output (each
API's pattern is in router/apis.py); nothing is decoded or re-encoded on the way through. The
engine's ``usage`` is read from the last events at the end of the stream: chat and completions
(when the client asked for it), Anthropic's ``message_delta``, the Responses API's
``response.completed``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

# A data event carrying a non-empty text piece: completions' "text", chat's "content" or
# "reasoning_content". Chat streams open with an empty-content role delta, which must not count.
_TOKEN_RE = re.compile(rb'"(?:text|content|reasoning_content)":\s*"(?!")')
_TAIL_BYTES = 16384
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
    #: the stream's last chunks, at least _TAIL_BYTES of them once there are that many;
    #: kept as a list so that a chunk costs an append, not a copy of the tail
    _chunks: list = field(default_factory=list)
    _kept: int = 0

    def feed(self, chunk: bytes) -> bool:
        """Account ``chunk``; return True if it holds the stream's first token."""
        self.events += chunk.count(b"data:")
        if len(self.head) < 4096:
            self.head += chunk[:4096 - len(self.head)]
        chunks = self._chunks
        chunks.append(chunk)
        self._kept += len(chunk)
        if self._kept > 2 * _TAIL_BYTES:  # trim, keeping at least _TAIL_BYTES
            drop = 0
            while self._kept - len(chunks[drop]) >= _TAIL_BYTES:
                self._kept -= len(chunks[drop])
                drop += 1
            del chunks[:drop]
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

    @property
    def _tail(self) -> bytes:
        return b"".join(self._chunks)[-_TAIL_BYTES:]

    def usage(self) -> dict[str, Any] | None:
        """The last non-null ``usage`` object in the stream, if any (top level, or inside the
        ``response`` of a Responses API event)."""
        tail = self._tail
        pos = tail.rfind(b'"usage":{')
        if pos < 0:
            pos = tail.rfind(b'"usage": {')
            if pos < 0:
                return None
        start = tail.rfind(b"data:", 0, pos)
        if start < 0:
            return None
        end = tail.find(b"\n", pos)
        line = tail[start + 5:end if end >= 0 else len(tail)].strip()
        try:
            obj = json.loads(line)
        except ValueError:
            return None
        return _usage_in(obj)

    @property
    def saw_done(self) -> bool:
        """True once the stream's closing event (``data: [DONE]``, ``message_stop``,
        ``response.completed``) has passed through."""
        return self.done_re.search(self._tail) is not None

    @property
    def data_events(self) -> int:
        """Data events other than the closing ``[DONE]`` (a rough token count)."""
        done = 1 if self.saw_done else 0
        return max(0, self.events - done)


def usage_of(body: bytes) -> dict[str, Any] | None:
    """``usage`` of a non-streaming JSON response, or None."""
    try:
        obj = json.loads(body)
    except ValueError:
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


def upstream_headers(headers: Any, request_id: str) -> list[tuple[str, str]]:
    """The client's headers to pass on, as pairs (a repeated header stays repeated), with
    ``X-Request-Id`` set to the router's id."""
    out = [(k, v) for k, v in headers.items()
           if (kl := k.lower()) not in HOP_HEADERS and kl != "x-request-id"]
    out.append(("X-Request-Id", request_id))
    return out
