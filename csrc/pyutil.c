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
    return Py_BuildValue("(ii)", rp_scan_choose_levels(n, batch, dim, gates, &m),
                         rp_scan_max_levels(n));
}

PyObject *rp_py_scan_workspace(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t n, batch, dim;
    int levels;
    (void)self;
    if (rp_py_check_nargs(nargs, 4, "scan_workspace") < 0 || rp_py_size_arg(args[0], &n) < 0 ||
        rp_py_size_arg(args[1], &batch) < 0 || rp_py_size_arg(args[2], &dim) < 0 ||
        rp_py_int_arg(args[3], &levels) < 0)
        return NULL;
    return PyLong_FromLongLong((long long)rp_scan_workspace_floats(n, batch, dim, levels));
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

/* ---- BPPSA: analytic CSR Jacobians and the sparse chain scan ---- */

static PyObject *rp_py_int32_array(int64_t len, int32_t **data)
{
    npy_intp dims[1] = {(npy_intp)len};
    PyObject *arr = PyArray_SimpleNew(1, dims, NPY_INT32);
    if (arr != NULL)
        *data = (int32_t *)PyArray_DATA((PyArrayObject *)arr);
    return arr;
}

/* A tuple of `count` new int32 arrays: indptr (rows + 1), then `count - 1`
 * arrays of nnz (indices and maps), their data pointers in ptrs. */
static PyObject *rp_py_pattern_tuple(int64_t rows, int64_t nnz, int count, int32_t **ptrs)
{
    PyObject *tuple = PyTuple_New(count);
    if (tuple == NULL)
        return NULL;
    for (int i = 0; i < count; i++) {
        PyObject *arr = rp_py_int32_array(i == 0 ? rows + 1 : nnz, &ptrs[i]);
        if (arr == NULL) {
            Py_DECREF(tuple);
            return NULL;
        }
        PyTuple_SET_ITEM(tuple, i, arr);
    }
    return tuple;
}

static int rp_py_geom_arg(PyObject *obj, rp_conv2d_geom *g)
{
    int64_t f[15];
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != 15) {
        PyErr_SetString(PyExc_TypeError,
                        "geometry: expected a tuple (c_in, h_in, w_in, c_out, h_out, w_out, kh, kw, "
                        "sh, sw, ph, pw, dh, dw, groups)");
        return -1;
    }
    for (int i = 0; i < 15; i++)
        if (rp_py_size_arg(PyTuple_GET_ITEM(obj, i), &f[i]) < 0)
            return -1;
    *g = (rp_conv2d_geom){f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7],
                          f[8], f[9], f[10], f[11], f[12], f[13], f[14]};
    return 0;
}

PyObject *rp_py_jacobian(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    rp_error err = {{0}};
    rp_conv2d_geom g;
    int64_t nnz = 0, rows, a = 0, b = 0;
    int32_t *p[4] = {NULL, NULL, NULL, NULL};
    const char *kind;
    PyObject *out;
    int rc, count;
    (void)self;
    if (rp_py_check_nargs(nargs, 2, "jacobian") < 0)
        return NULL;
    kind = PyUnicode_AsUTF8(args[0]);
    if (kind == NULL)
        return NULL;
    if (!strcmp(kind, "conv2d") || !strcmp(kind, "maxpool2d")) {
        if (rp_py_geom_arg(args[1], &g) < 0)
            return NULL;
        rows = g.c_in * g.h_in * g.w_in;
        count = kind[0] == 'c' ? 3 : 4;
        rc = count == 3 ? rp_jac_conv2d(&g, &nnz, NULL, NULL, NULL, &err)
                        : rp_jac_maxpool2d(&g, &nnz, NULL, NULL, NULL, NULL, &err);
    } else if (!strcmp(kind, "linear") || !strcmp(kind, "diagonal")) {
        if (!PyArg_ParseTuple(args[1], "LL", &a, &b))
            return NULL;
        rows = a;
        count = kind[0] == 'l' ? 3 : 2;
        rc = count == 3 ? rp_jac_linear(a, b, &nnz, NULL, NULL, NULL, &err)
                        : rp_jac_diagonal(a, &nnz, NULL, NULL, &err);
    } else {
        PyErr_Format(PyExc_ValueError, "jacobian: unknown layer kind '%s'", kind);
        return NULL;
    }
    if (rc != RP_OK)
        return rp_py_raise(rc, &err);
    out = rp_py_pattern_tuple(rows, nnz, count, p);
    if (out == NULL)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (!strcmp(kind, "conv2d"))
        rc = rp_jac_conv2d(&g, &nnz, p[0], p[1], p[2], &err);
    else if (!strcmp(kind, "maxpool2d"))
        rc = rp_jac_maxpool2d(&g, &nnz, p[0], p[1], p[2], p[3], &err);
    else if (count == 3)
        rc = rp_jac_linear(a, b, &nnz, p[0], p[1], p[2], &err);
    else
        rc = rp_jac_diagonal(a, &nnz, p[0], p[1], &err);
    Py_END_ALLOW_THREADS
    if (rc != RP_OK) {
        Py_DECREF(out);
        return rp_py_raise(rc, &err);
    }
    return out;
}

#define RP_CSR_PLAN_CAPSULE "reprop.csr_plan"

static void rp_py_plan_destructor(PyObject *capsule)
{
    rp_csr_plan_free(PyCapsule_GetPointer(capsule, RP_CSR_PLAN_CAPSULE));
}

/* An int32, C-contiguous 1-D array of at least `len` elements, borrowed. */
static int rp_py_int32_arg(PyObject *obj, int64_t len, const char *name, const int32_t **out)
{
    PyArrayObject *arr = (PyArrayObject *)obj;
    if (!PyArray_Check(obj) || PyArray_TYPE(arr) != NPY_INT32 || PyArray_NDIM(arr) != 1 ||
        !PyArray_IS_C_CONTIGUOUS(arr) || PyArray_DIM(arr, 0) != (npy_intp)len) {
        PyErr_Format(PyExc_ValueError, "%s: expected a contiguous int32 array of %lld elements", name,
                     (long long)len);
        return -1;
    }
    *out = (const int32_t *)PyArray_DATA(arr);
    return 0;
}

PyObject *rp_py_csr_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    rp_error err = {{0}};
    rp_scan_machine m;
    rp_csr_pattern *leaves;
    rp_csr_plan *plan = NULL;
    int64_t n, max_pairs;
    int levels, rc;
    PyObject *seq;
    (void)self;
    if (rp_py_check_nargs(nargs, 6, "csr_plan") < 0 || rp_py_int_arg(args[1], &levels) < 0 ||
        rp_py_size_arg(args[2], &max_pairs) < 0 || rp_py_machine_args(args + 3, &m) < 0)
        return NULL;
    seq = PySequence_Fast(args[0], "leaves: expected a sequence of (rows, cols, indptr, indices)");
    if (seq == NULL)
        return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    leaves = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof *leaves);
    if (leaves == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (int64_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i), *indptr, *indices;
        long long rows, cols;
        if (!PyArg_ParseTuple(item, "LLOO", &rows, &cols, &indptr, &indices) || rows < 1 ||
            rp_py_int32_arg(indptr, rows + 1, "indptr", &leaves[i].indptr) < 0 ||
            rp_py_int32_arg(indices, PyArray_Check(indices) ? PyArray_DIM((PyArrayObject *)indices, 0) : -1,
                            "indices", &leaves[i].indices) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "leaves: rows must be >= 1");
            PyMem_Free(leaves);
            Py_DECREF(seq);
            return NULL;
        }
        leaves[i].rows = rows, leaves[i].cols = cols;
        leaves[i].nnz = PyArray_DIM((PyArrayObject *)indices, 0);
    }
    Py_BEGIN_ALLOW_THREADS
    rc = rp_csr_plan_create(n, leaves, levels, max_pairs, &m, &plan, &err);
    Py_END_ALLOW_THREADS
    PyMem_Free(leaves);
    Py_DECREF(seq);
    if (rc != RP_OK)
        return rp_py_raise(rc, &err);
    PyObject *capsule = PyCapsule_New(plan, RP_CSR_PLAN_CAPSULE, rp_py_plan_destructor);
    if (capsule == NULL)
        rp_csr_plan_free(plan);
    return capsule;
}

PyObject *rp_py_csr_plan_info(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    rp_csr_plan_info info;
    rp_csr_plan *plan;
    (void)self;
    if (rp_py_check_nargs(nargs, 1, "csr_plan_info") < 0)
        return NULL;
    plan = PyCapsule_GetPointer(args[0], RP_CSR_PLAN_CAPSULE);
    if (plan == NULL)
        return NULL;
    rp_csr_plan_describe(plan, &info);
    return Py_BuildValue("{s:i,s:L,s:L,s:L,s:L,s:L}", "levels", info.levels, "work_floats",
                         (long long)info.work_floats, "madds", (long long)info.madds, "linear_madds",
                         (long long)info.linear_madds, "products", (long long)info.products, "pairs",
                         (long long)info.pairs);
}

/* A list of n data pointers (Python ints) into a PyMem array. */
static void **rp_py_pointer_list(PyObject *obj, int64_t n, const char *name)
{
    PyObject *seq = PySequence_Fast(obj, name);
    void **out;
    if (seq == NULL)
        return NULL;
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "%s: expected %lld pointers", name, (long long)n);
        Py_DECREF(seq);
        return NULL;
    }
    out = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof *out);
    for (int64_t i = 0; out != NULL && i < n; i++)
        if (rp_py_pointer_arg(PySequence_Fast_GET_ITEM(seq, i), &out[i]) < 0) {
            PyMem_Free(out);
            out = NULL;
        }
    if (out == NULL && !PyErr_Occurred())
        PyErr_NoMemory();
    Py_DECREF(seq);
    return out;
}

PyObject *rp_py_csr_scan(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    rp_error err = {{0}};
    rp_csr_plan *plan;
    rp_csr_plan_info info;
    void **values, **g, *g_out, *work;
    int64_t batch, n;
    int threads, rc;
    (void)self;
    if (rp_py_check_nargs(nargs, 7, "csr_scan") < 0)
        return NULL;
    plan = PyCapsule_GetPointer(args[0], RP_CSR_PLAN_CAPSULE);
    if (plan == NULL || rp_py_size_arg(args[1], &batch) < 0 || rp_py_pointer_arg(args[3], &g_out) < 0 ||
        rp_py_pointer_arg(args[5], &work) < 0 || rp_py_int_arg(args[6], &threads) < 0)
        return NULL;
    rp_csr_plan_describe(plan, &info);
    n = PySequence_Size(args[2]);
    if (n < 0)
        return NULL;
    values = rp_py_pointer_list(args[2], n, "values");
    if (values == NULL)
        return NULL;
    g = rp_py_pointer_list(args[4], n, "g");
    if (g == NULL) {
        PyMem_Free(values);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rc = rp_csr_scan_cpu(plan, batch, (const float *const *)values, g_out, (float *const *)g, work,
                         threads, &err);
    Py_END_ALLOW_THREADS
    PyMem_Free(values);
    PyMem_Free(g);
    if (rc != RP_OK)
        return rp_py_raise(rc, &err);
    Py_RETURN_NONE;
}
