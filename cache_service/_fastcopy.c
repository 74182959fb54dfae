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

static int get_pair(PyObject *d, PyObject *s, Py_buffer *dst, Py_buffer *src) {
    if (PyObject_GetBuffer(d, dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (PyObject_GetBuffer(s, src, PyBUF_C_CONTIGUOUS) < 0) {
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

static PyObject *copy_many(PyObject *self, PyObject *args) {
    PyObject *dl, *sl;
    if (!PyArg_ParseTuple(args, "OO", &dl, &sl)) return NULL;
    PyObject *dseq = PySequence_Fast(dl, "dsts must be a sequence");
    PyObject *sseq = dseq ? PySequence_Fast(sl, "srcs must be a sequence") : NULL;
    if (!sseq) { Py_XDECREF(dseq); return NULL; }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(dseq);
    Py_buffer *bufs = NULL;
    Py_ssize_t got = 0;
    if (n != PySequence_Fast_GET_SIZE(sseq)) {
        PyErr_SetString(PyExc_ValueError, "one destination per source");
        goto done;
    }
    bufs = PyMem_Calloc(n ? 2 * n : 1, sizeof(Py_buffer));
    if (!bufs) { PyErr_NoMemory(); goto done; }
    for (; got < n; got++) {
        PyObject *d = PySequence_Fast_GET_ITEM(dseq, got), *s = PySequence_Fast_GET_ITEM(sseq, got);
        if (get_pair(d, s, &bufs[2 * got], &bufs[2 * got + 1]) < 0) goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) memcpy(bufs[2 * i].buf, bufs[2 * i + 1].buf, (size_t)bufs[2 * i + 1].len);
    Py_END_ALLOW_THREADS
done:
    for (Py_ssize_t i = 0; i < got; i++) {
        PyBuffer_Release(&bufs[2 * i]);
        PyBuffer_Release(&bufs[2 * i + 1]);
    }
    PyMem_Free(bufs);
    Py_DECREF(dseq);
    Py_DECREF(sseq);
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

static PyObject *copy_hash_many(PyObject *self, PyObject *args) {
    PyObject *dl, *sl, *out = NULL;
    Py_ssize_t skip;
    unsigned long long addr;
    if (!PyArg_ParseTuple(args, "OOnK", &dl, &sl, &skip, &addr)) return NULL;
    hash_fn hash = (hash_fn)(uintptr_t)addr;
    PyObject *dseq = PySequence_Fast(dl, "dsts must be a sequence");
    PyObject *sseq = dseq ? PySequence_Fast(sl, "srcs must be a sequence") : NULL;
    if (!sseq) { Py_XDECREF(dseq); return NULL; }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(dseq), got = 0;
    Py_buffer *bufs = NULL;
    unsigned long long *sums = NULL;
    if (n != PySequence_Fast_GET_SIZE(sseq) || skip < 0 || !hash) {
        PyErr_SetString(PyExc_ValueError, "one destination per source, skip >= 0 and a hash function");
        goto done;
    }
    bufs = PyMem_Calloc(n ? 2 * n : 1, sizeof(Py_buffer));
    sums = PyMem_Calloc(n ? n : 1, sizeof(unsigned long long));
    if (!bufs || !sums) { PyErr_NoMemory(); goto done; }
    for (; got < n; got++) {
        PyObject *d = PySequence_Fast_GET_ITEM(dseq, got), *s = PySequence_Fast_GET_ITEM(sseq, got);
        if (get_pair(d, s, &bufs[2 * got], &bufs[2 * got + 1]) < 0) goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t len = bufs[2 * i + 1].len, from = skip < len ? skip : len;
        memcpy(bufs[2 * i].buf, bufs[2 * i + 1].buf, (size_t)len);
        sums[i] = hash((const char *)bufs[2 * i].buf + from, (size_t)(len - from));
    }
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(sums[i]);
        if (!v) { Py_CLEAR(out); break; }
        PyList_SET_ITEM(out, i, v);
    }
done:
    for (Py_ssize_t i = 0; i < got; i++) {
        PyBuffer_Release(&bufs[2 * i]);
        PyBuffer_Release(&bufs[2 * i + 1]);
    }
    PyMem_Free(bufs);
    PyMem_Free(sums);
    Py_DECREF(dseq);
    Py_DECREF(sseq);
    return out;
}

static PyMethodDef methods[] = {
    {"copy_many", copy_many, METH_VARARGS, "copy_many(dsts, srcs): dsts[i][:len(srcs[i])] = srcs[i]"},
    {"copy_hash_many", copy_hash_many, METH_VARARGS,
     "copy_hash_many(dsts, srcs, skip, hash): copy_many, and hash(copy[skip:]) of each copy"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fastcopy(void) { return PyModule_Create(&module); }
