/*
 * scan.c: BPPSA on the CPU, backprop as the paper's modified Blelloch scan.
 *
 * One schedule serves every kind of Jacobian. Over slots a[0..N-1] (a[0] the
 * incoming gradient, a vector; a[k] a map) plus a spare slot a[N], with L
 * up-sweep levels:
 *
 *   up-sweep   level d < L:  a[r] = a[l] <> a[r]       (l = i + 2^d - 1,
 *                                                       r = i + 2^(d+1) - 1 < N)
 *   middle     linear exclusive scan over the blocks of 2^L slots, whose
 *              ends e_j = min((j+1) 2^L - 1, N) receive the prefix P_j
 *   down-sweep level d = L-1 .. 0:  (a[l], a[r]) = (a[r], a[r] <> a[l])
 *                                                      (r clamped to N)
 *
 * after which slot s holds the exclusive prefix a[0] <> ... <> a[s-1]. L = 0
 * is the plain linear scan, L = rp_scan_max_levels the full Blelloch scan.
 * The spare slot stands for every position past the end, which is why the
 * down-sweep clamps r to N and the up-sweep skips pairs with r >= N (their
 * value would only feed the discarded total). Values on the left spine
 * (ranges starting at slot 0) are vectors: up-sweep results there are
 * matrix-vector products, and every down-sweep and middle step is one; the
 * only matrix-matrix products are the up-sweep's off the spine.
 *
 * The dense/structured recurrence runs the schedule through rp_scan_run,
 * which calls back per (slot pair, sequence); OpenMP runs the pairs of a
 * level and the sequences in parallel, the middle per sequence. The sparse
 * chain compiles the same schedule into a program of rows (rp_csr_compile)
 * that the CPU and the GPU run alike.
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "reprop.h"
#include "rp_internal.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* ---------------------------------------------------------------------------
 * The schedule
 * ------------------------------------------------------------------------- */

typedef struct {
    int64_t nslots; /* N */
    int64_t batch;
    int levels;
    int64_t work_floats; /* per-thread scratch of the callbacks */
    int64_t max_vec;     /* longest vector of any slot */
    void *ctx;
    /* a[r] = a[l] <> a[r] at level log2(r - l); spine: a[l] is a vector */
    void (*combine)(void *ctx, int64_t l, int64_t r, int spine, int64_t b, float *work);
    /* out = (final up-sweep value of slot s, a map) applied to the vector `in` */
    void (*apply)(void *ctx, int64_t s, int64_t b, const float *in, float *out, float *work);
    /* the vector of slot s: its up-sweep vector or c part, later its prefix */
    float *(*vec)(void *ctx, int64_t s, int64_t b);
    /* length of the exclusive prefix at slot s: the input size of a[s]'s map
     * (vectors of every slot have room for the longest) */
    int64_t (*prefix_len)(void *ctx, int64_t s);
} rp_scan_sched;

int rp_scan_max_levels(int64_t n)
{
    /* ceil(log2(n + 1)) - 1 is floor(log2(n)) for n >= 1, counted by shifting
     * n down: never forms 2^k or n + 1, which overflow for n near INT64_MAX */
    int k = 0;
    while (n > 1)
        n >>= 1, k++;
    return k;
}

static int64_t rp_min64(int64_t a, int64_t b) { return a < b ? a : b; }

static void rp_copy(float *restrict dst, const float *restrict src, int64_t len)
{
    if (dst != src)
        memcpy(dst, src, (size_t)len * sizeof *dst);
}

static int rp_threads(int num_threads)
{
    return rp_omp_threads(num_threads);
}

static int64_t rp_thread_num(void)
{
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* Per-thread scratch: the callbacks' work area, then three vectors. */
static int64_t rp_sched_scratch(const rp_scan_sched *s) { return s->work_floats + 3 * s->max_vec; }

static float *rp_thread_scratch(const rp_scan_sched *s, float *scratch)
{
    return scratch + rp_thread_num() * rp_sched_scratch(s);
}

/* Pairs of level d: l = p 2^(d+1) + 2^d - 1, r = l + 2^d, those with r < N. */
static void rp_up_level(const rp_scan_sched *s, int d, float *scratch, int threads)
{
    const int64_t half = (int64_t)1 << d, step = half << 1;
    const int64_t tasks = (s->nslots / step) * s->batch;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (tasks > 1)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t p = task / s->batch, b = task % s->batch;
        s->combine(s->ctx, p * step + half - 1, p * step + step - 1, p == 0, b,
                   rp_thread_scratch(s, scratch));
    }
}

/* Pairs with l < N; the last one's r is clamped to the spare slot N. */
static void rp_down_level(const rp_scan_sched *s, int d, float *scratch, int threads)
{
    const int64_t half = (int64_t)1 << d, step = half << 1;
    const int64_t tasks = ((s->nslots - half) / step + 1) * s->batch;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (tasks > 1)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t p = task / s->batch, b = task % s->batch;
        const int64_t l = p * step + half - 1, r = rp_min64(l + half, s->nslots);
        float *vl = s->vec(s->ctx, l, b), *vr = s->vec(s->ctx, r, b);
        /* vr holds the prefix of the node [i, r], i = l - half + 1; the left
         * child keeps it, the right child [l + 1, r] gets it through a[l] */
        if (p == 0) {
            /* the prefix of a range starting at slot 0 is the identity */
            rp_copy(vr, vl, s->prefix_len(s->ctx, l + 1));
        } else {
            float *work = rp_thread_scratch(s, scratch), *out = work + s->work_floats;
            s->apply(s->ctx, l, b, vr, out, work);
            rp_copy(vl, vr, s->prefix_len(s->ctx, l - half + 1));
            rp_copy(vr, out, s->prefix_len(s->ctx, l + 1));
        }
    }
}

/* The linear exclusive scan over the block ends e_j, P_1 = the up-sweep
 * vector of e_0 and P_j = a[e_{j-1}] applied to P_{j-1}; sequential in j,
 * independent per sequence. */
static void rp_middle(const rp_scan_sched *s, float *scratch, int threads)
{
    const int64_t block = (int64_t)1 << s->levels;
    const int64_t nb = (s->nslots + block) / block; /* ceil((N + 1) / block) */
    if (nb < 2)
        return;
#pragma omp parallel for schedule(static) num_threads(threads) if (s->batch > 1)
    for (int64_t b = 0; b < s->batch; b++) {
        float *work = rp_thread_scratch(s, scratch);
        float *run = work + s->work_floats + s->max_vec, *next = run + s->max_vec, *t;
        const int64_t last = rp_min64(nb * block - 1, s->nslots);
        rp_copy(run, s->vec(s->ctx, block - 1, b), s->prefix_len(s->ctx, block));
        for (int64_t j = 2; j < nb; j++) {
            const int64_t e = j * block - 1; /* e_{j-1} */
            s->apply(s->ctx, e, b, run, next, work);
            rp_copy(s->vec(s->ctx, e, b), run, s->prefix_len(s->ctx, (j - 1) * block));
            t = run, run = next, next = t;
        }
        rp_copy(s->vec(s->ctx, last, b), run, s->prefix_len(s->ctx, (nb - 1) * block));
    }
}

/* Runs the schedule; 0, or -1 when the scratch cannot be allocated. */
static int rp_scan_run(const rp_scan_sched *s, int num_threads)
{
    const int threads = rp_threads(num_threads);
    float *scratch = malloc((size_t)(threads * rp_sched_scratch(s)) * sizeof *scratch);
    if (scratch == NULL)
        return -1;
    for (int d = 0; d < s->levels; d++)
        rp_up_level(s, d, scratch, threads);
    rp_middle(s, scratch, threads);
    for (int d = s->levels - 1; d >= 0; d--)
        rp_down_level(s, d, scratch, threads);
    free(scratch);
    return 0;
}

/* ---------------------------------------------------------------------------
 * The recurrence g[t] = c[t] + J[t+1]^T g[t+1]: dense and structured leaves
 *
 * Slots: N = n; a[0] = c[n-1]; a[k] = (J[n-k]^T, c[n-1-k]); a[n] spare.
 * vecs (n + 1, B, H): the c part or vector of each slot.
 * mats (n / 2 - 1, B, H, H): the up-sweep product of odd slot s >= 3 at
 * rp_scan_prod_index(s) (slot 1 never holds one).
 * A slot's map is its leaf until level 0 combines it (odd slots, L >= 1).
 * The linear scan (L = 0) skips the slots: rp_rec_linear runs c into g.
 * ------------------------------------------------------------------------- */

typedef struct {
    const rp_scan_jacobians *j;
    int64_t n, B, H, G;
    int levels;
    float *vecs, *mats;
} rp_rec_ctx;

static float *rp_rec_vec(void *ctx, int64_t s, int64_t b)
{
    const rp_rec_ctx *x = ctx;
    return x->vecs + (s * x->B + b) * x->H;
}

static int64_t rp_rec_len(void *ctx, int64_t s)
{
    (void)s;
    return ((const rp_rec_ctx *)ctx)->H;
}

static float *rp_rec_mat(const rp_rec_ctx *x, int64_t s, int64_t b)
{
    return x->mats + (rp_scan_prod_index(s) * x->B + b) * x->H * x->H;
}

/* y = M x + c for a dense H x H matrix (y may alias c, not x). */
RP_TARGET_CLONES
static void rp_dense_mv(int64_t H, const float *restrict M, const float *restrict x,
                        const float *c, float *y)
{
    for (int64_t i = 0; i < H; i++) {
        float acc = 0.0f;
        for (int64_t k = 0; k < H; k++)
            acc += M[i * H + k] * x[k];
        y[i] = acc + c[i];
    }
}

/* Y = A X for dense H x H matrices (Y aliases neither). */
RP_TARGET_CLONES
static void rp_dense_mm(int64_t H, const float *restrict A, const float *restrict X,
                        float *restrict Y)
{
    memset(Y, 0, (size_t)(H * H) * sizeof *Y);
    for (int64_t i = 0; i < H; i++)
        for (int64_t k = 0; k < H; k++) {
            const float a = A[i * H + k];
            for (int64_t m = 0; m < H; m++)
                Y[i * H + m] += a * X[k * H + m];
        }
}

/* The leaf of time t, sequence b: jt, or the vectors u, v of the structured form. */
static const float *rp_leaf_u(const rp_rec_ctx *x, int64_t t, int64_t b)
{
    return x->j->u ? x->j->u + (t * x->B + b) * x->H : NULL;
}

/* The row of v at (t, b), or of y when v is f'(y): read through rp_v_at. */
static const float *rp_leaf_v(const rp_rec_ctx *x, int64_t t, int64_t b)
{
    const float *base = x->j->act == RP_SCAN_ACT_NONE ? x->j->v : x->j->y;
    return base + (t * x->B + b) * x->G * x->H;
}

/* Element r of v from its row: v itself, or f'(y) with the float32
 * operations of torch's 1 - y * y (the build has no fp-contraction, so y * y
 * is rounded before the subtraction) and, for relu, torch's derivative:
 * threshold_backward zeroes where y <= 0 only, so a NaN y has slope 1. */
static inline float rp_v_at(int act, const float *restrict row, int64_t r)
{
    switch (act) {
    case RP_SCAN_ACT_TANH:
        return 1.0f - row[r] * row[r];
    case RP_SCAN_ACT_RELU:
        return row[r] <= 0.0f ? 0.0f : 1.0f;
    default:
        return row[r];
    }
}

/* dst = v * x over a row (v times x, as d.mul_(g) forms d = v g in Python:
 * the same bits), v read as `act` says; inlined with a constant act, one
 * straight vector loop per activation (a test per element, unpredictable
 * for relu, made the scan up to 2x slower). relu is torch's
 * threshold_backward, a select, not a product: 0 where y <= 0 even for an
 * inf or NaN x (0 * inf would be NaN), x itself elsewhere; the same values
 * as (y > 0) * x for finite x but for the sign of a zero. */
static inline void rp_scale_row_as(int act, int64_t H, const float *restrict v, const float *x,
                                   float *dst)
{
    for (int64_t i = 0; i < H; i++) {
        const float xi = x[i]; /* read either way: the select is then a blend */
        dst[i] = act == RP_SCAN_ACT_RELU ? (v[i] <= 0.0f ? 0.0f : xi) : rp_v_at(act, v, i) * xi;
    }
}

static void rp_scale_row(int act, int64_t H, const float *restrict v, const float *x, float *dst)
{
    switch (act) {
    case RP_SCAN_ACT_TANH:
        rp_scale_row_as(RP_SCAN_ACT_TANH, H, v, x, dst);
        break;
    case RP_SCAN_ACT_RELU:
        rp_scale_row_as(RP_SCAN_ACT_RELU, H, v, x, dst);
        break;
    default:
        rp_scale_row_as(RP_SCAN_ACT_NONE, H, v, x, dst);
    }
}

/* y = J[t]^T x + c; structured: u x + sum_k W_k^T (v_k x), W^T read in
 * place (w is (G H, H), so W^T z is a sum of w's rows). work: G H floats. */
RP_TARGET_CLONES
static void rp_leaf_mv(const rp_rec_ctx *x, int64_t t, int64_t b, const float *restrict in,
                       const float *c, float *y, float *restrict work)
{
    const int64_t H = x->H, GH = x->G * x->H;
    const float *restrict u, *restrict v, *restrict w = x->j->w;
    if (x->G == 0) {
        rp_dense_mv(H, x->j->jt + (t * x->B + b) * H * H, in, c, y);
        return;
    }
    u = rp_leaf_u(x, t, b);
    v = rp_leaf_v(x, t, b);
    for (int64_t k = 0; k < x->G; k++)
        rp_scale_row(x->j->act, H, v + k * H, in, work + k * H);
    float *restrict acc = work + GH;
    for (int64_t i = 0; i < H; i++)
        acc[i] = u ? u[i] * in[i] : 0.0f;
    for (int64_t r = 0; r < GH; r++) {
        const float z = work[r];
        for (int64_t i = 0; i < H; i++)
            acc[i] += w[r * H + i] * z;
    }
    for (int64_t i = 0; i < H; i++)
        y[i] = acc[i] + c[i];
}

/* Y = J[t]^T X for a dense H x H X: u X + W^T (diag(v) [X; X; ...]).
 * work: G H H floats. */
RP_TARGET_CLONES
static void rp_leaf_mm(const rp_rec_ctx *x, int64_t t, int64_t b, const float *restrict X,
                       float *restrict Y, float *restrict work)
{
    const int64_t H = x->H, GH = x->G * x->H;
    const float *restrict u, *restrict v, *restrict w = x->j->w;
    if (x->G == 0) {
        rp_dense_mm(H, x->j->jt + (t * x->B + b) * H * H, X, Y);
        return;
    }
    u = rp_leaf_u(x, t, b);
    v = rp_leaf_v(x, t, b);
    for (int64_t r = 0; r < GH; r++) {
        const float vr = rp_v_at(x->j->act, v, r);
        for (int64_t m = 0; m < H; m++)
            work[r * H + m] = vr * X[(r % H) * H + m];
    }
    for (int64_t i = 0; i < H; i++)
        for (int64_t m = 0; m < H; m++)
            Y[i * H + m] = u ? u[i] * X[i * H + m] : 0.0f;
    for (int64_t r = 0; r < GH; r++)
        for (int64_t i = 0; i < H; i++) {
            const float a = w[r * H + i];
            for (int64_t m = 0; m < H; m++)
                Y[i * H + m] += a * work[r * H + m];
        }
}

/* J[t]^T as a dense H x H matrix. */
static void rp_leaf_dense(const rp_rec_ctx *x, int64_t t, int64_t b, float *restrict M)
{
    const int64_t H = x->H;
    if (x->G == 0) {
        memcpy(M, x->j->jt + (t * x->B + b) * H * H, (size_t)(H * H) * sizeof *M);
        return;
    }
    const float *u = rp_leaf_u(x, t, b), *v = rp_leaf_v(x, t, b), *w = x->j->w;
    for (int64_t i = 0; i < H; i++)
        for (int64_t m = 0; m < H; m++) {
            float acc = (u && i == m) ? u[i] : 0.0f;
            for (int64_t k = 0; k < x->G; k++)
                acc += w[(k * H + m) * H + i] * rp_v_at(x->j->act, v, k * H + m);
            M[i * H + m] = acc;
        }
}

/* out = M_s in + c_s, M_s the leaf or, for odd slots once level 0 ran, the product. */
static void rp_rec_map_mv(const rp_rec_ctx *x, int64_t s, int product, int64_t b,
                          const float *in, const float *c, float *out, float *work)
{
    if (product)
        rp_dense_mv(x->H, rp_rec_mat(x, s, b), in, c, out);
    else
        rp_leaf_mv(x, x->n - s, b, in, c, out, work);
}

static void rp_rec_apply(void *ctx, int64_t s, int64_t b, const float *in, float *out,
                         float *work)
{
    const rp_rec_ctx *x = ctx;
    rp_rec_map_mv(x, s, (s & 1) && x->levels > 0, b, in, rp_rec_vec(ctx, s, b), out, work);
}

static void rp_rec_combine(void *ctx, int64_t l, int64_t r, int spine, int64_t b, float *work)
{
    const rp_rec_ctx *x = ctx;
    const int64_t H = x->H;
    const int first = r - l == 1; /* level 0: a[r] is still a leaf */
    float *cl = rp_rec_vec(ctx, l, b), *cr = rp_rec_vec(ctx, r, b);
    if (spine) { /* a vector: M_r a[l] + c_r */
        rp_rec_map_mv(x, r, !first, b, cl, cr, cr, work);
        return;
    }
    float *Mr = rp_rec_mat(x, r, b), *tmp = work, *more = work + H * H;
    /* (M_r, c_r) <- (M_r M_l, M_r c_l + c_r), c first while M_r is intact */
    rp_rec_map_mv(x, r, !first, b, cl, cr, cr, more);
    if (first) {
        rp_leaf_dense(x, x->n - l, b, tmp);
        rp_leaf_mm(x, x->n - r, b, tmp, Mr, more);
    } else {
        rp_dense_mm(H, Mr, rp_rec_mat(x, l, b), tmp);
        memcpy(Mr, tmp, (size_t)(H * H) * sizeof *Mr);
    }
}

int64_t rp_scan_workspace_floats(int64_t n, int64_t batch, int64_t dim, int levels)
{
    /* Counted with overflow checks: a wrapped count would size a buffer that
     * the scan overruns. The cap keeps the buffer's bytes in int64 too. */
    const int64_t cap = INT64_MAX / (int64_t)sizeof(float);
    const int64_t row = rp_mul_capped(batch, dim, cap); /* B H */
    const int64_t vecs = rp_mul_capped(n, row, cap);    /* n B H */
    /* (n/2 - 1) B H H */
    const int64_t prods = rp_mul_capped(rp_mul_capped(rp_scan_prod_count(n), row, cap), dim, cap);
    if (levels == 0) /* the linear scan runs from c to g directly */
        return 0;
    if (vecs < 0 || prods < 0 || prods > cap - row - vecs)
        return -1;
    return vecs + row + prods;
}

int rp_scan_check_sizes(int64_t n, int64_t batch, int64_t dim, int gates, int levels, rp_error *err)
{
    if (n < 1 || batch < 0 || dim < 1)
        return rp_set_error(err, RP_EINVAL, "scan: need n >= 1, batch >= 0, dim >= 1 (got %lld, %lld, %lld)",
                            (long long)n, (long long)batch, (long long)dim);
    if (gates < 0)
        return rp_set_error(err, RP_EINVAL, "scan: gates must be >= 0 (got %d)", gates);
    if (levels < 0 || levels > rp_scan_max_levels(n))
        return rp_set_error(err, RP_EINVAL, "scan: levels must be in [0, %d] for n = %lld (got %d)",
                            rp_scan_max_levels(n), (long long)n, levels);
    if (rp_scan_workspace_floats(n, batch, dim, levels) < 0)
        return rp_set_error(err, RP_EINVAL,
                            "scan: the workspace of n = %lld, batch = %lld, dim = %lld (levels > 0) "
                            "passes INT64_MAX bytes",
                            (long long)n, (long long)batch, (long long)dim);
    return RP_OK;
}

/* Structured leaves take v, or y with an activation; dense ones neither. */
static int rp_scan_check_v(const rp_scan_jacobians *j, rp_error *err)
{
    if (j->act != RP_SCAN_ACT_NONE && j->act != RP_SCAN_ACT_TANH && j->act != RP_SCAN_ACT_RELU)
        return rp_set_error(err, RP_EINVAL, "scan: unknown activation %d", j->act);
    if (j->gates == 0)
        return j->act == RP_SCAN_ACT_NONE ? RP_OK
                                         : rp_set_error(err, RP_EINVAL, "scan: dense leaves take no activation");
    if (j->act == RP_SCAN_ACT_NONE)
        return j->v != NULL && j->y == NULL
                   ? RP_OK
                   : rp_set_error(err, RP_EINVAL, "scan: structured leaves need v (and y only with an activation)");
    return j->y != NULL && j->v == NULL
               ? RP_OK
               : rp_set_error(err, RP_EINVAL, "scan: an activation takes y in place of v (v must be NULL)");
}

int rp_scan_check(const rp_scan_jacobians *j, const float *c, const float *g, int levels,
                  const float *work, rp_error *err)
{
    int rc;
    if (j == NULL || c == NULL || g == NULL)
        return rp_set_error(err, RP_EINVAL, "scan: NULL jacobians, c or g");
    rc = rp_scan_check_sizes(j->n, j->batch, j->dim, j->gates, levels, err);
    if (rc != RP_OK)
        return rc;
    if (j->gates > 0 && j->w == NULL)
        return rp_set_error(err, RP_EINVAL, "scan: structured leaves need w");
    if (j->gates == 0 && j->jt == NULL)
        return rp_set_error(err, RP_EINVAL, "scan: dense leaves need jt");
    rc = rp_scan_check_v(j, err);
    if (rc != RP_OK)
        return rc;
    if (j->pre_activation && j->gates != 1)
        return rp_set_error(err, RP_EINVAL, "scan: pre_activation needs gates = 1 (got %d)", j->gates);
    if (work == NULL && j->batch > 0 && rp_scan_workspace_floats(j->n, j->batch, j->dim, levels) > 0)
        return rp_set_error(err, RP_EINVAL, "scan: NULL workspace");
    return RP_OK;
}

/* Copies c into the slots and the result out of them, in time order. */
static void rp_rec_load(const rp_rec_ctx *x, const float *c)
{
    const int64_t row = x->B * x->H;
    for (int64_t k = 0; k < x->n; k++)
        memcpy(x->vecs + k * row, c + (x->n - 1 - k) * row, (size_t)row * sizeof *c);
}

/* The result of (t, b) from g[t] into dst: g[t] itself, or with
 * pre_activation v[t] * g[t]. dst may be gt. */
static void rp_rec_emit(const rp_rec_ctx *x, int64_t t, int64_t b, const float *gt, float *dst)
{
    if (x->j->pre_activation)
        rp_scale_row(x->j->act, x->H, rp_leaf_v(x, t, b), gt, dst);
    else
        rp_copy(dst, gt, x->H);
}

/* Whether every result in the slots is finite: one pass over n B H floats
 * (the scan with levels did n B H^3 multiply-adds), before rp_rec_store. */
static int rp_rec_finite(const rp_rec_ctx *x)
{
    const float *first = x->vecs + x->B * x->H;
    const int64_t len = x->n * x->B * x->H;
    int64_t bad = 0;
    for (int64_t k = 0; k < len; k++)
        bad += !isfinite(first[k]);
    return bad == 0;
}

static void rp_rec_store(const rp_rec_ctx *x, float *g)
{
    for (int64_t s = 1; s <= x->n; s++)
        for (int64_t b = 0; b < x->B; b++)
            rp_rec_emit(x, x->n - s, b, x->vecs + (s * x->B + b) * x->H,
                        g + ((x->n - s) * x->B + b) * x->H);
}

/* levels = 0, the plain linear scan, straight from c into g: no slots, no
 * workspace, one sequence per task. The same leaf mat-vecs in the same order
 * as the schedule's middle with blocks of one slot, so the same bits. g[t]
 * is written after the last read of c[t], so g may alias c. With
 * pre_activation g[t], still the next step's input, stays in two per-thread
 * vectors and only v[t] g[t] goes out. 0, or -1 when the per-thread scratch
 * cannot be allocated. */
static int rp_rec_linear(const rp_rec_ctx *x, const float *c, float *g, int num_threads)
{
    const int threads = rp_threads(num_threads);
    const int64_t row = x->B * x->H, GH = x->G * x->H;
    /* rp_leaf_mv's work and the two vectors, written every step, padded by
     * at least a 128-byte line: threads sharing a line made the scan 1.7x
     * slower (B = 16, H = 20, two threads) */
    const int64_t per_thread = (GH + 3 * x->H + 63) / 32 * 32;
    float *scratch = malloc((size_t)(threads * per_thread) * sizeof *scratch);
    if (scratch == NULL)
        return -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (x->B > 1)
    for (int64_t b = 0; b < x->B; b++) {
        float *work = scratch + rp_thread_num() * per_thread;
        float *kept[2] = {work + GH + x->H, work + GH + 2 * x->H};
        const float *cb = c + b * x->H, *next = NULL;
        float *gb = g + b * x->H;
        for (int64_t t = x->n - 1; t >= 0; t--) {
            float *gt = x->j->pre_activation ? kept[t & 1] : gb + t * row;
            if (next == NULL)
                rp_copy(gt, cb + t * row, x->H);
            else
                rp_leaf_mv(x, t + 1, b, next, cb + t * row, gt, work);
            rp_rec_emit(x, t, b, gt, gb + t * row);
            next = gt;
        }
    }
    free(scratch);
    return 0;
}

int rp_scan_cpu(const rp_scan_jacobians *j, const float *c, float *g, int levels, float *work,
                int num_threads, rp_error *err)
{
    int rc = rp_scan_check(j, c, g, levels, work, err);
    if (rc != RP_OK || j->batch == 0)
        return rc;
    rp_rec_ctx x = {j, j->n, j->batch, j->dim, j->gates, levels, work, NULL};
    if (levels == 0) {
        if (rp_rec_linear(&x, c, g, num_threads) != 0)
            return rp_set_error(err, RP_ERUNTIME, "scan: out of memory for the per-thread scratch");
        return RP_OK;
    }
    x.mats = work + (j->n + 1) * j->batch * j->dim;
    const int64_t G = j->gates > 0 ? j->gates : 1, H = j->dim;
    rp_scan_sched s = {j->n, j->batch, levels, H * H + G * H * H + G * H + H, H, &x,
                       rp_rec_combine, rp_rec_apply, rp_rec_vec, rp_rec_len};
    rp_rec_load(&x, c);
    if (rp_scan_run(&s, num_threads) != 0)
        return rp_set_error(err, RP_ERUNTIME, "scan: out of memory for the per-thread scratch");
    if (!rp_rec_finite(&x)) {
        /* the up-sweep's products of up to 2^levels Jacobians overflowed,
         * and the down-sweep made inf * 0 = NaN of them: the linear scan
         * never forms them, so its result is finite wherever autograd's
         * is. c is intact (nothing was stored to g yet), so it starts over. */
        if (rp_rec_linear(&x, c, g, num_threads) != 0)
            return rp_set_error(err, RP_ERUNTIME, "scan: out of memory for the per-thread scratch");
        return RP_OK;
    }
    rp_rec_store(&x, g);
    return RP_OK;
}

/* ---------------------------------------------------------------------------
 * The cost model: multiply-adds on the critical path, each level or
 * dependent step charged its fixed cost, each round of `workers` parallel
 * tasks the cost of one task.
 * ------------------------------------------------------------------------- */

static double rp_rounds(double tasks, double workers)
{
    return workers >= tasks ? (tasks > 0 ? 1.0 : 0.0) : ceil(tasks / workers);
}

/* rp_scan_cost for sizes rp_scan_check_sizes accepts: levels <= 62, so every
 * 2^d fits, and the middle's nb - 2 steps (nb = ceil((n + 1) / block)) are
 * n / block - 1, which never forms n + block (past INT64_MAX for n near it). */
static double rp_scan_model_cost(int64_t n, int64_t batch, int64_t dim, int gates, int levels,
                                 const rp_scan_machine *m)
{
    const double H = (double)dim, G = gates > 0 ? gates : 1, B = (double)batch;
    const double W = m->workers > 1 ? m->workers : 1;
    const double leaf_mm = G * H * H * H + H * H * G, mm = H * H * H;
    const double leaf_mv = G * H * H + G * H, mv = H * H;
    const int64_t block = (int64_t)1 << levels, middle_steps = n / block - 1;
    double t = 0.0;
    for (int d = 0; d < levels; d++) {
        const int64_t half = (int64_t)1 << d;
        const double up = (double)(n / (2 * half)), down = (double)((n - half) / (2 * half) + 1);
        t += rp_rounds(up * B, W) * (d == 0 ? leaf_mm : mm) + m->level_cost;
        t += rp_rounds(down * B, W) * (d == 0 ? leaf_mv : mv) + m->level_cost;
    }
    if (middle_steps > 0) /* one sequence per worker, nb - 2 dependent steps */
        t += (double)middle_steps * (rp_rounds(B, W) * (levels == 0 ? leaf_mv : mv) + m->step_cost);
    return t;
}

int rp_scan_cost(int64_t n, int64_t batch, int64_t dim, int gates, int levels,
                 const rp_scan_machine *m, double *cost, rp_error *err)
{
    const int rc = rp_scan_check_sizes(n, batch, dim, gates, levels, err);
    if (rc != RP_OK)
        return rc;
    if (m == NULL || cost == NULL)
        return rp_set_error(err, RP_EINVAL, "scan cost: NULL machine or cost");
    *cost = rp_scan_model_cost(n, batch, dim, gates, levels, m);
    return RP_OK;
}

int rp_scan_choose_levels(int64_t n, int64_t batch, int64_t dim, int gates,
                          const rp_scan_machine *m)
{
    int best = 0;
    double best_cost;
    if (m == NULL || rp_scan_check_sizes(n, batch, dim, gates, 0, NULL) != RP_OK)
        return 0;
    best_cost = rp_scan_model_cost(n, batch, dim, gates, 0, m);
    for (int L = 1; L <= rp_scan_max_levels(n); L++) {
        const double c = rp_scan_model_cost(n, batch, dim, gates, L, m);
        if (c < best_cost)
            best = L, best_cost = c;
    }
    return best;
}

/* ---------------------------------------------------------------------------
 * The sparse chain: CSR transposed Jacobians with planned products
 *
 * Slots: N = n + 1; a[0] = g_n; a[k] = J_{n-k}^T (leaf k - 1, layer n - k).
 * Matrix ids: leaves 0..n-1 (values from the caller), then the up-sweep
 * products P(r, d) = (a[r] after levels < d) x (a[l] after levels < d), in
 * level order. A product's value is the sum of A[pair_a[q]] B[pair_b[q]]
 * over its pairs q (k ascending, the order of a row-by-row Gustavson
 * product).
 *
 * The plan then compiles the schedule of rp_scan_run, specialised to these
 * slots, into a program (reprop.h) rather than calling back per pair: the
 * same rows run on the CPU and the GPU, and a product of two shared leaves
 * is a row of the shared buffer, computed once for the batch.
 * ------------------------------------------------------------------------- */

typedef struct {
    int64_t rows, cols, nnz;
    int32_t *indptr, *indices;
    int level;             /* products: the up-sweep level; leaves: -1 */
    int shared;            /* values the same for every sequence */
    int64_t a, b;          /* products: operand ids, C = A B */
    int32_t *vmap;         /* leaves: value q at raw offset vmap[q], or NULL */
    int64_t nvalues;       /* the floats its values take: nnz, or the raw values */
    int64_t *pair_ptr;     /* nnz + 1 */
    int32_t *pair_a, *pair_b;
    uint32_t addr;         /* where its values are (rp_csr_program addresses) */
} rp_csr_mat;

/* A growing program: the arrays rp_csr_program views. */
typedef struct {
    int64_t nphases, nrows, nterms;
    int64_t *phase_ptr, *phase_shared, *term_ptr;
    uint32_t *dst, *tx, *ty, *leaf_addr, *g_addr;
    int64_t cap_phase_ptr, cap_phase_shared, cap_term_ptr, cap_dst, cap_tx, cap_ty;
    int failed; /* out of memory */
} rp_csr_emit;

struct rp_csr_plan {
    int64_t n, nslots;
    int levels, planned; /* levels run; levels whose products exist */
    int64_t nmats;
    rp_csr_mat *mats;
    int64_t stride;      /* levels the prod table has room for, plus one */
    int64_t *prod;       /* (N + 1) x stride: id of P(s, d) or -1 */
    int64_t max_vec;     /* room of each slot's vector */
    uint32_t vec0;       /* slot 0's vector: the other slots' and the two spares follow */
    rp_scan_machine machine;
    rp_csr_emit code;
    rp_csr_program program;
};

static void rp_csr_mat_free(rp_csr_mat *m)
{
    free(m->indptr), free(m->indices), free(m->pair_ptr), free(m->pair_a), free(m->pair_b), free(m->vmap);
}

static void rp_csr_emit_free(rp_csr_emit *e)
{
    free(e->phase_ptr), free(e->phase_shared), free(e->term_ptr), free(e->dst), free(e->tx);
    free(e->ty), free(e->leaf_addr), free(e->g_addr);
}

void rp_csr_plan_free(rp_csr_plan *p)
{
    if (p == NULL)
        return;
    for (int64_t i = 0; i < p->nmats; i++)
        rp_csr_mat_free(&p->mats[i]);
    rp_csr_emit_free(&p->code);
    free(p->mats), free(p->prod), free(p);
}

/* Slot s's map once the levels below `upto` have run. */
static int64_t rp_csr_map_at(const rp_csr_plan *p, int64_t s, int upto)
{
    for (int d = (upto < p->planned ? upto : p->planned) - 1; d >= 0; d--)
        if (p->prod[s * p->stride + d] >= 0)
            return p->prod[s * p->stride + d];
    return s - 1; /* the leaf */
}

static int64_t rp_csr_prefix_len_of(const rp_csr_plan *p, int64_t s)
{
    if (s == 0)
        return 0;
    if (s == p->nslots)
        return p->mats[s - 2].rows; /* g_0: rows of the last slot's leaf */
    return p->mats[s - 1].cols;
}

/* The symbolic product C = A B: pattern and pair lists. -1 when out of memory
 * or past max_pairs (C left empty). */
static int rp_csr_symbolic(const rp_csr_mat *A, const rp_csr_mat *B, int64_t max_pairs,
                           rp_csr_mat *C)
{
    int32_t *pos = malloc((size_t)(B->cols > 0 ? B->cols : 1) * sizeof *pos);
    int64_t *row_nnz = calloc((size_t)A->rows + 1, sizeof *row_nnz), pairs = 0;
    memset(C, 0, sizeof *C);
    C->rows = A->rows, C->cols = B->cols;
    if (pos == NULL || row_nnz == NULL)
        goto fail;
    for (int64_t j = 0; j < B->cols; j++)
        pos[j] = -1;
    /* pass 1: the row sizes and the pair count */
    for (int64_t i = 0; i < A->rows; i++) {
        int64_t cnt = 0;
        for (int64_t q = A->indptr[i]; q < A->indptr[i + 1]; q++) {
            const int64_t k = A->indices[q];
            pairs += B->indptr[k + 1] - B->indptr[k];
            for (int64_t t = B->indptr[k]; t < B->indptr[k + 1]; t++)
                if (pos[B->indices[t]] != (int32_t)i)
                    pos[B->indices[t]] = (int32_t)i, cnt++;
        }
        row_nnz[i + 1] = row_nnz[i] + cnt;
        if (max_pairs > 0 && pairs > max_pairs)
            goto fail;
    }
    if (row_nnz[A->rows] > INT32_MAX)
        goto fail;
    C->nnz = row_nnz[A->rows];
    C->indptr = malloc((size_t)(C->rows + 1) * sizeof *C->indptr);
    C->indices = malloc((size_t)(C->nnz > 0 ? C->nnz : 1) * sizeof *C->indices);
    C->pair_ptr = calloc((size_t)C->nnz + 1, sizeof *C->pair_ptr);
    C->pair_a = malloc((size_t)(pairs > 0 ? pairs : 1) * sizeof *C->pair_a);
    C->pair_b = malloc((size_t)(pairs > 0 ? pairs : 1) * sizeof *C->pair_b);
    if (!C->indptr || !C->indices || !C->pair_ptr || !C->pair_a || !C->pair_b)
        goto fail;
    for (int64_t j = 0; j < B->cols; j++)
        pos[j] = -1;
    /* pass 2: sorted columns per row, then the pairs per non-zero */
    for (int64_t i = 0; i < A->rows; i++) {
        const int64_t base = row_nnz[i];
        int64_t cnt = 0;
        C->indptr[i] = (int32_t)base;
        for (int64_t q = A->indptr[i]; q < A->indptr[i + 1]; q++)
            for (int64_t t = B->indptr[A->indices[q]]; t < B->indptr[A->indices[q] + 1]; t++)
                if (pos[B->indices[t]] < base) /* stale marks are below this row's base */
                    pos[B->indices[t]] = (int32_t)(base + cnt), C->indices[base + cnt++] = B->indices[t];
        /* insertion sort: rows are short and mostly ordered */
        for (int64_t x = base + 1; x < base + cnt; x++)
            for (int64_t y = x; y > base && C->indices[y - 1] > C->indices[y]; y--) {
                const int32_t tmp = C->indices[y];
                C->indices[y] = C->indices[y - 1], C->indices[y - 1] = tmp;
            }
        for (int64_t x = base; x < base + cnt; x++)
            pos[C->indices[x]] = (int32_t)x;
        for (int64_t q = A->indptr[i]; q < A->indptr[i + 1]; q++)
            for (int64_t t = B->indptr[A->indices[q]]; t < B->indptr[A->indices[q] + 1]; t++)
                C->pair_ptr[pos[B->indices[t]] + 1]++;
    }
    C->indptr[C->rows] = (int32_t)C->nnz;
    for (int64_t x = 0; x < C->nnz; x++)
        C->pair_ptr[x + 1] += C->pair_ptr[x];
    {
        int64_t *fill = malloc((size_t)(C->nnz > 0 ? C->nnz : 1) * sizeof *fill);
        if (fill == NULL)
            goto fail;
        memcpy(fill, C->pair_ptr, (size_t)(C->nnz > 0 ? C->nnz : 0) * sizeof *fill);
        for (int64_t i = 0; i < A->rows; i++) {
            for (int64_t x = C->indptr[i]; x < C->indptr[i + 1]; x++)
                pos[C->indices[x]] = (int32_t)x;
            for (int64_t q = A->indptr[i]; q < A->indptr[i + 1]; q++)
                for (int64_t t = B->indptr[A->indices[q]]; t < B->indptr[A->indices[q] + 1]; t++) {
                    const int64_t at = fill[pos[B->indices[t]]]++;
                    C->pair_a[at] = (int32_t)q, C->pair_b[at] = (int32_t)t;
                }
        }
        free(fill);
    }
    free(pos), free(row_nnz);
    return 0;
fail:
    free(pos), free(row_nnz);
    rp_csr_mat_free(C);
    memset(C, 0, sizeof *C);
    return -1;
}

/* Multiply-adds of up-sweep level d (pair lists off the spine, a mat-vec on
 * it) and of down-sweep level d (mat-vecs), per sequence. */
static int64_t rp_csr_level_madds(const rp_csr_plan *p, int d)
{
    const int64_t half = (int64_t)1 << d, step = half << 1, N = p->nslots;
    int64_t madds = 0;
    for (int64_t i = 0; i + step - 1 < N; i += step) {
        const int64_t r = i + step - 1, id = p->prod[r * p->stride + d];
        madds += id >= 0 ? p->mats[id].pair_ptr[p->mats[id].nnz] : p->mats[rp_csr_map_at(p, r, d)].nnz;
    }
    for (int64_t l = step + half - 1; l < N; l += step)
        madds += p->mats[rp_csr_map_at(p, l, d)].nnz;
    return madds;
}

/* Multiply-adds of one scan of one sequence with `levels`, and the
 * critical-path cost the model compares (see rp_scan_cost). */
static double rp_csr_cost(const rp_csr_plan *p, int levels, int64_t batch, const rp_scan_machine *m,
                          int64_t *madds_out)
{
    const double W = m->workers > 1 ? m->workers : 1, B = (double)batch;
    const int64_t N = p->nslots, block = (int64_t)1 << levels, nb = (N + block) / block;
    int64_t madds = 0;
    double t = 0.0;
    for (int d = 0; d < levels; d++) {
        const int64_t level = rp_csr_level_madds(p, d);
        madds += level;
        t += (double)level * B / W + 2 * m->level_cost;
    }
    for (int64_t j = 2; j < nb; j++) {
        const int64_t nnz = p->mats[rp_csr_map_at(p, j * block - 1, levels)].nnz;
        madds += nnz;
        t += (double)nnz * (B < W ? 1.0 : B / W) + m->step_cost;
    }
    if (madds_out)
        *madds_out = madds;
    return t;
}

static int rp_csr_copy_leaf(const rp_csr_pattern *src, rp_csr_mat *dst)
{
    memset(dst, 0, sizeof *dst);
    dst->rows = src->rows, dst->cols = src->cols, dst->nnz = src->nnz, dst->level = -1;
    dst->shared = src->shared != 0, dst->nvalues = src->value_map ? src->values : src->nnz;
    if (src->value_map != NULL) {
        dst->vmap = malloc((size_t)(src->nnz > 0 ? src->nnz : 1) * sizeof *dst->vmap);
        if (dst->vmap == NULL)
            return -1;
        if (src->nnz > 0)
            memcpy(dst->vmap, src->value_map, (size_t)src->nnz * sizeof *dst->vmap);
    }
    dst->indptr = malloc((size_t)(src->rows + 1) * sizeof *dst->indptr);
    dst->indices = malloc((size_t)(src->nnz > 0 ? src->nnz : 1) * sizeof *dst->indices);
    if (!dst->indptr || !dst->indices)
        return -1;
    memcpy(dst->indptr, src->indptr, (size_t)(src->rows + 1) * sizeof *dst->indptr);
    if (src->nnz > 0)
        memcpy(dst->indices, src->indices, (size_t)src->nnz * sizeof *dst->indices);
    return 0;
}

/* 0 = indptr[0] <= indptr[1] <= ... <= indptr[rows] = nnz: every row's
 * range lies inside indices[0, nnz), checked before any row is read (a
 * decreasing step would let an earlier row run past nnz). */
static int rp_csr_indptr_valid(const rp_csr_mat *m)
{
    if (m->indptr[0] != 0 || m->indptr[m->rows] != m->nnz)
        return 0;
    for (int64_t r = 0; r < m->rows; r++)
        if (m->indptr[r] > m->indptr[r + 1])
            return 0;
    return 1;
}

/* The sizes of the leaves: what their copies allocate and read. */
static int rp_csr_check_shapes(int64_t n, const rp_csr_pattern *leaves, rp_error *err)
{
    if (n < 1 || leaves == NULL)
        return rp_set_error(err, RP_EINVAL, "csr plan: need at least one layer");
    for (int64_t i = 0; i < n; i++) {
        const rp_csr_pattern *m = &leaves[i];
        /* no vector of a larger layer fits the 2^31 floats a program
         * addresses; checked before indptr's rows + 1 entries are copied */
        if (m->rows > INT32_MAX || m->cols > INT32_MAX)
            return rp_set_error(err, RP_EINVAL, "csr plan: layer %lld: %lld rows, %lld cols: past the "
                                "2^31 floats a program addresses", (long long)i, (long long)m->rows,
                                (long long)m->cols);
        if (m->rows < 1 || m->cols < 1 || m->nnz < 0 || !m->indptr || (m->nnz > 0 && !m->indices))
            return rp_set_error(err, RP_EINVAL, "csr plan: layer %lld: bad CSR sizes or NULL arrays",
                                (long long)i);
        if (i + 1 < n && m->cols != leaves[i + 1].rows)
            return rp_set_error(err, RP_EINVAL,
                                "csr plan: layer %lld has %lld outputs but layer %lld has %lld inputs",
                                (long long)i, (long long)m->cols, (long long)i + 1,
                                (long long)leaves[i + 1].rows);
    }
    return RP_OK;
}

/* The arrays of layer i's copy m: the plan's, which no one else writes, so
 * that what passes here is what the plan indexes with. Checked in the
 * caller's arrays instead, another thread (csr_plan runs without the GIL)
 * could write one between the check and the copy. */
static int rp_csr_check_pattern(int64_t i, const rp_csr_mat *m, rp_error *err)
{
    for (int64_t q = 0; m->vmap != NULL && q < m->nnz; q++)
        if (m->vmap[q] < 0 || m->vmap[q] >= m->nvalues)
            return rp_set_error(err, RP_EINVAL, "csr plan: layer %lld: value_map[%lld] = %d is "
                                "outside its %lld values", (long long)i, (long long)q,
                                (int)m->vmap[q], (long long)m->nvalues);
    if (!rp_csr_indptr_valid(m))
        return rp_set_error(err, RP_EINVAL, "csr plan: layer %lld: indptr must run from 0 to nnz "
                            "without decreasing", (long long)i);
    for (int64_t r = 0; r < m->rows; r++)
        for (int64_t q = m->indptr[r]; q < m->indptr[r + 1]; q++)
            if (m->indices[q] < 0 || m->indices[q] >= m->cols ||
                (q > m->indptr[r] && m->indices[q] <= m->indices[q - 1]))
                return rp_set_error(err, RP_EINVAL,
                                    "csr plan: layer %lld: row %lld is not sorted, unique and in range",
                                    (long long)i, (long long)r);
    return RP_OK;
}

/* The plan's leaves: slot k holds a copy of leaf k - 1 = J_{n-k}^T, each
 * checked once copied. */
static int rp_csr_copy_leaves(rp_csr_plan *p, const rp_csr_pattern *leaves, rp_error *err)
{
    const int64_t n = p->n;
    for (int64_t k = 1; k <= n; k++) {
        p->nmats++; /* freed with the plan, however far it was copied */
        if (rp_csr_copy_leaf(&leaves[n - k], &p->mats[k - 1]) != 0)
            return rp_set_error(err, RP_ERUNTIME, "csr plan: out of memory");
    }
    for (int64_t i = 0; i < n; i++) {
        const int rc = rp_csr_check_pattern(i, &p->mats[n - 1 - i], err);
        if (rc != RP_OK)
            return rc;
    }
    return RP_OK;
}


/* Plans the products of level d, each capped at `cap` pairs (0: none) and,
 * when budget >= 0, all of them at `budget` pairs. -1 when a cap is passed
 * or memory runs out: the caller drops the level. */
static int rp_csr_plan_level(rp_csr_plan *p, int d, int64_t cap, int64_t budget)
{
    const int64_t half = (int64_t)1 << d, step = half << 1;
    for (int64_t i = step; i + step - 1 < p->nslots; i += step) { /* off the spine */
        const int64_t l = i + half - 1, r = i + step - 1;
        const int64_t limit = budget < 0 ? cap : cap > 0 && cap < budget ? cap : budget;
        rp_csr_mat *grown = realloc(p->mats, (size_t)(p->nmats + 1) * sizeof *grown);
        if (grown == NULL)
            return -1;
        p->mats = grown;
        rp_csr_mat *C = &p->mats[p->nmats];
        const int64_t a = rp_csr_map_at(p, r, d), b = rp_csr_map_at(p, l, d);
        if (budget == 0 || rp_csr_symbolic(&p->mats[a], &p->mats[b], limit, C) != 0)
            return -1;
        C->level = d, C->a = a, C->b = b;
        p->prod[r * p->stride + d] = p->nmats++;
        if (budget > 0)
            budget -= C->pair_ptr[C->nnz];
    }
    return 0;
}

/* Drops the products of levels >= d (the last ones appended). */
static void rp_csr_drop_levels(rp_csr_plan *p, int d)
{
    while (p->nmats > p->n && p->mats[p->nmats - 1].level >= d)
        rp_csr_mat_free(&p->mats[--p->nmats]);
    for (int64_t s = 0; s <= p->nslots; s++)
        for (int e = d; e < p->stride - 1; e++)
            p->prod[s * p->stride + e] = -1;
    p->planned = d < p->planned ? d : p->planned;
}

/* Plans the products level by level, up to `want` levels, or when want < 0
 * every level the cost model could choose, then chooses. Planning stops at
 * the first level some product of which passes max_pairs (or that memory
 * cannot hold). With want < 0 it also stops at the first level that cannot
 * win: every choice of more levels runs the up- and down-sweeps of those
 * below it, so once their cost plus the new level's pairs pass the best
 * cost so far, no deeper choice can beat it; the level's products are
 * abandoned as soon as their pairs pass that budget, which bounds the time
 * and memory of planning. Products of levels past the choice are dropped. */
static int rp_csr_plan_products(rp_csr_plan *p, int want, int64_t max_pairs, const rp_scan_machine *m)
{
    const int top = rp_scan_max_levels(p->nslots), upto = want < 0 || want > top ? top : want;
    const double W = m->workers > 1 ? m->workers : 1;
    double best = 0.0, below = 0.0;
    p->stride = upto + 1;
    p->prod = malloc((size_t)((p->nslots + 1) * p->stride) * sizeof *p->prod);
    if (p->prod == NULL)
        return RP_ERUNTIME;
    for (int64_t i = 0; i < (p->nslots + 1) * p->stride; i++)
        p->prod[i] = -1;
    if (want < 0)
        best = rp_csr_cost(p, 0, 1, m, NULL);
    for (int d = 0; d < upto; d++) {
        const double room = (best - below - 2 * m->level_cost) * W;
        /* a NaN room (a NaN or inf - inf machine cost) is no room, never a cast */
        const int64_t budget = want >= 0 ? -1 : !(room >= 1.0) ? 0 : room > 9e18 ? INT64_MAX : (int64_t)room;
        if (rp_csr_plan_level(p, d, max_pairs, budget) != 0) {
            rp_csr_drop_levels(p, d);
            break;
        }
        p->planned = d + 1;
        if (want < 0) {
            const double c = rp_csr_cost(p, d + 1, 1, m, NULL);
            below += (double)rp_csr_level_madds(p, d) / W + 2 * m->level_cost;
            if (c < best)
                best = c, p->levels = d + 1;
        }
    }
    if (want >= 0)
        p->levels = want < p->planned ? want : p->planned;
    rp_csr_drop_levels(p, p->levels);
    return RP_OK;
}

/* ---- the program ---- */

#define RP_CSR_ONE RP_CSR_SHARED /* shared[0] = 1: a copy is a product with it */

static int rp_csr_grow(void **arr, int64_t *cap, int64_t need, size_t size)
{
    if (need <= *cap)
        return 0;
    int64_t cap2 = *cap > 0 ? *cap : 64;
    while (cap2 < need)
        cap2 *= 2;
    void *grown = realloc(*arr, (size_t)cap2 * size);
    if (grown == NULL)
        return -1;
    *arr = grown, *cap = cap2;
    return 0;
}

static void rp_emit_term(rp_csr_emit *e, uint32_t x, uint32_t y)
{
    if (e->failed || rp_csr_grow((void **)&e->tx, &e->cap_tx, e->nterms + 1, sizeof *e->tx) ||
        rp_csr_grow((void **)&e->ty, &e->cap_ty, e->nterms + 1, sizeof *e->ty)) {
        e->failed = 1;
        return;
    }
    e->tx[e->nterms] = x, e->ty[e->nterms++] = y;
}

/* Closes a row: dst = the sum of the terms emitted since the last row. */
static void rp_emit_row(rp_csr_emit *e, uint32_t dst)
{
    if (e->failed || rp_csr_grow((void **)&e->dst, &e->cap_dst, e->nrows + 1, sizeof *e->dst) ||
        rp_csr_grow((void **)&e->term_ptr, &e->cap_term_ptr, e->nrows + 2, sizeof *e->term_ptr)) {
        e->failed = 1;
        return;
    }
    e->dst[e->nrows++] = dst;
    e->term_ptr[e->nrows] = e->nterms;
}

/* From here on the phase's rows write the shared buffer. */
static void rp_emit_shared_rows(rp_csr_emit *e)
{
    if (!e->failed)
        e->phase_shared[e->nphases] = e->nrows;
}

/* Opens a phase (phase_ptr[nphases] is where it starts). */
static void rp_emit_phase(rp_csr_emit *e)
{
    if (e->failed ||
        rp_csr_grow((void **)&e->phase_ptr, &e->cap_phase_ptr, e->nphases + 2, sizeof *e->phase_ptr) ||
        rp_csr_grow((void **)&e->phase_shared, &e->cap_phase_shared, e->nphases + 1,
                    sizeof *e->phase_shared)) {
        e->failed = 1;
        return;
    }
    e->phase_shared[e->nphases] = -1;
}

/* Closes the open phase, dropping it when it has no rows. */
static void rp_emit_phase_end(rp_csr_emit *e)
{
    if (e->failed)
        return;
    const int64_t start = e->phase_ptr[e->nphases];
    if (e->phase_shared[e->nphases] < 0)
        e->phase_shared[e->nphases] = e->nrows;
    if (e->nrows > start)
        e->nphases++;
    e->phase_ptr[e->nphases] = e->nrows;
}

static void rp_emit_copy(rp_csr_emit *e, uint32_t dst, uint32_t src, int64_t len)
{
    for (int64_t i = 0; i < len; i++) {
        rp_emit_term(e, src + (uint32_t)i, RP_CSR_ONE);
        rp_emit_row(e, dst + (uint32_t)i);
    }
}

/* The address of M's value q. */
static uint32_t rp_csr_val(const rp_csr_mat *M, int64_t q)
{
    return M->addr + (uint32_t)(M->vmap != NULL ? M->vmap[q] : q);
}

/* out = M in, M's rows in CSR order. */
static void rp_emit_matvec(rp_csr_emit *e, const rp_csr_mat *M, uint32_t in, uint32_t out)
{
    for (int64_t i = 0; i < M->rows; i++) {
        for (int64_t q = M->indptr[i]; q < M->indptr[i + 1]; q++)
            rp_emit_term(e, rp_csr_val(M, q), in + (uint32_t)M->indices[q]);
        rp_emit_row(e, out + (uint32_t)i);
    }
}

static void rp_emit_product(rp_csr_emit *e, const rp_csr_plan *p, const rp_csr_mat *C)
{
    const rp_csr_mat *A = &p->mats[C->a], *B = &p->mats[C->b];
    for (int64_t q = 0; q < C->nnz; q++) {
        for (int64_t t = C->pair_ptr[q]; t < C->pair_ptr[q + 1]; t++)
            rp_emit_term(e, rp_csr_val(A, C->pair_a[t]), rp_csr_val(B, C->pair_b[t]));
        rp_emit_row(e, C->addr + (uint32_t)q);
    }
}

/* ---- the schedule ----
 *
 * rp_walk_up, rp_walk_middle and rp_walk_down traverse the schedule of
 * rp_scan_run specialised to the plan's slots, step by step over whole
 * matrices and vectors, and tell a visitor each step in order. The program
 * (rp_csr_compile) and the cuSPARSE peer's step table (rp_csr_plan_schedule)
 * are two visitors of this one traversal, so the two cannot drift apart.
 * Vectors by index: vector s <= N is slot s's, N + 1 and N + 2 the middle's
 * two spares; matrices by id. */

typedef struct {
    void *ctx;
    /* RP_CSR_GEMM (m = the product), RP_CSR_MV (y = M x), RP_CSR_COPY (len
     * floats of x to y); unused arguments -1 (len 0) */
    void (*step)(void *ctx, int64_t kind, int64_t m, int64_t x, int64_t y, int64_t len);
    /* the program's phases: RP_WALK_OPEN, RP_WALK_SHARED (the phase's rows
     * from here on are shared), RP_WALK_CLOSE */
    void (*phase)(void *ctx, int mark);
} rp_csr_visitor;

enum { RP_WALK_OPEN, RP_WALK_SHARED, RP_WALK_CLOSE };

static void rp_walk_mv(const rp_csr_visitor *v, int64_t m, int64_t x, int64_t y)
{
    v->step(v->ctx, RP_CSR_MV, m, x, y, 0);
}

static void rp_walk_copy(const rp_csr_visitor *v, int64_t x, int64_t y, int64_t len)
{
    v->step(v->ctx, RP_CSR_COPY, -1, x, y, len);
}

/* Up-sweep level d: the spine's mat-vec and the products off it, those of
 * per-sequence operands first, then the shared ones. */
static void rp_walk_up(const rp_csr_plan *p, const rp_csr_visitor *v, int d)
{
    const int64_t half = (int64_t)1 << d, step = half << 1;
    v->phase(v->ctx, RP_WALK_OPEN);
    for (int shared = 0; shared < 2; shared++) {
        if (shared)
            v->phase(v->ctx, RP_WALK_SHARED);
        for (int64_t i = 0; i + step - 1 < p->nslots; i += step) {
            const int64_t l = i + half - 1, r = i + step - 1;
            if (i == 0) {
                if (!shared) /* a vector: a[r]'s map applied to a[l]'s vector */
                    rp_walk_mv(v, rp_csr_map_at(p, r, d), l, r);
                continue;
            }
            const int64_t c = p->prod[r * p->stride + d];
            if (p->mats[c].shared == shared)
                v->step(v->ctx, RP_CSR_GEMM, c, -1, -1, 0);
        }
    }
    v->phase(v->ctx, RP_WALK_CLOSE);
}

/* The linear scan over the block ends (rp_middle): P_1 is the up-sweep
 * vector of e_0, P_j = a[e_{j-1}] P_{j-1}; slot e_{j-1} receives P_{j-1} and
 * the last block end the last P. The running P alternates between the two
 * spare vectors, so each step is one phase. */
static void rp_walk_middle(const rp_csr_plan *p, const rp_csr_visitor *v)
{
    const int64_t block = (int64_t)1 << p->levels, nb = (p->nslots + block) / block;
    const int64_t last = rp_min64(nb * block - 1, p->nslots);
    int64_t run = block - 1;
    if (nb < 2)
        return;
    if (nb == 2) {
        v->phase(v->ctx, RP_WALK_OPEN);
        rp_walk_copy(v, run, last, rp_csr_prefix_len_of(p, block));
        v->phase(v->ctx, RP_WALK_CLOSE);
        return;
    }
    for (int64_t j = 2; j < nb; j++) {
        const int64_t end = j * block - 1; /* e_{j-1} */
        const int64_t next = j + 1 < nb ? p->nslots + 1 + j % 2 : last;
        v->phase(v->ctx, RP_WALK_OPEN);
        rp_walk_mv(v, rp_csr_map_at(p, end, p->levels), run, next);
        rp_walk_copy(v, run, end, rp_csr_prefix_len_of(p, (j - 1) * block));
        v->phase(v->ctx, RP_WALK_CLOSE);
        run = next;
    }
}

/* Down-sweep level d (rp_down_level): (a[l], a[r]) = (a[r], a[r] <> a[l]),
 * r clamped to the spare slot. The left child's copy of a[r]'s vector comes
 * first; the mat-vec then reads that copy, so a[r] can be overwritten. */
static void rp_walk_down(const rp_csr_plan *p, const rp_csr_visitor *v, int d)
{
    const int64_t half = (int64_t)1 << d, step = half << 1;
    v->phase(v->ctx, RP_WALK_OPEN);
    for (int64_t l = half - 1; l < p->nslots; l += step) {
        const int64_t r = rp_min64(l + half, p->nslots);
        if (l == half - 1) /* a range starting at slot 0: its prefix is the identity */
            rp_walk_copy(v, l, r, rp_csr_prefix_len_of(p, l + 1));
        else
            rp_walk_copy(v, r, l, rp_csr_prefix_len_of(p, l - half + 1));
    }
    v->phase(v->ctx, RP_WALK_CLOSE);
    v->phase(v->ctx, RP_WALK_OPEN);
    for (int64_t l = step + half - 1; l < p->nslots; l += step)
        rp_walk_mv(v, rp_csr_map_at(p, l, p->levels), l, rp_min64(l + half, p->nslots));
    v->phase(v->ctx, RP_WALK_CLOSE);
}

/* The whole scan: the up-sweep, the middle, the down-sweep. */
static void rp_csr_walk(const rp_csr_plan *p, const rp_csr_visitor *v)
{
    for (int d = 0; d < p->levels; d++)
        rp_walk_up(p, v, d);
    rp_walk_middle(p, v);
    for (int d = p->levels - 1; d >= 0; d--)
        rp_walk_down(p, v, d);
}

/* ---- the step table: the visitor that records each step ---- */

typedef struct {
    rp_csr_schedule *s;
    int64_t cap;
    int failed; /* out of memory */
} rp_table_visit;

static void rp_table_step(void *ctx, int64_t kind, int64_t m, int64_t x, int64_t y, int64_t len)
{
    rp_table_visit *w = ctx;
    rp_csr_schedule *s = w->s;
    if (w->failed || rp_csr_grow((void **)&s->steps, &w->cap, (s->nsteps + 1) * RP_CSR_STEP_COLS,
                                 sizeof *s->steps)) {
        w->failed = 1;
        return;
    }
    int64_t *row = &s->steps[s->nsteps++ * RP_CSR_STEP_COLS];
    row[0] = kind, row[1] = m, row[2] = x, row[3] = y, row[4] = len;
}

/* The peer runs its steps in order: it has no phases. */
static void rp_table_phase(void *ctx, int mark) { (void)ctx, (void)mark; }

void rp_csr_schedule_free(rp_csr_schedule *s)
{
    if (s == NULL)
        return;
    free(s->steps), free(s->products);
    memset(s, 0, sizeof *s);
}

int rp_csr_plan_schedule(const rp_csr_plan *p, rp_csr_schedule *out, rp_error *err)
{
    rp_table_visit w = {out, 0, 0};
    memset(out, 0, sizeof *out);
    out->nproducts = p->nmats - p->n, out->nvectors = p->nslots + 3, out->width = p->max_vec;
    out->products = malloc((size_t)(out->nproducts > 0 ? out->nproducts : 1) * RP_CSR_PRODUCT_COLS *
                           sizeof *out->products);
    if (out->products == NULL)
        return rp_set_error(err, RP_ERUNTIME, "csr schedule: out of memory");
    for (int64_t j = 0; j < out->nproducts; j++) {
        const rp_csr_mat *C = &p->mats[p->n + j];
        int64_t *row = &out->products[j * RP_CSR_PRODUCT_COLS];
        row[0] = C->a, row[1] = C->b, row[2] = C->rows, row[3] = C->cols, row[4] = C->shared;
    }
    rp_csr_walk(p, &(rp_csr_visitor){&w, rp_table_step, rp_table_phase});
    if (w.failed) {
        rp_csr_schedule_free(out);
        return rp_set_error(err, RP_ERUNTIME, "csr schedule: out of memory");
    }
    return RP_OK;
}

/* ---- the program: the visitor that emits each step's rows ---- */

typedef struct {
    const rp_csr_plan *p;
    rp_csr_emit *e;
} rp_program_visit;

/* Vector v's address: the slots' vectors, then the spares, max_vec apart. */
static uint32_t rp_csr_vec_addr(const rp_csr_plan *p, int64_t v)
{
    return p->vec0 + (uint32_t)(v * p->max_vec);
}

static void rp_program_step(void *ctx, int64_t kind, int64_t m, int64_t x, int64_t y, int64_t len)
{
    const rp_program_visit *w = ctx;
    if (kind == RP_CSR_GEMM)
        rp_emit_product(w->e, w->p, &w->p->mats[m]);
    else if (kind == RP_CSR_MV)
        rp_emit_matvec(w->e, &w->p->mats[m], rp_csr_vec_addr(w->p, x), rp_csr_vec_addr(w->p, y));
    else
        rp_emit_copy(w->e, rp_csr_vec_addr(w->p, y), rp_csr_vec_addr(w->p, x), len);
}

static void rp_program_phase(void *ctx, int mark)
{
    rp_csr_emit *e = ((const rp_program_visit *)ctx)->e;
    if (mark == RP_WALK_OPEN)
        rp_emit_phase(e);
    else if (mark == RP_WALK_SHARED)
        rp_emit_shared_rows(e);
    else
        rp_emit_phase_end(e);
}

/* Takes n floats of an address space; 0 past the 2^31 a program addresses,
 * tested before the add: layers of 2^62 columns or values would wrap int64. */
static int rp_csr_take(int64_t *space, int64_t n)
{
    const int64_t cap = (int64_t)~RP_CSR_SHARED;
    if (n > cap - *space)
        return 0;
    *space += n;
    return 1;
}

/* Addresses: shared = [1, shared leaves, shared products]; per sequence =
 * [per-sequence leaves, a vector per slot, two spare vectors, per-sequence
 * products]. Products of levels not run get none. */
static int rp_csr_layout(rp_csr_plan *p, rp_error *err)
{
    int64_t seq = 0, shared = 1;
    int fits = 1;
    p->max_vec = 1;
    for (int64_t s = 1; s <= p->nslots; s++)
        p->max_vec = rp_csr_prefix_len_of(p, s) > p->max_vec ? rp_csr_prefix_len_of(p, s) : p->max_vec;
    for (int64_t i = 0; i < p->nmats; i++) { /* leaves, then the products (of the levels run only) */
        rp_csr_mat *m = &p->mats[i];
        if (m->level >= 0)
            m->shared = p->mats[m->a].shared && p->mats[m->b].shared, m->nvalues = m->nnz;
        if (m->shared) /* past 2^31 the addresses wrap, but the plan is refused below */
            m->addr = (uint32_t)shared | RP_CSR_SHARED, fits &= rp_csr_take(&shared, m->nvalues);
        else
            m->addr = (uint32_t)seq, fits &= rp_csr_take(&seq, m->nvalues);
        if (i == p->n - 1) { /* the vectors go between the leaves and the products */
            p->vec0 = (uint32_t)seq;
            fits &= p->max_vec <= (int64_t)~RP_CSR_SHARED / (p->nslots + 3) &&
                    rp_csr_take(&seq, (p->nslots + 3) * p->max_vec);
        }
    }
    if (!fits)
        return rp_set_error(err, RP_EINVAL,
                            "csr plan: the scan needs more than the 2^31 floats a program addresses "
                            "(per sequence or shared); plan fewer levels or set max_pairs");
    p->program.seq_floats = seq, p->program.shared_floats = shared;
    return RP_OK;
}

/* Compiles the schedule; the pair lists, now in the rows, are freed. */
static int rp_csr_compile(rp_csr_plan *p, rp_error *err)
{
    rp_csr_emit *e = &p->code;
    int rc = rp_csr_layout(p, err);
    if (rc != RP_OK)
        return rc;
    e->leaf_addr = malloc((size_t)p->n * sizeof *e->leaf_addr);
    e->g_addr = malloc((size_t)p->n * sizeof *e->g_addr);
    e->term_ptr = calloc(1, sizeof *e->term_ptr);
    e->phase_ptr = calloc(1, sizeof *e->phase_ptr);
    e->cap_term_ptr = e->cap_phase_ptr = 1;
    if (!e->leaf_addr || !e->g_addr || !e->term_ptr || !e->phase_ptr)
        return rp_set_error(err, RP_ERUNTIME, "csr plan: out of memory");
    for (int64_t i = 0; i < p->n; i++) { /* layer i: leaf n - 1 - i; g_i: slot n - i + 1 */
        e->leaf_addr[i] = p->mats[p->n - 1 - i].addr;
        e->g_addr[i] = rp_csr_vec_addr(p, p->n - i + 1);
    }
    rp_program_visit w = {p, e};
    rp_csr_walk(p, &(rp_csr_visitor){&w, rp_program_step, rp_program_phase});
    if (e->failed)
        return rp_set_error(err, RP_ERUNTIME, "csr plan: out of memory for the program");
    for (int64_t i = p->n; i < p->nmats; i++) {
        free(p->mats[i].pair_a), free(p->mats[i].pair_b);
        p->mats[i].pair_a = p->mats[i].pair_b = NULL;
    }
    p->program = (rp_csr_program){p->n, e->nphases, e->nrows, e->nterms, e->phase_ptr, e->phase_shared,
                                  e->dst, e->term_ptr, e->tx, e->ty, p->program.seq_floats,
                                  p->program.shared_floats, e->leaf_addr, e->g_addr, p->vec0};
    return RP_OK;
}

int rp_csr_plan_create(int64_t n, const rp_csr_pattern *leaves, int levels, int64_t max_pairs,
                       const rp_scan_machine *m, rp_csr_plan **out, rp_error *err)
{
    int rc = rp_csr_check_shapes(n, leaves, err);
    rp_csr_plan *p;
    if (rc != RP_OK)
        return rc;
    if (out == NULL || m == NULL)
        return rp_set_error(err, RP_EINVAL, "csr plan: NULL out or machine");
    *out = NULL;
    p = calloc(1, sizeof *p);
    if (p == NULL)
        return rp_set_error(err, RP_ERUNTIME, "csr plan: out of memory");
    p->n = n, p->nslots = n + 1, p->machine = *m;
    p->mats = calloc((size_t)n, sizeof *p->mats);
    if (p->mats == NULL) {
        rp_csr_plan_free(p);
        return rp_set_error(err, RP_ERUNTIME, "csr plan: out of memory");
    }
    rc = rp_csr_copy_leaves(p, leaves, err);
    if (rc != RP_OK) {
        rp_csr_plan_free(p);
        return rc;
    }
    rc = rp_csr_plan_products(p, levels, max_pairs, m);
    if (rc == RP_OK)
        rc = rp_csr_compile(p, err);
    else
        rp_set_error(err, rc, "csr plan: out of memory");
    if (rc != RP_OK) {
        rp_csr_plan_free(p);
        return rc;
    }
    *out = p;
    return RP_OK;
}

const rp_csr_program *rp_csr_plan_program(const rp_csr_plan *p) { return &p->program; }

void rp_csr_plan_describe(const rp_csr_plan *p, rp_csr_plan_info *info)
{
    rp_scan_machine one = {1, 0, 0};
    memset(info, 0, sizeof *info);
    info->levels = p->levels;
    info->cost = rp_csr_cost(p, p->levels, 1, &p->machine, NULL);
    info->seq_floats = p->program.seq_floats, info->shared_floats = p->program.shared_floats;
    rp_csr_cost(p, p->levels, 1, &one, &info->madds);
    rp_csr_cost(p, 0, 1, &one, &info->linear_madds);
    for (int64_t i = p->n; i < p->nmats; i++) { /* the products of the levels run */
        info->products++;
        info->pairs += p->mats[i].pair_ptr[p->mats[i].nnz];
    }
    info->phases = p->program.nphases, info->rows = p->program.nrows, info->terms = p->program.nterms;
}

/* ---- running a program on the CPU ---- */

#define RP_CSR_LANES 8 /* two SSE registers of sums: the portable build's vectors */

/* Lanes [b0, b0 + W) of row r: dst = sum over its terms of x * y, per lane
 * in increasing t. W is a constant at every call (the function is always
 * inlined), so the W sums stay in registers and each term is one vector
 * multiply and add; a runtime-width loop over b costs a loop, its aliasing
 * checks and a scalar tail per term, which left 4 sequences at 3x the time
 * of one. A row's terms all read the same pair of buffers (a mat-vec: the
 * map's values and a vector; a product: its operands'; a copy: a vector and
 * the 1), so the case is read off its first term. Lane b of dst depends
 * only on lane b of what the row reads, so the row may write lanes as it
 * goes even where it reads its own dst. */
static inline __attribute__((always_inline)) void
rp_csr_row_lanes(const rp_csr_program *g, int64_t r, int64_t B, int64_t b0, const int W,
                 float *seq, const float *shared)
{
    const int64_t t0 = g->term_ptr[r], t1 = g->term_ptr[r + 1];
    const uint32_t *restrict tx = g->tx, *restrict ty = g->ty, low = ~RP_CSR_SHARED;
    float acc[RP_CSR_LANES]; /* W <= RP_CSR_LANES; the first W used */
    for (int w = 0; w < W; w++)
        acc[w] = 0.0f;
    const int shared_x = t0 < t1 && (tx[t0] & RP_CSR_SHARED), shared_y = t0 < t1 && (ty[t0] & RP_CSR_SHARED);
    if (!shared_x && !shared_y) {
        for (int64_t t = t0; t < t1; t++) {
            const float *x = seq + (int64_t)tx[t] * B + b0, *y = seq + (int64_t)ty[t] * B + b0;
            for (int w = 0; w < W; w++)
                acc[w] += x[w] * y[w];
        }
    } else if (shared_x != shared_y) { /* one operand the same for every sequence */
        const uint32_t *restrict one = shared_x ? tx : ty, *restrict per = shared_x ? ty : tx;
        for (int64_t t = t0; t < t1; t++) {
            const float s = shared[one[t] & low], *v = seq + (int64_t)per[t] * B + b0;
            for (int w = 0; w < W; w++)
                acc[w] += s * v[w]; /* float multiplication commutes: x * y either way */
        }
    } else { /* two shared operands (plans write such sums to shared): one sum for every lane */
        float sum = 0.0f;
        for (int64_t t = t0; t < t1; t++)
            sum += shared[tx[t] & low] * shared[ty[t] & low];
        for (int w = 0; w < W; w++)
            acc[w] = sum;
    }
    float *dst = seq + (int64_t)g->dst[r] * B + b0;
    for (int w = 0; w < W; w++)
        dst[w] = acc[w];
}

/* Per-sequence rows [lo, hi) for B sequences: blocks of RP_CSR_LANES lanes,
 * then the rest in one block of its own constant width. */
static void rp_csr_rows_batch(const rp_csr_program *g, int64_t lo, int64_t hi, int64_t B, float *seq,
                              const float *shared)
{
    const int64_t full = B - B % RP_CSR_LANES;
    for (int64_t r = lo; r < hi; r++) {
        for (int64_t b0 = 0; b0 < full; b0 += RP_CSR_LANES)
            rp_csr_row_lanes(g, r, B, b0, RP_CSR_LANES, seq, shared);
        switch (B - full) {
        case 0: break;
        case 1: rp_csr_row_lanes(g, r, B, full, 1, seq, shared); break;
        case 2: rp_csr_row_lanes(g, r, B, full, 2, seq, shared); break;
        case 3: rp_csr_row_lanes(g, r, B, full, 3, seq, shared); break;
        case 4: rp_csr_row_lanes(g, r, B, full, 4, seq, shared); break;
        case 5: rp_csr_row_lanes(g, r, B, full, 5, seq, shared); break;
        case 6: rp_csr_row_lanes(g, r, B, full, 6, seq, shared); break;
        default: rp_csr_row_lanes(g, r, B, full, 7, seq, shared); break;
        }
    }
}

/* Shared rows [lo, hi): they read and write only the shared buffer, one sum
 * per row for the whole batch. */
static void rp_csr_rows_shared(const rp_csr_program *g, int64_t lo, int64_t hi, float *shared)
{
    const uint32_t low = ~RP_CSR_SHARED;
    for (int64_t r = lo; r < hi; r++) {
        float sum = 0.0f;
        for (int64_t t = g->term_ptr[r]; t < g->term_ptr[r + 1]; t++)
            sum += shared[g->tx[t] & low] * shared[g->ty[t] & low];
        shared[g->dst[r] & low] = sum;
    }
}

int rp_csr_run_cpu(const rp_csr_program *g, int64_t batch, float *seq, float *shared,
                   int num_threads, rp_error *err)
{
    if (g == NULL || (batch > 0 && (seq == NULL || shared == NULL)))
        return rp_set_error(err, RP_EINVAL, "csr run: NULL program, seq or shared");
    if (batch < 0)
        return rp_set_error(err, RP_EINVAL, "csr run: batch must be >= 0");
    if (batch == 0)
        return RP_OK;
    const int threads = rp_threads(num_threads);
    for (int64_t ph = 0; ph < g->nphases; ph++) {
        const int64_t lo = g->phase_ptr[ph], mid = g->phase_shared[ph], hi = g->phase_ptr[ph + 1];
        const int64_t chunk = 64, tasks = (hi - lo + chunk - 1) / chunk;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (tasks > 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t a = lo + task * chunk, z = rp_min64(a + chunk, hi);
            if (a < mid)
                rp_csr_rows_batch(g, a, rp_min64(z, mid), batch, seq, shared);
            if (z > mid)
                rp_csr_rows_shared(g, a > mid ? a : mid, z, shared);
        }
    }
    return RP_OK;
}

#define RP_CSR_GRADIENTS_PARALLEL (1 << 18) /* floats: below, threads cost more than the copy */

/* Every layer's input gradient g_i out of the program's seq buffer
 * (batch-minor) into out[i], batch-major: out[i][b * rows + o] =
 * seq[(g_addr[i] + o) * batch + b], rows the layer's inputs; *finite says
 * whether all of them are. One pass for ChainPlan.backward, where a torch
 * copy and a sum per layer took longer than a small chain's scan. */
int rp_csr_gradients_cpu(const rp_csr_plan *p, int64_t batch, const float *seq, float *const *out,
                         int num_threads, int *finite, rp_error *err)
{
    if (p == NULL || finite == NULL || (batch > 0 && (seq == NULL || out == NULL)))
        return rp_set_error(err, RP_EINVAL, "csr gradients: NULL plan, seq, out or finite");
    if (batch < 0)
        return rp_set_error(err, RP_EINVAL, "csr gradients: batch must be >= 0");
    const int64_t n = p->n;
    int64_t total = 0, bad = 0;
    for (int64_t i = 0; i < n; i++)
        total += p->mats[n - 1 - i].rows * batch;
#pragma omp parallel for schedule(dynamic, 1) num_threads(rp_threads(num_threads)) reduction(+ : bad) \
    if (total >= RP_CSR_GRADIENTS_PARALLEL)
    for (int64_t i = 0; i < n; i++) { /* layer i: leaf n - 1 - i (rp_csr_compile) */
        const int64_t rows = p->mats[n - 1 - i].rows, len = rows * batch;
        const float *restrict src = seq + (int64_t)p->program.g_addr[i] * batch;
        float *restrict dst = out[i];
        int nonfinite = 0;
        for (int64_t k = 0; k < len; k++) /* a compare that vectorizes, false for inf and NaN */
            nonfinite |= !(fabsf(src[k]) <= FLT_MAX);
        for (int64_t b = 0; b < batch; b++) /* contiguous writes, strided reads */
            for (int64_t o = 0; o < rows; o++)
                dst[b * rows + o] = src[o * batch + b];
        bad += nonfinite;
    }
    *finite = bad == 0;
    return RP_OK;
}
