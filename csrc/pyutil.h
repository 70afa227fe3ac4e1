/*
 * pyutil.h: argument parsing and bindings shared by the CPython extensions
 * (module.c for the CPU extension reprop._C, module_cuda.c for reprop._cuda).
 * Only the binding files and pyutil.c touch the CPython and NumPy C APIs.
 */
#ifndef REPROP_PYUTIL_H
#define REPROP_PYUTIL_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "reprop.h"

/* Turns a core status and message into a Python exception; returns NULL. */
PyObject *rp_py_raise(int code, const rp_error *err);

/* A parsed optimizer call: the hyper-parameters, the param dtype code and the
 * entry table, which borrows the memory of a NumPy int64 array of shape (n, 8)
 * held in `table` (a new reference the caller releases with Py_DECREF). */
typedef struct {
    rp_optim_hparams hp;
    int dtype;
    PyObject *table;
    rp_optim_entry *entries;
    int64_t n;
} rp_py_optim_call;

/* The kinds in the hparams tuple's last int, RP_HPARAM_KIND_BITS each. */
enum { RP_HPARAM_KINDS = 8, RP_HPARAM_KIND_BITS = 3 };

/* Parses (kind, dtype, table, hparams) where hparams is the tuple
 * (lr, weight_decay, eps, beta1, beta2, momentum, dampening, alpha, rho,
 *  lr_decay, nesterov, maximize, amsgrad, decoupled_weight_decay, centered
 *  [, kinds]), kinds the rp_lr_kinds of lr, weight_decay, beta1, beta2,
 *  dampening, alpha, rho and lr_decay, RP_HPARAM_KIND_BITS each from the
 *  lowest (absent: 0, all RP_LR_NUMBER; one int, for the tuple to stay as
 *  short as Python's free lists keep), and checks the table.
 * 0 on success, -1 with a Python exception set. */
int rp_py_parse_optim_call(PyObject *kind, PyObject *dtype, PyObject *table, PyObject *hparams,
                           rp_py_optim_call *call);

/* optim_hparams(group) -> tuple or None: the hparams tuple above of a param
 * group (a dict), as reprop.optim's _hparams_of builds it, when
 * every entry it reads is of a type that goes in as it is: group an exact
 * dict with "lr", the numeric entries (absent: 0.0; beta1 and beta2 the
 * first two items of an exact tuple or list "betas", absent: 0.0) exact
 * floats or ints of 64 bits, "capturable" and the flags (absent: False) bools, None,
 * exact ints or floats, whose truth is the flag; kinds 0. None
 * otherwise (a tensor lr,
 * a NumPy scalar, a bool where a number goes, a value refused, no "lr"), for
 * _hparams to convert or refuse the group's values itself. Defined in
 * pyutil.c. */
PyObject *rp_py_optim_hparams(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* optim_grad_pointers(params, param_keys, state, state_dicts, watched,
 *                     grad_contiguous, strided, table, given, step_table,
 *                     step_rows, tensor_type, memory, guard)
 *     -> (held, rows, report) or None
 * The per-step fast path of reprop.optim's cached pointer tables. A param's
 * gradient is its .grad, or given[id(param)] where `given` (else None) is a
 * dict of them. A row whose param has no gradient sits the step out; of
 * each other row it checks
 * that the param still has its storage and layout (param_keys[i] is the
 * tuple (data_ptr, dtype, shape, True if contiguous else strides, device
 * index) the table was built for), its state (the same dict, and each
 * watched[i] entry (key, tensor, column) still the tensor at that key, at
 * the address in that column, and contiguous but the step count; watched[i]
 * None: a dormant row, built without state) and a contiguous strided
 * gradient of type tensor_type (torch.Tensor) and the param's dtype, shape
 * and device without torch's negative bit, sharing none of the memory the
 * call writes (`memory`: a 1-D int64 array of disjoint [start, end) address
 * pairs, sorted), and writes the gradient pointer into
 * column 1 of `table`. `step_table` is the table the previous step's update
 * ran on: `table` itself with step_rows None (all rows took part), else a
 * copy of the rows whose int64 indices step_rows holds, ascending. While the
 * same rows take part, their pointers go into step_table too. Returns the
 * gradients read and None when the rows taking part are the previous step's,
 * else the list of their indices (for the caller to build another step
 * table), and `report`; or None as soon as anything differs, leaving the
 * Python path to rebuild, convert or raise. `guard` (optim.py's
 * _Plan.guard): None; True, for `report` to be, where the rows taking part
 * are the previous step's, the tuple of the tensors whose layouts it checked
 * (each row's param, watched state tensors but step counts, and gradient),
 * to build a layout guard from; or such a guard, a callable given those
 * tensors that says whether they still have the layouts of the ones it was
 * built from: where the rows taking part are still those, it checks the
 * layouts in one call, the rows being checked for identities and addresses
 * only (report False where it refused: the rows were then checked in full).
 * report is None otherwise. Defined in pyutil.c. */
PyObject *rp_py_optim_grad_pointers(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* optim_call_key(params) -> bytes: the id() of each object of the sequence
 * `params`, as native uintptr_t words: reprop.optim's plan cache key for a
 * call's params, which hashes and compares at memory speed where a tuple of
 * ids costs an int object per param each step. Defined in pyutil.c. */
PyObject *rp_py_optim_call_key(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* fad_codebook(kind, p0, p1) -> bytes: the rp_fad_codebook struct of an
 * activation, for the 8-bit backward and for inspection (its first 256
 * float32 are the decoded value of each code). Defined in pyutil.c. */
PyObject *rp_py_fad_codebook(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* The CUDA launchers (csrc/reprop.h) of the bindings both extensions have,
 * handed over by module_cuda.c: pyutil.c is compiled into reprop._C too,
 * which links no CUDA code. */
typedef struct {
    int (*fad_forward)(int kind, float p0, float p1, int dtype, const void *x, void *y,
                       int d_store, void *d, int64_t n, void *stream, rp_error *err);
    int (*fad_backward_code8)(int dtype, const void *grad_y, const uint8_t *codes,
                              const rp_fad_codebook *cb, void *grad_x, int64_t n, void *stream,
                              rp_error *err);
    int (*scan)(const rp_scan_jacobians *j, const float *c, float *g, int levels, float *work,
                void *stream, rp_error *err);
    int (*csr_run)(const rp_csr_program *g, const rp_csr_device_rows *rows, int64_t batch,
                   float *seq, float *shared, void *stream, rp_error *err);
} rp_py_cuda_launchers;

/* The state of either extension module (PyModuleDef.m_size): its CUDA
 * launchers, NULL in reprop._C. */
typedef struct {
    const rp_py_cuda_launchers *cuda;
} rp_py_module_state;

/* The Py_mod_exec work of either extension: imports NumPy's C API and keeps
 * `cuda` (NULL for the CPU extension) in the module's state. 0 on success,
 * -1 with a Python exception set. */
int rp_py_module_exec(PyObject *module, const rp_py_cuda_launchers *cuda);

/* The bindings both extensions have (METH_FASTCALL, self the module). Their
 * last argument says where the work runs: the CPU core's thread count in
 * reprop._C, the integer cudaStream_t the launchers enqueue on in reprop._cuda.
 * Pointers arrive as Python ints (data_ptr(), 0 for NULL), already checked by
 * python/reprop (fad.py, bppsa.py) for dtype, device, layout and size.
 *   fad_forward(kind, p0, p1, dtype, x, y, d_store, d, n, where)
 *       (rp_fad_forward_cpu, rp_cuda_fad_forward)
 *   fad_backward_code8(dtype, grad_y, codes, codebook, grad_x, n, where)
 *       codebook: the bytes fad_codebook() returned (rp_fad_backward_code8_cpu)
 *   scan(n, batch, dim, gates, w, u, v, jt, act, y, pre_activation, c, g, levels,
 *        work, where): act an rp_scan_act (rp_scan_cpu, rp_cuda_scan)
 *   csr_run(plan, batch, seq, shared, dst, term_ptr, tx, ty, where): a csr_plan's
 *        program; dst .. ty the device copies of its rows, ignored on the CPU
 *        (rp_csr_run_cpu, rp_cuda_csr_run) */
PyObject *rp_py_fad_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *rp_py_fad_backward_code8(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *rp_py_scan(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *rp_py_csr_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* reprop._C's alone: fad_backward_mixed16(dtype, grad_y, d, grad_x, n, num_threads)
 * (rp_fad_backward_mixed16_cpu), the GIL released. */
PyObject *rp_py_fad_backward_mixed16(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* None when a core call returned RP_OK, else its error raised (NULL). */
PyObject *rp_py_none_or_raise(int code, const rp_error *err);

/* Re-raises a pending TypeError, ValueError or OverflowError with
 * "fname: name: " (fname NULL: "name: ") in front of its message, so that a
 * bad argument or spec entry names itself; any other error stays as it is. */
void rp_py_prefix_error(const char *fname, const char *name);

/* Arguments of the bindings' own calls: 0, or -1 with a Python exception set. */
int rp_py_check_nargs(Py_ssize_t nargs, Py_ssize_t want, const char *fname);
/* An int argument; its errors name it (`name`), OverflowError when out of
 * int's range. */
int rp_py_int_arg(PyObject *obj, const char *name, int *out);
/* An int64 argument; its errors (OverflowError past int64) name it. */
int rp_py_size_arg(PyObject *obj, const char *name, int64_t *out);
/* A data pointer as an int (0 for NULL); its errors name it. */
int rp_py_pointer_arg(PyObject *obj, const char *name, void **out);
/* torch.cuda.Stream.cuda_stream, an int; its errors name "stream". */
int rp_py_stream_arg(PyObject *obj, void **stream);
/* The pointer of the capsule named `capsule` that the binding `maker`
 * returns; NULL with a TypeError naming the argument `name`. */
void *rp_py_capsule_arg(PyObject *obj, const char *capsule, const char *maker, const char *name);

/* Device-independent scan facts for reprop.bppsa (defined in pyutil.c):
 *   scan_plan(n, batch, dim, gates, workers, level_cost, step_cost)
 *       -> (levels the cost model picks, max levels)
 *   scan_workspace(n, batch, dim, levels) -> float32 elements of the workspace
 *   scan_cost(n, batch, dim, gates, levels, workers, level_cost, step_cost) -> float */
PyObject *rp_py_scan_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *rp_py_scan_cost(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *rp_py_scan_workspace(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* The sparse side of reprop.bppsa (defined in pyutil.c):
 *   jacobian(kind, geometry) -> int32 NumPy arrays (indptr, indices, maps...)
 *       kind "conv2d"/"maxpool2d" with the 15-tuple of rp_conv2d_geom,
 *       "linear" with (in, out), "diagonal" with (size, 0)
 *   csr_plan(leaves, levels, max_pairs, workers, level_cost, step_cost) -> capsule;
 *       leaves: (rows, cols, indptr, indices, shared, value_map or None, values) per
 *       layer, int32 arrays
 *   csr_plan_info(plan) -> dict of rp_csr_plan_info
 *   csr_program(plan) -> dict of NumPy copies of its rp_csr_program arrays
 *   csr_schedule(plan) -> dict of rp_csr_plan_schedule: steps (nsteps, 5) and
 *       products (nproducts, 5) int64 NumPy arrays, vectors, width
 *   csr_gradients(plan, batch, seq, out, num_threads) -> bool: out a sequence of
 *       a float32 data pointer per layer (rp_csr_gradients_cpu); whether all
 *       gradients are finite */
PyObject *rp_py_jacobian(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *rp_py_csr_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *rp_py_csr_plan_info(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *rp_py_csr_program(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *rp_py_csr_schedule(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *rp_py_csr_gradients(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* Out-of-order backprop scheduling (csrc/schedule.c), defined in pyutil.c;
 * arguments may be any array-likes, cast by NumPy's safe rule:
 *   sched_graph(spec) -> dict of the rp_task_graph arrays: kind, layer,
 *       micro, iteration, resource, policy, group (int32), cost, priority,
 *       dep_delay (float64), dep_ptr, dep_idx (int64). spec: a dict with
 *       every field of rp_iter_spec: layers, micro, stages, iterations,
 *       order, k (ints), transfer (float), sync_by_layer, sub_stream,
 *       input_grad (bools), fwd, out_grad, weight_grad (float64, layers),
 *       sync (float64 or None), stage (int32 or None)
 *   simulate(graph, corun_rate) -> (start, finish, busy, makespan): graph a
 *       dict of those arrays (sizes from kind, dep_idx and policy)
 *   sched_stages(layers, stages, group) -> int32 stage of each layer
 *   reverse_first_k(layers, k, mem_out_grad, mem_weight_grad, mem_forward,
 *       mem_cap) -> (kind, layer, k_used): int32 arrays of 2 layers; the
 *       memory sizes int64 arrays or None
 *   ksearch_next(layers, score) -> (next, best): score float64 (layers + 1)
 *   sched_regions(t_main, ready, deadline, t_sub, speedup, mem, mem_cap,
 *       shared_size, shared_start, shared_task)
 *       -> (region, order, pre, peak, held): t_main (n), ready and
 *       deadline (n_tasks), t_sub and speedup (n_tasks, n), mem int64
 *       (n_tasks) or None; mem_cap an int (< 0: none; else the same at
 *       every region end) or int64 (n), each >= 0; the storages several
 *       tasks read (rp_shared_reads) int64 (n_shared), (n_shared + 1) and
 *       (start[-1]), or all None; region and order int64 arrays, held int64
 *       (n) */
PyObject *rp_py_sched_graph(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *rp_py_simulate(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *rp_py_sched_stages(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *rp_py_reverse_first_k(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *rp_py_ksearch_next(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *rp_py_sched_regions(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif /* REPROP_PYUTIL_H */
