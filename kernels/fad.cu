/*
 * fad.cu: nested forward-AD activations on CUDA.
 *
 * Forward: one grid-stride pass over x computes y = f(x) and d = f'(x) with
 * fad_math.h's rp_fad_eval (the CPU core's per-element math, so results equal
 * csrc/fad.c bit for bit when this file is built with nvcc --fmad=false and
 * without --use_fast_math / -ftz=true / -prec-div=false), stores y in x's
 * dtype and d as float32, float16, bfloat16, an 8-bit code, or not at all.
 * Backward from codes: grad_x = grad_y * value[code], the 256-entry table
 * passed by value and staged in shared memory.
 *
 * Each thread step moves 16 bytes of x (4 float32 or 8 16-bit elements) and
 * the matching y, d, grad and code bytes with vector loads and stores when
 * every pointer is aligned for them; the last n % E elements, and misaligned
 * buffers, take a scalar loop. Kernels are templated on x's dtype and d's
 * storage; the kind is a runtime argument switched once per thread, outside
 * the loops (it is uniform across the grid).
 *
 * Shapes: x, y, d, grad_y, grad_x and codes are flat arrays of n elements.
 * Layout: device helpers, kernels, then the extern "C" launchers (which take
 * the stream, never synchronize, and check cudaGetLastError).
 */
#include <cuda_runtime.h>

#include <stdint.h>

#include "reprop.h"
#include "rp_internal.h"

#include "fad_math.h"

#define RP_FAD_THREADS 256     /* also the codebook size staged by backward blocks */
#define RP_FAD_MAX_BLOCKS 8192 /* grid-stride beyond: 2M threads fill any current GPU */

static_assert(RP_FAD_THREADS == 256, "backward blocks stage one table entry per thread");

#define RP_HD __host__ __device__ __forceinline__

/* ---------------------------------------------------------------------------
 * Element and vector IO
 * ------------------------------------------------------------------------- */

/* Storage of one element: float32 bits, float16/bfloat16 (round to nearest
 * even, rp_internal.h's conversions as on the CPU), or an 8-bit code. */
template <int ST> struct rp_fad_elem;

template <> struct rp_fad_elem<RP_F32> {
    static constexpr int SIZE = 4;
    static RP_HD float up(uint32_t w) { return rp_bits_to_f32(w); }
    static RP_HD uint32_t down(float f) { return rp_f32_to_bits(f); }
};
template <> struct rp_fad_elem<RP_F16> {
    static constexpr int SIZE = 2;
    static RP_HD float up(uint32_t w) { return rp_f16_to_f32((uint16_t)w); }
    static RP_HD uint32_t down(float f) { return rp_f32_to_f16(f); }
};
template <> struct rp_fad_elem<RP_BF16> {
    static constexpr int SIZE = 2;
    static RP_HD float up(uint32_t w) { return rp_bf16_to_f32((uint16_t)w); }
    static RP_HD uint32_t down(float f) { return rp_f32_to_bf16(f); }
};
template <> struct rp_fad_elem<RP_FAD_CODE8> {
    static constexpr int SIZE = 1;
};
template <> struct rp_fad_elem<RP_FAD_NONE> {
    static constexpr int SIZE = 0;
};

/* Elements per thread step: 16 bytes of x. */
template <int DT> struct rp_fad_width {
    static constexpr int E = 16 / rp_fad_elem<DT>::SIZE;
};

/* E elements of SIZE bytes (SIZE * E in {4, 8, 16, 32}) as 32-bit words,
 * little-endian: element k sits at bits 8 * SIZE * (k % (4 / SIZE)) of word
 * k * SIZE / 4. */
template <int SIZE, int E> struct rp_fad_vec {
    static constexpr int NW = SIZE * E / 4;
    static RP_HD void load(const void *base, int64_t v, uint32_t (&w)[NW])
    {
        if constexpr (NW == 1) {
            w[0] = reinterpret_cast<const uint32_t *>(base)[v];
        } else if constexpr (NW == 2) {
            const uint2 t = reinterpret_cast<const uint2 *>(base)[v];
            w[0] = t.x;
            w[1] = t.y;
        } else {
            for (int q = 0; q < NW / 4; q++) {
                const uint4 t = reinterpret_cast<const uint4 *>(base)[v * (NW / 4) + q];
                w[4 * q] = t.x;
                w[4 * q + 1] = t.y;
                w[4 * q + 2] = t.z;
                w[4 * q + 3] = t.w;
            }
        }
    }
    static RP_HD void store(void *base, int64_t v, const uint32_t (&w)[NW])
    {
        if constexpr (NW == 1) {
            reinterpret_cast<uint32_t *>(base)[v] = w[0];
        } else if constexpr (NW == 2) {
            reinterpret_cast<uint2 *>(base)[v] = make_uint2(w[0], w[1]);
        } else {
            for (int q = 0; q < NW / 4; q++)
                reinterpret_cast<uint4 *>(base)[v * (NW / 4) + q] =
                    make_uint4(w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3]);
        }
    }
    static RP_HD uint32_t get(const uint32_t (&w)[NW], int k)
    {
        constexpr int PER = 4 / SIZE;
        constexpr uint32_t MASK = SIZE == 4 ? 0xffffffffu : ((1u << (8 * SIZE)) - 1u);
        return (w[k / PER] >> (8 * SIZE * (k % PER))) & MASK;
    }
    static RP_HD void put(uint32_t (&w)[NW], int k, uint32_t e)
    {
        constexpr int PER = 4 / SIZE;
        if (k % PER == 0)
            w[k / PER] = e;
        else
            w[k / PER] |= e << (8 * SIZE * (k % PER));
    }
};

template <int SIZE> RP_HD uint32_t rp_fad_load1(const void *base, int64_t i)
{
    if constexpr (SIZE == 4)
        return reinterpret_cast<const uint32_t *>(base)[i];
    else if constexpr (SIZE == 2)
        return reinterpret_cast<const uint16_t *>(base)[i];
    else
        return reinterpret_cast<const uint8_t *>(base)[i];
}

template <int SIZE> RP_HD void rp_fad_store1(void *base, int64_t i, uint32_t w)
{
    if constexpr (SIZE == 4)
        reinterpret_cast<uint32_t *>(base)[i] = w;
    else if constexpr (SIZE == 2)
        reinterpret_cast<uint16_t *>(base)[i] = (uint16_t)w;
    else
        reinterpret_cast<uint8_t *>(base)[i] = (uint8_t)w;
}

/* ---------------------------------------------------------------------------
 * Forward
 * ------------------------------------------------------------------------- */

/* The by-value argument of the forward kernel. */
typedef struct {
    const void *x;
    void *y;
    void *d;
    int64_t n;
    float p0, p1;
    float inv_step; /* RP_FAD_CODE8 only */
    int zero_code;
    int kind;
    int vec; /* every pointer aligned for the vector path */
} rp_fad_fwd_args;

/* The stored word of element d (at x) in storage DS. */
template <int KIND, int DS> RP_HD uint32_t rp_fad_d_word(const rp_fad_fwd_args &a, float x, float d)
{
    if constexpr (DS == RP_FAD_CODE8)
        return rp_fad_encode(KIND, a.p0, a.p1, x, d, a.inv_step, a.zero_code);
    else
        return rp_fad_elem<DS>::down(d);
}

/* Elements [first, n) step `stride`, one at a time. */
template <int KIND, int DT, int DS>
__device__ void rp_fad_forward_scalar(const rp_fad_fwd_args &a, int64_t first, int64_t stride)
{
    constexpr int XS = rp_fad_elem<DT>::SIZE;
    for (int64_t i = first; i < a.n; i += stride) {
        float x = rp_fad_elem<DT>::up(rp_fad_load1<XS>(a.x, i));
        float y, d;
        rp_fad_eval(KIND, a.p0, a.p1, x, &y, &d);
        if constexpr (DS != RP_FAD_NONE)
            rp_fad_store1<rp_fad_elem<DS>::SIZE>(a.d, i, rp_fad_d_word<KIND, DS>(a, x, d));
        rp_fad_store1<XS>(a.y, i, rp_fad_elem<DT>::down(y));
    }
}

template <int KIND, int DT, int DS> __device__ void rp_fad_forward_run(const rp_fad_fwd_args &a)
{
    constexpr int E = rp_fad_width<DT>::E;
    constexpr int XS = rp_fad_elem<DT>::SIZE;
    constexpr int DSZ = rp_fad_elem<DS>::SIZE;
    typedef rp_fad_vec<XS, E> xio;
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t nvec = a.vec ? a.n / E : 0;
    for (int64_t v = tid; v < nvec; v += stride) {
        uint32_t xw[xio::NW], yw[xio::NW];
        float x[E], d[E];
        xio::load(a.x, v, xw);
#pragma unroll
        for (int k = 0; k < E; k++) {
            float y;
            x[k] = rp_fad_elem<DT>::up(xio::get(xw, k));
            rp_fad_eval(KIND, a.p0, a.p1, x[k], &y, &d[k]);
            xio::put(yw, k, rp_fad_elem<DT>::down(y));
        }
        if constexpr (DS != RP_FAD_NONE) {
            typedef rp_fad_vec<DSZ, E> dio;
            uint32_t dw[dio::NW];
#pragma unroll
            for (int k = 0; k < E; k++)
                dio::put(dw, k, rp_fad_d_word<KIND, DS>(a, x[k], d[k]));
            dio::store(a.d, v, dw);
        }
        xio::store(a.y, v, yw);
    }
    rp_fad_forward_scalar<KIND, DT, DS>(a, nvec * E + tid, stride);
}

#define RP_FAD_CASE(K)                                                                             \
    case K:                                                                                        \
        rp_fad_forward_run<K, DT, DS>(a);                                                          \
        break;

template <int DT, int DS>
__global__ void __launch_bounds__(RP_FAD_THREADS) rp_fad_forward_kernel(const rp_fad_fwd_args a)
{
    switch (a.kind) {
        RP_FAD_CASE(RP_FAD_GELU)
        RP_FAD_CASE(RP_FAD_GELU_TANH)
        RP_FAD_CASE(RP_FAD_SILU)
        RP_FAD_CASE(RP_FAD_MISH)
        RP_FAD_CASE(RP_FAD_SOFTPLUS)
        RP_FAD_CASE(RP_FAD_SIGMOID)
        RP_FAD_CASE(RP_FAD_TANH)
        RP_FAD_CASE(RP_FAD_ELU)
        RP_FAD_CASE(RP_FAD_CELU)
        RP_FAD_CASE(RP_FAD_SELU)
        RP_FAD_CASE(RP_FAD_LEAKY_RELU)
        RP_FAD_CASE(RP_FAD_HARDSWISH)
        RP_FAD_CASE(RP_FAD_HARDSIGMOID)
        RP_FAD_CASE(RP_FAD_LOGSIGMOID)
        RP_FAD_CASE(RP_FAD_SOFTSIGN)
        RP_FAD_CASE(RP_FAD_TANHSHRINK)
    default:
        break;
    }
}

/* ---------------------------------------------------------------------------
 * Backward from 8-bit codes
 * ------------------------------------------------------------------------- */

typedef struct {
    float value[256];
} rp_fad_table;

template <int DT>
__global__ void __launch_bounds__(RP_FAD_THREADS)
    rp_fad_backward_kernel(const void *grad_y, const uint8_t *codes, void *grad_x, int64_t n,
                           int vec, const rp_fad_table table)
{
    constexpr int E = rp_fad_width<DT>::E;
    constexpr int XS = rp_fad_elem<DT>::SIZE;
    typedef rp_fad_vec<XS, E> gio;
    typedef rp_fad_vec<1, E> cio;
    __shared__ float value[256];
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t nvec = vec ? n / E : 0;
    value[threadIdx.x] = table.value[threadIdx.x];
    __syncthreads();
    for (int64_t v = tid; v < nvec; v += stride) {
        uint32_t gw[gio::NW], ow[gio::NW], cw[cio::NW];
        gio::load(grad_y, v, gw);
        cio::load(codes, v, cw);
#pragma unroll
        for (int k = 0; k < E; k++) {
            float g = rp_fad_elem<DT>::up(gio::get(gw, k));
            gio::put(ow, k, rp_fad_elem<DT>::down(g * value[cio::get(cw, k)]));
        }
        gio::store(grad_x, v, ow);
    }
    for (int64_t i = nvec * E + tid; i < n; i += stride) {
        float g = rp_fad_elem<DT>::up(rp_fad_load1<XS>(grad_y, i));
        rp_fad_store1<XS>(grad_x, i, rp_fad_elem<DT>::down(g * value[codes[i]]));
    }
}

/* ---------------------------------------------------------------------------
 * Launchers
 * ------------------------------------------------------------------------- */

static int rp_fad_aligned(const void *p, uintptr_t bytes) { return ((uintptr_t)p % bytes) == 0; }

static size_t rp_fad_store_size(int store)
{
    return store == RP_F32 ? 4 : (store == RP_FAD_CODE8 ? 1 : (store == RP_FAD_NONE ? 0 : 2));
}

/* Blocks for `work` thread steps, capped (grid-stride loops do the rest). */
static unsigned rp_fad_blocks(int64_t work)
{
    int64_t b = (work + RP_FAD_THREADS - 1) / RP_FAD_THREADS;
    return (unsigned)(b < 1 ? 1 : (b > RP_FAD_MAX_BLOCKS ? RP_FAD_MAX_BLOCKS : b));
}

static int rp_fad_launch_status(const char *who, rp_error *err)
{
    cudaError_t e = cudaGetLastError(); /* also clears a non-sticky launch error */
    if (e != cudaSuccess)
        return rp_set_error(err, RP_ERUNTIME, "CUDA error in %s: %s", who, cudaGetErrorString(e));
    return RP_OK;
}

typedef void (*rp_fad_fwd_fn)(const rp_fad_fwd_args);

template <int DT> static rp_fad_fwd_fn rp_fad_pick_forward_dt(int d_store)
{
    switch (d_store) {
    case RP_FAD_NONE:
        return rp_fad_forward_kernel<DT, RP_FAD_NONE>;
    case RP_F32:
        return rp_fad_forward_kernel<DT, RP_F32>;
    case RP_F16:
        return rp_fad_forward_kernel<DT, RP_F16>;
    case RP_BF16:
        return rp_fad_forward_kernel<DT, RP_BF16>;
    default:
        return rp_fad_forward_kernel<DT, RP_FAD_CODE8>;
    }
}

static rp_fad_fwd_fn rp_fad_pick_forward(int dtype, int d_store)
{
    switch (dtype) {
    case RP_F32:
        return rp_fad_pick_forward_dt<RP_F32>(d_store);
    case RP_F16:
        return rp_fad_pick_forward_dt<RP_F16>(d_store);
    default:
        return rp_fad_pick_forward_dt<RP_BF16>(d_store);
    }
}

extern "C" int rp_cuda_fad_forward(int kind, float p0, float p1, int dtype, const void *x, void *y,
                                   int d_store, void *d, int64_t n, void *stream, rp_error *err)
{
    rp_fad_fwd_args a;
    int64_t e;
    uintptr_t dalign;
    int rc = rp_fad_check(kind, p0, p1, dtype, d_store, err);
    if (rc != RP_OK)
        return rc;
    if (n < 0)
        return rp_set_error(err, RP_EINVAL, "negative element count %lld", (long long)n);
    if (n > 0 && (x == NULL || y == NULL || (d_store != RP_FAD_NONE && d == NULL)))
        return rp_set_error(err, RP_EINVAL, "NULL data pointer for %lld elements", (long long)n);
    if (n == 0)
        return RP_OK;
    memset(&a, 0, sizeof a);
    if (d_store == RP_FAD_CODE8) {
        rp_fad_codebook cb;
        rc = rp_fad_codebook_init(kind, p0, p1, &cb, err);
        if (rc != RP_OK)
            return rc;
        a.inv_step = cb.inv_step;
        a.zero_code = cb.zero_code;
    }
    e = dtype == RP_F32 ? 4 : 8;
    /* d moves E elements per step: 16 bytes or less (E codes), in 16-byte pieces */
    dalign = (uintptr_t)(rp_fad_store_size(d_store) * e);
    dalign = dalign > 16 ? 16 : dalign;
    a.x = x;
    a.y = y;
    a.d = d_store == RP_FAD_NONE ? NULL : d;
    a.n = n;
    a.p0 = p0;
    a.p1 = p1;
    a.kind = kind;
    a.vec = rp_fad_aligned(x, 16) && rp_fad_aligned(y, 16) &&
            (d_store == RP_FAD_NONE || rp_fad_aligned(d, dalign));
    rp_fad_pick_forward(dtype, d_store)<<<rp_fad_blocks(a.vec ? n / e + n % e : n),
                                         RP_FAD_THREADS, 0, (cudaStream_t)stream>>>(a);
    return rp_fad_launch_status("rp_cuda_fad_forward", err);
}

extern "C" int rp_cuda_fad_backward_code8(int dtype, const void *grad_y, const uint8_t *codes,
                                          const rp_fad_codebook *cb, void *grad_x, int64_t n,
                                          void *stream, rp_error *err)
{
    rp_fad_table t;
    int64_t e;
    int vec;
    if (dtype != RP_F32 && dtype != RP_F16 && dtype != RP_BF16)
        return rp_set_error(err, RP_EINVAL, "unsupported dtype code %d", dtype);
    if (cb == NULL)
        return rp_set_error(err, RP_EINVAL, "codebook pointer is NULL");
    if (n < 0)
        return rp_set_error(err, RP_EINVAL, "negative element count %lld", (long long)n);
    if (n > 0 && (grad_y == NULL || codes == NULL || grad_x == NULL))
        return rp_set_error(err, RP_EINVAL, "NULL data pointer for %lld elements", (long long)n);
    if (n == 0)
        return RP_OK;
    memcpy(t.value, cb->value, sizeof t.value);
    e = dtype == RP_F32 ? 4 : 8;
    vec = rp_fad_aligned(grad_y, 16) && rp_fad_aligned(grad_x, 16) &&
          rp_fad_aligned(codes, (uintptr_t)e);
    const unsigned blocks = rp_fad_blocks(vec ? n / e + n % e : n);
    switch (dtype) {
    case RP_F32:
        rp_fad_backward_kernel<RP_F32><<<blocks, RP_FAD_THREADS, 0, (cudaStream_t)stream>>>(
            grad_y, codes, grad_x, n, vec, t);
        break;
    case RP_F16:
        rp_fad_backward_kernel<RP_F16><<<blocks, RP_FAD_THREADS, 0, (cudaStream_t)stream>>>(
            grad_y, codes, grad_x, n, vec, t);
        break;
    default:
        rp_fad_backward_kernel<RP_BF16><<<blocks, RP_FAD_THREADS, 0, (cudaStream_t)stream>>>(
            grad_y, codes, grad_x, n, vec, t);
        break;
    }
    return rp_fad_launch_status("rp_cuda_fad_backward_code8", err);
}
