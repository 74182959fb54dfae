/* The presence table's lookup (tiers/presence.py) in one call.
 *
 * contains(buckets, hashes) answers, per hash, whether the table holds it:
 * the same answers as PresenceTable._find, without numpy's per-operation
 * overhead (a lookup of 256 is a dozen array operations there, ~30-60 us on
 * these machines). All home buckets are prefetched first, so a table larger
 * than the caches costs about one memory latency per batch, not per hash.
 *
 * add(buckets, keys) places each uint64 key not held yet in the first free
 * slot (empty or a tombstone) of its bucket chain, as PresenceTable._place
 * does for distinct keys (a key repeated in `keys` is placed once); the
 * caller has grown the table so that every key finds room (a table found
 * full, or a key below 2, raises with the keys before it placed and not
 * counted: the caller's invariant broken). Returns (keys placed, empty
 * slots they took). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define WAYS 8
#define EMPTY 0
#define GONE 1

static uint64_t key_of(const unsigned char *p, Py_ssize_t n) {
    uint64_t k = 0;
    for (Py_ssize_t i = 0; i < n && i < 8; i++) k |= (uint64_t)p[i] << (8 * i);  /* little-endian */
    return k < 2 ? 2 : k;
}

static int held(const uint64_t *b, uint64_t mask, uint64_t k) {
    for (uint64_t at = k & mask, seen = 0; seen <= mask; at = (at + 1) & mask, seen++) {
        const uint64_t *row = b + at * WAYS;
        int empty = 0;
        for (int w = 0; w < WAYS; w++) {
            if (row[w] == k) return 1;
            empty |= row[w] == EMPTY;
        }
        if (empty) return 0;
    }
    return 0;
}

static PyObject *contains(PyObject *self, PyObject *args) {
    Py_buffer tab;
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "y*O", &tab, &seq)) return NULL;
    Py_ssize_t nb = tab.len / (Py_ssize_t)(WAYS * sizeof(uint64_t));
    PyObject *fast = PySequence_Fast(seq, "hashes must be a sequence");
    if (!fast || nb <= 0 || (nb & (nb - 1))) {
        if (fast) PyErr_SetString(PyExc_ValueError, "buckets must be a power of two of 8 uint64 each");
        Py_XDECREF(fast);
        PyBuffer_Release(&tab);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    uint64_t mask = (uint64_t)nb - 1, *keys = PyMem_Malloc(sizeof(uint64_t) * (n ? n : 1));
    PyObject *out = keys ? PyList_New(n) : PyErr_NoMemory();
    const uint64_t *b = tab.buf;
    for (Py_ssize_t i = 0; out && i < n; i++) {
        if (PyBytes_Check(items[i])) {
            keys[i] = key_of((const unsigned char *)PyBytes_AS_STRING(items[i]), PyBytes_GET_SIZE(items[i]));
        } else {  /* any other bytes-like hash */
            Py_buffer h;
            if (PyObject_GetBuffer(items[i], &h, PyBUF_C_CONTIGUOUS) < 0) {
                Py_CLEAR(out);
                break;
            }
            keys[i] = key_of(h.buf, h.len);
            PyBuffer_Release(&h);
        }
        __builtin_prefetch(b + (keys[i] & mask) * WAYS);
    }
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *v = held(b, mask, keys[i]) ? Py_True : Py_False;
        Py_INCREF(v);
        PyList_SET_ITEM(out, i, v);
    }
    PyMem_Free(keys);
    Py_DECREF(fast);
    PyBuffer_Release(&tab);
    return out;
}


/* The first free slot (EMPTY or GONE) of k's chain; NULL when the table is full. */
static uint64_t *free_slot(uint64_t *b, uint64_t mask, uint64_t k) {
    for (uint64_t at = k & mask, seen = 0; seen <= mask; at = (at + 1) & mask, seen++) {
        uint64_t *row = b + at * WAYS;
        for (int w = 0; w < WAYS; w++)
            if (row[w] == EMPTY || row[w] == GONE) return row + w;
    }
    return NULL;
}

static PyObject *add(PyObject *self, PyObject *args) {
    Py_buffer tab, keys;
    if (!PyArg_ParseTuple(args, "w*y*", &tab, &keys)) return NULL;
    Py_ssize_t nb = tab.len / (Py_ssize_t)(WAYS * sizeof(uint64_t)), n = keys.len / (Py_ssize_t)sizeof(uint64_t);
    PyObject *out = NULL;
    if (nb <= 0 || (nb & (nb - 1)) || keys.len % (Py_ssize_t)sizeof(uint64_t)) {
        PyErr_SetString(PyExc_ValueError, "buckets must be a power of two of 8 uint64 each, keys uint64");
        goto done;
    }
    uint64_t mask = (uint64_t)nb - 1, *b = tab.buf;
    const uint64_t *k = keys.buf;
    Py_ssize_t placed = 0, took = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (k[i] <= GONE) {  /* keys_of stores keys below 2 as 2: 0 and 1 mark empty and gone slots */
            PyErr_SetString(PyExc_ValueError, "keys must be at least 2");
            goto done;
        }
        if (held(b, mask, k[i])) continue;
        uint64_t *slot = free_slot(b, mask, k[i]);
        if (!slot) {
            PyErr_SetString(PyExc_RuntimeError, "presence table full: grow it first");
            goto done;
        }
        took += *slot == EMPTY;
        *slot = k[i];
        placed++;
    }
    out = Py_BuildValue("(nn)", placed, took);
done:
    PyBuffer_Release(&keys);
    PyBuffer_Release(&tab);
    return out;
}

static PyMethodDef methods[] = {
    {"contains", contains, METH_VARARGS, "contains(buckets, hashes) -> list[bool]: whether the table holds each hash."},
    {"add", add, METH_VARARGS, "add(buckets, keys) -> (placed, empty slots taken): hold these uint64 keys."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_presence", NULL, -1, methods};

PyMODINIT_FUNC PyInit__presence(void) { return PyModule_Create(&module); }
