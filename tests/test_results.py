"""store/results.py: the one per-request result record (the replay results format)."""

from __future__ import annotations

import pytest

from store.results import ABSENT, FIELDS, RECORD_KEYS, RequestResult


def test_a_record_has_the_core_fields_and_only_the_extras_its_producer_set():
    r = RequestResult(request_id="r1", session="s", turn=2, input_tokens=100, output_tokens=3,
                      status="ok", ttft_ms=12.5, arm="a")
    assert r.as_record() == {"request_id": "r1", "session": "s", "turn": 2, "input_tokens": 100,
                             "output_tokens": 3, "status": "ok", "ttft_ms": 12.5, "e2e_ms": None,
                             "tpot_ms": None, "cached_tokens": None, "instance": None,
                             "route_class": None, "arm": "a"}
    assert list(r.as_record()) == list(RECORD_KEYS)
    # An extra set to None is reported (replay's http_status of a request that never got one);
    # left ABSENT it is not in the record.
    r.http_status, r.arrival = None, 0.5
    assert list(r.as_record()) == [k for k in FIELDS if k in RECORD_KEYS or k in ("http_status", "arrival")]
    assert r.as_record()["http_status"] is None and "sent_at" not in r.as_record()


@pytest.mark.parametrize("extras", [
    # each producer's keys, in the order its records have always had (a subsequence of FIELDS)
    ("arrival", "sent_at", "http_status", "error"),                          # kvtop replay
    ("arrival", "error", "prefill_instance", "admission_wait_ms", "prefill_leg_ms"),  # kvtop simulate
    ("arrival", "stream", "t_done"),                                          # what-if's recorded run
    (),                                                                       # the decision log
])
def test_each_producers_keys_keep_their_order(extras):
    r = RequestResult(request_id="r", session="s", turn=1, input_tokens=1, output_tokens=1,
                      status="ok", arm="a", **{k: None for k in extras})
    assert list(r.as_record()) == [k for k in FIELDS if k in RECORD_KEYS or k in extras]


def test_fields_are_typed_and_required():
    with pytest.raises(TypeError):  # no request_id: a record cannot be half-built
        RequestResult(session="s", turn=1, input_tokens=1, output_tokens=1, status="ok", arm="a")
    with pytest.raises(AttributeError):  # slots: a misspelt field is an error, not a new key
        RequestResult(request_id="r", session="s", turn=1, input_tokens=1, output_tokens=1,
                      status="ok", arm="a").ttft = 3.0
    assert repr(ABSENT) == "ABSENT"
