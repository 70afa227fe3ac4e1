/*
 * module.c: the CPython binding of the CPU core, reprop._C.
 *
 * Multi-phase initialisation, no global state. Every function validates its
 * arguments and turns a core status into ValueError or RuntimeError. The
 * work that grows with the data runs without the GIL (the core never touches
 * Python objects): updates, activations, scans, Jacobians, csr plans and
 * runs, task graphs, simulations and schedules. The rest keeps it: the
 * optimizer's fast path, plan key and hyper-parameters (optim_grad_pointers,
 * optim_call_key, optim_hparams, which read Python objects), the checks and
 * small sums (optim_check, fad_codebook, scan_plan, scan_cost,
 * scan_workspace, ksearch_next, csr_plan_info), and the copies out of a plan
 * (csr_program, csr_schedule).
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
    if (rp_py_check_nargs(nargs, 5, "optim_step") < 0 || rp_py_int_arg(args[4], "num_threads", &num_threads) < 0 ||
        rp_py_parse_optim_call(args[0], args[1], args[2], args[3], &call) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = rp_optim_step_cpu(&call.hp, call.dtype, call.entries, call.n, num_threads, &err);
    Py_END_ALLOW_THREADS
    Py_DECREF(call.table);
    return rp_py_none_or_raise(rc, &err);
}

PyDoc_STRVAR(optim_check_doc,
             "optim_check(kind, dtype, table, hparams, capturable)\n--\n\n"
             "Raises the ValueError with which optim_step (CPU or CUDA) would refuse\n"
             "these hyper-parameters, changing nothing (rp_optim_check_update).");

static PyObject *rp_optim_check_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    rp_py_optim_call call;
    rp_error err = {{0}};
    int capturable, rc;
    (void)self;
    if (rp_py_check_nargs(nargs, 5, "optim_check") < 0)
        return NULL;
    capturable = PyObject_IsTrue(args[4]);
    if (capturable < 0 || rp_py_parse_optim_call(args[0], args[1], args[2], args[3], &call) < 0)
        return NULL;
    rc = rp_optim_check_update(&call.hp, call.entries, call.n, capturable, &err);
    Py_DECREF(call.table);
    return rp_py_none_or_raise(rc, &err);
}

PyDoc_STRVAR(fad_forward_doc,
             "fad_forward(kind, p0, p1, dtype, x, y, d_store, d, n, num_threads)\n--\n\n"
             "y = f(x) and d = f'(x) for n elements in one pass on the CPU (see\n"
             "rp_fad_forward_cpu in csrc/reprop.h); x, y, d are data pointers.");

PyDoc_STRVAR(fad_backward_code8_doc,
             "fad_backward_code8(dtype, grad_y, codes, codebook, grad_x, n, num_threads)\n--\n\n"
             "grad_x = grad_y * codebook.value[codes] on the CPU (rp_fad_backward_code8_cpu).");

PyDoc_STRVAR(fad_backward_mixed16_doc,
             "fad_backward_mixed16(dtype, grad_y, d, grad_x, n, num_threads)\n--\n\n"
             "grad_x = grad_y * d on the CPU, d of the other 16-bit dtype than grad_y's\n"
             "(rp_fad_backward_mixed16_cpu).");

PyDoc_STRVAR(scan_doc,
             "scan(n, batch, dim, gates, w, u, v, jt, act, y, pre_activation, c, g, levels, work,\n"
             "     num_threads)\n--\n\n"
             "The BPPSA recurrence g[t] = c[t] + J[t+1]^T g[t+1] on the CPU (rp_scan_cpu in\n"
             "csrc/reprop.h; act, y and pre_activation as in rp_scan_jacobians); pointers as\n"
             "ints, 0 for NULL.");

PyDoc_STRVAR(sched_graph_doc,
             "sched_graph(spec)\n--\n\n"
             "The task graph of layered training iterations (rp_iter_graph_build in\n"
             "csrc/reprop.h) as a dict of NumPy arrays: kind, layer, micro, iteration,\n"
             "resource, policy, group (int32), cost, priority, dep_delay (float64),\n"
             "dep_ptr, dep_idx (int64). `spec` is a dict of every rp_iter_spec field\n"
             "(see csrc/pyutil.h); sync and stage may be None.");

PyDoc_STRVAR(simulate_doc,
             "simulate(graph, corun_rate)\n--\n\n"
             "Plays a task graph (a dict as sched_graph returns) as a discrete-event\n"
             "simulation (rp_simulate): (start, finish, busy, makespan). ValueError for\n"
             "a malformed graph, a deadlock, or times that overflow.");

PyDoc_STRVAR(sched_stages_doc,
             "sched_stages(layers, stages, group)\n--\n\n"
             "The device of each layer (int32): contiguous blocks for group 0, else the\n"
             "modulo allocation (l // group) % stages (rp_sched_stages).");

PyDoc_STRVAR(reverse_first_k_doc,
             "reverse_first_k(layers, k, mem_out_grad, mem_weight_grad, mem_forward, mem_cap)\n"
             "--\n\n"
             "Algorithm 2's backward order as (kind, layer) int32 arrays of 2 * layers\n"
             "entries, and the k it used after the memory cap (mem_cap <= 0: none; the\n"
             "int64 sizes may then be None). See rp_sched_reverse_first_k.");

PyDoc_STRVAR(ksearch_next_doc,
             "ksearch_next(layers, score)\n--\n\n"
             "The coarse-to-fine search for k from the scores alone (NaN: not measured):\n"
             "(next k to measure or -1 when done, best k so far or -1). See\n"
             "rp_ksearch_next.");

PyDoc_STRVAR(sched_regions_doc,
             "sched_regions(t_main, ready, deadline, t_sub, speedup, mem, mem_cap,\n"
             "              shared_size, shared_start, shared_task)\n--\n\n"
             "Algorithm 1 with pre-scheduling (rp_sched_regions): (region, order, pre,\n"
             "peak, held), region and order int64 arrays of the tasks, held the bytes\n"
             "held at each region end (int64, n). mem may be None; mem_cap an int\n"
             "(< 0: no cap; else one cap for every region end) or n int64 caps, one\n"
             "per region end, each >= 0. The storages several tasks read, each held once\n"
             "(rp_shared_reads): storage s of shared_size[s] bytes is read by the tasks\n"
             "shared_task[shared_start[s]:shared_start[s + 1]] (all three None: none).");

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
    {"optim_check", (PyCFunction)(void (*)(void))rp_optim_check_py, METH_FASTCALL, optim_check_doc},
    {"optim_grad_pointers", (PyCFunction)(void (*)(void))rp_py_optim_grad_pointers, METH_FASTCALL,
     "optim_grad_pointers(params, param_keys, state, state_dicts, watched, grad_contiguous,\n"
     "                    strided, table, given, step_table, step_rows, tensor_type, memory,\n"
     "                    guard)\n--\n\n"
     "Per-step fast path of reprop.optim's cached pointer tables (see csrc/pyutil.h)."},
    {"optim_hparams", (PyCFunction)(void (*)(void))rp_py_optim_hparams, METH_FASTCALL,
     "optim_hparams(group) -> tuple or None: a param group's hparams tuple (csrc/pyutil.h)."},
    {"optim_call_key", (PyCFunction)(void (*)(void))rp_py_optim_call_key, METH_FASTCALL,
     "optim_call_key(params) -> bytes: the ids of params, reprop.optim's plan cache key."},
    {"fad_forward", (PyCFunction)(void (*)(void))rp_py_fad_forward, METH_FASTCALL, fad_forward_doc},
    {"fad_backward_code8", (PyCFunction)(void (*)(void))rp_py_fad_backward_code8, METH_FASTCALL,
     fad_backward_code8_doc},
    {"fad_backward_mixed16", (PyCFunction)(void (*)(void))rp_py_fad_backward_mixed16, METH_FASTCALL,
     fad_backward_mixed16_doc},
    {"fad_codebook", (PyCFunction)(void (*)(void))rp_py_fad_codebook, METH_FASTCALL,
     "fad_codebook(kind, p0, p1) -> bytes: an activation's 8-bit codebook (csrc/pyutil.h)."},
    {"scan", (PyCFunction)(void (*)(void))rp_py_scan, METH_FASTCALL, scan_doc},
    {"scan_plan", (PyCFunction)(void (*)(void))rp_py_scan_plan, METH_FASTCALL,
     "scan_plan(n, batch, dim, gates, workers, level_cost, step_cost) -> (levels, max)."},
    {"scan_workspace", (PyCFunction)(void (*)(void))rp_py_scan_workspace, METH_FASTCALL,
     "scan_workspace(n, batch, dim, levels) -> float32 elements of the scan's workspace."},
    {"scan_cost", (PyCFunction)(void (*)(void))rp_py_scan_cost, METH_FASTCALL,
     "scan_cost(n, batch, dim, gates, levels, workers, level_cost, step_cost) -> madds."},
    {"jacobian", (PyCFunction)(void (*)(void))rp_py_jacobian, METH_FASTCALL,
     "jacobian(kind, geometry) -> int32 arrays of a CSR transposed Jacobian (csrc/pyutil.h)."},
    {"csr_plan", (PyCFunction)(void (*)(void))rp_py_csr_plan, METH_FASTCALL,
     "csr_plan(leaves, levels, max_pairs, workers, level_cost, step_cost) -> plan capsule."},
    {"csr_plan_info", (PyCFunction)(void (*)(void))rp_py_csr_plan_info, METH_FASTCALL,
     "csr_plan_info(plan) -> dict: levels, cost, seq_floats, shared_floats, madds, linear_madds,\n"
     "products, pairs, phases, rows, terms."},
    {"csr_program", (PyCFunction)(void (*)(void))rp_py_csr_program, METH_FASTCALL,
     "csr_program(plan) -> dict of NumPy copies of the plan's program (csrc/reprop.h)."},
    {"csr_schedule", (PyCFunction)(void (*)(void))rp_py_csr_schedule, METH_FASTCALL,
     "csr_schedule(plan) -> dict: steps (kind, m, x, y, len) and products (a, b, rows, cols,\n"
     "shared) as int64 arrays, vectors, width: the cuSPARSE peer's step table (csrc/reprop.h)."},
    {"csr_run", (PyCFunction)(void (*)(void))rp_py_csr_run, METH_FASTCALL,
     "csr_run(plan, batch, seq, shared, dst, term_ptr, tx, ty, num_threads): the plan's program\n"
     "on the CPU (rp_csr_run_cpu); seq and shared data pointers, the row pointers ignored."},
    {"csr_gradients", (PyCFunction)(void (*)(void))rp_py_csr_gradients, METH_FASTCALL,
     "csr_gradients(plan, batch, seq, out, num_threads) -> bool: every layer's input gradient\n"
     "out of a CPU run's seq into out's float32 batch-major buffers (rp_csr_gradients_cpu);\n"
     "whether all are finite."},
    {"sched_graph", (PyCFunction)(void (*)(void))rp_py_sched_graph, METH_FASTCALL,
     sched_graph_doc},
    {"simulate", (PyCFunction)(void (*)(void))rp_py_simulate, METH_FASTCALL, simulate_doc},
    {"sched_stages", (PyCFunction)(void (*)(void))rp_py_sched_stages, METH_FASTCALL,
     sched_stages_doc},
    {"reverse_first_k", (PyCFunction)(void (*)(void))rp_py_reverse_first_k, METH_FASTCALL,
     reverse_first_k_doc},
    {"ksearch_next", (PyCFunction)(void (*)(void))rp_py_ksearch_next, METH_FASTCALL,
     ksearch_next_doc},
    {"sched_regions", (PyCFunction)(void (*)(void))rp_py_sched_regions, METH_FASTCALL,
     sched_regions_doc},
    {"build_info", rp_build_info_py, METH_NOARGS, "Facts about how the C core was built."},
    {NULL, NULL, 0, NULL},
};

static int rp_exec(PyObject *module) { return rp_py_module_exec(module, NULL); }

static PyModuleDef_Slot rp_slots[] = {
    {Py_mod_exec, rp_exec},
    {0, NULL},
};

static struct PyModuleDef rp_module = {
    PyModuleDef_HEAD_INIT, "reprop._C", "The reprop C core (CPU).", sizeof(rp_py_module_state),
    rp_methods, rp_slots, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&rp_module); }
