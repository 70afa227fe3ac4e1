/*
 * csr_emulation.cu: the CUDA runner of the sparse scan's programs
 * (rp_cuda_csr_run and rp_csr_kernel, at the end of kernels/scan.cu), run on
 * the host, must agree bit for bit with the CPU runner (rp_csr_run_cpu,
 * csrc/scan.c) and with the recurrence the programs compute.
 *
 * CI has nvcc but no GPU. This test includes scan.cu with the CUDA runtime
 * calls it makes renamed to host mocks (emu_runtime.h; the launch mock
 * below). The launch mock checks that the launch is rp_csr_kernel on the
 * call's stream and device, for the next non-empty phase of the program, with
 * the grid the launcher caps (RP_SCAN_MAX_GRID is 3 and RP_CSR_THREADS 32
 * here, so launches loop over their items), then runs every thread of every
 * block through the kernel itself (its host copy, emu_exec.h's executor:
 * its indices are the built-ins'), blocks first to last on one run and last
 * to first on another, each block's threads in one order on one run and the
 * other on the other: the results must be bitwise identical, which catches
 * an item that reads what another item of the same launch writes.
 *
 * Programs come from real plans: rp_csr_plan_create on random chains of n = 1
 * to 40 random CSR patterns (dense, diagonal, banded, random densities, empty;
 * 1 to 12 rows and columns; a quarter with a value_map, their values gathered
 * from fewer or more raw floats) whose leaves are all shared, none, or some
 * (two chains of each per n), for every levels from 0 to
 * rp_scan_max_levels(n + 1) (the plan has n + 1 slots), each run for B = 1,
 * 2, 3 and 13 (the CPU runner's blocks of 8 sequences and a rest). Each program
 * is first checked against the format's rules (phases and terms in order,
 * addresses in range, shared rows touching only shared, no row of a phase
 * writing what another row of it reads or writes, shared[0] never written).
 * The buffers start as NaN except shared[0] = 1, the leaves' values and g_n,
 * so a read of anything the program has not written shows; both are fenced
 * by canaries. The whole of both buffers after rp_cuda_csr_run must be
 * bitwise those of rp_csr_run_cpu (1 thread and 3) and of a serial reading
 * of the format (row by row, sequence by sequence), the leaves and g_n
 * unchanged, and every g_i within a rounding bound of the recurrence
 * g_i = J_i^T g_{i+1} evaluated in double (relative to the same recurrence
 * on absolute values, so cancellation does not hide an error). Random
 * synthetic programs add what plans may not have: empty phases, phases of
 * shared rows only, rows without terms, B up to 40.
 *
 * Also checked: one launch per non-empty phase, on the stream, with the
 * stream's device current during the launches and the caller's restored
 * after; B = 0 launches nothing; bad arguments give RP_EINVAL with nothing
 * launched; a refused launch, an error reported by cudaGetLastError and a
 * failing cudaGetDevice give RP_ERUNTIME with CUDA's text.
 *
 * What it cannot prove: anything only the device does (blocks and threads
 * running concurrently, coalescing, the generated code).
 *
 * Build and run (no GPU needed; -arch=sm_80 only because nvcc needs one):
 *   gcc -std=c11 -O3 -fopenmp -fno-math-errno -ffp-contract=off -Icsrc \
 *       -c csrc/scan.c -o scan.o                  (and csrc/common.c -> common.o)
 *   nvcc -std=c++17 -O2 --fmad=false -arch=sm_80 -Xcompiler -fopenmp,-ffp-contract=off \
 *       -Icsrc -Ikernels kernels/tests/csr_emulation.cu scan.o common.o -o csr_emulation
 *   ./csr_emulation          (about a second)
 * The kernel body runs as host code here: -ffp-contract=off keeps gcc from
 * fusing its multiply-adds. Exit status 0 when everything agrees; one
 * summary line either way.
 */
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#define RP_SCAN_MAX_GRID 3 /* every launch loops over its items */
#define RP_CSR_THREADS 32

#define EMU_DEVICES 3
#include "emu_runtime.h" /* CHECK; every runtime mock but launch and attribute */
#include "scan.cu"
#include "emu_faults.h" /* after reprop.h: rp_error */

/* scan.cu again, as host code: rp_csr_kernel itself, which the launch mock
 * runs for every thread of the grid (emu_exec.h), so that the item and
 * stride it derives from blockIdx, blockDim, gridDim and threadIdx are its
 * own, not the mock's restatement. */
#include "scan_host_copy.h"

static_assert(sizeof(emu_dev::rp_csr_args) == sizeof(rp_csr_args), "kernel arguments");

/* rp_csr_kernel, its host copy, for one thread. */
static void csr_thread(void *arg) { emu_dev::rp_csr_kernel(*(const emu_dev::rp_csr_args *)arg); }

/* ---------------------------------------------------------------------------
 * The emulated runtime
 * ------------------------------------------------------------------------- */

static struct {
    int launches;
    bool reverse; /* blocks, and threads within them, last to first */
} g_rt;

/* What the current call must launch: the non-empty phases of g, in order. */
static struct {
    const rp_csr_program *g;
    const rp_csr_device_rows *rows;
    int64_t B;
    float *seq, *shared;
    int64_t phase; /* the next phase to look at */
} g_expect;

static struct {
    long plans, runs, launches, blocks, looped;
} g_stats;

static cudaError_t mock_device_get_attribute(int *value, cudaDeviceAttr attr, int dev)
{
    CHECK(false, "attribute %d of device %d asked for", (int)attr, dev);
    *value = 0;
    return cudaSuccess;
}

static cudaError_t mock_launch_kernel(const void *fn, dim3 grid, dim3 block, void **args,
                                      size_t smem, cudaStream_t stream)
{
    const int index = g_rt.launches++;
    CHECK(fn == (const void *)rp_csr_kernel, "launch %d of a kernel other than rp_csr_kernel",
          index);
    if (fn != (const void *)rp_csr_kernel)
        return cudaErrorInvalidDeviceFunction;
    const cudaError_t injected = emu_injected_launch_error(index);
    if (injected != cudaSuccess)
        return injected;

    const rp_csr_args &a = *(const rp_csr_args *)args[0];
    const rp_csr_program *g = g_expect.g;
    emu_check_launch_site(grid, block, stream);
    CHECK(smem == 0, "launch %d with %zu bytes of shared memory", index, smem);
    CHECK(block.x == RP_CSR_THREADS, "launch %d of %u threads", index, block.x);

    int64_t p = g_expect.phase;
    while (p < g->nphases && g->phase_ptr[p + 1] == g->phase_ptr[p])
        p++;
    CHECK(p < g->nphases, "launch %d after the last non-empty phase", index);
    if (p >= g->nphases)
        return cudaSuccess;
    g_expect.phase = p + 1;
    const int64_t nseq = g->phase_shared[p] - g->phase_ptr[p];
    const int64_t nshared = g->phase_ptr[p + 1] - g->phase_shared[p];
    const int64_t items = nseq * g_expect.B + nshared;
    const int64_t blocks = (items + RP_CSR_THREADS - 1) / RP_CSR_THREADS;
    CHECK(a.begin == g->phase_ptr[p] && a.nseq == nseq && a.nshared == nshared && a.B == g_expect.B,
          "launch %d: rows %lld + %lld + %lld shared, B %lld; phase %lld: %lld + %lld + %lld, %lld",
          index, (long long)a.begin, (long long)a.nseq, (long long)a.nshared, (long long)a.B,
          (long long)p, (long long)g->phase_ptr[p], (long long)nseq, (long long)nshared,
          (long long)g_expect.B);
    CHECK(a.seq == g_expect.seq && a.shared == g_expect.shared &&
              a.rows.dst == g_expect.rows->dst && a.rows.term_ptr == g_expect.rows->term_ptr &&
              a.rows.tx == g_expect.rows->tx && a.rows.ty == g_expect.rows->ty,
          "launch %d: buffers or rows not the call's", index);
    CHECK((int64_t)grid.x == (blocks < RP_SCAN_MAX_GRID ? blocks : RP_SCAN_MAX_GRID),
          "launch %d: grid of %u for %lld items", index, grid.x, (long long)items);
    if (g_failures)
        return cudaSuccess;

    const int64_t stride = (int64_t)grid.x * block.x;
    emu_dev::rp_csr_args copy;
    memcpy(&copy, &a, sizeof copy);
    /* reversed: blocks last to first, each block's threads in the order the
     * forward run does not use */
    emu_run_grid_order(grid.x, block.x, csr_thread, &copy, g_rt.reverse, g_rt.reverse);
    g_stats.blocks += grid.x;
    g_stats.launches++;
    g_stats.looped += items > stride;
    return cudaSuccess;
}

/* ---------------------------------------------------------------------------
 * The format's meaning, its rules
 * ------------------------------------------------------------------------- */

static float *at(float *seq, float *shared, int64_t B, uint32_t addr, int64_t b)
{
    return (addr & RP_CSR_SHARED) ? shared + (addr & ~RP_CSR_SHARED) : seq + (int64_t)addr * B + b;
}

/* The format read literally: phase by phase, row by row, sequence by sequence. */
static void run_serial(const rp_csr_program *g, int64_t B, float *seq, float *shared)
{
    for (int64_t p = 0; p < g->nphases; p++)
        for (int64_t r = g->phase_ptr[p]; r < g->phase_ptr[p + 1]; r++)
            for (int64_t b = 0; b < (r < g->phase_shared[p] ? B : 1); b++) {
                float acc = 0.0f;
                for (int64_t t = g->term_ptr[r]; t < g->term_ptr[r + 1]; t++)
                    acc += *at(seq, shared, B, g->tx[t], b) * *at(seq, shared, B, g->ty[t], b);
                *at(seq, shared, B, g->dst[r], b) = acc;
            }
}

/* The rules of reprop.h that the kernel relies on; CHECKs name the first
 * violation. `n`: the layers whose leaf_addr (nval floats) and g_addr (dims)
 * to check (0: none). */
static void check_program(const rp_csr_program *g, int64_t n, const std::vector<int64_t> &nval,
                          const std::vector<int64_t> &dims)
{
    const int64_t S = g->seq_floats, H = g->shared_floats;
    bool ok = g->nphases >= 0 && g->nrows >= 0 && g->nterms >= 0 && S >= 0 && H >= 1 &&
              g->phase_ptr[0] == 0 && g->phase_ptr[g->nphases] == g->nrows && g->term_ptr[0] == 0 &&
              g->term_ptr[g->nrows] == g->nterms;
    CHECK(ok, "program sizes or array ends inconsistent");
    for (int64_t p = 0; ok && p < g->nphases; p++) {
        ok = g->phase_ptr[p] <= g->phase_shared[p] && g->phase_shared[p] <= g->phase_ptr[p + 1];
        CHECK(ok, "phase %lld: rows [%lld, %lld), shared from %lld", (long long)p,
              (long long)g->phase_ptr[p], (long long)g->phase_ptr[p + 1],
              (long long)g->phase_shared[p]);
    }
    for (int64_t r = 0; ok && r < g->nrows; r++) {
        ok = g->term_ptr[r] <= g->term_ptr[r + 1];
        CHECK(ok, "row %lld: terms not in order", (long long)r);
    }
    if (!ok)
        return;
    /* per address (seq, then shared): the phase and row that last wrote it, and read it */
    std::vector<int64_t> wphase((size_t)(S + H), -1), wrow((size_t)(S + H), -1),
        rphase((size_t)(S + H), -1), rrow((size_t)(S + H), -1);
    auto slot = [&](uint32_t addr, int64_t r, const char *what) -> int64_t {
        const int64_t off = addr & ~RP_CSR_SHARED;
        const bool in = (addr & RP_CSR_SHARED) ? off < H : off < S;
        CHECK(in, "row %lld: %s address %#x out of range (seq %lld, shared %lld floats)",
              (long long)r, what, addr, (long long)S, (long long)H);
        return in ? ((addr & RP_CSR_SHARED) ? S + off : off) : -1;
    };
    for (int64_t p = 0; p < g->nphases; p++)
        for (int64_t r = g->phase_ptr[p]; r < g->phase_ptr[p + 1]; r++) {
            const bool sh = r >= g->phase_shared[p];
            const int64_t d = slot(g->dst[r], r, "dst");
            if (d < 0)
                return;
            CHECK(!sh || (g->dst[r] & RP_CSR_SHARED), "shared row %lld writes seq", (long long)r);
            CHECK(sh || !(g->dst[r] & RP_CSR_SHARED), "per-sequence row %lld writes shared",
                  (long long)r);
            CHECK(g->dst[r] != RP_CSR_SHARED, "row %lld writes shared[0]", (long long)r);
            CHECK(wphase[(size_t)d] != p, "rows %lld and %lld of phase %lld write %#x",
                  (long long)wrow[(size_t)d], (long long)r, (long long)p, g->dst[r]);
            CHECK(rphase[(size_t)d] != p || rrow[(size_t)d] == r,
                  "row %lld writes %#x, which row %lld (-2: several) of phase %lld reads",
                  (long long)r, g->dst[r], (long long)rrow[(size_t)d], (long long)p);
            wphase[(size_t)d] = p, wrow[(size_t)d] = r;
            for (int64_t t = g->term_ptr[r]; t < g->term_ptr[r + 1]; t++) {
                const int64_t t0 = g->term_ptr[r];
                CHECK(((g->tx[t] ^ g->tx[t0]) & RP_CSR_SHARED) == 0 &&
                          ((g->ty[t] ^ g->ty[t0]) & RP_CSR_SHARED) == 0,
                      "row %lld: term %lld reads other buffers than its first term", (long long)r,
                      (long long)(t - t0));
                for (uint32_t x : {g->tx[t], g->ty[t]}) {
                    const int64_t s = slot(x, r, "term");
                    if (s < 0)
                        return;
                    CHECK(!sh || (x & RP_CSR_SHARED), "shared row %lld reads seq", (long long)r);
                    CHECK(wphase[(size_t)s] != p || wrow[(size_t)s] == r,
                          "row %lld reads %#x, which row %lld of the same phase %lld writes",
                          (long long)r, x, (long long)wrow[(size_t)s], (long long)p);
                    /* -2: read by several rows of the phase */
                    rrow[(size_t)s] = rphase[(size_t)s] == p && rrow[(size_t)s] != r ? -2 : r;
                    rphase[(size_t)s] = p;
                }
            }
            if (g_failures)
                return;
        }
    for (int64_t i = 0; i < n; i++) {
        const uint32_t la = g->leaf_addr[i], off = la & ~RP_CSR_SHARED;
        CHECK((int64_t)off + nval[(size_t)i] <= ((la & RP_CSR_SHARED) ? H : S),
              "leaf %lld at %#x, %lld floats: out of range", (long long)i, la,
              (long long)nval[(size_t)i]);
        CHECK(!(g->g_addr[i] & RP_CSR_SHARED) && (int64_t)g->g_addr[i] + dims[(size_t)i] <= S,
              "g_%lld at %#x, %lld floats: out of range", (long long)i, g->g_addr[i],
              (long long)dims[(size_t)i]);
    }
    if (n > 0)
        CHECK(!(g->g_out_addr & RP_CSR_SHARED) && (int64_t)g->g_out_addr + dims[(size_t)n] <= S,
              "g_n at %#x, %lld floats: out of range", g->g_out_addr, (long long)dims[(size_t)n]);
}

/* ---------------------------------------------------------------------------
 * One run: the CPU runners, then the emulated launcher forward and reversed
 * ------------------------------------------------------------------------- */

/* The program's row arrays as a caller's device copies. */
struct device_rows {
    std::vector<uint32_t> dst, tx, ty;
    std::vector<int64_t> term_ptr;
    rp_csr_device_rows r;
    explicit device_rows(const rp_csr_program *g)
        : dst(g->dst, g->dst + g->nrows), tx(g->tx, g->tx + g->nterms),
          ty(g->ty, g->ty + g->nterms), term_ptr(g->term_ptr, g->term_ptr + g->nrows + 1)
    {
        r = {dst.data(), term_ptr.data(), tx.data(), ty.data()};
    }
};

static int64_t nonempty_phases(const rp_csr_program *g)
{
    int64_t k = 0;
    for (int64_t p = 0; p < g->nphases; p++)
        k += g->phase_ptr[p + 1] > g->phase_ptr[p];
    return k;
}

/* Runs g on (seq0, shared0) through rp_csr_run_cpu (1 and 3 threads), the
 * serial reading and rp_cuda_csr_run forward and reversed; all must agree
 * bitwise. The result is left in (seq, shared). */
static void run_all(const rp_csr_program *g, int64_t B, const fenced &seq0, const fenced &shared0,
                    int device, fenced &seq, fenced &shared)
{
    char ctx[sizeof g_context];
    memcpy(ctx, g_context, sizeof ctx);
    rp_error err;
    fenced s1 = seq0, h1 = shared0, s2 = seq0, h2 = shared0;
    CHECK(rp_csr_run_cpu(g, B, s1.p(), h1.p(), 1, &err) == RP_OK, "rp_csr_run_cpu: %s", err.msg);
    CHECK(rp_csr_run_cpu(g, B, s2.p(), h2.p(), 3, &err) == RP_OK, "rp_csr_run_cpu: %s", err.msg);
    CHECK(s1.same(s2) && h1.same(h2), "rp_csr_run_cpu differs between 1 and 3 threads");
    seq = seq0, shared = shared0;
    run_serial(g, B, seq.p(), shared.p());
    CHECK(seq.same(s1) && shared.same(h1), "rp_csr_run_cpu differs from the serial reading");
    device_rows rows(g);
    for (int reverse = 0; reverse < 2; reverse++) {
        fenced sg = seq0, hg = shared0;
        snprintf(g_context, sizeof g_context, "%s%s", ctx, reverse ? " reversed" : "");
        g_emu.stream = emu_stream(device);
        g_emu.stream_device = device;
        g_emu.current_device = (device + 1) % EMU_DEVICES;
        g_rt.launches = 0;
        g_rt.reverse = reverse;
        g_expect = {g, &rows.r, B, sg.p(), hg.p(), 0};
        err.msg[0] = '\0';
        const int rc = rp_cuda_csr_run(g, &rows.r, B, sg.p(), hg.p(), (void *)g_emu.stream, &err);
        g_stats.runs++;
        CHECK(rc == RP_OK, "status %d: %s", rc, err.msg);
        CHECK(g_rt.launches == nonempty_phases(g), "%d launches for %lld non-empty phases",
              g_rt.launches, (long long)nonempty_phases(g));
        CHECK(g_emu.current_device == (device + 1) % EMU_DEVICES,
              "current device %d after the call", g_emu.current_device);
        CHECK(sg.intact() && hg.intact(), "a canary was overwritten");
        CHECK(sg.same(s1) && hg.same(h1), "differs bitwise from rp_csr_run_cpu");
    }
    memcpy(g_context, ctx, sizeof ctx);
}

/* ---------------------------------------------------------------------------
 * Chains of random CSR patterns, planned
 * ------------------------------------------------------------------------- */

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint32_t urand32(void)
{
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 32);
}
static int irand(int n) { return (int)(urand32() % (uint32_t)n); }
static float urand(float lo, float hi)
{
    return lo + (hi - lo) * (float)(urand32() >> 8) * (1.0f / 16777216.0f);
}

/* Layers i = 0..n-1: J_i^T (dims[i] x dims[i+1]), its pattern and sharing,
 * and the floats its caller gives: the nnz values, or (with a value map)
 * nval raw values of which value q is raw[vmap[q]]. */
struct chain {
    int64_t n;
    std::vector<int64_t> dims, nnz, nval, maxrow;
    std::vector<std::vector<int32_t>> indptr, indices, vmap;
    std::vector<rp_csr_pattern> leaves;
};

/* share: 0 none, 1 all, 2 each leaf at random. */
static void make_chain(int64_t n, int share, chain &c)
{
    c.n = n;
    c.dims.resize((size_t)n + 1);
    for (int64_t i = 0; i <= n; i++)
        c.dims[(size_t)i] = irand(6) == 0 ? 8 + irand(5) : 1 + irand(7);
    c.nnz.assign((size_t)n, 0);
    c.nval.assign((size_t)n, 0);
    c.vmap.assign((size_t)n, {});
    c.maxrow.assign((size_t)n, 0);
    c.indptr.assign((size_t)n, {});
    c.indices.assign((size_t)n, {});
    c.leaves.resize((size_t)n);
    for (int64_t i = 0; i < n; i++) {
        const int64_t R = c.dims[(size_t)i], C = c.dims[(size_t)i + 1];
        const int kind = irand(25); /* 0-2 dense, 3-5 diagonal, 6-8 banded, 9 empty, else random */
        const float density = urand(0.05f, 0.9f);
        std::vector<int32_t> &ip = c.indptr[(size_t)i], &ix = c.indices[(size_t)i];
        ip.push_back(0);
        for (int64_t r = 0; r < R; r++) {
            for (int64_t k = 0; k < C; k++) {
                bool on;
                if (kind <= 2)
                    on = true;
                else if (kind <= 5)
                    on = r == k;
                else if (kind <= 8)
                    on = llabs(r * C / R - k) <= 1;
                else if (kind == 9)
                    on = false;
                else
                    on = urand(0.0f, 1.0f) < density;
                if (on)
                    ix.push_back((int32_t)k);
            }
            ip.push_back((int32_t)ix.size());
            c.maxrow[(size_t)i] =
                std::max<int64_t>(c.maxrow[(size_t)i], ip[(size_t)r + 1] - ip[(size_t)r]);
        }
        c.nnz[(size_t)i] = c.nval[(size_t)i] = (int64_t)ix.size();
        if (!ix.empty() && irand(4) == 0) { /* a layer's weights, shared by several non-zeros */
            c.nval[(size_t)i] = 1 + irand((int)ix.size() + 2);
            for (size_t q = 0; q < ix.size(); q++)
                c.vmap[(size_t)i].push_back((int32_t)irand((int)c.nval[(size_t)i]));
        }
        rp_csr_pattern &leaf = c.leaves[(size_t)i];
        leaf = {};
        leaf.rows = R, leaf.cols = C, leaf.nnz = (int64_t)ix.size();
        leaf.indptr = ip.data(), leaf.indices = ix.data();
        leaf.shared = share == 2 ? irand(2) : share;
        if (!c.vmap[(size_t)i].empty())
            leaf.value_map = c.vmap[(size_t)i].data(), leaf.values = c.nval[(size_t)i];
    }
}

/* Values for B sequences: per leaf nval (shared) or B * nval (per sequence,
 * b-major here), and g_n (B * dims[n]). */
struct values {
    std::vector<std::vector<float>> leaf;
    std::vector<float> gout;
};

static void make_values(const chain &c, int64_t B, values &v)
{
    v.leaf.assign((size_t)c.n, {});
    for (int64_t i = 0; i < c.n; i++) {
        const float s = 1.7f / sqrtf((float)(c.maxrow[(size_t)i] > 0 ? c.maxrow[(size_t)i] : 1));
        const int64_t count = (c.leaves[(size_t)i].shared ? 1 : B) * c.nval[(size_t)i];
        const bool binary = irand(8) == 0; /* a ReLU's 0/1 diagonal */
        for (int64_t k = 0; k < count; k++)
            v.leaf[(size_t)i].push_back(binary ? (float)irand(2) : urand(-s, s));
    }
    v.gout.resize((size_t)(B * c.dims[(size_t)c.n]));
    for (float &x : v.gout)
        x = urand(-1.0f, 1.0f);
}

/* g_i of sequence b in double, and the same recurrence on |J| and |g_n|. */
static void reference(const chain &c, const values &v, int64_t b,
                      std::vector<std::vector<double>> &g, std::vector<std::vector<double>> &gabs)
{
    const int64_t n = c.n;
    g.assign((size_t)n + 1, {});
    gabs.assign((size_t)n + 1, {});
    for (int64_t k = 0; k < c.dims[(size_t)n]; k++) {
        g[(size_t)n].push_back(v.gout[(size_t)(b * c.dims[(size_t)n] + k)]);
        gabs[(size_t)n].push_back(fabs(g[(size_t)n].back()));
    }
    for (int64_t i = n - 1; i >= 0; i--) {
        const float *val =
            v.leaf[(size_t)i].data() + (c.leaves[(size_t)i].shared ? 0 : b * c.nval[(size_t)i]);
        const int32_t *vmap = c.vmap[(size_t)i].empty() ? NULL : c.vmap[(size_t)i].data();
        for (int64_t r = 0; r < c.dims[(size_t)i]; r++) {
            double s = 0.0, sa = 0.0;
            for (int32_t q = c.indptr[(size_t)i][(size_t)r]; q < c.indptr[(size_t)i][(size_t)r + 1];
                 q++) {
                const int32_t k = c.indices[(size_t)i][(size_t)q];
                const double x = val[vmap != NULL ? vmap[q] : q];
                s += x * g[(size_t)i + 1][(size_t)k];
                sa += fabs(x) * gabs[(size_t)i + 1][(size_t)k];
            }
            g[(size_t)i].push_back(s);
            gabs[(size_t)i].push_back(sa);
        }
    }
}

static double g_max_rel; /* max |g - reference| / its rounding bound, over every case */

static void run_plan(const chain &c, int L, int64_t B, int device)
{
    rp_csr_plan *plan = NULL;
    rp_error err;
    const rp_scan_machine m = {64, 100, 100};
    const int64_t n = c.n;
    CHECK(rp_csr_plan_create(n, c.leaves.data(), L, 0, &m, &plan, &err) == RP_OK, "plan: %s",
          err.msg);
    if (plan == NULL)
        return;
    const rp_csr_program *g = rp_csr_plan_program(plan);
    g_stats.plans++;
    check_program(g, n, c.nval, c.dims);
    if (g_failures) {
        rp_csr_plan_free(plan);
        return;
    }

    /* inputs: shared[0] = 1, the leaves' values (or raw values), g_n; NaN elsewhere */
    values v;
    make_values(c, B, v);
    fenced seq0, shared0, seq, shared;
    seq0.init(g->seq_floats * B, from_bits(0x7fa00000));
    shared0.init(g->shared_floats, from_bits(0x7fa00000));
    shared0.p()[0] = 1.0f;
    for (int64_t i = 0; i < n; i++) {
        const uint32_t a = g->leaf_addr[i];
        for (int64_t k = 0; k < c.nval[(size_t)i]; k++) {
            if (a & RP_CSR_SHARED)
                shared0.p()[(a & ~RP_CSR_SHARED) + k] = v.leaf[(size_t)i][(size_t)k];
            else
                for (int64_t b = 0; b < B; b++)
                    seq0.p()[(a + k) * B + b] =
                        v.leaf[(size_t)i][(size_t)(b * c.nval[(size_t)i] + k)];
        }
    }
    for (int64_t k = 0; k < c.dims[(size_t)n]; k++)
        for (int64_t b = 0; b < B; b++)
            seq0.p()[(g->g_out_addr + k) * B + b] = v.gout[(size_t)(b * c.dims[(size_t)n] + k)];

    run_all(g, B, seq0, shared0, device, seq, shared);

    /* the inputs unchanged */
    for (int64_t i = 0; i < n; i++) {
        const uint32_t a = g->leaf_addr[i];
        const int64_t len = (a & RP_CSR_SHARED) ? c.nval[(size_t)i] : c.nval[(size_t)i] * B;
        const int64_t off = (a & RP_CSR_SHARED) ? (a & ~RP_CSR_SHARED) : (int64_t)a * B;
        const float *now = ((a & RP_CSR_SHARED) ? shared.p() : seq.p()) + off;
        const float *was = ((a & RP_CSR_SHARED) ? shared0.p() : seq0.p()) + off;
        CHECK(memcmp(now, was, (size_t)len * 4) == 0, "leaf %lld's values were overwritten",
              (long long)i);
    }
    CHECK(memcmp(seq.p() + (int64_t)g->g_out_addr * B, seq0.p() + (int64_t)g->g_out_addr * B,
                 (size_t)(c.dims[(size_t)n] * B) * 4) == 0,
          "g_n was overwritten");
    CHECK(shared.p()[0] == 1.0f, "shared[0] was overwritten");

    /* g_i against the recurrence in double */
    const double bound = (double)(n + 1) * 16.0 * ldexp(1.0, -24);
    for (int64_t b = 0; b < B && !g_failures; b++) {
        std::vector<std::vector<double>> ref, refabs;
        reference(c, v, b, ref, refabs);
        for (int64_t i = 0; i < n; i++)
            for (int64_t k = 0; k < c.dims[(size_t)i]; k++) {
                const double got = seq.p()[(g->g_addr[i] + k) * B + b];
                const double e = fabs(got - ref[(size_t)i][(size_t)k]);
                const double tol = bound * refabs[(size_t)i][(size_t)k];
                CHECK(e <= tol + 1e-300,
                      "g_%lld[%lld] of sequence %lld: %.9g, reference %.9g (bound %.3g)",
                      (long long)i, (long long)k, (long long)b, got, ref[(size_t)i][(size_t)k],
                      tol);
                if (refabs[(size_t)i][(size_t)k] > 0)
                    g_max_rel = fmax(g_max_rel, e / tol);
                if (g_failures)
                    break;
            }
    }
    rp_csr_plan_free(plan);
}

static void sweep(void)
{
    const int64_t batches[] = {1, 2, 3, 13};
    int device = 0;
    for (int64_t n = 1; n <= 40; n++)
        for (int k = 0; k < 6; k++) { /* two chains of each sharing */
            const int share = k % 3;
            chain c;
            make_chain(n, share, c);
            for (int L = 0; L <= rp_scan_max_levels(n + 1); L++)
                for (int64_t B : batches) {
                    snprintf(g_context, sizeof g_context,
                             "n=%lld chain %d (share %d) levels=%d B=%lld", (long long)n, k, share,
                             L, (long long)B);
                    run_plan(c, L, B, device);
                    device = (device + 1) % EMU_DEVICES;
                    if (g_failures)
                        return;
                }
        }
}

/* ---------------------------------------------------------------------------
 * Synthetic programs: empty phases, shared-only phases, rows without terms
 * ------------------------------------------------------------------------- */

struct synthetic {
    std::vector<int64_t> phase_ptr, phase_shared, term_ptr;
    std::vector<uint32_t> dst, tx, ty;
    rp_csr_program g;
};

/* Per phase, fresh addresses to write, disjoint from those its rows read. */
static void make_synthetic(int64_t S, int64_t H, int nphases, synthetic &s)
{
    std::vector<uint32_t> seqa((size_t)S), sha((size_t)(H - 1));
    for (int64_t i = 0; i < S; i++)
        seqa[(size_t)i] = (uint32_t)i;
    for (int64_t i = 1; i < H; i++)
        sha[(size_t)i - 1] = (uint32_t)i | RP_CSR_SHARED;
    s.phase_ptr = {0};
    s.term_ptr = {0};
    for (int p = 0; p < nphases; p++) {
        for (size_t i = seqa.size(); i > 1; i--) /* shuffle: the first ones are written */
            std::swap(seqa[i - 1], seqa[(size_t)irand((int)i)]);
        for (size_t i = sha.size(); i > 1; i--)
            std::swap(sha[i - 1], sha[(size_t)irand((int)i)]);
        const int empty = irand(5) == 0, only_shared = irand(5) == 0;
        const int ns = empty || only_shared ? 0 : 1 + irand((int)S / 3);
        const int nh = empty ? 0 : irand((int)(H - 1) / 3 + 1);
        /* reads: the addresses past the written ones, and shared[0] */
        auto read_seq = [&]() { return seqa[(size_t)(ns + irand((int)S - ns))]; };
        auto read_shared = [&]() {
            const int avail = (int)sha.size() - nh;
            return avail == 0 || irand(9) == 0 ? RP_CSR_SHARED : sha[(size_t)(nh + irand(avail))];
        };
        s.phase_shared.push_back((int64_t)s.dst.size() + ns);
        for (int r = 0; r < ns + nh; r++) {
            const bool sh = r >= ns;
            s.dst.push_back(sh ? sha[(size_t)(r - ns)] : seqa[(size_t)r]);
            /* which buffer each operand reads: the same for every term of a row */
            const bool sx = sh || irand(2), sy = sh || irand(2);
            for (int t = irand(5); t > 0; t--) { /* rows without terms too */
                s.tx.push_back(sx ? read_shared() : read_seq());
                s.ty.push_back(sy ? read_shared() : read_seq());
            }
            s.term_ptr.push_back((int64_t)s.tx.size());
        }
        s.phase_ptr.push_back((int64_t)s.dst.size());
    }
    s.g = {};
    s.g.nphases = nphases;
    s.g.nrows = (int64_t)s.dst.size();
    s.g.nterms = (int64_t)s.tx.size();
    s.g.phase_ptr = s.phase_ptr.data();
    s.g.phase_shared = s.phase_shared.data();
    s.g.dst = s.dst.data();
    s.g.term_ptr = s.term_ptr.data();
    s.g.tx = s.tx.data();
    s.g.ty = s.ty.data();
    s.g.seq_floats = S;
    s.g.shared_floats = H;
}

static void synthetic_cases(void)
{
    const int64_t batches[] = {1, 2, 7, 19, 40};
    for (int k = 0; k < 300; k++) {
        synthetic s;
        make_synthetic(6 + irand(30), 4 + irand(12), 1 + irand(8), s);
        snprintf(g_context, sizeof g_context, "synthetic %d", k);
        check_program(&s.g, 0, {}, {});
        for (int64_t B : batches) {
            fenced seq0, shared0, seq, shared;
            seq0.init(s.g.seq_floats * B, 0.0f);
            shared0.init(s.g.shared_floats, 0.0f);
            for (int64_t i = 0; i < seq0.n; i++)
                seq0.p()[i] = urand(-1.0f, 1.0f);
            for (int64_t i = 0; i < shared0.n; i++)
                shared0.p()[i] = urand(-1.0f, 1.0f);
            snprintf(g_context, sizeof g_context, "synthetic %d B=%lld", k, (long long)B);
            run_all(&s.g, B, seq0, shared0, k % EMU_DEVICES, seq, shared);
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
    synthetic s;
    do /* a program of 3 non-empty phases at least */
        make_synthetic(20, 8, 6, s);
    while (nonempty_phases(&s.g) < 3);
    device_rows rows(&s.g);
    const int64_t B = 3;
    fenced seq, shared;
    seq.init(s.g.seq_floats * B, 0.5f);
    shared.init(s.g.shared_floats, 0.5f);
    g_emu.stream = emu_stream(1);
    g_emu.stream_device = 1;
    g_emu.current_device = 1;
    g_rt.reverse = false;
    g_expect = {&s.g, &rows.r, B, seq.p(), shared.p(), 0};

    /* bad arguments: RP_EINVAL, nothing launched */
    {
        rp_csr_program bad_order = s.g, null_phases = s.g, negative = s.g, below = s.g,
                       above = s.g;
        std::vector<int64_t> ps = s.phase_shared, pp = s.phase_ptr, pe = s.phase_ptr;
        ps[1] = s.phase_ptr[2] + 1;
        bad_order.phase_shared = ps.data();
        pp[0] = -1; /* phase 0 from row -1: ordered, but before the rows */
        below.phase_ptr = pp.data();
        /* the last phase ending past the rows: its kernel would read term_ptr
         * and dst past their ends */
        pe[(size_t)s.g.nphases] = s.g.nrows + 1;
        above.phase_ptr = pe.data();
        null_phases.phase_ptr = NULL;
        negative.nterms = -1;
        rp_csr_device_rows no_dst = rows.r, no_tx = rows.r;
        no_dst.dst = NULL;
        no_tx.tx = NULL;
        struct {
            const char *what;
            const rp_csr_program *g;
            const rp_csr_device_rows *rows;
            int64_t B;
            float *seq, *shared;
            const char *says; /* the message's start, when more than the function's name */
        } bad[] = {
            {"NULL program", NULL, &rows.r, B, seq.p(), shared.p()},
            {"NULL rows", &s.g, NULL, B, seq.p(), shared.p()},
            {"batch -1", &s.g, &rows.r, -1, seq.p(), shared.p(), "rp_cuda_csr_run: batch -1 < 0"},
            {"NULL seq", &s.g, &rows.r, B, NULL, shared.p()},
            {"NULL shared", &s.g, &rows.r, B, seq.p(), NULL},
            {"NULL device dst", &s.g, &no_dst, B, seq.p(), shared.p()},
            {"NULL device tx", &s.g, &no_tx, B, seq.p(), shared.p()},
            {"phases out of order", &bad_order, &rows.r, B, seq.p(), shared.p()},
            {"NULL phase_ptr", &null_phases, &rows.r, B, seq.p(), shared.p()},
            {"phase starting at row -1", &below, &rows.r, B, seq.p(), shared.p()},
            {"phase ending past the last row", &above, &rows.r, B, seq.p(), shared.p()},
            {"negative nterms", &negative, &rows.r, B, seq.p(), shared.p()},
            {"batch overflowing", &s.g, &rows.r, INT64_MAX / 4, seq.p(), shared.p()},
        };
        for (auto &c : bad) {
            snprintf(g_context, sizeof g_context, "error: %s", c.what);
            rp_error err;
            err.msg[0] = '\0';
            g_rt.launches = 0;
            const int rc = rp_cuda_csr_run(c.g, c.rows, c.B, c.seq, c.shared, g_emu.stream, &err);
            CHECK(rc == RP_EINVAL && strstr(err.msg, c.says ? c.says : "rp_cuda_csr_run") != NULL,
                  "status %d: %s", rc, err.msg);
            CHECK(g_rt.launches == 0, "%d launches", g_rt.launches);
        }
    }
    /* batch 0: nothing launched, nothing written (NULL seq allowed) */
    {
        snprintf(g_context, sizeof g_context, "error: batch 0");
        fenced before = shared;
        rp_error err;
        g_rt.launches = 0;
        const int rc = rp_cuda_csr_run(&s.g, &rows.r, 0, NULL, shared.p(), g_emu.stream, &err);
        CHECK(rc == RP_OK && g_rt.launches == 0 && shared.same(before), "status %d, %d launches",
              rc, g_rt.launches);
    }
    /* faults: a refused launch, an error found by cudaGetLastError, no device */
    emu_check_faults(3, g_rt.launches, "CUDA error in rp_cuda_csr_run", [&](rp_error &err) {
        g_expect = {&s.g, &rows.r, B, seq.p(), shared.p(), 0};
        return rp_cuda_csr_run(&s.g, &rows.r, B, seq.p(), shared.p(), g_emu.stream, &err);
    });
}

int main(void)
{
    catch_fatal_signals();
    synthetic_cases();
    if (!g_failures)
        sweep();
    if (!g_failures)
        error_cases();
    if (!g_failures) {
        snprintf(g_context, sizeof g_context, "coverage");
        CHECK(g_stats.looped > 0, "no launch looped over its items");
    }
    if (g_failures) {
        printf("csr_emulation: FAILED (%d failures; %ld plans, %ld runs, %ld launches)\n",
               g_failures, g_stats.plans, g_stats.runs, g_stats.launches);
        return 1;
    }
    printf("csr_emulation: OK (%ld plans, %ld runs, %ld launches (%ld looping), %ld blocks; "
           "max error vs double %.3f of the rounding bound)\n",
           g_stats.plans, g_stats.runs, g_stats.launches, g_stats.looped, g_stats.blocks,
           g_max_rel);
    return 0;
}
