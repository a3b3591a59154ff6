/* tierkv._native's kernels over tensors: decode attention (attend.c), chunk bounds (bounds.c),
 * a filter layer's choice of leaves (select.c).
 * Their arguments are addresses, checked by their Python callers. */
#ifndef TIERKV_KERNELS_H
#define TIERKV_KERNELS_H

#include <Python.h>

PyObject *py_decode_attend(PyObject *self, PyObject *args);
PyObject *py_decode_attend_parts(PyObject *self, PyObject *args);
PyObject *py_kernels_ready(PyObject *self, PyObject *args);
PyObject *py_bound_scores(PyObject *self, PyObject *args);
PyObject *py_fill_units(PyObject *self, PyObject *args);

#endif
