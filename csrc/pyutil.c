/* pyutil.c: argument parsing shared by the bindings; see pyutil.h. */
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include "pyutil.h"

#include <numpy/arrayobject.h>

int rp_py_import_numpy(void)
{
    import_array1(-1);
    return 0;
}

PyObject *rp_py_raise(int code, const rp_error *err)
{
    PyErr_SetString(code == RP_EINVAL ? PyExc_ValueError : PyExc_RuntimeError, err->msg);
    return NULL;
}

static int rp_py_check_table(PyObject *obj, PyArrayObject **out)
{
    PyArrayObject *arr;
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "table: expected a numpy.ndarray, got %s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    arr = (PyArrayObject *)obj;
    if (PyArray_TYPE(arr) != NPY_INT64 || PyArray_NDIM(arr) != 2 ||
        PyArray_DIM(arr, 1) != (npy_intp)(sizeof(rp_optim_entry) / sizeof(int64_t))) {
        PyErr_SetString(PyExc_ValueError, "table: expected an int64 array of shape (n, 8)");
        return -1;
    }
    if (!PyArray_IS_C_CONTIGUOUS(arr) || !PyArray_ISWRITEABLE(arr) || !PyArray_ISALIGNED(arr)) {
        PyErr_SetString(PyExc_ValueError,
                        "table: expected a C-contiguous, aligned, writeable array");
        return -1;
    }
    *out = arr;
    return 0;
}

int rp_py_parse_optim_call(PyObject *kind, PyObject *dtype, PyObject *table, PyObject *hparams,
                           rp_py_optim_call *call)
{
    PyArrayObject *arr = NULL;
    rp_optim_hparams *hp = &call->hp;
    memset(call, 0, sizeof *call);
    hp->kind = PyLong_AsLong(kind);
    if (hp->kind == -1 && PyErr_Occurred())
        return -1;
    call->dtype = (int)PyLong_AsLong(dtype);
    if (call->dtype == -1 && PyErr_Occurred())
        return -1;
    if (!PyTuple_Check(hparams)) {
        PyErr_SetString(PyExc_TypeError, "hparams: expected a tuple");
        return -1;
    }
    if (!PyArg_ParseTuple(hparams, "ddddddddddppppp;hparams: expected 10 floats and 5 bools",
                          &hp->lr, &hp->weight_decay, &hp->eps, &hp->beta1, &hp->beta2,
                          &hp->momentum, &hp->dampening, &hp->alpha, &hp->rho, &hp->lr_decay,
                          &hp->nesterov, &hp->maximize, &hp->amsgrad, &hp->decoupled_weight_decay,
                          &hp->centered))
        return -1;
    if (rp_py_check_table(table, &arr) < 0)
        return -1;
    Py_INCREF(table);
    call->table = table;
    call->entries = (rp_optim_entry *)PyArray_DATA(arr);
    call->n = (int64_t)PyArray_DIM(arr, 0);
    return 0;
}
