/* shm._claim.ClaimPath: a whole claim in one call (workers/claim.py).
 *
 * The same steps as Claimer.claim's Python path, in the same order: take
 * entries from the ready set (shm/ready.py's take: the tagged claim cursor,
 * the slot's seqlock), raise the low-water flag when the set runs low, read
 * each entry's row by key (one read transaction per take; a run of keys in
 * one statement, their array in JSON), skip the entries
 * whose row is gone or unschedulable, whose version moved or that are not
 * due, and grant the rest (shm/_claim.c's lease_grant). A grant the C path
 * cannot make (a slot mid-change, a long key, a full first pass) is handed
 * back as a row for the Python grant; nothing taken is dropped silently.
 *
 * The rows are read through the very SQLite library Python's sqlite3 module
 * uses: its functions are looked up in the loaded _sqlite3 extension (and
 * what it links), never in another copy. Two copies of SQLite in one process
 * would not see each other's POSIX locks on the file ("How To Corrupt An
 * SQLite Database File", 2.2.1); so when the functions cannot be found there
 * (a static build that hides them), the constructor fails and the claimer
 * stays on its Python path.
 */

#include "_claim.h"

#include <dlfcn.h>
#include <limits.h>
#include <linux/futex.h>
#include <math.h>
#include <sched.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* -- the ready set's layout (shm/ready.py; both must change together) ---------- */

#define R_ACTIVE 24     /* the switch word: active slot (low 32), generation futex word */
#define R_GENERATION 28 /* the futex word, inside the switch word */
#define R_SLOT_GENERATION 8
#define R_LOW_WATER 40
#define R_FIRST_SLOT 64
#define R_SLOT_HEADER 64
#define R_ENTRY_SIZE 32
#define R_CURSOR 24
#define R_FLAG_ASCII 1
#define R_READ_RETRIES 1000
#define CURSOR_INDEX 0xFFFFFFFFULL
#define R_RECORD 8 /* a grant record: lease slot + 1, copy, seq, tag (ready.py) */
#define RECORD_TAG_MASK 0xFFFFFULL
#define LEASE_SEQ_SHIFT 44 /* a lease word's 20-bit seq (shm/leases.py SEQ_SHIFT) */

/* -- SQLite, from the library Python's sqlite3 loaded --------------------------- */

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

static struct {
    int loaded;
    int (*open_v2)(const char *, sqlite3 **, int, const char *);
    int (*close_v2)(sqlite3 *);
    int (*prepare_v2)(sqlite3 *, const char *, int, sqlite3_stmt **, const char **);
    int (*bind_text)(sqlite3_stmt *, int, const char *, int, void (*)(void *));
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
} sq;

/* Find SQLite's functions in `module` (the path of Python's _sqlite3
   extension, already loaded; NULL: the interpreter itself). */
static int
load_sqlite(const char *module)
{
    if (sq.loaded)
        return 0;
    void *h = dlopen(module, RTLD_NOW | RTLD_NOLOAD);
    if (h == NULL) {
        PyErr_Format(PyExc_ImportError, "ClaimPath: %s is not loaded: %s",
                     module ? module : "the interpreter", dlerror());
        return -1;
    }
#define FIND(field, name)                                                            \
    do {                                                                             \
        *(void **)(&sq.field) = dlsym(h, name);                                      \
        if (sq.field == NULL) {                                                      \
            PyErr_Format(PyExc_ImportError, "ClaimPath: no %s in %s", name,          \
                         module ? module : "the interpreter");                       \
            return -1;                                                               \
        }                                                                            \
    } while (0)
    FIND(open_v2, "sqlite3_open_v2");
    FIND(close_v2, "sqlite3_close_v2");
    FIND(prepare_v2, "sqlite3_prepare_v2");
    FIND(bind_text, "sqlite3_bind_text");
    FIND(step, "sqlite3_step");
    FIND(reset, "sqlite3_reset");
    FIND(finalize, "sqlite3_finalize");
    FIND(column_type, "sqlite3_column_type");
    FIND(column_int64, "sqlite3_column_int64");
    FIND(column_double, "sqlite3_column_double");
    FIND(column_text, "sqlite3_column_text");
    FIND(column_blob, "sqlite3_column_blob");
    FIND(column_bytes, "sqlite3_column_bytes");
    FIND(busy_timeout, "sqlite3_busy_timeout");
    FIND(errmsg, "sqlite3_errmsg");
    FIND(errcode, "sqlite3_errcode");
    FIND(exec, "sqlite3_exec");
    FIND(get_autocommit, "sqlite3_get_autocommit");
#undef FIND
    sq.loaded = 1; /* the handle stays open: the module never unloads */
    return 0;
}

/* The columns read, in this order. */
static const char ROW_SQL[] =
    "SELECT route, cadence_s, sitemap, due_at, payload, job, version FROM schedule WHERE key = ?1";
enum { C_ROUTE, C_CADENCE, C_SITEMAP, C_DUE_AT, C_PAYLOAD, C_JOB, C_VERSION };
/* A run of keys in one statement: ?1 is a JSON array of them, and each row
   comes with its key's index in the array (column 0), then the columns
   above. CROSS JOIN keeps the array the outer loop, so the rows come in the
   array's order and each seek reuses the open cursors: measured in Python's
   sqlite3 (64 keys a run, the claim bench's schedule), 0.54 µs a key of
   SQLite's time against about 1 µs for a statement a key in the C path's
   profile, most of the difference the statement's reset and its cursors
   opened and closed each time. */
static const char ROWS_SQL[] =
    "SELECT j.key, s.route, s.cadence_s, s.sitemap, s.due_at, s.payload, s.job, s.version"
    " FROM json_each(?1) AS j CROSS JOIN schedule AS s ON s.key = j.value";
/* Keys read one statement each below this many in a run. */
#define ROWS_BATCH_MIN 4

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
    /* the schedule */
    sqlite3 *db;
    sqlite3_stmt *stmt;
    sqlite3_stmt *rows_stmt; /* ROWS_SQL */
    char *json;              /* the run's keys as a JSON array (ROWS_SQL's ?1) */
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
} ClaimPathObject;

static void
path_close(ClaimPathObject *self)
{
    if (self->stmt) {
        sq.finalize(self->stmt);
        self->stmt = NULL;
    }
    if (self->rows_stmt) {
        sq.finalize(self->rows_stmt);
        self->rows_stmt = NULL;
    }
    PyMem_Free(self->json);
    self->json = NULL;
    self->json_cap = 0;
    if (self->db) {
        sq.close_v2(self->db);
        self->db = NULL;
    }
    if (self->ready_held) {
        PyBuffer_Release(&self->ready);
        self->ready_held = 0;
    }
    PyMem_Free(self->entries);
    PyMem_Free(self->heap);
    self->entries = self->heap = NULL;
    /* A closed path keeps nothing alive (the claimer's bound method would
       make a cycle the collector cannot see: this type is not tracked). */
    Py_CLEAR(self->granter);
    Py_CLEAR(self->grant_type);
    Py_CLEAR(self->decode_payload);
    Py_CLEAR(self->scan_once);
    Py_CLEAR(self->route_cadence);
    Py_CLEAR(self->cadence_of);
}

static PyObject *
path_close_method(ClaimPathObject *self, PyObject *Py_UNUSED(ignored))
{
    path_close(self);
    Py_RETURN_NONE;
}

/* In a child of fork: let go of the parent's connection without a call into
   SQLite (a close could checkpoint or unlock what the parent still uses). */
static PyObject *
path_abandon(ClaimPathObject *self, PyObject *Py_UNUSED(ignored))
{
    self->stmt = NULL;
    self->rows_stmt = NULL;
    self->db = NULL;
    path_close(self);
    Py_RETURN_NONE;
}

static void
path_dealloc(ClaimPathObject *self)
{
    path_close(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *RowError; /* (sqlite code, message) */

static void
set_row_error(ClaimPathObject *self)
{
    int code = sq.errcode(self->db);
    PyObject *v = Py_BuildValue("(is)", code, sq.errmsg(self->db));
    if (v != NULL) {
        PyErr_SetObject(RowError, v);
        Py_DECREF(v);
    }
}

static int
path_init(ClaimPathObject *self, PyObject *args, PyObject *kwds)
{
    PyObject *ready, *granter, *module, *grant_type, *decode_payload, *route_cadence,
        *cadence_of, *scan_once;
    const char *db_path;
    Py_ssize_t capacity, heap_size;
    int busy_ms, cache_kib;
    double low_water;
    static char *kwlist[] = {"ready", "capacity", "heap_size", "low_water", "granter",
                             "sqlite_module", "db_path", "busy_timeout_ms", "cache_kib",
                             "limits", "grant_type", "decode_payload", "route_cadence",
                             "cadence_of", "scan_once", NULL};
    PyObject *limits;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OnndO!OsiiOOOO!OO", kwlist, &ready, &capacity,
                                     &heap_size, &low_water, &GranterType, &granter, &module,
                                     &db_path, &busy_ms, &cache_kib, &limits, &grant_type,
                                     &decode_payload, &PyDict_Type, &route_cadence, &cadence_of,
                                     &scan_once))
        return -1;
    if (self->db || self->ready_held) {
        PyErr_SetString(PyExc_TypeError, "ClaimPath: already initialised");
        return -1;
    }
    if (!PyArg_ParseTuple(limits, "dddd", &self->min_cadence, &self->max_cadence,
                          &self->min_due, &self->max_due))
        return -1;
    if (!PyType_Check(grant_type) ||
        !PyType_IsSubtype((PyTypeObject *)grant_type, &PyTuple_Type) ||
        !PyCallable_Check(decode_payload) || !PyCallable_Check(cadence_of) ||
        !PyCallable_Check(scan_once)) {
        PyErr_SetString(PyExc_TypeError,
                        "ClaimPath: grant_type must be a tuple type, the others callables");
        return -1;
    }
    const char *module_path = NULL;
    if (module != Py_None) {
        module_path = PyUnicode_AsUTF8(module);
        if (module_path == NULL)
            return -1;
    }
    if (load_sqlite(module_path) < 0)
        return -1;
    if (capacity < 1 || heap_size < 1 || !(low_water >= 0 && low_water <= 1)) {
        PyErr_SetString(PyExc_ValueError, "ClaimPath: bad ready set figures");
        return -1;
    }
    if (PyObject_GetBuffer(ready, &self->ready, PyBUF_WRITABLE) < 0)
        return -1;
    self->ready_held = 1;
    self->ready_capacity = capacity;
    self->heap_size = heap_size;
    self->heap_at = R_SLOT_HEADER + R_ENTRY_SIZE * capacity;
    self->records_at = (R_SLOT_HEADER + R_ENTRY_SIZE * capacity + heap_size + 63) / 64 * 64;
    self->stride = (self->records_at + R_RECORD * capacity + 63) / 64 * 64;
    self->low_water_fraction = low_water;
    if (((uintptr_t)self->ready.buf) % 8 || R_FIRST_SLOT + 2 * self->stride > self->ready.len) {
        PyErr_SetString(PyExc_ValueError, "ClaimPath: the ready set does not fit its buffer");
        path_close(self);
        return -1;
    }
    self->entries = PyMem_Malloc(R_ENTRY_SIZE * capacity);
    self->heap = PyMem_Malloc(heap_size);
    if (self->entries == NULL || self->heap == NULL) {
        path_close(self);
        PyErr_NoMemory();
        return -1;
    }
    if (sq.open_v2(db_path, &self->db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_NOMUTEX, NULL) != SQLITE_OK) {
        if (self->db)
            set_row_error(self);
        else
            PyErr_NoMemory();
        path_close(self);
        return -1;
    }
    sq.busy_timeout(self->db, busy_ms);
    char pragma[64];
    snprintf(pragma, sizeof pragma, "PRAGMA cache_size = -%d", cache_kib);
    if (sq.exec(self->db, pragma, NULL, NULL, NULL) != SQLITE_OK ||
        sq.prepare_v2(self->db, ROW_SQL, -1, &self->stmt, NULL) != SQLITE_OK ||
        sq.prepare_v2(self->db, ROWS_SQL, -1, &self->rows_stmt, NULL) != SQLITE_OK) {
        set_row_error(self);
        path_close(self);
        return -1;
    }
    Py_INCREF(granter);
    self->granter = (GranterObject *)granter;
    Py_INCREF(grant_type);
    self->grant_type = grant_type;
    Py_INCREF(decode_payload);
    self->decode_payload = decode_payload;
    Py_INCREF(scan_once);
    self->scan_once = scan_once;
    Py_INCREF(route_cadence);
    self->route_cadence = route_cadence;
    Py_INCREF(cadence_of);
    self->cadence_of = cadence_of;
    return 0;
}

/* -- the take ------------------------------------------------------------------ */

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

/* The slot at base once the publish tagged `tag` finished: 1 with its count
   and flags, 0 when it has moved past that publish (ReadySet._settled). */
static int
settled(ClaimPathObject *self, const char *base, uint32_t tag, Py_ssize_t *count,
        uint32_t *flags)
{
    for (int i = 0; i < R_READ_RETRIES; i++) {
        uint32_t seq = ld32(base);
        uint32_t n;
        memcpy(&n, base + 4, 4);
        memcpy(flags, base + 36, 4);
        if (seq == tag) {
            *count = n < self->ready_capacity ? n : self->ready_capacity;
            return 1;
        }
        if (seq != (uint32_t)(tag - 1))
            return 0;
        sched_yield();
    }
    return 0;
}

/* Whether the slot at base holds a finished publish of generation gen. */
static int
finished_at(const char *base, uint64_t gen)
{
    uint32_t seq = ld32(base);
    uint64_t cursor = ld64(base + R_CURSOR), g;
    memcpy(&g, base + R_SLOT_GENERATION, 8);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return !(seq & 1) && (uint32_t)(cursor >> 32) == seq && g == gen && ld32(base) == seq;
}

/* ReadySet.pending: the slot not active holds the next set (published ahead). */
static int
next_pending(ClaimPathObject *self)
{
    char *buf = (char *)self->ready.buf;
    uint64_t word = ld64(buf + R_ACTIVE), gen;
    const char *active = buf + R_FIRST_SLOT + (word & 1) * self->stride;
    memcpy(&gen, active + R_SLOT_GENERATION, 8);
    return finished_at(buf + R_FIRST_SLOT + (1 - (word & 1)) * self->stride, gen + 1);
}

/* ReadySet._switch: the set `word` names is drained; switch to the other slot
   if it is pending, and wake the waiters. 1 when the active slot is no longer
   the one `word` names (whoever switched). */
static int
switch_to_next(ClaimPathObject *self, uint64_t word)
{
    char *buf = (char *)self->ready.buf;
    const char *active = buf + R_FIRST_SLOT + (word & 1) * self->stride;
    const char *other = buf + R_FIRST_SLOT + (1 - (word & 1)) * self->stride;
    uint64_t gen;
    memcpy(&gen, active + R_SLOT_GENERATION, 8);
    if (!finished_at(other, gen + 1))
        return ld64(buf + R_ACTIVE) != word;
    uint64_t want = (1 - (word & 1)) | ((gen + 1) & 0xFFFFFFFFULL) << 32;
    if (__atomic_compare_exchange_n((uint64_t *)(buf + R_ACTIVE), &word, want, 0,
                                    __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
        self->switches++;
        syscall(SYS_futex, (uint32_t *)(buf + R_GENERATION), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    }
    return 1;
}

/* ReadySet.take(n) into self->entries / self->heap: 0, or -1 when the keeper
   lapped the reader R_READ_RETRIES times (*retries counts the torn reads). */
static int
take(ClaimPathObject *self, Py_ssize_t n, Taken *out, Py_ssize_t *retries)
{
    char *buf = (char *)self->ready.buf;
    memset(out, 0, sizeof *out);
    for (int attempt = 0; attempt < R_READ_RETRIES; attempt++) {
        uint64_t word = ld64(buf + R_ACTIVE);
        char *base = buf + R_FIRST_SLOT + (word & 1) * self->stride;
        uint32_t seq = ld32(base), raw_count, flags;
        memcpy(&raw_count, base + 4, 4);
        uint64_t cursor = ld64(base + R_CURSOR);
        memcpy(&flags, base + 36, 4);
        Py_ssize_t count = raw_count < self->ready_capacity ? raw_count : self->ready_capacity;
        if ((seq & 1) || (uint32_t)(cursor >> 32) != seq) {
            /* mid-publish, or a header torn by one */
        }
        else if ((Py_ssize_t)(cursor & CURSOR_INDEX) >= count) {
            /* Drained: no add (claimers polling an empty set leave the cursor be). */
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            if (ld32(base) == seq) {
                if (switch_to_next(self, word))
                    continue; /* the next set is active now: take from it */
                out->last_count = count;
                out->last_left = 0;
                return 0;
            }
        }
        else {
            uint64_t old = __atomic_fetch_add((uint64_t *)(base + R_CURSOR), (uint64_t)n,
                                              __ATOMIC_SEQ_CST);
            int ok = 1;
            if ((uint32_t)(old >> 32) != seq) {
                /* Republished between the read and the add: the entries are the new set's. */
                seq = (uint32_t)(old >> 32);
                ok = settled(self, base, seq, &count, &flags);
            }
            if (ok) {
                Py_ssize_t start = (Py_ssize_t)(old & CURSOR_INDEX);
                Py_ssize_t end = start + n < count ? start + n : count;
                Py_ssize_t got = start < end ? end - start : 0;
                int sane = 1;
                if (got) {
                    memcpy(self->entries, base + R_SLOT_HEADER + R_ENTRY_SIZE * start,
                           R_ENTRY_SIZE * got);
                    uint32_t lo, last_off;
                    uint16_t last_len;
                    memcpy(&lo, self->entries, 4);
                    memcpy(&last_off, self->entries + R_ENTRY_SIZE * (got - 1), 4);
                    memcpy(&last_len, self->entries + R_ENTRY_SIZE * (got - 1) + 4, 2);
                    uint64_t hi = (uint64_t)last_off + last_len;
                    if (lo <= hi && hi <= (uint64_t)self->heap_size) {
                        memcpy(self->heap, base + self->heap_at + lo, hi - lo);
                        out->heap_lo = lo;
                    }
                    else
                        sane = 0;
                    /* Every entry's key must lie inside what was copied: the
                     * keys are read from self->heap by these offsets, and a
                     * torn or foreign set must never make them read past it. */
                    for (Py_ssize_t i = 0; sane && i < got; i++) {
                        uint32_t off;
                        uint16_t len;
                        memcpy(&off, self->entries + R_ENTRY_SIZE * i, 4);
                        memcpy(&len, self->entries + R_ENTRY_SIZE * i + 4, 2);
                        if (off < lo || (uint64_t)off + len > hi)
                            sane = 0;
                    }
                }
                __atomic_thread_fence(__ATOMIC_ACQUIRE);
                if (sane && ld32(base) == seq) {
                    out->count = got;
                    out->records = (uint64_t *)(base + self->records_at) + start;
                    out->tag = ((uint64_t)seq >> 1) & RECORD_TAG_MASK;
                    out->flags = flags;
                    out->last_count = count;
                    out->last_left = count - start - n > 0 ? count - start - n : 0;
                    return 0;
                }
            }
        }
        (*retries)++;
        sched_yield();
    }
    return -1;
}

/* -- rows ---------------------------------------------------------------------- */

/* A column as Python's sqlite3 gives it (TEXT must be UTF-8: NULL on error). */
static PyObject *
column_value(sqlite3_stmt *stmt, int i)
{
    switch (sq.column_type(stmt, i)) {
    case SQLITE_INTEGER:
        return PyLong_FromLongLong(sq.column_int64(stmt, i));
    case SQLITE_FLOAT:
        return PyFloat_FromDouble(sq.column_double(stmt, i));
    case SQLITE_TEXT: {
        const char *t = (const char *)sq.column_text(stmt, i);
        return PyUnicode_DecodeUTF8(t, sq.column_bytes(stmt, i), NULL);
    }
    case SQLITE_BLOB:
        return PyBytes_FromStringAndSize(sq.column_blob(stmt, i), sq.column_bytes(stmt, i));
    default:
        Py_RETURN_NONE;
    }
}

/* One row, checked as node.rows.stored_row_is_valid checks it. */
typedef struct {
    PyObject *route;   /* str */
    int has_cadence;
    long long cadence; /* when has_cadence */
    PyObject *due_at;  /* int or float, as stored */
    double due;
    PyObject *payload; /* the stored value, not decoded */
    PyObject *job;
    unsigned long long version;
} RowRead;

static void
row_clear(RowRead *r)
{
    Py_CLEAR(r->route);
    Py_CLEAR(r->due_at);
    Py_CLEAR(r->payload);
    Py_CLEAR(r->job);
}

/* The current row of `st`, its columns from `at` on in C_* order: 1 a valid
   row in *r, 0 one the keeper cannot schedule. */
static int
parse_row(ClaimPathObject *self, sqlite3_stmt *st, int at, RowRead *r)
{
    memset(r, 0, sizeof *r);
    int route_t = sq.column_type(st, at + C_ROUTE), cad_t = sq.column_type(st, at + C_CADENCE),
        site_t = sq.column_type(st, at + C_SITEMAP), due_t = sq.column_type(st, at + C_DUE_AT);
    if (route_t != SQLITE_TEXT || sq.column_bytes(st, at + C_ROUTE) == 0)
        return 0;
    if (cad_t == SQLITE_INTEGER) {
        r->cadence = sq.column_int64(st, at + C_CADENCE);
        if (!(r->cadence >= self->min_cadence && r->cadence <= self->max_cadence))
            return 0;
        r->has_cadence = 1;
    }
    else if (cad_t != SQLITE_NULL)
        return 0;
    if (site_t == SQLITE_INTEGER) {
        long long v = sq.column_int64(st, at + C_SITEMAP);
        if (v != 0 && v != 1)
            return 0;
    }
    else if (site_t == SQLITE_FLOAT) {
        double v = sq.column_double(st, at + C_SITEMAP);
        if (v != 0.0 && v != 1.0)
            return 0;
    }
    else
        return 0;
    if (due_t != SQLITE_INTEGER && due_t != SQLITE_FLOAT)
        return 0;
    r->due = sq.column_double(st, at + C_DUE_AT);
    if (!isfinite(r->due) || !(r->due >= self->min_due && r->due <= self->max_due))
        return 0;
    if (sq.column_type(st, at + C_VERSION) != SQLITE_INTEGER)
        return 0;
    r->version = (unsigned long long)sq.column_int64(st, at + C_VERSION);
    r->route = column_value(st, at + C_ROUTE);
    r->due_at = column_value(st, at + C_DUE_AT);
    r->payload = column_value(st, at + C_PAYLOAD);
    r->job = column_value(st, at + C_JOB);
    if (r->route == NULL || r->due_at == NULL || r->payload == NULL || r->job == NULL) {
        /* TEXT that is not UTF-8: a row nobody can schedule, not an error */
        PyErr_Clear();
        row_clear(r);
        return 0;
    }
    return 1;
}

/* One key's row, one statement: 1 a valid row in *r, 0 no row or one the
   keeper cannot schedule, -1 error. */
static int
read_row(ClaimPathObject *self, const char *key, Py_ssize_t key_len, RowRead *r)
{
    sqlite3_stmt *st = self->stmt;
    memset(r, 0, sizeof *r);
    if (sq.bind_text(st, 1, key, (int)key_len, NULL) != SQLITE_OK) {
        set_row_error(self);
        return -1;
    }
    int rc = sq.step(st);
    int valid = 0;
    if (rc == SQLITE_ROW)
        valid = parse_row(self, st, 0, r);
    else if (rc != SQLITE_DONE) {
        set_row_error(self);
        valid = -1;
    }
    sq.reset(st);
    return valid;
}

/* Append `key` to self->json as a JSON string (the array's brackets and
   commas are the caller's); -1 with MemoryError. */
static int
json_key(ClaimPathObject *self, Py_ssize_t *len, const char *key, Py_ssize_t key_len)
{
    Py_ssize_t need = *len + 6 * key_len + 4;
    if (need > self->json_cap) {
        Py_ssize_t cap = need * 2 > 4096 ? need * 2 : 4096;
        char *grown = PyMem_Realloc(self->json, cap);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->json = grown;
        self->json_cap = cap;
    }
    static const char hex[] = "0123456789abcdef";
    char *out = self->json + *len;
    *out++ = '"';
    for (Py_ssize_t i = 0; i < key_len; i++) {
        unsigned char c = (unsigned char)key[i];
        if (c == '"' || c == '\\') {
            *out++ = '\\';
            *out++ = (char)c;
        }
        else if (c < 0x20) {
            memcpy(out, "\\u00", 4);
            out[4] = hex[c >> 4];
            out[5] = hex[c & 15];
            out += 6;
        }
        else
            *out++ = (char)c; /* UTF-8 passes through */
    }
    *out++ = '"';
    *len = out - self->json;
    return 0;
}

/* The cadence a grant caps holds at: the row's, or its route's default. */
static int
cadence_for(ClaimPathObject *self, RowRead *r, double *out)
{
    if (r->has_cadence) {
        *out = (double)r->cadence;
        return 0;
    }
    PyObject *v = PyDict_GetItemWithError(self->route_cadence, r->route);
    if (v != NULL) {
        Py_INCREF(v);
    }
    else {
        if (PyErr_Occurred())
            return -1;
        v = PyObject_CallOneArg(self->cadence_of, r->route);
        if (v == NULL)
            return -1;
    }
    *out = PyFloat_AsDouble(v);
    Py_DECREF(v);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* -- the claim ----------------------------------------------------------------- */

/* Counters a claim returns, in this order (workers/claim.py reads them). */
enum {
    K_TAKEN, K_GONE, K_MOVED, K_NOT_DUE, K_LEASED, K_HELD, K_PARKED, K_DRAINED,
    K_LOW_WATER, K_LAST_COUNT, K_LAST_LEFT, K_RETRIES, K_SWITCHES, K_N
};

static Py_ssize_t
skip_ws(PyObject *s, Py_ssize_t i)
{
    Py_ssize_t n = PyUnicode_GET_LENGTH(s);
    int kind = PyUnicode_KIND(s);
    const void *data = PyUnicode_DATA(s);
    while (i < n) {
        Py_UCS4 c = PyUnicode_READ(kind, data, i);
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r')
            break;
        i++;
    }
    return i;
}

/* node.store.sqlite.decode_payload: JSON text parsed, anything that is not
   JSON as stored. For str, json.loads's steps without its Python frames: the
   C scanner between JSON whitespace; other values go to decode_payload. */
static PyObject *
decode(ClaimPathObject *self, PyObject *stored)
{
    if (stored == Py_None)
        Py_RETURN_NONE;
    if (!PyUnicode_CheckExact(stored))
        return PyObject_CallOneArg(self->decode_payload, stored);
    Py_ssize_t start = skip_ws(stored, 0);
    PyObject *idx = PyLong_FromSsize_t(start);
    if (idx == NULL)
        return NULL;
    PyObject *args[2] = {stored, idx};
    PyObject *got = PyObject_Vectorcall(self->scan_once, args, 2, NULL);
    Py_DECREF(idx);
    if (got == NULL) {
        if (PyErr_ExceptionMatches(PyExc_StopIteration) ||
            PyErr_ExceptionMatches(PyExc_ValueError)) {
            PyErr_Clear();
            return Py_NewRef(stored); /* not JSON: as stored */
        }
        return NULL;
    }
    PyObject *value = NULL;
    Py_ssize_t end;
    if (PyTuple_Check(got) && PyTuple_GET_SIZE(got) == 2 &&
        (end = PyLong_AsSsize_t(PyTuple_GET_ITEM(got, 1))) >= 0) {
        if (skip_ws(stored, end) == PyUnicode_GET_LENGTH(stored))
            value = Py_NewRef(PyTuple_GET_ITEM(got, 0));
        else
            value = Py_NewRef(stored); /* extra data after the value */
    }
    else if (!PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "scan_once answered something not (value, end)");
    Py_DECREF(got);
    return value;
}

static PyObject *
new_grant(ClaimPathObject *self, uint64_t lease_id, PyObject *key, RowRead *r, double expires,
          uint32_t misses)
{
    PyObject *payload = decode(self, r->payload);
    if (payload == NULL)
        return NULL;
    PyTypeObject *type = (PyTypeObject *)self->grant_type;
    PyObject *g = type->tp_alloc(type, 8);
    if (g == NULL) {
        Py_DECREF(payload);
        return NULL;
    }
    PyObject *items[8] = {
        PyLong_FromUnsignedLongLong(lease_id), key, payload, r->job, r->due_at,
        PyFloat_FromDouble(expires), r->route, PyLong_FromUnsignedLong(misses),
    };
    if (items[0] == NULL || items[5] == NULL || items[7] == NULL) {
        Py_XDECREF(items[0]);
        Py_XDECREF(items[5]);
        Py_XDECREF(items[7]);
        Py_DECREF(payload);
        Py_DECREF(g);
        return NULL;
    }
    Py_INCREF(key);
    Py_INCREF(r->job);
    Py_INCREF(r->due_at);
    Py_INCREF(r->route);
    for (int i = 0; i < 8; i++)
        PyTuple_SET_ITEM(g, i, items[i]); /* steals */
    return g;
}

/* A slow entry for the Python grant: (key, version, cadence_s, payload, job,
   due_at, route), the payload as stored. */
static PyObject *
slow_entry(PyObject *key, RowRead *r, double cadence)
{
    return Py_BuildValue("(OKdOOOO)", key, r->version, cadence, r->payload, r->job, r->due_at,
                         r->route);
}

static PyObject *
entry_key(const Taken *t, const char *heap, const char *entry)
{
    uint32_t off;
    uint16_t len;
    memcpy(&off, entry, 4);
    memcpy(&len, entry + 4, 2);
    const char *p = heap + (off - t->heap_lo);
    if (t->flags & R_FLAG_ASCII)
        return PyUnicode_DecodeASCII(p, len, NULL);
    return PyUnicode_DecodeUTF8(p, len, NULL);
}

/* Keys hashed and prefetched at a time (lease_prefetch): 64 slots' lines are
   about 45 KiB, in the L2 cache of anything this runs on. */
#define PREFETCH_RUN 64

/* What lease_refusal found for one entry of a run, kept for its grant. */
typedef struct {
    uint64_t h64;
    int looked;
    Py_ssize_t slot;
    uint64_t word;
    char record[144];
} Look;

/* Entry i's row has been read into *r (valid): grant it if it is still due
   at its published version. 0, or -1 with an exception. */
static int
grant_row(ClaimPathObject *self, const Taken *t, GrantArgs *a, Py_ssize_t i, RowRead *r,
          PyObject *grants, PyObject *slow, long long *k)
{
    const char *entry = self->entries + R_ENTRY_SIZE * i;
    uint64_t version;
    memcpy(&version, entry + 8, 8);
    if (r->version != version) {
        k[K_MOVED]++;
        return 0;
    }
    if (r->due > a->now) {
        k[K_NOT_DUE]++;
        return 0;
    }
    double cadence;
    if (cadence_for(self, r, &cadence) < 0)
        return -1;
    a->cadence_s = cadence;
    a->version = r->version;
    uint64_t lease_id = 0, word = 0;
    uint32_t misses = 0;
    Py_ssize_t slot = -1;
    int got = lease_grant(self->granter, a, &lease_id, &misses, &slot, &word);
    if (got == G_GRANTED && slot >= 0 && slot < (1 << 23) - 1)
        /* Tell the keeper where this key's lease is (ready.py's grant
           records): its next scan need not read the slot. */
        __atomic_store_n(&t->records[i],
                         (uint64_t)(slot + 1) | ((word >> 8) & 1) << 23 |
                             ((word >> LEASE_SEQ_SHIFT) & 0xFFFFF) << 24 | t->tag << 44,
                         __ATOMIC_RELEASE);
    if (got == G_SEALED) {
        /* The node stopped granting from this table: end the claim here
           (workers/claim.py answers NodeRestarted; what was granted before
           is handed back with the error, as for any error). */
        PyErr_SetString(PyExc_RuntimeError, "sealed");
        return -1;
    }
    if (got == G_NO_SHARD)
        got = G_SLOW; /* the Python grant gives this process its counter shard */
    if (got == G_GRANTED || got == G_SLOW) {
        PyObject *key_str = entry_key(t, self->heap, entry);
        if (key_str == NULL)
            return -1;
        PyObject *item, *out = grants;
        if (got == G_GRANTED)
            item = new_grant(self, lease_id, key_str, r, a->now + a->lease_s, misses);
        else {
            item = slow_entry(key_str, r, cadence);
            out = slow;
        }
        Py_DECREF(key_str);
        int rc = (item == NULL || PyList_Append(out, item) < 0) ? -1 : 0;
        Py_XDECREF(item);
        return rc;
    }
    if (got == G_LEASED)
        k[K_LEASED]++;
    else if (got == G_HELD)
        k[K_HELD]++;
    else if (got == G_PARKED)
        k[K_PARKED]++;
    else {
        PyErr_SetString(PyExc_RuntimeError, "lease table: a slot was taken while held");
        return -1;
    }
    return 0;
}

/* Entry i's key and what lease_refusal found for it, into a. */
static void
args_for(ClaimPathObject *self, const Taken *t, GrantArgs *a, Py_ssize_t i, const Look *look)
{
    const char *entry = self->entries + R_ENTRY_SIZE * i;
    uint32_t off;
    uint16_t len;
    memcpy(&off, entry, 4);
    memcpy(&len, entry + 4, 2);
    a->key = self->heap + (off - t->heap_lo);
    a->key_len = len;
    a->h64 = look->h64;
    a->hashed = 1;
    a->looked = look->looked;
    if (look->looked == 1) {
        a->slot = look->slot;
        a->word = look->word;
        memcpy(a->record, look->record, sizeof a->record);
    }
}

/* Grant a run of entries [lo, hi) (at most PREFETCH_RUN): refusals first,
   then the rows of the rest, in one statement when there are enough of
   them. 0, or -1 with an exception. */
static int
grant_run(ClaimPathObject *self, const Taken *t, GrantArgs *a, Py_ssize_t lo, Py_ssize_t hi,
          PyObject *grants, PyObject *slow, long long *k)
{
    Look looks[PREFETCH_RUN];
    Py_ssize_t need[PREFETCH_RUN], alone[PREFETCH_RUN]; /* entries whose row is read */
    int found[PREFETCH_RUN];
    int n = 0, n_alone = 0;
    /* Hash the run's keys and have their slots' lines fetched while the
       first are looked at. */
    for (Py_ssize_t i = lo; i < hi; i++) {
        const char *e = self->entries + R_ENTRY_SIZE * i;
        uint32_t o;
        uint16_t l;
        memcpy(&o, e, 4);
        memcpy(&l, e + 4, 2);
        looks[i - lo].h64 = lease_prefetch(self->granter, self->heap + (o - t->heap_lo), l);
    }
    /* A key the lease table refuses now costs no row read (a set published
       while claimers granted from the last one starts with some of those
       keys). */
    for (Py_ssize_t i = lo; i < hi; i++) {
        Look *look = &looks[i - lo];
        look->looked = 0;
        args_for(self, t, a, i, look);
        int refused = lease_refusal(self->granter, a);
        if (refused) {
            k[refused == G_LEASED ? K_LEASED : refused == G_HELD ? K_HELD : K_PARKED]++;
            continue;
        }
        look->looked = a->looked;
        look->slot = a->slot;
        look->word = a->word;
        if (a->looked == 1)
            memcpy(look->record, a->record, sizeof look->record);
        /* json_each gives a string holding \u0000 back cut short: such a
           key is read on its own. */
        if (memchr(a->key, 0, a->key_len) != NULL)
            alone[n_alone++] = i;
        else
            need[n++] = i;
    }
    if (n < ROWS_BATCH_MIN) { /* too few for a batch to pay: all on their own */
        memcpy(alone + n_alone, need, n * sizeof need[0]);
        n_alone += n;
        n = 0;
    }
    for (int j = 0; j < n_alone; j++) {
        Py_ssize_t i = alone[j];
        args_for(self, t, a, i, &looks[i - lo]);
        RowRead r;
        int got = read_row(self, a->key, a->key_len, &r);
        if (got < 0)
            return -1;
        if (!got) {
            k[K_GONE]++;
            continue;
        }
        int rc = grant_row(self, t, a, i, &r, grants, slow, k);
        row_clear(&r);
        if (rc < 0)
            return -1;
    }
    if (n == 0)
        return 0;
    Py_ssize_t len = 1;
    for (int j = 0; j < n; j++) {
        const char *e = self->entries + R_ENTRY_SIZE * need[j];
        uint32_t o;
        uint16_t l;
        memcpy(&o, e, 4);
        memcpy(&l, e + 4, 2);
        if (json_key(self, &len, self->heap + (o - t->heap_lo), l) < 0)
            return -1;
        self->json[len++] = j + 1 < n ? ',' : ']';
        found[j] = 0;
    }
    self->json[0] = '[';
    sqlite3_stmt *st = self->rows_stmt;
    if (sq.bind_text(st, 1, self->json, (int)len, NULL) != SQLITE_OK) {
        set_row_error(self);
        return -1;
    }
    int rc = 0;
    for (;;) {
        int step = sq.step(st);
        if (step == SQLITE_DONE)
            break;
        if (step != SQLITE_ROW) {
            set_row_error(self);
            rc = -1;
            break;
        }
        long long j = sq.column_int64(st, 0);
        if (j < 0 || j >= n || found[j])
            continue; /* not an index of the array, or a key twice in the schedule */
        found[j] = 1;
        RowRead r;
        if (!parse_row(self, st, 1, &r)) {
            k[K_GONE]++;
            continue;
        }
        Py_ssize_t i = need[j];
        args_for(self, t, a, i, &looks[i - lo]);
        rc = grant_row(self, t, a, i, &r, grants, slow, k);
        row_clear(&r);
        if (rc < 0)
            break;
    }
    sq.reset(st);
    if (rc == 0)
        for (int j = 0; j < n; j++)
            if (!found[j])
                k[K_GONE]++; /* no row */
    return rc;
}

/* Grant the taken entries; -1 with an exception on an error (what was granted
   before it stays in `grants`). */
static int
grant_taken(ClaimPathObject *self, const Taken *t, GrantArgs *a, PyObject *grants,
            PyObject *slow, long long *k)
{
    int in_txn = 0;
    if (t->count > 1) {
        if (sq.exec(self->db, "BEGIN", NULL, NULL, NULL) != SQLITE_OK) {
            set_row_error(self);
            return -1;
        }
        in_txn = 1;
    }
    int rc = 0;
    for (Py_ssize_t lo = 0; lo < t->count && rc == 0; lo += PREFETCH_RUN)
        rc = grant_run(self, t, a, lo, lo + PREFETCH_RUN < t->count ? lo + PREFETCH_RUN : t->count,
                       grants, slow, k);
    if (in_txn && !sq.get_autocommit(self->db))
        sq.exec(self->db, "COMMIT", NULL, NULL, NULL); /* a read: nothing to lose */
    return rc;
}

/* claim(max, holder, lease_s, now, owner, stop) -> (grants, slow, counters)
 *
 * As Claimer.claim: take up to `max` entries (again while the set, or the
 * next one it switches to, has more),
 * grant what is still due. counters: see K_* (taken, gone, moved, not_due,
 * leased, held, parked, drained, low_water raised, last_count, last_left,
 * retries, switches to a pending set). Raises RowError (sqlite code,
 * message) on a store error, RuntimeError("unstable") when the set would not
 * read steadily and RuntimeError("sealed") when the lease table is sealed;
 * leases granted before an error are in the exception's `grants` attribute,
 * so none is lost. */
static PyObject *
path_claim(ClaimPathObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "claim() takes 6 arguments (%zd given)", nargs);
        return NULL;
    }
    if (self->db == NULL || self->granter == NULL || !self->granter->held) {
        PyErr_SetString(PyExc_ValueError, "ClaimPath is closed");
        return NULL;
    }
    Py_ssize_t max_n = PyLong_AsSsize_t(args[0]);
    if (max_n == -1 && PyErr_Occurred())
        return NULL;
    if (!PyBytes_Check(args[1]) || PyBytes_GET_SIZE(args[1]) > 32) {
        PyErr_SetString(PyExc_TypeError, "claim(): holder must be at most 32 bytes");
        return NULL;
    }
    GrantArgs a;
    memset(&a, 0, sizeof a);
    a.holder = PyBytes_AS_STRING(args[1]);
    a.holder_len = PyBytes_GET_SIZE(args[1]);
    a.lease_s = PyFloat_AsDouble(args[2]);
    a.now = PyFloat_AsDouble(args[3]);
    a.owner = PyLong_AsUnsignedLongLong(args[4]);
    a.stop = (int)PyLong_AsLong(args[5]);
    if (PyErr_Occurred())
        return NULL;
    if (max_n < 1 || !(a.lease_s > 0)) {
        PyErr_SetString(PyExc_ValueError, "claim(): max or lease_s out of range");
        return NULL;
    }
    long long k[K_N] = {0};
    PyObject *grants = PyList_New(0), *slow = PyList_New(0);
    if (grants == NULL || slow == NULL)
        goto fail;
    char *ready = (char *)self->ready.buf;
    Py_ssize_t switches = self->switches;
    while (PyList_GET_SIZE(grants) + PyList_GET_SIZE(slow) < max_n) {
        Py_ssize_t want = max_n - PyList_GET_SIZE(grants) - PyList_GET_SIZE(slow);
        if (want > self->ready_capacity)
            want = self->ready_capacity;
        Taken t;
        Py_ssize_t retries = 0;
        int unstable = take(self, want, &t, &retries);
        k[K_RETRIES] += retries;
        if (unstable) {
            PyErr_SetString(PyExc_RuntimeError, "unstable");
            goto fail;
        }
        k[K_LAST_COUNT] = t.last_count;
        k[K_LAST_LEFT] = t.last_left;
        /* Taken past the low-water mark with no next set pending: ask for it. */
        if (t.last_left < t.last_count * self->low_water_fraction &&
            ld64(ready + R_LOW_WATER) == 0 && !next_pending(self) &&
            __atomic_compare_exchange_n((uint64_t *)(ready + R_LOW_WATER), &(uint64_t){0}, 1,
                                        0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            k[K_LOW_WATER]++;
        if (t.count == 0) {
            k[K_DRAINED]++;
            break;
        }
        k[K_TAKEN] += t.count;
        if (grant_taken(self, &t, &a, grants, slow, k) < 0)
            goto fail;
        /* Fewer than `want`: the set ran out under us. Take again: the next
           set may be pending (take switches to it), or nothing is left. */
    }
    k[K_SWITCHES] = self->switches - switches;
    PyObject *counters = PyTuple_New(K_N);
    if (counters == NULL)
        goto fail;
    for (int i = 0; i < K_N; i++) {
        PyObject *v = PyLong_FromLongLong(k[i]);
        if (v == NULL) {
            Py_DECREF(counters);
            goto fail;
        }
        PyTuple_SET_ITEM(counters, i, v);
    }
    return Py_BuildValue("(NNN)", grants, slow, counters);
fail:
    /* Hand back what was granted with the error: those leases are live. */
    if (grants != NULL && PyErr_Occurred()) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (value != NULL) {
            PyObject_SetAttrString(value, "grants", grants);
            PyObject_SetAttrString(value, "slow", slow ? slow : Py_None);
        }
        PyErr_Restore(type, value, tb);
    }
    Py_XDECREF(grants);
    Py_XDECREF(slow);
    return NULL;
}

static PyMethodDef path_methods[] = {
    {"claim", (PyCFunction)(void (*)(void))path_claim, METH_FASTCALL,
     "claim(max, holder, lease_s, now, owner, stop) -> (grants, slow, counters)"},
    {"close", (PyCFunction)path_close_method, METH_NOARGS,
     "close(): the SQLite connection and the ready set's buffer"},
    {"abandon", (PyCFunction)path_abandon, METH_NOARGS,
     "abandon(): in a child of fork, drop the parent's connection unclosed"},
    {NULL, NULL, 0, NULL},
};

PyTypeObject ClaimPathType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shm._claim.ClaimPath",
    .tp_basicsize = sizeof(ClaimPathObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "ClaimPath(ready, capacity, heap_size, low_water, granter, sqlite_module, db_path,"
              " busy_timeout_ms, cache_kib, limits, grant_type, decode_payload, route_cadence,"
              " cadence_of)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)path_init,
    .tp_dealloc = (destructor)path_dealloc,
    .tp_methods = path_methods,
};

int
claim_path_add(PyObject *m)
{
    RowError = PyErr_NewException("shm._claim.RowError", NULL, NULL);
    if (RowError == NULL || PyModule_AddObjectRef(m, "RowError", RowError) < 0)
        return -1;
    if (PyType_Ready(&ClaimPathType) < 0)
        return -1;
    /* The ready set's offsets this file reads, by the names shm/ready.py
     * gives them: ready.py checks them at import (a build of another layout
     * is refused, never run). */
    PyObject *layout = Py_BuildValue(
        "{sisisisisisisisi}", "ACTIVE_OFFSET", R_ACTIVE, "GENERATION_OFFSET", R_GENERATION,
        "SLOT_GENERATION", R_SLOT_GENERATION, "LOW_WATER_OFFSET", R_LOW_WATER, "FIRST_SLOT",
        R_FIRST_SLOT, "SLOT_HEADER_SIZE", R_SLOT_HEADER, "ENTRY_SIZE", R_ENTRY_SIZE,
        "CLAIM_CURSOR", R_CURSOR);
    if (layout == NULL)
        return -1;
    int added = PyModule_AddObjectRef(m, "READY_LAYOUT", layout);
    Py_DECREF(layout);
    if (added < 0)
        return -1;
    return PyModule_AddObjectRef(m, "ClaimPath", (PyObject *)&ClaimPathType);
}
