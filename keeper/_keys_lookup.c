/* keeper/_keys_lookup.c: many keys looked up in a KeyColumn at once (the
 * column itself: keeper/_keys.c).
 *
 *   move_keys(keys, table, mask, held, det, cids, mins, flag, by_class)
 *                           Buckets._move_many's loop over a KeyColumn or a
 *                           list of keys by slot
 *   KeySet                  pick's exclusion by a set of str (keeper/_best.c),
 *                           compared with the column's bytes, no str made */
#include "_keys.h"

#include <string.h>

/* pick's exclusion by a set of str: the set's keys by the low 32 bits of
 * their hash, in an open-addressing table of at least twice their number. */
int
keyset_build(KeySet *ks, PyObject *set)
{
    Py_ssize_t n = PySet_GET_SIZE(set), cells = 8;
    while (cells < 2 * n)
        cells <<= 1;
    ks->mask = cells - 1;
    if ((ks->cell = PyMem_Calloc((size_t)cells, sizeof(*ks->cell))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    /* pick builds it last, so no Python code runs while it reads the keys'
     * UTF-8 (keeper/_best.c): a key not a str, or not UTF-8, equals no key
     * held. Up to Python 3.12 the set's own table is read as it is (its keys
     * borrowed, their hashes stored); later (the call is internal there),
     * through an iterator, each key held in ks->keep. */
    PyObject *key;
    Py_hash_t h;
#if PY_VERSION_HEX < 0x030D0000
    Py_ssize_t pos = 0;
    while (_PySet_NextEntry(set, &pos, &key, &h)) {
#else
    if ((ks->keep = PyList_New(0)) == NULL)
        return -1;
    PyObject *it = PyObject_GetIter(set);
    if (it == NULL)
        return -1;
    while ((key = PyIter_Next(it)) != NULL) {
        int kept = PyList_Append(ks->keep, key);
        Py_DECREF(key);
        if (kept < 0)
            break;
        if (!PyUnicode_CheckExact(key))
            continue; /* (its hash could run Python) */
        if ((h = PyObject_Hash(key)) == -1)
            break;
#endif
        Py_ssize_t len;
        const char *utf8 = PyUnicode_Check(key) ? PyUnicode_AsUTF8AndSize(key, &len) : NULL;
        if (utf8 == NULL) {
            if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_UnicodeError))
                break;
            PyErr_Clear();
            continue;
        }
        if (len > KC_MAX_LEN)
            continue; /* longer than any key held */
        Py_ssize_t i = (Py_ssize_t)((uint32_t)h & (size_t)ks->mask);
        while (ks->cell[i].utf8 != NULL)
            i = (i + 1) & ks->mask;
        ks->cell[i] = (KeySetCell){(uint32_t)h, (uint32_t)len, utf8};
    }
#if PY_VERSION_HEX >= 0x030D0000
    Py_DECREF(it);
#endif
    return PyErr_Occurred() ? -1 : 0;
}

/* The column's hash first: most candidates are not excluded, and their
 * blocks are not read at all. */
int
keyset_has(const KeySet *ks, const KeyColumn *col, Py_ssize_t slot)
{
    uint32_t h = col->hash[slot];
    for (Py_ssize_t i = (Py_ssize_t)(h & (size_t)ks->mask); ks->cell[i].utf8 != NULL;
         i = (i + 1) & ks->mask) {
        const KeySetCell *c = &ks->cell[i];
        if (kc_equal(col, slot, c->hash, c->utf8, c->len))
            return 1;
    }
    return 0;
}

void
keyset_free(KeySet *ks)
{
    PyMem_Free(ks->cell);
    Py_CLEAR(ks->keep);
}

/* move_keys(keys, table, mask, held, det, cids, mins, flag, by_class) -> moved
 *
 * The key loop of Buckets.detach_many / attach_many (keeper/buckets/detach.py
 * _move_many): each key of keys (any iterable of str) is looked up in the key
 * table (table: int32 cells, linear probing from hash(key) & mask, -1 empty;
 * held: the KeyColumn, or a list of keys, by slot), and a row found whose det
 * flag is not flag gets it, its order value (mins[slot] << 32 | slot)
 * appended to by_class[cids[slot]] (a dict of lists, made as needed). Returns
 * how many rows were flagged. The same lookups and the same answer as the
 * Python loop, with no Python frame a key. */
static int32_t
held_slot(PyObject *held, PyObject *key, const int32_t *table, Py_ssize_t mask, Py_ssize_t nrows)
{
    Py_hash_t h;
    if (KeyColumn_Check(held)) {
        Py_ssize_t i = kc_probe_any((KeyColumn *)held, table, mask, key);
        if (i < 0)
            return -2;
        if (table[i] >= nrows) {
            PyErr_SetString(PyExc_IndexError, "move_keys(): a slot out of range");
            return -2;
        }
        return table[i];
    }
    if ((h = PyObject_Hash(key)) == -1)
        return -2;
    Py_ssize_t i = (Py_ssize_t)h & mask;
    for (;;) {
        int32_t slot = table[i];
        if (slot < 0)
            return -1;
        if (slot >= PyList_GET_SIZE(held) || slot >= nrows) {
            PyErr_SetString(PyExc_IndexError, "move_keys(): a slot out of range");
            return -2;
        }
        PyObject *there = PyList_GET_ITEM(held, slot);
        if (there == key)
            return slot;
        Py_INCREF(there);
        int eq = PyObject_RichCompareBool(there, key, Py_EQ);
        Py_DECREF(there);
        if (eq < 0)
            return -2;
        if (eq)
            return slot;
        i = (i + 1) & mask;
    }
}

PyObject *
best_move_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 9 || !(PyList_Check(args[3]) || KeyColumn_Check(args[3])) ||
        !PyByteArray_Check(args[4]) || !PyDict_Check(args[8])) {
        PyErr_SetString(PyExc_TypeError,
                        "move_keys(keys, table, mask, held: KeyColumn or list, det: bytearray, "
                        "cids, mins, flag, by_class: dict)");
        return NULL;
    }
    PyObject *held = args[3], *by_class = args[8];
    Py_ssize_t mask = PyLong_AsSsize_t(args[2]);
    long flag = PyLong_AsLong(args[7]);
    if (PyErr_Occurred())
        return NULL;
    if (flag < 0 || flag > 255) {
        PyErr_SetString(PyExc_ValueError, "move_keys(): flag is a byte");
        return NULL;
    }
    Py_buffer tb, cb, mb;
    if (kc_table(args[1], mask, &tb) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[5], &cb, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&tb);
        return NULL;
    }
    if (PyObject_GetBuffer(args[6], &mb, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&tb);
        PyBuffer_Release(&cb);
        return NULL;
    }
    PyObject *it = NULL, *key = NULL, *result = NULL;
    Py_ssize_t moved = 0;
    Py_ssize_t nrows = cb.len / 4 < mb.len / 4 ? cb.len / 4 : mb.len / 4;
    /* (an empty buffer's pointer may be anywhere: array's is a static "") */
    if ((cb.len && (uintptr_t)cb.buf % 4) || (mb.len && (uintptr_t)mb.buf % 4)) {
        PyErr_SetString(PyExc_ValueError, "move_keys(): cids and mins are int32 buffers");
        goto done;
    }
    const int32_t *table = (const int32_t *)tb.buf, *cids = (const int32_t *)cb.buf,
                  *mins = (const int32_t *)mb.buf;
    if ((it = PyObject_GetIter(args[0])) == NULL)
        goto done;
    while ((key = PyIter_Next(it)) != NULL) {
        int32_t slot = held_slot(held, key, table, mask, nrows);
        Py_CLEAR(key);
        if (slot == -2)
            goto done;
        /* (a compare may have run Python: the flags read afresh) */
        if (slot >= PyByteArray_GET_SIZE(args[4])) {
            PyErr_SetString(PyExc_IndexError, "move_keys(): a slot out of range");
            goto done;
        }
        char *det = PyByteArray_AS_STRING(args[4]);
        if (slot < 0 || det[slot] == (char)flag)
            continue;
        det[slot] = (char)flag;
        PyObject *cid = PyLong_FromLong(cids[slot]);
        PyObject *value = PyLong_FromLongLong((long long)mins[slot] * 4294967296LL +
                                              (long long)(uint32_t)slot);
        if (cid == NULL || value == NULL) {
            Py_XDECREF(cid);
            Py_XDECREF(value);
            goto done;
        }
        PyObject *values = PyDict_GetItemWithError(by_class, cid);
        int bad = 0;
        if (values == NULL) {
            if (PyErr_Occurred() || (values = PyList_New(0)) == NULL)
                bad = 1;
            else {
                bad = PyDict_SetItem(by_class, cid, values) < 0;
                Py_DECREF(values); /* the dict holds it, or it is gone */
            }
        }
        bad = bad || PyList_Append(values, value) < 0;
        Py_DECREF(cid);
        Py_DECREF(value);
        if (bad)
            goto done;
        moved++;
    }
    if (!PyErr_Occurred())
        result = PyLong_FromSsize_t(moved);
done:
    Py_XDECREF(key);
    Py_XDECREF(it);
    PyBuffer_Release(&tb);
    PyBuffer_Release(&cb);
    PyBuffer_Release(&mb);
    return result;
}

