/* The replay's hot path in C: a pgoutput Insert, Update or Delete message as (kind, relation oid, old, new).
 *
 * Same result as pgoutput._decode_row_py, about five times faster. It decodes only well-formed messages:
 * for anything else (truncated, unknown marker or value kind, bad UTF-8, trailing bytes) it returns None,
 * and the Python decoder, which says exactly what is wrong, takes over. Pure: bytes in, values out.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *KIND_I, *KIND_U, *KIND_D;

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

/* decode_row(data: bytes, unchanged) -> (kind, relation oid, old, new) | None */
static PyObject *decode_row(PyObject *self, PyObject *args) {
    Py_buffer view;
    PyObject *unchanged;
    if (!PyArg_ParseTuple(args, "y*O", &view, &unchanged)) return NULL;
    const unsigned char *buf = view.buf;
    Py_ssize_t len = view.len, off = 6;
    PyObject *old = NULL, *new = NULL, *kind = NULL, *out = NULL;
    if (len < 6) goto fallback;
    uint32_t relid = be32(buf + 1);
    unsigned char marker = buf[5];
    switch (buf[0]) {
    case 'I':
        if (marker != 'N') goto fallback;
        kind = KIND_I;
        if ((new = tuple_at(buf, len, &off, unchanged)) == NULL) goto fallback;
        break;
    case 'U':
        kind = KIND_U;
        if (marker == 'K' || marker == 'O') {
            if ((old = tuple_at(buf, len, &off, unchanged)) == NULL) goto fallback;
            if (off >= len || buf[off] != 'N') goto fallback;
            off += 1;
        } else if (marker != 'N') {
            goto fallback;
        }
        if ((new = tuple_at(buf, len, &off, unchanged)) == NULL) goto fallback;
        break;
    case 'D':
        if (marker != 'K' && marker != 'O') goto fallback;
        kind = KIND_D;
        if ((old = tuple_at(buf, len, &off, unchanged)) == NULL) goto fallback;
        break;
    default:
        goto fallback;
    }
    if (off != len) goto fallback;
    out = row(kind, relid, old, new);
    PyBuffer_Release(&view);
    return out;
fallback:
    Py_XDECREF(old);
    Py_XDECREF(new);
    PyBuffer_Release(&view);
    if (PyErr_Occurred()) return NULL; /* out of memory: not a decoding matter */
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode_row", decode_row, METH_VARARGS,
     "decode_row(data, unchanged) -> (kind, relation oid, old, new), or None if not a well-formed row change"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pgoutput_rows", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pgoutput_rows(void) {
    KIND_I = PyUnicode_InternFromString("I");
    KIND_U = PyUnicode_InternFromString("U");
    KIND_D = PyUnicode_InternFromString("D");
    if (KIND_I == NULL || KIND_U == NULL || KIND_D == NULL) return NULL;
    return PyModule_Create(&module);
}
