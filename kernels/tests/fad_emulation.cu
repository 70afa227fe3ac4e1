/*
 * fad_emulation.cu: the FAD launchers and kernels of kernels/fad.cu, run on
 * the host, must agree bit for bit with the CPU core (csrc/fad.c).
 *
 * CI has nvcc but no GPU. fad.cu is included twice:
 *
 *   - as it is, for its launchers (rp_cuda_fad_forward,
 *     rp_cuda_fad_backward_code8), with the runtime calls they make by name
 *     (cudaGetLastError) renamed to emu_runtime.h's mocks. Their kernel
 *     launches are <<<>>> launches, which nvcc turns into calls to the
 *     runtime's __cudaGetKernel and __cudaLaunchKernel in code generated
 *     after preprocessing, where no rename reaches: the link wraps those two
 *     (-Xlinker --wrap=__cudaGetKernel,--wrap=__cudaLaunchKernel), and the
 *     wrappers below hand each launch to the launch mock, the kernel's host
 *     stub as the kernel (the call configuration itself stays the real
 *     runtime's, which needs no driver);
 *   - in namespace emu_dev, as host code (emu_host_begin.h: __global__ and
 *     __device__ read as __host__, __shared__ as static in section
 *     emu_shared, __launch_bounds__ as nothing, the built-in indices and
 *     __syncthreads as emu_exec.h's executor's), its extern "C" launchers
 *     and rp_fad_launch_status renamed (that copy of the launchers is dead
 *     code). So the launch mock runs the very kernel bodies of fad.cu
 *     (rp_fad_forward_kernel and what it calls, rp_fad_backward_kernel:
 *     renamed there rp_fad_backward_body by a function-like macro, which
 *     leaves the dead launcher's rp_fad_backward_kernel<DT><<<...>>> naming
 *     a dummy kernel), every thread of every block of the grid, through
 *     emu_exec.h's executor: threads as fibers, so that __syncthreads waits
 *     for every thread of the block to reach it (all stage their table entry
 *     before any reads the table); shared memory NaN at the start of each
 *     block, so a missing or misplaced barrier reads the table before it is
 *     staged; blocks in forward or reverse order, alternating between cases,
 *     and every second block run with its threads last to first.
 *
 * Each case runs the same call through rp_cuda_fad_forward (or
 * rp_cuda_fad_backward_code8) and rp_fad_forward_cpu
 * (rp_fad_backward_code8_cpu) on identical inputs and compares y, d and
 * grad_x byte for byte (but that a NaN may be any NaN: GCC commutes operands,
 * so its sign and payload differ between compilations, and a GPU returns
 * its canonical NaN), with canary bytes around every buffer and the inputs
 * checked unchanged. The launch mock checks the launch: the kernel
 * instantiation for the call's dtype and derivative storage, its by-value
 * arguments (pointers, n, p0/p1 bits, kind, the codebook's inv_step and
 * zero_code, the table), the vector-path decision (every pointer aligned
 * for the 16-byte x steps: d for its own width, codes for E bytes), the
 * grid (RP_FAD_THREADS threads; blocks for n / E + n % E vector steps, or n
 * scalar ones, capped at RP_FAD_MAX_BLOCKS: fad.cu's rule, re-stated), no
 * shared memory, the call's stream, and the current device left as it was
 * (the launchers run on the current device; python/reprop/fad.py makes the
 * tensor's current).
 *
 * What it covers: every activation kind with its parameters (softplus beta
 * and threshold of either sign, ELU alpha 0 and negative, CELU's, leaky
 * slopes 0, negative and above 1, and GELU, Tanh and Hardswish once more
 * with junk in their unused parameters); x as
 * float32, float16 and bfloat16; d stored not at all (d NULL, or a buffer
 * that must stay untouched), as float32, float16, bfloat16 and 8-bit codes;
 * every float16 and bfloat16 bit pattern as x, and for float32 the special
 * values (NaN of both signs and several payloads, +-inf, -0.0, subnormals,
 * FLT_MAX), each activation's kinks and switch points with their
 * neighbours (0, +-3, softplus's threshold, the exp/erf/tanh/log1p range
 * switches, exp's overflow and underflow clamps), and random bit patterns
 * and values; sizes 0, 1, around the vector width, one below/at/above a
 * block of RP_FAD_THREADS vector steps and of scalar steps, and past
 * RP_FAD_MAX_BLOCKS blocks (grid-stride loops: a thread's second step);
 * aligned, misaligned (by an element of x, y, d, or 4, 8 or 16 bytes of d:
 * float32 d of 16-bit x moves 32 bytes a step, in 16-byte pieces) and
 * in-place (y == x) buffers; the backward from codes for each dtype, every
 * code 0..255 (the NaN and exact-slope codes too) with codes of real
 * forwards, codes and grads misaligned, in place (grad_x == grad_y);
 * argument errors (statuses and messages the CPU core's, nothing launched);
 * a refused launch and an error cudaGetLastError reports after it (RP_ERUNTIME
 * with CUDA's text, the error cleared).
 *
 * With --random N [--seed S] [--first I] it runs N cases drawn from the seed
 * instead of the grid (.ci/run runs a couple hundred): any activation with
 * parameters drawn from edge values (0, -0, tiny, subnormal, huge, inf, NaN;
 * the CPU core's refusals must be the launcher's) or at random, any x dtype
 * and derivative storage, any layout, sizes near the vector width, a block
 * and the RP_FAD_MAX_BLOCKS cap, and a quarter backwards from codes. A
 * failed case prints the arguments that rerun it alone.
 *
 * What it cannot prove: anything only the device does: the device code nvcc
 * generates for fad_math.h (the emulation runs the host compilation of the
 * same source; --fmad=false and IEEE division and sqrt are what make them
 * agree), real vector loads and stores, blocks running concurrently, shared
 * memory banks.
 *
 * Build (.ci/run does this): the CPU reference with setup.py's flags, then
 * this file with nvcc, against the static CUDA runtime:
 *   gcc -std=c11 -O3 -fopenmp -fno-math-errno -ffp-contract=off -Icsrc \
 *       -c csrc/fad.c -o fad.o                (and csrc/common.c -> common.o)
 *   nvcc -std=c++17 -O2 --fmad=false -arch=sm_80 -Xcompiler -fopenmp,-ffp-contract=off \
 *       -Xlinker --wrap=__cudaGetKernel,--wrap=__cudaLaunchKernel \
 *       -Icsrc -Ikernels kernels/tests/fad_emulation.cu fad.o common.o -o fad_emulation
 * Exit status 0 when everything agrees; one summary line either way.
 */
#include <cuda_runtime.h>

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <algorithm>
#include <vector>

#define EMU_DEVICES 2
#include "emu_runtime.h" /* CHECK; every runtime mock but launch and attribute */
#include "fad.cu"
#include "emu_faults.h" /* after reprop.h: rp_error */

/* ---------------------------------------------------------------------------
 * fad.cu again, as host code: the kernels the launch mock runs (see the top)
 * ------------------------------------------------------------------------- */

#include "emu_exec.h"

namespace emu_dev {
/* What the dead copy of the backward launcher launches (see the top). */
template <int DT, class... A> __global__ void rp_fad_backward_kernel(A...) {}
} // namespace emu_dev

#include "emu_host_begin.h"
#define rp_fad_backward_kernel(...) rp_fad_backward_body(__VA_ARGS__)
#define rp_cuda_fad_forward emu_dead_fad_forward
#define rp_cuda_fad_backward_code8 emu_dead_fad_backward_code8
#define rp_fad_launch_status emu_dead_launch_status /* nvcc finds both copies ambiguous */
namespace emu_dev {
#include "fad.cu"
} // namespace emu_dev
#undef rp_fad_launch_status
#undef rp_cuda_fad_backward_code8
#undef rp_cuda_fad_forward
#undef rp_fad_backward_kernel
#include "emu_host_end.h"

static_assert(sizeof(emu_dev::rp_fad_fwd_args) == sizeof(rp_fad_fwd_args), "forward arguments");
static_assert(sizeof(emu_dev::rp_fad_table) == sizeof(rp_fad_table), "backward table");

/* ---------------------------------------------------------------------------
 * The emulated launches
 * ------------------------------------------------------------------------- */

enum { CALL_NONE, CALL_FORWARD, CALL_BACKWARD };

/* What the current call must launch, and what it did. */
static struct {
    int what; /* CALL_*: what the call may launch */
    int dtype, d_store, kind;
    float p0, p1, inv_step;
    int zero_code;
    const void *x, *y, *d;               /* forward */
    const void *grad_y, *codes, *grad_x; /* backward */
    const rp_fad_codebook *cb;
    int64_t n;
    int vec; /* the vector path expected */
    int launches;
    bool reverse; /* blocks last to first */
} g_call;

static struct {
    long cases, launches, vector_launches, scalar_launches, capped_grids, blocks, threads;
    long fwd_kinds_seen[RP_FAD_KINDS];
    long stores_seen[5]; /* by d_store + 1 */
    long dtypes_seen[3];
    long backward_launches, inplace_cases;
} g_stats;

static int x_size(int dtype) { return dtype == RP_F32 ? 4 : 2; }
static int vec_width(int dtype) { return 16 / x_size(dtype); } /* E */
static size_t store_size(int store)
{
    return store == RP_F32 ? 4 : (store == RP_FAD_CODE8 ? 1 : (store == RP_FAD_NONE ? 0 : 2));
}

/* fad.cu's grid: one thread per vector step (n / E, plus the n % E tail
 * elements), or per element, in blocks of RP_FAD_THREADS, 1 to RP_FAD_MAX_BLOCKS. */
static unsigned expected_blocks(int64_t n, int dtype, int vec)
{
    const int64_t e = vec_width(dtype);
    const int64_t work = vec ? n / e + n % e : n;
    const int64_t b = (work + RP_FAD_THREADS - 1) / RP_FAD_THREADS;
    return (unsigned)std::min<int64_t>(std::max<int64_t>(b, 1), RP_FAD_MAX_BLOCKS);
}

static bool same_bits(float a, float b) { return memcmp(&a, &b, 4) == 0; }

typedef void (*fwd_emulator)(const emu_dev::rp_fad_fwd_args &, unsigned);

template <int DT, int DS> static void forward_thread(void *arg)
{
    emu_dev::rp_fad_forward_kernel<DT, DS>(*(const emu_dev::rp_fad_fwd_args *)arg);
}

template <int DT, int DS>
static void emulate_forward(const emu_dev::rp_fad_fwd_args &a, unsigned nblocks)
{
    emu_dev::rp_fad_fwd_args copy = a;
    emu_run_grid_order(nblocks, RP_FAD_THREADS, forward_thread<DT, DS>, &copy, g_call.reverse);
}

static const int k_dtypes[3] = {RP_F32, RP_F16, RP_BF16};
static const int k_stores[5] = {RP_FAD_NONE, RP_F32, RP_F16, RP_BF16, RP_FAD_CODE8};

typedef struct {
    const void *kernel; /* the host stub fad.cu launches */
    int dtype, d_store;
    fwd_emulator run;
} fwd_entry;

template <int DT> static void add_forward_entries(std::vector<fwd_entry> &v)
{
    v.push_back({(const void *)rp_fad_forward_kernel<DT, RP_FAD_NONE>, DT, RP_FAD_NONE,
                 emulate_forward<DT, RP_FAD_NONE>});
    v.push_back({(const void *)rp_fad_forward_kernel<DT, RP_F32>, DT, RP_F32,
                 emulate_forward<DT, RP_F32>});
    v.push_back({(const void *)rp_fad_forward_kernel<DT, RP_F16>, DT, RP_F16,
                 emulate_forward<DT, RP_F16>});
    v.push_back({(const void *)rp_fad_forward_kernel<DT, RP_BF16>, DT, RP_BF16,
                 emulate_forward<DT, RP_BF16>});
    v.push_back({(const void *)rp_fad_forward_kernel<DT, RP_FAD_CODE8>, DT, RP_FAD_CODE8,
                 emulate_forward<DT, RP_FAD_CODE8>});
}

static const std::vector<fwd_entry> &forward_entries(void)
{
    static std::vector<fwd_entry> v;
    if (v.empty()) {
        add_forward_entries<RP_F32>(v);
        add_forward_entries<RP_F16>(v);
        add_forward_entries<RP_BF16>(v);
    }
    return v;
}

static void check_forward_launch(const void *fn, void **args, unsigned nblocks)
{
    const fwd_entry *entry = NULL;
    for (const fwd_entry &e : forward_entries())
        if (e.kernel == fn)
            entry = &e;
    CHECK(entry != NULL, "launched a kernel that is no forward instantiation");
    if (entry == NULL)
        return;
    CHECK(entry->dtype == g_call.dtype && entry->d_store == g_call.d_store,
          "forward kernel for dtype %d, d_store %d; the call's are %d, %d", entry->dtype,
          entry->d_store, g_call.dtype, g_call.d_store);
    emu_dev::rp_fad_fwd_args a;
    memcpy(&a, args[0], sizeof a);
    const bool code8 = g_call.d_store == RP_FAD_CODE8;
    CHECK(a.x == g_call.x && a.y == g_call.y, "x or y pointer");
    CHECK(a.d == (g_call.d_store == RP_FAD_NONE ? NULL : g_call.d), "d pointer %p", a.d);
    CHECK(a.n == g_call.n, "n %lld, the call's %lld", (long long)a.n, (long long)g_call.n);
    CHECK(a.kind == g_call.kind && same_bits(a.p0, g_call.p0) && same_bits(a.p1, g_call.p1),
          "kind %d (%g, %g)", a.kind, a.p0, a.p1);
    CHECK(!code8 || (same_bits(a.inv_step, g_call.inv_step) && a.zero_code == g_call.zero_code),
          "codebook constants %g, %d; expected %g, %d", a.inv_step, a.zero_code, g_call.inv_step,
          g_call.zero_code);
    CHECK(a.vec == g_call.vec, "vector path %d, expected %d", a.vec, g_call.vec);
    g_stats.fwd_kinds_seen[g_call.kind >= 0 && g_call.kind < RP_FAD_KINDS ? g_call.kind : 0]++;
    g_stats.stores_seen[g_call.d_store + 1]++;
    entry->run(a, nblocks);
}

/* The backward launch's arguments, for its thread body. */
static struct {
    const void *grad_y;
    const uint8_t *codes;
    void *grad_x;
    int64_t n;
    int vec;
    emu_dev::rp_fad_table table;
} g_bwd;

template <int DT> static void backward_thread(void *)
{
    emu_dev::rp_fad_backward_body<DT>(g_bwd.grad_y, g_bwd.codes, g_bwd.grad_x, g_bwd.n, g_bwd.vec,
                                      g_bwd.table);
}

/* The staged table (__shared__) starts each block as NaN (emu_exec.h): a
 * read of it before it is staged shows. */
template <int DT> static void emulate_backward(unsigned nblocks)
{
    emu_run_grid_order(nblocks, RP_FAD_THREADS, backward_thread<DT>, NULL, g_call.reverse);
}

static void check_backward_launch(const void *fn, void **args, unsigned nblocks)
{
    int dt = -1;
    if (fn == (const void *)rp_fad_backward_kernel<RP_F32>)
        dt = RP_F32;
    else if (fn == (const void *)rp_fad_backward_kernel<RP_F16>)
        dt = RP_F16;
    else if (fn == (const void *)rp_fad_backward_kernel<RP_BF16>)
        dt = RP_BF16;
    CHECK(dt == g_call.dtype, "backward kernel for dtype %d, the call's is %d", dt, g_call.dtype);
    if (dt != g_call.dtype)
        return;
    g_bwd.grad_y = *(const void *const *)args[0];
    g_bwd.codes = *(const uint8_t *const *)args[1];
    g_bwd.grad_x = *(void *const *)args[2];
    g_bwd.n = *(const int64_t *)args[3];
    g_bwd.vec = *(const int *)args[4];
    memcpy(&g_bwd.table, args[5], sizeof g_bwd.table);
    CHECK(g_bwd.grad_y == g_call.grad_y && g_bwd.codes == g_call.codes &&
              g_bwd.grad_x == g_call.grad_x,
          "grad_y, codes or grad_x pointer");
    CHECK(g_bwd.n == g_call.n, "n %lld, the call's %lld", (long long)g_bwd.n, (long long)g_call.n);
    CHECK(g_bwd.vec == g_call.vec, "vector path %d, expected %d", g_bwd.vec, g_call.vec);
    CHECK(memcmp(g_bwd.table.value, g_call.cb->value, sizeof g_bwd.table.value) == 0,
          "the table is not the codebook's values");
    g_stats.backward_launches++;
    switch (dt) {
    case RP_F32:
        emulate_backward<RP_F32>(nblocks);
        break;
    case RP_F16:
        emulate_backward<RP_F16>(nblocks);
        break;
    default:
        emulate_backward<RP_BF16>(nblocks);
        break;
    }
}

static int g_launch_counter; /* launches of the call, for emu_check_faults */

static cudaError_t mock_launch_kernel(const void *fn, dim3 grid, dim3 block, void **args,
                                      size_t smem, cudaStream_t stream)
{
    const int index = g_launch_counter++;
    g_call.launches++;
    emu_check_launch_site(grid, block, stream);
    CHECK(g_call.what != CALL_NONE, "a launch where none is due");
    CHECK(g_call.launches == 1, "%d launches for one call", g_call.launches);
    CHECK(block.x == RP_FAD_THREADS, "%u threads per block", block.x);
    CHECK(smem == 0, "%zu bytes of dynamic shared memory", smem);
    const unsigned want = expected_blocks(g_call.n, g_call.dtype, g_call.vec);
    CHECK(grid.x == want, "%u blocks for %lld elements (vector path %d), expected %u", grid.x,
          (long long)g_call.n, g_call.vec, want);
    const cudaError_t e = emu_injected_launch_error(index);
    if (e != cudaSuccess || g_fault.fault == FAULT_LAST_ERROR)
        return e; /* refused, or "launched" and reported later */
    if (g_call.what == CALL_NONE || grid.x != want || grid.x > RP_FAD_MAX_BLOCKS)
        return cudaSuccess;
    g_stats.launches++;
    g_stats.blocks += grid.x;
    g_stats.threads += (long)grid.x * RP_FAD_THREADS;
    g_stats.capped_grids += grid.x == RP_FAD_MAX_BLOCKS;
    (g_call.vec ? g_stats.vector_launches : g_stats.scalar_launches)++;
    if (g_call.what == CALL_FORWARD)
        check_forward_launch(fn, args, grid.x);
    else
        check_backward_launch(fn, args, grid.x);
    return cudaSuccess;
}

/* The runtime's ends of a <<<>>> launch (see the top): the kernel's handle is
 * its host stub, and the launch is the mock's. A refused launch is recorded
 * for cudaGetLastError, as the runtime records every failure. */
extern "C" cudaError_t __wrap___cudaGetKernel(cudaKernel_t *kernel, const void *fn)
{
    *kernel = (cudaKernel_t)fn;
    return cudaSuccess;
}

extern "C" cudaError_t __wrap___cudaLaunchKernel(cudaKernel_t kernel, dim3 grid, dim3 block,
                                                 void **args, size_t smem, cudaStream_t stream)
{
    const cudaError_t e = mock_launch_kernel((const void *)kernel, grid, block, args, smem, stream);
    if (e != cudaSuccess)
        g_emu.pending = e;
    return e;
}

/* ---------------------------------------------------------------------------
 * Test data
 * ------------------------------------------------------------------------- */

typedef struct {
    const char *name;
    int kind;
    float p0, p1;
} act_config;

/* Every kind, each parameter of either sign and at its special values;
 * kinds without parameters once more with junk ones (ignored alike). */
static std::vector<act_config> act_configs(void)
{
    return {
        {"gelu", RP_FAD_GELU, 0.0f, 0.0f},
        {"gelu (junk p0, p1)", RP_FAD_GELU, 2.5f, -1.0f},
        {"gelu tanh", RP_FAD_GELU_TANH, 0.0f, 0.0f},
        {"silu", RP_FAD_SILU, 0.0f, 0.0f},
        {"mish", RP_FAD_MISH, 0.0f, 0.0f},
        {"softplus beta 1 threshold 20", RP_FAD_SOFTPLUS, 1.0f, 20.0f},
        {"softplus beta 2 threshold 1", RP_FAD_SOFTPLUS, 2.0f, 1.0f},
        {"softplus beta 0.5 threshold -3", RP_FAD_SOFTPLUS, 0.5f, -3.0f},
        {"softplus beta -1.5 threshold 4", RP_FAD_SOFTPLUS, -1.5f, 4.0f},
        {"sigmoid", RP_FAD_SIGMOID, 0.0f, 0.0f},
        {"tanh", RP_FAD_TANH, 0.0f, 0.0f},
        {"tanh (junk p0, p1)", RP_FAD_TANH, -7.0f, 3.0e38f},
        {"elu alpha 1", RP_FAD_ELU, 1.0f, 0.0f},
        {"elu alpha 0", RP_FAD_ELU, 0.0f, 0.0f},
        {"elu alpha -1.5", RP_FAD_ELU, -1.5f, 0.0f},
        {"elu alpha 3", RP_FAD_ELU, 3.0f, 0.0f},
        {"celu alpha 1", RP_FAD_CELU, 1.0f, 0.0f},
        {"celu alpha 0.3", RP_FAD_CELU, 0.3f, 0.0f},
        {"celu alpha -0.7 (no 8-bit codes)", RP_FAD_CELU, -0.7f, 0.0f},
        {"selu", RP_FAD_SELU, 0.0f, 0.0f},
        {"leaky_relu 0.01", RP_FAD_LEAKY_RELU, 0.01f, 0.0f},
        {"leaky_relu 0", RP_FAD_LEAKY_RELU, 0.0f, 0.0f},
        {"leaky_relu -0.2", RP_FAD_LEAKY_RELU, -0.2f, 0.0f},
        {"leaky_relu 1.5", RP_FAD_LEAKY_RELU, 1.5f, 0.0f},
        {"hardswish", RP_FAD_HARDSWISH, 0.0f, 0.0f},
        {"hardswish (junk p0, p1)", RP_FAD_HARDSWISH, 1e-3f, 9.0f},
        {"hardsigmoid", RP_FAD_HARDSIGMOID, 0.0f, 0.0f},
        {"logsigmoid", RP_FAD_LOGSIGMOID, 0.0f, 0.0f},
        {"softsign", RP_FAD_SOFTSIGN, 0.0f, 0.0f},
        {"tanhshrink", RP_FAD_TANHSHRINK, 0.0f, 0.0f},
    };
}

static void push_with_neighbours(std::vector<float> &v, float x)
{
    for (float s : {x, -x}) {
        v.push_back(s);
        v.push_back(nextafterf(s, INFINITY));
        v.push_back(nextafterf(s, -INFINITY));
    }
}

/* float32 x: special values, kinks and switch points with their neighbours,
 * random bit patterns and random values, in a fixed shuffled order. */
static const std::vector<float> &f32_pool(void)
{
    static std::vector<float> v;
    if (!v.empty())
        return v;
    const uint32_t bits[] = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u,
                             0xffc00000u, 0x7f800001u, 0x7fa5a5a5u, 0xffbfffffu, 0x7fc12345u,
                             0x00000001u, 0x80000001u, 0x007fffffu, 0x807fffffu, 0x00800000u,
                             0x80800000u, 0x7f7fffffu, 0xff7fffffu, 0x33800000u, 0xb3800000u};
    for (uint32_t b : bits)
        v.push_back(from_bits(b));
    /* kinks (0, +-3), the exp clamps (89, -104, -18), tanh's 0.5493 and 10,
     * erf's 1 and 4 (at x * 0.7071), log1p's near-0 window, exp overflow
     * (88.72), sigmoid and softplus saturation, softplus thresholds of the
     * configs (x * beta = threshold), the float16 range */
    const float points[] = {0.5f,     1.0f,       2.0f,       3.0f,          6.0f,
                            10.0f,    20.0f,      88.72283f,  89.0f,         104.0f,
                            103.97f,  18.0f,      87.33655f,  0.54930614433f, 1.4142135f,
                            5.656854f, 0.29289321881f, 0.41421356237f, 0.70710677f, 1e-8f,
                            1e-30f,   1e10f,      65504.0f,   65520.0f,      1.5f,
                            20.0f / 1.0f, 1.0f / 2.0f, -3.0f / 0.5f, 4.0f / -1.5f, 15.0f,
                            16.6355f, 9.0f,       0.35f};
    for (float p : points)
        push_with_neighbours(v, p);
    rng64 r = {4242};
    for (int i = 0; i < 4096; i++)
        v.push_back(from_bits((uint32_t)rng_next(&r)));
    for (int i = 0; i < 8192; i++)
        v.push_back(-12.0f + 24.0f * (float)(rng_next(&r) >> 40) * (1.0f / 16777216.0f));
    for (int i = 0; i < 2048; i++)
        v.push_back(-120.0f + 240.0f * (float)(rng_next(&r) >> 40) * (1.0f / 16777216.0f));
    for (size_t i = v.size() - 1; i > 0; i--)
        std::swap(v[i], v[(size_t)(rng_next(&r) % (i + 1))]);
    return v;
}

/* 16-bit x: every bit pattern, shuffled. */
static const std::vector<uint16_t> &half_pool(void)
{
    static std::vector<uint16_t> v;
    if (v.empty()) {
        rng64 r = {77};
        for (uint32_t b = 0; b < 65536; b++)
            v.push_back((uint16_t)b);
        for (size_t i = v.size() - 1; i > 0; i--)
            std::swap(v[i], v[(size_t)(rng_next(&r) % (i + 1))]);
    }
    return v;
}

static size_t pool_size(int dtype) { return dtype == RP_F32 ? f32_pool().size() : 65536; }

/* n elements of `dtype` from the pool, from `start` on, wrapping around. */
static void fill_x(void *dst, int dtype, int64_t n, size_t start)
{
    const size_t m = pool_size(dtype), es = (size_t)x_size(dtype);
    for (int64_t i = 0; i < n; i++) {
        const size_t k = (start + (size_t)i) % m;
        memcpy((char *)dst + (size_t)i * es,
               dtype == RP_F32 ? (const void *)&f32_pool()[k] : (const void *)&half_pool()[k], es);
    }
}

/* Where the call runs: the current device and a stream of it. */
typedef struct {
    const char *name;
    int device;
    cudaStream_t stream;
} launch_config;

static launch_config launch_config_for(long i)
{
    static const launch_config v[] = {
        {"device 0, default stream", 0, NULL},
        {"device 1, a stream of it", 1, emu_stream(1)},
        {"device 0, per-thread stream", 0, cudaStreamPerThread},
        {"device 1, legacy stream", 1, cudaStreamLegacy},
        {"device 0, a stream of it", 0, emu_stream(0)},
    };
    return v[i % 5];
}

/* Expect one call: its launch, on `lc`. */
static void expect_call(int what, const launch_config &lc)
{
    g_call.what = what;
    g_call.launches = 0;
    g_call.reverse = (g_stats.cases & 1) != 0;
    g_emu.current_device = lc.device;
    g_emu.stream = lc.stream;
    g_emu.stream_device = lc.device;
    g_emu.pending = cudaSuccess;
}

/* After the call: the device as it was, no error pending, the runtime not
 * asked for the device (the launchers run on the current one). */
static void check_call_site(const launch_config &lc, long get_device_calls)
{
    CHECK(g_emu.current_device == lc.device, "device %d current after the call, not %d",
          g_emu.current_device, lc.device);
    CHECK(g_emu.pending == cudaSuccess, "an error left pending");
    CHECK(g_emu.get_device_calls == get_device_calls, "cudaGetDevice called");
}

static bool aligned(const void *p, size_t a) { return (uintptr_t)p % a == 0; }

/* Element i of a buffer of `format` (an rp_dtype, or RP_FAD_CODE8 for bytes)
 * is NaN. */
static bool is_nan(const void *p, int64_t i, int format)
{
    uint32_t u = 0;
    if (format == RP_F32) {
        memcpy(&u, (const char *)p + 4 * i, 4);
        return (u & 0x7fffffffu) > 0x7f800000u;
    }
    if (format == RP_FAD_CODE8)
        return false;
    memcpy(&u, (const char *)p + 2 * i, 2);
    return format == RP_F16 ? (u & 0x7fffu) > 0x7c00u : (u & 0x7fffu) > 0x7f80u;
}

/* `got` byte for byte `want`'s, but that a NaN may be any NaN: its sign and
 * payload are not the same from one compilation to the next (GCC commutes
 * operands; a GPU makes every NaN result its canonical 0x7fffffff). */
static bool compare_buffers(guarded_buffer *want, guarded_buffer *got, int format,
                            const char *what)
{
    const size_t esize = format == RP_F32 ? 4 : (format == RP_FAD_CODE8 ? 1 : 2);
    const bool guards = buffer_guards_intact(got);
    CHECK(guards, "write out of bounds of %s", what);
    CHECK(want->size == got->size, "%s: sizes differ", what);
    if (want->size != got->size)
        return false;
    const void *pw = buffer_data(want), *pg = buffer_data(got);
    const int64_t n = (int64_t)(want->size / esize);
    for (int64_t i = 0; i < n; i++) {
        if (memcmp((const char *)pw + i * (int64_t)esize, (const char *)pg + i * (int64_t)esize,
                   esize) == 0 ||
            (is_nan(pw, i, format) && is_nan(pg, i, format)))
            continue;
        uint32_t w = 0, g = 0;
        memcpy(&w, (const char *)pw + i * (int64_t)esize, esize);
        memcpy(&g, (const char *)pg + i * (int64_t)esize, esize);
        CHECK(false, "%s differs from the CPU's at element %lld of %lld: %#x, CPU %#x", what,
              (long long)i, (long long)n, g, w);
        return false;
    }
    return guards;
}

/* ---------------------------------------------------------------------------
 * Forward cases
 * ------------------------------------------------------------------------- */

typedef enum {
    L_ALIGNED,
    L_X_OFF,      /* x one element off a 16-byte boundary */
    L_Y_OFF,      /* y one element off */
    L_D_OFF,      /* d one element of its own off (NONE: a buffer to leave alone) */
    L_D_OFF8,     /* d 8 bytes off */
    L_D_OFF4,     /* d 4 bytes off */
    L_D_OFF16,    /* d 16 bytes off: enough for its widest steps (16 bytes), not 32 */
    L_INPLACE,    /* y == x */
    L_INPLACE_OFF, /* y == x, one element off */
    N_LAYOUTS
} layout;

static const char *const layout_names[N_LAYOUTS] = {
    "aligned", "x misaligned", "y misaligned", "d misaligned by an element",
    "d 8 bytes off", "d 4 bytes off", "d 16 bytes off", "in place", "in place, misaligned"};

typedef struct {
    guarded_buffer x, y, d;
} fwd_buffers;

static void alloc_forward(fwd_buffers *b, int dtype, int d_store, int64_t n, layout l,
                          size_t start)
{
    const size_t xs = (size_t)x_size(dtype), ds = store_size(d_store);
    const size_t dmis = l == L_D_OFF    ? (ds ? ds : 4)
                        : l == L_D_OFF8 ? 8
                        : l == L_D_OFF4 ? 4
                        : l == L_D_OFF16 ? 16
                                         : 0;
    buffer_allocate(&b->x, (size_t)n * xs, l == L_X_OFF || l == L_INPLACE_OFF ? xs : 0);
    buffer_allocate(&b->y, (size_t)n * xs, l == L_Y_OFF ? xs : 0);
    buffer_allocate(&b->d, (size_t)n * (ds ? ds : 4), dmis);
    fill_x(buffer_data(&b->x), dtype, n, start);
}

/* One forward call through both; false on a disagreement. */
static bool run_forward(const act_config &c, int dtype, int d_store, int64_t n, layout l,
                        size_t start)
{
    const launch_config lc = launch_config_for(g_stats.cases);
    const bool inplace = l == L_INPLACE || l == L_INPLACE_OFF;
    /* NONE: d NULL, or (misaligned layouts) a buffer that must stay untouched */
    const bool pass_d = d_store != RP_FAD_NONE || l == L_D_OFF || l == L_D_OFF8 || l == L_D_OFF4 ||
                        l == L_D_OFF16;
    fwd_buffers cpu, emu;
    rp_error ecpu = {{0}}, eemu = {{0}};
    const int failures = g_failures;

    snprintf(g_context, sizeof g_context, "forward %s, x %s, d %s, n %lld, %s, %s", c.name,
             rp_dtype_name(dtype),
             d_store == RP_FAD_NONE ? "none" : (d_store == RP_FAD_CODE8 ? "code8" : rp_dtype_name(d_store)),
             (long long)n, layout_names[l], lc.name);
    alloc_forward(&cpu, dtype, d_store, n, l, start);
    alloc_forward(&emu, dtype, d_store, n, l, start);
    guarded_buffer x0 = emu.x;
    void *xc = buffer_data(&cpu.x), *xe = buffer_data(&emu.x);
    void *yc = inplace ? xc : buffer_data(&cpu.y), *ye = inplace ? xe : buffer_data(&emu.y);
    void *dc = pass_d ? buffer_data(&cpu.d) : NULL, *de = pass_d ? buffer_data(&emu.d) : NULL;

    const int rc_cpu = rp_fad_forward_cpu(c.kind, c.p0, c.p1, dtype, xc, yc, d_store, dc, n, 1, &ecpu);

    memset(&g_call, 0, sizeof g_call);
    g_call.dtype = dtype;
    g_call.d_store = d_store;
    g_call.kind = c.kind;
    g_call.p0 = c.p0;
    g_call.p1 = c.p1;
    g_call.x = xe;
    g_call.y = ye;
    g_call.d = de;
    g_call.n = n;
    if (d_store == RP_FAD_CODE8) {
        rp_fad_codebook cb;
        rp_error e2 = {{0}};
        if (rp_fad_codebook_init(c.kind, c.p0, c.p1, &cb, &e2) == RP_OK) {
            g_call.inv_step = cb.inv_step;
            g_call.zero_code = cb.zero_code;
        }
    }
    {
        const size_t w = (size_t)vec_width(dtype) * store_size(d_store);
        g_call.vec = aligned(xe, 16) && aligned(ye, 16) &&
                     (d_store == RP_FAD_NONE || aligned(de, w < 16 ? w : 16));
    }
    const long queries = g_emu.get_device_calls;
    expect_call(rc_cpu == RP_OK && n > 0 ? CALL_FORWARD : CALL_NONE, lc);
    const int rc = rp_cuda_fad_forward(c.kind, c.p0, c.p1, dtype, xe, ye, d_store, de, n,
                                       (void *)lc.stream, &eemu);
    g_call.what = CALL_NONE;
    check_call_site(lc, queries);
    CHECK(rc == rc_cpu && strcmp(ecpu.msg, eemu.msg) == 0, "status %d '%s', the CPU's %d '%s'", rc,
          eemu.msg, rc_cpu, ecpu.msg);
    CHECK(g_call.launches == (rc_cpu == RP_OK && n > 0 ? 1 : 0), "%d launches", g_call.launches);
    g_stats.cases++;
    g_stats.dtypes_seen[dtype == RP_F32 ? 0 : (dtype == RP_F16 ? 1 : 2)]++;
    g_stats.inplace_cases += inplace;
    bool ok = true;
    if (!inplace) {
        ok = compare_buffers(&x0, &emu.x, RP_FAD_CODE8, "x (an input, bytes)") && ok;
        ok = compare_buffers(&cpu.y, &emu.y, dtype, "y") && ok;
    } else {
        ok = compare_buffers(&cpu.x, &emu.x, dtype, "y (in place)") && ok;
    }
    ok = compare_buffers(&cpu.d, &emu.d, d_store == RP_FAD_NONE ? RP_FAD_CODE8 : d_store,
                         d_store == RP_FAD_NONE ? "d (unused)" : "d") && ok;
    return ok && g_failures == failures;
}

static std::vector<int64_t> forward_sizes(int dtype)
{
    const int64_t E = vec_width(dtype), B = (int64_t)RP_FAD_THREADS * E;
    return {0, 1, 2, 3, E - 1, E, E + 1, 2 * E + 3, 17, 255, 256, 257, 511, 513,
            B - 1, B, B + 1, B + E + 1, 2 * B + 5};
}

/* Every config, dtype and storage: all values at once (every 16-bit
 * pattern), then the sizes, each small one in every layout. */
static void run_forward_grid(int *failed)
{
    const std::vector<act_config> configs = act_configs();
    rng64 r = {99};
    long combo = 0;
    for (const act_config &c : configs)
        for (int dtype : k_dtypes)
            for (int d_store : k_stores) {
                combo++;
                const int64_t all = (int64_t)pool_size(dtype) + 3;
                if (!run_forward(c, dtype, d_store, all, L_ALIGNED, 0) && ++*failed >= 10)
                    return;
                const std::vector<int64_t> sizes = forward_sizes(dtype);
                for (size_t i = 0; i < sizes.size(); i++)
                    for (int l = 0; l < N_LAYOUTS; l++) {
                        if (sizes[i] > 17 && l != (int)((i + (size_t)combo) % N_LAYOUTS))
                            continue;
                        const size_t start = (size_t)(rng_next(&r) % pool_size(dtype));
                        if (!run_forward(c, dtype, d_store, sizes[i], (layout)l, start) &&
                            ++*failed >= 10)
                            return;
                    }
            }
}

/* Past RP_FAD_MAX_BLOCKS blocks: the grid-stride loops take a second step. */
static void run_forward_grid_stride(int *failed)
{
    const int64_t T = (int64_t)RP_FAD_MAX_BLOCKS * RP_FAD_THREADS;
    const act_config leaky = {"leaky_relu 0.01", RP_FAD_LEAKY_RELU, 0.01f, 0.0f};
    const act_config silu = {"silu", RP_FAD_SILU, 0.0f, 0.0f};
    const act_config hsig = {"hardsigmoid", RP_FAD_HARDSIGMOID, 0.0f, 0.0f};
    if (!run_forward(leaky, RP_F32, RP_FAD_CODE8, 4 * (T + 300) + 3, L_ALIGNED, 5))
        ++*failed;
    if (!run_forward(silu, RP_F32, RP_F32, T + 777, L_X_OFF, 11))
        ++*failed;
    if (!run_forward(hsig, RP_BF16, RP_F16, T + 77, L_Y_OFF, 13))
        ++*failed;
}

/* ---------------------------------------------------------------------------
 * Backward cases
 * ------------------------------------------------------------------------- */

typedef enum {
    B_ALIGNED,
    B_GRAD_Y_OFF,
    B_GRAD_X_OFF,
    B_CODES_OFF1,
    B_CODES_OFF2,
    B_CODES_OFF4,
    B_INPLACE,
    B_INPLACE_OFF,
    N_BLAYOUTS
} blayout;

static const char *const blayout_names[N_BLAYOUTS] = {
    "aligned", "grad_y misaligned", "grad_x misaligned", "codes 1 byte off",
    "codes 2 bytes off", "codes 4 bytes off", "in place", "in place, misaligned"};

typedef struct {
    guarded_buffer g, codes, out;
} bwd_buffers;

/* grad_y from the pool; codes: every code 0..255 first, then those of a real
 * forward of `c` (x from the pool) or, with `random_codes`, random bytes. */
static void alloc_backward(bwd_buffers *b, const act_config &c, int dtype, int64_t n,
                           blayout l, size_t start, bool random_codes)
{
    const size_t xs = (size_t)x_size(dtype);
    const size_t cmis = l == B_CODES_OFF1 ? 1 : (l == B_CODES_OFF2 ? 2 : (l == B_CODES_OFF4 ? 4 : 0));
    buffer_allocate(&b->g, (size_t)n * xs, l == B_GRAD_Y_OFF || l == B_INPLACE_OFF ? xs : 0);
    buffer_allocate(&b->codes, (size_t)n, cmis);
    buffer_allocate(&b->out, (size_t)n * xs, l == B_GRAD_X_OFF ? xs : 0);
    fill_x(buffer_data(&b->g), dtype, n, start);
    uint8_t *codes = (uint8_t *)buffer_data(&b->codes);
    if (random_codes) {
        rng64 r = {start};
        for (int64_t i = 0; i < n; i++)
            codes[i] = (uint8_t)(rng_next(&r) >> 56);
    } else if (n > 0) {
        std::vector<char> x((size_t)n * xs), y((size_t)n * xs);
        rp_error err = {{0}};
        fill_x(x.data(), dtype, n, start * 7 + 1);
        const int rc = rp_fad_forward_cpu(c.kind, c.p0, c.p1, dtype, x.data(), y.data(),
                                          RP_FAD_CODE8, codes, n, 1, &err);
        CHECK(rc == RP_OK, "the forward for the codes: %s", err.msg);
    }
    for (int64_t i = 0; i < n && i < 256; i++)
        codes[i] = (uint8_t)i;
}

static bool run_backward(const act_config &c, int dtype, int64_t n, blayout l, size_t start,
                         bool random_codes)
{
    const launch_config lc = launch_config_for(g_stats.cases);
    const bool inplace = l == B_INPLACE || l == B_INPLACE_OFF;
    bwd_buffers cpu, emu;
    rp_fad_codebook cb;
    rp_error ecpu = {{0}}, eemu = {{0}};
    const int failures = g_failures;

    snprintf(g_context, sizeof g_context, "backward code8 %s, %s, n %lld, %s, %s codes, %s",
             c.name, rp_dtype_name(dtype), (long long)n, blayout_names[l],
             random_codes ? "random" : "forward's", lc.name);
    CHECK(rp_fad_codebook_init(c.kind, c.p0, c.p1, &cb, &ecpu) == RP_OK, "codebook: %s", ecpu.msg);
    alloc_backward(&cpu, c, dtype, n, l, start, random_codes);
    alloc_backward(&emu, c, dtype, n, l, start, random_codes);
    guarded_buffer g0 = emu.g, codes0 = emu.codes;
    void *gc = buffer_data(&cpu.g), *ge = buffer_data(&emu.g);
    void *oc = inplace ? gc : buffer_data(&cpu.out), *oe = inplace ? ge : buffer_data(&emu.out);
    const uint8_t *ce = (const uint8_t *)buffer_data(&emu.codes);

    const int rc_cpu = rp_fad_backward_code8_cpu(dtype, gc, (const uint8_t *)buffer_data(&cpu.codes),
                                                 &cb, oc, n, 1, &ecpu);
    memset(&g_call, 0, sizeof g_call);
    g_call.dtype = dtype;
    g_call.grad_y = ge;
    g_call.codes = ce;
    g_call.grad_x = oe;
    g_call.cb = &cb;
    g_call.n = n;
    g_call.vec = aligned(ge, 16) && aligned(oe, 16) && aligned(ce, (size_t)vec_width(dtype));
    const long queries = g_emu.get_device_calls;
    expect_call(rc_cpu == RP_OK && n > 0 ? CALL_BACKWARD : CALL_NONE, lc);
    const int rc = rp_cuda_fad_backward_code8(dtype, ge, ce, &cb, oe, n, (void *)lc.stream, &eemu);
    g_call.what = CALL_NONE;
    check_call_site(lc, queries);
    CHECK(rc == rc_cpu && strcmp(ecpu.msg, eemu.msg) == 0, "status %d '%s', the CPU's %d '%s'", rc,
          eemu.msg, rc_cpu, ecpu.msg);
    CHECK(g_call.launches == (rc_cpu == RP_OK && n > 0 ? 1 : 0), "%d launches", g_call.launches);
    g_stats.cases++;
    g_stats.inplace_cases += inplace;
    bool ok = compare_buffers(&codes0, &emu.codes, RP_FAD_CODE8, "codes (an input)");
    if (!inplace) {
        ok = compare_buffers(&g0, &emu.g, RP_FAD_CODE8, "grad_y (an input, bytes)") && ok;
        ok = compare_buffers(&cpu.out, &emu.out, dtype, "grad_x") && ok;
    } else {
        ok = compare_buffers(&cpu.g, &emu.g, dtype, "grad_x (in place)") && ok;
    }
    return ok && g_failures == failures;
}

static void run_backward_grid(int *failed)
{
    const act_config books[] = {
        {"gelu", RP_FAD_GELU, 0.0f, 0.0f},
        {"softplus beta -1.5 threshold 4", RP_FAD_SOFTPLUS, -1.5f, 4.0f},
        {"elu alpha 0", RP_FAD_ELU, 0.0f, 0.0f},
        {"leaky_relu -0.2", RP_FAD_LEAKY_RELU, -0.2f, 0.0f},
        {"hardswish", RP_FAD_HARDSWISH, 0.0f, 0.0f},
        {"tanh", RP_FAD_TANH, 0.0f, 0.0f},
    };
    rng64 r = {123};
    long combo = 0;
    for (const act_config &c : books)
        for (int dtype : k_dtypes) {
            combo++;
            for (int rnd = 0; rnd < 2; rnd++)
                if (!run_backward(c, dtype, (int64_t)pool_size(dtype) + 5, B_ALIGNED, 0, rnd) &&
                    ++*failed >= 10)
                    return;
            const std::vector<int64_t> sizes = forward_sizes(dtype);
            for (size_t i = 0; i < sizes.size(); i++)
                for (int l = 0; l < N_BLAYOUTS; l++) {
                    if (sizes[i] > 17 && l != (int)((i + (size_t)combo) % N_BLAYOUTS))
                        continue;
                    const size_t start = (size_t)(rng_next(&r) % pool_size(dtype));
                    if (!run_backward(c, dtype, sizes[i], (blayout)l, start, (i + l) % 2) &&
                        ++*failed >= 10)
                        return;
                }
        }
    /* past RP_FAD_MAX_BLOCKS blocks */
    const int64_t T = (int64_t)RP_FAD_MAX_BLOCKS * RP_FAD_THREADS;
    if (!run_backward(books[0], RP_F32, 4 * (T + 300) + 3, B_ALIGNED, 3, true))
        ++*failed;
    if (!run_backward(books[4], RP_BF16, T + 99, B_CODES_OFF1, 7, false))
        ++*failed;
}

/* ---------------------------------------------------------------------------
 * Errors
 * ------------------------------------------------------------------------- */

/* Argument errors: the CPU core's status and message, nothing launched,
 * nothing written (the forward grid covers d NULL with NONE and n = 0). */
static void test_argument_errors(void)
{
    float x[8] = {0}, y[8], d[8];
    uint8_t codes[8] = {0};
    rp_fad_codebook cb;
    rp_error err = {{0}};
    const launch_config lc = launch_config_for(0);
    rp_fad_codebook_init(RP_FAD_GELU, 0.0f, 0.0f, &cb, &err);
    struct fwd_args {
        const char *what;
        int kind;
        float p0, p1;
        int dtype, d_store;
        const void *x;
        void *y, *d;
        int64_t n;
    };
    const float nan = from_bits(0x7fc00000u);
    const fwd_args fwd[] = {
        {"kind -1", -1, 0, 0, RP_F32, RP_F32, x, y, d, 8},
        {"kind 16", RP_FAD_KINDS, 0, 0, RP_F32, RP_F32, x, y, d, 8},
        {"dtype 3", RP_FAD_GELU, 0, 0, RP_FAD_CODE8, RP_F32, x, y, d, 8},
        {"dtype -1", RP_FAD_GELU, 0, 0, -1, RP_F32, x, y, d, 8},
        {"d_store 7", RP_FAD_GELU, 0, 0, RP_F32, 7, x, y, d, 8},
        {"d_store -2", RP_FAD_GELU, 0, 0, RP_F32, -2, x, y, d, 8},
        {"p0 NaN", RP_FAD_ELU, nan, 0, RP_F32, RP_F32, x, y, d, 8},
        {"p1 inf", RP_FAD_SOFTPLUS, 1, INFINITY, RP_F32, RP_F32, x, y, d, 8},
        {"celu alpha 0", RP_FAD_CELU, 0, 0, RP_F32, RP_F32, x, y, d, 8},
        {"celu alpha < 0, codes", RP_FAD_CELU, -1, 0, RP_F32, RP_FAD_CODE8, x, y, d, 8},
        {"n -1", RP_FAD_GELU, 0, 0, RP_F32, RP_F32, x, y, d, -1},
        {"x NULL", RP_FAD_GELU, 0, 0, RP_F32, RP_F32, NULL, y, d, 8},
        {"y NULL", RP_FAD_GELU, 0, 0, RP_F32, RP_F32, x, NULL, d, 8},
        {"d NULL", RP_FAD_GELU, 0, 0, RP_F32, RP_F16, x, y, NULL, 8},
        {"n 0, all NULL", RP_FAD_GELU, 0, 0, RP_F32, RP_F32, NULL, NULL, NULL, 0},
        {"n 0, bad kind", 99, 0, 0, RP_F32, RP_F32, NULL, NULL, NULL, 0},
    };
    for (const fwd_args &a : fwd) {
        rp_error ecpu = {{0}}, eemu = {{0}};
        snprintf(g_context, sizeof g_context, "forward arguments: %s", a.what);
        const int rc_cpu = rp_fad_forward_cpu(a.kind, a.p0, a.p1, a.dtype, a.x, a.y, a.d_store,
                                              a.d, a.n, 1, &ecpu);
        memset(&g_call, 0, sizeof g_call);
        expect_call(CALL_NONE, lc);
        const int rc = rp_cuda_fad_forward(a.kind, a.p0, a.p1, a.dtype, a.x, a.y, a.d_store, a.d,
                                           a.n, NULL, &eemu);
        CHECK(rc == rc_cpu && strcmp(ecpu.msg, eemu.msg) == 0,
              "status %d '%s', the CPU's %d '%s'", rc, eemu.msg, rc_cpu, ecpu.msg);
        CHECK(a.n == 0 || rc != RP_OK, "accepted");
        CHECK(g_call.launches == 0, "launched anyway");
    }
    struct bwd_args {
        const char *what;
        int dtype;
        const void *g;
        const uint8_t *codes;
        const rp_fad_codebook *cb;
        void *out;
        int64_t n;
    };
    const bwd_args bwd[] = {
        {"dtype 3", RP_FAD_CODE8, x, codes, &cb, y, 8},
        {"dtype -1", RP_FAD_NONE, x, codes, &cb, y, 8},
        {"codebook NULL", RP_F32, x, codes, NULL, y, 8},
        {"n -1", RP_F32, x, codes, &cb, y, -1},
        {"grad_y NULL", RP_F32, NULL, codes, &cb, y, 8},
        {"codes NULL", RP_F16, x, NULL, &cb, y, 8},
        {"grad_x NULL", RP_BF16, x, codes, &cb, NULL, 8},
        {"n 0, all NULL", RP_F32, NULL, NULL, &cb, NULL, 0},
    };
    for (const bwd_args &a : bwd) {
        rp_error ecpu = {{0}}, eemu = {{0}};
        snprintf(g_context, sizeof g_context, "backward arguments: %s", a.what);
        const int rc_cpu = rp_fad_backward_code8_cpu(a.dtype, a.g, a.codes, a.cb, a.out, a.n, 1, &ecpu);
        memset(&g_call, 0, sizeof g_call);
        expect_call(CALL_NONE, lc);
        const int rc = rp_cuda_fad_backward_code8(a.dtype, a.g, a.codes, a.cb, a.out, a.n, NULL, &eemu);
        CHECK(rc == rc_cpu && strcmp(ecpu.msg, eemu.msg) == 0,
              "status %d '%s', the CPU's %d '%s'", rc, eemu.msg, rc_cpu, ecpu.msg);
        CHECK(a.n == 0 || rc != RP_OK, "accepted");
        CHECK(g_call.launches == 0, "launched anyway");
    }
}

/* A refused launch and one reported by cudaGetLastError afterwards:
 * RP_ERUNTIME naming the launcher with CUDA's text, the error cleared. */
static void test_runtime_errors(void)
{
    static float x[100], y[100];
    static uint16_t h[100];
    static uint8_t codes[100];
    static rp_fad_codebook cb;
    rp_error e0 = {{0}};
    const launch_config lc = launch_config_for(0);
    rp_fad_codebook_init(RP_FAD_SILU, 0.0f, 0.0f, &cb, &e0);
    const cudaError_t texts[2] = {cudaErrorLaunchOutOfResources, cudaErrorIllegalAddress};
    for (int which = 0; which < 2; which++) {
        auto call = [&](rp_error &err) {
            memset(&g_call, 0, sizeof g_call);
            g_call.n = 100;
            if (which == 0) {
                g_call.dtype = RP_F32;
                g_call.d_store = RP_F16;
                g_call.kind = RP_FAD_SILU;
                g_call.x = x;
                g_call.y = y;
                g_call.d = h;
                g_call.vec = aligned(x, 16) && aligned(y, 16) && aligned(h, 8);
            } else {
                g_call.dtype = RP_F16;
                g_call.grad_y = h;
                g_call.codes = codes;
                g_call.grad_x = h;
                g_call.cb = &cb;
                g_call.vec = aligned(h, 16) && aligned(codes, 8);
            }
            expect_call(which == 0 ? CALL_FORWARD : CALL_BACKWARD, lc);
            const int rc = which == 0 ? rp_cuda_fad_forward(RP_FAD_SILU, 0.0f, 0.0f, RP_F32, x, y,
                                                            RP_F16, h, 100, NULL, &err)
                                      : rp_cuda_fad_backward_code8(RP_F16, h, codes, &cb, h, 100,
                                                                   NULL, &err);
            const cudaError_t want = texts[g_fault.fault == FAULT_LAST_ERROR];
            CHECK(strstr(err.msg, cudaGetErrorString(want)) != NULL, "'%s' lacks CUDA's text '%s'",
                  err.msg, cudaGetErrorString(want));
            return rc;
        };
        emu_check_faults(1, g_launch_counter,
                         which == 0 ? "CUDA error in rp_cuda_fad_forward: "
                                    : "CUDA error in rp_cuda_fad_backward_code8: ",
                         call, false);
    }
    g_call.what = CALL_NONE;
}

/* ---------------------------------------------------------------------------
 * Main
 * ------------------------------------------------------------------------- */

static void check_coverage(void)
{
    snprintf(g_context, sizeof g_context, "coverage");
    for (int k = 0; k < RP_FAD_KINDS; k++)
        CHECK(g_stats.fwd_kinds_seen[k] > 0, "kind %d never launched", k);
    for (int s = 0; s < 5; s++)
        CHECK(g_stats.stores_seen[s] > 0, "derivative storage %d never launched", s - 1);
    for (int t = 0; t < 3; t++)
        CHECK(g_stats.dtypes_seen[t] > 0, "dtype %d never run", t);
    CHECK(g_stats.vector_launches > 0 && g_stats.scalar_launches > 0, "vector or scalar path unused");
    CHECK(g_stats.capped_grids >= 5, "only %ld grids capped at RP_FAD_MAX_BLOCKS", g_stats.capped_grids);
    CHECK(g_stats.inplace_cases > 0 && g_stats.backward_launches > 0, "in place or backward unused");
    CHECK(g_exec.barriers > 0, "no barrier emulated");
    CHECK(g_exec.blocks == g_stats.blocks && g_exec.threads == g_stats.threads,
          "%ld blocks, %ld threads run; %ld, %ld launched", g_exec.blocks, g_exec.threads,
          g_stats.blocks, g_stats.threads);
}

/* ---------------------------------------------------------------------------
 * The random mode: cases the grid does not walk
 * ------------------------------------------------------------------------- */

/* A parameter: mostly a plain value, sometimes an edge one (the C core's
 * refusals must be the launcher's too, status and message). */
static float random_param(rng64 *r)
{
    static const float edges[] = {0.0f, -0.0f, 1.0f, -1.0f, 1e-30f, -1e-30f, 1e-45f, 20.0f,
                                  -20.0f, 100.0f, 3e38f, INFINITY, -INFINITY, NAN, 0.5f, 2.0f};
    return rng_below(r, 2) ? pick(r, edges) : (float)((double)(rng_next(r) >> 40) / 1677721.6 - 5.0);
}

/* A size near an edge: the vector width, a block of vector or scalar steps,
 * the cap of RP_FAD_MAX_BLOCKS blocks (a thread's second step), or any. */
static int64_t random_size(rng64 *r, int dtype)
{
    const int64_t E = vec_width(dtype), B = (int64_t)RP_FAD_THREADS * E;
    const int64_t T = (int64_t)RP_FAD_MAX_BLOCKS * RP_FAD_THREADS;
    const int64_t edges[] = {0, E, 2 * E, RP_FAD_THREADS, B, 2 * B, T, E * T};
    switch (rng_below(r, 4)) {
    case 0:
        return (int64_t)rng_below(r, 3 * E);
    case 1:
        return std::max<int64_t>(0, pick(r, edges) + (int64_t)rng_below(r, 2 * E + 1) - E);
    case 2:
        return (int64_t)rng_below(r, 3 * B);
    default:
        return (int64_t)rng_below(r, 300);
    }
}

/* Random case `index` of `seed`: a forward, or a backward from codes when
 * the drawn activation has a codebook. */
static bool run_random_case(uint64_t seed, uint64_t index)
{
    static char name[96];
    rng64 r = random_case_rng(seed, index);
    const act_config c = {name, (int)rng_below(&r, RP_FAD_KINDS), random_param(&r),
                          random_param(&r)};
    const int dtype = pick(&r, k_dtypes);
    const int64_t n = random_size(&r, dtype);
    const size_t start = (size_t)rng_below(&r, pool_size(dtype));
    snprintf(name, sizeof name, "random case %llu:%llu: kind %d p0 %a p1 %a",
             (unsigned long long)seed, (unsigned long long)index, c.kind, (double)c.p0,
             (double)c.p1);
    rp_fad_codebook cb;
    rp_error err = {{0}};
    if (rng_below(&r, 4) == 0 && rp_fad_codebook_init(c.kind, c.p0, c.p1, &cb, &err) == RP_OK)
        return run_backward(c, dtype, n, (blayout)rng_below(&r, N_BLAYOUTS), start,
                            rng_below(&r, 2));
    return run_forward(c, dtype, pick(&r, k_stores), n, (layout)rng_below(&r, N_LAYOUTS), start);
}

int main(int argc, char **argv)
{
    struct timespec t0, t1;
    int failed = 0;
    const random_args random = parse_random_args(argc, argv);
    catch_fatal_signals();
    clock_gettime(CLOCK_MONOTONIC, &t0);
    test_argument_errors();
    test_runtime_errors();
    if (random.count > 0) {
        run_random_cases(random, run_random_case);
    } else {
        run_forward_grid(&failed);
        if (failed < 10)
            run_forward_grid_stride(&failed);
        if (failed < 10)
            run_backward_grid(&failed);
        if (g_failures == 0)
            check_coverage();
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("fad_emulation: %s: %ld cases, %ld launches (%ld vector, %ld scalar, %ld backward, "
           "%ld capped grids), %ld blocks, %ld threads, %ld barriers, %.1f s\n",
           g_failures ? "FAILED" : "ok", g_stats.cases, g_stats.launches, g_stats.vector_launches,
           g_stats.scalar_launches, g_stats.backward_launches, g_stats.capped_grids, g_stats.blocks,
           g_stats.threads, g_exec.barriers,
           (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
    return g_failures != 0;
}
