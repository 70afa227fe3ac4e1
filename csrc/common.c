/* common.c: the error convention and small facts about the build. */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>

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
