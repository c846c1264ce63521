/* The claim path's pieces (shm._claim.ClaimPath), shared between its C
 * files: shm/_claim_path.c (the type: its constructor, claim, close),
 * shm/_claim_take.c (the ready set's take), shm/_claim_sqlite.c (SQLite, from
 * the library Python's sqlite3 loaded), shm/_claim_grant.c (the rows read
 * and the grants, the per-entry loop) and shm/_claim_rows.c (the rows handed
 * in by a reader: a node on PostgreSQL). The ready set's offsets are
 * shm/layout.h's. */

#ifndef QUEUE_NODE_CLAIM_PATH_H
#define QUEUE_NODE_CLAIM_PATH_H

#include "_claim.h"

/* -- SQLite, from the library Python's sqlite3 loaded (shm/_claim_sqlite.c) ---- */

typedef struct sqlite3 sqlite3;
typedef struct sqlite3_stmt sqlite3_stmt;
#define SQLITE_OK 0
#define SQLITE_ROW 100
#define SQLITE_DONE 101
#define SQLITE_INTEGER 1
#define SQLITE_FLOAT 2
#define SQLITE_TEXT 3
#define SQLITE_BLOB 4
#define SQLITE_NULL 5
#define SQLITE_OPEN_READWRITE 0x00000002
#define SQLITE_OPEN_NOMUTEX 0x00008000 /* one thread at a time uses a claim path */

struct sqlite_api {
    int loaded;
    int (*open_v2)(const char *, sqlite3 **, int, const char *);
    int (*close_v2)(sqlite3 *);
    int (*prepare_v2)(sqlite3 *, const char *, int, sqlite3_stmt **, const char **);
    int (*bind_text)(sqlite3_stmt *, int, const char *, int, void (*)(void *));
    int (*bind_int64)(sqlite3_stmt *, int, long long);
    int (*step)(sqlite3_stmt *);
    int (*reset)(sqlite3_stmt *);
    int (*finalize)(sqlite3_stmt *);
    int (*column_type)(sqlite3_stmt *, int);
    long long (*column_int64)(sqlite3_stmt *, int);
    double (*column_double)(sqlite3_stmt *, int);
    const unsigned char *(*column_text)(sqlite3_stmt *, int);
    const void *(*column_blob)(sqlite3_stmt *, int);
    int (*column_bytes)(sqlite3_stmt *, int);
    int (*busy_timeout)(sqlite3 *, int);
    const char *(*errmsg)(sqlite3 *);
    int (*errcode)(sqlite3 *);
    int (*exec)(sqlite3 *, const char *, int (*)(void *, int, char **, char **), void *,
                char **);
    int (*get_autocommit)(sqlite3 *);
};
INTERNAL extern struct sqlite_api sq;

/* Find SQLite's functions in `module` (the path of Python's _sqlite3
   extension, already loaded; NULL: the interpreter itself). */
INTERNAL int load_sqlite(const char *module);

/* -- the claim path ------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    /* the ready set */
    Py_buffer ready;
    int ready_held;
    Py_ssize_t ready_capacity, heap_size, stride, heap_at, records_at;
    double low_water_fraction;
    Py_ssize_t switches; /* to a pending set, by this path */
    /* the lease table */
    GranterObject *granter;
    /* the schedule: a SQLite file read here, or (reader) rows handed in */
    PyObject *reader; /* keys -> rows, or NULL: shm/_claim_rows.c */
    sqlite3 *db;
    sqlite3_stmt *stmt;      /* row_sql: one key */
    sqlite3_stmt *rows_stmt; /* rows_sql: a run of keys */
    char *json;              /* the run's keys as a JSON array (rows_sql's ?1) */
    Py_ssize_t json_cap;
    double min_cadence, max_cadence, min_due, max_due;
    /* Python's side */
    PyObject *grant_type;     /* workers.claim.Grant, a tuple subclass */
    PyObject *decode_payload; /* node.store.sqlite.decode_payload */
    PyObject *scan_once;      /* json's C scanner: (str, idx) -> (value, end) */
    PyObject *route_cadence;  /* dict: route -> its default cadence (float) */
    PyObject *cadence_of;     /* route -> float, fills route_cadence */
    /* scratch for one take */
    char *entries;
    char *heap;
    /* A claim runs (the reader may release the GIL for seconds): another
       claim is refused meanwhile, and a close waits for its end. */
    int busy, close_pending;
} ClaimPathObject;

INTERNAL extern PyObject *RowError; /* (sqlite code, message) */

/* RowError from the connection's last error. */
INTERNAL void set_row_error(ClaimPathObject *self);

/* -- the take (shm/_claim_take.c) ---------------------------------------------- */

typedef struct {
    Py_ssize_t count;      /* entries copied into self->entries */
    uint64_t *records;     /* the slot's grant record of the first entry taken */
    uint64_t tag;          /* the take's publish, as a grant record names it */
    uint32_t flags;        /* the slot's flags */
    uint32_t heap_lo;      /* the first entry's key offset: self->heap starts there */
    Py_ssize_t last_count; /* the set's size and what it has left untaken */
    Py_ssize_t last_left;
} Taken;

static inline uint32_t
ld32(const char *p)
{
    return __atomic_load_n((const uint32_t *)p, __ATOMIC_ACQUIRE);
}

static inline uint64_t
ld64(const char *p)
{
    return __atomic_load_n((const uint64_t *)p, __ATOMIC_ACQUIRE);
}

/* ReadySet.take(n) into self->entries / self->heap: 0, or -1 when the keeper
   lapped the reader READY_READ_RETRIES times (*retries counts the torn reads),
   or TAKE_NOT_GRANTING, taking nothing, once the grant deadline has passed. */
#define TAKE_NOT_GRANTING (-2)
INTERNAL int take(ClaimPathObject *self, Py_ssize_t n, Taken *out, Py_ssize_t *retries);

/* ReadySet.pending: the slot not active holds the next set (published ahead). */
INTERNAL int next_pending(ClaimPathObject *self);

/* -- the grants (shm/_claim_grant.c) ------------------------------------------- */

/* Counters a claim returns, in this order (workers/claim/path.py reads them). */
enum {
    K_TAKEN, K_GONE, K_MOVED, K_NOT_DUE, K_LEASED, K_HELD, K_PARKED, K_DRAINED,
    K_LOW_WATER, K_LAST_COUNT, K_LAST_LEFT, K_RETRIES, K_SWITCHES, K_N
};

/* Grant the taken entries; -1 with an exception on an error (what was granted
   before it stays in `grants`). */
INTERNAL int grant_taken(ClaimPathObject *self, const Taken *t, GrantArgs *a, PyObject *grants,
                         PyObject *slow, long long *k);

/* -- rows handed in (shm/_claim_rows.c) ---------------------------------------- */

/* grant_taken with the rows from self->reader instead of SQLite. */
INTERNAL int grant_read(ClaimPathObject *self, const Taken *t, GrantArgs *a, PyObject *grants,
                        PyObject *slow, long long *k);

#endif
