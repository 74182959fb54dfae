/* Chained block hashes in one call: h_i = XXH3_128(h_{i-1} || block_i).
 * The Python loop in cache_service/keys.py is the reference; this only
 * removes its per-block interpreter overhead. Links against libxxhash. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <xxhash.h>

static void put_canonical(unsigned char *dst, XXH128_hash_t h) {
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, h);
    memcpy(dst, c.digest, 16);
}

static PyObject *chain(PyObject *self, PyObject *args) {
    Py_buffer parent, data;
    Py_ssize_t step;
    if (!PyArg_ParseTuple(args, "y*y*n", &parent, &data, &step)) return NULL;
    if (parent.len != 16 || step <= 0 || data.len % step != 0) {
        PyBuffer_Release(&parent);
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "parent must be 16 bytes and data a whole number of blocks");
        return NULL;
    }
    Py_ssize_t n = data.len / step;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 16);
    unsigned char *buf = out ? PyMem_Malloc(16 + step) : NULL;
    if (out && buf) {
        unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
        const unsigned char *src = data.buf;
        memcpy(buf, parent.buf, 16);
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            memcpy(buf + 16, src + i * step, step);
            put_canonical(dst + i * 16, XXH3_128bits(buf, 16 + step));
            memcpy(buf, dst + i * 16, 16);
        }
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(buf);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&data);
    if (out && !buf) { Py_DECREF(out); return PyErr_NoMemory(); }
    return out;
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS, "chain(parent16, data, step) -> concatenated 16-byte hashes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hashchain", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hashchain(void) { return PyModule_Create(&module); }
