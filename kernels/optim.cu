/*
 * optim.cu: fused multi-tensor optimizers on CUDA.
 *
 * One call updates a list of tensors of one parameter group and one dtype with
 * as few kernel launches as possible. The host cuts every tensor into chunks of
 * `chunk` elements and writes a launch table that is passed BY VALUE as the one
 * kernel argument (CUDA 12.1+ allows 32764 bytes on sm_70+; we build for sm_80
 * and sm_90 only):
 *
 *   per tensor (up to RP_TAB_TENSORS): param, grad and state[0..2] pointers,
 *       numel, the step scalars (a, b) or the device step pointer, the index of
 *       its first block, and a flags byte (vector path, state slots read and
 *       written);
 *   per block (up to RP_TAB_BLOCKS): the tensor it works on; its chunk is
 *       blockIdx.x - first_block[tensor].
 *
 * Each block updates one chunk, four elements per thread and step: 128-bit
 * loads and stores of float32 params, grads and state (64-bit ones for
 * float16/bfloat16 params and grads) when every pointer of its tensor is
 * 16-byte aligned (chunks start at multiples of the vector width); scalar code
 * for the last numel % 4 elements of a tensor and for misaligned tensors
 * (16-bit params and grads need only 8-byte alignment). A new launch is issued
 * only when the table fills; a tensor that does not fit continues in the next
 * table from where it stopped. The chunk size adapts to the total work: small
 * chunks when there is little of it (so hundreds of small tensors still spread
 * over every SM), larger ones for huge tensors (so one launch covers them).
 * REPROP_CUDA_OPTIM_CHUNK=<elements> overrides it, for tuning only.
 *
 * The per-element math is optim_math.h's, shared with the CPU loops, in float32
 * whatever the parameter dtype. Bitwise agreement with the CPU build (compiled
 * with -ffp-contract=off) needs this file compiled with nvcc --fmad=false and
 * without --use_fast_math / -ftz=true / -prec-div=false / -prec-sqrt=false:
 * the only fused multiply-adds are optim_math.h's explicit RP_FMAF, where
 * torch's ops have one.
 *
 * Capturable updates (CUDA graphs): one small launch first increments every
 * device step counter by one on the stream, then each update block reads its
 * tensor's step (and the learning rate from hp->lr_ptr when given) and derives
 * the step scalars on the device in double, as rp_optim_advance_steps does on
 * the host. Nothing here synchronizes with the host or allocates device memory.
 *
 * Layout: kernels first, then the launchers (all take the stream and check
 * cudaGetLastError), then the extern "C" entry points.
 */
#include <cuda_runtime.h>

#include <atomic>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reprop.h"
#include "rp_internal.h"

#include "optim_math.h"
#include "rp_cuda.cuh"

/* ---------------------------------------------------------------------------
 * Launch geometry and tables
 * ------------------------------------------------------------------------- */

#define RP_THREADS 256   /* threads per update block */
#define RP_MIN_BLOCKS 4  /* resident blocks per SM asked of the register allocator: <= 64 */
#ifndef RP_TAB_TENSORS /* overridable (smaller) for tests of the table logic */
#define RP_TAB_TENSORS 256
#endif
#ifndef RP_TAB_BLOCKS
#define RP_TAB_BLOCKS 8192
#endif
#ifndef RP_STEP_TAB
#define RP_STEP_TAB 4000 /* step pointers per increment launch */
#endif
#define RP_KERNEL_PARAM_LIMIT 32764 /* bytes of kernel arguments, CUDA >= 12.1, sm_70+ */

/* Chunk size, in multiples of one block step (RP_THREADS x vector width):
 * aim at RP_BLOCKS_PER_SM blocks per SM over the whole call, between
 * RP_MIN_STEPS and RP_MAX_STEPS steps per block; grow up to RP_HUGE_STEPS
 * when the call would otherwise need several full tables. */
#define RP_BLOCKS_PER_SM 16
#define RP_MIN_STEPS 2
#define RP_MAX_STEPS 16
#define RP_HUGE_STEPS 64

/* Flags byte of a table tensor. */
#define RP_TF_VEC 1u         /* all used pointers aligned for the vector path */
#define RP_TF_LOAD_SHIFT 1   /* bits 1..3: state slots read */
#define RP_TF_STORE_SHIFT 4  /* bits 4..6: state slots written */

typedef struct {
    float a[RP_TAB_TENSORS];
    float b[RP_TAB_TENSORS];
} rp_tab_scalars;

/* The one by-value argument of the update kernel. */
typedef struct {
    rp_optim_hparams hp; /* lr_ptr is NULL unless the update is capturable */
    rp_optim_consts c;   /* from hp.lr on the host */
    int32_t chunk;       /* elements per block, a multiple of RP_THREADS x vector width */
    void *ptr[5][RP_TAB_TENSORS];   /* param, grad, state[0..2], at this table's first chunk */
    int64_t numel[RP_TAB_TENSORS];  /* elements from ptr on */
    union {
        rp_tab_scalars sc;                /* non-capturable: host-computed a, b */
        const float *step[RP_TAB_TENSORS]; /* capturable: device step counters */
    } u;
    int32_t first_block[RP_TAB_TENSORS];
    uint8_t flags[RP_TAB_TENSORS];
    uint16_t block_tensor[RP_TAB_BLOCKS];
} rp_optim_launch;

static_assert(sizeof(rp_optim_launch) <= RP_KERNEL_PARAM_LIMIT,
              "rp_optim_launch exceeds the 32764-byte kernel parameter limit");
static_assert(RP_TAB_TENSORS <= 65536, "block_tensor holds 16-bit tensor indices");

/* The one by-value argument of the step-increment kernel. */
typedef struct {
    int32_t n;
    float *step[RP_STEP_TAB];
} rp_step_launch;

static_assert(sizeof(rp_step_launch) <= RP_KERNEL_PARAM_LIMIT,
              "rp_step_launch exceeds the 32764-byte kernel parameter limit");

/* ---------------------------------------------------------------------------
 * Kernels
 *
 * The work of one block is a __host__ __device__ function of (table, block,
 * thread) so that the index logic can also be exercised on the host; the
 * kernels add only what needs the device (shared memory, the barrier).
 * ------------------------------------------------------------------------- */

#define RP_HD __host__ __device__ __forceinline__

/* Loads and stores of the param/grad element type: `load`/`store` move the E
 * elements at vector index i (E * SIZE bytes, that aligned), `load1`/`store1`
 * one element. */
template <int DT> struct rp_io;

template <> struct rp_io<RP_F32> {
    static constexpr int E = 4;
    static constexpr int SIZE = 4;
    static RP_HD void load(const void *base, int i, float (&v)[E])
    {
        const float4 x = reinterpret_cast<const float4 *>(base)[i];
        v[0] = x.x;
        v[1] = x.y;
        v[2] = x.z;
        v[3] = x.w;
    }
    static RP_HD void store(void *base, int i, const float (&v)[E])
    {
        reinterpret_cast<float4 *>(base)[i] = make_float4(v[0], v[1], v[2], v[3]);
    }
    static RP_HD float load1(const void *base, int j)
    {
        return reinterpret_cast<const float *>(base)[j];
    }
    static RP_HD void store1(void *base, int j, float v)
    {
        reinterpret_cast<float *>(base)[j] = v;
    }
};

/* float16 / bfloat16: rp_internal.h's conversions, bit for bit the CPU's.
 * Four elements (64 bits) per step, like the float32 path: the float32 state
 * streams, most of the bytes, still move as float4. Eight (a 128-bit load)
 * would halve the param/grad load instructions, but fp16's branchy exact
 * conversions then keep too many values live and spill. */
template <int DT> struct rp_io16 {
    static constexpr int E = 4;
    static constexpr int SIZE = 2;
    static RP_HD float up(uint32_t h)
    {
        if constexpr (DT == RP_BF16)
            return rp_bf16_to_f32((uint16_t)h);
        else
            return rp_f16_to_f32((uint16_t)h);
    }
    static RP_HD uint32_t down(float f)
    {
        if constexpr (DT == RP_BF16)
            return rp_f32_to_bf16(f);
        else
            return rp_f32_to_f16(f);
    }
    /* Little-endian: element 2k is the low half of 32-bit word k. */
    static RP_HD void load(const void *base, int i, float (&v)[E])
    {
        const uint2 x = reinterpret_cast<const uint2 *>(base)[i];
        v[0] = up(x.x & 0xffffu);
        v[1] = up(x.x >> 16);
        v[2] = up(x.y & 0xffffu);
        v[3] = up(x.y >> 16);
    }
    static RP_HD void store(void *base, int i, const float (&v)[E])
    {
        uint2 x;
        x.x = down(v[0]) | (down(v[1]) << 16);
        x.y = down(v[2]) | (down(v[3]) << 16);
        reinterpret_cast<uint2 *>(base)[i] = x;
    }
    static RP_HD float load1(const void *base, int j)
    {
        return up(reinterpret_cast<const uint16_t *>(base)[j]);
    }
    static RP_HD void store1(void *base, int j, float v)
    {
        reinterpret_cast<uint16_t *>(base)[j] = (uint16_t)down(v);
    }
};

template <> struct rp_io<RP_F16> : rp_io16<RP_F16> {};
template <> struct rp_io<RP_BF16> : rp_io16<RP_BF16> {};

/* E float32 state values at vector index i (E/4 float4 each). */
template <int E>
RP_HD void rp_state_load(const float *s, int i, float (&v)[E])
{
#pragma unroll
    for (int k = 0; k < E / 4; k++) {
        const float4 x = reinterpret_cast<const float4 *>(s)[i * (E / 4) + k];
        v[4 * k + 0] = x.x;
        v[4 * k + 1] = x.y;
        v[4 * k + 2] = x.z;
        v[4 * k + 3] = x.w;
    }
}

template <int E>
RP_HD void rp_state_store(float *s, int i, const float (&v)[E])
{
#pragma unroll
    for (int k = 0; k < E / 4; k++)
        reinterpret_cast<float4 *>(s)[i * (E / 4) + k] =
            make_float4(v[4 * k + 0], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
}

/* State slots each optimizer can touch at all (compile time): lets the
 * compiler drop the code for the others. */
template <int KIND> struct rp_kind_slots {
    static constexpr unsigned mask = KIND == RP_SGD       ? 1u
                                     : KIND == RP_ADAM    ? 7u
                                     : KIND == RP_ADAGRAD ? 1u
                                     : KIND == RP_RMSPROP ? 7u
                                                          : 3u; /* Adadelta */
};

/* One element: optim_math.h's function for KIND. s0..s2 are the state slots
 * (dummies where unused); a, b the step scalars. */
template <int KIND>
RP_HD float rp_update_elem(const rp_optim_consts *c, float p, float g, float &s0, float &s1,
                           float &s2, float a, float b, int fresh)
{
    if constexpr (KIND == RP_SGD)
        return rp_sgd_elem(c, p, g, &s0, fresh);
    else if constexpr (KIND == RP_ADAM)
        return rp_adam_elem(c, p, g, &s0, &s1, &s2, a, b);
    else if constexpr (KIND == RP_ADAGRAD)
        return rp_adagrad_elem(c, p, g, &s0, a);
    else if constexpr (KIND == RP_RMSPROP)
        return rp_rmsprop_elem(c, p, g, &s0, &s1, &s2);
    else
        return rp_adadelta_elem(c, p, g, &s0, &s1);
}

/* Increments each step counter of the table by one: torch's `step_t += 1` on a
 * float32 tensor. Runs before the update launches on the same stream. */
static __global__ void rp_step_increment_kernel(const __grid_constant__ rp_step_launch L)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < L.n) {
        float *s = L.step[i];
        *s = *s + 1.0f;
    }
}

/* The consts of a block: the host's, or (capturable with a device lr) the
 * same function evaluated with the lr read from device memory. */
template <bool CAPT>
RP_HD void rp_block_consts(const rp_optim_launch &L, rp_optim_consts *c)
{
    if (CAPT && L.hp.lr_ptr != NULL)
        rp_optim_make_consts(&L.hp, (double)*L.hp.lr_ptr, c);
    else
        *c = L.c;
}

/* Capturable: the step scalars of a tensor from its (already incremented)
 * device step, by the host's arithmetic (rp_adam_step_terms, rp_lr_over), but
 * for 1 - beta2 ** step = -inf (beta2 = inf), whose square root is NaN here as
 * in torch's capturable Adam (a tensor sqrt), where the host follows
 * Python's (-inf) ** 0.5 = inf as torch's host path does. A device lr is
 * float32 (the launcher sets its kind). */
template <int KIND>
RP_HD float2 rp_capturable_scalars(const rp_optim_hparams *hp, const float *step)
{
    const double lr = hp->lr_ptr != NULL ? (double)*hp->lr_ptr : hp->lr;
    const double t = (double)*step;
    float2 v = make_float2(0.0f, 1.0f);
    if (KIND == RP_ADAM) {
        rp_adam_terms r;
        rp_adam_step_terms(hp, lr, t, &r);
        v.x = (float)(-r.step_size);
        v.y = (float)(isinf(r.bc2) ? sqrt(r.bc2) : r.bc2_sqrt);
    } else if (KIND == RP_ADAGRAD) {
        v.x = (float)(-rp_lr_over(hp, lr, hp->lr_decay_kind, rp_adagrad_decay(hp, t)));
    }
    return v;
}

/* Thread `tid` of block `block`: its share of the block's chunk. */
template <int KIND, int DT>
RP_HD void rp_update_chunk(const rp_optim_launch &L, int block, int tid,
                           const rp_optim_consts *c, float a, float b)
{
    typedef rp_io<DT> io;
    constexpr int E = io::E;
    constexpr unsigned kslots = rp_kind_slots<KIND>::mask;

    const int t = L.block_tensor[block];
    const int64_t start = (int64_t)(block - L.first_block[t]) * L.chunk;
    const int64_t rest = L.numel[t] - start; /* >= 1: blocks exist only for chunks in range */
    const int len = rest < (int64_t)L.chunk ? (int)rest : L.chunk;
    const unsigned flags = L.flags[t];
    const unsigned ld = (flags >> RP_TF_LOAD_SHIFT) & kslots;
    const unsigned st = (flags >> RP_TF_STORE_SHIFT) & kslots;
    const unsigned used = ld | st;
    /* SGD: a slot written but not read is a momentum buffer initialised from the gradient. */
    const int fresh = (st & 1u) && !(ld & 1u);

    void *const P = (char *)L.ptr[0][t] + start * io::SIZE;
    const void *const G = (const char *)L.ptr[1][t] + start * io::SIZE;
    float *const S0 = (used & 1u) ? (float *)L.ptr[2][t] + start : NULL;
    float *const S1 = (used & 2u) ? (float *)L.ptr[3][t] + start : NULL;
    float *const S2 = (used & 4u) ? (float *)L.ptr[4][t] + start : NULL;

    int j0 = 0; /* first element for the scalar loop */
    if (flags & RP_TF_VEC) {
        const int nv = len / E;
        for (int i = tid; i < nv; i += RP_THREADS) {
            float p[E], g[E], s0[E], s1[E], s2[E];
            io::load(P, i, p);
            io::load(G, i, g);
#pragma unroll
            for (int e = 0; e < E; e++)
                s0[e] = s1[e] = s2[e] = 0.0f;
            if (ld & 1u)
                rp_state_load<E>(S0, i, s0);
            if (ld & 2u)
                rp_state_load<E>(S1, i, s1);
            if (ld & 4u)
                rp_state_load<E>(S2, i, s2);
#pragma unroll
            for (int e = 0; e < E; e++)
                p[e] = rp_update_elem<KIND>(c, p[e], g[e], s0[e], s1[e], s2[e], a, b, fresh);
            io::store(P, i, p);
            if (st & 1u)
                rp_state_store<E>(S0, i, s0);
            if (st & 2u)
                rp_state_store<E>(S1, i, s1);
            if (st & 4u)
                rp_state_store<E>(S2, i, s2);
        }
        j0 = nv * E;
    }
    /* Misaligned tensors entirely, else the last len % E elements of a tensor. */
    for (int j = j0 + tid; j < len; j += RP_THREADS) {
        float s0 = (ld & 1u) ? S0[j] : 0.0f;
        float s1 = (ld & 2u) ? S1[j] : 0.0f;
        float s2 = (ld & 4u) ? S2[j] : 0.0f;
        const float p = rp_update_elem<KIND>(c, io::load1(P, j), io::load1(G, j), s0, s1, s2, a,
                                             b, fresh);
        io::store1(P, j, p);
        if (st & 1u)
            S0[j] = s0;
        if (st & 2u)
            S1[j] = s1;
        if (st & 4u)
            S2[j] = s2;
    }
}

/* The update: block -> (tensor, chunk) from the table, then the chunk. */
template <int KIND, int DT, bool CAPT>
static __global__ void __launch_bounds__(RP_THREADS, RP_MIN_BLOCKS)
    rp_optim_kernel(const __grid_constant__ rp_optim_launch L)
{
    const int t = L.block_tensor[blockIdx.x];
    rp_optim_consts c;
    float a = 0.0f, b = 1.0f;
    rp_block_consts<CAPT>(L, &c);
    if constexpr (KIND == RP_ADAM || KIND == RP_ADAGRAD) {
        if constexpr (CAPT) {
            /* One thread derives the step scalars (double pow: not per thread). */
            __shared__ float2 scal;
            if (threadIdx.x == 0)
                scal = rp_capturable_scalars<KIND>(&L.hp, L.u.step[t]);
            __syncthreads();
            a = scal.x;
            b = scal.y;
        } else {
            a = L.u.sc.a[t];
            b = L.u.sc.b[t];
        }
    }
    rp_update_chunk<KIND, DT>(L, blockIdx.x, threadIdx.x, &c, a, b);
}

/* ---------------------------------------------------------------------------
 * Launchers
 * ------------------------------------------------------------------------- */

typedef void (*rp_update_kernel_fn)(const rp_optim_launch);

template <int KIND, int DT>
static rp_update_kernel_fn rp_pick_update_kernel(int capturable)
{
    return capturable ? rp_optim_kernel<KIND, DT, true> : rp_optim_kernel<KIND, DT, false>;
}

template <int KIND>
static rp_update_kernel_fn rp_pick_update_kernel_dt(int dtype, int capturable)
{
    switch (dtype) {
    case RP_F32:
        return rp_pick_update_kernel<KIND, RP_F32>(capturable);
    case RP_F16:
        return rp_pick_update_kernel<KIND, RP_F16>(capturable);
    case RP_BF16:
        return rp_pick_update_kernel<KIND, RP_BF16>(capturable);
    default:
        return NULL;
    }
}

static rp_update_kernel_fn rp_update_kernel_for(int kind, int dtype, int capturable)
{
    switch (kind) {
    case RP_SGD:
        return rp_pick_update_kernel_dt<RP_SGD>(dtype, capturable);
    case RP_ADAM:
        return rp_pick_update_kernel_dt<RP_ADAM>(dtype, capturable);
    case RP_ADAGRAD:
        return rp_pick_update_kernel_dt<RP_ADAGRAD>(dtype, capturable);
    case RP_RMSPROP:
        return rp_pick_update_kernel_dt<RP_RMSPROP>(dtype, capturable);
    case RP_ADADELTA:
        return rp_pick_update_kernel_dt<RP_ADADELTA>(dtype, capturable);
    default:
        return NULL;
    }
}

/* One update launch of the first nblocks blocks of table L on stream. */
static int rp_cuda_update_launch(rp_update_kernel_fn fn, const rp_optim_launch *L, int nblocks,
                                 cudaStream_t stream, rp_error *err)
{
    void *args[1] = {(void *)L};
    cudaError_t e = cudaLaunchKernel((const void *)fn, dim3((unsigned)nblocks), dim3(RP_THREADS),
                                     args, 0, stream);
    cudaError_t last = cudaGetLastError(); /* also clears a non-sticky launch error */
    if (e == cudaSuccess)
        e = last;
    if (e != cudaSuccess)
        return rp_set_error(err, RP_ERUNTIME, "CUDA error in rp_cuda_optim_step: %s",
                            cudaGetErrorString(e));
    return RP_OK;
}

/* Capturable updates: increments the device step counter of every entry that
 * has one (zero-numel entries too, as rp_optim_advance_steps does), in as few
 * launches as the table allows. */
static int rp_cuda_step_increment(const rp_optim_entry *entries, int64_t n, cudaStream_t stream,
                                  rp_error *err)
{
    rp_step_launch *S = (rp_step_launch *)malloc(sizeof *S);
    int64_t i = 0;
    if (S == NULL)
        return rp_set_error(err, RP_ERUNTIME, "out of host memory for a step table");
    while (i < n) {
        int32_t m = 0;
        for (; i < n && m < RP_STEP_TAB; i++)
            if (entries[i].step != NULL)
                S->step[m++] = entries[i].step;
        if (m == 0)
            break;
        S->n = m;
        {
            const int threads = 128;
            void *args[1] = {(void *)S};
            cudaError_t e = cudaLaunchKernel((const void *)rp_step_increment_kernel,
                                             dim3((unsigned)((m + threads - 1) / threads)),
                                             dim3(threads), args, 0, stream);
            cudaError_t last = cudaGetLastError();
            if (e == cudaSuccess)
                e = last;
            if (e != cudaSuccess) {
                free(S);
                return rp_set_error(err, RP_ERUNTIME, "CUDA error in rp_cuda_step_increment: %s",
                                    cudaGetErrorString(e));
            }
        }
    }
    free(S);
    return RP_OK;
}

/* Number of SMs of device dev, cached (a host-side query: capture-safe). */
static int rp_sm_count(int dev)
{
    static std::atomic<int> cache[64];
    int v = 0;
    if (dev >= 0 && dev < 64) {
        v = cache[dev].load(std::memory_order_relaxed);
        if (v > 0)
            return v;
    }
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || v <= 0) {
        (void)cudaGetLastError();
        return 132; /* an H100/H200's count: only a tuning input */
    }
    if (dev >= 0 && dev < 64)
        cache[dev].store(v, std::memory_order_relaxed);
    return v;
}

/* REPROP_CUDA_OPTIM_CHUNK=<elements> overrides the chunk heuristic (tuning only;
 * results do not depend on it). 0 when unset. */
static int64_t rp_env_chunk(void)
{
    static const int64_t value = [] {
        const char *s = getenv("REPROP_CUDA_OPTIM_CHUNK");
        long long v = s != NULL ? strtoll(s, NULL, 10) : 0;
        return (int64_t)(v > 0 ? v : 0);
    }();
    return value;
}

/* Elements per block: a multiple of `unit` (one block step). */
static int64_t rp_pick_chunk(int64_t total, int sms, int64_t unit)
{
    int64_t chunk, env = rp_env_chunk();
    if (env > 0) {
        chunk = (env + unit - 1) / unit * unit;
        return chunk < RP_HUGE_STEPS * unit ? chunk : RP_HUGE_STEPS * unit;
    }
    chunk = (total + (int64_t)sms * RP_BLOCKS_PER_SM - 1) / ((int64_t)sms * RP_BLOCKS_PER_SM);
    chunk = (chunk + unit - 1) / unit * unit;
    if (chunk < RP_MIN_STEPS * unit)
        chunk = RP_MIN_STEPS * unit;
    if (chunk > RP_MAX_STEPS * unit)
        chunk = RP_MAX_STEPS * unit;
    if (total / chunk > RP_TAB_BLOCKS) { /* more than one full table: fewer, larger chunks */
        chunk = (total + RP_TAB_BLOCKS - 1) / RP_TAB_BLOCKS;
        chunk = (chunk + unit - 1) / unit * unit;
        if (chunk > RP_HUGE_STEPS * unit)
            chunk = RP_HUGE_STEPS * unit;
    }
    return chunk;
}

static int rp_aligned(const void *p, int64_t bytes) { return (uintptr_t)p % (uintptr_t)bytes == 0; }


/* ---------------------------------------------------------------------------
 * Entry points
 * ------------------------------------------------------------------------- */

extern "C" int rp_cuda_optim_step(const rp_optim_hparams *hp, int dtype,
                                  const rp_optim_entry *entries, const rp_step_scalars *scalars,
                                  int64_t n, int capturable, void *stream_, rp_error *err)
{
    cudaStream_t stream = (cudaStream_t)stream_;
    rp_device_guard guard;
    rp_update_kernel_fn fn;
    rp_optim_launch *L;
    rp_optim_consts c;
    int64_t esize, unit, vbytes, chunk, total = 0, i;
    int nt = 0, nb = 0, rc;
    unsigned slots;

    if (hp == NULL)
        return rp_set_error(err, RP_EINVAL, "rp_cuda_optim_step: null hyper-parameters");
    rc = rp_optim_check(hp, entries, n, err);
    if (rc != RP_OK)
        return rc;
    fn = rp_update_kernel_for(hp->kind, dtype, capturable);
    if (fn == NULL)
        return rp_set_error(err, RP_EINVAL, "unsupported dtype code %d", dtype);
    if (!capturable && scalars == NULL && n > 0 && (hp->kind == RP_ADAM || hp->kind == RP_ADAGRAD))
        return rp_set_error(err, RP_EINVAL,
                            "rp_cuda_optim_step: step scalars are required when not capturable");
    if (n == 0)
        return RP_OK;

    {
        cudaError_t e = guard.enter(stream);
        if (e != cudaSuccess)
            return rp_cuda_error(e, "rp_cuda_optim_step", err);
    }

    /* Capturable: the step counters first, on the same stream. */
    if (capturable && hp->kind != RP_SGD) {
        rc = rp_cuda_step_increment(entries, n, stream, err);
        if (rc != RP_OK)
            return rc;
    }

    for (i = 0; i < n; i++)
        total += entries[i].numel;
    if (total == 0)
        return RP_OK;

    static_assert(rp_io<RP_F32>::E == 4 && rp_io<RP_F16>::E == 4 && rp_io<RP_BF16>::E == 4,
                  "state vectors are one float4 per step");
    esize = dtype == RP_F32 ? rp_io<RP_F32>::SIZE : rp_io<RP_F16>::SIZE;
    vbytes = 4 * esize;
    unit = 4 * RP_THREADS; /* elements per block step */
    chunk = rp_pick_chunk(total, rp_sm_count(guard.dev), unit);

    L = (rp_optim_launch *)malloc(sizeof *L);
    if (L == NULL)
        return rp_set_error(err, RP_ERUNTIME, "out of host memory for a launch table");
    rp_optim_make_consts(hp, hp->lr, &c);
    L->hp = *hp;
    if (!capturable)
        L->hp.lr_ptr = NULL;
    else if (hp->lr_ptr != NULL)
        L->hp.lr_kind = RP_LR_F32; /* torch's tensor ops on a float32 lr */
    L->c = c;
    L->chunk = (int32_t)chunk;
    slots = rp_optim_state_slots(hp);

    for (i = 0; i < n; i++) {
        const rp_optim_entry *e = &entries[i];
        unsigned used = 0, load, flags;
        int vec, s;
        int64_t nchunks, done = 0;
        if (e->numel <= 0)
            continue;
        for (s = 0; s < 3; s++)
            if ((slots >> s & 1u) && e->state[s] != NULL)
                used |= 1u << s;
        load = used;
        if (hp->kind == RP_SGD && (e->flags & RP_ENTRY_FRESH_BUFFER))
            load &= ~1u; /* written from the gradient, never read */
        /* Vector accesses: E params/grads (16 or 8 bytes), E float32 states (16 bytes). */
        vec = rp_aligned(e->param, vbytes) && rp_aligned(e->grad, vbytes);
        for (s = 0; s < 3; s++)
            if (used >> s & 1u)
                vec = vec && rp_aligned(e->state[s], 16);
        flags = (vec ? RP_TF_VEC : 0u) | load << RP_TF_LOAD_SHIFT | used << RP_TF_STORE_SHIFT;

        nchunks = (e->numel + chunk - 1) / chunk;
        while (done < nchunks) {
            int64_t take, off, k;
            if (nt == RP_TAB_TENSORS || nb == RP_TAB_BLOCKS) {
                rc = rp_cuda_update_launch(fn, L, nb, stream, err);
                if (rc != RP_OK) {
                    free(L);
                    return rc;
                }
                nt = nb = 0;
            }
            take = nchunks - done;
            if (take > RP_TAB_BLOCKS - nb)
                take = RP_TAB_BLOCKS - nb;
            off = done * chunk; /* a multiple of the vector width: alignment is kept */
            L->ptr[0][nt] = (char *)e->param + off * esize;
            L->ptr[1][nt] = (char *)e->grad + off * esize;
            for (s = 0; s < 3; s++)
                L->ptr[2 + s][nt] = (used >> s & 1u) ? (void *)(e->state[s] + off) : NULL;
            L->numel[nt] = e->numel - off;
            if (capturable) {
                L->u.step[nt] = e->step;
            } else {
                L->u.sc.a[nt] = scalars != NULL ? scalars[i].a : 0.0f;
                L->u.sc.b[nt] = scalars != NULL ? scalars[i].b : 1.0f;
            }
            L->first_block[nt] = nb;
            L->flags[nt] = (uint8_t)flags;
            for (k = 0; k < take; k++)
                L->block_tensor[nb + k] = (uint16_t)nt;
            nb += (int)take;
            nt++;
            done += take;
        }
    }
    if (nb > 0) {
        rc = rp_cuda_update_launch(fn, L, nb, stream, err);
        if (rc != RP_OK) {
            free(L);
            return rc;
        }
    }
    free(L);
    return RP_OK;
}

extern "C" int rp_cuda_device_count(void)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        (void)cudaGetLastError(); /* no driver or no device: not an error */
        return 0;
    }
    return count;
}

#if !defined(RP_CUDA_ARCHS) && defined(__CUDA_ARCH_LIST__)
static const char *rp_arch_list_string(void)
{
    static const int archs[] = {__CUDA_ARCH_LIST__};
    static char buf[128];
    size_t len = 0, k;
    buf[0] = '\0';
    for (k = 0; k < sizeof archs / sizeof archs[0] && len + 16 < sizeof buf; k++)
        len += (size_t)snprintf(buf + len, sizeof buf - len, "%ssm_%d", k ? " " : "",
                                archs[k] / 10);
    return buf;
}
#endif

extern "C" const char *rp_cuda_archs(void)
{
#if defined(RP_CUDA_ARCHS)
    return RP_CUDA_ARCHS;
#elif defined(__CUDA_ARCH_LIST__)
    static const char *s = rp_arch_list_string(); /* thread-safe one-time init */
    return s;
#else
    return "sm_80 sm_90 compute_90";
#endif
}
