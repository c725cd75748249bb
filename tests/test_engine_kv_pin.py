"""kv_pin_ttl_s: a finished request's KV pinned for a TTL (a feature vLLM lacks, modelled so
that its gain can be measured; docs/simulator.md "KV pin"). Hand-worked block counts."""

from __future__ import annotations

import pytest

from kvtop.cli import main
from kvtop.sim.engine import Engine, EngineRequest, check_kv_pin_ttl
from kvtop.traces.loader import write_trace
from router.blocks import hash_token_blocks
from tests.test_engine import check_invariants
from tests.test_simulate import session_trace

BS = 16


def request(rid: str, n: int, seed: int, arrival: float, max_tokens: int = 1) -> EngineRequest:
    tokens = [(seed * 1_000_003 + i) % 151_936 for i in range(n)]
    return EngineRequest(rid, n, hash_token_blocks(tokens, BS), max_tokens, arrival)


def drive(e: Engine, t: float, until: float | None = None) -> tuple[float, dict]:
    """Step in virtual time until idle (or ``until``); the finished requests by id."""
    done = {}
    while e.has_work():
        r = e.step(t)
        check_invariants(e)
        for f in r.finished:
            done[f.request_id] = f
        if r.idle:
            nxt = e.next_event_time()
            assert nxt is not None, "engine has work but can never make progress"
            if until is not None and nxt >= until:   # idle until then: the caller acts first
                return until, done
            t = max(t, nxt)
        else:
            t = r.end_time
        if until is not None and t >= until:
            break
    return t, done


def scenario(ttl: float, pause: float):
    """A 10-block cache (16-token blocks). Session A's turn 1 (64 tokens: 4 blocks; its one
    output token, sampled at the prefill's end, needs none) finishes;
    during A's tool-call pause a new 112-token request B (7 blocks for its prompt) arrives,
    then A's turn 2 (turn 1's 64 tokens + 32 new). Without a pin, B's 7 blocks come from the
    free queue's head: the 6 never-used blocks, then the one of A's released run at its head
    (its last block, vLLM frees in reverse: the 4th prompt block, the chain's end), so
    A's turn 2 hits 3 blocks (48 tokens). With the pin, B may not take
    A's pinned blocks and waits for the pin or for A's turn 2, which hits all 4 full blocks
    of turn 1's prompt (64 tokens)."""
    e = Engine("h20", block_size=BS, num_gpu_blocks=10, kv_pin_ttl_s=ttl)
    e.add_request(request("a1", 64, seed=1, arrival=0.0))
    t, done = drive(e, 0.0)
    assert e.num_free_blocks == 10 and e.num_pinned_blocks == (4 if ttl else 0)
    t_b = t + 0.01
    e.add_request(request("b", 112, seed=2, arrival=t_b))
    t, done_b = drive(e, t_b, until=t_b + pause)
    done.update(done_b)
    e.add_request(request("a2", 96, seed=1, arrival=max(t, t_b + pause)))
    _, rest = drive(e, max(t, t_b + pause))
    done.update(rest)
    return e, done


def test_without_a_pin_another_request_evicts_the_paused_session():
    e, done = scenario(ttl=0.0, pause=1.0)
    assert done["a2"].num_cached_tokens == 48   # its 4th block went to b
    assert done["b"].num_cached_tokens == 0


def test_a_pin_keeps_the_session_and_its_next_turn_hits():
    e, done = scenario(ttl=30.0, pause=1.0)
    assert done["a2"].num_cached_tokens == 64   # all of turn 1's full prompt blocks
    # b waited for blocks rather than take the pinned ones: it started after a2 arrived
    assert done["b"].scheduled_time >= done["a2"].arrival_time
    assert e.num_pinned_blocks > 0               # a2's own blocks, pinned in turn


def test_an_ended_pin_lets_eviction_happen_as_today():
    # the pause outlasts the pin: b is admitted when the pin ends, takes the same blocks as
    # without a pin, and a2 hits the same 48 tokens
    e, done = scenario(ttl=0.5, pause=3.0)
    base, base_done = scenario(ttl=0.0, pause=3.0)
    assert done["a2"].num_cached_tokens == base_done["a2"].num_cached_tokens == 48
    assert done["b"].scheduled_time >= done["b"].arrival_time + 0.5 - 0.01   # it waited out the pin
    assert sorted(e._cached.values()) == sorted(base._cached.values())


def test_a_running_request_takes_pinned_blocks_rather_than_stall():
    # A 6-block cache: a (64 tokens, 4 blocks) finishes and is pinned for 60 s; c (17 tokens)
    # is admitted on the 2 unpinned blocks and decodes 40 tokens, to 56 tokens, 4 blocks: its
    # 3rd and 4th blocks can only be pinned ones, a's last two (the oldest pin's head). It takes
    # them: no preemption, no 60 s wait; a's chain keeps its first 2 blocks.
    e = Engine("h20", block_size=BS, num_gpu_blocks=6, kv_pin_ttl_s=60.0)
    a = request("a", 64, seed=1, arrival=0.0)
    e.add_request(a)
    t, _ = drive(e, 0.0)
    assert e.num_pinned_blocks == 4
    e.add_request(request("c", 17, seed=3, arrival=t, max_tokens=40))
    t_end, done = drive(e, t)
    assert done["c"].num_output_tokens == 40 and done["c"].num_preemptions == 0
    assert t_end < t + 60.0
    assert e.lookup_cached_tokens(a.block_hashes, 65) == 32


def test_the_per_request_hint_overrides_the_engine_ttl():
    # kv_pin_s: the API hint (a turn its session follows); 0 pins nothing under an engine TTL,
    # a positive one pins under an engine without one
    e = Engine("h20", block_size=BS, num_gpu_blocks=10, kv_pin_ttl_s=30.0)
    last = request("last", 64, seed=1, arrival=0.0)
    last.kv_pin_s = 0.0
    e.add_request(last)
    drive(e, 0.0)
    assert e.num_pinned_blocks == 0
    e = Engine("h20", block_size=BS, num_gpu_blocks=10)
    more = request("more", 64, seed=1, arrival=0.0)
    more.kv_pin_s = 30.0
    e.add_request(more)
    drive(e, 0.0)
    assert e.num_pinned_blocks == 4


def test_simulate_pins_only_continuing_turns(monkeypatch):
    import kvtop.sim.engine as eng
    from kvtop.simulate import SimConfig, simulate

    seen = {}
    real = eng.Engine.add_request

    def spy(self, request):
        seen[request.request_id] = request.kv_pin_s
        return real(self, request)

    monkeypatch.setattr(eng.Engine, "add_request", spy)
    reqs = session_trace(sessions=2, turns=3)
    simulate(reqs, "leastwork", SimConfig(instances=2, mode="closed", kv_pin_ttl_s=7.0,
                                          kv_pin_scope="continuing"))
    last = {}
    for r in reqs:
        last[r.session] = max(r.turn, last.get(r.session, 0))
    want = {str(k): (0.0 if r.turn == last[r.session] else 7.0) for k, r in enumerate(reqs)}
    assert seen == want and 0.0 in seen.values() and 7.0 in seen.values()
    seen.clear()
    simulate(reqs, "leastwork", SimConfig(instances=2, mode="closed", kv_pin_ttl_s=7.0))
    assert set(seen.values()) == {None}   # scope all: the engine's own TTL for every request


def test_ttl_zero_pins_nothing():
    e, done = scenario(ttl=0.0, pause=1.0)
    assert e.num_pinned_blocks == 0 and not e._pinned


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), 86401, "5", True])
def test_check_kv_pin_ttl_refuses(bad):
    with pytest.raises(ValueError, match="--kv-pin-ttl must be a number of seconds from 0 to 86400"):
        check_kv_pin_ttl(bad)
    with pytest.raises(ValueError):
        Engine("h20", kv_pin_ttl_s=bad)


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "1e6"])
def test_simulate_cli_refuses_a_bad_ttl(tmp_path, capsys, value):
    path = tmp_path / "t.jsonl"
    write_trace(path, session_trace(sessions=1, turns=1))
    assert main(["simulate", str(path), "--kv-pin-ttl", value]) == 2
    err = capsys.readouterr().err
    assert "--kv-pin-ttl must be a number of seconds from 0 to 86400" in err and err.count("\n") == 1


def test_simulate_cli_refuses_a_scope_without_a_ttl(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    write_trace(path, session_trace(sessions=1, turns=1))
    assert main(["simulate", str(path), "--kv-pin-scope", "continuing"]) == 2
    err = capsys.readouterr().err
    assert "give --kv-pin-ttl S too" in err and err.count("\n") == 1


def test_simulate_from_db_refuses_a_pin(tmp_path, capsys):
    assert main(["simulate", "--from-db", str(tmp_path / "x.db"), "--kv-pin-ttl", "5"]) == 2
    assert "--from-db takes" in capsys.readouterr().err


def test_sim_cli_refuses_a_bad_ttl(capsys):
    assert main(["sim", "--kv-pin-ttl", "-2", "--duration", "1"]) == 2
    err = capsys.readouterr().err
    assert "--kv-pin-ttl must be a number of seconds from 0 to 86400" in err and err.count("\n") == 1


def test_sim_children_get_the_pin():
    import argparse

    from kvtop.sim.cli import _child_argv, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = _child_argv(parser.parse_args(["--instances", "2", "--kv-pin-ttl", "7.5"]), 1)
    assert argv[argv.index("--kv-pin-ttl") + 1] == "7.5"
    assert "--kv-pin-ttl" not in _child_argv(parser.parse_args(["--instances", "2"]), 1)


def test_simulate_runs_with_a_pin(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    write_trace(path, session_trace())
    assert main(["simulate", str(path), "--policies", "leastwork", "--instances", "2",
                 "--kv-pin-ttl", "5"]) == 0
    assert "leastwork" in capsys.readouterr().out


def test_a_cap_on_the_pinned_share_ends_the_oldest_pins_early():
    # a 10-block cache, at most 50% pinned: a (4 blocks) then c (4 blocks) finish; c's pin
    # would make 8 pinned, so a's (the oldest) ends early, back in the free queue in order
    e = Engine("h20", block_size=BS, num_gpu_blocks=10, kv_pin_ttl_s=60.0, kv_pin_max_share=0.5)
    e.add_request(request("a", 64, seed=1, arrival=0.0))
    t, _ = drive(e, 0.0)
    assert e.num_pinned_blocks == 4
    e.add_request(request("c", 64, seed=2, arrival=t))
    drive(e, t)
    assert e.num_pinned_blocks == 4
    assert [r.rid for r in e._pinned] == [max(r.rid for r in e._pinned)]   # c's run alone
    with pytest.raises(ValueError):
        Engine("h20", kv_pin_max_share=0)
