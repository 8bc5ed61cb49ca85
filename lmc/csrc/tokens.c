/* Token ids -> little-endian uint32 bytes, the only form lmc hashes.
 *
 * Why C: a prompt arrives from vLLM and SGLang as a Python list of ints. Unboxing 128k ints
 * through struct.pack or array costs 5-13 ns a token, several times the xxh3_128 chain that
 * follows; this loop reads each int once (about 1-2 ns) and writes the bytes in place. It is
 * optional: lmc/token_database.py falls back to array('I').fromlist when it is not built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyObject *u32le(PyObject *self, PyObject *seq) {
    (void)self;
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
        PyErr_Format(PyExc_TypeError, "tokens must be a list or tuple of ints, got %s",
                     Py_TYPE(seq)->tp_name);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out == NULL)
        return NULL;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++, p += 4) {
        PyObject *o = items[i];
        if (!PyLong_Check(o)) {
            PyErr_Format(PyExc_TypeError, "token %zd is a %s, not an int", i,
                         Py_TYPE(o)->tp_name);
            Py_DECREF(out);
            return NULL;
        }
        unsigned long v;
#if PY_VERSION_HEX >= 0x030C0000
        if (PyUnstable_Long_IsCompact((PyLongObject *)o)) { /* one digit: no call, no checks */
            Py_ssize_t c = PyUnstable_Long_CompactValue((PyLongObject *)o);
            v = c < 0 ? 0x100000000UL : (unsigned long)c;
        } else
#else
        if (Py_SIZE(o) == 1) { /* CPython <= 3.11: a positive one-digit (30-bit) int */
            v = ((PyLongObject *)o)->ob_digit[0];
        } else
#endif
            v = PyLong_AsUnsignedLong(o); /* no Python code runs for an int */
        if ((v == (unsigned long)-1 && PyErr_Occurred()) || v > 0xFFFFFFFFUL) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "token ids must be ints in [0, 2**32): token %zd is %R",
                         i, o);
            Py_DECREF(out);
            return NULL;
        }
        p[0] = (unsigned char)v;
        p[1] = (unsigned char)(v >> 8);
        p[2] = (unsigned char)(v >> 16);
        p[3] = (unsigned char)(v >> 24);
    }
    return out;
}

/* chain(prev, data, step, end, digest) -> list of keys: key = digest(prev || data[off:off+step])
 * for off in range(0, end, step), each key becoming the next prev. The per-chunk Python
 * work (slice, concatenate, call, append) costs more than hashing 1 KiB, so it moves here. */
static PyObject *chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    Py_ssize_t step, end;
    if (nargs != 5 || !PyBytes_Check(args[0]) || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "chain(prev: bytes, data: bytes, step, end, digest)");
        return NULL;
    }
    if ((step = PyLong_AsSsize_t(args[2])) <= 0 || (end = PyLong_AsSsize_t(args[3])) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "chain: step must be > 0 and end >= 0");
        return NULL;
    }
    Py_ssize_t plen = PyBytes_GET_SIZE(args[0]);
    if (end > PyBytes_GET_SIZE(args[1])) {
        PyErr_SetString(PyExc_ValueError, "chain: end is past the data");
        return NULL;
    }
    const char *data = PyBytes_AS_STRING(args[1]);
    PyObject *digest = args[4];
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    PyObject *prev = args[0];
    Py_INCREF(prev);
    for (Py_ssize_t off = 0; off < end; off += step) {
        Py_ssize_t len = end - off < step ? end - off : step;
        if (PyBytes_GET_SIZE(prev) != plen) {
            PyErr_SetString(PyExc_ValueError, "chain: digest returned a key of another size");
            goto fail;
        }
        PyObject *msg = PyBytes_FromStringAndSize(NULL, plen + len);
        if (msg == NULL)
            goto fail;
        memcpy(PyBytes_AS_STRING(msg), PyBytes_AS_STRING(prev), (size_t)plen);
        memcpy(PyBytes_AS_STRING(msg) + plen, data + off, (size_t)len);
        PyObject *key = PyObject_CallOneArg(digest, msg);
        Py_DECREF(msg);
        if (key == NULL)
            goto fail;
        if (!PyBytes_Check(key) || PyList_Append(out, key) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "chain: digest must return bytes");
            Py_DECREF(key);
            goto fail;
        }
        Py_DECREF(prev);
        prev = key; /* the list holds its own reference */
    }
    Py_DECREF(prev);
    return out;
fail:
    Py_DECREF(prev);
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"u32le", u32le, METH_O, "Little-endian uint32 bytes of a list or tuple of token ids."},
    {"chain", (PyCFunction)(void (*)(void))chain, METH_FASTCALL,
     "Chained digests of fixed-size pieces of data, each over the previous key and the piece."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "lmc._tokens",
                                    "Fast token-id packing for lmc's chunk keys.", -1, methods};

PyMODINIT_FUNC PyInit__tokens(void) { return PyModule_Create(&module); }
