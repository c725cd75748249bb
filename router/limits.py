"""Overload bounds, client timeouts and the reliability flags of ``kvtop route``.

The router never queues without limit: past ``max_inflight`` requests in total (those waiting
in the admission queue included) it answers 429 with ``Retry-After`` before reading the body,
and an instance already holding ``max_inflight_per_instance`` requests is left out of the pick
(429 when every healthy instance is full). docs/reliability.md lists every path and flag.
"""

from __future__ import annotations

import argparse
import resource
import logging
from typing import TYPE_CHECKING, Any

from aiohttp import web

from router.http import error_response
from store.errors import CliError

if TYPE_CHECKING:  # typing only: router/state.py imports this module
    from router.state import RouterState

RETRY_AFTER_S = "1"

# Defaults, generous: a vLLM instance runs a few hundred sequences at most and queues the rest.
MAX_INFLIGHT = 10_000
MAX_INFLIGHT_PER_INSTANCE = 4_096
MAX_BODY_MB = 64
MAX_ANSWER_MB = 256
MAX_BUFFERED_MB = 512
CLIENT_TIMEOUT_S = 60.0
HEALTH_INTERVAL_S = 0.5
HEALTH_TIMEOUT_S = 1.0
HEALTH_BACKOFF_MAX_S = 5.0
MAX_VIEWERS = 64
OUTLIER_CONSECUTIVE = 5
OUTLIER_EJECTION_S = 10.0
FIRST_BYTE_TIMEOUT_S = 30.0


def _too_many(state: RouterState, message: str) -> web.Response:
    state.counts["rejected"] = state.counts.get("rejected", 0) + 1
    return error_response(429, message, err_type="RateLimitError", headers={"Retry-After": RETRY_AFTER_S})


def admit(state: RouterState) -> web.Response | None:
    """A 429 when the router already holds ``max_inflight`` requests, else None.

    ``in_flight`` counts every dispatched ticket, and a request is dispatched before it waits in
    the admission queue (router/features.py), so queued requests hold their places too."""
    limit = state.config.max_inflight
    if limit and state.cluster.in_flight >= limit:
        return _too_many(state, f"the router is at its limit of {limit} requests in flight; retry later")
    return None


def body_room(state: RouterState, declared: int) -> web.Response | None:
    """A 503 when the bodies the router holds (request bodies from arrival to the answer's end)
    would pass ``max_buffered_bytes`` with this one; None when it fits."""
    if over_body_room(state, declared):
        state.counts["rejected"] = state.counts.get("rejected", 0) + 1
        return error_response(503, body_room_message(state), headers={"Retry-After": RETRY_AFTER_S})
    return None


def over_body_room(state: RouterState, more: int, *, own: int = 0) -> bool:
    """Would ``more`` bytes pass ``max_buffered_bytes``? ``own``: bytes of the same body already
    counted. One body alone always fits (``--max-body-mb`` bounds it)."""
    limit = state.config.max_buffered_bytes
    return bool(limit) and state.body_bytes + more > limit and state.body_bytes - own > 0


def body_room_message(state: RouterState) -> str:
    return (f"the router already holds {state.body_bytes:,} bytes of request bodies "
            f"(--max-buffered-mb {state.config.max_buffered_bytes // (1024 * 1024)}); retry later")


def all_full(state: RouterState) -> web.Response:
    limit = state.config.max_inflight_per_instance
    return _too_many(state, f"every healthy instance holds its limit of {limit} requests; retry later")


def raise_open_file_limit() -> int:
    """Lift the soft RLIMIT_NOFILE to the hard limit: each request holds two sockets."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            return want
        return soft
    except (ValueError, OSError) as exc:  # not fatal: the router still runs, with fewer sockets
        logging.getLogger("kvtop.route").warning("cannot raise the open-file limit: %s", exc)
        return -1


# -- CLI -------------------------------------------------------------------------------------

def _positive(kind):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not v >= 0:
            raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
        return v
    parse.__name__ = kind.__name__
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("reliability (docs/reliability.md)")
    g.add_argument("--max-inflight", type=_positive(int), default=MAX_INFLIGHT, metavar="N",
                   help=f"answer 429 past N requests in flight in total, admission queue included "
                        f"(default {MAX_INFLIGHT:,}; 0 = no bound)")
    g.add_argument("--max-inflight-per-instance", type=_positive(int), default=MAX_INFLIGHT_PER_INSTANCE,
                   metavar="N", help="skip an instance holding N requests; 429 when all do "
                                     f"(default {MAX_INFLIGHT_PER_INSTANCE:,}; 0 = no bound)")
    g.add_argument("--max-viewers", type=_positive(int), default=MAX_VIEWERS, metavar="N",
                   help=f"event-stream viewers at once; more get a 503 (default {MAX_VIEWERS}; 0 = no bound)")
    g.add_argument("--max-body-mb", type=_positive(float), default=MAX_BODY_MB, metavar="MB",
                   help=f"largest request body; bigger gets a JSON 413 (default {MAX_BODY_MB})")
    g.add_argument("--max-answer-mb", type=_positive(float), default=MAX_ANSWER_MB, metavar="MB",
                   help="largest non-streaming answer the router buffers from a backend; bigger is a "
                        f"502 (default {MAX_ANSWER_MB}; streams are relayed as they come, unbounded)")
    g.add_argument("--max-buffered-mb", type=_positive(float), default=MAX_BUFFERED_MB, metavar="MB",
                   help="request bodies the router holds at once, in total; a body that would pass it gets "
                        f"a 503 (default {MAX_BUFFERED_MB}; a parsed JSON body costs about 5x its bytes; 0 = no bound)")
    g.add_argument("--client-timeout", type=_positive(float), default=CLIENT_TIMEOUT_S, metavar="S",
                   help=f"a client must send its whole body within S s, else 408, and may stop reading an "
                        f"answer for at most S s (default {CLIENT_TIMEOUT_S:g}; 0 = none)")
    g.add_argument("--total-timeout", type=_positive(float), default=0.0, metavar="S",
                   help="upstream limit on one attempt, start to last byte (default 0 = none; "
                        "--read-timeout bounds the gap between bytes)")
    g.add_argument("--health-interval", type=_positive(float), default=HEALTH_INTERVAL_S, metavar="S",
                   help=f"probe each backend's /health every S s (default {HEALTH_INTERVAL_S:g}; 0 = no active checks)")
    g.add_argument("--health-timeout", type=_positive(float), default=HEALTH_TIMEOUT_S, metavar="S",
                   help=f"one probe's time limit (default {HEALTH_TIMEOUT_S:g})")
    g.add_argument("--outlier-consecutive", type=_positive(int), default=OUTLIER_CONSECUTIVE, metavar="N",
                   help="eject an instance after N failed requests in a row on real traffic (5xx, gateway "
                        f"errors, timeouts), even while its /health answers (default {OUTLIER_CONSECUTIVE}; 0 = off)")
    g.add_argument("--outlier-ejection", type=_positive(float), default=OUTLIER_EJECTION_S, metavar="S",
                   help=f"first ejection's length; each later one is longer, up to 300 s (default {OUTLIER_EJECTION_S:g})")
    g.add_argument("--first-byte-timeout", type=_positive(float), default=FIRST_BYTE_TIMEOUT_S, metavar="S",
                   help="a streaming request's backend must send its answer's first byte within S s, else the "
                        f"attempt fails (retried when it can be); vLLM answers a stream's head at once "
                        f"(default {FIRST_BYTE_TIMEOUT_S:g}; 0 = none; a non-streaming answer's first byte is "
                        "its last, so --read-timeout bounds those)")
    g.add_argument("--health-backoff-max", type=_positive(float), default=HEALTH_BACKOFF_MAX_S, metavar="S",
                   help="longest wait between probes of a down backend; waits double from "
                        f"--health-interval (default {HEALTH_BACKOFF_MAX_S:g})")


def config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """RouterConfig fields from the flags above."""
    if args.max_body_mb <= 0 or args.max_answer_mb <= 0:
        raise CliError("--max-body-mb and --max-answer-mb must be positive")
    return {"max_inflight": args.max_inflight, "max_inflight_per_instance": args.max_inflight_per_instance,
            "max_body_bytes": int(args.max_body_mb * 1024 * 1024),
            "max_answer_bytes": int(args.max_answer_mb * 1024 * 1024), "max_viewers": args.max_viewers,
            "max_buffered_bytes": int(args.max_buffered_mb * 1024 * 1024), "client_timeout_s": args.client_timeout,
            "total_timeout_s": args.total_timeout or None, "health_interval_s": args.health_interval,
            "health_timeout_s": args.health_timeout or HEALTH_TIMEOUT_S,
            "health_backoff_max_s": args.health_backoff_max, "outlier_consecutive": args.outlier_consecutive,
            "outlier_ejection_s": args.outlier_ejection, "first_byte_timeout_s": args.first_byte_timeout or None}
