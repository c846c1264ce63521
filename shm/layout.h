/* The shared-memory layouts the C modules read and write, defined once.
 *
 * Every offset, size and code shm/_atomic*.c and shm/_claim*.c use is in one
 * of the lists below, grouped by segment. An entry is
 *
 *     X(C name, Python name, value)
 *
 * where the Python name is the one shm/leases/protocol.py or shm/ready/layout.py gives it,
 * or, for a field of a struct the Python side has no constant for,
 * "STRUCT.field" (shm/layout.py works those out from the struct's format).
 * The lists make the C names (enum constants) and, through layout_export,
 * each module's dicts: LEASE_LAYOUT and READY_LAYOUT (the entries the Python
 * side names) and LEASE_STRUCTS and READY_STRUCTS (the "STRUCT.field" ones),
 * every entry by its Python name, with the value the module was built with.
 * shm/layout.py checks them against the Python side at import, so a build of
 * another layout is refused, never run. Change a layout here and in the
 * Python module together.
 *
 * Bits the Python side writes with literals (a state word's prev and copy
 * fields, a counter shard's journal, a grant record's slot, copy and seq) are
 * named below the lists; they are not exported.
 */

#ifndef QUEUE_NODE_LAYOUT_H
#define QUEUE_NODE_LAYOUT_H

#include <Python.h>
#include <stdint.h>
#include <string.h>

/* -- the lease table (shm/leases/) --------------------------------------------- */

/* The table's header and its counter shards. */
#define LEASE_TABLE_FIELDS(X)                                                   \
    X(SEALED, "SEALED", 36) /* u32: 1 once the owning node stopped granting */ \
    X(NEXT_LEASE_ID, "NEXT_LEASE_ID", 40)                                      \
    X(BACKOFFS, "BACKOFFS", 72)                                                \
    X(EARLIEST_EXPIRY, "EARLIEST_EXPIRY", 120) /* f64 bits: a lower bound */   \
    X(STATES, "STATES", 128)                   /* the state words, u64 each */ \
    X(SHARD_SIZE, "SHARD_SIZE", 64)                                            \
    X(SHARD_JOURNAL, "SHARD_JOURNAL", 56)                                      \
    X(COUNT_GRANTS, "COUNT_GRANTS", 1) /* count k of a shard is at 8 * k */    \
    X(COUNT_COMPLETED, "COUNT_COMPLETED", 2)                                   \
    X(COUNT_RELEASED, "COUNT_RELEASED", 3)                                     \
    X(COUNT_EXPIRED, "COUNT_EXPIRED", 4)                                       \
    X(COUNT_LATE_EXPIRED, "COUNT_LATE_EXPIRED", 5)                             \
    X(COUNT_LATE_RELEASED, "COUNT_LATE_RELEASED", 6)

/* A state word: code (bits 0-3), prev code (4-7), copy (8), owner (9-43),
   seq (44-63). */
#define LEASE_WORD_FIELDS(X)                                                              \
    X(EMPTY, "EMPTY", 0)                                                                  \
    X(FREE, "FREE", 1)                                                                    \
    X(CLAIMING, "CLAIMING", 2)                                                            \
    X(UPDATING, "UPDATING", 3)                                                            \
    X(IDLE, "IDLE", 4)                                                                    \
    X(LEASED, "LEASED", 5)                                                                \
    X(HELD, "HELD", 6)                                                                    \
    X(PARKED, "PARKED", 7)                                                                \
    X(KEYED, "KEYED", (1 << 3) | (1 << 4) | (1 << 5) | (1 << 6) | (1 << 7)) /* codes */ \
    X(REUSABLE, "REUSABLE", (1 << 0) | (1 << 1) | (1 << 4))                              \
    X(SEQ_SHIFT, "SEQ_SHIFT", 44)                                                         \
    X(SEQ_MASK, "SEQ_MASK", (1 << 20) - 1)

/* A slot: key_len (u16) and block (u32) at the start, the ticket, the key's
   first INLINE_KEY bytes, the two record copies. */
#define LEASE_SLOT_FIELDS(X)                          \
    X(SLOT_SIZE, "SLOT_SIZE", 512)                    \
    X(SLOT_KEY_LEN, "KEY_META.key_len", 0)            \
    X(SLOT_RESERVED, "KEY_META.reserved", 2)          \
    X(SLOT_BLOCK, "KEY_META.block", 4)                \
    X(TICKET_AT, "TICKET_AT", 8)                      \
    X(KEY_AT, "KEY_AT", 16)                           \
    X(INLINE_KEY, "INLINE_KEY", 208)                  \
    X(COPY_AT_0, "COPY_AT_0", 224)                    \
    X(COPY_AT_1, "COPY_AT_1", 368)                    \
    X(RECORD_SIZE, "RECORD_SIZE", 144)

/* A record copy ("<QdddddIBBBx32s48sQ"). */
#define LEASE_RECORD_FIELDS(X)                            \
    X(R_LEASE_ID, "RECORD.lease_id", 0)                   \
    X(R_GRANTED_AT, "RECORD.granted_at", 8)               \
    X(R_EXPIRES_AT, "EXPIRES_AT", 16)                     \
    X(R_HELD_UNTIL, "HELD_UNTIL", 24)                     \
    X(R_LEASE_S, "RECORD.lease_s", 32)                    \
    X(R_CADENCE_S, "RECORD.cadence_s", 40)                \
    X(R_MISSES, "RECORD.misses", 48)                      \
    X(R_ENDED, "RECORD.ended", 52)                        \
    X(R_CONSUMER_LEN, "RECORD.consumer_len", 53)          \
    X(R_CONSUMER, "RECORD.consumer", 56)                  \
    X(R_VERSION, "RECORD.version", 136)                   \
    X(CONSUMER_BYTES, "CONSUMER_BYTES", 32)

#define LEASE_LAYOUT(X)     \
    LEASE_TABLE_FIELDS(X)   \
    LEASE_WORD_FIELDS(X)    \
    LEASE_SLOT_FIELDS(X)    \
    LEASE_RECORD_FIELDS(X)

/* -- the ready set (shm/ready/) ------------------------------------------------ */

/* The segment's header, a slot's header (two slots from FIRST_SLOT, one the
   active set), an entry, a grant record. */
#define READY_LAYOUT_INT(X)                                                        \
    X(R_ACTIVE, "ACTIVE_OFFSET", 24) /* u64: active slot (low 32), generation */   \
    X(R_GENERATION, "GENERATION_OFFSET", 28) /* the futex word, in the above */    \
    X(R_LOW_WATER, "LOW_WATER_OFFSET", 40)                                         \
    X(R_GRANT_UNTIL, "GRANT_UNTIL_OFFSET", 48) /* u64: monotonic ns; 0: none */    \
    X(R_FIRST_SLOT, "FIRST_SLOT", 64)                                              \
    X(R_SLOT_HEADER, "SLOT_HEADER_SIZE", 64)                                       \
    X(R_SEQ, "SLOT.seq", 0)                                                        \
    X(R_COUNT, "SLOT.count", 4)                                                    \
    X(R_SLOT_GENERATION, "SLOT_GENERATION", 8)                                     \
    X(R_CURSOR, "CLAIM_CURSOR", 24)                                                \
    X(R_FLAGS, "SLOT.flags", 36)                                                   \
    X(R_FLAG_ASCII, "FLAG_ASCII", 1)                                               \
    X(R_ENTRY_SIZE, "ENTRY_SIZE", 32)                                              \
    X(E_KEY_OFFSET, "ENTRY.key_offset", 0)                                         \
    X(E_KEY_LEN, "ENTRY.key_len", 4)                                               \
    X(E_CLASS_ID, "ENTRY.class_id", 6)                                             \
    X(E_VERSION, "ENTRY.version", 8)                                               \
    X(E_DUE_MINUTE, "ENTRY.due_minute", 16)                                        \
    X(E_RANK, "ENTRY.rank", 24)                                                    \
    X(R_RECORD, "RECORD", 8) /* a grant record: lease slot + 1, copy, seq, tag */  \
    X(RECORD_TAG_SHIFT, "RECORD_TAG_SHIFT", 44)                                    \
    X(RECORD_TAG_MASK, "RECORD_TAG_MASK", (1 << 20) - 1)

/* Wider than an int (an enum constant): a static const. */
#define READY_LAYOUT_U64(X) X(CURSOR_INDEX, "CURSOR_INDEX", 0xFFFFFFFFULL) /* the cursor's index */

#define READY_LAYOUT(X)   \
    READY_LAYOUT_INT(X)   \
    READY_LAYOUT_U64(X)

/* -- the C names ------------------------------------------------------------------ */

#define LAYOUT_ENUM(c, py, value) c = (value),
#define LAYOUT_U64(c, py, value) static const uint64_t c = (value);
enum { LEASE_LAYOUT(LAYOUT_ENUM) };
enum { READY_LAYOUT_INT(LAYOUT_ENUM) };
READY_LAYOUT_U64(LAYOUT_U64)
#undef LAYOUT_ENUM
#undef LAYOUT_U64

static const Py_ssize_t COPY_AT[2] = {COPY_AT_0, COPY_AT_1};

/* Not exported: the Python side writes these with literals. */
#define WORD_PREV_SHIFT 4 /* a state word's prev code */
#define WORD_COPY_SHIFT 8 /* a state word's copy bit */
/* A counter shard's journal: counter k (bits 0-2), the slot (3-24), the
   published word's seq (25-44), the low 19 bits of the count it brings
   counter k to (45-63); shm/leases/slots.py _settle_shard reads it. */
#define JOURNAL_SLOT_SHIFT 3
#define JOURNAL_SEQ_SHIFT 25
#define JOURNAL_TARGET_SHIFT 45
/* A grant record (shm/ready/): lease slot + 1 (bits 0-22), the lease word's
   copy bit (23) and seq (24-43), the tag (RECORD_TAG_SHIFT on). */
#define GRANT_SLOT_MASK 0x7FFFFFULL
#define GRANT_COPY_SHIFT 23
#define GRANT_SEQ_SHIFT 24

/* -- the export -------------------------------------------------------------------- */

typedef struct {
    const char *name; /* the Python name */
    unsigned long long value;
} LayoutField;

/* The fields named with a dot ("RECORD.lease_id": dotted 1), or without
   (0), as a dict by Python name. */
static inline PyObject *
layout_dict(const LayoutField *fields, int dotted)
{
    PyObject *d = PyDict_New();
    for (; d != NULL && fields->name != NULL; fields++) {
        if ((strchr(fields->name, '.') != NULL) != dotted)
            continue;
        PyObject *v = PyLong_FromUnsignedLongLong(fields->value);
        if (v == NULL || PyDict_SetItemString(d, fields->name, v) < 0)
            Py_CLEAR(d);
        Py_XDECREF(v);
    }
    return d;
}

static inline int
layout_add(PyObject *m, const char *name, const LayoutField *fields, int dotted)
{
    PyObject *d = layout_dict(fields, dotted);
    int added = d == NULL ? -1 : PyModule_AddObjectRef(m, name, d);
    Py_XDECREF(d);
    return added;
}

/* Adds to module m every entry above, by its Python name, as this module was
   built with it: LEASE_LAYOUT and READY_LAYOUT the constants the Python side
   names, LEASE_STRUCTS and READY_STRUCTS the struct fields ("STRUCT.field").
   shm/layout.py checks them all. */
static inline int
layout_export(PyObject *m)
{
#define LAYOUT_ROW(c, py, value) {py, (unsigned long long)(c)},
    static const LayoutField lease[] = {LEASE_LAYOUT(LAYOUT_ROW){NULL, 0}};
    static const LayoutField ready[] = {READY_LAYOUT(LAYOUT_ROW){NULL, 0}};
#undef LAYOUT_ROW
    if (layout_add(m, "LEASE_LAYOUT", lease, 0) < 0 ||
        layout_add(m, "LEASE_STRUCTS", lease, 1) < 0 ||
        layout_add(m, "READY_LAYOUT", ready, 0) < 0)
        return -1;
    return layout_add(m, "READY_STRUCTS", ready, 1);
}

#endif
