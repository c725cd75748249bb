"""Simulation tasks on a Ray cluster: ``kvtop simulate --repeats N --ray ADDRESS`` and
``kvtop sweep SPEC --ray ADDRESS`` (the optional extra: ``pip install 'kvtop[ray]'``).

The same tasks as the local worker processes (kvtop/repeats.py), run by one actor per CPU
of the cluster (or ``--workers N``): the traces go to the object store once and each actor
loads them once, so a task ships only its small description and brings back one row. The
simulation is deterministic, so the rows equal a local run's. Every node needs kvtop (this
version) importable, as with any Ray job.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvtop.cli import CliError


class _Worker:
    """One actor: the run's traces, loaded once (``setup``); runs tasks one at a time (``run``).
    Both come from kvtop/repeats.py, which calls this module, so they are passed in."""

    def __init__(self, setup: Callable[..., None], run: Callable[[Any], Any], args: tuple):
        setup(*args)
        self._run = run

    def run(self, item: Any) -> Any:
        return self._run(item)


def run_on_ray(address: str, setup: Callable[..., None], run: Callable[[Any], Any], shared: tuple,
               items: Sequence[Any], workers: int | None = None) -> Iterator[Any]:
    """Yield ``run(item)`` for every item as the cluster finishes them (in any order); every
    actor first calls ``setup(*shared)`` with ``shared`` taken from the object store."""
    try:
        import ray
        from ray.util import ActorPool
    except ImportError:
        raise CliError("--ray needs Ray: pip install 'kvtop[ray]'") from None
    started = not ray.is_initialized()
    if started:
        try:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise CliError(f"--ray {address}: cannot connect: {exc}") from None
    try:
        n = workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
        shared_ref = ray.put(shared)
        actor = ray.remote(num_cpus=1)(_Worker)
        actors = [actor.remote(setup, run, shared_ref) for _ in range(max(1, min(n, len(items))))]
        try:
            yield from ActorPool(actors).map_unordered(lambda a, item: a.run.remote(item), list(items))
        finally:
            for a in actors:
                ray.kill(a)
    finally:
        if started:
            ray.shutdown()
