/*
 * scan.cu: BPPSA, backprop through a chain as a parallel scan, on CUDA.
 *
 * The scan of reprop.h ("BPPSA"): slots k = 0..n, a[0] = c[n-1] (a vector),
 * a[k] = (J[n-k]^T, c[n-1-k]) (affine maps x -> M x + c), a[n] spare; slot s
 * ends with g[n-s]. `levels` = L up-sweep levels, a linear scan over the
 * blocks of 2^L slots that remain, then the L down-sweep levels, each
 * parallel over its pairs and the batch:
 *
 *   launch                    grid over          per task (one pair, one sequence)
 *   up-sweep level d          (pair, sequence)   a[r] = a[l] <> a[r]: the H x H product
 *                                                 M_r M_l and the vector M_r c_l + c_r
 *                                                 (a mat-vec only on the left spine)
 *   linear scan (middle)      sequence           P_j = M P_{j-1} + c over the blocks,
 *                                                 one block per sequence, a barrier a step
 *   down-sweep level d        (pair, sequence)   mat-vec: a[r] = M_l a[r] + c_l, a[l] = old a[r]
 *
 * so a scan is 2L + 1 launches (L = 0: the one linear-scan launch). Level 0
 * of the up-sweep (and the linear scan when L = 0) reads c directly, level 0
 * of the down-sweep (the linear scan when L = 0) writes g directly, so there
 * are no copy kernels. At L = 0 g may alias c (every element of c is read
 * before the element of g at its address is written, by the same block).
 *
 * With L > 0 the up-sweep's products of 2^d Jacobians can overflow where the
 * linear scan's vectors do not, and the down-sweep makes inf * 0 = NaN of
 * them; rp_scan_cpu then redoes the scan linearly from c. So does this one,
 * without the host waiting for the result: the call clears a flag (one int
 * past the workspace's floats, a memset), down-sweep level 0 sets it where a
 * result is not finite, and a last launch, the linear scan from c into g,
 * returns at once unless it is set: 2L + 2 launches, capturable in a CUDA
 * graph. c must then be apart from g (the redo reads it).
 *
 * Leaves J[t]^T are never materialized: element (i, m) is jt[t][i][m]
 * (dense) or u[t][i] [i == m] + sum_k w[(kH + m) H + i] v[t][kH + m]
 * (structured), computed where an operand is staged or a mat-vec reads it;
 * v is read from v or, with an activation, computed from y the same way
 * (rp_scan_v; relu's v x is a select, rp_scan_vx). With pre_activation every
 * store into g is v[t] g[t] (rp_scan_put): g itself is never written, nor
 * read back.
 *
 * Workspace (float32), rp_scan_workspace_floats(n, B, H, levels): none when
 * levels = 0 (the one linear-scan launch reads c and writes g), else
 *   vec  (n + 1, B, H)      the vector (c part) of every odd slot < n and the
 *                           prefixes of the middle and the down-sweep (even
 *                           slots < n never live here: their c is c itself)
 *   prod (n / 2 - 1, B, H, H)  the matrix of odd slot s, 3 <= s < n, at
 *                           rp_scan_prod_index(s) (slot 1's pair is on the
 *                           spine: a mat-vec, no product)
 * The up-sweep writes each product over its right operand: a task's rows are
 * read only by the block that writes them, and that block stages them in
 * shared memory before its first store.
 *
 * Kernels (dynamic shared memory, within the default 48 KB for H < 5117;
 * beyond, the launcher opts in to the device's maximum):
 *   up-sweep, H <= 64:   Q whole tasks per block, both operands staged in
 *                        shared memory (leaves computed on the fly while
 *                        staging), Q (2 H Hp + 2 Hp) floats + a 16-byte task
 *                        entry each, Hp = H rounded up to 4, Q ~ 256 / (Hp/4)^2
 *                        (H = 20: 10 tasks, 250 threads, 33 KB; H = 64: 1
 *                        task, 256 threads, 33 KB); each thread computes 4 x 4
 *                        output micro-tiles from float4 shared reads.
 *   up-sweep, H > 64:    one block per (task, panel of T rows): the T x H
 *                        rows of M_r staged, then 64-column tiles of the
 *                        product over 32-deep staged chunks of M_l; thread
 *                        micro-tiles of TM x 4 (TM = 4, 2, 1 for T = 64, 32,
 *                        <= 16), T / TM * 16 threads (256 for T >= 16). T = 64
 *                        for H <= 155, 32 to 309, 16 to 601, 8 to 1136, 4 to
 *                        2047, 2 to 3411, 1 beyond (H = 128: 41 KB).
 *   down-sweep:          Q tasks per block (~256 threads), S lanes per row of
 *                        M (~8 elements each, S <= 32, summed by warp
 *                        shuffles), one lane per row on structured leaves;
 *                        the prefix and c_l of each task staged (Q (2 Hp)
 *                        floats + 16 bytes).
 *   linear scan:         one block per sequence (S lanes per row, ~4
 *                        elements each, up to 1024 threads), P double-buffered
 *                        in shared memory, one barrier per step; w staged in
 *                        shared memory when it fits (L = 0, structured).
 * Every output is written once by one thread: deterministic, no atomics.
 * Arithmetic is float32 with explicit fmaf and, for 1 - y*y, __fmul_rn (so
 * --fmad=false does not matter here); each output's order of operations depends on `levels` and H only
 * (not on the launch configuration).
 *
 * Each kernel's work is a __host__ __device__ function of (executor, args,
 * block) written as phases (x.each(lambda of the thread index)) separated by
 * the executor's barriers (x.sync()), so that kernels/tests/scan_emulation.cu
 * runs the very same code on the host, every thread of every block, against
 * the recurrence. Rules that keep that honest: per-thread state that crosses
 * a barrier lives in an executor-provided `local`; a phase's lambda captures
 * loop counters by value (the emulation runs phases late, at the next barrier).
 * The emulation also runs the kernels themselves, with this file's device
 * executor (rp_scan_dev), each thread a fiber (see rp_scan_dev).
 *
 * Layout: executor and helpers, the task bodies, the kernels, the launcher;
 * then the sparse scan's program runner (rp_cuda_csr_run), and at the end
 * its cuSPARSE peer (rp_cuda_cusparse_*, built with RP_HAVE_CUSPARSE).
 */
#include <cuda_runtime.h>

#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "reprop.h"
#include "rp_internal.h"
#include "rp_cuda.cuh"

#define RP_HD __host__ __device__ __forceinline__
#ifdef __CUDA_ARCH__ /* the bodies are host code too (the emulation test) */
#define RP_SCAN_UNROLL _Pragma("unroll")
#else
#define RP_SCAN_UNROLL
#endif

#define RP_SCAN_THREADS 256     /* up- and down-sweep blocks, at most */
#define RP_SCAN_MID_THREADS 1024 /* linear-scan blocks, at most */
#define RP_SCAN_SMALL_H 64      /* up to this H, up-sweep blocks hold whole tasks */
#define RP_SCAN_BN 64           /* large up-sweep: columns per output tile */
#define RP_SCAN_BK 32           /* large up-sweep: depth of a staged chunk of M_l */
#define RP_SCAN_MAX_Q 64        /* tasks per block, at most */
#ifndef RP_SCAN_MAX_GRID /* overridable (smaller) by the emulation test */
#define RP_SCAN_MAX_GRID (1 << 20) /* blocks per launch; more work loops */
#endif
#ifndef RP_SCAN_SMEM_DEFAULT /* overridable by the emulation test */
#define RP_SCAN_SMEM_DEFAULT 49152 /* dynamic shared memory without an opt-in */
#endif

enum { RP_SCAN_PROD = 0, RP_SCAN_DENSE = 1, RP_SCAN_STRUCT = 2 };

/* ---------------------------------------------------------------------------
 * Executor and helpers
 * ------------------------------------------------------------------------- */

/* One thread of a block on the device. each(f) runs this thread's share of a
 * phase, sync() is the barrier, local<T> a register variable, group_sum sums
 * `x` over aligned groups of S lanes (S a power of two <= 32, every lane gets
 * the sum; called by every thread of the block). The barrier and the shuffle
 * are the device's; on the host they exist only where RP_SCAN_HOST_THREADS
 * is defined: kernels/tests/scan_host_copy.h compiles this file a second
 * time as host code, with __syncthreads and __shfl_xor_sync its emulation's,
 * whose threads are fibers, so that the kernels themselves run there. */
#if defined(__CUDA_ARCH__) || defined(RP_SCAN_HOST_THREADS)
#define RP_SCAN_BARRIERS 1
#endif
struct rp_scan_dev {
    template <class T> struct local {
        T v;
        RP_HD T &operator()(int) { return v; }
    };
    int tid, nt;
    template <class F> RP_HD void each(F &&f) { f(tid); }
    RP_HD void sync()
    {
#ifdef RP_SCAN_BARRIERS
        __syncthreads();
#endif
    }
    RP_HD void group_sum(local<float> &x, int S)
    {
#ifdef RP_SCAN_BARRIERS
        for (int o = S >> 1; o > 0; o >>= 1)
            x.v += __shfl_xor_sync(0xffffffffu, x.v, o);
#else
        (void)x; /* never run on the host but by the emulation's fibers */
        (void)S;
#endif
    }
};
#undef RP_SCAN_BARRIERS

/* Everything a kernel needs, passed by value. */
typedef struct {
    const float *w, *u, *v, *jt; /* the leaves (rp_scan_jacobians) */
    const float *y;              /* with act: v = f'(y) */
    int act;                     /* rp_scan_act */
    int pre;                     /* pre_activation: g gets v * g */
    const float *c;              /* (n, B, H) */
    float *g;                    /* (n, B, H), may alias c */
    float *vec;                  /* (n + 1, B, H) */
    float *prod;                 /* (n / 2 - 1, B, H, H) */
    int64_t n, B, H;
    int G;
    int d;          /* up/down: the level (0: leaves and c/g) */
    int q;          /* up (small), down: tasks per block */
    int tile;       /* up (large): rows per block */
    int S;          /* down, middle: lanes per row */
    int stage_w;    /* middle: w staged in shared memory */
    int64_t npairs; /* up/down: pairs of the level */
    int64_t ntasks; /* up/down: tasks (down level 0: pairs x B, then B tail copies) */
    int64_t nunits; /* block-sized work items */
    int64_t span;   /* middle: 2^levels */
    int64_t nb;     /* middle: number of blocks of slots */
    int *nonfinite; /* down level 0 with levels: set to 1 where a result is not finite */
    const int *redo_if; /* the linear redo: runs only where *redo_if is 1, else returns */
} rp_scan_args;

RP_HD int rp_scan_pad4(int64_t x) { return (int)((x + 3) & ~(int64_t)3); }

RP_HD float rp_scan_ldg(const float *p)
{
#ifdef __CUDA_ARCH__
    return __ldg(p);
#else
    return *p;
#endif
}

RP_HD float4 rp_scan_ld4(const float *p) /* p 16-byte aligned (shared memory) */
{
#ifdef __CUDA_ARCH__
    return *reinterpret_cast<const float4 *>(p);
#else
    return make_float4(p[0], p[1], p[2], p[3]);
#endif
}

/* y * y rounded on its own, never fused into what follows: __fmul_rn on
 * the device, a plain product on the host (which has no fused multiply-add
 * unless asked), so that the emulation runs rp_scan_v's formula itself. */
RP_HD float rp_scan_sq(float y)
{
#ifdef __CUDA_ARCH__
    return __fmul_rn(y, y);
#else
    return y * y;
#endif
}

/* Element idx of the structured leaves' v, (n, B, G H): v itself, or f'(y)
 * with the float32 operations of torch's 1 - y * y (the product rounded
 * first) and torch's relu slope (0 where y <= 0, else 1, so 1 at a NaN y),
 * as csrc/scan.c. */
RP_HD float rp_scan_v(const rp_scan_args &a, int64_t idx)
{
    if (a.act == RP_SCAN_ACT_NONE)
        return rp_scan_ldg(a.v + idx);
    const float y = rp_scan_ldg(a.y + idx);
    if (a.act == RP_SCAN_ACT_RELU)
        return y <= 0.0f ? 0.0f : 1.0f;
    return 1.0f - rp_scan_sq(y);
}

/* v[idx] applied to x: v x, but relu as torch's threshold_backward applies
 * it, a select (0 where y <= 0 even for an inf or NaN x, x elsewhere), as
 * csrc/scan.c's rp_scale_row. */
RP_HD float rp_scan_vx(const rp_scan_args &a, int64_t idx, float x)
{
    if (a.act == RP_SCAN_ACT_RELU)
        return rp_scan_ldg(a.y + idx) <= 0.0f ? 0.0f : x;
    return rp_scan_v(a, idx) * x;
}

/* Element (i, m) of the leaf J[t]^T of sequence b, tb = t * B + b; w_ may be
 * a shared-memory copy of w. */
template <int MODE>
RP_HD float rp_scan_leaf(const rp_scan_args &a, const float *w_, int64_t tb, int64_t i, int64_t m)
{
    const int64_t H = a.H;
    if constexpr (MODE == RP_SCAN_DENSE) {
        (void)w_;
        return rp_scan_ldg(a.jt + (tb * H + i) * H + m);
    } else {
        const int64_t vt = tb * a.G * H + m;
        float s = (a.u != NULL && i == m) ? rp_scan_ldg(a.u + tb * H + i) : 0.0f;
        for (int k = 0; k < a.G; k++)
            s = fmaf(w_[((int64_t)k * H + m) * H + i], rp_scan_v(a, vt + (int64_t)k * H), s);
        return s;
    }
}

/* sum_m M[i][m] x[m] over m = lane, lane + S, ... for the leaf of tb. */
template <int MODE>
RP_HD float rp_scan_leaf_dot(const rp_scan_args &a, const float *w_, int64_t tb, int64_t i,
                             const float *x, int lane, int S)
{
    const int64_t H = a.H;
    float s = 0.0f;
    if constexpr (MODE == RP_SCAN_DENSE) {
        (void)w_;
        const float *row = a.jt + (tb * H + i) * H;
        for (int64_t m = lane; m < H; m += S)
            s = fmaf(rp_scan_ldg(row + m), x[m], s);
    } else { /* S == 1 */
        const int64_t vt = tb * a.G * H;
        if (a.u != NULL)
            s = rp_scan_ldg(a.u + tb * H + i) * x[i];
        for (int k = 0; k < a.G; k++)
            for (int64_t m = lane; m < H; m += S)
                s = fmaf(w_[((int64_t)k * H + m) * H + i], rp_scan_vx(a, vt + (int64_t)k * H + m, x[m]), s);
    }
    return s;
}

/* Calls f(j, lane, L) for the rows j < nj of a 2-D loop spread over the
 * block: L lanes per row (a power of two, at most 32, about nk), f covering
 * k = lane, lane + L, ... < nk (the index contiguous in global memory), so
 * that index arithmetic divides once per row, not per element. */
template <class F> RP_HD void rp_scan_rows(int t, int nt, int nj, int nk, F &&f)
{
    int L = 1;
    while (L < 32 && L < nk && 2 * L <= nt)
        L *= 2;
    const int R = nt / L;
    if (t >= R * L)
        return;
    for (int j = t / L; j < nj; j += R)
        f(j, t % L, L);
}

/* Slot s of sequence b: its matrix in the workspace, its vector in the
 * workspace, its c part (from c when `leaf`, the workspace otherwise), and
 * the store of element i of its final value (to g[n-s] when `out`, times
 * v[n-s] with pre_activation, where G = 1; to the workspace otherwise). */
RP_HD float *rp_scan_prod(const rp_scan_args &a, int64_t s, int64_t b)
{
    return a.prod + (rp_scan_prod_index(s) * a.B + b) * a.H * a.H;
}
RP_HD float *rp_scan_vec(const rp_scan_args &a, int64_t s, int64_t b)
{
    return a.vec + (s * a.B + b) * a.H;
}
RP_HD const float *rp_scan_cpart(const rp_scan_args &a, bool leaf, int64_t s, int64_t b)
{
    return leaf ? a.c + ((a.n - 1 - s) * a.B + b) * a.H : rp_scan_vec(a, s, b);
}
RP_HD void rp_scan_put(const rp_scan_args &a, bool out, int64_t s, int64_t b, int i, float val)
{
    if (!out) {
        rp_scan_vec(a, s, b)[i] = val;
        return;
    }
    /* the slot's value, before pre_activation's scaling, as rp_scan_cpu checks
     * it; every thread that finds one stores the same 1: no atomics */
    if (a.nonfinite != NULL && !(fabsf(val) <= FLT_MAX))
        *a.nonfinite = 1;
    const int64_t e = ((a.n - s) * a.B + b) * a.H + i;
    a.g[e] = a.pre ? rp_scan_vx(a, e, val) : val;
}

/* Shared-memory floats of one task of the small up-sweep, and of a block. */
RP_HD int rp_scan_small_task_floats(int64_t H)
{
    const int Hp = rp_scan_pad4(H);
    return 2 * (int)H * Hp + 2 * Hp;
}
RP_HD size_t rp_scan_small_bytes(int64_t H, int Q)
{
    return (size_t)Q * 16 + (size_t)Q * rp_scan_small_task_floats(H) * 4;
}
/* ... of the large up-sweep with T rows per block. */
RP_HD size_t rp_scan_large_bytes(int64_t H, int T)
{
    return ((size_t)rp_scan_pad4((int64_t)T * (H | 1)) + RP_SCAN_BK * RP_SCAN_BN +
            (size_t)rp_scan_pad4(H) + (size_t)rp_scan_pad4(T)) *
           4;
}
/* ... of the down-sweep with Q tasks per block. */
RP_HD size_t rp_scan_down_bytes(int64_t H, int Q)
{
    return (size_t)Q * 16 + (size_t)Q * 2 * rp_scan_pad4(H) * 4;
}

/* A linear-scan thread's prefetched share of the next step's map. */
#define RP_SCAN_PF 8
struct rp_scan_pf {
    float m[RP_SCAN_PF];
    float c;
};

/* The micro-tile of a large up-sweep thread. */
template <int TM> struct rp_scan_acc {
    float a[TM][4];
};

/* ---------------------------------------------------------------------------
 * Up-sweep, H <= RP_SCAN_SMALL_H: Q whole tasks per block
 *
 * Task = p * B + b (pair p, sequence b); pair p joins l = p 2^(d+1) + 2^d - 1
 * and r = l + 2^d. Shared memory: a table of (p, b) per task, then per task
 * As (H x Hp, As[m][i] = M_r[i][m]), Bs (H x Hp, Bs[m][k] = M_l[m][k]), c_l
 * and c_r (Hp each); rows and columns past H are zero. Pair 0 (the left
 * spine) has a vector left operand: only its mat-vec runs.
 * ------------------------------------------------------------------------- */

template <int MODE, class X>
RP_HD void rp_scan_up_small(X &x, const rp_scan_args &a, int64_t block, int64_t grid, float *sm)
{
    constexpr bool leaf = MODE != RP_SCAN_PROD;
    const int H = (int)a.H, Hp = rp_scan_pad4(H), Q = a.q, nt = x.nt;
    const int TS = rp_scan_small_task_floats(H), H4 = Hp / 4, per = H4 * H4;
    const int64_t half = (int64_t)1 << a.d;
    int64_t *tab = reinterpret_cast<int64_t *>(sm);
    float *base = sm + 4 * Q;

    for (int64_t unit = block; unit < a.nunits; unit += grid) {
        x.each([&](int t) {
            for (int q = t; q < Q; q += nt) {
                const int64_t task = unit * Q + q;
                tab[2 * q] = task < a.ntasks ? task / a.B : -1;
                tab[2 * q + 1] = task < a.ntasks ? task % a.B : 0;
            }
        });
        x.sync();

        /* Stage M_r, M_l (not on the spine), c_l and c_r of every task. */
        x.each([&](int t) {
            if (MODE == RP_SCAN_STRUCT) { /* rows (q, m), lanes along i: w's rows run along i */
                rp_scan_rows(t, nt, Q * H, Hp, [&](int j, int lane, int L) {
                    const int q = j / H, m = j - q * H;
                    const int64_t p = tab[2 * q], b = tab[2 * q + 1];
                    const int64_t tb = (a.n - p * 2 * half - 2 * half + 1) * a.B + b;
                    float *dst = base + q * TS + m * Hp;
                    if (p >= 0)
                        for (int i = lane; i < Hp; i += L)
                            dst[i] = i < H ? rp_scan_leaf<MODE>(a, a.w, tb, i, m) : 0.0f;
                });
            } else { /* rows (q, i), lanes along m: rows of M are contiguous */
                rp_scan_rows(t, nt, Q * Hp, H, [&](int j, int lane, int L) {
                    const int q = j / Hp, i = j - q * Hp;
                    const int64_t p = tab[2 * q], b = tab[2 * q + 1];
                    const int64_t r = p * 2 * half + 2 * half - 1;
                    float *dst = base + q * TS + i;
                    if (p < 0)
                        return;
                    for (int m = lane; m < H; m += L) {
                        float val = 0.0f;
                        if (i < H) {
                            if constexpr (leaf)
                                val = rp_scan_leaf<MODE>(a, a.w, (a.n - r) * a.B + b, i, m);
                            else
                                val = rp_scan_prod(a, r, b)[(int64_t)i * H + m];
                        }
                        dst[m * Hp] = val;
                    }
                });
            }
            /* M_l[m][k], not on the spine (p == 0) */
            if (MODE == RP_SCAN_STRUCT) { /* rows (q, k), lanes along m */
                rp_scan_rows(t, nt, Q * Hp, H, [&](int j, int lane, int L) {
                    const int q = j / Hp, k = j - q * Hp;
                    const int64_t p = tab[2 * q], b = tab[2 * q + 1];
                    const int64_t tb = (a.n - p * 2 * half - half + 1) * a.B + b;
                    float *dst = base + q * TS + H * Hp + k;
                    if (p >= 1)
                        for (int m = lane; m < H; m += L)
                            dst[m * Hp] = k < H ? rp_scan_leaf<MODE>(a, a.w, tb, m, k) : 0.0f;
                });
            } else { /* rows (q, m), lanes along k */
                rp_scan_rows(t, nt, Q * H, Hp, [&](int j, int lane, int L) {
                    const int q = j / H, m = j - q * H;
                    const int64_t p = tab[2 * q], b = tab[2 * q + 1];
                    const int64_t l = p * 2 * half + half - 1;
                    float *dst = base + q * TS + H * Hp + m * Hp;
                    if (p < 1)
                        return;
                    for (int k = lane; k < Hp; k += L) {
                        float val = 0.0f;
                        if (k < H) {
                            if constexpr (leaf)
                                val = rp_scan_leaf<MODE>(a, a.w, (a.n - l) * a.B + b, m, k);
                            else
                                val = rp_scan_prod(a, l, b)[(int64_t)m * H + k];
                        }
                        dst[k] = val;
                    }
                });
            }
            rp_scan_rows(t, nt, Q, H, [&](int q, int lane, int L) {
                const int64_t p = tab[2 * q], b = tab[2 * q + 1];
                const int64_t l = p * 2 * half + half - 1, r = l + half;
                float *dst = base + q * TS + 2 * H * Hp;
                if (p < 0)
                    return;
                const float *cl = rp_scan_cpart(a, leaf, l, b), *cr = rp_scan_cpart(a, leaf, r, b);
                for (int i = lane; i < H; i += L) {
                    dst[i] = cl[i];
                    dst[Hp + i] = cr[i];
                }
            });
        });
        x.sync();

        /* Products, 4 x 4 micro-tiles, then the vectors M_r c_l + c_r. Everything
         * read is in shared memory now: writing over M_r and c_r is safe. */
        x.each([&](int t) {
            for (int mt = t; mt < Q * per; mt += nt) {
                const int q = mt / per, rem = mt - q * per, i4 = rem / H4, k4 = rem - i4 * H4;
                const int64_t p = tab[2 * q], b = tab[2 * q + 1];
                if (p < 1)
                    continue;
                const float *As = base + q * TS + i4 * 4, *Bs = base + q * TS + H * Hp + k4 * 4;
                float acc[4][4];
RP_SCAN_UNROLL
                for (int y = 0; y < 4; y++)
RP_SCAN_UNROLL
                    for (int z = 0; z < 4; z++)
                        acc[y][z] = 0.0f;
                for (int m = 0; m < H; m++) {
                    const float4 av = rp_scan_ld4(As + m * Hp), bv = rp_scan_ld4(Bs + m * Hp);
                    const float ar[4] = {av.x, av.y, av.z, av.w}, br[4] = {bv.x, bv.y, bv.z, bv.w};
RP_SCAN_UNROLL
                    for (int y = 0; y < 4; y++)
RP_SCAN_UNROLL
                        for (int z = 0; z < 4; z++)
                            acc[y][z] = fmaf(ar[y], br[z], acc[y][z]);
                }
                const int64_t r = p * 2 * half + 2 * half - 1;
                float *C = rp_scan_prod(a, r, b);
RP_SCAN_UNROLL
                for (int y = 0; y < 4; y++) {
                    const int i = i4 * 4 + y;
                    if (i < H)
RP_SCAN_UNROLL
                        for (int z = 0; z < 4; z++)
                            if (k4 * 4 + z < H)
                                C[(int64_t)i * H + k4 * 4 + z] = acc[y][z];
                }
            }
            for (int e = t; e < Q * H; e += nt) {
                const int q = e / H, i = e - q * H;
                const int64_t p = tab[2 * q], b = tab[2 * q + 1];
                if (p < 0)
                    continue;
                const float *As = base + q * TS, *cl = As + 2 * H * Hp, *cr = cl + Hp;
                float s = 0.0f;
                for (int m = 0; m < H; m++)
                    s = fmaf(As[m * Hp + i], cl[m], s);
                const int64_t r = p * 2 * half + 2 * half - 1;
                rp_scan_vec(a, r, b)[i] = s + cr[i];
            }
        });
        x.sync(); /* before the next unit restages */
    }
}

/* ---------------------------------------------------------------------------
 * Up-sweep, H > RP_SCAN_SMALL_H: one block per (task, panel of T rows)
 *
 * Shared memory: As (T x (H|1), rows i0.. of M_r), Bs (BK x BN, a chunk of
 * M_l), c_l (H), the panel's c_r (T). Thread (ty, tx) = (t / 16, t % 16)
 * owns rows ty*TM .. ty*TM+TM-1 and columns tx*4 .. tx*4+3 of each 64-column
 * tile; T / TM * 16 threads.
 * ------------------------------------------------------------------------- */

template <int MODE, int TM, class X>
RP_HD void rp_scan_up_large(X &x, const rp_scan_args &a, int64_t block, int64_t grid, float *sm)
{
    constexpr bool leaf = MODE != RP_SCAN_PROD;
    const int H = (int)a.H, T = a.tile, HS = H | 1, nt = x.nt;
    const int64_t npan = (a.H + T - 1) / T, half = (int64_t)1 << a.d;
    float *As = sm;
    float *Bs = sm + rp_scan_pad4((int64_t)T * HS);
    float *cl = Bs + RP_SCAN_BK * RP_SCAN_BN;
    float *cr = cl + rp_scan_pad4(H);
    typename X::template local<rp_scan_acc<TM>> acc;

    for (int64_t unit = block; unit < a.nunits; unit += grid) {
        const int64_t task = unit / npan, p = task / a.B, b = task - p * a.B;
        const int i0 = (int)(unit - task * npan) * T, rows = T < H - i0 ? T : H - i0;
        const int64_t l = p * 2 * half + half - 1, r = l + half;
        const bool spine = p == 0;

        x.each([&](int t) {
            if (MODE == RP_SCAN_STRUCT) { /* rows m, lanes along the panel's rows */
                rp_scan_rows(t, nt, H, T, [&](int m, int lane, int L) {
                    for (int row = lane; row < T; row += L)
                        As[row * HS + m] = row < rows ? rp_scan_leaf<MODE>(a, a.w, (a.n - r) * a.B + b,
                                                                           i0 + row, m)
                                                      : 0.0f;
                });
            } else { /* rows of the panel, lanes along m */
                rp_scan_rows(t, nt, T, H, [&](int row, int lane, int L) {
                    for (int m = lane; m < H; m += L) {
                        float val = 0.0f;
                        if (row < rows) {
                            if constexpr (leaf)
                                val = rp_scan_leaf<MODE>(a, a.w, (a.n - r) * a.B + b, i0 + row, m);
                            else
                                val = rp_scan_prod(a, r, b)[(int64_t)(i0 + row) * H + m];
                        }
                        As[row * HS + m] = val;
                    }
                });
            }
            const float *cls = rp_scan_cpart(a, leaf, l, b), *crs = rp_scan_cpart(a, leaf, r, b);
            for (int m = t; m < H; m += nt)
                cl[m] = cls[m];
            for (int row = t; row < rows; row += nt)
                cr[row] = crs[i0 + row];
        });
        x.sync();

        /* The panel's rows of M_r c_l + c_r (the spine's result). */
        x.each([&](int t) {
            float *dst = rp_scan_vec(a, r, b) + i0;
            for (int row = t; row < rows; row += nt) {
                float s = 0.0f;
                for (int m = 0; m < H; m++)
                    s = fmaf(As[row * HS + m], cl[m], s);
                dst[row] = s + cr[row];
            }
        });

        if (!spine) {
            for (int k0 = 0; k0 < H; k0 += RP_SCAN_BN) {
                x.each([&](int t) {
                    for (int y = 0; y < TM; y++)
                        for (int z = 0; z < 4; z++)
                            acc(t).a[y][z] = 0.0f;
                });
                for (int m0 = 0; m0 < H; m0 += RP_SCAN_BK) {
                    x.each([&](int t) {
                        for (int e = t; e < RP_SCAN_BK * RP_SCAN_BN; e += nt) {
                            int mm, kk;
                            if (MODE == RP_SCAN_STRUCT) {
                                kk = e / RP_SCAN_BK;
                                mm = e - kk * RP_SCAN_BK;
                            } else {
                                mm = e / RP_SCAN_BN;
                                kk = e - mm * RP_SCAN_BN;
                            }
                            const int m = m0 + mm, k = k0 + kk;
                            float val = 0.0f;
                            if (m < H && k < H) {
                                if constexpr (leaf)
                                    val = rp_scan_leaf<MODE>(a, a.w, (a.n - l) * a.B + b, m, k);
                                else
                                    val = rp_scan_prod(a, l, b)[(int64_t)m * H + k];
                            }
                            Bs[mm * RP_SCAN_BN + kk] = val;
                        }
                    });
                    x.sync();
                    x.each([&](int t) {
                        const int ty = t / 16, tx = t - ty * 16;
                        const int kmax = RP_SCAN_BK < H - m0 ? RP_SCAN_BK : H - m0;
                        const float *Ar = As + ty * TM * HS + m0;
                        rp_scan_acc<TM> &c = acc(t);
                        for (int mm = 0; mm < kmax; mm++) {
                            const float4 bv = rp_scan_ld4(Bs + mm * RP_SCAN_BN + tx * 4);
RP_SCAN_UNROLL
                            for (int y = 0; y < TM; y++) {
                                const float av = Ar[y * HS + mm];
                                c.a[y][0] = fmaf(av, bv.x, c.a[y][0]);
                                c.a[y][1] = fmaf(av, bv.y, c.a[y][1]);
                                c.a[y][2] = fmaf(av, bv.z, c.a[y][2]);
                                c.a[y][3] = fmaf(av, bv.w, c.a[y][3]);
                            }
                        }
                    });
                    x.sync();
                }
                x.each([&, k0](int t) {
                    const int ty = t / 16, tx = t - ty * 16;
                    float *C = rp_scan_prod(a, r, b);
RP_SCAN_UNROLL
                    for (int y = 0; y < TM; y++) {
                        const int row = ty * TM + y;
                        if (row < rows)
RP_SCAN_UNROLL
                            for (int z = 0; z < 4; z++) {
                                const int k = k0 + tx * 4 + z;
                                if (k < H)
                                    C[(int64_t)(i0 + row) * H + k] = acc(t).a[y][z];
                            }
                    }
                });
            }
        }
        x.sync(); /* before the next unit restages */
    }
}

/* ---------------------------------------------------------------------------
 * Down-sweep: Q tasks per block, S lanes per row
 *
 * Task = p * B + b for the pairs (l = p 2^(d+1) + 2^d - 1 < n, r = min(l + 2^d,
 * n)); at level 0 with n even, B more tasks copy slot n (untouched by level
 * 0) to g[0]. Shared memory: a table of (p, b) per task (p = -1: the copy,
 * -2: none), then per task the prefix x = a[r] and c_l (Hp each).
 * ------------------------------------------------------------------------- */

template <int MODE, class X>
RP_HD void rp_scan_down(X &x, const rp_scan_args &a, int64_t block, int64_t grid, float *sm)
{
    constexpr bool leaf = MODE != RP_SCAN_PROD; /* level 0: leaves, c and g */
    const int H = (int)a.H, Hp = rp_scan_pad4(H), Q = a.q, S = a.S, nt = x.nt, ng = nt / S;
    const int rounds = (Q * H + ng - 1) / ng;
    const int64_t half = (int64_t)1 << a.d, npt = a.npairs * a.B;
    int64_t *tab = reinterpret_cast<int64_t *>(sm);
    float *xs = sm + 4 * Q, *cs = xs + Q * Hp;
    typename X::template local<float> part;

    for (int64_t unit = block; unit < a.nunits; unit += grid) {
        x.each([&](int t) {
            for (int q = t; q < Q; q += nt) {
                const int64_t task = unit * Q + q;
                tab[2 * q] = task < npt ? task / a.B : (task < a.ntasks ? -1 : -2);
                tab[2 * q + 1] = task < npt ? task % a.B : (task < a.ntasks ? task - npt : 0);
            }
        });
        x.sync();

        x.each([&](int t) {
            rp_scan_rows(t, nt, Q, H, [&](int q, int lane, int L) {
                const int64_t p = tab[2 * q], b = tab[2 * q + 1];
                const int64_t l = p * 2 * half + half - 1;
                const int64_t r = p < 0 ? a.n : (l + half < a.n ? l + half : a.n);
                if (p < -1)
                    return;
                const float *xr = rp_scan_vec(a, r, b), *cl = rp_scan_cpart(a, leaf, l, b);
                for (int m = lane; m < H; m += L) {
                    xs[q * Hp + m] = xr[m]; /* the copy task (p == -1): slot n */
                    if (p >= 0)
                        cs[q * Hp + m] = cl[m];
                }
            });
        });
        x.sync();

        for (int round = 0; round < rounds; round++) {
            x.each([&, round](int t) {
                const int row = round * ng + t / S, lane = t % S;
                float s = 0.0f;
                if (row < Q * H) {
                    const int q = row / H, i = row - q * H;
                    const int64_t p = tab[2 * q], b = tab[2 * q + 1];
                    if (p >= 1) {
                        const int64_t l = p * 2 * half + half - 1;
                        const float *xq = xs + q * Hp;
                        if constexpr (leaf) {
                            s = rp_scan_leaf_dot<MODE>(a, a.w, (a.n - l) * a.B + b, i, xq, lane, S);
                        } else {
                            const float *M = rp_scan_prod(a, l, b) + (int64_t)i * H;
                            for (int m = lane; m < H; m += S)
                                s = fmaf(M[m], xq[m], s);
                        }
                    }
                }
                part(t) = s;
            });
            x.group_sum(part, S);
            x.each([&, round](int t) {
                const int row = round * ng + t / S;
                if (t % S != 0 || row >= Q * H)
                    return;
                const int q = row / H, i = row - q * H;
                const int64_t p = tab[2 * q], b = tab[2 * q + 1];
                if (p == -1) {
                    rp_scan_put(a, true, a.n, b, i, xs[q * Hp + i]); /* slot n -> g[0] */
                } else if (p >= 0) {
                    const int64_t l = p * 2 * half + half - 1;
                    const int64_t r = l + half < a.n ? l + half : a.n;
                    if (p == 0) { /* prefix = identity: a[r] = a[l] */
                        rp_scan_put(a, leaf, r, b, i, cs[q * Hp + i]);
                    } else {
                        rp_scan_put(a, leaf, r, b, i, part(t) + cs[q * Hp + i]);
                        rp_scan_put(a, leaf, l, b, i, xs[q * Hp + i]);
                    }
                }
            });
        }
        x.sync(); /* before the next unit restages */
    }
}

/* ---------------------------------------------------------------------------
 * Linear scan over the blocks of 2^L slots: one block per sequence
 *
 * Block j ends at e_j = min((j+1) 2^L - 1, n). P_1 = a[e_0] (a vector), then
 * step j = 1 .. nb-1 writes P_j to slot e_j and, but for the last, computes
 * P_{j+1} = M P_j + c from the map (M, c) of slot e_j, reading c before the
 * same thread overwrites it with P_j. At L = 0 the maps are the leaves, c
 * comes from c and P_j goes to g[n - j]. Shared memory: P (2 x Hp), w when
 * staged (G H H).
 * ------------------------------------------------------------------------- */

template <int MODE, class X>
RP_HD void rp_scan_mid(X &x, const rp_scan_args &a, int64_t block, int64_t grid, float *sm)
{
    constexpr bool leaf = MODE != RP_SCAN_PROD; /* levels == 0 */
    const int H = (int)a.H, Hp = rp_scan_pad4(H), S = a.S, nt = x.nt, ng = nt / S;
    const int rounds = (H + ng - 1) / ng;
    /* Prefetch: with one row per lane group (one round) and at most
     * RP_SCAN_PF elements per lane, each thread loads the next step's row
     * elements (and lane 0 its c) into registers while the current step
     * finishes, so a step's critical path holds no global load. */
    const bool pf = MODE != RP_SCAN_STRUCT && rounds == 1 && (H + S - 1) / S <= RP_SCAN_PF;
    float *P = sm, *ws = sm + 2 * Hp;
    const float *w_ = a.stage_w ? ws : a.w;
    typename X::template local<float> part;
    typename X::template local<rp_scan_pf> nx;

    if (a.redo_if != NULL && *a.redo_if == 0)
        return; /* the linear redo of a scan whose results were all finite */
    if (a.stage_w) {
        x.each([&](int t) {
            const int64_t nw = (int64_t)a.G * a.H * a.H;
            for (int64_t e = t; e < nw; e += nt)
                ws[e] = a.w[e];
        });
    }
    for (int64_t b = block; b < a.B; b += grid) {
        /* Thread t's share of the map of slot e (a step that computes P_{j+1}). */
        auto fetch = [&](int t, int64_t e) {
            const int i = t / S, lane = t % S;
            if (i >= H)
                return;
            const float *row;
            if constexpr (MODE == RP_SCAN_DENSE)
                row = a.jt + (((a.n - e) * a.B + b) * a.H + i) * a.H;
            else
                row = rp_scan_prod(a, e, b) + (int64_t)i * H;
            RP_SCAN_UNROLL
            for (int k = 0; k < RP_SCAN_PF; k++) {
                const int m = lane + k * S;
                nx(t).m[k] = m < H ? rp_scan_ldg(row + m) : 0.0f;
            }
            nx(t).c = lane == 0 ? rp_scan_cpart(a, leaf, e, b)[i] : 0.0f;
        };
        x.each([&](int t) {
            const float *p1 = rp_scan_cpart(a, leaf, a.span - 1, b);
            for (int m = t; m < H; m += nt)
                P[m] = p1[m];
            if (pf && a.nb > 2)
                fetch(t, 2 * a.span - 1 < a.n ? 2 * a.span - 1 : a.n);
        });
        x.sync();
        int cur = 0;
        for (int64_t j = 1; j < a.nb; j++) {
            const int64_t e = (j + 1) * a.span - 1 < a.n ? (j + 1) * a.span - 1 : a.n;
            const int64_t enext = (j + 2) * a.span - 1 < a.n ? (j + 2) * a.span - 1 : a.n;
            const bool more = j + 1 < a.nb;
            const float *Pc = P + cur * Hp;
            float *Pn = P + (1 - cur) * Hp;
            for (int round = 0; round < rounds; round++) {
                x.each([&, round](int t) {
                    const int i = round * ng + t / S, lane = t % S;
                    float s = 0.0f;
                    if (more && i < H) {
                        if (pf) {
                            RP_SCAN_UNROLL
                            for (int k = 0; k < RP_SCAN_PF; k++) {
                                const int m = lane + k * S;
                                if (m < H)
                                    s = fmaf(nx(t).m[k], Pc[m], s);
                            }
                        } else if constexpr (leaf) {
                            s = rp_scan_leaf_dot<MODE>(a, w_, (a.n - e) * a.B + b, i, Pc, lane, S);
                        } else {
                            const float *M = rp_scan_prod(a, e, b) + (int64_t)i * H;
                            for (int m = lane; m < H; m += S)
                                s = fmaf(M[m], Pc[m], s);
                        }
                    }
                    part(t) = s;
                });
                x.group_sum(part, S);
                x.each([&, round](int t) {
                    const int i = round * ng + t / S;
                    if (t % S == 0 && i < H) {
                        /* c of slot e before P_j overwrites it (L > 0: the same address) */
                        const float cold = !more ? 0.0f : (pf ? nx(t).c : rp_scan_cpart(a, leaf, e, b)[i]);
                        rp_scan_put(a, leaf, e, b, i, Pc[i]);
                        if (more)
                            Pn[i] = part(t) + cold;
                    }
                    if (pf && j + 2 < a.nb)
                        fetch(t, enext); /* the next step's map: read-only until then */
                });
            }
            x.sync();
            cur = 1 - cur;
        }
    }
}

/* ---------------------------------------------------------------------------
 * Kernels
 * ------------------------------------------------------------------------- */

#define RP_SCAN_KERNEL_BODY(call)                                                                  \
    extern __shared__ float4 rp_scan_smem[];                                                       \
    rp_scan_dev x;                                                                                 \
    x.tid = (int)threadIdx.x;                                                                      \
    x.nt = (int)blockDim.x;                                                                        \
    call(x, a, (int64_t)blockIdx.x, (int64_t)gridDim.x, reinterpret_cast<float *>(rp_scan_smem))

template <int MODE>
__global__ void __launch_bounds__(RP_SCAN_THREADS, 4) rp_scan_up_small_kernel(const rp_scan_args a)
{
    RP_SCAN_KERNEL_BODY(rp_scan_up_small<MODE>);
}

template <int MODE, int TM>
__global__ void __launch_bounds__(RP_SCAN_THREADS, TM == 4 ? 2 : 3) rp_scan_up_large_kernel(const rp_scan_args a)
{
    RP_SCAN_KERNEL_BODY((rp_scan_up_large<MODE, TM>));
}

template <int MODE>
__global__ void __launch_bounds__(RP_SCAN_THREADS, 4) rp_scan_down_kernel(const rp_scan_args a)
{
    RP_SCAN_KERNEL_BODY(rp_scan_down<MODE>);
}

template <int MODE>
__global__ void __launch_bounds__(RP_SCAN_MID_THREADS, 1) rp_scan_mid_kernel(const rp_scan_args a)
{
    RP_SCAN_KERNEL_BODY(rp_scan_mid<MODE>);
}

/* ---------------------------------------------------------------------------
 * Launchers
 * ------------------------------------------------------------------------- */

/* One planned launch. */
typedef struct {
    const void *fn;
    unsigned threads;
    size_t smem;
    int64_t units;
    rp_scan_args a;
} rp_scan_launch_plan;

template <int MODE> static const void *rp_scan_pick_large(int TM)
{
    if (TM == 4)
        return (const void *)rp_scan_up_large_kernel<MODE, 4>;
    if (TM == 2)
        return (const void *)rp_scan_up_large_kernel<MODE, 2>;
    return (const void *)rp_scan_up_large_kernel<MODE, 1>;
}

static const void *rp_scan_pick(int which, int mode, int TM)
{
    switch (which) {
    case 0: /* up-sweep, small H */
        return mode == RP_SCAN_PROD    ? (const void *)rp_scan_up_small_kernel<RP_SCAN_PROD>
               : mode == RP_SCAN_DENSE ? (const void *)rp_scan_up_small_kernel<RP_SCAN_DENSE>
                                       : (const void *)rp_scan_up_small_kernel<RP_SCAN_STRUCT>;
    case 1: /* up-sweep, large H */
        return mode == RP_SCAN_PROD    ? rp_scan_pick_large<RP_SCAN_PROD>(TM)
               : mode == RP_SCAN_DENSE ? rp_scan_pick_large<RP_SCAN_DENSE>(TM)
                                       : rp_scan_pick_large<RP_SCAN_STRUCT>(TM);
    case 2: /* down-sweep */
        return mode == RP_SCAN_PROD    ? (const void *)rp_scan_down_kernel<RP_SCAN_PROD>
               : mode == RP_SCAN_DENSE ? (const void *)rp_scan_down_kernel<RP_SCAN_DENSE>
                                       : (const void *)rp_scan_down_kernel<RP_SCAN_STRUCT>;
    default: /* middle */
        return mode == RP_SCAN_PROD    ? (const void *)rp_scan_mid_kernel<RP_SCAN_PROD>
               : mode == RP_SCAN_DENSE ? (const void *)rp_scan_mid_kernel<RP_SCAN_DENSE>
                                       : (const void *)rp_scan_mid_kernel<RP_SCAN_STRUCT>;
    }
}

static unsigned rp_scan_round32(int64_t x)
{
    int64_t r = (x + 31) / 32 * 32;
    return (unsigned)(r < 32 ? 32 : r);
}

/* Lanes per row of a mat-vec: about `per` elements each, at most 32 lanes;
 * one on structured leaves (their reads of w coalesce along the rows). */
static int rp_scan_lanes(int64_t H, bool structured_leaf, int per)
{
    int S = 1;
    if (structured_leaf)
        return 1;
    while (S < 32 && (int64_t)S * per < H)
        S *= 2;
    return S;
}

static void rp_scan_plan_up(const rp_scan_args *base, int d, int mode, size_t limit,
                            rp_scan_launch_plan *L)
{
    const int64_t H = base->H;
    L->a = *base;
    L->a.d = d;
    L->a.npairs = base->n >> (d + 1);
    L->a.ntasks = L->a.npairs * base->B;
    if (H <= RP_SCAN_SMALL_H) {
        const int H4 = rp_scan_pad4(H) / 4, per = H4 * H4;
        int Q = RP_SCAN_THREADS / per;
        Q = Q < 1 ? 1 : (Q > RP_SCAN_MAX_Q ? RP_SCAN_MAX_Q : Q);
        while (Q > 1 && rp_scan_small_bytes(H, Q) > limit)
            Q--;
        L->a.q = Q;
        L->a.nunits = (L->a.ntasks + Q - 1) / Q;
        L->threads = rp_scan_round32((int64_t)Q * per);
        if (L->threads > RP_SCAN_THREADS)
            L->threads = RP_SCAN_THREADS;
        L->smem = rp_scan_small_bytes(H, Q);
        L->fn = rp_scan_pick(0, mode, 0);
    } else {
        int T = 64, TM;
        while (T > 1 && rp_scan_large_bytes(H, T) > limit)
            T /= 2;
        TM = T >= 64 ? 4 : (T == 32 ? 2 : 1);
        L->a.tile = T;
        L->a.nunits = L->a.ntasks * ((H + T - 1) / T);
        L->threads = (unsigned)(T / TM * 16);
        L->smem = rp_scan_large_bytes(H, T);
        L->fn = rp_scan_pick(1, mode, TM);
    }
    L->units = L->a.nunits;
}

static void rp_scan_plan_down(const rp_scan_args *base, int d, int mode, size_t limit,
                              rp_scan_launch_plan *L)
{
    const int64_t H = base->H, half = (int64_t)1 << d;
    const int S = rp_scan_lanes(H, mode == RP_SCAN_STRUCT, 8);
    int64_t Q = RP_SCAN_THREADS / ((int64_t)S * H);
    Q = Q < 1 ? 1 : (Q > RP_SCAN_MAX_Q ? RP_SCAN_MAX_Q : Q);
    while (Q > 1 && rp_scan_down_bytes(H, (int)Q) > limit)
        Q--;
    L->a = *base;
    L->a.d = d;
    L->a.S = S;
    L->a.q = (int)Q;
    L->a.npairs = ((base->n - half) >> (d + 1)) + 1;
    L->a.ntasks = L->a.npairs * base->B + (d == 0 && base->n % 2 == 0 ? base->B : 0);
    L->a.nunits = (L->a.ntasks + Q - 1) / Q;
    L->threads = rp_scan_round32(Q * H * S);
    if (L->threads > RP_SCAN_THREADS)
        L->threads = RP_SCAN_THREADS;
    L->smem = rp_scan_down_bytes(H, (int)Q);
    L->fn = rp_scan_pick(2, mode, 0);
    L->units = L->a.nunits;
}

static void rp_scan_plan_mid(const rp_scan_args *base, int levels, int mode,
                             rp_scan_launch_plan *L)
{
    const int64_t H = base->H;
    const int S = rp_scan_lanes(H, mode == RP_SCAN_STRUCT, 4); /* short dependent chains */
    const size_t pbytes = (size_t)2 * rp_scan_pad4(H) * 4;
    const int64_t wfloats = (int64_t)base->G * H * H;
    const size_t wbytes = wfloats < ((int64_t)1 << 28) ? (size_t)rp_scan_pad4(wfloats) * 4 : SIZE_MAX / 2;
    L->a = *base;
    L->a.S = S;
    L->a.span = (int64_t)1 << levels;
    L->a.nb = (base->n + L->a.span) / L->a.span; /* ceil((n + 1) / span) */
    L->a.stage_w = mode == RP_SCAN_STRUCT && pbytes + wbytes <= RP_SCAN_SMEM_DEFAULT;
    L->a.nunits = base->B;
    L->threads = rp_scan_round32(H * S);
    if (L->threads > RP_SCAN_MID_THREADS)
        L->threads = RP_SCAN_MID_THREADS;
    L->smem = pbytes + (L->a.stage_w ? wbytes : 0);
    L->fn = rp_scan_pick(3, mode, 0);
    L->units = L->a.nunits;
}

extern "C" size_t rp_cuda_scan_shared_bytes(int64_t H, int levels)
{
    size_t need;
    if (H > ((int64_t)1 << 28)) /* a GiB of floats: past any device, and past rp_scan_pad4's int */
        return SIZE_MAX;
    need = (size_t)2 * rp_scan_pad4(H) * 4 + 16;
    if (levels > 0) {
        const size_t up = H <= RP_SCAN_SMALL_H ? rp_scan_small_bytes(H, 1) : rp_scan_large_bytes(H, 1);
        const size_t down = rp_scan_down_bytes(H, 1);
        need = up > need ? up : need;
        need = down > need ? down : need;
    }
    return need;
}

extern "C" int rp_cuda_shared_memory_per_block(int device, size_t *bytes, rp_error *err)
{
    int optin = 0;
    cudaError_t e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (e != cudaSuccess)
        return rp_cuda_error(e, "rp_cuda_shared_memory_per_block", err);
    *bytes = (size_t)optin > (size_t)RP_SCAN_SMEM_DEFAULT ? (size_t)optin : (size_t)RP_SCAN_SMEM_DEFAULT;
    return RP_OK;
}

extern "C" int rp_cuda_scan(const rp_scan_jacobians *j, const float *c, float *g, int levels,
                            float *work, void *stream_, rp_error *err)
{
    cudaStream_t stream = (cudaStream_t)stream_;
    rp_device_guard guard;
    rp_scan_launch_plan *plans = NULL;
    rp_scan_args base;
    size_t limit = RP_SCAN_SMEM_DEFAULT;
    int nplans = 0, mode, k, rc, *redo = NULL;

    rc = rp_scan_check(j, c, g, levels, work, err);
    if (rc != RP_OK)
        return rc;
    if (j->n <= 0 || j->batch <= 0 || j->dim <= 0)
        return RP_OK;
    if (levels > 0 && c == g)
        return rp_set_error(err, RP_EINVAL,
                            "rp_cuda_scan: with levels > 0, g must not be c: a result that is not "
                            "finite is redone from c");

    {
        cudaError_t e = guard.enter(stream);
        if (e != cudaSuccess)
            return rp_cuda_error(e, "rp_cuda_scan", err);
    }

    memset(&base, 0, sizeof base);
    base.w = j->w;
    base.u = j->u;
    base.v = j->v;
    base.jt = j->jt;
    base.y = j->y;
    base.act = j->act;
    base.pre = j->pre_activation;
    base.c = c;
    base.g = g;
    if (levels > 0) { /* the linear scan reads c and writes g only: no workspace */
        base.vec = work;
        base.prod = work + (j->n + 1) * j->batch * j->dim;
        redo = (int *)(work + rp_scan_workspace_floats(j->n, j->batch, j->dim, levels));
    }
    base.n = j->n;
    base.B = j->batch;
    base.H = j->dim;
    base.G = j->gates;
    mode = j->gates > 0 ? RP_SCAN_STRUCT : RP_SCAN_DENSE;

    /* Shared memory: the default 48 KB, or the device's opt-in maximum when
     * a one-task block does not fit in it (H in the thousands). */
    {
        const size_t small = rp_cuda_scan_shared_bytes(base.H, levels);
        if (small > limit) {
            rc = rp_cuda_shared_memory_per_block(guard.dev, &limit, err);
            if (rc != RP_OK)
                return rc;
            if (limit < small)
                return rp_set_error(err, RP_EINVAL,
                                    "rp_cuda_scan: dim %lld needs %zu bytes of shared memory per "
                                    "block, the device allows %zu",
                                    (long long)base.H, small, limit);
        }
    }

    plans = (rp_scan_launch_plan *)malloc(sizeof *plans * (size_t)(2 * levels + 2));
    if (plans == NULL)
        return rp_set_error(err, RP_ERUNTIME, "rp_cuda_scan: out of host memory");
    for (k = 0; k < levels; k++)
        rp_scan_plan_up(&base, k, k == 0 ? mode : RP_SCAN_PROD, limit, &plans[nplans++]);
    rp_scan_plan_mid(&base, levels, levels == 0 ? mode : RP_SCAN_PROD, &plans[nplans++]);
    for (k = levels - 1; k >= 0; k--)
        rp_scan_plan_down(&base, k, k == 0 ? mode : RP_SCAN_PROD, limit, &plans[nplans++]);
    if (redo != NULL) {
        plans[nplans - 1].a.nonfinite = redo;
        rp_scan_plan_mid(&base, 0, mode, &plans[nplans]);
        plans[nplans++].a.redo_if = redo;
    }

    /* A plan past the default fits `limit`, which is then the device's opt-in
     * maximum; the cap is set to that, not to the plan's own need: the cap
     * belongs to the kernel on the device, which scans of other dims share,
     * and one of them on another thread (the GIL released) lowering it to its
     * need between this call's setting and launch would fail the launch. */
    for (k = 0; k < nplans; k++) {
        if (plans[k].smem > RP_SCAN_SMEM_DEFAULT) {
            cudaError_t e = cudaFuncSetAttribute(plans[k].fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 (int)limit);
            if (e != cudaSuccess) {
                free(plans);
                return rp_cuda_error(e, "rp_cuda_scan", err);
            }
        }
    }
    if (redo != NULL) {
        const cudaError_t e = cudaMemsetAsync(redo, 0, sizeof *redo, stream);
        if (e != cudaSuccess) {
            free(plans);
            return rp_cuda_error(e, "rp_cuda_scan", err);
        }
    }
    for (k = 0; k < nplans; k++) {
        const rp_scan_launch_plan *L = &plans[k];
        const int64_t units = L->units < 1 ? 1 : L->units;
        const unsigned grid = (unsigned)(units < RP_SCAN_MAX_GRID ? units : RP_SCAN_MAX_GRID);
        void *args[] = {(void *)&L->a};
        cudaError_t e = cudaLaunchKernel(L->fn, dim3(grid), dim3(L->threads), args, L->smem, stream);
        if (e == cudaSuccess)
            e = cudaGetLastError();
        if (e != cudaSuccess) {
            free(plans);
            return rp_cuda_error(e, "rp_cuda_scan", err);
        }
    }
    free(plans);
    return RP_OK;
}

/* ---------------------------------------------------------------------------
 * Sparse BPPSA: the compiled program of an rp_csr_plan (reprop.h)
 *
 * One launch per non-empty phase; its work items are the phase's
 * per-sequence rows times the batch, then its shared rows once each. Item
 * idx < nseq * B is row begin + idx / B of sequence b = idx % B: the seq
 * buffer is batch-minor (offset o of sequence b at o * B + b), so the B
 * consecutive threads of one row read B consecutive floats of each operand
 * and write B consecutive floats (coalesced), and they share that row's
 * term list (broadcast loads). Rows are independent within a phase, so
 * items need no ordering; each row sums its terms in their order, one
 * float32 multiply then one add each, as rp_csr_run_cpu does.
 * ------------------------------------------------------------------------- */

#ifndef RP_CSR_THREADS /* overridable (smaller) by the emulation test */
#define RP_CSR_THREADS 256
#endif

typedef struct {
    rp_csr_device_rows rows;
    float *seq, *shared;
    int64_t B;
    int64_t begin;   /* the phase's first row */
    int64_t nseq;    /* its per-sequence rows, from begin */
    int64_t nshared; /* its shared rows, after those */
} rp_csr_args;

RP_HD float *rp_csr_at(const rp_csr_args &a, uint32_t addr, int64_t b)
{
    if (addr & RP_CSR_SHARED)
        return a.shared + (addr & ~RP_CSR_SHARED);
    return a.seq + (int64_t)addr * a.B + b;
}

/* The items first, first + stride, ... of one launch (one per thread). */
RP_HD void rp_csr_items(const rp_csr_args &a, int64_t first, int64_t stride)
{
    const int64_t nseq_items = a.nseq * a.B, items = nseq_items + a.nshared;
    for (int64_t idx = first; idx < items; idx += stride) {
        const bool per_seq = idx < nseq_items;
        const int64_t row = a.begin + (per_seq ? idx / a.B : a.nseq + (idx - nseq_items));
        const int64_t b = per_seq ? idx % a.B : 0;
        const int64_t t1 = a.rows.term_ptr[row + 1];
        float acc = 0.0f;
        for (int64_t t = a.rows.term_ptr[row]; t < t1; t++)
            acc += *rp_csr_at(a, a.rows.tx[t], b) * *rp_csr_at(a, a.rows.ty[t], b);
        *rp_csr_at(a, a.rows.dst[row], b) = acc;
    }
}

__global__ void __launch_bounds__(RP_CSR_THREADS) rp_csr_kernel(const rp_csr_args a)
{
    rp_csr_items(a, (int64_t)blockIdx.x * blockDim.x + threadIdx.x,
                 (int64_t)gridDim.x * blockDim.x);
}

static int rp_csr_check_run(const rp_csr_program *g, const rp_csr_device_rows *rows, int64_t batch,
                            const float *seq, const float *shared, rp_error *err)
{
    if (g == NULL || rows == NULL)
        return rp_set_error(err, RP_EINVAL, "rp_cuda_csr_run: NULL program or device rows");
    if (batch < 0)
        return rp_set_error(err, RP_EINVAL, "rp_cuda_csr_run: batch %lld < 0", (long long)batch);
    if (g->nphases < 0 || g->nrows < 0 || g->nterms < 0 || g->seq_floats < 0 ||
        g->shared_floats < 0)
        return rp_set_error(err, RP_EINVAL, "rp_cuda_csr_run: negative sizes in the program");
    if (g->nphases > 0 && (g->phase_ptr == NULL || g->phase_shared == NULL))
        return rp_set_error(err, RP_EINVAL, "rp_cuda_csr_run: NULL phase arrays");
    if (g->nrows > 0 && (rows->dst == NULL || rows->term_ptr == NULL))
        return rp_set_error(err, RP_EINVAL, "rp_cuda_csr_run: NULL device dst or term_ptr");
    if (g->nterms > 0 && (rows->tx == NULL || rows->ty == NULL))
        return rp_set_error(err, RP_EINVAL, "rp_cuda_csr_run: NULL device tx or ty");
    if ((seq == NULL && g->seq_floats > 0 && batch > 0) || (shared == NULL && g->shared_floats > 0))
        return rp_set_error(err, RP_EINVAL, "rp_cuda_csr_run: NULL seq or shared buffer");
    if (rp_mul_capped(g->seq_floats, batch, INT64_MAX) < 0 ||
        rp_mul_capped(g->nrows + 1, batch, INT64_MAX / 2) < 0)
        return rp_set_error(err, RP_EINVAL,
                            "rp_cuda_csr_run: batch %lld overflows the program's sizes",
                            (long long)batch);
    for (int64_t p = 0; p < g->nphases; p++)
        if (g->phase_ptr[p] < 0 || g->phase_ptr[p] > g->phase_shared[p] ||
            g->phase_shared[p] > g->phase_ptr[p + 1] || g->phase_ptr[p + 1] > g->nrows)
            return rp_set_error(err, RP_EINVAL,
                                "rp_cuda_csr_run: phase %lld: rows [%lld, %lld), shared from %lld, "
                                "not ordered within [0, %lld)",
                                (long long)p, (long long)g->phase_ptr[p],
                                (long long)g->phase_ptr[p + 1], (long long)g->phase_shared[p],
                                (long long)g->nrows);
    return RP_OK;
}

extern "C" int rp_cuda_csr_run(const rp_csr_program *g, const rp_csr_device_rows *rows,
                               int64_t batch, float *seq, float *shared, void *stream_,
                               rp_error *err)
{
    cudaStream_t stream = (cudaStream_t)stream_;
    rp_device_guard guard;
    rp_csr_args a;
    int rc = rp_csr_check_run(g, rows, batch, seq, shared, err);
    if (rc != RP_OK)
        return rc;
    if (batch == 0)
        return RP_OK;

    {
        cudaError_t e = guard.enter(stream);
        if (e != cudaSuccess)
            return rp_cuda_error(e, "rp_cuda_csr_run", err);
    }
    a.rows = *rows;
    a.seq = seq;
    a.shared = shared;
    a.B = batch;
    for (int64_t p = 0; p < g->nphases; p++) {
        a.begin = g->phase_ptr[p];
        a.nseq = g->phase_shared[p] - a.begin;
        a.nshared = g->phase_ptr[p + 1] - g->phase_shared[p];
        const int64_t items = a.nseq * batch + a.nshared;
        if (items == 0)
            continue;
        const int64_t blocks = (items + RP_CSR_THREADS - 1) / RP_CSR_THREADS;
        const unsigned grid = (unsigned)(blocks < RP_SCAN_MAX_GRID ? blocks : RP_SCAN_MAX_GRID);
        void *args[] = {(void *)&a};
        cudaError_t e = cudaLaunchKernel((const void *)rp_csr_kernel, dim3(grid),
                                         dim3(RP_CSR_THREADS), args, 0, stream);
        if (e == cudaSuccess)
            e = cudaGetLastError();
        if (e != cudaSuccess)
            return rp_cuda_error(e, "rp_cuda_csr_run", err);
    }
    return RP_OK;
}

/* ---------------------------------------------------------------------------
 * The cuSPARSE peer of the sparse scan (ChainPlan(product="cusparse"))
 *
 * The same schedule as the program above (python/reprop/bppsa.py derives it
 * as a list of steps), with every CSR x CSR product of the up-sweep done by
 * cuSPARSE's structure-reusing SpGEMM and every mat-vec by cusparseSpMM:
 *   GEMM  C = A B      cusparseSpGEMMreuse_compute per instance; the work
 *                      estimation, nnz and copy stages ran once, in create
 *   MV    y = M x      cusparseSpMM: a shared M once over the B vectors (B
 *                      columns), a per-sequence M once per sequence
 *   COPY  y = x        one 2D copy of the B vectors
 * A matrix is one instance (`shared`: the same values for every sequence,
 * a Conv2d's or Linear's) or one per sequence: cuSPARSE has no batched
 * SpGEMM, so a per-sequence product costs B calls and B sets of buffers.
 * A product is shared when both operands are. Vector slot v of sequence b
 * is at vectors + (v * B + b) * stride (the caller's memory, as are the
 * leaves' patterns and values); the products' arrays, the SpGEMM buffers and
 * the SpMM workspace are the chain's own. Nothing links libcusparse: it is
 * dlopen()ed at the first create (a CUDA build of torch has loaded it
 * already), its functions resolved by name into pointers typed from
 * cusparse.h, which setup.py found (RP_HAVE_CUSPARSE); without the header
 * only the stubs at the end are built.
 * ------------------------------------------------------------------------- */

#ifdef RP_HAVE_CUSPARSE
/* The reuse stages are deprecated in cuSPARSE 12.9 yet exported by every
 * libcusparse.so.12; they are what the peer is about. */
#define DISABLE_CUSPARSE_DEPRECATED
#include <cusparse.h>
#include <dlfcn.h>
#include <stdio.h>

/* the steps' kinds are reprop.h's RP_CSR_GEMM, RP_CSR_MV, RP_CSR_COPY */

/* A row of the caller's matrix table (RP_CUSPARSE_MAT_COLS int64 each; pointers
 * as integers): a leaf (a < 0) with its device pattern and values, instance
 * i's values at values + i * stride; or the product C = A B of matrices a
 * and b, listed before it, whose nnz and arrays cuSPARSE makes. */
typedef struct {
    int64_t rows, cols, nnz, a, b, shared;
    const int32_t *indptr, *indices;
    float *values;
    int64_t stride;
} rp_sp_matrix;

/* A row of the step table (RP_CSR_STEP_COLS int64): kind; m the matrix (GEMM:
 * the product to compute, MV: the map); x and y the vector slots read and
 * written (MV, COPY); len the floats a COPY moves. */
typedef struct {
    int64_t kind, m, x, y, len;
} rp_sp_op;

typedef struct {
    float *vectors;
    int64_t batch, nvectors, stride;
} rp_sp_vectors;

static rp_sp_matrix rp_sp_matrix_row(const int64_t *r)
{
    rp_sp_matrix m = {r[0], r[1], r[2], r[3], r[4], r[5], (const int32_t *)(uintptr_t)r[6],
                      (const int32_t *)(uintptr_t)r[7], (float *)(uintptr_t)r[8], r[9]};
    return m;
}

static rp_sp_op rp_sp_op_row(const int64_t *r)
{
    rp_sp_op o = {r[0], r[1], r[2], r[3], r[4]};
    return o;
}

#define RP_SP_FUNCS(X)                                                                             \
    X(cusparseCreate) X(cusparseDestroy) X(cusparseSetStream) X(cusparseGetErrorString)            \
    X(cusparseCreateCsr) X(cusparseDestroySpMat) X(cusparseCsrSetPointers)                         \
    X(cusparseSpMatGetSize) X(cusparseCreateDnMat) X(cusparseDestroyDnMat)                         \
    X(cusparseSpGEMM_createDescr) X(cusparseSpGEMM_destroyDescr)                                   \
    X(cusparseSpGEMMreuse_workEstimation) X(cusparseSpGEMMreuse_nnz) X(cusparseSpGEMMreuse_copy)   \
    X(cusparseSpGEMMreuse_compute) X(cusparseSpMM_bufferSize) X(cusparseSpMM)

/* The library's functions, typed by the header's own declarations. */
static struct {
#define RP_SP_FIELD(name) decltype(&::name) name;
    RP_SP_FUNCS(RP_SP_FIELD)
#undef RP_SP_FIELD
    bool loaded;
} rp_sp;

/* dlopen()s libcusparse.so.12 by name (found when torch loaded it, or on the
 * library path), else at `path` (the nvidia wheel's copy, "" for none), and
 * resolves the functions once. Not thread-safe: the binding holds the GIL. */
static int rp_sp_load(const char *path, rp_error *err)
{
    char first[128] = "";
    void *lib;
    if (rp_sp.loaded)
        return RP_OK;
    lib = dlopen("libcusparse.so.12", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        snprintf(first, sizeof first, "%s", dlerror());
        lib = path != NULL && path[0] != '\0' ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : NULL;
    }
    if (lib == NULL)
        return rp_set_error(err, RP_ERUNTIME,
                            "cuSPARSE: cannot load libcusparse.so.12 (%s)%s%s; a CUDA build of torch "
                            "loads it, or pip install nvidia-cusparse",
                            first, path != NULL && path[0] != '\0' ? "; nor " : "",
                            path != NULL && path[0] != '\0' ? path : "");
#define RP_SP_RESOLVE(name)                                                                        \
    rp_sp.name = (decltype(rp_sp.name))dlsym(lib, #name);                                          \
    if (rp_sp.name == NULL) {                                                                      \
        dlclose(lib); /* the pointers already taken are never used: loaded stays false */          \
        return rp_set_error(err, RP_ERUNTIME, "cuSPARSE: libcusparse.so.12 lacks %s", #name);      \
    }
    RP_SP_FUNCS(RP_SP_RESOLVE)
#undef RP_SP_RESOLVE
    rp_sp.loaded = true; /* the handle stays open: the pointers live in it */
    return RP_OK;
}

/* RP_ERUNTIME naming the call and cuSPARSE's text, or RP_OK. */
static int rp_sp_check(cusparseStatus_t s, const char *what, rp_error *err)
{
    if (s == CUSPARSE_STATUS_SUCCESS)
        return RP_OK;
    return rp_set_error(err, RP_ERUNTIME, "cuSPARSE error in %s: %s", what,
                        rp_sp.cusparseGetErrorString(s));
}

static int rp_sp_cuda(cudaError_t e, rp_error *err)
{
    return e == cudaSuccess ? RP_OK : rp_cuda_error(e, "the cuSPARSE peer", err);
}

/* At least 256 bytes: a NULL buffer would turn a reuse stage's second call
 * back into a size query, which skips the stage. */
static int rp_sp_alloc(void **p, size_t bytes, rp_error *err)
{
    return rp_sp_cuda(cudaMalloc(p, bytes > 256 ? bytes : 256), err);
}

static void rp_sp_free(void *p)
{
    if (p != NULL)
        (void)cudaFree(p);
}

/* One matrix for one sequence, or for the batch when shared. */
typedef struct {
    cusparseSpMatDescr_t mat;
    cusparseSpGEMMDescr_t gemm;                    /* products: the reuse state */
    void *offsets, *columns, *values, *buf4, *buf5; /* products: owned */
} rp_sp_inst;

typedef struct {
    rp_sp_matrix spec;
    int64_t ninst; /* 1 if shared, else B */
    rp_sp_inst *inst;
} rp_sp_mat;

typedef struct {
    rp_sp_op op;
    int64_t ninst;                   /* MV: the instances of its matrix */
    cusparseDnMatDescr_t *x, *y;     /* MV: the vectors each instance reads and writes */
} rp_sp_step;

struct rp_cusparse_chain {
    int device;
    cusparseHandle_t handle;
    int64_t nmats, nsteps;
    rp_sp_mat *mats;
    rp_sp_step *steps;
    rp_sp_vectors vec;
    void *work; /* SpMM's workspace, shared by every mat-vec (one stream) */
    size_t work_size;
};

static const float rp_sp_one = 1.0f, rp_sp_zero = 0.0f;
#define RP_SP_NN CUSPARSE_OPERATION_NON_TRANSPOSE, CUSPARSE_OPERATION_NON_TRANSPOSE

/* The instance of matrix `id` that sequence (or shared instance) i reads. */
static rp_sp_inst *rp_sp_operand(rp_cusparse_chain *c, int64_t id, int64_t i)
{
    rp_sp_mat *m = &c->mats[id];
    return &m->inst[m->ninst == 1 ? 0 : i];
}

static float *rp_sp_slot(const rp_sp_vectors *v, int64_t slot, int64_t b)
{
    return v->vectors + (slot * v->batch + b) * v->stride;
}

static int rp_sp_leaf_setup(rp_sp_mat *m, rp_error *err)
{
    const rp_sp_matrix *s = &m->spec;
    for (int64_t i = 0; i < m->ninst; i++) {
        int rc = rp_sp_check(rp_sp.cusparseCreateCsr(&m->inst[i].mat, s->rows, s->cols, s->nnz,
                                                     (void *)s->indptr, (void *)s->indices,
                                                     s->values + i * s->stride, CUSPARSE_INDEX_32I,
                                                     CUSPARSE_INDEX_32I, CUSPARSE_INDEX_BASE_ZERO,
                                                     CUDA_R_32F),
                             "cusparseCreateCsr", err);
        if (rc != RP_OK)
            return rc;
    }
    return RP_OK;
}

/* The reuse stages of C = A B up to its values: C's pattern, its arrays and
 * the buffers compute needs (4 and 5), kept in x; buffers 1 to 3 are freed
 * on every path. */
static int rp_sp_gemm_stages(rp_cusparse_chain *c, const rp_sp_inst *A, const rp_sp_inst *B,
                             rp_sp_inst *x, rp_error *err)
{
    const cusparseSpGEMMAlg_t alg = CUSPARSE_SPGEMM_DEFAULT;
    cusparseHandle_t h = c->handle;
    void *buf1 = NULL, *buf2 = NULL, *buf3 = NULL;
    size_t s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0;
    int64_t rows = 0, cols = 0, nnz = 0;
    int rc = rp_sp_check(rp_sp.cusparseSpGEMMreuse_workEstimation(h, RP_SP_NN, A->mat, B->mat, x->mat,
                                                                  alg, x->gemm, &s1, NULL),
                         "cusparseSpGEMMreuse_workEstimation", err);
    if (rc == RP_OK)
        rc = rp_sp_alloc(&buf1, s1, err);
    if (rc == RP_OK)
        rc = rp_sp_check(rp_sp.cusparseSpGEMMreuse_workEstimation(h, RP_SP_NN, A->mat, B->mat, x->mat,
                                                                  alg, x->gemm, &s1, buf1),
                         "cusparseSpGEMMreuse_workEstimation", err);
    if (rc == RP_OK)
        rc = rp_sp_check(rp_sp.cusparseSpGEMMreuse_nnz(h, RP_SP_NN, A->mat, B->mat, x->mat, alg,
                                                       x->gemm, &s2, NULL, &s3, NULL, &s4, NULL),
                         "cusparseSpGEMMreuse_nnz", err);
    if (rc == RP_OK)
        rc = rp_sp_alloc(&buf2, s2, err);
    if (rc == RP_OK)
        rc = rp_sp_alloc(&buf3, s3, err);
    if (rc == RP_OK)
        rc = rp_sp_alloc(&x->buf4, s4, err);
    if (rc == RP_OK)
        rc = rp_sp_check(rp_sp.cusparseSpGEMMreuse_nnz(h, RP_SP_NN, A->mat, B->mat, x->mat, alg,
                                                       x->gemm, &s2, buf2, &s3, buf3, &s4, x->buf4),
                         "cusparseSpGEMMreuse_nnz", err);
    if (rc == RP_OK)
        rc = rp_sp_check(rp_sp.cusparseSpMatGetSize(x->mat, &rows, &cols, &nnz),
                         "cusparseSpMatGetSize", err);
    if (rc == RP_OK && (nnz < 0 || nnz > INT32_MAX))
        rc = rp_set_error(err, RP_ERUNTIME, "cuSPARSE peer: a product has %lld non-zeros, past "
                          "32-bit indices", (long long)nnz);
    if (rc == RP_OK)
        rc = rp_sp_alloc(&x->columns, (size_t)nnz * sizeof(int32_t), err);
    if (rc == RP_OK)
        rc = rp_sp_alloc(&x->values, (size_t)nnz * sizeof(float), err);
    if (rc == RP_OK)
        rc = rp_sp_check(rp_sp.cusparseCsrSetPointers(x->mat, x->offsets, x->columns, x->values),
                         "cusparseCsrSetPointers", err);
    if (rc == RP_OK)
        rc = rp_sp_check(rp_sp.cusparseSpGEMMreuse_copy(h, RP_SP_NN, A->mat, B->mat, x->mat, alg,
                                                        x->gemm, &s5, NULL),
                         "cusparseSpGEMMreuse_copy", err);
    if (rc == RP_OK)
        rc = rp_sp_alloc(&x->buf5, s5, err);
    if (rc == RP_OK)
        rc = rp_sp_check(rp_sp.cusparseSpGEMMreuse_copy(h, RP_SP_NN, A->mat, B->mat, x->mat, alg,
                                                        x->gemm, &s5, x->buf5),
                         "cusparseSpGEMMreuse_copy", err);
    rp_sp_free(buf1), rp_sp_free(buf2), rp_sp_free(buf3);
    return rc;
}

/* Every instance of product m: an empty CSR descriptor over owned offsets,
 * then the reuse stages against its operands' instances. */
static int rp_sp_product_setup(rp_cusparse_chain *c, rp_sp_mat *m, rp_error *err)
{
    const rp_sp_matrix *s = &m->spec;
    for (int64_t i = 0; i < m->ninst; i++) {
        rp_sp_inst *x = &m->inst[i];
        int rc = rp_sp_alloc(&x->offsets, (size_t)(s->rows + 1) * sizeof(int32_t), err);
        if (rc == RP_OK)
            rc = rp_sp_check(rp_sp.cusparseCreateCsr(&x->mat, s->rows, s->cols, 0, x->offsets, NULL,
                                                     NULL, CUSPARSE_INDEX_32I, CUSPARSE_INDEX_32I,
                                                     CUSPARSE_INDEX_BASE_ZERO, CUDA_R_32F),
                             "cusparseCreateCsr", err);
        if (rc == RP_OK)
            rc = rp_sp_check(rp_sp.cusparseSpGEMM_createDescr(&x->gemm), "cusparseSpGEMM_createDescr",
                             err);
        if (rc == RP_OK)
            rc = rp_sp_gemm_stages(c, rp_sp_operand(c, s->a, i), rp_sp_operand(c, s->b, i), x, err);
        if (rc != RP_OK)
            return rc;
    }
    return RP_OK;
}

/* A mat-vec's vector descriptors (B columns for a shared matrix, one per
 * sequence otherwise) and the workspace it needs. */
static int rp_sp_mv_setup(rp_cusparse_chain *c, rp_sp_step *st, rp_error *err)
{
    rp_sp_mat *m = &c->mats[st->op.m];
    const int64_t ncols = m->ninst == 1 ? c->vec.batch : 1;
    st->ninst = m->ninst;
    st->x = (cusparseDnMatDescr_t *)calloc((size_t)st->ninst, sizeof *st->x);
    st->y = (cusparseDnMatDescr_t *)calloc((size_t)st->ninst, sizeof *st->y);
    if (st->x == NULL || st->y == NULL)
        return rp_set_error(err, RP_ERUNTIME, "cuSPARSE peer: out of host memory");
    for (int64_t i = 0; i < st->ninst; i++) {
        size_t need = 0;
        int rc = rp_sp_check(rp_sp.cusparseCreateDnMat(&st->x[i], m->spec.cols, ncols, c->vec.stride,
                                                       rp_sp_slot(&c->vec, st->op.x, i), CUDA_R_32F,
                                                       CUSPARSE_ORDER_COL),
                             "cusparseCreateDnMat", err);
        if (rc == RP_OK)
            rc = rp_sp_check(rp_sp.cusparseCreateDnMat(&st->y[i], m->spec.rows, ncols, c->vec.stride,
                                                       rp_sp_slot(&c->vec, st->op.y, i), CUDA_R_32F,
                                                       CUSPARSE_ORDER_COL),
                             "cusparseCreateDnMat", err);
        if (rc == RP_OK)
            rc = rp_sp_check(rp_sp.cusparseSpMM_bufferSize(c->handle, RP_SP_NN, &rp_sp_one, m->inst[i].mat,
                                                           st->x[i], &rp_sp_zero, st->y[i], CUDA_R_32F,
                                                           CUSPARSE_SPMM_ALG_DEFAULT, &need),
                             "cusparseSpMM_bufferSize", err);
        if (rc != RP_OK)
            return rc;
        c->work_size = need > c->work_size ? need : c->work_size;
    }
    return RP_OK;
}

/* The shapes and ids the steps rely on: products after their operands,
 * set up (by their GEMM step) before any step reads them; vectors in range. */
static int rp_sp_check_chain(int64_t nmats, const rp_sp_matrix *mats, int64_t nops, const rp_sp_op *ops,
                             const rp_sp_vectors *v, rp_error *err)
{
    if (v->batch < 1 || v->batch > INT32_MAX || v->nvectors < 1 || v->stride < 1 ||
        v->vectors == NULL ||
        rp_mul_capped(rp_mul_capped(v->nvectors, v->batch, INT64_MAX), v->stride, INT64_MAX / 4) < 0)
        return rp_set_error(err, RP_EINVAL, "cuSPARSE peer: bad vector buffer");
    char *ready = (char *)calloc((size_t)nmats, 1);
    int rc = ready == NULL ? rp_set_error(err, RP_ERUNTIME, "cuSPARSE peer: out of host memory") : RP_OK;
    for (int64_t i = 0; rc == RP_OK && i < nmats; i++) {
        const rp_sp_matrix *m = &mats[i];
        const bool leaf = m->a < 0;
        if (m->rows < 1 || m->cols < 1 || m->rows > INT32_MAX || m->cols > INT32_MAX)
            rc = rp_set_error(err, RP_EINVAL, "cuSPARSE peer: matrix %lld: bad shape", (long long)i);
        else if (leaf && (m->nnz < 0 || m->nnz > INT32_MAX || m->indptr == NULL || m->values == NULL ||
                          (m->nnz > 0 && m->indices == NULL) || (!m->shared && m->stride < m->nnz)))
            rc = rp_set_error(err, RP_EINVAL, "cuSPARSE peer: leaf %lld: bad CSR arrays", (long long)i);
        else if (!leaf && (m->a >= i || m->b < 0 || m->b >= i || mats[m->a].cols != mats[m->b].rows ||
                           m->rows != mats[m->a].rows || m->cols != mats[m->b].cols ||
                           m->shared != (mats[m->a].shared && mats[m->b].shared)))
            rc = rp_set_error(err, RP_EINVAL, "cuSPARSE peer: product %lld: bad operands", (long long)i);
        ready[i] = leaf;
    }
    for (int64_t k = 0; rc == RP_OK && k < nops; k++) {
        const rp_sp_op *o = &ops[k];
        const bool has_m = o->kind != RP_CSR_COPY && o->m >= 0 && o->m < nmats;
        const bool vecs = o->x >= 0 && o->x < v->nvectors && o->y >= 0 && o->y < v->nvectors;
        if (o->kind == RP_CSR_GEMM && has_m && !ready[o->m] && mats[o->m].a >= 0 &&
            ready[mats[o->m].a] && ready[mats[o->m].b])
            ready[o->m] = 1;
        else if (o->kind == RP_CSR_MV && has_m && ready[o->m] && vecs && o->x != o->y &&
                 mats[o->m].rows <= v->stride && mats[o->m].cols <= v->stride)
            continue;
        else if (!(o->kind == RP_CSR_COPY && vecs && o->x != o->y && o->len > 0 && o->len <= v->stride))
            rc = rp_set_error(err, RP_EINVAL, "cuSPARSE peer: step %lld is not a valid GEMM, MV or COPY "
                              "at that point", (long long)k);
    }
    free(ready);
    return rc;
}

static int rp_sp_build(rp_cusparse_chain *c, const rp_sp_matrix *mats, const rp_sp_op *ops,
                       cudaStream_t stream, rp_error *err)
{
    int rc = rp_sp_check(rp_sp.cusparseCreate(&c->handle), "cusparseCreate", err);
    if (rc == RP_OK)
        rc = rp_sp_check(rp_sp.cusparseSetStream(c->handle, stream), "cusparseSetStream", err);
    for (int64_t i = 0; rc == RP_OK && i < c->nmats; i++) {
        rp_sp_mat *m = &c->mats[i];
        m->spec = mats[i];
        m->ninst = m->spec.shared ? 1 : c->vec.batch;
        m->inst = (rp_sp_inst *)calloc((size_t)m->ninst, sizeof *m->inst);
        if (m->inst == NULL)
            rc = rp_set_error(err, RP_ERUNTIME, "cuSPARSE peer: out of host memory");
        else if (m->spec.a < 0)
            rc = rp_sp_leaf_setup(m, err);
    }
    for (int64_t k = 0; rc == RP_OK && k < c->nsteps; k++) { /* in order: operands first */
        rp_sp_step *st = &c->steps[k];
        st->op = ops[k];
        if (st->op.kind == RP_CSR_GEMM)
            rc = rp_sp_product_setup(c, &c->mats[st->op.m], err);
        else if (st->op.kind == RP_CSR_MV)
            rc = rp_sp_mv_setup(c, st, err);
    }
    if (rc == RP_OK)
        rc = rp_sp_alloc(&c->work, c->work_size, err);
    return rc;
}

extern "C" int rp_cuda_cusparse_built(void) { return 1; }

extern "C" void rp_cuda_cusparse_free(rp_cusparse_chain *c)
{
    int prev = -1;
    if (c == NULL)
        return;
    /* the handle and memory belong to the device they were made on */
    if (cudaGetDevice(&prev) == cudaSuccess && prev != c->device)
        (void)cudaSetDevice(c->device);
    for (int64_t k = 0; c->steps != NULL && k < c->nsteps; k++) {
        rp_sp_step *st = &c->steps[k];
        for (int64_t i = 0; i < st->ninst; i++) {
            if (st->x != NULL && st->x[i] != NULL)
                (void)rp_sp.cusparseDestroyDnMat(st->x[i]);
            if (st->y != NULL && st->y[i] != NULL)
                (void)rp_sp.cusparseDestroyDnMat(st->y[i]);
        }
        free(st->x), free(st->y);
    }
    for (int64_t i = 0; c->mats != NULL && i < c->nmats; i++) {
        rp_sp_mat *m = &c->mats[i];
        for (int64_t j = 0; m->inst != NULL && j < m->ninst; j++) {
            rp_sp_inst *x = &m->inst[j];
            if (x->gemm != NULL)
                (void)rp_sp.cusparseSpGEMM_destroyDescr(x->gemm);
            if (x->mat != NULL)
                (void)rp_sp.cusparseDestroySpMat(x->mat);
            rp_sp_free(x->offsets), rp_sp_free(x->columns), rp_sp_free(x->values);
            rp_sp_free(x->buf4), rp_sp_free(x->buf5);
        }
        free(m->inst);
    }
    rp_sp_free(c->work);
    if (c->handle != NULL)
        (void)rp_sp.cusparseDestroy(c->handle);
    if (prev >= 0 && prev != c->device)
        (void)cudaSetDevice(prev);
    free(c->steps), free(c->mats), free(c);
}

/* The chain of typed rows, checked, on the stream's device. */
static int rp_sp_create(const char *library, int64_t nmats, const rp_sp_matrix *mats, int64_t nops,
                        const rp_sp_op *ops, const rp_sp_vectors *vec, cudaStream_t stream,
                        rp_cusparse_chain **out, rp_error *err)
{
    rp_device_guard guard;
    rp_cusparse_chain *c;
    int rc = rp_sp_check_chain(nmats, mats, nops, ops, vec, err);
    if (rc == RP_OK)
        rc = rp_sp_load(library, err);
    if (rc == RP_OK)
        rc = rp_sp_cuda(guard.enter(stream), err);
    if (rc != RP_OK)
        return rc;
    c = (rp_cusparse_chain *)calloc(1, sizeof *c);
    if (c == NULL)
        return rp_set_error(err, RP_ERUNTIME, "cuSPARSE peer: out of host memory");
    c->device = guard.dev, c->nmats = nmats, c->nsteps = nops, c->vec = *vec;
    c->mats = (rp_sp_mat *)calloc((size_t)nmats, sizeof *c->mats);
    c->steps = (rp_sp_step *)calloc((size_t)(nops > 0 ? nops : 1), sizeof *c->steps);
    rc = c->mats == NULL || c->steps == NULL
             ? rp_set_error(err, RP_ERUNTIME, "cuSPARSE peer: out of host memory")
             : rp_sp_build(c, mats, ops, stream, err);
    if (rc != RP_OK) {
        rp_cuda_cusparse_free(c);
        return rc;
    }
    *out = c;
    return RP_OK;
}

extern "C" int rp_cuda_cusparse_create(const char *library, int64_t nmats, const int64_t *mat_rows,
                                       int64_t nops, const int64_t *op_rows, float *vectors,
                                       int64_t batch, int64_t nvectors, int64_t stride, void *stream,
                                       rp_cusparse_chain **out, rp_error *err)
{
    const rp_sp_vectors vec = {vectors, batch, nvectors, stride};
    rp_sp_matrix *mats;
    rp_sp_op *ops;
    int rc;
    if (nmats < 1 || nops < 0 || mat_rows == NULL || (nops > 0 && op_rows == NULL) || out == NULL)
        return rp_set_error(err, RP_EINVAL, "cuSPARSE peer: no matrices or NULL tables");
    mats = (rp_sp_matrix *)malloc((size_t)nmats * sizeof *mats);
    ops = (rp_sp_op *)malloc((size_t)(nops > 0 ? nops : 1) * sizeof *ops);
    if (mats == NULL || ops == NULL)
        rc = rp_set_error(err, RP_ERUNTIME, "cuSPARSE peer: out of host memory");
    else {
        for (int64_t i = 0; i < nmats; i++)
            mats[i] = rp_sp_matrix_row(mat_rows + i * RP_CUSPARSE_MAT_COLS);
        for (int64_t k = 0; k < nops; k++)
            ops[k] = rp_sp_op_row(op_rows + k * RP_CSR_STEP_COLS);
        rc = rp_sp_create(library, nmats, mats, nops, ops, &vec, (cudaStream_t)stream, out, err);
    }
    free(mats), free(ops);
    return rc;
}

static int rp_sp_run_step(rp_cusparse_chain *c, const rp_sp_step *st, cudaStream_t stream, rp_error *err)
{
    const rp_sp_op *o = &st->op;
    rp_sp_mat *m = o->kind == RP_CSR_COPY ? NULL : &c->mats[o->m];
    int rc = RP_OK;
    if (o->kind == RP_CSR_COPY) {
        const size_t pitch = (size_t)c->vec.stride * sizeof(float);
        return rp_sp_cuda(cudaMemcpy2DAsync(rp_sp_slot(&c->vec, o->y, 0), pitch, rp_sp_slot(&c->vec, o->x, 0),
                                            pitch, (size_t)o->len * sizeof(float), (size_t)c->vec.batch,
                                            cudaMemcpyDeviceToDevice, stream),
                          err);
    }
    for (int64_t i = 0; rc == RP_OK && i < m->ninst; i++)
        if (o->kind == RP_CSR_GEMM)
            rc = rp_sp_check(rp_sp.cusparseSpGEMMreuse_compute(
                                 c->handle, RP_SP_NN, &rp_sp_one, rp_sp_operand(c, m->spec.a, i)->mat,
                                 rp_sp_operand(c, m->spec.b, i)->mat, &rp_sp_zero, m->inst[i].mat, CUDA_R_32F,
                                 CUSPARSE_SPGEMM_DEFAULT, m->inst[i].gemm),
                             "cusparseSpGEMMreuse_compute", err);
        else
            rc = rp_sp_check(rp_sp.cusparseSpMM(c->handle, RP_SP_NN, &rp_sp_one, m->inst[i].mat, st->x[i],
                                                &rp_sp_zero, st->y[i], CUDA_R_32F, CUSPARSE_SPMM_ALG_DEFAULT,
                                                c->work),
                             "cusparseSpMM", err);
    return rc;
}

extern "C" int rp_cuda_cusparse_run(rp_cusparse_chain *c, void *stream_, rp_error *err)
{
    cudaStream_t stream = (cudaStream_t)stream_;
    rp_device_guard guard;
    if (c == NULL)
        return rp_set_error(err, RP_EINVAL, "cuSPARSE peer: NULL chain");
    int rc = rp_sp_cuda(guard.enter(stream), err);
    if (rc == RP_OK && guard.dev != c->device)
        rc = rp_set_error(err, RP_EINVAL, "cuSPARSE peer: the stream is on device %d, the chain on %d",
                          guard.dev, c->device);
    if (rc == RP_OK)
        rc = rp_sp_check(rp_sp.cusparseSetStream(c->handle, stream), "cusparseSetStream", err);
    for (int64_t k = 0; rc == RP_OK && k < c->nsteps; k++)
        rc = rp_sp_run_step(c, &c->steps[k], stream, err);
    return rc;
}

#else /* built without cusparse.h: the peer says so */

struct rp_cusparse_chain {
    int unused;
};

extern "C" int rp_cuda_cusparse_built(void) { return 0; }

extern "C" void rp_cuda_cusparse_free(rp_cusparse_chain *c) { (void)c; }

extern "C" int rp_cuda_cusparse_create(const char *library, int64_t nmats, const int64_t *mat_rows,
                                       int64_t nops, const int64_t *op_rows, float *vectors,
                                       int64_t batch, int64_t nvectors, int64_t stride, void *stream,
                                       rp_cusparse_chain **out, rp_error *err)
{
    (void)library, (void)nmats, (void)mat_rows, (void)nops, (void)op_rows, (void)vectors;
    (void)batch, (void)nvectors, (void)stride, (void)stream, (void)out;
    return rp_set_error(err, RP_ERUNTIME, "cuSPARSE peer: reprop was built without cusparse.h");
}

extern "C" int rp_cuda_cusparse_run(rp_cusparse_chain *c, void *stream, rp_error *err)
{
    (void)c, (void)stream;
    return rp_set_error(err, RP_ERUNTIME, "cuSPARSE peer: reprop was built without cusparse.h");
}

#endif /* RP_HAVE_CUSPARSE */
