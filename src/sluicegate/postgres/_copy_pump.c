/* The copy's row pump in C: `COPY … TO STDOUT` on one libpq connection straight into `COPY … FROM STDIN` on
 * another, the GIL released, no Python object per row (postgres/passthrough.py).
 *
 * The connections are psycopg2's (`connection.pgconn_ptr`), so the libpq functions must be the very library
 * psycopg2 loaded: they are looked up in it by path (dlopen RTLD_NOLOAD), never linked at build time. The
 * caller has opened each side's transaction through psycopg2 and commits or rolls back through it after.
 *
 * pump(source_ptr, target_ptr, libpq_path, select, insert) -> (ok, side, sqlstate, message, rows)
 *   ok: both COPYs ended well (rows: what the target took); else side is "source" or "target" and sqlstate
 *   (None when the connection itself failed) and message say why. After a failure the connections may be
 *   in the middle of a COPY: the caller closes them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

typedef struct pg_conn PGconn;
typedef struct pg_result PGresult;
/* ExecStatusType values (libpq-fe.h), stable since PostgreSQL 7.4 */
enum { PGRES_COMMAND_OK = 1, PGRES_COPY_OUT = 3, PGRES_COPY_IN = 4 };
#define PG_DIAG_SQLSTATE 'C'

static struct {
    void *handle;
    PGresult *(*exec)(PGconn *, const char *);
    int (*result_status)(const PGresult *);
    void (*clear)(PGresult *);
    int (*get_copy_data)(PGconn *, char **, int);
    int (*put_copy_data)(PGconn *, const char *, int);
    int (*put_copy_end)(PGconn *, const char *);
    PGresult *(*get_result)(PGconn *);
    void (*freemem)(void *);
    char *(*error_message)(const PGconn *);
    char *(*result_error_message)(const PGresult *);
    char *(*result_error_field)(const PGresult *, int);
    char *(*cmd_tuples)(PGresult *);
} pq;

static int load(const char *path) {
    void *h = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (h == NULL)
        return 0;
#define SYM(field, name) if ((*(void **)&pq.field = dlsym(h, name)) == NULL) return 0
    SYM(exec, "PQexec");
    SYM(result_status, "PQresultStatus");
    SYM(clear, "PQclear");
    SYM(get_copy_data, "PQgetCopyData");
    SYM(put_copy_data, "PQputCopyData");
    SYM(put_copy_end, "PQputCopyEnd");
    SYM(get_result, "PQgetResult");
    SYM(freemem, "PQfreemem");
    SYM(error_message, "PQerrorMessage");
    SYM(result_error_message, "PQresultErrorMessage");
    SYM(result_error_field, "PQresultErrorField");
    SYM(cmd_tuples, "PQcmdTuples");
#undef SYM
    pq.handle = h;
    return 1;
}

typedef struct {
    const char *side;
    char sqlstate[6];
    int has_state;
    char message[1024];
} failure;

static void fail_conn(failure *f, const char *side, PGconn *conn) {
    f->side = side;
    f->has_state = 0;
    snprintf(f->message, sizeof f->message, "%s", pq.error_message(conn));
}

static void fail_result(failure *f, const char *side, PGconn *conn, PGresult *res) {
    const char *state = res ? pq.result_error_field(res, PG_DIAG_SQLSTATE) : NULL;
    const char *msg = res ? pq.result_error_message(res) : NULL;
    f->side = side;
    f->has_state = state != NULL;
    if (state != NULL)
        snprintf(f->sqlstate, sizeof f->sqlstate, "%s", state);
    snprintf(f->message, sizeof f->message, "%s", (msg && *msg) ? msg : pq.error_message(conn));
}

/* The result of a finished command, the rest drained; 1 if it was `want`. */
static int finish(PGconn *conn, int want, failure *f, const char *side, long long *rows) {
    PGresult *res = pq.get_result(conn);
    int ok = res != NULL && pq.result_status(res) == want;
    if (ok && rows != NULL)
        *rows = atoll(pq.cmd_tuples(res));
    if (!ok)
        fail_result(f, side, conn, res);
    if (res != NULL)
        pq.clear(res);
    while ((res = pq.get_result(conn)) != NULL)
        pq.clear(res);
    return ok;
}

static int start(PGconn *conn, const char *query, int want, failure *f, const char *side) {
    PGresult *res = pq.exec(conn, query);
    int ok = res != NULL && pq.result_status(res) == want;
    if (!ok)
        fail_result(f, side, conn, res);
    if (res != NULL)
        pq.clear(res);
    return ok;
}

/* Rows go to the target in CopyData messages of up to BATCH bytes, not one message per row: the COPY data stream
 * has no row boundaries, and a ~100-byte row per message cost the pump a libpq call (and every ~80 rows a send)
 * and the target backend a protocol message each. */
#define BATCH (1 << 16)

static int put(PGconn *dst, const char *data, size_t len, failure *f) {
    if (len > 0 && pq.put_copy_data(dst, data, (int)len) != 1) {
        fail_conn(f, "target", dst);
        return 0;
    }
    return 1;
}

/* The source's rows into the target's COPY, in batches; 0 on a failure, with the side in `f`. */
static int pipe_rows(PGconn *src, PGconn *dst, failure *f) {
    char batch[BATCH];
    size_t used = 0;
    for (;;) {
        char *buf = NULL;
        int n = pq.get_copy_data(src, &buf, 0);
        if (n == -1)  /* the source's COPY is over: did it end well? */
            return finish(src, PGRES_COMMAND_OK, f, "source", NULL) && put(dst, batch, used, f);
        if (n < 0) {  /* -2: the source's connection failed */
            fail_conn(f, "source", src);
            return 0;
        }
        int ok = 1;
        if (used + (size_t)n > BATCH) {
            ok = put(dst, batch, used, f);
            used = 0;
        }
        if (ok && (size_t)n >= BATCH)  /* a row as big as a batch goes alone */
            ok = put(dst, buf, (size_t)n, f);
        else if (ok) {
            memcpy(batch + used, buf, (size_t)n);
            used += (size_t)n;
        }
        pq.freemem(buf);
        if (!ok)
            return 0;
    }
}

static int run(PGconn *src, PGconn *dst, const char *select, const char *insert, failure *f, long long *rows) {
    if (!start(src, select, PGRES_COPY_OUT, f, "source"))
        return 0;
    if (!start(dst, insert, PGRES_COPY_IN, f, "target"))
        return 0;  /* the source is left mid-COPY: the caller closes it */
    if (!pipe_rows(src, dst, f)) {
        if (strcmp(f->side, "source") == 0) {  /* end the target's COPY as failed: it keeps nothing */
            pq.put_copy_end(dst, "the source failed");
            finish(dst, PGRES_COMMAND_OK, &(failure){0}, "target", NULL);
        }
        return 0;
    }
    if (pq.put_copy_end(dst, NULL) != 1) {
        fail_conn(f, "target", dst);
        return 0;
    }
    return finish(dst, PGRES_COMMAND_OK, f, "target", rows);
}

static PyObject *pump(PyObject *self, PyObject *args) {
    unsigned long long src_ptr, dst_ptr;
    const char *path, *select, *insert;
    if (!PyArg_ParseTuple(args, "KKsss", &src_ptr, &dst_ptr, &path, &select, &insert))
        return NULL;
    if (pq.handle == NULL && !load(path)) {
        PyErr_Format(PyExc_RuntimeError, "libpq not usable at %s", path);
        return NULL;
    }
    failure f = {0};
    long long rows = 0;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = run((PGconn *)(uintptr_t)src_ptr, (PGconn *)(uintptr_t)dst_ptr, select, insert, &f, &rows);
    Py_END_ALLOW_THREADS
    if (ok)
        return Py_BuildValue("(OOOsL)", Py_True, Py_None, Py_None, "", rows);
    PyObject *state = f.has_state ? PyUnicode_FromString(f.sqlstate) : (Py_INCREF(Py_None), Py_None);
    PyObject *out = Py_BuildValue("(OsNsL)", Py_False, f.side, state, f.message, (long long)0);
    return out;
}

static PyMethodDef methods[] = {
    {"pump", pump, METH_VARARGS, "Pipe a COPY TO STDOUT on one connection into a COPY FROM STDIN on another."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copy_pump", NULL, -1, methods};

PyMODINIT_FUNC PyInit__copy_pump(void) { return PyModule_Create(&module); }
