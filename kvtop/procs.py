"""Ending processes kvtop started: a signal first, then a kill after a grace period; and a run
of free loopback ports for the servers it starts (kvtop sim takes PORT..PORT+n-1).

Only ever called with processes the caller itself started (a demo's servers, a test's or a
benchmark's subprocesses), by their Popen handle.
"""

from __future__ import annotations

import random
import signal
import socket
import subprocess
from collections.abc import Sequence


def stop_processes(procs: Sequence[subprocess.Popen], *, grace_s: float = 10.0,
                   sig: int = signal.SIGTERM) -> None:
    """Signal every live process, give them ``grace_s`` together to exit, kill the rest."""
    import time

    for proc in procs:
        if proc.poll() is None:
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop_process(proc: subprocess.Popen | None, *, grace_s: float = 10.0, sig: int = signal.SIGTERM) -> None:
    if proc is not None:
        stop_processes([proc], grace_s=grace_s, sig=sig)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    """The first port the kernel hands to outgoing connections (Linux: ip_local_port_range)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_port_run(n: int) -> int:
    """A base port with ``n`` free consecutive ports (kvtop sim takes PORT..PORT+n-1), below
    the kernel's range for outgoing connections: a port found free there can be handed to a
    client socket before the server binds it (a test polling the first instance took the
    second's port that way, about once in 30 starts)."""
    rng = random.Random()
    top = max(_ephemeral_low(), 12_000) - n
    for _ in range(200):
        base = rng.randrange(10_000, top)
        if all(_port_free(base + i) for i in range(n)):
            return base
    raise OSError("no run of free loopback ports found")
