/* KeyColumn: the keeper's keys by slot, outside str objects.
 *
 * The key table (keeper/buckets/table.py) held each row's key as a str in a
 * list: 112 bytes of pymalloc block and 8 of list for a 54-character key,
 * two thirds of the keeper's memory a row. A KeyColumn holds each key's UTF-8
 * in a block of its own (a 2-byte header, then the bytes: 64 bytes for 54
 * characters) and the low 32 bits of the key's hash beside its pointer: 76
 * bytes a row. A str is made only when Python asks for a key (``col[slot]``);
 * the lookups (``find``, move_keys, pick's exclusion) and the ready set's
 * writer (shm/_key_column.h) read the bytes where they are, and the keeper
 * makes its live set's strs (``take``) after the set is published.
 *
 *   KeyColumn()             empty; len(col), col[slot] -> str | None,
 *                           col[slot] = str | None, col.append(key),
 *                           col.extend(keys), col += keys
 *   col.reserve(n)          room for n slots without growing
 *   col.truncate(n)         drop the slots from n on
 *   col.hash_at(slot)       the stored hash (its low 32 bits, as hash(key) &
 *                           mask reads them for any mask below 2**32), None
 *                           for a slot that holds no key
 *   col.take(slots, n)      the keys of the first n slots of an int32 buffer
 *   col.find(key, table, mask) -> cell
 *                           the key table's probe (int32 cells, -1 empty,
 *                           linear from hash(key) & mask): the cell holding
 *                           key's slot, or the empty cell that ends it (a
 *                           key not a str, or not UTF-8, is held by none)
 *
 * keeper/_keys_lookup.c has the lookups of many keys at once: move_keys
 * (Buckets._move_many's loop, a KeyColumn or a list) and pick's KeySet. */
#include "_keys.h"

#include <string.h>

#include "../shm/_key_column.h"


/* A new str of a block's key. */
static PyObject *
kc_block_str(const unsigned char *block)
{
    Py_ssize_t len = KC_LEN(block);
    if (KC_ASCII(block)) {
        PyObject *s = PyUnicode_New(len, 127);
        if (s != NULL)
            memcpy(PyUnicode_DATA(s), KC_UTF8(block), (size_t)len);
        return s;
    }
    return PyUnicode_DecodeUTF8(KC_UTF8(block), len, "strict");
}

/* A new block for str ``key`` (NULL with an exception for a key not a str,
 * not UTF-8 encodable or over KC_MAX_LEN bytes), its hash in *h. */
static unsigned char *
kc_block(PyObject *key, Py_hash_t *h)
{
    if (!PyUnicode_Check(key)) {
        PyErr_Format(PyExc_TypeError, "a key is a str, not %.80s", Py_TYPE(key)->tp_name);
        return NULL;
    }
    Py_ssize_t len;
    const char *utf8 = PyUnicode_AsUTF8AndSize(key, &len);
    if (utf8 == NULL || (*h = PyObject_Hash(key)) == -1)
        return NULL;
    if (len > KC_MAX_LEN) {
        PyErr_Format(PyExc_ValueError, "a key of %zd bytes (at most %d)", len, KC_MAX_LEN);
        return NULL;
    }
    unsigned char *block = PyMem_Malloc((size_t)len + 2);
    if (block == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    block[0] = (unsigned char)(len & 0xFF);
    block[1] = (unsigned char)((len >> 8) | (PyUnicode_IS_ASCII(key) ? 0x80 : 0));
    memcpy(block + 2, utf8, (size_t)len);
    return block;
}

static int
kc_grow(KeyColumn *self, Py_ssize_t need)
{
    if (need <= self->cap)
        return 0;
    const Py_ssize_t most = PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(unsigned char *);
    if (need > most)
        goto nomem;
    Py_ssize_t cap = self->cap + (self->cap >> 3) + 8; /* as a list grows */
    if (cap < need || cap > most)
        cap = need;
    unsigned char **at = PyMem_Realloc(self->at, sizeof(*at) * (size_t)cap);
    if (at == NULL)
        goto nomem;
    self->at = at;
    uint32_t *hash = PyMem_Realloc(self->hash, sizeof(*hash) * (size_t)cap);
    if (hash == NULL)
        goto nomem;
    self->hash = hash;
    self->cap = cap;
    return 0;
nomem:
    PyErr_NoMemory();
    return -1;
}

static int
kc_append(KeyColumn *self, PyObject *key)
{
    Py_hash_t h = 0;
    unsigned char *block = key == Py_None ? NULL : kc_block(key, &h);
    if ((block == NULL && key != Py_None) || kc_grow(self, self->len + 1) < 0) {
        PyMem_Free(block);
        return -1;
    }
    self->at[self->len] = block;
    self->hash[self->len] = (uint32_t)h;
    self->len++;
    return 0;
}

static void
kc_dealloc(KeyColumn *self)
{
    for (Py_ssize_t i = 0; i < self->len; i++)
        PyMem_Free(self->at[i]);
    PyMem_Free(self->at);
    PyMem_Free(self->hash);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
kc_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) || (kwds != NULL && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "KeyColumn() takes no arguments");
        return NULL;
    }
    KeyColumn *self = (KeyColumn *)type->tp_alloc(type, 0);
    if (self != NULL) {
        self->at = NULL;
        self->hash = NULL;
        self->len = self->cap = 0;
    }
    return (PyObject *)self;
}

static Py_ssize_t
kc_length(KeyColumn *self)
{
    return self->len;
}

/* Whether a slot holds a key: 1, 0 (none), -1 with an IndexError (no such
 * slot). */
static int
kc_holds(const KeyColumn *self, Py_ssize_t slot)
{
    if (slot < 0 || slot >= self->len) {
        PyErr_SetString(PyExc_IndexError, "KeyColumn index out of range");
        return -1;
    }
    return self->at[slot] != NULL;
}

static PyObject *
kc_item(KeyColumn *self, Py_ssize_t slot)
{
    int holds = kc_holds(self, slot);
    if (holds <= 0)
        return holds < 0 ? NULL : Py_NewRef(Py_None);
    return kc_block_str(self->at[slot]);
}

static int
kc_ass_item(KeyColumn *self, Py_ssize_t slot, PyObject *key)
{
    if (slot < 0 || slot >= self->len) {
        PyErr_SetString(PyExc_IndexError, "KeyColumn assignment index out of range");
        return -1;
    }
    if (key == NULL) {
        PyErr_SetString(PyExc_TypeError, "a KeyColumn's slots are not deleted: set None");
        return -1;
    }
    Py_hash_t h = 0;
    unsigned char *block = NULL;
    if (key != Py_None && (block = kc_block(key, &h)) == NULL)
        return -1;
    if (slot >= self->len) { /* a key's __hash__ ran Python that truncated the column */
        PyMem_Free(block);
        PyErr_SetString(PyExc_IndexError, "KeyColumn assignment index out of range");
        return -1;
    }
    PyMem_Free(self->at[slot]);
    self->at[slot] = block;
    self->hash[slot] = (uint32_t)h;
    return 0;
}

static PyObject *
kc_extend(KeyColumn *self, PyObject *keys)
{
    /* (a list of its own: a key's __hash__ could change the one passed in) */
    PyObject *seq = PySequence_List(keys);
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(seq), was = self->len;
    PyObject **items = ((PyListObject *)seq)->ob_item;
    if (kc_grow(self, self->len + n) < 0)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++)
        if (kc_append(self, items[i]) < 0)
            goto fail;
    Py_DECREF(seq);
    Py_RETURN_NONE;
fail: /* nothing added */
    while (self->len > was)
        PyMem_Free(self->at[--self->len]);
    Py_DECREF(seq);
    return NULL;
}

static PyObject *
kc_inplace_concat(KeyColumn *self, PyObject *keys)
{
    PyObject *r = kc_extend(self, keys);
    if (r == NULL)
        return NULL;
    Py_DECREF(r);
    return Py_NewRef(self);
}

static PyObject *
kc_append_method(KeyColumn *self, PyObject *key)
{
    if (kc_append(self, key) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* A number of slots from a Python int (-1 with an exception: not an int,
 * or negative). */
static Py_ssize_t
kc_slots_arg(PyObject *arg, const char *what)
{
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n < 0 && !PyErr_Occurred())
        PyErr_Format(PyExc_ValueError, "%s(): a negative number of slots", what);
    return PyErr_Occurred() ? -1 : n;
}

static PyObject *
kc_reserve(KeyColumn *self, PyObject *arg)
{
    Py_ssize_t n = kc_slots_arg(arg, "reserve");
    if (n < 0 || kc_grow(self, n) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
kc_truncate(KeyColumn *self, PyObject *arg)
{
    Py_ssize_t n = kc_slots_arg(arg, "truncate");
    if (n < 0)
        return NULL;
    while (self->len > n)
        PyMem_Free(self->at[--self->len]);
    Py_RETURN_NONE;
}

static PyObject *
kc_hash_at(KeyColumn *self, PyObject *arg)
{
    Py_ssize_t slot = PyLong_AsSsize_t(arg);
    if (slot == -1 && PyErr_Occurred())
        return NULL;
    int holds = kc_holds(self, slot);
    if (holds <= 0)
        return holds < 0 ? NULL : Py_NewRef(Py_None);
    return PyLong_FromUnsignedLong(self->hash[slot]);
}

/* The probe for str ``key`` of hash h in int32 ``table`` of mask + 1 cells:
 * the cell holding its slot, or the empty cell ending it (-1 with an
 * exception for a slot out of range). */
static Py_ssize_t
kc_probe(const KeyColumn *self, const int32_t *table, Py_ssize_t mask, Py_hash_t h,
         const char *utf8, Py_ssize_t len)
{
    Py_ssize_t i = (Py_ssize_t)((size_t)h & (size_t)mask);
    for (;;) {
        int32_t slot = table[i];
        if (slot < 0)
            return i;
        if (slot >= self->len) {
            PyErr_SetString(PyExc_IndexError, "a key table's slot out of range of its keys");
            return -1;
        }
        if (kc_equal(self, slot, h, utf8, len))
            return i;
        i = (i + 1) & mask;
    }
}

/* kc_probe for any object: one that is not a str, or a str that is not
 * UTF-8 (a lone surrogate), equals no key held, and its probe ends at the
 * first empty cell from its hash, as the list's would. */
Py_ssize_t
kc_probe_any(const KeyColumn *self, const int32_t *table, Py_ssize_t mask, PyObject *key)
{
    Py_hash_t h = PyObject_Hash(key);
    if (h == -1)
        return -1;
    Py_ssize_t len = 0;
    const char *utf8 = PyUnicode_Check(key) ? PyUnicode_AsUTF8AndSize(key, &len) : NULL;
    if (utf8 != NULL)
        return kc_probe(self, table, mask, h, utf8, len);
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_UnicodeError))
            return -1;
        PyErr_Clear();
    }
    Py_ssize_t i = (Py_ssize_t)((size_t)h & (size_t)mask);
    while (table[i] >= 0)
        i = (i + 1) & mask;
    return i;
}

/* A key table's buffer, checked: int32 cells, mask + 1 of them. */
int
kc_table(PyObject *obj, Py_ssize_t mask, Py_buffer *view)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0)
        return -1;
    if (mask < 0 || view->len % 4 || view->len / 4 - 1 != mask || ((mask + 1) & mask) ||
        ((uintptr_t)view->buf % 4)) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "the key table is not int32 cells of mask + 1");
        return -1;
    }
    return 0;
}

static PyObject *
kc_find(KeyColumn *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "find(key, table, mask)");
        return NULL;
    }
    Py_ssize_t mask = PyLong_AsSsize_t(args[2]);
    Py_buffer tb;
    if ((mask == -1 && PyErr_Occurred()) || kc_table(args[1], mask, &tb) < 0)
        return NULL;
    Py_ssize_t cell = kc_probe_any(self, (const int32_t *)tb.buf, mask, args[0]);
    PyBuffer_Release(&tb);
    return cell < 0 ? NULL : PyLong_FromSsize_t(cell);
}

/* The writer's table of functions (shm/_key_column.h). */
static const char *
api_key(PyObject *column, Py_ssize_t slot, Py_ssize_t *len, int *ascii)
{
    KeyColumn *self = (KeyColumn *)column;
    if (slot < 0 || slot >= self->len) {
        *len = -1;
        return NULL;
    }
    const unsigned char *block = self->at[slot];
    if (block == NULL) {
        *len = 0;
        return NULL;
    }
    *len = KC_LEN(block);
    *ascii = KC_ASCII(block);
    return KC_UTF8(block);
}

static const KeyColumnAPI api = {&KeyColumnType, api_key};

/* take(slots, n) -> [str]: the keys of the first n slots of an int32
 * buffer (the keys a publish wrote: the keeper's live set). */
static PyObject *
kc_take(KeyColumn *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "take(slots, n)");
        return NULL;
    }
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *out = NULL;
    if (n < 0 || n > view.len / 4 || (view.len && (uintptr_t)view.buf % 4)) {
        PyErr_SetString(PyExc_ValueError, "take(): slots is not an int32 buffer of n slots");
        goto done;
    }
    const int32_t *slots = (const int32_t *)view.buf;
    if ((out = PyList_New(n)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = kc_item(self, slots[i]);
        if (key == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, key);
    }
done:
    PyBuffer_Release(&view);
    return out;
}

/* Two columns are equal when they hold the same keys in the same slots. */
static PyObject *
kc_richcompare(PyObject *a, PyObject *b, int op)
{
    if (!KeyColumn_Check(a) || !KeyColumn_Check(b) || (op != Py_EQ && op != Py_NE))
        Py_RETURN_NOTIMPLEMENTED;
    const KeyColumn *x = (const KeyColumn *)a, *y = (const KeyColumn *)b;
    int eq = x->len == y->len;
    for (Py_ssize_t i = 0; eq && i < x->len; i++) {
        const unsigned char *p = x->at[i], *q = y->at[i];
        eq = p == NULL ? q == NULL
                       : q != NULL && KC_LEN(p) == KC_LEN(q) &&
                             memcmp(p, q, (size_t)KC_LEN(p) + 2) == 0;
    }
    return PyBool_FromLong(eq == (op == Py_EQ));
}

static PyMethodDef kc_methods[] = {
    {"append", (PyCFunction)kc_append_method, METH_O, "append(key): a slot more"},
    {"extend", (PyCFunction)kc_extend, METH_O, "extend(keys): a slot more a key"},
    {"reserve", (PyCFunction)kc_reserve, METH_O, "reserve(n): room for n slots"},
    {"truncate", (PyCFunction)kc_truncate, METH_O, "truncate(n): drop the slots from n on"},
    {"hash_at", (PyCFunction)kc_hash_at, METH_O,
     "hash_at(slot): the key's stored hash (None: the slot holds no key)"},
    {"take", (PyCFunction)(void (*)(void))kc_take, METH_FASTCALL,
     "take(slots, n) -> list[str]: the keys of the first n slots (an int32 buffer)"},
    {"find", (PyCFunction)(void (*)(void))kc_find, METH_FASTCALL,
     "find(key, table, mask) -> cell: the key table's probe for key"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods kc_as_sequence = {
    .sq_length = (lenfunc)kc_length,
    .sq_item = (ssizeargfunc)kc_item,
    .sq_ass_item = (ssizeobjargproc)kc_ass_item,
    .sq_inplace_concat = (binaryfunc)kc_inplace_concat,
};

PyTypeObject KeyColumnType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "keeper._best.KeyColumn",
    .tp_basicsize = sizeof(KeyColumn),
    .tp_dealloc = (destructor)kc_dealloc,
    .tp_as_sequence = &kc_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The keeper's keys by slot, as UTF-8 outside str objects (keeper/_keys.c).",
    .tp_richcompare = kc_richcompare,
    .tp_methods = kc_methods,
    .tp_new = kc_new,
};

int
kc_add_to_module(PyObject *module)
{
    if (PyType_Ready(&KeyColumnType) < 0)
        return -1;
    PyObject *capsule = PyCapsule_New((void *)&api, KEY_COLUMN_CAPSULE, NULL);
    if (capsule == NULL)
        return -1;
    int bad = PyDict_SetItemString(KeyColumnType.tp_dict, "_api", capsule) < 0;
    Py_DECREF(capsule);
    PyType_Modified(&KeyColumnType);
    if (bad || PyModule_AddObjectRef(module, "KeyColumn", (PyObject *)&KeyColumnType) < 0)
        return -1;
    return 0;
}
