/*
 * optim_math.h: the per-element update of every fused optimizer, shared by
 * the CPU loops (csrc/optim.c) and the CUDA kernels (kernels/optim.cu) so that
 * both compute exactly the same thing.
 *
 * The order of operations follows torch.optim's single-tensor implementations
 * term by term (torch 2.x, e.g. torch/optim/adam.py `_single_tensor_adam`):
 * every Python float is rounded to float32 once, as torch does when it
 * multiplies a float32 tensor by a Python scalar, and each tensor op rounds
 * its result. `add(x, alpha=a)` is `self + a * x`, `addcmul(t1, t2, value=v)`
 * is `self + v * t1 * t2`, `addcdiv(t1, t2, value=v)` is `self + v * t1 / t2`,
 * left to right, as in ATen's CPU kernels.
 *
 * Arithmetic is float32 whatever the parameter dtype; state is float32.
 */
#ifndef REPROP_OPTIM_MATH_H
#define REPROP_OPTIM_MATH_H

#include "rp_internal.h"
#include "reprop.h"

#if defined(__CUDA_ARCH__)
#define RP_SQRTF(x) __fsqrt_rn(x) /* IEEE round-to-nearest whatever -prec-sqrt says */
#define RP_ISNAN(x) isnan(x)
#elif defined(__CUDACC__)
#define RP_SQRTF(x) sqrtf(x)
#define RP_ISNAN(x) isnan(x)
#else
#include <math.h>
#define RP_SQRTF(x) sqrtf(x)
#define RP_ISNAN(x) ((x) != (x))
#endif

/* Hyper-parameters rounded to float32 once per call, in the form each
 * optimizer's inner loop reads them. */
typedef struct {
    float sign;            /* -1 when maximize, else 1: exact negation */
    int has_wd;            /* weight_decay != 0 */
    float wd;              /* coupled weight decay: grad + wd * param */
    float decay_factor;    /* AdamW: 1 - lr * weight_decay */
    int decoupled;
    float eps;
    float w1, one_minus_w1; /* lerp weight (1 - beta1 or 1 - alpha) and 1 - weight */
    float beta2, one_minus_beta2;
    int amsgrad;
    float momentum, one_minus_dampening, neg_lr;
    int nesterov, has_momentum;
    float alpha, one_minus_alpha; /* RMSprop */
    int centered;
    float rho, one_minus_rho;     /* Adadelta */
} rp_optim_consts;

/* Whether the update keeps a momentum buffer: torch's SGD tests momentum != 0,
 * its RMSprop momentum > 0 (a negative or NaN momentum set after construction
 * runs plain RMSprop there). */
RP_HOSTDEV int rp_optim_has_momentum(const rp_optim_hparams *hp)
{
    return hp->kind == RP_RMSPROP ? hp->momentum > 0.0 : hp->momentum != 0.0;
}

/* Fills the float constants from the double hyper-parameters. `lr` is passed
 * separately because capturable CUDA updates read it from device memory. */
RP_HOSTDEV void rp_optim_make_consts(const rp_optim_hparams *hp, double lr, rp_optim_consts *c)
{
    double w1 = 0.0;
    memset(c, 0, sizeof *c);
    c->sign = hp->maximize ? -1.0f : 1.0f;
    c->has_wd = hp->weight_decay != 0.0;
    c->wd = (float)hp->weight_decay;
    c->decoupled = hp->decoupled_weight_decay;
    c->decay_factor = (float)(1.0 - lr * hp->weight_decay);
    c->eps = (float)hp->eps;
    c->amsgrad = hp->amsgrad;
    c->momentum = (float)hp->momentum;
    c->has_momentum = rp_optim_has_momentum(hp);
    c->one_minus_dampening = (float)(1.0 - hp->dampening);
    c->nesterov = hp->nesterov;
    c->neg_lr = (float)(-lr);
    c->beta2 = (float)hp->beta2;
    c->one_minus_beta2 = (float)(1.0 - hp->beta2);
    c->alpha = (float)hp->alpha;
    c->one_minus_alpha = (float)(1.0 - hp->alpha);
    c->centered = hp->centered;
    c->rho = (float)hp->rho;
    c->one_minus_rho = (float)(1.0 - hp->rho);
    if (hp->kind == RP_ADAM)
        w1 = 1.0 - hp->beta1;
    else if (hp->kind == RP_RMSPROP)
        w1 = 1.0 - hp->alpha;
    c->w1 = (float)w1;
    c->one_minus_w1 = 1.0f - c->w1;
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

/* torch.lerp(self, end, w): the two formulas ATen picks between by |w|. */
RP_HOSTDEV float rp_lerp(float self, float end, float w, float one_minus_w)
{
    return (w < 0.5f && w > -0.5f) ? self + w * (end - self) : end - (end - self) * one_minus_w;
}

/* torch.maximum: NaN in either operand wins. */
RP_HOSTDEV float rp_maximum(float a, float b)
{
    /* one expression of selects, so that CPU loops stay branch-free */
    float m = a > b ? a : b;
    m = RP_ISNAN(b) ? b : m;
    return RP_ISNAN(a) ? a : m;
}

/* Gradient after maximize and coupled weight decay. */
RP_HOSTDEV float rp_effective_grad(const rp_optim_consts *c, float g, float p)
{
    g = c->sign * g;
    return c->has_wd ? g + c->wd * p : g;
}

/* SGD. buf: momentum_buffer (unused without momentum); fresh: buffer just created. */
RP_HOSTDEV float rp_sgd_elem(const rp_optim_consts *c, float p, float g, float *buf, int fresh)
{
    g = rp_effective_grad(c, g, p);
    if (c->has_momentum) {
        float b = fresh ? g : *buf * c->momentum + c->one_minus_dampening * g;
        *buf = b;
        g = c->nesterov ? g + c->momentum * b : b;
    }
    return p + c->neg_lr * g;
}

/* Adam / AdamW. neg_step_size = -lr / (1 - beta1^t), bc2_sqrt = sqrt(1 - beta2^t). */
RP_HOSTDEV float rp_adam_elem(const rp_optim_consts *c, float p, float g, float *m, float *v,
                              float *vmax, float neg_step_size, float bc2_sqrt)
{
    float mm, vv, denom;
    g = c->sign * g;
    if (c->has_wd) {
        if (c->decoupled)
            p = p * c->decay_factor;
        else
            g = g + c->wd * p;
    }
    mm = rp_lerp(*m, g, c->w1, c->one_minus_w1);
    vv = *v * c->beta2;
    vv = vv + c->one_minus_beta2 * g * g;
    *m = mm;
    *v = vv;
    if (c->amsgrad) {
        vv = rp_maximum(*vmax, vv);
        *vmax = vv;
    }
    denom = RP_SQRTF(vv) / bc2_sqrt + c->eps;
    return p + neg_step_size * mm / denom;
}

/* Adagrad. neg_clr = -lr / (1 + (t - 1) * lr_decay). */
RP_HOSTDEV float rp_adagrad_elem(const rp_optim_consts *c, float p, float g, float *sum,
                                 float neg_clr)
{
    float s;
    g = rp_effective_grad(c, g, p);
    s = *sum + g * g; /* addcmul with value=1: 1 * g is exact */
    *sum = s;
    return p + neg_clr * g / (RP_SQRTF(s) + c->eps);
}

/* RMSprop. sq: square_avg, buf: momentum_buffer, ga: grad_avg (centered). */
RP_HOSTDEV float rp_rmsprop_elem(const rp_optim_consts *c, float p, float g, float *sq,
                                 float *buf, float *ga)
{
    float s, avg;
    g = rp_effective_grad(c, g, p);
    s = *sq * c->alpha;
    s = s + c->one_minus_alpha * g * g;
    *sq = s;
    if (c->centered) {
        float a = rp_lerp(*ga, g, c->w1, c->one_minus_w1);
        *ga = a;
        avg = RP_SQRTF(s + -1.0f * a * a);
    } else {
        avg = RP_SQRTF(s);
    }
    avg = avg + c->eps;
    if (c->has_momentum) {
        float b = *buf * c->momentum;
        b = b + g / avg;
        *buf = b;
        return p + c->neg_lr * b;
    }
    return p + c->neg_lr * g / avg;
}

/* Adadelta. sq: square_avg, acc: acc_delta. */
RP_HOSTDEV float rp_adadelta_elem(const rp_optim_consts *c, float p, float g, float *sq,
                                  float *acc)
{
    float s, std, delta, a;
    g = rp_effective_grad(c, g, p);
    s = *sq * c->rho;
    s = s + c->one_minus_rho * g * g;
    *sq = s;
    std = RP_SQRTF(s + c->eps);
    delta = RP_SQRTF(*acc + c->eps);
    delta = delta / std;
    delta = delta * g;
    a = *acc * c->rho;
    a = a + c->one_minus_rho * delta * delta;
    *acc = a;
    return p + c->neg_lr * delta;
}

#endif /* REPROP_OPTIM_MATH_H */
