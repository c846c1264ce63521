/* shm._claim: the claim path's hot loop in C, for shm/leases/. This file is
 * the module and its Granter type; the grant itself is shm/_grant.c, the key
 * hash shm/_blake2b.c, the ledger's completions and peeks shm/_complete.c,
 * the whole claim shm/_claim_path.c (shm/_claim.h).
 *
 * A grant in Python costs 7-25 us (a dozen calls into shm._atomic, struct
 * packing, blake2b through hashlib); here it is one call. `Granter.grant` is
 * the lease table's grant for the common cases, the same protocol step for
 * step as LeaseTable.grant in shm/leases/grant.py (read that docstring first: the
 * state word, the two record copies, the insert's ticket):
 *
 *   - the key's slot is found (IDLE, or HELD past its hold): take it
 *     (UPDATING, this process's pid and tag), write the inactive record copy,
 *     publish LEASED on it;
 *   - it is LEASED, HELD or PARKED: refuse, changing nothing;
 *   - the key has no slot and is short (at most 208 bytes, no overflow
 *     block): claim a free slot, write the key, raise maxdist, make it keyed
 *     (a full barrier), draw the ticket, probe for another slot with the same
 *     key, publish LEASED or back off.
 *
 * After it takes a slot (the swap to CLAIMING or UPDATING, a full barrier)
 * it reads the table's seal; sealed, it puts the slot's word back as it
 * found it and answers SEALED. The grant is counted by the publish itself
 * (lease_publish_counted in shm/_publish.h: this process's counter shard and
 * its journal), never by a separate add a kill could split from it.
 *
 * Everything else answers SLOW and the caller runs the Python grant, which
 * knows every case: a slot another process holds mid-change (alive: BUSY;
 * dead: roll it back), a slot that would not read steadily, a long key, a
 * table with no free slot on a first pass (the Python path reclaims slots of
 * dead processes, looks again, and counts a refusal), a race it kept losing.
 * Backing off more often than the Python path would is safe: an insert that
 * backs off leases nothing.
 *
 * `blake2b64(data)` is hashlib.blake2b(data, digest_size=8) read as a
 * little-endian integer (RFC 7693), the lease table's key hash, without the
 * hashlib object.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_claim.h"

static PyObject *
claim_blake2b64(PyObject *Py_UNUSED(module), PyObject *arg)
{
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0)
        return NULL;
    uint64_t h = blake2b64((const uint8_t *)b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

static int
granter_init(GranterObject *self, PyObject *args, PyObject *kwds)
{
    PyObject *obj;
    Py_ssize_t capacity, hashes, maxdist, owners, slots, blocks, long_blocks, size;
    static char *kwlist[] = {"buffer", "capacity", "hashes", "maxdist", "owners",
                             "slots", "blocks", "long_blocks", "size", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Onnnnnnnn", kwlist, &obj, &capacity, &hashes,
                                     &maxdist, &owners, &slots, &blocks, &long_blocks, &size))
        return -1;
    if (self->held) {
        PyBuffer_Release(&self->view);
        self->held = 0;
    }
    if (capacity <= 0 || (capacity & (capacity - 1)) || long_blocks < 0) {
        PyErr_SetString(PyExc_ValueError, "Granter: capacity must be a power of two");
        return -1;
    }
    if (PyObject_GetBuffer(obj, &self->view, PyBUF_WRITABLE) < 0)
        return -1;
    self->held = 1;
    /* The layout must be the one shm/leases/protocol.py computes, inside the buffer. */
    if (((uintptr_t)self->view.buf) % 8 || size > self->view.len ||
        hashes != STATES + 8 * capacity || maxdist != hashes + 8 * capacity ||
        owners < maxdist + 4 * capacity || slots < owners + 8 * long_blocks || slots % 8 ||
        blocks != slots + SLOT_SIZE * capacity || blocks > size) {
        PyBuffer_Release(&self->view);
        self->held = 0;
        PyErr_SetString(PyExc_ValueError, "Granter: the layout does not fit the buffer");
        return -1;
    }
    self->buf = (char *)self->view.buf;
    self->capacity = capacity;
    self->hashes = hashes;
    self->maxdist = maxdist;
    self->owners = owners;
    self->slots = slots;
    self->long_blocks = long_blocks;
    self->shard = NULL;
    self->shard_owner = 0;
    return 0;
}

static void
granter_dealloc(GranterObject *self)
{
    if (self->held)
        PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
granter_release(GranterObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->held) {
        PyBuffer_Release(&self->view);
        self->held = 0;
    }
    self->shard = NULL;
    self->shard_owner = 0;
    Py_RETURN_NONE;
}

/* set_shard(off, owner): grants by `owner` count in the 64-byte counter
   shard at `off` (LeaseTable._shard acquired it for that owner). */
static PyObject *
granter_set_shard(GranterObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "set_shard() takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!self->held) {
        PyErr_SetString(PyExc_ValueError, "Granter is released");
        return NULL;
    }
    Py_ssize_t off = PyLong_AsSsize_t(args[0]);
    unsigned long long owner = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    if (off < 0 || off % 64 || off > self->view.len - 64 || owner == 0) {
        PyErr_SetString(PyExc_ValueError, "set_shard(): not a shard inside the buffer");
        return NULL;
    }
    self->shard = self->buf + off;
    self->shard_owner = owner;
    Py_RETURN_NONE;
}


/* grant(key, holder, lease_s, now, cadence_s, version, owner, stop)
 *     -> (lease_id, misses) | 1 LEASED | 2 HELD | 3 PARKED | -1 SLOW | -2 TAKEN_OVER
 *        | -3 SEALED | -4 NO_SHARD
 *
 * key: the key's UTF-8 (1..1024 bytes; over 208 is SLOW); holder: the
 * consumer's UTF-8, at most 32 bytes; owner: this process's pid and tag as a
 * state word holds them; stop: a test stop (honoured by the test build only;
 * 0: none). */
static PyObject *
granter_grant(GranterObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_Format(PyExc_TypeError, "grant() takes 8 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!self->held) {
        PyErr_SetString(PyExc_ValueError, "Granter is released");
        return NULL;
    }
    if (!PyBytes_Check(args[0]) || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "grant(): key and holder must be bytes");
        return NULL;
    }
    GrantArgs a;
    memset(&a, 0, sizeof a);
    a.key = PyBytes_AS_STRING(args[0]);
    a.key_len = PyBytes_GET_SIZE(args[0]);
    a.holder = PyBytes_AS_STRING(args[1]);
    a.holder_len = PyBytes_GET_SIZE(args[1]);
    a.lease_s = PyFloat_AsDouble(args[2]);
    a.now = PyFloat_AsDouble(args[3]);
    a.cadence_s = PyFloat_AsDouble(args[4]);
    a.version = PyLong_AsUnsignedLongLong(args[5]);
    a.owner = PyLong_AsUnsignedLongLong(args[6]);
    a.stop = (int)PyLong_AsLong(args[7]);
    if (PyErr_Occurred())
        return NULL;
    if (a.key_len < 1 || a.key_len > 1024 || a.holder_len > CONSUMER_BYTES) {
        PyErr_SetString(PyExc_ValueError, "grant(): a key is 1 to 1024 bytes, a holder 32 at most");
        return NULL;
    }
    if (!(a.lease_s > 0 && a.cadence_s > 0)) {
        PyErr_SetString(PyExc_ValueError, "grant(): lease_s and cadence_s must be positive");
        return NULL;
    }
    uint64_t lease_id = 0, word = 0;
    uint32_t misses = 0;
    Py_ssize_t slot = -1;
    int got = lease_grant(self, &a, &lease_id, &misses, &slot, &word);
    if (got == G_GRANTED)
        return Py_BuildValue("(KI)", (unsigned long long)lease_id, (unsigned int)misses);
    return PyLong_FromLong(got);
}

static PyMethodDef granter_methods[] = {
    {"grant", (PyCFunction)(void (*)(void))granter_grant, METH_FASTCALL,
     "grant(key, holder, lease_s, now, cadence_s, version, owner, stop) -> (lease_id, misses)"
     " | 1 leased | 2 held | 3 parked | -1 slow | -2 taken over | -3 sealed | -4 no shard"},
    {"complete_many", (PyCFunction)(void (*)(void))granter_complete_many, METH_FASTCALL,
     "complete_many(items, start, owner, stop, answers) -> (outcomes, why): LeaseTable.complete"
     " for items[start:] ((key, lease_id) tuples) until one it leaves to Python; why 0 all,"
     " -1 slow, -2 taken over, -3 sealed, -4 no shard (shm/_complete.c)"},
    {"peek_many", (PyCFunction)(void (*)(void))granter_peek_many, METH_FASTCALL,
     "peek_many(items, start, lease_cls, answers) -> ([(outcome, lease | None)], why):"
     " LeaseTable.peek for items[start:] until one it leaves to Python; why 0 all, -1 slow"},
    {"set_shard", (PyCFunction)(void (*)(void))granter_set_shard, METH_FASTCALL,
     "set_shard(off, owner): grants by owner count in the counter shard at off"},
    {"release", (PyCFunction)granter_release, METH_NOARGS,
     "release(): drop the buffer export (before closing the mmap)"},
    {NULL, NULL, 0, NULL},
};

PyTypeObject GranterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shm._claim.Granter",
    .tp_basicsize = sizeof(GranterObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Granter(buffer, capacity, hashes, maxdist, owners, slots, blocks, long_blocks, size)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)granter_init,
    .tp_dealloc = (destructor)granter_dealloc,
    .tp_methods = granter_methods,
};

static PyMethodDef claim_functions[] = {
    {"blake2b64", claim_blake2b64, METH_O,
     "blake2b64(data) -> int: hashlib.blake2b(data, digest_size=8), little-endian"},
    {"owners_of", (PyCFunction)(void (*)(void))claim_owners_of, METH_FASTCALL,
     "owners_of(keys, seeds) -> bytes: each key's owner index (keeper/owners.py)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef claim_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "shm._claim",
    .m_doc = "The claim path in C: the lease table's grant, its key hash, a whole claim.",
    .m_size = -1,
    .m_methods = claim_functions,
};

PyMODINIT_FUNC
PyInit__claim(void)
{
    if (PyType_Ready(&GranterType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&claim_module);
    if (m == NULL)
        return NULL;
    /* Every offset and code this module was built with, by the names
     * shm/leases/protocol.py and shm/ready/layout.py give them: shm/layout.py checks them. */
    if (layout_export(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "Granter", (PyObject *)&GranterType) < 0 ||
        PyModule_AddIntConstant(m, "TEST_STOPS", LEASE_TEST_STOPS) < 0 ||
        claim_path_add(m) < 0 || claim_walk_add(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
