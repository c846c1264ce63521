/* The claim path with its rows handed in: a node on PostgreSQL, whose
 * claimers read their rows through the node's row service (workers/rows)
 * rather than a file of their own. ClaimPath(..., reader=f) calls
 * f(keys) once a run of entries (at most PREFETCH_RUN), with the keys the
 * lease table does not refuse, in entry order; f answers the rows found as
 * stored, each (key, route, cadence_s, sitemap, due_at, payload, job,
 * version), in any order (a key's row once; a key with no row left out), or
 * raises (the claim ends there, what it granted before handed back with the
 * error, as for a SQLite error). Each row is checked as
 * node.core.rows.stored_row_is_valid checks it and granted, in entry order,
 * by the SQLite path's own grant_row. Included after shm/_claim_grant.c
 * (one translation unit: shm/_claim_unit.c), whose run helpers it uses. */

#include "_claim_path.h"

#include <math.h>
#include <string.h>

/* sitemap in (0, 1, True, False), as Python compares it. */
static int
is_flag(PyObject *v)
{
    if (PyLong_Check(v)) {
        int overflow;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        return !overflow && (x == 0 || x == 1);
    }
    if (PyFloat_Check(v)) {
        double x = PyFloat_AS_DOUBLE(v);
        return x == 0.0 || x == 1.0;
    }
    return 0;
}

/* A row as the reader gives it, checked as stored_row_is_valid checks it
   (and its version an integer, as the SQLite path asks): 1 a valid row in
   *r, 0 one the keeper cannot schedule. `row` is a sequence of 8 (fast). */
static int
parse_given_row(ClaimPathObject *self, PyObject *row, RowRead *r)
{
    memset(r, 0, sizeof *r);
    PyObject **v = PySequence_Fast_ITEMS(row);
    PyObject *route = v[1], *cadence = v[2], *due_at = v[4], *version = v[7];
    if (!PyUnicode_Check(route) || PyUnicode_GET_LENGTH(route) == 0)
        return 0;
    if (cadence != Py_None) {
        if (!PyLong_Check(cadence) || PyBool_Check(cadence))
            return 0;
        int overflow;
        r->cadence = PyLong_AsLongLongAndOverflow(cadence, &overflow);
        if (overflow || !(r->cadence >= self->min_cadence && r->cadence <= self->max_cadence))
            return 0;
        r->has_cadence = 1;
    }
    if (!is_flag(v[3]))
        return 0;
    if (PyBool_Check(due_at) || !(PyLong_Check(due_at) || PyFloat_Check(due_at)))
        return 0;
    r->due = PyFloat_AsDouble(due_at);
    if (r->due == -1.0 && PyErr_Occurred()) { /* an int past a double: not a due time */
        PyErr_Clear();
        return 0;
    }
    if (!isfinite(r->due) || !(r->due >= self->min_due && r->due <= self->max_due))
        return 0;
    if (!PyLong_Check(version) || PyBool_Check(version))
        return 0;
    r->version = PyLong_AsUnsignedLongLong(version);
    if (PyErr_Occurred()) { /* negative, or past 64 bits: no version a set holds */
        PyErr_Clear();
        return 0;
    }
    r->route = Py_NewRef(route);
    r->due_at = Py_NewRef(due_at);
    r->payload = Py_NewRef(v[5]);
    r->job = Py_NewRef(v[6]);
    return 1;
}

/* The run's entries to read, [lo, hi) less the refused, in entry order:
   look_run's two lists (each ascending) merged. */
static int
merged(const Py_ssize_t *need, int n, const Py_ssize_t *alone, int n_alone, Py_ssize_t *out)
{
    int i = 0, j = 0, m = 0;
    while (i < n || j < n_alone)
        out[m++] = (j >= n_alone || (i < n && need[i] < alone[j])) ? need[i++] : alone[j++];
    return m;
}

/* Read and grant one run [lo, hi). 0, or -1 with an exception. */
static int
read_run(ClaimPathObject *self, const Taken *t, GrantArgs *a, Py_ssize_t lo, Py_ssize_t hi,
         PyObject *grants, PyObject *slow, long long *k)
{
    Look looks[PREFETCH_RUN];
    Py_ssize_t need[PREFETCH_RUN], alone[PREFETCH_RUN], order[PREFETCH_RUN];
    RowRead rows_at[PREFETCH_RUN];
    int state[PREFETCH_RUN]; /* 0 no row yet, 1 a valid row in rows_at, 2 an invalid one */
    int n = 0, n_alone = 0;
    look_run(self, t, a, lo, hi, looks, need, &n, alone, &n_alone, k);
    int m = merged(need, n, alone, n_alone, order);
    if (m == 0)
        return 0;
    int rc = -1;
    PyObject *keys = PyList_New(m), *at = PyDict_New(), *answer = NULL, *rows = NULL;
    memset(state, 0, sizeof state);
    if (keys == NULL || at == NULL)
        goto done;
    for (int j = 0; j < m; j++) {
        PyObject *key = entry_key(t, self->heap, self->entries + R_ENTRY_SIZE * order[j]);
        if (key == NULL)
            goto done;
        PyList_SET_ITEM(keys, j, key);
        PyObject *idx = PyLong_FromLong(j);
        int set = idx == NULL ? -1 : PyDict_SetItem(at, key, idx);
        Py_XDECREF(idx);
        if (set < 0)
            goto done;
    }
    answer = PyObject_CallOneArg(self->reader, keys);
    if (answer == NULL)
        goto done;
    rows = PySequence_Fast(answer, "ClaimPath: the reader answers a sequence of rows");
    if (rows == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(rows); i++) {
        PyObject *row = PySequence_Fast(PySequence_Fast_GET_ITEM(rows, i),
                                        "ClaimPath: a row is a sequence");
        if (row == NULL)
            goto done;
        if (PySequence_Fast_GET_SIZE(row) != 8) {
            Py_DECREF(row);
            PyErr_SetString(PyExc_ValueError, "ClaimPath: a row has 8 columns");
            goto done;
        }
        PyObject *idx = PyDict_GetItemWithError(at, PySequence_Fast_GET_ITEM(row, 0));
        if (idx == NULL) {
            Py_DECREF(row);
            if (PyErr_Occurred())
                goto done;
            continue; /* a key not asked for */
        }
        long j = PyLong_AsLong(idx);
        if (state[j] == 0)
            state[j] = parse_given_row(self, row, &rows_at[j]) ? 1 : 2;
        Py_DECREF(row);
    }
    rc = 0;
    for (int j = 0; j < m; j++) {
        if (state[j] != 1) {
            k[K_GONE]++; /* no row, or one the keeper cannot schedule */
            continue;
        }
        if (rc == 0) {
            Py_ssize_t e = order[j];
            args_for(self, t, a, e, &looks[e - lo]);
            rc = grant_row(self, t, a, e, &rows_at[j], grants, slow, k);
        }
    }
done:
    for (int j = 0; j < m; j++)
        if (state[j] == 1)
            row_clear(&rows_at[j]);
    Py_XDECREF(rows);
    Py_XDECREF(answer);
    Py_XDECREF(at);
    Py_XDECREF(keys);
    return rc;
}

int
grant_read(ClaimPathObject *self, const Taken *t, GrantArgs *a, PyObject *grants,
           PyObject *slow, long long *k)
{
    for (Py_ssize_t lo = 0; lo < t->count; lo += PREFETCH_RUN) {
        Py_ssize_t hi = lo + PREFETCH_RUN < t->count ? lo + PREFETCH_RUN : t->count;
        if (read_run(self, t, a, lo, hi, grants, slow, k) < 0)
            return -1;
    }
    return 0;
}
