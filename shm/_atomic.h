/* shm._atomic's pieces, shared between its C files: shm/_atomic.c (the module,
 * the View type and its single-word atomics), shm/_atomic_scan.c (the lease
 * table's scans), shm/_atomic_excluded.c (the keeper's excluded keys) and
 * shm/_atomic_seq.c (seqlocks, publication, the ready set's entry writer).
 * What each gives and why: shm/_atomic.c. The offsets are shm/layout.h's.
 *
 * The helpers below are static inline, a copy in each file: an argument
 * check costs what it did when the module was one file. */

#ifndef QUEUE_NODE_ATOMIC_H
#define QUEUE_NODE_ATOMIC_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_key_column.h"
#include "_publish.h"
#include "layout.h"

#define INTERNAL __attribute__((visibility("hidden")))

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int held;
} ViewObject;

/* The address of `width` bytes at `off`, or NULL with an exception set. */
static inline char *
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
static inline uint64_t *
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

static inline int
as_u64(PyObject *obj, uint64_t *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = (uint64_t)v;
    return 0;
}

static inline int
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

/* The methods and module functions defined outside shm/_atomic.c, for its
   tables. */
INTERNAL PyObject *view_find_hash(ViewObject *self, PyObject *const *args, Py_ssize_t nargs);
INTERNAL PyObject *view_find_code(ViewObject *self, PyObject *const *args, Py_ssize_t nargs);
INTERNAL PyObject *view_find_u64(ViewObject *self, PyObject *const *args, Py_ssize_t nargs);
INTERNAL PyObject *view_scan_codes(ViewObject *self, PyObject *const *args, Py_ssize_t nargs);
INTERNAL PyObject *view_code_counts(ViewObject *self, PyObject *const *args, Py_ssize_t nargs);
INTERNAL PyObject *view_scan_f64(ViewObject *self, PyObject *const *args, Py_ssize_t nargs);
INTERNAL PyObject *view_excluded_keys(ViewObject *self, PyObject *const *args, Py_ssize_t nargs);
INTERNAL PyObject *view_write_entries(ViewObject *self, PyObject *const *args, Py_ssize_t nargs);
INTERNAL PyObject *view_write_gathered(ViewObject *self, PyObject *const *args, Py_ssize_t nargs);
INTERNAL PyObject *view_check32(ViewObject *self, PyObject *const *args, Py_ssize_t nargs);
INTERNAL PyObject *view_check64(ViewObject *self, PyObject *const *args, Py_ssize_t nargs);
INTERNAL PyObject *view_begin32(ViewObject *self, PyObject *const *args, Py_ssize_t nargs);
INTERNAL PyObject *view_release32(ViewObject *self, PyObject *const *args, Py_ssize_t nargs);
INTERNAL PyObject *view_read_slot(ViewObject *self, PyObject *const *args, Py_ssize_t nargs);
INTERNAL PyObject *mod_acquire32(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
INTERNAL PyObject *mod_acquire64(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
INTERNAL PyObject *mod_release32(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
INTERNAL PyObject *mod_seq_copy(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
INTERNAL PyObject *mod_seq_write(PyObject *m, PyObject *const *args, Py_ssize_t nargs);

#endif
