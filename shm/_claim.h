/* shm._claim's pieces, shared between its C files: shm/_claim.c (the module
 * and its Granter type), shm/_grant.c (the lease table's grant),
 * shm/_blake2b.c (the key hash), shm/_complete.c (the ledger's completions
 * and peeks), and the claim path (shm/_claim_path.h). The
 * layouts are shm/layout.h's; the counted publish and the test stops are
 * shm/_publish.h's.
 *
 * Functions shared between the files are hidden (INTERNAL): called directly,
 * never through the PLT, as a static function is. */

#ifndef QUEUE_NODE_CLAIM_H
#define QUEUE_NODE_CLAIM_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "_publish.h"
#include "layout.h"

#define INTERNAL __attribute__((visibility("hidden")))

/* hashlib.blake2b(data, digest_size=8) as a little-endian integer (RFC 7693):
   the lease table's key hash (shm/_blake2b.c). */
INTERNAL uint64_t blake2b64(const uint8_t *data, size_t len);

/* Each key's owner among a node list, by rendezvous hashing (shm/_owners.c;
   keeper/owners.py is the definition). */
INTERNAL PyObject *claim_owners_of(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

/* A lease table mapping with its layout (shm/leases/). */
typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int held;
    char *buf;
    Py_ssize_t capacity; /* a power of two */
    Py_ssize_t hashes, maxdist, owners, slots;
    Py_ssize_t long_blocks;
    /* This process's counter shard (set_shard) and the owner bits it was
       set for: a grant by another owner (a child of fork) answers G_NO_SHARD
       and Python gives it one. */
    char *shard;
    uint64_t shard_owner;
} GranterObject;

INTERNAL extern PyTypeObject GranterType;

typedef struct {
    const char *key; /* UTF-8, 1..1024 bytes */
    Py_ssize_t key_len;
    const char *holder; /* UTF-8, at most 32 bytes */
    Py_ssize_t holder_len;
    double lease_s, now, cadence_s;
    uint64_t version;
    uint64_t owner; /* this process's pid and tag, as a state word holds them */
    int stop;       /* a test stop (test build only), 0 none */
    int hashed;     /* h64 holds the key's hash already */
    uint64_t h64;
    /* What lease_refusal found, for the grant's first look: 0 nothing known,
       1 the slot (slot, word, record as read), 2 no slot. A slot that has
       changed since fails the grant's swap and is looked up again. */
    int looked;
    Py_ssize_t slot;
    uint64_t word;
    char record[RECORD_SIZE];
} GrantArgs;

/* What lease_grant answers (and, as ints, Granter.grant). */
enum {
    G_GRANTED = 0,
    G_LEASED = 1,
    G_HELD = 2,
    G_PARKED = 3,
    G_AGAIN = 4, /* internal: look again */
    G_SLOW = -1,
    G_TAKEN_OVER = -2,
    G_SEALED = -3,   /* the table is sealed: nothing changed */
    G_NO_SHARD = -4, /* this owner has no counter shard yet: nothing changed */
};

/* *slot and *word: where a grant leased the key and the LEASED word it left
   there (on G_GRANTED). */
INTERNAL int lease_grant(GranterObject *g, const GrantArgs *a, uint64_t *lease_id, uint32_t *misses,
                Py_ssize_t *slot, uint64_t *word);

/* Whether the key's slot refuses a grant now, read without taking it:
   G_LEASED, G_HELD, G_PARKED, or 0 (no slot, grantable, or not sure: the
   grant decides). Sets a->h64 and a->hashed (hashes the key unless
   a->hashed says a->h64 holds its hash), and what it found (a->looked). */
INTERNAL int lease_refusal(GranterObject *g, GrantArgs *a);

/* The key's hash (blake2b64), after asking the CPU for the lines a grant of
   it touches at its home slot (state word, hash, maxdist, the slot): a claim
   calls it for a run of keys first, so that their cache misses overlap
   instead of each grant waiting out its own. Only a hint: nothing changes. */
INTERNAL uint64_t lease_prefetch(GranterObject *g, const char *key, Py_ssize_t key_len);

/* Granter.complete_many and Granter.peek_many (shm/_complete.c): the ledger's
   lease work for a group of results, LeaseTable.complete and .peek item by
   item. */
INTERNAL PyObject *granter_complete_many(GranterObject *self, PyObject *const *args,
                                         Py_ssize_t nargs);
INTERNAL PyObject *granter_peek_many(GranterObject *self, PyObject *const *args, Py_ssize_t nargs);

/* Adds ClaimPath and RowError to the module (shm/_claim_path.c). */
INTERNAL int claim_path_add(PyObject *m);
/* shm._claim.Walker, the keeper's load walk (shm/_claim_walk.c), added to the module. */
INTERNAL int claim_walk_add(PyObject *m);

#endif
