/* A batch of the disk tier's slot writes (tiers/disk_slots.py) in one call,
 * with the GIL released.
 *
 * write_slots(fds, offsets, hashes, objs, hash, sync, align) -> (sums, errno): for each
 * object (a buffer, or an (address, length) pair of memory the caller keeps
 * alive through the call: a CPU tensor's, without a numpy view per block), its xxh3_64 (`hash` is the address of the xxhash package's
 * XXH3_64bits, as in _fastcopy.c), then one pwritev of the slot's 32-byte
 * header (magic "TKVS", u32 object size, u64 checksum, 16-byte block hash,
 * little-endian: disk_slots.HEAD) and the object at its offset, then zeros to
 * the next multiple of `align` bytes of the file (0: none; at most 4096),
 * finishing a short write. A slot of whole pages written to its end is never
 * read in by the kernel first, as its last page would be if written in part. sums[i] is that checksum, or None where fds[i] is negative
 * (skipped by the caller) or the write failed; errno is the first failure's.
 * A batch of small blocks is a few microseconds of syscall each, where the
 * same loop in Python costs several times that in interpreter time, under the
 * GIL the store's other threads need. Segments.write_many's loop is the
 * reference. With `sync` true the files written to are fdatasynced in the
 * same call (one GIL release per batch where a separate sync makes two, and
 * the store's other threads take the GIL at each); a failed sync fails
 * every slot of the batch, with its errno. */
#include "_spans.h"
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#define HEAD_BYTES 32
#define HASH_BYTES 16
#define MAX_ALIGN 4096

static const unsigned char ZEROS[MAX_ALIGN];

typedef unsigned long long (*hash_fn)(const void *, size_t);

typedef struct {
    int fd;
    long long off;
    unsigned char head[HEAD_BYTES];
    Py_buffer obj;
    size_t pad;  /* zeros written after the object */
    int have_obj;
    unsigned long long sum;
    int ok;
} Slot;

static void put_le(unsigned char *p, unsigned long long v, int n) {
    for (int i = 0; i < n; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static int write_all(Slot *s) {
    struct iovec iov[3] = {{s->head, HEAD_BYTES}, {s->obj.buf, (size_t)s->obj.len}, {(void *)ZEROS, s->pad}};
    int k = 0, count = s->pad ? 3 : 2;
    long long off = s->off;
    while (k < count) {
        ssize_t n = pwritev(s->fd, iov + k, count - k, (off_t)off);
        if (n < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (n == 0) return EIO;
        off += n;
        while (k < count && (size_t)n >= iov[k].iov_len) n -= (ssize_t)iov[k++].iov_len;
        if (k < count) {  /* a short write: the rest of this part next */
            iov[k].iov_base = (char *)iov[k].iov_base + n;
            iov[k].iov_len -= (size_t)n;
        }
    }
    return 0;
}

/* Fill slots[i] from the arguments (GIL held); -1 with an exception set. */
static int gather(PyObject *fds, PyObject *offs, PyObject *hashes, PyObject *objs, long long align, Slot *slots,
                  Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        Slot *s = &slots[i];
        s->fd = (int)PyLong_AsLong(PySequence_Fast_GET_ITEM(fds, i));
        s->off = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(offs, i));
        if (PyErr_Occurred()) return -1;
        if (s->fd < 0) continue;
        PyObject *h = PySequence_Fast_GET_ITEM(hashes, i);
        if (!PyBytes_Check(h) || PyBytes_GET_SIZE(h) != HASH_BYTES) {
            PyErr_SetString(PyExc_ValueError, "each hash must be 16 bytes");
            return -1;
        }
        if (get_buffer(PySequence_Fast_GET_ITEM(objs, i), &s->obj, PyBUF_C_CONTIGUOUS) < 0) return -1;
        s->have_obj = 1;
        if (s->obj.len > 0xffffffffLL) {
            PyErr_SetString(PyExc_ValueError, "an object must be under 4 GiB");
            return -1;
        }
        long long end = s->off + HEAD_BYTES + (long long)s->obj.len;
        s->pad = align ? (size_t)((align - end % align) % align) : 0;
        memcpy(s->head, "TKVS", 4);
        put_le(s->head + 4, (unsigned long long)s->obj.len, 4);
        memcpy(s->head + 16, PyBytes_AS_STRING(h), HASH_BYTES);
    }
    return 0;
}

static PyObject *results(Slot *slots, Py_ssize_t n, int first_errno) {
    PyObject *sums = PyList_New(n);
    for (Py_ssize_t i = 0; sums && i < n; i++) {
        PyObject *v = slots[i].ok ? PyLong_FromUnsignedLongLong(slots[i].sum) : Py_NewRef(Py_None);
        if (!v) { Py_CLEAR(sums); break; }
        PyList_SET_ITEM(sums, i, v);
    }
    return sums ? Py_BuildValue("(Ni)", sums, first_errno) : NULL;
}

/* fdatasync each distinct fd that took a write (GIL released); on a failure
 * nothing of the batch is durable: every slot fails with that errno. */
static int sync_written(Slot *slots, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!slots[i].ok) continue;
        int seen = 0;
        for (Py_ssize_t j = 0; j < i && !seen; j++) seen = slots[j].ok && slots[j].fd == slots[i].fd;
        if (seen || fdatasync(slots[i].fd) == 0) continue;
        int err = errno;
        for (Py_ssize_t j = 0; j < n; j++) slots[j].ok = 0;
        return err;
    }
    return 0;
}

static PyObject *write_slots(PyObject *self, PyObject *args) {
    PyObject *fl, *ol, *hl, *bl, *fds = NULL, *offs = NULL, *hashes = NULL, *objs = NULL, *out = NULL;
    unsigned long long addr;
    int sync = 0;
    long long align = 0;
    Slot *slots = NULL;
    Py_ssize_t n = 0;
    if (!PyArg_ParseTuple(args, "OOOOK|pL", &fl, &ol, &hl, &bl, &addr, &sync, &align)) return NULL;
    if (!addr) return PyErr_Format(PyExc_ValueError, "hash must be a function's address");
    if (align < 0 || align > MAX_ALIGN) return PyErr_Format(PyExc_ValueError, "align must be 0 to %d", MAX_ALIGN);
    if (!(fds = PySequence_Fast(fl, "fds must be a sequence")) || !(offs = PySequence_Fast(ol, "offsets too"))
        || !(hashes = PySequence_Fast(hl, "hashes too")) || !(objs = PySequence_Fast(bl, "objs too")))
        goto done;
    n = PySequence_Fast_GET_SIZE(fds);
    if (PySequence_Fast_GET_SIZE(offs) != n || PySequence_Fast_GET_SIZE(hashes) != n || PySequence_Fast_GET_SIZE(objs) != n) {
        PyErr_SetString(PyExc_ValueError, "one offset, hash and object per fd");
        goto done;
    }
    if (!(slots = PyMem_Calloc(n ? n : 1, sizeof(Slot)))) { PyErr_NoMemory(); goto done; }
    if (gather(fds, offs, hashes, objs, align, slots, n) < 0) goto done;
    hash_fn hash = (hash_fn)(uintptr_t)addr;
    int first = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        Slot *s = &slots[i];
        if (s->fd < 0) continue;
        s->sum = hash(s->obj.buf, (size_t)s->obj.len);
        put_le(s->head + 8, s->sum, 8);
        int err = write_all(s);
        s->ok = err == 0;
        if (err && !first) first = err;
    }
    if (sync) {
        int err = sync_written(slots, n);
        if (err) first = err;
    }
    Py_END_ALLOW_THREADS
    out = results(slots, n, first);
done:
    for (Py_ssize_t i = 0; slots && i < n; i++)
        if (slots[i].have_obj) PyBuffer_Release(&slots[i].obj);
    PyMem_Free(slots);
    Py_XDECREF(fds);
    Py_XDECREF(offs);
    Py_XDECREF(hashes);
    Py_XDECREF(objs);
    return out;
}

static PyMethodDef methods[] = {
    {"write_slots", write_slots, METH_VARARGS,
     "write_slots(fds, offsets, hashes, objs, hash, sync=False, align=0) -> (sums, errno): each object's header and "
     "bytes into its slot (zeros after it to a multiple of align), then (sync) fdatasync of the files written"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_slotio", NULL, -1, methods};

PyMODINIT_FUNC PyInit__slotio(void) { return PyModule_Create(&module); }
