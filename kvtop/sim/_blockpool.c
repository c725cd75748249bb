/* The simulated engine's inner loops in C: kvtop/sim/engine.py's block pool, per block, and its
 * step's running, sampling and coalescing loops, per request, and the coalesced decode steps'
 * float sums.
 *
 * Optional: setup.py builds it with optional=True, so an install without a compiler still
 * works; kvtop/sim/_pool.py falls back to the same loops in Python (KVTOP_PURE_PYTHON=1 forces
 * that), and tests/test_engine_cpool.py runs random workloads through both and compares them.
 *
 * Every function works on the engine's own Python lists, dicts and request objects (the
 * refcount list, the block -> hash list, the hash -> block dict, _Req's slots), with the
 * semantics of the Python loop it replaces: the same list indexing (a negative index counts
 * from the end, one past the end raises IndexError), the same comparisons (identity, then ==),
 * the same dict operations in the same order. What it saves is the interpreter's cost per
 * element, not any data structure.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

/* ``lst[o]``'s position, as list indexing takes an int; -1 with an exception set if none. */
static inline Py_ssize_t
position(PyObject *lst, PyObject *o)
{
    Py_ssize_t i = PyLong_AsSsize_t(o);
    if (i == -1 && PyErr_Occurred()) {
        if (!PyLong_Check(o)) {
            PyErr_Clear();
            i = PyNumber_AsSsize_t(o, PyExc_IndexError);
            if (i == -1 && PyErr_Occurred())
                return -1;
        }
        else {
            PyErr_SetString(PyExc_IndexError, "list index out of range");
            return -1;
        }
    }
    Py_ssize_t n = PyList_GET_SIZE(lst);
    if (i < 0)
        i += n;
    if (i < 0 || i >= n) {
        PyErr_SetString(PyExc_IndexError, "list index out of range");
        return -1;
    }
    return i;
}

/* ``lst[i] = v`` (a new reference to v is taken). */
static inline void
store(PyObject *lst, Py_ssize_t i, PyObject *v)
{
    PyObject *old = PyList_GET_ITEM(lst, i);
    Py_INCREF(v);
    PyList_SET_ITEM(lst, i, v);
    Py_DECREF(old);
}

static int
need_list(PyObject *o, const char *what)
{
    if (!PyList_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be a list, not %.100s", what, Py_TYPE(o)->tp_name);
        return -1;
    }
    return 0;
}

#define SEQ(var, obj)                                                           \
    PyObject *var = PySequence_Fast((obj), "expected a list or tuple");        \
    if (var == NULL)                                                            \
        return NULL;

/* The loops below hold their own reference to each element they work on, and re-read the
 * lengths of the lists they walk at each step: an element's __index__, __hash__, __eq__ or
 * arithmetic, or a __del__ run by a value they replace, is Python code that may change those
 * lists (a borrowed element could be freed under them, a length read once could run past the
 * end). Such a change mid-call is an error where the Python loop takes a snapshot first. */
static int
changed(void)
{
    PyErr_SetString(PyExc_RuntimeError, "a list changed size during the loop");
    return -1;
}

/* gather(values, index) -> tuple(values[i] for i in index) */
static PyObject *
gather(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "gather(values, index)");
        return NULL;
    }
    PyObject *values = args[0];
    if (need_list(values, "values"))
        return NULL;
    SEQ(index, args[1]);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(index);
    PyObject *out = PyTuple_New(n);
    if (out == NULL)
        goto fail;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (k >= PySequence_Fast_GET_SIZE(index)) {
            changed();
            goto fail;
        }
        PyObject *o = PySequence_Fast_GET_ITEM(index, k);
        Py_INCREF(o);
        Py_ssize_t i = position(values, o);
        Py_DECREF(o);
        if (i < 0)
            goto fail;
        PyObject *v = PyList_GET_ITEM(values, i);
        Py_INCREF(v);
        PyTuple_SET_ITEM(out, k, v);
    }
    Py_DECREF(index);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(index);
    return NULL;
}

/* fill(lst, index, value): ``for i in index: lst[i] = value`` */
static PyObject *
fill(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "fill(lst, index, value)");
        return NULL;
    }
    PyObject *lst = args[0], *value = args[2];
    if (need_list(lst, "lst"))
        return NULL;
    SEQ(index, args[1]);
    for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(index); k++) {
        PyObject *o = PySequence_Fast_GET_ITEM(index, k);
        Py_INCREF(o);
        Py_ssize_t i = position(lst, o);
        Py_DECREF(o);
        if (i < 0) {
            Py_DECREF(index);
            return NULL;
        }
        store(lst, i, value);
    }
    Py_DECREF(index);
    Py_RETURN_NONE;
}

/* register(cached, block_hash, hashes, blocks, k, upto)
 *
 * ``_register``'s loop: for each idx in range(k, upto) whose hash is not in ``cached``,
 * ``cached[hashes[idx]] = blocks[idx]`` and ``block_hash[blocks[idx]] = hashes[idx]``; one
 * dict probe a block (``setdefault``, told apart from a hit by the dict's growth). */
static PyObject *
register_(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "register(cached, block_hash, hashes, blocks, k, upto)");
        return NULL;
    }
    PyObject *cached = args[0], *block_hash = args[1];
    if (!PyDict_Check(cached)) {
        PyErr_SetString(PyExc_TypeError, "cached must be a dict");
        return NULL;
    }
    if (need_list(block_hash, "block_hash"))
        return NULL;
    Py_ssize_t k = PyLong_AsSsize_t(args[4]);
    if (k == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t upto = PyLong_AsSsize_t(args[5]);
    if (upto == -1 && PyErr_Occurred())
        return NULL;
    SEQ(hashes, args[2]);
    PyObject *blocks = PySequence_Fast(args[3], "expected a list or tuple");
    if (blocks == NULL) {
        Py_DECREF(hashes);
        return NULL;
    }
    if (k < 0)
        k = 0;
    if (upto > PySequence_Fast_GET_SIZE(hashes) || upto > PySequence_Fast_GET_SIZE(blocks)) {
        PyErr_SetString(PyExc_IndexError, "list index out of range");
        goto fail;
    }
    for (Py_ssize_t idx = k; idx < upto; idx++) {
        if (upto > PySequence_Fast_GET_SIZE(hashes) || upto > PySequence_Fast_GET_SIZE(blocks)) {
            changed();
            goto fail;
        }
        PyObject *h = PySequence_Fast_GET_ITEM(hashes, idx);
        PyObject *b = PySequence_Fast_GET_ITEM(blocks, idx);
        Py_INCREF(h);
        Py_INCREF(b);
        Py_ssize_t before = PyDict_GET_SIZE(cached);
        Py_ssize_t i = 0;
        if (PyDict_SetDefault(cached, h, b) == NULL)
            i = -1;
        else if (PyDict_GET_SIZE(cached) != before) {   /* else another block holds this content */
            i = position(block_hash, b);
            if (i >= 0)
                store(block_hash, i, h);
        }
        Py_DECREF(h);
        Py_DECREF(b);
        if (i < 0)
            goto fail;
    }
    Py_DECREF(hashes);
    Py_DECREF(blocks);
    Py_RETURN_NONE;
fail:
    Py_DECREF(hashes);
    Py_DECREF(blocks);
    return NULL;
}

/* incr(lst, index): ``for i in index: lst[i] += 1`` */
static PyObject *
incr(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "incr(lst, index)");
        return NULL;
    }
    PyObject *lst = args[0];
    if (need_list(lst, "lst"))
        return NULL;
    SEQ(index, args[1]);
    PyObject *one = PyLong_FromLong(1);
    for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(index); k++) {
        PyObject *o = PySequence_Fast_GET_ITEM(index, k);
        Py_INCREF(o);
        Py_ssize_t i = position(lst, o);
        Py_DECREF(o);
        if (i < 0)
            goto fail;
        PyObject *r = PyList_GET_ITEM(lst, i);
        Py_INCREF(r);
        PyObject *v = PyNumber_InPlaceAdd(r, one);
        Py_DECREF(r);
        if (v == NULL)
            goto fail;
        if (i >= PyList_GET_SIZE(lst)) {   /* the addition ran code that shrank the list */
            Py_DECREF(v);
            PyErr_SetString(PyExc_IndexError, "list assignment index out of range");
            goto fail;
        }
        store(lst, i, v);
        Py_DECREF(v);
    }
    Py_DECREF(one);
    Py_DECREF(index);
    Py_RETURN_NONE;
fail:
    Py_DECREF(one);
    Py_DECREF(index);
    return NULL;
}

/* ``0 > v`` for an int v (1, 0, or -1 with an exception set). */
static inline int
is_negative(PyObject *v, PyObject *zero)
{
    if (PyLong_CheckExact(v)) {
        int overflow;
        long x = PyLong_AsLongAndOverflow(v, &overflow);
        if (x == -1 && !overflow && PyErr_Occurred())
            return -1;
        return overflow ? overflow < 0 : x < 0;
    }
    return PyObject_RichCompareBool(zero, v, Py_GT);
}

/* count_free(ref, index, shared) -> sum(1 for i in index if ref[i] < 0)
 * (``shared`` only lets the Python loop count cheaper; the answer is the same) */
static PyObject *
count_free(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "count_free(ref, index, shared)");
        return NULL;
    }
    PyObject *lst = args[0];
    if (need_list(lst, "lst"))
        return NULL;
    SEQ(index, args[1]);
    PyObject *zero = PyLong_FromLong(0);
    Py_ssize_t count = 0;
    for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(index); k++) {
        PyObject *o = PySequence_Fast_GET_ITEM(index, k);
        Py_INCREF(o);
        Py_ssize_t i = position(lst, o);
        Py_DECREF(o);
        if (i < 0)
            goto fail;
        PyObject *r = PyList_GET_ITEM(lst, i);
        Py_INCREF(r);
        int neg = is_negative(r, zero);
        Py_DECREF(r);
        if (neg < 0)
            goto fail;
        count += neg;
    }
    Py_DECREF(zero);
    Py_DECREF(index);
    return PyLong_FromSsize_t(count);
fail:
    Py_DECREF(zero);
    Py_DECREF(index);
    return NULL;
}

/* select_equal(lst, index, value) -> [i for i in index if lst[i] == value] */
static PyObject *
select_equal(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "select_equal(lst, index, value)");
        return NULL;
    }
    PyObject *lst = args[0], *value = args[2];
    if (need_list(lst, "lst"))
        return NULL;
    SEQ(index, args[1]);
    PyObject *out = PyList_New(0);
    if (out == NULL)
        goto fail;
    for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(index); k++) {
        PyObject *o = PySequence_Fast_GET_ITEM(index, k);
        Py_INCREF(o);
        Py_ssize_t i = position(lst, o);
        int eq = -1;
        if (i >= 0) {
            PyObject *r = PyList_GET_ITEM(lst, i);
            Py_INCREF(r);
            eq = PyObject_RichCompareBool(r, value, Py_EQ);
            Py_DECREF(r);
            if (eq > 0 && PyList_Append(out, o) < 0)
                eq = -1;
        }
        Py_DECREF(o);
        if (eq < 0)
            goto fail;
    }
    Py_DECREF(index);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(index);
    return NULL;
}

/* evict_claim(taken, block_hash, cached, ref, value, stop, start) -> position
 *
 * ``_allocate``'s loop over the blocks it took from the free queue, from ``taken[start]`` on:
 * a block that holds a hash loses it (``del cached[h]``, ``block_hash[b] = None``), and every
 * block's refcount entry becomes ``value``. It stops before a block that holds a hash and is in
 * the set ``stop`` (the head-of-line memo's blocks, which the caller handles itself), and
 * returns that block's position, else ``len(taken)``. ``stop`` may be None. */
static PyObject *
evict_claim(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "evict_claim(taken, block_hash, cached, ref, value, stop, start)");
        return NULL;
    }
    PyObject *block_hash = args[1], *cached = args[2], *ref = args[3], *value = args[4];
    PyObject *stop = args[5];
    if (need_list(block_hash, "block_hash") || need_list(ref, "ref"))
        return NULL;
    if (!PyDict_Check(cached)) {
        PyErr_SetString(PyExc_TypeError, "cached must be a dict");
        return NULL;
    }
    if (stop == Py_None || (PyAnySet_Check(stop) && PySet_GET_SIZE(stop) == 0))
        stop = NULL;
    else if (!PyAnySet_Check(stop)) {
        PyErr_SetString(PyExc_TypeError, "stop must be a set or None");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[6]);
    if (start == -1 && PyErr_Occurred())
        return NULL;
    SEQ(taken, args[0]);
    Py_ssize_t k = start < 0 ? 0 : start;
    PyObject *b;
    for (; k < PySequence_Fast_GET_SIZE(taken); k++) {
        b = PySequence_Fast_GET_ITEM(taken, k);
        Py_INCREF(b);
        Py_ssize_t i = position(block_hash, b);
        if (i < 0)
            goto fail_b;
        PyObject *h = PyList_GET_ITEM(block_hash, i);
        if (h != Py_None) {
            Py_INCREF(h);
            if (stop != NULL) {
                int in = PySet_Contains(stop, b);
                if (in) {
                    Py_DECREF(h);
                    Py_DECREF(b);
                    if (in < 0)
                        goto fail;
                    break;
                }
            }
            int rc = PyDict_DelItem(cached, h);
            Py_DECREF(h);
            if (rc < 0)
                goto fail_b;
            if (i >= PyList_GET_SIZE(block_hash)) {
                PyErr_SetString(PyExc_IndexError, "list assignment index out of range");
                goto fail_b;
            }
            store(block_hash, i, Py_None);
        }
        Py_ssize_t j = position(ref, b);
        Py_DECREF(b);
        if (j < 0)
            goto fail;
        store(ref, j, value);
    }
    Py_DECREF(taken);
    return PyLong_FromSsize_t(k);
fail_b:
    Py_DECREF(b);
fail:
    Py_DECREF(taken);
    return NULL;
}

/* release(blocks, ref, value) -> q
 *
 * ``_free_blocks``' general loop: for each block, last first, the refcount goes down by one;
 * a block left with none gets ``value`` (its free run's entry) and is appended to q. */
static PyObject *
release(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "release(blocks, ref, value)");
        return NULL;
    }
    PyObject *ref = args[1], *value = args[2];
    if (need_list(ref, "ref"))
        return NULL;
    SEQ(blocks, args[0]);
    PyObject *one = PyLong_FromLong(1);
    PyObject *q = PyList_New(0);
    if (q == NULL)
        goto fail;
    /* (last first, as reversed() does: it stops where the list has shrunk below it) */
    for (Py_ssize_t k = PySequence_Fast_GET_SIZE(blocks) - 1;
            k >= 0 && k < PySequence_Fast_GET_SIZE(blocks); k--) {
        PyObject *b = PySequence_Fast_GET_ITEM(blocks, k);
        Py_INCREF(b);
        Py_ssize_t i = position(ref, b);
        int rc = -1;
        if (i >= 0) {
            PyObject *cur = PyList_GET_ITEM(ref, i);
            Py_INCREF(cur);
            PyObject *r = PyNumber_Subtract(cur, one);
            Py_DECREF(cur);
            if (r != NULL) {
                int zero = PyObject_Not(r);
                if (zero >= 0 && i >= PyList_GET_SIZE(ref))
                    PyErr_SetString(PyExc_IndexError, "list assignment index out of range");
                else if (zero > 0) {
                    store(ref, i, value);
                    rc = PyList_Append(q, b);
                }
                else if (zero == 0) {
                    store(ref, i, r);
                    rc = 0;
                }
                Py_DECREF(r);
            }
        }
        Py_DECREF(b);
        if (rc < 0)
            goto fail;
    }
    Py_DECREF(one);
    Py_DECREF(blocks);
    return q;
fail:
    Py_DECREF(one);
    Py_XDECREF(q);
    Py_DECREF(blocks);
    return NULL;
}

/* touch(hit, ref) -> (free, entries)
 *
 * ``_touch``'s general loop: a held block's refcount goes up by one; a free one (a negative
 * entry, its run's id negated) becomes held by one. Returns the free ones taken and their
 * former entries, in order, for the caller's per-run bookkeeping. */
static PyObject *
touch(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "touch(hit, ref)");
        return NULL;
    }
    PyObject *ref = args[1];
    if (need_list(ref, "ref"))
        return NULL;
    SEQ(hit, args[0]);
    PyObject *one = PyLong_FromLong(1), *zero = PyLong_FromLong(0);
    PyObject *free = PyList_New(0), *entries = PyList_New(0);
    if (free == NULL || entries == NULL)
        goto fail;
    for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(hit); k++) {
        PyObject *b = PySequence_Fast_GET_ITEM(hit, k), *r = NULL;
        Py_INCREF(b);
        Py_ssize_t i = position(ref, b);
        int rc = -1;
        if (i >= 0) {
            r = PyList_GET_ITEM(ref, i);
            Py_INCREF(r);
            int neg = is_negative(r, zero);
            if (neg > 0) {
                if (i >= PyList_GET_SIZE(ref))
                    PyErr_SetString(PyExc_IndexError, "list assignment index out of range");
                else if (PyList_Append(free, b) == 0 && PyList_Append(entries, r) == 0) {
                    store(ref, i, one);
                    rc = 0;
                }
            }
            else if (neg == 0) {
                PyObject *v = PyNumber_Add(r, one);
                if (v != NULL) {
                    if (i >= PyList_GET_SIZE(ref))
                        PyErr_SetString(PyExc_IndexError, "list assignment index out of range");
                    else {
                        store(ref, i, v);
                        rc = 0;
                    }
                    Py_DECREF(v);
                }
            }
        }
        Py_XDECREF(r);
        Py_DECREF(b);
        if (rc < 0)
            goto fail;
    }
    Py_DECREF(one);
    Py_DECREF(zero);
    Py_DECREF(hit);
    PyObject *out = PyTuple_Pack(2, free, entries);
    Py_DECREF(free);
    Py_DECREF(entries);
    return out;
fail:
    Py_DECREF(one);
    Py_DECREF(zero);
    Py_XDECREF(free);
    Py_XDECREF(entries);
    Py_DECREF(hit);
    return NULL;
}

/* cached_prefix(cached, hashes, start, limit) -> list
 *
 * ``[cached[h] for h in hashes[start:limit]]`` up to the first hash not in the dict. */
static PyObject *
cached_prefix(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "cached_prefix(cached, hashes, start, limit)");
        return NULL;
    }
    PyObject *cached = args[0];
    if (!PyDict_Check(cached)) {
        PyErr_SetString(PyExc_TypeError, "cached must be a dict");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[2]);
    if (start == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t limit = PyLong_AsSsize_t(args[3]);
    if (limit == -1 && PyErr_Occurred())
        return NULL;
    SEQ(hashes, args[1]);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    if (limit > n)
        limit = n;
    if (start < 0)
        start = 0;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        goto fail;
    for (Py_ssize_t k = start; k < limit; k++) {
        if (k >= PySequence_Fast_GET_SIZE(hashes)) {
            changed();
            goto fail;
        }
        PyObject *h = PySequence_Fast_GET_ITEM(hashes, k);
        Py_INCREF(h);
        PyObject *b = PyDict_GetItemWithError(cached, h);   /* borrowed */
        Py_DECREF(h);
        if (b == NULL) {
            if (PyErr_Occurred())
                goto fail;
            break;
        }
        if (PyList_Append(out, b) < 0)
            goto fail;
    }
    Py_DECREF(hashes);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(hashes);
    return NULL;
}

/* chain_prefix(c_hashes, c_blocks, hashes, limit, block_hash) -> list
 *
 * ``c_blocks[:j]``: j is the first position below ``min(limit, len(c_hashes), len(c_blocks),
 * len(hashes))`` where ``c_hashes[j] != hashes[j]`` or ``block_hash[c_blocks[j]] != hashes[j]``
 * (engine.py's ``_chain_prefix``). */
static PyObject *
chain_prefix(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "chain_prefix(c_hashes, c_blocks, hashes, limit, block_hash)");
        return NULL;
    }
    PyObject *block_hash = args[4];
    if (need_list(block_hash, "block_hash"))
        return NULL;
    Py_ssize_t limit = PyLong_AsSsize_t(args[3]);
    if (limit == -1 && PyErr_Occurred())
        return NULL;
    PyObject *c_hashes = NULL, *c_blocks = NULL, *hashes = NULL, *out = NULL;
    c_hashes = PySequence_Fast(args[0], "expected a list or tuple");
    if (c_hashes == NULL)
        goto done;
    c_blocks = PySequence_Fast(args[1], "expected a list or tuple");
    if (c_blocks == NULL)
        goto done;
    hashes = PySequence_Fast(args[2], "expected a list or tuple");
    if (hashes == NULL)
        goto done;
    Py_ssize_t m = limit;
    if (PySequence_Fast_GET_SIZE(c_hashes) < m)
        m = PySequence_Fast_GET_SIZE(c_hashes);
    if (PySequence_Fast_GET_SIZE(c_blocks) < m)
        m = PySequence_Fast_GET_SIZE(c_blocks);
    if (PySequence_Fast_GET_SIZE(hashes) < m)
        m = PySequence_Fast_GET_SIZE(hashes);
    Py_ssize_t j = 0;
    for (; j < m; j++) {
        if (j >= PySequence_Fast_GET_SIZE(c_hashes) || j >= PySequence_Fast_GET_SIZE(c_blocks)
                || j >= PySequence_Fast_GET_SIZE(hashes)) {
            changed();
            goto done;
        }
        PyObject *h = PySequence_Fast_GET_ITEM(hashes, j);
        PyObject *ch = PySequence_Fast_GET_ITEM(c_hashes, j);
        PyObject *cb = PySequence_Fast_GET_ITEM(c_blocks, j);
        Py_INCREF(h);
        Py_INCREF(ch);
        Py_INCREF(cb);
        int eq = PyObject_RichCompareBool(ch, h, Py_EQ);
        if (eq > 0) {
            Py_ssize_t i = position(block_hash, cb);
            if (i < 0)
                eq = -1;
            else {
                PyObject *held = PyList_GET_ITEM(block_hash, i);
                Py_INCREF(held);
                eq = PyObject_RichCompareBool(held, h, Py_EQ);
                Py_DECREF(held);
            }
        }
        Py_DECREF(h);
        Py_DECREF(ch);
        Py_DECREF(cb);
        if (eq < 0)
            goto done;
        if (!eq)
            break;
    }
    if (j > PySequence_Fast_GET_SIZE(c_blocks)) {
        changed();
        goto done;
    }
    out = PyList_New(j);
    if (out == NULL)
        goto done;
    for (Py_ssize_t k = 0; k < j; k++) {
        PyObject *b = PySequence_Fast_GET_ITEM(c_blocks, k);
        Py_INCREF(b);
        PyList_SET_ITEM(out, k, b);
    }
done:
    Py_XDECREF(c_hashes);
    Py_XDECREF(c_blocks);
    Py_XDECREF(hashes);
    return out;
}

/* The engine's request objects (kvtop/sim/engine.py ``_Req``, a class with __slots__): the
 * offsets of the slots the running loop reads, taken from the class's member descriptors by
 * ``bind_request``. ``running_plain`` reads them directly, and leaves any other object (or an
 * unset slot, or a value that is not a plain int) to the Python loop. */
static PyTypeObject *req_type = NULL;
static Py_ssize_t off_computed, off_num_tokens, off_blocks, off_registered, off_hashes, off_output;
static Py_ssize_t off_id, off_first_token_time, off_max_tokens;

static int
slot_offset(PyTypeObject *t, const char *name, Py_ssize_t *off)
{
    PyObject *d = PyDict_GetItemString(t->tp_dict, name);   /* borrowed */
    /* a slot of this very class (a member descriptor of another class, set as an attribute
     * here, has that class's offsets: past the end of this one's objects) */
    if (d == NULL || !Py_IS_TYPE(d, &PyMemberDescr_Type) || PyDescr_TYPE(d) != t
            || ((PyMemberDescrObject *)d)->d_member->type != T_OBJECT_EX) {
        PyErr_Format(PyExc_TypeError, "%.100s.%s is not a __slots__ member", t->tp_name, name);
        return -1;
    }
    *off = ((PyMemberDescrObject *)d)->d_member->offset;
    return 0;
}

/* bind_request(cls): the request class whose slots running_plain reads */
static PyObject *
bind_request(PyObject *self, PyObject *cls)
{
    if (!PyType_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, "bind_request(cls) takes a class");
        return NULL;
    }
    PyTypeObject *t = (PyTypeObject *)cls;
    /* all of them read first, then set: a class that fails leaves the bound one as it was
     * (its offsets with its type, never another class's) */
    Py_ssize_t c, nt, bl, rg, hs, op, id, ftt, mt;
    if (slot_offset(t, "computed", &c) || slot_offset(t, "num_tokens", &nt)
            || slot_offset(t, "blocks", &bl) || slot_offset(t, "registered", &rg)
            || slot_offset(t, "hashes", &hs) || slot_offset(t, "output", &op)
            || slot_offset(t, "id", &id) || slot_offset(t, "first_token_time", &ftt)
            || slot_offset(t, "max_tokens", &mt))
        return NULL;
    off_computed = c;
    off_num_tokens = nt;
    off_blocks = bl;
    off_registered = rg;
    off_hashes = hs;
    off_output = op;
    off_id = id;
    off_first_token_time = ftt;
    off_max_tokens = mt;
    Py_INCREF(cls);
    Py_XSETREF(req_type, t);
    Py_RETURN_NONE;
}

#define SLOT(obj, off) (*(PyObject **)((char *)(obj) + (off)))

/* A slot's value as a C long long, if it is a plain int that fits; else 0 (no exception). */
static inline int
slot_long(PyObject *v, long long *out)
{
    if (v == NULL || !PyLong_CheckExact(v))
        return 0;
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || (x == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    *out = x;
    return 1;
}

/* running_plain(running, i, budget, threshold, block_size, scheduled)
 *     -> (i, budget, attn_sum, decode_ctx)
 *
 * ``Engine.step``'s loop over its running requests (fcfs), for the requests that need neither a
 * new block nor a registration: each gets ``min(pending, threshold, budget)`` tokens, its
 * ``computed`` goes up by them and it is appended to ``scheduled``. Stops at the first request
 * that needs more (the Python loop handles it) or when the budget is spent; returns where it
 * stopped, the budget left and the attention and decode-context sums it added. */
static PyObject *
running_plain(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "running_plain(running, i, budget, threshold, block_size, scheduled)");
        return NULL;
    }
    PyObject *running = args[0], *scheduled = args[5];
    if (need_list(running, "running") || need_list(scheduled, "scheduled"))
        return NULL;
    Py_ssize_t i = PyLong_AsSsize_t(args[1]);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    long long budget, threshold = 0, bs, attn = 0, ctx = 0;
    /* A budget, threshold or block size that is not a plain int in range (a float, an int past
     * 2**63: the engine's API takes them) is the Python loop's: nothing done here. (A block
     * size past 2**30 would overflow the rounding up below.) */
    if (!slot_long(args[2], &budget) || !slot_long(args[4], &bs) || bs <= 0 || bs > (1LL << 30)
            || (args[3] != Py_None && !slot_long(args[3], &threshold)))
        return Py_BuildValue("nOii", i, args[2], 0, 0);
    while (req_type != NULL && i >= 0 && i < PyList_GET_SIZE(running) && budget > 0) {
        PyObject *req = PyList_GET_ITEM(running, i);
        if (Py_TYPE(req) != req_type)
            break;
        long long computed, num_tokens, registered, output;
        PyObject *blocks = SLOT(req, off_blocks), *hashes = SLOT(req, off_hashes);
        if (!slot_long(SLOT(req, off_computed), &computed)
                || !slot_long(SLOT(req, off_num_tokens), &num_tokens)
                || !slot_long(SLOT(req, off_registered), &registered)
                || !slot_long(SLOT(req, off_output), &output)
                || blocks == NULL || !PyList_CheckExact(blocks) || hashes == NULL
                || !(PyList_CheckExact(hashes) || PyTuple_CheckExact(hashes)))
            break;
        long long num_new = num_tokens - computed;
        if (threshold && num_new > threshold)
            num_new = threshold;
        if (num_new > budget)
            num_new = budget;
        if (num_new <= 0 || computed < 0 || computed > (1LL << 30) || num_new > (1LL << 30))
            break;   /* not the plain case (or sums this loop would not keep exactly) */
        long long upto = computed + num_new;
        if ((upto + bs - 1) / bs > (long long)PyList_GET_SIZE(blocks))
            break;   /* needs a block */
        if (registered < (long long)Py_SIZE(hashes))
            break;   /* has prompt blocks to register */
        long long term = num_new == 1 && output ? computed + 1 : num_new * (2 * computed + num_new);
        if ((num_new == 1 && output ? ctx : attn) > LLONG_MAX - term)
            break;
        PyObject *v = PyLong_FromLongLong(upto);
        if (v == NULL)
            return NULL;
        if (PyList_Append(scheduled, req) < 0) {
            Py_DECREF(v);
            return NULL;
        }
        if (num_new == 1 && output)
            ctx += term;
        else
            attn += term;
        PyObject *old = SLOT(req, off_computed);
        SLOT(req, off_computed) = v;
        Py_XDECREF(old);
        budget -= num_new;
        i++;
    }
    return Py_BuildValue("nLLL", i, budget, attn, ctx);
}

/* ``obj.<slot> = v`` for a slot read by offset (a new reference to v is taken). */
static inline void
set_slot(PyObject *obj, Py_ssize_t off, PyObject *v)
{
    PyObject *old = SLOT(obj, off);
    Py_INCREF(v);
    SLOT(obj, off) = v;
    Py_XDECREF(old);
}

/* sample_plain(scheduled, k, emitted) -> (k, sampled)
 *
 * ``Engine.step``'s sampling loop from ``scheduled[k]`` on, for the requests that neither get
 * their first token nor finish: a request mid-prefill is passed over; one whose tokens are all
 * computed gets one (``output`` and ``num_tokens`` up by one, ``emitted[id] = output``). Stops
 * at the first request that would get its first token or finish (the Python loop handles it),
 * and returns its position and how many tokens were sampled. */
static PyObject *
sample_plain(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "sample_plain(scheduled, k, emitted)");
        return NULL;
    }
    PyObject *scheduled = args[0], *emitted = args[2];
    if (need_list(scheduled, "scheduled"))
        return NULL;
    if (!PyDict_CheckExact(emitted)) {
        PyErr_SetString(PyExc_TypeError, "emitted must be a dict");
        return NULL;
    }
    Py_ssize_t k = PyLong_AsSsize_t(args[1]);
    if (k == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t sampled = 0;
    while (req_type != NULL && k >= 0 && k < PyList_GET_SIZE(scheduled)) {
        PyObject *req = PyList_GET_ITEM(scheduled, k);
        if (Py_TYPE(req) != req_type)
            break;
        long long computed, num_tokens, output, max_tokens;
        PyObject *id = SLOT(req, off_id), *ftt = SLOT(req, off_first_token_time);
        if (!slot_long(SLOT(req, off_computed), &computed)
                || !slot_long(SLOT(req, off_num_tokens), &num_tokens)
                || !slot_long(SLOT(req, off_output), &output)
                || !slot_long(SLOT(req, off_max_tokens), &max_tokens)
                || id == NULL || !PyUnicode_CheckExact(id) || ftt == NULL
                || output >= (1LL << 60) || num_tokens >= (1LL << 60))
            break;
        if (computed < num_tokens) {   /* a non-final prefill chunk */
            k++;
            continue;
        }
        if (ftt == Py_None || output + 1 >= max_tokens)
            break;   /* its first token, or its last */
        PyObject *out = PyLong_FromLongLong(output + 1);
        if (out == NULL)
            return NULL;
        PyObject *nt = PyLong_FromLongLong(num_tokens + 1);
        if (nt == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        set_slot(req, off_output, out);
        set_slot(req, off_num_tokens, nt);
        Py_DECREF(nt);
        int rc = PyDict_SetItem(emitted, id, out);
        Py_DECREF(out);
        if (rc < 0)
            return NULL;
        sampled++;
        k++;
    }
    return Py_BuildValue("nn", k, sampled);
}

/* decode_room(running, block_size, n) -> the least of n and, over the running requests, the
 * decode steps before each needs a block (``len(blocks) * block_size - computed``) and before
 * the one it ends in (``max_tokens - output - 1``); None if a request is not one this loop
 * reads (the Python loop then does it). */
static PyObject *
decode_room(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "decode_room(running, block_size, n)");
        return NULL;
    }
    PyObject *running = args[0];
    if (need_list(running, "running"))
        return NULL;
    long long bs, n;
    if (req_type == NULL || !slot_long(args[1], &bs) || !slot_long(args[2], &n) || bs <= 0
            || bs > (1LL << 30))
        Py_RETURN_NONE;   /* (the Python loop's, as an unreadable request is) */
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(running); k++) {
        PyObject *req = PyList_GET_ITEM(running, k);
        long long computed, output, max_tokens;
        PyObject *blocks;
        if (Py_TYPE(req) != req_type || (blocks = SLOT(req, off_blocks)) == NULL
                || !PyList_CheckExact(blocks) || !slot_long(SLOT(req, off_computed), &computed)
                || !slot_long(SLOT(req, off_output), &output)
                || !slot_long(SLOT(req, off_max_tokens), &max_tokens)
                || computed > (1LL << 60) || computed < -(1LL << 60) || output > (1LL << 60)
                || output < -(1LL << 60) || max_tokens > (1LL << 60) || max_tokens < -(1LL << 60))
            Py_RETURN_NONE;
        long long room = (long long)PyList_GET_SIZE(blocks) * bs - computed;
        long long left = max_tokens - output - 1;
        if (room < n)
            n = room;
        if (left < n)
            n = left;
    }
    return PyLong_FromLongLong(n);
}

/* advance(running, u, emitted) -> bool
 *
 * ``_advance``'s loop: each running request's ``computed``, ``num_tokens`` and ``output`` go up
 * by ``u`` and ``emitted[id] = output``. False, with nothing changed, if a request is not one
 * this loop reads (the Python loop then does it). */
static PyObject *
advance(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "advance(running, u, emitted)");
        return NULL;
    }
    PyObject *running = args[0], *emitted = args[2];
    if (need_list(running, "running"))
        return NULL;
    if (!PyDict_CheckExact(emitted)) {
        PyErr_SetString(PyExc_TypeError, "emitted must be a dict");
        return NULL;
    }
    long long u;
    if (req_type == NULL || !slot_long(args[1], &u) || u > (1LL << 40) || u < -(1LL << 40))
        Py_RETURN_FALSE;   /* (the Python loop's, as an unreadable request is) */
    Py_ssize_t n = PyList_GET_SIZE(running);
    for (Py_ssize_t k = 0; k < n; k++) {   /* all of them readable, or none changed */
        PyObject *req = PyList_GET_ITEM(running, k), *id;
        long long x;
        if (Py_TYPE(req) != req_type || (id = SLOT(req, off_id)) == NULL || !PyUnicode_CheckExact(id)
                || !slot_long(SLOT(req, off_computed), &x) || x > (1LL << 60) || x < -(1LL << 60)
                || !slot_long(SLOT(req, off_num_tokens), &x) || x > (1LL << 60) || x < -(1LL << 60)
                || !slot_long(SLOT(req, off_output), &x) || x > (1LL << 60) || x < -(1LL << 60))
            Py_RETURN_FALSE;
    }
    /* (emitted's old values are dropped here: a __del__ could shorten the list) */
    for (Py_ssize_t k = 0; k < n && k < PyList_GET_SIZE(running); k++) {
        PyObject *req = PyList_GET_ITEM(running, k);
        long long computed = 0, num_tokens = 0, output = 0;   /* read above: they are ints */
        slot_long(SLOT(req, off_computed), &computed);
        slot_long(SLOT(req, off_num_tokens), &num_tokens);
        slot_long(SLOT(req, off_output), &output);
        PyObject *c = PyLong_FromLongLong(computed + u), *t = PyLong_FromLongLong(num_tokens + u);
        PyObject *o = PyLong_FromLongLong(output + u);
        if (c == NULL || t == NULL || o == NULL) {
            Py_XDECREF(c);
            Py_XDECREF(t);
            Py_XDECREF(o);
            return NULL;
        }
        set_slot(req, off_computed, c);
        set_slot(req, off_num_tokens, t);
        set_slot(req, off_output, o);
        Py_DECREF(c);
        Py_DECREF(t);
        int rc = PyDict_SetItem(emitted, SLOT(req, off_id), o);
        Py_DECREF(o);
        if (rc < 0)
            return NULL;
    }
    Py_RETURN_TRUE;
}

/* decode_times(base, kappa, ctx, num, n, t, busy, horizon) -> (starts, ends, busys)
 *
 * ``_coalesce``'s arithmetic: up to ``n`` decode steps, the first starting at ``t``, each
 * lasting ``base + kappa * ctx`` (ctx ``num`` more each step), ending at its start plus that
 * and adding that to ``busy``; only the steps that start before ``horizon``. The same IEEE
 * double operations as the Python loop, in the same order (the product is stored before the
 * sum, so that no compiler fuses them into one rounding). None if an argument is not a float
 * (or an int) this loop reads exactly: the Python loop then does it. */
static PyObject *
decode_times(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "decode_times(base, kappa, ctx, num, n, t, busy, horizon)");
        return NULL;
    }
    long long ctx, num, n;
    if (!PyFloat_CheckExact(args[0]) || !PyFloat_CheckExact(args[1]) || !PyFloat_CheckExact(args[5])
            || !PyFloat_CheckExact(args[6]) || !PyFloat_CheckExact(args[7])
            || !slot_long(args[2], &ctx) || !slot_long(args[3], &num) || !slot_long(args[4], &n)
            || n > (1LL << 20) || num < 0 || num > (1LL << 20) || ctx < 0 || ctx > (1LL << 52)
            || (n > 0 && ctx + num * n > (1LL << 52)))
        Py_RETURN_NONE;   /* (ints past 2**52 convert to a double as Python does, but why risk it) */
    double base = PyFloat_AS_DOUBLE(args[0]), kappa = PyFloat_AS_DOUBLE(args[1]);
    double t = PyFloat_AS_DOUBLE(args[5]), busy = PyFloat_AS_DOUBLE(args[6]);
    double horizon = PyFloat_AS_DOUBLE(args[7]);
    PyObject *starts = PyList_New(0), *ends = PyList_New(0), *busys = PyList_New(0);
    if (starts == NULL || ends == NULL || busys == NULL)
        goto fail;
    for (long long k = 0; k < n && t < horizon; k++) {
        volatile double prod = kappa * (double)ctx;
        double duration = base + prod;
        PyObject *v = PyFloat_FromDouble(t);
        if (v == NULL || PyList_Append(starts, v) < 0) {
            Py_XDECREF(v);
            goto fail;
        }
        Py_DECREF(v);
        t = t + duration;
        v = PyFloat_FromDouble(t);
        if (v == NULL || PyList_Append(ends, v) < 0) {
            Py_XDECREF(v);
            goto fail;
        }
        Py_DECREF(v);
        busy = busy + duration;
        v = PyFloat_FromDouble(busy);
        if (v == NULL || PyList_Append(busys, v) < 0) {
            Py_XDECREF(v);
            goto fail;
        }
        Py_DECREF(v);
        ctx += num;
    }
    PyObject *out = PyTuple_Pack(3, starts, ends, busys);
    Py_DECREF(starts);
    Py_DECREF(ends);
    Py_DECREF(busys);
    return out;
fail:
    Py_XDECREF(starts);
    Py_XDECREF(ends);
    Py_XDECREF(busys);
    return NULL;
}

/* decode_plan(running, block_size, k, free) -> (k, steps, indices)
 *
 * kvtop/sim/_pool.py's decode_plan: the decode steps the running requests can run on, blocks
 * taken on the way (at most k, none that ends a request, at most ``free`` blocks in all), and
 * the blocks they take in ``step()``'s order, by step then by running order: each one's step
 * and the index of its request. None if a request is not one this loop reads or the blocks
 * would be more than it lists (the Python loop then does it). */
typedef struct {
    long long step;
    Py_ssize_t index;
} plan_event;

static int
plan_event_order(const void *a, const void *b)
{
    const plan_event *x = a, *y = b;
    if (x->step != y->step)
        return x->step < y->step ? -1 : 1;
    return x->index < y->index ? -1 : x->index > y->index;
}

static PyObject *
decode_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "decode_plan(running, block_size, k, free)");
        return NULL;
    }
    PyObject *running = args[0];
    if (need_list(running, "running"))
        return NULL;
    long long bs, k, free_blocks;
    if (req_type == NULL || !slot_long(args[1], &bs) || !slot_long(args[2], &k)
            || !slot_long(args[3], &free_blocks) || bs <= 0 || bs > (1LL << 30) || k > (1LL << 20)
            || free_blocks < 0 || free_blocks > (1LL << 40))
        Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(running);
    /* first pass: every request readable, k bounded by the one that ends first */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *req = PyList_GET_ITEM(running, i), *blocks;
        long long computed, output, max_tokens;
        if (Py_TYPE(req) != req_type || (blocks = SLOT(req, off_blocks)) == NULL
                || !PyList_CheckExact(blocks) || !slot_long(SLOT(req, off_computed), &computed)
                || !slot_long(SLOT(req, off_output), &output)
                || !slot_long(SLOT(req, off_max_tokens), &max_tokens)
                || computed > (1LL << 60) || computed < -(1LL << 60) || output > (1LL << 60)
                || output < -(1LL << 60) || max_tokens > (1LL << 60) || max_tokens < -(1LL << 60))
            Py_RETURN_NONE;
        if (max_tokens - output - 1 < k)
            k = max_tokens - output - 1;
    }
    if (k <= 0)
        return Py_BuildValue("(LNN)", k, PyList_New(0), PyList_New(0));
    long long total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {   /* (nothing above ran Python code: the same list) */
        PyObject *req = PyList_GET_ITEM(running, i);
        long long computed = 0;
        slot_long(SLOT(req, off_computed), &computed);
        long long j = (long long)PyList_GET_SIZE(SLOT(req, off_blocks)) * bs - computed + 1;
        if (j < 1)
            j = 1;
        if (j <= k)
            total += (k - j) / bs + 1;
        if (total > (1LL << 22))
            Py_RETURN_NONE;
    }
    plan_event *ev = PyMem_Malloc(sizeof(plan_event) * (size_t)(total ? total : 1));
    if (ev == NULL)
        return PyErr_NoMemory();
    Py_ssize_t m = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *req = PyList_GET_ITEM(running, i);
        long long computed = 0;
        slot_long(SLOT(req, off_computed), &computed);
        long long j = (long long)PyList_GET_SIZE(SLOT(req, off_blocks)) * bs - computed + 1;
        if (j < 1)
            j = 1;
        for (; j <= k && m < total; j += bs) {
            ev[m].step = j;
            ev[m].index = i;
            m++;
        }
    }
    qsort(ev, (size_t)m, sizeof(plan_event), plan_event_order);
    if (m > free_blocks) {
        k = ev[free_blocks].step - 1;
        while (m > 0 && ev[m - 1].step > k)
            m--;
    }
    PyObject *steps = PyList_New(m), *index = PyList_New(m);
    if (steps == NULL || index == NULL)
        goto fail;
    for (Py_ssize_t q = 0; q < m; q++) {
        PyObject *a = PyLong_FromLongLong(ev[q].step), *b = PyLong_FromSsize_t(ev[q].index);
        if (a == NULL || b == NULL) {
            Py_XDECREF(a);
            Py_XDECREF(b);
            goto fail;
        }
        PyList_SET_ITEM(steps, q, a);
        PyList_SET_ITEM(index, q, b);
    }
    PyMem_Free(ev);
    return Py_BuildValue("(LNN)", k, steps, index);
fail:
    PyMem_Free(ev);
    Py_XDECREF(steps);
    Py_XDECREF(index);
    return NULL;
}

static PyMethodDef methods[] = {
    {"gather", (PyCFunction)(void (*)(void))gather, METH_FASTCALL, NULL},
    {"fill", (PyCFunction)(void (*)(void))fill, METH_FASTCALL, NULL},
    {"incr", (PyCFunction)(void (*)(void))incr, METH_FASTCALL, NULL},
    {"count_free", (PyCFunction)(void (*)(void))count_free, METH_FASTCALL, NULL},
    {"select_equal", (PyCFunction)(void (*)(void))select_equal, METH_FASTCALL, NULL},
    {"evict_claim", (PyCFunction)(void (*)(void))evict_claim, METH_FASTCALL, NULL},
    {"release", (PyCFunction)(void (*)(void))release, METH_FASTCALL, NULL},
    {"touch", (PyCFunction)(void (*)(void))touch, METH_FASTCALL, NULL},
    {"register", (PyCFunction)(void (*)(void))register_, METH_FASTCALL, NULL},
    {"cached_prefix", (PyCFunction)(void (*)(void))cached_prefix, METH_FASTCALL, NULL},
    {"chain_prefix", (PyCFunction)(void (*)(void))chain_prefix, METH_FASTCALL, NULL},
    {"running_plain", (PyCFunction)(void (*)(void))running_plain, METH_FASTCALL, NULL},
    {"sample_plain", (PyCFunction)(void (*)(void))sample_plain, METH_FASTCALL, NULL},
    {"decode_room", (PyCFunction)(void (*)(void))decode_room, METH_FASTCALL, NULL},
    {"advance", (PyCFunction)(void (*)(void))advance, METH_FASTCALL, NULL},
    {"decode_times", (PyCFunction)(void (*)(void))decode_times, METH_FASTCALL, NULL},
    {"decode_plan", (PyCFunction)(void (*)(void))decode_plan, METH_FASTCALL, NULL},
    {"bind_request", bind_request, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvtop.sim._blockpool",
    "The simulated engine's per-block loops in C (see kvtop/sim/_pool.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__blockpool(void)
{
    return PyModule_Create(&module);
}
