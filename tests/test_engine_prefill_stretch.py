"""Coalesced prefill chunks (Engine._coalesce_prefill): the steps in which one request goes on
with its chunked prefill while the others decode are returned as one result, and the records,
counters and block pool come out exactly as when stepping one by one, with arrivals and aborts
landing inside the coalesced steps."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtop.sim.engine import Engine, EngineRequest
from router.blocks import hash_token_blocks
from tests.test_engine import counters, drive_with_arrivals, req


def test_a_long_prefill_beside_decoding_requests_is_one_result():
    e = Engine("h20", block_size=16, max_num_batched_tokens=512)
    e.add_request(req("d", 100, max_tokens=400))
    first = e.step(0.0, coalesce=True)
    assert first.first_token == ["d"]
    e.add_request(req("p", 3_000, max_tokens=2, arrival=first.end_time))
    r = e.step(first.end_time, coalesce=True)        # p's first chunk, then its next ones
    # 3,000 tokens at 511 a step beside d: 5 chunks before the one that samples p's first token
    assert r.num_steps == 5 and not r.first_token and r.emitted == {"d": 1 + 5}
    busy = e.busy_time
    nxt = e.step(r.end_time, coalesce=True)
    assert nxt.first_token == ["p"] and nxt.num_steps == 1
    plain = Engine("h20", block_size=16, max_num_batched_tokens=512)
    plain.add_request(req("d", 100, max_tokens=400))
    t = plain.step(0.0).end_time
    plain.add_request(req("p", 3_000, max_tokens=2, arrival=t))
    for _ in range(5):
        t = plain.step(t).end_time
    assert t == r.end_time and plain.busy_time == busy   # the same bits
    assert plain.step(t).end_time == nxt.end_time


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 100_000), blocks=st.integers(40, 400), batch=st.sampled_from([64, 128, 300, 512]),
       threshold=st.sampled_from([0, 0, 100]), seqs=st.integers(1, 6), hook=st.booleans(),
       priority=st.booleans())
def test_coalesced_prefills_give_the_same_requests_counters_and_pool(seed, blocks, batch, threshold, seqs,
                                                                     hook, priority):
    rng = random.Random(seed)
    bases = [list(range(k * 100_000, k * 100_000 + 4_000)) for k in range(3)]
    arrivals, t = [], 0.0
    for k in range(12):
        n = rng.randint(1, min(4_000, blocks * 16 * 2 // 3))
        t += rng.choice([0.0, rng.uniform(0.0, 0.05), rng.uniform(0.0, 0.5)])
        arrivals.append(EngineRequest(f"r{k}", n, hash_token_blocks(rng.choice(bases)[:n], 16),
                                      rng.randint(1, 80), t,
                                      priority=rng.randint(-1, 1) if priority else 0))
    aborts = {rng.uniform(0.0, t + 1.0): f"r{rng.randrange(12)}" for _ in range(rng.choice([0, 0, 2]))}
    kw = dict(num_gpu_blocks=blocks, block_size=16, max_num_seqs=seqs, max_num_batched_tokens=batch,
              long_prefill_token_threshold=threshold,
              scheduling_policy="priority" if priority else "fcfs")
    order = (lambda views, budget: sorted(range(len(views)), key=lambda i: views[i].cost)) if hook else None
    plain, coalesced = Engine("h20", admission=order, **kw), Engine("h20", admission=order, **kw)
    a, calls_a = drive_with_arrivals(plain, arrivals, False, aborts)
    b, calls_b = drive_with_arrivals(coalesced, arrivals, True, aborts)
    assert a == b and counters(plain) == counters(coalesced)
    assert plain._ref == coalesced._ref and plain._cached == coalesced._cached
    assert plain._free_queue() == coalesced._free_queue()
    assert calls_b <= calls_a
