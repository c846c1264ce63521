/* shm._atomic's View.excluded_keys: the keeper's excluded keys read and
 * decoded in one pass (about 1 us a key in Python), or only what changed
 * since the last pass (shm/leases/scan.py excluded_changes). */

#include "_atomic.h"

/* excluded_keys(states_off, count, slots_off, slot_size, key_at, inline_key,
 *               held_off0, held_off1, blocks_off, block_size, long_blocks,
 *               now, always_mask, held_mask, retries, cache)
 *     -> (set of str, [index, ...])
 *
 * The keeper's filter in one pass: the keys of the slots whose state code is
 * in always_mask, or in held_mask with the current record's f64 at held_off0
 * (copy 0, bit 8 of the word clear) or held_off1 (copy 1) above `now`. Slot i
 * starts at slots_off + slot_size * i and begins with key_len (u16 at +0, UTF-8
 * bytes) and block (u32 at +4: overflow block index + 1, 0 none); the key's
 * first inline_key bytes are at key_at, the rest at the start of block
 * (blocks_off + block_size * (block - 1)), block_size bytes at most.
 *
 * Each slot is read seqlock style: word, record field and key bytes, then the
 * word again; a slot whose word changed is read again under its new word, up
 * to `retries` reads. Keys are decoded (strict UTF-8) only from consistent
 * reads. The list names the slots that kept changing, or whose key did not
 * read as valid (length or block out of range) under a steady word: the caller
 * settles those one by one.
 *
 * `cache` is None or a list of `count` items that this function owns between
 * calls: item i is the str last decoded from slot i while it was excluded, or
 * None. A slot whose bytes equal its cached str's UTF-8 gives that str again
 * (no decoding, its hash already computed); any other slot's item is replaced
 * (or set to None), so the cache holds no more than the last answer.
 *
 * Changes mode: with a 17th argument `seen` (a writable buffer of `count`
 * u64, the word each slot had when last settled; all ones: never) and a
 * cache, the answer is (added, removed, unsettled, hinted): the strs of keys
 * that became excluded since the last call and of those that no longer are
 * (the cache's old items); the first `hinted` of added are strs of the hints'
 * key lists (settled from grant records, below). A slot whose word equals seen[i] has made no transition
 * since (every transition bumps the word's seq), so only a held slot, whose
 * exclusion ends with time, is looked at again: the cost follows the slots
 * that changed, not the keys excluded. An unsettled slot gets seen[i] = all
 * ones and its cache item untouched, for the caller to settle and update.
 *
 * With an 18th argument `counts`, (held, extra): a set of the keys some
 * slot's cache item holds, and a dict of how many more slots than one hold
 * each key held by several, both owned by the caller and kept in step here
 * (a set's entries hold their hashes: a key not in it costs one cache line
 * to look up, where a big dict's lookup reads its index, entry and key): a
 * key is in `added` only when no slot held it before, and in `removed` only
 * when, at the end of the scan, no slot holds it any more.
 * A key keyed in two slots for a moment (two inserts racing, one backing off)
 * or moved to another slot is then reported neither way: it stays excluded.
 *
 * With a 19th argument `hints`, a tuple of up to four (records, keys, n,
 * tag, leased, seq_shift), one a published set (the keeper's active and
 * retiring sets): grant records a claimer wrote (shm/ready/layout.py's layout: u64 each, lease slot
 * + 1 in bits 0-22, the word's copy bit at 23 and seq at 24-43, `tag` at
 * 44-63) for keys[0:n], read before the scan. A record whose tag matches and
 * whose slot still has the word it names (code `leased`, that copy and seq:
 * no transition since the grant) settles that slot with keys[j] itself, as
 * if its bytes had been read: no read of the slot, no decoding, and the
 * caller's own str (its hash known) in `added`. Any other record is passed
 * over, and its slot read as usual. Needs changes mode and counts. */
static int
same_key(PyObject *str, const char *key, Py_ssize_t key_len)
{
    if (!PyUnicode_CheckExact(str))
        return 0;
    if (PyUnicode_IS_COMPACT_ASCII(str))
        return PyUnicode_GET_LENGTH(str) == key_len &&
               memcmp(PyUnicode_DATA(str), key, key_len) == 0;
    Py_ssize_t n;
    const char *utf8 = PyUnicode_AsUTF8AndSize(str, &n);
    if (utf8 == NULL) {
        PyErr_Clear(); /* not comparable: decode afresh */
        return 0;
    }
    return n == key_len && memcmp(utf8, key, key_len) == 0;
}

/* cache[i] = item (a new reference is taken). The item dropped must be None or
 * an exact str, whose release runs no Python code that could change the cache
 * or the view under the scan; anything else is a TypeError. */
static int
cache_put(PyObject *cache, Py_ssize_t i, PyObject *item)
{
    PyObject *old = PyList_GET_ITEM(cache, i);
    if (old != Py_None && !PyUnicode_CheckExact(old)) {
        PyErr_SetString(PyExc_TypeError, "excluded_keys: the cache holds something not a str");
        return -1;
    }
    Py_INCREF(item);
    PyList_SET_ITEM(cache, i, item);
    Py_DECREF(old);
    return 0;
}

/* Slot i, under word w, holds no excluded key: its cached key (if any) has
   left (into removed, in changes mode) and the slot is settled under w. */
static int
settle_out(PyObject *cache, PyObject *removed, uint64_t *seen, Py_ssize_t i, uint64_t w)
{
    if (cache != NULL && PyList_GET_ITEM(cache, i) != Py_None) {
        if (removed != NULL && PyList_Append(removed, PyList_GET_ITEM(cache, i)) < 0)
            return -1;
        if (cache_put(cache, i, Py_None) < 0)
            return -1;
    }
    if (seen != NULL)
        seen[i] = w;
    return 0;
}

/* The caller's counts (see excluded_keys): the keys held, and how many more
   slots than one hold a key held by several. */
typedef struct {
    PyObject *held;  /* set */
    PyObject *extra; /* dict: str -> int >= 1 */
} Counts;

/* One more slot holds str; str goes into added if none did. The counts are
   small ints, which CPython keeps as shared objects: nothing the garbage
   collector tracks is allocated here. */
static int
count_added(const Counts *counts, PyObject *added, PyObject *str)
{
    int has = PySet_Contains(counts->held, str);
    if (has < 0)
        return -1;
    if (!has)
        return PySet_Add(counts->held, str) < 0 ? -1 : PyList_Append(added, str);
    PyObject *n = PyDict_GetItemWithError(counts->extra, str);
    long v = 0;
    if (n == NULL && PyErr_Occurred())
        return -1;
    if (n != NULL && (v = PyLong_AsLong(n)) == -1 && PyErr_Occurred())
        return -1;
    PyObject *more = PyLong_FromLong(v + 1);
    if (more == NULL)
        return -1;
    int rc = PyDict_SetItem(counts->extra, str, more);
    Py_DECREF(more);
    return rc;
}

/* One slot fewer holds each str that left a slot's cache item; *removed is
   replaced by the list of those no slot holds any more (taken out of the
   counts). A str the counts never held (a cache filled before the counts
   were) counts as held once. */
static int
count_removed(const Counts *counts, PyObject **removed)
{
    PyObject *gone = PyList_New(0);
    if (gone == NULL)
        return -1;
    Py_ssize_t n = PyList_GET_SIZE(*removed);
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *str = PyList_GET_ITEM(*removed, j);
        long v = 0;
        if (PyDict_GET_SIZE(counts->extra)) {
            PyObject *c = PyDict_GetItemWithError(counts->extra, str);
            if (c == NULL && PyErr_Occurred())
                goto fail;
            if (c != NULL && (v = PyLong_AsLong(c)) == -1 && PyErr_Occurred())
                goto fail;
        }
        if (v > 1) {
            PyObject *less = PyLong_FromLong(v - 1);
            if (less == NULL)
                goto fail;
            int rc = PyDict_SetItem(counts->extra, str, less);
            Py_DECREF(less);
            if (rc < 0)
                goto fail;
            continue;
        }
        if (v == 1) {
            if (PyDict_DelItem(counts->extra, str) < 0)
                goto fail;
            continue; /* another slot still holds it */
        }
        if (PySet_Discard(counts->held, str) < 0)
            goto fail;
        if (PyList_Append(gone, str) < 0)
            goto fail;
    }
    Py_SETREF(*removed, gone);
    return 0;
fail:
    Py_DECREF(gone);
    return -1;
}

/* The scan gathers up to CANDIDATE_RUN candidates, then reads them with
   their lines asked for PREFETCH_DEPTH candidates ahead. */
#define CANDIDATE_RUN 512
#define PREFETCH_DEPTH 8

/* One of excluded_keys's hints (see there), as parsed. */
#define MAX_HINTS 4
typedef struct {
    PyObject *records, *keys; /* borrowed from the hints tuple */
    Py_ssize_t n, leased, shift;
    uint64_t tag;
} Hint;

/* excluded_keys's hints (see there): settle the slots the grant records name
   whose word has not moved since the grant, with the caller's keys. */
static int
settle_hinted(const uint64_t *states, Py_ssize_t count, uint64_t *seen, PyObject *cache,
              const Counts *counts, PyObject *added, PyObject *removed, const uint64_t *records,
              PyObject *keys, Py_ssize_t n, uint64_t tag, uint64_t leased, int seq_shift)
{
    for (Py_ssize_t j = 0; j < n; j++) {
        if (j + PREFETCH_DEPTH < n) {
            uint64_t ahead = __atomic_load_n(&records[j + PREFETCH_DEPTH], __ATOMIC_RELAXED);
            Py_ssize_t at = (Py_ssize_t)(ahead & GRANT_SLOT_MASK) - 1;
            if (ahead >> RECORD_TAG_SHIFT == tag && at >= 0 && at < count) {
                __builtin_prefetch(&states[at]);
                __builtin_prefetch(&seen[at]);
                __builtin_prefetch(&((PyListObject *)cache)->ob_item[at]);
            }
        }
        uint64_t rec = __atomic_load_n(&records[j], __ATOMIC_ACQUIRE);
        Py_ssize_t i = (Py_ssize_t)(rec & GRANT_SLOT_MASK) - 1;
        if (rec >> RECORD_TAG_SHIFT != tag || i < 0 || i >= count)
            continue; /* none, another publish's, or nonsense: the scan reads the slot */
        uint64_t want = leased | ((rec >> GRANT_COPY_SHIFT) & 1) << WORD_COPY_SHIFT |
                        ((rec >> GRANT_SEQ_SHIFT) & SEQ_MASK) << seq_shift;
        uint64_t w = __atomic_load_n(&states[i], __ATOMIC_ACQUIRE);
        if (w != want || seen[i] == w)
            continue; /* moved on since the grant (the scan reads it), or settled already */
        PyObject *str = PyList_GET_ITEM(keys, j);
        if (!PyUnicode_CheckExact(str)) {
            PyErr_SetString(PyExc_TypeError, "excluded_keys: a hint's key is not a str");
            return -1;
        }
        PyObject *old = PyList_GET_ITEM(cache, i);
        if (old != str) {
            int same = old != Py_None && PyUnicode_CheckExact(old) &&
                       PyUnicode_Compare(old, str) == 0;
            if (!same) {
                if (old != Py_None && PyList_Append(removed, old) < 0)
                    return -1;
                if (cache_put(cache, i, str) < 0 || count_added(counts, added, str) < 0)
                    return -1;
            }
        }
        seen[i] = w;
    }
    return 0;
}


PyObject *
view_excluded_keys(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 16 || nargs > 19) {
        PyErr_Format(PyExc_TypeError, "excluded_keys() takes 16 to 19 arguments (%zd given)",
                     nargs);
        return NULL;
    }
    Py_ssize_t count, slots_off, slot_size, key_at, inline_key, held0, held1;
    Py_ssize_t blocks_off, block_size, long_blocks, retries;
    uint64_t always_mask, held_mask;
    if (as_ssize(args[1], &count) < 0 || as_ssize(args[2], &slots_off) < 0 ||
        as_ssize(args[3], &slot_size) < 0 || as_ssize(args[4], &key_at) < 0 ||
        as_ssize(args[5], &inline_key) < 0 || as_ssize(args[6], &held0) < 0 ||
        as_ssize(args[7], &held1) < 0 || as_ssize(args[8], &blocks_off) < 0 ||
        as_ssize(args[9], &block_size) < 0 || as_ssize(args[10], &long_blocks) < 0 ||
        as_u64(args[12], &always_mask) < 0 || as_u64(args[13], &held_mask) < 0 ||
        as_ssize(args[14], &retries) < 0)
        return NULL;
    double now = PyFloat_AsDouble(args[11]);
    if (now == -1.0 && PyErr_Occurred())
        return NULL;
    if (inline_key < 0 || block_size < 0 || inline_key + block_size > 0xFFFF) {
        PyErr_SetString(PyExc_ValueError, "excluded_keys: keys are at most 65,535 bytes");
        return NULL;
    }
    Py_ssize_t max_key = inline_key + block_size;
    int changes = nargs >= 17 && args[16] != Py_None;
    Counts counts_pair = {NULL, NULL};
    const Counts *counts = NULL;
    if (nargs >= 18 && args[17] != Py_None) {
        PyObject *c = args[17];
        if (!changes || !PyTuple_CheckExact(c) || PyTuple_GET_SIZE(c) != 2 ||
            !PySet_CheckExact(PyTuple_GET_ITEM(c, 0)) ||
            !PyDict_CheckExact(PyTuple_GET_ITEM(c, 1))) {
            PyErr_SetString(PyExc_ValueError,
                            "excluded_keys: counts is (set, dict), with seen");
            return NULL;
        }
        counts_pair.held = PyTuple_GET_ITEM(c, 0);
        counts_pair.extra = PyTuple_GET_ITEM(c, 1);
        counts = &counts_pair;
    }
    /* hints: a tuple of up to MAX_HINTS (records, keys, n, tag, leased,
       seq_shift), one a published set whose records may name slots. */
    Hint hint[MAX_HINTS];
    Py_ssize_t hint_count = 0;
    PyObject *hints = nargs == 19 && args[18] != Py_None ? args[18] : NULL;
    if (hints != NULL) {
        if (counts == NULL || !PyTuple_CheckExact(hints) || PyTuple_GET_SIZE(hints) > MAX_HINTS) {
            PyErr_SetString(PyExc_ValueError,
                            "excluded_keys: hints are a tuple of at most 4 (records, keys, n, "
                            "tag, leased, seq_shift), with counts");
            return NULL;
        }
        for (Py_ssize_t h = 0; h < PyTuple_GET_SIZE(hints); h++) {
            Hint *x = &hint[hint_count];
            PyObject *one = PyTuple_GET_ITEM(hints, h);
            if (!PyTuple_CheckExact(one) ||
                !PyArg_ParseTuple(one, "OO!nKnn", &x->records, &PyList_Type, &x->keys, &x->n,
                                  &x->tag, &x->leased, &x->shift)) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_ValueError,
                                    "excluded_keys: a hint is (records, keys, n, tag, leased, "
                                    "seq_shift)");
                return NULL;
            }
            if (x->leased < 0 || x->leased > 15 || !((always_mask >> x->leased) & 1) ||
                x->shift < 9 || x->shift > 44 || x->n < 0 || x->n > PyList_GET_SIZE(x->keys)) {
                PyErr_SetString(PyExc_ValueError, "excluded_keys: hints out of range");
                return NULL;
            }
            hint_count++;
        }
    }
    /* Allocate first: from here on the scan allocates no object the garbage
       collector tracks, so no finalizer can run and change the cache or
       release the view between the checks below and the end of the scan
       (count_removed's list comes after it). */
    Py_buffer seen_view = {0}, records_view = {0};
    uint64_t *seen = NULL;
    PyObject *removed = NULL;
    char *key = PyMem_Malloc(max_key > 0 ? max_key : 1);
    PyObject *keys = changes ? PyList_New(0) : PySet_New(NULL);
    PyObject *unsettled = PyList_New(0);
    if (key == NULL || keys == NULL || unsettled == NULL) {
        if (key == NULL)
            PyErr_NoMemory();
        goto fail;
    }
    PyObject *cache = args[15] == Py_None ? NULL : args[15];
    if (cache != NULL && (!PyList_CheckExact(cache) || PyList_GET_SIZE(cache) != count)) {
        PyErr_SetString(PyExc_ValueError, "excluded_keys: cache is not None or a list of count");
        goto fail;
    }
    if (changes) {
        if (cache == NULL) {
            PyErr_SetString(PyExc_ValueError, "excluded_keys: changes need a cache");
            goto fail;
        }
        if (PyObject_GetBuffer(args[16], &seen_view, PyBUF_WRITABLE) < 0)
            goto fail;
        if (seen_view.len != count * 8 || ((uintptr_t)seen_view.buf) % 8) {
            PyBuffer_Release(&seen_view);
            seen_view.obj = NULL;
            PyErr_SetString(PyExc_ValueError, "excluded_keys: seen is not count aligned u64");
            goto fail;
        }
        seen = (uint64_t *)seen_view.buf;
        removed = PyList_New(0);
        if (removed == NULL)
            goto fail;
    }
    uint64_t *states = words(self, args[0], count);
    if (states == NULL)
        goto fail;
    Py_ssize_t len = self->view.len;
    /* Every slot (and its fields) and every block must lie inside the buffer. */
    if (slot_size < 8 || slots_off < 0 || slots_off > len || key_at < 8 ||
        key_at > slot_size - inline_key || held0 < 0 || held0 > slot_size - 8 || held1 < 0 ||
        held1 > slot_size - 8 || count > (len - slots_off) / slot_size ||
        blocks_off < 0 || blocks_off > len || long_blocks < 0 ||
        (block_size > 0 && long_blocks > (len - blocks_off) / block_size) || retries < 1) {
        PyErr_SetString(PyExc_ValueError, "excluded_keys: the layout does not fit the buffer");
        goto fail;
    }
    const char *buf = (const char *)self->view.buf;
    const char *slots = buf + slots_off;
    const char *blocks = buf + blocks_off;
    uint64_t wanted = always_mask | held_mask;
    uint32_t cand[CANDIDATE_RUN];
    Py_ssize_t hinted = 0; /* keys added from the hints: the first of `keys` */
    for (Py_ssize_t h = 0; h < hint_count; h++) {
        Hint *x = &hint[h];
        if (PyObject_GetBuffer(x->records, &records_view, PyBUF_SIMPLE) < 0)
            goto fail;
        if (records_view.len < x->n * 8 || ((uintptr_t)records_view.buf) % 8) {
            PyErr_SetString(PyExc_ValueError, "excluded_keys: records are not n aligned u64");
            goto fail;
        }
        if (settle_hinted(states, count, seen, cache, counts, keys, removed,
                          (const uint64_t *)records_view.buf, x->keys, x->n, x->tag,
                          (uint64_t)x->leased, (int)x->shift) < 0)
            goto fail;
        PyBuffer_Release(&records_view);
        records_view.obj = NULL;
        hinted = PyList_GET_SIZE(keys);
    }
    for (Py_ssize_t next = 0; next < count;) {
        /* Pass one, over the words in order: the slots worth a look, up to
           CANDIDATE_RUN of them. A slot with no transition since it was
           settled is passed over; one that is not a candidate is settled
           here (its cached key, if any, has left). */
        int n = 0;
        for (; next < count && n < CANDIDATE_RUN; next++) {
            Py_ssize_t i = next;
            uint64_t w = __atomic_load_n(&states[i], __ATOMIC_ACQUIRE);
            if (seen != NULL && w == seen[i] && !((held_mask >> (w & 0xF)) & 1))
                continue; /* no transition since it was settled: nothing changed */
            if ((wanted >> (w & 0xF)) & 1) {
                cand[n++] = (uint32_t)i;
                continue;
            }
            if (settle_out(cache, removed, seen, i, w) < 0)
                goto fail;
        }
        /* Pass two, over the candidates: they lie far apart in memory, so
           the lines of the one PREFETCH_DEPTH ahead are asked for before
           each is read, and their cache misses overlap. */
        for (int j = 0; j < n + PREFETCH_DEPTH; j++) {
            if (j < n) {
                Py_ssize_t ahead = cand[j];
                uint64_t a = __atomic_load_n(&states[ahead], __ATOMIC_RELAXED);
                const char *at = slots + slot_size * ahead;
                __builtin_prefetch(at);
                __builtin_prefetch(at + key_at + 48);
                if ((held_mask >> (a & 0xF)) & 1)
                    __builtin_prefetch(at + ((a >> WORD_COPY_SHIFT) & 1 ? held1 : held0));
                if (cache != NULL) {
                    const char *str = (const char *)PyList_GET_ITEM(cache, ahead);
                    __builtin_prefetch(str);
                    __builtin_prefetch(str + 64);
                }
            }
            if (j < PREFETCH_DEPTH)
                continue;
            Py_ssize_t i = cand[j - PREFETCH_DEPTH];
            uint64_t w = __atomic_load_n(&states[i], __ATOMIC_ACQUIRE);
            int added = 0, settled = 0;
            const char *slot = slots + slot_size * i;
            for (Py_ssize_t attempt = 0; attempt < retries && !settled; attempt++) {
                uint64_t code = w & 0xF;
                if (!((wanted >> code) & 1)) {
                    settled = 1; /* not a candidate (any more) */
                    break;
                }
                int excluded = (int)((always_mask >> code) & 1);
                if (!excluded) {
                    double until;
                    Py_ssize_t held = (w >> WORD_COPY_SHIFT) & 1 ? held1 : held0;
                    memcpy(&until, slot + held, sizeof until);
                    excluded = until > now;
                }
                uint16_t key_len = 0;
                uint32_t block = 0;
                int valid = 0;
                if (excluded) {
                    memcpy(&key_len, slot + SLOT_KEY_LEN, sizeof key_len);
                    memcpy(&block, slot + SLOT_BLOCK, sizeof block);
                    if (key_len > 0 && key_len <= max_key) {
                        if (key_len <= inline_key) {
                            memcpy(key, slot + key_at, key_len);
                            valid = 1;
                        } else if (block > 0 && (Py_ssize_t)block <= long_blocks) {
                            memcpy(key, slot + key_at, inline_key);
                            memcpy(key + inline_key, blocks + block_size * (Py_ssize_t)(block - 1),
                                   key_len - inline_key);
                            valid = 1;
                        }
                    }
                }
                /* The reads above happen before the word is read again. */
                __atomic_thread_fence(__ATOMIC_ACQUIRE);
                uint64_t again = __atomic_load_n(&states[i], __ATOMIC_ACQUIRE);
                if (again != w) {
                    w = again; /* changed under the reads: read it again */
                    continue;
                }
                if (!excluded) {
                    settled = 1; /* a hold that has passed, read consistently */
                    break;
                }
                if (!valid)
                    break; /* a steady word over a key that does not read: the caller's */
                PyObject *str = NULL;
                int fresh = 0;
                if (cache != NULL) {
                    PyObject *old = PyList_GET_ITEM(cache, i);
                    if (old != Py_None && same_key(old, key, key_len)) {
                        str = old;
                        Py_INCREF(str);
                    }
                }
                if (str == NULL) {
                    str = PyUnicode_DecodeUTF8(key, key_len, NULL);
                    if (str == NULL)
                        goto fail;
                    fresh = 1;
                    PyObject *old = cache != NULL ? PyList_GET_ITEM(cache, i) : Py_None;
                    if (removed != NULL && old != Py_None && PyList_Append(removed, old) < 0) {
                        Py_DECREF(str);
                        goto fail;
                    }
                    if (cache != NULL && cache_put(cache, i, str) < 0) {
                        Py_DECREF(str);
                        goto fail;
                    }
                }
                int rc = 0;
                if (!changes)
                    rc = PySet_Add(keys, str);
                else if (fresh && counts != NULL)
                    rc = count_added(counts, keys, str);
                else if (fresh)
                    rc = PyList_Append(keys, str);
                if (seen != NULL)
                    seen[i] = w;
                Py_DECREF(str);
                if (rc < 0)
                    goto fail;
                settled = added = 1;
            }
            if (!added && settled) {
                /* read consistently and not excluded (any more) */
                if (settle_out(cache, removed, seen, i, w) < 0)
                    goto fail;
            } else if (!added && !changes && cache != NULL &&
                       PyList_GET_ITEM(cache, i) != Py_None && cache_put(cache, i, Py_None) < 0) {
                goto fail;
            }
            if (!settled && seen != NULL)
                seen[i] = ~(uint64_t)0; /* the caller settles it; look again next time */
            if (!settled) {
                PyObject *v = PyLong_FromSsize_t(i);
                if (v == NULL || PyList_Append(unsettled, v) < 0) {
                    Py_XDECREF(v);
                    goto fail;
                }
                Py_DECREF(v);
            }
        }
    }
    if (counts != NULL && count_removed(counts, &removed) < 0)
        goto fail;
    PyObject *hinted_obj = changes ? PyLong_FromSsize_t(hinted) : NULL;
    if (changes && hinted_obj == NULL)
        goto fail;
    if (records_view.obj != NULL)
        PyBuffer_Release(&records_view);
    PyMem_Free(key);
    PyObject *out = changes ? PyTuple_Pack(4, keys, removed, unsettled, hinted_obj)
                            : PyTuple_Pack(2, keys, unsettled);
    Py_XDECREF(hinted_obj);
    if (seen_view.obj != NULL)
        PyBuffer_Release(&seen_view);
    Py_DECREF(keys);
    Py_XDECREF(removed);
    Py_DECREF(unsettled);
    return out;
fail:
    PyMem_Free(key);
    if (seen_view.obj != NULL)
        PyBuffer_Release(&seen_view);
    if (records_view.obj != NULL)
        PyBuffer_Release(&records_view);
    Py_XDECREF(keys);
    Py_XDECREF(removed);
    Py_XDECREF(unsettled);
    return NULL;
}
