/*
 * optim_emulation.cu: the CUDA optimizer launcher and kernels of kernels/optim.cu,
 * run on the host, must agree bit for bit with the CPU core (csrc/optim.c).
 *
 * CI has nvcc but no GPU. optim.cu is included twice:
 *
 *   - as it is, for its launcher (rp_cuda_optim_step), with the CUDA runtime
 *     calls it makes (cudaLaunchKernel, cudaGetDevice, cudaStreamIsCapturing,
 *     cudaStreamGetDevice, cudaSetDevice, cudaDeviceGetAttribute,
 *     cudaGetLastError) renamed to host
 *     mocks (emu_runtime.h; the launch and attribute mocks below); every other
 *     runtime call (cudaGetDeviceCount, cudaGetErrorString) is the real static
 *     runtime;
 *   - in namespace emu_dev, as host code (emu_host_begin.h: __global__ and
 *     __device__ read as __host__, __shared__ as static, the built-in indices
 *     and __syncthreads as emu_exec.h's executor's), its extern "C" entry
 *     points and the functions both copies would make ambiguous renamed; that
 *     copy's launchers are dead code.
 *
 * The launch mock checks the launch (kernel instantiation, grid, table), then
 * runs the very kernel bodies of optim.cu's host copy, rp_optim_kernel and
 * rp_step_increment_kernel, every thread of every block of the launch's grid
 * (emu_exec.h: threads as fibers, so that the capturable kernels'
 * __syncthreads waits for every thread of the block; shared memory NaN at
 * the start of each block; alternate blocks run their threads last to first,
 * so that a missing barrier reads the NaN).
 * Each case runs two steps through rp_cuda_optim_step and through
 * rp_optim_step_cpu on identical inputs and compares params, grads, every state
 * buffer and step counter byte for byte, with canary bytes around every buffer.
 *
 * What it proves, for every optimizer and its options, float32, float16 and
 * bfloat16, aligned, misaligned and 8-byte-aligned tensors, non-capturable and
 * capturable updates (with and without a device lr), and 1 to 132 SMs:
 *   - the kernel of each launch: the instantiation for the call's optimizer,
 *     dtype and capture mode;
 *   - the launch tables: each table tensor points into its entry at a chunk
 *     boundary with the right numel, state slots, step scalars or step pointer,
 *     and every element of every entry is updated exactly once;
 *   - the kernel bodies themselves, as compiled from optim.cu: each block's
 *     tensor, chunk and step scalars, the thread loops on the vector and the
 *     scalar path, tails included, and the step-increment kernel over its grid;
 *   - the vector-path decision: all used pointers 16-byte aligned (8 bytes for
 *     16-bit params and grads);
 *   - capturable updates: every step counter (zero-numel entries too) is
 *     incremented once, in as many increment launches as RP_STEP_TAB needs,
 *     before any update launch; consts and step scalars derived per block
 *     (by thread 0, shared past the barrier), from the device lr when given;
 *   - tables that fill up: several launches per call and a tensor continued in
 *     the next table (RP_TAB_TENSORS, RP_TAB_BLOCKS and RP_STEP_TAB are made
 *     small below, which optim.cu allows, so small inputs spill; RP_STEP_TAB
 *     still past the 128 counters of one increment block, so that a full step
 *     table is a grid of two);
 *   - the stream's device is current during the launches and restored after;
 *     a stream being captured into a CUDA graph is never asked its device
 *     (the real runtime's refusal would invalidate the capture);
 *   - error statuses: bad arguments give RP_EINVAL with nothing launched or
 *     written, CUDA errors (a refused launch, or one cudaGetLastError reports,
 *     of the step increments or of an update) give RP_ERUNTIME with CUDA's
 *     text (no update after failed increments), and
 *     rp_cuda_device_count() is 0 when the runtime finds no driver;
 *   - capturable Adam where beta2 ** step overflows the host's double: every
 *     param NaN, as torch's capturable Adam (checked apart: the C core, the
 *     reference of everything above, refuses that step on the host path).
 *
 * With --random N [--seed S] [--first I] it runs N cases drawn from the seed
 * instead of the grid (.ci/run runs a few thousand): any optimizer with any
 * options and edge hyper-parameters (0, tiny, huge, inf; tensor value kinds;
 * those the C core refuses are counted and skipped), any dtype and capture
 * mode, up to a few hundred tensors of sizes near the vector, block-step and
 * chunk edges, every buffer at its own offset, devices 4 to 63 with SM
 * counts drawn per seed (optim.cu caches each device's), blocks last to
 * first or not and either parity of blocks with threads reversed. A failed
 * case prints the arguments that rerun it alone. Both modes take a NaN for
 * any NaN (first_difference_nan_equal).
 *
 * What it cannot prove: anything only the device does: real 128-bit and 64-bit
 * loads and stores, shared memory banks, threads of a block running
 * concurrently (the executor's interleaving is one legal order), CUDA's
 * double pow and sqrt (the emulation uses the host's, as the CPU core does),
 * blocks running concurrently, and the device code nvcc generates (the
 * emulation runs the host compilation of the same source).
 *
 * Build (.ci/run does this): the CPU reference with setup.py's flags, then this
 * file with nvcc (optim.cu is CUDA C++), against the static CUDA runtime. Only
 * host code runs; -arch=sm_80 is there because __grid_constant__ needs sm_70+.
 *   gcc -std=c11 -O3 -fopenmp -fno-math-errno -ffp-contract=off -Icsrc \
 *       -c csrc/optim.c -o optim.o            (and csrc/common.c -> common.o)
 *   nvcc -std=c++17 -O2 --fmad=false -arch=sm_80 -Xcompiler -fopenmp,-ffp-contract=off \
 *       -Icsrc -Ikernels kernels/tests/optim_emulation.cu optim.o common.o -o optim_emulation
 * Without -ffp-contract=off on both sides the bitwise comparison is meaningless;
 * nvcc would compile the .c files with gcc's defaults (-ffp-contract=fast), hence gcc.
 * Exit status 0 when everything agrees; one summary line either way.
 */
#include <cuda_runtime.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <algorithm>
#include <vector>

/* Small tables, so that a few thousand elements already need several launches.
 * The step table stays above the increment kernel's 128 threads per block, so
 * that a full one is a grid of two blocks (a grid short of a block would leave
 * counters unincremented). */
#define RP_TAB_TENSORS 6
#define RP_TAB_BLOCKS 24
#define RP_STEP_TAB 200

/* The grid runs on devices 0 to 3; the random mode on the others, each with
 * an SM count drawn once (optim.cu caches each device's count). */
#define EMU_DEVICES 64
#define GRID_DEVICES 4
#include "emu_runtime.h" /* CHECK; every runtime mock but launch and attribute */
#include "optim.cu"

/* optim.cu again, as host code: the kernels the launch mock runs (see the top) */
#include "emu_exec.h"
#include "emu_host_begin.h"
#define rp_cuda_optim_step emu_dead_optim_step
#define rp_cuda_device_count emu_dead_device_count
#define rp_cuda_archs emu_dead_archs
/* Functions of both copies whose arguments are all of global types: argument-
 * dependent lookup finds the first copy's too, which nvcc finds ambiguous. */
#define rp_cuda_step_increment emu_dead_step_increment
#define rp_update_elem emu_host_update_elem
#define rp_capturable_scalars emu_host_capturable_scalars
namespace emu_dev {
#include "optim.cu"
} // namespace emu_dev
#undef rp_capturable_scalars
#undef rp_update_elem
#undef rp_cuda_step_increment
#undef rp_cuda_archs
#undef rp_cuda_device_count
#undef rp_cuda_optim_step
#include "emu_host_end.h"

static_assert(sizeof(emu_dev::rp_optim_launch) == sizeof(rp_optim_launch), "update table");
static_assert(sizeof(emu_dev::rp_step_launch) == sizeof(rp_step_launch), "step table");

#include "../../csrc/tests/optim_shared.h" /* base_hparams, elem_store: as test_core.c's */

#define STEPS_PER_CASE 2
#define BLOCK_STEP (4 * RP_THREADS) /* elements of one block step: chunks are multiples */

/* ---------------------------------------------------------------------------
 * The emulated runtime: devices, injected faults
 * ------------------------------------------------------------------------- */

/* The grid's SM counts; the random mode draws the other devices'. */
static int emu_sm_count[EMU_DEVICES] = {132, 1, 4, 7};

/* The order the executor runs blocks and threads in (emu_run_grid_order):
 * index order in the grid, drawn per case in the random mode. */
static bool g_blocks_reversed, g_odd_reversed;

typedef enum {
    FAULT_NONE,
    FAULT_GET_DEVICE,    /* cudaGetDevice fails */
    FAULT_STEP_LAUNCH,   /* the step-increment launch is refused */
    FAULT_UPDATE_LAUNCH, /* an update launch is refused */
    FAULT_LAST_ERROR,    /* an update launch "succeeds" but cudaGetLastError reports an error */
    FAULT_STEP_LAST_ERROR, /* likewise the step-increment launch */
} emu_fault;

static emu_fault g_fault;

static bool g_random_mode; /* --random: cases drawn at random, not the grid */

/* OPTIM_EMULATION_CHUNK=<elements> (random mode, mutation audit mut_kopt): the
 * cases run with the tuning override REPROP_CUDA_OPTIM_CHUNK set to it (optim.cu
 * reads it once per process, hence a variable of its own run), and every launch's
 * chunk must be it rounded up to a block step, capped at RP_HUGE_STEPS steps.
 * 0: the chunk heuristic (the override unset). */
static int64_t g_chunk_override;

static int64_t expected_override_chunk(void)
{
    const int64_t chunk = (g_chunk_override + BLOCK_STEP - 1) / BLOCK_STEP * BLOCK_STEP;
    return std::min<int64_t>(chunk, RP_HUGE_STEPS * BLOCK_STEP);
}

static bool emu_get_device_fails(void) { return g_fault == FAULT_GET_DEVICE; }

/* What the current rp_cuda_optim_step call is expected to launch, and what it did. */
typedef struct {
    int kind, dtype;
    bool capturable;
    unsigned slots; /* rp_optim_state_slots of the hyper-parameters */
    const rp_optim_entry *entries;
    int64_t n;
    const rp_step_scalars *scalars; /* non-capturable; may be NULL without step scalars */
    const uint8_t *expect_vec;      /* per entry: 1 when the vector path must be taken */
    std::vector<int64_t> updated;   /* elements updated per entry */
    int step_launches, update_launches;
    int partial_update_launches; /* tables with blocks and tensors to spare */
} emu_call;

static emu_call g_call;

/* What the grid exercised, to make sure no dimension is silently lost. */
typedef struct {
    long cases, calls, update_launches, step_launches;
    long vector_blocks, scalar_blocks;
    long multi_launch_calls;      /* calls with more than one update launch */
    long multi_step_launch_calls; /* capturable calls with more than one increment launch */
    long multi_block_step_launches; /* increment launches of more than one block */
    long continued_tensors;       /* table tensors that continue an entry begun earlier */
    long capped_chunks;           /* launches with chunks of RP_HUGE_STEPS block steps */
    std::vector<int> chunks;      /* the distinct chunk sizes launched */
    long device_switches;         /* calls on a stream of another device than the current */
    long captured_calls;          /* calls on a stream being captured into a CUDA graph */
    long refused_cases;           /* random cases whose hyper-parameters the C core refuses */
} emu_stats;

static emu_stats g_stats;

static cudaError_t mock_device_get_attribute(int *value, cudaDeviceAttr attr, int dev)
{
    CHECK(attr == cudaDevAttrMultiProcessorCount, "unexpected attribute %d", (int)attr);
    CHECK(dev >= 0 && dev < EMU_DEVICES, "attribute of device %d", dev);
    *value = emu_sm_count[dev >= 0 && dev < EMU_DEVICES ? dev : 0];
    return cudaSuccess;
}

/* ---------------------------------------------------------------------------
 * The emulated kernels
 * ------------------------------------------------------------------------- */

/* rp_step_increment_kernel, its host copy, for one thread. */
static void step_increment_thread(void *arg)
{
    emu_dev::rp_step_increment_kernel(*(const emu_dev::rp_step_launch *)arg);
}

static void step_increment_launch(const rp_step_launch &S, dim3 grid, dim3 block)
{
    CHECK(g_call.capturable && g_call.kind != RP_SGD, "step increment launched needlessly");
    CHECK(g_call.update_launches == 0, "step increment launched after an update launch");
    CHECK(S.n >= 1 && S.n <= RP_STEP_TAB, "step table of %d counters", S.n);
    CHECK((int64_t)grid.x * block.x >= S.n && (int64_t)(grid.x - 1) * block.x < S.n,
          "%u x %u threads for %d counters", grid.x, block.x, S.n);
    emu_dev::rp_step_launch copy;
    memcpy(&copy, &S, sizeof copy);
    emu_run_grid_order(grid.x, block.x, step_increment_thread, &copy, g_blocks_reversed,
                       g_odd_reversed);
    g_stats.multi_block_step_launches += grid.x > 1;
    g_call.step_launches++;
    g_stats.step_launches++;
}

/* rp_optim_kernel<KIND, DT, CAPT>, its host copy, for one thread. */
template <int KIND, int DT, bool CAPT> static void update_thread(void *arg)
{
    emu_dev::rp_optim_kernel<KIND, DT, CAPT>(*(const emu_dev::rp_optim_launch *)arg);
}

template <int KIND, int DT, bool CAPT>
static void emulate_grid(const rp_optim_launch &L, int nblocks, int nthreads)
{
    emu_dev::rp_optim_launch copy;
    memcpy(&copy, &L, sizeof copy);
    emu_run_grid_order((unsigned)nblocks, (unsigned)nthreads, update_thread<KIND, DT, CAPT>,
                       &copy, g_blocks_reversed, g_odd_reversed);
}

typedef void (*emulate_fn)(const rp_optim_launch &, int, int);

/* The emulation of rp_optim_kernel<KIND, DT, CAPT> and that kernel, the one
 * a launch must name: picked here from the call's kind, dtype and capture
 * mode, not through optim.cu's rp_update_kernel_for, so that a launcher
 * picking another instantiation (float16 for bfloat16, the non-capturable
 * kernel for a capturable call) shows. */
typedef struct {
    emulate_fn run;
    const void *kernel;
} emulator;

template <int KIND, int DT, bool CAPT> static emulator emulator_of(void)
{
    return {emulate_grid<KIND, DT, CAPT>, (const void *)rp_optim_kernel<KIND, DT, CAPT>};
}

template <int KIND, int DT>
static emulator emulator_capt(bool capturable)
{
    return capturable ? emulator_of<KIND, DT, true>() : emulator_of<KIND, DT, false>();
}

template <int KIND>
static emulator emulator_dtype(int dtype, bool capturable)
{
    switch (dtype) {
    case RP_F32:
        return emulator_capt<KIND, RP_F32>(capturable);
    case RP_F16:
        return emulator_capt<KIND, RP_F16>(capturable);
    default:
        return emulator_capt<KIND, RP_BF16>(capturable);
    }
}

static emulator emulator_for(int kind, int dtype, bool capturable)
{
    switch (kind) {
    case RP_SGD:
        return emulator_dtype<RP_SGD>(dtype, capturable);
    case RP_ADAM:
        return emulator_dtype<RP_ADAM>(dtype, capturable);
    case RP_ADAGRAD:
        return emulator_dtype<RP_ADAGRAD>(dtype, capturable);
    case RP_RMSPROP:
        return emulator_dtype<RP_RMSPROP>(dtype, capturable);
    default:
        return emulator_dtype<RP_ADADELTA>(dtype, capturable);
    }
}

/* ---------------------------------------------------------------------------
 * Launch-table checks
 * ------------------------------------------------------------------------- */

static int64_t param_size(int dtype) { return dtype == RP_F32 ? 4 : 2; }

/* The entry whose param holds `p`, and p's element offset in it; -1 if none. */
static int64_t find_entry(const void *p, int64_t *offset)
{
    const int64_t esize = param_size(g_call.dtype);
    for (int64_t j = 0; j < g_call.n; j++) {
        const rp_optim_entry &e = g_call.entries[j];
        const char *base = (const char *)e.param;
        if (e.numel > 0 && (const char *)p >= base && (const char *)p < base + e.numel * esize) {
            *offset = ((const char *)p - base) / esize;
            return j;
        }
    }
    return -1;
}

/* The flags byte entry j must get: vector path, state slots read and written. */
static unsigned expected_flags(int64_t j)
{
    const rp_optim_entry &e = g_call.entries[j];
    unsigned used = 0, load;
    for (int s = 0; s < 3; s++)
        if ((g_call.slots >> s & 1u) && e.state[s] != NULL)
            used |= 1u << s;
    load = used;
    if (g_call.kind == RP_SGD && (e.flags & RP_ENTRY_FRESH_BUFFER))
        load &= ~1u;
    return (g_call.expect_vec[j] ? RP_TF_VEC : 0u) | load << RP_TF_LOAD_SHIFT |
           used << RP_TF_STORE_SHIFT;
}

static bool same_float_bits(float a, float b) { return memcmp(&a, &b, sizeof a) == 0; }

/* Table tensor t against the entry it points into; returns the entry, or -1. */
static int64_t check_table_tensor(const rp_optim_launch &L, int t)
{
    const int64_t esize = param_size(g_call.dtype);
    int64_t off = 0;
    const int64_t j = find_entry(L.ptr[0][t], &off);
    CHECK(j >= 0, "table tensor %d: param pointer %p is in no entry", t, L.ptr[0][t]);
    if (j < 0)
        return -1;
    const rp_optim_entry &e = g_call.entries[j];
    const unsigned flags = expected_flags(j);
    const unsigned used = flags >> RP_TF_STORE_SHIFT & 7u;
    CHECK(off % L.chunk == 0, "entry %lld resumes at element %lld, inside a chunk of %d",
          (long long)j, (long long)off, L.chunk);
    CHECK(L.ptr[1][t] == (const char *)e.grad + off * esize, "entry %lld: grad pointer",
          (long long)j);
    for (int s = 0; s < 3; s++) {
        const void *want = (used >> s & 1u) ? (const void *)(e.state[s] + off) : NULL;
        CHECK(L.ptr[2 + s][t] == want, "entry %lld: state %d pointer", (long long)j, s);
    }
    CHECK(L.numel[t] == e.numel - off, "entry %lld: numel %lld from element %lld of %lld",
          (long long)j, (long long)L.numel[t], (long long)off, (long long)e.numel);
    CHECK(L.flags[t] == flags, "entry %lld: flags %#x, expected %#x", (long long)j, L.flags[t],
          flags);
    if (g_call.capturable) {
        CHECK(L.u.step[t] == e.step, "entry %lld: step pointer", (long long)j);
    } else {
        const float a = g_call.scalars != NULL ? g_call.scalars[j].a : 0.0f;
        const float b = g_call.scalars != NULL ? g_call.scalars[j].b : 1.0f;
        CHECK(same_float_bits(L.u.sc.a[t], a) && same_float_bits(L.u.sc.b[t], b),
              "entry %lld: step scalars (%g, %g), expected (%g, %g)", (long long)j,
              L.u.sc.a[t], L.u.sc.b[t], a, b);
    }
    if (off > 0)
        g_stats.continued_tensors++;
    return j;
}

/* The chunk rp_pick_chunk (optim.cu's own, its host copy) gives for the call's
 * total elements on the SM count of the launch's device (mutation audit
 * mut_kopt: the launcher's inputs to the heuristic, which no result depends
 * on, e.g. another device's cached SM count, went unnoticed). */
static int64_t expected_chunk(void)
{
    int64_t total = 0;
    for (int64_t i = 0; i < g_call.n; i++)
        total += std::max<int64_t>(g_call.entries[i].numel, 0);
    return emu_dev::rp_pick_chunk(total, emu_sm_count[g_emu.stream_device], BLOCK_STEP);
}

/* The table of one update launch of nblocks blocks; adds each block's elements
 * to g_call.updated. Returns false when the table cannot be emulated safely. */
static bool check_table(const rp_optim_launch &L, int nblocks)
{
    int64_t entry_of[RP_TAB_TENSORS];
    bool seen[RP_TAB_TENSORS] = {false};
    bool ok = true;
    int tensors = 0;

    CHECK(L.chunk > 0 && L.chunk % BLOCK_STEP == 0, "chunk %d", L.chunk);
    if (L.chunk <= 0 || L.chunk % BLOCK_STEP != 0)
        return false;
    CHECK(L.chunk == expected_chunk(), "chunk %d, not %lld: the call's total on its device's SMs",
          L.chunk, (long long)expected_chunk());
    CHECK(g_chunk_override == 0 || L.chunk == expected_override_chunk(),
          "chunk %d with REPROP_CUDA_OPTIM_CHUNK=%lld, not %lld", L.chunk,
          (long long)g_chunk_override, (long long)expected_override_chunk());
    if (L.chunk == RP_HUGE_STEPS * BLOCK_STEP)
        g_stats.capped_chunks++;
    if (std::find(g_stats.chunks.begin(), g_stats.chunks.end(), L.chunk) == g_stats.chunks.end())
        g_stats.chunks.push_back(L.chunk);
    for (int block = 0; block < nblocks; block++) {
        const int t = L.block_tensor[block];
        CHECK(t < RP_TAB_TENSORS, "block %d: tensor %d", block, t);
        if (t >= RP_TAB_TENSORS)
            return false;
        if (!seen[t]) {
            seen[t] = true;
            tensors++;
            entry_of[t] = check_table_tensor(L, t);
            ok = ok && entry_of[t] >= 0;
        }
        const int64_t start = (int64_t)(block - L.first_block[t]) * L.chunk;
        CHECK(start >= 0 && start < L.numel[t], "block %d: chunk start %lld of %lld elements",
              block, (long long)start, (long long)L.numel[t]);
        if (start < 0 || start >= L.numel[t] || entry_of[t] < 0)
            return false;
        const int64_t rest = L.numel[t] - start;
        g_call.updated[entry_of[t]] += rest < L.chunk ? rest : L.chunk;
        if (L.flags[t] & RP_TF_VEC)
            g_stats.vector_blocks++;
        else
            g_stats.scalar_blocks++;
    }
    g_call.partial_update_launches += nblocks < RP_TAB_BLOCKS && tensors < RP_TAB_TENSORS;
    return ok;
}

static void emulate_update(const void *fn, const rp_optim_launch &L, dim3 grid, dim3 block)
{
    const bool step_kind = g_call.kind != RP_SGD;
    const emulator em = emulator_for(g_call.kind, g_call.dtype, g_call.capturable);
    CHECK(fn == em.kernel, "wrong kernel for kind %d, dtype %d, capturable %d", g_call.kind,
          g_call.dtype, (int)g_call.capturable);
    CHECK(block.x == RP_THREADS, "%u threads per block", block.x);
    CHECK(grid.x >= 1 && grid.x <= RP_TAB_BLOCKS, "%u blocks", grid.x);
    CHECK(!(g_call.capturable && step_kind) || g_call.step_launches > 0,
          "update launched before the step increments");
    g_call.update_launches++;
    g_stats.update_launches++;
    if (grid.x < 1 || grid.x > RP_TAB_BLOCKS || !check_table(L, (int)grid.x))
        return;
    em.run(L, (int)grid.x, (int)block.x);
}

static cudaError_t mock_launch_kernel(const void *fn, dim3 grid, dim3 block, void **args,
                                      size_t smem, cudaStream_t stream)
{
    emu_check_launch_site(grid, block, stream);
    CHECK(smem == 0, "%zu bytes of shared memory", smem);
    if (fn == (const void *)rp_step_increment_kernel) {
        if (g_fault == FAULT_STEP_LAUNCH) {
            g_emu.pending = cudaErrorLaunchOutOfResources;
            return cudaErrorLaunchOutOfResources;
        }
        if (g_fault == FAULT_STEP_LAST_ERROR) {
            g_emu.pending = cudaErrorLaunchFailure;
            return cudaSuccess;
        }
        step_increment_launch(*(const rp_step_launch *)args[0], grid, block);
        return cudaSuccess;
    }
    if (g_fault == FAULT_UPDATE_LAUNCH) {
        g_emu.pending = cudaErrorInvalidConfiguration;
        return cudaErrorInvalidConfiguration;
    }
    if (g_fault == FAULT_LAST_ERROR) {
        g_emu.pending = cudaErrorLaunchFailure;
        return cudaSuccess;
    }
    emulate_update(fn, *(const rp_optim_launch *)args[0], grid, block);
    return cudaSuccess;
}

/* ---------------------------------------------------------------------------
 * Test data: guarded buffers, tensors, cases
 * ------------------------------------------------------------------------- */

static float rng_uniform(rng64 *r, float lo, float hi) /* in [lo, hi) */
{
    return lo + (hi - lo) * ((float)(rng_next(r) >> 40) * (1.0f / 16777216.0f));
}

/* n values in [lo, hi) of `dtype`; with `specials`, every 97th is tiny (a float16
 * subnormal) and every 89th exactly zero. */
static void fill_values(void *dst, int dtype, int64_t n, float lo, float hi, bool specials,
                        rng64 *r)
{
    for (int64_t i = 0; i < n; i++) {
        float v = rng_uniform(r, lo, hi);
        if (specials && i % 97 == 5)
            v = 1e-6f * rng_uniform(r, -1.0f, 1.0f);
        if (specials && i % 89 == 7)
            v = 0.0f;
        elem_store(dtype, dst, i, v);
    }
}

/* Values are drawn once into a pool per kind of buffer; a buffer copies its pool
 * from a random start, wrapping around (drawing every value afresh would take
 * most of the run time). */
#define POOL_ELEMS 65521 /* prime: no repeats at chunk-sized periods */

typedef struct {
    int dtype;
    float lo, hi;
    bool specials;
    std::vector<unsigned char> values;
} value_pool;

static std::vector<value_pool> g_pools;

static const value_pool &pool_for(int dtype, float lo, float hi, bool specials)
{
    for (const value_pool &p : g_pools)
        if (p.dtype == dtype && p.lo == lo && p.hi == hi && p.specials == specials)
            return p;
    rng64 r = {1000 + g_pools.size()};
    g_pools.push_back({dtype, lo, hi, specials, {}});
    value_pool &p = g_pools.back();
    p.values.resize((size_t)POOL_ELEMS * (size_t)param_size(dtype));
    fill_values(p.values.data(), dtype, POOL_ELEMS, lo, hi, specials, &r);
    return p;
}

static void fill_from_pool(void *dst, int dtype, int64_t n, float lo, float hi, bool specials,
                           rng64 *r)
{
    const value_pool &p = pool_for(dtype, lo, hi, specials);
    const size_t esize = (size_t)param_size(dtype);
    int64_t start = (int64_t)(rng_next(r) % POOL_ELEMS), done = 0;
    while (done < n) {
        const int64_t take = n - done < POOL_ELEMS - start ? n - done : POOL_ELEMS - start;
        memcpy((char *)dst + done * esize, p.values.data() + start * esize, take * esize);
        done += take;
        start = 0;
    }
}

/* Plausible values of state slot `slot` (squares and their averages >= 0; the
 * centered RMSprop's grad_avg small enough that square_avg - grad_avg^2 > 0). */
static void state_range(int kind, int slot, float *lo, float *hi)
{
    *lo = 0.0f;
    *hi = 0.1f;
    if (kind == RP_SGD || (kind == RP_ADAM && slot == 0) || (kind == RP_RMSPROP && slot == 1))
        *lo = -0.1f; /* momentum buffers, exp_avg */
    else if (kind == RP_ADAM)
        *hi = 0.01f; /* exp_avg_sq, max_exp_avg_sq */
    else if (kind == RP_RMSPROP && slot == 0)
        *lo = 0.01f; /* square_avg */
    else if (kind == RP_RMSPROP && slot == 2) {
        *lo = -0.05f; /* grad_avg */
        *hi = 0.05f;
    }
}

/* RANDOM_OFFSETS (the random mode only): every buffer at its own offset. */
typedef enum { ALIGNED, MIXED, EIGHT_BYTES, N_MISALIGNMENTS, RANDOM_OFFSETS = N_MISALIGNMENTS }
    misalignment;

static const char *const misalignment_names[N_MISALIGNMENTS + 1] = {
    "aligned", "mixed misaligned", "param/grad 8-byte aligned", "random offsets"};

/* The random mode's offsets of a case derive from this and the entry index,
 * so that a case's twin (build_case's `from`) gets the same ones. */
static uint64_t g_offset_salt;

/* Byte offsets of entry i's buffers from a 64-byte boundary. */
typedef struct {
    size_t param, grad, state[3];
} buffer_offsets;

static buffer_offsets offsets_for(misalignment m, size_t i, size_t esize)
{
    buffer_offsets o = {0, 0, {0, 0, 0}};
    if (m == MIXED) {
        if (i % 3 == 1)
            o.param = esize; /* one element */
        if (i % 5 == 2)
            o.grad = 2 * esize;
        if (i % 11 == 5)
            o.state[0] = 4; /* one float */
        if (i % 7 == 3)
            o.state[1] = 8;
        if (i % 13 == 6)
            o.state[2] = 12;
    } else if (m == EIGHT_BYTES) {
        o.param = 8; /* enough for 16-bit vectors (8 bytes), not for float32 ones */
        o.grad = 8;
    } else if (m == RANDOM_OFFSETS) {
        rng64 r = {g_offset_salt * 1000003u + i}; /* element (param, grad) or float offsets */
        o.param = rng_next(&r) % 3 == 0 ? esize * (rng_next(&r) % 16) : 0;
        o.grad = rng_next(&r) % 3 == 0 ? esize * (rng_next(&r) % 16) : 0;
        for (int s = 0; s < 3; s++)
            o.state[s] = rng_next(&r) % 4 == 0 ? 4 * (rng_next(&r) % 16) : 0;
    }
    return o;
}

/* optim.cu's rule, from the offsets: E = 4 elements of param and grad, and
 * float4s of every state slot the update uses, must be naturally aligned. */
static bool vector_path_expected(const buffer_offsets &o, unsigned used_slots, size_t esize)
{
    bool vec = o.param % (4 * esize) == 0 && o.grad % (4 * esize) == 0;
    for (int s = 0; s < 3; s++)
        if (used_slots >> s & 1u)
            vec = vec && o.state[s] % 16 == 0;
    return vec;
}

typedef struct {
    guarded_buffer param, grad, state[3];
    float step;
} tensor_data;

/* The tensors of one call; entries point into them. */
typedef struct {
    std::vector<tensor_data> tensors;
    std::vector<rp_optim_entry> entries;
    std::vector<uint8_t> expect_vec;
} case_data;

/* The values of `dst`: copied from `from`, or drawn when `from` is NULL. */
static void set_values(guarded_buffer *dst, const guarded_buffer *from, int dtype, int64_t n,
                       float lo, float hi, bool specials, rng64 *r)
{
    if (from != NULL)
        memcpy(buffer_data(dst), from->storage.data() + from->offset, dst->size);
    else
        fill_from_pool(buffer_data(dst), dtype, n, lo, hi, specials, r);
}

/* Entry i and its tensors; their values those of `from` when not NULL. */
static void build_tensor(case_data *cd, size_t i, const rp_optim_hparams &hp, int dtype,
                         int64_t numel, misalignment m, const tensor_data *from, rng64 *r)
{
    const size_t esize = (size_t)param_size(dtype);
    const unsigned slots = rp_optim_state_slots(&hp);
    const buffer_offsets o = offsets_for(m, i, esize);
    tensor_data *t = &cd->tensors[i];
    rp_optim_entry *e = &cd->entries[i];
    unsigned used = 0;

    buffer_allocate(&t->param, (size_t)numel * esize, o.param);
    buffer_allocate(&t->grad, (size_t)numel * esize, o.grad);
    set_values(&t->param, from ? &from->param : NULL, dtype, numel, -1.0f, 1.0f, true, r);
    set_values(&t->grad, from ? &from->grad : NULL, dtype, numel, -0.5f, 0.5f, true, r);
    e->param = buffer_data(&t->param);
    e->grad = buffer_data(&t->grad);
    e->numel = numel;
    for (int s = 0; s < 3; s++) {
        float lo = -1.0f, hi = 1.0f;
        const bool slot_used = slots >> s & 1u;
        /* An unused slot is NULL in even entries; odd ones get a buffer the update
         * must leave alone. */
        if (!slot_used && i % 2 == 0)
            continue;
        if (slot_used)
            state_range(hp.kind, s, &lo, &hi);
        buffer_allocate(&t->state[s], (size_t)numel * 4, o.state[s]);
        set_values(&t->state[s], from ? &from->state[s] : NULL, RP_F32, numel, lo, hi, false,
                   r);
        e->state[s] = (float *)buffer_data(&t->state[s]);
        used |= slot_used ? 1u << s : 0u;
    }
    if (hp.kind != RP_SGD) {
        t->step = (float)(i * 7 % 10);
        e->step = &t->step;
        /* SGD's flag on another optimizer's entry reads nothing different: its
         * slot 0 is state all the same (mutation audit mut_kopt: skipping
         * the load of slot 0 for any flagged entry survived) */
        if (i % 2 == 1)
            e->flags = RP_ENTRY_FRESH_BUFFER;
    } else if (i % 2 == 0) {
        e->flags = RP_ENTRY_FRESH_BUFFER; /* momentum buffer created by this step */
    } else {
        /* SGD keeps no step count: a counter passed anyway stays as it is, as
         * the CPU core leaves it (mutation audit mut_kopt: capturable SGD
         * calls incrementing counters survived) */
        t->step = (float)i;
        e->step = &t->step;
    }
    cd->expect_vec[i] = vector_path_expected(o, used, esize);
}

/* Tensors of the given sizes, their values drawn from `seed`, or (`from` not
 * NULL: a twin) those of `from`, built from the same arguments. */
static void build_case(case_data *cd, const rp_optim_hparams &hp, int dtype,
                       const std::vector<int64_t> &sizes, misalignment m, uint64_t seed,
                       const case_data *from = NULL)
{
    rng64 r = {seed};
    const size_t n = sizes.size();
    cd->tensors.clear();
    cd->tensors.resize(n);
    cd->entries.assign(n, rp_optim_entry());
    cd->expect_vec.assign(n, 0);
    for (size_t i = 0; i < n; i++)
        build_tensor(cd, i, hp, dtype, sizes[i], m, from ? &from->tensors[i] : NULL, &r);
}

/* Element bits `b` of `dtype` are a NaN. */
static bool is_nan_bits(uint32_t b, int dtype)
{
    if (dtype == RP_F32)
        return (b & 0x7fffffffu) > 0x7f800000u;
    if (dtype == RP_BF16)
        return (b & 0x7fffu) > 0x7f80u;
    return (b & 0x7fffu) > 0x7c00u;
}

/* The first element where two buffers of `dtype` differ, or -1: bit for
 * bit, except that a NaN equals any NaN (as fad_emulation.cu compares). Their
 * sign and payload carry no meaning: the device's arithmetic returns its
 * canonical NaN, and on the host the C core's compilation and the kernels'
 * host copy may order operands or fold a negation differently (x86 returns
 * the first NaN operand; a negation flips a NaN's sign): the random mode's
 * RMSprop with lr = 1e30 ended at NaN 0x7fc0 here, 0xffc0 on the CPU. */
static int64_t first_difference_nan_equal(guarded_buffer *want, guarded_buffer *got, int dtype)
{
    const size_t esize = dtype == RP_F32 ? 4 : 2;
    const int64_t first = first_difference(want, got, esize); /* bit for bit: the fast path */
    if (first < 0 || want->size != got->size)
        return first;
    const unsigned char *w = (const unsigned char *)buffer_data(want);
    const unsigned char *g = (const unsigned char *)buffer_data(got);
    for (size_t i = (size_t)first; i < want->size / esize; i++) {
        uint32_t wb = 0, gb = 0;
        memcpy(&wb, w + i * esize, esize);
        memcpy(&gb, g + i * esize, esize);
        if (wb != gb && !(is_nan_bits(wb, dtype) && is_nan_bits(gb, dtype)))
            return (int64_t)i;
    }
    return -1;
}

static bool compare_buffer(guarded_buffer *want, guarded_buffer *got, int dtype,
                           const char *what, size_t i)
{
    const size_t esize = dtype == RP_F32 ? 4 : 2;
    const int64_t at = first_difference_nan_equal(want, got, dtype);
    const bool guards = buffer_guards_intact(got);
    CHECK(guards, "write out of bounds of %s of tensor %zu", what, i);
    uint32_t want_bits = 0, got_bits = 0; /* the element's bytes, for the report */
    if (at >= 0) {
        memcpy(&want_bits, (const char *)buffer_data(want) + (size_t)at * esize, esize);
        memcpy(&got_bits, (const char *)buffer_data(got) + (size_t)at * esize, esize);
    }
    CHECK(at < 0, "%s of tensor %zu differs from the CPU's at element %lld: 0x%x, CPU 0x%x",
          what, i, (long long)at, got_bits, want_bits);
    return at < 0 && guards;
}

/* Everything of `got` equal, byte for byte, to `want`. */
static bool compare_cases(case_data *want, case_data *got, int dtype)
{
    for (size_t i = 0; i < want->tensors.size(); i++) {
        tensor_data *w = &want->tensors[i], *g = &got->tensors[i];
        bool ok = compare_buffer(&w->param, &g->param, dtype, "param", i) &&
                  compare_buffer(&w->grad, &g->grad, dtype, "grad", i);
        static const char *const names[3] = {"state 0", "state 1", "state 2"};
        for (int s = 0; s < 3 && ok; s++)
            ok = compare_buffer(&w->state[s], &g->state[s], RP_F32, names[s], i);
        if (ok) {
            CHECK(same_float_bits(w->step, g->step), "step of tensor %zu: %g, CPU %g", i,
                  (double)g->step, (double)w->step);
            ok = same_float_bits(w->step, g->step);
        }
        if (!ok)
            return false;
    }
    return true;
}

/* ---------------------------------------------------------------------------
 * The grid: hyper-parameters, sizes, launch configurations
 * ------------------------------------------------------------------------- */

typedef struct {
    const char *name;
    rp_optim_hparams hp;
} hparam_config;

/* Every optimizer, each option at least once. */
static std::vector<hparam_config> hparam_configs(void)
{
    std::vector<hparam_config> v;
    rp_optim_hparams h = base_hparams(RP_SGD);
    v.push_back({"sgd", h});
    h.momentum = 0.9;
    v.push_back({"sgd momentum", h});
    h.nesterov = 1;
    h.weight_decay = 0.01;
    v.push_back({"sgd nesterov weight_decay", h});
    h.nesterov = 0;
    h.dampening = 0.1;
    h.maximize = 1;
    v.push_back({"sgd dampening maximize", h});

    h = base_hparams(RP_ADAM);
    v.push_back({"adam", h});
    h.weight_decay = 0.01;
    v.push_back({"adam weight_decay", h});
    h.decoupled_weight_decay = 1;
    v.push_back({"adamw", h});
    h.amsgrad = 1;
    v.push_back({"adamw amsgrad", h});
    h.decoupled_weight_decay = 0;
    h.maximize = 1;
    v.push_back({"adam amsgrad maximize", h});
    h.beta1 = 0.3; /* lerp weight >= 0.5: ATen's other formula */
    v.push_back({"adam amsgrad maximize beta1=0.3", h});
    h = base_hparams(RP_ADAM);
    h.beta1 = 0.5; /* lerp weight exactly 0.5: still the other formula (|w| < 0.5 is not) */
    v.push_back({"adam beta1=0.5", h});
    /* 1 - lr * weight_decay rounded once is 0.79f, torch's two float32 ops
     * on a float32 tensor lr (capturable) give 0.78999996f */
    h = base_hparams(RP_ADAM);
    h.lr = 0.7;
    h.weight_decay = 0.3;
    h.decoupled_weight_decay = 1;
    v.push_back({"adamw lr=0.7 weight_decay=0.3", h});
    /* bfloat16 tensor betas: the bias corrections in bfloat16 (rp_lr_kind) */
    h = base_hparams(RP_ADAM);
    h.beta1 = 0.90234375;
    h.beta2 = 0.98828125;
    h.beta1_kind = h.beta2_kind = RP_LR_BF16;
    v.push_back({"adam bfloat16 betas", h});

    h = base_hparams(RP_ADAGRAD);
    v.push_back({"adagrad", h});
    h.lr_decay = 0.01;
    h.weight_decay = 0.1;
    h.maximize = 1;
    v.push_back({"adagrad lr_decay weight_decay maximize", h});
    /* tensor lr and lr_decay of two dtypes: the capturable kernel's step size
     * must divide with lr_decay's kind (found missing by the random mode) */
    h = base_hparams(RP_ADAGRAD);
    h.lr_decay = 0.01;
    h.lr_kind = RP_LR_F16;
    h.lr_decay_kind = RP_LR_F32;
    v.push_back({"adagrad float16 tensor lr, float32 tensor lr_decay", h});

    h = base_hparams(RP_RMSPROP);
    v.push_back({"rmsprop", h});
    h.momentum = 0.5;
    v.push_back({"rmsprop momentum", h});
    h.centered = 1;
    v.push_back({"rmsprop momentum centered", h});
    h.momentum = 0.0;
    h.weight_decay = 0.1;
    h.maximize = 1;
    v.push_back({"rmsprop centered weight_decay maximize", h});

    h = base_hparams(RP_ADADELTA);
    h.lr = 1.0;
    v.push_back({"adadelta", h});
    h.weight_decay = 0.1;
    h.maximize = 1;
    v.push_back({"adadelta weight_decay maximize", h});
    return v;
}

typedef struct {
    const char *name;
    std::vector<int64_t> sizes;
    bool sampled; /* too big for the whole grid: one case per hyper-parameter config */
} size_set;

/* With RP_TAB_TENSORS 6 and RP_TAB_BLOCKS 24, chunks are 2048 to 16384 elements
 * (by SM count) until a call has more than 24 x 2048; then they grow to fit one
 * table, up to 65536. */
static std::vector<size_set> size_sets(void)
{
    std::vector<size_set> v;
    v.push_back({"no tensors", {}, false});
    v.push_back({"empty tensors only", {0, 0, 0}, false});
    v.push_back({"vector-width edges", {1, 3, 4, 5}, false});
    v.push_back({"block-step and chunk edges", {1023, 1024, 1025, 2047, 2048, 2049, 4097}, false});
    v.push_back({"mixed with empties", {0, 7, 0, 6149, 13, 64, 65, 1, 2, 3, 4, 9999, 0}, false});
    v.push_back({"table full of blocks", {9000, 9000, 9000, 9000, 9001}, false});
    v.push_back({"chunks grown to fit a table", {70001, 3, 30000}, false});
    {
        size_set many = {"many tensors", {}, false};
        for (int i = 0; i < 40; i++)
            many.sizes.push_back(i * 7919 % 3000 + (i % 3 == 0 ? 5000 : 0));
        v.push_back(many);
    }
    v.push_back({"largest chunks, split over tables", {1600001, 77}, true});
    {
        /* more step counters than a step table holds (RP_STEP_TAB), more
         * than one increment block's (128) in the first table */
        size_set steps = {"step tables of several blocks", {}, true};
        for (int i = 0; i < 2 * RP_STEP_TAB - 130; i++)
            steps.sizes.push_back(i % 4);
        v.push_back(steps);
    }
    return v;
}

typedef enum { NOT_CAPTURABLE, CAPTURABLE, CAPTURABLE_LR_PTR, N_CAPTURE_MODES } capture_mode;

static const char *const capture_names[N_CAPTURE_MODES] = {
    "not capturable", "capturable", "capturable with device lr"};

/* Where a call runs: the current device and the stream (on its own device),
 * which may be being captured into a CUDA graph. */
typedef struct {
    const char *name;
    int current_device;
    cudaStream_t stream;
    int stream_device;
    bool capturing;
} launch_config;

static std::vector<launch_config> launch_configs(void)
{
    std::vector<launch_config> v;
    v.push_back({"default stream, device 0 (132 SMs)", 0, NULL, 0});
    v.push_back({"stream of device 1 (1 SM) from device 0", 0, emu_stream(1), 1});
    v.push_back({"per-thread stream, device 2 (4 SMs)", 2, cudaStreamPerThread, 2});
    v.push_back({"stream of device 3 (7 SMs), current", 3, emu_stream(3), 3});
    v.push_back({"legacy stream, device 1 (1 SM)", 1, cudaStreamLegacy, 1});
    /* its device cannot be asked (emu_runtime.h): the current one, the Python
     * callers' tensors' */
    v.push_back({"stream of device 2 (4 SMs) being captured, current", 2, emu_stream(2), 2, true});
    return v;
}

/* ---------------------------------------------------------------------------
 * One case: STEPS_PER_CASE steps on the CPU and through the emulated launcher
 * ------------------------------------------------------------------------- */

typedef struct {
    const hparam_config *config;
    int dtype;
    const size_set *sizes;
    misalignment misalign;
    capture_mode capture;
} case_spec;

static void expect_call(const rp_optim_hparams &hp, int dtype, bool capturable, case_data *cd,
                        const rp_step_scalars *scalars, const launch_config &lc)
{
    g_call.kind = hp.kind;
    g_call.dtype = dtype;
    g_call.capturable = capturable;
    g_call.slots = rp_optim_state_slots(&hp);
    g_call.entries = cd->entries.data();
    g_call.n = (int64_t)cd->entries.size();
    g_call.scalars = scalars;
    g_call.expect_vec = cd->expect_vec.data();
    g_call.updated.assign(cd->entries.size(), 0);
    g_call.step_launches = 0;
    g_call.update_launches = 0;
    g_call.partial_update_launches = 0;
    g_emu.current_device = lc.current_device;
    g_emu.stream = lc.stream;
    g_emu.stream_device = lc.stream_device;
    g_emu.capturing = lc.capturing;
}

/* After a successful call: everything updated once, the device restored. */
static void check_call_done(const case_data *cd, const launch_config &lc)
{
    int64_t steps = 0, total = 0;
    for (size_t j = 0; j < cd->entries.size(); j++) {
        const rp_optim_entry &e = cd->entries[j];
        CHECK(g_call.updated[j] == e.numel, "entry %zu: %lld of %lld elements updated", j,
              (long long)g_call.updated[j], (long long)e.numel);
        steps += e.step != NULL;
        total += e.numel;
    }
    if (g_call.capturable && g_call.kind != RP_SGD) {
        const int64_t want = (steps + RP_STEP_TAB - 1) / RP_STEP_TAB;
        CHECK(g_call.step_launches == want, "%d increment launches for %lld counters",
              g_call.step_launches, (long long)steps);
    }
    CHECK((g_call.update_launches > 0) == (total > 0), "%d update launches for %lld elements",
          g_call.update_launches, (long long)total);
    /* a table is launched when full, but the last (mutation audit mut_kopt:
     * tables one block short of full survived) */
    CHECK(g_call.partial_update_launches <= 1, "%d of %d update launches with room left",
          g_call.partial_update_launches, g_call.update_launches);
    CHECK(g_emu.current_device == lc.current_device, "device %d current after the call, not %d",
          g_emu.current_device, lc.current_device);
    g_stats.calls++;
    g_stats.multi_launch_calls += g_call.update_launches > 1;
    g_stats.multi_step_launch_calls += g_call.step_launches > 1;
    g_stats.device_switches += lc.stream_device != lc.current_device;
    g_stats.captured_calls += lc.capturing;
}

/* One step through rp_cuda_optim_step, as csrc/module_cuda.c makes it. */
static int emulated_step(const case_spec &spec, int iteration, case_data *cd,
                         const launch_config &lc, const float *device_lr)
{
    rp_optim_hparams hp = spec.config->hp;
    const int64_t n = (int64_t)cd->entries.size();
    const bool capturable = spec.capture != NOT_CAPTURABLE;
    std::vector<rp_step_scalars> scalars((size_t)n);
    const rp_step_scalars *sc = NULL;
    rp_error err = {{0}};
    int rc;

    if (spec.capture == CAPTURABLE_LR_PTR) {
        hp.lr = 123.0; /* must not be used */
        hp.lr_ptr = device_lr;
    }
    if (!capturable) {
        rc = rp_optim_advance_steps(&hp, cd->entries.data(), n, scalars.data(), &err);
        CHECK(rc == RP_OK, "%s", err.msg);
        /* Only Adam and Adagrad need the scalars: the others may pass NULL. */
        const bool needs_scalars = hp.kind == RP_ADAM || hp.kind == RP_ADAGRAD;
        sc = needs_scalars || iteration % 2 == 0 ? scalars.data() : NULL;
    }
    expect_call(hp, spec.dtype, capturable, cd, sc, lc);
    rc = rp_cuda_optim_step(&hp, spec.dtype, cd->entries.data(), sc, n, capturable ? 1 : 0,
                            (void *)lc.stream, &err);
    CHECK(rc == RP_OK, "rp_cuda_optim_step: status %d: %s", rc, err.msg);
    rp_optim_entries_done(cd->entries.data(), n);
    if (rc == RP_OK)
        check_call_done(cd, lc);
    return rc;
}

static void describe_case(const case_spec &spec, int iteration, const launch_config &lc)
{
    snprintf(g_context, sizeof g_context, "%s, %s, '%s', %s, %s, step %d, %s",
             spec.config->name, rp_dtype_name(spec.dtype), spec.sizes->name,
             misalignment_names[spec.misalign], capture_names[spec.capture], iteration + 1,
             lc.name);
}

/* Returns false on the first disagreement. */
static bool run_case(const case_spec &spec, const std::vector<launch_config> &configs,
                     uint64_t seed)
{
    const rp_optim_hparams &hp = spec.config->hp;
    const float device_lr = (float)hp.lr;
    rp_optim_hparams hp_cpu = hp;
    case_data cpu, emu;
    rp_error err = {{0}};

    build_case(&cpu, hp, spec.dtype, spec.sizes->sizes, spec.misalign, seed);
    build_case(&emu, hp, spec.dtype, spec.sizes->sizes, spec.misalign, seed, &cpu);
    if (spec.capture == CAPTURABLE_LR_PTR) {
        /* what the device reads: a float32 tensor lr, which torch computes
         * with in float32 tensor ops (AdamW's 1 - lr * weight_decay, Adam's
         * lr / (1 - beta1 ** step)) */
        hp_cpu.lr = (double)device_lr;
        hp_cpu.lr_kind = RP_LR_F32;
    }
    g_stats.cases++;
    for (int it = 0; it < STEPS_PER_CASE; it++) {
        const launch_config &lc = configs[(size_t)(g_stats.cases + it) % configs.size()];
        const int failures = g_failures;
        describe_case(spec, it, lc);
        const int rc = rp_optim_step_cpu(&hp_cpu, spec.dtype, cpu.entries.data(),
                                         (int64_t)cpu.entries.size(), 1, &err);
        if (rc == RP_EINVAL && g_random_mode) {
            /* hyper-parameters torch refuses: the C core's tests cover the refusal */
            g_stats.refused_cases++;
            return true;
        }
        CHECK(rc == RP_OK, "rp_optim_step_cpu: status %d: %s", rc, err.msg);
        if (rc != RP_OK || emulated_step(spec, it, &emu, lc, &device_lr) != RP_OK)
            return false;
        if (!compare_cases(&cpu, &emu, spec.dtype) || g_failures != failures)
            return false;
    }
    return true;
}

/* ---------------------------------------------------------------------------
 * Error statuses
 * ------------------------------------------------------------------------- */

static void check_status(const char *what, int rc, int want, const rp_error &err,
                         const char *text)
{
    snprintf(g_context, sizeof g_context, "status: %s", what);
    CHECK(rc == want, "status %d, expected %d (%s)", rc, want, err.msg);
    CHECK(text == NULL || strstr(err.msg, text) != NULL, "message '%s' lacks '%s'", err.msg,
          text);
}

/* A rejected call on `cd` (built as in test_argument_errors): the status, nothing
 * launched, nothing written. */
static void expect_rejected(const char *what, const rp_optim_hparams *hp, int dtype,
                            case_data *cd, const rp_step_scalars *scalars, int capturable,
                            int want, const char *text)
{
    static const launch_config lc = {"device 0", 0, NULL, 0};
    case_data untouched;
    rp_error err = {{0}};
    build_case(&untouched, base_hparams(RP_ADAM), RP_F32, {100, 9}, ALIGNED, 7);
    if (hp->kind >= RP_SGD && hp->kind <= RP_ADADELTA)
        expect_call(*hp, dtype, capturable != 0, cd, scalars, lc);
    else
        expect_call(base_hparams(RP_ADAM), dtype, capturable != 0, cd, scalars, lc);
    const int rc = rp_cuda_optim_step(hp, dtype, cd->entries.data(), scalars,
                                      (int64_t)cd->entries.size(), capturable, NULL, &err);
    check_status(what, rc, want, err, text);
    CHECK(g_call.step_launches == 0 && g_call.update_launches == 0, "launched anyway");
    compare_cases(&untouched, cd, RP_F32);
}

static void test_argument_errors(void)
{
    const rp_optim_hparams adam = base_hparams(RP_ADAM);
    const rp_step_scalars scalars[2] = {{-1e-3f, 1.0f}, {-1e-3f, 1.0f}};
    rp_optim_hparams hp = adam;
    case_data cd;
    rp_error err = {{0}};

    build_case(&cd, adam, RP_F32, {100, 9}, ALIGNED, 7);
    expect_rejected("bad dtype", &adam, 7, &cd, scalars, 0, RP_EINVAL, "dtype code 7");
    hp.kind = 9;
    expect_rejected("bad kind", &hp, RP_F32, &cd, scalars, 0, RP_EINVAL, "kind 9");
    expect_rejected("adam without scalars", &adam, RP_F32, &cd, NULL, 0, RP_EINVAL,
                    "step scalars are required");
    hp = base_hparams(RP_ADAGRAD);
    expect_rejected("adagrad without scalars", &hp, RP_F32, &cd, NULL, 0, RP_EINVAL,
                    "step scalars are required");

    cd.entries[1].state[1] = NULL;
    expect_rejected("missing state slot", &adam, RP_F32, &cd, scalars, 1, RP_EINVAL,
                    "state slot 1 is required");
    build_case(&cd, adam, RP_F32, {100, 9}, ALIGNED, 7);
    cd.entries[0].step = NULL;
    expect_rejected("missing step", &adam, RP_F32, &cd, scalars, 1, RP_EINVAL,
                    "step pointer is required");
    build_case(&cd, adam, RP_F32, {100, 9}, ALIGNED, 7);
    cd.entries[1].numel = -1;
    expect_rejected("negative numel", &adam, RP_F32, &cd, scalars, 0, RP_EINVAL,
                    "negative numel");

    check_status("null hyper-parameters",
                 rp_cuda_optim_step(NULL, RP_F32, NULL, NULL, 0, 0, NULL, &err), RP_EINVAL, err,
                 "null hyper-parameters");
    {
        const long queries = g_emu.get_device_calls;
        const int rc = rp_cuda_optim_step(&adam, RP_F32, NULL, NULL, 0, 0, NULL, &err);
        check_status("no entries", rc, RP_OK, err, NULL);
        CHECK(g_emu.get_device_calls == queries, "the runtime was queried for nothing");
    }
}

/* A call on another device's stream that meets `fault`: RP_ERUNTIME with the
 * CUDA error's text, the error cleared and the current device restored. */
static void expect_runtime_error(const char *what, emu_fault fault, int capturable,
                                 cudaError_t error)
{
    static const launch_config lc = {"stream of device 2 from device 0", 0, emu_stream(2), 2};
    const rp_optim_hparams adam = base_hparams(RP_ADAM);
    std::vector<rp_step_scalars> scalars(2);
    case_data cd;
    rp_error err = {{0}};

    build_case(&cd, adam, RP_F32, {100, 9}, ALIGNED, 7);
    CHECK(rp_optim_advance_steps(&adam, cd.entries.data(), 2, scalars.data(), &err) == RP_OK,
          "%s", err.msg);
    expect_call(adam, RP_F32, capturable != 0, &cd, capturable ? NULL : scalars.data(), lc);
    snprintf(g_context, sizeof g_context, "status: %s", what);
    g_fault = fault;
    const int rc = rp_cuda_optim_step(&adam, RP_F32, cd.entries.data(),
                                      capturable ? NULL : scalars.data(), 2, capturable,
                                      (void *)lc.stream, &err);
    g_fault = FAULT_NONE;
    check_status(what, rc, RP_ERUNTIME, err, cudaGetErrorString(error));
    if (fault == FAULT_STEP_LAUNCH || fault == FAULT_STEP_LAST_ERROR)
        CHECK(g_call.update_launches == 0, "%d update launches after the failed increments",
              g_call.update_launches);
    CHECK(g_emu.pending == cudaSuccess, "the CUDA error was left pending");
    CHECK(g_emu.current_device == lc.current_device, "device %d left current",
          g_emu.current_device);
}

static void test_runtime_errors(void)
{
    expect_runtime_error("cudaGetDevice fails", FAULT_GET_DEVICE, 0, cudaErrorNoDevice);
    expect_runtime_error("step increment launch fails", FAULT_STEP_LAUNCH, 1,
                         cudaErrorLaunchOutOfResources);
    expect_runtime_error("update launch fails", FAULT_UPDATE_LAUNCH, 0,
                         cudaErrorInvalidConfiguration);
    expect_runtime_error("launch error reported later", FAULT_LAST_ERROR, 1,
                         cudaErrorLaunchFailure);
    expect_runtime_error("step increment error reported later", FAULT_STEP_LAST_ERROR, 1,
                         cudaErrorLaunchFailure);
}

/* Capturable calls whose counters all lie in entries the C core checks
 * nothing of (zero numel, no step pointer): nothing to increment, so no
 * increment launch, whose empty grid a device refuses (mutation audit
 * mut_kopt: an empty increment launch survived). After a full step table too. */
static void test_stepless_empty_entries(void)
{
    static const launch_config lc = {"default stream", 0, NULL, 0};
    const rp_optim_hparams adam = base_hparams(RP_ADAM);
    const std::vector<int64_t> counts = {2, RP_STEP_TAB + 2};
    for (const int64_t n : counts) {
        case_data cd;
        rp_error err = {{0}};
        build_case(&cd, adam, RP_F32, std::vector<int64_t>((size_t)n, 0), ALIGNED, 7);
        for (int64_t i = n == 2 ? 0 : RP_STEP_TAB; i < n; i++)
            cd.entries[(size_t)i].step = NULL;
        expect_call(adam, RP_F32, true, &cd, NULL, lc);
        snprintf(g_context, sizeof g_context, "status: %lld empty entries, the last stepless",
                 (long long)n);
        const int rc = rp_cuda_optim_step(&adam, RP_F32, cd.entries.data(), NULL, n, 1,
                                          (void *)lc.stream, &err);
        check_status("stepless empty entries", rc, RP_OK, err, NULL);
        if (rc == RP_OK)
            check_call_done(&cd, lc);
    }
}

/* Capturable Adam where beta2 ** step overflows the host's double to inf
 * (beta2 beyond 1, finite as a float32, made by hand after the optimizer's
 * check): torch's capturable Adam computes 1 - beta2 ** step in float32
 * tensor ops, -inf, and its tensor square root is NaN, so every param is
 * NaN (torch 2.13's own capturable arithmetic on the CPU, its device check
 * lifted: exp_avg and exp_avg_sq stay 0 with zero gradients and state, the
 * step counts on). The C core refuses that step on the host path (Python's
 * beta2 ** step overflows), so the cases above, run against it, never reach
 * it (mutation audit, session 44: O04, the host's square root, inf for a
 * Python number, in the kernel left the params as they were). */
static void test_capturable_adam_past_the_beta2_power(void)
{
    static const launch_config lc = {"default stream", 0, NULL, 0};
    static const struct {
        double beta2;
        float step; /* the counter before the call */
    } overflows[] = {{1e34, 9.0f}, {1.5, 2000.0f}};
    for (const auto &o : overflows) {
        rp_optim_hparams adam = base_hparams(RP_ADAM);
        adam.beta2 = o.beta2;
        case_data cd;
        rp_error err = {{0}};
        build_case(&cd, adam, RP_F32, {5, 2 * BLOCK_STEP + 3}, ALIGNED, 11);
        for (tensor_data &t : cd.tensors) {
            for (guarded_buffer *b : {&t.grad, &t.state[0], &t.state[1]})
                memset(buffer_data(b), 0, b->size);
            t.step = o.step;
        }
        expect_call(adam, RP_F32, true, &cd, NULL, lc);
        const int rc = rp_cuda_optim_step(&adam, RP_F32, cd.entries.data(), NULL,
                                          (int64_t)cd.entries.size(), 1, (void *)lc.stream, &err);
        check_status("capturable Adam past the beta2 power", rc, RP_OK, err, NULL);
        if (rc != RP_OK)
            continue;
        check_call_done(&cd, lc);
        snprintf(g_context, sizeof g_context, "capturable Adam, beta2 %g from step %g", o.beta2,
                 (double)o.step);
        for (size_t i = 0; i < cd.entries.size(); i++) {
            const rp_optim_entry &e = cd.entries[i];
            CHECK(*e.step == o.step + 1.0f, "tensor %zu: step %g", i, (double)*e.step);
            int64_t k = 0;
            while (k < e.numel && isnan(elem_load(RP_F32, e.param, k)) &&
                   e.state[0][k] == 0.0f && e.state[1][k] == 0.0f)
                k++;
            CHECK(k == e.numel, "tensor %zu, element %lld: param %g (not NaN), moments %g, %g",
                  i, (long long)k, (double)elem_load(RP_F32, e.param, k), (double)e.state[0][k],
                  (double)e.state[1][k]);
        }
    }
}

/* The real runtime answers: without a driver (CI) the count must be 0. */
static int test_device_count(void)
{
    const int count = rp_cuda_device_count();
    int real = 0;
    const cudaError_t e = cudaGetDeviceCount(&real);
    snprintf(g_context, sizeof g_context, "rp_cuda_device_count");
    if (e != cudaSuccess)
        CHECK(count == 0, "%d devices, but the runtime says: %s", count, cudaGetErrorString(e));
    else
        CHECK(count == real, "%d devices, the runtime counts %d", count, real);
    return count;
}

/* ---------------------------------------------------------------------------
 * Main
 * ------------------------------------------------------------------------- */

/* Every dimension must have been exercised. */
static void check_coverage(void)
{
    snprintf(g_context, sizeof g_context, "coverage");
    CHECK(g_stats.vector_blocks > 0 && g_stats.scalar_blocks > 0, "vector or scalar path unused");
    CHECK(g_stats.multi_launch_calls > 0, "no call needed several update launches");
    CHECK(g_stats.continued_tensors > 0, "no tensor continued in a second table");
    CHECK(g_stats.multi_step_launch_calls > 0, "no call needed several increment launches");
    CHECK(g_stats.multi_block_step_launches > 0, "no increment launch of several blocks");
    CHECK(g_stats.chunks.size() >= 6, "only %zu chunk sizes", g_stats.chunks.size());
    CHECK(g_stats.capped_chunks > 0, "chunks never reached RP_HUGE_STEPS block steps");
    CHECK(g_stats.device_switches > 0, "no call on another device's stream");
    CHECK(g_stats.captured_calls > 0, "no call on a stream being captured");
    CHECK(g_exec.barriers > 0, "no emulated thread reached a barrier");
}

/* Sampled sets run one (dtype, misalignment, capture mode) combination per
 * hyper-parameter config h, spread over all 27 by a stride of 7. */
static bool sampled_case(size_t h, int dtype, int m, int cm)
{
    const size_t combo = ((size_t)dtype * N_MISALIGNMENTS + (size_t)m) * N_CAPTURE_MODES + cm;
    return combo == h * 7 % (3 * N_MISALIGNMENTS * N_CAPTURE_MODES);
}

static bool run_grid(void)
{
    const std::vector<hparam_config> hps = hparam_configs();
    const std::vector<size_set> sets = size_sets();
    const std::vector<launch_config> configs = launch_configs();
    uint64_t seed = 1;
    int failed_cases = 0;

    for (size_t h = 0; h < hps.size(); h++)
        for (int dtype = RP_F32; dtype <= RP_BF16; dtype++)
            for (const size_set &set : sets)
                for (int m = 0; m < N_MISALIGNMENTS; m++)
                    for (int cm = 0; cm < N_CAPTURE_MODES; cm++) {
                        const case_spec spec = {&hps[h], dtype, &set, (misalignment)m,
                                                (capture_mode)cm};
                        if (set.sampled && !sampled_case(h, dtype, m, cm))
                            continue;
                        if (!run_case(spec, configs, seed++) && ++failed_cases >= 10)
                            return false;
                    }
    return failed_cases == 0;
}

/* ---------------------------------------------------------------------------
 * The random mode: cases the grid does not walk
 * ------------------------------------------------------------------------- */

/* A hyper-parameter's rp_lr_kind: mostly a Python number. */
static int random_value_kind(rng64 *r)
{
    return rng_below(r, 3) == 0 ? (int)rng_below(r, 5) : RP_LR_NUMBER;
}

/* Hyper-parameters of a random optimizer, edge values included (those the C
 * core refuses are skipped by run_case). */
static rp_optim_hparams random_hparams(rng64 *r)
{
    static const double lrs[] = {1e-2, 0.0, 1e-40, 1e-30, 0.7, 1.0, 3.0, 1e30, INFINITY};
    static const double decays[] = {0.0, 0.0, 0.01, 0.3, 1e-40, 1e3, INFINITY};
    static const double epss[] = {1e-8, 0.0, 1e-30, 1.0, 1e-3, INFINITY};
    static const double beta1s[] = {0.9, 0.0, 0.3, 0.5, 0.999, 1.0, 0.90234375};
    static const double beta2s[] = {0.999, 0.0, 0.5, 0.99999, 0.98828125, INFINITY};
    static const double momenta[] = {0.0, 0.9, 0.5, 1.0, 1e-40};
    static const double dampenings[] = {0.0, 0.1, 1.0};
    static const double alphas[] = {0.99, 0.0, 0.5, 1.0};
    static const double rhos[] = {0.9, 0.0, 0.99, 1.0};
    static const double lr_decays[] = {0.0, 0.01, 1.0, 1e3};
    rp_optim_hparams h = base_hparams((int)rng_below(r, 5));
    h.lr = pick(r, lrs);
    h.weight_decay = pick(r, decays);
    h.eps = pick(r, epss);
    h.beta1 = pick(r, beta1s);
    h.beta2 = pick(r, beta2s);
    h.momentum = pick(r, momenta);
    h.dampening = pick(r, dampenings);
    h.alpha = pick(r, alphas);
    h.rho = pick(r, rhos);
    h.lr_decay = pick(r, lr_decays);
    h.nesterov = (int)rng_below(r, 2);
    h.maximize = (int)rng_below(r, 2);
    h.amsgrad = (int)rng_below(r, 2);
    h.decoupled_weight_decay = (int)rng_below(r, 2);
    h.centered = (int)rng_below(r, 2);
    h.lr_kind = random_value_kind(r);
    h.weight_decay_kind = random_value_kind(r);
    h.beta1_kind = random_value_kind(r);
    h.beta2_kind = random_value_kind(r);
    h.dampening_kind = random_value_kind(r);
    h.alpha_kind = random_value_kind(r);
    h.rho_kind = random_value_kind(r);
    h.lr_decay_kind = random_value_kind(r);
    return h;
}

/* A tensor size near an edge: vector width, block step, chunk sizes. */
static int64_t random_size(rng64 *r)
{
    static const int64_t edges[] = {0, 1, 4, BLOCK_STEP, 2 * BLOCK_STEP, 2048, 4096, 8192, 16384};
    switch (rng_below(r, 4)) {
    case 0:
        return (int64_t)rng_below(r, 9);
    case 1:
        return std::max<int64_t>(0, pick(r, edges) + (int64_t)rng_below(r, 7) - 3);
    case 2:
        return (int64_t)rng_below(r, rng_below(r, 8) == 0 ? 80000 : 12000);
    default:
        return (int64_t)rng_below(r, 300);
    }
}

static std::vector<int64_t> random_sizes(rng64 *r)
{
    const uint64_t shape = rng_below(r, 10);
    /* mostly a few tensors; sometimes more than a step table holds */
    const size_t n = shape == 0 ? 0 : shape == 1 ? 150 + rng_below(r, 200) : rng_below(r, 12);
    std::vector<int64_t> v(n);
    for (size_t i = 0; i < n; i++)
        v[i] = shape == 1 ? (int64_t)rng_below(r, 5) : random_size(r);
    return v;
}

/* SM counts of the random mode's devices: few (1 to 8) or any up to 200. */
static void draw_sm_counts(uint64_t seed)
{
    rng64 r = {seed};
    for (int d = GRID_DEVICES; d < EMU_DEVICES; d++)
        emu_sm_count[d] = (int)(1 + (rng_below(&r, 2) ? rng_below(&r, 8) : rng_below(&r, 200)));
}

/* A call on one of the random mode's devices: its stream, from it or from
 * another device, or one of the special streams of the current device. */
static launch_config random_launch_config(rng64 *r)
{
    static const cudaStream_t specials[] = {NULL, cudaStreamPerThread, cudaStreamLegacy};
    const int dev = GRID_DEVICES + (int)rng_below(r, EMU_DEVICES - GRID_DEVICES);
    const int current = GRID_DEVICES + (int)rng_below(r, EMU_DEVICES - GRID_DEVICES);
    if (rng_below(r, 3) == 0)
        return {"a special stream of the current device", dev, pick(r, specials), dev};
    return {"a stream of its own device", current, emu_stream(dev), dev};
}

static void describe_hparams(char *buf, size_t size, const rp_optim_hparams &h)
{
    snprintf(buf, size,
             "kind %d lr %g wd %g eps %g betas %g %g momentum %g dampening %g alpha %g rho %g "
             "lr_decay %g nesterov %d maximize %d amsgrad %d decoupled %d centered %d "
             "value kinds %d%d%d%d%d%d%d%d",
             h.kind, h.lr, h.weight_decay, h.eps, h.beta1, h.beta2, h.momentum, h.dampening,
             h.alpha, h.rho, h.lr_decay, h.nesterov, h.maximize, h.amsgrad,
             h.decoupled_weight_decay, h.centered, h.lr_kind, h.weight_decay_kind,
             h.beta1_kind, h.beta2_kind, h.dampening_kind, h.alpha_kind, h.rho_kind,
             h.lr_decay_kind);
}

/* Random case `index` of `seed`. */
static bool run_random_case(uint64_t seed, uint64_t index)
{
    static char hp_name[200], sizes_name[120];
    rng64 r = random_case_rng(seed, index);
    const hparam_config config = {hp_name, random_hparams(&r)};
    size_set sizes = {sizes_name, random_sizes(&r), false};
    const std::vector<launch_config> configs = {random_launch_config(&r),
                                               random_launch_config(&r)};
    const case_spec spec = {&config, (int)rng_below(&r, 3), &sizes,
                            (misalignment)rng_below(&r, N_MISALIGNMENTS + 1),
                            (capture_mode)rng_below(&r, N_CAPTURE_MODES)};
    g_blocks_reversed = rng_below(&r, 2);
    g_odd_reversed = rng_below(&r, 2);
    g_offset_salt = rng_next(&r);
    describe_hparams(hp_name, sizeof hp_name, config.hp);
    snprintf(sizes_name, sizeof sizes_name,
             "random case %llu:%llu, %zu tensors, %d and %d SMs, order %d%d",
             (unsigned long long)seed, (unsigned long long)index, sizes.sizes.size(),
             emu_sm_count[configs[0].stream_device], emu_sm_count[configs[1].stream_device],
             (int)g_blocks_reversed, (int)g_odd_reversed);
    return run_case(spec, configs, rng_next(&r));
}

/* REPROP_CUDA_OPTIM_CHUNK from OPTIM_EMULATION_CHUNK in the random mode, else
 * unset: the chunk heuristic, not a developer's tuning override. */
static void set_chunk_override(bool random_mode)
{
    const char *s = getenv("OPTIM_EMULATION_CHUNK");
    g_chunk_override = random_mode && s != NULL ? std::max(0LL, strtoll(s, NULL, 10)) : 0;
    if (g_chunk_override > 0)
        setenv("REPROP_CUDA_OPTIM_CHUNK", s, 1);
    else
        unsetenv("REPROP_CUDA_OPTIM_CHUNK");
}

int main(int argc, char **argv)
{
    struct timespec t0, t1;
    const random_args random = parse_random_args(argc, argv);
    g_random_mode = random.count > 0;
    set_chunk_override(g_random_mode);
    catch_fatal_signals();
    clock_gettime(CLOCK_MONOTONIC, &t0);
    test_argument_errors();
    test_runtime_errors();
    test_stepless_empty_entries();
    test_capturable_adam_past_the_beta2_power();
    const int devices = test_device_count();
    if (g_random_mode) {
        draw_sm_counts(random.seed);
        run_random_cases(random, run_random_case);
    } else {
        run_grid();
        if (g_failures == 0)
            check_coverage();
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("optim_emulation: %s: %ld cases (%ld refused by the C core), %ld calls, %ld update + %ld increment launches "
           "(%ld vector / %ld scalar blocks, %ld multi-launch calls, %ld continued tensors, "
           "%zu chunk sizes; %ld blocks, %ld threads, %ld barriers emulated), %d CUDA devices, "
           "%.1f s\n",
           g_failures ? "FAILED" : "ok", g_stats.cases, g_stats.refused_cases, g_stats.calls, g_stats.update_launches,
           g_stats.step_launches, g_stats.vector_blocks, g_stats.scalar_blocks,
           g_stats.multi_launch_calls, g_stats.continued_tensors, g_stats.chunks.size(),
           g_exec.blocks, g_exec.threads, g_exec.barriers, devices,
           (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
    return g_failures != 0;
}
