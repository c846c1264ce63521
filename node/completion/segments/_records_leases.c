/* node.completion.segments._records.lease_entries: a segment's lease
 * evidence read back in C, for compaction's summary of a segment it removes
 * (recovery.py, SegmentRecovery._results_of, is the reference; the ledger
 * compacts on its loop, and reading a 64 MiB segment's metas in Python held
 * the loop for about half a second: docs/performance.md, "Compaction's read
 * of a segment in C").
 *
 * lease_entries(buffer, start, size, max_record) -> [(id, lease_id, key)] | None
 *
 * Walks the frames of ``buffer[start:size]`` as _results_of does: a frame
 * whose length is 0, over ``max_record`` or past ``size`` ends the walk; a
 * format-2 RESULT (kind 1) whose meta fits the frame and passes its crc
 * (crc32 of the meta seeded with the frame's length) gives (id, lease_id,
 * key) from the meta's first four fields; any other frame is passed over
 * when its body fails its crc. None when the walk meets what this reader
 * does not read exactly as msgpack would (a body that passes its crc in a
 * frame of another kind: a format-1 record; a meta of other shapes or types;
 * a key that is not UTF-8): the caller reads the segment in Python. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <zlib.h>

#define LE_K_RESULT 1
#define LE_FRAME 8       /* <II: length, crc */
#define LE_FRAME_HEAD 17 /* <IIBII: the frame, kind, meta length, head crc */

static uint32_t
le32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t
be(const unsigned char *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = v << 8 | p[i];
    return v;
}

typedef struct {
    const unsigned char *p, *end;
} In;

/* A msgpack int (either sign) into *v: 0, or -1 when the next object is not one. */
static int
read_int(In *in, long long *v)
{
    if (in->p >= in->end)
        return -1;
    unsigned char t = *in->p++;
    int n = 0, sign = 0;
    if (t <= 0x7f) {
        *v = t;
        return 0;
    }
    if (t >= 0xe0) {
        *v = (signed char)t;
        return 0;
    }
    switch (t) {
    case 0xcc: n = 1; break;
    case 0xcd: n = 2; break;
    case 0xce: n = 4; break;
    case 0xcf: n = 8; break;
    case 0xd0: n = 1; sign = 1; break;
    case 0xd1: n = 2; sign = 1; break;
    case 0xd2: n = 4; sign = 1; break;
    case 0xd3: n = 8; sign = 1; break;
    default: return -1;
    }
    if (in->end - in->p < n)
        return -1;
    uint64_t u = be(in->p, n);
    in->p += n;
    if (sign) {
        int shift = 64 - 8 * n;
        *v = (long long)(u << shift) >> shift;
    } else {
        if (u > (uint64_t)LLONG_MAX)
            return -1;
        *v = (long long)u;
    }
    return 0;
}

/* A msgpack str: its bytes and length, -1 when the next object is not one. */
static int
read_str(In *in, const unsigned char **s, Py_ssize_t *len)
{
    if (in->p >= in->end)
        return -1;
    unsigned char t = *in->p++;
    Py_ssize_t n;
    if (t >= 0xa0 && t <= 0xbf)
        n = t & 0x1f;
    else if (t == 0xd9 || t == 0xda || t == 0xdb) {
        int w = t == 0xd9 ? 1 : t == 0xda ? 2 : 4;
        if (in->end - in->p < w)
            return -1;
        n = (Py_ssize_t)be(in->p, w);
        in->p += w;
    } else
        return -1;
    if (in->end - in->p < n)
        return -1;
    *s = in->p;
    *len = n;
    in->p += n;
    return 0;
}

/* Past one scalar object (nil, bool, int, float, str, bin): 0, or -1. */
static int
skip_scalar(In *in)
{
    if (in->p >= in->end)
        return -1;
    unsigned char t = *in->p;
    if (t == 0xc0 || t == 0xc2 || t == 0xc3) {
        in->p++;
        return 0;
    }
    if (t == 0xca || t == 0xcb) {
        int n = t == 0xca ? 4 : 8;
        if (in->end - in->p < 1 + n)
            return -1;
        in->p += 1 + n;
        return 0;
    }
    if (t == 0xc4 || t == 0xc5 || t == 0xc6) {
        int w = t == 0xc4 ? 1 : t == 0xc5 ? 2 : 4;
        if (in->end - in->p < 1 + w)
            return -1;
        Py_ssize_t n = (Py_ssize_t)be(in->p + 1, w);
        if (in->end - in->p - 1 - w < n)
            return -1;
        in->p += 1 + w + n;
        return 0;
    }
    long long ignored;
    const unsigned char *s;
    Py_ssize_t n;
    In probe = *in;
    if (read_int(&probe, &ignored) == 0) {
        *in = probe;
        return 0;
    }
    probe = *in;
    if (read_str(&probe, &s, &n) == 0) {
        *in = probe;
        return 0;
    }
    return -1;
}

/* (id, lease_id, key) of a meta, NULL with no error set when it is not of
   the shape this reader takes, NULL with an error set when Python failed. */
static PyObject *
entry_of(const unsigned char *meta, Py_ssize_t len)
{
    In in = {meta, meta + len};
    if (len < 1)
        return NULL;
    unsigned char t = *in.p++;
    Py_ssize_t fields;
    if (t >= 0x90 && t <= 0x9f)
        fields = t & 0x0f;
    else if (t == 0xdc && len >= 3) {
        fields = (Py_ssize_t)be(in.p, 2);
        in.p += 2;
    } else
        return NULL;
    long long rid, lease_id;
    const unsigned char *job, *key;
    Py_ssize_t job_n, key_n;
    if (fields < 4 || read_int(&in, &rid) < 0 || read_str(&in, &job, &job_n) < 0 ||
        read_str(&in, &key, &key_n) < 0 || read_int(&in, &lease_id) < 0)
        return NULL;
    for (Py_ssize_t i = 4; i < fields; i++)
        if (skip_scalar(&in) < 0)
            return NULL;
    if (in.p != in.end)
        return NULL; /* bytes after the meta: msgpack would refuse it */
    PyObject *k = PyUnicode_DecodeUTF8((const char *)key, key_n, NULL);
    if (k == NULL) {
        if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
            PyErr_Clear();
        return NULL;
    }
    return Py_BuildValue("(LLN)", rid, lease_id, k);
}

PyObject *
records_lease_entries(PyObject *self, PyObject *args)
{
    PyObject *buffer;
    Py_ssize_t start, size, max_record;
    if (!PyArg_ParseTuple(args, "Onnn", &buffer, &start, &size, &max_record))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(buffer, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        goto done;
    if (start < 0 || size > view.len)
        size = -1; /* nothing read: the caller's reader says what is wrong */
    const unsigned char *b = view.buf;
    Py_ssize_t off = start;
    while (size >= 0 && off + LE_FRAME_HEAD <= size) {
        uint32_t ln = le32(b + off), crc = le32(b + off + 4);
        Py_ssize_t end = off + LE_FRAME + (Py_ssize_t)ln;
        if (ln == 0 || (Py_ssize_t)ln > max_record || end > size)
            break;
        unsigned char kind = b[off + 8];
        if (kind == LE_K_RESULT) {
            uint32_t meta_len = le32(b + off + 9), meta_crc = le32(b + off + 13);
            const unsigned char *meta = b + off + LE_FRAME_HEAD;
            if (LE_FRAME_HEAD + (Py_ssize_t)meta_len <= LE_FRAME + (Py_ssize_t)ln &&
                (uint32_t)crc32(ln, meta, meta_len) == meta_crc) {
                PyObject *entry = entry_of(meta, meta_len);
                if (entry == NULL) {
                    if (!PyErr_Occurred())
                        goto fallback;
                    Py_CLEAR(out);
                    goto done;
                }
                int failed = PyList_Append(out, entry);
                Py_DECREF(entry);
                if (failed) {
                    Py_CLEAR(out);
                    goto done;
                }
            }
        } else if ((uint32_t)crc32(0, b + off + LE_FRAME, ln) == crc) {
            /* A whole record of another kind: a retirement (format 2), or a
               format-1 result that the Python reader reads. */
            In in = {b + off + LE_FRAME, b + end};
            unsigned char t = *in.p++;
            long long first;
            if (!((t >= 0x90 && t <= 0x9f) || t == 0xdc || t == 0xdd) ||
                (t == 0xdc && (in.p += 2) > in.end) || (t == 0xdd && (in.p += 4) > in.end) ||
                read_int(&in, &first) < 0 || first == LE_K_RESULT)
                goto fallback;
        }
        off = end;
    }
    goto done;
fallback:
    Py_CLEAR(out);
    out = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&view);
    return out;
}
