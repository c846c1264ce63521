/* SQLite for the claim path, from the very library Python's sqlite3 module
 * uses: its functions are looked up in the loaded _sqlite3 extension (and
 * what it links), never in another copy (why: shm/_claim_path.c). */

#include "_claim_path.h"

#include <dlfcn.h>

struct sqlite_api sq;

int
load_sqlite(const char *module)
{
    if (sq.loaded)
        return 0;
    void *h = dlopen(module, RTLD_NOW | RTLD_NOLOAD);
    if (h == NULL) {
        PyErr_Format(PyExc_ImportError, "ClaimPath: %s is not loaded: %s",
                     module ? module : "the interpreter", dlerror());
        return -1;
    }
#define FIND(field, name)                                                            \
    do {                                                                             \
        *(void **)(&sq.field) = dlsym(h, name);                                      \
        if (sq.field == NULL) {                                                      \
            PyErr_Format(PyExc_ImportError, "ClaimPath: no %s in %s", name,          \
                         module ? module : "the interpreter");                       \
            return -1;                                                               \
        }                                                                            \
    } while (0)
    FIND(open_v2, "sqlite3_open_v2");
    FIND(close_v2, "sqlite3_close_v2");
    FIND(prepare_v2, "sqlite3_prepare_v2");
    FIND(bind_text, "sqlite3_bind_text");
    FIND(bind_int64, "sqlite3_bind_int64");
    FIND(step, "sqlite3_step");
    FIND(reset, "sqlite3_reset");
    FIND(finalize, "sqlite3_finalize");
    FIND(column_type, "sqlite3_column_type");
    FIND(column_int64, "sqlite3_column_int64");
    FIND(column_double, "sqlite3_column_double");
    FIND(column_text, "sqlite3_column_text");
    FIND(column_blob, "sqlite3_column_blob");
    FIND(column_bytes, "sqlite3_column_bytes");
    FIND(busy_timeout, "sqlite3_busy_timeout");
    FIND(errmsg, "sqlite3_errmsg");
    FIND(errcode, "sqlite3_errcode");
    FIND(exec, "sqlite3_exec");
    FIND(get_autocommit, "sqlite3_get_autocommit");
#undef FIND
    sq.loaded = 1; /* the handle stays open: the module never unloads */
    return 0;
}

PyObject *RowError;

void
set_row_error(ClaimPathObject *self)
{
    int code = sq.errcode(self->db);
    PyObject *v = Py_BuildValue("(is)", code, sq.errmsg(self->db));
    if (v != NULL) {
        PyErr_SetObject(RowError, v);
        Py_DECREF(v);
    }
}
