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

/* t.data_ptr() as an integer; -1 with an exception set on failure. */
static int rp_py_data_ptr(PyObject *t, PyObject *name, unsigned long long *out)
{
    PyObject *r = PyObject_CallMethodNoArgs(t, name);
    if (r == NULL)
        return -1;
    *out = PyLong_AsUnsignedLongLong(r);
    Py_DECREF(r);
    return (*out == (unsigned long long)-1 && PyErr_Occurred()) ? -1 : 0;
}

/* state.get(key) without calling __missing__: borrowed, Py_None when absent,
 * NULL with an exception set on error. */
static PyObject *rp_py_dict_get(PyObject *dict, PyObject *key)
{
    PyObject *v = PyDict_GetItemWithError(dict, key);
    if (v == NULL && !PyErr_Occurred())
        return Py_None;
    return v;
}

/* One row of the fast path: 1 when it holds and its pointer was written,
 * 0 when the Python path must take over, -1 on error. */
static int rp_py_grad_row(PyObject *p, PyObject *param_ptr, PyObject *state, PyObject *st,
                          PyObject *watched, PyObject *contiguous, PyObject *strided,
                          PyObject *const *names, int64_t *row)
{
    unsigned long long ptr, want;
    PyObject *g, *attr;
    Py_ssize_t k;
    int ok;
    if (contiguous != Py_True || !PyTuple_Check(watched))
        return 0;
    if (rp_py_data_ptr(p, names[0], &ptr) < 0)
        return -1;
    want = PyLong_AsUnsignedLongLong(param_ptr);
    if (want == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    if (ptr != want)
        return 0;
    attr = rp_py_dict_get(state, p);
    if (attr != st)
        return attr == NULL ? -1 : 0;
    for (k = 0; k < PyTuple_GET_SIZE(watched); k++) {
        PyObject *pair = PyTuple_GET_ITEM(watched, k), *v;
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 || !PyDict_Check(st))
            return 0;
        v = rp_py_dict_get(st, PyTuple_GET_ITEM(pair, 0));
        if (v != PyTuple_GET_ITEM(pair, 1))
            return v == NULL ? -1 : 0;
    }
    g = PyObject_GetAttr(p, names[1]);
    if (g == NULL)
        return -1;
    ok = g != Py_None;
    if (ok) {
        attr = PyObject_GetAttr(g, names[2]);
        ok = attr == NULL ? -1 : attr == strided;
        Py_XDECREF(attr);
    }
    if (ok == 1) {
        attr = PyObject_CallMethodNoArgs(g, names[3]);
        ok = attr == NULL ? -1 : attr == Py_True;
        Py_XDECREF(attr);
    }
    if (ok == 1)
        ok = rp_py_data_ptr(g, names[0], &ptr) < 0 ? -1 : 1;
    Py_DECREF(g);
    if (ok == 1)
        row[1] = (int64_t)ptr;
    return ok;
}

PyObject *rp_py_optim_grad_pointers(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const attr_names[4] = {"data_ptr", "grad", "layout", "is_contiguous"};
    PyObject *names[4] = {NULL, NULL, NULL, NULL};
    PyObject *result = NULL;
    PyArrayObject *table;
    Py_ssize_t n, i;
    int k, ok = 1;
    (void)self;
    if (nargs != 8) {
        PyErr_Format(PyExc_TypeError, "optim_grad_pointers() takes 8 arguments (%zd given)",
                     nargs);
        return NULL;
    }
    if (!PyList_Check(args[0]) || !PyList_Check(args[1]) || !PyDict_Check(args[2]) ||
        !PyList_Check(args[3]) || !PyList_Check(args[4]) || !PyList_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError,
                        "optim_grad_pointers: expected lists, a dict of state and a table");
        return NULL;
    }
    if (rp_py_check_table(args[7], &table) < 0)
        return NULL;
    n = PyList_GET_SIZE(args[0]);
    if (PyList_GET_SIZE(args[1]) != n || PyList_GET_SIZE(args[3]) != n ||
        PyList_GET_SIZE(args[4]) != n || PyList_GET_SIZE(args[5]) != n ||
        PyArray_DIM(table, 0) != (npy_intp)n) {
        PyErr_SetString(PyExc_ValueError, "optim_grad_pointers: lists and table differ in length");
        return NULL;
    }
    for (k = 0; k < 4; k++) {
        names[k] = PyUnicode_InternFromString(attr_names[k]);
        if (names[k] == NULL)
            goto done;
    }
    for (i = 0; i < n && ok == 1; i++)
        ok = rp_py_grad_row(PyList_GET_ITEM(args[0], i), PyList_GET_ITEM(args[1], i), args[2],
                            PyList_GET_ITEM(args[3], i), PyList_GET_ITEM(args[4], i),
                            PyList_GET_ITEM(args[5], i), args[6], names,
                            (int64_t *)PyArray_GETPTR1(table, i));
    if (ok >= 0)
        result = PyBool_FromLong(ok);
done:
    for (k = 0; k < 4; k++)
        Py_XDECREF(names[k]);
    return result;
}

static int rp_py_int_arg(PyObject *obj, int *out)
{
    long v = PyLong_AsLong(obj);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = (int)v;
    return 0;
}

static int rp_py_float_arg(PyObject *obj, float *out)
{
    double v = PyFloat_AsDouble(obj);
    if (v == -1.0 && PyErr_Occurred())
        return -1;
    *out = (float)v;
    return 0;
}

static int rp_py_pointer_arg(PyObject *obj, void **out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = (void *)(uintptr_t)v;
    return 0;
}

static int rp_py_size_arg(PyObject *obj, int64_t *out)
{
    long long v = PyLong_AsLongLong(obj);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = (int64_t)v;
    return 0;
}

static int rp_py_check_nargs(Py_ssize_t nargs, Py_ssize_t want, const char *fname)
{
    if (nargs == want)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", fname, want, nargs);
    return -1;
}

int rp_py_parse_fad_forward(PyObject *const *args, Py_ssize_t nargs, const char *fname,
                            rp_py_fad_forward_call *call)
{
    void *x;
    if (rp_py_check_nargs(nargs, 10, fname) < 0 || rp_py_int_arg(args[0], &call->kind) < 0 ||
        rp_py_float_arg(args[1], &call->p0) < 0 || rp_py_float_arg(args[2], &call->p1) < 0 ||
        rp_py_int_arg(args[3], &call->dtype) < 0 || rp_py_pointer_arg(args[4], &x) < 0 ||
        rp_py_pointer_arg(args[5], &call->y) < 0 || rp_py_int_arg(args[6], &call->d_store) < 0 ||
        rp_py_pointer_arg(args[7], &call->d) < 0 || rp_py_size_arg(args[8], &call->n) < 0)
        return -1;
    call->x = x;
    return 0;
}

static int rp_py_codebook_arg(PyObject *obj, const rp_fad_codebook **out)
{
    if (!PyBytes_Check(obj) || PyBytes_GET_SIZE(obj) != (Py_ssize_t)sizeof(rp_fad_codebook)) {
        PyErr_SetString(PyExc_TypeError, "codebook: expected the bytes fad_codebook() returns");
        return -1;
    }
    *out = (const rp_fad_codebook *)PyBytes_AS_STRING(obj);
    return 0;
}

int rp_py_parse_fad_backward(PyObject *const *args, Py_ssize_t nargs, const char *fname,
                             rp_py_fad_backward_call *call)
{
    void *grad_y, *codes;
    if (rp_py_check_nargs(nargs, 7, fname) < 0 || rp_py_int_arg(args[0], &call->dtype) < 0 ||
        rp_py_pointer_arg(args[1], &grad_y) < 0 || rp_py_pointer_arg(args[2], &codes) < 0 ||
        rp_py_codebook_arg(args[3], &call->cb) < 0 ||
        rp_py_pointer_arg(args[4], &call->grad_x) < 0 || rp_py_size_arg(args[5], &call->n) < 0)
        return -1;
    call->grad_y = grad_y;
    call->codes = codes;
    return 0;
}

PyObject *rp_py_fad_codebook(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    rp_fad_codebook cb;
    rp_error err = {{0}};
    int kind, rc;
    float p0, p1;
    (void)self;
    if (rp_py_check_nargs(nargs, 3, "fad_codebook") < 0 || rp_py_int_arg(args[0], &kind) < 0 ||
        rp_py_float_arg(args[1], &p0) < 0 || rp_py_float_arg(args[2], &p1) < 0)
        return NULL;
    rc = rp_fad_codebook_init(kind, p0, p1, &cb, &err);
    if (rc != RP_OK)
        return rp_py_raise(rc, &err);
    return PyBytes_FromStringAndSize((const char *)&cb, sizeof cb);
}

int rp_py_parse_scan(PyObject *const *args, Py_ssize_t nargs, const char *fname,
                     rp_py_scan_call *call)
{
    void *w, *u, *v, *jt, *c;
    if (rp_py_check_nargs(nargs, 13, fname) < 0 || rp_py_size_arg(args[0], &call->j.n) < 0 ||
        rp_py_size_arg(args[1], &call->j.batch) < 0 || rp_py_size_arg(args[2], &call->j.dim) < 0 ||
        rp_py_int_arg(args[3], &call->j.gates) < 0 || rp_py_pointer_arg(args[4], &w) < 0 ||
        rp_py_pointer_arg(args[5], &u) < 0 || rp_py_pointer_arg(args[6], &v) < 0 ||
        rp_py_pointer_arg(args[7], &jt) < 0 || rp_py_pointer_arg(args[8], &c) < 0 ||
        rp_py_pointer_arg(args[9], (void **)&call->g) < 0 ||
        rp_py_int_arg(args[10], &call->levels) < 0 ||
        rp_py_pointer_arg(args[11], (void **)&call->work) < 0)
        return -1;
    call->j.w = w, call->j.u = u, call->j.v = v, call->j.jt = jt;
    call->c = c;
    return 0;
}

static int rp_py_machine_args(PyObject *const *args, rp_scan_machine *m)
{
    m->workers = PyFloat_AsDouble(args[0]);
    m->level_cost = PyFloat_AsDouble(args[1]);
    m->step_cost = PyFloat_AsDouble(args[2]);
    return PyErr_Occurred() ? -1 : 0;
}

PyObject *rp_py_scan_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t n, batch, dim;
    int gates;
    rp_scan_machine m;
    (void)self;
    if (rp_py_check_nargs(nargs, 7, "scan_plan") < 0 || rp_py_size_arg(args[0], &n) < 0 ||
        rp_py_size_arg(args[1], &batch) < 0 || rp_py_size_arg(args[2], &dim) < 0 ||
        rp_py_int_arg(args[3], &gates) < 0 || rp_py_machine_args(args + 4, &m) < 0)
        return NULL;
    if (n < 1 || batch < 0 || dim < 1) {
        PyErr_SetString(PyExc_ValueError, "scan_plan: need n >= 1, batch >= 0, dim >= 1");
        return NULL;
    }
    return Py_BuildValue("(iiL)", rp_scan_choose_levels(n, batch, dim, gates, &m),
                         rp_scan_max_levels(n), (long long)rp_scan_workspace_floats(n, batch, dim));
}

PyObject *rp_py_scan_cost(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t n, batch, dim;
    int gates, levels;
    rp_scan_machine m;
    (void)self;
    if (rp_py_check_nargs(nargs, 8, "scan_cost") < 0 || rp_py_size_arg(args[0], &n) < 0 ||
        rp_py_size_arg(args[1], &batch) < 0 || rp_py_size_arg(args[2], &dim) < 0 ||
        rp_py_int_arg(args[3], &gates) < 0 || rp_py_int_arg(args[4], &levels) < 0 ||
        rp_py_machine_args(args + 5, &m) < 0)
        return NULL;
    return PyFloat_FromDouble(rp_scan_cost(n, batch, dim, gates, levels, &m));
}
