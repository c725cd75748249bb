"""``@kv=auto``: the KV-event endpoints an engine announces, asked for when it joins the fleet.

vLLM serves ``GET /kv_event_sources`` (vllm/entrypoints/serve/kv_events/api_router.py, not
behind VLLM_SERVER_DEV_MODE): one entry per data-parallel rank, ``{"data_parallel_rank",
"endpoint", "replay_endpoint", "topic"}``, as a bare JSON array in vLLM's current code (an
earlier revision wrapped it in ``{"sources": [...]}``; both are read). The endpoints are as the
engine bound them, so a wildcard host (``tcp://*:5557``, ``tcp://0.0.0.0:5557``) is replaced by
the host of the instance's URL. kvtop follows one publisher per instance: rank 0's (the lowest
announced). An instance that does not answer, or announces nothing, joins without KV events
(its hits come from the estimate) and the router says so once.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import urlsplit

from router.upstream import UpstreamError

AUTO = "auto"
PATH = "/kv_event_sources"
WILDCARDS = ("*", "0.0.0.0", "::", "[::]", "")


def pick(data: Any, url: str) -> tuple[str, str | None] | None:
    """(endpoint, replay endpoint) from a /kv_event_sources answer, or None when it announces none."""
    sources = data.get("sources") if isinstance(data, dict) else data
    if not isinstance(sources, list):
        return None
    good = [s for s in sources if isinstance(s, dict) and isinstance(s.get("endpoint"), str)
            and s["endpoint"].startswith(("tcp://", "ipc://"))]
    if not good:
        return None
    first = min(good, key=lambda s: s.get("data_parallel_rank") if isinstance(s.get("data_parallel_rank"), int) else 0)
    host = urlsplit(url).hostname or "127.0.0.1"
    replay = first.get("replay_endpoint")
    return _routable(first["endpoint"], host), (_routable(replay, host) if isinstance(replay, str) and replay else None)


def _routable(endpoint: str, host: str) -> str:
    """``tcp://*:5557`` as the router can reach it: the instance's host for a wildcard."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    rest = endpoint[len("tcp://"):]
    h, sep, port = rest.rpartition(":")
    if sep and h in WILDCARDS:
        return f"tcp://{'[' + host + ']' if ':' in host else host}:{port}"
    return endpoint


async def announced(pool: Any, url: str, timeout_s: float = 3.0) -> tuple[str, str | None] | None:
    """Ask the instance at ``url``; None when it does not answer with a usable announcement."""
    try:
        async with asyncio.timeout(timeout_s):
            r = await pool.request(url, "GET", PATH, (), b"")
            async with r:
                body = await r.read(limit=256 * 1024)
        if r.status != 200:
            return None
        return pick(json.loads(body), url)
    except (UpstreamError, TimeoutError, OSError, ValueError):
        return None
