/* shm._atomic: 64-bit atomics on a shared-memory mapping, for shm/leases.py.
 *
 * Python has no compare-and-swap on shared memory. This module gives the lease
 * table the few it needs, as methods of a View that holds a writable buffer
 * export of an mmap for its lifetime (so the mapping cannot be unmapped under
 * it; release() drops the export before mmap.close()).
 *
 * Every read-modify-write is sequentially consistent (on x86_64 a LOCK'd
 * instruction, a full barrier; on aarch64 LDAXR/STLXR or CASAL); load32 and
 * load64 are sequentially consistent too (the seal's Dekker check needs its
 * load ordered after the taker's swap; on x86_64 and aarch64 it costs what an
 * acquire load does). A successful cas64 is followed by a release fence: the
 * stores a taker makes after it are not seen before it. The seqlock and
 * publication functions below (check32, check64, begin32, release32,
 * read_slot, and the module functions acquire32, acquire64, release32,
 * seq_copy, seq_write) carry the fences the Python readers and writers of
 * the lease table, ready set and state buffer need on a weakly ordered CPU
 * (aarch64): CPython's struct module is plain memcpy, no fences. Why each is
 * enough: docs/shm.md, "Memory ordering". Offsets are byte offsets
 * into the buffer, checked for bounds and natural alignment on every call: a
 * bad offset is a ValueError, never a stray write into someone's memory.
 *
 * The scans (find_hash, find_code, scan_codes, scan_f64, find_u64, code_counts)
 * exist because the same loops in Python cost about 0.3 us a slot, and a probe
 * for a free slot in a nearly full table may have to visit all of them;
 * code_counts is what every GET /queue-state asks of the table. excluded_keys reads
 * and decodes the keeper's excluded keys in one pass (about 1 us a key in
 * Python).
 *
 * publish_counted is the lease table's counted publish (a state change and
 * its lifetime count as one step a kill cannot split; shm/_claim.h, shared
 * with the C grant). A build with -DQUEUE_NODE_TEST_STOPS honours its test
 * stop; the production build compiles it out.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>

#include "_claim.h"

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
    return PyLong_FromUnsignedLongLong(__atomic_load_n(p, __ATOMIC_SEQ_CST));
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
    if (__atomic_compare_exchange_n(p, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        /* A take (a lease slot to UPDATING): the record the caller writes
           next must not be seen before the swap (write_seqcount_begin's
           smp_wmb). Free on x86_64; DMB ISH on aarch64. */
        __atomic_thread_fence(__ATOMIC_RELEASE);
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
    return PyLong_FromUnsignedLong(__atomic_load_n(p, __ATOMIC_SEQ_CST));
}

/* store32(off, value): a sequentially consistent store, then a full fence:
   no load of the caller's after it is read before the store is seen (the
   lease table's seal, a Dekker-style flag). */
static PyObject *
view_store32(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(2, "store32");
    uint64_t v;
    uint32_t *p = (uint32_t *)at(self, args[0], 4);
    if (p == NULL || as_u64(args[1], &v) < 0)
        return NULL;
    if (v > UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "store32 value does not fit in 32 bits");
        return NULL;
    }
    __atomic_store_n(p, (uint32_t)v, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

/* publish_counted(states_off, idx, own, new, shard_off, k, stop) -> bool
 *
 * Swap slot idx's state word from `own` (held by this process) to `new` and
 * count it in counter k of the 64-byte counter shard at shard_off, with the
 * shard's journal around the swap (lease_publish_counted in shm/_claim.h).
 * False when the word was not `own` (nothing published, nothing counted).
 * stop: a test stop, honoured by the test build only. */
static PyObject *
view_publish_counted(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(7, "publish_counted");
    Py_ssize_t idx, k;
    uint64_t own, new_word;
    if (as_ssize(args[1], &idx) < 0 || as_u64(args[2], &own) < 0 ||
        as_u64(args[3], &new_word) < 0 || as_ssize(args[5], &k) < 0)
        return NULL;
    int stop = (int)PyLong_AsLong(args[6]);
    if (stop == -1 && PyErr_Occurred())
        return NULL;
    if (k < COUNT_GRANTS || k > COUNT_LATE_RELEASED || idx < 0 || idx >= (1 << 22)) {
        PyErr_SetString(PyExc_ValueError, "publish_counted(): counter or slot out of range");
        return NULL;
    }
    uint64_t *states = words(self, args[0], idx + 1);
    uint64_t *shard = states ? words(self, args[4], 8) : NULL;
    if (shard == NULL)
        return NULL;
    if (((char *)shard - (char *)self->view.buf) % 64) {
        PyErr_SetString(PyExc_ValueError, "publish_counted(): a shard is 64-byte aligned");
        return NULL;
    }
    int done = lease_publish_counted(&states[idx], idx, own, new_word, (char *)shard, (int)k, stop);
    return PyBool_FromLong(done);
}

/* shard_counts(off, n) -> ([sum of count 1, ..., sum of count 6], [index of a
 * shard whose journal is set])
 *
 * The lease table's counter shards 0..n-1 from `off` (64 bytes each: owner,
 * counts 1..6, journal), summed in one pass. A set journal is a publish in
 * progress, or one a dead process left uncounted: the caller settles those. */
static PyObject *
view_shard_counts(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(2, "shard_counts");
    Py_ssize_t n;
    if (as_ssize(args[1], &n) < 0)
        return NULL;
    if (n < 0 || n > PY_SSIZE_T_MAX / 8) {
        PyErr_SetString(PyExc_ValueError, "shard_counts(): bad shard count");
        return NULL;
    }
    uint64_t *w = words(self, args[0], 8 * n);
    if (w == NULL)
        return NULL;
    uint64_t sums[7] = {0};
    PyObject *pending = PyList_New(0);
    if (pending == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t *shard = w + 8 * i;
        /* The journal first: a count it names is then either in the sum or
           still to be settled. */
        uint64_t journal = __atomic_load_n(&shard[SHARD_JOURNAL / 8], __ATOMIC_ACQUIRE);
        for (int k = COUNT_GRANTS; k <= COUNT_LATE_RELEASED; k++)
            sums[k] += __atomic_load_n(&shard[k], __ATOMIC_ACQUIRE);
        if (journal) {
            PyObject *v = PyLong_FromSsize_t(i);
            if (v == NULL || PyList_Append(pending, v) < 0) {
                Py_XDECREF(v);
                Py_DECREF(pending);
                return NULL;
            }
            Py_DECREF(v);
        }
    }
    PyObject *out = PyList_New(COUNT_LATE_RELEASED);
    if (out == NULL) {
        Py_DECREF(pending);
        return NULL;
    }
    for (int k = COUNT_GRANTS; k <= COUNT_LATE_RELEASED; k++) {
        PyObject *v = PyLong_FromUnsignedLongLong(sums[k]);
        if (v == NULL) {
            Py_DECREF(out);
            Py_DECREF(pending);
            return NULL;
        }
        PyList_SET_ITEM(out, k - 1, v);
    }
    return Py_BuildValue("(NN)", out, pending);
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

/* code_counts(states_off, count, updating_code) -> [n of code 0, ..., n of code 15]
 *
 * How many slots are in each state, in one pass over the state words. A slot
 * whose code is updating_code counts as the code it was (bits 4-7, `prev`):
 * its current record still stands, as the lease table's scans read it. */
static PyObject *
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

static PyObject *
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
                    __builtin_prefetch(buf + base + stride * j + ((a >> 8) & 1 ? off1 : off0));
            }
        }
        uint64_t w = __atomic_load_n(&states[i], __ATOMIC_ACQUIRE);
        if (!((code_mask >> (w & 0xF)) & 1))
            continue;
        double v;
        memcpy(&v, buf + base + stride * i + ((w >> 8) & 1 ? off1 : off0), sizeof v);
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

/* excluded_keys(states_off, count, slots_off, slot_size, key_at, inline_key,
 *               held_off0, held_off1, blocks_off, block_size, long_blocks,
 *               now, always_mask, held_mask, retries, cache)
 *     -> (set of str, [index, ...])
 *
 * The keeper's filter in one pass: the keys of the slots whose state code is
 * in always_mask, or in held_mask with the current record's f64 at held_off0
 * (copy 0, bit 8 of the word clear) or held_off1 (copy 1) above `now`. Slot i
 * starts at slots_off + slot_size * i and begins with key_len (u16 at +0, UTF-8
 * bytes) and block (u32 at +4: overflow block index + 1, 0 none); the key's
 * first inline_key bytes are at key_at, the rest at the start of block
 * (blocks_off + block_size * (block - 1)), block_size bytes at most.
 *
 * Each slot is read seqlock style: word, record field and key bytes, then the
 * word again; a slot whose word changed is read again under its new word, up
 * to `retries` reads. Keys are decoded (strict UTF-8) only from consistent
 * reads. The list names the slots that kept changing, or whose key did not
 * read as valid (length or block out of range) under a steady word: the caller
 * settles those one by one.
 *
 * `cache` is None or a list of `count` items that this function owns between
 * calls: item i is the str last decoded from slot i while it was excluded, or
 * None. A slot whose bytes equal its cached str's UTF-8 gives that str again
 * (no decoding, its hash already computed); any other slot's item is replaced
 * (or set to None), so the cache holds no more than the last answer.
 *
 * Changes mode: with a 17th argument `seen` (a writable buffer of `count`
 * u64, the word each slot had when last settled; all ones: never) and a
 * cache, the answer is (added, removed, unsettled, hinted): the strs of keys
 * that became excluded since the last call and of those that no longer are
 * (the cache's old items); the first `hinted` of added are strs of the hints'
 * key lists (settled from grant records, below). A slot whose word equals seen[i] has made no transition
 * since (every transition bumps the word's seq), so only a held slot, whose
 * exclusion ends with time, is looked at again: the cost follows the slots
 * that changed, not the keys excluded. An unsettled slot gets seen[i] = all
 * ones and its cache item untouched, for the caller to settle and update.
 *
 * With an 18th argument `counts`, (held, extra): a set of the keys some
 * slot's cache item holds, and a dict of how many more slots than one hold
 * each key held by several, both owned by the caller and kept in step here
 * (a set's entries hold their hashes: a key not in it costs one cache line
 * to look up, where a big dict's lookup reads its index, entry and key): a
 * key is in `added` only when no slot held it before, and in `removed` only
 * when, at the end of the scan, no slot holds it any more.
 * A key keyed in two slots for a moment (two inserts racing, one backing off)
 * or moved to another slot is then reported neither way: it stays excluded.
 *
 * With a 19th argument `hints`, a tuple of up to four (records, keys, n,
 * tag, leased, seq_shift), one a published set (the keeper's active and
 * retiring sets): grant records a claimer wrote (shm/ready.py's layout: u64 each, lease slot
 * + 1 in bits 0-22, the word's copy bit at 23 and seq at 24-43, `tag` at
 * 44-63) for keys[0:n], read before the scan. A record whose tag matches and
 * whose slot still has the word it names (code `leased`, that copy and seq:
 * no transition since the grant) settles that slot with keys[j] itself, as
 * if its bytes had been read: no read of the slot, no decoding, and the
 * caller's own str (its hash known) in `added`. Any other record is passed
 * over, and its slot read as usual. Needs changes mode and counts. */
static int
same_key(PyObject *str, const char *key, Py_ssize_t key_len)
{
    if (!PyUnicode_CheckExact(str))
        return 0;
    if (PyUnicode_IS_COMPACT_ASCII(str))
        return PyUnicode_GET_LENGTH(str) == key_len &&
               memcmp(PyUnicode_DATA(str), key, key_len) == 0;
    Py_ssize_t n;
    const char *utf8 = PyUnicode_AsUTF8AndSize(str, &n);
    if (utf8 == NULL) {
        PyErr_Clear(); /* not comparable: decode afresh */
        return 0;
    }
    return n == key_len && memcmp(utf8, key, key_len) == 0;
}

/* cache[i] = item (a new reference is taken). The item dropped must be None or
 * an exact str, whose release runs no Python code that could change the cache
 * or the view under the scan; anything else is a TypeError. */
static int
cache_put(PyObject *cache, Py_ssize_t i, PyObject *item)
{
    PyObject *old = PyList_GET_ITEM(cache, i);
    if (old != Py_None && !PyUnicode_CheckExact(old)) {
        PyErr_SetString(PyExc_TypeError, "excluded_keys: the cache holds something not a str");
        return -1;
    }
    Py_INCREF(item);
    PyList_SET_ITEM(cache, i, item);
    Py_DECREF(old);
    return 0;
}

/* Slot i, under word w, holds no excluded key: its cached key (if any) has
   left (into removed, in changes mode) and the slot is settled under w. */
static int
settle_out(PyObject *cache, PyObject *removed, uint64_t *seen, Py_ssize_t i, uint64_t w)
{
    if (cache != NULL && PyList_GET_ITEM(cache, i) != Py_None) {
        if (removed != NULL && PyList_Append(removed, PyList_GET_ITEM(cache, i)) < 0)
            return -1;
        if (cache_put(cache, i, Py_None) < 0)
            return -1;
    }
    if (seen != NULL)
        seen[i] = w;
    return 0;
}

/* The caller's counts (see excluded_keys): the keys held, and how many more
   slots than one hold a key held by several. */
typedef struct {
    PyObject *held;  /* set */
    PyObject *extra; /* dict: str -> int >= 1 */
} Counts;

/* One more slot holds str; str goes into added if none did. The counts are
   small ints, which CPython keeps as shared objects: nothing the garbage
   collector tracks is allocated here. */
static int
count_added(const Counts *counts, PyObject *added, PyObject *str)
{
    int has = PySet_Contains(counts->held, str);
    if (has < 0)
        return -1;
    if (!has)
        return PySet_Add(counts->held, str) < 0 ? -1 : PyList_Append(added, str);
    PyObject *n = PyDict_GetItemWithError(counts->extra, str);
    long v = 0;
    if (n == NULL && PyErr_Occurred())
        return -1;
    if (n != NULL && (v = PyLong_AsLong(n)) == -1 && PyErr_Occurred())
        return -1;
    PyObject *more = PyLong_FromLong(v + 1);
    if (more == NULL)
        return -1;
    int rc = PyDict_SetItem(counts->extra, str, more);
    Py_DECREF(more);
    return rc;
}

/* One slot fewer holds each str that left a slot's cache item; *removed is
   replaced by the list of those no slot holds any more (taken out of the
   counts). A str the counts never held (a cache filled before the counts
   were) counts as held once. */
static int
count_removed(const Counts *counts, PyObject **removed)
{
    PyObject *gone = PyList_New(0);
    if (gone == NULL)
        return -1;
    Py_ssize_t n = PyList_GET_SIZE(*removed);
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *str = PyList_GET_ITEM(*removed, j);
        long v = 0;
        if (PyDict_GET_SIZE(counts->extra)) {
            PyObject *c = PyDict_GetItemWithError(counts->extra, str);
            if (c == NULL && PyErr_Occurred())
                goto fail;
            if (c != NULL && (v = PyLong_AsLong(c)) == -1 && PyErr_Occurred())
                goto fail;
        }
        if (v > 1) {
            PyObject *less = PyLong_FromLong(v - 1);
            if (less == NULL)
                goto fail;
            int rc = PyDict_SetItem(counts->extra, str, less);
            Py_DECREF(less);
            if (rc < 0)
                goto fail;
            continue;
        }
        if (v == 1) {
            if (PyDict_DelItem(counts->extra, str) < 0)
                goto fail;
            continue; /* another slot still holds it */
        }
        if (PySet_Discard(counts->held, str) < 0)
            goto fail;
        if (PyList_Append(gone, str) < 0)
            goto fail;
    }
    Py_SETREF(*removed, gone);
    return 0;
fail:
    Py_DECREF(gone);
    return -1;
}

/* The scan gathers up to CANDIDATE_RUN candidates, then reads them with
   their lines asked for PREFETCH_DEPTH candidates ahead. */
#define CANDIDATE_RUN 512
#define PREFETCH_DEPTH 8

/* One of excluded_keys's hints (see there), as parsed. */
#define MAX_HINTS 4
typedef struct {
    PyObject *records, *keys; /* borrowed from the hints tuple */
    Py_ssize_t n, leased, shift;
    uint64_t tag;
} Hint;

/* excluded_keys's hints (see there): settle the slots the grant records name
   whose word has not moved since the grant, with the caller's keys. */
static int
settle_hinted(const uint64_t *states, Py_ssize_t count, uint64_t *seen, PyObject *cache,
              const Counts *counts, PyObject *added, PyObject *removed, const uint64_t *records,
              PyObject *keys, Py_ssize_t n, uint64_t tag, uint64_t leased, int seq_shift)
{
    for (Py_ssize_t j = 0; j < n; j++) {
        if (j + PREFETCH_DEPTH < n) {
            uint64_t ahead = __atomic_load_n(&records[j + PREFETCH_DEPTH], __ATOMIC_RELAXED);
            Py_ssize_t at = (Py_ssize_t)(ahead & 0x7FFFFF) - 1;
            if (ahead >> 44 == tag && at >= 0 && at < count) {
                __builtin_prefetch(&states[at]);
                __builtin_prefetch(&seen[at]);
                __builtin_prefetch(&((PyListObject *)cache)->ob_item[at]);
            }
        }
        uint64_t rec = __atomic_load_n(&records[j], __ATOMIC_ACQUIRE);
        Py_ssize_t i = (Py_ssize_t)(rec & 0x7FFFFF) - 1;
        if (rec >> 44 != tag || i < 0 || i >= count)
            continue; /* none, another publish's, or nonsense: the scan reads the slot */
        uint64_t want = leased | ((rec >> 23) & 1) << 8 | ((rec >> 24) & 0xFFFFF) << seq_shift;
        uint64_t w = __atomic_load_n(&states[i], __ATOMIC_ACQUIRE);
        if (w != want || seen[i] == w)
            continue; /* moved on since the grant (the scan reads it), or settled already */
        PyObject *str = PyList_GET_ITEM(keys, j);
        if (!PyUnicode_CheckExact(str)) {
            PyErr_SetString(PyExc_TypeError, "excluded_keys: a hint's key is not a str");
            return -1;
        }
        PyObject *old = PyList_GET_ITEM(cache, i);
        if (old != str) {
            int same = old != Py_None && PyUnicode_CheckExact(old) &&
                       PyUnicode_Compare(old, str) == 0;
            if (!same) {
                if (old != Py_None && PyList_Append(removed, old) < 0)
                    return -1;
                if (cache_put(cache, i, str) < 0 || count_added(counts, added, str) < 0)
                    return -1;
            }
        }
        seen[i] = w;
    }
    return 0;
}


static PyObject *
view_excluded_keys(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 16 || nargs > 19) {
        PyErr_Format(PyExc_TypeError, "excluded_keys() takes 16 to 19 arguments (%zd given)",
                     nargs);
        return NULL;
    }
    Py_ssize_t count, slots_off, slot_size, key_at, inline_key, held0, held1;
    Py_ssize_t blocks_off, block_size, long_blocks, retries;
    uint64_t always_mask, held_mask;
    if (as_ssize(args[1], &count) < 0 || as_ssize(args[2], &slots_off) < 0 ||
        as_ssize(args[3], &slot_size) < 0 || as_ssize(args[4], &key_at) < 0 ||
        as_ssize(args[5], &inline_key) < 0 || as_ssize(args[6], &held0) < 0 ||
        as_ssize(args[7], &held1) < 0 || as_ssize(args[8], &blocks_off) < 0 ||
        as_ssize(args[9], &block_size) < 0 || as_ssize(args[10], &long_blocks) < 0 ||
        as_u64(args[12], &always_mask) < 0 || as_u64(args[13], &held_mask) < 0 ||
        as_ssize(args[14], &retries) < 0)
        return NULL;
    double now = PyFloat_AsDouble(args[11]);
    if (now == -1.0 && PyErr_Occurred())
        return NULL;
    if (inline_key < 0 || block_size < 0 || inline_key + block_size > 0xFFFF) {
        PyErr_SetString(PyExc_ValueError, "excluded_keys: keys are at most 65,535 bytes");
        return NULL;
    }
    Py_ssize_t max_key = inline_key + block_size;
    int changes = nargs >= 17 && args[16] != Py_None;
    Counts counts_pair = {NULL, NULL};
    const Counts *counts = NULL;
    if (nargs >= 18 && args[17] != Py_None) {
        PyObject *c = args[17];
        if (!changes || !PyTuple_CheckExact(c) || PyTuple_GET_SIZE(c) != 2 ||
            !PySet_CheckExact(PyTuple_GET_ITEM(c, 0)) ||
            !PyDict_CheckExact(PyTuple_GET_ITEM(c, 1))) {
            PyErr_SetString(PyExc_ValueError,
                            "excluded_keys: counts is (set, dict), with seen");
            return NULL;
        }
        counts_pair.held = PyTuple_GET_ITEM(c, 0);
        counts_pair.extra = PyTuple_GET_ITEM(c, 1);
        counts = &counts_pair;
    }
    /* hints: a tuple of up to MAX_HINTS (records, keys, n, tag, leased,
       seq_shift), one a published set whose records may name slots. */
    Hint hint[MAX_HINTS];
    Py_ssize_t hint_count = 0;
    PyObject *hints = nargs == 19 && args[18] != Py_None ? args[18] : NULL;
    if (hints != NULL) {
        if (counts == NULL || !PyTuple_CheckExact(hints) || PyTuple_GET_SIZE(hints) > MAX_HINTS) {
            PyErr_SetString(PyExc_ValueError,
                            "excluded_keys: hints are a tuple of at most 4 (records, keys, n, "
                            "tag, leased, seq_shift), with counts");
            return NULL;
        }
        for (Py_ssize_t h = 0; h < PyTuple_GET_SIZE(hints); h++) {
            Hint *x = &hint[hint_count];
            PyObject *one = PyTuple_GET_ITEM(hints, h);
            if (!PyTuple_CheckExact(one) ||
                !PyArg_ParseTuple(one, "OO!nKnn", &x->records, &PyList_Type, &x->keys, &x->n,
                                  &x->tag, &x->leased, &x->shift)) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_ValueError,
                                    "excluded_keys: a hint is (records, keys, n, tag, leased, "
                                    "seq_shift)");
                return NULL;
            }
            if (x->leased < 0 || x->leased > 15 || !((always_mask >> x->leased) & 1) ||
                x->shift < 9 || x->shift > 44 || x->n < 0 || x->n > PyList_GET_SIZE(x->keys)) {
                PyErr_SetString(PyExc_ValueError, "excluded_keys: hints out of range");
                return NULL;
            }
            hint_count++;
        }
    }
    /* Allocate first: from here on the scan allocates no object the garbage
       collector tracks, so no finalizer can run and change the cache or
       release the view between the checks below and the end of the scan
       (count_removed's list comes after it). */
    Py_buffer seen_view = {0}, records_view = {0};
    uint64_t *seen = NULL;
    PyObject *removed = NULL;
    char *key = PyMem_Malloc(max_key > 0 ? max_key : 1);
    PyObject *keys = changes ? PyList_New(0) : PySet_New(NULL);
    PyObject *unsettled = PyList_New(0);
    if (key == NULL || keys == NULL || unsettled == NULL) {
        if (key == NULL)
            PyErr_NoMemory();
        goto fail;
    }
    PyObject *cache = args[15] == Py_None ? NULL : args[15];
    if (cache != NULL && (!PyList_CheckExact(cache) || PyList_GET_SIZE(cache) != count)) {
        PyErr_SetString(PyExc_ValueError, "excluded_keys: cache is not None or a list of count");
        goto fail;
    }
    if (changes) {
        if (cache == NULL) {
            PyErr_SetString(PyExc_ValueError, "excluded_keys: changes need a cache");
            goto fail;
        }
        if (PyObject_GetBuffer(args[16], &seen_view, PyBUF_WRITABLE) < 0)
            goto fail;
        if (seen_view.len != count * 8 || ((uintptr_t)seen_view.buf) % 8) {
            PyBuffer_Release(&seen_view);
            seen_view.obj = NULL;
            PyErr_SetString(PyExc_ValueError, "excluded_keys: seen is not count aligned u64");
            goto fail;
        }
        seen = (uint64_t *)seen_view.buf;
        removed = PyList_New(0);
        if (removed == NULL)
            goto fail;
    }
    uint64_t *states = words(self, args[0], count);
    if (states == NULL)
        goto fail;
    Py_ssize_t len = self->view.len;
    /* Every slot (and its fields) and every block must lie inside the buffer. */
    if (slot_size < 8 || slots_off < 0 || slots_off > len || key_at < 8 ||
        key_at > slot_size - inline_key || held0 < 0 || held0 > slot_size - 8 || held1 < 0 ||
        held1 > slot_size - 8 || count > (len - slots_off) / slot_size ||
        blocks_off < 0 || blocks_off > len || long_blocks < 0 ||
        (block_size > 0 && long_blocks > (len - blocks_off) / block_size) || retries < 1) {
        PyErr_SetString(PyExc_ValueError, "excluded_keys: the layout does not fit the buffer");
        goto fail;
    }
    const char *buf = (const char *)self->view.buf;
    const char *slots = buf + slots_off;
    const char *blocks = buf + blocks_off;
    uint64_t wanted = always_mask | held_mask;
    uint32_t cand[CANDIDATE_RUN];
    Py_ssize_t hinted = 0; /* keys added from the hints: the first of `keys` */
    for (Py_ssize_t h = 0; h < hint_count; h++) {
        Hint *x = &hint[h];
        if (PyObject_GetBuffer(x->records, &records_view, PyBUF_SIMPLE) < 0)
            goto fail;
        if (records_view.len < x->n * 8 || ((uintptr_t)records_view.buf) % 8) {
            PyErr_SetString(PyExc_ValueError, "excluded_keys: records are not n aligned u64");
            goto fail;
        }
        if (settle_hinted(states, count, seen, cache, counts, keys, removed,
                          (const uint64_t *)records_view.buf, x->keys, x->n, x->tag,
                          (uint64_t)x->leased, (int)x->shift) < 0)
            goto fail;
        PyBuffer_Release(&records_view);
        records_view.obj = NULL;
        hinted = PyList_GET_SIZE(keys);
    }
    for (Py_ssize_t next = 0; next < count;) {
        /* Pass one, over the words in order: the slots worth a look, up to
           CANDIDATE_RUN of them. A slot with no transition since it was
           settled is passed over; one that is not a candidate is settled
           here (its cached key, if any, has left). */
        int n = 0;
        for (; next < count && n < CANDIDATE_RUN; next++) {
            Py_ssize_t i = next;
            uint64_t w = __atomic_load_n(&states[i], __ATOMIC_ACQUIRE);
            if (seen != NULL && w == seen[i] && !((held_mask >> (w & 0xF)) & 1))
                continue; /* no transition since it was settled: nothing changed */
            if ((wanted >> (w & 0xF)) & 1) {
                cand[n++] = (uint32_t)i;
                continue;
            }
            if (settle_out(cache, removed, seen, i, w) < 0)
                goto fail;
        }
        /* Pass two, over the candidates: they lie far apart in memory, so
           the lines of the one PREFETCH_DEPTH ahead are asked for before
           each is read, and their cache misses overlap. */
        for (int j = 0; j < n + PREFETCH_DEPTH; j++) {
            if (j < n) {
                Py_ssize_t ahead = cand[j];
                uint64_t a = __atomic_load_n(&states[ahead], __ATOMIC_RELAXED);
                const char *at = slots + slot_size * ahead;
                __builtin_prefetch(at);
                __builtin_prefetch(at + key_at + 48);
                if ((held_mask >> (a & 0xF)) & 1)
                    __builtin_prefetch(at + ((a >> 8) & 1 ? held1 : held0));
                if (cache != NULL) {
                    const char *str = (const char *)PyList_GET_ITEM(cache, ahead);
                    __builtin_prefetch(str);
                    __builtin_prefetch(str + 64);
                }
            }
            if (j < PREFETCH_DEPTH)
                continue;
            Py_ssize_t i = cand[j - PREFETCH_DEPTH];
            uint64_t w = __atomic_load_n(&states[i], __ATOMIC_ACQUIRE);
            int added = 0, settled = 0;
            const char *slot = slots + slot_size * i;
            for (Py_ssize_t attempt = 0; attempt < retries && !settled; attempt++) {
                uint64_t code = w & 0xF;
                if (!((wanted >> code) & 1)) {
                    settled = 1; /* not a candidate (any more) */
                    break;
                }
                int excluded = (int)((always_mask >> code) & 1);
                if (!excluded) {
                    double until;
                    memcpy(&until, slot + ((w >> 8) & 1 ? held1 : held0), sizeof until);
                    excluded = until > now;
                }
                uint16_t key_len = 0;
                uint32_t block = 0;
                int valid = 0;
                if (excluded) {
                    memcpy(&key_len, slot, sizeof key_len);
                    memcpy(&block, slot + 4, sizeof block);
                    if (key_len > 0 && key_len <= max_key) {
                        if (key_len <= inline_key) {
                            memcpy(key, slot + key_at, key_len);
                            valid = 1;
                        } else if (block > 0 && (Py_ssize_t)block <= long_blocks) {
                            memcpy(key, slot + key_at, inline_key);
                            memcpy(key + inline_key, blocks + block_size * (Py_ssize_t)(block - 1),
                                   key_len - inline_key);
                            valid = 1;
                        }
                    }
                }
                /* The reads above happen before the word is read again. */
                __atomic_thread_fence(__ATOMIC_ACQUIRE);
                uint64_t again = __atomic_load_n(&states[i], __ATOMIC_ACQUIRE);
                if (again != w) {
                    w = again; /* changed under the reads: read it again */
                    continue;
                }
                if (!excluded) {
                    settled = 1; /* a hold that has passed, read consistently */
                    break;
                }
                if (!valid)
                    break; /* a steady word over a key that does not read: the caller's */
                PyObject *str = NULL;
                int fresh = 0;
                if (cache != NULL) {
                    PyObject *old = PyList_GET_ITEM(cache, i);
                    if (old != Py_None && same_key(old, key, key_len)) {
                        str = old;
                        Py_INCREF(str);
                    }
                }
                if (str == NULL) {
                    str = PyUnicode_DecodeUTF8(key, key_len, NULL);
                    if (str == NULL)
                        goto fail;
                    fresh = 1;
                    PyObject *old = cache != NULL ? PyList_GET_ITEM(cache, i) : Py_None;
                    if (removed != NULL && old != Py_None && PyList_Append(removed, old) < 0) {
                        Py_DECREF(str);
                        goto fail;
                    }
                    if (cache != NULL && cache_put(cache, i, str) < 0) {
                        Py_DECREF(str);
                        goto fail;
                    }
                }
                int rc = 0;
                if (!changes)
                    rc = PySet_Add(keys, str);
                else if (fresh && counts != NULL)
                    rc = count_added(counts, keys, str);
                else if (fresh)
                    rc = PyList_Append(keys, str);
                if (seen != NULL)
                    seen[i] = w;
                Py_DECREF(str);
                if (rc < 0)
                    goto fail;
                settled = added = 1;
            }
            if (!added && settled) {
                /* read consistently and not excluded (any more) */
                if (settle_out(cache, removed, seen, i, w) < 0)
                    goto fail;
            } else if (!added && !changes && cache != NULL &&
                       PyList_GET_ITEM(cache, i) != Py_None && cache_put(cache, i, Py_None) < 0) {
                goto fail;
            }
            if (!settled && seen != NULL)
                seen[i] = ~(uint64_t)0; /* the caller settles it; look again next time */
            if (!settled) {
                PyObject *v = PyLong_FromSsize_t(i);
                if (v == NULL || PyList_Append(unsettled, v) < 0) {
                    Py_XDECREF(v);
                    goto fail;
                }
                Py_DECREF(v);
            }
        }
    }
    if (counts != NULL && count_removed(counts, &removed) < 0)
        goto fail;
    PyObject *hinted_obj = changes ? PyLong_FromSsize_t(hinted) : NULL;
    if (changes && hinted_obj == NULL)
        goto fail;
    if (records_view.obj != NULL)
        PyBuffer_Release(&records_view);
    PyMem_Free(key);
    PyObject *out = changes ? PyTuple_Pack(4, keys, removed, unsettled, hinted_obj)
                            : PyTuple_Pack(2, keys, unsettled);
    Py_XDECREF(hinted_obj);
    if (seen_view.obj != NULL)
        PyBuffer_Release(&seen_view);
    Py_DECREF(keys);
    Py_XDECREF(removed);
    Py_DECREF(unsettled);
    return out;
fail:
    PyMem_Free(key);
    if (seen_view.obj != NULL)
        PyBuffer_Release(&seen_view);
    if (records_view.obj != NULL)
        PyBuffer_Release(&records_view);
    Py_XDECREF(keys);
    Py_XDECREF(removed);
    Py_XDECREF(unsettled);
    return NULL;
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

/* write_entries(entries_off, heap_off, heap_size, n, keys, versions, dues,
 *               cids, ranks) -> (written, heap_used, all_ascii)
 *
 * The ready set's writer (shm/ready.py, ReadySet.publish_columns): entries
 * 0..n-1 of the columns (lists) as 32-byte entries at entries_off (key
 * offset u32, key length u16, class id u16, version u64, due minute i64,
 * rank f64) and their keys' UTF-8 into the heap at heap_off, in order. Stops
 * at the first key that does not fit whole in heap_size bytes. A field out
 * of range (a key over 65,535 bytes, a class id over 65,535, a negative or
 * too large version or due minute) is a ValueError naming the entry, with
 * the entries before it written: the caller's slot stays odd. */
static PyObject *
view_write_entries(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(9, "write_entries");
    if (!self->held) {
        PyErr_SetString(PyExc_ValueError, "view is released");
        return NULL;
    }
    Py_ssize_t entries_off, heap_off, heap_size, n;
    if (as_ssize(args[0], &entries_off) < 0 || as_ssize(args[1], &heap_off) < 0 ||
        as_ssize(args[2], &heap_size) < 0 || as_ssize(args[3], &n) < 0)
        return NULL;
    PyObject *cols[5];
    for (int c = 0; c < 5; c++) {
        cols[c] = args[4 + c];
        if (!PyList_Check(cols[c]) || PyList_GET_SIZE(cols[c]) < n) {
            PyErr_SetString(PyExc_TypeError, "write_entries(): the columns are lists of at least n");
            return NULL;
        }
    }
    Py_ssize_t len = self->view.len;
    if (entries_off < 0 || n < 0 || n > (len - entries_off) / 32 || heap_off < 0 ||
        heap_size < 0 || heap_size > len - heap_off) {
        PyErr_SetString(PyExc_ValueError, "write_entries(): the slot does not fit the buffer");
        return NULL;
    }
    char *entries = (char *)self->view.buf + entries_off;
    char *heap = (char *)self->view.buf + heap_off;
    Py_ssize_t used = 0, i = 0;
    int ascii = 1;
    for (; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(cols[0], i);
        if (!PyUnicode_Check(key)) {
            PyErr_Format(PyExc_TypeError, "ready entry %zd: the key is not a str", i);
            return NULL;
        }
        Py_ssize_t klen;
        const char *utf8 = PyUnicode_AsUTF8AndSize(key, &klen);
        if (utf8 == NULL)
            return NULL;
        if (!PyUnicode_IS_ASCII(key))
            ascii = 0;
        if (klen > heap_size - used)
            break; /* the heap is full: the keys that fit whole, and stop */
        unsigned long long version = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(cols[1], i));
        long long due = PyLong_AsLongLong(PyList_GET_ITEM(cols[2], i));
        long cid = PyLong_AsLong(PyList_GET_ITEM(cols[3], i));
        double rank = PyFloat_AsDouble(PyList_GET_ITEM(cols[4], i));
        if (PyErr_Occurred() || klen > 0xFFFF || cid < 0 || cid > 0xFFFF) {
            if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_OverflowError) &&
                !PyErr_ExceptionMatches(PyExc_TypeError))
                return NULL;
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError,
                         "ready entry %zd: a field does not fit (key_len and class_id are u16, "
                         "version u64, due_minute i64)", i);
            return NULL;
        }
        char *e = entries + 32 * i;
        uint32_t offset = (uint32_t)used;
        uint16_t key_len = (uint16_t)klen, class_id = (uint16_t)cid;
        uint64_t v = version;
        int64_t d = due;
        memcpy(e, &offset, 4);
        memcpy(e + 4, &key_len, 2);
        memcpy(e + 6, &class_id, 2);
        memcpy(e + 8, &v, 8);
        memcpy(e + 16, &d, 8);
        memcpy(e + 24, &rank, 8);
        memcpy(heap + used, utf8, klen);
        used += klen;
    }
    return Py_BuildValue("(nnO)", i, used, ascii ? Py_True : Py_False);
}


/* -- seqlocks and publication (docs/shm.md, "Memory ordering") --------------
 *
 * A seqlock reader: load the counter with acquire, copy, acquire fence, load
 * the counter again (relaxed) and compare. The fence orders the copy's loads
 * before the second load; the acquire orders them after the first. A writer:
 * store the odd counter, release fence, write, store the even counter with
 * release. Readers whose copy saw any of the writes synchronise with the
 * writer's fence and so see its odd counter or later: they retry.
 *
 * The copies are relaxed atomic loads (whole words where aligned), so the
 * reader's racy copy is not a data race in the C11 model; the writers here
 * are CPython's memcpy (struct.pack_into, slice assignment) or the plain
 * stores of write_entries, ordered by the fences around them. */

/* Copy n bytes from shared memory with relaxed atomic loads. */
static void
copy_relaxed(char *dst, const char *src, Py_ssize_t n)
{
    while (n > 0 && ((uintptr_t)src & 7)) {
        *dst++ = (char)__atomic_load_n((const unsigned char *)src, __ATOMIC_RELAXED);
        src++;
        n--;
    }
    for (; n >= 8; n -= 8, src += 8, dst += 8) {
        uint64_t w = __atomic_load_n((const uint64_t *)src, __ATOMIC_RELAXED);
        memcpy(dst, &w, 8);
    }
    for (; n > 0; n--)
        *dst++ = (char)__atomic_load_n((const unsigned char *)src++, __ATOMIC_RELAXED);
}

/* check32(off, expected) -> bool: a seqlock reader's closing check (acquire
   fence, then the counter again). */
static PyObject *
view_check32(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(2, "check32");
    uint64_t expected;
    uint32_t *p = (uint32_t *)at(self, args[0], 4);
    if (p == NULL || as_u64(args[1], &expected) < 0)
        return NULL;
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return PyBool_FromLong(__atomic_load_n(p, __ATOMIC_RELAXED) == expected);
}

/* check64(off, expected) -> bool: check32 for a 64-bit word (a lease state word). */
static PyObject *
view_check64(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(2, "check64");
    uint64_t expected;
    uint64_t *p = (uint64_t *)at(self, args[0], 8);
    if (p == NULL || as_u64(args[1], &expected) < 0)
        return NULL;
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return PyBool_FromLong(__atomic_load_n(p, __ATOMIC_RELAXED) == expected);
}

static int
as_u32(PyObject *obj, uint32_t *out)
{
    uint64_t v;
    if (as_u64(obj, &v) < 0)
        return -1;
    if (v > UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "value does not fit in 32 bits");
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

/* begin32(off, odd): a seqlock writer's opening store, then a release fence:
   no store the caller makes after it is seen before it. */
static PyObject *
view_begin32(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(2, "begin32");
    uint32_t v;
    uint32_t *p = (uint32_t *)at(self, args[0], 4);
    if (p == NULL || as_u32(args[1], &v) < 0)
        return NULL;
    __atomic_store_n(p, v, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* release32(off, value): a release store: every store the caller made
   before it is seen by whoever loads this value with acquire. */
static PyObject *
view_release32(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(2, "release32");
    uint32_t v;
    uint32_t *p = (uint32_t *)at(self, args[0], 4);
    if (p == NULL || as_u32(args[1], &v) < 0)
        return NULL;
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* read_slot(state_off, slot_off, key_at, inline_key, blocks_off, block_size,
 *           long_blocks, copy_at, record_size, keyed_mask, retries)
 *   -> (word, key, record) or None
 *
 * The lease table's seqlock read of one slot (LeaseTable._stable): the state
 * word (acquire), the key (inline, or continued in its overflow block) and
 * the record copy the word names (copy_at + copy * record_size), then an
 * acquire fence and the word again; retried while it moved. None when the
 * slot is not keyed (its code not in keyed_mask), or did not read steadily
 * in `retries` tries, or its key metadata is out of range. */
static PyObject *
view_read_slot(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(11, "read_slot");
    Py_ssize_t slot_off, key_at, inline_key, blocks_off, block_size, long_blocks, copy_at,
        record_size, retries;
    uint64_t keyed;
    uint64_t *state = (uint64_t *)at(self, args[0], 8);
    if (state == NULL || as_ssize(args[1], &slot_off) < 0 || as_ssize(args[2], &key_at) < 0 ||
        as_ssize(args[3], &inline_key) < 0 || as_ssize(args[4], &blocks_off) < 0 ||
        as_ssize(args[5], &block_size) < 0 || as_ssize(args[6], &long_blocks) < 0 ||
        as_ssize(args[7], &copy_at) < 0 || as_ssize(args[8], &record_size) < 0 ||
        as_u64(args[9], &keyed) < 0 || as_ssize(args[10], &retries) < 0)
        return NULL;
    Py_ssize_t len = self->view.len;
    if (slot_off < 0 || key_at < 8 || inline_key < 0 || copy_at < key_at + inline_key ||
        record_size <= 0 || slot_off % 8 || slot_off > len - copy_at - 2 * record_size ||
        block_size < 0 || long_blocks < 0 || blocks_off < 0 ||
        (long_blocks > 0 && long_blocks > (len - blocks_off) / (block_size ? block_size : 1))) {
        PyErr_SetString(PyExc_ValueError, "read_slot(): the slot does not fit the buffer");
        return NULL;
    }
    const char *slot = (const char *)self->view.buf + slot_off;
    const char *blocks = (const char *)self->view.buf + blocks_off;
    char key[4096], rec[1024];
    if (inline_key + block_size > (Py_ssize_t)sizeof key || record_size > (Py_ssize_t)sizeof rec) {
        PyErr_SetString(PyExc_ValueError, "read_slot(): key or record too large");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < retries; i++) {
        uint64_t w = __atomic_load_n(state, __ATOMIC_ACQUIRE);
        if (!((keyed >> (w & 15)) & 1))
            Py_RETURN_NONE;
        uint16_t key_len = __atomic_load_n((const uint16_t *)slot, __ATOMIC_RELAXED);
        uint32_t block = __atomic_load_n((const uint32_t *)(slot + 4), __ATOMIC_RELAXED);
        int ok = key_len > 0 && key_len <= inline_key + block_size;
        if (ok && key_len > inline_key)
            ok = block > 0 && (Py_ssize_t)block <= long_blocks;
        if (ok) {
            Py_ssize_t head = key_len < inline_key ? key_len : inline_key;
            copy_relaxed(key, slot + key_at, head);
            if (key_len > inline_key)
                copy_relaxed(key + inline_key, blocks + block_size * (Py_ssize_t)(block - 1),
                             key_len - inline_key);
        }
        copy_relaxed(rec, slot + copy_at + record_size * (Py_ssize_t)((w >> 8) & 1), record_size);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(state, __ATOMIC_RELAXED) == w && ok)
            return Py_BuildValue("(Ky#y#)", (unsigned long long)w, key, (Py_ssize_t)key_len, rec,
                                 record_size);
    }
    Py_RETURN_NONE;
}

/* -- module functions: on any buffer, read-only ones too (the state buffer a
 * group member maps read-only). Each takes the buffer for the call. */

/* The address of `width` bytes at `off` in `view` (aligned to width), or NULL. */
static char *
buf_at(Py_buffer *view, PyObject *off_obj, Py_ssize_t width, Py_ssize_t n)
{
    Py_ssize_t off = PyLong_AsSsize_t(off_obj);
    if (off == -1 && PyErr_Occurred())
        return NULL;
    if (off < 0 || n < 0 || off > view->len - n || (width > 1 && off % width) ||
        ((uintptr_t)view->buf % 8)) {
        PyErr_Format(PyExc_ValueError,
                     "%zd bytes at offset %zd are not aligned to %zd inside the buffer (%zd bytes)",
                     n, off, width, view->len);
        return NULL;
    }
    return (char *)view->buf + off;
}

#define WITH_BUFFER(obj, flags)                                               \
    Py_buffer buffer;                                                         \
    if (PyObject_GetBuffer((obj), &buffer, (flags)) < 0)                      \
        return NULL;

/* acquire32(buffer, off) -> int */
static PyObject *
mod_acquire32(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(2, "acquire32");
    WITH_BUFFER(args[0], PyBUF_SIMPLE);
    uint32_t *p = (uint32_t *)buf_at(&buffer, args[1], 4, 4);
    PyObject *out = p ? PyLong_FromUnsignedLong(__atomic_load_n(p, __ATOMIC_ACQUIRE)) : NULL;
    PyBuffer_Release(&buffer);
    return out;
}

/* acquire64(buffer, off) -> int */
static PyObject *
mod_acquire64(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(2, "acquire64");
    WITH_BUFFER(args[0], PyBUF_SIMPLE);
    uint64_t *p = (uint64_t *)buf_at(&buffer, args[1], 8, 8);
    PyObject *out =
        p ? PyLong_FromUnsignedLongLong(__atomic_load_n(p, __ATOMIC_ACQUIRE)) : NULL;
    PyBuffer_Release(&buffer);
    return out;
}

/* release32(buffer, off, value): a release store. */
static PyObject *
mod_release32(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(3, "release32");
    uint32_t v;
    if (as_u32(args[2], &v) < 0)
        return NULL;
    WITH_BUFFER(args[0], PyBUF_WRITABLE);
    uint32_t *p = (uint32_t *)buf_at(&buffer, args[1], 4, 4);
    if (p != NULL)
        __atomic_store_n(p, v, __ATOMIC_RELEASE);
    PyBuffer_Release(&buffer);
    if (p == NULL)
        return NULL;
    Py_RETURN_NONE;
}

/* seq_copy(buffer, seq_off, off, n) -> (seq, bytes) or None
 *
 * One try of a seqlock read: the u32 counter at seq_off (acquire), None if it
 * is odd; n bytes from off; acquire fence; None if the counter moved. Two
 * copies under one counter are consistent with each other when both return
 * the same seq. */
static PyObject *
mod_seq_copy(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(4, "seq_copy");
    Py_ssize_t n;
    if (as_ssize(args[3], &n) < 0)
        return NULL;
    WITH_BUFFER(args[0], PyBUF_SIMPLE);
    PyObject *out = NULL;
    uint32_t *seq_p = (uint32_t *)buf_at(&buffer, args[1], 4, 4);
    const char *src = seq_p ? buf_at(&buffer, args[2], 1, n) : NULL;
    if (src == NULL)
        goto done;
    uint32_t seq = __atomic_load_n(seq_p, __ATOMIC_ACQUIRE);
    if (seq & 1) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    PyObject *data = PyBytes_FromStringAndSize(NULL, n);
    if (data == NULL)
        goto done;
    copy_relaxed(PyBytes_AS_STRING(data), src, n);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (__atomic_load_n(seq_p, __ATOMIC_RELAXED) != seq) {
        Py_DECREF(data);
        out = Py_NewRef(Py_None);
        goto done;
    }
    out = Py_BuildValue("(kN)", (unsigned long)seq, data);
done:
    PyBuffer_Release(&buffer);
    return out;
}

/* seq_write(buffer, seq_off, off, data) -> the new (even) seq
 *
 * The only writer's seqlock write: the counter to the next odd value
 * (relaxed), a release fence, data at off, the counter to the next even value
 * with release. A counter left odd (a writer that died mid-write) goes on to
 * the next odd one. */
static PyObject *
mod_seq_write(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(4, "seq_write");
    Py_buffer data;
    if (PyObject_GetBuffer(args[3], &data, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *out = NULL;
    Py_buffer buffer;
    if (PyObject_GetBuffer(args[0], &buffer, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    uint32_t *seq_p = (uint32_t *)buf_at(&buffer, args[1], 4, 4);
    char *dst = seq_p ? buf_at(&buffer, args[2], 1, data.len) : NULL;
    if (dst != NULL) {
        uint32_t seq = __atomic_load_n(seq_p, __ATOMIC_RELAXED);
        seq += (seq & 1) ? 2 : 1;
        __atomic_store_n(seq_p, seq, __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_RELEASE);
        memcpy(dst, data.buf, data.len);
        __atomic_store_n(seq_p, seq + 1, __ATOMIC_RELEASE);
        out = PyLong_FromUnsignedLong(seq + 1);
    }
    PyBuffer_Release(&buffer);
    PyBuffer_Release(&data);
    return out;
}

static PyMethodDef module_methods[] = {
    {"acquire32", (PyCFunction)(void (*)(void))mod_acquire32, METH_FASTCALL,
     "acquire32(buffer, off) -> int: an acquire load"},
    {"acquire64", (PyCFunction)(void (*)(void))mod_acquire64, METH_FASTCALL,
     "acquire64(buffer, off) -> int: an acquire load"},
    {"release32", (PyCFunction)(void (*)(void))mod_release32, METH_FASTCALL,
     "release32(buffer, off, value): a release store"},
    {"seq_copy", (PyCFunction)(void (*)(void))mod_seq_copy, METH_FASTCALL,
     "seq_copy(buffer, seq_off, off, n) -> (seq, bytes) or None: one seqlock read"},
    {"seq_write", (PyCFunction)(void (*)(void))mod_seq_write, METH_FASTCALL,
     "seq_write(buffer, seq_off, off, data) -> new seq: one seqlock write"},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef view_methods[] = {
    {"check32", (PyCFunction)(void (*)(void))view_check32, METH_FASTCALL,
     "check32(off, expected) -> bool: acquire fence, then whether the word is expected"},
    {"check64", (PyCFunction)(void (*)(void))view_check64, METH_FASTCALL,
     "check64(off, expected) -> bool: acquire fence, then whether the word is expected"},
    {"begin32", (PyCFunction)(void (*)(void))view_begin32, METH_FASTCALL,
     "begin32(off, value): a store, then a release fence (a seqlock writer's opening)"},
    {"release32", (PyCFunction)(void (*)(void))view_release32, METH_FASTCALL,
     "release32(off, value): a release store"},
    {"read_slot", (PyCFunction)(void (*)(void))view_read_slot, METH_FASTCALL,
     "read_slot(state_off, slot_off, key_at, inline_key, blocks_off, block_size, long_blocks,"
     " copy_at, record_size, keyed_mask, retries) -> (word, key, record) or None"},
    {"load64", (PyCFunction)(void (*)(void))view_load64, METH_FASTCALL, "load64(off) -> int"},
    {"write_entries", (PyCFunction)(void (*)(void))view_write_entries, METH_FASTCALL,
     "write_entries(entries_off, heap_off, heap_size, n, keys, versions, dues, cids, ranks)"
     " -> (written, heap_used, all_ascii)"},
    {"store64", (PyCFunction)(void (*)(void))view_store64, METH_FASTCALL,
     "store64(off, value): a sequentially consistent store"},
    {"cas64", (PyCFunction)(void (*)(void))view_cas64, METH_FASTCALL,
     "cas64(off, expected, desired) -> the value found (success iff == expected)"},
    {"add64", (PyCFunction)(void (*)(void))view_add64, METH_FASTCALL,
     "add64(off, delta) -> the value before"},
    {"load32", (PyCFunction)(void (*)(void))view_load32, METH_FASTCALL, "load32(off) -> int"},
    {"max32", (PyCFunction)(void (*)(void))view_max32, METH_FASTCALL,
     "max32(off, value) -> the value before; raises the word to at least value"},
    {"store32", (PyCFunction)(void (*)(void))view_store32, METH_FASTCALL,
     "store32(off, value): a sequentially consistent store, then a full fence"},
    {"publish_counted", (PyCFunction)(void (*)(void))view_publish_counted, METH_FASTCALL,
     "publish_counted(states_off, idx, own, new, shard_off, k, stop) -> bool"},
    {"shard_counts", (PyCFunction)(void (*)(void))view_shard_counts, METH_FASTCALL,
     "shard_counts(off, n) -> ([6 sums], [index of a shard with its journal set])"},
    {"find_hash", (PyCFunction)(void (*)(void))view_find_hash, METH_FASTCALL,
     "find_hash(states_off, hashes_off, count, start, n, hash, code_mask) -> [index]"},
    {"find_code", (PyCFunction)(void (*)(void))view_find_code, METH_FASTCALL,
     "find_code(states_off, count, start, n, code_mask) -> index or -1"},
    {"find_u64", (PyCFunction)(void (*)(void))view_find_u64, METH_FASTCALL,
     "find_u64(off, count, start, value) -> index or -1"},
    {"scan_codes", (PyCFunction)(void (*)(void))view_scan_codes, METH_FASTCALL,
     "scan_codes(states_off, count, code_mask) -> [(index, word)]"},
    {"code_counts", (PyCFunction)(void (*)(void))view_code_counts, METH_FASTCALL,
     "code_counts(states_off, count, updating_code) -> [slots per state code, 16 entries]"},
    {"scan_f64", (PyCFunction)(void (*)(void))view_scan_f64, METH_FASTCALL,
     "scan_f64(states_off, count, code_mask, base, stride, off0, off1, limit, above)"
     " -> [(index, word)]"},
    {"excluded_keys", (PyCFunction)(void (*)(void))view_excluded_keys, METH_FASTCALL,
     "excluded_keys(states_off, count, slots_off, slot_size, key_at, inline_key, held_off0,"
     " held_off1, blocks_off, block_size, long_blocks, now, always_mask, held_mask, retries,"
     " cache[, seen]) -> (set of keys, [index of a slot to settle]), or with seen"
     " (added, removed, [index of a slot to settle])"},
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
    .m_doc = "Atomics and fenced seqlock reads and writes on shared memory (shm/).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__atomic(void)
{
    if (PyType_Ready(&ViewType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&atomic_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "TEST_STOPS", LEASE_TEST_STOPS) < 0 ||
        PyModule_AddIntConstant(m, "SYS_futex", SYS_futex) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&ViewType);
    if (PyModule_AddObject(m, "View", (PyObject *)&ViewType) < 0) {
        Py_DECREF(&ViewType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
