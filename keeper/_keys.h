/* keeper/_keys.c's KeyColumn as the other files of keeper._best see it. */
#ifndef QUEUE_NODE_KEEPER_KEYS_H
#define QUEUE_NODE_KEEPER_KEYS_H

#include <Python.h>
#include <stdint.h>

/* A key's block: a 2-byte header (its UTF-8 length, bit 15 set when all
 * ASCII), then its UTF-8. */
typedef struct {
    PyObject_HEAD
    unsigned char **at; /* per slot: the key's block, or NULL for no key */
    uint32_t *hash;     /* per slot: the low 32 bits of hash(key) */
    Py_ssize_t len, cap;
} KeyColumn;

extern PyTypeObject KeyColumnType;

#define KC_MAX_LEN 0x7FFF /* a key's UTF-8, in bytes: 15 bits of its header */
#define KeyColumn_Check(op) PyObject_TypeCheck(op, &KeyColumnType)
#define KC_LEN(block) ((Py_ssize_t)((block)[0] | ((block)[1] & 0x7F) << 8))
#define KC_ASCII(block) ((block)[1] >> 7)
#define KC_UTF8(block) ((const char *)(block) + 2)

/* Whether slot's key is ``utf8`` (``len`` bytes) of hash ``h``. */
static inline int
kc_equal(const KeyColumn *col, Py_ssize_t slot, Py_hash_t h, const char *utf8, Py_ssize_t len)
{
    const unsigned char *block = col->at[slot];
    return block != NULL && col->hash[slot] == (uint32_t)h && KC_LEN(block) == len &&
           memcmp(KC_UTF8(block), utf8, (size_t)len) == 0;
}

/* A key table's buffer, checked (int32 cells, mask + 1 of them, a power of
 * two): 0, or -1 with an exception. */
int kc_table(PyObject *obj, Py_ssize_t mask, Py_buffer *view);

/* The key table's probe for any object: the cell holding its slot, or the
 * empty cell ending it (one not a str, or not UTF-8, is held by none); -1
 * with an exception. */
Py_ssize_t kc_probe_any(const KeyColumn *self, const int32_t *table, Py_ssize_t mask,
                        PyObject *key);

/* pick's exclusion by a set of str (keeper/_best.c): build it, ask it
 * whether slot's key is in it, free it (a zeroed KeySet frees as empty). */
typedef struct {
    uint32_t hash, len;
    const char *utf8; /* NULL: an empty cell */
} KeySetCell;
typedef struct {
    KeySetCell *cell;
    Py_ssize_t mask;
    PyObject *keep; /* from Python 3.13: the set's keys, held while the cells point into them */
} KeySet;
int keyset_build(KeySet *ks, PyObject *set);
int keyset_has(const KeySet *ks, const KeyColumn *col, Py_ssize_t slot);
void keyset_free(KeySet *ks);

/* The names the module adds: KeyColumn and move_keys. */
int kc_add_to_module(PyObject *module);
PyObject *best_move_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

#endif
