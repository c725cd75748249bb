"""Ending processes kvtop started: a signal first, then a kill after a grace period.

Only ever called with processes the caller itself started (a demo's servers, a test's or a
benchmark's subprocesses), by their Popen handle.
"""

from __future__ import annotations

import signal
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
