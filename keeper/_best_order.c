/* keeper._best's order merges: the values that join a class's order
 * (keeper/order.py, ``Order``) merged in C, with no Python int a value.
 *
 * An order is a list of int64 arrays (blocks, ascending, each at most twice
 * the load) with each block's last value in ``maxes``. The keeper moves
 * thousands of values between a class's attached and detached orders every
 * publish (``Order.add_sorted``), and a load leaves a class's values pending,
 * unsorted, until the next read merges them all (``Order.flush``): in Python
 * both made an int object a value and sorted lists of them, ~7 ms of a
 * publish at 3,000 grants and ~200 ms for the first publish after a second of
 * loading near 1,000,000 rows. Here:
 *
 *   sort_runs(runs)                    the values of ``runs`` (int64 buffers),
 *                                      one ascending array('q'): an LSD radix
 *                                      sort by bytes, skipping a byte every
 *                                      value shares (minutes span few bytes)
 *   merge_blocks(blocks, maxes, new, load)
 *                                      merge ``new`` (ascending int64 buffer,
 *                                      none held) into the order in place:
 *                                      each block with a share is replaced by
 *                                      the merge of the two, cut into blocks
 *                                      of about ``load`` when over twice it;
 *                                      the blocks without one stay as they
 *                                      are (the same objects)
 *   positions(blocks, bounds)          how many values lie below each of
 *                                      ascending bounds (the state
 *                                      document's windows and lateness bins)
 *   enter_rows(rows, cids, table, mask, slot)
 *                                      a load chunk's new rows into the key
 *                                      table, their columns and their order
 *                                      values by class (Buckets._enter)
 *
 * Values are order values, minute << 32 | slot; the sort flips their sign
 * bit so that a negative one (a due time before 1970) sorts as in Python.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static PyObject *array_type; /* array.array, imported at the first call */

static PyObject *
new_array(const int64_t *values, Py_ssize_t n)
{
    if (array_type == NULL) {
        PyObject *mod = PyImport_ImportModule("array");
        if (mod == NULL)
            return NULL;
        array_type = PyObject_GetAttrString(mod, "array");
        Py_DECREF(mod);
        if (array_type == NULL)
            return NULL;
    }
    PyObject *raw = PyBytes_FromStringAndSize((const char *)values, n * (Py_ssize_t)sizeof(int64_t));
    if (raw == NULL)
        return NULL;
    PyObject *out = PyObject_CallFunction(array_type, "sO", "q", raw);
    Py_DECREF(raw);
    return out;
}

/* An int64 buffer (array('q'), or any C-contiguous buffer of 8-byte items). */
static int
get_values(PyObject *obj, Py_buffer *view)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != 8 || view->format == NULL ||
        (strcmp(view->format, "q") != 0 && strcmp(view->format, "l") != 0)) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, "order values must be an int64 buffer (array('q'))");
        return -1;
    }
    return 0;
}

static void
radix_sort(uint64_t *a, uint64_t *tmp, Py_ssize_t n)
{
    if (n < 2)
        return;
    if (n < 64) { /* insertion sort */
        for (Py_ssize_t i = 1; i < n; i++) {
            uint64_t v = a[i];
            Py_ssize_t j = i;
            while (j > 0 && a[j - 1] > v) {
                a[j] = a[j - 1];
                j--;
            }
            a[j] = v;
        }
        return;
    }
    Py_ssize_t counts[8][256];
    memset(counts, 0, sizeof(counts));
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t v = a[i];
        for (int b = 0; b < 8; b++)
            counts[b][(v >> (8 * b)) & 0xff]++;
    }
    uint64_t *src = a, *dst = tmp;
    for (int b = 0; b < 8; b++) {
        Py_ssize_t *c = counts[b];
        if (c[(src[0] >> (8 * b)) & 0xff] == n)
            continue; /* every value has this byte: the pass would keep the order */
        Py_ssize_t at = 0;
        for (int d = 0; d < 256; d++) {
            Py_ssize_t k = c[d];
            c[d] = at;
            at += k;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t v = src[i];
            dst[c[(v >> (8 * b)) & 0xff]++] = v;
        }
        uint64_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != a)
        memcpy(a, src, (size_t)n * sizeof(uint64_t));
}

/* sort_runs(runs) -> array('q'): every value of the int64 buffers in
   ``runs``, ascending. */
PyObject *
best_sort_runs(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "sort_runs(runs: list)");
        return NULL;
    }
    PyObject *runs = args[0];
    Py_ssize_t nruns = PyList_GET_SIZE(runs), total = 0;
    Py_buffer *views = PyMem_Calloc(nruns ? nruns : 1, sizeof(Py_buffer));
    if (views == NULL)
        return PyErr_NoMemory();
    Py_ssize_t got = 0;
    PyObject *out = NULL;
    uint64_t *all = NULL, *tmp = NULL;
    for (; got < nruns; got++) {
        if (get_values(PyList_GET_ITEM(runs, got), &views[got]) < 0)
            goto done;
        total += views[got].len / 8;
    }
    all = PyMem_Malloc((size_t)(total ? total : 1) * sizeof(uint64_t));
    tmp = PyMem_Malloc((size_t)(total ? total : 1) * sizeof(uint64_t));
    if (all == NULL || tmp == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t at = 0;
    for (Py_ssize_t r = 0; r < nruns; r++) {
        memcpy(all + at, views[r].buf, (size_t)views[r].len);
        at += views[r].len / 8;
    }
    /* Signed order as unsigned bytes: the sign bit flipped, and back. */
    for (Py_ssize_t i = 0; i < total; i++)
        all[i] ^= (uint64_t)1 << 63;
    radix_sort(all, tmp, total);
    for (Py_ssize_t i = 0; i < total; i++)
        all[i] ^= (uint64_t)1 << 63;
    out = new_array((const int64_t *)all, total);
done:
    for (Py_ssize_t r = 0; r < got; r++)
        PyBuffer_Release(&views[r]);
    PyMem_Free(views);
    PyMem_Free(all);
    PyMem_Free(tmp);
    return out;
}

/* First index in new[lo:n) whose value is above v. */
static Py_ssize_t
upper_bound(const int64_t *new, Py_ssize_t lo, Py_ssize_t n, int64_t v)
{
    Py_ssize_t hi = n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (new[mid] <= v)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Append to out_blocks / out_maxes the merge of block (len nb) and share (len
   m), cut into blocks of about load when over twice it. */
static int
emit_merged(PyObject *out_blocks, PyObject *out_maxes, const int64_t *block, Py_ssize_t nb,
            const int64_t *share, Py_ssize_t m, Py_ssize_t load, int64_t *buf)
{
    Py_ssize_t i = 0, j = 0, t = 0;
    while (i < nb && j < m)
        buf[t++] = block[i] <= share[j] ? block[i++] : share[j++];
    while (i < nb)
        buf[t++] = block[i++];
    while (j < m)
        buf[t++] = share[j++];
    Py_ssize_t pieces = t > 2 * load ? t / load : 1;
    Py_ssize_t step = (t + pieces - 1) / pieces;
    for (Py_ssize_t start = 0; start < t; start += step) {
        Py_ssize_t len = t - start < step ? t - start : step;
        PyObject *arr = new_array(buf + start, len);
        if (arr == NULL)
            return -1;
        PyObject *mx = PyLong_FromLongLong(buf[start + len - 1]);
        int bad = mx == NULL || PyList_Append(out_blocks, arr) < 0 || PyList_Append(out_maxes, mx) < 0;
        Py_DECREF(arr);
        Py_XDECREF(mx);
        if (bad)
            return -1;
    }
    return 0;
}

/* merge_blocks(blocks, maxes, new, load): merge the ascending int64 buffer
   ``new`` (no value held already) into the order's ``blocks`` and ``maxes``,
   in place. */
PyObject *
best_merge_blocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyList_Check(args[0]) || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "merge_blocks(blocks: list, maxes: list, new, load: int)");
        return NULL;
    }
    PyObject *blocks = args[0], *maxes = args[1];
    Py_ssize_t load = PyLong_AsSsize_t(args[3]);
    if (load == -1 && PyErr_Occurred())
        return NULL;
    if (load < 1) {
        PyErr_SetString(PyExc_ValueError, "load must be at least 1");
        return NULL;
    }
    Py_buffer nv;
    if (get_values(args[2], &nv) < 0)
        return NULL;
    const int64_t *new = nv.buf;
    Py_ssize_t n = nv.len / 8, nblocks = PyList_GET_SIZE(blocks);
    PyObject *out_blocks = NULL, *out_maxes = NULL, *result = NULL;
    int64_t *buf = NULL;
    if (n == 0) {
        result = Py_None;
        Py_INCREF(result);
        goto done;
    }
    if (PyList_GET_SIZE(maxes) != nblocks) {
        PyErr_SetString(PyExc_ValueError, "blocks and maxes differ in length");
        goto done;
    }
    out_blocks = PyList_New(0);
    out_maxes = PyList_New(0);
    if (out_blocks == NULL || out_maxes == NULL)
        goto done;
    if (nblocks == 0) {
        /* An empty order: blocks of ``load`` each, as Order._rebuild. */
        for (Py_ssize_t start = 0; start < n; start += load) {
            Py_ssize_t len = n - start < load ? n - start : load;
            PyObject *arr = new_array(new + start, len);
            if (arr == NULL)
                goto done;
            PyObject *mx = PyLong_FromLongLong(new[start + len - 1]);
            int bad = mx == NULL || PyList_Append(out_blocks, arr) < 0 ||
                      PyList_Append(out_maxes, mx) < 0;
            Py_DECREF(arr);
            Py_XDECREF(mx);
            if (bad)
                goto done;
        }
    }
    else {
        Py_ssize_t most = 0; /* the largest block with a share, for the buffer */
        Py_ssize_t start = 0;
        /* First pass: the buffer's size. */
        for (Py_ssize_t b = 0; b < nblocks && start < n; b++) {
            PyObject *block = PyList_GET_ITEM(blocks, b);
            Py_ssize_t nb = PyObject_Length(block);
            if (nb < 0)
                goto done;
            Py_ssize_t cut;
            if (b == nblocks - 1)
                cut = n;
            else {
                long long mx = PyLong_AsLongLong(PyList_GET_ITEM(maxes, b));
                if (mx == -1 && PyErr_Occurred())
                    goto done;
                cut = upper_bound(new, start, n, (int64_t)mx);
            }
            if (cut > start && nb + cut - start > most)
                most = nb + cut - start;
            start = cut;
        }
        buf = PyMem_Malloc((size_t)(most ? most : 1) * sizeof(int64_t));
        if (buf == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        start = 0;
        for (Py_ssize_t b = 0; b < nblocks; b++) {
            PyObject *block = PyList_GET_ITEM(blocks, b);
            Py_ssize_t cut = start;
            if (start < n) {
                if (b == nblocks - 1)
                    cut = n;
                else {
                    long long mx = PyLong_AsLongLong(PyList_GET_ITEM(maxes, b));
                    if (mx == -1 && PyErr_Occurred())
                        goto done;
                    cut = upper_bound(new, start, n, (int64_t)mx);
                }
            }
            if (cut == start) { /* no share: the block stays */
                if (PyList_Append(out_blocks, block) < 0 ||
                    PyList_Append(out_maxes, PyList_GET_ITEM(maxes, b)) < 0)
                    goto done;
                continue;
            }
            Py_buffer bv;
            if (get_values(block, &bv) < 0)
                goto done;
            int bad = emit_merged(out_blocks, out_maxes, bv.buf, bv.len / 8, new + start,
                                  cut - start, load, buf);
            PyBuffer_Release(&bv);
            if (bad)
                goto done;
            start = cut;
        }
    }
    if (PyList_SetSlice(blocks, 0, nblocks, out_blocks) < 0 ||
        PyList_SetSlice(maxes, 0, PyList_GET_SIZE(maxes), out_maxes) < 0)
        goto done;
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&nv);
    PyMem_Free(buf);
    Py_XDECREF(out_blocks);
    Py_XDECREF(out_maxes);
    return result;
}

/* First index in a[0:n) whose value is not below v. */
static Py_ssize_t
lower_bound(const int64_t *a, Py_ssize_t n, int64_t v)
{
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (a[mid] < v)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* positions(blocks, bounds) -> list[int]: for ascending ``bounds``, how many
   of the order's values are below each (Order.positions). One walk over the
   blocks up to the last bound, a bisection a bound inside its block. */
PyObject *
best_positions(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyList_Check(args[0]) || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "positions(blocks: list, bounds: list)");
        return NULL;
    }
    PyObject *blocks = args[0], *bounds = args[1];
    Py_ssize_t nblocks = PyList_GET_SIZE(blocks), nbounds = PyList_GET_SIZE(bounds);
    PyObject *out = PyList_New(nbounds);
    if (out == NULL)
        return NULL;
    Py_ssize_t b = 0, before = 0; /* values in blocks[:b] */
    Py_buffer view;
    int held = 0; /* view holds blocks[b] */
    for (Py_ssize_t j = 0; j < nbounds; j++) {
        long long bound = PyLong_AsLongLong(PyList_GET_ITEM(bounds, j));
        if (bound == -1 && PyErr_Occurred())
            goto fail;
        Py_ssize_t n = before;
        for (;;) {
            if (b == nblocks)
                break;
            if (!held) {
                if (get_values(PyList_GET_ITEM(blocks, b), &view) < 0)
                    goto fail;
                held = 1;
            }
            const int64_t *a = view.buf;
            Py_ssize_t len = view.len / 8;
            if (len && a[len - 1] >= bound) {
                n = before + lower_bound(a, len, (int64_t)bound);
                break;
            }
            before += len;
            n = before;
            PyBuffer_Release(&view);
            held = 0;
            b++;
        }
        PyObject *v = PyLong_FromSsize_t(n);
        if (v == NULL)
            goto fail;
        PyList_SET_ITEM(out, j, v);
    }
    if (held)
        PyBuffer_Release(&view);
    return out;
fail:
    if (held)
        PyBuffer_Release(&view);
    Py_DECREF(out);
    return NULL;
}

static PyObject *
new_typed_array(const char *typecode, const void *data, Py_ssize_t nbytes)
{
    if (array_type == NULL) {
        PyObject *probe = new_array(NULL, 0); /* imports array.array */
        if (probe == NULL)
            return NULL;
        Py_DECREF(probe);
    }
    PyObject *raw = PyBytes_FromStringAndSize((const char *)data, nbytes);
    if (raw == NULL)
        return NULL;
    PyObject *out = PyObject_CallFunction(array_type, "sO", typecode, raw);
    Py_DECREF(raw);
    return out;
}

/* enter_rows(rows, cids, table, mask, slot) -> (versions, minutes, groups)
 *
 * The loop of Buckets._enter for a chunk whose keys are all new (keeper/
 * buckets/buckets.py): row j, (key, version, route, cadence_s, sitemap,
 * due_at), takes slot ``slot + j``, written into the first empty cell of the
 * key table (int32 cells, -1 empty, linear probing from hash(key) & mask);
 * its minute is floor(due_at) // 60. Returns the versions (array('q')), the
 * minutes (array('i')) and, per class id of ``cids`` in ascending order,
 * ``(cid, array('q'))`` of the rows' order values (minute << 32 | slot), in
 * row order: what the Python loop leaves pending, with no Python object a
 * row. The table must have room (the caller reserves). */
PyObject *
best_enter_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "enter_rows(rows, cids, table, mask, slot)");
        return NULL;
    }
    Py_ssize_t mask = PyLong_AsSsize_t(args[3]);
    Py_ssize_t slot0 = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred())
        return NULL;
    PyObject *rows = PySequence_Tuple(args[0]);
    if (rows == NULL)
        return NULL;
    PyObject *cid_list = PySequence_Tuple(args[1]);
    if (cid_list == NULL) {
        Py_DECREF(rows);
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(rows);
    PyObject *result = NULL, *groups = NULL;
    int64_t *versions = NULL, *values = NULL, *grouped = NULL;
    int32_t *minutes = NULL, *cids = NULL;
    Py_ssize_t *counts = NULL;
    Py_buffer tb;
    int have_table = 0;
    if (PyTuple_GET_SIZE(cid_list) != n) {
        PyErr_SetString(PyExc_ValueError, "enter_rows(): rows and cids differ in length");
        goto done;
    }
    if (PyObject_GetBuffer(args[2], &tb, PyBUF_WRITABLE | PyBUF_FORMAT) < 0)
        goto done;
    have_table = 1;
    if (tb.itemsize != 4 || tb.format == NULL || strcmp(tb.format, "i") != 0 ||
        mask < 0 || tb.len / 4 != mask + 1 || ((mask + 1) & mask)) {
        PyErr_SetString(PyExc_ValueError, "enter_rows(): the table is not int32 cells of mask + 1");
        goto done;
    }
    if (slot0 < 0 || slot0 + n > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "enter_rows(): slots out of range");
        goto done;
    }
    size_t m = (size_t)(n ? n : 1);
    versions = PyMem_Malloc(m * sizeof(int64_t));
    values = PyMem_Malloc(m * sizeof(int64_t));
    grouped = PyMem_Malloc(m * sizeof(int64_t));
    minutes = PyMem_Malloc(m * sizeof(int32_t));
    cids = PyMem_Malloc(m * sizeof(int32_t));
    if (!versions || !values || !grouped || !minutes || !cids) {
        PyErr_NoMemory();
        goto done;
    }
    /* Read every row first: a bad row raises with the table untouched. */
    long max_cid = -1;
    Py_hash_t *hashes = (Py_hash_t *)grouped; /* the same size, free until grouping */
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *row = PyTuple_GET_ITEM(rows, j);
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) < 6) {
            PyErr_SetString(PyExc_TypeError, "enter_rows(): a row is a 6-tuple");
            goto done;
        }
        Py_hash_t h = PyObject_Hash(PyTuple_GET_ITEM(row, 0));
        if (h == -1)
            goto done;
        hashes[j] = h;
        long long version = PyLong_AsLongLong(PyTuple_GET_ITEM(row, 1));
        double due = PyFloat_AsDouble(PyTuple_GET_ITEM(row, 5));
        long cid = PyLong_AsLong(PyTuple_GET_ITEM(cid_list, j));
        if (PyErr_Occurred())
            goto done;
        double fl = floor(due);
        if (!(fl >= -549755813888.0 && fl < 549755813888.0) || cid < 0 || cid > INT32_MAX) {
            PyErr_SetString(PyExc_ValueError, "enter_rows(): a due time or class id out of range");
            goto done;
        }
        int64_t secs = (int64_t)fl;
        int64_t minute = secs >= 0 ? secs / 60 : -((-secs + 59) / 60); /* floor division */
        if (minute < INT32_MIN || minute > INT32_MAX) {
            PyErr_SetString(PyExc_ValueError, "enter_rows(): a due minute out of range");
            goto done;
        }
        versions[j] = (int64_t)version;
        minutes[j] = (int32_t)minute;
        cids[j] = (int32_t)cid;
        values[j] = (int64_t)((uint64_t)minute << 32 | (uint32_t)(slot0 + j));
        if (cid > max_cid)
            max_cid = cid;
    }
    int32_t *table = tb.buf;
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_ssize_t i = (Py_ssize_t)hashes[j] & mask;
        while (table[i] >= 0)
            i = (i + 1) & mask;
        table[i] = (int32_t)(slot0 + j);
    }
    /* Group the values by class, row order kept (a counting sort). */
    counts = PyMem_Calloc((size_t)(max_cid + 2), sizeof(Py_ssize_t));
    if (counts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t j = 0; j < n; j++)
        counts[cids[j] + 1]++;
    for (long c = 0; c <= max_cid; c++)
        counts[c + 1] += counts[c];
    /* counts[c] is now where class c starts; hashes are not needed any more. */
    Py_ssize_t *fill = PyMem_Malloc((size_t)(max_cid + 1 > 0 ? max_cid + 1 : 1) * sizeof(Py_ssize_t));
    if (fill == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(fill, counts, (size_t)(max_cid + 1 > 0 ? max_cid + 1 : 0) * sizeof(Py_ssize_t));
    for (Py_ssize_t j = 0; j < n; j++)
        grouped[fill[cids[j]]++] = values[j];
    PyMem_Free(fill);
    if ((groups = PyList_New(0)) == NULL)
        goto done;
    for (long c = 0; c <= max_cid; c++) {
        Py_ssize_t start = counts[c], end = counts[c + 1];
        if (end == start)
            continue;
        PyObject *arr = new_array(grouped + start, end - start);
        PyObject *pair = arr == NULL ? NULL : Py_BuildValue("(lN)", c, arr);
        if (pair == NULL || PyList_Append(groups, pair) < 0) {
            Py_XDECREF(pair);
            goto done;
        }
        Py_DECREF(pair);
    }
    PyObject *vers = new_typed_array("q", versions, n * 8);
    PyObject *mins = vers == NULL ? NULL : new_typed_array("i", minutes, n * 4);
    if (mins == NULL) {
        Py_XDECREF(vers);
        goto done;
    }
    result = Py_BuildValue("(NNO)", vers, mins, groups);
done:
    if (have_table)
        PyBuffer_Release(&tb);
    Py_XDECREF(groups);
    Py_DECREF(rows);
    Py_DECREF(cid_list);
    PyMem_Free(versions);
    PyMem_Free(values);
    PyMem_Free(grouped);
    PyMem_Free(minutes);
    PyMem_Free(cids);
    PyMem_Free(counts);
    return result;
}
