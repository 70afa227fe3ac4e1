/*
 * optim_shared.h: what the optimizer tests share: the C core's unit tests
 * (test_core.c, C11) and the host emulation of the CUDA launcher
 * (kernels/tests/optim_emulation.cu, C++17) vary the same baseline
 * hyper-parameters and write elements of every dtype the same way.
 */
#ifndef REPROP_TESTS_OPTIM_SHARED_H
#define REPROP_TESTS_OPTIM_SHARED_H

#include <string.h>

#include "../reprop.h"
#include "../rp_internal.h"

/* Optimizer `kind` with every option off; each test turns on what it covers. */
static inline rp_optim_hparams base_hparams(int kind)
{
    rp_optim_hparams hp;
    memset(&hp, 0, sizeof hp);
    hp.kind = kind;
    hp.lr = 1e-2;
    hp.eps = 1e-8;
    hp.beta1 = 0.9;
    hp.beta2 = 0.999;
    hp.alpha = 0.99;
    hp.rho = 0.9;
    return hp;
}

/* Element i of a `dtype` array (RP_F32, RP_BF16 or RP_F16) as float32. */
static inline float elem_load(int dtype, const void *p, int64_t i)
{
    if (dtype == RP_F32)
        return ((const float *)p)[i];
    if (dtype == RP_BF16)
        return rp_bf16_to_f32(((const uint16_t *)p)[i]);
    return rp_f16_to_f32(((const uint16_t *)p)[i]);
}

/* v stored as element i of a `dtype` array, rounded to nearest even. */
static inline void elem_store(int dtype, void *p, int64_t i, float v)
{
    if (dtype == RP_F32)
        ((float *)p)[i] = v;
    else if (dtype == RP_BF16)
        ((uint16_t *)p)[i] = rp_f32_to_bf16(v);
    else
        ((uint16_t *)p)[i] = rp_f32_to_f16(v);
}

#endif /* REPROP_TESTS_OPTIM_SHARED_H */
