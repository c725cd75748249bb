"""Exact tokens without stalls: kvtop's added latency on real-sized agentic turns with --tokenizer.

A byte-level BPE tokenizer (``--vocab`` tokens, default 32,000, trained here on the Python
standard library's sources, with ChatML special tokens and a Qwen2.5-style chat template that
renders tools) is built once into ``--tokenizer-dir``. A trivial backend (its own process)
answers every request at once; ``kvtop route`` sits in front of it, with and without
``--tokenizer``. Growing agentic sessions (a ~20k-token system prompt plus 20 tools, then
tool-call / tool-result turns of ~2k tokens each, to ~200k tokens, ~800 KB) go through as
``chat``, ``messages`` (Anthropic) and ``responses`` bodies, and straight to the backend.

Reported, per API and router:
  - returning turns: added latency p50 / p99 (router minus direct, same body) for the last
    ``--turns`` turns of a session that already sent its previous turn, and the router's CPU
    time per turn (every thread of its process and of its child processes: kvtop's parser worker),
    which unlike the latency does not grow when other work on a shared host takes the cores;
  - cold turns: added latency of a fresh ~200k-token session's first turn, next to what
    tokenizing its text alone takes in this process;
  - stalls: p50 / p99 / max of tiny requests and of /health sent every 10 ms while
    ``--concurrent`` cold 200k-token turns go through at once, against the same without them;
    for the peers too (they tokenize nothing: their ratio is what this host's client, backend
    and scheduling allow any router).

    python benchmarks/bench_agentic.py                      # about 2 minutes
    python benchmarks/bench_agentic.py --apis chat --turns 10 --concurrent 20

Every process binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_overhead  # noqa: E402
from bench_overhead import free_port, pct  # noqa: E402

from kvtop.procs import stop_process  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
#: Qwen2.5's chat template in substance: tools as JSON lines in the system turn, tool calls
#: as <tool_call> JSON, consecutive tool results in one user turn.
CHAT_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- for message in messages %}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def corpus(limit_bytes: int = 6_000_000) -> list[str]:
    """The standard library's sources: real code and prose every Python install has."""
    out, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        out.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return out


def build_tokenizer(directory: str | Path, vocab: int = 32_000, corpus_bytes: int = 4_000_000) -> Path:
    """A byte-level BPE tokenizer.json + tokenizer_config.json (with the chat template) in
    ``directory`` (kept: built once per vocabulary size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = Path(directory)
    if (d / "tokenizer.json").exists() and (d / "tokenizer_config.json").exists():
        return d
    d.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(corpus_bytes), trainer=trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": CHAT_TEMPLATE}, indent=1))
    return d


# --- sessions ------------------------------------------------------------------------------------

class Session:
    """One agentic session's text: a system prompt, 20 tools, then tool-call turns."""

    def __init__(self, seed: int, texts: list[str], system_chars: int = 80_000, turn_chars: int = 8_000):
        rng = random.Random(seed)
        self.rng, self.texts, self.turn_chars = rng, texts, turn_chars
        self.system = self._text(system_chars)
        self.tools = [{"name": f"tool_{seed}_{k}", "description": self._text(600),
                       "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                      "required": ["path"]}} for k in range(20)]
        self.task = self._text(1_000)
        self.turns: list[tuple[str, str]] = []  # (tool call argument, tool result)

    def _text(self, n: int) -> str:
        out, size = [], 0
        while size < n:
            t = self.rng.choice(self.texts)
            start = self.rng.randrange(max(1, len(t) - 4000))
            piece = t[start:start + min(4000, n - size)]
            out.append(piece)
            size += len(piece)
        return "".join(out)

    def grow(self) -> None:
        self.turns.append((f"src/file_{len(self.turns)}.py", self._text(self.turn_chars)))

    def chars(self) -> int:
        return len(self.system) + sum(len(r) for _, r in self.turns)

    def body(self, api: str, sid: str) -> dict:
        if api == "messages":
            msgs: list[dict] = [{"role": "user", "content": self.task}]
            for k, (arg, result) in enumerate(self.turns):
                msgs.append({"role": "assistant", "content": [
                    {"type": "tool_use", "id": f"toolu_{k}", "name": self.tools[k % 20]["name"], "input": {"path": arg}}]})
                msgs.append({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": f"toolu_{k}", "content": result}]})
            return {"model": "tiny", "max_tokens": 8, "system": [{"type": "text", "text": self.system}],
                    "tools": [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
                              for t in self.tools], "messages": msgs,
                    "metadata": {"user_id": f"user_ab_account_cd_session_{sid}"}}
        if api == "responses":
            items: list[dict] = [{"type": "message", "role": "user", "content": self.task}]
            for k, (arg, result) in enumerate(self.turns):
                items.append({"type": "function_call", "call_id": f"call_{k}", "name": self.tools[k % 20]["name"],
                              "arguments": json.dumps({"path": arg})})
                items.append({"type": "function_call_output", "call_id": f"call_{k}", "output": result})
            return {"model": "tiny", "max_output_tokens": 8, "instructions": self.system, "input": items,
                    "tools": [{"type": "function", **t} for t in self.tools], "prompt_cache_key": sid}
        msgs = [{"role": "system", "content": self.system}, {"role": "user", "content": self.task}]
        for k, (arg, result) in enumerate(self.turns):
            msgs.append({"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call_{k}", "type": "function",
                "function": {"name": self.tools[k % 20]["name"], "arguments": json.dumps({"path": arg})}}]})
            msgs.append({"role": "tool", "tool_call_id": f"call_{k}", "content": result})
        return {"model": "tiny", "max_tokens": 8, "messages": msgs, "session_id": sid,
                "tools": [{"type": "function", "function": t} for t in self.tools]}


PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


# --- the trivial backend ---------------------------------------------------------------------------

def serve_backend(port: int) -> None:
    from aiohttp import web

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        p = request.path
        if p.endswith("/messages"):
            return web.json_response({"id": "msg_1", "type": "message", "role": "assistant",
                                      "content": [{"type": "text", "text": "ok"}], "model": "tiny",
                                      "usage": {"input_tokens": 1, "output_tokens": 1}})
        if p.endswith("/responses"):
            return web.json_response({"id": f"resp_{time.monotonic_ns()}", "object": "response",
                                      "status": "completed", "output": [],
                                      "usage": {"input_tokens": 1, "output_tokens": 1}})
        return web.json_response({"id": "c", "object": "chat.completion", "model": "tiny",
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1}})

    async def models(_):
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    app = web.Application(client_max_size=64 * 1024 * 1024)
    for path in (*PATHS.values(), "/v1/completions"):
        app.router.add_post(path, answer)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", lambda _: web.Response(text=""))
    for probe in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):  # peers ask
        app.router.add_get(probe, lambda _: web.json_response({"model_path": "tiny"}))
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    bench_overhead.wait_ready(url, proc, timeout, expect=b"")


# --- the client --------------------------------------------------------------------------------------

async def post(http, url: str, payload: bytes) -> float:
    t0 = time.perf_counter()
    async with http.post(url, data=payload, headers={"Content-Type": "application/json"}) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}")
    return (time.perf_counter() - t0) * 1000


def tree_cpu_ms(pid: int | None) -> float:
    """CPU time (ms) of a process, its threads and its child processes (the router's worker),
    from the scheduler's own nanosecond counters: unlike wall-clock latency, it does not grow
    when other work on a shared host takes the cores."""
    if pid is None:
        return 0.0
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):  # gone meanwhile, or not Linux
            continue
    return total / 1e6


async def returning(http, router: str, direct: str, api: str, texts, turns: int, target_chars: int,
                    seed: int, pid: int | None = None) -> tuple[list[float], float]:
    """(added ms, router CPU ms per turn) of the last ``turns`` turns of a session grown to
    about ``target_chars``."""
    s = Session(seed, texts)
    sid = f"bench-{seed}"
    while s.chars() < target_chars - turns * s.turn_chars:
        s.grow()
    await post(http, router + PATHS[api], json.dumps(s.body(api, sid)).encode())  # the session's past
    added, cpu = [], 0.0
    for _ in range(turns):
        s.grow()
        payload = json.dumps(s.body(api, sid)).encode()
        d = min([await post(http, direct + PATHS[api], payload) for _ in range(2)])
        c0 = tree_cpu_ms(pid)
        r = await post(http, router + PATHS[api], payload)
        cpu += tree_cpu_ms(pid) - c0
        added.append(r - d)
    return added, cpu / turns


async def cold(http, router: str, direct: str, api: str, texts, target_chars: int, seed: int,
               tokenizer) -> tuple[float, float, int]:
    """(added ms, ms to tokenize its rendered text alone, tokens) of a fresh session's turn."""
    s = Session(seed, texts)
    while s.chars() < target_chars:
        s.grow()
    payload = json.dumps(s.body(api, f"cold-{seed}")).encode()
    d = min([await post(http, direct + PATHS[api], payload) for _ in range(2)])
    r = await post(http, router + PATHS[api], payload)
    tok_ms, n = 0.0, 0
    if tokenizer is not None:
        from router.request import read_body

        text = tokenizer.render(read_body(json.loads(payload), api).prompt)
        t0 = time.perf_counter()
        n = len(tokenizer.encode(text))
        tok_ms = (time.perf_counter() - t0) * 1000
    return r - d, tok_ms, n


async def stalls(http, router: str, texts, concurrent: int, seconds: float, seed: int) -> dict:
    """Tiny requests and /health every 10 ms, alone and while ``concurrent`` cold big turns pass."""
    tiny = json.dumps({"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}).encode()

    async def probe(stop: asyncio.Event, out: dict) -> None:
        while not stop.is_set():
            out["tiny"].append(await post(http, router + PATHS["chat"], tiny))
            t0 = time.perf_counter()
            async with http.get(router + "/health") as r:
                data = await r.read()
                out["health_status"].add(r.status)
                # kvtop's own view: a backend it marked down during the phase shows here (the
                # peers' /health says nothing of their backends)
                try:
                    h = json.loads(data)
                except ValueError:
                    h = None
                if isinstance(h, dict) and "healthy_instances" in h:
                    out["down_seen"] += h["instances"] - h["healthy_instances"] > 0
            out["health"].append((time.perf_counter() - t0) * 1000)
            await asyncio.sleep(0.01)

    async def phase(big: list[bytes]) -> dict:
        out = {"tiny": [], "health": [], "health_status": set(), "down_seen": 0}
        stop = asyncio.Event()
        task = asyncio.create_task(probe(stop, out))
        if big:
            await asyncio.gather(*[post(http, router + PATHS["chat"], b) for b in big])
        else:
            await asyncio.sleep(seconds)
        stop.set()
        await task
        return out

    bodies = []
    for k in range(concurrent):
        s = Session(seed + 1000 + k, texts)
        while s.chars() < 780_000:
            s.grow()
        bodies.append(json.dumps(s.body("chat", f"stall-{seed}-{k}")).encode())
    quiet = await phase([])
    busy = await phase(bodies)
    res = {}
    for name, ph in (("quiet", quiet), ("busy", busy)):
        for kind in ("tiny", "health"):
            xs = ph[kind]
            res[f"{name}_{kind}"] = {"n": len(xs), "p50": pct(xs, 0.5), "p99": pct(xs, 0.99), "max": max(xs)}
        res[f"{name}_health_status"] = sorted(ph["health_status"])
        res[f"{name}_probes_with_a_backend_down"] = ph["down_seen"]
    return res


async def run(args) -> dict:
    import aiohttp

    from router.tokenizer import Tokenizer

    tok_dir = build_tokenizer(args.tokenizer_dir, args.vocab)
    texts = corpus(6_000_000)
    tokenizer = Tokenizer(str(tok_dir))
    tmp = tempfile.mkdtemp(prefix="kvtop-agentic-")
    procs = []
    bport = free_port()
    procs.append(subprocess.Popen([sys.executable, __file__, "--serve-backend", str(bport)]))
    backend = f"http://127.0.0.1:{bport}"
    wait_ready(backend + "/v1/models", procs[-1])
    routers, pids = {}, {}
    for name, extra in (("kvtop-tokenizer", ["--tokenizer", str(tok_dir)]), ("kvtop-text", [])):
        if name not in args.routers:
            continue
        port = free_port()
        procs.append(subprocess.Popen([sys.executable, "-m", "kvtop", "route", "--host", "127.0.0.1",
                                       "--port", str(port), "--backend", backend, "--policy", "unified",
                                       "--db", "none", "--state-dir", tmp, "--block-size", "16", *extra],
                                      stdout=subprocess.DEVNULL))
        routers[name] = f"http://127.0.0.1:{port}"
        pids[name] = procs[-1].pid
        wait_ready(routers[name] + "/health", procs[-1])
    peers_bin = Path(args.peers_venv).expanduser() / "bin"
    for name in ("sglang", "vllm-router"):
        if name not in args.routers.split(","):
            continue
        if not (peers_bin / "python").exists():
            print(f"{name}: skipped, no peers venv at {args.peers_venv} (benchmarks/peers/run.py makes it)",
                  flush=True)
            continue
        port, prom = free_port(), free_port()
        # started as benchmarks/peers/run.py starts them; they get the same chat bodies
        common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", backend,
                  "--policy", "cache_aware", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom)]
        cmd = ([str(peers_bin / "python"), "-m", "sglang_router.launch_router", *common, "--log-level", "warn"]
               if name == "sglang" else [str(peers_bin / "vllm-router"), *common, "--log-level", "warning"])
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
        routers[name] = f"http://127.0.0.1:{port}"
        pids[name] = procs[-1].pid
        wait_ready(routers[name] + "/health", procs[-1])
    results: dict = {"vocab": tokenizer._tok.get_vocab_size(), "routers": {}}
    timeout = aiohttp.ClientTimeout(total=300)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as http:
            for name, url in routers.items():
                r = results["routers"][name] = {}
                for k, api in enumerate(args.apis.split(",")):
                    if name in ("sglang", "vllm-router") and api != "chat":
                        continue  # the peers route chat; the same chat bodies as kvtop's
                    added, cpu = await returning(http, url, backend, api, texts, args.turns, args.chars,
                                                 seed=k + 1, pid=pids.get(name))
                    c_added, tok_ms, n = await cold(http, url, backend, api, texts, args.chars, seed=100 + k,
                                                    tokenizer=tokenizer if name == "kvtop-tokenizer" else None)
                    r[api] = {"returning_p50_ms": pct(added, 0.5), "returning_p99_ms": pct(added, 0.99),
                              "returning_cpu_ms": cpu,
                              "cold_added_ms": c_added, "cold_tokenize_alone_ms": tok_ms, "cold_tokens": n}
                    print(name, api, json.dumps(r[api]), flush=True)
                if args.concurrent:  # the peers too: what this host allows a router that tokenizes nothing
                    r["stalls"] = await stalls(http, url, texts, args.concurrent, args.quiet_seconds, seed=7)
                    print(name, "stalls", json.dumps(r["stalls"]), flush=True)
                    if not name.startswith("kvtop"):
                        continue
                    st = r["stalls"]
                    down = st["quiet_probes_with_a_backend_down"] + st["busy_probes_with_a_backend_down"]
                    print(name, "no backend marked down by the router's own stall:",
                          "HOLDS" if not down and st["busy_health_status"] == [200] else f"FAILS ({down} probes saw one down)",
                          flush=True)
    finally:
        for p in procs:
            stop_process(p)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve-backend", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--apis", default="chat,messages,responses")
    ap.add_argument("--routers", default="kvtop-tokenizer,kvtop-text,sglang,vllm-router",
                    help="any of kvtop-tokenizer, kvtop-text, sglang, vllm-router (chat only)")
    ap.add_argument("--turns", type=int, default=20, help="returning turns measured per API (default 20)")
    ap.add_argument("--chars", type=int, default=800_000, help="session size in characters (default 800,000)")
    ap.add_argument("--peers-venv", default="~/.cache/kvtop-peers/venv",
                    help="venv with sglang-router and vllm-router (benchmarks/peers/run.py makes it)")
    ap.add_argument("--concurrent", type=int, default=6, help="cold 200k-token turns at once in the stall test")
    ap.add_argument("--quiet-seconds", type=float, default=3.0)
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--tokenizer-dir", default=os.path.join(tempfile.gettempdir(), "kvtop-bench-tokenizer-32k"))
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    if args.serve_backend:
        serve_backend(args.serve_backend)
        return
    if args.tokenizer_dir.endswith("-32k") and args.vocab != 32_000:
        args.tokenizer_dir = args.tokenizer_dir[:-4] + f"-{args.vocab // 1000}k"
    res = asyncio.run(run(args))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
