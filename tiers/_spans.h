/* Buffers for the batched C calls (_fastcopy.c, _slotio.c): a buffer object,
 * or an (address, length) pair naming memory the caller keeps alive through
 * the call (a CPU tensor's, a slot of a pool): no buffer object per block,
 * where a numpy view costs a microsecond. A pair is "acquired" with obj NULL,
 * so PyBuffer_Release leaves it alone. */
#ifndef TIERKV_SPANS_H
#define TIERKV_SPANS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

static int get_buffer(PyObject *o, Py_buffer *b, int flags) {
    if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) != 2) return PyObject_GetBuffer(o, b, flags);
    memset(b, 0, sizeof(*b));
    b->buf = PyLong_AsVoidPtr(PyTuple_GET_ITEM(o, 0));
    b->len = PyLong_AsSsize_t(PyTuple_GET_ITEM(o, 1));
    if (PyErr_Occurred()) return -1;
    if (!b->buf || b->len < 0) {
        PyErr_SetString(PyExc_ValueError, "an (address, length) pair must name memory");
        return -1;
    }
    return 0;
}

#endif
