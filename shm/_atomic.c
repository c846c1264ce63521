/* shm._atomic: 64-bit atomics on a shared-memory mapping, for shm/leases/.
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
 * its lifetime count as one step a kill cannot split; shm/_publish.h, shared
 * with the C grant). A build with -DQUEUE_NODE_TEST_STOPS honours its test
 * stop; the production build compiles it out.
 *
 * This file is the module, the View type and its single-word atomics; the
 * scans are shm/_atomic_scan.c, excluded_keys shm/_atomic_excluded.c, the
 * seqlocks, publication and write_entries shm/_atomic_seq.c (shm/_atomic.h).
 */

#include "_atomic.h"

#include <sys/syscall.h>

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

static PyObject *
view_release(ViewObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->held) {
        PyBuffer_Release(&self->view);
        self->held = 0;
    }
    Py_RETURN_NONE;
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
    {"write_gathered", (PyCFunction)(void (*)(void))view_write_gathered, METH_FASTCALL,
     "write_gathered(entries_off, heap_off, heap_size, n, keys, versions, slots, dues, cids,"
     " ranks) -> (written, heap_used, all_ascii, keys_written)"},
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
    /* Every offset and code this module was built with, by the names
     * shm/leases/protocol.py and shm/ready/layout.py give them: shm/layout.py checks them. */
    if (PyModule_AddIntConstant(m, "TEST_STOPS", LEASE_TEST_STOPS) < 0 ||
        PyModule_AddIntConstant(m, "SYS_futex", SYS_futex) < 0 || layout_export(m) < 0) {
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
