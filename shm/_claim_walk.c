/* shm._claim.Walker: the keeper's load walk of a SQLite schedule in C
 * (node/store/sqlite.py, walk_schedule), through the same SQLite library as
 * the claim path (shm/_claim_sqlite.c).
 *
 * What it saves against sqlite3's fetchall (docs/performance.md, "Exec to
 * live, round 3"): the row-validity expression SQLite evaluated a row (the
 * checks are made here on the column types and values), a Python object a
 * column for the route and the cadence (the same str and int are handed out
 * again while they repeat) and the tuple slicing after it.
 *
 * Walker(module, db_path, busy_ms, limits, all_sql, after_sql)
 *   walk(after, limit) -> (rows, last) | (None, None)
 *   close()
 *
 * rows: what SQLiteStore.walk_schedule's SQL gives, ``(key, version, route,
 * cadence_s, sitemap, due_at)`` a row, ``sitemap`` 0 or 1, ``due_at`` an
 * int where SQLite stored an integer; ``last`` the last key when the walk
 * read ``limit`` rows, else None. (None, None) when a row of the chunk is not
 * as the node writes rows (unschedulable, a key or version of another type,
 * a key that is not UTF-8) or SQLite failed: the caller reads the chunk
 * itself then, and answers or raises exactly as it always did. */

#include "_claim_path.h"

#define WALK_CACHED 64 /* routes and cadences handed out again */
#define MAX_KEY_BYTES 1024 /* node.core.rows.MAX_KEY_BYTES */

typedef struct {
    PyObject_HEAD
    sqlite3 *db;
    sqlite3_stmt *all_stmt;   /* the first chunk: LIMIT ?1 */
    sqlite3_stmt *after_stmt; /* the next ones: key > ?1, LIMIT ?2 */
    long long min_cadence, max_cadence;
    double min_due, max_due;
    /* the routes seen (their UTF-8 bytes and str) and the cadences (int) */
    char *route_bytes[WALK_CACHED];
    int route_len[WALK_CACHED];
    PyObject *route_str[WALK_CACHED];
    int routes, route_last;
    long long cadence_value[WALK_CACHED];
    PyObject *cadence_int[WALK_CACHED];
    int cadences;
} WalkerObject;

static void
walker_close_db(WalkerObject *self)
{
    if (self->all_stmt)
        sq.finalize(self->all_stmt);
    if (self->after_stmt)
        sq.finalize(self->after_stmt);
    if (self->db)
        sq.close_v2(self->db);
    self->all_stmt = self->after_stmt = NULL;
    self->db = NULL;
}

static void
walker_clear_cache(WalkerObject *self)
{
    for (int i = 0; i < self->routes; i++) {
        PyMem_Free(self->route_bytes[i]);
        Py_CLEAR(self->route_str[i]);
    }
    for (int i = 0; i < self->cadences; i++)
        Py_CLEAR(self->cadence_int[i]);
    self->routes = self->route_last = self->cadences = 0;
}

static void
walker_dealloc(WalkerObject *self)
{
    walker_close_db(self);
    walker_clear_cache(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
walker_init(WalkerObject *self, PyObject *args, PyObject *kw)
{
    PyObject *module;
    const char *db_path, *all_sql, *after_sql;
    int busy_ms;
    if (!PyArg_ParseTuple(args, "Osi(LLdd)ss", &module, &db_path, &busy_ms, &self->min_cadence,
                          &self->max_cadence, &self->min_due, &self->max_due, &all_sql,
                          &after_sql))
        return -1;
    walker_close_db(self);
    const char *module_path = NULL;
    if (module != Py_None && (module_path = PyUnicode_AsUTF8(module)) == NULL)
        return -1;
    if (load_sqlite(module_path) < 0)
        return -1;
    if (sq.open_v2(db_path, &self->db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_NOMUTEX, NULL) !=
        SQLITE_OK) {
        if (self->db)
            PyErr_Format(RowError, "Walker: %s", sq.errmsg(self->db));
        else
            PyErr_NoMemory();
        walker_close_db(self);
        return -1;
    }
    sq.busy_timeout(self->db, busy_ms);
    if (sq.prepare_v2(self->db, all_sql, -1, &self->all_stmt, NULL) != SQLITE_OK ||
        sq.prepare_v2(self->db, after_sql, -1, &self->after_stmt, NULL) != SQLITE_OK) {
        PyErr_Format(RowError, "Walker: %s", sq.errmsg(self->db));
        walker_close_db(self);
        return -1;
    }
    return 0;
}

/* The route's str, made once for each of the first WALK_CACHED routes seen
   (past them, a new str a row: the same value). */
static PyObject *
walker_route(WalkerObject *self, const char *text, int n)
{
    int i = self->route_last;
    if (i < self->routes && self->route_len[i] == n &&
        memcmp(self->route_bytes[i], text, (size_t)n) == 0)
        return Py_NewRef(self->route_str[i]);
    for (i = 0; i < self->routes; i++)
        if (self->route_len[i] == n && memcmp(self->route_bytes[i], text, (size_t)n) == 0) {
            self->route_last = i;
            return Py_NewRef(self->route_str[i]);
        }
    PyObject *s = PyUnicode_DecodeUTF8(text, n, NULL);
    if (s == NULL || self->routes == WALK_CACHED)
        return s;
    char *copy = PyMem_Malloc(n ? (size_t)n : 1);
    if (copy == NULL)
        return s; /* not cached: still the right str */
    memcpy(copy, text, (size_t)n);
    i = self->routes++;
    self->route_bytes[i] = copy;
    self->route_len[i] = n;
    self->route_str[i] = Py_NewRef(s);
    self->route_last = i;
    return s;
}

/* The cadence's int, made once for each of the first WALK_CACHED seen. */
static PyObject *
walker_cadence(WalkerObject *self, long long value)
{
    for (int i = 0; i < self->cadences; i++)
        if (self->cadence_value[i] == value)
            return Py_NewRef(self->cadence_int[i]);
    PyObject *v = PyLong_FromLongLong(value);
    if (v == NULL || self->cadences == WALK_CACHED)
        return v;
    self->cadence_value[self->cadences] = value;
    self->cadence_int[self->cadences++] = Py_NewRef(v);
    return v;
}

/* One row as walk_schedule's SQL gives it: a new tuple, NULL with no error
   set when the row is not as the node writes rows, NULL with an error set
   when Python failed (memory). */
static PyObject *
walker_row(WalkerObject *self, sqlite3_stmt *st)
{
    if (sq.column_type(st, 0) != SQLITE_TEXT || sq.column_type(st, 1) != SQLITE_INTEGER ||
        sq.column_type(st, 2) != SQLITE_TEXT || sq.column_type(st, 4) != SQLITE_INTEGER)
        return NULL;
    int ct = sq.column_type(st, 3), dt = sq.column_type(st, 5);
    long long cadence = 0, sitemap = sq.column_int64(st, 4);
    if (ct == SQLITE_INTEGER) {
        cadence = sq.column_int64(st, 3);
        if (cadence < self->min_cadence || cadence > self->max_cadence)
            return NULL;
    } else if (ct != SQLITE_NULL)
        return NULL;
    if (sitemap != 0 && sitemap != 1)
        return NULL;
    if (dt != SQLITE_FLOAT && dt != SQLITE_INTEGER)
        return NULL;
    double due = sq.column_double(st, 5);
    if (!(due >= self->min_due && due <= self->max_due))
        return NULL;
    const char *route = (const char *)sq.column_text(st, 2); /* text, then its length */
    int route_n = sq.column_bytes(st, 2);
    if (route_n == 0 || route == NULL)
        return NULL;
    const char *key = (const char *)sq.column_text(st, 0);
    int key_n = sq.column_bytes(st, 0);
    if (key == NULL || key_n < 1 || key_n > MAX_KEY_BYTES)
        return NULL; /* no key of the node's (node.rows.stored_key_is_valid): the SQL says so */
    PyObject *row = PyTuple_New(6);
    if (row == NULL)
        return NULL;
    PyObject *k = PyUnicode_DecodeUTF8(key, key_n, NULL);
    if (k == NULL) {
        if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
            PyErr_Clear(); /* not UTF-8: the caller's own read says so */
        Py_DECREF(row);
        return NULL;
    }
    PyTuple_SET_ITEM(row, 0, k);
    PyObject *r = walker_route(self, route, route_n);
    if (r == NULL) {
        if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
            PyErr_Clear();
        Py_DECREF(row);
        return NULL;
    }
    PyTuple_SET_ITEM(row, 2, r);
    PyObject *v = PyLong_FromLongLong(sq.column_int64(st, 1));
    PyObject *c = ct == SQLITE_NULL ? Py_NewRef(Py_None) : walker_cadence(self, cadence);
    PyObject *s = PyLong_FromLongLong(sitemap); /* 0 or 1: the interpreter's own */
    PyObject *d = dt == SQLITE_INTEGER ? PyLong_FromLongLong(sq.column_int64(st, 5))
                                       : PyFloat_FromDouble(due);
    if (v == NULL || c == NULL || s == NULL || d == NULL) {
        Py_XDECREF(v);
        Py_XDECREF(c);
        Py_XDECREF(s);
        Py_XDECREF(d);
        Py_DECREF(row);
        return NULL;
    }
    PyTuple_SET_ITEM(row, 1, v);
    PyTuple_SET_ITEM(row, 3, c);
    PyTuple_SET_ITEM(row, 4, s);
    PyTuple_SET_ITEM(row, 5, d);
    return row;
}

static PyObject *
walker_walk(WalkerObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "walk(after, limit)");
        return NULL;
    }
    long long limit = PyLong_AsLongLong(args[1]);
    if (limit == -1 && PyErr_Occurred())
        return NULL;
    if (self->db == NULL) {
        PyErr_SetString(PyExc_ValueError, "Walker: closed");
        return NULL;
    }
    PyObject *after = args[0];
    sqlite3_stmt *st;
    if (after == Py_None) {
        st = self->all_stmt;
        if (sq.bind_int64(st, 1, limit) != SQLITE_OK)
            goto fallback_reset;
    } else {
        Py_ssize_t n;
        const char *text = PyUnicode_AsUTF8AndSize(after, &n);
        if (text == NULL)
            return NULL;
        st = self->after_stmt;
        /* SQLITE_TRANSIENT (-1): SQLite copies the text. */
        if (sq.bind_text(st, 1, text, (int)n, (void (*)(void *))(intptr_t)-1) != SQLITE_OK ||
            sq.bind_int64(st, 2, limit) != SQLITE_OK)
            goto fallback_reset;
    }
    PyObject *rows = PyList_New(0);
    if (rows == NULL) {
        sq.reset(st);
        return NULL;
    }
    int rc;
    while ((rc = sq.step(st)) == SQLITE_ROW) {
        PyObject *row = walker_row(self, st);
        if (row == NULL) {
            Py_DECREF(rows);
            if (PyErr_Occurred()) {
                sq.reset(st);
                return NULL;
            }
            goto fallback_reset;
        }
        int failed = PyList_Append(rows, row);
        Py_DECREF(row);
        if (failed) {
            Py_DECREF(rows);
            sq.reset(st);
            return NULL;
        }
    }
    sq.reset(st);
    if (rc != SQLITE_DONE) {
        Py_DECREF(rows);
        return Py_BuildValue("(OO)", Py_None, Py_None);
    }
    Py_ssize_t got = PyList_GET_SIZE(rows);
    PyObject *last = got >= limit && got > 0
                         ? PyTuple_GET_ITEM(PyList_GET_ITEM(rows, got - 1), 0)
                         : Py_None;
    PyObject *out = PyTuple_Pack(2, rows, last);
    Py_DECREF(rows);
    return out;

fallback_reset:
    sq.reset(st);
    return Py_BuildValue("(OO)", Py_None, Py_None);
}

static PyObject *
walker_close(WalkerObject *self, PyObject *unused)
{
    walker_close_db(self);
    walker_clear_cache(self);
    Py_RETURN_NONE;
}

static PyMethodDef walker_methods[] = {
    {"walk", (PyCFunction)(void (*)(void))walker_walk, METH_FASTCALL,
     "walk(after, limit) -> (rows, last), or (None, None): read the chunk yourself"},
    {"close", (PyCFunction)walker_close, METH_NOARGS, "close() the walker's connection"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject WalkerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shm._claim.Walker",
    .tp_basicsize = sizeof(WalkerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Walker(module, db_path, busy_ms, limits, all_sql, after_sql): the load walk",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)walker_init,
    .tp_dealloc = (destructor)walker_dealloc,
    .tp_methods = walker_methods,
};

INTERNAL int
claim_walk_add(PyObject *m)
{
    if (PyType_Ready(&WalkerType) < 0)
        return -1;
    return PyModule_AddObjectRef(m, "Walker", (PyObject *)&WalkerType);
}
