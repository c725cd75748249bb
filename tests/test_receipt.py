"""Decision receipts: every candidate's terms are recorded, whatever the reason."""

from __future__ import annotations

import pytest

from router.cluster import Candidate, ClusterView
from router.policies import build_policy
from router.policies.base import AFFINITY_STICK


def _view(session_instance):
    # Session bound to i1, which holds 9k of the 10k-token prompt and is not overloaded.
    cands = [Candidate(0, "i0", 0, 10_000, 4_000, 2, 50_000),
             Candidate(1, "i1", 9_000, 1_000, 0, 2, 10_000),
             Candidate(2, "i2", 0, 10_000, 0, 1, 0)]
    return ClusterView(cands, 10_000, session_instance, 3, 0, [c.hit for c in cands])


@pytest.mark.parametrize("name, score_i0", [
    ("sticky", 2),              # sticky's score is BS_i
    ("unified", 28_000),        # what unified's fallback would score: (P + new) x BS
    # unified_ab's cost in seconds: 2 x 0.05 + 14,000 / 5,000 + 0.01 x 50,000 / 5,000 - 2 turns x 0.05
    ("unified_ab", 2.9),
])
def test_affinity_stick_records_every_candidate(name, score_i0):
    """The receipt promises every candidate's terms; a stick used to record the chosen one only."""
    pick = build_policy(name).pick(None, _view(1))
    assert pick.reason == AFFINITY_STICK and pick.index == 1
    assert [t["instance"] for t in pick.terms] == ["i0", "i1", "i2"]
    assert [t["hit"] for t in pick.terms] == [0, 9_000, 0]
    assert pick.terms[0]["score"] == pytest.approx(score_i0)


def test_an_exact_hit_is_shown_beside_what_the_estimate_said():
    """The dashboard's receipt (decision events) and `kvtop log why` (log rows) say it alike,
    in words, never as the raw field."""
    from kvtop.receipt import from_row, head_lines

    event = {"request_id": "r1", "instance": "i0", "reason": "affinity_stick", "est_hit": 15360,
             "index_source": "exact", "estimate_hit": 12288, "best_hit": 15360}
    text = "\n".join(head_lines(event))
    assert "est hit 15,360 tok (exact; the estimate said 12,288)" in text
    assert "estimate_hit" not in text
    row = {"request_id": "r1", "instance": "i0", "reason": "argmin", "est_hit_tokens": 0,
           "index_source": "estimate", "estimate_hit_tokens": None}
    assert "est hit 0 tok (estimate)" in "\n".join(head_lines(from_row(row, None)))
