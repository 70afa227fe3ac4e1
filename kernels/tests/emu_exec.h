/*
 * emu_exec.h: a host executor for CUDA kernel bodies compiled a second time
 * as host code (emu_host_begin.h / emu_host_end.h around the second
 * #include of the .cu, in a namespace of the emulation's own).
 *
 * The built-in indices (threadIdx, blockIdx, blockDim, gridDim) read the
 * globals below, __syncthreads is emu_syncthreads, and __shared__ variables
 * live in section emu_shared, which emu_run_grid fills with NaN before each
 * block (a read of shared memory before a thread of the block wrote it
 * shows). emu_run_grid runs every block of a 1-D grid, one after another,
 * each block's threads as fibers: each thread runs until it reaches
 * __syncthreads or ends, and once every thread of the block waits at the
 * barrier, each is resumed in turn; alternate blocks run their threads in
 * reverse order, so that a missing barrier shows whichever thread writes
 * first (emu_run_grid_order also runs the blocks last to first, if asked).
 * A barrier that some threads of a block reach and the others never do is a
 * CHECK failure. __shfl_xor_sync is emu_shfl_xor_sync, an exchange between
 * barriers.
 *
 * The fibers are made once and kept (one per thread of the largest block);
 * on x86-64 they switch with the few instructions below (callee-saved
 * registers and the stack pointer; no signal mask, unlike swapcontext's
 * system call, which would make the emulations several times slower),
 * elsewhere, or with EMU_UCONTEXT defined, with ucontext (a process running
 * with x86 shadow stacks, which glibc leaves off unless a tunable turns them
 * on, needs it).
 *
 * Include after emu_check.h (CHECK, from_bits, g_context).
 */
#ifndef REPROP_EMU_EXEC_H
#define REPROP_EMU_EXEC_H

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__x86_64__) && !defined(EMU_UCONTEXT)
#define EMU_UCONTEXT
#endif
#if defined(EMU_UCONTEXT)
#include <ucontext.h>
#endif

#include "emu_check.h"

/* The indices of the emulated thread: the built-ins of the host copy. */
static uint3 emu_threadIdx, emu_blockIdx;
static dim3 emu_blockDim, emu_gridDim;

#define EMU_MAX_THREADS 1024
#define EMU_FIBER_STACK (64 * 1024)
#ifndef EMU_MAX_ROUNDS /* barriers a block may pass before it counts as running away */
#define EMU_MAX_ROUNDS 64
#endif

/* ---------------------------------------------------------------------------
 * Context switches
 * ------------------------------------------------------------------------- */

#if !defined(EMU_UCONTEXT)
/* Saves the callee-saved registers on the current stack, stores the stack
 * pointer in *save, and resumes the context whose stack pointer is `to`
 * (one saved by this function, or one emu_fiber_init prepared). The SysV
 * ABI leaves everything else caller-saved; MXCSR and the x87 control word
 * are the same in every fiber. */
extern "C" void emu_ctx_swap(void **save, void *to);
__asm__(".text\n"
        ".p2align 4\n"
        ".globl emu_ctx_swap\n"
        ".type emu_ctx_swap,@function\n"
        "emu_ctx_swap:\n"
        "    pushq %rbp\n"
        "    pushq %rbx\n"
        "    pushq %r12\n"
        "    pushq %r13\n"
        "    pushq %r14\n"
        "    pushq %r15\n"
        "    movq %rsp, (%rdi)\n"
        "    movq %rsi, %rsp\n"
        "    popq %r15\n"
        "    popq %r14\n"
        "    popq %r13\n"
        "    popq %r12\n"
        "    popq %rbx\n"
        "    popq %rbp\n"
        "    ret\n"
        ".size emu_ctx_swap, .-emu_ctx_swap\n");

typedef void *emu_ctx;

/* A context that starts entry() on the stack [base, base + size). */
static void emu_fiber_init(emu_ctx *ctx, char *base, size_t size, void (*entry)(void))
{
    uintptr_t top = ((uintptr_t)base + size) & ~(uintptr_t)15;
    void **sp = (void **)top;
    *--sp = NULL;            /* entry's return address: it never returns */
    *--sp = (void *)entry;   /* emu_ctx_swap's ret goes there, the stack as after a call */
    for (int r = 0; r < 6; r++)
        *--sp = NULL;        /* rbp, rbx, r12..r15 */
    *ctx = (void *)sp;
}

static void emu_switch(emu_ctx *from, emu_ctx *to) { emu_ctx_swap(from, *to); }
#else
typedef ucontext_t emu_ctx;

static void emu_fiber_init(emu_ctx *ctx, char *base, size_t size, void (*entry)(void))
{
    getcontext(ctx);
    ctx->uc_stack.ss_sp = base;
    ctx->uc_stack.ss_size = size;
    ctx->uc_link = NULL; /* entry never returns */
    makecontext(ctx, entry, 0);
}

static void emu_switch(emu_ctx *from, emu_ctx *to) { swapcontext(from, to); }
#endif

/* ---------------------------------------------------------------------------
 * The executor
 * ------------------------------------------------------------------------- */

enum { EMU_RUNNING, EMU_AT_BARRIER, EMU_DONE };

static struct {
    emu_ctx sched;
    emu_ctx ctx[EMU_MAX_THREADS];
    int state[EMU_MAX_THREADS];
    int fibers;       /* made so far, each with its own stack */
    int current;      /* the thread running, -1 outside a block */
    void (*body)(void *); /* the kernel of this grid, for one thread */
    void *arg;
    long blocks, threads, barriers; /* run so far: each thread's barriers count once */
} g_exec = {};

static void emu_set_thread(unsigned block, unsigned thread, unsigned nblocks, unsigned nthreads)
{
    emu_blockIdx = make_uint3(block, 0, 0);
    emu_threadIdx = make_uint3(thread, 0, 0);
    emu_blockDim = dim3(nthreads);
    emu_gridDim = dim3(nblocks);
}

/* A fiber: runs the body for each block it is resumed for, then waits. */
static void emu_fiber_main(void)
{
    for (;;) {
        const int t = g_exec.current;
        g_exec.body(g_exec.arg);
        g_exec.state[t] = EMU_DONE;
        emu_switch(&g_exec.ctx[t], &g_exec.sched);
    }
}

static void emu_syncthreads(void)
{
    const int t = g_exec.current;
    CHECK(t >= 0, "__syncthreads outside an emulated block");
    if (t < 0)
        return;
    g_exec.state[t] = EMU_AT_BARRIER;
    g_exec.barriers++;
    emu_switch(&g_exec.ctx[t], &g_exec.sched);
}

/* __shfl_xor_sync: lane t gets the v of lane t ^ o. A block-wide exchange
 * between two barriers, so every thread of the block must call it (the
 * scan's group_sum is called so; a kernel shuffling in some warps only is
 * a barrier the others never reach here), and a missing __syncthreads right
 * before or after it does not show. */
static float g_emu_shfl[EMU_MAX_THREADS];

static float emu_shfl_xor_sync(unsigned mask, float v, int o)
{
    const int t = g_exec.current, partner = t ^ o;
    CHECK(mask == 0xffffffffu && o > 0 && o < 32 && partner < (int)emu_blockDim.x,
          "thread %d: shuffle with mask %#x, lane mask %d of %u threads", t, mask, o, emu_blockDim.x);
    if (t < 0 || partner >= (int)emu_blockDim.x)
        return v;
    g_emu_shfl[t] = v;
    emu_syncthreads(); /* every lane has published */
    const float got = g_emu_shfl[partner];
    emu_syncthreads(); /* every lane has read before the next publishes */
    return got;
}

/* The kernels' __shared__ variables (section emu_shared) start each block as NaN. */
extern "C" char __start_emu_shared[] __attribute__((weak));
extern "C" char __stop_emu_shared[] __attribute__((weak));

static void emu_poison_shared(void)
{
    const float nan = from_bits(0x7fc0beef);
    for (char *p = __start_emu_shared; p + sizeof nan <= __stop_emu_shared; p += sizeof nan)
        memcpy(p, &nan, sizeof nan);
}

static void emu_make_fibers(int n)
{
    if (n <= g_exec.fibers)
        return;
    for (int t = g_exec.fibers; t < n; t++) {
        char *stack = (char *)malloc(EMU_FIBER_STACK); /* kept to the end */
        CHECK(stack != NULL, "no memory for a fiber stack");
        if (stack == NULL)
            abort();
        emu_fiber_init(&g_exec.ctx[t], stack, EMU_FIBER_STACK, emu_fiber_main);
    }
    g_exec.fibers = n;
}

/* Resumes every thread of the block not done yet, each until it reaches a
 * barrier or ends, in `reverse` order or not; returns how many are not done. */
static int emu_resume_threads(unsigned block, unsigned nblocks, int nthreads, bool reverse)
{
    int live = 0;
    for (int i = 0; i < nthreads; i++) {
        const int t = reverse ? nthreads - 1 - i : i;
        if (g_exec.state[t] == EMU_DONE)
            continue;
        g_exec.state[t] = EMU_RUNNING;
        g_exec.current = t;
        emu_set_thread(block, (unsigned)t, nblocks, (unsigned)nthreads);
        emu_switch(&g_exec.sched, &g_exec.ctx[t]);
        live += g_exec.state[t] != EMU_DONE;
    }
    g_exec.current = -1;
    return live;
}

/* Block `block` of `nblocks`, `nthreads` threads, in `reverse` order or not. */
static void emu_run_block(unsigned block, unsigned nblocks, int nthreads, bool reverse)
{
    emu_poison_shared();
    for (int t = 0; t < nthreads; t++)
        g_exec.state[t] = EMU_RUNNING;
    for (int round = 0;; round++) {
        int waiting = 0;
        const int live = emu_resume_threads(block, nblocks, nthreads, reverse);
        for (int t = 0; t < nthreads; t++)
            waiting += g_exec.state[t] == EMU_AT_BARRIER;
        if (live == 0)
            break;
        CHECK(waiting == nthreads, "block %u: %d threads wait at a barrier the others never reach",
              block, waiting);
        if (waiting != nthreads || round > EMU_MAX_ROUNDS) {
            /* Threads left at a barrier stay suspended: let them finish, as if
             * released, so that every fiber is at its loop's end again. */
            int left = live;
            for (int guard = 0; left > 0 && guard < 64; guard++)
                left = emu_resume_threads(block, nblocks, nthreads, false);
            CHECK(left == 0, "block %u: threads never end", block);
            break;
        }
    }
    g_exec.blocks++;
    g_exec.threads += nthreads;
}

/* Block `block` of a 1-D grid of nblocks x nthreads threads, each thread
 * running body(arg), its threads last to first when `reverse`: for an
 * emulation that prepares and checks something around each block (a
 * dynamic shared memory buffer of its own, say). */
static void emu_run_one_block(unsigned block, unsigned nblocks, unsigned nthreads,
                              void (*body)(void *), void *arg, bool reverse)
{
    CHECK(nthreads >= 1 && nthreads <= EMU_MAX_THREADS, "%u threads per block", nthreads);
    if (nthreads < 1 || nthreads > EMU_MAX_THREADS)
        return;
    emu_make_fibers((int)nthreads);
    g_exec.body = body;
    g_exec.arg = arg;
    emu_run_block(block, nblocks, (int)nthreads, reverse);
}

/* Every block of a 1-D grid of nblocks x nthreads threads, each thread
 * running body(arg): blocks 0 to nblocks - 1, or with blocks_reversed last
 * to first (an emulation that alternates it between launches shows a kernel
 * whose blocks depend on running in index order); every second block run
 * (the second, fourth, ...) runs its threads last to first, or with
 * odd_reversed the first, third, ... (a run with both flags and one with
 * neither run every block's threads in both orders). */
static void emu_run_grid_order(unsigned nblocks, unsigned nthreads, void (*body)(void *),
                               void *arg, bool blocks_reversed, bool odd_reversed = false)
{
    for (unsigned i = 0; i < nblocks; i++)
        emu_run_one_block(blocks_reversed ? nblocks - 1 - i : i, nblocks, nthreads, body, arg,
                          ((i & 1u) != 0) != odd_reversed);
}

/* The same, blocks in index order: odd blocks run their threads last to first. */
static void emu_run_grid(unsigned nblocks, unsigned nthreads, void (*body)(void *), void *arg)
{
    emu_run_grid_order(nblocks, nthreads, body, arg, false);
}

#endif /* REPROP_EMU_EXEC_H */
