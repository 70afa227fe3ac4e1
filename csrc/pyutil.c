/* pyutil.c: argument parsing and bindings shared by the extensions; see pyutil.h. */
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include "pyutil.h"

#include <numpy/arrayobject.h>
#include <stddef.h>

static int rp_py_import_numpy(void)
{
    import_array1(-1);
    return 0;
}

int rp_py_module_exec(PyObject *module, const rp_py_cuda_launchers *cuda)
{
    ((rp_py_module_state *)PyModule_GetState(module))->cuda = cuda;
    return rp_py_import_numpy();
}

/* The CUDA launchers of `module`'s extension; NULL in reprop._C. */
static const rp_py_cuda_launchers *rp_py_cuda_of(PyObject *module)
{
    return ((rp_py_module_state *)PyModule_GetState(module))->cuda;
}

PyObject *rp_py_raise(int code, const rp_error *err)
{
    PyErr_SetString(code == RP_EINVAL ? PyExc_ValueError : PyExc_RuntimeError, err->msg);
    return NULL;
}

PyObject *rp_py_none_or_raise(int code, const rp_error *err)
{
    if (code != RP_OK)
        return rp_py_raise(code, err);
    Py_RETURN_NONE;
}

void rp_py_prefix_error(const char *fname, const char *name)
{
    PyObject *type, *value, *tb, *msg, *kind;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    kind = PyErr_GivenExceptionMatches(type, PyExc_TypeError)       ? PyExc_TypeError
           : PyErr_GivenExceptionMatches(type, PyExc_ValueError)    ? PyExc_ValueError
           : PyErr_GivenExceptionMatches(type, PyExc_OverflowError) ? PyExc_OverflowError
                                                                    : NULL;
    msg = kind != NULL && value != NULL ? PyObject_Str(value) : NULL;
    if (msg == NULL) {
        if (kind != NULL) /* PyObject_Str failed: keep the original */
            PyErr_Clear();
        PyErr_Restore(type, value, tb);
        return;
    }
    if (fname != NULL)
        PyErr_Format(kind, "%s: %s: %U", fname, name, msg);
    else
        PyErr_Format(kind, "%s: %U", name, msg);
    Py_DECREF(msg);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

/* Whether the core can read arr's memory as a C array of its dtype: native
 * byte order (PyArray_TYPE says NPY_INT64 for '>i8' too, whose bytes the core
 * would read swapped: pointers and sizes from another number), aligned and
 * C-contiguous. The one check of every array argument the core reads in
 * place. */
static int rp_py_is_c_data(PyArrayObject *arr)
{
    return PyArray_ISNOTSWAPPED(arr) && PyArray_ISALIGNED(arr) && PyArray_IS_C_CONTIGUOUS(arr);
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
    /* equivalent: np.longlong is int64 too where long is (LP64) */
    if (!PyArray_EquivTypenums(PyArray_TYPE(arr), NPY_INT64) || PyArray_NDIM(arr) != 2 ||
        PyArray_DIM(arr, 1) != (npy_intp)(sizeof(rp_optim_entry) / sizeof(int64_t))) {
        PyErr_SetString(PyExc_ValueError, "table: expected an int64 array of shape (n, 8)");
        return -1;
    }
    if (!rp_py_is_c_data(arr) || !PyArray_ISWRITEABLE(arr)) {
        PyErr_SetString(PyExc_ValueError,
                        "table: expected a C-contiguous, aligned, writeable array in native byte "
                        "order");
        return -1;
    }
    *out = arr;
    return 0;
}

/* The kinds packed into the hparams tuple's last int (pyutil.h). */
static void rp_py_unpack_kinds(int packed, rp_optim_hparams *hp)
{
    int *const kinds[RP_HPARAM_KINDS] = {&hp->lr_kind,        &hp->weight_decay_kind,
                                         &hp->beta1_kind,     &hp->beta2_kind,
                                         &hp->dampening_kind, &hp->alpha_kind,
                                         &hp->rho_kind,       &hp->lr_decay_kind};
    int k;
    for (k = 0; k < RP_HPARAM_KINDS; k++)
        *kinds[k] = packed >> (RP_HPARAM_KIND_BITS * k) & ((1 << RP_HPARAM_KIND_BITS) - 1);
}

int rp_py_parse_optim_call(PyObject *kind, PyObject *dtype, PyObject *table, PyObject *hparams,
                           rp_py_optim_call *call)
{
    PyArrayObject *arr = NULL;
    rp_optim_hparams *hp = &call->hp;
    int kinds = 0;
    memset(call, 0, sizeof *call);
    if (rp_py_int_arg(kind, "kind", &hp->kind) < 0 || rp_py_int_arg(dtype, "dtype", &call->dtype) < 0)
        return -1;
    if (!PyTuple_Check(hparams)) {
        PyErr_SetString(PyExc_TypeError, "hparams: expected a tuple");
        return -1;
    }
    if (!PyArg_ParseTuple(hparams,
                          "ddddddddddppppp|i;hparams: expected 10 floats, 5 bools and an optional int",
                          &hp->lr, &hp->weight_decay, &hp->eps, &hp->beta1, &hp->beta2,
                          &hp->momentum, &hp->dampening, &hp->alpha, &hp->rho, &hp->lr_decay,
                          &hp->nesterov, &hp->maximize, &hp->amsgrad, &hp->decoupled_weight_decay,
                          &hp->centered, &kinds))
        return -1;
    rp_py_unpack_kinds(kinds, hp);
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

/* A dict lookup's result as state.get() has it (no __missing__): borrowed,
 * Py_None when absent, NULL with an exception set on error. */
static PyObject *rp_py_found(PyObject *v)
{
    if (v == NULL && !PyErr_Occurred())
        return Py_None;
    return v;
}

/* state.get(key), as rp_py_found has it. */
static PyObject *rp_py_dict_get(PyObject *dict, PyObject *key)
{
    return rp_py_found(PyDict_GetItemWithError(dict, key));
}

/* Whether getattr(t, name) (call: t.name()) equals `want`: 1 yes, 0 no, -1 on error.
 * `same`: compare by identity (dtype objects are singletons), else with ==. */
static int rp_py_attr_equals(PyObject *t, PyObject *name, int call, PyObject *want, int same)
{
    PyObject *v = call ? PyObject_CallMethodNoArgs(t, name) : PyObject_GetAttr(t, name);
    int eq;
    if (v == NULL)
        return -1;
    eq = same ? v == want : PyObject_RichCompareBool(v, want, Py_EQ);
    Py_DECREF(v);
    return eq;
}

/* The table column of a row's step count (optim.py's _COL_STEP). */
#define RP_PY_STEP_COLUMN ((long)(offsetof(rp_optim_entry, step) / sizeof(int64_t)))

/* Attribute names the fast path looks up. */
enum { RP_N_DATA_PTR, RP_N_GRAD, RP_N_LAYOUT, RP_N_IS_CONTIGUOUS, RP_N_DTYPE, RP_N_SHAPE,
       RP_N_STRIDE, RP_N_GET_DEVICE, RP_N_IS_NEG, RP_N_ITEMSIZE, RP_N_HASH, RP_N_NAMES };

/* names[0 .. n) as the interned strings of text[], made at the first call
 * and kept for the process (names is the caller's static array; its last
 * entry, set last, says it is filled). NULL with an exception set on
 * failure, nothing kept: the next call tries again. */
static PyObject *const *rp_py_interned(const char *const *text, PyObject **names, int n)
{
    int k;
    if (names[n - 1] != NULL)
        return names;
    for (k = 0; k < n; k++) {
        names[k] = PyUnicode_InternFromString(text[k]);
        if (names[k] == NULL) {
            while (k-- > 0)
                Py_CLEAR(names[k]);
            return NULL;
        }
    }
    return names;
}

/* The names, interned at the first call and kept for the process:
 * interning them at each call cost about 7k instructions, a quarter of the
 * call for a fused module's two params. A static, as torch, on whose tensors
 * they are looked up, runs in the main interpreter only. NULL with an
 * exception set on failure (nothing kept: the next call tries again). */
static PyObject *const *rp_py_attr_names(void)
{
    static const char *const text[RP_N_NAMES] = {
        "data_ptr", "grad", "layout", "is_contiguous", "dtype", "shape", "stride", "get_device",
        "is_neg", "itemsize", "__hash__"};
    static PyObject *names[RP_N_NAMES];
    return rp_py_interned(text, names, RP_N_NAMES);
}

/* The memory the call writes (optim.py's _CallMemory.bounds): n disjoint
 * [start, end) spans sorted by address, as pairs. */
typedef struct {
    const int64_t *span;
    Py_ssize_t n;
} rp_py_call_memory;

/* What the rows of one fast-path call read (optim_grad_pointers' arguments),
 * and how far each row looks. `light`: at identities and addresses only,
 * leaving the layouts (dtype, shape, strides, and a gradient's layout,
 * device and negative bit) to the caller's metadata guard, which vouches for
 * all of them in one call (rp_py_guarded_rows). `checked`, where not NULL,
 * collects the tensors whose layouts the guard checks, in its order: each
 * row's param, its watched state tensors but step counts, its gradient. */
typedef struct {
    PyObject *const *names;
    PyObject *state, *strided, *tensor_type, *given;
    PyObject *tensor_hash; /* tensor_type's __hash__, borrowed; NULL if none */
    const rp_py_call_memory *memory;
    int light;
    PyObject *checked;
} rp_py_grad_call;

/* Adds t to the tensors for the metadata guard, where the call collects
 * them. 0, or -1 with an exception set. */
static int rp_py_check_later(const rp_py_grad_call *call, PyObject *t)
{
    return call->checked == NULL ? 0 : PyList_Append(call->checked, t);
}

/* Whether param p still has the memory a row of the table was built for:
 * key is (data_ptr, dtype, shape, layout, device index, span) as the plan
 * recorded them (optim.py's _layout_key), layout True for a contiguous param,
 * else its strides, and span the bytes its elements lie in from data_ptr,
 * which follows from the others. The kernels walk numel elements of the
 * dtype from the data pointer, so a param whose .data was replaced by
 * another tensor at the same address (a view of its own storage, or a reused
 * allocation) of another shape, dtype or layout must not pass: one of the
 * same numel reshaped (p.data = p.data.reshape(3, 2)) no longer matches its
 * gradient, which torch refuses. Equal addresses are on the same device
 * (CUDA's unified addressing). 1 / 0 / -1 with an exception set. */
static int rp_py_same_param(PyObject *p, PyObject *key, const rp_py_grad_call *call)
{
    PyObject *const *names = call->names;
    unsigned long long ptr, want;
    PyObject *layout = PyTuple_GET_ITEM(key, 3);
    int ok;
    if (rp_py_data_ptr(p, names[RP_N_DATA_PTR], &ptr) < 0)
        return -1;
    want = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(key, 0));
    if (want == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    if (ptr != want)
        return 0;
    if (call->light) /* the guard vouches for the rest */
        return 1;
    ok = rp_py_attr_equals(p, names[RP_N_DTYPE], 0, PyTuple_GET_ITEM(key, 1), 1);
    if (ok == 1)
        ok = rp_py_attr_equals(p, names[RP_N_SHAPE], 0, PyTuple_GET_ITEM(key, 2), 0);
    if (ok == 1) {
        if (layout == Py_True)
            ok = rp_py_attr_equals(p, names[RP_N_IS_CONTIGUOUS], 1, Py_True, 1);
        else
            ok = rp_py_attr_equals(p, names[RP_N_STRIDE], 1, layout, 0);
    }
    return ok;
}

/* Whether gradient g is one the row can read as the param's: a plain
 * torch.Tensor (`tensor_type`: a subclass, whose __torch_dispatch__ may hold
 * no memory of its own, goes to the Python path's checks), strided,
 * contiguous, with the param's dtype, shape (torch refuses a gradient of
 * another shape, also one of the same numel) and device, and without torch's
 * lazy negative bit (x.conj().imag: its memory holds -g). 1 / 0 / -1. */
static int rp_py_usable_grad(PyObject *g, PyObject *key, const rp_py_grad_call *call)
{
    PyObject *const *names = call->names;
    int ok;
    if ((PyObject *)Py_TYPE(g) != call->tensor_type)
        return 0;
    if (call->light) /* the guard vouches for the rest */
        return 1;
    ok = rp_py_attr_equals(g, names[RP_N_LAYOUT], 0, call->strided, 1);
    if (ok == 1)
        ok = rp_py_attr_equals(g, names[RP_N_DTYPE], 0, PyTuple_GET_ITEM(key, 1), 1);
    if (ok == 1)
        ok = rp_py_attr_equals(g, names[RP_N_SHAPE], 0, PyTuple_GET_ITEM(key, 2), 0);
    if (ok == 1)
        ok = rp_py_attr_equals(g, names[RP_N_GET_DEVICE], 1, PyTuple_GET_ITEM(key, 4), 0);
    if (ok == 1)
        ok = rp_py_attr_equals(g, names[RP_N_IS_CONTIGUOUS], 1, Py_True, 1);
    if (ok == 1)
        ok = rp_py_attr_equals(g, names[RP_N_IS_NEG], 1, Py_False, 1);
    return ok;
}

/* Whether state tensor v (not a step count), at the address its row points
 * at, is still what the row reads there: contiguous, as the state of the
 * rows this path takes is, and of the param's shape (`shape`). A tensor
 * changed in place keeps its identity and address: relaid (t_(),
 * as_strided_(), set_() with other strides, .data swapped for a transposed
 * view of itself), torch's update reads it in its new layout; reshaped or
 * given fewer elements (as_strided_((6, 4), (4, 1)), as_strided_((3, 6),
 * (6, 1)) or resize_(3, 6) of a (4, 6) param's, set_() onto less memory),
 * torch's update refuses it, where the kernels read and wrote the param's
 * numel floats from its address, past its elements. The Python path then
 * reads or refuses it. (A step count changed in place needs no look: one of
 * no elements has address 0, and one element is all the kernels read.)
 * 1 / 0 / -1. */
static int rp_py_state_current(PyObject *v, PyObject *shape, PyObject *const *names)
{
    int ok = rp_py_attr_equals(v, names[RP_N_IS_CONTIGUOUS], 1, Py_True, 1);
    if (ok == 1)
        ok = rp_py_attr_equals(v, names[RP_N_SHAPE], 0, shape, 0);
    return ok;
}

/* state.get(p), as rp_py_found has it, with p's hash known where p's type
 * hashes with torch.Tensor's own __hash__: id(self) (torch/_tensor.py),
 * which CPython's slot for a Python __hash__ returns as the hash itself
 * where it fits a Py_hash_t. Calling that Python function was 50 ns of a
 * row's 1.2 us. The lookup is the same: the dict compares the keys as it
 * did. */
static PyObject *rp_py_state_of(PyObject *p, const rp_py_grad_call *call)
{
    PyTypeObject *type = Py_TYPE(p);
    if (call->tensor_hash != NULL && (uintptr_t)p <= (uintptr_t)PY_SSIZE_T_MAX &&
        type->tp_hash == ((PyTypeObject *)call->tensor_type)->tp_hash &&
        _PyType_Lookup(type, call->names[RP_N_HASH]) == call->tensor_hash)
        return rp_py_found(_PyDict_GetItem_KnownHash(call->state, p, (Py_hash_t)(uintptr_t)p));
    return rp_py_dict_get(call->state, p);
}

/* Whether a row still points where the table was built for: the same
 * param memory and layout, the same state dict, and each state tensor
 * watched[i] lists, (key, tensor, column), still the tensor at that key, at
 * the address in that column (the same tensor object with other memory,
 * .data replaced, is stale too) and as the row reads it there
 * (rp_py_state_current). A dormant row (watched None: its param had no state
 * when the table was built) never is. 1 / 0 / -1. */
static int rp_py_row_current(PyObject *p, PyObject *key, PyObject *st, PyObject *watched,
                             PyObject *contiguous, const rp_py_grad_call *call,
                             const int64_t *row)
{
    unsigned long long ptr;
    PyObject *attr;
    Py_ssize_t k;
    int ok;
    if (contiguous != Py_True || !PyTuple_Check(watched) || !PyTuple_Check(key) ||
        PyTuple_GET_SIZE(key) != 6)
        return 0;
    ok = rp_py_same_param(p, key, call);
    if (ok != 1)
        return ok;
    if (rp_py_check_later(call, p) < 0)
        return -1;
    attr = rp_py_state_of(p, call);
    if (attr != st)
        return attr == NULL ? -1 : 0;
    for (k = 0; k < PyTuple_GET_SIZE(watched); k++) {
        PyObject *entry = PyTuple_GET_ITEM(watched, k), *v;
        long col;
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 3 || !PyDict_Check(st))
            return 0;
        v = rp_py_dict_get(st, PyTuple_GET_ITEM(entry, 0));
        if (v != PyTuple_GET_ITEM(entry, 1))
            return v == NULL ? -1 : 0;
        col = PyLong_AsLong(PyTuple_GET_ITEM(entry, 2));
        if (col == -1 && PyErr_Occurred())
            return -1;
        if (col < 0 || (size_t)col >= sizeof(rp_optim_entry) / sizeof(int64_t))
            return 0;
        if (rp_py_data_ptr(v, call->names[RP_N_DATA_PTR], &ptr) < 0)
            return -1;
        if ((int64_t)ptr != row[col])
            return 0;
        if (col != RP_PY_STEP_COLUMN) {
            ok = call->light ? 1 : rp_py_state_current(v, PyTuple_GET_ITEM(key, 2), call->names);
            if (ok == 1 && rp_py_check_later(call, v) < 0)
                ok = -1;
            if (ok != 1)
                return ok;
        }
    }
    return 1;
}

/* What rp_py_grad_row found: the row takes part with its pointer written,
 * its param has no gradient this step (the row sits the step out, as torch
 * skips such a param, unchecked: nothing reads it), or the Python path must
 * take over. */
enum { RP_ROW_ERROR = -1, RP_ROW_STALE = 0, RP_ROW_HOLDS = 1, RP_ROW_NO_GRAD = 2 };

/* Param p's gradient this step, a new reference: p.grad, or given[id(p)]
 * where the caller gives the gradients (a dict by id, as optim.py's `given`);
 * NULL with an exception set (KeyError for a param given none, as
 * given[id(p)] raises). */
static PyObject *rp_py_grad_of(PyObject *p, const rp_py_grad_call *call)
{
    PyObject *given = call->given, *id, *g;
    if (given == Py_None)
        return PyObject_GetAttr(p, call->names[RP_N_GRAD]);
    id = PyLong_FromVoidPtr(p); /* id(p) */
    if (id == NULL)
        return NULL;
    g = PyDict_GetItemWithError(given, id);
    if (g == NULL && !PyErr_Occurred())
        PyErr_SetObject(PyExc_KeyError, id);
    Py_DECREF(id);
    Py_XINCREF(g);
    return g;
}

/* Whether a contiguous gradient at address g may share memory that the call
 * writes: a param's (its own too) or a state tensor's. Its numel elements of
 * the param's dtype lie in numel x itemsize bytes from g: key[5], the span
 * of a contiguous param (key[3] True), or, for a param with gaps in memory
 * (a column slice, whose span key[5] is the whole matrix's rows: taken as
 * the gradient's, it met other tensors and sent every step to the Python
 * path, twice as slow), counted from the dtype's itemsize. The kernels would
 * read such a gradient while they write that memory, where torch reads all
 * of it first, or after an in-place op has written it (the state, decoupled
 * weight decay): the Python path reads one sharing its own param's memory
 * through a copy, filled as torch reads it, and refuses the others. A
 * bisection over the spans. 1 / 0 / -1 with an exception set. */
static int rp_py_meets_call_memory(unsigned long long g, PyObject *key, int64_t numel,
                                   PyObject *const *names, const rp_py_call_memory *memory)
{
    unsigned long long span;
    Py_ssize_t lo = 0, hi = memory->n; /* spans [lo, hi) may start below the gradient's end */
    if (PyTuple_GET_ITEM(key, 3) == Py_True) {
        span = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(key, 5));
        if (span == (unsigned long long)-1 && PyErr_Occurred())
            return -1;
    } else {
        PyObject *size = PyObject_GetAttr(PyTuple_GET_ITEM(key, 1), names[RP_N_ITEMSIZE]);
        long long itemsize;
        if (size == NULL)
            return -1;
        itemsize = PyLong_AsLongLong(size);
        Py_DECREF(size);
        if (itemsize == -1 && PyErr_Occurred())
            return -1;
        span = (unsigned long long)numel * (unsigned long long)itemsize;
    }
    if (span == 0)
        return 0;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if ((unsigned long long)memory->span[2 * mid] < g + span)
            lo = mid + 1;
        else
            hi = mid;
    }
    /* lo - 1: the last span starting below the gradient's end; the spans are
     * disjoint, so only it may reach past the gradient's start */
    return lo > 0 && (unsigned long long)memory->span[2 * lo - 1] > g;
}

/* One row of the fast path; RP_ROW_HOLDS with the gradient the row now
 * points at, a new reference, in *held. */
static int rp_py_grad_row(PyObject *p, PyObject *key, PyObject *st, PyObject *watched,
                          PyObject *contiguous, const rp_py_grad_call *call, int64_t *row,
                          PyObject **held)
{
    unsigned long long ptr;
    PyObject *g = rp_py_grad_of(p, call);
    int ok;
    if (g == NULL)
        return RP_ROW_ERROR;
    if (g == Py_None) {
        Py_DECREF(g);
        return RP_ROW_NO_GRAD;
    }
    ok = rp_py_row_current(p, key, st, watched, contiguous, call, row);
    if (ok == 1)
        ok = rp_py_usable_grad(g, key, call);
    if (ok == 1)
        ok = rp_py_data_ptr(g, call->names[RP_N_DATA_PTR], &ptr) < 0 ? -1 : 1;
    /* no memory behind a non-empty gradient: a meta tensor, whose get_device()
     * is a CPU param's -1; the Python path names the mismatch */
    if (ok == 1 && ptr == 0 && ((const rp_optim_entry *)row)->numel > 0)
        ok = 0;
    if (ok == 1) {
        int meets = rp_py_meets_call_memory(ptr, key, ((const rp_optim_entry *)row)->numel,
                                            call->names, call->memory);
        ok = meets < 0 ? -1 : !meets;
    }
    if (ok == 1 && rp_py_check_later(call, g) < 0)
        ok = -1;
    if (ok != 1) {
        Py_DECREF(g);
        return ok;
    }
    row[1] = (int64_t)ptr;
    *held = g;
    return RP_ROW_HOLDS;
}

/* The rows of the table the previous step's update ran on (optim.py's
 * _Plan.step_table): `at` their indices, ascending (NULL: all n rows, the
 * step table being the table itself), m of them, and `entries` the step
 * table's rows, in that order. */
typedef struct {
    const int64_t *at;
    Py_ssize_t m;
    rp_optim_entry *entries;
} rp_py_step_rows;

/* The k-th row of the previous step's update. */
static Py_ssize_t rp_py_step_row(const rp_py_step_rows *step, Py_ssize_t k)
{
    return step->at == NULL ? k : (Py_ssize_t)step->at[k];
}

/* [step row 0, ..., step row k - 1]: the rows taking part this step, as far
 * as they are the previous step's, once this step's differ. */
static PyObject *rp_py_step_row_list(const rp_py_step_rows *step, Py_ssize_t k)
{
    PyObject *list = PyList_New(k);
    Py_ssize_t i;
    for (i = 0; list != NULL && i < k; i++) {
        PyObject *v = PyLong_FromSsize_t(rp_py_step_row(step, i));
        if (v == NULL)
            Py_CLEAR(list);
        else
            PyList_SET_ITEM(list, i, v);
    }
    return list;
}

/* Row i takes part as the k-th row of this step: while the rows taking part
 * are the previous step's, its gradient pointer goes into the step table too
 * (a copy of those rows when some sit out), which the update runs on again;
 * from the first difference on, each row is listed in *rows for the caller
 * to build another step table. 0, or -1 with an exception set. */
static int rp_py_take_part(const rp_py_step_rows *step, Py_ssize_t i, Py_ssize_t k,
                           int64_t grad, PyObject **rows)
{
    PyObject *v;
    int rc;
    if (*rows == NULL) {
        if (k < step->m && rp_py_step_row(step, k) == i) {
            step->entries[k].grad = (const void *)(intptr_t)grad;
            return 0;
        }
        if ((*rows = rp_py_step_row_list(step, k)) == NULL)
            return -1;
    }
    v = PyLong_FromSsize_t(i);
    if (v == NULL)
        return -1;
    rc = PyList_Append(*rows, v);
    Py_DECREF(v);
    return rc;
}

/* The arguments of optim_grad_pointers with an item per row: params,
 * param_keys, state_dicts, watched, grad_contiguous. */
static const int rp_py_row_lists[] = {0, 1, 3, 4, 5};
#define RP_PY_ROW_ITEMS ((int)(sizeof rp_py_row_lists / sizeof rp_py_row_lists[0]))

static void rp_py_release_row(PyObject **item, int count)
{
    while (count-- > 0)
        Py_DECREF(item[count]);
}

/* Row i's items of those lists, new references in item: the Python code a
 * row runs (a .grad property, __torch_function__, __eq__) may shrink the
 * lists or drop the items the row still reads. 0 when a list has no row i
 * any more. */
static int rp_py_hold_row(PyObject *const *args, Py_ssize_t i, PyObject **item)
{
    for (int k = 0; k < RP_PY_ROW_ITEMS; k++) {
        PyObject *list = args[rp_py_row_lists[k]];
        if (i >= PyList_GET_SIZE(list)) {
            rp_py_release_row(item, k);
            return 0;
        }
        item[k] = PyList_GET_ITEM(list, i);
        Py_INCREF(item[k]);
    }
    return 1;
}

/* Fills the table's gradient column from the rows of params[i] with one;
 * RP_ROW_HOLDS with the gradients read appended to `held` and, in *rows,
 * NULL when the rows taking part are the previous step's, else their list;
 * or RP_ROW_STALE or RP_ROW_ERROR. */
static int rp_py_grad_rows(PyObject *const *args, PyArrayObject *table,
                           const rp_py_step_rows *step, const rp_py_grad_call *call,
                           PyObject *held, PyObject **rows)
{
    Py_ssize_t n = PyList_GET_SIZE(args[0]), i, k = 0;
    for (i = 0; i < n; i++) {
        int64_t *row = (int64_t *)PyArray_GETPTR1(table, i);
        PyObject *item[RP_PY_ROW_ITEMS], *g = NULL;
        int ok;
        if (!rp_py_hold_row(args, i, item))
            return RP_ROW_STALE; /* the lists shrank under the call */
        ok = rp_py_grad_row(item[0], item[1], item[2], item[3], item[4], call, row, &g);
        rp_py_release_row(item, RP_PY_ROW_ITEMS);
        if (ok == RP_ROW_NO_GRAD)
            continue;
        if (ok != RP_ROW_HOLDS)
            return ok;
        ok = PyList_Append(held, g);
        Py_DECREF(g);
        if (ok < 0 || rp_py_take_part(step, i, k++, row[1], rows) < 0)
            return RP_ROW_ERROR;
    }
    if (*rows == NULL && k != step->m && (*rows = rp_py_step_row_list(step, k)) == NULL)
        return RP_ROW_ERROR;
    return RP_ROW_HOLDS;
}

/* The step table and rows arguments (args[9], args[10]) of the fast path, for
 * a table of n rows. 0, or -1 with an exception set. */
static int rp_py_step_rows_arg(PyObject *const *args, PyArrayObject *table, Py_ssize_t n,
                               rp_py_step_rows *step)
{
    PyArrayObject *step_table, *at;
    if (rp_py_check_table(args[9], &step_table) < 0)
        return -1;
    step->entries = (rp_optim_entry *)PyArray_DATA(step_table);
    step->m = (Py_ssize_t)PyArray_DIM(step_table, 0);
    step->at = NULL;
    if (args[10] == Py_None) {
        if (step_table == table)
            return 0;
    } else if (PyArray_Check(args[10])) {
        at = (PyArrayObject *)args[10];
        if (PyArray_EquivTypenums(PyArray_TYPE(at), NPY_INT64) && PyArray_NDIM(at) == 1 &&
            rp_py_is_c_data(at) &&
            PyArray_DIM(at, 0) == (npy_intp)step->m && step->m <= n) {
            step->at = (const int64_t *)PyArray_DATA(at);
            return 0;
        }
    }
    PyErr_SetString(PyExc_ValueError, "optim_grad_pointers: step_rows must be None with the "
                                      "table as step_table, or the row indices of step_table's "
                                      "rows as a C-contiguous int64 array in native byte order");
    return -1;
}

/* The memory argument (args[12]) of the fast path: a C-contiguous 1-D int64
 * array of pairs, in native byte order. 0, or -1 with an exception set. */
static int rp_py_call_memory_arg(PyObject *arg, rp_py_call_memory *memory)
{
    PyArrayObject *arr = (PyArrayObject *)arg;
    if (!PyArray_Check(arg) || !PyArray_EquivTypenums(PyArray_TYPE(arr), NPY_INT64) ||
        PyArray_NDIM(arr) != 1 || PyArray_DIM(arr, 0) % 2 != 0 || !rp_py_is_c_data(arr)) {
        PyErr_SetString(PyExc_ValueError, "optim_grad_pointers: memory must be a C-contiguous "
                                          "1-D int64 array of [start, end) pairs in native byte "
                                          "order");
        return -1;
    }
    memory->span = (const int64_t *)PyArray_DATA(arr);
    memory->n = (Py_ssize_t)(PyArray_DIM(arr, 0) / 2);
    return 0;
}

/* Whether the metadata guard vouches for the layouts of the tensors a light
 * look collected: 1 / 0 / -1 with an exception set. */
static int rp_py_guard_vouches(PyObject *guard, PyObject *checked)
{
    PyObject *tensors = PyList_AsTuple(checked), *r;
    int vouches;
    if (tensors == NULL)
        return -1;
    r = PyObject_CallObject(guard, tensors);
    Py_DECREF(tensors);
    if (r == NULL)
        return -1;
    vouches = PyObject_IsTrue(r);
    Py_DECREF(r);
    return vouches;
}

/* rp_py_grad_rows with a full look at each row, again: what a light look
 * had read is dropped. */
static int rp_py_grad_rows_again(PyObject *const *args, PyArrayObject *table,
                                 const rp_py_step_rows *step, rp_py_grad_call *call,
                                 PyObject *held, PyObject **rows)
{
    call->light = 0;
    Py_CLEAR(*rows);
    if (PyList_SetSlice(held, 0, PyList_GET_SIZE(held), NULL) < 0)
        return RP_ROW_ERROR;
    return rp_py_grad_rows(args, table, step, call, held, rows);
}

/* Clears the error a light look met, unless it is a KeyboardInterrupt or
 * SystemExit (not an Exception), which stands: 1 cleared, 0 not. */
static int rp_py_clear_error(void)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return 0;
    PyErr_Clear();
    return 1;
}

/* rp_py_grad_rows as the metadata guard (args[13]) has it. None: a full
 * look at each row. True: a full look that, where the rows taking part are
 * the previous step's, reports the tensors it found right in *report (a
 * tuple, in rp_py_grad_call's order), for the caller to build a guard from.
 * A guard, a callable that says whether tensors (in that order) still have
 * the layouts of those it was built from: a light look at each row, for
 * which it vouches. A guard knows the rows it was built from, the previous
 * step's (the caller drops it where they change). Where others take part,
 * where a row raised (a sparse gradient has no data pointer: the full look
 * refuses its layout first), or where the guard refuses or raises, a full
 * look after all, which has the last word; where the guard was asked,
 * *report is then False, for the caller to drop it. A row the light look
 * finds stale, a full look finds stale too (or raises first): that answer
 * stands. *report: a new reference. */
static int rp_py_guarded_rows(PyObject *const *args, PyArrayObject *table,
                              const rp_py_step_rows *step, rp_py_grad_call *call,
                              PyObject *held, PyObject **rows, PyObject **report)
{
    PyObject *guard = args[13];
    int ok, asked, vouches = 0;
    *report = Py_NewRef(Py_None);
    if (guard == Py_None)
        return rp_py_grad_rows(args, table, step, call, held, rows);
    if ((call->checked = PyList_New(0)) == NULL)
        return RP_ROW_ERROR;
    call->light = guard != Py_True;
    ok = rp_py_grad_rows(args, table, step, call, held, rows);
    asked = call->light && ok == RP_ROW_HOLDS && *rows == NULL;
    if (asked)
        vouches = rp_py_guard_vouches(guard, call->checked);
    else if (ok == RP_ROW_HOLDS && *rows == NULL)
        Py_SETREF(*report, PyList_AsTuple(call->checked));
    Py_CLEAR(call->checked);
    if (*report == NULL)
        return RP_ROW_ERROR;
    if (!call->light || ok == RP_ROW_STALE || vouches == 1)
        return ok;
    if ((ok == RP_ROW_ERROR || vouches < 0) && !rp_py_clear_error())
        return RP_ROW_ERROR;
    if (asked)
        Py_SETREF(*report, Py_NewRef(Py_False));
    return rp_py_grad_rows_again(args, table, step, call, held, rows);
}

PyObject *rp_py_optim_grad_pointers(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *const *names;
    PyObject *result = NULL, *held = NULL, *rows = NULL, *report = NULL;
    PyArrayObject *table;
    rp_py_step_rows step;
    rp_py_call_memory memory;
    rp_py_grad_call call;
    Py_ssize_t n;
    int ok;
    (void)self;
    if (rp_py_check_nargs(nargs, 14, "optim_grad_pointers") < 0)
        return NULL;
    if (!PyList_Check(args[0]) || !PyList_Check(args[1]) || !PyDict_Check(args[2]) ||
        !PyList_Check(args[3]) || !PyList_Check(args[4]) || !PyList_Check(args[5]) ||
        (args[8] != Py_None && !PyDict_Check(args[8])) || !PyType_Check(args[11])) {
        PyErr_SetString(PyExc_TypeError, "optim_grad_pointers: expected lists, a dict of state, "
                                         "a table, None or a dict of gradients and a type");
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
    if (rp_py_step_rows_arg(args, table, n, &step) < 0 ||
        rp_py_call_memory_arg(args[12], &memory) < 0 || (names = rp_py_attr_names()) == NULL)
        return NULL;
    /* the gradients the table points at, for the caller to hold until the
     * update has run: the update releases the GIL, and another thread may
     * drop a .grad (zero_grad) meanwhile */
    held = PyList_New(0);
    if (held == NULL)
        goto done;
    call = (rp_py_grad_call){names, args[2], args[6], args[11], args[8],
                             _PyType_Lookup((PyTypeObject *)args[11], names[RP_N_HASH]), &memory,
                             0, NULL};
    ok = rp_py_guarded_rows(args, table, &step, &call, held, &rows, &report);
    if (ok == RP_ROW_HOLDS) {
        result = PyTuple_Pack(3, held, rows != NULL ? rows : Py_None, report);
    } else if (ok == RP_ROW_STALE) {
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    Py_XDECREF(held);
    Py_XDECREF(rows);
    Py_XDECREF(report);
    return result;
}

PyObject *rp_py_optim_call_key(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *seq, *key = NULL;
    Py_ssize_t n, i;
    uintptr_t *ids;
    (void)self;
    if (rp_py_check_nargs(nargs, 1, "optim_call_key") < 0)
        return NULL;
    seq = PySequence_Fast(args[0], "optim_call_key: params must be a sequence");
    if (seq == NULL)
        return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    /* no overflow: the sequence holds n pointers of this size already */
    key = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof *ids);
    if (key != NULL) {
        ids = (uintptr_t *)PyBytes_AS_STRING(key);
        for (i = 0; i < n; i++)
            ids[i] = (uintptr_t)PySequence_Fast_GET_ITEM(seq, i); /* id(params[i]) */
    }
    Py_DECREF(seq);
    return key;
}

/* The group keys optim_hparams reads, in the order optim.py's _hparams_of reads
 * them: "lr", "capturable", "betas", then the other numeric entries of the
 * hparams tuple after lr (beta1 and beta2 come from "betas"), then the flags. */
enum { RP_HK_LR, RP_HK_CAPTURABLE, RP_HK_BETAS, RP_HK_WEIGHT_DECAY, RP_HK_EPS, RP_HK_MOMENTUM,
       RP_HK_DAMPENING, RP_HK_ALPHA, RP_HK_RHO, RP_HK_LR_DECAY, RP_HK_NESTEROV, RP_HK_MAXIMIZE,
       RP_HK_AMSGRAD, RP_HK_DECOUPLED_WEIGHT_DECAY, RP_HK_CENTERED, RP_HK_NAMES };

/* The keys, interned at the first call and kept for the process, as
 * rp_py_attr_names. NULL with an exception set on failure. */
static PyObject *const *rp_py_hparam_keys(void)
{
    static const char *const text[RP_HK_NAMES] = {
        "lr", "capturable", "betas", "weight_decay", "eps", "momentum", "dampening", "alpha",
        "rho", "lr_decay", "nesterov", "maximize", "amsgrad", "decoupled_weight_decay",
        "centered"};
    static PyObject *names[RP_HK_NAMES];
    return rp_py_interned(text, names, RP_HK_NAMES);
}

/* What rp_py_plain_truth finds of a value: bool(value) is 0 or 1, or the
 * value is of a type whose bool() may run Python code or raise (a tensor, an
 * array), which optim.py's _hparams_of converts itself. */
enum { RP_TRUTH_OTHER = -1 };

/* bool(v) for the types whose truth runs no Python code and cannot fail:
 * bool, None, int and float (exact types); RP_TRUTH_OTHER for any other. */
static int rp_py_plain_truth(PyObject *v)
{
    if (v == Py_True)
        return 1;
    if (v == Py_False || v == Py_None)
        return 0;
    if (PyLong_CheckExact(v) || PyFloat_CheckExact(v))
        return PyObject_IsTrue(v); /* no Python code runs, cannot fail */
    return RP_TRUTH_OTHER;
}

/* Whether v goes into the tuple as it is: a float, or an int of 64 bits,
 * exact types (optim.py's _numbers: bools, NumPy scalars, tensors and ints
 * torch cannot pass on are converted or refused by its _scalar). */
static int rp_py_plain_number(PyObject *v)
{
    int overflow = 0;
    if (PyFloat_CheckExact(v))
        return 1;
    if (!PyLong_CheckExact(v))
        return 0;
    (void)PyLong_AsLongLongAndOverflow(v, &overflow); /* cannot fail on an exact int */
    return overflow == 0;
}

/* group.get(key) as a new reference, *out NULL when absent. 0, or -1 with an
 * exception set. */
static int rp_py_hparam_get(PyObject *group, PyObject *key, PyObject **out)
{
    *out = PyDict_GetItemWithError(group, key);
    if (*out == NULL)
        return PyErr_Occurred() ? -1 : 0;
    Py_INCREF(*out);
    return 0;
}

/* betas[i] of an exact tuple or list of two items, a new reference; 0 when
 * betas is anything else (Python unpacks it, and refuses another number of
 * items, as torch's update does). */
static int rp_py_beta(PyObject *betas, Py_ssize_t i, PyObject **out)
{
    if (PyTuple_CheckExact(betas) && PyTuple_GET_SIZE(betas) == 2)
        *out = PyTuple_GET_ITEM(betas, i);
    else if (PyList_CheckExact(betas) && PyList_GET_SIZE(betas) == 2)
        *out = PyList_GET_ITEM(betas, i);
    else
        return 0;
    Py_INCREF(*out);
    return 1;
}

/* The first 15 entries of the hparams tuple (all but the kinds) into item
 * (new references; NULL: a numeric entry absent, 0.0), read in the order optim.py's _hparams_of reads
 * them: 1 done, 0 when the group holds a value that only _hparams_of takes, -1
 * with an exception set. *betas holds group["betas"] (a new reference or
 * NULL) for the caller to release. */
static int rp_py_hparam_items(PyObject *group, PyObject *const *keys, PyObject **item,
                              PyObject **betas)
{
    static const int after_betas[] = {RP_HK_MOMENTUM, RP_HK_DAMPENING, RP_HK_ALPHA, RP_HK_RHO,
                                      RP_HK_LR_DECAY};
    PyObject *capturable;
    int k, truth;
    /* group["lr"]: when absent, Python raises its KeyError */
    if (rp_py_hparam_get(group, keys[RP_HK_LR], &item[0]) < 0)
        return -1;
    if (item[0] == NULL)
        return 0;
    /* Python takes bool() of capturable first (it matters for a tensor lr) */
    if (rp_py_hparam_get(group, keys[RP_HK_CAPTURABLE], &capturable) < 0)
        return -1;
    truth = capturable == NULL ? 0 : rp_py_plain_truth(capturable);
    Py_XDECREF(capturable);
    if (truth == RP_TRUTH_OTHER)
        return 0;
    if (rp_py_hparam_get(group, keys[RP_HK_BETAS], betas) < 0 ||
        rp_py_hparam_get(group, keys[RP_HK_WEIGHT_DECAY], &item[1]) < 0 ||
        rp_py_hparam_get(group, keys[RP_HK_EPS], &item[2]) < 0)
        return -1;
    /* absent betas: the default (0.0, 0.0) */
    if (*betas != NULL && (!rp_py_beta(*betas, 0, &item[3]) || !rp_py_beta(*betas, 1, &item[4])))
        return 0;
    for (k = 0; k < 5; k++)
        if (rp_py_hparam_get(group, keys[after_betas[k]], &item[5 + k]) < 0)
            return -1;
    /* a tensor lr (also a capturable one), a bool, a NumPy scalar: Python's
     * _scalar converts them (or refuses them, with its message) */
    for (k = 0; k < 10; k++)
        if (item[k] != NULL && !rp_py_plain_number(item[k]))
            return 0;
    for (k = 0; k < 5; k++) {
        PyObject *v;
        if (rp_py_hparam_get(group, keys[RP_HK_NESTEROV + k], &v) < 0)
            return -1;
        truth = v == NULL ? 0 : rp_py_plain_truth(v);
        Py_XDECREF(v);
        if (truth == RP_TRUTH_OTHER)
            return 0;
        item[10 + k] = truth ? Py_True : Py_False;
        Py_INCREF(item[10 + k]);
    }
    return 1;
}

PyObject *rp_py_optim_hparams(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *const *keys;
    PyObject *item[16] = {NULL}, *betas = NULL, *zero = NULL, *result = NULL;
    int k, ok;
    (void)self;
    if (rp_py_check_nargs(nargs, 1, "optim_hparams") < 0)
        return NULL;
    /* a dict subclass may look its keys up in Python code (get, __missing__) */
    if (!PyDict_CheckExact(args[0]))
        Py_RETURN_NONE;
    if ((keys = rp_py_hparam_keys()) == NULL)
        return NULL;
    ok = rp_py_hparam_items(args[0], keys, item, &betas);
    /* the kinds: every value is a number here (a tensor one goes to Python) */
    if (ok == 1 && (item[15] = PyLong_FromLong(RP_LR_NUMBER)) != NULL &&
        (zero = PyFloat_FromDouble(0.0)) != NULL && (result = PyTuple_New(16)) != NULL) {
        for (k = 0; k < 16; k++) {
            if (item[k] == NULL) {
                Py_INCREF(zero);
                item[k] = zero;
            }
            PyTuple_SET_ITEM(result, k, item[k]); /* steals it */
            item[k] = NULL;
        }
    } else if (ok == 0) {
        Py_INCREF(Py_None);
        result = Py_None;
    }
    for (k = 0; k < 16; k++)
        Py_XDECREF(item[k]);
    Py_XDECREF(betas);
    Py_XDECREF(zero);
    return result;
}

int rp_py_int_arg(PyObject *obj, const char *name, int *out)
{
    /* range-checked, never truncated: 2**32 must not become kind 0 */
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    char got[24];
    if (v == -1 && PyErr_Occurred()) {
        rp_py_prefix_error(NULL, name);
        return -1;
    }
    if (overflow == 0 && v >= INT_MIN && v <= INT_MAX) {
        *out = (int)v;
        return 0;
    }
    /* the value, never its repr: Python refuses to write an int of over
     * 4300 digits as text, which would replace this error with its own */
    if (overflow == 0)
        PyOS_snprintf(got, sizeof got, "%lld", v);
    else
        PyOS_snprintf(got, sizeof got, "%s", overflow > 0 ? "an int >= 2^63" : "an int < -2^63");
    PyErr_Format(PyExc_OverflowError, "%s: expected an int in [%d, %d], got %s", name, INT_MIN, INT_MAX,
                 got);
    return -1;
}

/* A float argument, converted before the next (PyFloat_AsDouble of an
 * object with __float__ must not run with an exception already set). */
static int rp_py_double_arg(PyObject *obj, const char *name, double *out)
{
    *out = PyFloat_AsDouble(obj);
    if (*out == -1.0 && PyErr_Occurred()) {
        rp_py_prefix_error(NULL, name);
        return -1;
    }
    return 0;
}

static int rp_py_float_arg(PyObject *obj, const char *name, float *out)
{
    double v;
    if (rp_py_double_arg(obj, name, &v) < 0)
        return -1;
    *out = (float)v;
    return 0;
}

int rp_py_pointer_arg(PyObject *obj, const char *name, void **out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        rp_py_prefix_error(NULL, name);
        return -1;
    }
    *out = (void *)(uintptr_t)v;
    return 0;
}

int rp_py_size_arg(PyObject *obj, const char *name, int64_t *out)
{
    long long v = PyLong_AsLongLong(obj);
    if (v == -1 && PyErr_Occurred()) {
        rp_py_prefix_error(NULL, name);
        return -1;
    }
    *out = (int64_t)v;
    return 0;
}

int rp_py_check_nargs(Py_ssize_t nargs, Py_ssize_t want, const char *fname)
{
    if (nargs == want)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", fname, want, nargs);
    return -1;
}

int rp_py_stream_arg(PyObject *obj, void **stream)
{
    *stream = PyLong_AsVoidPtr(obj);
    if (*stream == NULL && PyErr_Occurred()) {
        rp_py_prefix_error(NULL, "stream");
        return -1;
    }
    return 0;
}

/* The last argument of a binding both extensions have: a thread count, or
 * the stream when the module has CUDA launchers. */
typedef struct {
    int num_threads;
    void *stream;
} rp_py_where;

static int rp_py_where_arg(PyObject *obj, const rp_py_cuda_launchers *cuda, rp_py_where *where)
{
    memset(where, 0, sizeof *where);
    if (cuda != NULL)
        return rp_py_stream_arg(obj, &where->stream);
    return rp_py_int_arg(obj, "num_threads", &where->num_threads);
}

/* The bindings both extensions have release the GIL around the core, which
 * never touches Python objects. */
PyObject *rp_py_fad_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const rp_py_cuda_launchers *cuda = rp_py_cuda_of(self);
    void *x, *y, *d;
    float p0, p1;
    int64_t n;
    int kind, dtype, d_store, rc;
    rp_py_where where;
    rp_error err = {{0}};
    if (rp_py_check_nargs(nargs, 10, "fad_forward") < 0 || rp_py_int_arg(args[0], "kind", &kind) < 0 ||
        rp_py_float_arg(args[1], "p0", &p0) < 0 || rp_py_float_arg(args[2], "p1", &p1) < 0 ||
        rp_py_int_arg(args[3], "dtype", &dtype) < 0 || rp_py_pointer_arg(args[4], "x", &x) < 0 ||
        rp_py_pointer_arg(args[5], "y", &y) < 0 || rp_py_int_arg(args[6], "d_store", &d_store) < 0 ||
        rp_py_pointer_arg(args[7], "d", &d) < 0 || rp_py_size_arg(args[8], "n", &n) < 0 ||
        rp_py_where_arg(args[9], cuda, &where) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (cuda != NULL)
        rc = cuda->fad_forward(kind, p0, p1, dtype, x, y, d_store, d, n, where.stream, &err);
    else
        rc = rp_fad_forward_cpu(kind, p0, p1, dtype, x, y, d_store, d, n, where.num_threads, &err);
    Py_END_ALLOW_THREADS
    return rp_py_none_or_raise(rc, &err);
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

PyObject *rp_py_fad_backward_code8(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const rp_py_cuda_launchers *cuda = rp_py_cuda_of(self);
    const rp_fad_codebook *cb;
    void *grad_y, *codes, *grad_x;
    int64_t n;
    int dtype, rc;
    rp_py_where where;
    rp_error err = {{0}};
    if (rp_py_check_nargs(nargs, 7, "fad_backward_code8") < 0 ||
        rp_py_int_arg(args[0], "dtype", &dtype) < 0 || rp_py_pointer_arg(args[1], "grad_y", &grad_y) < 0 ||
        rp_py_pointer_arg(args[2], "codes", &codes) < 0 || rp_py_codebook_arg(args[3], &cb) < 0 ||
        rp_py_pointer_arg(args[4], "grad_x", &grad_x) < 0 || rp_py_size_arg(args[5], "n", &n) < 0 ||
        rp_py_where_arg(args[6], cuda, &where) < 0)
        return NULL;
    /* cb points into the bytes argument, which the caller holds until we return. */
    Py_BEGIN_ALLOW_THREADS
    if (cuda != NULL)
        rc = cuda->fad_backward_code8(dtype, grad_y, codes, cb, grad_x, n, where.stream, &err);
    else
        rc = rp_fad_backward_code8_cpu(dtype, grad_y, codes, cb, grad_x, n, where.num_threads,
                                       &err);
    Py_END_ALLOW_THREADS
    return rp_py_none_or_raise(rc, &err);
}

/* reprop._C only: CUDA runs that pair through torch's ops (fad.py). */
PyObject *rp_py_fad_backward_mixed16(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *grad_y, *d, *grad_x;
    int64_t n;
    int dtype, num_threads, rc;
    rp_error err = {{0}};
    (void)self;
    if (rp_py_check_nargs(nargs, 6, "fad_backward_mixed16") < 0 ||
        rp_py_int_arg(args[0], "dtype", &dtype) < 0 || rp_py_pointer_arg(args[1], "grad_y", &grad_y) < 0 ||
        rp_py_pointer_arg(args[2], "d", &d) < 0 || rp_py_pointer_arg(args[3], "grad_x", &grad_x) < 0 ||
        rp_py_size_arg(args[4], "n", &n) < 0 || rp_py_int_arg(args[5], "num_threads", &num_threads) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = rp_fad_backward_mixed16_cpu(dtype, grad_y, d, grad_x, n, num_threads, &err);
    Py_END_ALLOW_THREADS
    return rp_py_none_or_raise(rc, &err);
}

PyObject *rp_py_fad_codebook(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    rp_fad_codebook cb;
    rp_error err = {{0}};
    int kind, rc;
    float p0, p1;
    (void)self;
    if (rp_py_check_nargs(nargs, 3, "fad_codebook") < 0 || rp_py_int_arg(args[0], "kind", &kind) < 0 ||
        rp_py_float_arg(args[1], "p0", &p0) < 0 || rp_py_float_arg(args[2], "p1", &p1) < 0)
        return NULL;
    rc = rp_fad_codebook_init(kind, p0, p1, &cb, &err);
    if (rc != RP_OK)
        return rp_py_raise(rc, &err);
    return PyBytes_FromStringAndSize((const char *)&cb, sizeof cb);
}

PyObject *rp_py_scan(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const rp_py_cuda_launchers *cuda = rp_py_cuda_of(self);
    rp_scan_jacobians j;
    void *w, *u, *v, *jt, *y, *c, *g, *work;
    int levels, rc;
    rp_py_where where;
    rp_error err = {{0}};
    if (rp_py_check_nargs(nargs, 16, "scan") < 0 || rp_py_size_arg(args[0], "n", &j.n) < 0 ||
        rp_py_size_arg(args[1], "batch", &j.batch) < 0 || rp_py_size_arg(args[2], "dim", &j.dim) < 0 ||
        rp_py_int_arg(args[3], "gates", &j.gates) < 0 || rp_py_pointer_arg(args[4], "w", &w) < 0 ||
        rp_py_pointer_arg(args[5], "u", &u) < 0 || rp_py_pointer_arg(args[6], "v", &v) < 0 ||
        rp_py_pointer_arg(args[7], "jt", &jt) < 0 || rp_py_int_arg(args[8], "act", &j.act) < 0 ||
        rp_py_pointer_arg(args[9], "y", &y) < 0 ||
        rp_py_int_arg(args[10], "pre_activation", &j.pre_activation) < 0 ||
        rp_py_pointer_arg(args[11], "c", &c) < 0 || rp_py_pointer_arg(args[12], "g", &g) < 0 ||
        rp_py_int_arg(args[13], "levels", &levels) < 0 || rp_py_pointer_arg(args[14], "work", &work) < 0 ||
        rp_py_where_arg(args[15], cuda, &where) < 0)
        return NULL;
    j.w = w, j.u = u, j.v = v, j.jt = jt, j.y = y;
    Py_BEGIN_ALLOW_THREADS
    if (cuda != NULL)
        rc = cuda->scan(&j, c, g, levels, work, where.stream, &err);
    else
        rc = rp_scan_cpu(&j, c, g, levels, work, where.num_threads, &err);
    Py_END_ALLOW_THREADS
    return rp_py_none_or_raise(rc, &err);
}

/* The cost model's machine (workers, level_cost, step_cost) from args[0 .. 2]. */
static int rp_py_machine_args(PyObject *const *args, rp_scan_machine *m)
{
    return rp_py_double_arg(args[0], "workers", &m->workers) < 0 ||
                   rp_py_double_arg(args[1], "level_cost", &m->level_cost) < 0 ||
                   rp_py_double_arg(args[2], "step_cost", &m->step_cost) < 0
               ? -1
               : 0;
}

PyObject *rp_py_scan_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t n, batch, dim;
    int gates, rc;
    rp_scan_machine m;
    rp_error err = {{0}};
    (void)self;
    if (rp_py_check_nargs(nargs, 7, "scan_plan") < 0 || rp_py_size_arg(args[0], "n", &n) < 0 ||
        rp_py_size_arg(args[1], "batch", &batch) < 0 || rp_py_size_arg(args[2], "dim", &dim) < 0 ||
        rp_py_int_arg(args[3], "gates", &gates) < 0 || rp_py_machine_args(args + 4, &m) < 0)
        return NULL;
    rc = rp_scan_check_sizes(n, batch, dim, gates, 0, &err);
    if (rc != RP_OK)
        return rp_py_raise(rc, &err);
    return Py_BuildValue("(ii)", rp_scan_choose_levels(n, batch, dim, gates, &m),
                         rp_scan_max_levels(n));
}

PyObject *rp_py_scan_workspace(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t n, batch, dim;
    int levels, rc;
    rp_error err = {{0}};
    (void)self;
    if (rp_py_check_nargs(nargs, 4, "scan_workspace") < 0 || rp_py_size_arg(args[0], "n", &n) < 0 ||
        rp_py_size_arg(args[1], "batch", &batch) < 0 || rp_py_size_arg(args[2], "dim", &dim) < 0 ||
        rp_py_int_arg(args[3], "levels", &levels) < 0)
        return NULL;
    /* gates 0: the workspace is the same for every kind of leaves */
    rc = rp_scan_check_sizes(n, batch, dim, 0, levels, &err);
    if (rc != RP_OK)
        return rp_py_raise(rc, &err);
    return PyLong_FromLongLong((long long)rp_scan_workspace_floats(n, batch, dim, levels));
}

PyObject *rp_py_scan_cost(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t n, batch, dim;
    int gates, levels, rc;
    rp_scan_machine m;
    rp_error err = {{0}};
    double cost;
    (void)self;
    if (rp_py_check_nargs(nargs, 8, "scan_cost") < 0 || rp_py_size_arg(args[0], "n", &n) < 0 ||
        rp_py_size_arg(args[1], "batch", &batch) < 0 || rp_py_size_arg(args[2], "dim", &dim) < 0 ||
        rp_py_int_arg(args[3], "gates", &gates) < 0 || rp_py_int_arg(args[4], "levels", &levels) < 0 ||
        rp_py_machine_args(args + 5, &m) < 0)
        return NULL;
    rc = rp_scan_cost(n, batch, dim, gates, levels, &m, &cost, &err);
    if (rc != RP_OK)
        return rp_py_raise(rc, &err);
    return PyFloat_FromDouble(cost);
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

/* PyArg_ParseTuple raises SystemError, not TypeError, for anything but a
 * tuple: its callers check first. `name` names the argument. */
static int rp_py_tuple_arg(PyObject *obj, const char *name)
{
    if (PyTuple_Check(obj))
        return 0;
    PyErr_Format(PyExc_TypeError, "%s: expected a tuple, got %s", name, Py_TYPE(obj)->tp_name);
    return -1;
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
    for (int i = 0; i < 15; i++) {
        char name[16];
        PyOS_snprintf(name, sizeof name, "geometry[%d]", i);
        if (rp_py_size_arg(PyTuple_GET_ITEM(obj, i), name, &f[i]) < 0)
            return -1;
    }
    *g = (rp_conv2d_geom){f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7],
                          f[8], f[9], f[10], f[11], f[12], f[13], f[14]};
    return 0;
}

/* The layers jacobian() knows, and how many int32 arrays each pattern has
 * (indptr, indices, then its maps). */
enum { RP_PY_CONV2D, RP_PY_MAXPOOL2D, RP_PY_LINEAR, RP_PY_DIAGONAL, RP_PY_JAC_KINDS };
static const char *const rp_py_jac_names[RP_PY_JAC_KINDS] = {"conv2d", "maxpool2d", "linear",
                                                             "diagonal"};
static const int rp_py_jac_arrays[RP_PY_JAC_KINDS] = {3, 4, 3, 2};

/* The layer kind the str obj names, all of it: C's strcmp would stop at an
 * embedded NUL and take "linear\0x" for "linear". */
static int rp_py_jac_kind_arg(PyObject *obj, int *kind)
{
    Py_ssize_t len;
    const char *s;
    if (!PyUnicode_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "kind: expected a str, got %s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    if ((s = PyUnicode_AsUTF8AndSize(obj, &len)) == NULL)
        return -1;
    for (*kind = 0; *kind < RP_PY_JAC_KINDS; (*kind)++)
        if (strlen(rp_py_jac_names[*kind]) == (size_t)len && !memcmp(s, rp_py_jac_names[*kind], len))
            return 0;
    PyErr_Format(PyExc_ValueError, "jacobian: unknown layer kind %R", obj);
    return -1;
}

/* The geometry of a layer kind: g for conv2d and maxpool2d, else (a, b). */
static int rp_py_jac_geometry_arg(PyObject *obj, int kind, rp_conv2d_geom *g, int64_t *a, int64_t *b)
{
    if (kind == RP_PY_CONV2D || kind == RP_PY_MAXPOOL2D)
        return rp_py_geom_arg(obj, g);
    if (rp_py_tuple_arg(obj, "geometry") < 0 ||
        !PyArg_ParseTuple(obj,
                          kind == RP_PY_LINEAR ? "LL;geometry: expected (in_features, out_features), 2 ints"
                                               : "LL;geometry: expected (size, 0), 2 ints",
                          a, b))
        return -1;
    if (kind == RP_PY_DIAGONAL && *b != 0) { /* the core takes the size alone: refused, not ignored */
        PyErr_Format(PyExc_ValueError, "geometry: expected (size, 0) for a diagonal, got (%lld, %lld)",
                     (long long)*a, (long long)*b);
        return -1;
    }
    return 0;
}

/* The core's pattern of a layer: its nnz, and its arrays into p where they
 * are not NULL. */
static int rp_py_jac_run(int kind, const rp_conv2d_geom *g, int64_t a, int64_t b, int64_t *nnz,
                         int32_t *const *p, rp_error *err)
{
    switch (kind) {
    case RP_PY_CONV2D:
        return rp_jac_conv2d(g, nnz, p[0], p[1], p[2], err);
    case RP_PY_MAXPOOL2D:
        return rp_jac_maxpool2d(g, nnz, p[0], p[1], p[2], p[3], err);
    case RP_PY_LINEAR:
        return rp_jac_linear(a, b, nnz, p[0], p[1], p[2], err);
    default:
        return rp_jac_diagonal(a, nnz, p[0], p[1], err);
    }
}

PyObject *rp_py_jacobian(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    rp_error err = {{0}};
    rp_conv2d_geom g;
    int64_t nnz = 0, rows, a = 0, b = 0;
    int32_t *p[4] = {NULL, NULL, NULL, NULL};
    PyObject *out;
    int kind, rc;
    (void)self;
    if (rp_py_check_nargs(nargs, 2, "jacobian") < 0 || rp_py_jac_kind_arg(args[0], &kind) < 0 ||
        rp_py_jac_geometry_arg(args[1], kind, &g, &a, &b) < 0)
        return NULL;
    rc = rp_py_jac_run(kind, &g, a, b, &nnz, p, &err); /* p all NULL: the sizes, checked */
    if (rc != RP_OK)
        return rp_py_raise(rc, &err);
    rows = kind == RP_PY_CONV2D || kind == RP_PY_MAXPOOL2D ? g.c_in * g.h_in * g.w_in : a;
    out = rp_py_pattern_tuple(rows, nnz, rp_py_jac_arrays[kind], p);
    if (out == NULL)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = rp_py_jac_run(kind, &g, a, b, &nnz, p, &err);
    Py_END_ALLOW_THREADS
    if (rc != RP_OK) {
        Py_DECREF(out);
        return rp_py_raise(rc, &err);
    }
    return out;
}

#define RP_CSR_PLAN_CAPSULE "reprop.csr_plan"

/* The items of the sequence obj as a new tuple (TypeError `msg` when obj is
 * not iterable), which holds them however the caller's sequence changes. */
static PyObject *rp_py_tuple_of(PyObject *obj, const char *msg)
{
    PyObject *fast = PySequence_Fast(obj, msg), *tuple;
    if (fast == NULL)
        return NULL;
    tuple = PySequence_Tuple(fast);
    Py_DECREF(fast);
    return tuple;
}

static void rp_py_plan_destructor(PyObject *capsule)
{
    rp_csr_plan_free(PyCapsule_GetPointer(capsule, RP_CSR_PLAN_CAPSULE));
}

void *rp_py_capsule_arg(PyObject *obj, const char *capsule, const char *maker, const char *name)
{
    void *ptr = PyCapsule_GetPointer(obj, capsule);
    if (ptr == NULL) {
        PyErr_Clear(); /* the capsule API's ValueError names neither the argument nor what it takes */
        PyErr_Format(PyExc_TypeError, "%s: expected the capsule %s() returns, got %s", name, maker,
                     Py_TYPE(obj)->tp_name);
    }
    return ptr;
}

/* The plan of a csr_plan capsule. */
static rp_csr_plan *rp_py_plan_arg(PyObject *obj)
{
    return rp_py_capsule_arg(obj, RP_CSR_PLAN_CAPSULE, "csr_plan", "plan");
}

/* An int32 1-D array of `len` elements (len < 0: any) the core reads in
 * place, borrowed; errors name it ("leaves[i]: name: "). */
static int rp_py_int32_arg(PyObject *obj, int64_t len, const char *leaf, const char *name,
                           const int32_t **out)
{
    PyArrayObject *arr = (PyArrayObject *)obj;
    if (!PyArray_Check(obj) || PyArray_TYPE(arr) != NPY_INT32 || PyArray_NDIM(arr) != 1 ||
        !rp_py_is_c_data(arr) || (len >= 0 && PyArray_DIM(arr, 0) != (npy_intp)len)) {
        if (len >= 0)
            PyErr_Format(PyExc_ValueError, "%s: %s: expected a C-contiguous, aligned int32 array of "
                         "%lld elements in native byte order", leaf, name, (long long)len);
        else
            PyErr_Format(PyExc_ValueError, "%s: %s: expected a C-contiguous, aligned 1-D int32 array "
                         "in native byte order", leaf, name);
        return -1;
    }
    *out = (const int32_t *)PyArray_DATA(arr);
    return 0;
}

/* Leaf i of csr_plan's leaves into *leaf, which borrows the arrays of the
 * tuple `item`; errors name the leaf. */
static int rp_py_leaf_arg(PyObject *item, int64_t i, rp_csr_pattern *leaf)
{
    PyObject *indptr, *indices, *value_map;
    long long rows, cols, values;
    int shared;
    char name[48];
    PyOS_snprintf(name, sizeof name, "leaves[%lld]", (long long)i);
    if (rp_py_tuple_arg(item, name) < 0 ||
        !PyArg_ParseTuple(item, "LLOOpOL;leaves: expected tuples (rows, cols, indptr, indices, shared, "
                                "value_map, values)",
                          &rows, &cols, &indptr, &indices, &shared, &value_map, &values))
        return -1;
    /* a program addresses 2^31 floats, so no vector of a larger layer fits;
     * refused before rows + 1, which 2^63 - 1 would wrap to a negative
     * length, that is "any length", letting the core read past indptr */
    if (rows < 1 || rows > INT32_MAX || cols < 1 || cols > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: rows and cols must be in [1, 2^31), the floats a program "
                     "addresses (got %lld, %lld)", name, rows, cols);
        return -1;
    }
    if (rp_py_int32_arg(indptr, rows + 1, name, "indptr", &leaf->indptr) < 0 ||
        rp_py_int32_arg(indices, -1, name, "indices", &leaf->indices) < 0 ||
        (value_map != Py_None &&
         rp_py_int32_arg(value_map, PyArray_DIM((PyArrayObject *)indices, 0), name, "value_map",
                         &leaf->value_map) < 0))
        return -1;
    leaf->rows = rows, leaf->cols = cols, leaf->shared = shared, leaf->values = values;
    leaf->nnz = PyArray_DIM((PyArrayObject *)indices, 0);
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
    if (rp_py_check_nargs(nargs, 6, "csr_plan") < 0 || rp_py_int_arg(args[1], "levels", &levels) < 0 ||
        rp_py_size_arg(args[2], "max_pairs", &max_pairs) < 0 || rp_py_machine_args(args + 3, &m) < 0)
        return NULL;
    /* a tuple of its own, never the caller's list (which PySequence_Fast
     * hands back): the leaves borrow the arrays of its leaf tuples while
     * Python code runs (a `shared` with __bool__) and while the plan is built
     * without the GIL, when another thread may empty that list */
    seq = rp_py_tuple_of(args[0], "leaves: expected a sequence of (rows, cols, indptr, indices, "
                                  "shared, value_map, values)");
    if (seq == NULL)
        return NULL;
    n = PyTuple_GET_SIZE(seq);
    leaves = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof *leaves);
    if (leaves == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (int64_t i = 0; i < n; i++)
        if (rp_py_leaf_arg(PyTuple_GET_ITEM(seq, i), i, &leaves[i]) < 0) {
            PyMem_Free(leaves);
            Py_DECREF(seq);
            return NULL;
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
    plan = rp_py_plan_arg(args[0]);
    if (plan == NULL)
        return NULL;
    rp_csr_plan_describe(plan, &info);
    return Py_BuildValue("{s:i,s:d,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L}", "levels", info.levels, "cost",
                         info.cost, "seq_floats", (long long)info.seq_floats, "shared_floats",
                         (long long)info.shared_floats, "madds", (long long)info.madds, "linear_madds",
                         (long long)info.linear_madds, "products", (long long)info.products, "pairs",
                         (long long)info.pairs, "phases", (long long)info.phases, "rows",
                         (long long)info.rows, "terms", (long long)info.terms);
}

/* A NumPy copy of n elements of a core array. */
static PyObject *rp_py_array_copy(const void *data, int64_t n, int typenum)
{
    npy_intp dim = (npy_intp)n;
    PyObject *arr = PyArray_SimpleNew(1, &dim, typenum);
    if (arr != NULL && n > 0)
        memcpy(PyArray_DATA((PyArrayObject *)arr), data, (size_t)n * PyArray_ITEMSIZE((PyArrayObject *)arr));
    return arr;
}

PyObject *rp_py_csr_program(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const rp_csr_program *g;
    rp_csr_plan *plan;
    (void)self;
    if (rp_py_check_nargs(nargs, 1, "csr_program") < 0)
        return NULL;
    plan = rp_py_plan_arg(args[0]);
    if (plan == NULL)
        return NULL;
    g = rp_csr_plan_program(plan);
    return Py_BuildValue("{s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:k}", "phase_ptr",
                         rp_py_array_copy(g->phase_ptr, g->nphases + 1, NPY_INT64), "phase_shared",
                         rp_py_array_copy(g->phase_shared, g->nphases, NPY_INT64), "dst",
                         rp_py_array_copy(g->dst, g->nrows, NPY_UINT32), "term_ptr",
                         rp_py_array_copy(g->term_ptr, g->nrows + 1, NPY_INT64), "tx",
                         rp_py_array_copy(g->tx, g->nterms, NPY_UINT32), "ty",
                         rp_py_array_copy(g->ty, g->nterms, NPY_UINT32), "leaf_addr",
                         rp_py_array_copy(g->leaf_addr, g->layers, NPY_UINT32), "g_addr",
                         rp_py_array_copy(g->g_addr, g->layers, NPY_UINT32), "g_out_addr",
                         (unsigned long)g->g_out_addr);
}

/* A NumPy (rows, cols) int64 copy of a C-order table. */
static PyObject *rp_py_table_copy(const int64_t *data, int64_t rows, int64_t cols)
{
    npy_intp dims[2] = {(npy_intp)rows, (npy_intp)cols};
    PyObject *arr = PyArray_SimpleNew(2, dims, NPY_INT64);
    if (arr != NULL && rows > 0)
        memcpy(PyArray_DATA((PyArrayObject *)arr), data, (size_t)(rows * cols) * sizeof *data);
    return arr;
}

PyObject *rp_py_csr_schedule(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    rp_csr_schedule sched;
    rp_csr_plan *plan;
    rp_error err = {{0}};
    PyObject *out;
    int rc;
    (void)self;
    if (rp_py_check_nargs(nargs, 1, "csr_schedule") < 0)
        return NULL;
    plan = rp_py_plan_arg(args[0]);
    if (plan == NULL)
        return NULL;
    rc = rp_csr_plan_schedule(plan, &sched, &err);
    if (rc != RP_OK)
        return rp_py_raise(rc, &err);
    out = Py_BuildValue("{s:N,s:N,s:L,s:L}", "steps",
                        rp_py_table_copy(sched.steps, sched.nsteps, RP_CSR_STEP_COLS), "products",
                        rp_py_table_copy(sched.products, sched.nproducts, RP_CSR_PRODUCT_COLS), "vectors",
                        (long long)sched.nvectors, "width", (long long)sched.width);
    rp_csr_schedule_free(&sched);
    return out;
}

PyObject *rp_py_csr_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const rp_py_cuda_launchers *cuda = rp_py_cuda_of(self);
    rp_csr_device_rows rows;
    rp_csr_plan *plan;
    void *seq, *shared, *dst, *term_ptr, *tx, *ty;
    int64_t batch;
    rp_py_where where;
    rp_error err = {{0}};
    int rc;
    if (rp_py_check_nargs(nargs, 9, "csr_run") < 0)
        return NULL;
    plan = rp_py_plan_arg(args[0]);
    if (plan == NULL || rp_py_size_arg(args[1], "batch", &batch) < 0 || rp_py_pointer_arg(args[2], "seq", &seq) < 0 ||
        rp_py_pointer_arg(args[3], "shared", &shared) < 0 || rp_py_pointer_arg(args[4], "dst", &dst) < 0 ||
        rp_py_pointer_arg(args[5], "term_ptr", &term_ptr) < 0 || rp_py_pointer_arg(args[6], "tx", &tx) < 0 ||
        rp_py_pointer_arg(args[7], "ty", &ty) < 0 || rp_py_where_arg(args[8], cuda, &where) < 0)
        return NULL;
    rows = (rp_csr_device_rows){dst, term_ptr, tx, ty};
    Py_BEGIN_ALLOW_THREADS
    if (cuda != NULL)
        rc = cuda->csr_run(rp_csr_plan_program(plan), &rows, batch, seq, shared, where.stream, &err);
    else
        rc = rp_csr_run_cpu(rp_csr_plan_program(plan), batch, seq, shared, where.num_threads, &err);
    Py_END_ALLOW_THREADS
    return rp_py_none_or_raise(rc, &err);
}

PyObject *rp_py_csr_gradients(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    rp_csr_plan *plan;
    void *seq, *ptr;
    float **out;
    PyObject *ptrs;
    int64_t batch, n, parsed = 0;
    int num_threads, finite = 0, rc = RP_OK;
    rp_error err = {{0}};
    (void)self;
    if (rp_py_check_nargs(nargs, 5, "csr_gradients") < 0)
        return NULL;
    plan = rp_py_plan_arg(args[0]);
    if (plan == NULL || rp_py_size_arg(args[1], "batch", &batch) < 0 || rp_py_pointer_arg(args[2], "seq", &seq) < 0 ||
        rp_py_int_arg(args[4], "num_threads", &num_threads) < 0)
        return NULL;
    ptrs = PySequence_Fast(args[3], "out: expected a sequence of data pointers");
    if (ptrs == NULL)
        return NULL;
    n = rp_csr_plan_program(plan)->layers;
    if (PySequence_Fast_GET_SIZE(ptrs) != n) {
        PyErr_Format(PyExc_ValueError, "out: expected %lld data pointers (one per layer), got %zd",
                     (long long)n, PySequence_Fast_GET_SIZE(ptrs));
        Py_DECREF(ptrs);
        return NULL;
    }
    out = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof *out);
    if (out == NULL) {
        Py_DECREF(ptrs);
        return PyErr_NoMemory();
    }
    for (; parsed < n; parsed++) {
        char name[32];
        PyOS_snprintf(name, sizeof name, "out[%lld]", (long long)parsed);
        if (rp_py_pointer_arg(PySequence_Fast_GET_ITEM(ptrs, parsed), name, &ptr) < 0)
            break;
        out[parsed] = ptr;
    }
    if (parsed == n) {
        Py_BEGIN_ALLOW_THREADS
        rc = rp_csr_gradients_cpu(plan, batch, seq, out, num_threads, &finite, &err);
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(out);
    Py_DECREF(ptrs);
    if (parsed < n)
        return NULL;
    return rc == RP_OK ? PyBool_FromLong(finite) : rp_py_raise(rc, &err);
}

/* ---- out-of-order backprop scheduling ---- */

/* spec[key], a new reference the caller releases: the entry's own Python
 * code (__len__, __float__, __index__, __bool__) may delete it from the dict,
 * which then no longer keeps it alive. NULL with a TypeError naming the key
 * when absent, or the lookup's own error (a key's __eq__ raising). */
static PyObject *rp_py_spec_item(PyObject *spec, const char *key, const char *fname)
{
    PyObject *k = PyUnicode_FromString(key), *v;
    if (k == NULL)
        return NULL;
    v = PyDict_GetItemWithError(spec, k);
    Py_DECREF(k);
    if (v == NULL && !PyErr_Occurred())
        PyErr_Format(PyExc_TypeError, "%s: the dict has no '%s'", fname, key);
    Py_XINCREF(v);
    return v;
}

static int rp_py_spec_int(PyObject *spec, const char *key, const char *fname, int64_t *out)
{
    PyObject *v = rp_py_spec_item(spec, key, fname), *index;
    long long x;
    if (v == NULL)
        return -1;
    index = PyNumber_Index(v); /* ints and NumPy integers, not floats */
    Py_DECREF(v);
    x = index != NULL ? PyLong_AsLongLong(index) : -1;
    Py_XDECREF(index);
    if (x == -1 && PyErr_Occurred()) {
        rp_py_prefix_error(fname, key);
        return -1;
    }
    *out = (int64_t)x;
    return 0;
}

static int rp_py_spec_float(PyObject *spec, const char *key, const char *fname, double *out)
{
    PyObject *v = rp_py_spec_item(spec, key, fname);
    if (v == NULL)
        return -1;
    *out = PyFloat_AsDouble(v);
    Py_DECREF(v);
    if (*out == -1.0 && PyErr_Occurred()) {
        rp_py_prefix_error(fname, key);
        return -1;
    }
    return 0;
}

/* A bool, a Python int or a NumPy bool or integer: its truth. */
static int rp_py_spec_flag(PyObject *spec, const char *key, const char *fname, int *out)
{
    PyObject *v = rp_py_spec_item(spec, key, fname);
    if (v == NULL)
        return -1;
    if (!PyLong_Check(v) && !PyArray_IsScalar(v, Bool) && !PyArray_IsScalar(v, Integer)) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be a bool (got %s)", fname, key,
                     Py_TYPE(v)->tp_name);
        Py_DECREF(v);
        return -1;
    }
    *out = PyObject_IsTrue(v);
    Py_DECREF(v);
    return *out < 0 ? -1 : 0;
}

/* obj as an aligned C-contiguous array of typenum and shape dims (-1: any
 * extent), a new reference; NULL with an exception naming `name`. Any
 * array-like is first read in its own dtype and then cast by NumPy's safe
 * rule, so floats (arrays or lists) are never truncated into an integer
 * array (an empty one casts freely: [] reads as float64). int32 is reached
 * through int64 with a range check, so that int64 arrays (NumPy's default
 * integer) are accepted when their values fit.
 *
 * own: a private copy even when obj already fits, which NumPy would hand
 * back itself (or a view of its buffer). For the arrays whose values the
 * core checks and then uses as indices, sizes or sums without the GIL:
 * another thread writing the caller's array in between would pass the check
 * with one value and have the core use another (a task id past the end, a
 * sum past int64). Not for the float data, where that race only gives wrong
 * numbers, as it does in NumPy itself. */
static PyArrayObject *rp_py_array(PyObject *obj, int typenum, int ndim, const npy_intp *dims,
                                  int own, const char *fname, const char *name)
{
    const int via = typenum == NPY_INT32 && !(PyArray_Check(obj) &&
                                              PyArray_TYPE((PyArrayObject *)obj) == NPY_INT32)
                        ? NPY_INT64
                        : typenum;
    PyArrayObject *arr, *src = (PyArrayObject *)PyArray_FROM_OF(obj, 0);
    if (src == NULL) {
        rp_py_prefix_error(fname, name);
        return NULL;
    }
    arr = (PyArrayObject *)PyArray_FROM_OTF(
        (PyObject *)src, via,
        NPY_ARRAY_IN_ARRAY | (PyArray_SIZE(src) == 0 ? NPY_ARRAY_FORCECAST : 0) |
            (own ? NPY_ARRAY_ENSURECOPY : 0));
    Py_DECREF(src);
    if (arr == NULL) {
        rp_py_prefix_error(fname, name);
        return NULL;
    }
    if (PyArray_NDIM(arr) != ndim) {
        PyErr_Format(PyExc_ValueError, "%s: %s must be %d-D (got %d-D)", fname, name, ndim,
                     PyArray_NDIM(arr));
        goto fail;
    }
    for (int i = 0; i < ndim; i++)
        if (dims[i] >= 0 && PyArray_DIM(arr, i) != dims[i]) {
            PyErr_Format(PyExc_ValueError,
                         "%s: %s must have %lld elements along axis %d (got %lld)", fname, name,
                         (long long)dims[i], i, (long long)PyArray_DIM(arr, i));
            goto fail;
        }
    if (via != typenum) {
        const int64_t *v = (const int64_t *)PyArray_DATA(arr);
        PyArrayObject *narrow;
        for (npy_intp i = 0; i < PyArray_SIZE(arr); i++)
            if (v[i] < INT32_MIN || v[i] > INT32_MAX) {
                PyErr_Format(PyExc_ValueError, "%s: %s[%lld] = %lld does not fit in int32", fname,
                             name, (long long)i, (long long)v[i]);
                goto fail;
            }
        narrow = (PyArrayObject *)PyArray_FROM_OTF((PyObject *)arr, typenum,
                                                   NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
        Py_DECREF(arr);
        return narrow;
    }
    return arr;
fail:
    Py_DECREF(arr);
    return NULL;
}

/* spec[key] as a 1-D array of `len` elements of typenum (own: a private
 * copy, see rp_py_array); *out NULL when the entry is None and none_ok. */
static int rp_py_spec_array(PyObject *spec, const char *key, const char *fname, int typenum,
                            npy_intp len, int none_ok, int own, PyArrayObject **out)
{
    PyObject *v = rp_py_spec_item(spec, key, fname);
    *out = NULL;
    if (v == NULL)
        return -1;
    if (none_ok && v == Py_None) {
        Py_DECREF(v);
        return 0;
    }
    *out = rp_py_array(v, typenum, 1, &len, own, fname, key);
    Py_DECREF(v);
    return *out == NULL ? -1 : 0;
}

/* The arrays of an rp_task_graph, as the dicts of sched_graph and simulate
 * hold them. The extent of each: 0 tasks, 1 tasks + 1, 2 deps, 3 resources;
 * the first array of each extent sets it. simulate owns (rp_py_array) the
 * ones its check bounds and it then indexes or branches on: kind (a name),
 * resource, dep_ptr and dep_idx (task and resource ids), policy and group. */
typedef struct {
    const char *key;
    int typenum;
    int extent;
    int own;
} rp_py_graph_field;

#define RP_PY_GRAPH_FIELDS 12

static const rp_py_graph_field rp_py_graph_fields[RP_PY_GRAPH_FIELDS] = {
    {"kind", NPY_INT32, 0, 1},       {"layer", NPY_INT32, 0, 0},    {"micro", NPY_INT32, 0, 0},
    {"iteration", NPY_INT32, 0, 0},  {"resource", NPY_INT32, 0, 1}, {"cost", NPY_FLOAT64, 0, 0},
    {"priority", NPY_FLOAT64, 0, 0}, {"dep_ptr", NPY_INT64, 1, 1},  {"dep_idx", NPY_INT64, 2, 1},
    {"dep_delay", NPY_FLOAT64, 2, 0}, {"policy", NPY_INT32, 3, 1},  {"group", NPY_INT32, 3, 1},
};

static void rp_py_graph_bind(PyArrayObject *const *a, rp_task_graph *g)
{
    g->n_tasks = (int64_t)PyArray_DIM(a[0], 0);
    g->n_deps = (int64_t)PyArray_DIM(a[8], 0);
    g->n_resources = (int64_t)PyArray_DIM(a[10], 0);
    g->kind = PyArray_DATA(a[0]), g->layer = PyArray_DATA(a[1]), g->micro = PyArray_DATA(a[2]);
    g->iteration = PyArray_DATA(a[3]), g->resource = PyArray_DATA(a[4]);
    g->cost = PyArray_DATA(a[5]), g->priority = PyArray_DATA(a[6]);
    g->dep_ptr = PyArray_DATA(a[7]), g->dep_idx = PyArray_DATA(a[8]);
    g->dep_delay = PyArray_DATA(a[9]), g->policy = PyArray_DATA(a[10]);
    g->group = PyArray_DATA(a[11]);
}

static void rp_py_release(PyArrayObject **a, int n)
{
    for (int i = 0; i < n; i++)
        Py_CLEAR(a[i]);
}

static PyObject *rp_py_new_array(npy_intp len, int typenum)
{
    return PyArray_SimpleNew(1, &len, typenum);
}

/* The rp_iter_spec of a sched_graph dict; the arrays it points into are
 * new references in a[0 .. 4] (fwd, out_grad, weight_grad, sync, stage). */
static int rp_py_parse_spec(PyObject *spec, rp_iter_spec *s, PyArrayObject **a)
{
    static const char *const fname = "sched_graph";
    int64_t order;
    memset(s, 0, sizeof *s);
    if (rp_py_spec_int(spec, "layers", fname, &s->layers) < 0 ||
        rp_py_spec_int(spec, "micro", fname, &s->micro) < 0 ||
        rp_py_spec_int(spec, "stages", fname, &s->stages) < 0 ||
        rp_py_spec_int(spec, "iterations", fname, &s->iterations) < 0 ||
        rp_py_spec_float(spec, "transfer", fname, &s->transfer) < 0 ||
        rp_py_spec_int(spec, "order", fname, &order) < 0 ||
        rp_py_spec_int(spec, "k", fname, &s->k) < 0 ||
        rp_py_spec_flag(spec, "sync_by_layer", fname, &s->sync_by_layer) < 0 ||
        rp_py_spec_flag(spec, "sub_stream", fname, &s->sub_stream) < 0 ||
        rp_py_spec_flag(spec, "input_grad", fname, &s->input_grad) < 0)
        return -1;
    if (s->layers < 1 || s->layers > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: layers must be in [1, 2^31) (got %lld)", fname,
                     (long long)s->layers);
        return -1;
    }
    if (order < INT32_MIN || order > INT32_MAX) { /* the core's int cannot hold it */
        PyErr_Format(PyExc_ValueError, "%s: order %lld is not an rp_order", fname,
                     (long long)order);
        return -1;
    }
    s->order = (int)order;
    /* stage owned: the builder checks it, then makes resource ids of it */
    if (rp_py_spec_array(spec, "fwd", fname, NPY_FLOAT64, (npy_intp)s->layers, 0, 0, &a[0]) < 0 ||
        rp_py_spec_array(spec, "out_grad", fname, NPY_FLOAT64, (npy_intp)s->layers, 0, 0, &a[1]) <
            0 ||
        rp_py_spec_array(spec, "weight_grad", fname, NPY_FLOAT64, (npy_intp)s->layers, 0, 0,
                         &a[2]) < 0 ||
        rp_py_spec_array(spec, "sync", fname, NPY_FLOAT64, (npy_intp)s->layers, 1, 0, &a[3]) < 0 ||
        rp_py_spec_array(spec, "stage", fname, NPY_INT32, (npy_intp)s->layers, 1, 1, &a[4]) < 0)
        return -1;
    s->fwd = PyArray_DATA(a[0]), s->out_grad = PyArray_DATA(a[1]);
    s->weight_grad = PyArray_DATA(a[2]);
    s->sync = a[3] != NULL ? PyArray_DATA(a[3]) : NULL;
    s->stage = a[4] != NULL ? PyArray_DATA(a[4]) : NULL;
    return 0;
}

PyObject *rp_py_sched_graph(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    rp_iter_spec s;
    rp_task_graph g;
    rp_error err = {{0}};
    PyArrayObject *in[5] = {NULL, NULL, NULL, NULL, NULL}, *out[RP_PY_GRAPH_FIELDS] = {NULL};
    PyObject *result = NULL;
    npy_intp extent[4];
    int rc;
    (void)self;
    if (rp_py_check_nargs(nargs, 1, "sched_graph") < 0)
        return NULL;
    if (!PyDict_Check(args[0])) {
        PyErr_Format(PyExc_TypeError, "sched_graph: spec must be a dict (got %s)",
                     Py_TYPE(args[0])->tp_name);
        return NULL;
    }
    if (rp_py_parse_spec(args[0], &s, in) < 0)
        goto done;
    memset(&g, 0, sizeof g);
    rc = rp_iter_graph_size(&s, &g.n_tasks, &g.n_deps, &g.n_resources, &err);
    if (rc != RP_OK) {
        rp_py_raise(rc, &err);
        goto done;
    }
    extent[0] = (npy_intp)g.n_tasks, extent[1] = (npy_intp)g.n_tasks + 1;
    extent[2] = (npy_intp)g.n_deps, extent[3] = (npy_intp)g.n_resources;
    for (int i = 0; i < RP_PY_GRAPH_FIELDS; i++) {
        const rp_py_graph_field *f = &rp_py_graph_fields[i];
        out[i] = (PyArrayObject *)rp_py_new_array(extent[f->extent], f->typenum);
        if (out[i] == NULL)
            goto done;
    }
    rp_py_graph_bind(out, &g);
    Py_BEGIN_ALLOW_THREADS
    rc = rp_iter_graph_build(&s, &g, &err);
    Py_END_ALLOW_THREADS
    if (rc != RP_OK) {
        rp_py_raise(rc, &err);
        goto done;
    }
    result = PyDict_New();
    for (int i = 0; result != NULL && i < RP_PY_GRAPH_FIELDS; i++)
        if (PyDict_SetItemString(result, rp_py_graph_fields[i].key, (PyObject *)out[i]) < 0)
            Py_CLEAR(result);
done:
    rp_py_release(in, 5);
    rp_py_release(out, RP_PY_GRAPH_FIELDS);
    return result;
}

/* The twelve arrays of a graph dict, new references in a. */
static int rp_py_parse_graph(PyObject *graph, PyArrayObject **a)
{
    static const char *const fname = "simulate";
    npy_intp extent[4] = {-1, -1, -1, -1};
    if (!PyDict_Check(graph)) {
        PyErr_Format(PyExc_TypeError, "simulate: graph must be a dict (got %s)",
                     Py_TYPE(graph)->tp_name);
        return -1;
    }
    for (int i = 0; i < RP_PY_GRAPH_FIELDS; i++) {
        const rp_py_graph_field *f = &rp_py_graph_fields[i];
        if (rp_py_spec_array(graph, f->key, fname, f->typenum, extent[f->extent], 0, f->own,
                             &a[i]) < 0)
            return -1;
        if (extent[f->extent] < 0)
            extent[f->extent] = PyArray_DIM(a[i], 0);
        if (f->extent == 0)
            extent[1] = extent[0] + 1;
    }
    return 0;
}

PyObject *rp_py_simulate(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    rp_task_graph g;
    rp_error err = {{0}};
    PyArrayObject *a[RP_PY_GRAPH_FIELDS] = {NULL};
    PyObject *start = NULL, *finish = NULL, *busy = NULL, *result = NULL;
    double rate, makespan = 0.0;
    int rc;
    (void)self;
    if (rp_py_check_nargs(nargs, 2, "simulate") < 0)
        return NULL;
    rate = PyFloat_AsDouble(args[1]);
    if (rate == -1.0 && PyErr_Occurred()) {
        rp_py_prefix_error("simulate", "corun_rate");
        return NULL;
    }
    if (rp_py_parse_graph(args[0], a) < 0)
        goto done;
    rp_py_graph_bind(a, &g);
    start = rp_py_new_array((npy_intp)g.n_tasks, NPY_FLOAT64);
    finish = rp_py_new_array((npy_intp)g.n_tasks, NPY_FLOAT64);
    busy = rp_py_new_array((npy_intp)g.n_resources, NPY_FLOAT64);
    if (start == NULL || finish == NULL || busy == NULL)
        goto done;
    Py_BEGIN_ALLOW_THREADS
    rc = rp_simulate(&g, rate, PyArray_DATA((PyArrayObject *)start),
                     PyArray_DATA((PyArrayObject *)finish), PyArray_DATA((PyArrayObject *)busy),
                     &makespan, &err);
    Py_END_ALLOW_THREADS
    if (rc != RP_OK)
        rp_py_raise(rc, &err);
    else
        result = Py_BuildValue("(OOOd)", start, finish, busy, makespan);
done:
    rp_py_release(a, RP_PY_GRAPH_FIELDS);
    Py_XDECREF(start);
    Py_XDECREF(finish);
    Py_XDECREF(busy);
    return result;
}

PyObject *rp_py_sched_stages(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    rp_error err = {{0}};
    int64_t layers, stages, group;
    PyObject *out;
    int rc;
    (void)self;
    if (rp_py_check_nargs(nargs, 3, "sched_stages") < 0 || rp_py_size_arg(args[0], "layers", &layers) < 0 ||
        rp_py_size_arg(args[1], "stages", &stages) < 0 || rp_py_size_arg(args[2], "group", &group) < 0)
        return NULL;
    if (layers < 1 || layers > INT32_MAX) /* the core's message, before allocating */
        return rp_py_raise(rp_sched_stages(layers, stages, group, NULL, &err), &err);
    out = rp_py_new_array((npy_intp)layers, NPY_INT32);
    if (out == NULL)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = rp_sched_stages(layers, stages, group, PyArray_DATA((PyArrayObject *)out), &err);
    Py_END_ALLOW_THREADS
    if (rc != RP_OK) {
        Py_DECREF(out);
        return rp_py_raise(rc, &err);
    }
    return out;
}

/* An optional int64 array of memory sizes, `len` elements (None: *out
 * stays NULL), owned: the core checks that their sum fits in int64, then
 * sums them. */
static int rp_py_optional_int64(PyObject *obj, npy_intp len, const char *fname, const char *name,
                                PyArrayObject **out)
{
    *out = NULL;
    if (obj == Py_None)
        return 0;
    *out = rp_py_array(obj, NPY_INT64, 1, &len, 1, fname, name);
    return *out == NULL ? -1 : 0;
}

PyObject *rp_py_reverse_first_k(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const fname = "reverse_first_k";
    rp_error err = {{0}};
    int64_t layers, k, mem_forward, mem_cap, k_used = 0;
    PyArrayObject *og = NULL, *wg = NULL;
    PyObject *kind = NULL, *layer = NULL, *result = NULL;
    int rc;
    (void)self;
    if (rp_py_check_nargs(nargs, 6, fname) < 0 || rp_py_size_arg(args[0], "layers", &layers) < 0 ||
        rp_py_size_arg(args[1], "k", &k) < 0 || rp_py_size_arg(args[4], "mem_forward", &mem_forward) < 0 ||
        rp_py_size_arg(args[5], "mem_cap", &mem_cap) < 0)
        return NULL;
    if (layers < 1 || layers > INT32_MAX / 2) /* the core's message, before allocating */
        return rp_py_raise(rp_sched_reverse_first_k(layers, k, NULL, NULL, 0, 0, NULL, NULL, NULL,
                                                    &err),
                           &err);
    if (rp_py_optional_int64(args[2], (npy_intp)layers, fname, "mem_out_grad", &og) < 0 ||
        rp_py_optional_int64(args[3], (npy_intp)layers, fname, "mem_weight_grad", &wg) < 0)
        goto done;
    kind = rp_py_new_array((npy_intp)(2 * layers), NPY_INT32);
    layer = rp_py_new_array((npy_intp)(2 * layers), NPY_INT32);
    if (kind == NULL || layer == NULL)
        goto done;
    Py_BEGIN_ALLOW_THREADS
    rc = rp_sched_reverse_first_k(layers, k, og != NULL ? PyArray_DATA(og) : NULL,
                                  wg != NULL ? PyArray_DATA(wg) : NULL, mem_forward, mem_cap,
                                  PyArray_DATA((PyArrayObject *)kind),
                                  PyArray_DATA((PyArrayObject *)layer), &k_used, &err);
    Py_END_ALLOW_THREADS
    if (rc != RP_OK)
        rp_py_raise(rc, &err);
    else
        result = Py_BuildValue("(OOL)", kind, layer, (long long)k_used);
done:
    Py_XDECREF(og);
    Py_XDECREF(wg);
    Py_XDECREF(kind);
    Py_XDECREF(layer);
    return result;
}

PyObject *rp_py_ksearch_next(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    rp_error err = {{0}};
    int64_t layers, next = -1, best = -1;
    PyArrayObject *score;
    npy_intp len;
    int rc;
    (void)self;
    if (rp_py_check_nargs(nargs, 2, "ksearch_next") < 0 || rp_py_size_arg(args[0], "layers", &layers) < 0)
        return NULL;
    if (layers < 1 || layers > (int64_t)1 << 40)
        return rp_py_raise(rp_ksearch_next(layers, NULL, &next, &best, &err), &err);
    len = (npy_intp)(layers + 1);
    score = rp_py_array(args[1], NPY_FLOAT64, 1, &len, 0, "ksearch_next", "score");
    if (score == NULL)
        return NULL;
    rc = rp_ksearch_next(layers, PyArray_DATA(score), &next, &best, &err);
    Py_DECREF(score);
    if (rc != RP_OK)
        return rp_py_raise(rc, &err);
    return Py_BuildValue("(LL)", (long long)next, (long long)best);
}

/* sched_regions' storages several tasks read (args: size, start, task;
 * all None: none, *shared stays NULL): int64 arrays of n, n + 1 and
 * start[n] elements, owned (the core checks them, then reads task up to
 * start[n] and sums the sizes without the GIL). */
static int rp_py_shared_reads(PyObject *const *args, const char *fname, PyArrayObject **a,
                              rp_shared_reads *sh, const rp_shared_reads **shared)
{
    npy_intp any = -1, starts;
    *shared = NULL;
    if (args[0] == Py_None && args[1] == Py_None && args[2] == Py_None)
        return 0;
    if ((a[0] = rp_py_array(args[0], NPY_INT64, 1, &any, 1, fname, "shared_size")) == NULL)
        return -1;
    starts = PyArray_DIM(a[0], 0) + 1;
    if ((a[1] = rp_py_array(args[1], NPY_INT64, 1, &starts, 1, fname, "shared_start")) == NULL ||
        (a[2] = rp_py_array(args[2], NPY_INT64, 1, &any, 1, fname, "shared_task")) == NULL)
        return -1;
    sh->n = (int64_t)(starts - 1);
    sh->size = PyArray_DATA(a[0]), sh->start = PyArray_DATA(a[1]), sh->task = PyArray_DATA(a[2]);
    /* the core reads task up to start[n], which its check keeps >= every start */
    if (sh->start[sh->n] != (int64_t)PyArray_DIM(a[2], 0)) {
        PyErr_Format(PyExc_ValueError, "%s(): shared_start[-1] = %lld must be len(shared_task) "
                     "= %lld", fname, (long long)sh->start[sh->n],
                     (long long)PyArray_DIM(a[2], 0));
        return -1;
    }
    *shared = sh;
    return 0;
}

/* sched_regions' mem_cap: an int, < 0 for no cap (*out stays NULL), else
 * the same cap at each of the n region ends; or anything else as an int64
 * array of n caps (each >= 0: the core checks it), owned as mem is. */
static int rp_py_mem_caps(PyObject *obj, npy_intp n, const char *fname, PyArrayObject **out)
{
    int64_t cap;
    *out = NULL;
    if (PyArray_Check(obj) || PySequence_Check(obj)) {
        *out = rp_py_array(obj, NPY_INT64, 1, &n, 1, fname, "mem_cap");
        return *out == NULL ? -1 : 0;
    }
    if (rp_py_size_arg(obj, "mem_cap", &cap) < 0)
        return -1;
    if (cap < 0)
        return 0;
    if ((*out = (PyArrayObject *)rp_py_new_array(n, NPY_INT64)) == NULL)
        return -1;
    for (npy_intp i = 0; i < n; i++)
        ((int64_t *)PyArray_DATA(*out))[i] = cap;
    return 0;
}

PyObject *rp_py_sched_regions(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const fname = "sched_regions";
    rp_error err = {{0}};
    /* t_main, ready, deadline, t_sub, speedup, mem, shared size, start, task, mem_cap */
    PyArrayObject *a[10] = {NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    PyObject *region = NULL, *order = NULL, *held = NULL, *result = NULL;
    npy_intp any = -1, n, tasks, shape[2];
    int64_t pre = 0, peak = 0;
    rp_shared_reads sh;
    const rp_shared_reads *shared = NULL;
    int rc;
    (void)self;
    if (rp_py_check_nargs(nargs, 10, fname) < 0)
        return NULL;
    a[0] = rp_py_array(args[0], NPY_FLOAT64, 1, &any, 0, fname, "t_main");
    if (a[0] == NULL)
        goto done;
    a[1] = rp_py_array(args[1], NPY_FLOAT64, 1, &any, 0, fname, "ready");
    if (a[1] == NULL)
        goto done;
    n = PyArray_DIM(a[0], 0), tasks = PyArray_DIM(a[1], 0);
    shape[0] = tasks, shape[1] = n;
    /* deadline owned: checked within [1, n], then a region index */
    if ((a[2] = rp_py_array(args[2], NPY_INT64, 1, &tasks, 1, fname, "deadline")) == NULL ||
        (a[3] = rp_py_array(args[3], NPY_FLOAT64, 2, shape, 0, fname, "t_sub")) == NULL ||
        (a[4] = rp_py_array(args[4], NPY_FLOAT64, 2, shape, 0, fname, "speedup")) == NULL ||
        rp_py_optional_int64(args[5], tasks, fname, "mem", &a[5]) < 0 ||
        rp_py_mem_caps(args[6], n, fname, &a[9]) < 0 ||
        rp_py_shared_reads(args + 7, fname, a + 6, &sh, &shared) < 0)
        goto done;
    region = rp_py_new_array(tasks, NPY_INT64);
    order = rp_py_new_array(tasks, NPY_INT64);
    held = rp_py_new_array(n, NPY_INT64);
    if (region == NULL || order == NULL || held == NULL)
        goto done;
    Py_BEGIN_ALLOW_THREADS
    rc = rp_sched_regions((int64_t)n, PyArray_DATA(a[0]), (int64_t)tasks, PyArray_DATA(a[1]),
                          PyArray_DATA(a[2]), PyArray_DATA(a[3]), PyArray_DATA(a[4]),
                          a[5] != NULL ? PyArray_DATA(a[5]) : NULL, shared,
                          a[9] != NULL ? PyArray_DATA(a[9]) : NULL,
                          PyArray_DATA((PyArrayObject *)region),
                          PyArray_DATA((PyArrayObject *)order),
                          PyArray_DATA((PyArrayObject *)held), &pre, &peak, &err);
    Py_END_ALLOW_THREADS
    if (rc != RP_OK)
        rp_py_raise(rc, &err);
    else
        result = Py_BuildValue("(OOLLO)", region, order, (long long)pre, (long long)peak, held);
done:
    rp_py_release(a, 10);
    Py_XDECREF(region);
    Py_XDECREF(order);
    Py_XDECREF(held);
    return result;
}
