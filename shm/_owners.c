/* Rendezvous (highest random weight) hashing: which node of a list owns a key.
 *
 * keeper/owners.py is the reader's version and the definition; this is the same
 * arithmetic for a whole chunk of keys at a time (the keeper's load and walks
 * classify up to 1,000,000 keys, about 3 us a key in Python for three nodes).
 *
 * A key's weight on a node is mix64(blake2b64(key) ^ seed), the node's seed being
 * blake2b64 of its name; the highest weight wins and a tie (odds 2^-64) goes to
 * the lower index, the nodes being sorted by name, so every node computes the
 * same owner from the same list. mix64 is SplitMix64's finaliser: the XOR alone
 * would order a key's weights the same way for every key that shares high bits.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_claim.h"

static inline uint64_t
owners_mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* owners_of(keys: list[str], seeds: bytes) -> bytes: for each key, the index of
   its owner among the seeds (8 bytes each, native order, at most 255 of them). */
PyObject *
claim_owners_of(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "owners_of(keys: list[str], seeds: bytes)");
        return NULL;
    }
    Py_buffer sb;
    if (PyObject_GetBuffer(args[1], &sb, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_ssize_t nodes = sb.len / 8;
    if (sb.len % 8 != 0 || nodes < 1 || nodes > 255) {
        PyBuffer_Release(&sb);
        PyErr_SetString(PyExc_ValueError, "seeds: 1 to 255 of 8 bytes each");
        return NULL;
    }
    uint64_t seeds[255];
    memcpy(seeds, sb.buf, (size_t)sb.len);
    PyBuffer_Release(&sb);
    PyObject *keys = args[0];
    Py_ssize_t n = PyList_GET_SIZE(keys);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (out == NULL)
        return NULL;
    uint8_t *owner = (uint8_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        Py_ssize_t len;
        const char *utf8 = PyUnicode_Check(key) ? PyUnicode_AsUTF8AndSize(key, &len) : NULL;
        if (utf8 == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "owners_of: every key must be a str");
            Py_DECREF(out);
            return NULL;
        }
        uint64_t h = blake2b64((const uint8_t *)utf8, (size_t)len);
        uint64_t best = owners_mix64(h ^ seeds[0]);
        uint8_t best_at = 0;
        for (Py_ssize_t j = 1; j < nodes; j++) {
            uint64_t w = owners_mix64(h ^ seeds[j]);
            if (w > best) {
                best = w;
                best_at = (uint8_t)j;
            }
        }
        owner[i] = best_at;
    }
    return out;
}
