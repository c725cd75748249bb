"""Route classes by input length, as the seed study defines them.

One definition for the router's decision log, the reports and the offline simulator.
"""

from __future__ import annotations

WARM, MEDIUM, HEAVY, HEAVY_PLUS = "WARM", "MEDIUM", "HEAVY", "HEAVY+"
HEAVY_P2P, HEAVY_COLO = "HEAVY_P2P", "HEAVY_COLO"

#: Classes in report order, with their input-token bounds [lo, hi).
CLASSES: tuple[tuple[str, int, float], ...] = (
    (WARM, 0, 5_000),
    (MEDIUM, 5_000, 20_000),
    (HEAVY, 20_000, 50_000),
    (HEAVY_PLUS, 50_000, float("inf")),
)


def route_class(input_tokens: int) -> str:
    """WARM < 5k, MEDIUM 5k-20k, HEAVY 20k-50k, HEAVY+ >= 50k input tokens."""
    if input_tokens < 5_000:
        return WARM
    if input_tokens < 20_000:
        return MEDIUM
    if input_tokens < 50_000:
        return HEAVY
    return HEAVY_PLUS


def length_class(route_cls: str) -> str:
    """The length class behind a route class (offloaded HEAVY requests are still HEAVY)."""
    return HEAVY if route_cls in (HEAVY_P2P, HEAVY_COLO) else route_cls
