/*
 * rp_internal.h: helpers shared by the C core and the CUDA kernels, not part
 * of the public API. Everything is static inline and compiles as C11 (gcc)
 * and as CUDA C++ (nvcc), where RP_HOSTDEV makes it callable from kernels.
 */
#ifndef REPROP_INTERNAL_H
#define REPROP_INTERNAL_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define RP_HOSTDEV __host__ __device__ __forceinline__
#else
#define RP_HOSTDEV static inline
#endif

/* Run-time choice of AVX-512 / AVX2 loops on x86-64 (GCC function
 * multi-versioning); never -march=native, so one build runs everywhere. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__) && \
    !defined(RP_NO_TARGET_CLONES)
#define RP_TARGET_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define RP_TARGET_CLONES
#endif

/* a * b for a, b >= 0, or -1 when either is negative or the product passes
 * `cap`: size arithmetic on caller-given counts that must not overflow. */
RP_HOSTDEV int64_t rp_mul_capped(int64_t a, int64_t b, int64_t cap)
{
    if (a < 0 || b < 0)
        return -1;
    if (b != 0 && a > cap / b)
        return -1;
    return a * b;
}

/* ---- the BPPSA scan's up-sweep products (csrc/scan.c, kernels/scan.cu) ----
 * One H x H matrix per sequence for each odd slot s in [3, n): the up-sweep
 * writes products at odd slots only, and never at slot 1, which level 0
 * combines on the left spine (its result there is a vector, the pair's
 * mat-vec). floor(n / 2) - 1 of them, none for n < 2. */

RP_HOSTDEV int64_t rp_scan_prod_count(int64_t n) { return n >= 2 ? n / 2 - 1 : 0; }

RP_HOSTDEV int64_t rp_scan_prod_index(int64_t s) { return (s - 3) >> 1; }

/* ---- reduced-precision element types, round-to-nearest-even as torch ---- */

RP_HOSTDEV float rp_bits_to_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

RP_HOSTDEV uint32_t rp_f32_to_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

RP_HOSTDEV float rp_bf16_to_f32(uint16_t h) { return rp_bits_to_f32((uint32_t)h << 16); }

RP_HOSTDEV uint16_t rp_f32_to_bf16(float f)
{
    /* selects, not branches, so that CPU loops over it vectorize */
    uint32_t u = rp_f32_to_bits(f);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t quiet_nan = (u >> 16) | 0x0040u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

RP_HOSTDEV float rp_f16_to_f32(uint16_t h)
{
    /* selects, not branches, so that CPU loops over it vectorize */
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t normal = sign | ((exp + 112u) << 23) | (man << 13);
    uint32_t special = sign | 0x7f800000u | (man << 13); /* inf or NaN */
    /* zero or subnormal: man * 2^-24, exact in float */
    uint32_t small = sign | rp_f32_to_bits((float)man * 5.9604644775390625e-8f);
    return rp_bits_to_f32(exp == 0x1fu ? special : (exp == 0 ? small : normal));
}

RP_HOSTDEV uint16_t rp_f32_to_f16(float f)
{
    /* selects, not branches, so that CPU loops over it vectorize */
    uint32_t u = rp_f32_to_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t au = u & 0x7fffffffu;
    uint32_t nan = 0x7e00u | ((au >> 13) & 0x3ffu);
    /* below 2^-14 the half is subnormal: adding 0.5 = 2^-1 rounds to its ulp 2^-24 */
    uint32_t subnormal = rp_f32_to_bits(rp_bits_to_f32(au) + 0.5f) - 0x3f000000u;
    /* rebias the exponent (-112 << 23) and round to nearest even */
    uint32_t normal = (au + 0xc8000fffu + ((au >> 13) & 1u)) >> 13;
    uint32_t mag = au > 0x7f800000u ? nan
                   : au >= 0x477ff000u ? 0x7c00u /* rounds to >= 65520: inf */
                   : au < 0x38800000u ? subnormal : normal;
    return (uint16_t)(sign | mag);
}

/* Element i of a float32 / bfloat16 / float16 array, as float32 and back
 * (for macro-generated loops over the three dtypes). */
#define RP_LOAD_F32(ptr, i) (((const float *)(ptr))[i])
#define RP_STORE_F32(ptr, i, v) (((float *)(ptr))[i] = (v))
#define RP_LOAD_BF16(ptr, i) rp_bf16_to_f32(((const uint16_t *)(ptr))[i])
#define RP_STORE_BF16(ptr, i, v) (((uint16_t *)(ptr))[i] = rp_f32_to_bf16(v))
#define RP_LOAD_F16(ptr, i) rp_f16_to_f32(((const uint16_t *)(ptr))[i])
#define RP_STORE_F16(ptr, i, v) (((uint16_t *)(ptr))[i] = rp_f32_to_f16(v))

#endif /* REPROP_INTERNAL_H */
