/* Many block copies in one call, with the GIL released.
 *
 * copy_many(dsts, srcs) copies each srcs[i] into the start of dsts[i]. The
 * data paths copy dozens of few-hundred-KiB blocks per request; a torch
 * copy_ per block costs microseconds of interpreter and dispatch each, which
 * at these sizes is a good part of the copy itself. tiers/cpu.py falls back
 * to torch copies without this module (and for device memory). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_spans.h"

/* Below this many bytes a call keeps the GIL: a copy of a few dozen KiB
 * takes microseconds, less than handing the GIL to another thread and
 * waiting to get it back (the store's caller and its disk writer take turns
 * on it; a release per small batch cost the caller that wait each time). */
#define RELEASE_BYTES (256 << 10)

static PyThreadState *release_if(Py_ssize_t bytes) {
    return bytes >= RELEASE_BYTES ? PyEval_SaveThread() : NULL;
}

static void take_back(PyThreadState *ts) {
    if (ts) PyEval_RestoreThread(ts);
}

static int get_pair(PyObject *d, PyObject *s, Py_buffer *dst, Py_buffer *src) {
    if (get_buffer(d, dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (get_buffer(s, src, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(dst);
        return -1;
    }
    if (dst->len < src->len) {
        PyErr_Format(PyExc_ValueError, "destination has %zd bytes, source %zd", dst->len, src->len);
        PyBuffer_Release(dst);
        PyBuffer_Release(src);
        return -1;
    }
    return 0;
}

/* The buffers of a call's (dsts, srcs): all acquired by open_pairs, or an
 * exception set; close_pairs releases whatever was acquired. */
typedef struct {
    PyObject *dseq, *sseq;
    Py_buffer *bufs;  /* dst i at 2i, src i at 2i + 1 */
    Py_ssize_t n, got;
} Pairs;

static int open_pairs(PyObject *dl, PyObject *sl, Pairs *p) {
    memset(p, 0, sizeof(*p));
    p->dseq = PySequence_Fast(dl, "dsts must be a sequence");
    p->sseq = p->dseq ? PySequence_Fast(sl, "srcs must be a sequence") : NULL;
    if (!p->sseq) return -1;
    p->n = PySequence_Fast_GET_SIZE(p->dseq);
    if (p->n != PySequence_Fast_GET_SIZE(p->sseq)) {
        PyErr_SetString(PyExc_ValueError, "one destination per source");
        return -1;
    }
    p->bufs = PyMem_Calloc(p->n ? 2 * p->n : 1, sizeof(Py_buffer));
    if (!p->bufs) { PyErr_NoMemory(); return -1; }
    for (; p->got < p->n; p->got++) {
        PyObject *d = PySequence_Fast_GET_ITEM(p->dseq, p->got), *s = PySequence_Fast_GET_ITEM(p->sseq, p->got);
        if (get_pair(d, s, &p->bufs[2 * p->got], &p->bufs[2 * p->got + 1]) < 0) return -1;
    }
    return 0;
}

static void close_pairs(Pairs *p) {
    for (Py_ssize_t i = 0; i < p->got; i++) {
        PyBuffer_Release(&p->bufs[2 * i]);
        PyBuffer_Release(&p->bufs[2 * i + 1]);
    }
    PyMem_Free(p->bufs);
    Py_XDECREF(p->dseq);
    Py_XDECREF(p->sseq);
}

static Py_ssize_t pairs_bytes(const Pairs *p) {
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < p->n; i++) n += p->bufs[2 * i + 1].len;
    return n;
}

static PyObject *copy_many(PyObject *self, PyObject *args) {
    PyObject *dl, *sl;
    Pairs p;
    if (!PyArg_ParseTuple(args, "OO", &dl, &sl)) return NULL;
    if (open_pairs(dl, sl, &p) == 0) {
        PyThreadState *ts = release_if(pairs_bytes(&p));
        for (Py_ssize_t i = 0; i < p.n; i++) memcpy(p.bufs[2 * i].buf, p.bufs[2 * i + 1].buf, (size_t)p.bufs[2 * i + 1].len);
        take_back(ts);
    }
    close_pairs(&p);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* copy_hash_many(dsts, srcs, skip, hash) -> list of int: copy_many, and
 * hash(copy + skip, its length - skip) of each copy right after it was
 * copied, while its bytes are still in this core's cache: one pass over
 * memory where copying then hashing reads it twice. `hash` is the address
 * of an XXH3_64bits-shaped function (tiers/host_copy.py passes the one the
 * xxhash package exports, so the hash is that package's build, which picks
 * the widest vector unit at run time: twice the speed of a baseline build of
 * libxxhash's header here); the Python loop there is the reference. */
typedef unsigned long long (*hash_fn)(const void *, size_t);

/* The n checksums as a list of ints (NULL with an exception set). */
static PyObject *sums_list(const unsigned long long *sums, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(sums[i]);
        if (!v) { Py_CLEAR(out); break; }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

static PyObject *copy_hash_many(PyObject *self, PyObject *args) {
    PyObject *dl, *sl, *out = NULL;
    Py_ssize_t skip;
    unsigned long long addr;
    Pairs p;
    if (!PyArg_ParseTuple(args, "OOnK", &dl, &sl, &skip, &addr)) return NULL;
    if (skip < 0 || !addr) {
        PyErr_SetString(PyExc_ValueError, "skip must be >= 0 and hash a function's address");
        return NULL;
    }
    hash_fn hash = (hash_fn)(uintptr_t)addr;
    unsigned long long *sums = NULL;
    if (open_pairs(dl, sl, &p) == 0 && (sums = PyMem_Calloc(p.n ? p.n : 1, sizeof(*sums))) == NULL)
        PyErr_NoMemory();
    if (sums) {
        PyThreadState *ts = release_if(pairs_bytes(&p));
        for (Py_ssize_t i = 0; i < p.n; i++) {
            Py_ssize_t len = p.bufs[2 * i + 1].len, from = skip < len ? skip : len;
            memcpy(p.bufs[2 * i].buf, p.bufs[2 * i + 1].buf, (size_t)len);
            sums[i] = hash((const char *)p.bufs[2 * i].buf + from, (size_t)(len - from));
        }
        take_back(ts);
        out = sums_list(sums, p.n);
    }
    PyMem_Free(sums);
    close_pairs(&p);
    return out;
}

/* hash_rows(rows, skip, hash) -> list of int: hash(row + skip, its length -
 * skip) of each row of a C-contiguous 2-D byte buffer (a batch of block
 * objects encoded in one stack: their payload checksums in one call where a
 * numpy slice and a call per row cost more than hashing a small block). */
static PyObject *hash_rows(PyObject *self, PyObject *args) {
    PyObject *obj, *out = NULL;
    Py_ssize_t skip;
    unsigned long long addr;
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "OnK", &obj, &skip, &addr)) return NULL;
    if (PyObject_GetBuffer(obj, &b, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (b.ndim != 2 || b.itemsize != 1 || skip < 0 || skip > b.shape[1] || !addr) {
        PyErr_SetString(PyExc_ValueError, "rows must be 2-D bytes, skip within a row and hash a function's address");
        PyBuffer_Release(&b);
        return NULL;
    }
    hash_fn hash = (hash_fn)(uintptr_t)addr;
    Py_ssize_t n = b.shape[0], len = b.shape[1];
    unsigned long long *sums = PyMem_Calloc(n ? n : 1, sizeof(*sums));
    if (!sums) {
        PyBuffer_Release(&b);
        return PyErr_NoMemory();
    }
    PyThreadState *ts = release_if(n * (len - skip));
    for (Py_ssize_t i = 0; i < n; i++) sums[i] = hash((const char *)b.buf + i * len + skip, (size_t)(len - skip));
    take_back(ts);
    out = sums_list(sums, n);
    PyMem_Free(sums);
    PyBuffer_Release(&b);
    return out;
}

static PyMethodDef methods[] = {
    {"copy_many", copy_many, METH_VARARGS,
     "copy_many(dsts, srcs): dsts[i][:len(srcs[i])] = srcs[i] (buffers, or (address, length) pairs)"},
    {"copy_hash_many", copy_hash_many, METH_VARARGS,
     "copy_hash_many(dsts, srcs, skip, hash): copy_many, and hash(copy[skip:]) of each copy"},
    {"hash_rows", hash_rows, METH_VARARGS, "hash_rows(rows, skip, hash): hash(row[skip:]) of each row of a 2-D buffer"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fastcopy(void) { return PyModule_Create(&module); }
