/*
 * emu_check.h: failure reporting of the host emulations of the CUDA
 * launchers (optim_emulation.cu, scan_emulation.cu). Each failed CHECK is
 * printed with the case being run (g_context), up to 30; a crash of an
 * emulated kernel still names its case. CHECKs stand in this directory's
 * headers too, hence the file in each report.
 */
#ifndef REPROP_EMU_CHECK_H
#define REPROP_EMU_CHECK_H

#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static int g_failures;
static char g_context[256]; /* the case being run */

static void report_failure(const char *file, int line, const char *cond, const char *fmt, ...)
{
    va_list ap;
    if (++g_failures > 30)
        return;
    fprintf(stderr, "FAIL [%s] %s:%d: CHECK(%s): ", g_context, file, line, cond);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

static void on_fatal_signal(int sig)
{
    static const char head[] = "FAIL [";
    static const char tail[] = "]: crashed (out-of-bounds or misaligned access?)\n";
    ssize_t ignored = write(2, head, sizeof head - 1);
    ignored = write(2, g_context, strnlen(g_context, sizeof g_context));
    ignored = write(2, tail, sizeof tail - 1);
    (void)ignored;
    signal(sig, SIG_DFL);
    raise(sig);
}

/* From main(), before the first case: a crash can come from any of them. */
static void catch_fatal_signals(void)
{
    signal(SIGSEGV, on_fatal_signal);
    signal(SIGBUS, on_fatal_signal);
    signal(SIGFPE, on_fatal_signal);
    signal(SIGABRT, on_fatal_signal); /* e.g. malloc finding its heap overwritten */
}

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond))                                                                               \
            report_failure(__FILE__, __LINE__, #cond, __VA_ARGS__);                                \
    } while (0)

#endif /* REPROP_EMU_CHECK_H */
