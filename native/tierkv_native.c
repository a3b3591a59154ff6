/* tierkv._native: byte shuffles and gathered preads, with the GIL released.
 *
 * shuffle(src, itemsize, out=None)      byte planes of n items (byte 0 of all, byte 1 of all...)
 * unshuffle(src, itemsize, out=None)    the inverse
 * pread_extents(fd, offsets, lengths, out) -> int   extents of one file, back to back in out
 * decode_attend(...)                                  decode attention over 16-bit KV (attend.c)
 * bound_scores(...)                                   LKA chunk bounds from summaries (bounds.c)
 * kernels_ready() -> bool                             whether this CPU runs those two (simd.h)
 * fill_units(...)                                     a filter layer's choice of leaves (select.c)
 *
 * Pure fallbacks with identical results live in tierkv/storage/native.py; the attention's is
 * torch's, in tierkv/attention.py, and fill_units's in tierkv/policies/omnikv.py.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "kernels.h"

#define MAX_ITEMSIZE 64
#define BLOCK_ITEMS 2048 /* items per cache block: source and planes stay in L1/L2 */
#define GIL_FREE_BYTES 65536

/* One block of `count` items starting at item `first`; `size` is a compile-time constant in the
 * specialised callers so the inner loops unroll and vectorise. */
static inline void shuffle_block(const uint8_t *restrict src, uint8_t *restrict dst, Py_ssize_t n,
                                 Py_ssize_t first, Py_ssize_t count, int size, int inverse)
{
    if (inverse) { /* contiguous stores, one load per plane: gcc interleaves vectors */
        for (Py_ssize_t i = first; i < first + count; i++)
            for (int b = 0; b < size; b++)
                dst[i * size + b] = src[(Py_ssize_t)b * n + i];
        return;
    }
    for (int b = 0; b < size; b++)
        for (Py_ssize_t i = first; i < first + count; i++)
            dst[(Py_ssize_t)b * n + i] = src[i * size + b];
}

static inline void shuffle_all(const uint8_t *src, uint8_t *dst, Py_ssize_t n, int size,
                               int inverse)
{
    for (Py_ssize_t first = 0; first < n; first += BLOCK_ITEMS) {
        Py_ssize_t count = n - first < BLOCK_ITEMS ? n - first : BLOCK_ITEMS;
        shuffle_block(src, dst, n, first, count, size, inverse);
    }
}

static void shuffle_any(const uint8_t *src, uint8_t *dst, Py_ssize_t n, int size, int inverse)
{
    switch (size) {
    case 2: shuffle_all(src, dst, n, 2, inverse); break;
    case 4: shuffle_all(src, dst, n, 4, inverse); break;
    default: shuffle_all(src, dst, n, size, inverse); break;
    }
}

/* The buffer of `out`, writable and contiguous; ValueError (as the fallbacks raise) otherwise. */
static int writable_buffer(PyObject *out, Py_buffer *view)
{
    if (PyObject_GetBuffer(out, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) == 0)
        return 0;
    PyErr_SetString(PyExc_ValueError, "out must be a writable, contiguous buffer");
    return -1;
}

/* shuffle / unshuffle (src, itemsize, out=None): into new bytes or into out. */
static PyObject *shuffle_call(PyObject *args, PyObject *kwargs, int inverse)
{
    static char *kwlist[] = {"src", "itemsize", "out", NULL};
    Py_buffer src, dst;
    int itemsize;
    PyObject *out = Py_None, *result;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*i|O", kwlist, &src, &itemsize, &out))
        return NULL;
    if (itemsize < 1 || itemsize > MAX_ITEMSIZE || src.len % itemsize) {
        PyErr_Format(PyExc_ValueError, "itemsize=%d: must be in [1, %d] and divide len(src)=%zd",
                     itemsize, MAX_ITEMSIZE, src.len);
        PyBuffer_Release(&src);
        return NULL;
    }
    if (out == Py_None) {
        result = PyBytes_FromStringAndSize(NULL, src.len);
        if (result == NULL) {
            PyBuffer_Release(&src);
            return NULL;
        }
        dst.buf = PyBytes_AS_STRING(result);
        dst.len = src.len;
    } else {
        if (writable_buffer(out, &dst) < 0) {
            PyBuffer_Release(&src);
            return NULL;
        }
        if (dst.len != src.len) {
            PyErr_Format(PyExc_ValueError, "out holds %zd bytes, src %zd", dst.len, src.len);
            PyBuffer_Release(&dst);
            PyBuffer_Release(&src);
            return NULL;
        }
        result = Py_NewRef(out);
    }
    Py_ssize_t n = src.len / itemsize;
    if (src.len >= GIL_FREE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        shuffle_any(src.buf, dst.buf, n, itemsize, inverse);
        Py_END_ALLOW_THREADS
    } else {
        shuffle_any(src.buf, dst.buf, n, itemsize, inverse);
    }
    if (out != Py_None)
        PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

static PyObject *py_shuffle(PyObject *self, PyObject *args, PyObject *kwargs)
{
    return shuffle_call(args, kwargs, 0);
}

static PyObject *py_unshuffle(PyObject *self, PyObject *args, PyObject *kwargs)
{
    return shuffle_call(args, kwargs, 1);
}

/* A sequence of non-negative ints as a new array of `count` long longs; NULL with an error set. */
static long long *int_array(PyObject *seq, const char *name, Py_ssize_t *count)
{
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of ints");
    if (fast == NULL)
        return NULL;
    *count = PySequence_Fast_GET_SIZE(fast);
    long long *values = PyMem_Malloc((*count ? *count : 1) * sizeof(long long));
    if (values == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < *count; i++) {
        values[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (values[i] < 0) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "%s[%zd]=%lld: must be >= 0", name, i, values[i]);
            PyMem_Free(values);
            Py_DECREF(fast);
            return NULL;
        }
    }
    Py_DECREF(fast);
    return values;
}

/* Read every extent; 0 on success, else an errno value (end of file: -1, with `*failed_at` the
 * offset reached and `*missing` the bytes still due for that extent). */
static int read_extents(int fd, const long long *offsets, const long long *lengths,
                        Py_ssize_t count, char *out, long long *failed_at, long long *missing)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        long long done = 0;
        while (done < lengths[i]) {
            ssize_t got = pread(fd, out + done, (size_t)(lengths[i] - done),
                                (off_t)(offsets[i] + done));
            if (got < 0 && errno == EINTR)
                continue;
            if (got <= 0) {
                *failed_at = offsets[i] + done;
                *missing = lengths[i] - done;
                return got < 0 ? errno : -1;
            }
            done += got;
        }
        out += lengths[i];
    }
    return 0;
}

static PyObject *py_pread_extents(PyObject *self, PyObject *args)
{
    int fd;
    PyObject *offsets_obj, *lengths_obj, *out;
    Py_buffer dst;
    Py_ssize_t n_offsets, n_lengths;
    long long total = 0, failed_at = 0, missing = 0;
    int err;

    if (!PyArg_ParseTuple(args, "iOOO", &fd, &offsets_obj, &lengths_obj, &out))
        return NULL;
    long long *offsets = int_array(offsets_obj, "offsets", &n_offsets);
    if (offsets == NULL)
        return NULL;
    long long *lengths = int_array(lengths_obj, "lengths", &n_lengths);
    if (lengths == NULL) {
        PyMem_Free(offsets);
        return NULL;
    }
    PyObject *result = NULL;
    if (n_offsets != n_lengths) {
        PyErr_Format(PyExc_ValueError, "%zd offsets but %zd lengths", n_offsets, n_lengths);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n_lengths; i++)
        total += lengths[i];
    if (writable_buffer(out, &dst) < 0)
        goto done;
    if (total > dst.len) {
        PyErr_Format(PyExc_ValueError, "extents total %lld bytes, out holds %zd", total, dst.len);
        PyBuffer_Release(&dst);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    err = read_extents(fd, offsets, lengths, n_lengths, dst.buf, &failed_at, &missing);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    if (err > 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
    } else if (err < 0) {
        PyObject *exc_args = Py_BuildValue("(iN)", EIO, PyUnicode_FromFormat(
            "unexpected end of file at offset %lld (%lld bytes short)", failed_at, missing));
        if (exc_args != NULL) {
            PyErr_SetObject(PyExc_OSError, exc_args);
            Py_DECREF(exc_args);
        }
    } else {
        result = PyLong_FromLongLong(total);
    }
done:
    PyMem_Free(offsets);
    PyMem_Free(lengths);
    return result;
}

static PyMethodDef methods[] = {
    {"shuffle", (PyCFunction)(void (*)(void))py_shuffle, METH_VARARGS | METH_KEYWORDS,
     "shuffle(src, itemsize, out=None) -> bytes | out\n\n"
     "Byte planes of src: byte 0 of every item, then byte 1 of every item, ..."},
    {"unshuffle", (PyCFunction)(void (*)(void))py_unshuffle, METH_VARARGS | METH_KEYWORDS,
     "unshuffle(src, itemsize, out=None) -> bytes | out\n\nThe inverse of shuffle."},
    {"pread_extents", py_pread_extents, METH_VARARGS,
     "pread_extents(fd, offsets, lengths, out) -> int\n\n"
     "Read lengths[i] bytes at offsets[i] of fd into out, back to back; return the total.\n"
     "OSError on a read error or end of file."},
    {"decode_attend", py_decode_attend, METH_VARARGS,
     "decode_attend(q, k, v, top, sum, out, B, g, n, d, kind[, stride]) -> None\n\n"
     "Merge one part's attention into a running softmax state; addresses, checked by the caller\n"
     "(tierkv.attention.DecodeAccumulator)."},
    {"decode_attend_parts", py_decode_attend_parts, METH_VARARGS,
     "decode_attend_parts(q, scaling, table, count, slot, wk, wv, wk_head, wv_head, wn, out,\n"
     "scores, tokens, B, g, d, kind) -> None\n\nAttention over parts read where they lie\n"
     "(native/attend.c); addresses, checked by the caller (tierkv.scattered.attend_parts)."},
    {"kernels_ready", py_kernels_ready, METH_NOARGS,
     "kernels_ready() -> bool: whether this CPU runs decode_attend and bound_scores\n"
     "(x86-64 with AVX2, FMA and F16C); where not, callers take torch's path."},
    {"bound_scores", py_bound_scores, METH_VARARGS,
     "bound_scores(q, kmin, kmax, out, m, h, g, d, kind, alpha) -> None\n\n"
     "LKA chunk bounds per query head into out; addresses, checked by the caller\n"
     "(tierkv.summary.bound_scores)."},
    {"fill_units", py_fill_units, METH_VARARGS,
     "fill_units(scores, n, cuts, u, bounds, m, sinks, budget, out) -> int\n\n"
     "A filter layer's chosen leaves into out, their count returned (native/select.c);\n"
     "addresses, checked by the caller (tierkv.policies.omnikv.OmniKV._fill)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native",
                                    "tierkv's optional C helpers", -1, methods};

PyMODINIT_FUNC PyInit__native(void)
{
    return PyModule_Create(&module);
}
