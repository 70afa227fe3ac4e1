/*
 * module_cuda.c: the CPython binding of the CUDA kernels, reprop._cuda.
 *
 * Built only when nvcc is found. It links the CUDA runtime statically, so
 * importing it needs no driver and no device: rp_cuda_device_count() is then
 * simply 0. Updates are enqueued on the caller's stream and never synchronise.
 */
#include "pyutil.h" /* Python.h first, as the C API asks */

#include <stdlib.h>
#include <string.h>

PyDoc_STRVAR(optim_step_doc,
             "optim_step(kind, dtype, table, hparams, capturable, stream, lr_ptr)\n--\n\n"
             "Fused multi-tensor optimizer step on CUDA, enqueued on `stream` (an\n"
             "integer cudaStream_t). Non-capturable: step counters are host float32\n"
             "and advanced here. Capturable: step counters are device float32 and\n"
             "advanced on the stream; hparams[0] is ignored if `lr_ptr` is nonzero.");

static PyObject *rp_cuda_optim_step_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    rp_py_optim_call call;
    rp_step_scalars *scalars = NULL;
    rp_error err = {{0}};
    void *stream, *lr_ptr;
    int capturable, rc;
    (void)self;
    if (rp_py_check_nargs(nargs, 7, "optim_step") < 0)
        return NULL;
    capturable = PyObject_IsTrue(args[4]);
    if (capturable < 0)
        return NULL;
    if (rp_py_stream_arg(args[5], &stream) < 0 || rp_py_pointer_arg(args[6], "lr_ptr", &lr_ptr) < 0)
        return NULL;
    if (rp_py_parse_optim_call(args[0], args[1], args[2], args[3], &call) < 0)
        return NULL;
    call.hp.lr_ptr = lr_ptr;
    rc = rp_optim_check(&call.hp, call.entries, call.n, &err);
    /* the host counters advance with the scalars, computed once; a refused
       dtype or a failed launch puts them back, as the CPU path leaves them
       (the kernels read the scalars, not the counters) */
    if (rc == RP_OK && !capturable && call.n > 0) {
        scalars = rp_optim_scalars_alloc(call.n, &err);
        if (scalars == NULL)
            rc = RP_ERUNTIME;
        else
            rc = rp_optim_advance_steps(&call.hp, call.entries, call.n, scalars, &err);
    }
    if (rc == RP_OK) {
        Py_BEGIN_ALLOW_THREADS
        rc = rp_cuda_optim_step(&call.hp, call.dtype, call.entries, scalars, call.n, capturable,
                                stream, &err);
        Py_END_ALLOW_THREADS
        if (rc != RP_OK && scalars != NULL)
            rp_optim_undo_steps(&call.hp, call.entries, call.n, scalars);
    }
    if (rc == RP_OK)
        rp_optim_entries_done(call.entries, call.n);
    free(scalars);
    Py_DECREF(call.table);
    return rp_py_none_or_raise(rc, &err);
}

#define RP_CUSPARSE_CAPSULE "reprop.cusparse_chain"

/* A C-contiguous 2-D int64 buffer (a NumPy array) of `cols` columns, held
 * in *view until PyBuffer_Release; 0, or -1 with a ValueError naming it. */
static int rp_cuda_table_arg(PyObject *obj, Py_ssize_t cols, const char *name, Py_buffer *view)
{
    const char *fmt;
    int ok = PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0;
    if (ok) {
        fmt = view->format != NULL ? view->format : "B";
        if (*fmt == '@' || *fmt == '=' || *fmt == '<')
            fmt++;
        ok = view->itemsize == 8 && (strcmp(fmt, "q") == 0 || strcmp(fmt, "l") == 0) &&
             view->ndim == 2 && view->shape[1] == cols;
        if (!ok)
            PyBuffer_Release(view);
    }
    if (ok)
        return 0;
    PyErr_Clear(); /* the buffer protocol's own error does not name the argument */
    PyErr_Format(PyExc_ValueError, "%s: expected a C-contiguous int64 array of shape (n, %zd)", name,
                 cols);
    return -1;
}

/* The path `library` (a str, "" for none) as UTF-8 for the loader; 0, or -1
 * with an exception naming it. A NUL inside would end the path there for C,
 * so that another file than the one named would be loaded. */
static int rp_cuda_library_arg(PyObject *obj, const char **out)
{
    Py_ssize_t len;
    if (!PyUnicode_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "library: expected a str, got %s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    *out = PyUnicode_AsUTF8AndSize(obj, &len);
    if (*out == NULL) { /* a lone surrogate: UnicodeEncodeError, a ValueError */
        rp_py_prefix_error(NULL, "library");
        return -1;
    }
    if (strlen(*out) != (size_t)len) {
        PyErr_SetString(PyExc_ValueError, "library: embedded null character");
        return -1;
    }
    return 0;
}

static void rp_cuda_cusparse_destructor(PyObject *capsule)
{
    rp_cuda_cusparse_free(PyCapsule_GetPointer(capsule, RP_CUSPARSE_CAPSULE));
}

PyDoc_STRVAR(cusparse_create_doc,
             "cusparse_create(library, mats, ops, vectors, batch, nvectors, stride, stream)\n--\n\n"
             "The cuSPARSE peer's chain (a capsule; kernels/scan.cu): cuSPARSE loaded\n"
             "(by soname, else from the path `library`), every product's reuse stages\n"
             "run on `stream` up to its values. Vector slot v of sequence b at\n"
             "vectors + (v * batch + b) * stride floats.");

static PyObject *rp_cuda_cusparse_create_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer mats, ops;
    rp_cusparse_chain *chain = NULL;
    rp_error err = {{0}};
    const char *library;
    int64_t batch, nvectors, stride;
    void *vectors, *stream;
    int rc;
    (void)self;
    if (rp_py_check_nargs(nargs, 8, "cusparse_create") < 0 || rp_cuda_library_arg(args[0], &library) < 0 ||
        rp_py_pointer_arg(args[3], "vectors", &vectors) < 0 || rp_py_size_arg(args[4], "batch", &batch) < 0 ||
        rp_py_size_arg(args[5], "nvectors", &nvectors) < 0 || rp_py_size_arg(args[6], "stride", &stride) < 0 ||
        rp_py_stream_arg(args[7], &stream) < 0)
        return NULL;
    if (rp_cuda_table_arg(args[1], RP_CUSPARSE_MAT_COLS, "mats", &mats) < 0)
        return NULL;
    if (rp_cuda_table_arg(args[2], RP_CSR_STEP_COLS, "ops", &ops) < 0) {
        PyBuffer_Release(&mats);
        return NULL;
    }
    /* with the GIL: the first call loads and resolves the library once */
    rc = rp_cuda_cusparse_create(library, mats.shape[0], mats.buf, ops.shape[0], ops.buf,
                                 (float *)vectors, batch, nvectors, stride, stream, &chain,
                                 &err);
    PyBuffer_Release(&mats);
    PyBuffer_Release(&ops);
    if (rc != RP_OK)
        return rp_py_raise(rc, &err);
    PyObject *capsule = PyCapsule_New(chain, RP_CUSPARSE_CAPSULE, rp_cuda_cusparse_destructor);
    if (capsule == NULL)
        rp_cuda_cusparse_free(chain);
    return capsule;
}

PyDoc_STRVAR(cusparse_run_doc,
             "cusparse_run(chain, stream)\n--\n\n"
             "One scan of a cusparse_create chain on `stream`: its products' values by\n"
             "cusparseSpGEMMreuse_compute, its mat-vecs and copies; never synchronizes.");

static PyObject *rp_cuda_cusparse_run_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    rp_cusparse_chain *chain;
    rp_error err = {{0}};
    void *stream;
    int rc;
    (void)self;
    if (rp_py_check_nargs(nargs, 2, "cusparse_run") < 0)
        return NULL;
    chain = rp_py_capsule_arg(args[0], RP_CUSPARSE_CAPSULE, "cusparse_create", "chain");
    if (chain == NULL || rp_py_stream_arg(args[1], &stream) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = rp_cuda_cusparse_run(chain, stream, &err);
    Py_END_ALLOW_THREADS
    return rp_py_none_or_raise(rc, &err);
}

/* What the bindings pyutil.c shares with reprop._C run here. */
static const rp_py_cuda_launchers rp_cuda_launchers = {
    rp_cuda_fad_forward, rp_cuda_fad_backward_code8, rp_cuda_scan, rp_cuda_csr_run};

PyDoc_STRVAR(fad_forward_doc,
             "fad_forward(kind, p0, p1, dtype, x, y, d_store, d, n, stream)\n--\n\n"
             "y = f(x) and d = f'(x) for n elements in one kernel on `stream`\n"
             "(rp_cuda_fad_forward in csrc/reprop.h); x, y, d are device pointers.");

PyDoc_STRVAR(fad_backward_code8_doc,
             "fad_backward_code8(dtype, grad_y, codes, codebook, grad_x, n, stream)\n--\n\n"
             "grad_x = grad_y * codebook.value[codes] on `stream` (rp_cuda_fad_backward_code8).");

PyDoc_STRVAR(scan_doc,
             "scan(n, batch, dim, gates, w, u, v, jt, act, y, pre_activation, c, g, levels, work,\n"
             "     stream)\n--\n\n"
             "The BPPSA recurrence on `stream` (rp_cuda_scan in csrc/reprop.h; act, y and\n"
             "pre_activation as in rp_scan_jacobians); device pointers as ints, 0 for NULL.");

PyDoc_STRVAR(csr_run_doc,
             "csr_run(plan, batch, seq, shared, dst, term_ptr, tx, ty, stream)\n--\n\n"
             "A reprop._C.csr_plan's program on `stream` (rp_cuda_csr_run): seq, shared\n"
             "and the device copies of its rows dst, term_ptr, tx, ty as device pointers.");

PyDoc_STRVAR(scan_shared_bytes_doc,
             "scan_shared_bytes(dim, levels)\n--\n\n"
             "Shared memory (bytes) one block of scan() needs at the least for hidden size\n"
             "`dim` (rp_cuda_scan_shared_bytes): the same for every levels > 0.");

static PyObject *rp_cuda_scan_shared_bytes_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t dim;
    int levels;
    (void)self;
    if (rp_py_check_nargs(nargs, 2, "scan_shared_bytes") < 0 || rp_py_size_arg(args[0], "dim", &dim) < 0 ||
        rp_py_int_arg(args[1], "levels", &levels) < 0)
        return NULL;
    if (dim < 1 || levels < 0) {
        PyErr_Format(PyExc_ValueError, "scan_shared_bytes: expected dim >= 1 and levels >= 0, got %lld and %d",
                     (long long)dim, levels);
        return NULL;
    }
    return PyLong_FromSize_t(rp_cuda_scan_shared_bytes(dim, levels));
}

PyDoc_STRVAR(shared_memory_per_block_doc,
             "shared_memory_per_block(device)\n--\n\n"
             "The most shared memory (bytes) one block may use on CUDA device `device`:\n"
             "its opt-in maximum, at least the default 48 KB.");

static PyObject *rp_cuda_shared_memory_per_block_py(PyObject *self, PyObject *const *args,
                                                    Py_ssize_t nargs)
{
    rp_error err = {{0}};
    size_t bytes = 0;
    int device, rc;
    (void)self;
    if (rp_py_check_nargs(nargs, 1, "shared_memory_per_block") < 0 ||
        rp_py_int_arg(args[0], "device", &device) < 0)
        return NULL;
    rc = rp_cuda_shared_memory_per_block(device, &bytes, &err);
    return rc == RP_OK ? PyLong_FromSize_t(bytes) : rp_py_raise(rc, &err);
}

/* Facts fixed at build time only: counting devices initializes the driver
 * (a child forked after it cannot use CUDA), which reading them must not. */
static PyObject *rp_cuda_build_info_py(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return Py_BuildValue("{s:s,s:O}", "archs", rp_cuda_archs(), "cusparse",
                         rp_cuda_cusparse_built() ? Py_True : Py_False);
}

static PyObject *rp_cuda_device_count_py(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyLong_FromLong(rp_cuda_device_count());
}

static PyMethodDef rp_cuda_methods[] = {
    {"optim_step", (PyCFunction)(void (*)(void))rp_cuda_optim_step_py, METH_FASTCALL,
     optim_step_doc},
    {"fad_forward", (PyCFunction)(void (*)(void))rp_py_fad_forward, METH_FASTCALL, fad_forward_doc},
    {"fad_backward_code8", (PyCFunction)(void (*)(void))rp_py_fad_backward_code8, METH_FASTCALL,
     fad_backward_code8_doc},
    {"scan", (PyCFunction)(void (*)(void))rp_py_scan, METH_FASTCALL, scan_doc},
    {"csr_run", (PyCFunction)(void (*)(void))rp_py_csr_run, METH_FASTCALL, csr_run_doc},
    {"cusparse_create", (PyCFunction)(void (*)(void))rp_cuda_cusparse_create_py, METH_FASTCALL,
     cusparse_create_doc},
    {"cusparse_run", (PyCFunction)(void (*)(void))rp_cuda_cusparse_run_py, METH_FASTCALL,
     cusparse_run_doc},
    {"scan_shared_bytes", (PyCFunction)(void (*)(void))rp_cuda_scan_shared_bytes_py, METH_FASTCALL,
     scan_shared_bytes_doc},
    {"shared_memory_per_block", (PyCFunction)(void (*)(void))rp_cuda_shared_memory_per_block_py,
     METH_FASTCALL, shared_memory_per_block_doc},
    {"build_info", rp_cuda_build_info_py, METH_NOARGS, "Facts about the CUDA build."},
    {"device_count", rp_cuda_device_count_py, METH_NOARGS,
     "The CUDA devices this build's runtime can use (0 without a driver); initializes the driver."},
    {NULL, NULL, 0, NULL},
};

static int rp_cuda_exec(PyObject *module) { return rp_py_module_exec(module, &rp_cuda_launchers); }

static PyModuleDef_Slot rp_cuda_slots[] = {
    {Py_mod_exec, rp_cuda_exec},
    {0, NULL},
};

static struct PyModuleDef rp_cuda_module = {
    PyModuleDef_HEAD_INIT, "reprop._cuda", "The reprop CUDA kernels.", sizeof(rp_py_module_state),
    rp_cuda_methods, rp_cuda_slots, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__cuda(void) { return PyModuleDef_Init(&rp_cuda_module); }
