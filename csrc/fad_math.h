/*
 * fad_math.h: the per-element math of the nested forward-AD activations,
 * shared by the CPU loops (csrc/fad.c) and the CUDA kernels (kernels/fad.cu)
 * so that both compute exactly the same bits.
 *
 * Two layers:
 *
 *  1. Float elementary functions (exp, expm1, log1p, tanh, erf) written with
 *     selects only: no branches (so GCC vectorizes loops over them), no libm
 *     calls (whose results differ between glibc and CUDA's libdevice), no
 *     fused multiply-adds (the build uses -ffp-contract=off and nvcc
 *     --fmad=false), no float <-> int conversions of possibly-NaN values.
 *     Accuracy over the whole float range is about one ulp (measured by
 *     csrc/tests/test_fad.c); special values follow C99 Annex F.
 *
 *  2. rp_fad_eval: y = f(x) and d = f'(x) of every rp_fad_kind in float32,
 *     written term by term like PyTorch's own CPU kernels (the vectorized
 *     paths of aten/src/ATen/native/cpu/Activation.cpp and Elu.h/Gelu.h, and
 *     for the composite Softsign/Tanhshrink the gradient autograd builds from
 *     derivatives.yaml): the same terms in the same order, but with the
 *     elementary functions above rather than torch's, so not torch's bits:
 *     tests/test_fad.py holds every result to twice torch's own error
 *     against float64 plus two roundings (and an allowance where terms
 *     cancel). NaN and inf land where torch's
 *     vectorized CPU loop puts them, which is not always where its scalar
 *     loop (short tensors, the tails of long ones) does. Measured on torch
 *     2.13, the differences: GELU (erf) at +inf is inf here, as in float64,
 *     where torch's float32 kernel gives NaN (AVX-512, AVX2 and default
 *     builds alike; a one-element tensor: inf); the derivative of ELU, CELU,
 *     SELU and Hardswish at a NaN is NaN, as torch's vectorized loop gives,
 *     where its scalar loop gives 1 (SELU: its scale, 1.0507). README lists
 *     them.
 *     d is the gradient for grad_y = 1; backward multiplies it by grad_y.
 *
 * And the 8-bit derivative code of one element (rp_fad_encode), see
 * rp_fad_codebook in reprop.h.
 */
#ifndef REPROP_FAD_MATH_H
#define REPROP_FAD_MATH_H

#include "reprop.h"
#include "rp_internal.h"

/* ---- bit-level helpers ---- */

#define RP_F32_INF 0x7f800000u
#define RP_F32_QNAN 0x7fc00000u
#define RP_F32_SIGN 0x80000000u

/* Adding 1.5 * 2^23 rounds a float of magnitude < 2^22 to an integer
 * (nearest even), and the low bits of the sum then hold that integer in
 * two's complement: rounding and conversion without cvt instructions, so
 * NaN inputs stay harmless (their lanes are discarded by a later select). */
#define RP_ROUND_MAGIC 12582912.0f /* 0x1.8p23 */
#define RP_ROUND_MAGIC_BITS 0x4b400000u

RP_HOSTDEV float rp_absf(float x) { return rp_bits_to_f32(rp_f32_to_bits(x) & ~RP_F32_SIGN); }

RP_HOSTDEV float rp_with_sign_of(float mag, float x)
{
    return rp_bits_to_f32(rp_f32_to_bits(mag) | (rp_f32_to_bits(x) & RP_F32_SIGN));
}

/* 2^k as a float for an integer k in [-126, 127]. */
RP_HOSTDEV float rp_pow2i(uint32_t k_twos)
{
    return rp_bits_to_f32((k_twos + 127u) << 23);
}

/* ---- exp / expm1 ---- */

/* ln 2 split so that k * RP_LN2_HI is exact for |k| <= 255 (15 significant bits). */
#define RP_LN2_HI 0x1.62e4p-1f
#define RP_LN2_LO 1.428606765330187e-06f
#define RP_LOG2E 1.44269502162933349609375f

/* expm1(r) for |r| <= ln2/2: Taylor to degree 8, truncation error < 2^-31 * |r|. */
RP_HOSTDEV float rp_expm1_reduced(float r)
{
    float q = 1.0f / 40320.0f;
    q = 1.0f / 5040.0f + r * q;
    q = 1.0f / 720.0f + r * q;
    q = 1.0f / 120.0f + r * q;
    q = 1.0f / 24.0f + r * q;
    q = 1.0f / 6.0f + r * q;
    q = 0.5f + r * q;
    return r + (r * r) * q;
}

/* Range reduction x = k ln2 + r, |r| <= ln2/2, for |x| < 2^21: returns r,
 * k as a float in *kf and in two's complement in *kbits. */
RP_HOSTDEV float rp_exp_reduce(float x, float *kf, uint32_t *kbits)
{
    float t = x * RP_LOG2E + RP_ROUND_MAGIC;
    float k = t - RP_ROUND_MAGIC;
    *kf = k;
    *kbits = rp_f32_to_bits(t) - RP_ROUND_MAGIC_BITS;
    return (x - k * RP_LN2_HI) - k * RP_LN2_LO;
}

RP_HOSTDEV float rp_expf(float x)
{
    /* Clamped (NaN passes the compares) to where the result is still
     * inf / 0 after rounding: k stays in [-150, 128]. */
    float xc = x > 89.0f ? 89.0f : (x < -104.0f ? -104.0f : x);
    float kf;
    uint32_t k, k1;
    float r = rp_exp_reduce(xc, &kf, &k);
    float p = 1.0f + rp_expm1_reduced(r);
    /* 2^k = 2^k1 * 2^(k-k1) with both factors normal; p * 2^k1 is exact, so
     * the only rounding is the last product (also into subnormals). */
    k1 = ((k + 1024u) >> 1) - 512u; /* floor(k / 2) */
    return (p * rp_pow2i(k1)) * rp_pow2i(k - k1);
}

RP_HOSTDEV float rp_expm1f(float x)
{
    /* below -18 the result rounds to -1; above 89 it is inf */
    float xc = x > 89.0f ? 89.0f : (x < -18.0f ? -18.0f : x);
    float kf, e, half, res;
    uint32_t k;
    float r = rp_exp_reduce(xc, &kf, &k);
    e = rp_expm1_reduced(r);
    /* expm1(x) = 2^k e + (2^k - 1), computed halved so that 2^(k-1) is
     * representable up to k = 128; the doubling is exact. */
    half = rp_pow2i(k - 1u);
    res = ((half - 0.5f) + half * e) * 2.0f;
    res = k == 0u ? e : res; /* exact for tiny x, where halving would underflow */
    return x == 0.0f ? x : res; /* keeps the sign of zero */
}

/* ---- log1p ---- */

RP_HOSTDEV float rp_log1pf(float x)
{
    /* log1p(x) = k ln2 + log1p(f) + c, with 1 + x = 2^k (1 + f) rounded to
     * u = 1 + x, 1 + f in [sqrt(2)/2, sqrt(2)), and c ~ (1 + x - u) / u the
     * correction for the rounding of u. Near 0 (where 1 + x is already in
     * range) f = x exactly and k = c = 0. */
    const uint32_t sqrt_half_bits = 0x3f3504f3u; /* sqrt(2)/2 */
    float u = 1.0f + x;
    uint32_t iu = rp_f32_to_bits(u) + (0x3f800000u - sqrt_half_bits);
    uint32_t k_twos = (iu >> 23) - 127u; /* garbage for u <= 0: selected away */
    float fu = rp_bits_to_f32((iu & 0x007fffffu) + sqrt_half_bits) - 1.0f;
    float cu = (u >= 2.0f ? 1.0f - (u - x) : x - (u - 1.0f)) / u;
    int near0 = x > -0.29289321881f && x < 0.41421356237f;
    float f = near0 ? x : fu;
    float c = near0 ? 0.0f : cu;
    float dk = near0 ? 0.0f : (float)(int32_t)k_twos;
    /* log1p(f) = 2 atanh(s), s = f / (2 + f), |s| < 0.1716:
     *          = f - hfsq + s (hfsq + R), R = 2s^2/3 + 2s^4/5 + ... */
    float s = f / (2.0f + f);
    float z = s * s;
    float rr = z * (2.0f / 3.0f + z * (2.0f / 5.0f + z * (2.0f / 7.0f + z * (2.0f / 9.0f))));
    float hfsq = 0.5f * f * f;
    float res = s * (hfsq + rr) + (dk * RP_LN2_LO + c) - hfsq + f + dk * RP_LN2_HI;
    res = rp_absf(x) < 0x1p-24f ? x : res; /* +-0, subnormals: log1p(x) rounds to x */
    res = x == -1.0f ? -rp_bits_to_f32(RP_F32_INF) : res;
    res = x < -1.0f ? rp_bits_to_f32(RP_F32_QNAN) : res;
    res = x == rp_bits_to_f32(RP_F32_INF) ? x : res;
    return x != x ? x : res;
}

/* ---- tanh ---- */

RP_HOSTDEV float rp_tanhf(float x)
{
    /* On |x|: below log(3)/2, a + a z P(z) with z = a^2 and P a degree-4
     * fit of (tanh(a)/a - 1)/z (relative error < 1e-9); above, 1 - 2/(t + 2)
     * with t = expm1(2|x|), whose error the division damps; past 10 the
     * result is 1 in float (the clamp keeps t finite). */
    float a = rp_absf(x);
    float ac = a > 10.0f ? 10.0f : a;
    float z = ac * ac;
    float p = -0.006286973159034634f;
    float t, res;
    p = 0.02108073180407005f + z * p;
    p = -0.05385452637729472f + z * p;
    p = 0.13332607508735586f + z * p;
    p = -0.33333318199907214f + z * p;
    t = rp_expm1f(2.0f * ac);
    res = ac <= 0.54930614433f ? ac + ac * (z * p) : 1.0f - 2.0f / (t + 2.0f);
    res = rp_with_sign_of(res, x);
    return x != x ? x : res;
}

/* ---- erf ---- */

RP_HOSTDEV float rp_erff(float x)
{
    /* |x| < 1:  erf = a + a * P(a^2), P a degree-6 fit of erf(a)/a - 1
     *           (|error| < 1.2e-9);
     * 1..4:     erf = 1 - exp(-a^2) * Q(1/a), Q a degree-7 fit of
     *           erfcx(a) = exp(a^2) erfc(a) weighted by exp(-a^2), so the
     *           error in erf is < 2.6e-10;
     * >= 4:     1 (erfc(4) < 2^-25). */
    float a = rp_absf(x);
    float z = a * a;
    float p = 7.889285487976128e-05f;
    float ab, u, qv, lo, hi, res;
    p = -0.0008020894938329942f + z * p;
    p = 0.005189542003818798f + z * p;
    p = -0.026854448557847715f + z * p;
    p = 0.11283600290661125f + z * p;
    p = -0.3761262715004068f + z * p;
    p = 0.12837916591864698f + z * p;
    lo = a + a * p;

    ab = a < 1.0f ? 1.0f : (a > 4.0f ? 4.0f : a);
    u = 1.0f / ab;
    qv = -0.018048690937984613f;
    qv = 0.1201346530347055f + u * qv;
    qv = -0.349608877949779f + u * qv;
    qv = 0.5662845222337172f + u * qv;
    qv = -0.49649530989411217f + u * qv;
    qv = 0.04602079280418708f + u * qv;
    qv = 0.5590953795049713f + u * qv;
    qv = 0.0002011066641160079f + u * qv;
    hi = 1.0f - rp_expf(-(ab * ab)) * qv;

    res = a < 1.0f ? lo : (a < 4.0f ? hi : 1.0f);
    res = rp_with_sign_of(res, x);
    return x != x ? x : res;
}

/* ---- the activations: y = f(x), d = f'(x) ---- */

#define RP_GELU_ALPHA 0.7071067690849304f       /* float(M_SQRT1_2) */
#define RP_GELU_BETA 0.3989422917366028f        /* float(M_2_SQRTPI * M_SQRT1_2 * 0.5) */
#define RP_GELU_TANH_BETA 0.7978845834732056f   /* float(M_SQRT2 * M_2_SQRTPI * 0.5) */
#define RP_GELU_TANH_KAPPA 0.044715f
#define RP_SELU_ALPHA 1.6732632423543772848170429916717f
#define RP_SELU_SCALE 1.0507009873554804934193349852946f

/* sigmoid(x) as torch writes it: 1 / (1 + exp(-x)). */
RP_HOSTDEV float rp_sigmoidf(float x) { return 1.0f / (1.0f + rp_expf(-x)); }

/* torch's elu(x, alpha * scale = negcoef, scale = poscoef, input_scale =
 * negiptcoef) forward (Elu.h, vectorized: x >= 0 selects the positive side)
 * and its backward with is_result=false (x > 0 selects the positive side). */
RP_HOSTDEV void rp_elu_eval(float negcoef, float poscoef, float negiptcoef, float x, float *y,
                            float *d)
{
    float xs = x * negiptcoef;
    *y = x >= 0.0f ? x * poscoef : rp_expm1f(xs) * negcoef;
    *d = x > 0.0f ? poscoef : negiptcoef * negcoef * rp_expf(xs);
}

/* Softsign is x / (|x| + 1) in torch.nn.functional, so its gradient is what
 * autograd sums from div and abs: 1/a + (-((x/a)/a)) * sgn(x), a = |x| + 1
 * (sgn(0) = 0; NaN at +-inf, where torch gives NaN too). */
RP_HOSTDEV void rp_softsign_eval(float x, float *y, float *d)
{
    float a = rp_absf(x) + 1.0f;
    float sgn = x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f);
    *y = x / a;
    *d = 1.0f / a + (-((x / a) / a)) * sgn;
}

RP_HOSTDEV void rp_fad_eval(int kind, float p0, float p1, float x, float *y, float *d)
{
    switch (kind) {
    case RP_FAD_GELU: {
        float e = rp_erff(x * RP_GELU_ALPHA);
        float cdf = 0.5f * (1.0f + e);
        float pdf = RP_GELU_BETA * rp_expf(x * x * -0.5f);
        *y = x * 0.5f * (1.0f + e);
        *d = cdf + x * pdf;
        break;
    }
    case RP_FAD_GELU_TANH: {
        float x_sq = x * x;
        float inner = RP_GELU_TANH_BETA * (x + RP_GELU_TANH_KAPPA * (x * x * x));
        float t = rp_tanhf(inner);
        float left = 0.5f * x;
        float right = 1.0f + t;
        float inner_d = RP_GELU_TANH_BETA * (1.0f + 3.0f * RP_GELU_TANH_KAPPA * x_sq);
        *y = left * right;
        *d = 0.5f * right + left * (1.0f - t * t) * inner_d;
        break;
    }
    case RP_FAD_SILU: {
        float den = 1.0f + rp_expf(-x);
        float s = 1.0f / den;
        *y = x / den;
        *d = s * (1.0f + x * (1.0f - s));
        break;
    }
    case RP_FAD_MISH: {
        float tsp = rp_tanhf(rp_log1pf(rp_expf(x)));
        float s = rp_sigmoidf(x);
        *y = x * tsp;
        *d = tsp + x * s * (1.0f - tsp * tsp);
        break;
    }
    case RP_FAD_SOFTPLUS: { /* p0 = beta, p1 = threshold */
        float xb = x * p0;
        float z = rp_expf(xb);
        int linear = xb > p1;
        *y = linear ? x : rp_log1pf(z) / p0;
        *d = linear ? 1.0f : z / (z + 1.0f);
        break;
    }
    case RP_FAD_SIGMOID: {
        float s = rp_sigmoidf(x);
        *y = s;
        *d = (1.0f - s) * s; /* torch's sigmoid_backward: from the output */
        break;
    }
    case RP_FAD_TANH: {
        float t = rp_tanhf(x);
        *y = t;
        *d = 1.0f - t * t; /* torch's tanh_backward: from the output */
        break;
    }
    case RP_FAD_ELU:
        rp_elu_eval(p0 * 1.0f, 1.0f, 1.0f, x, y, d);
        break;
    case RP_FAD_CELU: /* torch: elu(x, alpha, scale=1, input_scale=1/alpha) */
        rp_elu_eval(p0 * 1.0f, 1.0f, 1.0f / p0, x, y, d);
        break;
    case RP_FAD_SELU:
        rp_elu_eval(RP_SELU_ALPHA * RP_SELU_SCALE, RP_SELU_SCALE, 1.0f, x, y, d);
        break;
    case RP_FAD_LEAKY_RELU: {
        float slope = x > 0.0f ? 1.0f : p0;
        *y = x * slope;
        *d = slope;
        break;
    }
    case RP_FAD_HARDSWISH: {
        float m = x + 3.0f;
        m = m < 0.0f ? 0.0f : m;
        m = m > 6.0f ? 6.0f : m;
        *y = x * m / 6.0f;
        /* torch 2.13 (measured): 0 from -3 down, 1 from 3 up, NaN stays NaN.
         * -0 from -3 down tells torch's select (a 0 gradient even from an inf)
         * from the +0 of the middle piece at x = -1.5, which it multiplies. */
        float mid = x / 3.0f + 0.5f;
        *d = x <= -3.0f ? -0.0f : (x >= 3.0f ? 1.0f : mid);
        break;
    }
    case RP_FAD_HARDSIGMOID: {
        float m = x + 3.0f;
        m = m < 0.0f ? 0.0f : m; /* NaN passes, as torch's vec::maximum */
        m = m > 6.0f ? 6.0f : m;
        *y = m / 6.0f;
        *d = (x > -3.0f) & (x < 3.0f) ? 1.0f / 6.0f : 0.0f;
        break;
    }
    case RP_FAD_LOGSIGMOID: {
        /* torch: z = exp(-|x|) is the saved buffer; y = min(x, 0) - log1p(z);
         * backward (max_deriv - sign * (z / (1 + z))) with the sign of x. */
        float z = rp_expf(-rp_absf(x));
        int neg = x < 0.0f;
        float mn = neg ? x : (x != x ? x : 0.0f);
        *y = mn - rp_log1pf(z);
        *d = (neg ? 1.0f : 0.0f) - (neg ? 1.0f : -1.0f) * (z / (1.0f + z));
        break;
    }
    case RP_FAD_SOFTSIGN:
        rp_softsign_eval(x, y, d);
        break;
    case RP_FAD_TANHSHRINK: {
        /* x - tanh(x); autograd: grad + (-grad) * (1 - t^2) */
        float t = rp_tanhf(x);
        *y = x - t;
        *d = 1.0f + (-1.0f) * (1.0f - t * t);
        break;
    }
    default:
        *y = rp_bits_to_f32(RP_F32_QNAN);
        *d = rp_bits_to_f32(RP_F32_QNAN);
        break;
    }
}

/* ---- the 8-bit derivative code ---- */

/* Whether x lies on the activation's constant-slope piece, decided from x
 * with torch's own comparisons (so d there is exactly the constant). */
RP_HOSTDEV int rp_fad_on_exact_piece(int kind, float p0, float p1, float x)
{
    switch (kind) {
    case RP_FAD_ELU:
    case RP_FAD_CELU:
    case RP_FAD_SELU:
    case RP_FAD_LEAKY_RELU:
        return x > 0.0f;
    case RP_FAD_HARDSWISH:
        return x >= 3.0f;
    case RP_FAD_SOFTPLUS:
        return x * p0 > p1;
    default:
        return 0;
    }
}

/* The code of derivative d at x: NaN, exact, or the nearest grid point
 * zero_code + rint(d * inv_step) clamped to [0, RP_FAD_CODE_GRID - 1]. */
RP_HOSTDEV uint8_t rp_fad_encode(int kind, float p0, float p1, float x, float d, float inv_step,
                                 int zero_code)
{
    float lo = (float)-zero_code;
    float hi = (float)(RP_FAD_CODE_GRID - 1 - zero_code);
    float q = d * inv_step;
    uint32_t code;
    q = q < lo ? lo : (q > hi ? hi : q); /* also keeps q inside the magic's range */
    code = (uint32_t)zero_code + (rp_f32_to_bits(q + RP_ROUND_MAGIC) - RP_ROUND_MAGIC_BITS);
    code = d != d ? (uint32_t)RP_FAD_CODE_NAN : code;
    code = rp_fad_on_exact_piece(kind, p0, p1, x) ? (uint32_t)RP_FAD_CODE_EXACT : code;
    return (uint8_t)code;
}

#endif /* REPROP_FAD_MATH_H */
