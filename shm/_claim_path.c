/* shm._claim.ClaimPath: a whole claim in one call (workers/claim/path.py).
 *
 * The same steps as Claimer.claim's Python path, in the same order: take
 * entries from the ready set (shm/ready/'s take: the tagged claim cursor,
 * the slot's seqlock), raise the low-water flag when the set runs low, read
 * each entry's row by key (one read transaction per take; a run of keys in
 * one statement, their array in JSON), skip the entries
 * whose row is gone or unschedulable, whose version moved or that are not
 * due, and grant the rest (shm/_grant.c's lease_grant). A grant the C path
 * cannot make (a slot mid-change, a long key, a full first pass) is handed
 * back as a row for the Python grant; nothing taken is dropped silently.
 *
 * This file is the type (its constructor, claim, close); the take is
 * shm/_claim_take.c, the rows and grants shm/_claim_grant.c, SQLite's
 * functions shm/_claim_sqlite.c (shm/_claim_path.h). The statements are the
 * caller's (row_sql and rows_sql: node/store/queries.py CLAIM_ROW_SQL and
 * CLAIM_ROWS_SQL), the columns they select in the order _claim_grant.c reads.
 *
 * The rows are read through the very SQLite library Python's sqlite3 module
 * uses: its functions are looked up in the loaded _sqlite3 extension (and
 * what it links), never in another copy. Two copies of SQLite in one process
 * would not see each other's POSIX locks on the file ("How To Corrupt An
 * SQLite Database File", 2.2.1); so when the functions cannot be found there
 * (a static build that hides them), the constructor fails and the claimer
 * stays on its Python path.
 */

#include "_claim_path.h"

#include <stdio.h>
#include <string.h>

static void
path_close(ClaimPathObject *self)
{
    if (self->busy) { /* the claim running (its reader called back) closes at its end */
        self->close_pending = 1;
        return;
    }
    if (self->stmt) {
        sq.finalize(self->stmt);
        self->stmt = NULL;
    }
    if (self->rows_stmt) {
        sq.finalize(self->rows_stmt);
        self->rows_stmt = NULL;
    }
    PyMem_Free(self->json);
    self->json = NULL;
    self->json_cap = 0;
    if (self->db) {
        sq.close_v2(self->db);
        self->db = NULL;
    }
    if (self->ready_held) {
        PyBuffer_Release(&self->ready);
        self->ready_held = 0;
    }
    PyMem_Free(self->entries);
    PyMem_Free(self->heap);
    self->entries = self->heap = NULL;
    /* A closed path keeps nothing alive (the claimer's bound method would
       make a cycle the collector cannot see: this type is not tracked). */
    Py_CLEAR(self->reader);
    Py_CLEAR(self->granter);
    Py_CLEAR(self->grant_type);
    Py_CLEAR(self->decode_payload);
    Py_CLEAR(self->scan_once);
    Py_CLEAR(self->route_cadence);
    Py_CLEAR(self->cadence_of);
}

static PyObject *
path_close_method(ClaimPathObject *self, PyObject *Py_UNUSED(ignored))
{
    path_close(self);
    Py_RETURN_NONE;
}

/* In a child of fork: let go of the parent's connection without a call into
   SQLite (a close could checkpoint or unlock what the parent still uses). */
static PyObject *
path_abandon(ClaimPathObject *self, PyObject *Py_UNUSED(ignored))
{
    self->busy = 0; /* a claim another thread of the parent ran is no claim here */
    self->stmt = NULL;
    self->rows_stmt = NULL;
    self->db = NULL;
    path_close(self);
    Py_RETURN_NONE;
}

static void
path_dealloc(ClaimPathObject *self)
{
    self->busy = 0; /* no claim runs on an object nothing refers to */
    path_close(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
path_init(ClaimPathObject *self, PyObject *args, PyObject *kwds)
{
    PyObject *ready, *granter, *module, *grant_type, *decode_payload, *route_cadence,
        *cadence_of, *scan_once;
    const char *db_path;
    Py_ssize_t capacity, heap_size;
    int busy_ms, cache_kib;
    double low_water;
    const char *row_sql, *rows_sql;
    PyObject *reader = Py_None;
    static char *kwlist[] = {"ready", "capacity", "heap_size", "low_water", "granter",
                             "sqlite_module", "db_path", "busy_timeout_ms", "cache_kib",
                             "limits", "grant_type", "decode_payload", "route_cadence",
                             "cadence_of", "scan_once", "row_sql", "rows_sql", "reader", NULL};
    PyObject *limits;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OnndO!OziiOOOO!OOzz|O", kwlist, &ready,
                                     &capacity, &heap_size, &low_water, &GranterType, &granter,
                                     &module, &db_path, &busy_ms, &cache_kib, &limits,
                                     &grant_type, &decode_payload, &PyDict_Type, &route_cadence,
                                     &cadence_of, &scan_once, &row_sql, &rows_sql, &reader))
        return -1;
    /* Rows read from a SQLite file here (db_path and the statements), or
       handed in by reader (shm/_claim_rows.c): one or the other. */
    if (reader == Py_None ? (db_path == NULL || row_sql == NULL || rows_sql == NULL)
                          : !PyCallable_Check(reader)) {
        PyErr_SetString(PyExc_TypeError,
                        "ClaimPath: a db_path and its statements, or a callable reader");
        return -1;
    }
    if (self->db || self->reader || self->ready_held) {
        PyErr_SetString(PyExc_TypeError, "ClaimPath: already initialised");
        return -1;
    }
    if (!PyArg_ParseTuple(limits, "dddd", &self->min_cadence, &self->max_cadence,
                          &self->min_due, &self->max_due))
        return -1;
    if (!PyType_Check(grant_type) ||
        !PyType_IsSubtype((PyTypeObject *)grant_type, &PyTuple_Type) ||
        !PyCallable_Check(decode_payload) || !PyCallable_Check(cadence_of) ||
        !PyCallable_Check(scan_once)) {
        PyErr_SetString(PyExc_TypeError,
                        "ClaimPath: grant_type must be a tuple type, the others callables");
        return -1;
    }
    const char *module_path = NULL;
    if (module != Py_None) {
        module_path = PyUnicode_AsUTF8(module);
        if (module_path == NULL)
            return -1;
    }
    if (reader == Py_None && load_sqlite(module_path) < 0)
        return -1;
    if (capacity < 1 || heap_size < 1 || !(low_water >= 0 && low_water <= 1)) {
        PyErr_SetString(PyExc_ValueError, "ClaimPath: bad ready set figures");
        return -1;
    }
    if (PyObject_GetBuffer(ready, &self->ready, PyBUF_WRITABLE) < 0)
        return -1;
    self->ready_held = 1;
    self->ready_capacity = capacity;
    self->heap_size = heap_size;
    self->heap_at = R_SLOT_HEADER + R_ENTRY_SIZE * capacity;
    self->records_at = (R_SLOT_HEADER + R_ENTRY_SIZE * capacity + heap_size + 63) / 64 * 64;
    self->stride = (self->records_at + R_RECORD * capacity + 63) / 64 * 64;
    self->low_water_fraction = low_water;
    if (((uintptr_t)self->ready.buf) % 8 || R_FIRST_SLOT + 2 * self->stride > self->ready.len) {
        PyErr_SetString(PyExc_ValueError, "ClaimPath: the ready set does not fit its buffer");
        path_close(self);
        return -1;
    }
    self->entries = PyMem_Malloc(R_ENTRY_SIZE * capacity);
    self->heap = PyMem_Malloc(heap_size);
    if (self->entries == NULL || self->heap == NULL) {
        path_close(self);
        PyErr_NoMemory();
        return -1;
    }
    if (reader != Py_None) {
        self->reader = Py_NewRef(reader);
        goto python_side;
    }
    if (sq.open_v2(db_path, &self->db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_NOMUTEX, NULL) != SQLITE_OK) {
        if (self->db)
            set_row_error(self);
        else
            PyErr_NoMemory();
        path_close(self);
        return -1;
    }
    sq.busy_timeout(self->db, busy_ms);
    char pragma[64];
    snprintf(pragma, sizeof pragma, "PRAGMA cache_size = -%d", cache_kib);
    if (sq.exec(self->db, pragma, NULL, NULL, NULL) != SQLITE_OK ||
        sq.prepare_v2(self->db, row_sql, -1, &self->stmt, NULL) != SQLITE_OK ||
        sq.prepare_v2(self->db, rows_sql, -1, &self->rows_stmt, NULL) != SQLITE_OK) {
        set_row_error(self);
        path_close(self);
        return -1;
    }
python_side:
    Py_INCREF(granter);
    self->granter = (GranterObject *)granter;
    Py_INCREF(grant_type);
    self->grant_type = grant_type;
    Py_INCREF(decode_payload);
    self->decode_payload = decode_payload;
    Py_INCREF(scan_once);
    self->scan_once = scan_once;
    Py_INCREF(route_cadence);
    self->route_cadence = route_cadence;
    Py_INCREF(cadence_of);
    self->cadence_of = cadence_of;
    return 0;
}

/* The counters as a tuple (K_* order), or NULL with an exception. */
static PyObject *
counters_of(const long long *k)
{
    PyObject *counters = PyTuple_New(K_N);
    if (counters == NULL)
        return NULL;
    for (int i = 0; i < K_N; i++) {
        PyObject *v = PyLong_FromLongLong(k[i]);
        if (v == NULL) {
            Py_DECREF(counters);
            return NULL;
        }
        PyTuple_SET_ITEM(counters, i, v);
    }
    return counters;
}

/* claim(max, holder, lease_s, now, owner, stop) -> (grants, slow, counters)
 *
 * As Claimer.claim: take up to `max` entries (again while the set, or the
 * next one it switches to, has more),
 * grant what is still due. counters: see K_* (taken, gone, moved, not_due,
 * leased, held, parked, drained, low_water raised, last_count, last_left,
 * retries, switches to a pending set). Raises RowError (sqlite code,
 * message) on a store error, RuntimeError("unstable") when the set would not
 * read steadily, RuntimeError("not_granting") once the grant deadline has
 * passed (every take checks it), RuntimeError("sealed") when the lease
 * table is sealed, RuntimeError("busy") while another claim of this path
 * runs (its reader calling back, or another thread), and what a reader
 * raises; leases granted before an error are in the exception's `grants`
 * attribute, so none is lost, with `slow` and `counters` as returned. */
static PyObject *
path_claim(ClaimPathObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "claim() takes 6 arguments (%zd given)", nargs);
        return NULL;
    }
    if ((self->db == NULL && self->reader == NULL) || self->granter == NULL ||
        !self->granter->held || self->close_pending) {
        PyErr_SetString(PyExc_ValueError, "ClaimPath is closed");
        return NULL;
    }
    if (self->busy) { /* from its own reader, or another thread: one claim at a time */
        PyErr_SetString(PyExc_RuntimeError, "busy");
        return NULL;
    }
    Py_ssize_t max_n = PyLong_AsSsize_t(args[0]);
    if (max_n == -1 && PyErr_Occurred())
        return NULL;
    if (!PyBytes_Check(args[1]) || PyBytes_GET_SIZE(args[1]) > 32) {
        PyErr_SetString(PyExc_TypeError, "claim(): holder must be at most 32 bytes");
        return NULL;
    }
    GrantArgs a;
    memset(&a, 0, sizeof a);
    a.holder = PyBytes_AS_STRING(args[1]);
    a.holder_len = PyBytes_GET_SIZE(args[1]);
    a.lease_s = PyFloat_AsDouble(args[2]);
    a.now = PyFloat_AsDouble(args[3]);
    a.owner = PyLong_AsUnsignedLongLong(args[4]);
    a.stop = (int)PyLong_AsLong(args[5]);
    if (PyErr_Occurred())
        return NULL;
    if (max_n < 1 || !(a.lease_s > 0)) {
        PyErr_SetString(PyExc_ValueError, "claim(): max or lease_s out of range");
        return NULL;
    }
    long long k[K_N] = {0};
    PyObject *grants = PyList_New(0), *slow = PyList_New(0), *result = NULL;
    Py_ssize_t switches = self->switches;
    self->busy = 1;
    if (grants == NULL || slow == NULL)
        goto fail;
    char *ready = (char *)self->ready.buf;
    while (PyList_GET_SIZE(grants) + PyList_GET_SIZE(slow) < max_n) {
        Py_ssize_t want = max_n - PyList_GET_SIZE(grants) - PyList_GET_SIZE(slow);
        if (want > self->ready_capacity)
            want = self->ready_capacity;
        Taken t;
        Py_ssize_t retries = 0;
        int taken = take(self, want, &t, &retries);
        k[K_RETRIES] += retries;
        if (taken != 0) {
            PyErr_SetString(PyExc_RuntimeError,
                            taken == TAKE_NOT_GRANTING ? "not_granting" : "unstable");
            goto fail;
        }
        k[K_LAST_COUNT] = t.last_count;
        k[K_LAST_LEFT] = t.last_left;
        /* Taken past the low-water mark with no next set pending: ask for it. */
        if (t.last_left < t.last_count * self->low_water_fraction &&
            ld64(ready + R_LOW_WATER) == 0 && !next_pending(self) &&
            __atomic_compare_exchange_n((uint64_t *)(ready + R_LOW_WATER), &(uint64_t){0}, 1,
                                        0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            k[K_LOW_WATER]++;
        if (t.count == 0) {
            k[K_DRAINED]++;
            break;
        }
        k[K_TAKEN] += t.count;
        if (grant_taken(self, &t, &a, grants, slow, k) < 0)
            goto fail;
        /* Fewer than `want`: the set ran out under us. Take again: the next
           set may be pending (take switches to it), or nothing is left. */
    }
    k[K_SWITCHES] = self->switches - switches;
    PyObject *counters = counters_of(k);
    if (counters == NULL)
        goto fail;
    result = Py_BuildValue("(NNN)", grants, slow, counters);
    goto out;
fail:
    /* Hand back what was granted with the error, and the counters: those
       leases are live, the entries taken gone from the set. */
    k[K_SWITCHES] = self->switches - switches;
    if (grants != NULL && PyErr_Occurred()) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (value != NULL) {
            PyObject *counters = counters_of(k);
            PyObject_SetAttrString(value, "grants", grants);
            PyObject_SetAttrString(value, "slow", slow ? slow : Py_None);
            if (counters != NULL)
                PyObject_SetAttrString(value, "counters", counters);
            Py_XDECREF(counters);
            PyErr_Clear(); /* (a failed attribute: the claim's own error stands) */
        }
        PyErr_Restore(type, value, tb);
    }
    Py_XDECREF(grants);
    Py_XDECREF(slow);
out:
    self->busy = 0;
    if (self->close_pending) { /* closed from within the claim: now */
        self->close_pending = 0;
        path_close(self);
    }
    return result;
}

static PyMethodDef path_methods[] = {
    {"claim", (PyCFunction)(void (*)(void))path_claim, METH_FASTCALL,
     "claim(max, holder, lease_s, now, owner, stop) -> (grants, slow, counters)"},
    {"close", (PyCFunction)path_close_method, METH_NOARGS,
     "close(): the SQLite connection and the ready set's buffer"},
    {"abandon", (PyCFunction)path_abandon, METH_NOARGS,
     "abandon(): in a child of fork, drop the parent's connection unclosed"},
    {NULL, NULL, 0, NULL},
};

PyTypeObject ClaimPathType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shm._claim.ClaimPath",
    .tp_basicsize = sizeof(ClaimPathObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "ClaimPath(ready, capacity, heap_size, low_water, granter, sqlite_module, db_path,"
              " busy_timeout_ms, cache_kib, limits, grant_type, decode_payload, route_cadence,"
              " cadence_of, scan_once, row_sql, rows_sql, reader=None): rows read from"
              " db_path with row_sql and rows_sql, or (reader) handed in: reader(keys) -> rows,"
              " each (key, route, cadence_s, sitemap, due_at, payload, job, version)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)path_init,
    .tp_dealloc = (destructor)path_dealloc,
    .tp_methods = path_methods,
};

int
claim_path_add(PyObject *m)
{
    RowError = PyErr_NewException("shm._claim.RowError", NULL, NULL);
    if (RowError == NULL || PyModule_AddObjectRef(m, "RowError", RowError) < 0)
        return -1;
    if (PyType_Ready(&ClaimPathType) < 0)
        return -1;
    return PyModule_AddObjectRef(m, "ClaimPath", (PyObject *)&ClaimPathType);
}
