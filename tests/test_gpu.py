"""GPU telemetry end to end, on a machine with an NVIDIA GPU (skipped, with the reason, without).

Real processes: one simulated vLLM instance, ``kvtop route`` mapping it to GPU 0 with
``@gpu=0``, and a second process keeping that GPU busy with matrix products (PyTorch, where
installed). The router must report NVML's own utilisation and memory for the instance (not the
simulator's busy ratio), see the load come and go, and ``kvtop attach --once`` must show it.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import free_port
from router.engine_metrics import GpuSampler


def _nvml_or_skip() -> GpuSampler:
    g = GpuSampler()
    if not g.init():
        pytest.skip(f"no NVIDIA GPU/NVML on this machine: {g.reason}")
    return g


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def _wait_up(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args[3]} exited: {proc.communicate()[1][-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"{url} did not come up")


LOAD = """
import sys, time, torch
x = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
keep = torch.empty(int(sys.argv[2]) * 2**20, dtype=torch.uint8, device="cuda")  # held memory
print("ready", flush=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    for _ in range(20):
        x = (x @ x).clamp_(-1, 1)
    torch.cuda.synchronize()
"""


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def test_router_reports_nvml_utilisation_and_memory_under_load(tmp_path):
    g = _nvml_or_skip()
    try:
        (idle,) = g.sample([0]).values()
    finally:
        g.shutdown()
    assert isinstance(idle, tuple), idle
    try:
        import torch  # noqa: F401  (only to make the GPU busy)
        has_torch = torch.cuda.is_available()
    except ImportError:
        has_torch = False

    sim_port, router_port = free_port(), free_port()
    sim = subprocess.Popen([sys.executable, "-m", "kvtop", "sim", "--instances", "1", "--port-base", str(sim_port),
                            "--duration", "120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs = [sim]
    try:
        _wait_up(f"http://127.0.0.1:{sim_port}", sim)
        router = subprocess.Popen(
            [sys.executable, "-m", "kvtop", "route", "--backend", f"a=http://127.0.0.1:{sim_port}@gpu=0",
             "--port", str(router_port), "--state-dir", str(tmp_path), "--db", str(tmp_path / "k.db")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(router)
        url = f"http://127.0.0.1:{router_port}"
        _wait_up(url, router)

        def gpu() -> dict:
            return _get_json(url + "/kvtop/v1/state")["instances"][0]["gpu"]

        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and gpu().get("source") != "nvml":
            time.sleep(0.2)
        first = gpu()
        assert first["source"] == "nvml", first
        assert 0 <= first["util_pct"] <= 100
        assert 0 <= first["mem_used_bytes"] <= first["mem_total_bytes"]  # 0 MiB on an idle H100
        assert first["mem_total_bytes"] == idle[2]  # NVML's own total, in the same unit
        smi = shutil.which("nvidia-smi")
        if smi:  # the operator's cross-check: the same "used" as nvidia-smi (the driver's reserve left out)
            q = subprocess.run([smi, "-i", "0", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=30)
            smi_mib = float(q.stdout.strip())
            assert abs(gpu()["mem_used_bytes"] / 2**20 - smi_mib) <= 64, (gpu(), smi_mib)

        if not has_torch:
            pytest.skip("NVML reading checked; no PyTorch with CUDA here to load the GPU")
        held_mb = 4096
        load = subprocess.Popen([sys.executable, "-c", LOAD, "12", str(held_mb)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(load)
        assert load.stdout.readline().strip() == "ready", load.stderr.read()[-2000:]
        busy: list[dict] = []
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            busy.append(gpu())
            time.sleep(0.25)
        peak = max(b["util_pct"] for b in busy)
        assert peak >= 80, [b["util_pct"] for b in busy]
        # the memory the load holds shows (>= its 4 GiB tensor beyond the idle reading)
        assert max(b["mem_used_bytes"] for b in busy) - first["mem_used_bytes"] >= held_mb * 2**20 * 0.95

        out = subprocess.run([sys.executable, "-m", "kvtop", "attach", url, "--once",
                              "--state-dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        row = next(line for line in out.stdout.splitlines() if re.match(r"^a\s+up\b", line))
        # the row ends with the GPU's utilisation and its memory "used/total" (NVML's, not n/a)
        m = re.search(r"\s(\d{1,3})\s+([\d.]+[KMGT]?)/([\d.]+[KMGT]?)\s*$", row)
        assert m, row
        assert int(m.group(1)) >= 50, row  # the load still runs while attach reads the state

        load.wait(timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and gpu()["util_pct"] > 20:
            time.sleep(0.25)
        assert gpu()["util_pct"] <= 20, "the router still reports the finished load"
    finally:
        for p in reversed(procs):
            _stop(p)
