/* shm._atomic: 64-bit atomics on a shared-memory mapping, for shm/leases.py.
 *
 * Python has no compare-and-swap on shared memory. This module gives the lease
 * table the few it needs, as methods of a View that holds a writable buffer
 * export of an mmap for its lifetime (so the mapping cannot be unmapped under
 * it; release() drops the export before mmap.close()).
 *
 * Every read-modify-write is sequentially consistent (on x86_64 a LOCK'd
 * instruction, a full barrier); loads are acquire. Offsets are byte offsets
 * into the buffer, checked for bounds and natural alignment on every call: a
 * bad offset is a ValueError, never a stray write into someone's memory.
 *
 * The scans (find_hash, find_code, scan_codes, scan_f64, find_u64) exist because the
 * same loops in Python cost about 0.3 us a slot, and a probe for a free slot
 * in a nearly full table may have to visit all of them.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int held;
} ViewObject;

static int
view_init(ViewObject *self, PyObject *args, PyObject *kwds)
{
    PyObject *obj;
    static char *kwlist[] = {"buffer", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O", kwlist, &obj))
        return -1;
    if (self->held) {
        PyBuffer_Release(&self->view);
        self->held = 0;
    }
    if (PyObject_GetBuffer(obj, &self->view, PyBUF_WRITABLE) < 0)
        return -1;
    self->held = 1;
    if (((uintptr_t)self->view.buf) % 8) {
        PyBuffer_Release(&self->view);
        self->held = 0;
        PyErr_SetString(PyExc_ValueError, "buffer is not 8-byte aligned");
        return -1;
    }
    return 0;
}

static void
view_dealloc(ViewObject *self)
{
    if (self->held)
        PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The address of `width` bytes at `off`, or NULL with an exception set. */
static char *
at(ViewObject *self, PyObject *off_obj, Py_ssize_t width)
{
    if (!self->held) {
        PyErr_SetString(PyExc_ValueError, "view is released");
        return NULL;
    }
    Py_ssize_t off = PyLong_AsSsize_t(off_obj);
    if (off == -1 && PyErr_Occurred())
        return NULL;
    if (off < 0 || off > self->view.len - width || off % width) {
        PyErr_Format(PyExc_ValueError,
                     "offset %zd is not an aligned %zd-byte word inside the buffer (%zd bytes)",
                     off, width, self->view.len);
        return NULL;
    }
    return (char *)self->view.buf + off;
}

/* A range of `count` u64 words from `off`, checked; NULL with an exception set. */
static uint64_t *
words(ViewObject *self, PyObject *off_obj, Py_ssize_t count)
{
    if (!self->held) {
        PyErr_SetString(PyExc_ValueError, "view is released");
        return NULL;
    }
    Py_ssize_t off = PyLong_AsSsize_t(off_obj);
    if (off == -1 && PyErr_Occurred())
        return NULL;
    if (count < 0 || off < 0 || off % 8 || count > (self->view.len - off) / 8) {
        PyErr_Format(PyExc_ValueError,
                     "%zd words at offset %zd do not fit the buffer (%zd bytes)",
                     count, off, self->view.len);
        return NULL;
    }
    return (uint64_t *)((char *)self->view.buf + off);
}

static int
as_u64(PyObject *obj, uint64_t *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = (uint64_t)v;
    return 0;
}

static int
as_ssize(PyObject *obj, Py_ssize_t *out)
{
    Py_ssize_t v = PyLong_AsSsize_t(obj);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

#define NARGS(n, name)                                                        \
    if (nargs != (n)) {                                                       \
        PyErr_Format(PyExc_TypeError, name "() takes %d arguments (%zd given)", \
                     (n), nargs);                                             \
        return NULL;                                                          \
    }

static PyObject *
view_load64(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(1, "load64");
    uint64_t *p = (uint64_t *)at(self, args[0], 8);
    if (p == NULL)
        return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_load_n(p, __ATOMIC_ACQUIRE));
}

static PyObject *
view_store64(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(2, "store64");
    uint64_t v;
    uint64_t *p = (uint64_t *)at(self, args[0], 8);
    if (p == NULL || as_u64(args[1], &v) < 0)
        return NULL;
    __atomic_store_n(p, v, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

/* cas64(off, expected, desired) -> the value found; it succeeded iff that is `expected`. */
static PyObject *
view_cas64(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(3, "cas64");
    uint64_t expected, desired;
    uint64_t *p = (uint64_t *)at(self, args[0], 8);
    if (p == NULL || as_u64(args[1], &expected) < 0 || as_u64(args[2], &desired) < 0)
        return NULL;
    __atomic_compare_exchange_n(p, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return PyLong_FromUnsignedLongLong(expected);
}

/* add64(off, delta) -> the value before (wraps modulo 2**64). */
static PyObject *
view_add64(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(2, "add64");
    uint64_t delta;
    uint64_t *p = (uint64_t *)at(self, args[0], 8);
    if (p == NULL || as_u64(args[1], &delta) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_fetch_add(p, delta, __ATOMIC_SEQ_CST));
}

static PyObject *
view_load32(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(1, "load32");
    uint32_t *p = (uint32_t *)at(self, args[0], 4);
    if (p == NULL)
        return NULL;
    return PyLong_FromUnsignedLong(__atomic_load_n(p, __ATOMIC_ACQUIRE));
}

/* max32(off, value) -> the value before; the word becomes max(before, value). */
static PyObject *
view_max32(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(2, "max32");
    uint64_t v;
    uint32_t *p = (uint32_t *)at(self, args[0], 4);
    if (p == NULL || as_u64(args[1], &v) < 0)
        return NULL;
    if (v > UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "max32 value does not fit in 32 bits");
        return NULL;
    }
    uint32_t cur = __atomic_load_n(p, __ATOMIC_ACQUIRE);
    while (cur < (uint32_t)v &&
           !__atomic_compare_exchange_n(p, &cur, (uint32_t)v, 1, __ATOMIC_SEQ_CST,
                                        __ATOMIC_ACQUIRE))
        ;
    /* A full barrier even when nothing changed: the caller's next loads must
       not pass its earlier stores (the lease table's Dekker-style check). */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return PyLong_FromUnsignedLong(cur);
}

/* find_hash(states_off, hashes_off, count, start, n, hash, code_mask) -> [index, ...]
 *
 * Visits n slots from `start` (wrapping at count, a power of two) and lists
 * those whose state code (low 4 bits) is in code_mask and whose hash equals
 * `hash`. The caller confirms each candidate under the slot's state word. */
static PyObject *
view_find_hash(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(7, "find_hash");
    Py_ssize_t count, start, n;
    uint64_t hash, code_mask;
    if (as_ssize(args[2], &count) < 0 || as_ssize(args[3], &start) < 0 ||
        as_ssize(args[4], &n) < 0 || as_u64(args[5], &hash) < 0 ||
        as_u64(args[6], &code_mask) < 0)
        return NULL;
    if (count <= 0 || (count & (count - 1))) {
        PyErr_SetString(PyExc_ValueError, "count must be a power of two");
        return NULL;
    }
    uint64_t *states = words(self, args[0], count);
    uint64_t *hashes = states ? words(self, args[1], count) : NULL;
    if (hashes == NULL)
        return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    Py_ssize_t mask = count - 1;
    if (n > count)
        n = count;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t idx = (start + i) & mask;
        uint64_t w = __atomic_load_n(&states[idx], __ATOMIC_ACQUIRE);
        if (!((code_mask >> (w & 0xF)) & 1))
            continue;
        if (__atomic_load_n(&hashes[idx], __ATOMIC_ACQUIRE) != hash)
            continue;
        PyObject *v = PyLong_FromSsize_t(idx);
        if (v == NULL || PyList_Append(out, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(v);
    }
    return out;
}

/* find_code(states_off, count, start, n, code_mask) -> index or -1
 *
 * The first of n slots from `start` (wrapping at count) whose state code is in
 * code_mask. */
static PyObject *
view_find_code(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(5, "find_code");
    Py_ssize_t count, start, n;
    uint64_t code_mask;
    if (as_ssize(args[1], &count) < 0 || as_ssize(args[2], &start) < 0 ||
        as_ssize(args[3], &n) < 0 || as_u64(args[4], &code_mask) < 0)
        return NULL;
    if (count <= 0) {
        PyErr_SetString(PyExc_ValueError, "count must be positive");
        return NULL;
    }
    uint64_t *states = words(self, args[0], count);
    if (states == NULL)
        return NULL;
    if (n > count)
        n = count;
    Py_ssize_t idx = ((start % count) + count) % count;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t w = __atomic_load_n(&states[idx], __ATOMIC_ACQUIRE);
        if ((code_mask >> (w & 0xF)) & 1)
            return PyLong_FromSsize_t(idx);
        if (++idx == count)
            idx = 0;
    }
    return PyLong_FromLong(-1);
}

/* find_u64(off, count, start, value) -> the first index from start (wrapping)
 * whose word equals value, or -1. */
static PyObject *
view_find_u64(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(4, "find_u64");
    Py_ssize_t count, start;
    uint64_t value;
    if (as_ssize(args[1], &count) < 0 || as_ssize(args[2], &start) < 0 ||
        as_u64(args[3], &value) < 0)
        return NULL;
    if (count <= 0)
        return PyLong_FromLong(-1);
    uint64_t *w = words(self, args[0], count);
    if (w == NULL)
        return NULL;
    Py_ssize_t idx = ((start % count) + count) % count;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (__atomic_load_n(&w[idx], __ATOMIC_ACQUIRE) == value)
            return PyLong_FromSsize_t(idx);
        if (++idx == count)
            idx = 0;
    }
    return PyLong_FromLong(-1);
}

/* scan_codes(states_off, count, code_mask) -> [(index, word), ...] in index order. */
static PyObject *
view_scan_codes(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(3, "scan_codes");
    Py_ssize_t count;
    uint64_t code_mask;
    if (as_ssize(args[1], &count) < 0 || as_u64(args[2], &code_mask) < 0)
        return NULL;
    uint64_t *states = words(self, args[0], count);
    if (states == NULL)
        return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t w = __atomic_load_n(&states[i], __ATOMIC_ACQUIRE);
        if (!((code_mask >> (w & 0xF)) & 1))
            continue;
        PyObject *pair = Py_BuildValue("(nK)", i, (unsigned long long)w);
        if (pair == NULL || PyList_Append(out, pair) < 0) {
            Py_XDECREF(pair);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(pair);
    }
    return out;
}

/* scan_f64(states_off, count, code_mask, base, stride, off0, off1, limit, above)
 *     -> [(index, word), ...]
 *
 * Slots whose state code is in code_mask and whose f64 field passes the test:
 * `> limit` when `above`, else `<= limit`. Slot i's field is at
 * base + stride * i + (off1 if bit 8 of its word (the current record copy) is
 * set, else off0). A torn value only makes a candidate; the caller confirms. */
static PyObject *
view_scan_f64(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(9, "scan_f64");
    Py_ssize_t count, base, stride, off0, off1;
    uint64_t code_mask;
    if (as_ssize(args[1], &count) < 0 || as_u64(args[2], &code_mask) < 0 ||
        as_ssize(args[3], &base) < 0 || as_ssize(args[4], &stride) < 0 ||
        as_ssize(args[5], &off0) < 0 || as_ssize(args[6], &off1) < 0)
        return NULL;
    double limit = PyFloat_AsDouble(args[7]);
    if (limit == -1.0 && PyErr_Occurred())
        return NULL;
    int above = PyObject_IsTrue(args[8]);
    if (above < 0)
        return NULL;
    uint64_t *states = words(self, args[0], count);
    if (states == NULL)
        return NULL;
    /* The last slot's field must end inside the buffer. */
    Py_ssize_t far = off0 > off1 ? off0 : off1;
    Py_ssize_t room = self->view.len - 8;
    if (base < 0 || stride <= 0 || off0 < 0 || off1 < 0 || base > room || far > room - base ||
        (count > 0 && (count - 1) > (room - base - far) / stride)) {
        PyErr_SetString(PyExc_ValueError, "scan_f64: the fields do not fit the buffer");
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    const char *buf = (const char *)self->view.buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t w = __atomic_load_n(&states[i], __ATOMIC_ACQUIRE);
        if (!((code_mask >> (w & 0xF)) & 1))
            continue;
        double v;
        memcpy(&v, buf + base + stride * i + ((w >> 8) & 1 ? off1 : off0), sizeof v);
        if (above ? !(v > limit) : !(v <= limit))
            continue;
        PyObject *pair = Py_BuildValue("(nK)", i, (unsigned long long)w);
        if (pair == NULL || PyList_Append(out, pair) < 0) {
            Py_XDECREF(pair);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(pair);
    }
    return out;
}

static PyObject *
view_release(ViewObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->held) {
        PyBuffer_Release(&self->view);
        self->held = 0;
    }
    Py_RETURN_NONE;
}

static PyMethodDef view_methods[] = {
    {"load64", (PyCFunction)(void (*)(void))view_load64, METH_FASTCALL, "load64(off) -> int"},
    {"store64", (PyCFunction)(void (*)(void))view_store64, METH_FASTCALL,
     "store64(off, value): a sequentially consistent store"},
    {"cas64", (PyCFunction)(void (*)(void))view_cas64, METH_FASTCALL,
     "cas64(off, expected, desired) -> the value found (success iff == expected)"},
    {"add64", (PyCFunction)(void (*)(void))view_add64, METH_FASTCALL,
     "add64(off, delta) -> the value before"},
    {"load32", (PyCFunction)(void (*)(void))view_load32, METH_FASTCALL, "load32(off) -> int"},
    {"max32", (PyCFunction)(void (*)(void))view_max32, METH_FASTCALL,
     "max32(off, value) -> the value before; raises the word to at least value"},
    {"find_hash", (PyCFunction)(void (*)(void))view_find_hash, METH_FASTCALL,
     "find_hash(states_off, hashes_off, count, start, n, hash, code_mask) -> [index]"},
    {"find_code", (PyCFunction)(void (*)(void))view_find_code, METH_FASTCALL,
     "find_code(states_off, count, start, n, code_mask) -> index or -1"},
    {"find_u64", (PyCFunction)(void (*)(void))view_find_u64, METH_FASTCALL,
     "find_u64(off, count, start, value) -> index or -1"},
    {"scan_codes", (PyCFunction)(void (*)(void))view_scan_codes, METH_FASTCALL,
     "scan_codes(states_off, count, code_mask) -> [(index, word)]"},
    {"scan_f64", (PyCFunction)(void (*)(void))view_scan_f64, METH_FASTCALL,
     "scan_f64(states_off, count, code_mask, base, stride, off0, off1, limit, above)"
     " -> [(index, word)]"},
    {"release", (PyCFunction)view_release, METH_NOARGS,
     "release(): drop the buffer export (before closing the mmap)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ViewType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shm._atomic.View",
    .tp_basicsize = sizeof(ViewObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "View(buffer): atomics on a writable, 8-byte aligned buffer",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)view_init,
    .tp_dealloc = (destructor)view_dealloc,
    .tp_methods = view_methods,
};

static struct PyModuleDef atomic_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "shm._atomic",
    .m_doc = "64-bit atomics on shared memory for the lease table.",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__atomic(void)
{
    if (PyType_Ready(&ViewType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&atomic_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&ViewType);
    if (PyModule_AddObject(m, "View", (PyObject *)&ViewType) < 0) {
        Py_DECREF(&ViewType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
