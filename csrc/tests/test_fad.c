/*
 * test_fad.c: unit tests of the nested forward-AD activations (csrc/fad.c,
 * csrc/fad_math.h), built and run by .ci/run under AddressSanitizer and
 * UndefinedBehaviorSanitizer.
 *
 * The Python suite compares against torch; these tests cover what it cannot
 * see: the float elementary functions over the whole float range against
 * double-precision libm (max ulp error), f and f' of every kind against
 * double-precision formulas, bf16/fp16 storage, the 8-bit codebook (error
 * bound, exact zero and exact codes), in-place calls, error statuses, and
 * OpenMP results equal to a single thread's bit for bit.
 */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../fad_math.h"
#include "../reprop.h"
#include "../rp_internal.h"

#include "check.h"

static uint32_t rng_state = 12345u;

static float rand_uniform(float lo, float hi)
{
    rng_state = rng_state * 1664525u + 1013904223u;
    return lo + (hi - lo) * ((float)((rng_state >> 8) & 0xffffffu) / 16777216.0f);
}

static int same_bits(float a, float b) { return rp_f32_to_bits(a) == rp_f32_to_bits(b); }
static int same_float(float a, float b) { return (a != a && b != b) || same_bits(a, b); }

/* ---- elementary functions against double libm ---- */

/* |got - want| in units of the float ulp at want (subnormal ulp below 2^-126);
 * 1e9 for a wrong NaN, infinity or overflow. */
static double ulp_error(float got, double want)
{
    int e;
    if (isnan(want))
        return isnan(got) ? 0.0 : 1e9;
    if (isinf((float)want) || isinf(got))
        return got == (float)want ? 0.0 : 1e9;
    frexp(want, &e);
    return fabs((double)got - want) / ldexp(1.0, e - 24 < -149 ? -149 : e - 24);
}

typedef struct {
    const char *name;
    float (*f)(float);
    double (*ref)(double);
    double bound; /* ulp */
} math_case;

static void test_math_function(const math_case *mc)
{
    static const float specials[] = {0.0f, -0.0f, 1e-45f, -1e-45f, 1e-38f, -1e-38f, 0x1p-24f,
                                     -0x1p-24f, 0.5f, -0.5f, 1.0f, -1.0f, 88.72283f, 88.7229f,
                                     -87.0f, -103.9f, -104.0f, 9.0f, 10.0f, 4.0f, -4.0f, 3.9f,
                                     1e30f, -1e30f};
    const float inf = rp_bits_to_f32(RP_F32_INF), nan = rp_bits_to_f32(RP_F32_QNAN);
    double worst = 0.0;
    float worst_x = 0.0f;
    uint64_t b;
    size_t i;
    for (b = 0; b < 0x100000000ull; b += 257) {
        float x = rp_bits_to_f32((uint32_t)b);
        double e = ulp_error(mc->f(x), mc->ref((double)x));
        if (e > worst) {
            worst = e;
            worst_x = x;
        }
    }
    for (i = 0; i < sizeof specials / sizeof *specials; i++) {
        double e = ulp_error(mc->f(specials[i]), mc->ref((double)specials[i]));
        if (e > worst) {
            worst = e;
            worst_x = specials[i];
        }
    }
    printf("  %-6s max %.3f ulp (at %a)\n", mc->name, worst, (double)worst_x);
    CHECK(worst <= mc->bound, "%s: %.3f ulp at %a exceeds %.1f", mc->name, worst, (double)worst_x,
          mc->bound);
    /* the sign of zero, infinities and NaN exactly as libm */
    CHECK(same_bits(mc->f(-0.0f), (float)mc->ref(-0.0)), "%s(-0)", mc->name);
    CHECK(same_bits(mc->f(0.0f), (float)mc->ref(0.0)), "%s(+0)", mc->name);
    CHECK(same_float(mc->f(inf), (float)mc->ref(INFINITY)), "%s(inf) = %g", mc->name,
          (double)mc->f(inf));
    CHECK(same_float(mc->f(-inf), (float)mc->ref(-INFINITY)), "%s(-inf) = %g", mc->name,
          (double)mc->f(-inf));
    CHECK(mc->f(nan) != mc->f(nan), "%s(NaN) is not NaN", mc->name);
}

/* Mutation audit (session 38): below 2^-125 in magnitude (the subnormals
 * and the first normal binade) expm1, log1p and tanh round to x itself, and
 * these functions give x bit for bit; halving x there (expm1's 2^(k-1)
 * scaling without its k == 0 select) loses its last bit. */
static void test_math_tiny(void)
{
    static float (*const fns[])(float) = {rp_expm1f, rp_log1pf, rp_tanhf};
    static const char *const names[] = {"expm1", "log1p", "tanh"};
    uint32_t b;
    size_t f;
    for (f = 0; f < sizeof fns / sizeof *fns; f++) {
        long bad = 0;
        float first = 0.0f;
        for (b = 1; b < 0x01000000u; b++) {
            float x = rp_bits_to_f32(b), nx = rp_bits_to_f32(b | RP_F32_SIGN);
            if (!same_bits(fns[f](x), x) || !same_bits(fns[f](nx), nx)) {
                if (bad == 0)
                    first = x;
                bad++;
            }
        }
        CHECK(bad == 0, "%s(x) != x for %ld tiny x (first +-%a)", names[f], bad, (double)first);
    }
}

static void test_math(void)
{
    /* Bounds: the measured maxima (exp 0.92, expm1 1.39, log1p 0.81, tanh
     * 1.37, erf 1.43 ulp) rounded up a little, so that a dropped term or a
     * "tidied" coefficient fails (mutation audit, session 38: expm1 without
     * its degree-8 term 1.70, tanh's -1/3 for -0.33333318 1.42, log1p's
     * near-0 interval widened to 0.5 0.93). */
    const math_case cases[] = {
        {"exp", rp_expf, exp, 1.0},     {"expm1", rp_expm1f, expm1, 1.5},
        {"log1p", rp_log1pf, log1p, 0.9}, {"tanh", rp_tanhf, tanh, 1.4},
        {"erf", rp_erff, erf, 1.5},
    };
    size_t i;
    printf("elementary functions, every 257th float against double libm:\n");
    for (i = 0; i < sizeof cases / sizeof *cases; i++)
        test_math_function(&cases[i]);
    test_math_tiny();
    CHECK(rp_log1pf(-1.0f) == -rp_bits_to_f32(RP_F32_INF), "log1p(-1)");
    CHECK(rp_log1pf(-2.0f) != rp_log1pf(-2.0f), "log1p(-2) is not NaN");
}

/* ---- f and f' of every kind against double formulas ---- */

static const double selu_alpha = 1.6732632423543772848170429916717;
static const double selu_scale = 1.0507009873554804934193349852946;
static const double pi = 3.14159265358979323846;

static double sigmoid_d(double x) { return 1.0 / (1.0 + exp(-x)); }

/* y and d of kind at x in double (the mathematical functions, not torch's
 * float formulas). */
static void reference(int kind, double p0, double p1, double x, double *y, double *d)
{
    switch (kind) {
    case RP_FAD_GELU:
        *y = 0.5 * x * (1.0 + erf(x / sqrt(2.0)));
        *d = 0.5 * (1.0 + erf(x / sqrt(2.0))) + x * exp(-0.5 * x * x) / sqrt(2.0 * pi);
        break;
    case RP_FAD_GELU_TANH: {
        double b = sqrt(2.0 / pi), k = 0.044715, t = tanh(b * (x + k * x * x * x));
        *y = 0.5 * x * (1.0 + t);
        *d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * b * (1.0 + 3.0 * k * x * x);
        break;
    }
    case RP_FAD_SILU:
        *y = x * sigmoid_d(x);
        *d = sigmoid_d(x) * (1.0 + x * (1.0 - sigmoid_d(x)));
        break;
    case RP_FAD_MISH: {
        double t = tanh(log1p(exp(x)));
        *y = x * t;
        *d = t + x * sigmoid_d(x) * (1.0 - t * t);
        break;
    }
    case RP_FAD_SOFTPLUS:
        *y = x * p0 > p1 ? x : log1p(exp(x * p0)) / p0;
        *d = x * p0 > p1 ? 1.0 : sigmoid_d(x * p0);
        break;
    case RP_FAD_SIGMOID:
        *y = sigmoid_d(x);
        *d = *y * (1.0 - *y);
        break;
    case RP_FAD_TANH:
        *y = tanh(x);
        *d = 1.0 - *y * *y;
        break;
    case RP_FAD_ELU:
        *y = x > 0.0 ? x : p0 * expm1(x);
        *d = x > 0.0 ? 1.0 : p0 * exp(x);
        break;
    case RP_FAD_CELU:
        *y = x > 0.0 ? x : p0 * expm1(x / p0);
        *d = x > 0.0 ? 1.0 : exp(x / p0);
        break;
    case RP_FAD_SELU:
        *y = x > 0.0 ? selu_scale * x : selu_scale * selu_alpha * expm1(x);
        *d = x > 0.0 ? selu_scale : selu_scale * selu_alpha * exp(x);
        break;
    case RP_FAD_LEAKY_RELU:
        *y = x > 0.0 ? x : p0 * x;
        *d = x > 0.0 ? 1.0 : p0;
        break;
    case RP_FAD_HARDSWISH:
        *y = x * fmin(fmax(x + 3.0, 0.0), 6.0) / 6.0;
        *d = x <= -3.0 ? 0.0 : (x >= 3.0 ? 1.0 : x / 3.0 + 0.5);
        break;
    case RP_FAD_HARDSIGMOID:
        *y = fmin(fmax(x + 3.0, 0.0), 6.0) / 6.0;
        *d = x > -3.0 && x < 3.0 ? 1.0 / 6.0 : 0.0;
        break;
    case RP_FAD_LOGSIGMOID:
        *y = fmin(x, 0.0) - log1p(exp(-fabs(x)));
        *d = sigmoid_d(-x);
        break;
    case RP_FAD_SOFTSIGN:
        *y = x / (1.0 + fabs(x));
        *d = 1.0 / ((1.0 + fabs(x)) * (1.0 + fabs(x)));
        break;
    default: /* RP_FAD_TANHSHRINK */
        *y = x - tanh(x);
        *d = tanh(x) * tanh(x);
        break;
    }
}

typedef struct {
    int kind;
    float p0, p1;
} kind_case;

static const kind_case kind_cases[] = {
    {RP_FAD_GELU, 0, 0},        {RP_FAD_GELU_TANH, 0, 0},   {RP_FAD_SILU, 0, 0},
    {RP_FAD_MISH, 0, 0},        {RP_FAD_SOFTPLUS, 1, 20},   {RP_FAD_SOFTPLUS, 2, 5},
    {RP_FAD_SIGMOID, 0, 0},     {RP_FAD_TANH, 0, 0},        {RP_FAD_ELU, 1, 0},
    {RP_FAD_ELU, 0.5f, 0},      {RP_FAD_CELU, 1, 0},        {RP_FAD_CELU, 2, 0},
    {RP_FAD_SELU, 0, 0},        {RP_FAD_LEAKY_RELU, 0.01f, 0}, {RP_FAD_LEAKY_RELU, -0.2f, 0},
    {RP_FAD_HARDSWISH, 0, 0},   {RP_FAD_HARDSIGMOID, 0, 0}, {RP_FAD_LOGSIGMOID, 0, 0},
    {RP_FAD_SOFTSIGN, 0, 0},    {RP_FAD_TANHSHRINK, 0, 0},
    {RP_FAD_ELU, 0, 0}, /* a derivative range of one point, 0 (rp_fad_grid) */
};
#define N_KIND_CASES ((int)(sizeof kind_cases / sizeof *kind_cases))

/* torch's float formulas cancel in places (1 + erf in GELU's tail, 1 - t^2
 * near |t| = 1): absolute error bound relative to max(1, |ref|). */
static void test_eval_against_reference(void)
{
    int c, i;
    for (c = 0; c < N_KIND_CASES; c++) {
        const kind_case *k = &kind_cases[c];
        double worst_y = 0.0, worst_d = 0.0;
        for (i = 0; i < 200000; i++) {
            float x = i < 100000 ? rand_uniform(-6.0f, 6.0f) : rand_uniform(-40.0f, 40.0f);
            float y, d;
            double yr, dr;
            /* torch's piecewise edges are compared exactly, not across them */
            if (fabsf(fabsf(x) - 3.0f) < 1e-5f)
                continue;
            rp_fad_eval(k->kind, k->p0, k->p1, x, &y, &d);
            reference(k->kind, k->p0, k->p1, x, &yr, &dr);
            worst_y = fmax(worst_y, fabs(y - yr) / fmax(1.0, fabs(yr)));
            worst_d = fmax(worst_d, fabs(d - dr) / fmax(1.0, fabs(dr)));
        }
        CHECK(worst_y < 2e-6 && worst_d < 2e-6, "kind %d (p0=%g): y err %.3g, d err %.3g",
              k->kind, (double)k->p0, worst_y, worst_d);
    }
}

/* Values torch 2.13 gives at the edges (measured), per kind. */
static void test_eval_special_values(void)
{
    const float inf = rp_bits_to_f32(RP_F32_INF), nan = rp_bits_to_f32(RP_F32_QNAN);
    float y, d;
    rp_fad_eval(RP_FAD_GELU, 0, 0, inf, &y, &d);
    CHECK(y == inf && d != d, "gelu(inf): y=%g d=%g (torch: inf, nan)", (double)y, (double)d);
    rp_fad_eval(RP_FAD_SILU, 0, 0, -inf, &y, &d);
    CHECK(y != y && d != d, "silu(-inf): torch gives nan, nan");
    rp_fad_eval(RP_FAD_HARDSWISH, 0, 0, -3.0f, &y, &d);
    CHECK(d == 0.0f, "hardswish'(-3) = %g, torch 0", (double)d);
    rp_fad_eval(RP_FAD_HARDSWISH, 0, 0, 3.0f, &y, &d);
    CHECK(d == 1.0f && y == 3.0f, "hardswish(3)");
    rp_fad_eval(RP_FAD_HARDSWISH, 0, 0, nan, &y, &d);
    CHECK(d != d, "hardswish'(nan) is nan in torch");
    rp_fad_eval(RP_FAD_ELU, 1, 0, nan, &y, &d);
    CHECK(y != y && d != d, "elu(nan)");
    rp_fad_eval(RP_FAD_ELU, 1, 0, 0.0f, &y, &d);
    CHECK(y == 0.0f && d == 1.0f, "elu'(0) = alpha");
    rp_fad_eval(RP_FAD_LEAKY_RELU, 0.01f, 0, nan, &y, &d);
    CHECK(y != y && d == 0.01f, "leaky_relu'(nan) = slope in torch");
    rp_fad_eval(RP_FAD_SOFTSIGN, 0, 0, 0.0f, &y, &d);
    CHECK(d == 1.0f, "softsign'(0)");
    rp_fad_eval(RP_FAD_SOFTSIGN, 0, 0, inf, &y, &d);
    CHECK(y != y && d != d, "softsign(inf) is nan in torch");
    rp_fad_eval(RP_FAD_LOGSIGMOID, 0, 0, -inf, &y, &d);
    CHECK(y == -inf && d == 1.0f, "logsigmoid(-inf)");
    rp_fad_eval(RP_FAD_SOFTPLUS, 1, 20, inf, &y, &d);
    CHECK(y == inf && d == 1.0f, "softplus(inf)");
    rp_fad_eval(RP_FAD_HARDSIGMOID, 0, 0, nan, &y, &d);
    CHECK(y != y && d == 0.0f, "hardsigmoid(nan)");
    rp_fad_eval(RP_FAD_TANHSHRINK, 0, 0, -inf, &y, &d);
    CHECK(y == -inf && d == 1.0f, "tanhshrink(-inf)");
    /* torch's hardsigmoid_backward is 1/6 strictly inside (-3, 3) only (measured) */
    rp_fad_eval(RP_FAD_HARDSIGMOID, 0, 0, -3.0f, &y, &d);
    CHECK(y == 0.0f && d == 0.0f, "hardsigmoid'(-3) = %g, torch 0", (double)d);
    rp_fad_eval(RP_FAD_HARDSIGMOID, 0, 0, 3.0f, &y, &d);
    CHECK(y == 1.0f && d == 0.0f, "hardsigmoid'(3) = %g, torch 0", (double)d);
    /* softplus is linear only where x * beta > threshold, strictly: at
     * x * beta == threshold torch's slope is z / (z + 1), not 1, and the code
     * must be a grid code, not the exact slope */
    {
        rp_fad_codebook cb;
        rp_error err;
        uint8_t code;
        rp_fad_eval(RP_FAD_SOFTPLUS, 1.0f, 1.0f, 1.0f, &y, &d);
        CHECK(fabsf(d - 0.7310586f) < 1e-6f, "softplus'(1) at threshold 1: %g", (double)d);
        CHECK(!rp_fad_on_exact_piece(RP_FAD_SOFTPLUS, 1.0f, 1.0f, 1.0f),
              "softplus at x * beta == threshold is not the linear piece");
        CHECK(rp_fad_codebook_init(RP_FAD_SOFTPLUS, 1.0f, 1.0f, &cb, &err) == RP_OK, "%s", err.msg);
        code = rp_fad_encode(RP_FAD_SOFTPLUS, 1.0f, 1.0f, 1.0f, d, cb.inv_step, cb.zero_code);
        CHECK(code < RP_FAD_CODE_GRID && fabsf(cb.value[code] - d) < 0.01f,
              "softplus'(1) at threshold 1 coded %d (decodes to %g)", code, (double)cb.value[code]);
    }
}

/* ---- forward through the public entry point ---- */

static float *random_inputs(int64_t n)
{
    float *x = (float *)malloc((size_t)n * sizeof *x);
    int64_t i;
    for (i = 0; i < n; i++)
        x[i] = i % 97 == 0 ? rp_bits_to_f32(RP_F32_QNAN) : rand_uniform(-8.0f, 8.0f);
    return x;
}

/* dtype and d storage rounding: the 16-bit results are the float32 math on
 * the widened input, rounded once. */
static void test_forward_storage(void)
{
    const int64_t n = 1000 + 3;
    float *x = random_inputs(n);
    uint16_t *x16 = (uint16_t *)malloc((size_t)n * 2), *y16 = (uint16_t *)malloc((size_t)n * 2);
    uint16_t *d16 = (uint16_t *)malloc((size_t)n * 2);
    rp_error err;
    int c, dt;
    int64_t i;
    for (c = 0; c < N_KIND_CASES; c++) {
        const kind_case *k = &kind_cases[c];
        for (dt = RP_F16; dt <= RP_BF16; dt++) {
            for (i = 0; i < n; i++)
                x16[i] = dt == RP_F16 ? rp_f32_to_f16(x[i]) : rp_f32_to_bf16(x[i]);
            CHECK(rp_fad_forward_cpu(k->kind, k->p0, k->p1, dt, x16, y16, dt, d16, n, 1, &err) ==
                      RP_OK, "%s", err.msg);
            for (i = 0; i < n; i++) {
                float xf = dt == RP_F16 ? rp_f16_to_f32(x16[i]) : rp_bf16_to_f32(x16[i]);
                float y, d;
                uint16_t ye, de;
                rp_fad_eval(k->kind, k->p0, k->p1, xf, &y, &d);
                ye = dt == RP_F16 ? rp_f32_to_f16(y) : rp_f32_to_bf16(y);
                de = dt == RP_F16 ? rp_f32_to_f16(d) : rp_f32_to_bf16(d);
                CHECK(y16[i] == ye && d16[i] == de, "kind %d dtype %d at %lld", k->kind, dt,
                      (long long)i);
            }
        }
    }
    free(x);
    free(x16);
    free(y16);
    free(d16);
}

/* Mutation audit (session 38): the conversions themselves, at the points the
 * storage test above cannot tell apart (it rounds its reference with them):
 * ties to even, float16's overflow edge, and a signalling NaN whose payload
 * lies in the bits bfloat16 drops (truncated, it read as inf). */
static void test_conversions(void)
{
    CHECK(rp_f32_to_bf16(1.0f + 0x1p-8f) == 0x3f80u && rp_f32_to_bf16(1.0f + 0x3p-8f) == 0x3f82u,
          "bfloat16 ties to even");
    CHECK(rp_f32_to_bf16(-(1.0f + 0x1p-8f)) == 0xbf80u, "bfloat16 negative tie to even");
    CHECK(rp_f32_to_f16(1.0f + 0x1p-11f) == 0x3c00u && rp_f32_to_f16(1.0f + 0x3p-11f) == 0x3c02u,
          "float16 ties to even");
    CHECK(rp_f32_to_f16(65519.99f) == 0x7bffu && rp_f32_to_f16(65520.0f) == 0x7c00u,
          "float16 overflow edge");
    CHECK((rp_f32_to_bf16(rp_bits_to_f32(0x7f800001u)) & 0x7fffu) > 0x7f80u,
          "bfloat16 of a NaN with a low payload is not NaN");
    CHECK((rp_f32_to_f16(rp_bits_to_f32(0x7f800001u)) & 0x7fffu) > 0x7c00u,
          "float16 of a NaN with a low payload is not NaN");
}

/* y == x gives what a separate y gives, for every dtype. */
static void test_forward_in_place(void)
{
    const int64_t n = 5000 + 7;
    float *x = random_inputs(n);
    float *a = (float *)malloc((size_t)n * 4), *b = (float *)malloc((size_t)n * 4);
    float *d = (float *)malloc((size_t)n * 4);
    rp_error err;
    int dt, c;
    for (c = 0; c < N_KIND_CASES; c += 3) {
        for (dt = RP_F32; dt <= RP_BF16; dt++) {
            memcpy(a, x, (size_t)n * 4);
            CHECK(rp_fad_forward_cpu(kind_cases[c].kind, kind_cases[c].p0, kind_cases[c].p1, dt,
                                     a, b, RP_F32, d, n, 1, &err) == RP_OK, "%s", err.msg);
            CHECK(rp_fad_forward_cpu(kind_cases[c].kind, kind_cases[c].p0, kind_cases[c].p1, dt,
                                     a, a, RP_FAD_NONE, NULL, n, 1, &err) == RP_OK, "%s", err.msg);
            /* only the first n x-sized bytes are y */
            CHECK(memcmp(a, b, (size_t)n * (dt == RP_F32 ? 4 : 2)) == 0, "kind %d dtype %d",
                  kind_cases[c].kind, dt);
        }
    }
    free(x);
    free(a);
    free(b);
    free(d);
}

/* Chunks over several threads equal one thread, bit for bit, for every storage. */
static void test_forward_threads(void)
{
    const int64_t n = 3 * 16384 + 1000 + 5;
    float *x = random_inputs(n);
    float *y1 = (float *)malloc((size_t)n * 4), *y4 = (float *)malloc((size_t)n * 4);
    float *d1 = (float *)malloc((size_t)n * 4), *d4 = (float *)malloc((size_t)n * 4);
    const int stores[] = {RP_F32, RP_F16, RP_BF16, RP_FAD_CODE8};
    rp_error err;
    int c, s;
    for (c = 0; c < N_KIND_CASES; c++) {
        for (s = 0; s < 4; s++) {
            size_t dbytes = (size_t)n * (stores[s] == RP_F32 ? 4 : (stores[s] == RP_FAD_CODE8 ? 1 : 2));
            memset(d1, 0xab, (size_t)n * 4);
            memset(d4, 0xcd, (size_t)n * 4);
            CHECK(rp_fad_forward_cpu(kind_cases[c].kind, kind_cases[c].p0, kind_cases[c].p1,
                                     RP_F32, x, y1, stores[s], d1, n, 1, &err) == RP_OK, "%s",
                  err.msg);
            CHECK(rp_fad_forward_cpu(kind_cases[c].kind, kind_cases[c].p0, kind_cases[c].p1,
                                     RP_F32, x, y4, stores[s], d4, n, 4, &err) == RP_OK, "%s",
                  err.msg);
            CHECK(memcmp(y1, y4, (size_t)n * 4) == 0 && memcmp(d1, d4, dbytes) == 0,
                  "kind %d store %d: threads differ", kind_cases[c].kind, stores[s]);
        }
    }
    free(x);
    free(y1);
    free(y4);
    free(d1);
    free(d4);
}

/* ---- the 8-bit codebook ---- */

static void test_codebook(void)
{
    const int64_t n = 20000;
    float *x = random_inputs(n);
    float *y = (float *)malloc((size_t)n * 4), *d = (float *)malloc((size_t)n * 4);
    uint8_t *codes = (uint8_t *)malloc((size_t)n);
    rp_fad_codebook cb;
    rp_error err;
    int c;
    int64_t i;
    printf("codebooks [lo, hi] step zero_code:\n");
    for (c = 0; c < N_KIND_CASES; c++) {
        const kind_case *k = &kind_cases[c];
        float step;
        CHECK(rp_fad_codebook_init(k->kind, k->p0, k->p1, &cb, &err) == RP_OK, "%s", err.msg);
        step = cb.value[cb.zero_code + 1] - cb.value[cb.zero_code];
        printf("  kind %2d p0=%-5g [%.6f, %.6f] step %.4g zero %d\n", k->kind, (double)k->p0,
               (double)cb.lo, (double)cb.hi, (double)step, cb.zero_code);
        CHECK(cb.value[cb.zero_code] == 0.0f, "kind %d: zero not on the grid", k->kind);
        CHECK(cb.value[RP_FAD_CODE_NAN] != cb.value[RP_FAD_CODE_NAN], "NaN code");
        CHECK(cb.value[0] <= cb.lo && cb.value[RP_FAD_CODE_GRID - 1] >= cb.hi,
              "kind %d: grid [%g, %g] misses [%g, %g]", k->kind, (double)cb.value[0],
              (double)cb.value[RP_FAD_CODE_GRID - 1], (double)cb.lo, (double)cb.hi);
        CHECK(rp_fad_forward_cpu(k->kind, k->p0, k->p1, RP_F32, x, y, RP_F32, d, n, 1, &err) ==
                  RP_OK, "%s", err.msg);
        CHECK(rp_fad_forward_cpu(k->kind, k->p0, k->p1, RP_F32, x, y, RP_FAD_CODE8, codes, n, 1,
                                 &err) == RP_OK, "%s", err.msg);
        for (i = 0; i < n; i++) {
            float v = cb.value[codes[i]];
            if (d[i] != d[i]) {
                CHECK(codes[i] == RP_FAD_CODE_NAN, "kind %d: NaN d coded %d", k->kind, codes[i]);
            } else if (rp_fad_on_exact_piece(k->kind, k->p0, k->p1, x[i])) {
                CHECK(codes[i] == RP_FAD_CODE_EXACT && v == d[i], "kind %d: exact piece at %g",
                      k->kind, (double)x[i]);
            } else {
                CHECK(codes[i] < RP_FAD_CODE_GRID, "kind %d: grid code %d", k->kind, codes[i]);
                CHECK(fabsf(v - d[i]) <= 0.5f * step * (1.0f + 0x1p-20f),
                      "kind %d: d=%g decodes to %g (step %g)", k->kind, (double)d[i], (double)v,
                      (double)step);
                if (d[i] == 0.0f)
                    CHECK(v == 0.0f, "kind %d: zero derivative decodes to %g", k->kind, (double)v);
                if (k->kind == RP_FAD_LEAKY_RELU || k->kind == RP_FAD_HARDSIGMOID)
                    CHECK(v == d[i], "kind %d: two-valued derivative %g decodes to %g", k->kind,
                          (double)d[i], (double)v);
            }
        }
    }
    free(x);
    free(y);
    free(d);
    free(codes);
}

/* Parameters at float32's ends: a LeakyReLU slope down to FLT_MIN still
 * decodes exactly (its step was 2^-102 below that), and an ELU alpha near
 * FLT_MAX keeps every grid value finite (the widened, rounded-up grid ended
 * past it, and d = alpha at x = -0 decoded as inf). */
static void test_codebook_extremes(void)
{
    static const kind_case cases[] = {
        {RP_FAD_LEAKY_RELU, 1e-31f, 0}, {RP_FAD_LEAKY_RELU, -1e-31f, 0},
        {RP_FAD_LEAKY_RELU, FLT_MIN, 0}, {RP_FAD_LEAKY_RELU, 3e38f, 0},
        {RP_FAD_ELU, 3.4e38f, 0},        {RP_FAD_ELU, -3.4e38f, 0},
        {RP_FAD_ELU, FLT_MAX, 0},        {RP_FAD_ELU, -FLT_MAX, 0},
    };
    const float xs[] = {-0.0f, -1e-7f, -1.0f, -30.0f};
    rp_fad_codebook cb;
    rp_error err;
    size_t c, i;
    int code;
    for (c = 0; c < sizeof cases / sizeof *cases; c++) {
        const kind_case *k = &cases[c];
        float step;
        CHECK(rp_fad_codebook_init(k->kind, k->p0, k->p1, &cb, &err) == RP_OK, "%s", err.msg);
        /* read beside zero_code on the grid's side (code 254 is the exact slope) */
        step = cb.zero_code > 0 ? cb.value[cb.zero_code] - cb.value[cb.zero_code - 1]
                                : cb.value[1] - cb.value[0];
        /* a two-valued grid produces only the codes zero_code, zero_code +- 1 */
        for (code = 0; code < RP_FAD_CODE_GRID && k->kind != RP_FAD_LEAKY_RELU; code++)
            CHECK(isfinite(cb.value[code]), "kind %d p0 %g: code %d decodes to %g", k->kind,
                  (double)k->p0, code, (double)cb.value[code]);
        /* the ends of +-FLT_MAX are just off the grid (its step has 16 bits) */
        CHECK(cb.value[0] - cb.lo <= 0.5f * step &&
                  cb.hi - cb.value[RP_FAD_CODE_GRID - 1] <= 0.5f * step,
              "kind %d p0 %g: grid misses [%g, %g]", k->kind, (double)k->p0, (double)cb.lo,
              (double)cb.hi);
        for (i = 0; i < sizeof xs / sizeof *xs; i++) {
            float y, d, v;
            rp_fad_eval(k->kind, k->p0, k->p1, xs[i], &y, &d);
            v = cb.value[rp_fad_encode(k->kind, k->p0, k->p1, xs[i], d, cb.inv_step,
                                       cb.zero_code)];
            if (k->kind == RP_FAD_LEAKY_RELU)
                CHECK(v == d, "slope %g: %g decodes to %g", (double)k->p0, (double)d, (double)v);
            else
                CHECK(fabsf(v - d) <= 0.5f * step, "alpha %g: %g decodes to %g (step %g)",
                      (double)k->p0, (double)d, (double)v, (double)step);
        }
    }
}

static void test_backward_code8(void)
{
    const int64_t n = 3 * 16384 + 77;
    float *g = random_inputs(n), *out = (float *)malloc((size_t)n * 4);
    uint16_t *g16 = (uint16_t *)malloc((size_t)n * 2), *o16 = (uint16_t *)malloc((size_t)n * 2);
    uint8_t *codes = (uint8_t *)malloc((size_t)n);
    rp_fad_codebook cb;
    rp_error err;
    int64_t i;
    int dt, threads;
    CHECK(rp_fad_codebook_init(RP_FAD_GELU, 0, 0, &cb, &err) == RP_OK, "%s", err.msg);
    for (i = 0; i < n; i++)
        codes[i] = (uint8_t)(i * 7919 % 256);
    for (threads = 1; threads <= 3; threads += 2) {
        CHECK(rp_fad_backward_code8_cpu(RP_F32, g, codes, &cb, out, n, threads, &err) == RP_OK,
              "%s", err.msg);
        for (i = 0; i < n; i++)
            CHECK(same_float(out[i], g[i] * cb.value[codes[i]]), "f32 at %lld", (long long)i);
        for (dt = RP_F16; dt <= RP_BF16; dt++) {
            for (i = 0; i < n; i++)
                g16[i] = dt == RP_F16 ? rp_f32_to_f16(g[i]) : rp_f32_to_bf16(g[i]);
            CHECK(rp_fad_backward_code8_cpu(dt, g16, codes, &cb, o16, n, threads, &err) == RP_OK,
                  "%s", err.msg);
            /* in place: grad_x == grad_y */
            CHECK(rp_fad_backward_code8_cpu(dt, g16, codes, &cb, g16, n, threads, &err) == RP_OK,
                  "%s", err.msg);
            CHECK(memcmp(o16, g16, (size_t)n * 2) == 0, "dtype %d in place differs", dt);
            for (i = 0; i < n; i++) {
                float gf = dt == RP_F16 ? rp_f16_to_f32(rp_f32_to_f16(g[i]))
                                        : rp_bf16_to_f32(rp_f32_to_bf16(g[i]));
                float want = gf * cb.value[codes[i]];
                uint16_t w = dt == RP_F16 ? rp_f32_to_f16(want) : rp_f32_to_bf16(want);
                CHECK(o16[i] == w, "dtype %d at %lld", dt, (long long)i);
            }
        }
    }
    free(g);
    free(out);
    free(g16);
    free(o16);
    free(codes);
}

/* ---- backward from a 16-bit f' of the other 16-bit dtype ---- */

/* v rounded to nearest even with `frac_bits` fraction bits, normal
 * exponents from `min_exp` up, inf past `max_finite`: the reference of the
 * 16-bit roundings, in double and by another route than rp_internal.h's
 * bit tricks. v holds at most 24 significant bits, so v / ulp is exact. */
static double round_to_format(double v, int frac_bits, int min_exp, double max_finite)
{
    int e;
    double ulp, r;
    if (v == 0.0 || isinf(v))
        return v;
    frexp(v, &e); /* |v| in [2^(e-1), 2^e) */
    e = e - 1 < min_exp ? min_exp : e - 1;
    ulp = ldexp(1.0, e - frac_bits);
    r = nearbyint(v / ulp) * ulp; /* the default rounding mode: to nearest even */
    return fabs(r) > max_finite ? copysign(INFINITY, r) : r;
}

/* The expected output bits for grad bits gb (of `dtype`) times d bits db (of
 * the other 16-bit dtype): bfloat16 NaN 0xffff (torch's CPU cast), float16
 * NaN any quiet NaN (checked apart: rp_f32_to_f16 keeps the payload). */
static uint16_t mixed16_reference(int dtype, uint16_t gb, uint16_t db)
{
    int bf16 = dtype == RP_BF16;
    float g = bf16 ? rp_bf16_to_f32(gb) : rp_f16_to_f32(gb);
    float d = bf16 ? rp_f16_to_f32(db) : rp_bf16_to_f32(db);
    /* the double product is exact; its float rounding is the float32 product's */
    double p = (double)(float)((double)g * (double)d);
    if (p != p)
        return bf16 ? 0xffffu : rp_f32_to_f16((float)p);
    if (bf16)
        return (uint16_t)(rp_f32_to_bits((float)round_to_format(p, 7, -126, 0x1.fep127)) >> 16);
    return rp_f32_to_f16((float)round_to_format(p, 10, -14, 65504.0)); /* exact: no rounding */
}

static int is_f16_nan(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0; }

/* Run by .ci/run twice: as this CPU picks (the F16C loops on x86-64 with
 * AVX2 and F16C), and with REPROP_TEST_NO_F16C=1 (the portable loops). */
static void test_backward_mixed16(void)
{
    /* every 16-bit pattern of one operand against a random other (NaNs, infs,
     * subnormals, overflow, ties), past OpenMP's threshold, with a tail */
    const int64_t n = 2 * 65536 + 7;
    uint16_t *g = (uint16_t *)malloc((size_t)n * 2), *d = (uint16_t *)malloc((size_t)n * 2);
    uint16_t *out = (uint16_t *)malloc((size_t)n * 2), *out1 = (uint16_t *)malloc((size_t)n * 2);
    rp_error err;
    int64_t i, len;
    int dtype, threads;
    for (i = 0; i < n; i++) {
        rng_state = rng_state * 1664525u + 1013904223u;
        g[i] = i < 65536 ? (uint16_t)i : (uint16_t)(rng_state >> 16);
        d[i] = i >= 65536 && i < 2 * 65536 ? (uint16_t)(i - 65536) : (uint16_t)(rng_state >> 3);
    }
    for (dtype = RP_F16; dtype <= RP_BF16; dtype++) {
        for (threads = 1; threads <= 3; threads += 2) {
            CHECK(rp_fad_backward_mixed16_cpu(dtype, g, d, out, n, threads, &err) == RP_OK, "%s",
                  err.msg);
            for (i = 0; i < n; i++) {
                uint16_t want = mixed16_reference(dtype, g[i], d[i]);
                int nan_ok = dtype == RP_F16 && is_f16_nan(want) && is_f16_nan(out[i]);
                CHECK(out[i] == want || nan_ok, "dtype %d: %#x * %#x gave %#x, want %#x", dtype,
                      g[i], d[i], out[i], want);
            }
            if (threads == 1)
                memcpy(out1, out, (size_t)n * 2);
            else
                CHECK(memcmp(out, out1, (size_t)n * 2) == 0, "dtype %d: 3 threads differ", dtype);
        }
        /* the vector tails: each length from 0 to 17 at an odd offset, the
         * element past the end left as it was */
        for (len = 0; len <= 17; len++) {
            memset(out, 0x5a, 20 * 2);
            CHECK(rp_fad_backward_mixed16_cpu(dtype, g + 65541, d + 65541, out, len, 1, &err) ==
                      RP_OK, "%s", err.msg);
            for (i = 0; i < len; i++)
                CHECK(out[i] == out1[65541 + i], "dtype %d: length %lld at %lld", dtype,
                      (long long)len, (long long)i);
            CHECK(out[len] == 0x5a5a, "dtype %d: length %lld wrote past the end", dtype,
                  (long long)len);
        }
    }
    /* hand-checked bfloat16 values: ties to even both ways, overflow, a
     * float16 subnormal, NaN */
    {
        static const struct {
            float g, d;
            uint16_t want;
        } cases[] = {
            {1.0f, 1.0f + 0x1p-8f, 0x3f80},     /* halfway: down to even 1 */
            {1.0f, 1.0f + 0x3p-8f, 0x3f82},     /* halfway: up to even 1 + 2^-6 */
            {1.0f + 0x1p-7f, 1.0f + 0x1p-10f, 0x3f81}, /* just past 1 + 2^-7 */
            {0x1p127f, 2.0f, 0x7f80},           /* overflow: inf */
            {-0x1.fep127f, 1.0f + 0x1p-8f, 0xff80}, /* rounds up past the largest: -inf */
            {1.0f, 0x1p-24f, 0x3380},           /* the smallest float16 subnormal */
            {-0.0f, 3.0f, 0x8000},
        };
        uint16_t gb, db, o;
        size_t c;
        for (c = 0; c < sizeof cases / sizeof cases[0]; c++) {
            gb = rp_f32_to_bf16(cases[c].g);
            db = rp_f32_to_f16(cases[c].d);
            CHECK(rp_fad_backward_mixed16_cpu(RP_BF16, &gb, &db, &o, 1, 1, &err) == RP_OK, "%s",
                  err.msg);
            CHECK(o == cases[c].want, "case %zu: %#x, want %#x", c, o, cases[c].want);
        }
        gb = 0xffc1; /* a negative NaN with a payload */
        db = rp_f32_to_f16(1.0f);
        CHECK(rp_fad_backward_mixed16_cpu(RP_BF16, &gb, &db, &o, 1, 1, &err) == RP_OK, "%s", err.msg);
        CHECK(o == 0xffff, "NaN: %#x", o);
    }
    CHECK(rp_fad_backward_mixed16_cpu(RP_F32, g, d, out, 4, 1, &err) == RP_EINVAL, "float32");
    CHECK(rp_fad_backward_mixed16_cpu(RP_BF16, g, NULL, out, 4, 1, &err) == RP_EINVAL, "NULL d");
    CHECK(rp_fad_backward_mixed16_cpu(RP_BF16, g, d, out, -1, 1, &err) == RP_EINVAL, "negative n");
    CHECK(rp_fad_backward_mixed16_cpu(RP_BF16, NULL, NULL, NULL, 0, 1, &err) == RP_OK, "n = 0");
    free(g);
    free(d);
    free(out);
    free(out1);
}

/* ---- error statuses ---- */

static void test_errors(void)
{
    float x[4] = {0}, y[4], d[4];
    uint8_t codes[4] = {0};
    rp_fad_codebook cb;
    rp_error err;
    CHECK(rp_fad_check(RP_FAD_KINDS, 0, 0, RP_F32, RP_F32, &err) == RP_EINVAL, "bad kind");
    CHECK(rp_fad_check(-1, 0, 0, RP_F32, RP_F32, &err) == RP_EINVAL, "negative kind");
    CHECK(rp_fad_check(RP_FAD_GELU, 0, 0, 7, RP_F32, &err) == RP_EINVAL, "bad dtype");
    CHECK(rp_fad_check(RP_FAD_GELU, 0, 0, RP_F32, 9, &err) == RP_EINVAL, "bad d_store");
    /* mutation audit (session 38): below RP_FAD_NONE too, not only past RP_FAD_CODE8 */
    CHECK(rp_fad_check(RP_FAD_GELU, 0, 0, RP_F32, RP_FAD_NONE - 1, &err) == RP_EINVAL,
          "d_store below RP_FAD_NONE");
    CHECK(rp_fad_check(RP_FAD_CELU, 0, 0, RP_F32, RP_F32, &err) == RP_EINVAL, "CELU alpha 0");
    CHECK(strstr(err.msg, "CELU") != NULL, "message: %s", err.msg);
    CHECK(rp_fad_check(RP_FAD_ELU, rp_bits_to_f32(RP_F32_QNAN), 0, RP_F32, RP_F32, &err) ==
              RP_EINVAL, "NaN parameter");
    /* mutation audit (session 38): p1 (Softplus's threshold) is checked as p0 is */
    CHECK(rp_fad_check(RP_FAD_SOFTPLUS, 1, rp_bits_to_f32(RP_F32_INF), RP_F32, RP_F32, &err) ==
              RP_EINVAL, "infinite threshold");
    CHECK(rp_fad_check(RP_FAD_SOFTPLUS, 1, rp_bits_to_f32(RP_F32_QNAN), RP_F32, RP_F32, &err) ==
              RP_EINVAL, "NaN threshold");
    CHECK(rp_fad_check(RP_FAD_GELU, 0, 0, RP_F32, RP_FAD_NONE, &err) == RP_OK, "NONE ok");
    CHECK(rp_fad_check(RP_FAD_GELU, 0, 0, RP_BF16, RP_FAD_CODE8, &err) == RP_OK, "CODE8 ok");
    CHECK(rp_fad_forward_cpu(RP_FAD_GELU, 0, 0, RP_F32, x, y, RP_F32, d, -1, 1, &err) ==
              RP_EINVAL, "negative n");
    CHECK(rp_fad_forward_cpu(RP_FAD_GELU, 0, 0, RP_F32, NULL, y, RP_F32, d, 4, 1, &err) ==
              RP_EINVAL, "NULL x");
    CHECK(rp_fad_forward_cpu(RP_FAD_GELU, 0, 0, RP_F32, x, y, RP_F32, NULL, 4, 1, &err) ==
              RP_EINVAL, "NULL d");
    CHECK(rp_fad_forward_cpu(RP_FAD_GELU, 0, 0, RP_F32, NULL, NULL, RP_F32, NULL, 0, 1, &err) ==
              RP_OK, "n = 0 with NULL");
    CHECK(rp_fad_forward_cpu(RP_FAD_KINDS, 0, 0, RP_F32, x, y, RP_F32, d, 4, 1, &err) ==
              RP_EINVAL, "forward bad kind");
    CHECK(rp_fad_codebook_init(RP_FAD_CELU, 0, 0, &cb, &err) == RP_EINVAL, "codebook CELU 0");
    CHECK(rp_fad_codebook_init(RP_FAD_CELU, -0.5f, 0, &cb, &err) == RP_EINVAL,
          "codebook CELU alpha < 0");
    CHECK(strstr(err.msg, "unbounded") != NULL, "message: %s", err.msg);
    CHECK(rp_fad_check(RP_FAD_CELU, -0.5f, 0, RP_F32, RP_F32, &err) == RP_OK, "CELU < 0 in f32");
    CHECK(rp_fad_codebook_init(RP_FAD_GELU, 0, 0, NULL, &err) == RP_EINVAL, "codebook NULL");
    CHECK(rp_fad_codebook_init(RP_FAD_GELU, 0, 0, &cb, &err) == RP_OK, "%s", err.msg);
    CHECK(rp_fad_backward_code8_cpu(RP_F32, x, codes, NULL, y, 4, 1, &err) == RP_EINVAL,
          "backward NULL codebook");
    CHECK(rp_fad_backward_code8_cpu(5, x, codes, &cb, y, 4, 1, &err) == RP_EINVAL,
          "backward bad dtype");
    CHECK(rp_fad_backward_code8_cpu(RP_F32, x, NULL, &cb, y, 4, 1, &err) == RP_EINVAL,
          "backward NULL codes");
    CHECK(rp_fad_backward_code8_cpu(RP_F32, x, codes, &cb, y, -2, 1, &err) == RP_EINVAL,
          "backward negative n");
}

int main(void)
{
    test_math();
    test_eval_against_reference();
    test_eval_special_values();
    test_forward_storage();
    test_conversions();
    test_forward_in_place();
    test_forward_threads();
    test_codebook();
    test_codebook_extremes();
    test_backward_code8();
    test_backward_mixed16();
    test_errors();
    if (failures) {
        fprintf(stderr, "test_fad: %d check(s) failed\n", failures);
        return 1;
    }
    printf("test_fad: all checks passed\n");
    return 0;
}
