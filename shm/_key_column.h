/* A column of keys by slot held outside str objects (keeper/_keys.c, the
 * keeper's KeyColumn), read by the ready set's entry writer
 * (shm/_atomic_seq.c write_gathered) through this table of functions, which
 * the column's type carries as a capsule in its ``_api`` attribute: the
 * writer copies each key's UTF-8 straight from the column, and shm imports
 * nothing of the keeper. */
#ifndef QUEUE_NODE_KEY_COLUMN_H
#define QUEUE_NODE_KEY_COLUMN_H

#include <Python.h>

#define KEY_COLUMN_CAPSULE "queue_node.key_column_api"

typedef struct {
    /* The column's type: the writer reads only an object of it. */
    PyTypeObject *type;
    /* The UTF-8 of slot's key and its length in *len, *ascii set when it is
     * all ASCII; NULL with *len 0 for a slot that holds no key, NULL with
     * *len -1 for a slot out of range. Makes no Python object. */
    const char *(*key)(PyObject *column, Py_ssize_t slot, Py_ssize_t *len, int *ascii);
} KeyColumnAPI;

#endif
