/*
 * scan_emulation.cu: the CUDA scan of kernels/scan.cu (rp_cuda_scan and its
 * kernels), run on the host, must agree with the recurrence it computes.
 *
 * CI has nvcc but no GPU. This test includes scan.cu with the CUDA runtime
 * calls it makes (cudaLaunchKernel, cudaGetDevice, cudaStreamIsCapturing,
 * cudaStreamGetDevice, cudaSetDevice, cudaDeviceGetAttribute, cudaFuncSetAttribute,
 * cudaGetLastError) renamed to host mocks (emu_runtime.h; the launch and
 * attribute mocks below). The launch mock finds the kernel it is handed
 * among every instantiation scan.cu can launch and runs every block of the
 * grid on the host through the very task bodies the kernels run
 * (rp_scan_up_small, rp_scan_up_large, rp_scan_mid, rp_scan_down), with a
 * host executor: a phase (x.each) is queued, and a
 * barrier (x.sync, or the warp shuffle of x.group_sum) runs the queued phases
 * thread-major, each thread through all of them before the next thread
 * starts, in increasing thread order on some runs and decreasing on others.
 * That is an order the device may choose where no barrier separates two
 * phases, so a missing barrier shows up as a read of shared memory another
 * thread has not written yet (it starts as NaN, fenced by canaries) or has
 * already overwritten. Per-thread state lives in one array slot per thread;
 * the shuffle sum is the same butterfly over the group's slots.
 *
 * One run of each levels (variant 2 below) runs the kernels themselves
 * instead, with their device executor rp_scan_dev: scan.cu compiled a second
 * time as host code (scan_host_copy.h), every thread of a block a fiber
 * (emu_exec.h) with its own threadIdx, that runs until its __syncthreads,
 * the shuffle an exchange between two barriers, odd blocks' threads last to
 * first, the dynamic shared memory the same fenced NaN buffer. That covers
 * what the host executor restates: the kernels' entry (thread and block
 * indices, the shared memory), rp_scan_dev's barrier and shuffle, and the
 * device's own semantics, where a phase runs at once, every automatic
 * variable is the thread's, and a barrier that some threads of a block skip
 * fails; its results must be bitwise those of the host executor.
 *
 * Each case compares g with the recurrence g[n-1] = c[n-1], g[t] = c[t] +
 * J[t+1]^T g[t+1] evaluated in double, and with rp_scan_cpu (csrc/scan.c),
 * for n = 1..70 (a subset for the larger H) and every levels in [0,
 * rp_scan_max_levels(n)], dense leaves and structured ones (G = 1 without u,
 * G = 1 and G = 3 with u; with v given as f'(y) for tanh and relu, and
 * pre_activation), H from 1 to 400 (whole-task up-sweep blocks up to
 * 64, row panels of 64, 32, 16, 8, 4, 2 and 1 rows beyond), in place (g ==
 * c, at levels 0: with levels it is refused, the redo reads c) and not, under three shared-memory budgets (48 KB, and 20 KB and 12 KB
 * to force the other tile shapes and the opt-in path; the results must be
 * bitwise the same under another budget), with the grid capped
 * at 3 blocks so that every kernel's loop over work items runs. Workspace
 * and g start as NaN (a read of anything not yet written shows), every
 * buffer is fenced by canaries (the workspace is exactly
 * rp_scan_workspace_floats for the levels run, and every product float of it
 * must be written), and the inputs must come back unchanged.
 * On the first run of each levels c and the leaves are read-only copies that
 * end at an inaccessible page: a read past the end of an input (a leaf or a
 * c the scan does not have, say) crashes there; on the device executor's run
 * they start after one, so that a read before the start (c[-1], say) crashes.
 * Where v is f'(y), the first run of each levels passes v = f'(y) (1 - y*y or
 * relu's slope, formed on the host) and every other run y with the
 * activation: the results must be bitwise the same (relu with pre_activation:
 * but for the +0 of its select where y <= 0); with pre_activation the first
 * run's result must also be bitwise v times that of a run without it.
 *
 * Also checked: 2 levels + 1 launches per call, with levels one more (the
 * linear redo, reading the flag that down-sweep level 0 alone sets, cleared
 * by a memset of the one int past the workspace's floats before the first
 * launch), on the stream, with the
 * stream's device current during them and the caller's restored after;
 * block sizes within the kernels' launch bounds and a multiple of the shuffle
 * group; dynamic shared memory within 48 KB or the opt-in set for that kernel
 * beforehand; rp_scan_check's failures returned with nothing launched; batch
 * 0 launches nothing; a refused launch, an error reported by
 * cudaGetLastError and a device without enough opt-in shared memory give
 * RP_ERUNTIME / RP_EINVAL with a message, as do a failing opt-in query or
 * opt-in, and an up-sweep block (not the linear scan's) needing more than the
 * device's opt-in at levels = 1.
 *
 * With --random N [--seed S] [--first I] it runs N problems drawn from the
 * seed instead of the grid (.ci/run runs 20), each as run_case runs a grid
 * one: n up to 300, H from 1 to 130 (mostly up to 40), batch 1 to 4, dense
 * leaves or 1 to 3 gates with or without u, v or f'(y), pre_activation, a
 * shared-memory budget of 12 to 48 KB in 1 KB steps and an opt-in maximum
 * of 48, 99, 163 or 227 KB; a third of them with 1 to 3 inputs (of c, jt,
 * w, u, v or y) made +inf, -inf or NaN (a small grid of such cases runs after
 * the others). A failed problem prints its seed and index.
 *
 * With inf or NaN inputs the recurrence in double is no reference (it would
 * multiply where relu selects): a run with levels whose slots are not all
 * finite is redone by the call's linear redo, as rp_scan_cpu redoes it, and
 * the result must be NaN where rp_scan_cpu's is NaN, the same inf where it is
 * inf and within the rounding bound where it is finite; runs compare bitwise
 * but for the NaNs' bits (which NaN a sum keeps follows its order).
 *
 * What it cannot prove: anything only the device does (blocks running
 * concurrently, __ldg, bank conflicts, the generated code, launch-bound
 * register limits), nor a missing __syncthreads right next to a shuffle
 * (emulated with barriers of the whole block, where the device's syncs a
 * warp). Blocks of a launch run one after another, in forward
 * order and (on a third run of the small n) in reverse, and the results must
 * be bitwise identical, which catches a block that reads what another block
 * of the same launch writes; thread orders likewise.
 *
 * Build and run (no GPU needed; -arch=sm_80 only because nvcc needs one):
 *   gcc -std=c11 -O3 -fopenmp -fno-math-errno -ffp-contract=off -Icsrc \
 *       -c csrc/scan.c -o scan.o                  (and csrc/common.c -> common.o)
 *   nvcc -std=c++17 -O2 --fmad=false -arch=sm_80 -Xcompiler -fopenmp \
 *       -Icsrc -Ikernels kernels/tests/scan_emulation.cu scan.o common.o -o scan_emulation
 *   ./scan_emulation          (--quick: a smaller grid of cases)
 * Exit status 0 when everything agrees; one summary line either way.
 */
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <algorithm>
#include <functional>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

static int g_smem_default = 49152; /* the budget scan.cu plans with */
#define RP_SCAN_SMEM_DEFAULT ((size_t)g_smem_default)
#define RP_SCAN_MAX_GRID 3 /* every kernel loops over its work items */

#define EMU_DEVICES 3
#include "emu_runtime.h" /* CHECK; every runtime mock but launch and attribute */
static cudaError_t mock_func_set_attribute(const void *fn, cudaFuncAttribute attr, int value);
#define cudaFuncSetAttribute mock_func_set_attribute
static cudaError_t mock_memset_async(void *p, int value, size_t bytes, cudaStream_t stream);
#define cudaMemsetAsync mock_memset_async
#include "scan.cu"
#include "emu_faults.h" /* after reprop.h: rp_error */
/* the linear scan's block passes a few barriers per step (its shuffles two each) */
#define EMU_MAX_ROUNDS (1 << 24)
#include "scan_host_copy.h" /* the kernels themselves, for the device executor's runs */

static_assert(sizeof(emu_dev::rp_scan_args) == sizeof(rp_scan_args), "kernel arguments");

/* ---------------------------------------------------------------------------
 * The host executor: every thread of a block, phase by phase
 * ------------------------------------------------------------------------- */

struct emu_exec {
    template <class T> struct local {
        T v[EMU_MAX_THREADS];
        __host__ __device__ T &operator()(int t) { return v[t]; }
    };
    int nt;
    bool reverse; /* unsynchronized phases: threads last to first */
    std::vector<std::function<void(int)>> pending;
    /* A phase is queued; a barrier (or a shuffle) runs the queued phases
     * thread-major: each thread runs all of them before the next thread
     * starts, which is one order the device may pick without a barrier. A
     * missing barrier then shows as reads of another thread's not-yet-written
     * data (NaN shared memory, stale values) in one of the two orders. */
    template <class F> __host__ __device__ void each(F &&f)
    {
#ifndef __CUDA_ARCH__
        pending.emplace_back(f);
#endif
    }
    __host__ __device__ void flush()
    {
#ifndef __CUDA_ARCH__
        for (int i = 0; i < nt; i++) {
            const int t = reverse ? nt - 1 - i : i;
            for (auto &f : pending)
                f(t);
        }
        pending.clear();
#endif
    }
    __host__ __device__ void sync() { flush(); }
    /* __shfl_xor_sync butterfly: lane l adds lane l ^ o, for o = S/2 .. 1 (the
     * launch mock has checked that S is a power of two <= 32 dividing nt).
     * A shuffle waits for the lanes of its warp: the queued phases run first. */
    __host__ __device__ void group_sum(local<float> &x, int S)
    {
        float tmp[32];
        flush();
        for (int g = 0; g < nt; g += S)
            for (int o = S >> 1; o > 0; o >>= 1) {
                for (int l = 0; l < S; l++)
                    tmp[l] = x.v[g + l] + x.v[g + (l ^ o)];
                for (int l = 0; l < S; l++)
                    x.v[g + l] = tmp[l];
            }
    }
};

/* ---------------------------------------------------------------------------
 * The emulated runtime
 * ------------------------------------------------------------------------- */

static struct {
    int optin; /* cudaDevAttrMaxSharedMemoryPerBlockOptin */
    int launches;
    bool reverse_blocks;  /* run each grid's blocks last to first */
    bool reverse_threads; /* run unsynchronized phases' threads last to first */
    bool device_executor; /* run the kernels themselves, threads as fibers */
    std::vector<std::pair<const void *, int>> attr; /* opt-ins set */
    int attr_fault; /* 1: cudaDeviceGetAttribute fails, 2: cudaFuncSetAttribute fails */
} g_rt;

static struct {
    long cases, launches, blocks, optins, device_blocks;
    long by_kind[4], device_by_kind[4]; /* launches; those run by the device executor */
    long tiles[8]; /* large up-sweep launches by log2(T) */
    long nonfinite, fallbacks; /* runs with inf or NaN inputs; of those, linear fallbacks */
} g_stats;

static cudaError_t mock_device_get_attribute(int *value, cudaDeviceAttr attr, int dev)
{
    CHECK(attr == cudaDevAttrMaxSharedMemoryPerBlockOptin, "unexpected attribute %d", (int)attr);
    CHECK(dev == g_emu.stream_device, "attribute of device %d, the stream's is %d", dev,
          g_emu.stream_device);
    if (g_rt.attr_fault == 1) {
        g_emu.pending = cudaErrorInvalidDevice;
        return cudaErrorInvalidDevice;
    }
    *value = g_rt.optin;
    return cudaSuccess;
}

static cudaError_t mock_func_set_attribute(const void *fn, cudaFuncAttribute attr, int value)
{
    CHECK(attr == cudaFuncAttributeMaxDynamicSharedMemorySize, "unexpected attribute %d", (int)attr);
    /* the device's maximum, whatever the call needs: a cap set to each call's
       own need was lowered under a concurrent scan of a larger H */
    CHECK(value == g_rt.optin, "opt-in of %d bytes, not the device's maximum %d", value,
          g_rt.optin);
    CHECK(g_emu.current_device == g_emu.stream_device, "opt-in on device %d, stream on %d",
          g_emu.current_device, g_emu.stream_device);
    if (g_rt.attr_fault == 2) {
        g_emu.pending = cudaErrorInvalidValue;
        return cudaErrorInvalidValue;
    }
    g_rt.attr.push_back(std::make_pair(fn, value));
    g_stats.optins++;
    return cudaSuccess;
}

/* ---------------------------------------------------------------------------
 * The kernels: every instantiation scan.cu can launch, and its body
 * ------------------------------------------------------------------------- */

typedef void (*emu_body)(emu_exec &x, const rp_scan_args &a, int64_t block, int64_t grid,
                         float *sm);

template <int MODE>
static void body_up_small(emu_exec &x, const rp_scan_args &a, int64_t block, int64_t grid, float *sm)
{
    rp_scan_up_small<MODE>(x, a, block, grid, sm);
}
template <int MODE, int TM>
static void body_up_large(emu_exec &x, const rp_scan_args &a, int64_t block, int64_t grid, float *sm)
{
    rp_scan_up_large<MODE, TM>(x, a, block, grid, sm);
}
template <int MODE>
static void body_down(emu_exec &x, const rp_scan_args &a, int64_t block, int64_t grid, float *sm)
{
    rp_scan_down<MODE>(x, a, block, grid, sm);
}
template <int MODE>
static void body_mid(emu_exec &x, const rp_scan_args &a, int64_t block, int64_t grid, float *sm)
{
    rp_scan_mid<MODE>(x, a, block, grid, sm);
}

/* The host copy of kernel K (scan_host_copy.h) for one thread: rp_scan_dev
 * with the built-in indices, a fiber's barriers and the shuffle. */
template <void (*K)(emu_dev::rp_scan_args)> static void dev_thread(void *arg)
{
    K(*(const emu_dev::rp_scan_args *)arg);
}

typedef struct {
    const void *fn;
    emu_body body;
    void (*thread)(void *); /* the kernel itself, for the device executor */
    int kind; /* 0 up small, 1 up large, 2 down, 3 middle */
    int mode, tm;
    int max_threads;
} emu_kernel;

static std::vector<emu_kernel> g_kernels;

template <int MODE> static void register_mode()
{
    g_kernels.push_back({(const void *)rp_scan_up_small_kernel<MODE>, body_up_small<MODE>,
                         dev_thread<emu_dev::rp_scan_up_small_kernel<MODE>>, 0, MODE, 0,
                         RP_SCAN_THREADS});
    g_kernels.push_back({(const void *)rp_scan_up_large_kernel<MODE, 1>, body_up_large<MODE, 1>,
                         dev_thread<emu_dev::rp_scan_up_large_kernel<MODE, 1>>, 1, MODE, 1,
                         RP_SCAN_THREADS});
    g_kernels.push_back({(const void *)rp_scan_up_large_kernel<MODE, 2>, body_up_large<MODE, 2>,
                         dev_thread<emu_dev::rp_scan_up_large_kernel<MODE, 2>>, 1, MODE, 2,
                         RP_SCAN_THREADS});
    g_kernels.push_back({(const void *)rp_scan_up_large_kernel<MODE, 4>, body_up_large<MODE, 4>,
                         dev_thread<emu_dev::rp_scan_up_large_kernel<MODE, 4>>, 1, MODE, 4,
                         RP_SCAN_THREADS});
    g_kernels.push_back({(const void *)rp_scan_down_kernel<MODE>, body_down<MODE>,
                         dev_thread<emu_dev::rp_scan_down_kernel<MODE>>, 2, MODE, 0, RP_SCAN_THREADS});
    g_kernels.push_back({(const void *)rp_scan_mid_kernel<MODE>, body_mid<MODE>,
                         dev_thread<emu_dev::rp_scan_mid_kernel<MODE>>, 3, MODE, 0,
                         RP_SCAN_MID_THREADS});
}

/* What the current call is expected to launch. */
static struct {
    int levels, mode; /* the leaves' mode */
    int next;         /* launches so far */
    int *redo;        /* with levels: the redo's flag, one int past the workspace's floats */
    int memsets;      /* of the flag, before the first launch */
} g_expect;

/* The flag's clearing: on the call's stream and device, before any launch,
 * the one int past the workspace's floats. */
static cudaError_t mock_memset_async(void *p, int value, size_t bytes, cudaStream_t stream)
{
    emu_check_launch_site(dim3(1), dim3(1), stream);
    CHECK(p == (void *)g_expect.redo && bytes == sizeof(int) && value == 0,
          "memset of %zu bytes at %p, the flag is at %p", bytes, p, (void *)g_expect.redo);
    CHECK(g_expect.next == 0, "the flag cleared after launch %d", g_expect.next);
    g_expect.memsets++;
    memset(p, value, bytes);
    return cudaSuccess;
}

/* The workspace a call with `levels` takes: with levels, the flag's float too. */
static int64_t work_floats(int64_t n, int64_t B, int64_t H, int levels)
{
    return rp_scan_workspace_floats(n, B, H, levels) + (levels > 0);
}

/* What the next call must launch: `levels` in the leaves' `mode`, with its
 * flag past the workspace's floats at `work`. */
static void expect_call(int levels, int mode, float *work, int64_t n, int64_t B, int64_t H)
{
    g_expect.levels = levels;
    g_expect.mode = mode;
    g_expect.next = 0;
    g_expect.memsets = 0;
    g_expect.redo = levels > 0 ? (int *)(work + rp_scan_workspace_floats(n, B, H, levels)) : NULL;
}


static cudaError_t mock_launch_kernel(const void *fn, dim3 grid, dim3 block, void **args,
                                      size_t smem, cudaStream_t stream)
{
    const emu_kernel *k = NULL;
    const int index = g_rt.launches++;
    for (const emu_kernel &e : g_kernels)
        if (e.fn == fn)
            k = &e;
    CHECK(k != NULL, "launch of an unknown kernel %p", fn);
    if (k == NULL)
        return cudaErrorInvalidDeviceFunction;
    const cudaError_t injected = emu_injected_launch_error(index);
    if (injected != cudaSuccess)
        return injected;

    const rp_scan_args &a = *(const rp_scan_args *)args[0];
    emu_check_launch_site(grid, block, stream);
    CHECK(grid.x >= 1 && grid.x <= RP_SCAN_MAX_GRID, "grid of %u", grid.x);
    CHECK(block.x >= 1 && (int)block.x <= k->max_threads, "%u threads, kernel bound %d", block.x,
          k->max_threads);
    CHECK((int64_t)grid.x == (a.nunits < RP_SCAN_MAX_GRID ? a.nunits : RP_SCAN_MAX_GRID),
          "grid of %u for %lld units", grid.x, (long long)a.nunits);
    {
        size_t allowed = (size_t)g_smem_default;
        for (auto &p : g_rt.attr)
            if (p.first == fn && (size_t)p.second > allowed)
                allowed = (size_t)p.second;
        CHECK(smem <= allowed, "%zu bytes of shared memory, %zu allowed", smem, allowed);
    }

    /* The order of launches: up-sweep levels 0..L-1, the middle, the down-sweep
     * L-1..0, then with L > 0 the linear redo (a middle of leaves), which
     * reads the flag that down-sweep level 0 alone sets. */
    {
        const int L = g_expect.levels, i = g_expect.next++;
        const bool redo = L > 0 && i == 2 * L + 1;
        int kind, d = -1, mode;
        if (i < L) {
            kind = 0;
            d = i;
        } else if (i == L || redo) {
            kind = 3;
        } else {
            kind = 2;
            d = 2 * L - i;
        }
        mode = (kind == 3 ? L == 0 || redo : d == 0) ? g_expect.mode : RP_SCAN_PROD;
        CHECK(i < 2 * L + 1 + (L > 0), "launch %d of a scan with %d levels", i, L);
        CHECK(a.redo_if == (redo ? g_expect.redo : NULL), "launch %d reads the flag %p", i,
              (const void *)a.redo_if);
        CHECK(a.nonfinite == (L > 0 && i == 2 * L ? g_expect.redo : NULL), "launch %d sets the flag %p",
              i, (void *)a.nonfinite);
        CHECK(L == 0 || g_expect.memsets == 1, "launch %d before the flag's clearing", i);
        CHECK(k->kind == kind || (kind == 0 && k->kind == 1), "launch %d is kernel kind %d, not %d",
              i, k->kind, kind);
        CHECK(k->mode == mode, "launch %d in mode %d, not %d", i, k->mode, mode);
        if (d >= 0)
            CHECK(a.d == d, "launch %d at level %d, not %d", i, a.d, d);
        if (k->kind == 0)
            CHECK(a.H <= RP_SCAN_SMALL_H, "small up-sweep with H = %lld", (long long)a.H);
        if (k->kind == 1) {
            const int T = a.tile, tm = T >= 64 ? 4 : (T == 32 ? 2 : 1);
            CHECK(a.H > RP_SCAN_SMALL_H, "large up-sweep with H = %lld", (long long)a.H);
            CHECK(tm == k->tm && (int)block.x == T / tm * 16, "tile %d, TM %d, %u threads", T,
                  k->tm, block.x);
            for (int s = 0; s < 8; s++)
                if (T == 1 << s)
                    g_stats.tiles[s]++;
        }
        if (k->kind == 2 || k->kind == 3)
            CHECK(a.S >= 1 && a.S <= 32 && (a.S & (a.S - 1)) == 0 && block.x % 32 == 0,
                  "%u threads in groups of %d", block.x, a.S);
    }
    if (g_failures)
        return cudaSuccess;

    g_stats.launches++;
    g_stats.by_kind[k->kind]++;
    g_stats.device_by_kind[k->kind] += g_rt.device_executor;
    std::vector<float> sm(smem / 4 + 2 * EMU_CANARY + 4);
    float *base = sm.data() + EMU_CANARY;
    emu_exec x;
    x.nt = (int)block.x;
    x.reverse = g_rt.reverse_threads;
    emu_dev::rp_scan_args copy;
    memcpy(&copy, &a, sizeof copy);
    emu_dev::emu_scan_smem = reinterpret_cast<float4 (*)[]>(base);
    for (unsigned i = 0; i < grid.x; i++) {
        const unsigned blk = g_rt.reverse_blocks ? grid.x - 1 - i : i;
        float nan_fill;
        uint32_t nan_bits = 0x7fbfffff, canary = emu_canary_bits;
        memcpy(&nan_fill, &nan_bits, 4);
        for (size_t e = 0; e < sm.size(); e++)
            memcpy(&sm[e], &canary, 4);
        for (size_t e = 0; e < smem / 4; e++)
            base[e] = nan_fill;
        if (g_rt.device_executor) { /* odd blocks' threads last to first */
            emu_run_one_block(blk, grid.x, block.x, k->thread, &copy, (i & 1u) != 0);
            g_stats.device_blocks++;
        } else {
            k->body(x, a, blk, grid.x, base);
            CHECK(x.pending.empty(), "block %u ends with %zu phases after its last barrier", blk,
                  x.pending.size());
            x.flush();
        }
        for (size_t e = 0; e < sm.size(); e++) {
            if (e >= EMU_CANARY && e < EMU_CANARY + smem / 4)
                continue;
            uint32_t bits;
            memcpy(&bits, &sm[e], 4);
            CHECK(bits == emu_canary_bits, "block %u wrote shared memory outside its %zu bytes", blk,
                  smem);
            if (bits != emu_canary_bits)
                break;
        }
        g_stats.blocks++;
    }
    return cudaSuccess;
}

/* ---------------------------------------------------------------------------
 * Data, the reference
 * ------------------------------------------------------------------------- */

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static float urand(float lo, float hi)
{
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return lo + (hi - lo) * (float)((g_rng >> 40) * (1.0 / 16777216.0));
}

typedef struct {
    int64_t n, B, H;
    int G;      /* 0: dense */
    bool has_u; /* structured */
    int act;    /* structured: v = f'(y), an rp_scan_act */
    bool pre;   /* G = 1: pre_activation */
    int nonfinite;   /* inf or NaN values put into c or the leaves (inject_nonfinite) */
    uint64_t nf_seed; /* where and which */
} emu_problem;

struct emu_data {
    emu_problem pr;
    fenced w, u, v, jt, c, y;
};

/* f'(y) as a caller forms v: 1 - y * y (y * y rounded first), and torch's
 * relu slope, 0 where y <= 0, else 1 (a NaN y included). */
static float derivative(int act, float y)
{
    const float yy = y * y;
    return act == RP_SCAN_ACT_TANH ? 1.0f - yy : (y <= 0.0f ? 0.0f : 1.0f);
}

/* pr.nonfinite values of +inf, -inf or NaN at random elements of c (the
 * incoming gradient) or of one of the leaves' inputs (jt, w, u, and v or, with
 * an activation, y, v then recomputed as f'(y)). */
static void inject_nonfinite(emu_data &D)
{
    static const float values[] = {INFINITY, -INFINITY, NAN};
    rng64 r = {D.pr.nf_seed};
    fenced *leaves[] = {&D.jt, &D.w, &D.u, D.pr.act ? &D.y : &D.v};
    for (int k = 0; k < D.pr.nonfinite; k++) {
        fenced *dst = &D.c;
        if (rng_below(&r, 5) >= 2) { /* 3 in 5: a leaf's input */
            const int first = (int)rng_below(&r, 4);
            for (int l = 0; l < 4 && dst == &D.c; l++)
                if (leaves[(first + l) % 4]->n > 0)
                    dst = leaves[(first + l) % 4];
        }
        const int64_t i = (int64_t)rng_below(&r, (uint64_t)dst->n);
        dst->p()[i] = pick(&r, values);
        if (dst == &D.y)
            D.v.p()[i] = derivative(D.pr.act, D.y.p()[i]);
    }
}

static void make_data(const emu_problem &pr, emu_data &D)
{
    const int64_t n = pr.n, B = pr.B, H = pr.H, G = pr.G;
    D.pr = pr;
    D.c.init(n * B * H, 0.0f);
    for (int64_t i = 0; i < n * B * H; i++)
        D.c.p()[i] = urand(-1.0f, 1.0f);
    if (G == 0) {
        const float s = 1.2f / sqrtf((float)H);
        D.jt.init(n * B * H * H, 0.0f);
        for (int64_t i = 0; i < n * B * H * H; i++)
            D.jt.p()[i] = urand(-s, s);
        D.w.init(0, 0.0f);
        D.u.init(0, 0.0f);
        D.v.init(0, 0.0f);
        D.y.init(0, 0.0f);
    } else {
        const float s = 0.5f / sqrtf((float)(H * G));
        D.w.init(G * H * H, 0.0f);
        for (int64_t i = 0; i < G * H * H; i++)
            D.w.p()[i] = urand(-s, s);
        D.v.init(n * B * G * H, 0.0f);
        for (int64_t i = 0; i < n * B * G * H; i++)
            D.v.p()[i] = urand(-1.0f, 1.0f);
        /* y with zeros of both signs, and for relu NaNs (slope 1); v = f'(y) */
        D.y.init(pr.act ? n * B * G * H : 0, 0.0f);
        for (int64_t i = 0; i < D.y.n; i++) {
            const float y = pr.act == RP_SCAN_ACT_TANH ? tanhf(urand(-2.0f, 2.0f))
                            : i % 11 == 9                 ? NAN
                                                          : urand(-1.0f, 1.0f);
            D.y.p()[i] = i % 7 == 3 ? 0.0f : (i % 7 == 5 ? -0.0f : y);
            D.v.p()[i] = derivative(pr.act, D.y.p()[i]);
        }
        D.u.init(pr.has_u ? n * B * H : 0, 0.0f);
        for (int64_t i = 0; i < (pr.has_u ? n * B * H : 0); i++)
            D.u.p()[i] = urand(-0.4f, 0.4f);
        D.jt.init(0, 0.0f);
    }
    inject_nonfinite(D);
}

/* The problem's Jacobians; `implied`: v as f'(y) where the problem has y. */
static rp_scan_jacobians jacobians_of(emu_data &D, bool implied = false)
{
    rp_scan_jacobians j;
    memset(&j, 0, sizeof j);
    j.n = D.pr.n;
    j.batch = D.pr.B;
    j.dim = D.pr.H;
    j.gates = D.pr.G;
    j.pre_activation = D.pr.pre;
    if (D.pr.G > 0) {
        j.w = D.w.p();
        j.u = D.pr.has_u ? D.u.p() : NULL;
        if (implied && D.pr.act) {
            j.act = D.pr.act;
            j.y = D.y.p();
        } else {
            j.v = D.v.p();
        }
    } else {
        j.jt = D.jt.p();
    }
    return j;
}

/* g[n-1] = c[n-1], g[t] = c[t] + J[t+1]^T g[t+1], in double; v g with pre_activation. */
static void reference(emu_data &D, std::vector<double> &g)
{
    const int64_t n = D.pr.n, B = D.pr.B, H = D.pr.H, G = D.pr.G;
    const float *c = D.c.p();
    g.assign((size_t)(n * B * H), 0.0);
    for (int64_t b = 0; b < B; b++) {
        for (int64_t i = 0; i < H; i++)
            g[(size_t)(((n - 1) * B + b) * H + i)] = c[((n - 1) * B + b) * H + i];
        for (int64_t t = n - 2; t >= 0; t--) {
            const int64_t tb = (t + 1) * B + b;
            const double *gn = &g[(size_t)(((t + 1) * B + b) * H)];
            for (int64_t i = 0; i < H; i++) {
                double s = c[(t * B + b) * H + i];
                for (int64_t m = 0; m < H; m++) {
                    double M;
                    if (G == 0) {
                        M = D.jt.p()[(tb * H + i) * H + m];
                    } else {
                        M = (D.pr.has_u && i == m) ? D.u.p()[tb * H + i] : 0.0;
                        for (int64_t k = 0; k < G; k++)
                            M += (double)D.w.p()[(k * H + m) * H + i] *
                                 (double)D.v.p()[tb * G * H + k * H + m];
                    }
                    s += M * gn[m];
                }
                g[(size_t)((t * B + b) * H + i)] = s;
            }
        }
    }
    if (D.pr.pre)
        for (int64_t e = 0; e < n * B * H; e++)
            g[(size_t)e] *= D.v.p()[e];
}

/* A read-only copy of n floats that ends where an inaccessible page begins
 * (`head`: that starts where one ends): a kernel reading past the end (before
 * the start) of an input crashes (the canaries of `fenced` catch writes
 * only), as does a write to it. p is NULL for a NULL source. */
struct page_guarded {
    char *map = NULL;
    size_t len = 0;
    float *p = NULL;
    page_guarded(const float *src, int64_t n, bool head)
    {
        if (src == NULL)
            return;
        const size_t page = (size_t)sysconf(_SC_PAGESIZE), bytes = (size_t)n * sizeof(float);
        const size_t data = (bytes + page - 1) / page * page;
        len = data + page;
        void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        CHECK(m != MAP_FAILED, "mmap of %zu bytes", len);
        if (m == MAP_FAILED)
            return;
        map = (char *)m;
        char *const first = head ? map + page : map, *const fence = head ? map : map + data;
        p = (float *)(head ? first : first + data - bytes);
        memcpy(p, src, bytes);
        CHECK(mprotect(first, data, PROT_READ) == 0 && mprotect(fence, page, PROT_NONE) == 0,
              "mprotect");
    }
    ~page_guarded()
    {
        if (map != NULL)
            munmap(map, len);
    }
    page_guarded(const page_guarded &) = delete;
    page_guarded &operator=(const page_guarded &) = delete;
};

static bool same_bits(const float *a, const float *b, int64_t n)
{
    return memcmp(a, b, (size_t)n * sizeof(float)) == 0;
}

/* Bitwise equal, but any NaN equals any NaN (with inf or NaN inputs the NaN
 * that survives a sum, and the sign x86 gives inf * 0, follow the order of
 * the operations, which the launch configuration changes). */
static bool same_bits_or_nan(const float *a, const float *b, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (!(isnan(a[i]) && isnan(b[i])) && memcmp(&a[i], &b[i], 4) != 0)
            return false;
    return true;
}

/* How many of the n floats at p still hold the bits `fill`. */
static int64_t count_bits(const float *p, int64_t n, uint32_t fill)
{
    int64_t left = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, &p[i], 4);
        left += bits == fill;
    }
    return left;
}

/* ---------------------------------------------------------------------------
 * One case: every levels, in place and not, blocks forward and reversed
 * ------------------------------------------------------------------------- */

static double g_max_err, g_max_err_cpu;

/* d, the result of j with pre_activation, must be bitwise v times the g of
 * the same scan without it. */
static void check_pre_activation(const rp_scan_jacobians &j, emu_data &D, int L, const float *d)
{
    const int64_t total = j.n * j.batch * j.dim;
    rp_scan_jacobians plain = j;
    fenced g, work;
    rp_error err;
    plain.pre_activation = 0;
    g.init(total, 0.0f);
    work.init(work_floats(j.n, j.batch, j.dim, L), 0.0f);
    g_rt.launches = 0;
    expect_call(L, g_expect.mode, work.p(), j.n, j.batch, j.dim);
    CHECK(rp_cuda_scan(&plain, D.c.p(), g.p(), L, work.p(), (void *)g_emu.stream, &err) == RP_OK,
          "without pre_activation: %s", err.msg);
    for (int64_t i = 0; i < total; i++)
        g.p()[i] = D.v.p()[i] * g.p()[i];
    CHECK(D.pr.nonfinite ? same_bits_or_nan(g.p(), d, total) : same_bits(g.p(), d, total),
          "pre_activation differs from v * g");
}

/* With inf or NaN inputs the reference is csrc/scan.c's (its linear scan's:
 * the recurrence in double would turn relu's select into 0 * inf = NaN): at
 * every element NaN where it is NaN, the same inf where it is inf, and within
 * the usual rounding bound of it where it is finite. */
static void check_nonfinite(const float *g, const float *ref, int64_t n, int64_t B, int64_t H)
{
    const int64_t total = n * B * H;
    double scale = 1.0;
    for (int64_t i = 0; i < total; i++)
        if (isfinite(ref[i]))
            scale = fmax(scale, fabs((double)ref[i]));
    const double tol = 2e-5 * scale * (1.0 + 0.05 * (double)n * sqrt((double)H) / 8.0);
    for (int64_t i = 0; i < total; i++) {
        const bool ok = isnan(ref[i]) ? isnan(g[i])
                        : isinf(ref[i]) ? g[i] == ref[i]
                                        : fabs((double)g[i] - (double)ref[i]) <= tol;
        CHECK(ok, "inf/NaN inputs: g = %g vs rp_scan_cpu's %g at (t=%lld, b=%lld, i=%lld)",
              (double)g[i], (double)ref[i], (long long)(i / (B * H)), (long long)(i / H % B),
              (long long)(i % H));
        if (!ok)
            return;
    }
}

static void run_case(const emu_problem &pr, int device, bool both_orders)
{
    emu_data D;
    std::vector<double> ref;
    make_data(pr, D);
    reference(D, ref);
    const int64_t n = pr.n, B = pr.B, H = pr.H, total = n * B * H;
    const int maxL = rp_scan_max_levels(n);
    emu_data saved = D;
    double scale = 1.0;
    for (int64_t i = 0; i < total; i++)
        scale = fmax(scale, fabs(ref[(size_t)i]));
    /* with inf or NaN inputs: rp_scan_cpu's results, v given and (where the
     * problem has y) v as f'(y), which differ (relu's select is not 0 * x) */
    std::vector<float> nf_ref[2];
    for (int implied = 0; pr.nonfinite && implied < 2; implied++) {
        const rp_scan_jacobians jc = jacobians_of(D, implied != 0);
        rp_error e;
        nf_ref[implied].resize((size_t)total);
        CHECK(rp_scan_cpu(&jc, D.c.p(), nf_ref[implied].data(), 0, NULL, 1, &e) == RP_OK,
              "rp_scan_cpu: %s", e.msg);
    }

    for (int L = 0; L <= maxL; L++) {
        const int64_t wf = rp_scan_workspace_floats(n, B, H, L);
        std::vector<float> first; /* the forward-order result of this levels */
        std::vector<float> firsts[2]; /* inf or NaN inputs: the first with v given, as f'(y) */
        /* 0: forward, out of place; 1: in place, threads reversed; 2: the
         * device executor (the kernels themselves, threads as fibers); 3:
         * blocks reversed; 4: another shared-memory budget (other Q, T, S:
         * the results must not depend on the launch configuration); v as
         * f'(y) from 1 on */
        const int save_budget = g_smem_default;
        for (int variant = 0; variant < (both_orders ? 5 : 3); variant++) {
            /* in place at L = 0 alone: with levels the redo reads c (error_cases) */
            const bool inplace = variant == 1 && L == 0, fibers = variant == 2, reverse = variant == 3;
            g_smem_default = variant == 4 ? (save_budget == 12288 ? 49152 : 12288) : save_budget;
            rp_scan_jacobians j = jacobians_of(D, variant > 0);
            fenced work, gsep, cin;
            rp_error err;
            err.msg[0] = '\0';
            float nanv;
            uint32_t nb = 0x7fa00000;
            memcpy(&nanv, &nb, 4);
            work.init(work_floats(n, B, H, L), nanv);
            gsep.init(total, nanv);
            cin = D.c; /* the call's c (and g when in place) */
            float *g = inplace ? cin.p() : gsep.p();
            /* variant 0: c and the leaves read-only, each ending at an
             * inaccessible page, so that a read past the end of one crashes;
             * variant 2: each starting after one, for a read before the start */
            const bool guarded = variant == 0 || variant == 2, head = variant == 2;
            page_guarded gw(guarded ? j.w : NULL, D.w.n, head), gu(guarded ? j.u : NULL, D.u.n, head),
                gv(guarded ? j.v : NULL, D.v.n, head), gjt(guarded ? j.jt : NULL, D.jt.n, head),
                gy(guarded ? j.y : NULL, D.y.n, head), gc(guarded ? D.c.p() : NULL, total, head);
            if (guarded) {
                j.w = gw.p, j.u = gu.p, j.v = gv.p, j.jt = gjt.p, j.y = gy.p;
            }
            snprintf(g_context, sizeof g_context,
                     "n=%lld B=%lld H=%lld G=%d u=%d act=%d%s pre=%d levels=%d %s%s%s smem=%d "
                     "inf/NaN inputs %d (seed %llu)",
                     (long long)n, (long long)B, (long long)H, pr.G, (int)pr.has_u, pr.act,
                     j.act ? " (f'(y))" : "", (int)pr.pre, L, inplace ? "in place" : "out of place",
                     reverse ? " reversed" : "", fibers ? " device executor" : "", g_smem_default,
                     pr.nonfinite, (unsigned long long)pr.nf_seed);
            g_emu.stream = emu_stream(device);
            g_emu.stream_device = device;
            g_emu.current_device = (device + 1) % EMU_DEVICES;
            g_rt.launches = 0;
            g_rt.reverse_blocks = reverse;
            g_rt.reverse_threads = inplace;
            g_rt.device_executor = fibers;
            g_rt.attr.clear();
            expect_call(L, pr.G > 0 ? RP_SCAN_STRUCT : RP_SCAN_DENSE, work.p(), n, B, H);
            const int rc = rp_cuda_scan(&j, guarded ? gc.p : cin.p(), g, L, work.p(),
                                        (void *)g_emu.stream, &err);
            g_stats.cases++;
            CHECK(rc == RP_OK, "status %d: %s", rc, err.msg);
            CHECK(g_rt.launches == 2 * L + 1 + (L > 0), "%d launches for %d levels", g_rt.launches, L);
            /* the flag: set where a result of the levels was not finite (the
             * redo ran), which finite inputs never give here */
            const int redone = L > 0 ? *g_expect.redo : 0;
            CHECK(redone == 0 || redone == 1, "flag %d", redone);
            CHECK(redone == 0 || pr.nonfinite, "finite inputs redone by the linear scan");
            CHECK(g_emu.current_device == (device + 1) % EMU_DEVICES,
                  "current device %d after the call, was %d", g_emu.current_device,
                  (device + 1) % EMU_DEVICES);
            CHECK(work.intact() && gsep.intact() && cin.intact() && D.w.intact() && D.u.intact() &&
                      D.v.intact() && D.jt.intact() && D.y.intact(),
                  "a canary was overwritten");
            CHECK(same_bits(D.w.p(), saved.w.p(), D.w.n) && same_bits(D.u.p(), saved.u.p(), D.u.n) &&
                      same_bits(D.v.p(), saved.v.p(), D.v.n) &&
                      same_bits(D.jt.p(), saved.jt.p(), D.jt.n) && same_bits(D.y.p(), saved.y.p(), D.y.n),
                  "the leaves were modified");
            if (!inplace)
                CHECK(same_bits(cin.p(), saved.c.p(), total), "c was modified");
            /* every product the workspace holds is written (the vectors' even
             * slots < n are not: on the device their c is c itself) */
            if (L > 0) {
                const int64_t vecs = (n + 1) * B * H, left = count_bits(work.p() + vecs, wf - vecs, nb);
                CHECK(left == 0, "%lld of the workspace's %lld product floats never written",
                      (long long)left, (long long)(wf - vecs));
            }
            if (pr.nonfinite) {
                const bool implied = variant > 0 && pr.act;
                if (variant == 0 && pr.pre)
                    check_pre_activation(j, D, L, g); /* the same slots: the same redo */
                g_stats.nonfinite++;
                g_stats.fallbacks += redone;
                check_nonfinite(g, nf_ref[implied].data(), n, B, H);
                std::vector<float> &f = firsts[implied];
                if (f.empty())
                    f.assign(g, g + total);
                else
                    CHECK(same_bits_or_nan(f.data(), g, total),
                          "inf/NaN inputs: differs bitwise from the first run");
                g_smem_default = save_budget;
                if (g_failures)
                    return;
                continue;
            }
            double err_max = 0.0;
            int64_t worst = 0;
            for (int64_t i = 0; i < total; i++) {
                const double e = fabs((double)g[i] - ref[(size_t)i]);
                if (!(e <= err_max)) { /* NaN too */
                    err_max = isnan(e) ? INFINITY : e;
                    worst = i;
                }
            }
            CHECK(err_max <= 2e-5 * scale * (1.0 + 0.05 * (double)n * sqrt((double)H) / 8.0),
                  "max |g - reference| = %g at (t=%lld, b=%lld, i=%lld): %g vs %g (scale %g)",
                  err_max, (long long)(worst / (B * H)), (long long)(worst / H % B),
                  (long long)(worst % H), (double)g[worst], ref[(size_t)worst], scale);
            g_max_err = fmax(g_max_err, err_max / scale);
            if (variant == 0) {
                first.assign(g, g + total);
                /* relu's f'(y) g is torch's select, +0 where y <= 0, where
                 * this run's v * g has the zero of g's sign */
                for (int64_t i = 0; pr.pre && pr.act == RP_SCAN_ACT_RELU && i < total; i++)
                    first[(size_t)i] = D.y.p()[i] <= 0.0f ? 0.0f : first[(size_t)i];
                /* against the CPU scan of csrc/scan.c with the same levels */
                std::vector<float> gcpu((size_t)total), wcpu((size_t)(wf > 0 ? wf : 1));
                rp_error e2;
                const int rc2 = rp_scan_cpu(&j, D.c.p(), gcpu.data(), L, wcpu.data(), 1, &e2);
                CHECK(rc2 == RP_OK, "rp_scan_cpu: %s", e2.msg);
                double ec = 0.0;
                for (int64_t i = 0; i < total; i++)
                    ec = fmax(ec, fabs((double)gcpu[(size_t)i] - (double)g[i]));
                g_max_err_cpu = fmax(g_max_err_cpu, ec / scale);
                if (pr.pre)
                    check_pre_activation(j, D, L, g);
            } else {
                CHECK(same_bits(first.data(), g, total),
                      "differs bitwise from the forward, out-of-place run");
            }
            g_smem_default = save_budget;
            if (g_failures)
                return;
        }
    }
}

/* ---------------------------------------------------------------------------
 * Error paths
 * ------------------------------------------------------------------------- */

static void error_cases(void)
{
    emu_problem pr = {9, 2, 5, 1, false};
    emu_data D;
    make_data(pr, D);
    rp_scan_jacobians j = jacobians_of(D);
    fenced work, g;
    rp_error err;
    work.init(work_floats(9, 2, 5, rp_scan_max_levels(9)), 0.0f);
    g.init(9 * 2 * 5, 0.0f);
    g_emu.stream = emu_stream(1);
    g_emu.stream_device = 1;
    g_emu.current_device = 1;
    g_rt.attr.clear();
    g_rt.reverse_blocks = false;
    g_rt.reverse_threads = false;
    g_rt.device_executor = false;

    /* rp_scan_check's verdicts, nothing launched */
    {
        const int bad_levels[] = {-1, rp_scan_max_levels(9) + 1};
        for (int L : bad_levels) {
            snprintf(g_context, sizeof g_context, "error: levels %d", L);
            rp_error e1, e2;
            g_rt.launches = 0;
            const int rc = rp_cuda_scan(&j, D.c.p(), g.p(), L, work.p(), g_emu.stream, &e1);
            const int want = rp_scan_check(&j, D.c.p(), g.p(), L, work.p(), &e2);
            CHECK(rc == want && rc == RP_EINVAL && strcmp(e1.msg, e2.msg) == 0,
                  "status %d (%s), rp_scan_check %d (%s)", rc, e1.msg, want, e2.msg);
            CHECK(g_rt.launches == 0, "%d launches", g_rt.launches);
        }
        /* an unknown activation, y and v both, pre_activation with 3 gates */
        rp_scan_jacobians bad[3] = {j, j, j};
        bad[0].act = 7;
        bad[1].act = RP_SCAN_ACT_TANH, bad[1].y = D.v.p();
        bad[2].gates = 3, bad[2].pre_activation = 1;
        for (const rp_scan_jacobians &jb : bad) {
            snprintf(g_context, sizeof g_context, "error: act %d, pre %d", jb.act, jb.pre_activation);
            rp_error e1, e2;
            g_rt.launches = 0;
            const int rc = rp_cuda_scan(&jb, D.c.p(), g.p(), 0, work.p(), g_emu.stream, &e1);
            const int want = rp_scan_check(&jb, D.c.p(), g.p(), 0, work.p(), &e2);
            CHECK(rc == want && rc == RP_EINVAL && strcmp(e1.msg, e2.msg) == 0,
                  "status %d (%s), rp_scan_check %d (%s)", rc, e1.msg, want, e2.msg);
            CHECK(g_rt.launches == 0, "%d launches", g_rt.launches);
        }
        snprintf(g_context, sizeof g_context, "error: NULL jacobians");
        g_rt.launches = 0;
        CHECK(rp_cuda_scan(NULL, D.c.p(), g.p(), 0, work.p(), g_emu.stream, &err) == RP_EINVAL,
              "accepted NULL jacobians");
        CHECK(g_rt.launches == 0, "%d launches", g_rt.launches);
    }
    /* batch 0: nothing to do */
    {
        snprintf(g_context, sizeof g_context, "error: batch 0");
        rp_scan_jacobians j0 = j;
        j0.batch = 0;
        g_rt.launches = 0;
        const int rc = rp_cuda_scan(&j0, D.c.p(), g.p(), 1, NULL, g_emu.stream, &err);
        CHECK(rc == RP_OK && g_rt.launches == 0, "status %d, %d launches", rc, g_rt.launches);
    }
    /* in place with levels: refused (the redo reads c), nothing cleared or launched */
    {
        snprintf(g_context, sizeof g_context, "error: in place with levels");
        fenced cg = D.c;
        g_rt.launches = 0;
        expect_call(1, RP_SCAN_STRUCT, work.p(), 9, 2, 5);
        err.msg[0] = '\0';
        const int rc = rp_cuda_scan(&j, cg.p(), cg.p(), 1, work.p(), g_emu.stream, &err);
        CHECK(rc == RP_EINVAL && strstr(err.msg, "must not be c") != NULL, "status %d: %s", rc, err.msg);
        CHECK(g_rt.launches == 0 && g_expect.memsets == 0, "%d launches, %d memsets", g_rt.launches,
              g_expect.memsets);
    }
    /* faults: a refused launch, an error found by cudaGetLastError, no device */
    emu_check_faults(6, g_rt.launches, "CUDA error", [&](rp_error &e) {
        expect_call(2, RP_SCAN_STRUCT, work.p(), 9, 2, 5);
        return rp_cuda_scan(&j, D.c.p(), g.p(), 2, work.p(), g_emu.stream, &e);
    });
    /* a dimension whose one-task blocks need more shared memory than the device has */
    {
        snprintf(g_context, sizeof g_context, "error: shared memory");
        const int save = g_rt.optin, save_default = g_smem_default;
        g_smem_default = 1024;
        g_rt.optin = 1024;
        emu_problem p2 = {4, 1, 200, 1, false};
        emu_data D2;
        make_data(p2, D2);
        rp_scan_jacobians j2 = jacobians_of(D2);
        fenced w2, g2;
        w2.init(work_floats(4, 1, 200, 1), 0.0f);
        g2.init(4 * 200, 0.0f);
        g_rt.launches = 0;
        err.msg[0] = '\0';
        const int rc = rp_cuda_scan(&j2, D2.c.p(), g2.p(), 1, w2.p(), g_emu.stream, &err);
        CHECK(rc == RP_EINVAL && strstr(err.msg, "shared memory") != NULL, "status %d: %s", rc,
              err.msg);
        CHECK(g_rt.launches == 0, "%d launches", g_rt.launches);
        g_rt.optin = save;
        g_smem_default = save_default;
    }
    /* H = 64, levels = 1 under a 12 KB default: the linear scan fits, the
     * one-task up-sweep block (33296 bytes) needs the opt-in. A device
     * allowing 20 KB: RP_EINVAL, nothing set or launched. A device whose
     * attribute query or opt-in fails: RP_ERUNTIME, the error cleared. */
    {
        const int save = g_rt.optin, save_default = g_smem_default;
        emu_problem p3 = {4, 1, 64, 0, false};
        emu_data D3;
        make_data(p3, D3);
        rp_scan_jacobians j3 = jacobians_of(D3);
        fenced w3, g3;
        w3.init(work_floats(4, 1, 64, 1), 0.0f);
        g3.init(4 * 64, 0.0f);
        g_smem_default = 12288;
        const struct {
            const char *what;
            int optin, fault, status;
            const char *text;
        } opt[] = {{"up-sweep past the opt-in", 20480, 0, RP_EINVAL, "shared memory"},
                   {"opt-in query fails", 232448, 1, RP_ERUNTIME,
                    "CUDA error in rp_cuda_shared_memory_per_block"},
                   {"opt-in refused", 232448, 2, RP_ERUNTIME, "CUDA error in rp_cuda_scan"}};
        for (const auto &o : opt) {
            snprintf(g_context, sizeof g_context, "error: H=64 levels=1, %s", o.what);
            g_rt.optin = o.optin;
            g_rt.attr_fault = o.fault;
            g_rt.attr.clear();
            g_rt.launches = 0;
            expect_call(1, RP_SCAN_DENSE, w3.p(), 4, 1, 64);
            g_emu.current_device = 0;
            g_emu.pending = cudaSuccess;
            err.msg[0] = '\0';
            const int rc = rp_cuda_scan(&j3, D3.c.p(), g3.p(), 1, w3.p(), g_emu.stream, &err);
            CHECK(rc == o.status && strstr(err.msg, o.text) != NULL, "status %d: %s", rc, err.msg);
            CHECK(g_rt.launches == 0, "%d launches", g_rt.launches);
            CHECK(g_rt.attr.empty(), "%zu opt-ins set", g_rt.attr.size());
            CHECK(g_emu.pending == cudaSuccess, "error left pending");
            CHECK(g_emu.current_device == 0, "device %d not restored", g_emu.current_device);
        }
        g_rt.attr_fault = 0;
        g_rt.optin = save;
        g_smem_default = save_default;
    }
}

/* ---------------------------------------------------------------------------
 * The grid of cases
 * ------------------------------------------------------------------------- */

/* inf or NaN inputs (inject_nonfinite): whole-task and row-panel up-sweeps,
 * dense and structured leaves, relu's select with pre_activation, under the
 * 48 KB budget; the random mode draws the rest. */
static void nonfinite_sweep(bool smoke, int device)
{
    const emu_problem kinds[] = {{0, 2, 0, 0, false, 0, false},
                                 {0, 2, 0, 1, true, 0, false},
                                 {0, 2, 0, 1, false, RP_SCAN_ACT_RELU, true},
                                 {0, 1, 0, 3, true, RP_SCAN_ACT_TANH, false}};
    const int64_t hs[] = {5, 20, 70}, ns[] = {1, 2, 3, 5, 8, 9, 17};
    uint64_t seed = 1;
    for (const emu_problem &k : kinds)
        for (int64_t H : hs)
            for (int64_t n : ns) {
                if ((smoke && n > 9) || (H > 64 && n > 9))
                    continue;
                emu_problem pr = k;
                pr.n = n, pr.H = H, pr.nonfinite = 1 + (int)(seed % 3), pr.nf_seed = seed++;
                run_case(pr, device, n <= 5);
                device = (device + 1) % EMU_DEVICES;
                if (g_failures)
                    return;
            }
}

/* A default budget 4 bytes under what a one-task block of the levels needs
 * (rp_cuda_scan_shared_bytes): the launcher must take the opt-in even for a
 * need that small a step past the default. */
/* Finite inputs whose up-sweep products overflow: J^T = diag(100, 0.5) at every
 * step (dense, and structured as w = diag(100, 0.5) with v = 1) and a
 * gradient only in the second component at the end. g[t] = (0, 0.5^(n-1-t))
 * exactly, but the products of 2^(d+1) leaves pass float32's range from
 * level 4 on, and the down-sweep's inf * 0 made NaN of them: every levels
 * must give the exact g, those that overflow through the linear redo. */
static void overflow_sweep(int device)
{
    const int64_t n = 64, B = 2, H = 2, total = n * B * H;
    fenced jt, w, v, c, g, work;
    jt.init(n * B * H * H, 0.0f);
    for (int64_t tb = 0; tb < n * B; tb++)
        jt.p()[tb * H * H] = 100.0f, jt.p()[tb * H * H + 3] = 0.5f;
    w.init(H * H, 0.0f);
    w.p()[0] = 100.0f, w.p()[3] = 0.5f;
    v.init(n * B * H, 1.0f);
    c.init(total, 0.0f);
    for (int64_t b = 0; b < B; b++)
        c.p()[((n - 1) * B + b) * H + 1] = 1.0f;
    g_emu.stream = emu_stream(device);
    g_emu.stream_device = g_emu.current_device = device;
    g_rt.reverse_blocks = g_rt.reverse_threads = g_rt.device_executor = false;
    for (int G = 0; G <= 1; G++) {
        rp_scan_jacobians j;
        memset(&j, 0, sizeof j);
        j.n = n, j.batch = B, j.dim = H, j.gates = G;
        j.jt = G ? NULL : jt.p(), j.w = G ? w.p() : NULL, j.v = G ? v.p() : NULL;
        int redone = 0;
        for (int L = 0; L <= rp_scan_max_levels(n); L++) {
            snprintf(g_context, sizeof g_context, "overflow: %s leaves, levels %d", G ? "structured" : "dense", L);
            rp_error err;
            g.init(total, NAN);
            work.init(work_floats(n, B, H, L), NAN);
            g_rt.launches = 0;
            expect_call(L, G ? RP_SCAN_STRUCT : RP_SCAN_DENSE, work.p(), n, B, H);
            CHECK(rp_cuda_scan(&j, c.p(), g.p(), L, work.p(), g_emu.stream, &err) == RP_OK, "%s", err.msg);
            for (int64_t i = 0; i < total; i++) {
                const int64_t t = i / (B * H);
                const float want = i % H == 0 ? 0.0f : ldexpf(1.0f, -(int)(n - 1 - t));
                CHECK(same_bits(&g.p()[i], &want, 1), "g = %g at (t=%lld, i=%lld), want %g", (double)g.p()[i],
                      (long long)t, (long long)(i % H), (double)want);
                if (g_failures)
                    return;
            }
            redone += L > 0 ? *g_expect.redo : 0;
            CHECK(L < 5 || *g_expect.redo == 1, "not redone: %d", *g_expect.redo);
        }
        g_stats.fallbacks += redone;
    }
}

static void optin_edge_sweep(int device)
{
    const int64_t hs[] = {5, 20, 70};
    for (int64_t H : hs)
        for (int L = 0; L <= 1; L++) {
            g_smem_default = (int)rp_cuda_scan_shared_bytes(H, L) - 4;
            run_case({3, 2, H, 0, false, 0, false}, device, false);
            device = (device + 1) % EMU_DEVICES;
            if (g_failures)
                break;
        }
    g_smem_default = 49152;
}

static void sweep(bool quick, bool smoke)
{
    struct leafkind {
        int G;
        bool u;
        int act;
        bool pre;
    };
    const leafkind kinds[] = {{0, false, 0, false},
                              {1, false, 0, false},
                              {1, true, 0, false},
                              {3, true, 0, false},
                              {1, false, RP_SCAN_ACT_TANH, true},
                              {1, false, RP_SCAN_ACT_RELU, true},
                              {1, true, RP_SCAN_ACT_RELU, false},
                              {3, true, RP_SCAN_ACT_TANH, false}};
    const int budgets[] = {49152, 20480, 12288};
    int device = 0;

    for (int bi = 0; bi < 3; bi++) {
        g_smem_default = budgets[bi];
        g_rt.optin = 232448; /* an H100/H200's */
        for (const leafkind &lk : kinds) {
            /* v as f'(y) changes what the leaves read and g's stores, not the
             * tiling: the default budget (and each case's variant 3) suffices */
            if (lk.act && bi > 0)
                continue;
            /* small H: whole-task up-sweep blocks */
            const int small_h[] = {1, 3, 5, 8, 20, 33, 64};
            for (int H : small_h) {
                if (bi > 0 && H != 20 && H != 64 && H != 5)
                    continue;
                if (smoke && H != 5 && H != 20)
                    continue;
                for (int64_t n = 1; n <= 70; n++) {
                    const bool all_n = H <= 20 && bi == 0;
                    if (!all_n && !(n <= 17 || (n >= 31 && n <= 34) || n == 63 || n == 64 ||
                                    n == 65 || n == 70))
                        continue;
                    if (quick && n > 20 && n != 33 && n != 64)
                        continue;
                    if (smoke && n > 12)
                        continue;
                    if (H >= 33 && n > 34 && (quick || bi > 0))
                        continue;
                    const int64_t B = H >= 33 ? 1 : (n % 3 == 0 ? 1 : 3);
                    run_case({n, B, H, lk.G, lk.u, lk.act, lk.pre}, device, n <= 17);
                    device = (device + 1) % EMU_DEVICES;
                    if (g_failures)
                        return;
                }
            }
            /* large H: row panels */
            const int large_h[] = {65, 70, 100, 130, 180, 300, 400};
            for (int H : large_h) {
                if (H >= 180 && bi != 2)
                    continue; /* T of 4, 2, 1 appear under the 12 KB budget */
                if (smoke && H != 70 && H != 180)
                    continue;
                const int64_t ns[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17};
                for (int64_t n : ns) {
                    if (H >= 100 && n > 5)
                        continue;
                    if (quick && n > 5)
                        continue;
                    run_case({n, n <= 4 && H < 100 ? 2 : 1, H, lk.G, lk.u, lk.act, lk.pre}, device,
                             n <= 5);
                    device = (device + 1) % EMU_DEVICES;
                    if (g_failures)
                        return;
                }
            }
        }
    }
    g_smem_default = 49152;
    nonfinite_sweep(smoke, device);
    overflow_sweep(device);
    optin_edge_sweep(device);
}

/* ---------------------------------------------------------------------------
 * The random mode: problems the grid does not walk
 * ------------------------------------------------------------------------- */

/* Random case `index` of `seed`: a problem of any leaf kind, n up to 300 and
 * H up to 130 (their product bounded, for time), under a random
 * shared-memory budget and opt-in maximum, each of its levels run as
 * run_case runs them. */
static bool run_random_case(uint64_t seed, uint64_t index)
{
    static const int optins[] = {49152, 101376, 166912, 232448}; /* sm_86/89, sm_80, sm_90 */
    rng64 r = random_case_rng(seed, index);
    const int failures = g_failures;
    emu_problem pr;
    pr.H = 1 + (int64_t)rng_below(&r, rng_below(&r, 3) == 0 ? 130 : 40);
    pr.G = (int)rng_below(&r, 4);
    /* the dense leaves' n * B * H * H floats, the structured ones' reference
     * n * B * G * H * H products: a few million at most */
    const int64_t per_step = pr.H * pr.H * (pr.G > 0 ? pr.G : 1);
    const int64_t max_n = std::min<int64_t>(300, std::max<int64_t>(1, 1500000 / per_step));
    pr.n = 1 + (int64_t)rng_below(&r, rng_below(&r, 2) ? std::min<int64_t>(max_n, 40) : max_n);
    pr.B = 1 + (int64_t)rng_below(&r, pr.n * per_step < 200000 ? 4 : 1);
    pr.has_u = pr.G > 0 && rng_below(&r, 2);
    pr.act = pr.G > 0 ? (int)rng_below(&r, 3) : 0; /* 0, RP_SCAN_ACT_TANH or _RELU */
    pr.pre = pr.G == 1 && rng_below(&r, 3) == 0;
    g_smem_default = 12288 + 1024 * (int)rng_below(&r, 37); /* 12 to 48 KB */
    g_rt.optin = pick(&r, optins);
    g_rng = rng_next(&r) | 1u; /* make_data's values */
    /* 1 in 3: 1 to 3 inf or NaN inputs, drawn from a stream of their own, so
     * that the problems above are those the mode drew before it had them */
    rng64 nf = random_case_rng(seed ^ 0x6e6f6e66696e6974u, index);
    pr.nonfinite = rng_below(&nf, 3) == 0 ? 1 + (int)rng_below(&nf, 3) : 0;
    pr.nf_seed = rng_next(&nf);
    run_case(pr, (int)rng_below(&r, EMU_DEVICES), rng_below(&r, 2) != 0);
    if (g_failures != failures)
        printf("  random case %llu:%llu: smem budget %d, opt-in %d, %d inf or NaN inputs\n",
               (unsigned long long)seed, (unsigned long long)index, g_smem_default, g_rt.optin,
               pr.nonfinite);
    g_smem_default = 49152;
    g_rt.optin = 232448;
    return g_failures == failures;
}

int main(int argc, char **argv)
{
    const bool quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    const bool smoke = argc > 1 && strcmp(argv[1], "--smoke") == 0; /* seconds: for edits */
    const random_args random = parse_random_args(quick || smoke ? 1 : argc, argv);
    catch_fatal_signals();
    register_mode<RP_SCAN_PROD>();
    register_mode<RP_SCAN_DENSE>();
    register_mode<RP_SCAN_STRUCT>();
    g_rt.optin = 232448;

    if (random.count > 0) {
        run_random_cases(random, run_random_case);
        printf("scan_emulation: %s (%ld random cases' runs (%ld with inf or NaN inputs, %ld of "
               "those redone by the linear scan), %ld launches, %ld blocks (%ld as fibers), %ld "
               "opt-ins; max error %.2e vs double, %.2e vs rp_scan_cpu)\n",
               g_failures ? "FAILED" : "OK", g_stats.cases, g_stats.nonfinite, g_stats.fallbacks,
               g_stats.launches, g_stats.blocks, g_stats.device_blocks, g_stats.optins, g_max_err,
               g_max_err_cpu);
        return g_failures != 0;
    }
    sweep(quick || smoke, smoke);
    if (!g_failures)
        error_cases();

    /* the grid must have exercised every kernel and tile shape */
    if (!g_failures) {
        snprintf(g_context, sizeof g_context, "coverage");
        for (int k = 0; k < 4; k++)
            CHECK(g_stats.by_kind[k] > 0 && g_stats.device_by_kind[k] > 0,
                  "kernel kind %d never launched (%ld), or not by the device executor (%ld)", k,
                  g_stats.by_kind[k], g_stats.device_by_kind[k]);
        for (int s = 0; s <= 6; s++)
            CHECK(smoke || g_stats.tiles[s] > 0, "large up-sweep with %d-row panels never launched", 1 << s);
        CHECK(smoke || g_stats.optins > 0, "the shared-memory opt-in never exercised");
    }

    if (g_failures) {
        printf("scan_emulation: FAILED (%d failures; %ld cases, %ld launches)\n", g_failures,
               g_stats.cases, g_stats.launches);
        return 1;
    }
    printf("scan_emulation: OK (%ld cases, %ld launches, %ld blocks (%ld as fibers), %ld opt-ins; max "
           "error %.2e vs double, %.2e vs rp_scan_cpu, relative to max |g|)\n",
           g_stats.cases, g_stats.launches, g_stats.blocks, g_stats.device_blocks, g_stats.optins,
           g_max_err, g_max_err_cpu);
    return 0;
}
