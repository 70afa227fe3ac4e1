/* common.c: the error convention and small facts about the build and the CPU. */
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "reprop.h"

int rp_set_error(rp_error *err, int code, const char *fmt, ...)
{
    va_list ap;
    if (err != NULL) {
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
    }
    return code;
}

const char *rp_dtype_name(int dtype)
{
    switch (dtype) {
    case RP_F32:
        return "float32";
    case RP_F16:
        return "float16";
    case RP_BF16:
        return "bfloat16";
    default:
        return "unknown";
    }
}

int rp_omp_max_threads(void)
{
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* Set in the child of a fork(). GNU libgomp registers no fork handler: a
 * thread that has run a parallel region keeps its pool of worker threads,
 * which a forked child inherits as a record only (fork copies the calling
 * thread alone), so the child's next parallel region of more than one thread
 * waits forever for workers that do not exist (os.fork, multiprocessing's
 * fork start method). The core cannot tell whether the parent's pool was
 * started (torch's kernels share the same libgomp), so a forked child runs
 * every region on one thread. A plain int: written once, in the child's only
 * thread, before anything else runs there. */
static int rp_forked_child;

static void rp_note_forked_child(void) { rp_forked_child = 1; }

/* At load (of reprop._C, and of reprop._cuda, which also links this file):
 * the handler is registered before any region can run. */
__attribute__((constructor)) static void rp_register_fork_handler(void)
{
    (void)pthread_atfork(NULL, NULL, rp_note_forked_child);
}

int rp_omp_threads(int num_threads)
{
    if (rp_forked_child)
        return 1;
    return num_threads > 0 ? num_threads : rp_omp_max_threads();
}

/* ---- CPU features the loops pick at run time ---- */

#if defined(__x86_64__) && defined(__GNUC__)
/* torch's kernels for AVX2 and AVX-512 fuse add(alpha=), addcmul and lerp;
 * it picks them where the CPU has AVX2 and FMA (ATen's DispatchStub), and its
 * baseline kernels, which round the products apart, elsewhere. */
static int rp_detect_fused_madd(void)
{
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

static int rp_detect_f16c(void)
{
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}
#else
/* aarch64 and the others fuse in hardware, as torch's kernels there */
static int rp_detect_fused_madd(void) { return 1; }

static int rp_detect_f16c(void) { return 0; }
#endif

/* Each probe's test hook is not an option: the variable set to 1 in the
 * environment at the first call answers "no" on any CPU, so that tests check
 * the other path against the same bits here (torch run with
 * ATEN_CPU_CAPABILITY=default for the unfused multiply-adds). */
static const struct {
    const char *test_hook;
    int (*detect)(void);
} rp_cpu_probes[RP_CPU_NPROBES] = {
    [RP_CPU_FUSED_MADD] = {"REPROP_TEST_UNFUSED_MADD", rp_detect_fused_madd},
    [RP_CPU_F16C] = {"REPROP_TEST_NO_F16C", rp_detect_f16c},
};

static int rp_cpu_detect(int probe)
{
    const char *hook = getenv(rp_cpu_probes[probe].test_hook);
    if (hook != NULL && strcmp(hook, "1") == 0)
        return 0;
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
#endif
    return rp_cpu_probes[probe].detect();
}

int rp_cpu_has(int probe)
{
    /* detected once: the answer never changes, and loops run on many threads */
    static atomic_int known[RP_CPU_NPROBES] = {-1, -1};
    int has = atomic_load_explicit(&known[probe], memory_order_relaxed);
    if (has < 0) {
        has = rp_cpu_detect(probe);
        atomic_store_explicit(&known[probe], has, memory_order_relaxed);
    }
    return has;
}
