"""Malformed requests at the data plane and the control API: always a JSON 4xx, never a crash.

Hypothesis draws batches of malformed requests (bad JSON, non-UTF-8, wrong types, huge
numbers, missing fields, wrong content types, huge strings, deeply nested junk, bad query
parameters, missing or wrong bearer tokens) and the router, in-process behind aiohttp's test
client on loopback, must answer each with a 4xx whose body is an OpenAI-shaped JSON error.
Afterwards no request was routed, every counter is zero, the policy was never swapped and
the router still serves. The backend is a closed port, so anything routed would be a 5xx.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from fakevllm import CLOSED_PORT
from router.app import STATE, Backend, RouterConfig, create_app
from router.control import CONTROL
from router.policies import POLICIES

BATCH = 50
EXAMPLES = int(os.environ.get('KVTOP_FUZZ_EXAMPLES', 200))  # x BATCH = 10,000 requests
MAX_BODY = 64 * 1024
MAX_INPUT_TOKENS = 256
TOKEN = "fuzz-token-" + "x" * 32

DATA_PATHS = ("/v1/completions", "/v1/chat/completions")
JSON_CT = {"Content-Type": "application/json"}
WRONG_CT = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
            "application/json; charset=latin-1", "", "image/png")


def dumps(obj) -> bytes:
    return json.dumps(obj).encode()


# -- bodies that no valid request can come from ----------------------------------------------

junk_scalar = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True, allow_infinity=True),
                        st.integers(min_value=-(10**40), max_value=10**40), st.text(max_size=8))
junk_json = st.recursive(junk_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)), max_leaves=12)

# a prompt the router must refuse: wrong type, empty, batched, bad token ids, too long
bad_prompt = st.one_of(
    st.none(), st.booleans(), st.floats(), st.dictionaries(st.text(max_size=4), junk_scalar, max_size=3),
    st.just([]), st.just(""), st.just([[1, 2], [3]]), st.just(["a", "b"]),
    st.lists(st.integers(max_value=-1), min_size=1, max_size=5),  # negative token ids
    st.lists(st.integers(min_value=2**64, max_value=10**400), min_size=1, max_size=3),  # huge ids
    st.lists(st.one_of(st.floats(), st.text(max_size=3), st.none()), min_size=1, max_size=5).filter(
        lambda xs: not all(isinstance(x, str) for x in xs)),
    st.integers(min_value=MAX_INPUT_TOKENS * 4 + 8, max_value=MAX_BODY // 2).map(lambda n: "w" * n),  # too long
    st.just(list(range(MAX_INPUT_TOKENS + 1))),  # one token over the limit
)

# a valid prompt with one other field of the wrong type or range
bad_field = st.one_of(
    st.tuples(st.just("stream"), st.one_of(st.integers(), st.text(max_size=4), st.floats(), st.lists(st.none()))),
    st.tuples(st.just("max_tokens"), st.one_of(st.integers(max_value=-1), st.floats(), st.booleans(),
                                               st.text(max_size=4), st.just(-(10**400)))),
    st.tuples(st.just("model"), st.one_of(st.integers(), st.booleans(), st.lists(st.none(), max_size=2))),
    st.tuples(st.just("user"), st.one_of(st.integers(), st.floats(), st.dictionaries(st.text(max_size=2), st.none()))),
    st.tuples(st.just("session_id"), st.one_of(st.booleans(), st.floats(), st.lists(st.none(), max_size=2))),
)

bad_messages = st.one_of(
    st.none(), st.integers(), st.text(max_size=5), st.just([]),
    st.lists(junk_scalar, min_size=1, max_size=3),
    st.lists(st.fixed_dictionaries({"role": junk_scalar.filter(lambda r: not isinstance(r, str))}),
             min_size=1, max_size=2),  # a role that is not a string
    st.one_of(st.integers(), st.floats(), st.booleans(), st.dictionaries(st.text(max_size=2), st.none())).map(
        lambda c: [{"role": "user", "content": c}]),  # content neither a string nor a list of parts
    st.integers(min_value=MAX_INPUT_TOKENS * 4 + 64, max_value=MAX_BODY // 2).map(
        lambda n: [{"role": "user", "content": "w" * n}]),
)


def _non_utf8(raw: bytes) -> bytes:
    return b'{"prompt": "' + raw + b'\xff\xfe\xc3"}'


data_body = st.one_of(
    # bad JSON, or a JSON object without a prompt (hypothesis once built '{"prompt":[1]}' from this)
    st.binary(max_size=80).filter(lambda b: b"prompt" not in b and b"messages" not in b).map(lambda b: b"{" + b),
    st.binary(max_size=40).map(_non_utf8),  # non-UTF-8
    st.just(b""), st.just(b"null"), st.just(b"[]"), st.just(b'"prompt"'),
    junk_json.map(lambda j: dumps({"junk": j})),  # missing fields, nested junk
    bad_prompt.map(lambda p: dumps({"prompt": p, "max_tokens": 2})),
    bad_field.map(lambda kv: dumps({"prompt": [1, 2, 3], kv[0]: kv[1]})),
    st.integers(min_value=1, max_value=120_000).map(lambda d: b"[" * d + b"]" * d),  # deep nesting
    st.integers(min_value=3, max_value=20_000).map(lambda d: b'{"prompt":' + b"[" * d + b"1" + b"]" * d + b"}"),
    st.integers(min_value=MAX_BODY + 1, max_value=MAX_BODY * 3).map(lambda n: b'{"prompt": "' + b"a" * n + b'"}'),
    st.sampled_from([b'{"prompt": 1e999}', b'{"prompt": [1], "max_tokens": 1e999}', b'{"prompt": NaN}',
                     b'{"prompt": [1], "max_tokens": -1e400}', b'{"prompt":"a"', b"{'prompt': 'a'}"]),
)
chat_body = st.one_of(
    data_body,
    bad_messages.map(lambda m: dumps({"messages": m})),
    bad_field.map(lambda kv: dumps({"messages": [{"role": "user", "content": "hi"}], kv[0]: kv[1]})),
)


@st.composite
def data_request(draw):
    path = draw(st.sampled_from(DATA_PATHS))
    body = draw(chat_body if "chat" in path else data_body)
    ct = draw(st.one_of(st.just("application/json"), st.sampled_from(WRONG_CT)))
    return "POST", path, ({"Content-Type": ct} if ct else {}), body


policy_body = st.one_of(
    data_body,
    st.text(max_size=12).filter(lambda n: n not in POLICIES).map(lambda n: dumps({"name": n})),
    junk_json.filter(lambda j: not isinstance(j, str) or j not in POLICIES).map(lambda j: dumps({"name": j})),
    st.sampled_from(sorted(POLICIES)).flatmap(lambda n: st.one_of(
        junk_json.filter(lambda j: not isinstance(j, dict) and j is not None).map(
            lambda j: dumps({"name": n, "knobs": j})),  # knobs not an object
        st.text(min_size=1, max_size=8).map(lambda k: dumps({"name": n, "knobs": {"no_such_" + k: 1}})),
        st.text(min_size=1, max_size=8).map(lambda k: dumps({"name": n, "extra_" + k: 1})))),
)
knobs_body = st.one_of(
    data_body.filter(lambda b: b.strip() not in (b"{}",)),
    junk_json.filter(lambda j: not isinstance(j, dict)).map(dumps),
    st.dictionaries(st.text(min_size=1, max_size=8).map(lambda k: "no_such_" + k), junk_scalar,
                    min_size=1, max_size=3).map(dumps),
    # real knobs of the router's policy (unified) with values of the wrong type or out of range
    st.sampled_from(["overload_factor", "cache_ratio_gate", "lmetric_decode_weight"]).flatmap(
        lambda k: st.one_of(st.text(max_size=4), st.none(), st.lists(st.none(), max_size=2),
                            st.floats(min_value=-1e308, max_value=-1e-9), st.just(float("nan")),
                            st.just(1e400)).map(lambda v: dumps({k: v}))),
)
#: what a header value may carry on the wire: printable ASCII and Latin-1 (no CR, LF or NUL)
header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF,
                                    blacklist_categories=("Cc",)), max_size=80)
auth = st.one_of(
    st.sampled_from([
        {}, {"Authorization": "Bearer"}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic " + TOKEN},
        {"Authorization": "Bearer " + TOKEN[:-1]}, {"Authorization": "Bearer " + TOKEN + "x"},
        {"Authorization": "bearer  "}, {"Authorization": TOKEN}, {"Authorization": "Bearer " + TOKEN + "\xe9"}]),
    # generated: any scheme and credentials (never the token), a user header alongside
    st.tuples(st.sampled_from(["Bearer ", "bearer ", "Basic ", "", "Bearer  "]),
              header_text.filter(lambda t: t.strip() != TOKEN), header_text).map(
        lambda t: {"Authorization": t[0] + t[1], "X-Kvtop-User": t[2]}),
)
#: every mutation the control API has: without a valid token each is a 401, whatever the body
MUTATIONS = [("/kvtop/v1/policy", "PUT"), ("/kvtop/v1/knobs", "PATCH"), ("/kvtop/v1/shadows", "PUT"),
             ("/kvtop/v1/fleet", "POST"), ("/kvtop/v1/fleet/i0/cordon", "POST"),
             ("/kvtop/v1/fleet/i0/remove", "POST"), ("/kvtop/v1/auth", "GET")]
bad_query_value = st.one_of(st.text(max_size=8), st.integers(min_value=10**6), st.integers(max_value=0),
                            st.sampled_from(["nan", "inf", "-1", "1e999", "0x10", " ", "1.5"])).map(
    lambda v: v if str(v) != "" else "x")  # an empty parameter means "the default", which is valid


@st.composite
def control_request(draw):
    kind = draw(st.integers(0, 5))
    if kind == 0:  # mutation with a valid token and a bad body, from any user name
        path, method = draw(st.sampled_from([("/kvtop/v1/policy", "PUT"), ("/kvtop/v1/knobs", "PATCH")]))
        body = draw(policy_body if method == "PUT" else knobs_body)
        return method, path, {**JSON_CT, "Authorization": "Bearer " + TOKEN, "X-Kvtop-User": draw(header_text)}, body
    if kind == 1:  # mutation without a valid token: refused whatever the body
        path, method = draw(st.sampled_from(MUTATIONS))
        return method, path, {**JSON_CT, **draw(auth)}, dumps({"name": "lmetric"})
    if kind == 2:
        limit = draw(bad_query_value.filter(lambda v: not _int_in(v, 1, 2000)))
        return "GET", "/kvtop/v1/decisions", {}, ("limit", str(limit))
    if kind == 3:
        key = draw(st.sampled_from(["limit", "sort", "instance"]))
        v = draw(bad_query_value)
        ok = {"limit": lambda: _int_in(v, 1, 10_000), "sort": lambda: v in ("last_seen", "turns", "tokens", "moves"),
              "instance": lambda: v == "i0"}[key]()
        if ok:
            v = "bad"
        return "GET", "/kvtop/v1/sessions", {}, (key, str(v))
    if kind == 4:  # the event stream with a bad rate or type: refused before streaming starts
        key = draw(st.sampled_from(["hz", "decisions", "types"]))
        out_of_range = ["-1", "nan", "inf", "-inf", "x", "1e9", "20001"] + (["0", "0.1"] if key == "hz" else [])
        v = draw(st.sampled_from(out_of_range) if key != "types"
                 else st.text(min_size=1, max_size=6).map(lambda t: "zz" + t.replace(",", "")))
        return "GET", "/kvtop/v1/events", {}, (key, v)
    method = draw(st.sampled_from(["GET", "POST", "DELETE", "PUT", "PATCH"]))  # wrong method or path
    path = draw(st.sampled_from(["/kvtop/v1/nope", "/v1/embeddings", "/kvtop/v1/state", "/v1/models/x",
                                 "/kvtop/v2/state"]))
    if path == "/kvtop/v1/state" and method == "GET":
        method = "POST"
    return method, path, JSON_CT, b"{}"


def _int_in(v, lo, hi) -> bool:
    try:
        return lo <= int(str(v).strip()) <= hi
    except ValueError:
        return False


any_request = st.one_of(data_request(), data_request(), control_request())


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    loop = asyncio.new_event_loop()
    tmp = tmp_path_factory.mktemp("fuzz")
    # unified, not the default (expected_cost has no knobs): the fuzz sends its real knobs bad values
    cfg = RouterConfig(backends=[Backend("i0", f"http://127.0.0.1:{CLOSED_PORT}")], db=str(tmp / "fuzz.db"),
                       state_dir=str(tmp / "st"), control_token=TOKEN, max_body_bytes=MAX_BODY,
                       max_input_tokens=MAX_INPUT_TOKENS, health_interval_s=0, policy="unified")
    client = TestClient(TestServer(create_app(cfg), host="127.0.0.1"), loop=loop)
    loop.run_until_complete(client.start_server())
    yield loop, client
    loop.run_until_complete(client.close())
    loop.close()


async def _send(client, req) -> tuple[int, object, bytes]:
    method, path, headers, body = req
    params = None
    if isinstance(body, tuple):
        params, body = [body], None
    async def one():
        async with client.request(method, path, data=body, headers=headers, params=params) as r:
            return r.status, r.headers.get("Content-Type", ""), await r.read()
    try:
        return await asyncio.wait_for(one(), 10)
    except asyncio.TimeoutError:
        return 0, "", b"no answer within 10 s"  # fails the status check, showing the request


SEEN = {"n": 0}


@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(batch=st.lists(any_request, min_size=BATCH, max_size=BATCH))
def test_malformed_requests_get_json_4xx(router, batch):
    loop, client = router
    async def send_all():
        return await asyncio.gather(*(_send(client, r) for r in batch))

    results = loop.run_until_complete(send_all())
    for req, (status, ctype, raw) in zip(batch, results):
        what = (req[0], req[1], str(req[3])[:120])
        assert 400 <= status < 500, (status, what, raw[:200])
        assert ctype.startswith("application/json"), (ctype, what)
        err = json.loads(raw)["error"]
        assert isinstance(err["message"], str) and err["message"] and err["code"] == status, (err, what)
    SEEN["n"] += len(batch)
    state = client.server.app[STATE]
    assert state.cluster.counters_zero() and state.counts["requests"] == 0


def test_router_unchanged_after_fuzz(router):
    loop, client = router
    assert SEEN["n"] >= 10_000, "the fuzz test must run first and send at least 10,000 requests"
    app = client.server.app
    state = app[STATE]
    assert state.cluster.counters_zero() and state.counts["requests"] == 0
    assert state.slot.version == 1 and state.slot.policy.name == "unified", "no mutation got through"
    assert state.counts["bad_requests"] > 5_000
    assert app[CONTROL].token == TOKEN

    async def still_serves():
        # the fuzz spent this client's control-read allowance (router/control.py ReadGuard):
        # it refills within READ_BURST / READ_RATE seconds
        from router.control_reads import READ_BURST, READ_RATE

        await asyncio.sleep(READ_BURST / READ_RATE)
        async with client.get("/kvtop/v1/state") as r:
            assert r.status == 200 and (await r.json())["totals"]["in_flight"] == 0
        async with client.put("/kvtop/v1/policy", json={"name": "lmetric"},
                               headers={"Authorization": "Bearer " + TOKEN}) as r:
            assert r.status == 200  # the real token still works
    loop.run_until_complete(still_serves())


# -- the four APIs' bodies, shaped like each API and hostile: never a 500 (issue 36) -------------

def _deep(d: int, leaf=1):
    o = leaf
    for _ in range(d):
        o = {"a": o}
    return o


fuzz_role = st.one_of(st.sampled_from(["user", "assistant", "system", "developer", "tool", "ctx", "msg"]),
                      junk_json)
fuzz_block = st.one_of(
    junk_json,
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image", "thinking", "tool_use", "tool_result",
                                                    "server_tool_use", "redacted_thinking"])},
                          optional={"text": junk_json, "thinking": junk_json, "input": junk_json,
                                    "id": junk_json, "name": junk_json, "tool_use_id": junk_json,
                                    "content": st.one_of(junk_json, st.lists(st.fixed_dictionaries(
                                        {"type": st.just("text"), "text": junk_json}), max_size=3))}))
fuzz_content = st.one_of(st.text(max_size=20), junk_json, st.lists(fuzz_block, max_size=4))
fuzz_message = st.one_of(junk_json, st.fixed_dictionaries({"role": fuzz_role}, optional={"content": fuzz_content}))
deep_value = st.sampled_from([99, 100, 101, 150, 1000, 1100]).map(_deep)  # around the bound, and past json's
fuzz_tool = st.one_of(junk_json, st.fixed_dictionaries(
    {"name": junk_json}, optional={"input_schema": st.one_of(junk_json, deep_value), "type": junk_json,
                                   "parameters": st.one_of(junk_json, deep_value), "description": junk_json}))

messages_body = st.fixed_dictionaries({}, optional={
    "messages": st.one_of(junk_json, st.lists(fuzz_message, max_size=4)),
    "system": st.one_of(junk_json, st.lists(fuzz_block, max_size=2)),
    "tools": st.one_of(junk_json, st.lists(fuzz_tool, max_size=3)),
    "metadata": st.one_of(junk_json, st.fixed_dictionaries({"user_id": st.one_of(junk_json, st.text(max_size=300))})),
    "max_tokens": junk_json, "stream": junk_json, "model": junk_json})
fuzz_item = st.one_of(junk_json, st.fixed_dictionaries(
    {"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "x"])},
    optional={"role": fuzz_role, "content": fuzz_content, "call_id": junk_json, "name": junk_json,
              "arguments": st.one_of(junk_json, deep_value), "output": st.one_of(junk_json, deep_value)}))
responses_body = st.fixed_dictionaries({}, optional={
    "input": st.one_of(junk_json, st.lists(fuzz_item, max_size=4)),
    "instructions": junk_json, "tools": st.one_of(junk_json, st.lists(fuzz_tool, max_size=3)),
    "prompt_cache_key": st.one_of(junk_json, st.text(max_size=300)), "previous_response_id": junk_json,
    "max_output_tokens": junk_json, "stream": junk_json})
chat_api_body = st.fixed_dictionaries({}, optional={
    "messages": st.one_of(junk_json, st.lists(st.one_of(junk_json, st.fixed_dictionaries(
        {"role": fuzz_role}, optional={"content": fuzz_content, "tool_calls": st.one_of(junk_json, deep_value)})),
        max_size=4)),
    "tools": st.one_of(junk_json, st.lists(fuzz_tool, max_size=3)), "session_id": junk_json, "user": junk_json,
    "max_tokens": junk_json})
completions_api_body = st.fixed_dictionaries({}, optional={
    "prompt": st.one_of(junk_json, st.lists(junk_scalar, max_size=5)), "max_tokens": junk_json,
    "stream": junk_json, "session_id": junk_json})
API_BODIES = {"/v1/messages": messages_body, "/v1/responses": responses_body,
              "/v1/chat/completions": chat_api_body, "/v1/completions": completions_api_body}


def _deep_dumps(obj) -> bytes:
    import sys

    old = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)
    try:
        return json.dumps(obj).encode()
    finally:
        sys.setrecursionlimit(old)


#: Batches of API_BATCH bodies per API: 50 (500 bodies) by default, so the suite stays inside
#: CI's 15 minutes; issue 36's must-hold run is KVTOP_FUZZ_API_EXAMPLES=1000 (10,000 bodies per
#: API). Small batches: a batch of 50 of these bodies overran hypothesis's buffer, which then drew
#: again and again: 25-107 s for the same 100 bodies depending on the seed.
API_BATCH = 10
API_EXAMPLES = int(os.environ.get("KVTOP_FUZZ_API_EXAMPLES", 50))


@pytest.mark.parametrize("path", sorted(API_BODIES))
def test_api_bodies_never_get_a_500(router, path):
    """API_EXAMPLES x API_BATCH bodies per API, shaped like the API with junk and deep nesting
    anywhere: whatever the router makes of them, never a 500 (a body it routes meets a closed
    port: 502/503), and every answer is JSON."""
    loop, client = router
    seen = {"n": 0}

    @settings(max_examples=API_EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(batch=st.lists(API_BODIES[path], min_size=API_BATCH, max_size=API_BATCH))
    def run(batch):
        reqs = [("POST", path, JSON_CT, _deep_dumps(b)) for b in batch]

        async def send_all():
            return await asyncio.gather(*(_send(client, r) for r in reqs))

        for req, (status, ctype, raw) in zip(reqs, loop.run_until_complete(send_all())):
            assert status != 500 and status != 0, (status, req[3][:200], raw[:300])
            assert ctype.startswith("application/json"), (ctype, req[3][:200])
        seen["n"] += len(batch)

    run()
    assert seen["n"] >= API_EXAMPLES * API_BATCH // 2  # (hypothesis may stop short when drawing overruns)
    state = client.server.app[STATE]
    assert state.cluster.counters_zero()
