/* node.completion.segments._records: a group commit's RESULT records in C.
 *
 * encode_results(results) -> (bytes, sizes) | None
 *
 * ``results`` is a list of (id, Result). The answer is the records' frames
 * back to back, byte for byte what segments/format.py's
 * ``encode_result_record`` writes for each (format 2: the frame's length and
 * crc32, kind 1, the meta's length, the meta's crc32 seeded with the body's
 * length, the meta as msgpack packs it, the data), and each frame's size.
 * None when a result holds anything this encoder does not write exactly as
 * msgpack would (a negative or huge int, an int subclass, a str lease id, an
 * unknown encoding, ...): the caller encodes that group in Python, which
 * also says what is wrong. Only the common shapes are here; the Python
 * encoder stays the reference (tests/unit/test_completion_batch.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <zlib.h>

#define K_RESULT 1
#define FRAME_HEAD 17 /* <IIBII: length, crc, kind, meta length, head crc */
#define RESULT_HEAD 9 /* <BII: kind, meta length, head crc */
#define META_MAX 2400 /* 8 fields: a key of 1,024 bytes, a job of 128, six numbers */

static PyObject *s_key, *s_job, *s_lease_id, *s_version, *s_finished_at, *s_cadence_s,
    *s_data, *s_encoding, *s_bytes, *s_json;

typedef struct {
    unsigned char *p;
    unsigned char *end;
} Out;

static void put_le32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}

static void put_be(unsigned char *p, uint64_t v, int n) {
    for (int i = n - 1; i >= 0; i--) {
        p[i] = (unsigned char)v;
        v >>= 8;
    }
}

/* msgpack's smallest form of a non-negative int (as msgpack-python packs one). */
static int pack_uint(Out *o, PyObject *v) {
    if (!PyLong_CheckExact(v))
        return -1;
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    uint64_t u;
    if (overflow > 0) {
        u = PyLong_AsUnsignedLongLong(v);
        if (u == (uint64_t)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            return -1;
        }
    } else if (overflow < 0 || x < 0) {
        return -1;
    } else {
        u = (uint64_t)x;
    }
    if (o->end - o->p < 9)
        return -1;
    if (u < 128) {
        *o->p++ = (unsigned char)u;
    } else if (u < 256) {
        *o->p++ = 0xcc;
        *o->p++ = (unsigned char)u;
    } else if (u < 65536) {
        *o->p++ = 0xcd;
        put_be(o->p, u, 2);
        o->p += 2;
    } else if (u < 4294967296ULL) {
        *o->p++ = 0xce;
        put_be(o->p, u, 4);
        o->p += 4;
    } else {
        *o->p++ = 0xcf;
        put_be(o->p, u, 8);
        o->p += 8;
    }
    return 0;
}

static int pack_str(Out *o, PyObject *v) {
    if (!PyUnicode_CheckExact(v))
        return -1;
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(v, &n);
    if (s == NULL) {
        PyErr_Clear();
        return -1;
    }
    if (n >= 65536 || o->end - o->p < n + 3)
        return -1;
    if (n < 32) {
        *o->p++ = (unsigned char)(0xa0 | n);
    } else if (n < 256) {
        *o->p++ = 0xd9;
        *o->p++ = (unsigned char)n;
    } else {
        *o->p++ = 0xda;
        put_be(o->p, (uint64_t)n, 2);
        o->p += 2;
    }
    memcpy(o->p, s, (size_t)n);
    o->p += n;
    return 0;
}

/* A float as msgpack's float 64; an exact int as pack_uint does. */
static int pack_number(Out *o, PyObject *v) {
    if (PyFloat_CheckExact(v)) {
        if (o->end - o->p < 9)
            return -1;
        double d = PyFloat_AS_DOUBLE(v);
        uint64_t bits;
        memcpy(&bits, &d, 8);
        *o->p++ = 0xcb;
        put_be(o->p, bits, 8);
        o->p += 8;
        return 0;
    }
    return pack_uint(o, v);
}

typedef struct {
    PyObject *v[8];
} Fields;

static int get_fields(PyObject *r, Fields *f) {
    PyObject *names[8] = {s_key,         s_job,       s_lease_id, s_version,
                          s_finished_at, s_cadence_s, s_data,     s_encoding};
    for (int i = 0; i < 8; i++) {
        f->v[i] = PyObject_GetAttr(r, names[i]);
        if (f->v[i] == NULL) {
            for (int j = 0; j < i; j++)
                Py_DECREF(f->v[j]);
            return -1;
        }
    }
    return 0;
}

static void drop_fields(Fields *f) {
    for (int i = 0; i < 8; i++)
        Py_DECREF(f->v[i]);
}

/* One record into buf (room checked by the caller): its frame's size, or -1
 * when this encoder does not take it. */
static Py_ssize_t encode_one(PyObject *rid, Fields *f, unsigned char *buf, Py_ssize_t room) {
    PyObject *key = f->v[0], *job = f->v[1], *lease_id = f->v[2], *version = f->v[3];
    PyObject *finished_at = f->v[4], *cadence_s = f->v[5], *data = f->v[6], *enc = f->v[7];
    int code;
    if (!PyBytes_CheckExact(data) || !PyUnicode_CheckExact(enc))
        return -1;
    if (PyUnicode_Compare(enc, s_bytes) == 0)
        code = 0;
    else if (PyUnicode_Compare(enc, s_json) == 0)
        code = 1;
    else {
        PyErr_Clear();
        return -1;
    }
    Py_ssize_t dlen = PyBytes_GET_SIZE(data);
    if (room < FRAME_HEAD + META_MAX + dlen)
        return -1;
    unsigned char *meta = buf + FRAME_HEAD;
    Out o = {meta, meta + META_MAX};
    *o.p++ = 0x98; /* fixarray of 8 */
    if (pack_uint(&o, rid) || pack_str(&o, job) || pack_str(&o, key) || pack_uint(&o, lease_id) ||
        pack_uint(&o, version) || pack_number(&o, finished_at) || pack_number(&o, cadence_s))
        return -1;
    *o.p++ = (unsigned char)code;
    uint32_t m = (uint32_t)(o.p - meta);
    uint64_t n64 = (uint64_t)RESULT_HEAD + m + (uint64_t)dlen;
    if (n64 > 0xffffffffULL)
        return -1;
    uint32_t n = (uint32_t)n64;
    uint32_t head_crc = (uint32_t)crc32((uLong)n, meta, m);
    unsigned char *rhead = buf + 8;
    rhead[0] = K_RESULT;
    put_le32(rhead + 1, m);
    put_le32(rhead + 5, head_crc);
    memcpy(meta + m, PyBytes_AS_STRING(data), (size_t)dlen);
    uint32_t body_crc = (uint32_t)crc32(0L, rhead, (uInt)n);
    put_le32(buf, n);
    put_le32(buf + 4, body_crc);
    return 8 + (Py_ssize_t)n;
}

static PyObject *encode_results(PyObject *self, PyObject *arg) {
    if (!PyList_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "encode_results takes a list of (id, Result)");
        return NULL;
    }
    Py_ssize_t count = PyList_GET_SIZE(arg);
    Py_ssize_t cap = 0;
    for (Py_ssize_t i = 0; i < count; i++) { /* room: each data's size plus the most a head takes */
        PyObject *pair = PyList_GET_ITEM(arg, i);
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2)
            Py_RETURN_NONE;
        PyObject *data = PyObject_GetAttr(PyTuple_GET_ITEM(pair, 1), s_data);
        if (data == NULL)
            return NULL;
        Py_ssize_t dlen = PyBytes_CheckExact(data) ? PyBytes_GET_SIZE(data) : -1;
        Py_DECREF(data);
        if (dlen < 0)
            Py_RETURN_NONE;
        cap += FRAME_HEAD + META_MAX + dlen;
    }
    PyObject *sizes = PyList_New(count);
    if (sizes == NULL)
        return NULL;
    unsigned char *buf = PyMem_Malloc(cap ? (size_t)cap : 1);
    if (buf == NULL) {
        Py_DECREF(sizes);
        return PyErr_NoMemory();
    }
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *pair = PyList_GET_ITEM(arg, i);
        Fields f;
        if (get_fields(PyTuple_GET_ITEM(pair, 1), &f) < 0)
            goto fail;
        Py_ssize_t size = encode_one(PyTuple_GET_ITEM(pair, 0), &f, buf + at, cap - at);
        drop_fields(&f);
        if (size < 0)
            goto none;
        PyObject *sz = PyLong_FromSsize_t(size);
        if (sz == NULL)
            goto fail;
        PyList_SET_ITEM(sizes, i, sz);
        at += size;
    }
    PyObject *blob = PyBytes_FromStringAndSize((const char *)buf, at);
    PyMem_Free(buf);
    if (blob == NULL) {
        Py_DECREF(sizes);
        return NULL;
    }
    PyObject *out = PyTuple_Pack(2, blob, sizes);
    Py_DECREF(blob);
    Py_DECREF(sizes);
    return out;
none:
    PyErr_Clear();
    PyMem_Free(buf);
    Py_DECREF(sizes);
    Py_RETURN_NONE;
fail:
    PyMem_Free(buf);
    Py_DECREF(sizes);
    return NULL;
}

static PyMethodDef methods[] = {
    {"encode_results", encode_results, METH_O,
     "A group's RESULT frames back to back and each one's size; None: encode it in Python."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_records", "A group commit's RESULT records in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__records(void) {
    const char *names[] = {"key",       "job",  "lease_id", "version", "finished_at",
                           "cadence_s", "data", "encoding", "bytes",   "json"};
    PyObject **slots[] = {&s_key,       &s_job,  &s_lease_id, &s_version, &s_finished_at,
                          &s_cadence_s, &s_data, &s_encoding, &s_bytes,   &s_json};
    for (int i = 0; i < 10; i++) {
        *slots[i] = PyUnicode_InternFromString(names[i]);
        if (*slots[i] == NULL)
            return NULL;
    }
    return PyModule_Create(&module);
}
