"""Backlog seconds per instance: how long its engine will take to prefill what is queued on it.

The figure the state (``/kvtop/v1/state``) and the dashboard show. Each request queued on the
instance costs the prior's seconds for its new and cached tokens (router/calibration.py
``T0(q, h)``) times the ENGINE's scale, ``k`` of a fit of ``S = a + k x T0`` to the instance's
first tokens (router/engine_fit.py): on an idle instance a request's service time
``S`` holds its fixed overheads ``a`` too (HTTP, parsing, tokenizing: paid before the engine
starts), but while a backlog drains each request's overheads overlap the prefill before it,
so the gap between consecutive first tokens is ``k x T0`` alone. Dividing by the
calibration's per-request rate (``sum(q) / sum(S)``) counted ``a`` once per queued request:
on the simulated fleet at ``--speed 20`` that read 1.7-2.6x the time the backlog took.

The fit is the instance's own once it has ``MIN_OWN_SAMPLES`` first tokens, else the fleet's
(every instance's first tokens). ``backlog_source`` says what the seconds rest on, best first:

- ``drain``: ``k`` from first tokens that came while a backlog stood (a backlog's drain);
- ``fit``: ``k`` from first tokens on idle instances, the overheads taken out by the fit's
  intercept (no backlog has drained yet);
- ``measured`` (``fleet`` while the instance has no sample of its own): no fit yet (too few
  first tokens, or all of one size): the calibration's per-request rate ``sum(q) / sum(S)``,
  overheads included, so backlog seconds read high;
- ``assumed``: nothing measured: ``--assumed-prefill-tps``.

``backlog_prefill_tps`` is the rate behind it: the prior's linear rate at the fitted scale
(``tokens_per_s / k``), else the per-token rate used. The request at the head of the queue has been prefilling since
it arrived or since the instance's last first token, whichever is later; that part of it is
done, and is taken off (as the lookahead does for ``expected_cost``, router/cluster.py).
Routing does not read this module: policies price requests with the calibration's ``seconds``.
"""

from __future__ import annotations

from typing import Any

#: First tokens an instance needs before its own fit replaces the fleet's: a fit's intercept
#: and slope from a handful of samples swing with the host's jitter (on the simulated fleet at
#: --speed 20, one instance's 6 samples read 2.5x the engine's scale; the fleet's 13, 1.1x).
MIN_OWN_SAMPLES = 32


def instance_backlog(cluster: Any, i: int, assumed_tps: float, now: float) -> dict[str, Any]:
    """``backlog_s``, ``backlog_source`` and ``backlog_prefill_tps`` for instance ``i``.

    ``now`` is on the cluster's clock (its ``clock()``, the calibration's timestamps)."""
    cal = cluster.calibration
    prior = cal.prior
    pending = max(cluster.instances[i].pending_prefill_tokens, 0)
    tickets = cluster._prefilling[i]  # the cluster's tickets before their first token
    fit = cal.engine.scale(i) if cal.engine.samples(i) >= MIN_OWN_SAMPLES else None
    fit = fit or cal.engine.scale()
    if fit is not None:  # the engine's scale on the prior's shape
        k, source = fit[0], ("drain" if fit[1] else "fit")
        tps = prior.tokens_per_s / k

        def seconds(q: int, h: int) -> float:
            return k * prior.seconds(q, h)
    else:  # one rate per token: the calibration's per-request rate, else the assumed one
        if cal.measured:
            tps, source = cal.tps(i), ("measured" if cal.samples(i) else "fleet")
        else:
            tps, source = assumed_tps, "assumed"
        if not tps or tps <= 0:
            return {"backlog_s": None, "backlog_source": source, "backlog_prefill_tps": None}

        def seconds(q: int, h: int) -> float:
            return q / tps

    if tickets:
        total = sum(seconds(t.new_prefill, t.input_tokens - t.new_prefill) for t in tickets.values())
        head = min(tickets.values(), key=lambda t: t.started)
        done = now - max(head.started, cal.last_first(i))
        total -= min(max(done, 0.0), seconds(head.new_prefill, head.input_tokens - head.new_prefill))
    else:  # pending tokens without tickets (a count set directly): the linear rate
        total = pending / tps
    return {"backlog_s": max(total, 0.0), "backlog_source": source, "backlog_prefill_tps": round(tps, 1)}
