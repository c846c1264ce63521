/* shm._claim: the claim path's hot loop in C, for shm/leases.py.
 *
 * A grant in Python costs 7-25 us (a dozen calls into shm._atomic, struct
 * packing, blake2b through hashlib); here it is one call. `Granter.grant` is
 * the lease table's grant for the common cases, the same protocol step for
 * step as LeaseTable.grant in shm/leases.py (read that docstring first: the
 * state word, the two record copies, the insert's ticket):
 *
 *   - the key's slot is found (IDLE, or HELD past its hold): take it
 *     (UPDATING, this process's pid and tag), write the inactive record copy,
 *     publish LEASED on it;
 *   - it is LEASED, HELD or PARKED: refuse, changing nothing;
 *   - the key has no slot and is short (at most 208 bytes, no overflow
 *     block): claim a free slot, write the key, raise maxdist, make it keyed
 *     (a full barrier), draw the ticket, probe for another slot with the same
 *     key, publish LEASED or back off.
 *
 * After it takes a slot (the swap to CLAIMING or UPDATING, a full barrier)
 * it reads the table's seal; sealed, it puts the slot's word back as it
 * found it and answers SEALED. The grant is counted by the publish itself
 * (lease_publish_counted in shm/_claim.h: this process's counter shard and
 * its journal), never by a separate add a kill could split from it.
 *
 * Everything else answers SLOW and the caller runs the Python grant, which
 * knows every case: a slot another process holds mid-change (alive: BUSY;
 * dead: roll it back), a slot that would not read steadily, a long key, a
 * table with no free slot on a first pass (the Python path reclaims slots of
 * dead processes, looks again, and counts a refusal), a race it kept losing.
 * Backing off more often than the Python path would is safe: an insert that
 * backs off leases nothing.
 *
 * `blake2b64(data)` is hashlib.blake2b(data, digest_size=8) read as a
 * little-endian integer (RFC 7693), the lease table's key hash, without the
 * hashlib object.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_claim.h"

/* -- BLAKE2b, digest 8 bytes, no key (RFC 7693) ---------------------------------- */

static const uint64_t B2_IV[8] = {
    0x6A09E667F3BCC908ULL, 0xBB67AE8584CAA73BULL, 0x3C6EF372FE94F82BULL, 0xA54FF53A5F1D36F1ULL,
    0x510E527FADE682D1ULL, 0x9B05688C2B3E6C1FULL, 0x1F83D9ABFB41BD6BULL, 0x5BE0CD19137E2179ULL,
};

static const uint8_t B2_SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t
rotr64(uint64_t x, int n)
{
    return (x >> n) | (x << (64 - n));
}

static inline uint64_t
le64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8); /* x86_64 and aarch64 Linux are little-endian */
    return v;
}

#define B2_G(a, b, c, d, x, y)       \
    do {                             \
        a = a + b + (x);             \
        d = rotr64(d ^ a, 32);       \
        c = c + d;                   \
        b = rotr64(b ^ c, 24);       \
        a = a + b + (y);             \
        d = rotr64(d ^ a, 16);       \
        c = c + d;                   \
        b = rotr64(b ^ c, 63);       \
    } while (0)

static void
b2_compress(uint64_t h[8], const uint8_t block[128], uint64_t t, int last)
{
    uint64_t v[16], m[16];
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = B2_IV[i];
    }
    v[12] ^= t;
    if (last)
        v[14] = ~v[14];
    for (int i = 0; i < 16; i++)
        m[i] = le64(block + 8 * i);
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = B2_SIGMA[r];
        B2_G(v[0], v[4], v[8], v[12], m[s[0]], m[s[1]]);
        B2_G(v[1], v[5], v[9], v[13], m[s[2]], m[s[3]]);
        B2_G(v[2], v[6], v[10], v[14], m[s[4]], m[s[5]]);
        B2_G(v[3], v[7], v[11], v[15], m[s[6]], m[s[7]]);
        B2_G(v[0], v[5], v[10], v[15], m[s[8]], m[s[9]]);
        B2_G(v[1], v[6], v[11], v[12], m[s[10]], m[s[11]]);
        B2_G(v[2], v[7], v[8], v[13], m[s[12]], m[s[13]]);
        B2_G(v[3], v[4], v[9], v[14], m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++)
        h[i] ^= v[i] ^ v[i + 8];
}

/* The first 8 bytes of BLAKE2b-64(data), little-endian: hashlib's digest as
   int.from_bytes(..., "little"). */
uint64_t
blake2b64(const uint8_t *data, size_t len)
{
    uint64_t h[8];
    memcpy(h, B2_IV, sizeof h);
    h[0] ^= 0x01010000ULL ^ 8; /* depth 1, fanout 1, no key, 8-byte digest */
    uint64_t t = 0;
    while (len > 128) {
        t += 128;
        b2_compress(h, data, t, 0);
        data += 128;
        len -= 128;
    }
    uint8_t last[128] = {0};
    memcpy(last, data, len);
    t += len;
    b2_compress(h, last, t, 1);
    return h[0];
}

static PyObject *
claim_blake2b64(PyObject *Py_UNUSED(module), PyObject *arg)
{
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0)
        return NULL;
    uint64_t h = blake2b64((const uint8_t *)b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

/* -- the lease table's layout (shm/leases.py; both must change together) ------- */

enum { EMPTY, FREE, CLAIMING, UPDATING, IDLE, LEASED, HELD, PARKED };
#define KEYED ((1u << UPDATING) | (1u << IDLE) | (1u << LEASED) | (1u << HELD) | (1u << PARKED))
#define REUSABLE ((1u << EMPTY) | (1u << FREE) | (1u << IDLE))
#define SEQ_SHIFT 44
#define SEQ_MASK ((1ULL << 20) - 1)

#define NEXT_LEASE_ID 40
#define BACKOFFS 72
#define EARLIEST_EXPIRY 120 /* shm/leases.py: a lower bound on every live lease's expiry */
#define STATES 128
#define SLOT_SIZE 512
#define TICKET_AT 8
#define KEY_AT 16
#define INLINE_KEY 208
#define RECORD_SIZE 144
static const Py_ssize_t COPY_AT[2] = {224, 368};

/* Offsets inside a record ("<QdddddIBBBx32s48sQ"). */
#define R_LEASE_ID 0
#define R_GRANTED_AT 8
#define R_EXPIRES_AT 16
#define R_HELD_UNTIL 24
#define R_LEASE_S 32
#define R_CADENCE_S 40
#define R_MISSES 48
#define R_ENDED 52
#define R_CONSUMER_LEN 53
#define R_CONSUMER 56
#define R_VERSION 136
#define CONSUMER_BYTES 32

#define READ_RETRIES 100
#define INSERT_RETRIES 4


static inline uint64_t *
state_at(GranterObject *g, Py_ssize_t idx)
{
    return (uint64_t *)(g->buf + STATES + 8 * idx);
}

static inline char *
slot_at(GranterObject *g, Py_ssize_t idx)
{
    return g->buf + g->slots + SLOT_SIZE * idx;
}

static inline uint64_t
next_word(uint64_t w, uint64_t code, uint64_t copy, uint64_t prev, uint64_t owner)
{
    return code | prev << 4 | copy << 8 | owner | (((w >> SEQ_SHIFT) + 1) & SEQ_MASK) << SEQ_SHIFT;
}

/* Whether the table is sealed. Read after the swap that took a slot: that
   swap is a full barrier, and a seq_cst load is a plain load on x86_64 (and
   an ordered one on aarch64, where a relaxed load could pass the swap's
   store). */
static inline int
sealed(GranterObject *g)
{
    return __atomic_load_n((uint32_t *)(g->buf + SEALED), __ATOMIC_SEQ_CST) != 0;
}

static inline int
cas(uint64_t *p, uint64_t old, uint64_t new)
{
    if (!__atomic_compare_exchange_n(p, &old, new, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        return 0;
    /* A take is followed by the holder's record writes: under C11 they must
     * not be seen before the take (docs/shm.md, "Memory ordering"). Free on
     * x86; on ARMv8 it orders the plain stores after the swap. */
    __atomic_thread_fence(__ATOMIC_RELEASE);
    return 1;
}

static inline uint64_t
bump(GranterObject *g, Py_ssize_t off, uint64_t by)
{
    return __atomic_fetch_add((uint64_t *)(g->buf + off), by, __ATOMIC_SEQ_CST);
}

/* After a lease is published LEASED: lower the table's next-expiry hint (an
   f64's bits; positive doubles order as their bits) to its expiry, as
   LeaseTable._lower_expiry does. 0 (unknown) stays 0. */
static void
lower_expiry(GranterObject *g, double expires_at)
{
    uint64_t bits, *hint = (uint64_t *)(g->buf + EARLIEST_EXPIRY);
    memcpy(&bits, &expires_at, 8);
    uint64_t cur = __atomic_load_n(hint, __ATOMIC_SEQ_CST);
    while (bits < cur &&
           !__atomic_compare_exchange_n(hint, &cur, bits, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        ;
}

static int
granter_init(GranterObject *self, PyObject *args, PyObject *kwds)
{
    PyObject *obj;
    Py_ssize_t capacity, hashes, maxdist, owners, slots, blocks, long_blocks, size;
    static char *kwlist[] = {"buffer", "capacity", "hashes", "maxdist", "owners",
                             "slots", "blocks", "long_blocks", "size", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Onnnnnnnn", kwlist, &obj, &capacity, &hashes,
                                     &maxdist, &owners, &slots, &blocks, &long_blocks, &size))
        return -1;
    if (self->held) {
        PyBuffer_Release(&self->view);
        self->held = 0;
    }
    if (capacity <= 0 || (capacity & (capacity - 1)) || long_blocks < 0) {
        PyErr_SetString(PyExc_ValueError, "Granter: capacity must be a power of two");
        return -1;
    }
    if (PyObject_GetBuffer(obj, &self->view, PyBUF_WRITABLE) < 0)
        return -1;
    self->held = 1;
    /* The layout must be the one shm/leases.py computes, inside the buffer. */
    if (((uintptr_t)self->view.buf) % 8 || size > self->view.len ||
        hashes != STATES + 8 * capacity || maxdist != hashes + 8 * capacity ||
        owners < maxdist + 4 * capacity || slots < owners + 8 * long_blocks || slots % 8 ||
        blocks != slots + SLOT_SIZE * capacity || blocks > size) {
        PyBuffer_Release(&self->view);
        self->held = 0;
        PyErr_SetString(PyExc_ValueError, "Granter: the layout does not fit the buffer");
        return -1;
    }
    self->buf = (char *)self->view.buf;
    self->capacity = capacity;
    self->hashes = hashes;
    self->maxdist = maxdist;
    self->owners = owners;
    self->slots = slots;
    self->long_blocks = long_blocks;
    self->shard = NULL;
    self->shard_owner = 0;
    return 0;
}

static void
granter_dealloc(GranterObject *self)
{
    if (self->held)
        PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
granter_release(GranterObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->held) {
        PyBuffer_Release(&self->view);
        self->held = 0;
    }
    self->shard = NULL;
    self->shard_owner = 0;
    Py_RETURN_NONE;
}

/* set_shard(off, owner): grants by `owner` count in the 64-byte counter
   shard at `off` (LeaseTable._shard acquired it for that owner). */
static PyObject *
granter_set_shard(GranterObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "set_shard() takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!self->held) {
        PyErr_SetString(PyExc_ValueError, "Granter is released");
        return NULL;
    }
    Py_ssize_t off = PyLong_AsSsize_t(args[0]);
    unsigned long long owner = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    if (off < 0 || off % 64 || off > self->view.len - 64 || owner == 0) {
        PyErr_SetString(PyExc_ValueError, "set_shard(): not a shard inside the buffer");
        return NULL;
    }
    self->shard = self->buf + off;
    self->shard_owner = owner;
    Py_RETURN_NONE;
}

/* Whether keyed slot idx holds `key` right now, read under its word w (the
   caller re-checks the word after). Inline keys only: a longer slot key can
   never equal a key this path handles. */
static inline int
slot_has_key(GranterObject *g, Py_ssize_t idx, const char *key, Py_ssize_t key_len)
{
    const char *slot = slot_at(g, idx);
    uint16_t len;
    memcpy(&len, slot, 2);
    return len == key_len && memcmp(slot + KEY_AT, key, key_len) == 0;
}

/* Look the key up: 1 found (*idx, *word, the current record copied into rec),
   0 not found, -1 slow (a slot kept changing under the reader). */
static int
lookup(GranterObject *g, const char *key, Py_ssize_t key_len, uint64_t h64, Py_ssize_t *out_idx,
       uint64_t *out_w, char rec[RECORD_SIZE])
{
    Py_ssize_t mask = g->capacity - 1, home = (Py_ssize_t)(h64 & (uint64_t)mask);
    uint32_t *maxdist = (uint32_t *)(g->buf + g->maxdist);
    uint64_t *hashes = (uint64_t *)(g->buf + g->hashes);
    Py_ssize_t span = (Py_ssize_t)__atomic_load_n(&maxdist[home], __ATOMIC_ACQUIRE) + 1;
    if (span > g->capacity)
        span = g->capacity;
    for (Py_ssize_t i = 0; i < span; i++) {
        Py_ssize_t idx = (home + i) & mask;
        uint64_t *state = state_at(g, idx);
        uint64_t w = __atomic_load_n(state, __ATOMIC_ACQUIRE);
        if (!((KEYED >> (w & 15)) & 1) || __atomic_load_n(&hashes[idx], __ATOMIC_ACQUIRE) != h64)
            continue;
        int tries = 0;
        for (;;) {
            int same = slot_has_key(g, idx, key, key_len);
            if (same)
                memcpy(rec, slot_at(g, idx) + COPY_AT[(w >> 8) & 1], RECORD_SIZE);
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            uint64_t again = __atomic_load_n(state, __ATOMIC_ACQUIRE);
            if (again == w) {
                if (!same)
                    break;
                *out_idx = idx;
                *out_w = w;
                return 1;
            }
            if (++tries >= READ_RETRIES)
                return -1;
            w = again;
            if (!((KEYED >> (w & 15)) & 1))
                break;
        }
    }
    return 0;
}

/* Whether another keyed slot holds `key` settled, or in an insert that is not
   behind this one (a lower ticket, or none drawn yet). A slot that will not
   read steadily counts as ahead: backing off is always safe. */
static int
placed_before(GranterObject *g, const char *key, Py_ssize_t key_len, uint64_t h64,
              Py_ssize_t home, Py_ssize_t mine, uint64_t ticket)
{
    Py_ssize_t mask = g->capacity - 1;
    uint32_t *maxdist = (uint32_t *)(g->buf + g->maxdist);
    uint64_t *hashes = (uint64_t *)(g->buf + g->hashes);
    Py_ssize_t span = (Py_ssize_t)__atomic_load_n(&maxdist[home], __ATOMIC_SEQ_CST) + 1;
    if (span > g->capacity)
        span = g->capacity;
    for (Py_ssize_t i = 0; i < span; i++) {
        Py_ssize_t idx = (home + i) & mask;
        if (idx == mine)
            continue;
        uint64_t *state = state_at(g, idx);
        uint64_t w = __atomic_load_n(state, __ATOMIC_SEQ_CST);
        if (!((KEYED >> (w & 15)) & 1) || __atomic_load_n(&hashes[idx], __ATOMIC_SEQ_CST) != h64)
            continue;
        int same = slot_has_key(g, idx, key, key_len);
        uint64_t theirs =
            __atomic_load_n((uint64_t *)(slot_at(g, idx) + TICKET_AT), __ATOMIC_SEQ_CST);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(state, __ATOMIC_SEQ_CST) != w)
            return 1;
        if (!same)
            continue;
        if ((w & 15) != UPDATING || ((w >> 4) & 15) != FREE)
            return 1; /* settled: the key is placed */
        if (theirs == 0 || theirs < ticket)
            return 1;
    }
    return 0;
}

static void
write_lease(char *rec, uint64_t lease_id, const GrantArgs *a)
{
    double expires = a->now + a->lease_s;
    memcpy(rec + R_LEASE_ID, &lease_id, 8);
    memcpy(rec + R_GRANTED_AT, &a->now, 8);
    memcpy(rec + R_EXPIRES_AT, &expires, 8);
    memcpy(rec + R_LEASE_S, &a->lease_s, 8);
    memcpy(rec + R_CADENCE_S, &a->cadence_s, 8);
    rec[R_ENDED] = 0; /* Ended.LIVE */
    rec[R_CONSUMER_LEN] = (char)a->holder_len;
    memset(rec + R_CONSUMER, 0, CONSUMER_BYTES);
    memcpy(rec + R_CONSUMER, a->holder, a->holder_len);
    memcpy(rec + R_VERSION, &a->version, 8);
}

/* The existing slot's grant: G_GRANTED with *lease_id and *misses, a refusal,
   G_SLOW, G_SEALED, G_TAKEN_OVER, or G_AGAIN (the slot changed under us: look
   again). */
static int
grant_existing(GranterObject *g, Py_ssize_t idx, uint64_t w, char rec[RECORD_SIZE],
               const GrantArgs *a, uint64_t *lease_id, uint32_t *misses, uint64_t *word)
{
    uint64_t code = w & 15;
    double held_until;
    memcpy(&held_until, rec + R_HELD_UNTIL, 8);
    if (code == UPDATING)
        return G_SLOW; /* alive: BUSY; dead: roll it back. Python decides. */
    if (code == LEASED)
        return G_LEASED;
    if (code == PARKED)
        return G_PARKED;
    if (code == HELD && held_until > a->now)
        return G_HELD;
    /* IDLE, or a hold that has passed: take it (as LeaseTable._take). */
    uint64_t *state = state_at(g, idx);
    uint64_t own = UPDATING | (w & 15) << 4 | (w & 0x100) | a->owner |
                   (((w >> SEQ_SHIFT) + 1) & SEQ_MASK) << SEQ_SHIFT;
    if (!cas(state, w, own))
        return G_AGAIN;
    LEASE_STOP(a->stop, P_UPDATE);
    if (sealed(g)) /* put back the very word: nothing was written */
        return cas(state, own, w) ? G_SEALED : G_TAKEN_OVER;
    *lease_id = bump(g, NEXT_LEASE_ID, 1) + 1;
    uint64_t copy = 1 - ((own >> 8) & 1);
    write_lease(rec, *lease_id, a);
    memcpy(slot_at(g, idx) + COPY_AT[copy], rec, RECORD_SIZE);
    LEASE_STOP(a->stop, P_WRITTEN);
    uint64_t leased = LEASED | copy << 8 | (((own >> SEQ_SHIFT) + 1) & SEQ_MASK) << SEQ_SHIFT;
    if (!lease_publish_counted(state, idx, own, leased, g->shard, COUNT_GRANTS, a->stop))
        return G_TAKEN_OVER;
    *word = leased;
    lower_expiry(g, a->now + a->lease_s);
    memcpy(misses, rec + R_MISSES, 4);
    return G_GRANTED;
}

/* Hold (CLAIMING) the first reusable slot from home: 1 with *idx, *was (its
   word before) and *own, or 0 when one pass over the table found none. */
static int
claim_free(GranterObject *g, Py_ssize_t home, uint64_t owner, Py_ssize_t *out_idx,
           uint64_t *out_was, uint64_t *out_own)
{
    Py_ssize_t mask = g->capacity - 1;
    for (Py_ssize_t i = 0; i < g->capacity; i++) {
        Py_ssize_t idx = (home + i) & mask;
        uint64_t *state = state_at(g, idx);
        uint64_t w = __atomic_load_n(state, __ATOMIC_ACQUIRE);
        if (!((REUSABLE >> (w & 15)) & 1))
            continue;
        uint64_t own = next_word(w, CLAIMING, (w >> 8) & 1, 0, owner);
        if (cas(state, w, own)) {
            *out_idx = idx;
            *out_was = w;
            *out_own = own;
            return 1;
        }
    }
    return 0;
}

/* Free the overflow blocks a slot's last key (or a dead insert) left, as
   LeaseTable._write_key does before it writes a key. */
static void
free_blocks(GranterObject *g, Py_ssize_t idx, uint64_t was)
{
    uint64_t *owners = (uint64_t *)(g->buf + g->owners);
    if ((was & 15) == IDLE) {
        uint32_t block;
        memcpy(&block, slot_at(g, idx) + 4, 4);
        if (block && block <= (uint64_t)g->long_blocks)
            cas(&owners[block - 1], (uint64_t)idx + 1, 0);
    }
    else if ((was & 15) == FREE) {
        for (Py_ssize_t j = 0; j < g->long_blocks; j++)
            if (__atomic_load_n(&owners[j], __ATOMIC_ACQUIRE) == (uint64_t)idx + 1)
                cas(&owners[j], (uint64_t)idx + 1, 0);
    }
}

/* The new key's insert: G_GRANTED with *lease_id (the ticket), G_AGAIN when
   it backed off (look again), G_SLOW, G_SEALED or G_TAKEN_OVER. */
static int
insert(GranterObject *g, uint64_t h64, const GrantArgs *a, uint64_t *lease_id,
       Py_ssize_t *slot_out, uint64_t *word)
{
    Py_ssize_t mask = g->capacity - 1, home = (Py_ssize_t)(h64 & (uint64_t)mask), idx;
    uint64_t was, own;
    if (!claim_free(g, home, a->owner, &idx, &was, &own))
        return G_SLOW; /* reclaim the dead, look again, count a refusal: Python */
    uint64_t *state = state_at(g, idx);
    LEASE_STOP(a->stop, P_INSERT);
    if (sealed(g)) /* put back the very word: nothing was written */
        return cas(state, own, was) ? G_SEALED : G_TAKEN_OVER;
    char *slot = slot_at(g, idx);
    uint64_t copy = 1 - ((own >> 8) & 1);
    free_blocks(g, idx, was);
    /* Relaxed: nobody reads a slot's hash or ticket before it is keyed, and
       the full barrier below comes before the swap that keys it. (Two full
       barriers here cost more than the rest of a grant, measured with perf.) */
    __atomic_store_n((uint64_t *)(g->buf + g->hashes + 8 * idx), h64, __ATOMIC_RELAXED);
    __atomic_store_n((uint64_t *)(slot + TICKET_AT), 0, __ATOMIC_RELAXED);
    uint16_t len16 = (uint16_t)a->key_len, reserved = 0;
    uint32_t block = 0;
    memcpy(slot, &len16, 2);
    memcpy(slot + 2, &reserved, 2);
    memcpy(slot + 4, &block, 4);
    memcpy(slot + KEY_AT, a->key, a->key_len);
    /* maxdist[home] covers this slot, then a full barrier (Dekker). */
    uint32_t *md = (uint32_t *)(g->buf + g->maxdist) + home;
    uint32_t dist = (uint32_t)((idx - home) & mask), cur = __atomic_load_n(md, __ATOMIC_ACQUIRE);
    while (cur < dist &&
           !__atomic_compare_exchange_n(md, &cur, dist, 1, __ATOMIC_SEQ_CST, __ATOMIC_ACQUIRE))
        ;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    uint64_t keyed = next_word(own, UPDATING, (own >> 8) & 1, FREE, a->owner);
    if (!cas(state, own, keyed))
        return G_TAKEN_OVER;
    own = keyed;
    uint64_t ticket = bump(g, NEXT_LEASE_ID, 1) + 1;
    char rec[RECORD_SIZE];
    memset(rec, 0, RECORD_SIZE);
    write_lease(rec, ticket, a);
    memcpy(slot + COPY_AT[copy], rec, RECORD_SIZE);
    __atomic_store_n((uint64_t *)(slot + TICKET_AT), ticket, __ATOMIC_SEQ_CST);
    LEASE_STOP(a->stop, P_KEYED);
    if (placed_before(g, a->key, a->key_len, h64, home, idx, ticket)) {
        bump(g, BACKOFFS, 1);
        /* As LeaseTable._rollback: the slot becomes FREE (this key used no block). */
        if (!cas(state, own, next_word(own, FREE, (own >> 8) & 1, 0, 0)))
            return G_TAKEN_OVER;
        return G_AGAIN;
    }
    uint64_t leased = next_word(own, LEASED, copy, 0, 0);
    if (!lease_publish_counted(state, idx, own, leased, g->shard, COUNT_GRANTS, a->stop))
        return G_TAKEN_OVER;
    lower_expiry(g, a->now + a->lease_s);
    *lease_id = ticket;
    *slot_out = idx;
    *word = leased;
    return G_GRANTED;
}

uint64_t
lease_prefetch(GranterObject *g, const char *key, Py_ssize_t key_len)
{
    uint64_t h64 = blake2b64((const uint8_t *)key, (size_t)key_len);
    if (key_len > INLINE_KEY)
        return h64;
    Py_ssize_t home = (Py_ssize_t)(h64 & (uint64_t)(g->capacity - 1));
    /* For writing (1), keep in every level (3): the grant's swaps and stores
       land on these lines. */
    __builtin_prefetch(state_at(g, home), 1, 3);
    __builtin_prefetch(g->buf + g->hashes + 8 * home, 1, 3);
    __builtin_prefetch((uint32_t *)(g->buf + g->maxdist) + home, 0, 3);
    const char *slot = slot_at(g, home);
    for (int line = 0; line < SLOT_SIZE; line += 64)
        __builtin_prefetch(slot + line, 1, 3);
    return h64;
}

int
lease_refusal(GranterObject *g, GrantArgs *a)
{
    if (a->key_len > INLINE_KEY)
        return 0;
    if (!a->hashed) {
        a->h64 = blake2b64((const uint8_t *)a->key, (size_t)a->key_len);
        a->hashed = 1;
    }
    int got = lookup(g, a->key, a->key_len, a->h64, &a->slot, &a->word, a->record);
    a->looked = got < 0 ? 0 : got ? 1 : 2;
    if (got != 1)
        return 0;
    double held_until;
    memcpy(&held_until, a->record + R_HELD_UNTIL, 8);
    switch (a->word & 15) {
    case LEASED:
        return G_LEASED;
    case PARKED:
        return G_PARKED;
    case HELD:
        return held_until > a->now ? G_HELD : 0;
    default:
        return 0;
    }
}

int
lease_grant(GranterObject *g, const GrantArgs *a, uint64_t *lease_id, uint32_t *misses,
            Py_ssize_t *slot, uint64_t *word)
{
    if (a->key_len > INLINE_KEY)
        return G_SLOW;
    if (a->owner != g->shard_owner) /* a first grant, or a child of fork */
        return G_NO_SHARD;
    uint64_t h64 = a->hashed ? a->h64 : blake2b64((const uint8_t *)a->key, (size_t)a->key_len);
    for (int attempt = 0; attempt < INSERT_RETRIES; attempt++) {
        Py_ssize_t idx;
        uint64_t w;
        char rec[RECORD_SIZE];
        int got;
        if (attempt == 0 && a->looked == 1) { /* lease_refusal's look, moments ago */
            idx = a->slot;
            w = a->word;
            memcpy(rec, a->record, RECORD_SIZE);
            got = 1;
        }
        else if (attempt == 0 && a->looked == 2)
            got = 0;
        else
            got = lookup(g, a->key, a->key_len, h64, &idx, &w, rec);
        if (got < 0)
            return G_SLOW;
        if (got) {
            got = grant_existing(g, idx, w, rec, a, lease_id, misses, word);
            *slot = idx;
        }
        else {
            *misses = 0;
            got = insert(g, h64, a, lease_id, slot, word);
        }
        if (got != G_AGAIN)
            return got;
    }
    return G_SLOW;
}

/* grant(key, holder, lease_s, now, cadence_s, version, owner, stop)
 *     -> (lease_id, misses) | 1 LEASED | 2 HELD | 3 PARKED | -1 SLOW | -2 TAKEN_OVER
 *        | -3 SEALED | -4 NO_SHARD
 *
 * key: the key's UTF-8 (1..1024 bytes; over 208 is SLOW); holder: the
 * consumer's UTF-8, at most 32 bytes; owner: this process's pid and tag as a
 * state word holds them; stop: a test stop (honoured by the test build only;
 * 0: none). */
static PyObject *
granter_grant(GranterObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_Format(PyExc_TypeError, "grant() takes 8 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!self->held) {
        PyErr_SetString(PyExc_ValueError, "Granter is released");
        return NULL;
    }
    if (!PyBytes_Check(args[0]) || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "grant(): key and holder must be bytes");
        return NULL;
    }
    GrantArgs a;
    memset(&a, 0, sizeof a);
    a.key = PyBytes_AS_STRING(args[0]);
    a.key_len = PyBytes_GET_SIZE(args[0]);
    a.holder = PyBytes_AS_STRING(args[1]);
    a.holder_len = PyBytes_GET_SIZE(args[1]);
    a.lease_s = PyFloat_AsDouble(args[2]);
    a.now = PyFloat_AsDouble(args[3]);
    a.cadence_s = PyFloat_AsDouble(args[4]);
    a.version = PyLong_AsUnsignedLongLong(args[5]);
    a.owner = PyLong_AsUnsignedLongLong(args[6]);
    a.stop = (int)PyLong_AsLong(args[7]);
    if (PyErr_Occurred())
        return NULL;
    if (a.key_len < 1 || a.key_len > 1024 || a.holder_len > CONSUMER_BYTES) {
        PyErr_SetString(PyExc_ValueError, "grant(): a key is 1 to 1024 bytes, a holder 32 at most");
        return NULL;
    }
    if (!(a.lease_s > 0 && a.cadence_s > 0)) {
        PyErr_SetString(PyExc_ValueError, "grant(): lease_s and cadence_s must be positive");
        return NULL;
    }
    uint64_t lease_id = 0, word = 0;
    uint32_t misses = 0;
    Py_ssize_t slot = -1;
    int got = lease_grant(self, &a, &lease_id, &misses, &slot, &word);
    if (got == G_GRANTED)
        return Py_BuildValue("(KI)", (unsigned long long)lease_id, (unsigned int)misses);
    return PyLong_FromLong(got);
}

static PyMethodDef granter_methods[] = {
    {"grant", (PyCFunction)(void (*)(void))granter_grant, METH_FASTCALL,
     "grant(key, holder, lease_s, now, cadence_s, version, owner, stop) -> (lease_id, misses)"
     " | 1 leased | 2 held | 3 parked | -1 slow | -2 taken over | -3 sealed | -4 no shard"},
    {"set_shard", (PyCFunction)(void (*)(void))granter_set_shard, METH_FASTCALL,
     "set_shard(off, owner): grants by owner count in the counter shard at off"},
    {"release", (PyCFunction)granter_release, METH_NOARGS,
     "release(): drop the buffer export (before closing the mmap)"},
    {NULL, NULL, 0, NULL},
};

PyTypeObject GranterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shm._claim.Granter",
    .tp_basicsize = sizeof(GranterObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Granter(buffer, capacity, hashes, maxdist, owners, slots, blocks, long_blocks, size)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)granter_init,
    .tp_dealloc = (destructor)granter_dealloc,
    .tp_methods = granter_methods,
};

static PyMethodDef claim_functions[] = {
    {"blake2b64", claim_blake2b64, METH_O,
     "blake2b64(data) -> int: hashlib.blake2b(data, digest_size=8), little-endian"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef claim_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "shm._claim",
    .m_doc = "The claim path in C: the lease table's grant, its key hash, a whole claim.",
    .m_size = -1,
    .m_methods = claim_functions,
};

PyMODINIT_FUNC
PyInit__claim(void)
{
    if (PyType_Ready(&GranterType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&claim_module);
    if (m == NULL)
        return NULL;
    /* The lease table's offsets and codes this module uses, by the names
     * shm/leases.py gives them: leases.py checks them at import. */
    PyObject *layout = Py_BuildValue(
        "{sisisisisisisisisisisisisisisisisisisisi}", "SEALED", SEALED, "SHARD_JOURNAL",
        SHARD_JOURNAL, "NEXT_LEASE_ID", NEXT_LEASE_ID, "BACKOFFS", BACKOFFS, "EARLIEST_EXPIRY",
        EARLIEST_EXPIRY, "STATES", STATES, "SLOT_SIZE", SLOT_SIZE, "TICKET_AT", TICKET_AT,
        "KEY_AT", KEY_AT, "INLINE_KEY", INLINE_KEY, "CONSUMER_BYTES", CONSUMER_BYTES,
        "SEQ_SHIFT", SEQ_SHIFT, "RECORD_SIZE", RECORD_SIZE, "COPY_AT_0", (int)COPY_AT[0],
        "COPY_AT_1", (int)COPY_AT[1], "IDLE", IDLE, "LEASED", LEASED, "HELD", HELD, "PARKED",
        PARKED, "UPDATING", UPDATING);
    int added = layout == NULL ? -1 : PyModule_AddObjectRef(m, "LEASE_LAYOUT", layout);
    Py_XDECREF(layout);
    if (added < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "Granter", (PyObject *)&GranterType) < 0 ||
        PyModule_AddIntConstant(m, "TEST_STOPS", LEASE_TEST_STOPS) < 0 ||
        claim_path_add(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
