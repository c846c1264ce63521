/* keeper._best: the merge at the heart of Buckets.best_columns (keeper/buckets/best.py).
 *
 * best_columns takes each active class's head run out of its order (order
 * values, ascending: minute << 32 | slot) and needs the k best of them all by
 * rank, best first. A row's rank is (now - minute * 60) / cadence_s + boost,
 * so within one class's run the ranks never rise: the k best are a k-way
 * merge of the runs, a heap of one head a class. The Python it replaces
 * computed every candidate's rank and sorted them all (a fifth of a publish);
 * this gives the same picks in the same order (the sort was stable: equal
 * ranks keep their candidates' order) and the same floats (the same
 * expression, in double).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    double rank;
    Py_ssize_t at;  /* the candidate's position in values */
    Py_ssize_t end; /* where its class's run ends */
    Py_ssize_t cls;
} Head;

/* Head a before head b: the higher rank, then the earlier candidate. */
static inline int
before(const Head *a, const Head *b)
{
    return a->rank > b->rank || (a->rank == b->rank && a->at < b->at);
}

static void
sift_down(Head *heap, Py_ssize_t n, Py_ssize_t i)
{
    for (;;) {
        Py_ssize_t best = i, l = 2 * i + 1, r = l + 1;
        if (l < n && before(&heap[l], &heap[best]))
            best = l;
        if (r < n && before(&heap[r], &heap[best]))
            best = r;
        if (best == i)
            return;
        Head t = heap[i];
        heap[i] = heap[best];
        heap[best] = t;
        i = best;
    }
}

static inline double
rank_of(int64_t value, double now, double cadence, double boost)
{
    /* As Python computes (now - minute * 60) / cadence_s + boost: the minute
       times 60 is an exact integer, converted once. */
    int64_t minute = value >> 32;
    return (now - (double)(minute * 60)) / cadence + boost;
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
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *out[6] = {NULL, NULL, NULL, NULL, NULL, NULL}, *result = NULL;
    Head *heap = NULL;
    double *cad = NULL, *bst = NULL;
    if (view.len % 8 || (view.len && ((uintptr_t)view.buf) % 8)) {
        PyErr_SetString(PyExc_ValueError, "merge(): values are not aligned int64");
        goto done;
    }
    const int64_t *values = (const int64_t *)view.buf;
    Py_ssize_t n = view.len / 8;
    heap = PyMem_Malloc(sizeof(Head) * (classes ? classes : 1));
    cad = PyMem_Malloc(sizeof(double) * (classes ? classes : 1));
    bst = PyMem_Malloc(sizeof(double) * (classes ? classes : 1));
    if (heap == NULL || cad == NULL || bst == NULL) {
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
        if (start < 0 || end > n || start > end || !(cad[c] > 0)) {
            PyErr_SetString(PyExc_ValueError, "merge(): a run or a cadence out of range");
            goto done;
        }
        total += end - start;
        if (start < end) {
            heap[size].rank = rank_of(values[start], now, cad[c], bst[c]);
            heap[size].at = start;
            heap[size].end = end;
            heap[size].cls = c;
            size++;
        }
    }
    for (Py_ssize_t i = size / 2 - 1; i >= 0; i--)
        sift_down(heap, size, i);
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
        Head *top = &heap[0];
        int64_t value = values[top->at];
        PyObject *item[5] = {
            PyLong_FromSsize_t(top->at),
            PyFloat_FromDouble(top->rank),
            PyLong_FromLongLong(value & 0xFFFFFFFFLL),
            PyLong_FromLongLong(value >> 32),
            PyList_GET_ITEM(cids, top->cls),
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
        marks[top->at] = 1;
        if (++top->at < top->end) {
            Py_ssize_t c = top->cls;
            top->rank = rank_of(values[top->at], now, cad[c], bst[c]);
        }
        else
            heap[0] = heap[--size];
        sift_down(heap, size, 0);
    }
    result = PyTuple_Pack(6, out[0], out[1], out[2], out[3], out[4], out[5]);
done:
    for (int j = 0; j < 6; j++)
        Py_XDECREF(out[j]);
    PyMem_Free(heap);
    PyMem_Free(cad);
    PyMem_Free(bst);
    PyBuffer_Release(&view);
    return result;
}

/* flag(flags, at, value): flags[i] = value for each i in the list at (a
 * bytearray; every index is checked first, so a bad one changes nothing). */
static PyObject *
best_flag(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3 || !PyByteArray_Check(args[0]) || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "flag(flags: bytearray, at: list, value)");
        return NULL;
    }
    long value = PyLong_AsLong(args[2]);
    if (value == -1 && PyErr_Occurred())
        return NULL;
    if (value < 0 || value > 255) {
        PyErr_SetString(PyExc_ValueError, "flag(): value is a byte");
        return NULL;
    }
    Py_ssize_t size = PyByteArray_GET_SIZE(args[0]), n = PyList_GET_SIZE(args[1]);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t at = PyLong_AsSsize_t(PyList_GET_ITEM(args[1], i));
        if (at == -1 && PyErr_Occurred())
            return NULL;
        if (at < 0 || at >= size) {
            PyErr_SetString(PyExc_IndexError, "flag(): an index out of range");
            return NULL;
        }
    }
    char *flags = PyByteArray_AS_STRING(args[0]);
    for (Py_ssize_t i = 0; i < n; i++)
        flags[PyLong_AsSsize_t(PyList_GET_ITEM(args[1], i))] = (char)value;
    Py_RETURN_NONE;
}

static PyMethodDef best_methods[] = {
    {"merge", (PyCFunction)(void (*)(void))best_merge, METH_FASTCALL,
     "merge(values, starts, cadences, boosts, cids, now, k) -> (picks, ranks, slots, minutes, "
     "classes, marks): the k best candidates of the class runs, best first"},
    {"flag", (PyCFunction)(void (*)(void))best_flag, METH_FASTCALL,
     "flag(flags, at, value): flags[i] = value for each i in at"},
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
    return PyModule_Create(&best_module);
}
