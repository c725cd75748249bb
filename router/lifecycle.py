"""A request's life, built once: the driver says what happened, the lifecycle says what to do.

Sans-I/O, as h11 is for HTTP: ``step(flow, event) -> action``. The live proxy
(router/proxy.py) performs the actions over HTTP with wall time; the offline simulator
(kvtop/simulate.py) performs them on simulated engines in virtual time. Neither decides
anything about the order of the steps: routing, the admission gate, the offload's two legs,
the retry after a failed attempt, the end and the client's departure are decided here, the
same way for both, over the bookkeeping of router/pipeline.py (tickets, admission queue,
decision and outcome records, each released exactly once).

    events (driver -> lifecycle)            actions (lifecycle -> driver)
    Arrived(exclude)       route it          Send(leg)     send the current leg upstream
    Admitted               its gate opened   Wait(leg)     hold it until Admitted
    LegSent                bytes went up     Refuse(...)   answer the client this error
    PrefillAnswered(p)     P's KV params     Done(outcome) it is over
    FirstToken(observed)   the answer began  None          nothing to do now
    Ended(status, ...)     the attempt ended (an answer, or a failure the client saw)
    LegFailed(status, ...) the serve leg failed before a byte reached the client
    ClientGone(where)      the client left
    Counted(request)       a request routed on its estimate was tokenized

``Send``/``Wait`` carry ``new_attempt`` when they follow a routing decision (the first attempt
or a retry), so the driver can prepare that attempt's body. ``LegFailed`` may only be
reported while ``may_retry(flow)`` is true; the lifecycle then routes the request once more,
away from the instance that failed (and from its pin and full instances), or refuses it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router.core import NoInstance
from router.pipeline import OK, Flow, Leg, Outcome, Pipeline
from router.request import RouteRequest

#: A failed attempt is retried once (on another instance) when nothing reached the client.
MAX_ATTEMPTS = 2

#: Refuse reasons: no instance could take it / every candidate is at its in-flight bound.
NO_INSTANCE, ALL_FULL = "no_instance", "all_full"


# -- events ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Arrived:
    exclude: tuple[int, ...] = ()  # instances it must never go to (a previous_response_id pin)


@dataclass(frozen=True, slots=True)
class Admitted:
    pass


@dataclass(frozen=True, slots=True)
class LegSent:
    pass


@dataclass(frozen=True, slots=True)
class PrefillAnswered:
    params: dict[str, Any] | None  # P's kv_transfer_params; None: the prefill leg failed


@dataclass(frozen=True, slots=True)
class FirstToken:
    observed: bool = True  # False: a non-streaming answer, whose first token nobody saw


@dataclass(frozen=True, slots=True)
class Ended:
    status: str = OK
    http_status: int | None = None
    error: str | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    stream: bool | None = None


@dataclass(frozen=True, slots=True)
class LegFailed:
    status: str
    error: str | None = None
    http_status: int | None = None


@dataclass(frozen=True, slots=True)
class ClientGone:
    where: str


@dataclass(frozen=True, slots=True)
class Counted:
    request: RouteRequest | None  # None: counting failed, the estimate stays


# -- actions -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Send:
    leg: Leg
    new_attempt: bool = False


@dataclass(frozen=True, slots=True)
class Wait:
    leg: Leg
    new_attempt: bool = False


@dataclass(frozen=True, slots=True)
class Refuse:
    status: int  # 503 before any attempt, 502 after a failed one
    message: str
    reason: str  # NO_INSTANCE | ALL_FULL


@dataclass(frozen=True, slots=True)
class Done:
    outcome: Outcome | None


Event = Arrived | Admitted | LegSent | PrefillAnswered | FirstToken | Ended | LegFailed | ClientGone | Counted
Action = Send | Wait | Refuse | Done | None


class Lifecycle:
    """The order of a request's steps over one Pipeline; see the module docstring."""

    def __init__(self, pipeline: Pipeline, *, full: Callable[[], tuple[int, ...]] = tuple,
                 closed: Callable[[RouteRequest], tuple[int, ...]] = lambda req: ()):
        self.pipeline = pipeline
        #: () -> instances at their in-flight bound now (live: router/limits.py); never chosen
        self.full = full
        #: request -> instances the fleet closes to it (cordoned, draining: router/fleet.py);
        #: never chosen, and a request left with none is refused as when none is healthy
        self.closed = closed

    def receive(self, req: RouteRequest, t_recv: float | None = None) -> Flow:
        return self.pipeline.receive(req, t_recv)

    def may_retry(self, flow: Flow) -> bool:
        """Would a failure of the current attempt, before any byte reached the client, be
        tried again elsewhere? (The driver relays the failure itself when not.)"""
        d = flow.decision
        return d is not None and d.attempt < MAX_ATTEMPTS

    def step(self, flow: Flow, event: Event) -> Action:
        try:
            on = self._on[type(event)]
        except KeyError:
            raise TypeError(f"not a lifecycle event: {event!r}") from None
        return on(self, flow, event)

    # one method per event, found by the event's type (a ``match`` over nine class patterns
    # cost three times this lookup, four times a request)
    def _arrived(self, flow: Flow, event: Arrived) -> Action:
        flow.pinned = event.exclude
        return self._route(flow, event.exclude)

    def _admitted(self, flow: Flow, event: Admitted) -> Action:
        return Send(flow.leg)

    def _leg_sent(self, flow: Flow, event: LegSent) -> Action:
        self.pipeline.sent(flow)
        return None

    def _prefill_answered(self, flow: Flow, event: PrefillAnswered) -> Action:
        self.pipeline.prefill_done(flow, event.params)
        return self._gate(flow, new_attempt=False)

    def _first_token(self, flow: Flow, event: FirstToken) -> Action:
        self.pipeline.first_token(flow, observed=event.observed)
        return None

    def _ended(self, flow: Flow, e: Ended) -> Action:
        return Done(self.pipeline.finish(flow, e.status, http_status=e.http_status, error=e.error,
                                         output_tokens=e.output_tokens, cached_tokens=e.cached_tokens,
                                         stream=e.stream))

    def _leg_failed(self, flow: Flow, e: LegFailed) -> Action:
        if not self.may_retry(flow):
            raise ValueError("LegFailed reported where no retry is allowed (see may_retry)")
        pipe = self.pipeline
        failed = flow.decision
        pipe.finish(flow, e.status, http_status=e.http_status, error=e.error)
        pipe.retry(flow)
        return self._route(flow, tuple(set(flow.pinned) | {failed.instance}))

    def _client_gone(self, flow: Flow, event: ClientGone) -> Action:
        return Done(self.pipeline.abandon(flow, event.where))

    def _counted(self, flow: Flow, event: Counted) -> Action:
        self.pipeline.amend(flow, event.request)
        return None

    _on = {Arrived: _arrived, Admitted: _admitted, LegSent: _leg_sent,
           PrefillAnswered: _prefill_answered, FirstToken: _first_token, Ended: _ended,
           LegFailed: _leg_failed, ClientGone: _client_gone, Counted: _counted}

    def _route(self, flow: Flow, exclude: tuple[int, ...]) -> Action:
        closed = self.closed(flow.request)
        full = self.full()
        if closed and full:  # a closed instance at its bound is closed, not full
            full = tuple(i for i in full if i not in closed)
        try:
            self.pipeline.route(flow, exclude=exclude + closed + full)
        except NoInstance as exc:
            first = flow.first
            if full and first is None:
                return Refuse(503, str(exc), ALL_FULL)
            if closed:
                names = self.pipeline.cluster.instances
                exc = NoInstance(f"{exc}; out of rotation (cordoned, draining or removed): "
                                 f"{', '.join(names[i].name for i in closed)}")
            if first is None:
                return Refuse(503, str(exc), NO_INSTANCE)
            return Refuse(502, f"{first.instance_name} failed and {exc}", NO_INSTANCE)
        return self._gate(flow, new_attempt=True)

    def _gate(self, flow: Flow, *, new_attempt: bool) -> Action:
        leg = flow.leg
        if self.pipeline.admit(flow):
            return Send(leg, new_attempt)
        return Wait(leg, new_attempt)
