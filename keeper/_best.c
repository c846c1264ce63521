/* keeper._best: the merge at the heart of Buckets.best_gathered (keeper/buckets/best.py).
 *
 * best_gathered takes each active class's head run out of its order (order
 * values, ascending: minute << 32 | slot) and needs the k best of them all by
 * rank, best first. A row's rank is (now - minute * 60) / cadence_s + boost,
 * so within one class's run the ranks never rise: the k best are a k-way
 * merge of the runs, a tournament of one head a class. The Python it replaces
 * computed every candidate's rank and sorted them all (a fifth of a publish);
 * this gives the same picks in the same order (the sort was stable: equal
 * ranks keep their candidates' order) and the same floats (the same
 * expression, in double).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_keys.h"

static inline double
rank_of(int64_t value, double now, double cadence, double boost)
{
    /* As Python computes (now - minute * 60) / cadence_s + boost: the minute
       times 60 is an exact integer, converted once. */
    int64_t minute = value >> 32;
    return (now - (double)(minute * 60)) / cadence + boost;
}

/* The k-way merge (merge, pick) is a tree of losers (a tournament) over the
 * runs, kept as columns by run: each pick replays one leaf-to-root path, one
 * comparison a level, where a binary heap's sift makes two a level and moves
 * whole heads (about half of pick's time with 20 classes, whose heads
 * interleave pick by pick; docs/performance.md). The order: the higher rank
 * first, then the earlier candidate. Positions are distinct, so the order is
 * total and the picks are those of any merge by it (the Python reference's
 * stable sort included). */
typedef struct {
    double *rank;        /* each run's head's rank (-inf once spent: below every
                            live head's, whose ranks are finite, see MIN_CADENCE) */
    Py_ssize_t *at;      /* its head's position in values */
    Py_ssize_t *end;     /* where its run ends */
    Py_ssize_t *cls;     /* its class's index */
    Py_ssize_t *loser;   /* [0]: the winner; [i], i >= 1: the loser at node i */
    Py_ssize_t runs;
} Tourney;

static inline int
run_before(const Tourney *t, Py_ssize_t a, Py_ssize_t b)
{
    return t->rank[a] > t->rank[b] || (t->rank[a] == t->rank[b] && t->at[a] < t->at[b]);
}

/* The least cadence the merges take: with now and the boosts finite and the
 * minutes int32, every rank is then finite (|now - minute * 60| < 2^38), so a
 * spent run's -inf ranks below every live head (the keeper's are >= 60 s). */
#define MIN_CADENCE 1.0

/* Play the whole tournament (leaves at runs..2 runs - 1, node i's children
 * 2i and 2i + 1); win: scratch of 2 runs. */
static void
tourney_build(Tourney *t, Py_ssize_t *win)
{
    Py_ssize_t m = t->runs;
    for (Py_ssize_t j = 0; j < m; j++)
        win[m + j] = j;
    for (Py_ssize_t i = m - 1; i >= 1; i--) {
        Py_ssize_t a = win[2 * i], b = win[2 * i + 1];
        int a_wins = run_before(t, a, b);
        win[i] = a_wins ? a : b;
        t->loser[i] = a_wins ? b : a;
    }
    t->loser[0] = m > 1 ? win[1] : 0;
}

/* Run w's head changed: replay its path to the root. */
static inline void
tourney_replay(Tourney *t, Py_ssize_t w)
{
    for (Py_ssize_t node = (w + t->runs) >> 1; node > 0; node >>= 1) {
        Py_ssize_t l = t->loser[node];
        if (run_before(t, l, w)) {
            t->loser[node] = w;
            w = l;
        }
    }
    t->loser[0] = w;
}

/* Run w (class index c) past its head at: its next head, or spent (-inf). */
static inline void
tourney_advance(Tourney *t, Py_ssize_t w, Py_ssize_t at, Py_ssize_t c, const int64_t *values,
                double now, const double *cad, const double *bst)
{
    t->at[w] = ++at;
    t->rank[w] = at < t->end[w] ? rank_of(values[at], now, cad[c], bst[c]) : -Py_HUGE_VAL;
    tourney_replay(t, w);
}

static int
tourney_alloc(Tourney *t, Py_ssize_t room, Py_ssize_t **win)
{
    t->rank = PyMem_Malloc(sizeof(double) * room);
    t->at = PyMem_Malloc(sizeof(Py_ssize_t) * room);
    t->end = PyMem_Malloc(sizeof(Py_ssize_t) * room);
    t->cls = PyMem_Malloc(sizeof(Py_ssize_t) * room);
    t->loser = PyMem_Malloc(sizeof(Py_ssize_t) * room);
    *win = PyMem_Malloc(sizeof(Py_ssize_t) * 2 * room);
    if (t->rank == NULL || t->at == NULL || t->end == NULL || t->cls == NULL ||
        t->loser == NULL || *win == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void
tourney_free(Tourney *t, Py_ssize_t *win)
{
    PyMem_Free(t->rank);
    PyMem_Free(t->at);
    PyMem_Free(t->end);
    PyMem_Free(t->cls);
    PyMem_Free(t->loser);
    PyMem_Free(win);
}

/* merge(values, starts, cadences, boosts, cids, now, k)
 *     -> (picks, ranks, slots, minutes, classes, marks)
 *
 * values: the candidates' order values (a buffer of int64), class run after
 * class run; starts[c]: where class c's run starts (each run ends where the
 * next starts, the last at the end); cadences[c], boosts[c]: its rank's
 * terms; cids[c]: its class id. Of the k best (fewer if there are fewer),
 * best first: picks, their positions in values; ranks; slots and minutes,
 * the two halves of their values; classes, their class ids. marks: a
 * bytearray of len(values), 1 at each pick. */
static PyObject *
best_merge(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "merge() takes 7 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *starts = args[1], *cadences = args[2], *boosts = args[3], *cids = args[4];
    if (!PyList_Check(starts) || !PyList_Check(cadences) || !PyList_Check(boosts) ||
        !PyList_Check(cids)) {
        PyErr_SetString(PyExc_TypeError, "merge(): starts, cadences, boosts and cids are lists");
        return NULL;
    }
    Py_ssize_t classes = PyList_GET_SIZE(starts);
    if (PyList_GET_SIZE(cadences) != classes || PyList_GET_SIZE(boosts) != classes ||
        PyList_GET_SIZE(cids) != classes) {
        PyErr_SetString(PyExc_ValueError,
                        "merge(): starts, cadences, boosts and cids differ in length");
        return NULL;
    }
    double now = PyFloat_AsDouble(args[5]);
    Py_ssize_t k = PyLong_AsSsize_t(args[6]);
    if (PyErr_Occurred())
        return NULL;
    if (!isfinite(now)) {
        PyErr_SetString(PyExc_ValueError, "now is not a finite number");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *out[6] = {NULL, NULL, NULL, NULL, NULL, NULL}, *result = NULL;
    Tourney t = {NULL, NULL, NULL, NULL, NULL, 0};
    Py_ssize_t *win = NULL;
    double *cad = NULL, *bst = NULL;
    if (view.len % 8 || (view.len && ((uintptr_t)view.buf) % 8)) {
        PyErr_SetString(PyExc_ValueError, "merge(): values are not aligned int64");
        goto done;
    }
    const int64_t *values = (const int64_t *)view.buf;
    Py_ssize_t n = view.len / 8, room = classes ? classes : 1;
    if (tourney_alloc(&t, room, &win) < 0)
        goto done;
    cad = PyMem_Malloc(sizeof(double) * room);
    bst = PyMem_Malloc(sizeof(double) * room);
    if (cad == NULL || bst == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t size = 0, total = 0;
    for (Py_ssize_t c = 0; c < classes; c++) {
        Py_ssize_t start = PyLong_AsSsize_t(PyList_GET_ITEM(starts, c));
        Py_ssize_t end = c + 1 < classes ? PyLong_AsSsize_t(PyList_GET_ITEM(starts, c + 1)) : n;
        cad[c] = PyFloat_AsDouble(PyList_GET_ITEM(cadences, c));
        bst[c] = PyFloat_AsDouble(PyList_GET_ITEM(boosts, c));
        if (PyErr_Occurred())
            goto done;
        if (start < 0 || end > n || start > end || !(cad[c] >= MIN_CADENCE) ||
            !isfinite(bst[c])) {
            PyErr_SetString(PyExc_ValueError, "merge(): a run, a cadence (at least 1 s) or a "
                                              "boost (finite) out of range");
            goto done;
        }
        total += end - start;
        if (start < end) {
            t.rank[size] = rank_of(values[start], now, cad[c], bst[c]);
            t.at[size] = start;
            t.end[size] = end;
            t.cls[size] = c;
            size++;
        }
    }
    t.runs = size;
    tourney_build(&t, win);
    Py_ssize_t want = k < total ? k : total;
    if (want < 0)
        want = 0;
    for (int j = 0; j < 5; j++)
        if ((out[j] = PyList_New(want)) == NULL)
            goto done;
    if ((out[5] = PyByteArray_FromStringAndSize(NULL, n)) == NULL)
        goto done;
    char *marks = PyByteArray_AS_STRING(out[5]);
    memset(marks, 0, n);
    for (Py_ssize_t i = 0; i < want; i++) {
        Py_ssize_t w = t.loser[0], at = t.at[w], c = t.cls[w];
        int64_t value = values[at];
        PyObject *item[5] = {
            PyLong_FromSsize_t(at),
            PyFloat_FromDouble(t.rank[w]),
            PyLong_FromLongLong(value & 0xFFFFFFFFLL),
            PyLong_FromLongLong(value >> 32),
            PyList_GET_ITEM(cids, c),
        };
        Py_XINCREF(item[4]);
        for (int j = 0; j < 5; j++) {
            if (item[j] == NULL) {
                for (int m = 0; m < 5; m++)
                    Py_XDECREF(item[m]);
                goto done;
            }
        }
        for (int j = 0; j < 5; j++)
            PyList_SET_ITEM(out[j], i, item[j]);
        marks[at] = 1;
        /* want <= total: a live run is left, and it wins over every spent one. */
        tourney_advance(&t, w, at, c, values, now, cad, bst);
    }
    result = PyTuple_Pack(6, out[0], out[1], out[2], out[3], out[4], out[5]);
done:
    for (int j = 0; j < 6; j++)
        Py_XDECREF(out[j]);
    tourney_free(&t, win);
    PyMem_Free(cad);
    PyMem_Free(bst);
    PyBuffer_Release(&view);
    return result;
}

/* pick(values, starts, cadences, boosts, cids, now, k, keys, exclude)
 *     -> (n, kth, skipped, positions, slots, minutes, classes, ranks, marks)
 *
 * merge for the keeper's publish (Buckets.best_gathered): the same k-way
 * merge, the same picks in the same order and the same floats, but no
 * Python object a pick: the columns come back as bytes, each a C array of n
 * items (positions in values, slots, minutes and class ids as int32, ranks as
 * double), which shm._atomic.View.write_gathered writes into the ready set
 * as they are. kth: the k-th pick's rank, or None when there are fewer than
 * k. marks: a bytearray of len(values), 1 at each pick.
 *
 * exclude (None, or a container of keys; keys the table's keys by slot, a
 * KeyColumn or a list; a set is looked up by the column's bytes, with no str
 * made): a candidate whose key is in it is passed over, neither picked nor
 * marked; skipped says how many were (those the merge reached: ranked above
 * the k-th pick, or all when there are fewer than k). */
static PyObject *
best_pick(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 9) {
        PyErr_Format(PyExc_TypeError, "pick() takes 9 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *starts = args[1], *cadences = args[2], *boosts = args[3], *cids = args[4];
    PyObject *keys = args[7], *exclude = args[8] == Py_None ? NULL : args[8];
    KeyColumn *col = KeyColumn_Check(keys) ? (KeyColumn *)keys : NULL;
    if (!PyList_Check(starts) || !PyList_Check(cadences) || !PyList_Check(boosts) ||
        !PyList_Check(cids) || (exclude != NULL && !PyList_Check(keys) && col == NULL)) {
        PyErr_SetString(PyExc_TypeError,
                        "pick(): starts, cadences, boosts and cids are lists, and keys is a "
                        "KeyColumn or a list when exclude is given");
        return NULL;
    }
    Py_ssize_t classes = PyList_GET_SIZE(starts);
    if (PyList_GET_SIZE(cadences) != classes || PyList_GET_SIZE(boosts) != classes ||
        PyList_GET_SIZE(cids) != classes) {
        PyErr_SetString(PyExc_ValueError,
                        "pick(): starts, cadences, boosts and cids differ in length");
        return NULL;
    }
    double now = PyFloat_AsDouble(args[5]);
    Py_ssize_t k = PyLong_AsSsize_t(args[6]);
    if (PyErr_Occurred())
        return NULL;
    if (!isfinite(now)) {
        PyErr_SetString(PyExc_ValueError, "now is not a finite number");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *out[6] = {NULL, NULL, NULL, NULL, NULL, NULL}, *result = NULL;
    Tourney t = {NULL, NULL, NULL, NULL, NULL, 0};
    Py_ssize_t *win = NULL;
    double *cad = NULL, *bst = NULL;
    int32_t *cid_of = NULL;
    int any_set = exclude != NULL && PyAnySet_Check(exclude);
    KeySet ks = {NULL, 0, NULL}; /* exclude's keys, for a KeyColumn's */
    if (view.len % 8 || (view.len && ((uintptr_t)view.buf) % 8)) {
        PyErr_SetString(PyExc_ValueError, "pick(): values are not aligned int64");
        goto done;
    }
    const int64_t *values = (const int64_t *)view.buf;
    Py_ssize_t n = view.len / 8, nkeys = exclude == NULL ? 0
                                         : col != NULL ? col->len : PyList_GET_SIZE(keys);
    Py_ssize_t room = classes ? classes : 1;
    if (tourney_alloc(&t, room, &win) < 0)
        goto done;
    cad = PyMem_Malloc(sizeof(double) * room);
    bst = PyMem_Malloc(sizeof(double) * room);
    cid_of = PyMem_Malloc(sizeof(int32_t) * room);
    if (cad == NULL || bst == NULL || cid_of == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t size = 0, total = 0;
    for (Py_ssize_t c = 0; c < classes; c++) {
        Py_ssize_t start = PyLong_AsSsize_t(PyList_GET_ITEM(starts, c));
        Py_ssize_t end = c + 1 < classes ? PyLong_AsSsize_t(PyList_GET_ITEM(starts, c + 1)) : n;
        long cid = PyLong_AsLong(PyList_GET_ITEM(cids, c));
        cad[c] = PyFloat_AsDouble(PyList_GET_ITEM(cadences, c));
        bst[c] = PyFloat_AsDouble(PyList_GET_ITEM(boosts, c));
        if (PyErr_Occurred())
            goto done;
        if (start < 0 || end > n || start > end || !(cad[c] >= MIN_CADENCE) ||
            !isfinite(bst[c]) || cid < INT32_MIN || cid > INT32_MAX) {
            PyErr_SetString(PyExc_ValueError, "pick(): a run, a cadence (at least 1 s), a boost "
                                              "(finite) or a class out of range");
            goto done;
        }
        cid_of[c] = (int32_t)cid;
        total += end - start;
        if (start < end) {
            t.rank[size] = rank_of(values[start], now, cad[c], bst[c]);
            t.at[size] = start;
            t.end[size] = end;
            t.cls[size] = c;
            size++;
        }
    }
    t.runs = size;
    tourney_build(&t, win);
    Py_ssize_t want = k < total ? k : total;
    if (want < 0)
        want = 0;
    if ((out[0] = PyBytes_FromStringAndSize(NULL, 4 * want)) == NULL ||
        (out[1] = PyBytes_FromStringAndSize(NULL, 4 * want)) == NULL ||
        (out[2] = PyBytes_FromStringAndSize(NULL, 4 * want)) == NULL ||
        (out[3] = PyBytes_FromStringAndSize(NULL, 4 * want)) == NULL ||
        (out[4] = PyBytes_FromStringAndSize(NULL, 8 * want)) == NULL ||
        (out[5] = PyByteArray_FromStringAndSize(NULL, n)) == NULL)
        goto done;
    int32_t *positions = (int32_t *)PyBytes_AS_STRING(out[0]);
    int32_t *slots = (int32_t *)PyBytes_AS_STRING(out[1]);
    int32_t *minutes = (int32_t *)PyBytes_AS_STRING(out[2]);
    int32_t *classes_of = (int32_t *)PyBytes_AS_STRING(out[3]);
    double *ranks = (double *)PyBytes_AS_STRING(out[4]);
    char *marks = PyByteArray_AS_STRING(out[5]);
    memset(marks, 0, n);
    /* (built last: no Python code runs from here on, which could change the
     * set under the KeySet) */
    if (col != NULL && any_set && keyset_build(&ks, exclude) < 0)
        goto done;
    Py_ssize_t got = 0, skipped = 0;
    while (got < want && size > 0) {
        Py_ssize_t w = t.loser[0], at = t.at[w];
        if (at >= t.end[w])
            break; /* the winner is spent: so is every run */
        int64_t value = values[at];
        int32_t slot = (int32_t)(value & 0xFFFFFFFFLL);
        int take = 1;
        if (exclude != NULL) {
            if (slot < 0 || slot >= nkeys) {
                PyErr_SetString(PyExc_IndexError, "pick(): a slot out of range of keys");
                goto done;
            }
            int in;
            if (col != NULL && any_set)
                in = keyset_has(&ks, col, slot);
            else {
                PyObject *key = col != NULL ? PySequence_GetItem(keys, slot)
                                            : Py_NewRef(PyList_GET_ITEM(keys, slot));
                if (key == NULL)
                    goto done;
                in = any_set ? PySet_Contains(exclude, key) : PySequence_Contains(exclude, key);
                Py_DECREF(key);
            }
            if (in < 0)
                goto done;
            take = !in;
            skipped += in;
        }
        Py_ssize_t c = t.cls[w];
        if (take) {
            positions[got] = (int32_t)at;
            slots[got] = slot;
            minutes[got] = (int32_t)(value >> 32);
            classes_of[got] = cid_of[c];
            ranks[got] = t.rank[w];
            marks[at] = 1;
            got++;
        }
        /* A spent run ranks -inf: it loses to every live head (MIN_CADENCE). */
        tourney_advance(&t, w, at, c, values, now, cad, bst);
    }
    if (got < want) { /* some were excluded: the columns are shorter */
        for (int j = 0; j < 5; j++)
            if (_PyBytes_Resize(&out[j], (j == 4 ? 8 : 4) * got) < 0)
                goto done;
    }
    PyObject *kth = got == k && k > 0 ? PyFloat_FromDouble(ranks[got - 1]) : Py_NewRef(Py_None);
    if (kth == NULL)
        goto done;
    result = Py_BuildValue("(nNnOOOOOO)", got, kth, skipped, out[0], out[1], out[2], out[3],
                           out[4], out[5]);
done:
    for (int j = 0; j < 6; j++)
        Py_XDECREF(out[j]);
    tourney_free(&t, win);
    keyset_free(&ks);
    PyMem_Free(cad);
    PyMem_Free(bst);
    PyMem_Free(cid_of);
    PyBuffer_Release(&view);
    return result;
}

/* flag(flags, at, value): flags[i] = value for each i in at, a list of ints
 * or a buffer of int32 (pick's slots) (flags a bytearray; every index is
 * checked first, so a bad one changes nothing). */
static PyObject *
best_flag(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3 || !PyByteArray_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "flag(flags: bytearray, at: list or int32 buffer, value)");
        return NULL;
    }
    long value = PyLong_AsLong(args[2]);
    if (value == -1 && PyErr_Occurred())
        return NULL;
    if (value < 0 || value > 255) {
        PyErr_SetString(PyExc_ValueError, "flag(): value is a byte");
        return NULL;
    }
    Py_ssize_t size = PyByteArray_GET_SIZE(args[0]);
    char *flags = PyByteArray_AS_STRING(args[0]);
    if (!PyList_Check(args[1])) {
        Py_buffer view;
        if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0)
            return NULL;
        if (view.len % 4 || (view.len && ((uintptr_t)view.buf) % 4)) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_TypeError, "flag(): at is not a list or an int32 buffer");
            return NULL;
        }
        const int32_t *at = (const int32_t *)view.buf;
        Py_ssize_t n = view.len / 4;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (at[i] < 0 || at[i] >= size) {
                PyBuffer_Release(&view);
                PyErr_SetString(PyExc_IndexError, "flag(): an index out of range");
                return NULL;
            }
        }
        for (Py_ssize_t i = 0; i < n; i++)
            flags[at[i]] = (char)value;
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PyList_GET_SIZE(args[1]);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t at = PyLong_AsSsize_t(PyList_GET_ITEM(args[1], i));
        if (at == -1 && PyErr_Occurred())
            return NULL;
        if (at < 0 || at >= size) {
            PyErr_SetString(PyExc_IndexError, "flag(): an index out of range");
            return NULL;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++)
        flags[PyLong_AsSsize_t(PyList_GET_ITEM(args[1], i))] = (char)value;
    Py_RETURN_NONE;
}

/* keeper/_best_order.c: the order merges. */
PyObject *best_sort_runs(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *best_merge_blocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *best_positions(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *best_enter_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

static PyMethodDef best_methods[] = {
    {"merge", (PyCFunction)(void (*)(void))best_merge, METH_FASTCALL,
     "merge(values, starts, cadences, boosts, cids, now, k) -> (picks, ranks, slots, minutes, "
     "classes, marks): the k best candidates of the class runs, best first"},
    {"pick", (PyCFunction)(void (*)(void))best_pick, METH_FASTCALL,
     "pick(values, starts, cadences, boosts, cids, now, k, keys, exclude) -> (n, kth, skipped, "
     "positions, slots, minutes, classes, ranks, marks): merge, as C arrays, exclude passed over"},
    {"move_keys", (PyCFunction)(void (*)(void))best_move_keys, METH_FASTCALL,
     "move_keys(keys, table, mask, held, det, cids, mins, flag, by_class) -> moved: "
     "_move_many's key loop (keeper/_keys.c)"},
    {"flag", (PyCFunction)(void (*)(void))best_flag, METH_FASTCALL,
     "flag(flags, at, value): flags[i] = value for each i in at"},
    {"sort_runs", (PyCFunction)(void (*)(void))best_sort_runs, METH_FASTCALL,
     "sort_runs(runs) -> array('q'): the int64 values of runs, ascending"},
    {"merge_blocks", (PyCFunction)(void (*)(void))best_merge_blocks, METH_FASTCALL,
     "merge_blocks(blocks, maxes, new, load): merge ascending int64 values into an order's "
     "blocks, in place (keeper/order.py)"},
    {"positions", (PyCFunction)(void (*)(void))best_positions, METH_FASTCALL,
     "positions(blocks, bounds) -> list[int]: how many values are below each ascending bound"},
    {"enter_rows", (PyCFunction)(void (*)(void))best_enter_rows, METH_FASTCALL,
     "enter_rows(rows, cids, table, mask, slot) -> (versions, minutes, [(cid, values)]): "
     "a load chunk's new rows into the key table (Buckets._enter)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef best_module = {
    PyModuleDef_HEAD_INIT, "keeper._best",
    "The keeper's k-way merge of class runs by rank (keeper/buckets/best.py best_columns).", -1,
    best_methods,
};

PyMODINIT_FUNC
PyInit__best(void)
{
    PyObject *module = PyModule_Create(&best_module);
    if (module != NULL && kc_add_to_module(module) < 0)
        Py_CLEAR(module);
    return module;
}
