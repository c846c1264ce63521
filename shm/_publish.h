/* The lease table's counted publish and its test stops, shared by
 * shm/_atomic.c (publish_counted, for the Python side) and the C grant
 * (shm/_grant.c): one protocol, one copy. The offsets are shm/layout.h's. */

#ifndef QUEUE_NODE_PUBLISH_H
#define QUEUE_NODE_PUBLISH_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "layout.h"

/* -- test stops: only in a build with -DQUEUE_NODE_TEST_STOPS --------------------
 *
 * A stop is `point | how << 4` (shm/leases/test_stops.py _c_stop, from
 * QUEUE_NODE_TEST_LEASE_STOP). The production build compiles every stop to
 * nothing: the grant reads no stop variable and takes no branch for it.
 * tests/integration/test_lease_counters.py builds the test build into a temporary
 * directory and its children load it (QUEUE_NODE_TEST_BUILD). */

enum {
    P_INSERT = 1,    /* an insert's slot taken (CLAIMING) */
    P_KEYED = 2,     /* an insert's slot keyed, ticket drawn */
    P_UPDATE = 3,    /* an existing slot taken (UPDATING) */
    P_WRITTEN = 4,   /* the new record copy written */
    P_PUBLISHED = 5, /* a counted publish: swapped, not yet counted */
    P_JOURNALED = 6, /* a counted publish: journal written, not yet swapped */
    P_COUNTED = 7,   /* a counted publish: counted, journal not yet cleared */
    P_READ = 8,      /* a claim: the entry's row read and found due, not yet granted */
};

#ifdef QUEUE_NODE_TEST_STOPS
#include <signal.h>
#include <unistd.h>
#define LEASE_TEST_STOPS 1

static inline void
lease_test_stop(int stop, int point)
{
    if ((stop & 15) != point)
        return;
    switch ((stop >> 4) & 15) {
    case 1: /* exit */
        _exit(17);
    case 2: /* pause: widens a race window */
        usleep(500);
        break;
    default: /* stop: the test kills it, or lets it go on */
        kill(getpid(), SIGSTOP);
    }
}
#define LEASE_STOP(stop, point) lease_test_stop((stop), (point))
#else
#define LEASE_TEST_STOPS 0
#define LEASE_STOP(stop, point) ((void)0)
#endif

/* -- the lease table's seal and counter shards ----------------------------------
 *
 * SEALED: a u32 in the table's header, 1 once the node that owns the table
 * has stopped granting from it. A process checks it after it has taken a
 * slot (its compare-and-swap is a full barrier), so either it sees the seal
 * or the sealer's wait sees its slot mid-change (Dekker).
 *
 * Counter shards: one 64-byte line per process (owner word, then the counts
 * of COUNT_GRANTS .. COUNT_LATE_RELEASED at 8 * k, then the journal). Only
 * its process writes a shard while that process lives; the table's counters
 * are the header's base plus every shard's counts. (Offsets: shm/layout.h.) */

/* The journal of one counted publish: counter k (bits 0-2), the slot (3-24),
   the published word's seq (25-44), and the low 19 bits of the count it
   brings counter k to (45-63). */
static inline uint64_t
lease_journal(int k, Py_ssize_t idx, uint64_t new_word, uint64_t target)
{
    return (uint64_t)k | (uint64_t)idx << JOURNAL_SLOT_SHIFT |
           ((new_word >> SEQ_SHIFT) & SEQ_MASK) << JOURNAL_SEQ_SHIFT |
           target << JOURNAL_TARGET_SHIFT;
}

/* Publish `new_word` over the held word `own` of slot idx and count it in
 * counter k of this process's shard, as one step for whoever survives a
 * kill at any instruction:
 *
 *   journal = (k, idx, new seq, count + 1)   a kill here: not published;
 *                                            whoever rolls the slot back
 *                                            clears the journal first
 *   publish (compare-and-swap)               a kill here (P_PUBLISHED):
 *                                            published, not counted; the
 *                                            journal says so, and whoever
 *                                            settles the dead shard counts it
 *   count = count + 1                        a kill here: counted; the
 *                                            journal's target says so
 *   journal = 0
 *
 * The shard's counts are written by its process only (the GIL holds across
 * this call, so its threads never interleave here): a plain store, no lock.
 * 0 when the swap failed (the slot was taken while held). */
static inline int
lease_publish_counted(uint64_t *state, Py_ssize_t idx, uint64_t own, uint64_t new_word,
                      char *shard, int k, int stop)
{
    uint64_t *count = (uint64_t *)(shard + 8 * k);
    uint64_t *journal = (uint64_t *)(shard + SHARD_JOURNAL);
    uint64_t c = __atomic_load_n(count, __ATOMIC_RELAXED);
    /* Relaxed: the swap below is a full barrier, so the journal is seen
       before the publish. */
    __atomic_store_n(journal, lease_journal(k, idx, new_word, c + 1), __ATOMIC_RELAXED);
    LEASE_STOP(stop, P_JOURNALED);
    if (!__atomic_compare_exchange_n(state, &own, new_word, 0, __ATOMIC_SEQ_CST,
                                     __ATOMIC_SEQ_CST)) {
        __atomic_store_n(journal, 0, __ATOMIC_RELEASE);
        return 0;
    }
    LEASE_STOP(stop, P_PUBLISHED);
    (void)stop;
    __atomic_store_n(count, c + 1, __ATOMIC_RELEASE);
    LEASE_STOP(stop, P_COUNTED);
    __atomic_store_n(journal, 0, __ATOMIC_RELEASE);
    return 1;
}

#endif
