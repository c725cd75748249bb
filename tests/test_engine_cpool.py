"""The block pool's per-block loops exist twice: compiled (kvtop/sim/_blockpool.c, built by
``pip install`` when it can be) and in Python (kvtop/sim/_pool.py, the fallback, forced by
KVTOP_PURE_PYTHON=1). Both must give the same engine, result by result and block by block:
random workloads (shared prefixes, preemptions, aborts, KV events, priorities, KV pins,
remote-prefill pulls) run once on each and are compared after every step; each function is
compared on its own with edge cases (errors included); and the shadow-pool test of
tests/test_engine_block_pool.py runs on the implementation the suite does not use by default,
so that CI exercises both."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import sysconfig
from contextlib import contextmanager

import pytest

from kvtop.sim import _pool
from kvtop.sim import engine as engine_mod
from kvtop.sim.engine import Engine, EngineRejected, EngineRequest
from tests.test_engine_block_pool import BS, drive, shadowed, workload

needs_c = pytest.mark.skipif(_pool.C is None, reason="the C block pool is not built here "
                             "(no C compiler at install time): only the Python loops run")

# engine.py's name for each of _pool's functions
ENGINE_NAMES = {name: "_" + name for name in _pool.NAMES}
ENGINE_NAMES["touch"] = "_touch_blocks"
ENGINE_NAMES["register"] = "_register_blocks"
ENGINE_NAMES["advance"] = "_advance_running"


@contextmanager
def using(impl):
    """The engine module on ``impl``'s loops (``_pool.C`` or ``_pool.PY``) inside the block."""
    saved = {n: getattr(engine_mod, attr) for n, attr in ENGINE_NAMES.items()}
    try:
        for n, attr in ENGINE_NAMES.items():
            setattr(engine_mod, attr, getattr(impl, n))
        yield
    finally:
        for n, attr in ENGINE_NAMES.items():
            setattr(engine_mod, attr, saved[n])


def test_the_engine_uses_every_pool_function_of_the_chosen_implementation():
    impl = _pool.C if _pool.IMPL == "c" else _pool.PY
    for n, attr in ENGINE_NAMES.items():
        assert getattr(engine_mod, attr) is getattr(impl, n), n


def test_kvtop_pure_python_forces_the_python_loops():
    code = ("from kvtop.sim import _pool, engine; "
            "print(_pool.IMPL, engine._fill is _pool.PY.fill, engine._evict_claim is _pool.PY.evict_claim)")
    env = dict(os.environ, KVTOP_PURE_PYTHON="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.stdout.split() == ["python", "True", "True"]


def test_the_extensions_are_built_where_a_compiler_is():
    """A CI machine has gcc and the Python headers: there the install must have built the C
    loops (setup.py: this one and the router prefix index's), else the comparisons with the
    Python loops would skip without anyone noticing."""
    headers = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc:   # one that runs (CC=/bin/false: the install had no compiler, as it was told)
        cc = subprocess.run([cc, "--version"], capture_output=True).returncode == 0
    if not (headers and cc):
        pytest.skip("no C compiler or no Python headers here: the fallback is what runs")
    assert _pool.C is not None, ("kvtop/sim/_blockpool.c is not built: run "
                                 "`pip install -e .` again (it builds the optional extension)")
    try:
        from router import _index_loops  # noqa: F401
    except ImportError:
        pytest.fail("router/_index_loops.c is not built: run `pip install -e .` again")


# ------------------------------------------------------------------ function by function

def both(name, *args):
    """Call C's and Python's ``name`` on copies of ``args``; return (result or exception type,
    the arguments after) for each."""
    out = []
    for impl in (_pool.C, _pool.PY):
        copies = [a.copy() if isinstance(a, (list, dict, set)) else a for a in args]
        try:
            res = getattr(impl, name)(*copies)
        except Exception as exc:   # the same exception type from both
            res = type(exc)
        out.append((res, copies))
    return out


@needs_c
@pytest.mark.parametrize("seed", range(40))
def test_each_function_matches_its_python_loop(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    ref = [rng.choice([1, 1, 2, 3, -rng.randint(1, 9)]) for _ in range(n)]
    idx = [rng.randrange(-n, n) for _ in range(rng.randint(0, 30))]   # negative: from the end
    bad = idx + [n]                                                     # one past the end
    block_hash = [rng.choice([None, rng.randint(0, 10**6)]) for _ in range(n)]
    cached = {h: b for b, h in enumerate(block_hash) if h is not None}
    for args in ((ref, idx), (ref, tuple(idx)), (ref, bad), (ref, ["x"])):
        a, b = both("gather", *args)
        assert a == b
    for name, extra in (("fill", (-7,)), ("incr", ()),
                        # shared=0 promises every held entry is 1 (the engine's invariant)
                        ("count_free", (int(max(ref) > 1) or rng.randint(0, 1),)),
                        ("select_equal", (1,))):
        for index in (idx, tuple(idx), bad):
            a, b = both(name, ref, index, *extra)
            assert a == b, name
    uniq = rng.sample(range(n), rng.randint(0, n))    # distinct blocks, as the engine's lists are
    held = [b for b in uniq if ref[b] > 0]
    for args in ((held, ref, -42), (held + [n], ref, -42)):
        a, b = both("release", *args)
        assert a == b
    for index in (uniq, uniq + [n]):
        a, b = both("touch", index, ref)
        assert a == b
    stop = set(rng.sample(range(n), rng.randint(0, min(3, n))))
    for start in (0, rng.randint(0, len(uniq))):
        for s in (stop, set(), None):
            a, b = both("evict_claim", uniq, block_hash, cached, ref, 1, s, start)
            assert a == b
    a, b = both("evict_claim", uniq, block_hash, {}, ref, 1, None, 0)   # a hash not cached
    assert a == b
    # registering: new hashes, ones another block holds already, one repeated inside the run
    free = [b for b, h in enumerate(block_hash) if h is None]
    run = [rng.choice([rng.randint(2 * 10**6, 3 * 10**6)] + list(cached)[:3]) for _ in free]
    if len(run) > 2 and rng.random() < 0.3:
        run[-1] = run[0]
    k = rng.randint(0, len(run))
    a, b = both("register", cached, block_hash, run, free, k, rng.randint(k, len(run)))
    assert a == b and list(a[1][0].items()) == list(b[1][0].items())   # the dict's order too
    hashes = [rng.choice(list(cached) + [-1]) if cached else -1 for _ in range(rng.randint(0, 90))]
    for start, limit in ((0, len(hashes)), (rng.randint(0, 5), rng.randint(0, 200))):
        a, b = both("cached_prefix", cached, hashes, start, limit)
        assert a == b
    chain = [h for h in block_hash if h is not None]
    c_blocks = [b for b, h in enumerate(block_hash) if h is not None]
    for _ in range(5):
        want = list(chain)
        if want and rng.random() < 0.5:
            want[rng.randrange(len(want))] = -5
        mine = list(c_blocks)
        if mine and rng.random() < 0.5:
            mine[rng.randrange(len(mine))] = rng.randrange(n)
        a, b = both("chain_prefix", chain, mine, want, rng.randint(0, 2 * n), block_hash)
        assert a == b


def running_requests(rng: random.Random) -> list:
    """Running requests in every state the step's loop meets: decoding, mid-prefill, needing a
    block, with blocks to register, a budget or threshold that cuts them."""
    reqs = []
    for k in range(rng.randint(0, 12)):
        n = rng.randint(1, 10 * BS)
        r = engine_mod._Req(EngineRequest(f"r{k}", n, list(range(n // BS)), 8, 0.0), 0.0)
        r.computed = rng.randint(0, n)
        r.num_tokens = n + rng.choice([0, 0, 1, 3])
        r.output = r.num_tokens - n
        r.blocks = list(range(-(-r.num_tokens // BS) + rng.choice([0, 0, 0, -1, 1])))
        r.registered = rng.choice([len(r.hashes), len(r.hashes), max(0, len(r.hashes) - 1)])
        reqs.append(r)
    return reqs


def request_state(reqs) -> list:
    return [(r.id, r.computed, r.num_tokens, r.output, len(r.blocks), r.registered) for r in reqs]


@needs_c
@pytest.mark.parametrize("seed", range(60))
def test_the_running_loop_matches_its_python_loop(seed):
    rng = random.Random(seed)
    reqs = running_requests(rng)
    budget, threshold, start = rng.choice([1, 7, 64, 2048]), rng.choice([0, None, 16]), rng.randint(0, 2)
    out = []
    for impl in (_pool.C, _pool.PY):
        copies = [engine_mod._Req(EngineRequest(r.id, r.prompt, r.hashes, 8, 0.0), 0.0) for r in reqs]
        for c, r in zip(copies, reqs):
            c.computed, c.num_tokens, c.output, c.blocks, c.registered = \
                r.computed, r.num_tokens, r.output, list(r.blocks), r.registered
        scheduled: list = []
        res = impl.running_plain(copies, start, budget, threshold, BS, scheduled)
        out.append((res, [r.id for r in scheduled], request_state(copies)))
    assert out[0] == out[1]


@needs_c
@pytest.mark.parametrize("seed", range(60))
def test_the_sampling_loop_matches_its_python_loop(seed):
    rng = random.Random(seed)
    reqs = running_requests(rng)
    for r in reqs:   # first tokens, last tokens, mid-prefill chunks
        r.first_token_time = rng.choice([None, 1.0, 2.0])
        r.max_tokens = r.output + rng.choice([1, 2, 5])
        if rng.random() < 0.5:
            r.computed = r.num_tokens
    start = rng.randint(0, 2)
    out = []
    for impl in (_pool.C, _pool.PY):
        copies = [engine_mod._Req(EngineRequest(r.id, r.prompt, r.hashes, 8, 0.0), 0.0) for r in reqs]
        for c, r in zip(copies, reqs):
            c.computed, c.num_tokens, c.output, c.max_tokens, c.first_token_time = \
                r.computed, r.num_tokens, r.output, r.max_tokens, r.first_token_time
        emitted = {"before": 1}
        res = impl.sample_plain(copies, start, emitted)
        out.append((res, list(emitted.items()), request_state(copies)))
    assert out[0] == out[1]


@needs_c
@pytest.mark.parametrize("seed", range(30))
def test_the_decode_stretch_loops_match_their_python_loops(seed):
    rng = random.Random(seed)
    reqs = running_requests(rng)
    for r in reqs:
        r.max_tokens = r.output + rng.randint(1, 9)
    assert _pool.C.decode_room(reqs, BS, 1 << 30) == _pool.PY.decode_room(reqs, BS, 1 << 30)
    u = rng.randint(0, 5)
    out = []
    for impl in (_pool.C, _pool.PY):
        copies = [engine_mod._Req(EngineRequest(r.id, r.prompt, r.hashes, 8, 0.0), 0.0) for r in reqs]
        for c, r in zip(copies, reqs):
            c.computed, c.num_tokens, c.output = r.computed, r.num_tokens, r.output
        emitted = {"before": 1}
        assert impl.advance(copies, u, emitted) is True
        out.append((list(emitted.items()), request_state(copies)))
    assert out[0] == out[1]


@needs_c
@pytest.mark.parametrize("seed", range(30))
def test_the_decode_times_match_their_python_loop_bit_for_bit(seed):
    rng = random.Random(seed)
    p = engine_mod.get_profile(rng.choice(["h20", "cpu-tiny", "h100"]))
    num = rng.randint(1, 300)
    t = rng.uniform(0.0, 1e5)
    args = (p.decode_base(num), p.kappa, rng.randint(num, 200_000 * num), num, rng.randint(0, 70), t,
            rng.uniform(0.0, 1e5), rng.choice([float("inf"), t, t + rng.uniform(0.0, 0.5), float("nan")]))
    c, py = _pool.C.decode_times(*args), _pool.PY.decode_times(*args)
    assert c == py and all(len(x) == len(c[0]) for x in c)
    if args[4] and args[7] == float("inf"):
        assert len(c[0]) == args[4]
        # what step() computes for the same steps, one by one
        assert c[1][0] == t + p.step_time(num, num, 0, args[2], 0)


@needs_c
@pytest.mark.parametrize("seed", range(40))
def test_the_decode_plan_matches_its_python_loop(seed):
    rng = random.Random(seed)
    reqs = running_requests(rng)
    for r in reqs:
        r.max_tokens = r.output + rng.randint(1, 300)
    args = (reqs, rng.choice([1, 3, BS]), rng.choice([0, 1, 5, 64, 512]), rng.choice([0, 1, 2, 7, 40, 10_000]))
    plan = _pool.C.decode_plan(*args)
    assert plan == _pool.PY.decode_plan(*args)
    k, steps, index = plan
    # the blocks come by step, then running order, none past k, no more than the free ones
    assert list(zip(steps, index)) == sorted(set(zip(steps, index)))
    assert len(steps) <= args[3] and all(1 <= s <= k for s in steps)
    for i, r in enumerate(reqs):   # each request's blocks: where its context passes a block
        mine = [s for s, j in zip(steps, index) if j == i]
        first = max(1, len(r.blocks) * args[1] - r.computed + 1)
        assert mine == list(range(first, k + 1, args[1]))
    left = min([r.max_tokens - r.output - 1 for r in reqs], default=args[2])
    assert k <= min(args[2], left)
    if k < min(args[2], left):   # cut short by the free blocks: one more step needs more of them
        assert sum(len(range(max(1, len(r.blocks) * args[1] - r.computed + 1), k + 2, args[1]))
                   for r in reqs) > args[3]


@needs_c
def test_the_c_decode_plan_leaves_other_objects_to_python():
    class Other:
        computed, num_tokens, output, blocks, registered, hashes, max_tokens = 0, 5, 0, [0], 0, [], 9
    assert _pool.C.decode_plan([Other()], BS, 10, 100) is None
    assert _pool.C.decode_plan([], 0, 10, 100) is None            # a block size it does not take
    assert _pool.C.decode_plan([], BS, 1 << 40, 100) is None
    assert _pool.C.decode_plan([], BS, 10, 100) == (10, [], [])
    assert _pool.PY.decode_plan([], BS, 10, 100) == (10, [], [])
    pytest.raises(TypeError, _pool.C.decode_plan, [], BS)


@needs_c
def test_the_c_decode_times_leave_other_numbers_to_python():
    assert _pool.C.decode_times(1, 0.5, 10, 1, 3, 0.0, 0.0, 1.0) is None          # an int base
    assert _pool.C.decode_times(1.0, 0.5, 10, 1, 3, 0.0, 0.0, 1) is None          # an int horizon
    assert _pool.C.decode_times(1.0, 0.5, 1 << 60, 1, 3, 0.0, 0.0, 9.0) is None   # past 2**52
    assert _pool.C.decode_times(1.0, 0.5, 10, 1, 1 << 40, 0.0, 0.0, 9.0) is None
    assert _pool.C.decode_times(1.0, 0.5, 10.0, 1, 3, 0.0, 0.0, 9.0) is None      # a float ctx
    assert _pool.PY.decode_times(1, 0.5, 10, 1, 3, 0.0, 0.0, 9.0) == ([0.0, 6.0], [6.0, 12.5], [6.0, 12.5])
    pytest.raises(TypeError, _pool.C.decode_times, 1.0, 0.5)


@needs_c
def test_the_c_running_loop_leaves_other_objects_to_python():
    class Other:
        computed, num_tokens, output, blocks, registered, hashes = 0, 5, 0, [0], 0, []
    scheduled: list = []
    assert _pool.C.running_plain([Other()], 0, 100, None, BS, scheduled) == (0, 100, 0, 0)
    assert scheduled == []
    assert _pool.C.sample_plain([Other()], 0, {}) == (0, 0)
    assert _pool.C.decode_room([Other()], BS, 1 << 30) is None
    emitted: dict = {}
    assert _pool.C.advance([Other()], 1, emitted) is False and emitted == {}


@needs_c
@pytest.mark.parametrize("kw", [{"max_num_batched_tokens": 1 << 70},
                                {"long_prefill_token_threshold": 1 << 70},
                                {"max_num_batched_tokens": 4096.0}])
def test_scalars_the_c_loops_cannot_read_go_to_the_python_loops(kw):
    # Engine() takes them (no bound on its keyword arguments): the C loops must hand them to
    # the Python loops, not raise where the fallback runs.
    def run(impl):
        with using(impl):
            eng = Engine(block_size=BS, **kw)
            for n in range(3):
                eng.add_request(EngineRequest(request_id=f"r{n}", num_prompt_tokens=40 + 30 * n,
                                              max_tokens=6, block_hashes=[], arrival_time=0.0))
            out = [eng.step(k * 0.01, coalesce=True) for k in range(12)]
            return eng.generation_tokens, [(r.emitted, [f.request_id for f in r.finished])
                                           for r in out]
    assert run(_pool.C) == run(_pool.PY)
    assert _pool.C.running_plain([], 0, 1 << 70, None, BS, []) == (0, 1 << 70, 0, 0)
    # a block size near 2**63: rounding the tokens up to blocks must not overflow (a request
    # with no block needs one)
    req = engine_mod._Req.__new__(engine_mod._Req)
    req.computed, req.num_tokens, req.blocks, req.registered, req.hashes, req.output = \
        0, 5, [], 0, (), 0
    for impl in (_pool.C, _pool.PY):
        assert impl.running_plain([req], 0, 100, None, (1 << 63) - 1, []) == (0, 100, 0, 0)
    assert _pool.C.decode_room([], 1 << 70, 1 << 30) is None
    assert _pool.C.advance([], 1 << 70, {}) is False


@needs_c
def test_the_c_loops_refuse_what_the_engine_never_passes():
    assert pytest.raises(TypeError, _pool.C.fill, (1, 2), [0], 1)
    assert pytest.raises(TypeError, _pool.C.evict_claim, [0], [None], [], [0], 1, None, 0)
    assert pytest.raises(TypeError, _pool.C.gather, [1])
    assert pytest.raises(IndexError, _pool.C.gather, [1], [10**30])


# Python code that a C loop runs (an element's __index__, __hash__ or comparison) may change the
# lists it walks: the C loop must hold what it uses and re-read lengths, or it reads freed memory
# (a crash, or garbage). In a child process, so that a crash fails this test, not the run.
HOSTILE_POOL = r"""
import pytest
from kvtop.sim._blockpool import touch, select_equal, gather, release, evict_claim

ref = []
class LessOnce:                 # ``ref[b] < 0`` replaces ref's entries, freeing this one
    def __gt__(self, other):
        return NotImplemented
    def __lt__(self, other):
        ref[:] = [5]
        return True
ref.append(LessOnce())
free, entries = touch([0], ref)
assert free == [0] and type(entries[0]) is LessOnce and ref == [1], (free, entries, ref)

idx = []
class Clears:                   # its __index__ empties the index list that holds it
    def __index__(self):
        idx.clear()
        return 0
idx.append(Clears())
out = select_equal([1], idx, 1)
assert len(out) == 1 and type(out[0]) is Clears, out

idx[:] = [Clears()] + list(range(1000))
with pytest.raises(RuntimeError):
    gather([1], idx)

blocks = []
class ClearsBlocks:
    def __index__(self):
        blocks.clear()
        return 0
blocks.extend([0] * 50 + [ClearsBlocks()])
ref = [3]
assert release(blocks, ref, -1) == [] and ref == [2]   # as reversed() stops: the list is gone

block_hash = []
class Held:
    __hash__ = object.__hash__
class Block(int):               # hashing it (``b in stop``) empties block_hash, freeing a Held
    def __hash__(self):
        block_hash[:] = [None]
        return 1
block_hash.append(Held())
cached = {block_hash[0]: 0}
assert evict_claim([Block(0)], block_hash, cached, [0], -1, {99}, 0) == 1
assert cached == {} and block_hash == [None]
print("ok")
"""


@needs_c
def test_the_c_loops_survive_python_code_that_changes_their_lists():
    out = subprocess.run([sys.executable, "-c", HOSTILE_POOL], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(__file__)), timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stderr[-2000:]


@needs_c
def test_bind_request_is_all_or_nothing():
    # A class that has some of the slots but not all: refused, and the bound class keeps its
    # own offsets (not the refused class's, which would be read off the engine's requests).
    class Partial:
        __slots__ = ("a", "b", "c", "d", "computed", "num_tokens", "blocks", "registered",
                     "hashes", "output", "id")
    try:
        with pytest.raises(TypeError):
            _pool.C.bind_request(Partial)
        req = engine_mod._Req.__new__(engine_mod._Req)
        req.computed, req.num_tokens, req.blocks, req.registered = 0, 5, [0], 0
        req.hashes, req.output = (), 0
        scheduled: list = []
        assert _pool.C.running_plain([req], 0, 100, None, BS, scheduled) == (1, 95, 25, 0)
        assert req.computed == 5 and scheduled == [req]
    finally:
        _pool.C.bind_request(engine_mod._Req)


@needs_c
def test_bind_request_takes_only_the_class_own_slots():
    # _Req's member descriptors set on a small class hold _Req's offsets: reading them off that
    # class's objects would read past their end.
    names = ("computed", "num_tokens", "blocks", "registered", "hashes", "output", "id",
             "first_token_time", "max_tokens")
    borrowed = type("Borrowed", (), {"__slots__": (),
                                     **{n: getattr(engine_mod._Req, n) for n in names}})
    try:
        with pytest.raises(TypeError):
            _pool.C.bind_request(borrowed)
    finally:
        _pool.C.bind_request(engine_mod._Req)


# ------------------------------------------------------------------ whole engines

def run_engine(seed: int) -> list:
    """Drive a random engine through a random workload; everything observable after each
    step: the result, the counters, and the pool block by block."""
    rng = random.Random(seed)
    blocks = rng.randint(24, 160)
    priority = rng.random() < 0.3
    e = Engine("h20", block_size=BS, num_gpu_blocks=blocks,
               max_num_batched_tokens=rng.choice([32, 128, 2048]), max_num_seqs=rng.randint(1, 6),
               scheduling_policy="priority" if priority else "fcfs",
               kv_pin_ttl_s=rng.choice([0.0, 0.0, 0.5, 3.0]),
               kv_pin_max_share=rng.choice([1.0, 0.3]))
    if rng.random() < 0.3:
        e.kv_events = []
    pending = []
    for t, r in workload(rng, 40, blocks // 2, compaction=rng.choice([0.0, 0.3])):
        if priority:
            r.priority = rng.randint(-2, 2)
        if r.block_hashes and rng.random() < 0.1:   # a decode side pulling the prompt's KV
            r.kv_transfer_params = {"do_remote_prefill": True,
                                    "remote_block_ids": list(range(len(r.block_hashes)))}
        pending.append((t, r))
    seen: list = []
    original_step = e.step

    def step(now, **kw):
        res = original_step(now, coalesce=rng.random() < 0.5)
        seen.append((repr(res), e.num_free_blocks, e.num_pinned_blocks, e.num_preemptions,
                     e.prefix_hits, e.prefix_queries, e.generation_tokens, list(e._ref),
                     list(e._block_hash), dict(e._cached), e._free_queue(), e._hol_touch_free,
                     list(e._hol_hit), list(e.kv_events or ())))
        return res

    e.step = step
    drive(e, rng, pending)
    seen.append((e.num_free_blocks, e.num_allocated_blocks(), dict(e.request_success)))
    return seen


@needs_c
@pytest.mark.parametrize("seed", range(24))
def test_c_and_python_loops_give_the_same_engine(seed):
    with using(_pool.C):
        c = run_engine(seed)
    with using(_pool.PY):
        py = run_engine(seed)
    assert len(c) == len(py)
    for k, (a, b) in enumerate(zip(c, py)):
        assert a == b, f"step {k}"


@pytest.mark.parametrize("seed", range(12))
def test_the_other_implementation_matches_the_block_by_block_pool(seed):
    """tests/test_engine_block_pool.py's shadow pool on the implementation the rest of the
    suite does not run: the Python loops where C is built, else C (when it is)."""
    other = _pool.PY if _pool.IMPL == "c" else _pool.C
    if other is None:
        pytest.skip("only the Python loops exist here, and the rest of the suite runs them")
    rng = random.Random(seed)
    blocks = rng.randint(24, 160)
    with using(other):
        e = Engine("h20", block_size=BS, num_gpu_blocks=blocks,
                   max_num_batched_tokens=rng.choice([32, 128, 2048]),
                   max_num_seqs=rng.randint(1, 6))
        if rng.random() < 0.5:
            e.kv_events = []
        shadowed(e)
        drive(e, rng, list(workload(rng, 40, blocks // 2)))
    assert e.num_free_blocks == blocks and e.num_allocated_blocks() == 0


def test_a_rejected_request_leaves_both_pools_alone():
    for impl in filter(None, (_pool.C, _pool.PY)):
        with using(impl):
            e = Engine("h20", block_size=BS, num_gpu_blocks=8)
            with pytest.raises(EngineRejected):
                e.add_request(EngineRequest("big", 20 * BS, list(range(20)), 1, 0.0))
            assert e.num_free_blocks == 8 and e._free_queue() == list(range(8))
