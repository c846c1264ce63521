/* shm._atomic's scans of the lease table (find_hash, find_code, find_u64,
 * scan_codes, code_counts, scan_f64): the same loops in Python cost about
 * 0.3 us a slot, and a probe for a free slot in a nearly full table may have
 * to visit all of them (shm/_atomic.c). */

#include "_atomic.h"

/* find_hash(states_off, hashes_off, count, start, n, hash, code_mask) -> [index, ...]
 *
 * Visits n slots from `start` (wrapping at count, a power of two) and lists
 * those whose state code (low 4 bits) is in code_mask and whose hash equals
 * `hash`. The caller confirms each candidate under the slot's state word. */
PyObject *
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
PyObject *
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
PyObject *
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
PyObject *
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

/* code_counts(states_off, count, updating_code) -> [n of code 0, ..., n of code 15]
 *
 * How many slots are in each state, in one pass over the state words. A slot
 * whose code is updating_code counts as the code it was (bits 4-7, `prev`):
 * its current record still stands, as the lease table's scans read it. */
PyObject *
view_code_counts(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(3, "code_counts");
    Py_ssize_t count;
    uint64_t updating;
    if (as_ssize(args[1], &count) < 0 || as_u64(args[2], &updating) < 0)
        return NULL;
    uint64_t *states = words(self, args[0], count);
    if (states == NULL)
        return NULL;
    Py_ssize_t n[16] = {0};
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t w = __atomic_load_n(&states[i], __ATOMIC_ACQUIRE);
        uint64_t code = w & 0xF;
        if (code == updating)
            code = (w >> 4) & 0xF;
        n[code]++;
    }
    PyObject *out = PyList_New(16);
    if (out == NULL)
        return NULL;
    for (int c = 0; c < 16; c++) {
        PyObject *v = PyLong_FromSsize_t(n[c]);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, c, v);
    }
    return out;
}

/* scan_f64(states_off, count, code_mask, base, stride, off0, off1, limit, above
 *          [, rest_min])
 *     -> [(index, word), ...]  or, with rest_min true, ([...], least)
 *
 * Slots whose state code is in code_mask and whose f64 field passes the test:
 * `> limit` when `above`, else `<= limit`. Slot i's field is at
 * base + stride * i + (off1 if bit 8 of its word (the current record copy) is
 * set, else off0). A torn value only makes a candidate; the caller confirms.
 * `least` is the smallest field of the slots in code_mask that did not pass
 * (inf if none): the lease table's next expiry (LeaseTable.expire). */
/* scan_f64 prefetches the fields of this many slots at a time. */
#define SCAN_RUN 64

PyObject *
view_scan_f64(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 9 && nargs != 10) {
        PyErr_Format(PyExc_TypeError, "scan_f64() takes 9 or 10 arguments (%zd given)", nargs);
        return NULL;
    }
    int rest_min = 0;
    if (nargs == 10 && (rest_min = PyObject_IsTrue(args[9])) < 0)
        return NULL;
    double least = Py_HUGE_VAL;
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
        /* The fields lie a slot apart (cache misses): ask for the next run's
           lines first, so that their misses overlap (a hint, nothing read). */
        if (i % SCAN_RUN == 0) {
            for (Py_ssize_t j = i; j < count && j < i + SCAN_RUN; j++) {
                uint64_t a = __atomic_load_n(&states[j], __ATOMIC_RELAXED);
                if ((code_mask >> (a & 0xF)) & 1)
                    __builtin_prefetch(buf + base + stride * j +
                                       ((a >> WORD_COPY_SHIFT) & 1 ? off1 : off0));
            }
        }
        uint64_t w = __atomic_load_n(&states[i], __ATOMIC_ACQUIRE);
        if (!((code_mask >> (w & 0xF)) & 1))
            continue;
        double v;
        memcpy(&v, buf + base + stride * i + ((w >> WORD_COPY_SHIFT) & 1 ? off1 : off0), sizeof v);
        if (above ? !(v > limit) : !(v <= limit)) {
            if (v < least)
                least = v;
            continue;
        }
        PyObject *pair = Py_BuildValue("(nK)", i, (unsigned long long)w);
        if (pair == NULL || PyList_Append(out, pair) < 0) {
            Py_XDECREF(pair);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(pair);
    }
    if (rest_min)
        return Py_BuildValue("(Nd)", out, least);
    return out;
}
