/* The claim path's take from the ready set: shm/ready/take.py's ReadySet.take in C
 * (the tagged claim cursor, the slot's seqlock, the switch to a set published
 * ahead). The offsets are shm/layout.h's. */

#include "_claim_path.h"

#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* Reads of a slot torn by the keeper's publish before a take gives up
   (shm/ready/layout.py READ_RETRIES). */
#define READY_READ_RETRIES 1000

/* The slot at base once the publish tagged `tag` finished: 1 with its count
   and flags, 0 when it has moved past that publish (ReadySet._settled). */
static int
settled(ClaimPathObject *self, const char *base, uint32_t tag, Py_ssize_t *count,
        uint32_t *flags)
{
    for (int i = 0; i < READY_READ_RETRIES; i++) {
        uint32_t seq = ld32(base + R_SEQ);
        uint32_t n;
        memcpy(&n, base + R_COUNT, 4);
        memcpy(flags, base + R_FLAGS, 4);
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
    uint32_t seq = ld32(base + R_SEQ);
    uint64_t cursor = ld64(base + R_CURSOR), g;
    memcpy(&g, base + R_SLOT_GENERATION, 8);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return !(seq & 1) && (uint32_t)(cursor >> 32) == seq && g == gen && ld32(base + R_SEQ) == seq;
}

int
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

/* Whether the grant deadline (R_GRANT_UNTIL: CLOCK_MONOTONIC ns, 0 for none)
   has passed: ReadySet.take's check. A single node (0) reads no clock. */
static int
past_deadline(const char *buf)
{
    uint64_t until = ld64(buf + R_GRANT_UNTIL);
    if (until == 0)
        return 0;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec >= until;
}

int
take(ClaimPathObject *self, Py_ssize_t n, Taken *out, Py_ssize_t *retries)
{
    char *buf = (char *)self->ready.buf;
    memset(out, 0, sizeof *out);
    if (past_deadline(buf))
        return TAKE_NOT_GRANTING;
    for (int attempt = 0; attempt < READY_READ_RETRIES; attempt++) {
        uint64_t word = ld64(buf + R_ACTIVE);
        char *base = buf + R_FIRST_SLOT + (word & 1) * self->stride;
        uint32_t seq = ld32(base + R_SEQ), raw_count, flags;
        memcpy(&raw_count, base + R_COUNT, 4);
        uint64_t cursor = ld64(base + R_CURSOR);
        memcpy(&flags, base + R_FLAGS, 4);
        Py_ssize_t count = raw_count < self->ready_capacity ? raw_count : self->ready_capacity;
        if ((seq & 1) || (uint32_t)(cursor >> 32) != seq) {
            /* mid-publish, or a header torn by one */
        }
        else if ((Py_ssize_t)(cursor & CURSOR_INDEX) >= count) {
            /* Drained: no add (claimers polling an empty set leave the cursor be). */
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            if (ld32(base + R_SEQ) == seq) {
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
                    memcpy(&lo, self->entries + E_KEY_OFFSET, 4);
                    memcpy(&last_off, self->entries + R_ENTRY_SIZE * (got - 1) + E_KEY_OFFSET, 4);
                    memcpy(&last_len, self->entries + R_ENTRY_SIZE * (got - 1) + E_KEY_LEN, 2);
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
                        memcpy(&off, self->entries + R_ENTRY_SIZE * i + E_KEY_OFFSET, 4);
                        memcpy(&len, self->entries + R_ENTRY_SIZE * i + E_KEY_LEN, 2);
                        if (off < lo || (uint64_t)off + len > hi)
                            sane = 0;
                    }
                }
                __atomic_thread_fence(__ATOMIC_ACQUIRE);
                if (sane && ld32(base + R_SEQ) == seq) {
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
