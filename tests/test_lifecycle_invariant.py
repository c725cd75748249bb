"""The request lifecycle's core invariant, property-tested: whatever order arrivals, admission,
offload prefill answers (good or failed), first tokens, failures with a retry, ends and
client departures come in, every counter and every admission gate is empty once every
request has ended, and each attempt has exactly one outcome.

The pipeline (router/pipeline.py) is driven here as both drivers drive it (router/proxy.py
live, kvtop/simulate.py offline), with every legal next step of every request open to
hypothesis at each point."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.build import build_router
from router.core import NoInstance
from router.pipeline import CLIENT_GONE, OK, PREFILL, UPSTREAM_ERROR
from router.request import RouteRequest
from router.settings import Settings


class Sink:
    def __init__(self):
        self.decisions, self.outcomes = [], []

    def decision(self, d):
        self.decisions.append(d)

    def outcome(self, d, o):
        self.outcomes.append((d.request.request_id, d.attempt, o.status))


def _request(k: int, size_blocks: int, session: int) -> RouteRequest:
    blocks = [session * 1000 + b for b in range(size_blocks)]
    return RouteRequest(f"r{k}", f"s{session}", "header", size_blocks * 16, blocks, "tokens", "completions",
                        True, 4)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(),
       policy=st.sampled_from(["sticky", "round_robin", "leastwork", "expected_cost"]),
       offload=st.sampled_from(["off", "simple", "cost"]),
       admission=st.sampled_from(["off", "fifo", "pack"]),
       budget=st.integers(1, 400),
       n=st.integers(1, 8))
def test_every_order_of_events_leaves_the_books_empty(data, policy, offload, admission, budget, n):
    now = [0.0]
    ready: set[int] = set()  # flows whose admission gate opened (on_admit)
    sink = Sink()
    s = Settings.parse(policy, {"offload_mode": offload, "offload_threshold": 32,
                                     "admission": admission, "admission_budget_tokens": budget})
    pipe = build_router(s, ["a", "b", "c"], sink, block_size=16, capacity_blocks=64,
                        clock=lambda: now[0], on_admit=lambda flow: ready.add(id(flow))).pipeline
    sizes = [data.draw(st.integers(3, 12), label=f"blocks{k}") for k in range(n)]
    flows = {}
    state: dict[int, str] = {}
    for k in range(n):
        f = pipe.receive(_request(k, sizes[k], data.draw(st.sampled_from([0, 0, 1]), label=f"session{k}")))
        flows[k] = f
        state[k] = "new"
    attempts = {k: 0 for k in range(n)}
    # requests already decoding (D busy is when `simple` and `cost` offload at all); they end
    # in the loop like any other
    for j in range(3):  # session 0's: under sticky they load one instance, whose later turns offload
        k = n + j
        f = flows[k] = pipe.receive(_request(k, 1, 0))
        pipe.route(f)
        attempts[k] = 1
        state[k] = "gate" if data.draw(st.booleans(), label=f"warm{j}") else "decoding"
        if state[k] == "decoding":
            assert pipe.admit(f), "the first request on an instance always passes its gate"
            pipe.sent(f)
            pipe.first_token(f)
    n += 3
    for _ in range(200):
        live = [k for k in range(n) if state[k] != "done"]
        if not live:
            break
        k = data.draw(st.sampled_from(live), label="which")
        f = flows[k]
        now[0] += data.draw(st.floats(0, 0.5), label="dt")
        # the client leaves, whatever it was doing (routing is synchronous with the receipt:
        # a request is routed before its client can be seen leaving)
        if f.decision is not None and data.draw(st.integers(0, 9), label="leave") == 0:
            pipe.abandon(f, "in the test")
            state[k] = "done"
            continue
        st_k = state[k]
        if st_k == "new":
            try:
                pipe.route(f, exclude=(f.decision.instance,) if attempts[k] else ())
            except NoInstance:
                state[k] = "done"
                continue
            attempts[k] += 1
            state[k] = "gate"
        elif st_k == "gate":
            state[k] = "ready" if pipe.admit(f) else "waiting"
        elif st_k == "waiting":
            if id(f) in ready:
                ready.discard(id(f))
                state[k] = "ready"
        elif st_k == "ready":
            pipe.sent(f)
            state[k] = "prefilling" if f.leg.kind == PREFILL else "serving"
        elif st_k == "prefilling":
            ok = data.draw(st.booleans(), label="prefill ok")
            pipe.prefill_done(f, {"remote": 1} if ok else None)
            state[k] = "gate"
        elif st_k == "serving":
            what = data.draw(st.sampled_from(["first", "fail", "retry"]), label="serve")
            if what == "first":
                pipe.first_token(f)
                state[k] = "decoding"
            else:
                pipe.finish(f, UPSTREAM_ERROR, error="boom")
                if what == "retry" and attempts[k] == 1:  # nothing reached the client: once more
                    pipe.retry(f)
                    state[k] = "new"
                else:
                    state[k] = "done"
        elif st_k == "decoding":
            pipe.finish(f, OK, output_tokens=4, cached_tokens=0)
            state[k] = "done"
    for k in range(n):  # the rest leave
        if state[k] != "done" and flows[k].decision is not None:
            pipe.abandon(flows[k], "at the end")
    assert pipe.idle(), [(i.name, i.num_requests, i.pending_prefill_tokens) for i in pipe.cluster.instances]
    assert not any(pipe.queue.waiting) and not any(pipe.queue.admitted)
    # exactly one outcome per attempt that was routed
    seen = [(rid, a) for rid, a, _ in sink.outcomes]
    assert len(seen) == len(set(seen)) == sum(attempts.values())
    assert all(status in (OK, UPSTREAM_ERROR, CLIENT_GONE) for *_, status in sink.outcomes)


def test_a_prefill_answer_frees_its_admission_gate():
    """P's answer ends P's prefill: before the fix its gate kept the entry admitted, so with
    admission on, P admitted nothing again (kvtop simulate ended 'counters not at zero')."""
    sink = Sink()
    s = Settings.parse("sticky", {"offload_mode": "simple", "offload_threshold": 32,
                                  "admission": "fifo", "admission_budget_tokens": 64})
    pipe = build_router(s, ["a", "b"], sink, block_size=16, capacity_blocks=64, clock=lambda: 0.0).pipeline
    busy = pipe.receive(_request(0, 1, 9))
    pipe.route(busy)  # the session's first turn: a
    assert pipe.admit(busy)
    pipe.sent(busy)
    pipe.first_token(busy)  # a decodes: the session's heavy next turn (sticky: a) offloads to idle b
    heavy2 = pipe.receive(_request(2, 8, 9))
    leg = pipe.route(heavy2)
    assert leg.kind == PREFILL and leg.instance == 1, "a decodes and b is idle: simple offloads"
    assert pipe.admit(heavy2)
    pipe.sent(heavy2)
    pipe.prefill_done(heavy2, {"remote": 1})
    assert id(leg.ticket) not in pipe.queue.admitted[leg.instance]
    for f in (busy, heavy2):
        pipe.abandon(f, "done")
    assert pipe.idle() and not any(pipe.queue.admitted)
