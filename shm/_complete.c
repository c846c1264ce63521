/* The lease table's completion in C: Granter.complete_many and
 * Granter.peek_many, the ledger's per-result lease work for a whole group
 * in one call. Each item is, step for step, LeaseTable.complete or
 * LeaseTable.peek (shm/leases/table.py):
 *
 *   peek: find the key's slot (the seqlock read of the grant's lookup) and
 *   answer what complete would, changing nothing, with the lease's record
 *   (a Lease) when it would be accepted;
 *
 *   complete: find the slot, take it (UPDATING, this process's pid and tag),
 *   read the seal (sealed: put the very word back, SEALED); a lease id that
 *   is not the slot's, or a lease that already ended with a result, rolls
 *   the slot back (SUPERSEDED, UNKNOWN, REPEAT); otherwise write the
 *   inactive record copy with misses 0, no hold and ended RESULT, and
 *   publish it IDLE, counted (lease_publish_counted, shm/_publish.h: the
 *   shard's journal makes a kill -9 at any instruction count once) as
 *   COMPLETED when the lease was live, else as a late result (released or
 *   expired).
 *
 * An item this path does not finish stops the call there, and Python does
 * that item and calls again from the next (LeaseTable.complete_many,
 * peek_many), so a group is done in exactly the order, with exactly the
 * effects, of a loop of the Python methods: SLOW (a slot another process
 * holds mid-change: alive, Python waits for it and answers BUSY; dead, it
 * rolls it back; a slot that would not read steadily; a key over 208 bytes,
 * not a str, not UTF-8; a lease id that is not a non-negative int below
 * 2**64), SEALED, TAKEN_OVER, NO_SHARD (this owner has no counter shard
 * yet: Python takes one).
 *
 * Compiled in shm/_claim_unit.c after shm/_grant.c, whose helpers (lookup,
 * cas, sealed, state_at, slot_at) it uses; its test stops (P_UPDATE,
 * P_WRITTEN, and the counted publish's) are the Python path's, in the test
 * build only. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_claim.h"

/* Indexes into the answers tuple Python passes (shm/leases/table.py _ANSWERS). */
enum { A_COMPLETED = 0, A_LATE = 1, A_REPEAT = 2, A_SUPERSEDED = 3, A_UNKNOWN = 4, A_COUNT = 5 };

/* shm/leases/protocol.py Ended */
#define ENDED_RESULT 1
#define ENDED_RELEASED 2

/* Swaps of the key's slot lost to another process in a row (its word
   changed between the look and the take) before Python waits it out. */
#define TAKE_RETRIES 8

/* The key's UTF-8 and the lease id of items[i], a (key, lease_id) tuple:
   1, or 0 when this path does not take it (Python does, and raises what it
   raises for it). */
static int
item_args(PyObject *item, const char **key, Py_ssize_t *key_len, uint64_t *lease_id)
{
    if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 2)
        return 0;
    PyObject *k = PyTuple_GET_ITEM(item, 0), *l = PyTuple_GET_ITEM(item, 1);
    if (!PyUnicode_CheckExact(k) || !PyLong_CheckExact(l))
        return 0;
    *key = PyUnicode_AsUTF8AndSize(k, key_len);
    if (*key == NULL) {
        PyErr_Clear();
        return 0;
    }
    if (*key_len < 1 || *key_len > INLINE_KEY)
        return 0;
    unsigned long long v = PyLong_AsUnsignedLongLong(l);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    *lease_id = v;
    return 1;
}

/* What complete answers for the slot's record read under a word of code
   `code` (not UPDATING): an A_*, and in *count the counter its publish
   counts (0: none, the slot is rolled back). */
static int
judge(uint64_t code, const char rec[RECORD_SIZE], uint64_t lease_id, int *count)
{
    uint64_t theirs;
    memcpy(&theirs, rec + R_LEASE_ID, 8);
    unsigned char ended = (unsigned char)rec[R_ENDED];
    *count = 0;
    if (theirs != lease_id)
        return lease_id < theirs ? A_SUPERSEDED : A_UNKNOWN;
    if (code == IDLE && ended == ENDED_RESULT)
        return A_REPEAT;
    if (code == LEASED) {
        *count = COUNT_COMPLETED;
        return A_COMPLETED;
    }
    *count = ended == ENDED_RELEASED ? COUNT_LATE_RELEASED : COUNT_LATE_EXPIRED;
    return A_LATE;
}

/* LeaseTable.complete for one short key: G_GRANTED (0) with *answer, or
   G_SLOW, G_SEALED, G_TAKEN_OVER (then nothing is changed but what a
   rollback restores). */
static int
complete_one(GranterObject *g, const char *key, Py_ssize_t key_len, uint64_t lease_id,
             uint64_t owner, int stop, int *answer)
{
    uint64_t h64 = blake2b64((const uint8_t *)key, (size_t)key_len);
    (void)stop;
    for (int attempt = 0; attempt < TAKE_RETRIES; attempt++) {
        char rec[RECORD_SIZE];
        Py_ssize_t idx;
        uint64_t w;
        int got = lookup(g, key, key_len, h64, &idx, &w, rec);
        if (got < 0)
            return G_SLOW;
        if (!got) {
            *answer = A_UNKNOWN;
            return G_GRANTED;
        }
        if ((w & 15) == UPDATING)
            return G_SLOW; /* alive: Python waits, then BUSY; dead: it rolls it back */
        /* Take it, as LeaseTable._take: the word it was, read with the record. */
        uint64_t *state = state_at(g, idx);
        uint64_t own = UPDATING | (w & 15) << WORD_PREV_SHIFT | (w & 1ULL << WORD_COPY_SHIFT) |
                       owner | (((w >> SEQ_SHIFT) + 1) & SEQ_MASK) << SEQ_SHIFT;
        if (!cas(state, w, own))
            continue; /* changed since the look: look again */
        LEASE_STOP(stop, P_UPDATE);
        if (sealed(g)) /* put back the very word: nothing was written */
            return cas(state, own, w) ? G_SEALED : G_TAKEN_OVER;
        uint64_t code = w & 15, next_seq = (((own >> SEQ_SHIFT) + 1) & SEQ_MASK) << SEQ_SHIFT;
        uint64_t copy = (own >> WORD_COPY_SHIFT) & 1;
        int count;
        *answer = judge(code, rec, lease_id, &count);
        if (!count) /* LeaseTable._rollback: the code it was, the same copy */
            return cas(state, own, code | copy << WORD_COPY_SHIFT | next_seq) ? G_GRANTED
                                                                               : G_TAKEN_OVER;
        /* rec._replace(misses=0, held_until=0.0, ended=Ended.RESULT) */
        uint32_t no_misses = 0;
        double no_hold = 0.0;
        memcpy(rec + R_MISSES, &no_misses, 4);
        memcpy(rec + R_HELD_UNTIL, &no_hold, 8);
        rec[R_ENDED] = ENDED_RESULT;
        copy = 1 - copy;
        memcpy(slot_at(g, idx) + COPY_AT[copy], rec, RECORD_SIZE);
        LEASE_STOP(stop, P_WRITTEN);
        uint64_t idle = IDLE | copy << WORD_COPY_SHIFT | next_seq;
        if (!lease_publish_counted(state, idx, own, idle, g->shard, count, stop))
            return G_TAKEN_OVER;
        return G_GRANTED;
    }
    return G_SLOW;
}

/* The Lease LeaseTable.peek answers for a record (`cls` a tuple subclass):
   Lease(key, lease_id, consumer, granted_at, expires_at, misses, version,
   cadence_s). */
static PyObject *
new_lease(PyObject *cls, PyObject *key, const char rec[RECORD_SIZE])
{
    uint64_t lease_id, version;
    double granted_at, expires_at, cadence_s;
    uint32_t misses;
    memcpy(&lease_id, rec + R_LEASE_ID, 8);
    memcpy(&granted_at, rec + R_GRANTED_AT, 8);
    memcpy(&expires_at, rec + R_EXPIRES_AT, 8);
    memcpy(&cadence_s, rec + R_CADENCE_S, 8);
    memcpy(&misses, rec + R_MISSES, 4);
    memcpy(&version, rec + R_VERSION, 8);
    Py_ssize_t consumer_len = (unsigned char)rec[R_CONSUMER_LEN];
    if (consumer_len > CONSUMER_BYTES)
        consumer_len = CONSUMER_BYTES; /* as Python's slice of the 32 bytes */
    PyObject *fields = PyTuple_New(8);
    if (fields == NULL)
        return NULL;
    Py_INCREF(key);
    PyTuple_SET_ITEM(fields, 0, key);
    PyObject *values[7] = {
        PyLong_FromUnsignedLongLong(lease_id),
        PyUnicode_DecodeUTF8(rec + R_CONSUMER, consumer_len, "replace"),
        PyFloat_FromDouble(granted_at),
        PyFloat_FromDouble(expires_at),
        PyLong_FromUnsignedLong(misses),
        PyLong_FromUnsignedLongLong(version),
        PyFloat_FromDouble(cadence_s),
    };
    int failed = 0;
    for (int i = 0; i < 7; i++) {
        if (values[i] == NULL)
            failed = 1;
        else
            PyTuple_SET_ITEM(fields, i + 1, values[i]); /* a NULL item is fine to free */
    }
    if (failed) {
        Py_DECREF(fields);
        return NULL;
    }
    PyObject *args = PyTuple_Pack(1, fields);
    Py_DECREF(fields);
    if (args == NULL)
        return NULL;
    /* tuple.__new__(cls, fields), as shm/leases/protocol.py _new_record */
    PyObject *lease = PyTuple_Type.tp_new((PyTypeObject *)cls, args, NULL);
    Py_DECREF(args);
    return lease;
}

/* The arguments both methods share: the items list, the start, and the
   answers tuple (A_COUNT Outcome members). */
static int
many_args(GranterObject *self, const char *name, PyObject *items, PyObject *start_obj,
          PyObject *answers, Py_ssize_t *start)
{
    if (!self->held) {
        PyErr_SetString(PyExc_ValueError, "Granter is released");
        return -1;
    }
    if (!PyList_CheckExact(items)) {
        PyErr_Format(PyExc_TypeError, "%s(): items must be a list", name);
        return -1;
    }
    if (!PyTuple_CheckExact(answers) || PyTuple_GET_SIZE(answers) != A_COUNT) {
        PyErr_Format(PyExc_TypeError, "%s(): answers must be a tuple of %d", name, A_COUNT);
        return -1;
    }
    *start = PyLong_AsSsize_t(start_obj);
    if (*start == -1 && PyErr_Occurred())
        return -1;
    if (*start < 0 || *start > PyList_GET_SIZE(items)) {
        PyErr_Format(PyExc_ValueError, "%s(): start out of range", name);
        return -1;
    }
    return 0;
}

/* (done, why): done the answers of items[start:start + len(done)], why 0
   when that is all of them, else what stopped it at the next item. */
static PyObject *
many_result(PyObject *done, int why)
{
    if (done == NULL)
        return NULL;
    PyObject *out = Py_BuildValue("(Ni)", done, why);
    return out;
}

/* complete_many(items, start, owner, stop, answers) -> (outcomes, why) */
PyObject *
granter_complete_many(GranterObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "complete_many() takes 5 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *items = args[0], *answers = args[4];
    Py_ssize_t start;
    if (many_args(self, "complete_many", items, args[1], answers, &start) < 0)
        return NULL;
    uint64_t owner = PyLong_AsUnsignedLongLong(args[2]);
    int stop = (int)PyLong_AsLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    PyObject *done = PyList_New(0);
    if (done == NULL)
        return NULL;
    if (owner != self->shard_owner || self->shard == NULL) /* a first change, or a fork's child */
        return many_result(done, G_NO_SHARD);
    Py_ssize_t n = PyList_GET_SIZE(items);
    for (Py_ssize_t i = start; i < n; i++) {
        const char *key;
        Py_ssize_t key_len;
        uint64_t lease_id;
        if (!item_args(PyList_GET_ITEM(items, i), &key, &key_len, &lease_id))
            return many_result(done, G_SLOW);
        int answer;
        int got = complete_one(self, key, key_len, lease_id, owner, stop, &answer);
        if (got != G_GRANTED)
            return many_result(done, got);
        if (PyList_Append(done, PyTuple_GET_ITEM(answers, answer)) < 0) {
            Py_DECREF(done);
            return NULL;
        }
    }
    return many_result(done, 0);
}

/* peek_many(items, start, lease_cls, answers) -> ([(outcome, lease | None)], why) */
PyObject *
granter_peek_many(GranterObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "peek_many() takes 4 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *items = args[0], *cls = args[2], *answers = args[3];
    Py_ssize_t start;
    if (many_args(self, "peek_many", items, args[1], answers, &start) < 0)
        return NULL;
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "peek_many(): lease_cls must be a tuple type");
        return NULL;
    }
    PyObject *done = PyList_New(0);
    if (done == NULL)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(items);
    for (Py_ssize_t i = start; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(items, i);
        const char *key;
        Py_ssize_t key_len;
        uint64_t lease_id;
        if (!item_args(item, &key, &key_len, &lease_id))
            return many_result(done, G_SLOW);
        char rec[RECORD_SIZE];
        Py_ssize_t idx;
        uint64_t w;
        uint64_t h64 = blake2b64((const uint8_t *)key, (size_t)key_len);
        int got = lookup(self, key, key_len, h64, &idx, &w, rec);
        /* A slot held mid-change: Python reads what it was (its holder
           alive) or rolls it back (dead). */
        if (got < 0 || (got && (w & 15) == UPDATING))
            return many_result(done, G_SLOW);
        int answer = A_UNKNOWN, count;
        if (got)
            answer = judge(w & 15, rec, lease_id, &count);
        PyObject *lease = Py_None;
        Py_INCREF(lease);
        if (answer == A_COMPLETED || answer == A_LATE) {
            Py_DECREF(lease);
            lease = new_lease(cls, PyTuple_GET_ITEM(item, 0), rec);
            if (lease == NULL) {
                Py_DECREF(done);
                return NULL;
            }
        }
        PyObject *pair = PyTuple_Pack(2, PyTuple_GET_ITEM(answers, answer), lease);
        Py_DECREF(lease);
        if (pair == NULL || PyList_Append(done, pair) < 0) {
            Py_XDECREF(pair);
            Py_DECREF(done);
            return NULL;
        }
        Py_DECREF(pair);
    }
    return many_result(done, 0);
}
