"""``--backend`` specs: ``[NAME=]URL[@gpu=N][@kv=tcp://HOST:PORT|auto][@kv-replay=tcp://HOST:PORT]``
(``@kv=auto``: the endpoints the engine announces, router/kv_sources.py).

One parser for `kvtop route --backend` (router/cli.py) and an instance added to a running
router (router/fleet_api.py), so both take and refuse the same specs with the same words.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from router.state import Backend
from store.errors import CliError


def parse_backend(spec: str, index: int) -> Backend:
    gpu = None
    url = spec.strip()
    opts: dict[str, str] = {}
    while True:  # trailing @gpu=N, @kv=tcp://..., @kv-replay=tcp://..., in any order
        head, sep, tail = url.rpartition("@")
        key, eq, value = tail.partition("=")
        if not sep or not eq or key not in ("gpu", "kv", "kv-replay"):
            break
        if key in opts:
            raise CliError(f"--backend {spec!r}: @{key}= given twice")
        opts[key], url = value, head
    if "gpu" in opts:
        try:
            gpu = int(opts["gpu"])
        except ValueError:
            raise CliError(f"--backend {spec!r}: @gpu= needs an integer GPU index") from None
    for key in ("kv", "kv-replay"):
        if key in opts and not opts[key].startswith(("tcp://", "ipc://")) and not (key == "kv" and opts[key] == "auto"):
            raise CliError(f"--backend {spec!r}: @{key}= expects a ZMQ endpoint, tcp://HOST:PORT or ipc://PATH"
                           + (", or auto (ask the engine: GET /kv_event_sources)" if key == "kv" else ""))
    if "kv-replay" in opts and "kv" not in opts:
        raise CliError(f"--backend {spec!r}: @kv-replay= needs @kv= (the event stream itself)")
    if "kv-replay" in opts and opts["kv"] == "auto":
        raise CliError(f"--backend {spec!r}: @kv=auto takes the replay endpoint the engine announces too")
    name = f"i{index}"
    head, sep, rest = url.partition("=")
    if sep and "://" not in head:
        name, url = head, rest
    try:
        u = urlsplit(url)
        ok = u.scheme in ("http", "https") and bool(u.hostname) and (u.port is None or u.port > 0)
    except ValueError:  # a port that is not a number, an IPv6 address without brackets
        ok = False
    if not ok:
        raise CliError(f"--backend {spec!r}: expected http://HOST:PORT or https://HOST:PORT "
                       "(an IPv6 address in brackets: http://[::1]:8000)")
    return Backend(name=name, url=url.rstrip("/"), gpu=gpu, kv_events=opts.get("kv"),
                   kv_replay=opts.get("kv-replay"))
