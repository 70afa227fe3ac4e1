/*
 * fad.c: nested forward-AD activations on the CPU.
 *
 * Forward evaluates y = f(x) and d = f'(x) in one pass (fad_math.h), so
 * backward needs only d: grad_x = grad_y * d. d is stored as float32,
 * float16, bfloat16 or one 8-bit code per element (a codebook lookup, see
 * rp_fad_codebook in reprop.h), or not at all.
 *
 * The work is cut into chunks of RP_FAD_CHUNK elements (OpenMP over chunks
 * for large n), each chunk into blocks of RP_FAD_BLOCK elements that go
 * through three tight loops on the stack:
 *
 *   x block (x's dtype) -> float32 xb -> kind loop -> float32 yb, db
 *                                                   -> y (x's dtype), d (d_store)
 *
 * Every loop is compiled for AVX-512, AVX2 and baseline x86-64 and picked at
 * run time. The kind loops call rp_fad_eval with a literal kind, so its
 * switch folds and GCC vectorizes the branch-free math. Results are per
 * element and therefore independent of the thread count.
 *
 * Shapes: x, y, d, grad_y, grad_x and codes are flat arrays of n elements.
 */
/* Two GCC options for this file only, neither of which changes a result:
 * no-trapping-math, because GCC if-converts the float compares of
 * fad_math.h's selects for AVX2 only when they may be assumed not to trap
 * (FP exception flags are not part of our contract); no-tree-pre, because
 * partial-redundancy elimination threads constants of one inlined function
 * (e.g. exp's clamped tail) into the selects of the next (log1p in Mish,
 * LogSigmoid, Softplus) as boolean phis the vectorizer cannot handle. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math", "no-tree-pre")
#endif

#include <float.h>
#include <math.h>
#include <string.h>

#include "fad_math.h"
#include "reprop.h"
#include "rp_internal.h"

/* Elements per stack block: the three float32 buffers (6 KiB) stay in L1. */
#define RP_FAD_BLOCK 512
/* Elements per OpenMP work item, a multiple of RP_FAD_BLOCK. */
#define RP_FAD_CHUNK ((int64_t)16384)
/* Below this many elements a single thread wins over a fork/join. */
#define RP_FAD_PARALLEL_MIN ((int64_t)32768)

/* ---------------------------------------------------------------------------
 * Codebook
 * ------------------------------------------------------------------------- */

/* Relative widening of a derivative range on its open sides: the float32 d
 * may exceed the exact extreme by a few ulp. */
#define RP_FAD_MARGIN (1.0 / 512.0)
/* Smallest grid step, so that inv_step stays finite for degenerate ranges
 * (e.g. ELU with alpha ~ 1e-40); the decoding error is then below 2^-103. */
#define RP_FAD_MIN_STEP 0x1p-102
/* A two-valued derivative {0, v} has step |v| for every normal v, whose
 * encoding v * (1 / |v|) rounds to +-1; a subnormal v (where 1 / |v| may be
 * inf, and is inexact) decodes to 0 or this step, the nearer. */
#define RP_FAD_MIN_TWO_VALUED_STEP FLT_MIN

/* Range [lo, hi] of f' over all x, in double. The extremes of the smooth
 * parameter-free activations were found once offline with mpmath (at
 * x = -+1.4142 for GELU, -+1.4185 for the tanh form, -+2.3994 for SiLU, and
 * -2.2564 / 1.4906 for Mish). */
static void rp_fad_deriv_range(int kind, float p0, double *lo, double *hi)
{
    *lo = 0.0;
    *hi = 1.0;
    switch (kind) {
    case RP_FAD_GELU:
        *lo = -0.128904145185;
        *hi = 1.12890414519;
        break;
    case RP_FAD_GELU_TANH:
        *lo = -0.128993068659;
        *hi = 1.12899306866;
        break;
    case RP_FAD_SILU:
        *lo = -0.0998393201289;
        *hi = 1.09983932013;
        break;
    case RP_FAD_MISH:
        *lo = -0.112526122389;
        *hi = 1.08849816125;
        break;
    case RP_FAD_SIGMOID: /* s (1 - s) */
        *hi = 0.25;
        break;
    case RP_FAD_ELU: /* alpha e^x for x <= 0 */
        *lo = p0 < 0.0f ? (double)p0 : 0.0;
        *hi = p0 > 0.0f ? (double)p0 : 0.0;
        break;
    case RP_FAD_CELU: /* e^(x/alpha) for x <= 0: in (0, 1] (rp_fad_check refuses alpha < 0) */
        break;
    case RP_FAD_SELU: /* alpha scale e^x for x <= 0 */
        *hi = (double)(RP_SELU_ALPHA * RP_SELU_SCALE);
        break;
    case RP_FAD_HARDSWISH: /* x/3 + 1/2 on [-3, 3) */
        *lo = -0.5;
        *hi = 1.5;
        break;
    default: /* Softplus, Tanh, LogSigmoid, Softsign, Tanhshrink: within [0, 1] */
        break;
    }
}

/* The grid of a two-valued derivative {0, v}: step v, so that v decodes
 * exactly (value[zero_code +- 1] = +-step). */
static int rp_fad_two_valued(int kind, float p0, float *v)
{
    if (kind == RP_FAD_LEAKY_RELU) {
        *v = p0;
        return 1;
    }
    if (kind == RP_FAD_HARDSIGMOID) {
        *v = 1.0f / 6.0f;
        return 1;
    }
    return 0;
}

/* The constant slope that RP_FAD_CODE_EXACT stands for, NaN when the kind
 * has none (the code is then never produced). */
static float rp_fad_exact_value(int kind)
{
    switch (kind) {
    case RP_FAD_ELU:
    case RP_FAD_CELU:
    case RP_FAD_LEAKY_RELU:
    case RP_FAD_HARDSWISH:
    case RP_FAD_SOFTPLUS:
        return 1.0f;
    case RP_FAD_SELU:
        return RP_SELU_SCALE;
    default:
        return rp_bits_to_f32(RP_F32_QNAN);
    }
}

/* Rounds a positive step to 16 significant bits, so that every grid value
 * (c - zero_code) * step (an 8-bit integer times it) is exact in float: up,
 * unless that takes the step past `limit` (a grid end near FLT_MAX, ELU's
 * |alpha| ~ 3.4e38, would decode as inf); down then, which moves the far end
 * by under 2^-16 of it, far less than half a step. That keeps the grid
 * finite where the unrounded step is within `limit`, as it is for the
 * one-sided ranges of every kind with a parameter. */
static double rp_fad_round_step(double step, double limit)
{
    int e;
    double m = frexp(step, &e); /* step = m 2^e, m in [0.5, 1) */
    double up = ldexp(ceil(ldexp(m, 16)), e - 16);
    return up <= limit ? up : ldexp(floor(ldexp(m, 16)), e - 16);
}

/* Grid of GRID points over [lo, hi] (lo <= 0 <= hi) with 0 on a point. */
static void rp_fad_grid(double lo, double hi, int *zero_code, double *step)
{
    const int n = RP_FAD_CODE_GRID - 1; /* intervals */
    double span = hi - lo;
    int z;
    double s;
    if (lo < 0.0)
        lo = fmax(lo - RP_FAD_MARGIN * span, -FLT_MAX);
    if (hi > 0.0)
        hi = fmin(hi + RP_FAD_MARGIN * span, FLT_MAX);
    /* the range holds 0; when it is only 0 (ELU with alpha = 0), -lo / (hi - lo)
     * is 0 / 0, and converting its NaN to int is undefined behaviour */
    z = hi > lo ? (int)floor(-lo / (hi - lo) * n + 0.5) : 0;
    z = z < 0 ? 0 : (z > n ? n : z);
    /* the step that reaches both ends from the zero point */
    s = 0.0;
    if (z > 0)
        s = -lo / z;
    if (z < n && hi / (n - z) > s)
        s = hi / (n - z);
    s = s < RP_FAD_MIN_STEP ? RP_FAD_MIN_STEP : s;
    *zero_code = z;
    *step = rp_fad_round_step(s, FLT_MAX / (z > n - z ? z : n - z));
}

int rp_fad_codebook_init(int kind, float p0, float p1, rp_fad_codebook *cb, rp_error *err)
{
    double lo, hi, step;
    float v, fstep;
    int zero_code, c;
    int rc = rp_fad_check(kind, p0, p1, RP_F32, RP_FAD_CODE8, err);
    if (rc != RP_OK)
        return rc;
    if (cb == NULL)
        return rp_set_error(err, RP_EINVAL, "codebook pointer is NULL");
    if (rp_fad_two_valued(kind, p0, &v)) {
        lo = v < 0.0f ? (double)v : 0.0;
        hi = v > 0.0f ? (double)v : 0.0;
        zero_code = v < 0.0f ? 1 : 0;
        fstep = fabsf(v) < RP_FAD_MIN_TWO_VALUED_STEP ? RP_FAD_MIN_TWO_VALUED_STEP : fabsf(v);
    } else {
        rp_fad_deriv_range(kind, p0, &lo, &hi);
        rp_fad_grid(lo, hi, &zero_code, &step);
        fstep = (float)step; /* exact: 16 significant bits */
    }
    for (c = 0; c < RP_FAD_CODE_GRID; c++)
        cb->value[c] = (float)(c - zero_code) * fstep;
    cb->value[RP_FAD_CODE_EXACT] = rp_fad_exact_value(kind);
    cb->value[RP_FAD_CODE_NAN] = rp_bits_to_f32(RP_F32_QNAN);
    cb->inv_step = 1.0f / fstep;
    cb->zero_code = zero_code;
    cb->lo = (float)lo;
    cb->hi = (float)hi;
    return RP_OK;
}

/* ---------------------------------------------------------------------------
 * Validation
 * ------------------------------------------------------------------------- */

static int rp_fad_dtype_ok(int dtype) { return dtype == RP_F32 || dtype == RP_F16 || dtype == RP_BF16; }

int rp_fad_check(int kind, float p0, float p1, int dtype, int d_store, rp_error *err)
{
    if (kind < 0 || kind >= RP_FAD_KINDS)
        return rp_set_error(err, RP_EINVAL, "unknown activation kind %d", kind);
    if (!rp_fad_dtype_ok(dtype))
        return rp_set_error(err, RP_EINVAL, "unsupported dtype code %d", dtype);
    if (!rp_fad_dtype_ok(d_store) && d_store != RP_FAD_CODE8 && d_store != RP_FAD_NONE)
        return rp_set_error(err, RP_EINVAL, "unsupported derivative storage code %d", d_store);
    if (!isfinite(p0) || !isfinite(p1))
        return rp_set_error(err, RP_EINVAL, "activation parameters must be finite (got %g, %g)",
                            (double)p0, (double)p1);
    if (kind == RP_FAD_CELU && p0 == 0.0f)
        return rp_set_error(err, RP_EINVAL, "CELU alpha must be nonzero");
    /* A grid needs a bounded f'; CELU's e^(x/alpha) grows without bound as
     * x -> -inf when alpha < 0, and clamping it would be silently wrong. */
    if (kind == RP_FAD_CELU && p0 < 0.0f && d_store == RP_FAD_CODE8)
        return rp_set_error(err, RP_EINVAL,
                            "CELU with alpha < 0 has an unbounded derivative: no 8-bit codes");
    return RP_OK;
}

/* Pointers and size of one call; NULL is fine only where nothing is read or written. */
static int rp_fad_check_buffers(int64_t n, const void *a, const void *b, const void *c,
                                rp_error *err)
{
    if (n < 0)
        return rp_set_error(err, RP_EINVAL, "negative element count %lld", (long long)n);
    if (n > 0 && (a == NULL || b == NULL || c == NULL))
        return rp_set_error(err, RP_EINVAL, "NULL data pointer for %lld elements", (long long)n);
    return RP_OK;
}

/* ---------------------------------------------------------------------------
 * Block loops
 * ------------------------------------------------------------------------- */

/* x block (dtype) -> float32. */
RP_TARGET_CLONES static void rp_fad_load(int dtype, const void *restrict src, float *restrict dst,
                                         int64_t len)
{
    int64_t i;
    if (dtype == RP_F32) {
        memcpy(dst, src, (size_t)len * sizeof *dst);
    } else if (dtype == RP_BF16) {
        const uint16_t *s = (const uint16_t *)src;
        for (i = 0; i < len; i++)
            dst[i] = rp_bf16_to_f32(s[i]);
    } else {
        const uint16_t *s = (const uint16_t *)src;
        for (i = 0; i < len; i++)
            dst[i] = rp_f16_to_f32(s[i]);
    }
}

/* float32 -> dtype, rounded to nearest even. */
RP_TARGET_CLONES static void rp_fad_store(int dtype, const float *restrict src, void *restrict dst,
                                          int64_t len)
{
    int64_t i;
    if (dtype == RP_F32) {
        memcpy(dst, src, (size_t)len * sizeof *src);
    } else if (dtype == RP_BF16) {
        uint16_t *o = (uint16_t *)dst;
        for (i = 0; i < len; i++)
            o[i] = rp_f32_to_bf16(src[i]);
    } else {
        uint16_t *o = (uint16_t *)dst;
        for (i = 0; i < len; i++)
            o[i] = rp_f32_to_f16(src[i]);
    }
}

/* Per kind: y and d, y only (d dead, so its math is dropped), and the codes
 * of a block's derivatives. */
#define RP_FAD_DEFINE_KIND(KIND, NAME)                                                             \
    RP_TARGET_CLONES static void rp_fad_yd_##NAME(float p0, float p1, const float *restrict x,      \
                                                  float *restrict y, float *restrict d,            \
                                                  int64_t len)                                      \
    {                                                                                              \
        int64_t i;                                                                                 \
        for (i = 0; i < len; i++)                                                                  \
            rp_fad_eval(KIND, p0, p1, x[i], &y[i], &d[i]);                                         \
    }                                                                                              \
    RP_TARGET_CLONES static void rp_fad_y_##NAME(float p0, float p1, const float *restrict x,       \
                                                 float *restrict y, int64_t len)                   \
    {                                                                                              \
        int64_t i;                                                                                 \
        for (i = 0; i < len; i++) {                                                                \
            float unused;                                                                          \
            rp_fad_eval(KIND, p0, p1, x[i], &y[i], &unused);                                       \
        }                                                                                          \
    }                                                                                              \
    RP_TARGET_CLONES static void rp_fad_code_##NAME(float p0, float p1, const float *restrict x,    \
                                                    const float *restrict d,                       \
                                                    uint8_t *restrict code, float inv_step,        \
                                                    int zero_code, int64_t len)                    \
    {                                                                                              \
        int64_t i;                                                                                 \
        for (i = 0; i < len; i++)                                                                  \
            code[i] = rp_fad_encode(KIND, p0, p1, x[i], d[i], inv_step, zero_code);               \
    }

RP_FAD_DEFINE_KIND(RP_FAD_GELU, gelu)
RP_FAD_DEFINE_KIND(RP_FAD_GELU_TANH, gelu_tanh)
RP_FAD_DEFINE_KIND(RP_FAD_SILU, silu)
RP_FAD_DEFINE_KIND(RP_FAD_MISH, mish)
RP_FAD_DEFINE_KIND(RP_FAD_SOFTPLUS, softplus)
RP_FAD_DEFINE_KIND(RP_FAD_SIGMOID, sigmoid)
RP_FAD_DEFINE_KIND(RP_FAD_TANH, tanh)
RP_FAD_DEFINE_KIND(RP_FAD_ELU, elu)
RP_FAD_DEFINE_KIND(RP_FAD_CELU, celu)
RP_FAD_DEFINE_KIND(RP_FAD_SELU, selu)
RP_FAD_DEFINE_KIND(RP_FAD_LEAKY_RELU, leaky_relu)
RP_FAD_DEFINE_KIND(RP_FAD_HARDSWISH, hardswish)
RP_FAD_DEFINE_KIND(RP_FAD_HARDSIGMOID, hardsigmoid)
RP_FAD_DEFINE_KIND(RP_FAD_LOGSIGMOID, logsigmoid)
RP_FAD_DEFINE_KIND(RP_FAD_SOFTSIGN, softsign)
RP_FAD_DEFINE_KIND(RP_FAD_TANHSHRINK, tanhshrink)

typedef struct {
    void (*yd)(float, float, const float *restrict, float *restrict, float *restrict, int64_t);
    void (*y)(float, float, const float *restrict, float *restrict, int64_t);
    void (*code)(float, float, const float *restrict, const float *restrict, uint8_t *restrict,
                 float, int, int64_t);
} rp_fad_loops;

#define RP_FAD_LOOPS(NAME) {rp_fad_yd_##NAME, rp_fad_y_##NAME, rp_fad_code_##NAME}

/* Indexed by rp_fad_kind. */
static const rp_fad_loops rp_fad_kind_loops[RP_FAD_KINDS] = {
    RP_FAD_LOOPS(gelu),     RP_FAD_LOOPS(gelu_tanh),  RP_FAD_LOOPS(silu),
    RP_FAD_LOOPS(mish),     RP_FAD_LOOPS(softplus),   RP_FAD_LOOPS(sigmoid),
    RP_FAD_LOOPS(tanh),     RP_FAD_LOOPS(elu),        RP_FAD_LOOPS(celu),
    RP_FAD_LOOPS(selu),     RP_FAD_LOOPS(leaky_relu), RP_FAD_LOOPS(hardswish),
    RP_FAD_LOOPS(hardsigmoid), RP_FAD_LOOPS(logsigmoid), RP_FAD_LOOPS(softsign),
    RP_FAD_LOOPS(tanhshrink),
};

/* ---------------------------------------------------------------------------
 * Forward
 * ------------------------------------------------------------------------- */

/* Everything a chunk needs, read-only. */
typedef struct {
    const rp_fad_loops *loops;
    float p0, p1;
    int dtype, d_store;
    const void *x;
    void *y, *d;
    float inv_step; /* RP_FAD_CODE8 only */
    int zero_code;
} rp_fad_fwd;

static size_t rp_fad_size(int store) { return store == RP_F32 ? 4 : (store == RP_FAD_CODE8 ? 1 : 2); }

/* One block [start, start + len), len <= RP_FAD_BLOCK. y may equal x: x is
 * read (or copied) before y is written. */
static void rp_fad_forward_block(const rp_fad_fwd *f, int64_t start, int64_t len)
{
    float xb[RP_FAD_BLOCK], yb[RP_FAD_BLOCK], db[RP_FAD_BLOCK];
    const size_t xsize = rp_fad_size(f->dtype);
    const float *xf = xb;
    if (f->dtype == RP_F32)
        xf = (const float *)f->x + start;
    else
        rp_fad_load(f->dtype, (const char *)f->x + start * (int64_t)xsize, xb, len);

    if (f->d_store == RP_FAD_NONE) {
        f->loops->y(f->p0, f->p1, xf, yb, len);
    } else {
        void *dst = (char *)f->d + start * (int64_t)rp_fad_size(f->d_store);
        float *df = f->d_store == RP_F32 ? (float *)dst : db;
        f->loops->yd(f->p0, f->p1, xf, yb, df, len);
        if (f->d_store == RP_FAD_CODE8)
            f->loops->code(f->p0, f->p1, xf, db, (uint8_t *)dst, f->inv_step, f->zero_code, len);
        else if (f->d_store != RP_F32)
            rp_fad_store(f->d_store, db, dst, len);
    }
    rp_fad_store(f->dtype, yb, (char *)f->y + start * (int64_t)xsize, len);
}

static void rp_fad_forward_chunk(const rp_fad_fwd *f, int64_t start, int64_t end)
{
    int64_t b;
    for (b = start; b < end; b += RP_FAD_BLOCK)
        rp_fad_forward_block(f, b, end - b < RP_FAD_BLOCK ? end - b : RP_FAD_BLOCK);
}

int rp_fad_forward_cpu(int kind, float p0, float p1, int dtype, const void *x, void *y,
                       int d_store, void *d, int64_t n, int num_threads, rp_error *err)
{
    rp_fad_fwd f;
    int64_t nchunks, k;
    int rc = rp_fad_check(kind, p0, p1, dtype, d_store, err);
    if (rc == RP_OK)
        rc = rp_fad_check_buffers(n, x, y, d_store == RP_FAD_NONE ? x : d, err);
    if (rc != RP_OK)
        return rc;
    memset(&f, 0, sizeof f);
    f.loops = &rp_fad_kind_loops[kind];
    f.p0 = p0;
    f.p1 = p1;
    f.dtype = dtype;
    f.d_store = d_store;
    f.x = x;
    f.y = y;
    f.d = d;
    if (d_store == RP_FAD_CODE8) {
        rp_fad_codebook cb;
        rc = rp_fad_codebook_init(kind, p0, p1, &cb, err);
        if (rc != RP_OK)
            return rc;
        f.inv_step = cb.inv_step;
        f.zero_code = cb.zero_code;
    }
    num_threads = rp_omp_threads(num_threads);
    nchunks = (n + RP_FAD_CHUNK - 1) / RP_FAD_CHUNK;

#pragma omp parallel for schedule(static) num_threads(num_threads) if (n >= RP_FAD_PARALLEL_MIN)
    for (k = 0; k < nchunks; k++) {
        int64_t start = k * RP_FAD_CHUNK;
        rp_fad_forward_chunk(&f, start, n - start < RP_FAD_CHUNK ? n : start + RP_FAD_CHUNK);
    }
    return RP_OK;
}

/* ---------------------------------------------------------------------------
 * Backward from 8-bit codes
 * ------------------------------------------------------------------------- */

/* grad_x = grad_y * value[code], out of place and in place (grad_x ==
 * grad_y: one restrict pointer read and written at the same index). */
#define RP_FAD_DEFINE_BACKWARD(SUFFIX, LOAD, STORE)                                                \
    RP_TARGET_CLONES static void rp_fad_bwd_##SUFFIX(const void *restrict g,                      \
                                                     const uint8_t *restrict codes,               \
                                                     const float *restrict value,                 \
                                                     void *restrict out, int64_t len)             \
    {                                                                                              \
        int64_t i;                                                                                 \
        for (i = 0; i < len; i++)                                                                  \
            STORE(out, i, LOAD(g, i) * value[codes[i]]);                                           \
    }                                                                                              \
    RP_TARGET_CLONES static void rp_fad_bwd_inplace_##SUFFIX(void *restrict io,                   \
                                                             const uint8_t *restrict codes,       \
                                                             const float *restrict value,         \
                                                             int64_t len)                         \
    {                                                                                              \
        int64_t i;                                                                                 \
        for (i = 0; i < len; i++)                                                                  \
            STORE(io, i, LOAD(io, i) * value[codes[i]]);                                           \
    }

RP_FAD_DEFINE_BACKWARD(f32, RP_LOAD_F32, RP_STORE_F32)
RP_FAD_DEFINE_BACKWARD(bf16, RP_LOAD_BF16, RP_STORE_BF16)
RP_FAD_DEFINE_BACKWARD(f16, RP_LOAD_F16, RP_STORE_F16)

static void rp_fad_backward_chunk(int dtype, const void *g, const uint8_t *codes,
                                  const float *value, void *out, int64_t start, int64_t len)
{
    const size_t esize = rp_fad_size(dtype);
    const void *gs = (const char *)g + start * (int64_t)esize;
    void *os = (char *)out + start * (int64_t)esize;
    const uint8_t *cs = codes + start;
    int inplace = g == out;
    switch (dtype) {
    case RP_F32:
        inplace ? rp_fad_bwd_inplace_f32(os, cs, value, len) : rp_fad_bwd_f32(gs, cs, value, os, len);
        break;
    case RP_BF16:
        inplace ? rp_fad_bwd_inplace_bf16(os, cs, value, len) : rp_fad_bwd_bf16(gs, cs, value, os, len);
        break;
    default:
        inplace ? rp_fad_bwd_inplace_f16(os, cs, value, len) : rp_fad_bwd_f16(gs, cs, value, os, len);
        break;
    }
}

int rp_fad_backward_code8_cpu(int dtype, const void *grad_y, const uint8_t *codes,
                              const rp_fad_codebook *cb, void *grad_x, int64_t n,
                              int num_threads, rp_error *err)
{
    int64_t nchunks, k;
    int rc;
    if (!rp_fad_dtype_ok(dtype))
        return rp_set_error(err, RP_EINVAL, "unsupported dtype code %d", dtype);
    if (cb == NULL)
        return rp_set_error(err, RP_EINVAL, "codebook pointer is NULL");
    rc = rp_fad_check_buffers(n, grad_y, codes, grad_x, err);
    if (rc != RP_OK)
        return rc;
    num_threads = rp_omp_threads(num_threads);
    nchunks = (n + RP_FAD_CHUNK - 1) / RP_FAD_CHUNK;

#pragma omp parallel for schedule(static) num_threads(num_threads) if (n >= RP_FAD_PARALLEL_MIN)
    for (k = 0; k < nchunks; k++) {
        int64_t start = k * RP_FAD_CHUNK;
        int64_t len = n - start < RP_FAD_CHUNK ? n - start : RP_FAD_CHUNK;
        rp_fad_backward_chunk(dtype, grad_y, codes, cb->value, grad_x, start, len);
    }
    return RP_OK;
}

/* ---------------------------------------------------------------------------
 * Backward from a 16-bit f' of the other 16-bit dtype
 * ------------------------------------------------------------------------- */

/* torch's CPU cast of a float32 NaN to bfloat16 gives 0xffff whatever the
 * NaN's sign and payload (its vector conversion blends all ones into the
 * unordered lanes, and it runs that conversion on tails too); every other
 * value rounds to nearest even, as rp_f32_to_bf16. */
static inline uint16_t rp_fad_f32_to_bf16_as_torch(float f)
{
    return f != f ? (uint16_t)0xffffu : rp_f32_to_bf16(f);
}

/* grad_x = grad_y * d of a bfloat16 grad_y and a float16 d, and of the
 * reverse pair: the float32 product of an 8- and an 11-bit significand is
 * exact (but beyond float32's range), so one rounding to grad_y's dtype
 * gives the bits of torch's promoted multiply and cast, without its
 * float32 temporary. The portable loops convert through rp_internal.h's
 * exact selects; where the CPU has AVX2 and F16C, the loops below convert
 * float16 in hardware (vcvtph2ps / vcvtps2ph, exact both ways but for the
 * final rounding, which is to nearest even as torch's), several times as
 * fast as the selects, which GCC vectorizes poorly. */
RP_TARGET_CLONES static void rp_fad_bwd_bf16_by_f16(const uint16_t *restrict g,
                                                    const uint16_t *restrict d,
                                                    uint16_t *restrict out, int64_t len)
{
    int64_t i;
    for (i = 0; i < len; i++)
        out[i] = rp_fad_f32_to_bf16_as_torch(rp_bf16_to_f32(g[i]) * rp_f16_to_f32(d[i]));
}

RP_TARGET_CLONES static void rp_fad_bwd_f16_by_bf16(const uint16_t *restrict g,
                                                    const uint16_t *restrict d,
                                                    uint16_t *restrict out, int64_t len)
{
    int64_t i;
    for (i = 0; i < len; i++)
        out[i] = rp_f32_to_f16(rp_f16_to_f32(g[i]) * rp_bf16_to_f32(d[i]));
}

typedef void (*rp_fad_mixed16_loop)(const uint16_t *restrict, const uint16_t *restrict,
                                    uint16_t *restrict, int64_t);

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>

#define RP_FAD_F16C __attribute__((target("avx2,f16c")))

/* 8 bfloat16 -> float32: the bits shifted up, exact. */
RP_FAD_F16C static inline __m256 rp_fad_load8_bf16(const uint16_t *p)
{
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* float32 -> 8 bfloat16, rp_fad_f32_to_bf16_as_torch's rounding and NaN. */
RP_FAD_F16C static inline void rp_fad_store8_bf16(uint16_t *p, __m256 v)
{
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_or_si256(r, _mm256_srli_epi32(nan, 16)); /* 0xffff there */
    /* every lane <= 0xffff, so the unsigned saturation of the pack is exact */
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128((__m128i *)p, packed);
}

RP_FAD_F16C static inline void rp_fad_mul8_bf16_by_f16(const uint16_t *g, const uint16_t *d,
                                                     uint16_t *out)
{
    __m256 df = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)d));
    rp_fad_store8_bf16(out, _mm256_mul_ps(rp_fad_load8_bf16(g), df));
}

RP_FAD_F16C static inline void rp_fad_mul8_f16_by_bf16(const uint16_t *g, const uint16_t *d,
                                                     uint16_t *out)
{
    __m256 gf = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
    __m256 p = _mm256_mul_ps(gf, rp_fad_load8_bf16(d));
    _mm_storeu_si128((__m128i *)out, _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT));
}

/* Blocks of 8, the tail (len % 8) through the same vector code on zero-
 * padded copies, so that every element takes the one rounding. */
#define RP_FAD_DEFINE_F16C_LOOP(NAME, MUL8)                                                        \
    RP_FAD_F16C static void NAME(const uint16_t *restrict g, const uint16_t *restrict d,           \
                                 uint16_t *restrict out, int64_t len)                              \
    {                                                                                              \
        uint16_t gt[8] = {0}, dt[8] = {0}, ot[8];                                                  \
        int64_t i, tail = len % 8;                                                                 \
        for (i = 0; i < len - tail; i += 8)                                                        \
            MUL8(g + i, d + i, out + i);                                                           \
        if (tail == 0)                                                                             \
            return;                                                                                \
        memcpy(gt, g + i, (size_t)tail * sizeof *g);                                               \
        memcpy(dt, d + i, (size_t)tail * sizeof *d);                                               \
        MUL8(gt, dt, ot);                                                                          \
        memcpy(out + i, ot, (size_t)tail * sizeof *out);                                           \
    }

RP_FAD_DEFINE_F16C_LOOP(rp_fad_bwd_bf16_by_f16_f16c, rp_fad_mul8_bf16_by_f16)
RP_FAD_DEFINE_F16C_LOOP(rp_fad_bwd_f16_by_bf16_f16c, rp_fad_mul8_f16_by_bf16)
#define RP_FAD_HAS_F16C_LOOPS 1
#endif

static rp_fad_mixed16_loop rp_fad_mixed16_pick(int dtype)
{
#ifdef RP_FAD_HAS_F16C_LOOPS
    if (rp_cpu_has(RP_CPU_F16C))
        return dtype == RP_BF16 ? rp_fad_bwd_bf16_by_f16_f16c : rp_fad_bwd_f16_by_bf16_f16c;
#endif
    return dtype == RP_BF16 ? rp_fad_bwd_bf16_by_f16 : rp_fad_bwd_f16_by_bf16;
}

int rp_fad_backward_mixed16_cpu(int dtype, const void *grad_y, const void *d, void *grad_x,
                                int64_t n, int num_threads, rp_error *err)
{
    rp_fad_mixed16_loop loop;
    int64_t nchunks, k;
    int rc;
    if (dtype != RP_BF16 && dtype != RP_F16)
        return rp_set_error(err, RP_EINVAL, "unsupported dtype code %d (bfloat16 or float16)",
                            dtype);
    rc = rp_fad_check_buffers(n, grad_y, d, grad_x, err);
    if (rc != RP_OK)
        return rc;
    loop = rp_fad_mixed16_pick(dtype);
    num_threads = rp_omp_threads(num_threads);
    nchunks = (n + RP_FAD_CHUNK - 1) / RP_FAD_CHUNK;

#pragma omp parallel for schedule(static) num_threads(num_threads) if (n >= RP_FAD_PARALLEL_MIN)
    for (k = 0; k < nchunks; k++) {
        int64_t start = k * RP_FAD_CHUNK;
        int64_t len = n - start < RP_FAD_CHUNK ? n - start : RP_FAD_CHUNK;
        loop((const uint16_t *)grad_y + start, (const uint16_t *)d + start,
             (uint16_t *)grad_x + start, len);
    }
    return RP_OK;
}
