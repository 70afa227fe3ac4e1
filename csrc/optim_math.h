/*
 * optim_math.h: the per-element update of every fused optimizer, shared by
 * the CPU loops (csrc/optim.c) and the CUDA kernels (kernels/optim.cu) so that
 * both compute exactly the same thing.
 *
 * The order of operations follows torch.optim's single-tensor implementations
 * term by term (torch 2.x, e.g. torch/optim/adam.py `_single_tensor_adam`):
 * every Python float is rounded to float32 once, as torch does when it
 * multiplies a float32 tensor by a Python scalar, and each tensor op rounds
 * its result once, as ATen's kernels do:
 *
 *   add(x, alpha=a)            fma(a, x, self)
 *   addcmul(t1, t2, value=v)   fma(v * t1, t2, self)
 *   lerp(end, w)               fma(w, end - self, self), or for |w| >= 0.5
 *                              fma(-(end - self), 1 - w, end)
 *   addcdiv(t1, t2, value=v)   self + v * t1 / t2, each op rounded
 *
 * The fused multiply-adds are torch's: its CPU kernels for AVX2 and AVX-512
 * (vectorized bodies and scalar tails alike) and its CUDA kernels contract
 * these three ops, and the single rounding decides more than the last bit:
 * a product that overflows on its own (RMSprop's centered square_avg minus
 * grad_avg^2 once square_avg is inf, SGD's lr * grad against a large param)
 * or underflows to a zero of the wrong sign. torch's baseline x86 kernels
 * (CPUs without AVX2 and FMA, ATEN_CPU_CAPABILITY=default) round the product
 * apart, and so do the CPU loops on such CPUs (rp_optim_consts.fused_madd),
 * where a fused multiply-add would be a software fmaf call per element.
 * Every other multiply-add rounds term by term (the build disables
 * contraction), so the CPU loops and the CUDA kernels agree bit for bit
 * wherever both fuse.
 *
 * Arithmetic is float32 whatever the parameter dtype; state is float32.
 */
#ifndef REPROP_OPTIM_MATH_H
#define REPROP_OPTIM_MATH_H

#include "rp_internal.h"
#include "reprop.h"

#if defined(__CUDA_ARCH__)
#define RP_SQRTF(x) __fsqrt_rn(x) /* IEEE round-to-nearest whatever -prec-sqrt says */
#define RP_DMUL(a, b) __dmul_rn(a, b) /* never contracted into a following add */
#define RP_FMAF(a, b, c) __fmaf_rn(a, b, c)
#define RP_ISNAN(x) isnan(x)
#elif defined(__CUDACC__)
#define RP_SQRTF(x) sqrtf(x)
#define RP_FMAF(a, b, c) fmaf(a, b, c)
#define RP_ISNAN(x) isnan(x)
#define RP_DMUL(a, b) ((a) * (b))
#else
#include <math.h>
#define RP_SQRTF(x) sqrtf(x)
/* one instruction in the AVX2 and AVX-512 clones of the CPU loops; a libm call
 * in the baseline x86-64 one (and in a build without target_clones), which
 * fuses only on CPUs with AVX2 and FMA: in that clone the few without the rest
 * of x86-64-v3 */
#define RP_FMAF(a, b, c) fmaf(a, b, c)
#define RP_ISNAN(x) ((x) != (x))
#define RP_DMUL(a, b) ((a) * (b)) /* the build does not contract */
#endif

/* The element math below is inlined into every CPU loop, or the loop does
 * not vectorize: forced, since optim.c's loops (a fused and a plain set of
 * each, in three clones) take GCC past its unit growth limit for inline. */
#if defined(__CUDACC__) || !defined(__GNUC__)
#define RP_OPTIM_INLINE RP_HOSTDEV
#else
#define RP_OPTIM_INLINE static inline __attribute__((always_inline))
#endif

#if defined(__CUDACC__)
/* torch's CUDA kernels fuse, and every CUDA device has the instruction */
#define RP_FUSED_MADD() 1
#else
/* Whether torch's CPU kernels fuse on this CPU (common.c). */
#define RP_FUSED_MADD() rp_cpu_has(RP_CPU_FUSED_MADD)
#endif

/* Hyper-parameters rounded to float32 once per call, in the form each
 * optimizer's inner loop reads them. */
typedef struct {
    float sign;            /* -1 when maximize, else 1: exact negation */
    int has_wd;            /* weight_decay != 0, coupled (not AdamW's) */
    float wd;              /* coupled weight decay: grad + wd * param */
    float decay_factor;    /* AdamW: 1 - lr * weight_decay (weight_decay != 0); else 1,
                              and param * 1 is param */
    float eps;
    float w1, one_minus_w1; /* lerp weight (1 - beta1 or 1 - alpha) and 1 - weight */
    float beta2, one_minus_beta2;
    int amsgrad;
    float momentum, one_minus_dampening, neg_lr;
    int nesterov, has_momentum;
    float alpha, one_minus_alpha; /* RMSprop */
    int centered;
    float rho, one_minus_rho;     /* Adadelta */
    int fused_madd;               /* round add(alpha=), addcmul and lerp once (rp_madd) */
} rp_optim_consts;

/* Whether the update keeps a momentum buffer: torch's SGD tests momentum != 0,
 * its RMSprop momentum > 0 (a negative or NaN momentum set after construction
 * runs plain RMSprop there). */
RP_HOSTDEV int rp_optim_has_momentum(const rp_optim_hparams *hp)
{
    return hp->kind == RP_RMSPROP ? hp->momentum > 0.0 : hp->momentum != 0.0;
}

/* x, a float32 result of a tensor op on a tensor lr of rp_lr_kind `kind`
 * (RP_LR_F32, F16 or BF16), rounded to the lr's dtype as that op rounds it. */
RP_HOSTDEV float rp_lr_round(int kind, float x)
{
    if (kind == RP_LR_F16)
        return rp_f16_to_f32(rp_f32_to_f16(x));
    if (kind == RP_LR_BF16)
        return rp_bf16_to_f32(rp_f32_to_bf16(x));
    return x;
}

/* The arithmetic of tensor ops on hyper-parameters of rp_lr_kind `kind`
 * (reprop.h), in double: for RP_LR_NUMBER and RP_LR_F64 the double itself;
 * else float32 operands and each result rounded to float32 (one +, -, *, /
 * or sqrt of float32 operands is the same in double rounded once to float32
 * as in float32), then to a 16-bit dtype. RP_DMUL keeps a device from
 * contracting a product into the add that follows it. */

/* x as an operand of such an op: a number is converted to the op's math
 * type (float32 but for float64). */
RP_HOSTDEV double rp_kind_operand(int kind, double x)
{
    return kind == RP_LR_NUMBER || kind == RP_LR_F64 ? x : (double)(float)x;
}

/* x, the exact result of such an op, rounded as the op rounds it. */
RP_HOSTDEV double rp_kind_round(int kind, double x)
{
    return kind == RP_LR_NUMBER || kind == RP_LR_F64 ? x : (double)rp_lr_round(kind, (float)x);
}

/* The kind of an op on values of kinds a and b: torch's promotion of two
 * 0-d tensors (a number takes the tensor's dtype). */
RP_HOSTDEV int rp_kind_promote(int a, int b)
{
    if (a == RP_LR_NUMBER)
        return b;
    if (b == RP_LR_NUMBER || a == b)
        return a;
    if (a == RP_LR_F64 || b == RP_LR_F64)
        return RP_LR_F64;
    return RP_LR_F32; /* float32 with a 16-bit dtype, float16 with bfloat16 */
}

/* 1 - x, x of `kind`. */
RP_HOSTDEV float rp_kind_one_minus(int kind, double x)
{
    return (float)rp_kind_round(kind, 1.0 - rp_kind_operand(kind, x));
}

/* lr / denom, lr of hp->lr_kind and denom of `denom_kind`, as torch computes
 * it: a number over a tensor is the tensor's reciprocal times the number
 * (Tensor.__rtruediv__), two ops; else one division in the promoted kind. */
RP_HOSTDEV double rp_lr_over(const rp_optim_hparams *hp, double lr, int denom_kind, double denom)
{
    int k = denom_kind;
    if (hp->lr_kind == RP_LR_NUMBER && k != RP_LR_NUMBER)
        return rp_kind_round(k, rp_kind_round(k, 1.0 / denom) * rp_kind_operand(k, lr));
    k = rp_kind_promote(hp->lr_kind, denom_kind);
    return rp_kind_round(k, rp_kind_operand(k, lr) / rp_kind_operand(k, denom));
}

/* AdamW's 1 - lr * weight_decay as torch computes it: in double, rounded to
 * float32 once by the param's mul_, for numbers (or float64 tensors); else
 * two tensor ops in the kind both promote to. */
RP_HOSTDEV float rp_decay_factor(const rp_optim_hparams *hp, double lr)
{
    const int k = rp_kind_promote(hp->lr_kind, hp->weight_decay_kind);
    const double lr_wd = RP_DMUL(rp_kind_operand(k, lr), rp_kind_operand(k, hp->weight_decay));
    return (float)rp_kind_round(k, 1.0 - rp_kind_round(k, lr_wd));
}

/* beta ** t of a tensor beta of `kind` (not a number) as torch's pow of a
 * 0-d tensor by a Python float: t converted to the tensor's dtype, the
 * powers 2 and 3 as products (but for float16), others by pow. */
RP_HOSTDEV double rp_kind_pow(int kind, double beta, double t)
{
    const double e = rp_kind_round(kind, t);
    if (kind != RP_LR_F16 && (e == 2.0 || e == 3.0)) {
        const double square = rp_kind_round(kind, beta * beta);
        return e == 2.0 ? square : rp_kind_round(kind, square * beta);
    }
    return rp_kind_round(kind, pow(beta, e));
}

/* Adam's terms at step t. */
typedef struct {
    double pow1, pow2;   /* beta1 ** t, beta2 ** t */
    double bc1, bc2;     /* 1 - pow1, 1 - pow2 */
    double step_size;    /* lr / bc1 */
    double bc2_sqrt;     /* bc2 ** 0.5 */
} rp_adam_terms;

/* Adam's terms at step t as torch's for-loop update computes them, with
 * number betas in Python (a number beta ** t is Python's pow, whose errors
 * the host checks), tensor ones in tensor ops of their kinds. */
RP_HOSTDEV void rp_adam_step_terms(const rp_optim_hparams *hp, double lr, double t,
                                   rp_adam_terms *r)
{
    const int k1 = hp->beta1_kind, k2 = hp->beta2_kind;
    r->pow1 = k1 == RP_LR_NUMBER ? pow(hp->beta1, t) : rp_kind_pow(k1, hp->beta1, t);
    r->pow2 = k2 == RP_LR_NUMBER ? pow(hp->beta2, t) : rp_kind_pow(k2, hp->beta2, t);
    r->bc1 = rp_kind_round(k1, 1.0 - r->pow1);
    r->bc2 = rp_kind_round(k2, 1.0 - r->pow2);
    r->step_size = rp_lr_over(hp, lr, k1, r->bc1);
    /* Python's (-inf) ** 0.5 is inf (beta2 = inf), a tensor's sqrt NaN */
    r->bc2_sqrt = k2 == RP_LR_NUMBER && isinf(r->bc2) ? INFINITY
                                                      : rp_kind_round(k2, sqrt(r->bc2));
}

/* Adagrad's 1 + (t - 1) * lr_decay as torch computes it. */
RP_HOSTDEV double rp_adagrad_decay(const rp_optim_hparams *hp, double t)
{
    const int k = hp->lr_decay_kind;
    const double prod = RP_DMUL(rp_kind_operand(k, t - 1.0), rp_kind_operand(k, hp->lr_decay));
    return rp_kind_round(k, 1.0 + rp_kind_round(k, prod));
}

/* Fills the float constants from the double hyper-parameters. `lr` is passed
 * separately because capturable CUDA updates read it from device memory. */
RP_HOSTDEV void rp_optim_make_consts(const rp_optim_hparams *hp, double lr, rp_optim_consts *c)
{
    const int decoupled = hp->kind == RP_ADAM && hp->decoupled_weight_decay;
    memset(c, 0, sizeof *c);
    c->sign = hp->maximize ? -1.0f : 1.0f;
    c->has_wd = hp->weight_decay != 0.0 && !decoupled;
    c->wd = (float)hp->weight_decay;
    /* torch multiplies only for a non-zero weight_decay: 1 - inf * 0 is NaN */
    c->decay_factor = decoupled && hp->weight_decay != 0.0 ? rp_decay_factor(hp, lr) : 1.0f;
    c->eps = (float)hp->eps;
    c->amsgrad = hp->amsgrad;
    c->momentum = (float)hp->momentum;
    c->has_momentum = rp_optim_has_momentum(hp);
    c->one_minus_dampening = rp_kind_one_minus(hp->dampening_kind, hp->dampening);
    c->nesterov = hp->nesterov;
    c->neg_lr = (float)(-lr);
    c->beta2 = (float)hp->beta2;
    c->one_minus_beta2 = rp_kind_one_minus(hp->beta2_kind, hp->beta2);
    c->alpha = (float)hp->alpha;
    c->one_minus_alpha = rp_kind_one_minus(hp->alpha_kind, hp->alpha);
    c->centered = hp->centered;
    c->rho = (float)hp->rho;
    c->one_minus_rho = rp_kind_one_minus(hp->rho_kind, hp->rho);
    /* torch casts a tensor beta1 to the (float32) moment's dtype first */
    if (hp->kind == RP_ADAM)
        c->w1 = rp_kind_one_minus(hp->beta1_kind == RP_LR_NUMBER ? RP_LR_NUMBER : RP_LR_F32,
                                  hp->beta1);
    else if (hp->kind == RP_RMSPROP)
        c->w1 = c->one_minus_alpha;
    c->one_minus_w1 = 1.0f - c->w1;
    c->fused_madd = RP_FUSED_MADD();
}

/* The state slots these hyper-parameters use: bit i set for entry.state[i]. */
RP_HOSTDEV unsigned rp_optim_state_slots(const rp_optim_hparams *hp)
{
    switch (hp->kind) {
    case RP_SGD:
        return rp_optim_has_momentum(hp) ? 1u : 0u;
    case RP_ADAM:
        return 3u | (hp->amsgrad ? 4u : 0u);
    case RP_ADAGRAD:
        return 1u;
    case RP_RMSPROP:
        return 1u | (rp_optim_has_momentum(hp) ? 2u : 0u) | (hp->centered ? 4u : 0u);
    case RP_ADADELTA:
        return 3u;
    default:
        return 0u;
    }
}

/* a * b + c as torch computes it on this device: rounded once where its
 * kernels fuse (`fused`), else the product and the sum each rounded. The CPU
 * loops pass a literal, so the choice folds away and each copy vectorizes;
 * on a CUDA device `fused` is always 1 (RP_FUSED_MADD) and not read, so that
 * no kernel selects per element. */
RP_OPTIM_INLINE float rp_madd(int fused, float a, float b, float c)
{
#if defined(__CUDA_ARCH__)
    (void)fused;
    return RP_FMAF(a, b, c);
#else
    return fused ? RP_FMAF(a, b, c) : a * b + c;
#endif
}

/* torch's self.add(other, alpha=alpha). */
RP_OPTIM_INLINE float rp_add_alpha(int fused, float self, float other, float alpha)
{
    return rp_madd(fused, alpha, other, self);
}

/* Conditions in the element math pick operands (values at hand or constants),
 * never whether something is computed: GCC vectorizes a CPU loop with a branch
 * only by turning it into a select, which it refuses where a branch calls fmaf
 * or does floating-point arithmetic (that might trap), unless it unswitches
 * the loop, which it does for small ones only. The two below rest on
 * x + -0.0 == x for every float x, -0.0 and NaN included, and on 0 * -0.0
 * and 1 * x being exact. */

/* cond ? self.add(other, alpha=alpha) : self */
RP_OPTIM_INLINE float rp_add_alpha_if(int fused, int cond, float self, float other, float alpha)
{
    return rp_madd(fused, cond ? alpha : 0.0f, cond ? other : -0.0f, self);
}

/* cond ? self.add(other, alpha=alpha) : other */
RP_OPTIM_INLINE float rp_add_alpha_or_other(int fused, int cond, float self, float other, float alpha)
{
    return rp_madd(fused, cond ? alpha : 1.0f, other, cond ? self : -0.0f);
}

/* torch's self.addcmul(t1, t2, value=value). */
RP_OPTIM_INLINE float rp_addcmul(int fused, float self, float t1, float t2, float value)
{
    return rp_madd(fused, value * t1, t2, self);
}

/* torch's self.addcdiv(t1, t2, value=value): a division, so nothing to fuse. */
RP_OPTIM_INLINE float rp_addcdiv(float self, float t1, float t2, float value)
{
    return self + value * t1 / t2;
}

/* torch.lerp(self, end, w): self + w * (end - self) for |w| < 0.5, else
 * end - (1 - w) * (end - self); one multiply-add of picked operands, as in
 * ATen's vectorized lerp. */
RP_OPTIM_INLINE float rp_lerp(int fused, float self, float end, float w, float one_minus_w)
{
    int small_w = fabsf(w) < 0.5f;
    return rp_madd(fused, small_w ? w : -one_minus_w, end - self, small_w ? self : end);
}

/* torch.maximum: NaN in either operand wins. */
RP_OPTIM_INLINE float rp_maximum(float a, float b)
{
    /* one expression of selects, so that CPU loops stay branch-free */
    float m = a > b ? a : b;
    m = RP_ISNAN(b) ? b : m;
    return RP_ISNAN(a) ? a : m;
}

/* Gradient after maximize and coupled weight decay. */
RP_OPTIM_INLINE float rp_effective_grad(const rp_optim_consts *c, float g, float p)
{
    return rp_add_alpha_if(c->fused_madd, c->has_wd, c->sign * g, p, c->wd);
}

/* SGD. buf: momentum_buffer (unused without momentum); fresh: buffer just
 * created (a literal in the CPU loops, where this branch must fold away). */
RP_OPTIM_INLINE float rp_sgd_elem(const rp_optim_consts *c, float p, float g, float *buf, int fresh)
{
    g = rp_effective_grad(c, g, p);
    if (c->has_momentum) {
        float b = fresh ? g
                        : rp_add_alpha(c->fused_madd, *buf * c->momentum, g,
                                       c->one_minus_dampening);
        *buf = b;
        g = rp_add_alpha_or_other(c->fused_madd, c->nesterov, g, b, c->momentum);
    }
    return rp_add_alpha(c->fused_madd, p, g, c->neg_lr);
}

/* Adam / AdamW. neg_step_size = -lr / (1 - beta1^t), bc2_sqrt = sqrt(1 - beta2^t). */
RP_OPTIM_INLINE float rp_adam_elem(const rp_optim_consts *c, float p, float g, float *m, float *v,
                              float *vmax, float neg_step_size, float bc2_sqrt)
{
    float mm, vv, denom;
    p = p * c->decay_factor;
    g = rp_effective_grad(c, g, p);
    mm = rp_lerp(c->fused_madd, *m, g, c->w1, c->one_minus_w1);
    vv = rp_addcmul(c->fused_madd, *v * c->beta2, g, g, c->one_minus_beta2);
    *m = mm;
    *v = vv;
    if (c->amsgrad) {
        vv = rp_maximum(*vmax, vv);
        *vmax = vv;
    }
    denom = RP_SQRTF(vv) / bc2_sqrt + c->eps;
    return rp_addcdiv(p, mm, denom, neg_step_size);
}

/* Adagrad. neg_clr = -lr / (1 + (t - 1) * lr_decay). */
RP_OPTIM_INLINE float rp_adagrad_elem(const rp_optim_consts *c, float p, float g, float *sum,
                                 float neg_clr)
{
    float s;
    g = rp_effective_grad(c, g, p);
    s = rp_addcmul(c->fused_madd, *sum, g, g, 1.0f);
    *sum = s;
    return rp_addcdiv(p, g, RP_SQRTF(s) + c->eps, neg_clr);
}

/* RMSprop. sq: square_avg, buf: momentum_buffer, ga: grad_avg (centered). */
RP_OPTIM_INLINE float rp_rmsprop_elem(const rp_optim_consts *c, float p, float g, float *sq,
                                 float *buf, float *ga)
{
    float s, avg;
    g = rp_effective_grad(c, g, p);
    s = rp_addcmul(c->fused_madd, *sq * c->alpha, g, g, c->one_minus_alpha);
    *sq = s;
    if (c->centered) {
        float a = rp_lerp(c->fused_madd, *ga, g, c->w1, c->one_minus_w1);
        *ga = a;
        avg = RP_SQRTF(rp_addcmul(c->fused_madd, s, a, a, -1.0f));
    } else {
        avg = RP_SQRTF(s);
    }
    avg = avg + c->eps;
    if (c->has_momentum) {
        float b = rp_addcdiv(*buf * c->momentum, g, avg, 1.0f);
        *buf = b;
        return rp_add_alpha(c->fused_madd, p, b, c->neg_lr);
    }
    return rp_addcdiv(p, g, avg, c->neg_lr);
}

/* Adadelta. sq: square_avg, acc: acc_delta. */
RP_OPTIM_INLINE float rp_adadelta_elem(const rp_optim_consts *c, float p, float g, float *sq,
                                  float *acc)
{
    float s, std, delta, a;
    g = rp_effective_grad(c, g, p);
    s = rp_addcmul(c->fused_madd, *sq * c->rho, g, g, c->one_minus_rho);
    *sq = s;
    std = RP_SQRTF(s + c->eps);
    delta = RP_SQRTF(*acc + c->eps);
    delta = delta / std;
    delta = delta * g;
    a = rp_addcmul(c->fused_madd, *acc * c->rho, delta, delta, c->one_minus_rho);
    *acc = a;
    return rp_add_alpha(c->fused_madd, p, delta, c->neg_lr);
}

#endif /* REPROP_OPTIM_MATH_H */
