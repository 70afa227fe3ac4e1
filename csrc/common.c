/* common.c: the error convention and small facts about the build. */
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
