/* The router's prefix index (router/prefix_index.py) per-block loops in C: a request's blocks
 * added to an instance's LRU and their owner bits set, and the oldest blocks evicted.
 *
 * Optional: setup.py builds it with optional=True; router/prefix_index.py runs the same loops
 * in Python without it or with KVTOP_PURE_PYTHON=1, and tests/test_prefix_index_cloops.py
 * compares the two. Each instance's LRU is a plain dict in insertion order (a touch deletes and
 * re-inserts a block); the loops leave the same dicts, in the same order, as the Python ones;
 * what they save is the interpreter's cost per block.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* add(lru, owners, blocks, held, bit): for h in reversed(blocks[held:]): if h not in lru:
 * lru[h] = None; owners[h] = owners.get(h, 0) | bit */
static PyObject *
add(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "add(lru, owners, blocks, held, bit)");
        return NULL;
    }
    PyObject *lru = args[0], *owners = args[1], *bit = args[4];
    if (!PyDict_CheckExact(lru) || !PyDict_CheckExact(owners)) {
        PyErr_SetString(PyExc_TypeError, "lru and owners must be dicts");
        return NULL;
    }
    Py_ssize_t held = PyLong_AsSsize_t(args[3]);
    if (held == -1 && PyErr_Occurred())
        return NULL;
    PyObject *blocks = PySequence_Fast(args[2], "expected a list or tuple");
    if (blocks == NULL)
        return NULL;
    PyObject *zero = PyLong_FromLong(0);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(blocks);
    if (held < 0)
        held = 0;
    /* Each block is held by a reference of its own, and the list's length is read again at
     * each step: a key's __hash__/__eq__ is Python code that may change the list (the Python
     * loop walks a slice, a snapshot: this one stops). */
    for (Py_ssize_t k = n - 1; k >= held; k--) {
        if (k >= PySequence_Fast_GET_SIZE(blocks)) {
            PyErr_SetString(PyExc_RuntimeError, "blocks changed size during add");
            goto fail;
        }
        PyObject *h = PySequence_Fast_GET_ITEM(blocks, k);
        Py_INCREF(h);
        /* ``if h not in lru: lru[h] = None`` in one probe: the dict grew exactly when h was absent */
        Py_ssize_t size = PyDict_GET_SIZE(lru);
        int rc = PyDict_SetDefault(lru, h, Py_None) == NULL ? -1 : PyDict_GET_SIZE(lru) == size;
        if (rc == 0) {
            PyObject *cur = PyDict_GetItemWithError(owners, h);   /* borrowed */
            if (cur == NULL && rc == 0 && PyErr_Occurred())
                rc = -1;
            if (rc == 0) {
                PyObject *v = PyNumber_Or(cur == NULL ? zero : cur, bit);
                rc = v == NULL ? -1 : PyDict_SetItem(owners, h, v);
                Py_XDECREF(v);
            }
        }
        Py_DECREF(h);
        if (rc < 0)
            goto fail;
    }
    Py_DECREF(zero);
    Py_DECREF(blocks);
    Py_RETURN_NONE;
fail:
    Py_DECREF(zero);
    Py_DECREF(blocks);
    return NULL;
}

static int evict_one(PyObject *lru, PyObject *owners, PyObject *tags, PyObject *old,
                     PyObject *keep, PyObject *zero);

/* evict(lru, owners, tags, olds, keep): for old in olds: del lru[old];
 * mask = owners.pop(old, 0) & keep; if mask: owners[old] = mask; else: tags.pop(old, None) */
static PyObject *
evict(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "evict(lru, owners, tags, olds, keep)");
        return NULL;
    }
    PyObject *lru = args[0], *owners = args[1], *tags = args[2], *keep = args[4];
    if (!PyDict_Check(lru) || !PyDict_CheckExact(owners) || !PyDict_CheckExact(tags)) {
        PyErr_SetString(PyExc_TypeError, "lru must be a dict (an OrderedDict), owners and tags dicts");
        return NULL;
    }
    PyObject *olds = PySequence_Fast(args[3], "expected a list or tuple");
    if (olds == NULL)
        return NULL;
    PyObject *zero = PyLong_FromLong(0);
    /* (each key held by a reference of its own, the length read at each step: see add) */
    for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(olds); k++) {
        PyObject *old = PySequence_Fast_GET_ITEM(olds, k);
        Py_INCREF(old);
        int rc = evict_one(lru, owners, tags, old, keep, zero);
        Py_DECREF(old);
        if (rc < 0)
            goto fail;
    }
    Py_DECREF(zero);
    Py_DECREF(olds);
    Py_RETURN_NONE;
fail:
    Py_DECREF(zero);
    Py_DECREF(olds);
    return NULL;
}

static int
evict_one(PyObject *lru, PyObject *owners, PyObject *tags, PyObject *old, PyObject *keep,
          PyObject *zero)
{
    if (PyObject_DelItem(lru, old) < 0)
        return -1;
    PyObject *m = PyDict_GetItemWithError(owners, old);   /* borrowed */
    if (m == NULL) {
        if (PyErr_Occurred())
            return -1;
        m = zero;
        Py_INCREF(m);
    }
    else {
        Py_INCREF(m);
        if (PyDict_DelItem(owners, old) < 0) {
            Py_DECREF(m);
            return -1;
        }
    }
    PyObject *mask = PyNumber_And(m, keep);
    Py_DECREF(m);
    if (mask == NULL)
        return -1;
    int truth = PyObject_IsTrue(mask);
    int rc = truth < 0 ? -1 : 0;
    if (truth > 0)
        rc = PyDict_SetItem(owners, old, mask);
    else if (truth == 0 && PyDict_GET_SIZE(tags)) {   /* no tags kept: nothing to drop */
        int in = PyDict_Contains(tags, old);
        rc = in < 0 ? -1 : in ? PyDict_DelItem(tags, old) : 0;
    }
    Py_DECREF(mask);
    return rc;
}

/* touch(lru, owners, blocks, end, bit): for h in reversed(blocks[:end]): if h in lru: move it to
 * the newest end (del lru[h]; lru[h] = None); else: lru[h] = None; owners[h] = owners.get(h, 0) |
 * bit. The LRU is a plain dict in insertion order (router/prefix_index.py ``_touch``). */
static PyObject *
touch(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "touch(lru, owners, blocks, end, bit)");
        return NULL;
    }
    PyObject *lru = args[0], *owners = args[1], *bit = args[4];
    if (!PyDict_CheckExact(lru) || !PyDict_CheckExact(owners)) {
        PyErr_SetString(PyExc_TypeError, "lru and owners must be dicts");
        return NULL;
    }
    Py_ssize_t end = PyLong_AsSsize_t(args[3]);
    if (end == -1 && PyErr_Occurred())
        return NULL;
    PyObject *blocks = PySequence_Fast(args[2], "expected a list or tuple");
    if (blocks == NULL)
        return NULL;
    PyObject *zero = PyLong_FromLong(0);
    if (end > PySequence_Fast_GET_SIZE(blocks))
        end = PySequence_Fast_GET_SIZE(blocks);
    /* (each block held by a reference of its own, the length read at each step: see add) */
    for (Py_ssize_t k = end - 1; k >= 0; k--) {
        if (k >= PySequence_Fast_GET_SIZE(blocks)) {
            PyErr_SetString(PyExc_RuntimeError, "blocks changed size during touch");
            goto fail;
        }
        PyObject *h = PySequence_Fast_GET_ITEM(blocks, k);
        Py_INCREF(h);
        int rc = PyDict_DelItem(lru, h);
        if (rc < 0 && PyErr_ExceptionMatches(PyExc_KeyError)) {   /* absent: added, owner bit set */
            PyErr_Clear();
            PyObject *cur = PyDict_GetItemWithError(owners, h);   /* borrowed */
            if (cur != NULL || !PyErr_Occurred()) {
                PyObject *v = PyNumber_Or(cur == NULL ? zero : cur, bit);
                rc = v == NULL ? -1 : PyDict_SetItem(owners, h, v);
                Py_XDECREF(v);
            }
        }
        if (rc == 0)
            rc = PyDict_SetItem(lru, h, Py_None);
        Py_DECREF(h);
        if (rc < 0)
            goto fail;
    }
    Py_DECREF(zero);
    Py_DECREF(blocks);
    Py_RETURN_NONE;
fail:
    Py_DECREF(zero);
    Py_DECREF(blocks);
    return NULL;
}

static PyMethodDef methods[] = {
    {"add", (PyCFunction)(void (*)(void))add, METH_FASTCALL, NULL},
    {"evict", (PyCFunction)(void (*)(void))evict, METH_FASTCALL, NULL},
    {"touch", (PyCFunction)(void (*)(void))touch, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "router._index_loops",
    "The router prefix index's per-block loops in C (see router/prefix_index.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__index_loops(void)
{
    return PyModule_Create(&module);
}
