"""Real agents end to end: Claude Code (``claude -p``, then three ``--continue`` turns) and Codex
(``codex exec``, then two ``resume --last`` turns), each through ``kvtop route`` to ``kvtop sim
--instances 2 --speed 1``. Every turn exits 0 within 60 s, every request of a session lands on
one instance (the router's decisions say so, and so does each simulated instance's own count),
and every decision has its ``ok`` outcome.

The agents come from the npm registry, pinned (AGENTS below), installed once into
``$KVTOP_AGENTS_DIR`` (default ``~/.cache/kvtop-agents``, outside the clone; .ci/run prepares it)
and reused. Skipped only where node or npm is absent. The agents run with telemetry, update
checks and other non-essential traffic off, in a scratch HOME, and with every proxy variable
pointing at a closed loopback port (NO_PROXY: loopback), so that only loopback is reachable.

The simulated answers here are 128 tokens each (``--output-len 128``) to keep the run to about a
minute; whether an answer is a tool call is still the simulator's seeded draw, so each turn runs
the agent's tool loop for one to four requests. ``KVTOP_AGENTS_OUTPUT_LEN=sample`` runs it with
kvtop sim's default answer lengths (the bundled trace's; turns then take 5-40 s).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import sqlite_utils

from kvtop.procs import free_port_run

AGENTS = {"claude": "@anthropic-ai/claude-code@2.1.197", "codex": "@openai/codex@0.171.0"}
AGENTS_DIR = Path(os.environ.get("KVTOP_AGENTS_DIR") or Path.home() / ".cache" / "kvtop-agents")
TURN_LIMIT_S = 60

pytestmark = pytest.mark.skipif(not (shutil.which("node") and shutil.which("npm")),
                                reason="node and npm are needed to install Claude Code and Codex")


def _bin(name: str) -> Path:
    return AGENTS_DIR / "node_modules" / ".bin" / name


def _installed() -> bool:
    for name, spec in AGENTS.items():
        pkg = AGENTS_DIR / "node_modules" / spec.rsplit("@", 1)[0] / "package.json"
        if not _bin(name).exists() or not pkg.exists() \
                or json.loads(pkg.read_text()).get("version") != spec.rsplit("@", 1)[1]:
            return False
    return True


@pytest.fixture(scope="module")
def agents() -> dict[str, Path]:
    """The pinned agents, installed from the npm registry on first use (.ci/run does it first)."""
    if not _installed():
        AGENTS_DIR.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["npm", "install", "--prefix", str(AGENTS_DIR), "--no-audit", "--no-fund",
                            "--loglevel=error", *AGENTS.values()], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0 and _installed(), f"npm install failed:\n{r.stdout}\n{r.stderr}"
    return {name: _bin(name) for name in AGENTS}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when this returns: nothing listens there


def _wait_http(url: str, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > end:
            raise AssertionError(f"{url} did not come up")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """`kvtop sim --instances 2 --speed 1` and `kvtop route` in front of it, as a user runs them;
    yields (router URL, [instance URLs], decision log path)."""
    tmp = tmp_path_factory.mktemp("fleet")
    base = free_port_run(6)  # 2 HTTP ports, then 2 x (KV events, replay)
    env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost"}
    sim = subprocess.Popen([sys.executable, "-m", "kvtop", "sim", "--instances", "2", "--port-base", str(base),
                            "--speed", "1", "--output-len", os.environ.get("KVTOP_AGENTS_OUTPUT_LEN", "128"),
                            "--duration", "900"],
                           stdout=subprocess.PIPE, stderr=open(tmp / "sim.err", "w"), text=True, env=env)
    procs = [sim]
    try:
        lines = [sim.stdout.readline() for _ in range(3)]
        assert lines[2].startswith("route with: kvtop route "), lines
        backends = lines[2].split("kvtop route ", 1)[1].split()
        router_port = free_port_run(1)  # now that the instances hold theirs
        db = tmp / "kvtop.db"
        router = subprocess.Popen([sys.executable, "-m", "kvtop", "route", *backends, "--port", str(router_port),
                                   "--db", str(db), "--state-dir", str(tmp / "state")],
                                  stdout=open(tmp / "route.out", "w"), stderr=subprocess.STDOUT, env=env)
        procs.append(router)
        url = f"http://127.0.0.1:{router_port}"
        _wait_http(url + "/health", 30)
        yield url, [f"http://127.0.0.1:{base + i}" for i in range(2)], db
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


def _sandbox_env(home: Path) -> dict[str, str]:
    """A scratch HOME, and every proxy variable at a closed loopback port: only loopback works."""
    dead = f"http://127.0.0.1:{_closed_port()}"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
           "TERM": "dumb", "NO_COLOR": "1", "XDG_CONFIG_HOME": str(home / ".config")}
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env[var] = env[var.lower()] = dead
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    return env


def _turn(argv: list[str], cwd: Path, env: dict[str, str], label: str) -> str:
    t0 = time.monotonic()
    try:
        r = subprocess.run(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=TURN_LIMIT_S)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{label}: no exit within {TURN_LIMIT_S} s\n{exc.stdout}\n{exc.stderr}") from None
    took = time.monotonic() - t0
    print(f"{label}: exit {r.returncode} in {took:.1f} s")
    assert r.returncode == 0, f"{label}: exit {r.returncode} after {took:.1f} s\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    assert took < TURN_LIMIT_S
    return r.stdout


def _requests_served(url: str) -> int:
    """Finished requests an instance counted itself (vllm:request_success_total, all reasons)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:request_success_total")))


def _check_session(db: Path, since: float, sims: list[str], before: list[int], min_requests: int) -> None:
    """One session, on one instance; every decision has its ok outcome."""
    time.sleep(0.5)  # the router's writer flushes every few hundred milliseconds
    log = sqlite_utils.Database(db)
    decisions = [d for d in log["decisions"].rows_where("ts >= ?", [since], order_by="ts")]
    assert len(decisions) >= min_requests, decisions
    assert len({d["session_id"] for d in decisions}) == 1, [d["session_id"] for d in decisions]
    assert len({d["instance"] for d in decisions}) == 1, [(d["instance"], d["reason"]) for d in decisions]
    assert decisions[0]["reason"] == "affinity_new"
    assert all(d["reason"] == "affinity_stick" for d in decisions[1:]), [d["reason"] for d in decisions]
    assert all(d["input_tokens"] > 1000 for d in decisions)  # an agent's system prompt and tools
    outcomes = {o["request_id"]: o for o in log["outcomes"].rows}
    for d in decisions:
        o = outcomes.get(d["request_id"])
        assert o is not None, d
        assert o["status"] == "ok" and o["output_tokens"] and o["output_tokens"] >= 1, o
        assert o["ttft_ms"] is not None and o["e2e_ms"] >= o["ttft_ms"], o
    # the instances' own counts: all of it on the chosen one, none on the other
    served = [_requests_served(u) - b for u, b in zip(sims, before)]
    chosen = int(decisions[0]["instance"][1:]) if decisions[0]["instance"][1:].isdigit() else None
    assert sorted(served) == [0, len(decisions)], served
    if chosen is not None:
        assert served[chosen] == len(decisions), (served, chosen)


def test_claude_code_continues_a_session_through_kvtop(agents, fleet, tmp_path):
    url, sims, db = fleet
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (work / "README.md").write_text("a small project\n")
    env = {**_sandbox_env(home), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "sk-kvtop-test",
           "CLAUDE_CONFIG_DIR": str(home / ".claude"), "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1",
           "DISABLE_BUG_COMMAND": "1", "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1"}
    claude = str(agents["claude"])
    since, before = time.time(), [_requests_served(u) for u in sims]
    out = _turn([claude, "-p", "list the files in this project", "--model", "sim-model"], work, env, "claude -p")
    assert out.strip()
    for k, prompt in enumerate(("now read the README", "summarise it", "and suggest a test")):
        out = _turn([claude, "-p", "--continue", prompt, "--model", "sim-model"], work, env, f"claude --continue #{k + 1}")
        assert out.strip()
    _check_session(db, since, sims, before, min_requests=4)


def test_codex_resumes_a_session_through_kvtop(agents, fleet, tmp_path):
    url, sims, db = fleet
    home, work = tmp_path / "home", tmp_path / "work"
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True)
    work.mkdir()
    (work / "README.md").write_text("a small project\n")
    # a custom provider speaking the Responses API (Codex's only wire API), nothing else enabled
    (codex_home / "config.toml").write_text(f'''model = "sim-model"
model_provider = "kvtop"
approval_policy = "never"
sandbox_mode = "read-only"
check_for_update_on_startup = false

[model_providers.kvtop]
name = "kvtop"
base_url = "{url}/v1"
env_key = "KVTOP_API_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0

[analytics]
enabled = false

[feedback]
enabled = false
''')
    env = {**_sandbox_env(home), "CODEX_HOME": str(codex_home), "KVTOP_API_KEY": "sk-kvtop-test"}
    codex = str(agents["codex"])
    since, before = time.time(), [_requests_served(u) for u in sims]
    _turn([codex, "exec", "--skip-git-repo-check", "list the files in this project"], work, env, "codex exec")
    for k, prompt in enumerate(("now read the README", "and suggest a test")):
        _turn([codex, "exec", "--skip-git-repo-check", "resume", "--last", prompt], work, env, f"codex resume #{k + 1}")
    _check_session(db, since, sims, before, min_requests=3)
