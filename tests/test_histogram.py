"""router/histogram.py: the same /metrics text as prometheus_client's Histogram."""

from __future__ import annotations

import math
import random

import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from router.histogram import FastHistogram
from router.telemetry import DECISION_BUCKETS_S, LATENCY_BUCKETS_S


def _pair(buckets):
    a, b = CollectorRegistry(), CollectorRegistry()
    h = Histogram("kvtop_x_seconds", "what it times", buckets=buckets, registry=a)
    f = FastHistogram("kvtop_x_seconds", "what it times", buckets=buckets, registry=b)
    f._created = h._created  # the one sample that is a clock reading
    return (a, h), (b, f)


@pytest.mark.parametrize("buckets", [LATENCY_BUCKETS_S, DECISION_BUCKETS_S, (-1.0, 0.0, 1.0)],
                         ids=["latency", "decision", "negative-bounds"])
def test_the_same_samples_as_prometheus_client(buckets):
    (a, h), (b, f) = _pair(buckets)
    rng = random.Random(5)
    # every bucket and its edges: on a bound (counted in it), past the last bound, zero,
    # negative, an infinity, NaN (in no bucket, in the sum)
    values = [rng.uniform(-0.1, 200) for _ in range(500)] + [rng.expovariate(1e4) for _ in range(500)]
    values += [float(x) for x in buckets] + [0.0, -3.0, 1e9, math.inf, math.nan]
    rng.shuffle(values)
    for v in values:
        h.observe(v)
        f.observe(v)
    assert generate_latest(b) == generate_latest(a)
    assert generate_openmetrics(b) == generate_openmetrics(a)


def test_nothing_observed_reads_as_zero():
    (a, _), (b, _) = _pair(LATENCY_BUCKETS_S)
    assert generate_latest(b) == generate_latest(a)
