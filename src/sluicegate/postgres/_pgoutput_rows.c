/* The replay's hot path in C: a pgoutput Insert, Update or Delete message as (kind, relation oid, old, new),
 * a row change staged in the applier's net effect (stage_change, and RowSink straight from the message), and
 * the applier's staged rows as COPY text (copy_lines).
 *
 * Same result as pgoutput._decode_row_py, about five times faster. It decodes only well-formed messages:
 * for anything else (truncated, unknown marker or value kind, bad UTF-8, trailing bytes) it returns None,
 * and the Python decoder, which says exactly what is wrong, takes over. Pure: bytes in, values out.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <structmember.h>

static PyObject *KIND_I, *KIND_U, *KIND_D;
static PyObject *S_ROWS, *S_KEY_INDICES, *S_PENDING_ROWS, *S_PENDING_BYTES, *S_CHUNK_DUE;

static inline uint32_t be32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}

/* TupleData at *off: Int16 count, then per column a kind byte and, for 't'/'b', Int32 length + bytes.
 * A new tuple, or NULL with no exception set when the bytes are not well-formed (or with one set on
 * memory errors). */
static PyObject *tuple_at(const unsigned char *buf, Py_ssize_t len, Py_ssize_t *off, PyObject *unchanged) {
    Py_ssize_t o = *off;
    if (o + 2 > len) return NULL;
    Py_ssize_t n = ((Py_ssize_t)buf[o] << 8) | buf[o + 1];
    o += 2;
    PyObject *values = PyTuple_New(n);
    if (values == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (o >= len) goto malformed;
        unsigned char kind = buf[o];
        PyObject *v;
        if (kind == 't' || kind == 'b') {
            if (o + 5 > len) goto malformed;
            Py_ssize_t size = (Py_ssize_t)be32(buf + o + 1);
            Py_ssize_t start = o + 5;
            if (size > len - start) goto malformed;
            if (kind == 't') {
                v = PyUnicode_DecodeUTF8((const char *)buf + start, size, NULL);
                if (v == NULL) {
                    if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) goto failed;
                    PyErr_Clear();
                    goto malformed;
                }
            } else {
                v = PyBytes_FromStringAndSize((const char *)buf + start, size);
                if (v == NULL) goto failed;
            }
            o = start + size;
        } else if (kind == 'n') {
            v = Py_None;
            Py_INCREF(v);
            o += 1;
        } else if (kind == 'u') {
            v = unchanged;
            Py_INCREF(v);
            o += 1;
        } else {
            goto malformed;
        }
        PyTuple_SET_ITEM(values, i, v);
    }
    *off = o;
    return values;
malformed:
    Py_DECREF(values);
    return NULL;
failed:
    Py_DECREF(values);
    return NULL;
}

static PyObject *row(PyObject *kind, uint32_t relid, PyObject *old, PyObject *new) {
    PyObject *oid = PyLong_FromUnsignedLong(relid);
    if (oid == NULL) {
        Py_XDECREF(old);
        Py_XDECREF(new);
        return NULL;
    }
    if (old == NULL) { old = Py_None; Py_INCREF(old); }
    if (new == NULL) { new = Py_None; Py_INCREF(new); }
    Py_INCREF(kind);
    PyObject *out = PyTuple_New(4);
    if (out == NULL) {
        Py_DECREF(kind); Py_DECREF(oid); Py_DECREF(old); Py_DECREF(new);
        return NULL;
    }
    PyTuple_SET_ITEM(out, 0, kind);
    PyTuple_SET_ITEM(out, 1, oid);
    PyTuple_SET_ITEM(out, 2, old);
    PyTuple_SET_ITEM(out, 3, new);
    return out;
}

/* An Insert, Update or Delete message in buf[0:len]: its kind (KIND_*, borrowed) and its old and new rows (new
 * references, NULL when the message has none). 1; 0 with no exception set when the message is not
 * well-formed; -1 with one set on memory errors. */
static int parse_row(const unsigned char *buf, Py_ssize_t len, PyObject *unchanged, PyObject **kind,
                     PyObject **old, PyObject **new) {
    Py_ssize_t off = 6;
    *kind = *old = *new = NULL;
    if (len < 6) return 0;
    unsigned char marker = buf[5];
    switch (buf[0]) {
    case 'I':
        if (marker != 'N') return 0;
        *kind = KIND_I;
        if ((*new = tuple_at(buf, len, &off, unchanged)) == NULL) goto malformed;
        break;
    case 'U':
        *kind = KIND_U;
        if (marker == 'K' || marker == 'O') {
            if ((*old = tuple_at(buf, len, &off, unchanged)) == NULL) goto malformed;
            if (off >= len || buf[off] != 'N') goto malformed;
            off += 1;
        } else if (marker != 'N') {
            return 0;
        }
        if ((*new = tuple_at(buf, len, &off, unchanged)) == NULL) goto malformed;
        break;
    case 'D':
        if (marker != 'K' && marker != 'O') return 0;
        *kind = KIND_D;
        if ((*old = tuple_at(buf, len, &off, unchanged)) == NULL) goto malformed;
        break;
    default:
        return 0;
    }
    if (off == len) return 1;
malformed:
    Py_CLEAR(*old);
    Py_CLEAR(*new);
    return PyErr_Occurred() ? -1 : 0;
}

/* decode_row(data: bytes, unchanged) -> (kind, relation oid, old, new) | None */
static PyObject *decode_row(PyObject *self, PyObject *args) {
    Py_buffer view;
    PyObject *unchanged, *kind, *old, *new;
    if (!PyArg_ParseTuple(args, "y*O", &view, &unchanged)) return NULL;
    const unsigned char *buf = view.buf;
    int parsed = parse_row(buf, view.len, unchanged, &kind, &old, &new);
    PyObject *out = parsed == 1 ? row(kind, be32(buf + 1), old, new) : NULL;
    PyBuffer_Release(&view);
    if (parsed == 0) Py_RETURN_NONE;  /* the Python decoder says what is wrong */
    return out;  /* NULL: out of memory, not a decoding matter */
}

/* ---- a row change into the applier's net effect (appliers/postgres.PostgresApplier.change) ---- */

/* The key of `values` at `key` (a tuple of column positions), as a new tuple; NULL with no exception set
 * when a position is not an int within `values`. */
static PyObject *key_of(PyObject *values, PyObject *key) {
    Py_ssize_t n = PyTuple_GET_SIZE(key), width = PyTuple_GET_SIZE(values);
    PyObject *out = PyTuple_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pos = PyTuple_GET_ITEM(key, i);
        Py_ssize_t at = PyLong_Check(pos) ? PyLong_AsSsize_t(pos) : -1;
        if (at < 0 || at >= width) {
            PyErr_Clear();
            Py_DECREF(out);
            return NULL;
        }
        PyObject *v = PyTuple_GET_ITEM(values, at);
        Py_INCREF(v);
        PyTuple_SET_ITEM(out, i, v);
    }
    return out;
}

/* rows[key of values] = (op, values, None): 1; 0 (rows untouched) when `key` does not fit `values`; -1 with
 * an exception set on errors. */
static int stage_into(PyObject *rows, PyObject *key, PyObject *op, PyObject *values) {
    PyObject *k = key_of(values, key);
    if (k == NULL) return PyErr_Occurred() ? -1 : 0;
    PyObject *entry = PyTuple_Pack(3, op, values, Py_None);
    if (entry == NULL) {
        Py_DECREF(k);
        return -1;
    }
    int failed = PyDict_SetItem(rows, k, entry);
    Py_DECREF(k);
    Py_DECREF(entry);
    return failed ? -1 : 1;
}

/* The common cases of PostgresApplier.change (its _stage), with the same result: an insert, or an update that
 * carries every value and no old row (its key unchanged): rows[key of new] = ("U", new, None); a delete:
 * rows[key of old] = ("D", old, None). 1 when staged; 0, rows untouched, for anything else (an update with an
 * old row, an unchanged TOAST value, values not a tuple): Python's path handles it; -1 on errors. */
static int stage_row(PyObject *rows, PyObject *key, PyObject *kind, PyObject *old, PyObject *new,
                     PyObject *unchanged) {
    PyObject *op, *values;
    if (kind == KIND_D) {
        op = KIND_D;
        values = old;
    } else if ((kind == KIND_I || kind == KIND_U) && (old == NULL || old == Py_None)) {
        op = KIND_U;
        values = new;
    } else {
        return 0;
    }
    if (values == NULL || !PyTuple_CheckExact(values)) return 0;
    if (kind == KIND_U)  /* an insert carries every value; an update may leave a TOAST value out */
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(values); i++)
            if (PyTuple_GET_ITEM(values, i) == unchanged) return 0;
    return stage_into(rows, key, op, values);
}

/* stage_change(rows, key, change, unchanged) -> bool: stage_row for a Change; False (rows untouched) for what
 * stage_row leaves to Python, or anything not a Change's shape. */
static PyObject *stage_change(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "stage_change(rows, key, change, unchanged)");
        return NULL;
    }
    PyObject *rows = args[0], *key = args[1], *change = args[2], *unchanged = args[3];
    if (!PyDict_CheckExact(rows) || !PyTuple_CheckExact(key) || !PyTuple_Check(change) ||
        PyTuple_GET_SIZE(change) < 4)
        Py_RETURN_FALSE;
    int staged = stage_row(rows, key, PyTuple_GET_ITEM(change, 0), PyTuple_GET_ITEM(change, 2),
                           PyTuple_GET_ITEM(change, 3), unchanged);
    if (staged < 0) return NULL;
    return PyBool_FromLong(staged);
}

/* ---- RowSink: a row message of an ordinary transaction straight into the applier's net effect ----
 *
 * assemble (assembler.py) offers it each Insert, Update or Delete message of an ordinary transaction before
 * decoding one itself: take(data) stages what PostgresApplier.change would stage for the Change, counts it
 * as change does (asking the applier's chunk_due at its step limits), and returns True; or returns False, touching
 * nothing, and the message goes the usual way (a Change to the player and the applier). It parses as
 * decode_row does and takes only what stage_row stages, only while `active` (the player clears it for
 * transactions already applied), and only for a relation whose Relation message the applier has already
 * checked: the applier's memo (_rels) holds that very Relation with its table. */

typedef struct {
    PyObject_HEAD
    PyObject *applier;    /* the PostgresApplier: pending_rows, pending_bytes, chunk_due() */
    PyObject *relations;  /* assemble's Framing.relations: oid -> the Relation in force */
    PyObject *targets;    /* the applier's _rels: oid -> (Relation, TargetTable or None) */
    PyObject *unchanged;
    Py_ssize_t step_rows, step_bytes;
    char active;
    Py_ssize_t taken;
} RowSink;

static int sink_init(RowSink *self, PyObject *args, PyObject *kwds) {
    PyObject *applier, *relations, *targets, *unchanged;
    Py_ssize_t step_rows, step_bytes;
    if (!PyArg_ParseTuple(args, "OO!O!Onn:RowSink", &applier, &PyDict_Type, &relations, &PyDict_Type, &targets,
                          &unchanged, &step_rows, &step_bytes))
        return -1;
    Py_INCREF(applier); Py_XSETREF(self->applier, applier);
    Py_INCREF(relations); Py_XSETREF(self->relations, relations);
    Py_INCREF(targets); Py_XSETREF(self->targets, targets);
    Py_INCREF(unchanged); Py_XSETREF(self->unchanged, unchanged);
    self->step_rows = step_rows;
    self->step_bytes = step_bytes;
    self->active = 0;
    self->taken = 0;
    return 0;
}

static int sink_traverse(RowSink *self, visitproc visit, void *arg) {
    Py_VISIT(self->applier);
    Py_VISIT(self->relations);
    Py_VISIT(self->targets);
    Py_VISIT(self->unchanged);
    return 0;
}

static int sink_clear(RowSink *self) {
    Py_CLEAR(self->applier);
    Py_CLEAR(self->relations);
    Py_CLEAR(self->targets);
    Py_CLEAR(self->unchanged);
    return 0;
}

static void sink_dealloc(RowSink *self) {
    PyObject_GC_UnTrack(self);
    sink_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* attr += by, as a Py_ssize_t; the new value, or -1 with an exception set. */
static Py_ssize_t add_to(PyObject *obj, PyObject *attr, Py_ssize_t by) {
    PyObject *v = PyObject_GetAttr(obj, attr);
    if (v == NULL) return -1;
    Py_ssize_t n = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    if (n == -1 && PyErr_Occurred()) return -1;
    n += by;
    v = PyLong_FromSsize_t(n);
    if (v == NULL) return -1;
    int failed = PyObject_SetAttr(obj, attr, v);
    Py_DECREF(v);
    return failed ? -1 : n;
}

/* The target table's staged rows and key positions for the message's relation, as new references; 0 when
 * the applier has not checked this Relation (or does not replicate it); -1 on errors. */
static int sink_target(RowSink *self, uint32_t relid, PyObject **rows, PyObject **key) {
    PyObject *oid = PyLong_FromUnsignedLong(relid);
    if (oid == NULL) return -1;
    PyObject *rel = PyDict_GetItemWithError(self->relations, oid);
    PyObject *hit = rel != NULL ? PyDict_GetItemWithError(self->targets, oid) : NULL;
    Py_DECREF(oid);
    if (hit == NULL) return PyErr_Occurred() ? -1 : 0;
    if (!PyTuple_Check(hit) || PyTuple_GET_SIZE(hit) != 2 || PyTuple_GET_ITEM(hit, 0) != rel ||
        PyTuple_GET_ITEM(hit, 1) == Py_None)
        return 0;
    PyObject *target = PyTuple_GET_ITEM(hit, 1);
    Py_INCREF(target);  /* held while its attributes are read */
    *rows = PyObject_GetAttr(target, S_ROWS);
    *key = *rows != NULL ? PyObject_GetAttr(target, S_KEY_INDICES) : NULL;
    Py_DECREF(target);
    if (*key == NULL) {
        Py_CLEAR(*rows);
        return -1;
    }
    if (!PyDict_CheckExact(*rows) || !PyTuple_CheckExact(*key)) {
        Py_CLEAR(*rows);
        Py_CLEAR(*key);
        return 0;
    }
    return 1;
}

static PyObject *sink_take(RowSink *self, PyObject *data) {
    if (!self->active || !PyBytes_CheckExact(data)) Py_RETURN_FALSE;
    const unsigned char *buf = (const unsigned char *)PyBytes_AS_STRING(data);
    Py_ssize_t len = PyBytes_GET_SIZE(data);
    if (len < 6) Py_RETURN_FALSE;
    PyObject *rows, *key, *kind, *old, *new;
    int found = sink_target(self, be32(buf + 1), &rows, &key);
    if (found <= 0) {
        if (found < 0) return NULL;
        Py_RETURN_FALSE;
    }
    int staged = parse_row(buf, len, self->unchanged, &kind, &old, &new);
    if (staged == 1) {
        staged = stage_row(rows, key, kind, old, new, self->unchanged);
        Py_XDECREF(old);
        Py_XDECREF(new);
    }
    Py_DECREF(rows);
    Py_DECREF(key);
    if (staged < 0) return NULL;
    if (staged == 0) Py_RETURN_FALSE;
    self->taken++;
    /* Counted as PostgresApplier.change counts a Change (its size: the message's length). */
    Py_ssize_t pending_rows = add_to(self->applier, S_PENDING_ROWS, 1);
    if (pending_rows < 0) return NULL;
    Py_ssize_t pending_bytes = add_to(self->applier, S_PENDING_BYTES, len);
    if (pending_bytes < 0) return NULL;
    if (pending_rows >= self->step_rows || pending_bytes >= self->step_bytes) {
        PyObject *r = PyObject_CallMethodNoArgs(self->applier, S_CHUNK_DUE);
        if (r == NULL) return NULL;
        Py_DECREF(r);
    }
    Py_RETURN_TRUE;
}

static PyMethodDef sink_methods[] = {
    {"take", (PyCFunction)sink_take, METH_O,
     "take(data) -> bool: the row message staged in the applier's net effect and counted, or False (untouched)"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef sink_members[] = {
    {"active", T_BOOL, offsetof(RowSink, active), 0, "take rows (False: a transaction already applied)"},
    {"taken", T_PYSSIZET, offsetof(RowSink, taken), READONLY, "rows staged"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject RowSinkType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "sluicegate.postgres._pgoutput_rows.RowSink",
    .tp_basicsize = sizeof(RowSink),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "RowSink(applier, relations, targets, unchanged, step_rows, step_bytes)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)sink_init,
    .tp_dealloc = (destructor)sink_dealloc,
    .tp_traverse = (traverseproc)sink_traverse,
    .tp_clear = (inquiry)sink_clear,
    .tp_methods = sink_methods,
    .tp_members = sink_members,
};

/* ---- the applier's staging rows as COPY text (appliers/postgres.copy_text) ---- */

typedef struct {
    char *p;
    Py_ssize_t len, cap;
} out_buf;

static int reserve(out_buf *b, Py_ssize_t more) {
    if (b->len + more <= b->cap)
        return 1;
    Py_ssize_t cap = b->cap ? b->cap : 1 << 16;
    while (cap < b->len + more)
        cap *= 2;
    char *p = PyMem_Realloc(b->p, cap);
    if (p == NULL) {
        PyErr_NoMemory();
        return 0;
    }
    b->p = p;
    b->cap = cap;
    return 1;
}

static int put(out_buf *b, const char *s, Py_ssize_t n) {
    if (!reserve(b, n))
        return 0;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    return 1;
}

/* COPY text's escapes: backslash, newline, carriage return and tab (the delimiter). */
static int put_escaped(out_buf *b, const char *s, Py_ssize_t n) {
    if (!reserve(b, 2 * n))
        return 0;
    char *o = b->p + b->len;
    for (Py_ssize_t i = 0; i < n; i++) {
        char c = s[i];
        switch (c) {
        case '\\': *o++ = '\\'; *o++ = '\\'; break;
        case '\n': *o++ = '\\'; *o++ = 'n'; break;
        case '\r': *o++ = '\\'; *o++ = 'r'; break;
        case '\t': *o++ = '\\'; *o++ = 't'; break;
        default: *o++ = c;
        }
    }
    b->len = o - b->p;
    return 1;
}

/* One staged row (op, values, keep) as a line; 0 with an exception set on memory errors, -1 (no exception)
 * when the row is not of the shape this handles (the caller falls back to Python). */
static int put_row(out_buf *b, PyObject *row, PyObject *unchanged, Py_ssize_t *deletes) {
    if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != 3)
        return -1;
    PyObject *op = PyTuple_GET_ITEM(row, 0), *values = PyTuple_GET_ITEM(row, 1), *keep = PyTuple_GET_ITEM(row, 2);
    if (!PyUnicode_Check(op) || !PyTuple_Check(values) || (keep != Py_None && !PyList_Check(keep)))
        return -1;
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(op, &n);
    if (s == NULL) {
        PyErr_Clear();
        return -1;
    }
    if (n == 1 && s[0] == 'D')
        (*deletes)++;
    if (!put(b, s, n))
        return 0;
    if (keep != Py_None && PyList_GET_SIZE(keep) > 0) {
        if (!put(b, "\t{", 2))
            return 0;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keep); i++) {
            long k = PyLong_AsLong(PyList_GET_ITEM(keep, i));
            if (k == -1 && PyErr_Occurred()) {
                PyErr_Clear();
                return -1;
            }
            char num[32];
            int len = snprintf(num, sizeof num, i ? ",%ld" : "%ld", k);
            if (!put(b, num, len))
                return 0;
        }
        if (!put(b, "}\t", 2))
            return 0;
    } else if (!put(b, "\t\\N\t", 4)) {
        return 0;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(values); i++) {
        PyObject *v = PyTuple_GET_ITEM(values, i);
        if (i && !put(b, "\t", 1))
            return 0;
        if (v == Py_None || v == unchanged) {
            if (!put(b, "\\N", 2))
                return 0;
            continue;
        }
        if (!PyUnicode_Check(v))
            return -1;
        s = PyUnicode_AsUTF8AndSize(v, &n);
        if (s == NULL) {  /* not encodable (a lone surrogate): Python's path says what is wrong */
            PyErr_Clear();
            return -1;
        }
        if (!put_escaped(b, s, n))
            return 0;
    }
    return put(b, "\n", 1);
}

static PyObject *copy_lines(PyObject *self, PyObject *args) {
    PyObject *rows, *unchanged;
    Py_ssize_t start, stop;
    if (!PyArg_ParseTuple(args, "O!nnO", &PyList_Type, &rows, &start, &stop, &unchanged))
        return NULL;
    if (start < 0 || stop > PyList_GET_SIZE(rows) || start > stop) {
        PyErr_SetString(PyExc_IndexError, "copy_lines: rows[start:stop] out of range");
        return NULL;
    }
    out_buf b = {NULL, 0, 0};
    Py_ssize_t deletes = 0;
    for (Py_ssize_t i = start; i < stop; i++) {
        int ok = put_row(&b, PyList_GET_ITEM(rows, i), unchanged, &deletes);
        if (ok != 1) {
            PyMem_Free(b.p);
            if (ok == 0)
                return NULL;
            Py_RETURN_NONE;
        }
    }
    PyObject *text = PyBytes_FromStringAndSize(b.p ? b.p : "", b.len);
    PyMem_Free(b.p);
    if (text == NULL)
        return NULL;
    return Py_BuildValue("(Nn)", text, deletes);
}

static PyMethodDef methods[] = {
    {"decode_row", decode_row, METH_VARARGS,
     "decode_row(data, unchanged) -> (kind, relation oid, old, new), or None if not a well-formed row change"},
    {"stage_change", (PyCFunction)(void (*)(void))stage_change, METH_FASTCALL,
     "stage_change(rows, key, change, unchanged) -> bool: an insert, a whole-row update or a delete staged in "
     "rows (the applier's net effect); False for other changes, left to the Python path"},
    {"copy_lines", copy_lines, METH_VARARGS,
     "copy_lines(rows, start, stop, unchanged) -> (COPY text bytes, deletes) of rows[start:stop], or None if a "
     "row is not (str, tuple of str/None/unchanged, list of int or None)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pgoutput_rows", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pgoutput_rows(void) {
    KIND_I = PyUnicode_InternFromString("I");
    KIND_U = PyUnicode_InternFromString("U");
    KIND_D = PyUnicode_InternFromString("D");
    if (KIND_I == NULL || KIND_U == NULL || KIND_D == NULL) return NULL;
    S_ROWS = PyUnicode_InternFromString("rows");
    S_KEY_INDICES = PyUnicode_InternFromString("key_indices");
    S_PENDING_ROWS = PyUnicode_InternFromString("pending_rows");
    S_PENDING_BYTES = PyUnicode_InternFromString("pending_bytes");
    S_CHUNK_DUE = PyUnicode_InternFromString("chunk_due");
    if (S_ROWS == NULL || S_KEY_INDICES == NULL || S_PENDING_ROWS == NULL || S_PENDING_BYTES == NULL ||
        S_CHUNK_DUE == NULL)
        return NULL;
    if (PyType_Ready(&RowSinkType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&RowSinkType);
    if (PyModule_AddObject(m, "RowSink", (PyObject *)&RowSinkType) < 0) {
        Py_DECREF(&RowSinkType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
