"""kvtop sim --process-per-instance: each instance in its own process, one heavy request on
one instance does not stall another, and the parent ends every child it started."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time

from kvtop.procs import free_port_run


def _get(port: int, path: str) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def _wait(ports, proc, timeout=30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"kvtop sim exited ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        try:
            if all(_get(p, "/health")[0] == 200 for p in ports):
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError("instances did not come up")


def _closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_process_per_instance_isolates_and_stops_cleanly():
    base = free_port_run(2)  # below the ports the kernel hands to this test's own connections
    proc = subprocess.Popen([sys.executable, "-m", "kvtop", "sim", "--instances", "2", "--port-base", str(base),
                             "--speed", "1000", "--duration", "60", "--process-per-instance"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait([base, base + 1], proc)
        # each process labels its metrics as instance i would in one process
        for i in range(2):
            _, text = _get(base + i, "/metrics")
            assert f'engine="{i}"' in text.decode()
        # a long prompt on instance 0; instance 1's /health meanwhile
        lat: list[float] = []
        stop = threading.Event()

        def probe() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                _get(base + 1, "/health")
                lat.append(time.perf_counter() - t0)
                time.sleep(0.01)

        th = threading.Thread(target=probe)
        th.start()
        body = json.dumps({"model": "m", "prompt": "w " * 250_000, "max_tokens": 1}).encode()
        c = http.client.HTTPConnection("127.0.0.1", base, timeout=60)
        c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        assert c.getresponse().status == 200
        c.close()
        stop.set()
        th.join()
        assert lat and max(lat) < 0.5, max(lat)  # one process: tens of ms; here ~1 ms
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert sorted(line.split(":")[0] for line in out.splitlines() if line.startswith("instance")) == \
        ["instance 0", "instance 1"]
    # the route-with line comes once, after both instances listen
    lines = out.splitlines()
    routes = [k for k, line in enumerate(lines) if line.startswith("route with: ")]
    assert len(routes) == 1 and lines[routes[0]].count("--backend ") == 2
    assert _closed(base) and _closed(base + 1)  # no child left serving


def test_a_child_that_cannot_start_ends_the_rest():
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    busy = blocker.getsockname()[1]
    blocker.listen()
    try:
        # instance 1's port is taken: its process fails, the parent stops instance 0 and says so
        proc = subprocess.run([sys.executable, "-m", "kvtop", "sim", "--instances", "2", "--port-base",
                               str(busy - 1), "--duration", "30", "--process-per-instance"],
                              capture_output=True, text=True, timeout=60)
    finally:
        blocker.close()
    assert proc.returncode == 2
    assert "an instance process exited" in proc.stderr
    assert "route with:" not in proc.stdout  # never printed for a fleet that did not come up
    assert _closed(busy - 1)


def test_a_taken_default_kv_port_is_replaced_in_each_child():
    """Without --kv-events-port-base the KV ports are a default layout: a child that finds its
    port taken binds a free one (as one process does), and the route-with line names the ports
    the children bound, not the layout's."""
    base = free_port_run(6)
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", base + 3))  # instance 0's replay port in the default layout
    blocker.listen()
    proc = subprocess.Popen([sys.executable, "-m", "kvtop", "sim", "--instances", "2", "--port-base", str(base),
                             "--speed", "1000", "--duration", "60", "--process-per-instance"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        route = None
        lines = []
        deadline = time.monotonic() + 30
        while route is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()[-2000:]
            lines.append(line)
            if line.startswith("route with: "):
                route = line
        assert route is not None
    finally:
        blocker.close()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    first = next(line for line in lines if line.startswith("instance 0:"))
    replay = first.split(" replay ")[1].split()[0]
    assert replay != f"tcp://127.0.0.1:{base + 3}"
    assert f"@kv=tcp://127.0.0.1:{base + 2}@kv-replay={replay} " in route
    assert f"@kv=tcp://127.0.0.1:{base + 4}@kv-replay=tcp://127.0.0.1:{base + 5} " in route
