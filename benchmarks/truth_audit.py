"""The truth audit: every figure kvtop shows, held against what the engines themselves did.

Real agents' request shapes go through kvtop's router to ``kvtop sim`` instances, which keep
their own account of every request (kvtop/sim/truth.py: cached tokens served, tokens
prefilled, output tokens, queue wait, time to first token):

- Claude Code-shaped Messages sessions: a system prompt with the billing header, tools, and
  per turn a tool_use, a mid-conversation ``system`` reminder, the tool_result and an answer;
  then a ``--continue``-style resume (a new session id resending the whole history);
- Codex-shaped Responses sessions: long instructions, 60 function tools, ``prompt_cache_key``,
  ``function_call`` / ``function_call_output`` items, the whole input every turn;
- chat and completions (text, and token ids).

Then kvtop's views (decision and outcome rows, ``/kvtop/v1/state``, ``/metrics``, ``kvtop log
summary``) are compared with that truth and with the client's own observations, and one table
is printed: figure, kvtop, truth, error. docs/truth.md keeps it.

    python benchmarks/truth_audit.py                  # the table in docs/truth.md (about a minute)
    python benchmarks/truth_audit.py --turns 2 --speed 20   # quicker

Everything runs in this process on 127.0.0.1 and stops by itself. The router counts text with
the simulator's own tokenizer (``--tokenizer kvtop-sim``, as ``kvtop sim``'s route line gives
it), so text prompts are exact too; ``--no-tokenizer`` runs it on the router's
4-characters-a-token approximation instead (text prompts then route on the estimate).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402
import sqlite_utils  # noqa: E402

from kvtop.sim.engine import Engine  # noqa: E402
from kvtop.sim.kv_publisher import KvEventPublisher  # noqa: E402
from kvtop.sim.server import SimInstance, serve  # noqa: E402
from router.app import STATE, Backend, RouterConfig, create_app, start_server  # noqa: E402

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma "
         "tau upsilon phi chi psi omega").split()


def words(n: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + k * 13) % len(WORDS)] + str((seed + k) % 97) for k in range(n))


def codex_tools(n: int = 60) -> list[dict]:
    return [{"type": "function", "name": f"tool_{k}", "strict": False,
             "description": f"Tool {k}: reads and edits files in the workspace. " + words(30, k),
             "parameters": {"type": "object", "properties": {
                 "path": {"type": "string", "description": "a path relative to the workspace root"},
                 "mode": {"type": "string", "enum": ["read", "write", "append"]}},
                 "required": ["path"], "additionalProperties": False}} for k in range(n)]


def claude_tools(n: int = 12) -> list[dict]:
    return [{"name": f"Tool{k}", "description": words(40, 100 + k),
             "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}} for k in range(n)]


# -- the client ----------------------------------------------------------------------------------------
@dataclass
class Sent:
    shape: str
    request_id: str | None
    status: int
    t_sent: float
    ttft_s: float | None
    usage: dict | None


@dataclass
class Client:
    url: str
    http: aiohttp.ClientSession
    sent: list[Sent] = field(default_factory=list)

    async def post(self, shape: str, path: str, body: dict, headers: dict | None = None,
                   data: bytes | None = None) -> Sent:
        if data is None:
            data = json.dumps(body).encode()  # encoded before the clock starts: the client's own work
        first = None
        usage = None
        buf = b""
        t0 = time.monotonic()
        async with self.http.post(self.url + path, data=data,
                                  headers={"Content-Type": "application/json", **(headers or {})}) as r:
            rid = r.headers.get("X-Kvtop-Request-Id")
            if body.get("stream"):
                async for chunk in r.content.iter_any():
                    if first is None and _has_token(chunk):
                        first = time.monotonic() - t0
                    buf += chunk
                for line in buf.split(b"\n"):
                    if line.startswith(b"data:") and line[5:].strip() not in (b"[DONE]", b""):
                        ev = json.loads(line[5:])
                        u = ev.get("usage") or (ev.get("response") or {}).get("usage") if isinstance(ev, dict) else None
                        if u:
                            usage = u
            else:
                data = await r.read()
                first = time.monotonic() - t0
                if r.status == 200:
                    usage = json.loads(data).get("usage")
        s = Sent(shape, rid, r.status, t0, first, usage)
        self.sent.append(s)
        return s


_TOKEN = re.compile(rb'"(?:text|content|delta|partial_json)":\s*"(?!")')


def _has_token(chunk: bytes) -> bool:
    return _TOKEN.search(chunk) is not None


def client_output(u: dict | None) -> int | None:
    if not u:
        return None
    return u.get("completion_tokens", u.get("output_tokens"))


def client_cached(u: dict | None) -> int | None:
    if not u:
        return None
    for k in ("prompt_tokens_details", "input_tokens_details"):
        if isinstance(u.get(k), dict) and "cached_tokens" in u[k]:
            return u[k]["cached_tokens"]
    return u.get("cache_read_input_tokens")


# -- the workloads ---------------------------------------------------------------------------------------
async def claude_code(c: Client, turns: int, sid: str, seed: int) -> list[dict]:
    system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1; cch={seed:05d};"},
              {"type": "text", "text": "You are Claude Code. " + words(600, seed)}]
    msgs: list[dict] = [{"role": "user", "content": [{"type": "text", "text": "task: " + words(80, seed + 1)}]}]
    for t in range(turns):
        body = {"model": "sim-model", "max_tokens": 24, "stream": True, "system": system,
                "tools": claude_tools(), "messages": msgs,
                "metadata": {"user_id": f"user_abc_account_x_session_{sid}"}}
        await c.post("claude_code", "/v1/messages", body)
        msgs = msgs + [
            {"role": "assistant", "content": [{"type": "tool_use", "id": f"tu{t}", "name": "Tool1",
                                               "input": {"path": f"src/m{t}.py"}}]},
            {"role": "system", "content": f"<system-reminder>todo list at step {t}: {words(20, t)}</system-reminder>"},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"tu{t}",
                                          "content": words(300, seed * 10 + t)}]},
            {"role": "assistant", "content": [{"type": "text", "text": words(30, seed + t)}]},
            {"role": "user", "content": [{"type": "text", "text": "next: " + words(40, seed + 50 + t)}]}]
    return msgs


async def claude_code_resume(c: Client, history: list[dict], seed: int) -> None:
    """``claude --continue``: a new session id, the whole history again, one more message."""
    system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1; cch={seed + 1:05d};"},
              {"type": "text", "text": "You are Claude Code. " + words(600, seed)}]
    body = {"model": "sim-model", "max_tokens": 24, "stream": True, "system": system, "tools": claude_tools(),
            "messages": history + [{"role": "system", "content": "<system-reminder>resumed</system-reminder>"}],
            "metadata": {"user_id": "user_abc_account_x_session_resumed"}}
    await c.post("claude_code_resume", "/v1/messages", body)


async def codex(c: Client, turns: int, key: str, seed: int) -> None:
    items: list[dict] = [{"type": "message", "role": "user",
                          "content": [{"type": "input_text", "text": "fix it: " + words(60, seed)}]}]
    tools = codex_tools(60)
    for t in range(turns):
        body = {"model": "sim-model", "instructions": "You are Codex. " + words(400, seed), "tools": tools,
                "input": items, "stream": True, "store": False, "max_output_tokens": 16, "prompt_cache_key": key}
        await c.post("codex_60_tools", "/v1/responses", body)
        items = items + [
            {"type": "function_call", "call_id": f"c{t}", "name": "tool_3", "arguments": json.dumps({"path": f"a{t}"})},
            {"type": "function_call_output", "call_id": f"c{t}", "output": words(200, seed * 3 + t)},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": words(20, t)}]}]


async def chat(c: Client, turns: int, sid: str, seed: int) -> None:
    msgs = [{"role": "system", "content": words(200, seed)}, {"role": "user", "content": words(50, seed + 1)}]
    for t in range(turns):
        await c.post("chat", "/v1/chat/completions",
                     {"model": "sim-model", "messages": msgs, "max_tokens": 12, "stream": t % 2 == 0,
                      "stream_options": {"include_usage": True} if t % 2 == 0 else None},
                     headers={"X-Session-ID": sid})
        msgs = msgs + [{"role": "assistant", "content": words(20, t)}, {"role": "user", "content": words(40, seed + t)}]


async def completions(c: Client, turns: int, sid: str, seed: int) -> None:
    text = words(300, seed)
    ids = [(seed * 31 + k * 17) % 30_000 for k in range(1500)]
    for t in range(turns):
        await c.post("completions_text", "/v1/completions",
                     {"model": "sim-model", "prompt": text, "max_tokens": 10}, headers={"X-Session-ID": sid})
        await c.post("completions_ids", "/v1/completions",
                     {"model": "sim-model", "prompt": ids, "max_tokens": 10, "stream": True,
                      "stream_options": {"include_usage": True}}, headers={"X-Session-ID": sid + "-ids"})
        text += " " + words(100, seed + t)
        ids = ids + [(seed + t * 7 + k) % 30_000 for k in range(300)]


async def burst(c: Client, n: int, tokens: int, seed: int, shape: str = "backlog_burst") -> None:
    """Cold prompts at once (token ids: nothing cached), so a backlog forms and drains. Every
    body is encoded before the first is sent: encoded in each request's own coroutine, the
    others' encoding ran between a request's clock start and its send (about 1 ms each), and
    the client's TTFT counted ~20 ms of its own work that the router never saw."""
    bodies = [{"model": "sim-model", "prompt": [(seed + k * 101 + j * 7) % 30_000 for j in range(tokens)],
               "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}} for k in range(n)]
    encoded = [json.dumps(b).encode() for b in bodies]
    await asyncio.gather(*(c.post(shape, "/v1/completions", b, headers={"X-Session-ID": f"burst-{seed}-{k}"}, data=d)
                           for k, (b, d) in enumerate(zip(bodies, encoded))))


async def watch_backlog(url: str, stop: asyncio.Event, insts: list | None = None) -> list[tuple]:
    """The state's per-instance backlog while a burst runs: (monotonic time, state, each
    engine's clock then: the mean of its clock before and after the state was read)."""
    seen = []
    async with aiohttp.ClientSession() as http:
        while not stop.is_set():
            t = time.monotonic()
            before = [i.engine_clock() for i in insts or ()]
            snap = await (await http.get(url + "/kvtop/v1/state")).json()
            clocks = [(b + i.engine_clock()) / 2 for b, i in zip(before, insts or ())]
            seen.append((t, snap, clocks))
            await asyncio.sleep(0.005)
    return seen


# -- the run ----------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


async def audit(turns: int = 6, *, speed: float = 20.0, blocks: int = 4000, tmp: str | None = None,
                tokenizer: str | None = "kvtop-sim") -> dict[str, Any]:
    """Run the workloads and gather every view and the truth. Returns the raw material."""
    tmp = tmp or tempfile.mkdtemp(prefix="kvtop-truth-")
    insts = []
    for _ in range(2):
        eng = Engine("h20", num_gpu_blocks=blocks)
        inst = SimInstance(eng, model="sim-model", port=_free_port(), speed=speed)
        inst.kv_publisher = KvEventPublisher(eng, port=0, replay_port=0)
        insts.append(inst)
    ready = asyncio.Event()
    sim = asyncio.get_running_loop().create_task(serve(insts, on_ready=lambda _: ready.set()))
    await ready.wait()
    db = str(Path(tmp) / "truth.db")
    cfg = RouterConfig(backends=[Backend(f"sim{k}", f"http://127.0.0.1:{i.port}", kv_events=i.kv_publisher.endpoint,
                                         kv_replay=i.kv_publisher.replay_endpoint) for k, i in enumerate(insts)],
                       block_size=16, capacity_tokens=blocks * 16, db=db, state_dir=str(Path(tmp) / "state"),
                       scrape_interval_s=0.2, health_interval_s=0, tokenizer=tokenizer)
    app = create_app(cfg)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    runner = await start_server(app, sock)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    state = app[STATE]
    try:
        await asyncio.sleep(0.3)  # the KV-event subscribers connect

        async def clients() -> list[Sent]:
            async with aiohttp.ClientSession() as http:
                c = Client(url, http)
                cc = await asyncio.gather(
                    claude_code(c, turns, "s1", 1), codex(c, turns, "codex-key-1", 2), chat(c, turns, "chat-1", 3),
                    completions(c, max(2, turns // 2), "cmp-1", 4))
                await claude_code_resume(c, cc[0], 1)
                return c.sent

        # The clients run on their own loop (a thread): on the router's loop their timings would
        # include waiting behind the router's and the engines' work, not only the answer's. A
        # short GIL switch interval keeps the client thread from waiting up to 5 ms (Python's
        # default) for the interpreter each time an answer's bytes arrive.
        switch = sys.getswitchinterval()
        sys.setswitchinterval(0.0002)
        try:
            sent = await asyncio.to_thread(asyncio.run, clients())
        finally:
            sys.setswitchinterval(switch)

        # Two bursts of cold prompts, one after the other: the first on a router that has seen
        # no backlog drain yet (its backlog seconds rest on first tokens of idle instances), the
        # second once one has drained. Each instance's state is watched while they run.
        backlog_seen: list[tuple[str, list]] = []
        burst_sent: list[Sent] = []
        for name, n, seed in (("backlog_burst_1", 16, 7), ("backlog_burst_2", 24, 11)):
            async def bursts(name=name, n=n, seed=seed) -> list[Sent]:
                async with aiohttp.ClientSession() as http:
                    c = Client(url, http)
                    await burst(c, n, 6000, seed, name)
                    return c.sent

            stop = asyncio.Event()
            watcher = asyncio.ensure_future(watch_backlog(url, stop, insts))
            sys.setswitchinterval(0.0002)  # as for the sessions above
            try:
                burst_sent += await asyncio.to_thread(asyncio.run, bursts())
            finally:
                sys.setswitchinterval(switch)
            stop.set()
            backlog_seen.append((name, await watcher))
        sent = sent + burst_sent
        await asyncio.sleep(0.5)  # the last outcomes are recorded, the telemetry poller runs
        async with aiohttp.ClientSession() as http:
            snap = await (await http.get(url + "/kvtop/v1/state")).json()
            metrics = await (await http.get(url + "/metrics")).text()
            truth: dict[str, dict] = {}
            for i in insts:
                body = await (await http.get(f"http://127.0.0.1:{i.port}/kvtop/sim/truth")).json()
                for r in body["records"]:
                    truth[r["request_id"]] = {**r, "instance_port": i.port}
        state.writer.flush()
        rows = sqlite_utils.Database(db)
        decisions = {d["request_id"]: d for d in rows["decisions"].rows}
        outcomes = {o["request_id"]: o for o in rows["outcomes"].rows}
    finally:
        await runner.cleanup()
        sim.cancel()
        try:
            await sim
        except BaseException:
            pass
    from kvtop.log_cli import format_summary
    from store import summary as store_summary

    from kvtop.report import load_db_arms, render

    summary = store_summary.summary(db, None)
    report_csv = render(load_db_arms(db, None), "csv")
    return {"speed": speed, "report_csv": report_csv, "sent": sent, "backlog_seen": backlog_seen, "truth": truth, "decisions": decisions, "outcomes": outcomes, "state": snap,
            "metrics": metrics, "summary": summary, "summary_text": format_summary(summary), "db": db}


# -- the comparison ----------------------------------------------------------------------------------------
def compare(a: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(figure, kvtop, truth, error) rows."""
    sent, truth, dec, out = a["sent"], a["truth"], a["decisions"], a["outcomes"]
    rows: list[tuple[str, str, str, str]] = []
    ok = [s for s in sent if s.status == 200]
    paired = [(s, truth.get(s.request_id), out.get(s.request_id), dec.get(s.request_id)) for s in ok]
    missing = sum(1 for _, t, o, d in paired if t is None or o is None or d is None)
    rows.append(("requests answered 200 with a decision, an outcome and an engine record",
                 f"{len(paired) - missing}", f"{len(ok)}", f"{missing} missing"))
    full = [(s, t, o, d) for s, t, o, d in paired if t is not None and o is not None and d is not None]

    def equal_share(label: str, kv, tv, subset=None) -> None:
        group = [p for p in full if subset is None or subset(p[0])]
        if not group:
            return
        eq = sum(1 for p in group if kv(p) == tv(p))
        rows.append((label, f"{eq} of {len(group)} equal", f"{len(group)}",
                     f"{len(group) - eq} differ ({100 * (len(group) - eq) / len(group):.1f}%)"))

    equal_share("outcome output_tokens = engine's output tokens", lambda p: p[2]["output_tokens"],
                lambda p: p[1]["output_tokens"])
    equal_share("outcome delivered_hit_tokens = engine's cached tokens", lambda p: p[2]["delivered_hit_tokens"],
                lambda p: p[1]["cached_tokens"])
    equal_share("  of those, Codex with 60 tools", lambda p: p[2]["delivered_hit_tokens"],
                lambda p: p[1]["cached_tokens"], lambda s: s.shape == "codex_60_tools")
    equal_share("client's usage (output, cached) = engine's", lambda p: (client_output(p[0].usage),
                                                                         client_cached(p[0].usage)),
                lambda p: (p[1]["output_tokens"], p[1]["cached_tokens"]))
    for shape in sorted({s.shape for s, *_ in full}) + ["all"]:
        group = [p for p in full if shape == "all" or p[0].shape == shape]
        est = sum(p[3]["est_hit_tokens"] or 0 for p in group)
        cached = sum(p[1]["cached_tokens"] for p in group)
        prompt = sum(p[1]["prompt_tokens"] for p in group)
        err = sum(abs((p[3]["est_hit_tokens"] or 0) - p[1]["cached_tokens"]) for p in group)
        exact = sum(1 for p in group if p[3]["index_source"] == "exact")
        rows.append((f"estimated hit tokens vs engine cached, {shape} ({exact}/{len(group)} exact)",
                     f"{est:,}", f"{cached:,}", f"{100 * err / max(1, prompt):.1f}% of prompt tokens"))
        router_in = sum(p[3]["input_tokens"] for p in group)
        rows.append((f"input tokens counted vs engine prompt tokens, {shape}", f"{router_in:,}", f"{prompt:,}",
                     f"{100 * (router_in - prompt) / max(1, prompt):+.1f}%"))
    diffs = sorted(abs(p[2]["ttft_ms"] - p[0].ttft_s * 1000) for p in full
                   if p[2]["ttft_ms"] is not None and p[0].ttft_s is not None)
    if diffs:
        rows.append(("logged TTFT vs the client's (|difference|, ms)", f"p50 {statistics.median(diffs):.1f}",
                     "0", f"max {diffs[-1]:.1f} ms"))
    rows += backlog_rows(a)
    st, m, summ = a["state"], a["metrics"], a["summary"]
    n_dec = len(dec)
    segs = summ["segments"]
    views = {"state routed_total": st["totals"]["routed_total"],
             "/metrics kvtop_decisions_total": int(_metric(m, "kvtop_decisions_total")),
             "decision rows": n_dec,
             "log summary decisions": sum(s["decisions"] for s in segs)}
    rows.append(("requests routed: " + " / ".join(views), " / ".join(str(v) for v in views.values()),
                 f"{len(sent)} sent", "equal" if len(set(views.values()) | {len(sent)}) == 1 else "DIFFER"))
    ok_views = {"state outcomes ok": st["outcomes_by_status"].get("ok", 0),
                "/metrics kvtop_outcomes_total{ok}": int(_metric(m, "kvtop_outcomes_total", status="ok")),
                "outcome rows ok": sum(1 for o in out.values() if o["status"] == "ok"),
                "log summary ok": sum(s["statuses"].get("ok", 0) for s in segs)}
    rows.append(("ok outcomes: " + " / ".join(ok_views), " / ".join(str(v) for v in ok_views.values()),
                 f"{len(ok)} answered 200", "equal" if len(set(ok_views.values()) | {len(ok)}) == 1 else "DIFFER"))
    errs = {"state errors": st["totals"]["errors_total"],
            "/metrics kvtop_instance_errors_total": int(_metric(m, "kvtop_instance_errors_total"))}
    rows.append(("errors: " + " / ".join(errs), " / ".join(str(v) for v in errs.values()),
                 f"{len(sent) - len(ok)} not 200", "equal" if len(set(errs.values()) | {len(sent) - len(ok)}) == 1
                 else "DIFFER"))
    infl = {"state in_flight": st["totals"]["in_flight"],
            "/metrics kvtop_instance_num_requests": int(_metric(m, "kvtop_instance_num_requests"))}
    rows.append(("in flight after the run: " + " / ".join(infl), " / ".join(str(v) for v in infl.values()), "0",
                 "equal" if set(infl.values()) == {0} else "DIFFER"))
    delivered = sum(p[1]["cached_tokens"] for p in full)
    report = _report_row(a.get("report_csv", ""))
    if report:
        prompt = sum(p[1]["prompt_tokens"] for p in full)
        rows.append(("kvtop report --db: requests / ok", f"{report['requests']} / {report['ok']}",
                     f"{len(sent)} / {len(ok)}", "equal" if (int(report["requests"]), int(report["ok"])) ==
                     (len(sent), len(ok)) else "DIFFER"))
        apc = float(report["apc"])
        rows.append(("kvtop report --db: APC (cached share of prompt tokens)", f"{apc:.3f}",
                     f"{delivered / max(1, prompt):.3f}", f"{100 * (apc * prompt / max(1, delivered) - 1):+.1f}%"))
    rows.append(("cached tokens: state hit_tokens.delivered", f"{st['hit_tokens']['delivered']:,}", f"{delivered:,}",
                 f"{st['hit_tokens']['delivered'] - delivered:+,}"))
    return rows


def backlog_rows(a: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Per burst and instance, at the moment the backlog peaked in the state, its backlog seconds
    against the time its engine then took to drain it: from its engine clock at that moment to
    the engine's first token of the last burst request it held (the engine's own account, in
    wall seconds at its --speed). The client's clock is shown too: on a loaded host it differs
    by the host's lag (an engine behind its wall clock catches up: that is the host's time, not
    the engine's).

    The peak is taken among the moments the state's pending tokens were the engine's within one
    request (the burst requests whose first token the engine had not yet produced, by its own
    records): at --speed 20 the router's view of a burst can lag its engine by whole requests
    (one event loop parses 24 bodies of 6,000 tokens while the engines' clocks run on), and a
    count the engine has already drained in part says nothing of the rate. Where no moment
    agrees, the largest count is used and the row says "(view lagging)"."""
    out = []
    speed = a.get("speed") or 1.0
    for shape, seen in a.get("backlog_seen") or []:
        burst = [(s, a["decisions"].get(s.request_id)) for s in a["sent"] if s.shape == shape and s.status == 200]
        if not seen or not burst:
            continue
        names = [i["name"] for i in seen[0][1]["instances"]]
        for k, name in enumerate(names):
            mine = [s for s, d in burst if d is not None and d["instance"] == name and s.ttft_s is not None]
            recs = [r for r in (a["truth"].get(s.request_id) for s in mine) if r and r.get("ttft_s") is not None]
            if not mine or not recs or k >= len(seen[0][2]):
                continue

            def engine_pending(clock: float) -> int:
                return sum(r["prefill_tokens"] for r in recs if clock < r["arrival"] + r["ttft_s"])

            views = [(t, snap["instances"][k], clocks[k]) for t, snap, clocks in seen
                     if k < len(snap["instances"]) and snap["instances"][k]["backlog_s"] is not None
                     and snap["instances"][k]["pending_prefill_tokens"] > 0]
            if not views:
                continue
            one = max(r["prefill_tokens"] for r in recs)
            agree = [v for v in views if abs(v[1]["pending_prefill_tokens"] - engine_pending(v[2])) <= one]
            t_peak, inst, clock = max(agree or views, key=lambda v: v[1]["pending_prefill_tokens"])
            client = max(s.t_sent + s.ttft_s for s in mine) - t_peak
            drained = (max(r["arrival"] + r["ttft_s"] for r in recs) - clock) / speed
            shown = inst["backlog_s"]
            rate = f"{inst.get('backlog_source', 'assumed')} {inst.get('backlog_prefill_tps') or 0:,.0f}/s"
            out.append((f"backlog seconds at the peak, {shape}, {name} ({inst['pending_prefill_tokens']:,} "
                        f"tokens, {rate}){'' if agree else ' (view lagging)'}",
                        f"{shown:.3f} s", f"{drained:.3f} s drained (client's clock {client:.3f} s)",
                        f"{100 * (shown - drained) / drained:+.0f}%" if drained > 0 else "n/a"))
    return out


def _report_row(text: str) -> dict[str, str] | None:
    """The first arm of ``kvtop report``'s CSV (its first table)."""
    import csv
    import io

    lines = text.strip().split("\n\n")[0] if text else ""
    got = list(csv.DictReader(io.StringIO(lines)))
    return got[0] if got else None


def format_table(rows: list[tuple[str, str, str, str]]) -> str:
    head = ("figure", "kvtop", "truth", "error")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line, sep] + ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=6, help="turns per session (default 6)")
    p.add_argument("--speed", type=float, default=1.0,
                   help="the simulated engines' --speed (default 1: engine time is wall time, so the backlog "
                        "and TTFT figures mean what they would on the profile's GPU)")
    p.add_argument("--no-tokenizer", action="store_true",
                   help="the router without --tokenizer kvtop-sim: text prompts counted by the approximation")
    args = p.parse_args(argv)
    if args.turns < 1 or args.speed <= 0:
        p.error("--turns must be >= 1 and --speed > 0")
    a = asyncio.run(audit(args.turns, speed=args.speed, tokenizer=None if args.no_tokenizer else "kvtop-sim"))
    print(format_table(compare(a)))
    print()
    print(a["summary_text"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
