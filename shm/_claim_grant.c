/* The claim path's rows and grants: each taken entry's row read by key (a run
 * of keys in one statement), checked as node.core.rows checks a stored row,
 * and granted (shm/_grant.c's lease_grant) when still due at its published
 * version; what the C grant cannot make goes back as a row for the Python
 * grant. The per-entry loop is all in this file. */

#include "_claim_path.h"

#include <math.h>
#include <string.h>

/* The columns the statements read (node/store/queries.py CLAIM_ROW_SQL, and
   CLAIM_ROWS_SQL after its key's index), in this order. */
enum { C_ROUTE, C_CADENCE, C_SITEMAP, C_DUE_AT, C_PAYLOAD, C_JOB, C_VERSION };
/* Keys read one statement each below this many in a run. */
#define ROWS_BATCH_MIN 4

/* -- rows ---------------------------------------------------------------------- */

/* A column as Python's sqlite3 gives it (TEXT must be UTF-8: NULL on error). */
static PyObject *
column_value(sqlite3_stmt *stmt, int i)
{
    switch (sq.column_type(stmt, i)) {
    case SQLITE_INTEGER:
        return PyLong_FromLongLong(sq.column_int64(stmt, i));
    case SQLITE_FLOAT:
        return PyFloat_FromDouble(sq.column_double(stmt, i));
    case SQLITE_TEXT: {
        const char *t = (const char *)sq.column_text(stmt, i);
        return PyUnicode_DecodeUTF8(t, sq.column_bytes(stmt, i), NULL);
    }
    case SQLITE_BLOB:
        return PyBytes_FromStringAndSize(sq.column_blob(stmt, i), sq.column_bytes(stmt, i));
    default:
        Py_RETURN_NONE;
    }
}

/* A payload's or job's column: as column_value, but TEXT that is not UTF-8
   (another program's) as its bytes, as Python's read gives it then
   (node/store/sqlite_values.py, read_raw): the claim hands the payload out
   raw, and releases a row whose job is such bytes with the reason
   (workers/claim/path.py). */
static PyObject *
column_value_or_bytes(sqlite3_stmt *stmt, int i)
{
    PyObject *v = column_value(stmt, i);
    if (v == NULL && sq.column_type(stmt, i) == SQLITE_TEXT &&
        PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
        PyErr_Clear();
        v = PyBytes_FromStringAndSize((const char *)sq.column_text(stmt, i),
                                      sq.column_bytes(stmt, i));
    }
    return v;
}

/* One row, checked as node.rows.stored_row_is_valid checks it. */
typedef struct {
    PyObject *route;   /* str */
    int has_cadence;
    long long cadence; /* when has_cadence */
    PyObject *due_at;  /* int or float, as stored */
    double due;
    PyObject *payload; /* the stored value, not decoded */
    PyObject *job;
    unsigned long long version;
} RowRead;

static void
row_clear(RowRead *r)
{
    Py_CLEAR(r->route);
    Py_CLEAR(r->due_at);
    Py_CLEAR(r->payload);
    Py_CLEAR(r->job);
}

/* The current row of `st`, its columns from `at` on in C_* order: 1 a valid
   row in *r, 0 one the keeper cannot schedule. */
static int
parse_row(ClaimPathObject *self, sqlite3_stmt *st, int at, RowRead *r)
{
    memset(r, 0, sizeof *r);
    int route_t = sq.column_type(st, at + C_ROUTE), cad_t = sq.column_type(st, at + C_CADENCE),
        site_t = sq.column_type(st, at + C_SITEMAP), due_t = sq.column_type(st, at + C_DUE_AT);
    if (route_t != SQLITE_TEXT || sq.column_bytes(st, at + C_ROUTE) == 0)
        return 0;
    if (cad_t == SQLITE_INTEGER) {
        r->cadence = sq.column_int64(st, at + C_CADENCE);
        if (!(r->cadence >= self->min_cadence && r->cadence <= self->max_cadence))
            return 0;
        r->has_cadence = 1;
    }
    else if (cad_t != SQLITE_NULL)
        return 0;
    if (site_t == SQLITE_INTEGER) {
        long long v = sq.column_int64(st, at + C_SITEMAP);
        if (v != 0 && v != 1)
            return 0;
    }
    else if (site_t == SQLITE_FLOAT) {
        double v = sq.column_double(st, at + C_SITEMAP);
        if (v != 0.0 && v != 1.0)
            return 0;
    }
    else
        return 0;
    if (due_t != SQLITE_INTEGER && due_t != SQLITE_FLOAT)
        return 0;
    r->due = sq.column_double(st, at + C_DUE_AT);
    if (!isfinite(r->due) || !(r->due >= self->min_due && r->due <= self->max_due))
        return 0;
    if (sq.column_type(st, at + C_VERSION) != SQLITE_INTEGER)
        return 0;
    r->version = (unsigned long long)sq.column_int64(st, at + C_VERSION);
    r->route = column_value(st, at + C_ROUTE);
    r->due_at = column_value(st, at + C_DUE_AT);
    r->payload = column_value_or_bytes(st, at + C_PAYLOAD);
    r->job = column_value_or_bytes(st, at + C_JOB);
    if (r->route == NULL || r->due_at == NULL || r->payload == NULL || r->job == NULL) {
        /* A route that is not UTF-8: a row nobody can schedule, not an error */
        PyErr_Clear();
        row_clear(r);
        return 0;
    }
    return 1;
}

/* One key's row, one statement: 1 a valid row in *r, 0 no row or one the
   keeper cannot schedule, -1 error. */
static int
read_row(ClaimPathObject *self, const char *key, Py_ssize_t key_len, RowRead *r)
{
    sqlite3_stmt *st = self->stmt;
    memset(r, 0, sizeof *r);
    if (sq.bind_text(st, 1, key, (int)key_len, NULL) != SQLITE_OK) {
        set_row_error(self);
        return -1;
    }
    int rc = sq.step(st);
    int valid = 0;
    if (rc == SQLITE_ROW)
        valid = parse_row(self, st, 0, r);
    else if (rc != SQLITE_DONE) {
        set_row_error(self);
        valid = -1;
    }
    sq.reset(st);
    return valid;
}

/* Append `key` to self->json as a JSON string (the array's brackets and
   commas are the caller's); -1 with MemoryError. */
static int
json_key(ClaimPathObject *self, Py_ssize_t *len, const char *key, Py_ssize_t key_len)
{
    Py_ssize_t need = *len + 6 * key_len + 4;
    if (need > self->json_cap) {
        Py_ssize_t cap = need * 2 > 4096 ? need * 2 : 4096;
        char *grown = PyMem_Realloc(self->json, cap);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->json = grown;
        self->json_cap = cap;
    }
    static const char hex[] = "0123456789abcdef";
    char *out = self->json + *len;
    *out++ = '"';
    for (Py_ssize_t i = 0; i < key_len; i++) {
        unsigned char c = (unsigned char)key[i];
        if (c == '"' || c == '\\') {
            *out++ = '\\';
            *out++ = (char)c;
        }
        else if (c < 0x20) {
            memcpy(out, "\\u00", 4);
            out[4] = hex[c >> 4];
            out[5] = hex[c & 15];
            out += 6;
        }
        else
            *out++ = (char)c; /* UTF-8 passes through */
    }
    *out++ = '"';
    *len = out - self->json;
    return 0;
}

/* The cadence a grant caps holds at: the row's, or its route's default. */
static int
cadence_for(ClaimPathObject *self, RowRead *r, double *out)
{
    if (r->has_cadence) {
        *out = (double)r->cadence;
        return 0;
    }
    PyObject *v = PyDict_GetItemWithError(self->route_cadence, r->route);
    if (v != NULL) {
        Py_INCREF(v);
    }
    else {
        if (PyErr_Occurred())
            return -1;
        v = PyObject_CallOneArg(self->cadence_of, r->route);
        if (v == NULL)
            return -1;
    }
    *out = PyFloat_AsDouble(v);
    Py_DECREF(v);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* -- the claim ----------------------------------------------------------------- */

static Py_ssize_t
skip_ws(PyObject *s, Py_ssize_t i)
{
    Py_ssize_t n = PyUnicode_GET_LENGTH(s);
    int kind = PyUnicode_KIND(s);
    const void *data = PyUnicode_DATA(s);
    while (i < n) {
        Py_UCS4 c = PyUnicode_READ(kind, data, i);
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r')
            break;
        i++;
    }
    return i;
}

/* node.store.sqlite_values.decode_payload: JSON text parsed, anything that is not
   JSON as stored. For str, json.loads's steps without its Python frames: the
   C scanner between JSON whitespace; other values go to decode_payload. */
static PyObject *
decode(ClaimPathObject *self, PyObject *stored)
{
    if (stored == Py_None)
        Py_RETURN_NONE;
    if (!PyUnicode_CheckExact(stored))
        return PyObject_CallOneArg(self->decode_payload, stored);
    Py_ssize_t start = skip_ws(stored, 0);
    PyObject *idx = PyLong_FromSsize_t(start);
    if (idx == NULL)
        return NULL;
    PyObject *args[2] = {stored, idx};
    PyObject *got = PyObject_Vectorcall(self->scan_once, args, 2, NULL);
    Py_DECREF(idx);
    if (got == NULL) {
        if (PyErr_ExceptionMatches(PyExc_StopIteration) ||
            PyErr_ExceptionMatches(PyExc_ValueError)) {
            PyErr_Clear();
            return Py_NewRef(stored); /* not JSON: as stored */
        }
        return NULL;
    }
    PyObject *value = NULL;
    Py_ssize_t end;
    if (PyTuple_Check(got) && PyTuple_GET_SIZE(got) == 2 &&
        (end = PyLong_AsSsize_t(PyTuple_GET_ITEM(got, 1))) >= 0) {
        if (skip_ws(stored, end) == PyUnicode_GET_LENGTH(stored))
            value = Py_NewRef(PyTuple_GET_ITEM(got, 0));
        else
            value = Py_NewRef(stored); /* extra data after the value */
    }
    else if (!PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "scan_once answered something not (value, end)");
    Py_DECREF(got);
    return value;
}

static PyObject *
new_grant(ClaimPathObject *self, uint64_t lease_id, PyObject *key, RowRead *r, double expires,
          uint32_t misses)
{
    PyObject *payload = decode(self, r->payload);
    if (payload == NULL)
        return NULL;
    PyTypeObject *type = (PyTypeObject *)self->grant_type;
    PyObject *g = type->tp_alloc(type, 8);
    if (g == NULL) {
        Py_DECREF(payload);
        return NULL;
    }
    PyObject *items[8] = {
        PyLong_FromUnsignedLongLong(lease_id), key, payload, r->job, r->due_at,
        PyFloat_FromDouble(expires), r->route, PyLong_FromUnsignedLong(misses),
    };
    if (items[0] == NULL || items[5] == NULL || items[7] == NULL) {
        Py_XDECREF(items[0]);
        Py_XDECREF(items[5]);
        Py_XDECREF(items[7]);
        Py_DECREF(payload);
        Py_DECREF(g);
        return NULL;
    }
    Py_INCREF(key);
    Py_INCREF(r->job);
    Py_INCREF(r->due_at);
    Py_INCREF(r->route);
    for (int i = 0; i < 8; i++)
        PyTuple_SET_ITEM(g, i, items[i]); /* steals */
    return g;
}

/* A slow entry for the Python grant: (key, version, cadence_s, payload, job,
   due_at, route), the payload as stored. */
static PyObject *
slow_entry(PyObject *key, RowRead *r, double cadence)
{
    return Py_BuildValue("(OKdOOOO)", key, r->version, cadence, r->payload, r->job, r->due_at,
                         r->route);
}

static PyObject *
entry_key(const Taken *t, const char *heap, const char *entry)
{
    uint32_t off;
    uint16_t len;
    memcpy(&off, entry + E_KEY_OFFSET, 4);
    memcpy(&len, entry + E_KEY_LEN, 2);
    const char *p = heap + (off - t->heap_lo);
    if (t->flags & R_FLAG_ASCII)
        return PyUnicode_DecodeASCII(p, len, NULL);
    return PyUnicode_DecodeUTF8(p, len, NULL);
}

/* Keys hashed and prefetched at a time (lease_prefetch): 64 slots' lines are
   about 45 KiB, in the L2 cache of anything this runs on. */
#define PREFETCH_RUN 64

/* What lease_refusal found for one entry of a run, kept for its grant. */
typedef struct {
    uint64_t h64;
    int looked;
    Py_ssize_t slot;
    uint64_t word;
    char record[144];
} Look;

/* Entry i's row has been read into *r (valid): grant it if it is still due
   at its published version. 0, or -1 with an exception. */
static int
grant_row(ClaimPathObject *self, const Taken *t, GrantArgs *a, Py_ssize_t i, RowRead *r,
          PyObject *grants, PyObject *slow, long long *k)
{
    const char *entry = self->entries + R_ENTRY_SIZE * i;
    uint64_t version;
    memcpy(&version, entry + E_VERSION, 8);
    if (r->version != version) {
        k[K_MOVED]++;
        return 0;
    }
    if (r->due > a->now) {
        k[K_NOT_DUE]++;
        return 0;
    }
    double cadence;
    if (cadence_for(self, r, &cadence) < 0)
        return -1;
    a->cadence_s = cadence;
    a->version = r->version;
    uint64_t lease_id = 0, word = 0;
    uint32_t misses = 0;
    Py_ssize_t slot = -1;
    /* The read-to-grant window (docs/delivery.md): a test stops here. */
    LEASE_STOP(a->stop, P_READ);
    int got = lease_grant(self->granter, a, &lease_id, &misses, &slot, &word);
    if (got == G_GRANTED && slot >= 0 && slot < (Py_ssize_t)GRANT_SLOT_MASK)
        /* Tell the keeper where this key's lease is (ready.py's grant
           records): its next scan need not read the slot. */
        __atomic_store_n(&t->records[i],
                         (uint64_t)(slot + 1) |
                             ((word >> WORD_COPY_SHIFT) & 1) << GRANT_COPY_SHIFT |
                             ((word >> SEQ_SHIFT) & SEQ_MASK) << GRANT_SEQ_SHIFT |
                             t->tag << RECORD_TAG_SHIFT,
                         __ATOMIC_RELEASE);
    if (got == G_SEALED) {
        /* The node stopped granting from this table: end the claim here
           (workers/claim/path.py answers NodeRestarted; what was granted before
           is handed back with the error, as for any error). */
        PyErr_SetString(PyExc_RuntimeError, "sealed");
        return -1;
    }
    if (got == G_NO_SHARD)
        got = G_SLOW; /* the Python grant gives this process its counter shard */
    if (got == G_GRANTED || got == G_SLOW) {
        PyObject *key_str = entry_key(t, self->heap, entry);
        if (key_str == NULL)
            return -1;
        PyObject *item, *out = grants;
        if (got == G_GRANTED)
            item = new_grant(self, lease_id, key_str, r, a->now + a->lease_s, misses);
        else {
            item = slow_entry(key_str, r, cadence);
            out = slow;
        }
        Py_DECREF(key_str);
        int rc = (item == NULL || PyList_Append(out, item) < 0) ? -1 : 0;
        Py_XDECREF(item);
        return rc;
    }
    if (got == G_LEASED)
        k[K_LEASED]++;
    else if (got == G_HELD)
        k[K_HELD]++;
    else if (got == G_PARKED)
        k[K_PARKED]++;
    else {
        PyErr_SetString(PyExc_RuntimeError, "lease table: a slot was taken while held");
        return -1;
    }
    return 0;
}

/* Entry i's key and what lease_refusal found for it, into a. */
static void
args_for(ClaimPathObject *self, const Taken *t, GrantArgs *a, Py_ssize_t i, const Look *look)
{
    const char *entry = self->entries + R_ENTRY_SIZE * i;
    uint32_t off;
    uint16_t len;
    memcpy(&off, entry + E_KEY_OFFSET, 4);
    memcpy(&len, entry + E_KEY_LEN, 2);
    a->key = self->heap + (off - t->heap_lo);
    a->key_len = len;
    a->h64 = look->h64;
    a->hashed = 1;
    a->looked = look->looked;
    if (look->looked == 1) {
        a->slot = look->slot;
        a->word = look->word;
        memcpy(a->record, look->record, sizeof a->record);
    }
}

/* The first steps of a run of entries [lo, hi) (at most PREFETCH_RUN): the
   keys hashed and their slots' lines fetched while the first are looked at,
   then the entries the lease table refuses now set aside (counted in k; a set
   published while claimers granted from the last one starts with some of
   those keys, and they cost no row read). The others, in entry order, go to
   need (their rows read in a run), or to alone (read on their own: a key
   holding NUL, which json_each gives back cut short). */
static void
look_run(ClaimPathObject *self, const Taken *t, GrantArgs *a, Py_ssize_t lo, Py_ssize_t hi,
         Look *looks, Py_ssize_t *need, int *n, Py_ssize_t *alone, int *n_alone, long long *k)
{
    for (Py_ssize_t i = lo; i < hi; i++) {
        const char *e = self->entries + R_ENTRY_SIZE * i;
        uint32_t o;
        uint16_t l;
        memcpy(&o, e + E_KEY_OFFSET, 4);
        memcpy(&l, e + E_KEY_LEN, 2);
        looks[i - lo].h64 = lease_prefetch(self->granter, self->heap + (o - t->heap_lo), l);
    }
    for (Py_ssize_t i = lo; i < hi; i++) {
        Look *look = &looks[i - lo];
        look->looked = 0;
        args_for(self, t, a, i, look);
        int refused = lease_refusal(self->granter, a);
        if (refused) {
            k[refused == G_LEASED ? K_LEASED : refused == G_HELD ? K_HELD : K_PARKED]++;
            continue;
        }
        look->looked = a->looked;
        look->slot = a->slot;
        look->word = a->word;
        if (a->looked == 1)
            memcpy(look->record, a->record, sizeof look->record);
        if (memchr(a->key, 0, a->key_len) != NULL)
            alone[(*n_alone)++] = i;
        else
            need[(*n)++] = i;
    }
}

/* Grant a run of entries [lo, hi) (at most PREFETCH_RUN): refusals first,
   then the rows of the rest, in one statement when there are enough of
   them. 0, or -1 with an exception. */
static int
grant_run(ClaimPathObject *self, const Taken *t, GrantArgs *a, Py_ssize_t lo, Py_ssize_t hi,
          PyObject *grants, PyObject *slow, long long *k)
{
    Look looks[PREFETCH_RUN];
    Py_ssize_t need[PREFETCH_RUN], alone[PREFETCH_RUN]; /* entries whose row is read */
    int found[PREFETCH_RUN];
    int n = 0, n_alone = 0;
    look_run(self, t, a, lo, hi, looks, need, &n, alone, &n_alone, k);
    if (n < ROWS_BATCH_MIN) { /* too few for a batch to pay: all on their own */
        memcpy(alone + n_alone, need, n * sizeof need[0]);
        n_alone += n;
        n = 0;
    }
    for (int j = 0; j < n_alone; j++) {
        Py_ssize_t i = alone[j];
        args_for(self, t, a, i, &looks[i - lo]);
        RowRead r;
        int got = read_row(self, a->key, a->key_len, &r);
        if (got < 0)
            return -1;
        if (!got) {
            k[K_GONE]++;
            continue;
        }
        int rc = grant_row(self, t, a, i, &r, grants, slow, k);
        row_clear(&r);
        if (rc < 0)
            return -1;
    }
    if (n == 0)
        return 0;
    Py_ssize_t len = 1;
    for (int j = 0; j < n; j++) {
        const char *e = self->entries + R_ENTRY_SIZE * need[j];
        uint32_t o;
        uint16_t l;
        memcpy(&o, e + E_KEY_OFFSET, 4);
        memcpy(&l, e + E_KEY_LEN, 2);
        if (json_key(self, &len, self->heap + (o - t->heap_lo), l) < 0)
            return -1;
        self->json[len++] = j + 1 < n ? ',' : ']';
        found[j] = 0;
    }
    self->json[0] = '[';
    sqlite3_stmt *st = self->rows_stmt;
    if (sq.bind_text(st, 1, self->json, (int)len, NULL) != SQLITE_OK) {
        set_row_error(self);
        return -1;
    }
    int rc = 0;
    for (;;) {
        int step = sq.step(st);
        if (step == SQLITE_DONE)
            break;
        if (step != SQLITE_ROW) {
            set_row_error(self);
            rc = -1;
            break;
        }
        long long j = sq.column_int64(st, 0);
        if (j < 0 || j >= n || found[j])
            continue; /* not an index of the array, or a key twice in the schedule */
        found[j] = 1;
        RowRead r;
        if (!parse_row(self, st, 1, &r)) {
            k[K_GONE]++;
            continue;
        }
        Py_ssize_t i = need[j];
        args_for(self, t, a, i, &looks[i - lo]);
        rc = grant_row(self, t, a, i, &r, grants, slow, k);
        row_clear(&r);
        if (rc < 0)
            break;
    }
    sq.reset(st);
    if (rc == 0)
        for (int j = 0; j < n; j++)
            if (!found[j])
                k[K_GONE]++; /* no row */
    return rc;
}

int
grant_taken(ClaimPathObject *self, const Taken *t, GrantArgs *a, PyObject *grants,
            PyObject *slow, long long *k)
{
    if (self->reader != NULL)
        return grant_read(self, t, a, grants, slow, k);
    int in_txn = 0;
    if (t->count > 1) {
        if (sq.exec(self->db, "BEGIN", NULL, NULL, NULL) != SQLITE_OK) {
            set_row_error(self);
            return -1;
        }
        in_txn = 1;
    }
    int rc = 0;
    for (Py_ssize_t lo = 0; lo < t->count && rc == 0; lo += PREFETCH_RUN)
        rc = grant_run(self, t, a, lo, lo + PREFETCH_RUN < t->count ? lo + PREFETCH_RUN : t->count,
                       grants, slow, k);
    if (in_txn && !sq.get_autocommit(self->db))
        sq.exec(self->db, "COMMIT", NULL, NULL, NULL); /* a read: nothing to lose */
    return rc;
}
