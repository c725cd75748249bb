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
