/* The lease table's grant in C (shm._claim's Granter.grant and the claim
 * path's grants): the protocol step for step as LeaseTable.grant in
 * shm/leases/; what it does and when it answers SLOW: shm/_claim.c. The
 * offsets and codes are shm/layout.h's. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_claim.h"

#define LEASE_READ_RETRIES 100
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
    return code | prev << WORD_PREV_SHIFT | copy << WORD_COPY_SHIFT | owner |
           (((w >> SEQ_SHIFT) + 1) & SEQ_MASK) << SEQ_SHIFT;
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



/* Whether keyed slot idx holds `key` right now, read under its word w (the
   caller re-checks the word after). Inline keys only: a longer slot key can
   never equal a key this path handles. */
static inline int
slot_has_key(GranterObject *g, Py_ssize_t idx, const char *key, Py_ssize_t key_len)
{
    const char *slot = slot_at(g, idx);
    uint16_t len;
    memcpy(&len, slot + SLOT_KEY_LEN, 2);
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
                memcpy(rec, slot_at(g, idx) + COPY_AT[(w >> WORD_COPY_SHIFT) & 1], RECORD_SIZE);
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            uint64_t again = __atomic_load_n(state, __ATOMIC_ACQUIRE);
            if (again == w) {
                if (!same)
                    break;
                *out_idx = idx;
                *out_w = w;
                return 1;
            }
            if (++tries >= LEASE_READ_RETRIES)
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
        if ((w & 15) != UPDATING || ((w >> WORD_PREV_SHIFT) & 15) != FREE)
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
    uint64_t own = UPDATING | (w & 15) << WORD_PREV_SHIFT | (w & 1ULL << WORD_COPY_SHIFT) |
                   a->owner | (((w >> SEQ_SHIFT) + 1) & SEQ_MASK) << SEQ_SHIFT;
    if (!cas(state, w, own))
        return G_AGAIN;
    LEASE_STOP(a->stop, P_UPDATE);
    if (sealed(g)) /* put back the very word: nothing was written */
        return cas(state, own, w) ? G_SEALED : G_TAKEN_OVER;
    *lease_id = bump(g, NEXT_LEASE_ID, 1) + 1;
    uint64_t copy = 1 - ((own >> WORD_COPY_SHIFT) & 1);
    write_lease(rec, *lease_id, a);
    memcpy(slot_at(g, idx) + COPY_AT[copy], rec, RECORD_SIZE);
    LEASE_STOP(a->stop, P_WRITTEN);
    uint64_t leased =
        LEASED | copy << WORD_COPY_SHIFT | (((own >> SEQ_SHIFT) + 1) & SEQ_MASK) << SEQ_SHIFT;
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
        uint64_t own = next_word(w, CLAIMING, (w >> WORD_COPY_SHIFT) & 1, 0, owner);
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
        memcpy(&block, slot_at(g, idx) + SLOT_BLOCK, 4);
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
    uint64_t copy = 1 - ((own >> WORD_COPY_SHIFT) & 1);
    free_blocks(g, idx, was);
    /* Relaxed: nobody reads a slot's hash or ticket before it is keyed, and
       the full barrier below comes before the swap that keys it. (Two full
       barriers here cost more than the rest of a grant, measured with perf.) */
    __atomic_store_n((uint64_t *)(g->buf + g->hashes + 8 * idx), h64, __ATOMIC_RELAXED);
    __atomic_store_n((uint64_t *)(slot + TICKET_AT), 0, __ATOMIC_RELAXED);
    uint16_t len16 = (uint16_t)a->key_len, reserved = 0;
    uint32_t block = 0;
    memcpy(slot + SLOT_KEY_LEN, &len16, 2);
    memcpy(slot + SLOT_RESERVED, &reserved, 2);
    memcpy(slot + SLOT_BLOCK, &block, 4);
    memcpy(slot + KEY_AT, a->key, a->key_len);
    /* maxdist[home] covers this slot, then a full barrier (Dekker). */
    uint32_t *md = (uint32_t *)(g->buf + g->maxdist) + home;
    uint32_t dist = (uint32_t)((idx - home) & mask), cur = __atomic_load_n(md, __ATOMIC_ACQUIRE);
    while (cur < dist &&
           !__atomic_compare_exchange_n(md, &cur, dist, 1, __ATOMIC_SEQ_CST, __ATOMIC_ACQUIRE))
        ;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    uint64_t keyed = next_word(own, UPDATING, (own >> WORD_COPY_SHIFT) & 1, FREE, a->owner);
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
        if (!cas(state, own, next_word(own, FREE, (own >> WORD_COPY_SHIFT) & 1, 0, 0)))
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
