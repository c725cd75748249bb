"""The prefix index's per-block insert loops exist twice: compiled (router/_index_loops.c, built
by ``pip install`` when it can be) and in Python (router/prefix_index.py, the fallback, forced by
KVTOP_PURE_PYTHON=1). Random inserts through both must leave the same index, order included;
and the per-block reference test of tests/test_prefix_index.py runs on the implementation the
rest of the suite does not use, so that CI exercises both."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import OrderedDict

import pytest

import router.prefix_index as prefix_index
from router.prefix_index import PrefixIndex
from tests.test_prefix_index import test_insert_equals_the_per_block_loop

try:
    from router import _index_loops as C
except ImportError:
    C = None

needs_c = pytest.mark.skipif(C is None, reason="router/_index_loops.c is not built here (no C "
                             "compiler at install time): only the Python loops run")


def call(loops, fn, *args):
    """``fn(*args)`` with the prefix index on ``loops`` (the C module, or None: Python)."""
    saved = prefix_index._loops
    prefix_index._loops = loops
    try:
        return fn(*args)
    finally:
        prefix_index._loops = saved


def state(idx) -> tuple:
    idx.flush()
    return ([list(lru) for lru in idx._lru], list(idx._owners.items()), list(idx._tags.items()),
            list(idx.evictions))


@needs_c
@pytest.mark.parametrize("seed", range(8))
def test_c_and_python_loops_leave_the_same_index(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 4)
    caps = [rng.randint(3, 90) for _ in range(n)]
    c_idx, py_idx = PrefixIndex(n, caps, 16), PrefixIndex(n, caps, 16)
    trunk = [rng.getrandbits(62) for _ in range(30)]
    chains = [trunk[:rng.randint(0, 30)] + [rng.getrandbits(62) for _ in range(rng.randint(1, 70))]
              for _ in range(8)]
    for step in range(400):
        chain = rng.choice(chains)
        blocks = chain[:rng.randint(0, len(chain))]
        if step % 7 == 0 and blocks:  # not a chain: a repeat and a foreign hash
            blocks = blocks + [rng.choice(blocks), rng.getrandbits(62)] + blocks[:3]
        if step % 5 == 0:
            blocks = tuple(blocks)
        inst, tag = rng.randrange(n), rng.choice([None, "a", "b"])
        k, count, piece = rng.randrange(n), rng.randint(0, 90), rng.choice([4, 16])
        for loops, idx in ((C, c_idx), (None, py_idx)):
            call(loops, idx.insert, inst, blocks, tag)
            if step % 13 == 0:
                call(loops, idx.flush_step, piece)
            if step % 97 == 0:
                call(loops, idx.forget_instance, k)
        assert call(C, c_idx.oldest_tags, k, count) == call(None, py_idx.oldest_tags, k, count)
        assert call(C, state, c_idx) == call(None, state, py_idx)
        assert call(C, c_idx.match, chain) == call(None, py_idx.match, chain)


@pytest.mark.parametrize("seed", range(3))
def test_the_other_implementation_matches_the_per_block_loop(seed, monkeypatch):
    """tests/test_prefix_index.py's per-block reference, on the loops the rest of the suite does
    not run: Python where C is built, else C (when it is)."""
    other = None if prefix_index._loops is not None else C
    if other is None and prefix_index._loops is None:
        pytest.skip("only the Python loops exist here, and the rest of the suite runs them")
    monkeypatch.setattr(prefix_index, "_loops", other)
    test_insert_equals_the_per_block_loop(seed)


def test_kvtop_pure_python_forces_the_python_loops():
    code = "import router.prefix_index as p; print(p._loops is None)"
    env = dict(os.environ, KVTOP_PURE_PYTHON="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.stdout.split() == ["True"]


@needs_c
def test_the_c_loops_refuse_what_the_index_never_passes():
    with pytest.raises(TypeError):
        C.add([], {}, [1], 0, 1)
    with pytest.raises(KeyError):   # as ``del lru[old]`` does for a block it does not hold
        C.evict({}, {}, {}, [5], -2)
    with pytest.raises(TypeError):  # the LRU is a plain dict (insertion order) since issue 37
        C.touch(OrderedDict(), {}, [1], 1, 1)
    with pytest.raises(TypeError):  # (its dict.setdefault would leave an OrderedDict's links behind)
        C.add(OrderedDict(), {}, [1], 0, 1)


def _move_to_end_each(lru, owners, blocks, bit):
    """The touch's reference: each block moved to the newest end in turn, an absent one added."""
    for h in blocks:
        if h in lru:
            del lru[h]
        else:
            owners[h] = owners.get(h, 0) | bit
        lru[h] = None


@pytest.mark.parametrize("seed", range(6))
def test_touch_moves_each_block_to_the_newest_end_in_turn(seed):
    """The touch in C (``touch``) and in Python (``_touch``, in C-level passes that stop at an
    absent or repeated block) against moving each block in turn: held, absent and repeated
    blocks in any order leave the same LRU order and owner bits."""
    rng = random.Random(seed)
    for _ in range(200):
        held = rng.sample(range(40), rng.randint(0, 30))
        lru = dict.fromkeys(held)
        owners = {h: rng.choice([1, 2, 3]) for h in held}
        blocks = [rng.choice(held) if held and rng.random() < 0.8 else rng.randrange(40, 50)
                  for _ in range(rng.randint(0, 25))]
        want_lru, want_owners = dict(lru), dict(owners)
        _move_to_end_each(want_lru, want_owners, blocks[::-1], 4)
        got_lru, got_owners = dict(lru), dict(owners)
        prefix_index._touch(got_lru, got_owners, blocks[::-1], 4)
        assert (list(got_lru), got_owners) == (list(want_lru), want_owners)
        if C is not None:
            c_lru, c_owners = dict(lru), dict(owners)
            C.touch(c_lru, c_owners, blocks, len(blocks), 4)
            assert (list(c_lru), c_owners) == (list(want_lru), want_owners)


# Python code that a C loop runs (a key's __hash__) may change the list it walks: the loop must
# hold each key it uses and re-read the length, or it reads freed memory. In a child process, so
# that a crash fails this test, not the run.
HOSTILE_INDEX = r"""
from collections import OrderedDict
import pytest
from router._index_loops import add, evict, touch

blocks = []
class Clears:                   # hashing it empties the list that holds it
    def __hash__(self):
        blocks.clear()
        return 7
blocks.extend([1, 2, 3, Clears()])
lru, owners = {}, {}
with pytest.raises(RuntimeError):
    add(lru, owners, blocks, 0, 1)
assert len(lru) == 1 and list(owners.values()) == [1]

olds = []
class ClearsOlds:
    def __hash__(self):
        olds.clear()
        return 8
key = ClearsOlds()
lru, owners, tags = OrderedDict([(key, None), (1, None)]), {key: 3}, {key: "t"}
olds.extend([key, 1])
del key
evict(lru, owners, tags, olds, ~1)   # stops where olds ends: after the first
assert list(lru) == [1] and list(owners.values()) == [2] and list(tags.values()) == ["t"]

blocks = []
blocks.extend([1, 2, 3, Clears()])
lru, owners = {}, {}
with pytest.raises(RuntimeError):   # the walk from the last block stops once the list is empty
    touch(lru, owners, blocks, 4, 1)
assert len(lru) == 1 and list(owners.values()) == [1]
print("ok")
"""


@needs_c
def test_the_c_loops_survive_python_code_that_changes_their_lists():
    out = subprocess.run([sys.executable, "-c", HOSTILE_INDEX], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(__file__)), timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stderr[-2000:]
