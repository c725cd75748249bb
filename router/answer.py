"""A relayed non-streaming answer written to the client in one send.

aiohttp's ``web.Response`` builds a header multidict, runs the prepare hooks, decides the
framing and serializes the head on every answer: about 12 µs of CPU per answer in a tight
loop, two to three times that in the router, where each request finds its caches cold. A
backend's complete answer needs none of it: its status, its Content-Type, the router's three
``X-Kvtop-*`` headers, the length, the date. ``send_whole`` writes those and the body with
one ``write`` on aiohttp's own stream writer (so backpressure, the bytes-sent count and a
closed connection behave as for any answer) and returns a response that aiohttp's handler
finds already sent.

Only the plain case takes this path: HTTP/1.1, a client keeping the connection alive, every
header value free of control characters. Anything else goes through ``web.Response``
(which says ``Connection: close``, or refuses a bad value, as it always did).
"""

from __future__ import annotations

import re
import time
from email.utils import formatdate
from http import HTTPStatus

from aiohttp import web
from aiohttp.http import SERVER_SOFTWARE, HttpVersion11
from multidict import CIMultiDict, CIMultiDictProxy

#: A character no header name or value may hold on the wire (CR, LF, the other controls).
_UNSAFE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
#: Answers up to this size go head and body in one buffer (one send); larger ones as two.
_JOIN_BYTES = 256 * 1024
_SERVER = f"Server: {SERVER_SOFTWARE}\r\n".encode("latin-1")
_date_second = -1
_date_line = b""


def _date() -> bytes:
    """The Date header line, made once a second."""
    global _date_second, _date_line
    now = time.time()
    sec = int(now)
    if sec != _date_second:
        _date_line = f"Date: {formatdate(sec, usegmt=True)}\r\n".encode("latin-1")
        _date_second = sec
    return _date_line


_STATUS_LINES: dict[int, bytes] = {}


def _status_line(status: int) -> bytes:
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = ""
    line = _STATUS_LINES[status] = f"HTTP/1.1 {status} {reason}\r\n".encode("latin-1")
    return line


class Sent:
    """An answer ``send_whole`` has written: aiohttp's handler
    finds nothing left to send. Not a ``web.StreamResponse``: building one (its header
    multidict, its status) cost more than the rest of this object's life, and all the servers
    ask of it is ``prepare``, ``write_eof`` and ``keep_alive``. Its status and headers are those
    on the wire (for logs and tests)."""

    __slots__ = ("status", "_headers", "body_length")

    prepared = True
    keep_alive = True
    __http_exception__ = False

    def __init__(self, status: int, headers: dict[str, str], sent_bytes: int):
        self.status = status
        self._headers = headers
        self.body_length = sent_bytes  # what aiohttp's access log reports

    @property
    def reason(self) -> str:
        try:
            return HTTPStatus(self.status).phrase
        except ValueError:
            return ""

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        return CIMultiDictProxy(CIMultiDict(self._headers))

    def __repr__(self) -> str:
        return f"<Sent {self.status} {self.reason}>"

    async def prepare(self, request):  # noqa: ARG002 - written already
        return None

    async def write(self, data) -> None:
        raise RuntimeError("the answer was sent whole")

    async def write_eof(self, data: bytes = b"") -> None:
        return None


def head_lines(headers: dict[str, str]) -> bytes | None:
    """Header lines for ``headers``, or None when a name or value cannot be written as it is."""
    if _UNSAFE.search("".join(headers) + "".join(headers.values())):
        return None
    return "".join([f"{k}: {v}\r\n" for k, v in headers.items()]).encode("utf-8", "surrogateescape")


async def send_whole(request: web.Request, status: int, headers: dict[str, str],
                     body: bytes) -> web.StreamResponse | Sent:
    """Answer ``request`` with ``status``, ``headers`` (Content-Type among them) and ``body``,
    all in one write when the request allows it (see the module's docstring); else as a
    ``web.Response``. Raises ConnectionResetError when the client has gone."""
    lines = head_lines(headers) if request.version == HttpVersion11 and request.keep_alive else None
    if lines is None:
        resp = web.Response(body=body, status=status, headers=headers)
        await resp.prepare(request)
        await resp.write_eof()
        return resp
    status_line = _STATUS_LINES.get(status) or _status_line(status)
    head = (status_line + lines + b"Content-Length: %d\r\n" % len(body) + _date() + _SERVER + b"\r\n")
    writer = request.writer
    if len(body) < _JOIN_BYTES:
        await writer.write(head + body)  # one send
    else:  # not copied just to put a head in front of it
        await writer.write(head)
        await writer.write(body)
    await writer.write_eof()
    return Sent(status, headers, writer.output_size)
