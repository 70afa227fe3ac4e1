/*
 * module.c: the CPython binding of the CPU core, reprop._C.
 *
 * Multi-phase initialisation, no global state. Every function validates its
 * arguments, releases the GIL around the numeric work, and turns a core
 * status into ValueError or RuntimeError.
 */
#include "pyutil.h"

PyDoc_STRVAR(optim_step_doc,
             "optim_step(kind, dtype, table, hparams, num_threads)\n--\n\n"
             "Fused multi-tensor optimizer step on the CPU. `table` is an int64 array of\n"
             "shape (n, 8) whose rows are rp_optim_entry records (see csrc/reprop.h);\n"
             "`hparams` the tuple described in csrc/pyutil.h.");

static PyObject *rp_optim_step_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    rp_py_optim_call call;
    rp_error err = {{0}};
    int num_threads, rc;
    (void)self;
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "optim_step() takes 5 arguments (%zd given)", nargs);
        return NULL;
    }
    num_threads = (int)PyLong_AsLong(args[4]);
    if (num_threads == -1 && PyErr_Occurred())
        return NULL;
    if (rp_py_parse_optim_call(args[0], args[1], args[2], args[3], &call) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = rp_optim_step_cpu(&call.hp, call.dtype, call.entries, call.n, num_threads, &err);
    Py_END_ALLOW_THREADS
    Py_DECREF(call.table);
    if (rc != RP_OK)
        return rp_py_raise(rc, &err);
    Py_RETURN_NONE;
}

static PyObject *rp_build_info_py(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
#ifdef _OPENMP
    const int openmp = 1;
#else
    const int openmp = 0;
#endif
    return Py_BuildValue("{s:O,s:i}", "openmp", openmp ? Py_True : Py_False, "omp_max_threads",
                         rp_omp_max_threads());
}

static PyMethodDef rp_methods[] = {
    {"optim_step", (PyCFunction)(void (*)(void))rp_optim_step_py, METH_FASTCALL, optim_step_doc},
    {"optim_grad_pointers", (PyCFunction)(void (*)(void))rp_py_optim_grad_pointers, METH_FASTCALL,
     "Per-step fast path of reprop.optim's cached pointer tables (see csrc/pyutil.h)."},
    {"build_info", rp_build_info_py, METH_NOARGS, "Facts about how the C core was built."},
    {NULL, NULL, 0, NULL},
};

static int rp_exec(PyObject *module)
{
    (void)module;
    return rp_py_import_numpy();
}

static PyModuleDef_Slot rp_slots[] = {
    {Py_mod_exec, rp_exec},
    {0, NULL},
};

static struct PyModuleDef rp_module = {
    PyModuleDef_HEAD_INIT, "reprop._C", "The reprop C core (CPU).", 0, rp_methods, rp_slots,
    NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&rp_module); }
