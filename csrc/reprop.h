/*
 * reprop.h: the public header of the reprop C core.
 *
 * Everything here is plain C11: no Python, no torch. The Python layer hands
 * down raw data pointers, sizes and dtype codes after checking them; the core
 * trusts what it is given and returns an int status (RP_OK on success) with a
 * message in the caller's rp_error buffer otherwise.
 *
 * Every public symbol is prefixed rp_.
 */
#ifndef REPROP_H
#define REPROP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define RP_OK 0
#define RP_EINVAL 1   /* bad argument: maps to ValueError */
#define RP_ERUNTIME 2 /* failure while running: maps to RuntimeError */

/* A caller-owned error message buffer. */
typedef struct {
    char msg[256];
} rp_error;

int rp_set_error(rp_error *err, int code, const char *fmt, ...);

/* Element types of parameters and gradients. State is always float32. */
typedef enum { RP_F32 = 0, RP_F16 = 1, RP_BF16 = 2 } rp_dtype;

const char *rp_dtype_name(int dtype);

/* ---------------------------------------------------------------------------
 * Fused multi-tensor optimizers (csrc/optim.c, kernels/optim.cu)
 * ------------------------------------------------------------------------- */

typedef enum {
    RP_SGD = 0,
    RP_ADAM = 1, /* Adam and AdamW (decoupled_weight_decay) */
    RP_ADAGRAD = 2,
    RP_RMSPROP = 3,
    RP_ADADELTA = 4,
} rp_optim_kind;

/* Which state slots each optimizer uses (entry.state[0..2]), in torch's names:
 *   SGD:      [0] momentum_buffer (only when momentum != 0)
 *   Adam(W):  [0] exp_avg  [1] exp_avg_sq  [2] max_exp_avg_sq (amsgrad only)
 *   Adagrad:  [0] sum
 *   RMSprop:  [0] square_avg  [1] momentum_buffer (momentum > 0)  [2] grad_avg (centered)
 *   Adadelta: [0] square_avg  [1] acc_delta
 * Unused slots are NULL. */

/* Entry flags. */
#define RP_ENTRY_FRESH_BUFFER 1 /* SGD: momentum buffer is new, initialise it from the gradient */

/* One tensor of a multi-tensor update. Exactly 8 x 64 bits, so the Python
 * layer can hand down an int64 array of shape (n, 8) and the core reads it as
 * an array of entries. All tensors of an entry have `numel` elements laid out
 * identically (same strides, non-overlapping and dense). */
typedef struct {
    void *param;       /* param dtype, updated in place */
    const void *grad;  /* param dtype */
    float *state[3];   /* float32, updated in place; see the table above */
    float *step;       /* float32 step counter (torch's state["step"]); NULL for SGD.
                          Host memory unless the update is capturable (then device memory). */
    int64_t numel;
    int64_t flags;     /* RP_ENTRY_* */
} rp_optim_entry;

/* How torch computes with a hyper-parameter (rp_optim_hparams' *_kind): a
 * Python number in double, where a zero denominator raises
 * ZeroDivisionError; a tensor one in tensor ops in torch.result_type(x, 1.0)
 * (two tensors: the dtype both promote to), float32 arithmetic rounded to a
 * 16-bit dtype, where a zero denominator or an overflow gives inf or NaN and
 * the update steps on: Adam's bias corrections 1 - beta ** step (the power
 * too), Adagrad's 1 + (step - 1) * lr_decay, lr divided by them, AdamW's
 * 1 - lr * weight_decay and the weights 1 - beta2, 1 - alpha, 1 - rho and
 * 1 - dampening (Adam's 1 - beta1 is a float32 op whatever the dtype:
 * torch casts beta1 to the parameter's). A device lr (capturable) is float32. */
typedef enum { RP_LR_NUMBER = 0, RP_LR_F64 = 1, RP_LR_F32 = 2, RP_LR_F16 = 3, RP_LR_BF16 = 4 } rp_lr_kind;

/* Hyper-parameters of one parameter group, in torch's names. */
typedef struct {
    int kind; /* rp_optim_kind */
    double lr;
    double weight_decay;
    double eps;
    double beta1, beta2;        /* Adam */
    double momentum, dampening; /* SGD, RMSprop (momentum) */
    double alpha;               /* RMSprop */
    double rho;                 /* Adadelta */
    double lr_decay;            /* Adagrad */
    int nesterov;               /* SGD */
    int maximize;
    int amsgrad;                /* Adam */
    int decoupled_weight_decay; /* Adam: 1 for AdamW */
    int centered;               /* RMSprop */
    int lr_kind;                /* rp_lr_kind of each: how torch computes with it */
    int weight_decay_kind, beta1_kind, beta2_kind, dampening_kind, alpha_kind, rho_kind,
        lr_decay_kind;
    /* Capturable CUDA updates read the learning rate from device memory when
     * lr_ptr is not NULL (a float32 scalar), and the steps from entry.step. */
    const float *lr_ptr;
} rp_optim_hparams;

/* Per-tensor scalars that depend on the step count, computed on the host in
 * double and rounded to float once, as torch does with Python floats:
 *   Adam:    a = -lr / (1 - beta1^step)      b = sqrt(1 - beta2^step)
 *   Adagrad: a = -lr / (1 + (step-1) * lr_decay)
 *   others:  unused. */
typedef struct {
    float a, b;
    float before; /* the host counter as the entry found it (rp_optim_undo_steps) */
} rp_step_scalars;

/* Validates the hyper-parameters and entries (NULL pointers, negative sizes,
 * missing state slots), then rp_optim_check_hparams. */
int rp_optim_check(const rp_optim_hparams *hp, const rp_optim_entry *entries, int64_t n,
                   rp_error *err);

/* RP_EINVAL, naming the hyper-parameter, for the step-independent values
 * torch.optim refuses: a constant it passes to a float32 op (weight_decay,
 * 1 - beta1, -lr, ...) beyond float32's range. Reads only the entries' flags. */
int rp_optim_check_hparams(const rp_optim_hparams *hp, const rp_optim_entry *entries, int64_t n,
                           rp_error *err);

/* Fills scalars[i] for each entry's next step (its host-side counter + 1,
 * a counter shared by several entries advancing once per entry in table
 * order, as torch's loop counts) and advances the counters by one. RP_EINVAL,
 * naming the hyper-parameter, where torch.optim refuses the step (and no
 * counter changes): a bias correction or lr decay of 0 (a division by zero),
 * a power that is not a finite real number, a step size beyond float32. For
 * non-capturable updates on any device. */
int rp_optim_advance_steps(const rp_optim_hparams *hp, const rp_optim_entry *entries, int64_t n,
                           rp_step_scalars *scalars, rp_error *err);

/* Puts back the counters rp_optim_advance_steps advanced with these
 * `scalars`: an update that could not be issued after all (a refused dtype,
 * a failed launch) leaves them as it found them. */
void rp_optim_undo_steps(const rp_optim_hparams *hp, const rp_optim_entry *entries, int64_t n,
                         const rp_step_scalars *scalars);

/* malloc'd room for n entries' step scalars (the caller frees it); NULL with
 * RP_ERUNTIME set in err when memory runs out. */
rp_step_scalars *rp_optim_scalars_alloc(int64_t n, rp_error *err);

/* What rp_optim_check and rp_optim_advance_steps would refuse of the
 * hyper-parameters, changing nothing: an unknown kind,
 * rp_optim_check_hparams and, unless capturable (step counters on the
 * device, which the host cannot read), the step scalars'. Leaves every step
 * counter as it found it, so that an update split over several calls is
 * refused before any of them runs. */
int rp_optim_check_update(const rp_optim_hparams *hp, const rp_optim_entry *entries, int64_t n,
                          int capturable, rp_error *err);

/* Clears the one-shot entry flags once an update has been issued. */
void rp_optim_entries_done(rp_optim_entry *entries, int64_t n);

/* CPU update of n entries of one dtype: in one OpenMP parallel region, or
 * on the calling thread below 2^17 elements in all or with one thread.
 * Calls rp_optim_advance_steps itself. Vectorized with AVX2/AVX-512 chosen at
 * run time. num_threads <= 0 means OpenMP's default. */
int rp_optim_step_cpu(const rp_optim_hparams *hp, int dtype, rp_optim_entry *entries,
                      int64_t n, int num_threads, rp_error *err);

/* Number of OpenMP threads the core would use by default (1 without OpenMP). */
int rp_omp_max_threads(void);

/* CPU features that pick the core's loops at run time, each probed once per
 * process: whether torch's CPU kernels fuse multiply-adds here (the fused
 * optimizers round as they do), and AVX2 with F16C (FAD's mixed 16-bit
 * backward). A probe's REPROP_TEST_* variable forces "no" (common.c). */
enum { RP_CPU_FUSED_MADD, RP_CPU_F16C, RP_CPU_NPROBES };
int rp_cpu_has(int probe);

/* The threads a parallel region of the core runs on: num_threads, or
 * OpenMP's default where num_threads <= 0; always 1 in a process forked from
 * the one that loaded the core (GNU libgomp's pool does not survive fork:
 * see common.c). */
int rp_omp_threads(int num_threads);

/* CUDA update of n entries of one dtype on `stream` (a cudaStream_t), as few
 * launches as the kernel-argument tables allow. When `capturable` is 0,
 * `scalars` holds the per-entry host-computed values (see
 * rp_optim_advance_steps) and entry.step is host memory, which the kernels do
 * not read (the caller advances it, and undoes that if the update fails); when 1,
 * `scalars` is NULL, entry.step is device memory incremented on the stream,
 * and hp->lr_ptr may point to a device lr.
 * Defined in kernels/optim.cu; returns RP_ERUNTIME with the CUDA error text. */
int rp_cuda_optim_step(const rp_optim_hparams *hp, int dtype, const rp_optim_entry *entries,
                       const rp_step_scalars *scalars, int64_t n, int capturable,
                       void *stream, rp_error *err);

/* ---------------------------------------------------------------------------
 * Nested forward-AD activations (csrc/fad.c, kernels/fad.cu)
 *
 * One pass over x computes y = f(x) and d = f'(x); backward is then
 * grad_x = grad_y * d, so only d is saved for backward. Arithmetic is float32
 * whatever the input dtype (x: RP_F32/F16/BF16, y in x's dtype).
 * ------------------------------------------------------------------------- */

typedef enum {
    RP_FAD_GELU = 0,       /* erf form */
    RP_FAD_GELU_TANH = 1,  /* approximate="tanh" */
    RP_FAD_SILU = 2,
    RP_FAD_MISH = 3,
    RP_FAD_SOFTPLUS = 4,   /* p0 = beta, p1 = threshold */
    RP_FAD_SIGMOID = 5,
    RP_FAD_TANH = 6,
    RP_FAD_ELU = 7,        /* p0 = alpha */
    RP_FAD_CELU = 8,       /* p0 = alpha (nonzero) */
    RP_FAD_SELU = 9,
    RP_FAD_LEAKY_RELU = 10, /* p0 = negative_slope */
    RP_FAD_HARDSWISH = 11,
    RP_FAD_HARDSIGMOID = 12,
    RP_FAD_LOGSIGMOID = 13,
    RP_FAD_SOFTSIGN = 14,
    RP_FAD_TANHSHRINK = 15,
    RP_FAD_KINDS = 16,
} rp_fad_kind;

/* How d is stored: an rp_dtype code (RP_F32, RP_F16, RP_BF16, rounded to
 * nearest even from float32), RP_FAD_CODE8 (one uint8 code per element, see
 * rp_fad_codebook), or RP_FAD_NONE (d is not computed: inference, no_grad). */
#define RP_FAD_CODE8 3
#define RP_FAD_NONE (-1)

/* The 8-bit codebook of one activation and its parameters: a lookup
 * quantization of f'(x). Codes 0..RP_FAD_CODE_GRID-1 are a uniform grid
 * value[c] = (c - zero_code) * step covering f's derivative range, with 0
 * exactly on the grid (so saturated regions give exactly zero gradient);
 * code RP_FAD_CODE_EXACT stands for the activation's exact constant slope
 * where it has one (x > 0 for ELU/CELU/SELU/LeakyReLU, x >= 3 for Hardswish,
 * the linear region of Softplus past its threshold); RP_FAD_CODE_NAN for a
 * NaN derivative. Encoding rounds to the nearest grid value, so the error of
 * a decoded derivative is at most step / 2 (exactly 0 on constant pieces). */
#define RP_FAD_CODE_GRID 254
#define RP_FAD_CODE_EXACT 254
#define RP_FAD_CODE_NAN 255

typedef struct {
    float value[256]; /* decoded derivative of each code */
    float inv_step;   /* encode: c = zero_code + rint(d * inv_step), clamped to the grid */
    int zero_code;
    float lo, hi;     /* the derivative range the grid covers */
} rp_fad_codebook;

/* Fills cb for kind with parameters p0, p1 (see rp_fad_kind). */
int rp_fad_codebook_init(int kind, float p0, float p1, rp_fad_codebook *cb, rp_error *err);

/* Validates kind, dtypes and parameters (e.g. CELU alpha != 0). */
int rp_fad_check(int kind, float p0, float p1, int dtype, int d_store, rp_error *err);

/* CPU forward: x and y are n elements of `dtype` (y may equal x: in place),
 * d is n elements stored as d_store (NULL with RP_FAD_NONE). Vectorized with
 * AVX2/AVX-512 chosen at run time, OpenMP over chunks for large n.
 * num_threads <= 0 means OpenMP's default. */
int rp_fad_forward_cpu(int kind, float p0, float p1, int dtype, const void *x, void *y,
                       int d_store, void *d, int64_t n, int num_threads, rp_error *err);

/* CPU backward from 8-bit codes: grad_x[i] = grad_y[i] * cb->value[codes[i]],
 * grad_y and grad_x of `dtype` (float32 arithmetic, one rounding). */
int rp_fad_backward_code8_cpu(int dtype, const void *grad_y, const uint8_t *codes,
                              const rp_fad_codebook *cb, void *grad_x, int64_t n,
                              int num_threads, rp_error *err);

/* The same on CUDA, enqueued on `stream` (a cudaStream_t), never
 * synchronizing; the kernels are compiled from the same per-element math
 * (csrc/fad_math.h), so results equal the CPU's bit for bit. */
int rp_cuda_fad_forward(int kind, float p0, float p1, int dtype, const void *x, void *y,
                        int d_store, void *d, int64_t n, void *stream, rp_error *err);
int rp_cuda_fad_backward_code8(int dtype, const void *grad_y, const uint8_t *codes,
                               const rp_fad_codebook *cb, void *grad_x, int64_t n,
                               void *stream, rp_error *err);

/* CPU backward from a 16-bit d of the other 16-bit dtype: grad_x[i] =
 * grad_y[i] * d[i], grad_y and grad_x of `dtype` (RP_BF16 with a float16 d,
 * RP_F16 with a bfloat16 d), the exact float32 product rounded once as
 * torch's promoted multiply and cast round it, NaN as torch's CPU cast. */
int rp_fad_backward_mixed16_cpu(int dtype, const void *grad_y, const void *d, void *grad_x,
                                int64_t n, int num_threads, rp_error *err);

/* ---------------------------------------------------------------------------
 * BPPSA: backprop as a parallel scan (csrc/scan.c, kernels/scan.cu)
 *
 * The recurrence of backprop through a chain, for B independent sequences of
 * n steps of H-vectors (h_t = f(h_{t-1}, x_t), J[t] = dh_t/dh_{t-1}):
 *
 *     g[n-1] = c[n-1],     g[t] = c[t] + J[t+1]^T g[t+1]     (t = n-2 .. 0)
 *
 * c[t] is the gradient reaching h_t from outside the recurrence (the output
 * at step t), g[t] the total gradient of h_t. This is the exclusive scan of
 * the paper's Eq. 4-5 with A <> B = BA over n + 1 slots
 *
 *     a[0] = c[n-1],   a[k] = (J[n-k]^T, c[n-1-k])  (k = 1 .. n-1),   a[n] spare
 *
 * where (M, c) is the affine map x -> M x + c (c[t] = 0 but for the last step
 * gives the paper's pure matrix scan). Slot k of the result is g[n-k].
 *
 * The modified Blelloch scan runs `levels` up-sweep levels, a linear scan
 * over the 2^levels-slot blocks that remain, and the down-sweep of those
 * levels with reversed operands: levels = 0 is the plain linear scan,
 * rp_scan_max_levels(n) the full Blelloch scan, anything between the hybrid
 * of the paper's Section 5.3. Every level is parallel over its pairs and the
 * batch; down-sweep and linear-scan steps are matrix-vector products.
 * Arithmetic is float32, in a fixed order for a given `levels`.
 *
 * Shapes (row-major, contiguous):
 *   c, g  (n, B, H)              g may alias c (in place)
 *   dense leaves:       jt (n, B, H, H), jt[t] = J[t]^T
 *   structured leaves:  J[t]^T = diag(u[t]) + sum_k W_k^T diag(v[t][kH:(k+1)H])
 *       w (G*H, H) shared by every step and sequence (torch's weight_hh_l*,
 *       W_k its rows kH..(k+1)H-1), u (n, B, H) or NULL for zero,
 *       v (n, B, G*H). The RNN is G = 1, u = NULL, v = f'(pre-activation);
 *       the GRU G = 3 (see python/reprop/bppsa.py). Never copied per step.
 *       Instead of v, an activation `act` and y (n, B, G*H), the layer's
 *       output: v = f'(y) computed where v is read, 1 - y*y (y*y rounded
 *       first, never fused) for tanh, the same float32 bits as that
 *       expression evaluated into a v beforehand, with no (n, B, G*H) buffer
 *       for them. relu is applied as torch's threshold_backward applies it,
 *       a select: v x is 0 where y <= 0 (even for an inf or NaN x, where a
 *       product would give NaN) and x elsewhere (a NaN y included); for
 *       finite x the values of (y > 0 ? 1 : 0) * x, zeros always +0.
 *   pre_activation (G = 1 only): the result is d[t] = v[t] * g[t] (the
 *       gradient of the pre-activation when v = f'), written where g would
 *       be, in place of g; the same bits as multiplying g by v afterwards
 *       (relu: the select).
 *       g may alias c as before; it never overlaps w, u, v, y or jt.
 * Entry t = 0 of the leaves is never read (but for v[0] by pre_activation).
 * ------------------------------------------------------------------------- */

/* How the structured leaves' v is given. */
typedef enum {
    RP_SCAN_ACT_NONE = 0, /* v itself */
    RP_SCAN_ACT_TANH = 1, /* v = 1 - y*y */
    RP_SCAN_ACT_RELU = 2  /* v x = (y <= 0 ? 0 : x), torch's threshold_backward */
} rp_scan_act;

typedef struct {
    int64_t n, batch, dim; /* n steps, B sequences, H */
    int gates;             /* G >= 1: structured leaves; 0: dense leaves */
    const float *w;        /* structured: (G*H, H) */
    const float *u;        /* structured: (n, B, H) or NULL */
    const float *v;        /* structured: (n, B, G*H); NULL when act is set */
    const float *jt;       /* dense: (n, B, H, H) */
    int act;               /* rp_scan_act; structured leaves only */
    const float *y;        /* act set: (n, B, G*H), v = f'(y); else NULL */
    int pre_activation;    /* G = 1: write v[t] * g[t] instead of g[t] */
} rp_scan_jacobians;

/* What the cost model knows of a device: how many independent H x H
 * products it runs at once, and the fixed costs, in multiply-adds, of one
 * up- or down-sweep level (a launch, a barrier) and of one step of the
 * linear scan (a dependent step: a barrier, a trip to memory). */
typedef struct {
    double workers;
    double level_cost;
    double step_cost;
} rp_scan_machine;

/* The largest useful `levels` for n steps: ceil(log2(n + 1)) - 1, at most 62
 * (n = INT64_MAX); 0 for n < 1. */
int rp_scan_max_levels(int64_t n);

/* Validates the sizes of a scan: n >= 1, batch >= 0, dim >= 1, gates >= 0,
 * levels in [0, rp_scan_max_levels(n)], and a workspace whose size in bytes
 * fits in int64 (see rp_scan_workspace_floats). */
int rp_scan_check_sizes(int64_t n, int64_t batch, int64_t dim, int gates, int levels,
                        rp_error *err);

/* The `levels` in [0, rp_scan_max_levels(n)] the cost model predicts fastest;
 * 0 for sizes rp_scan_check_sizes rejects or a NULL m. */
int rp_scan_choose_levels(int64_t n, int64_t batch, int64_t dim, int gates,
                          const rp_scan_machine *m);

/* Predicted time of `levels` in multiply-adds on machine m (for reports),
 * in *cost; RP_EINVAL for sizes rp_scan_check_sizes rejects. */
int rp_scan_cost(int64_t n, int64_t batch, int64_t dim, int gates, int levels,
                 const rp_scan_machine *m, double *cost, rp_error *err);

/* Float32 workspace a scan with `levels` needs: none for the linear scan
 * (levels = 0 runs from c into g directly; work may then be NULL), else
 * (n + 1) B H for the slots' vectors and (floor(n / 2) - 1) B H H for the
 * up-sweep products (none for n < 2); -1 when a size is negative or the workspace's bytes
 * would pass INT64_MAX. */
int64_t rp_scan_workspace_floats(int64_t n, int64_t batch, int64_t dim, int levels);

/* Validates shapes, pointers and levels. */
int rp_scan_check(const rp_scan_jacobians *j, const float *c, const float *g, int levels,
                  const float *work, rp_error *err);

/* CPU scan: OpenMP over the pairs of a level and the batch. With levels > 0,
 * a result that is not finite is recomputed by the linear scan (levels 0):
 * the up-sweep's products over 2^d steps can overflow where the linear
 * scan's vectors do not (a chaotic recurrence whose later steps get no
 * gradient), and inf * 0 gave NaN. */
int rp_scan_cpu(const rp_scan_jacobians *j, const float *c, float *g, int levels, float *work,
                int num_threads, rp_error *err);

/* CUDA scan on `stream`: one launch per level plus one for the linear part,
 * never synchronizing; every pointer is device memory. With levels > 0 a
 * result that is not finite is redone by the linear scan, as rp_scan_cpu
 * does, decided on the device: work then holds one float more than
 * rp_scan_workspace_floats (a flag), one more launch redoes the scan from c
 * where the flag is set (2 levels + 2 launches in all, after a memset of
 * the flag), and g must not be c (RP_EINVAL: the redo reads c). */
int rp_cuda_scan(const rp_scan_jacobians *j, const float *c, float *g, int levels, float *work,
                 void *stream, rp_error *err);

/* Shared memory (bytes) one block of rp_cuda_scan needs at the least for
 * hidden size dim: the linear scan's vectors, and with levels > 0 one task
 * of the up- and of the down-sweep (the same for any number of levels);
 * SIZE_MAX past any device. A scan needing more than the device's
 * rp_cuda_shared_memory_per_block (the opt-in maximum, at least the default
 * 48 KB) is refused. */
size_t rp_cuda_scan_shared_bytes(int64_t dim, int levels);
int rp_cuda_shared_memory_per_block(int device, size_t *bytes, rp_error *err);

/* ---------------------------------------------------------------------------
 * Sparse BPPSA over a chain of layers (csrc/scan.c, csrc/jacobian.c)
 *
 * Layers i = 0 .. n-1 with transposed Jacobians J_i^T (in_i x out_i, CSR,
 * out_i = in_{i+1}); from the gradient of the chain's output g_n the scan
 * gives every g_i = J_i^T g_{i+1}, the gradient of layer i's input. Slots as
 * above: a[0] = g_n, a[k] = J_{n-k}^T. The sparsity pattern of each J_i^T is
 * fixed by the architecture, so a plan computes once, ahead of training, the
 * patterns of every up-sweep product and for each of their non-zeros the
 * list of (A, B) non-zero pairs that sum into it; a step then only refreshes
 * values: products are pair-list sums, down-sweep steps CSR mat-vecs.
 *
 * A leaf marked `shared` has the same values for every sequence (a Conv2d's
 * or Linear's weights): stored once, and a product of two shared operands is
 * computed once for the batch.
 * ------------------------------------------------------------------------- */

typedef struct {
    int64_t rows, cols, nnz;
    const int32_t *indptr;    /* rows + 1 */
    const int32_t *indices;   /* nnz column indices, ascending within each row */
    int shared;               /* values the same for every sequence */
    const int32_t *value_map; /* NULL: the caller gives the nnz values; else it
                               * gives `values` raw floats (a layer's weights)
                               * and value q is raw[value_map[q]], never gathered */
    int64_t values;
} rp_csr_pattern;

typedef struct rp_csr_plan rp_csr_plan;

/* Plans the scan of n leaves (leaves[i] = pattern of J_i^T, copied, then
 * checked: the caller may write its arrays meanwhile). levels < 0 lets the
 * cost model choose from the exact product sizes; products
 * whose pair lists would pass max_pairs (0: no cap) are not planned, which
 * caps the levels. *out is freed with rp_csr_plan_free. */
int rp_csr_plan_create(int64_t n, const rp_csr_pattern *leaves, int levels, int64_t max_pairs,
                       const rp_scan_machine *m, rp_csr_plan **out, rp_error *err);
void rp_csr_plan_free(rp_csr_plan *p);

/* The plan's scan compiled to a program that the CPU (rp_csr_run_cpu) and
 * the GPU (rp_cuda_csr_run) run alike. Two float32 buffers hold all a step
 * reads and writes:
 *   seq    (seq_floats x B, batch-minor: per-sequence offset o of sequence b
 *          at o * B + b): the values of the per-sequence leaves, one vector
 *          per slot (g_n goes in, every g_i comes out there) and the values
 *          of per-sequence products;
 *   shared (shared_floats): shared[0] = 1 (the caller's job: copies are
 *          products with it), the values of the shared leaves and of the
 *          products of two shared operands.
 * An address is a uint32: RP_CSR_SHARED set for the shared buffer, else seq;
 * the other bits the offset. Phase p is rows [phase_ptr[p], phase_ptr[p+1]);
 * those from phase_shared[p] on write to shared and read only shared, once
 * for the batch; the others write seq, once per sequence. Row r writes
 *     dst[r] = sum over t in [term_ptr[r], term_ptr[r+1]) of X(tx[t]) * X(ty[t])
 * in increasing t, a float32 multiply then a float32 add (never fused), so
 * every runner gives the same bits. Every term of a row reads the same pair
 * of buffers (the CPU runner picks its loop by the first term). Phases run
 * in order; the rows of a phase write distinct addresses, none of which
 * another row of the phase reads. */
#define RP_CSR_SHARED 0x80000000u

typedef struct {
    int64_t layers, nphases, nrows, nterms;
    const int64_t *phase_ptr;    /* nphases + 1 */
    const int64_t *phase_shared; /* nphases */
    const uint32_t *dst;         /* nrows */
    const int64_t *term_ptr;     /* nrows + 1 */
    const uint32_t *tx, *ty;     /* nterms */
    int64_t seq_floats, shared_floats;
    const uint32_t *leaf_addr;   /* n: where layer i's values (or raw values) go */
    const uint32_t *g_addr;      /* n: where g_i (in_i floats) comes out, in seq */
    uint32_t g_out_addr;         /* where g_n (out_{n-1} floats) goes, in seq */
} rp_csr_program;

const rp_csr_program *rp_csr_plan_program(const rp_csr_plan *p);

/* Facts about a plan: the levels, the cost model's figure for them (for one
 * sequence on the plan's machine), the buffers per sequence and shared, the
 * multiply-adds of one scan of one sequence (products, mat-vecs), those of
 * the same on the plain linear scan, the planned products run and their
 * pairs, and the program's size. */
typedef struct {
    int levels;
    double cost;
    int64_t seq_floats, shared_floats;
    int64_t madds;
    int64_t linear_madds;
    int64_t products;
    int64_t pairs;
    int64_t phases, rows, terms;
} rp_csr_plan_info;

void rp_csr_plan_describe(const rp_csr_plan *p, rp_csr_plan_info *info);

/* The plan's schedule over whole matrices and vectors, as the cuSPARSE
 * peer's step table (rp_cuda_cusparse_create's op_rows): the steps the
 * program's rows come from, in their order (one traversal makes both).
 * Matrix k - 1 is slot k's leaf, the pattern of layer n - k; products n, n +
 * 1, ... follow in the plan's order. Vector s <= n + 1 is slot s's (g_n goes
 * in vector 0, g_i comes out of vector n - i + 1), n + 2 and n + 3 are two
 * spares, each `width` floats. C-order int64 tables:
 *   steps    (nsteps x RP_CSR_STEP_COLS): kind, m, x, y, len:
 *            (RP_CSR_GEMM, c, -1, -1, 0) computes product c,
 *            (RP_CSR_MV, m, x, y, 0) is vector y = matrix m times vector x,
 *            (RP_CSR_COPY, -1, x, y, len) copies len floats of vector x to y;
 *   products (nproducts x RP_CSR_PRODUCT_COLS): a, b, rows, cols, shared of
 *            product n + j = matrix a times matrix b, shared when both are.
 * Freed with rp_csr_schedule_free. */
enum { RP_CSR_GEMM = 0, RP_CSR_MV = 1, RP_CSR_COPY = 2 }; /* also the cuSPARSE peer's (kernels/scan.cu) */
#define RP_CSR_STEP_COLS 5
#define RP_CSR_PRODUCT_COLS 5

typedef struct {
    int64_t nsteps, nproducts, nvectors, width;
    int64_t *steps, *products;
} rp_csr_schedule;

int rp_csr_plan_schedule(const rp_csr_plan *p, rp_csr_schedule *out, rp_error *err);
void rp_csr_schedule_free(rp_csr_schedule *s);

/* Runs the program for B sequences on the CPU: OpenMP over the rows of a
 * phase, each row over the batch. */
int rp_csr_run_cpu(const rp_csr_program *g, int64_t batch, float *seq, float *shared,
                   int num_threads, rp_error *err);

/* Copies the gradients g_0 .. g_{n-1} out of a CPU run's seq buffer into
 * out[i] (float32, batch-major: sequence b's rows_i floats at b * rows_i,
 * rows_i layer i's inputs) and sets *finite to whether all are finite. */
int rp_csr_gradients_cpu(const rp_csr_plan *p, int64_t batch, const float *seq, float *const *out,
                         int num_threads, int *finite, rp_error *err);

/* The program's row arrays in device memory (copies of dst, term_ptr, tx, ty). */
typedef struct {
    const uint32_t *dst;
    const int64_t *term_ptr;
    const uint32_t *tx, *ty;
} rp_csr_device_rows;

/* Runs the program on `stream`: one launch per phase, never synchronizing.
 * g's phase arrays are host memory; rows, seq and shared device memory. */
int rp_cuda_csr_run(const rp_csr_program *g, const rp_csr_device_rows *rows, int64_t batch,
                    float *seq, float *shared, void *stream, rp_error *err);

/* The cuSPARSE peer of the program (kernels/scan.cu, built with
 * RP_HAVE_CUSPARSE; without it, stubs that say so): the same schedule over
 * whole CSR matrices, products by cusparseSpGEMMreuse (work estimation, nnz
 * and copy once, at create; only _compute per run), mat-vecs by
 * cusparseSpMM. Tables are C-contiguous int64 rows: matrices (rows, cols,
 * nnz, a, b, shared, indptr, indices, values, stride), steps (kind, m, x, y,
 * len: rp_csr_plan_schedule's, RP_CSR_STEP_COLS); device pointers as
 * integers. libcusparse.so.12 is dlopen'ed at the first create (by soname,
 * else the path `library`), never linked. */
#define RP_CUSPARSE_MAT_COLS 10
typedef struct rp_cusparse_chain rp_cusparse_chain;
int rp_cuda_cusparse_built(void);
int rp_cuda_cusparse_create(const char *library, int64_t nmats, const int64_t *mat_rows, int64_t nops,
                            const int64_t *op_rows, float *vectors, int64_t batch, int64_t nvectors,
                            int64_t stride, void *stream, rp_cusparse_chain **out, rp_error *err);
int rp_cuda_cusparse_run(rp_cusparse_chain *c, void *stream, rp_error *err);
void rp_cuda_cusparse_free(rp_cusparse_chain *c);

/* ---------------------------------------------------------------------------
 * Analytic CSR transposed Jacobians (csrc/jacobian.c)
 *
 * J^T of a layer as CSR with rows = input elements and columns = output
 * elements (flattened C x H x W per sample, batch excluded), patterns fixed
 * by the geometry. Values are gathered per step by the Python layer through
 * the returned maps, so no routine here reads activations:
 *   conv2d:    value[k] = weight.flatten()[wmap[k]]
 *   linear:    value[k] = weight.flatten()[wmap[k]]        (weight (out, in))
 *   maxpool2d: value[b, k] = (indices[b].flatten()[omap[k]] == pmap[k]), the
 *              pattern is every (input, window) pair, so it never changes
 *   diagonal:  value[b, k] = f'(x[b, k])  (ReLU and element-wise activations)
 * Each routine is called twice: with NULL arrays to get *nnz, then with
 * arrays of rows + 1 and nnz int32 elements.
 * ------------------------------------------------------------------------- */

typedef struct {
    int64_t c_in, h_in, w_in;
    int64_t c_out, h_out, w_out;
    int64_t kh, kw, sh, sw, ph, pw, dh, dw;
    int64_t groups; /* conv2d only */
} rp_conv2d_geom;

int rp_jac_conv2d(const rp_conv2d_geom *g, int64_t *nnz, int32_t *indptr, int32_t *indices,
                  int32_t *wmap, rp_error *err);
int rp_jac_maxpool2d(const rp_conv2d_geom *g, int64_t *nnz, int32_t *indptr, int32_t *indices,
                     int32_t *omap, int32_t *pmap, rp_error *err);
int rp_jac_linear(int64_t in_features, int64_t out_features, int64_t *nnz, int32_t *indptr,
                  int32_t *indices, int32_t *wmap, rp_error *err);
int rp_jac_diagonal(int64_t size, int64_t *nnz, int32_t *indptr, int32_t *indices,
                    rp_error *err);

/* ---------------------------------------------------------------------------
 * Out-of-order backprop scheduling (csrc/schedule.c)
 *
 * One training iteration as a task graph over layers l = 0 .. L-1 (layer 0
 * nearest the input) and micro-batches m = 0 .. M-1:
 *   F(l, m)  forward;          needs F(l-1, m) and, from the second
 *                              iteration on, layer l's update (S(l), or
 *                              every dW(l, .) of the previous iteration)
 *   dO(l, m) output gradient:  the gradient of layer l's input; needs
 *                              dO(l+1, m) (for l = L-1: F(L-1, m), the loss)
 *   dW(l, m) weight gradient:  needs what dO(l, m) needs, and nothing needs it
 *                              but the update: the freedom ooo backprop uses
 *   S(l)     all-reduce of layer l's weight gradient (data parallelism)
 * dO(0, .) exists only when the input needs a gradient. Tasks run on
 * resources: a device's main stream, its sub-stream, its network link. The
 * simulator below plays any such graph; the builders, Algorithm 1 (multi-
 * region joint scheduling), Algorithm 2 (reverse first-k), the search for k
 * and the layer allocation are the paper's (Oh et al., EuroSys '22).
 * ------------------------------------------------------------------------- */

typedef enum {
    RP_TASK_FORWARD = 0,
    RP_TASK_OUTPUT_GRAD = 1,
    RP_TASK_WEIGHT_GRAD = 2,
    RP_TASK_SYNC = 3,
} rp_task_kind;

/* How a resource picks its next task when it is free. */
typedef enum {
    RP_RES_IN_ORDER = 0, /* a fixed program: tasks strictly by ascending priority */
    RP_RES_PRIORITY = 1, /* list scheduling: the ready task of lowest priority */
    RP_RES_FIFO = 2,     /* the task that became ready first (ties: lowest priority) */
} rp_res_policy;

/* A task graph: per task its kind, layer, micro-batch, iteration, resource,
 * cost (time alone on its resource) and priority (lower first); the
 * predecessors of task t are dep_idx[dep_ptr[t] .. dep_ptr[t+1]) with the
 * delay each adds after its finish (a transfer between devices); per
 * resource its policy and co-run group (resources of one group share a
 * device: while k > 1 of them run, each advances at corun_rate, see
 * rp_simulate; -1 for none). Arrays are the caller's. */
typedef struct {
    int64_t n_tasks, n_deps, n_resources;
    int32_t *kind, *layer, *micro, *iteration, *resource; /* (n_tasks) */
    double *cost, *priority;                               /* (n_tasks) */
    int64_t *dep_ptr;                                      /* (n_tasks + 1) */
    int64_t *dep_idx;                                      /* (n_deps) */
    double *dep_delay;                                     /* (n_deps) */
    int32_t *policy, *group;                               /* (n_resources) */
} rp_task_graph;

/* Plays the graph as a discrete-event simulation: a task starts when its
 * resource is free and chooses it, and every predecessor has finished (plus
 * its delay). Tasks of one co-run group that overlap advance at corun_rate
 * each (1: no slowdown, 0.5: the device is shared fairly). Writes start and
 * finish (n_tasks), busy (n_resources: time running a task) and *makespan.
 * RP_EINVAL for a malformed graph, one that deadlocks (a cycle, or an
 * in-order program waiting on a task ordered after it), or one whose times
 * overflow a double (finite costs that sum past it, or a tiny corun_rate);
 * start and finish of the tasks that never ran are then NaN. kind, layer,
 * micro and iteration only label messages here and may be NULL. */
int rp_simulate(const rp_task_graph *g, double corun_rate, double *start, double *finish,
                double *busy, double *makespan, rp_error *err);

typedef enum {
    RP_ORDER_CONVENTIONAL = 0,    /* autograd's: dW(l) then dO(l), layer by layer; forwards first */
    RP_ORDER_FAST_FORWARD = 1,    /* gradient fast-forwarding: any ready dO before any dW */
    RP_ORDER_REVERSE_FIRST_K = 2, /* Algorithm 2: dW(0) .. dW(k-1) after the last dO, first to last */
} rp_order;

/* A layered training iteration, every time in one unit (seconds, or 1 for
 * the paper's unit-time figures). */
typedef struct {
    int64_t layers, micro, stages, iterations;
    const double *fwd, *out_grad, *weight_grad; /* (layers) per micro-batch */
    const double *sync;    /* (layers) all-reduce time of dW(l); NULL: no data parallelism */
    const int32_t *stage;  /* (layers) device of layer l; NULL: all on device 0 */
    double transfer;       /* delay of an activation or gradient between two devices */
    int order;             /* rp_order */
    int64_t k;             /* RP_ORDER_REVERSE_FIRST_K: layers whose dW is reversed */
    int sync_by_layer;     /* the link sends S(l) lowest layer first; 0: first come first served */
    int sub_stream;        /* dW on a second stream of its device (co-run group of the device) */
    int input_grad;        /* dO(0, .) is computed */
} rp_iter_spec;

/* Sizes of the graph of `iterations` iterations (count, then build into
 * arrays of these sizes). Resources: devices [0, S), then sub-streams
 * [S, 2S) (they run the dW tasks) when sub_stream, then links (one per
 * device) when sync. Main streams and sub-streams are in order except under
 * FAST_FORWARD (priority); links are FIFO unless sync_by_layer (priority). */
int rp_iter_graph_size(const rp_iter_spec *s, int64_t *n_tasks, int64_t *n_deps,
                       int64_t *n_resources, rp_error *err);
int rp_iter_graph_build(const rp_iter_spec *s, rp_task_graph *g, rp_error *err);

/* Layer allocation over `stages` devices: group 0 gives contiguous blocks
 * (balanced by count, the conventional allocation); group g >= 1 the modulo
 * allocation of groups of g consecutive layers: layer l on (l / g) mod stages. */
int rp_sched_stages(int64_t layers, int64_t stages, int64_t group, int32_t *stage, rp_error *err);

/* Algorithm 2, reverse first-k, with its memory cap (line 1): the largest
 * k' <= min(k, layers) with mem_forward - sum_{i >= k'} mem_out_grad[i] +
 * sum_{i < k'} mem_weight_grad[i] < mem_cap (mem_cap <= 0: no cap; 0 when no
 * k' fits) becomes *k_used; then order (2L entries of kind and layer) is
 * dW(l), dO(l) for l = L-1 .. k_used, dO(l) for l = k_used-1 .. 0, then
 * dW(0) .. dW(k_used-1). Arrays of sizes may be NULL when there is no cap. */
int rp_sched_reverse_first_k(int64_t layers, int64_t k, const int64_t *mem_out_grad,
                             const int64_t *mem_weight_grad, int64_t mem_forward,
                             int64_t mem_cap, int32_t *kind, int32_t *layer, int64_t *k_used,
                             rp_error *err);

/* The coarse-to-fine search for k (Section 5.1), stateless: score[k] for k
 * in [0, layers] is the measured throughput or NaN where not measured yet.
 * Returns in *next the k to measure next, or -1 when the search is over;
 * *best is the best k measured so far (-1 before any). Steps of L/10
 * over [0, L] (L itself included), then steps halved (rounded up) around
 * the best until a step of 1: for a concave score, its maximum, measuring
 * each k at most once. */
int rp_ksearch_next(int64_t layers, const double *score, int64_t *next, int64_t *best,
                    rp_error *err);

/* Storages several tasks of rp_sched_regions read (one input of q/k/v
 * projections, output gradients that are views of one cat's gradient),
 * each held once however many of its readers are deferred. A storage is
 * held at a region end where every reader is ready before that end (the
 * main stream has run their nodes, which held it until then anyway) and
 * some reader runs in a later region: the union of what the deferred
 * readers hold. Charged a share per reader in mem instead, a deferral of
 * only some readers counted part of it, and the cap could pass. */
typedef struct {
    int64_t n;            /* storages */
    const int64_t *size;  /* (n) bytes of storage s */
    const int64_t *start; /* (n + 1) its readers are task[start[s]] .. task[start[s + 1] - 1] */
    const int64_t *task;  /* (start[n]) task indices in [0, n_tasks) */
} rp_shared_reads;

/* Algorithm 1, multi-region joint scheduling of sub-stream tasks, with the
 * memory model of pre-scheduling. The main stream's timeline is cut into n
 * regions of times t_main (n); task j (a deferred dW) becomes runnable at
 * ready[j] on that timeline, must be placed in a region before
 * deadline[j] (the region of the forward that uses its weights; n: none),
 * takes t_sub[j * n + i] when it runs in region i and speeds region i up
 * by speedup[j * n + i] (co-run profile). It holds mem[j] bytes from ready
 * until it runs (NULL: no memory model). Regions [0, pre) are pre-scheduled:
 * their tasks run as soon as ready, in their own region; pre grows from 0
 * until the held memory at the end of every region i is <= mem_cap[i] (n
 * caps, each >= 0; NULL: no cap; one cap for all: n equal ones), or up to n
 * (a region end may then still pass its cap). Tasks that no open region can
 * take go to region deadline[j] - 1. Writes region[j], order (tasks by
 * region, then as placed), held[i] the bytes held at the end of region i
 * (n; NULL: not written), *pre and *peak, the largest held[i] (0 without
 * mem). shared (NULL: none; only with mem) adds the storages several tasks
 * read, held as rp_shared_reads says, to the held memory. */
int rp_sched_regions(int64_t n, const double *t_main, int64_t n_tasks, const double *ready,
                     const int64_t *deadline, const double *t_sub, const double *speedup,
                     const int64_t *mem, const rp_shared_reads *shared, const int64_t *mem_cap,
                     int64_t *region, int64_t *order, int64_t *held, int64_t *pre, int64_t *peak,
                     rp_error *err);

/* CUDA device count (0 when there is no driver or device), and the
 * architectures the kernels were compiled for, e.g. "sm_80 sm_90 compute_90". */
int rp_cuda_device_count(void);
const char *rp_cuda_archs(void);

#ifdef __cplusplus
}
#endif

#endif /* REPROP_H */
