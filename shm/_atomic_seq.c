/* shm._atomic's seqlocks and publication (check32, check64, begin32,
 * release32, read_slot, and the module functions acquire32, acquire64,
 * release32, seq_copy, seq_write) and the ready set's entry writer
 * (write_entries). Why each fence is enough: docs/shm.md, "Memory ordering". */

#include "_atomic.h"

/* The four arguments both entry writers begin with (entries_off, heap_off,
 * heap_size, n), checked against the view: -1 with the error set. */
static int
slot_args(ViewObject *self, PyObject *const *args, const char *name, Py_ssize_t *entries_off,
          Py_ssize_t *heap_off, Py_ssize_t *heap_size, Py_ssize_t *n)
{
    if (!self->held) {
        PyErr_SetString(PyExc_ValueError, "view is released");
        return -1;
    }
    if (as_ssize(args[0], entries_off) < 0 || as_ssize(args[1], heap_off) < 0 ||
        as_ssize(args[2], heap_size) < 0 || as_ssize(args[3], n) < 0)
        return -1;
    Py_ssize_t len = self->view.len;
    if (*entries_off < 0 || *n < 0 || *n > (len - *entries_off) / R_ENTRY_SIZE || *heap_off < 0 ||
        *heap_size < 0 || *heap_size > len - *heap_off) {
        PyErr_Format(PyExc_ValueError, "%s(): the slot does not fit the buffer", name);
        return -1;
    }
    return 0;
}

/* One 32-byte ready entry (shm/ready/layout.py ENTRY). */
static inline void
put_entry(char *e, uint32_t offset, uint16_t key_len, uint16_t class_id, uint64_t version,
          int64_t due, double rank)
{
    memcpy(e + E_KEY_OFFSET, &offset, 4);
    memcpy(e + E_KEY_LEN, &key_len, 2);
    memcpy(e + E_CLASS_ID, &class_id, 2);
    memcpy(e + E_VERSION, &version, 8);
    memcpy(e + E_DUE_MINUTE, &due, 8);
    memcpy(e + E_RANK, &rank, 8);
}

/* write_entries(entries_off, heap_off, heap_size, n, keys, versions, dues,
 *               cids, ranks) -> (written, heap_used, all_ascii)
 *
 * The ready set's writer (shm/ready/, ReadySet.publish_columns): entries
 * 0..n-1 of the columns (lists) as 32-byte entries at entries_off (key
 * offset u32, key length u16, class id u16, version u64, due minute i64,
 * rank f64) and their keys' UTF-8 into the heap at heap_off, in order. Stops
 * at the first key that does not fit whole in heap_size bytes. A field out
 * of range (a key over 65,535 bytes, a class id over 65,535, a negative or
 * too large version or due minute) is a ValueError naming the entry, with
 * the entries before it written: the caller's slot stays odd. */
PyObject *
view_write_entries(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(9, "write_entries");
    Py_ssize_t entries_off, heap_off, heap_size, n;
    if (slot_args(self, args, "write_entries", &entries_off, &heap_off, &heap_size, &n) < 0)
        return NULL;
    PyObject *cols[5];
    for (int c = 0; c < 5; c++) {
        cols[c] = args[4 + c];
        if (!PyList_Check(cols[c]) || PyList_GET_SIZE(cols[c]) < n) {
            PyErr_SetString(PyExc_TypeError, "write_entries(): the columns are lists of at least n");
            return NULL;
        }
    }
    char *entries = (char *)self->view.buf + entries_off;
    char *heap = (char *)self->view.buf + heap_off;
    Py_ssize_t used = 0, i = 0;
    int ascii = 1;
    for (; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(cols[0], i);
        if (!PyUnicode_Check(key)) {
            PyErr_Format(PyExc_TypeError, "ready entry %zd: the key is not a str", i);
            return NULL;
        }
        Py_ssize_t klen;
        const char *utf8 = PyUnicode_AsUTF8AndSize(key, &klen);
        if (utf8 == NULL)
            return NULL;
        if (!PyUnicode_IS_ASCII(key))
            ascii = 0;
        if (klen > heap_size - used)
            break; /* the heap is full: the keys that fit whole, and stop */
        unsigned long long version = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(cols[1], i));
        long long due = PyLong_AsLongLong(PyList_GET_ITEM(cols[2], i));
        long cid = PyLong_AsLong(PyList_GET_ITEM(cols[3], i));
        double rank = PyFloat_AsDouble(PyList_GET_ITEM(cols[4], i));
        if (PyErr_Occurred() || klen > 0xFFFF || cid < 0 || cid > 0xFFFF) {
            if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_OverflowError) &&
                !PyErr_ExceptionMatches(PyExc_TypeError))
                return NULL;
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError,
                         "ready entry %zd: a field does not fit (key_len and class_id are u16, "
                         "version u64, due_minute i64)", i);
            return NULL;
        }
        put_entry(entries + R_ENTRY_SIZE * i, (uint32_t)used, (uint16_t)klen, (uint16_t)cid,
                  version, due, rank);
        memcpy(heap + used, utf8, klen);
        used += klen;
    }
    return Py_BuildValue("(nnO)", i, used, ascii ? Py_True : Py_False);
}

/* write_gathered(entries_off, heap_off, heap_size, n, keys, versions, slots,
 *                dues, cids, ranks) -> (written, heap_used, all_ascii)
 *
 * write_entries for a writer that holds its rows in columns by slot (the
 * keeper's buckets, keeper/buckets/best.py best_gathered): entry i is
 * (keys[slots[i]], versions[slots[i]], dues[i], cids[i], ranks[i]). keys is
 * a list of str or a key column (the keeper's KeyColumn: its UTF-8 copied
 * from where it lies, shm/_key_column.h) and versions a buffer of int64, both
 * indexed by slot; slots,
 * dues and cids are buffers of at least n int32, ranks of at least n double
 * (array('i'), array('d'), or the bytes keeper._best.pick gives). No Python
 * object is made an entry (the keys written are keys[slots[i]] for i below
 * written: a column makes them only when asked, after the publication). The same bytes as write_entries of the gathered
 * columns, the same stop at a full heap, the same errors for a field out of
 * range; a slot out of range of keys or versions is an IndexError. */
static int
gathered_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t n, Py_ssize_t item, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0)
        return -1;
    /* (an empty buffer's pointer may be anywhere: array's is a static "") */
    if (view->len < n * item || (view->len && ((uintptr_t)view->buf) % item)) {
        PyErr_Format(PyExc_ValueError,
                     "write_gathered(): %s is not an aligned buffer of at least %zd items of %zd "
                     "bytes", what, n, item);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

PyObject *
view_write_gathered(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(10, "write_gathered");
    Py_ssize_t entries_off, heap_off, heap_size, n;
    if (slot_args(self, args, "write_gathered", &entries_off, &heap_off, &heap_size, &n) < 0)
        return NULL;
    PyObject *keys = args[4];
    const KeyColumnAPI *column = NULL; /* keys a key column (shm/_key_column.h) */
    if (!PyList_Check(keys)) {
        PyObject *capsule = PyObject_GetAttrString((PyObject *)Py_TYPE(keys), "_api");
        if (capsule != NULL)
            column = PyCapsule_GetPointer(capsule, KEY_COLUMN_CAPSULE);
        Py_XDECREF(capsule);
        if (column != NULL && !PyObject_TypeCheck(keys, column->type))
            column = NULL; /* another type carrying the capsule: not a column */
        if (column == NULL) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError, "write_gathered(): keys is a list or a key column");
            return NULL;
        }
    }
    Py_buffer bufs[5];
    static const char *what[5] = {"versions", "slots", "dues", "cids", "ranks"};
    static const Py_ssize_t item[5] = {8, 4, 4, 4, 8};
    int got = 0;
    PyObject *result = NULL;
    for (; got < 5; got++)
        if (gathered_buffer(args[5 + got], &bufs[got], got ? n : 0, item[got], what[got]) < 0)
            goto done;
    const int64_t *versions = (const int64_t *)bufs[0].buf;
    const int32_t *slots = (const int32_t *)bufs[1].buf, *dues = (const int32_t *)bufs[2].buf,
                  *cids = (const int32_t *)bufs[3].buf;
    const double *ranks = (const double *)bufs[4].buf;
    Py_ssize_t nversions = bufs[0].len / 8, nkeys = column ? PY_SSIZE_T_MAX : PyList_GET_SIZE(keys);
    char *entries = (char *)self->view.buf + entries_off;
    char *heap = (char *)self->view.buf + heap_off;
    Py_ssize_t used = 0, i = 0;
    int ascii = 1;
    for (; i < n; i++) {
        int32_t slot = slots[i];
        if (slot < 0 || slot >= nkeys || slot >= nversions) {
            PyErr_Format(PyExc_IndexError, "ready entry %zd: slot %d is out of range", i,
                         (int)slot);
            break;
        }
        Py_ssize_t klen;
        const char *utf8;
        if (column != NULL) {
            int key_ascii = 0;
            if ((utf8 = column->key(keys, slot, &klen, &key_ascii)) == NULL) {
                PyErr_Format(klen < 0 ? PyExc_IndexError : PyExc_TypeError,
                             "ready entry %zd: slot %d holds no key", i, (int)slot);
                break;
            }
            ascii &= key_ascii;
        } else {
            PyObject *key = PyList_GET_ITEM(keys, slot);
            if (!PyUnicode_Check(key)) {
                PyErr_Format(PyExc_TypeError, "ready entry %zd: the key is not a str", i);
                break;
            }
            if ((utf8 = PyUnicode_AsUTF8AndSize(key, &klen)) == NULL)
                break;
            if (!PyUnicode_IS_ASCII(key))
                ascii = 0;
        }
        if (klen > heap_size - used)
            break; /* the heap is full: the keys that fit whole, and stop */
        int64_t version = versions[slot];
        int32_t cid = cids[i];
        if (version < 0 || klen > 0xFFFF || cid < 0 || cid > 0xFFFF) {
            PyErr_Format(PyExc_ValueError,
                         "ready entry %zd: a field does not fit (key_len and class_id are u16, "
                         "version u64, due_minute i64)", i);
            break;
        }
        put_entry(entries + R_ENTRY_SIZE * i, (uint32_t)used, (uint16_t)klen, (uint16_t)cid,
                  (uint64_t)version, dues[i], ranks[i]);
        memcpy(heap + used, utf8, klen);
        used += klen;
    }
    if (!PyErr_Occurred())
        result = Py_BuildValue("(nnO)", i, used, ascii ? Py_True : Py_False);
done:
    for (int b = 0; b < got; b++)
        PyBuffer_Release(&bufs[b]);
    return result;
}

/* -- seqlocks and publication (docs/shm.md, "Memory ordering") --------------
 *
 * A seqlock reader: load the counter with acquire, copy, acquire fence, load
 * the counter again (relaxed) and compare. The fence orders the copy's loads
 * before the second load; the acquire orders them after the first. A writer:
 * store the odd counter, release fence, write, store the even counter with
 * release. Readers whose copy saw any of the writes synchronise with the
 * writer's fence and so see its odd counter or later: they retry.
 *
 * The copies are relaxed atomic loads (whole words where aligned), so the
 * reader's racy copy is not a data race in the C11 model; the writers here
 * are CPython's memcpy (struct.pack_into, slice assignment) or the plain
 * stores of write_entries, ordered by the fences around them. */

/* Copy n bytes from shared memory with relaxed atomic loads. */
static void
copy_relaxed(char *dst, const char *src, Py_ssize_t n)
{
    while (n > 0 && ((uintptr_t)src & 7)) {
        *dst++ = (char)__atomic_load_n((const unsigned char *)src, __ATOMIC_RELAXED);
        src++;
        n--;
    }
    for (; n >= 8; n -= 8, src += 8, dst += 8) {
        uint64_t w = __atomic_load_n((const uint64_t *)src, __ATOMIC_RELAXED);
        memcpy(dst, &w, 8);
    }
    for (; n > 0; n--)
        *dst++ = (char)__atomic_load_n((const unsigned char *)src++, __ATOMIC_RELAXED);
}

/* check32(off, expected) -> bool: a seqlock reader's closing check (acquire
   fence, then the counter again). */
PyObject *
view_check32(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(2, "check32");
    uint64_t expected;
    uint32_t *p = (uint32_t *)at(self, args[0], 4);
    if (p == NULL || as_u64(args[1], &expected) < 0)
        return NULL;
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return PyBool_FromLong(__atomic_load_n(p, __ATOMIC_RELAXED) == expected);
}

/* check64(off, expected) -> bool: check32 for a 64-bit word (a lease state word). */
PyObject *
view_check64(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(2, "check64");
    uint64_t expected;
    uint64_t *p = (uint64_t *)at(self, args[0], 8);
    if (p == NULL || as_u64(args[1], &expected) < 0)
        return NULL;
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return PyBool_FromLong(__atomic_load_n(p, __ATOMIC_RELAXED) == expected);
}

static int
as_u32(PyObject *obj, uint32_t *out)
{
    uint64_t v;
    if (as_u64(obj, &v) < 0)
        return -1;
    if (v > UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "value does not fit in 32 bits");
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

/* begin32(off, odd): a seqlock writer's opening store, then a release fence:
   no store the caller makes after it is seen before it. */
PyObject *
view_begin32(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(2, "begin32");
    uint32_t v;
    uint32_t *p = (uint32_t *)at(self, args[0], 4);
    if (p == NULL || as_u32(args[1], &v) < 0)
        return NULL;
    __atomic_store_n(p, v, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* release32(off, value): a release store: every store the caller made
   before it is seen by whoever loads this value with acquire. */
PyObject *
view_release32(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(2, "release32");
    uint32_t v;
    uint32_t *p = (uint32_t *)at(self, args[0], 4);
    if (p == NULL || as_u32(args[1], &v) < 0)
        return NULL;
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* read_slot(state_off, slot_off, key_at, inline_key, blocks_off, block_size,
 *           long_blocks, copy_at, record_size, keyed_mask, retries)
 *   -> (word, key, record) or None
 *
 * The lease table's seqlock read of one slot (LeaseTable._stable): the state
 * word (acquire), the key (inline, or continued in its overflow block) and
 * the record copy the word names (copy_at + copy * record_size), then an
 * acquire fence and the word again; retried while it moved. None when the
 * slot is not keyed (its code not in keyed_mask), or did not read steadily
 * in `retries` tries, or its key metadata is out of range. */
PyObject *
view_read_slot(ViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(11, "read_slot");
    Py_ssize_t slot_off, key_at, inline_key, blocks_off, block_size, long_blocks, copy_at,
        record_size, retries;
    uint64_t keyed;
    uint64_t *state = (uint64_t *)at(self, args[0], 8);
    if (state == NULL || as_ssize(args[1], &slot_off) < 0 || as_ssize(args[2], &key_at) < 0 ||
        as_ssize(args[3], &inline_key) < 0 || as_ssize(args[4], &blocks_off) < 0 ||
        as_ssize(args[5], &block_size) < 0 || as_ssize(args[6], &long_blocks) < 0 ||
        as_ssize(args[7], &copy_at) < 0 || as_ssize(args[8], &record_size) < 0 ||
        as_u64(args[9], &keyed) < 0 || as_ssize(args[10], &retries) < 0)
        return NULL;
    Py_ssize_t len = self->view.len;
    if (slot_off < 0 || key_at < 8 || inline_key < 0 || copy_at < key_at + inline_key ||
        record_size <= 0 || slot_off % 8 || slot_off > len - copy_at - 2 * record_size ||
        block_size < 0 || long_blocks < 0 || blocks_off < 0 ||
        (long_blocks > 0 && long_blocks > (len - blocks_off) / (block_size ? block_size : 1))) {
        PyErr_SetString(PyExc_ValueError, "read_slot(): the slot does not fit the buffer");
        return NULL;
    }
    const char *slot = (const char *)self->view.buf + slot_off;
    const char *blocks = (const char *)self->view.buf + blocks_off;
    char key[4096], rec[1024];
    if (inline_key + block_size > (Py_ssize_t)sizeof key || record_size > (Py_ssize_t)sizeof rec) {
        PyErr_SetString(PyExc_ValueError, "read_slot(): key or record too large");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < retries; i++) {
        uint64_t w = __atomic_load_n(state, __ATOMIC_ACQUIRE);
        if (!((keyed >> (w & 15)) & 1))
            Py_RETURN_NONE;
        uint16_t key_len = __atomic_load_n((const uint16_t *)slot, __ATOMIC_RELAXED);
        uint32_t block = __atomic_load_n((const uint32_t *)(slot + 4), __ATOMIC_RELAXED);
        int ok = key_len > 0 && key_len <= inline_key + block_size;
        if (ok && key_len > inline_key)
            ok = block > 0 && (Py_ssize_t)block <= long_blocks;
        if (ok) {
            Py_ssize_t head = key_len < inline_key ? key_len : inline_key;
            copy_relaxed(key, slot + key_at, head);
            if (key_len > inline_key)
                copy_relaxed(key + inline_key, blocks + block_size * (Py_ssize_t)(block - 1),
                             key_len - inline_key);
        }
        Py_ssize_t copy = (Py_ssize_t)((w >> WORD_COPY_SHIFT) & 1);
        copy_relaxed(rec, slot + copy_at + record_size * copy, record_size);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(state, __ATOMIC_RELAXED) == w && ok)
            return Py_BuildValue("(Ky#y#)", (unsigned long long)w, key, (Py_ssize_t)key_len, rec,
                                 record_size);
    }
    Py_RETURN_NONE;
}

/* -- module functions: on any buffer, read-only ones too (the state buffer a
 * group member maps read-only). Each takes the buffer for the call. */

/* The address of `width` bytes at `off` in `view` (aligned to width), or NULL. */
static char *
buf_at(Py_buffer *view, PyObject *off_obj, Py_ssize_t width, Py_ssize_t n)
{
    Py_ssize_t off = PyLong_AsSsize_t(off_obj);
    if (off == -1 && PyErr_Occurred())
        return NULL;
    if (off < 0 || n < 0 || off > view->len - n || (width > 1 && off % width) ||
        ((uintptr_t)view->buf % 8)) {
        PyErr_Format(PyExc_ValueError,
                     "%zd bytes at offset %zd are not aligned to %zd inside the buffer (%zd bytes)",
                     n, off, width, view->len);
        return NULL;
    }
    return (char *)view->buf + off;
}

#define WITH_BUFFER(obj, flags)                                               \
    Py_buffer buffer;                                                         \
    if (PyObject_GetBuffer((obj), &buffer, (flags)) < 0)                      \
        return NULL;

/* acquire32(buffer, off) -> int */
PyObject *
mod_acquire32(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(2, "acquire32");
    WITH_BUFFER(args[0], PyBUF_SIMPLE);
    uint32_t *p = (uint32_t *)buf_at(&buffer, args[1], 4, 4);
    PyObject *out = p ? PyLong_FromUnsignedLong(__atomic_load_n(p, __ATOMIC_ACQUIRE)) : NULL;
    PyBuffer_Release(&buffer);
    return out;
}

/* acquire64(buffer, off) -> int */
PyObject *
mod_acquire64(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(2, "acquire64");
    WITH_BUFFER(args[0], PyBUF_SIMPLE);
    uint64_t *p = (uint64_t *)buf_at(&buffer, args[1], 8, 8);
    PyObject *out =
        p ? PyLong_FromUnsignedLongLong(__atomic_load_n(p, __ATOMIC_ACQUIRE)) : NULL;
    PyBuffer_Release(&buffer);
    return out;
}

/* release32(buffer, off, value): a release store. */
PyObject *
mod_release32(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(3, "release32");
    uint32_t v;
    if (as_u32(args[2], &v) < 0)
        return NULL;
    WITH_BUFFER(args[0], PyBUF_WRITABLE);
    uint32_t *p = (uint32_t *)buf_at(&buffer, args[1], 4, 4);
    if (p != NULL)
        __atomic_store_n(p, v, __ATOMIC_RELEASE);
    PyBuffer_Release(&buffer);
    if (p == NULL)
        return NULL;
    Py_RETURN_NONE;
}

/* seq_copy(buffer, seq_off, off, n) -> (seq, bytes) or None
 *
 * One try of a seqlock read: the u32 counter at seq_off (acquire), None if it
 * is odd; n bytes from off; acquire fence; None if the counter moved. Two
 * copies under one counter are consistent with each other when both return
 * the same seq. */
PyObject *
mod_seq_copy(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(4, "seq_copy");
    Py_ssize_t n;
    if (as_ssize(args[3], &n) < 0)
        return NULL;
    WITH_BUFFER(args[0], PyBUF_SIMPLE);
    PyObject *out = NULL;
    uint32_t *seq_p = (uint32_t *)buf_at(&buffer, args[1], 4, 4);
    const char *src = seq_p ? buf_at(&buffer, args[2], 1, n) : NULL;
    if (src == NULL)
        goto done;
    uint32_t seq = __atomic_load_n(seq_p, __ATOMIC_ACQUIRE);
    if (seq & 1) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    PyObject *data = PyBytes_FromStringAndSize(NULL, n);
    if (data == NULL)
        goto done;
    copy_relaxed(PyBytes_AS_STRING(data), src, n);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (__atomic_load_n(seq_p, __ATOMIC_RELAXED) != seq) {
        Py_DECREF(data);
        out = Py_NewRef(Py_None);
        goto done;
    }
    out = Py_BuildValue("(kN)", (unsigned long)seq, data);
done:
    PyBuffer_Release(&buffer);
    return out;
}

/* seq_write(buffer, seq_off, off, data) -> the new (even) seq
 *
 * The only writer's seqlock write: the counter to the next odd value
 * (relaxed), a release fence, data at off, the counter to the next even value
 * with release. A counter left odd (a writer that died mid-write) goes on to
 * the next odd one. */
PyObject *
mod_seq_write(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    NARGS(4, "seq_write");
    Py_buffer data;
    if (PyObject_GetBuffer(args[3], &data, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *out = NULL;
    Py_buffer buffer;
    if (PyObject_GetBuffer(args[0], &buffer, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    uint32_t *seq_p = (uint32_t *)buf_at(&buffer, args[1], 4, 4);
    char *dst = seq_p ? buf_at(&buffer, args[2], 1, data.len) : NULL;
    if (dst != NULL) {
        uint32_t seq = __atomic_load_n(seq_p, __ATOMIC_RELAXED);
        seq += (seq & 1) ? 2 : 1;
        __atomic_store_n(seq_p, seq, __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_RELEASE);
        memcpy(dst, data.buf, data.len);
        __atomic_store_n(seq_p, seq + 1, __ATOMIC_RELEASE);
        out = PyLong_FromUnsignedLong(seq + 1);
    }
    PyBuffer_Release(&buffer);
    PyBuffer_Release(&data);
    return out;
}
