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
 * The schedule (rp_scan_run) calls back per (slot pair, sequence), so the
 * dense/structured recurrence and the sparse chain share it; OpenMP runs the
 * pairs of a level and the sequences in parallel, the middle per sequence.
 */
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
    /* length of the prefix vector slot s receives: the input size of its map */
    int64_t (*prefix_len)(void *ctx, int64_t s);
} rp_scan_sched;

int rp_scan_max_levels(int64_t n)
{
    int k = 0;
    while (((int64_t)1 << k) < n + 1)
        k++;
    return k > 0 ? k - 1 : 0;
}

static int64_t rp_min64(int64_t a, int64_t b) { return a < b ? a : b; }

static void rp_copy(float *restrict dst, const float *restrict src, int64_t len)
{
    if (dst != src)
        memcpy(dst, src, (size_t)len * sizeof *dst);
}

static int rp_threads(int num_threads)
{
    return num_threads > 0 ? num_threads : rp_omp_max_threads();
}

/* Per-thread scratch: the callbacks' work area, then three vectors. */
static int64_t rp_sched_scratch(const rp_scan_sched *s) { return s->work_floats + 3 * s->max_vec; }

static float *rp_thread_scratch(const rp_scan_sched *s, float *scratch)
{
#ifdef _OPENMP
    return scratch + (int64_t)omp_get_thread_num() * rp_sched_scratch(s);
#else
    return scratch;
#endif
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
        if (p == 0) {
            /* the prefix of a range starting at slot 0 is the identity */
            rp_copy(vr, vl, s->prefix_len(s->ctx, r));
        } else {
            float *work = rp_thread_scratch(s, scratch), *out = work + s->work_floats;
            s->apply(s->ctx, l, b, vr, out, work);
            rp_copy(vl, vr, s->prefix_len(s->ctx, l));
            rp_copy(vr, out, s->prefix_len(s->ctx, r));
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
            rp_copy(s->vec(s->ctx, e, b), run, s->prefix_len(s->ctx, e));
            t = run, run = next, next = t;
        }
        rp_copy(s->vec(s->ctx, last, b), run, s->prefix_len(s->ctx, last));
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
 * mats (n / 2, B, H, H): the up-sweep product of odd slot s at (s - 1) / 2.
 * A slot's map is its leaf until level 0 combines it (odd slots, L >= 1).
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
    return x->mats + (((s - 1) / 2) * x->B + b) * x->H * x->H;
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

static const float *rp_leaf_v(const rp_rec_ctx *x, int64_t t, int64_t b)
{
    return x->j->v + (t * x->B + b) * x->G * x->H;
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
    for (int64_t r = 0; r < GH; r++)
        work[r] = v[r] * in[r % H];
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
    for (int64_t r = 0; r < GH; r++)
        for (int64_t m = 0; m < H; m++)
            work[r * H + m] = v[r] * X[(r % H) * H + m];
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
                acc += w[(k * H + m) * H + i] * v[k * H + m];
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

int64_t rp_scan_workspace_floats(int64_t n, int64_t batch, int64_t dim)
{
    return (n + 1) * batch * dim + (n / 2) * batch * dim * dim;
}

int rp_scan_check(const rp_scan_jacobians *j, const float *c, const float *g, int levels,
                  const float *work, rp_error *err)
{
    if (j == NULL || c == NULL || g == NULL)
        return rp_set_error(err, RP_EINVAL, "scan: NULL jacobians, c or g");
    if (j->n < 1 || j->batch < 0 || j->dim < 1)
        return rp_set_error(err, RP_EINVAL, "scan: need n >= 1, batch >= 0, dim >= 1 (got %lld, %lld, %lld)",
                            (long long)j->n, (long long)j->batch, (long long)j->dim);
    if (j->gates < 0)
        return rp_set_error(err, RP_EINVAL, "scan: gates must be >= 0 (got %d)", j->gates);
    if (j->gates > 0 && (j->w == NULL || j->v == NULL))
        return rp_set_error(err, RP_EINVAL, "scan: structured leaves need w and v");
    if (j->gates == 0 && j->jt == NULL)
        return rp_set_error(err, RP_EINVAL, "scan: dense leaves need jt");
    if (levels < 0 || levels > rp_scan_max_levels(j->n))
        return rp_set_error(err, RP_EINVAL, "scan: levels must be in [0, %d] for n = %lld (got %d)",
                            rp_scan_max_levels(j->n), (long long)j->n, levels);
    if (work == NULL && j->batch > 0)
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

static void rp_rec_store(const rp_rec_ctx *x, float *g)
{
    const int64_t row = x->B * x->H;
    for (int64_t s = 1; s <= x->n; s++)
        memcpy(g + (x->n - s) * row, x->vecs + s * row, (size_t)row * sizeof *g);
}

int rp_scan_cpu(const rp_scan_jacobians *j, const float *c, float *g, int levels, float *work,
                int num_threads, rp_error *err)
{
    int rc = rp_scan_check(j, c, g, levels, work, err);
    if (rc != RP_OK || j->batch == 0)
        return rc;
    rp_rec_ctx x = {j, j->n, j->batch, j->dim, j->gates, levels, work, NULL};
    x.mats = work + (j->n + 1) * j->batch * j->dim;
    const int64_t G = j->gates > 0 ? j->gates : 1, H = j->dim;
    rp_scan_sched s = {j->n, j->batch, levels, H * H + G * H * H + G * H + H, H, &x,
                       rp_rec_combine, rp_rec_apply, rp_rec_vec, rp_rec_len};
    rp_rec_load(&x, c);
    if (rp_scan_run(&s, num_threads) != 0)
        return rp_set_error(err, RP_ERUNTIME, "scan: out of memory for the per-thread scratch");
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

double rp_scan_cost(int64_t n, int64_t batch, int64_t dim, int gates, int levels,
                    const rp_scan_machine *m)
{
    const double H = (double)dim, G = gates > 0 ? gates : 1, B = (double)batch;
    const double W = m->workers > 1 ? m->workers : 1;
    const double leaf_mm = G * H * H * H + H * H * G, mm = H * H * H;
    const double leaf_mv = G * H * H + G * H, mv = H * H;
    const int64_t block = (int64_t)1 << levels, nb = (n + block) / block;
    double t = 0.0;
    for (int d = 0; d < levels; d++) {
        const int64_t half = (int64_t)1 << d;
        const double up = (double)(n / (2 * half)), down = (double)((n - half) / (2 * half) + 1);
        t += rp_rounds(up * B, W) * (d == 0 ? leaf_mm : mm) + m->level_cost;
        t += rp_rounds(down * B, W) * (d == 0 ? leaf_mv : mv) + m->level_cost;
    }
    if (nb > 2) /* the middle: one sequence per worker, nb - 2 dependent steps */
        t += (double)(nb - 2) * (rp_rounds(B, W) * (levels == 0 ? leaf_mv : mv) + m->step_cost);
    return t;
}

int rp_scan_choose_levels(int64_t n, int64_t batch, int64_t dim, int gates,
                          const rp_scan_machine *m)
{
    int best = 0;
    double best_cost = rp_scan_cost(n, batch, dim, gates, 0, m);
    for (int L = 1; L <= rp_scan_max_levels(n); L++) {
        const double c = rp_scan_cost(n, batch, dim, gates, L, m);
        if (c < best_cost)
            best = L, best_cost = c;
    }
    return best;
}
