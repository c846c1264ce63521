/* node.completion.segments._records: a group commit's results in C.
 *
 * encode_results(results) -> (bytes, sizes) | None
 * make_results(cls, items, finished_at) -> [cls]
 * plain_results(cls, results, limit) -> bool
 * plain_items(items, short_key, limit) -> bool
 * offer_dicts(ids, results) -> [dict]
 * lease_entries(buffer, start, size, max_record) -> [(id, lease_id, key)] | None
 *   (a segment's lease evidence for compaction: _records_leases.c)
 *
 * The last four take a step an item out of the ledger's Python (each has a
 * Python reference beside its caller, and tests/unit/test_records_c.py
 * holds the two together); encode_results:
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
#include <structmember.h>
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


/* -- the ledger's group steps ------------------------------------------------------ */

/* Result's fields in the order of its slots' offsets below. */
#define N_FIELDS 9
static PyObject *s_id, *s_result;

/* The offsets of cls's slots for Result's nine fields (a dataclass with
 * slots: each a member descriptor of an object field). -1 and an error set
 * when cls is not of that shape. */
static int field_offsets(PyObject *cls, Py_ssize_t off[N_FIELDS]) {
    PyObject *names[N_FIELDS] = {s_key,       s_job,  s_lease_id, s_version, s_finished_at,
                                 s_cadence_s, s_data, s_encoding, s_id};
    if (!PyType_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, "a class with slots is needed");
        return -1;
    }
    for (int i = 0; i < N_FIELDS; i++) {
        PyObject *d = PyObject_GetAttr(cls, names[i]);
        if (d == NULL)
            return -1;
        int ok = Py_IS_TYPE(d, &PyMemberDescr_Type) &&
                 ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX;
        if (ok)
            off[i] = ((PyMemberDescrObject *)d)->d_member->offset;
        Py_DECREF(d);
        if (!ok) {
            PyErr_Format(PyExc_TypeError, "%R is not a slot of %R", names[i], cls);
            return -1;
        }
    }
    return 0;
}

#define SLOT(obj, off) (*(PyObject **)((char *)(obj) + (off)))

/* base.make_result for each (key, lease_id, data, encoding, job, version,
 * cadence_s) of items, all finished at finished_at, id 0: the slots set as
 * their descriptors set them (the values are taken as they are, as there). */
static PyObject *make_results(PyObject *self, PyObject *args) {
    PyObject *cls, *items, *finished_at;
    if (!PyArg_ParseTuple(args, "OO!O", &cls, &PyList_Type, &items, &finished_at))
        return NULL;
    Py_ssize_t off[N_FIELDS];
    if (field_offsets(cls, off) < 0)
        return NULL;
    PyTypeObject *type = (PyTypeObject *)cls;
    Py_ssize_t n = PyList_GET_SIZE(items);
    PyObject *zero = PyLong_FromLong(0);
    PyObject *out = PyList_New(n);
    if (out == NULL || zero == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *it = PyList_GET_ITEM(items, i);
        if (!PyTuple_CheckExact(it) || PyTuple_GET_SIZE(it) != 7) {
            PyErr_SetString(PyExc_TypeError,
                            "an item is (key, lease_id, data, encoding, job, version, cadence_s)");
            goto fail;
        }
        PyObject *r = type->tp_alloc(type, 0);
        if (r == NULL)
            goto fail;
        /* item order -> field: key 0, lease_id 2, data 6, encoding 7, job 1,
         * version 3, cadence_s 5; then finished_at 4 and id 8. */
        static const int field_of[7] = {0, 2, 6, 7, 1, 3, 5};
        for (int k = 0; k < 7; k++) {
            PyObject *v = PyTuple_GET_ITEM(it, k);
            Py_INCREF(v);
            SLOT(r, off[field_of[k]]) = v;
        }
        Py_INCREF(finished_at);
        SLOT(r, off[4]) = finished_at;
        Py_INCREF(zero);
        SLOT(r, off[8]) = zero;
        PyList_SET_ITEM(out, i, r);
    }
    Py_DECREF(zero);
    return out;
fail:
    Py_XDECREF(zero);
    Py_XDECREF(out);
    return NULL;
}

/* result_checks.plain_results: every result of exactly cls, every field of
 * the exact type check_result wants, and the record small. False is never
 * wrong (the caller then checks each result in full). */
static PyObject *plain_results(PyObject *self, PyObject *args) {
    PyObject *cls, *results;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "OOn", &cls, &results, &limit))
        return NULL;
    if (!PyList_Check(results) && !PyTuple_Check(results))
        Py_RETURN_FALSE;
    Py_ssize_t off[N_FIELDS];
    if (field_offsets(cls, off) < 0)
        return NULL;
    PyObject *seq = results;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **rs = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *r = rs[i];
        if ((PyObject *)Py_TYPE(r) != cls)
            Py_RETURN_FALSE;
        PyObject *key = SLOT(r, off[0]), *job = SLOT(r, off[1]), *lease_id = SLOT(r, off[2]);
        PyObject *version = SLOT(r, off[3]), *finished_at = SLOT(r, off[4]);
        PyObject *cadence_s = SLOT(r, off[5]), *data = SLOT(r, off[6]), *enc = SLOT(r, off[7]);
        if (key == NULL || job == NULL || lease_id == NULL || version == NULL ||
            finished_at == NULL || cadence_s == NULL || data == NULL || enc == NULL)
            Py_RETURN_FALSE;
        if (!PyUnicode_CheckExact(key) || !PyUnicode_CheckExact(job) ||
            !PyLong_CheckExact(lease_id) || !PyLong_CheckExact(version) ||
            !PyFloat_CheckExact(finished_at) || !PyFloat_CheckExact(cadence_s) ||
            !PyBytes_CheckExact(data) || !PyUnicode_CheckExact(enc))
            Py_RETURN_FALSE;
        if (PyUnicode_Compare(enc, s_bytes) != 0 && PyUnicode_Compare(enc, s_json) != 0)
            Py_RETURN_FALSE;
        if (PyBytes_GET_SIZE(data) + PyUnicode_GET_LENGTH(key) + PyUnicode_GET_LENGTH(job) > limit)
            Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* requests.check_items' lean pass: every item a dict with a str key of 1 to
 * short_key characters, an int lease id above 0, bytes result, key and result
 * together at most limit, and an encoding "json" or "bytes". False is never
 * wrong (the caller then checks each item field by field). */
static PyObject *plain_items(PyObject *self, PyObject *args) {
    PyObject *items;
    Py_ssize_t short_key, limit;
    if (!PyArg_ParseTuple(args, "O!nn", &PyList_Type, &items, &short_key, &limit))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(items);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *it = PyList_GET_ITEM(items, i);
        if (!PyDict_CheckExact(it))
            Py_RETURN_FALSE;
        /* Borrowed; NULL when absent. The keys are exact str: no Python runs. */
        PyObject *key = PyDict_GetItemWithError(it, s_key);
        PyObject *lease_id = PyDict_GetItemWithError(it, s_lease_id);
        PyObject *result = PyDict_GetItemWithError(it, s_result);
        PyObject *enc = PyDict_GetItemWithError(it, s_encoding);
        if (PyErr_Occurred())
            return NULL;
        if (key == NULL || lease_id == NULL || result == NULL || enc == NULL)
            Py_RETURN_FALSE;
        if (!PyUnicode_CheckExact(key) || !PyLong_CheckExact(lease_id) ||
            !PyBytes_CheckExact(result) || !PyUnicode_CheckExact(enc))
            Py_RETURN_FALSE;
        Py_ssize_t klen = PyUnicode_GET_LENGTH(key);
        if (klen <= 0 || klen > short_key)
            Py_RETURN_FALSE;
        int overflow = 0;
        long long id = PyLong_AsLongLongAndOverflow(lease_id, &overflow);
        if (id == -1 && PyErr_Occurred())
            return NULL;
        if (overflow < 0 || (overflow == 0 && id <= 0))
            Py_RETURN_FALSE;
        if (PyBytes_GET_SIZE(result) + klen > limit)
            Py_RETURN_FALSE;
        if (PyUnicode_Compare(enc, s_json) != 0 && PyUnicode_Compare(enc, s_bytes) != 0)
            Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* The ledger's offer: {id, key, job, result, encoding, finished_at} for each
 * id and its result (the result's own id is not read: the log's recent
 * results carry 0). */
static PyObject *offer_dicts(PyObject *self, PyObject *args) {
    PyObject *ids, *results;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &ids, &PyList_Type, &results))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(ids);
    if (PyList_GET_SIZE(results) != n) {
        PyErr_SetString(PyExc_ValueError, "offer_dicts: as many results as ids");
        return NULL;
    }
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    PyObject *from[5] = {s_key, s_job, s_data, s_encoding, s_finished_at};
    PyObject *to[5] = {s_key, s_job, s_result, s_encoding, s_finished_at};
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *r = PyList_GET_ITEM(results, i);
        PyObject *d = _PyDict_NewPresized(6);
        if (d == NULL)
            goto fail;
        PyList_SET_ITEM(out, i, d);
        if (PyDict_SetItem(d, s_id, PyList_GET_ITEM(ids, i)) < 0)
            goto fail;
        for (int k = 0; k < 5; k++) {
            PyObject *v = PyObject_GetAttr(r, from[k]);
            if (v == NULL)
                goto fail;
            int bad = PyDict_SetItem(d, to[k], v);
            Py_DECREF(v);
            if (bad < 0)
                goto fail;
        }
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

PyObject *records_lease_entries(PyObject *self, PyObject *args); /* _records_leases.c */

static PyMethodDef methods[] = {
    {"encode_results", encode_results, METH_O,
     "A group's RESULT frames back to back and each one's size; None: encode it in Python."},
    {"make_results", make_results, METH_VARARGS,
     "make_result(key, job, lease_id, version, finished_at, cadence_s, data, encoding) of "
     "each (key, lease_id, data, encoding, job, version, cadence_s)."},
    {"plain_results", plain_results, METH_VARARGS,
     "result_checks.plain_results, for results of exactly cls."},
    {"plain_items", plain_items, METH_VARARGS, "requests.check_items' lean pass."},
    {"offer_dicts", offer_dicts, METH_VARARGS, "The ledger's offer of each id and its result."},
    {"lease_entries", records_lease_entries, METH_VARARGS,
     "(id, lease_id, key) of a segment's results, as SegmentRecovery._results_of reads them; "
     "None: read it in Python."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_records", "A group commit's RESULT records in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__records(void) {
    const char *names[] = {"key",   "job",  "lease_id", "version", "finished_at",
                           "cadence_s", "data", "encoding", "bytes", "json",
                           "id",    "result"};
    PyObject **slots[] = {&s_key,   &s_job,  &s_lease_id, &s_version, &s_finished_at,
                          &s_cadence_s, &s_data, &s_encoding, &s_bytes, &s_json,
                          &s_id,    &s_result};
    for (int i = 0; i < 12; i++) {
        *slots[i] = PyUnicode_InternFromString(names[i]);
        if (*slots[i] == NULL)
            return NULL;
    }
    return PyModule_Create(&module);
}
