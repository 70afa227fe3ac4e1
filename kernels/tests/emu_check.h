/*
 * emu_check.h: failure reporting of the host emulations of the CUDA
 * launchers (optim_emulation.cu, scan_emulation.cu, csr_emulation.cu,
 * fad_emulation.cu), their canary-fenced buffers (float ones, and byte ones
 * at any misalignment) and the random numbers they draw. Each failed CHECK
 * is printed with the case being run (g_context), up to 30; a crash of an
 * emulated kernel still names its case. CHECKs stand in this directory's
 * headers too, hence the file in each report.
 */
#ifndef REPROP_EMU_CHECK_H
#define REPROP_EMU_CHECK_H

#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <vector>

static int g_failures;
static char g_context[640]; /* the case being run */

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

/* Buffers between canaries: a write out of bounds changes a canary. */
#define EMU_CANARY 64
static const uint32_t emu_canary_bits = 0x7fc0dead; /* a NaN no arithmetic produces */

static float from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

struct fenced {
    std::vector<float> mem;
    int64_t n = 0;
    void init(int64_t count, float fill)
    {
        n = count;
        mem.assign((size_t)(count + 2 * EMU_CANARY), fill);
        for (int i = 0; i < EMU_CANARY; i++)
            mem[(size_t)i] = mem[(size_t)(EMU_CANARY + count + i)] = from_bits(emu_canary_bits);
    }
    float *p() { return mem.data() + EMU_CANARY; }
    bool intact() const
    {
        for (int i = 0; i < EMU_CANARY; i++) {
            uint32_t a, b;
            memcpy(&a, &mem[(size_t)i], 4);
            memcpy(&b, &mem[(size_t)(EMU_CANARY + n + i)], 4);
            if (a != emu_canary_bits || b != emu_canary_bits)
                return false;
        }
        return true;
    }
    bool same(const fenced &o) const /* bitwise, canaries included */
    {
        return n == o.n && memcmp(mem.data(), o.mem.data(), mem.size() * sizeof(float)) == 0;
    }
};

/* Buffers of any element size between canary bytes, at a chosen misalignment:
 * `size` payload bytes starting `misalign` bytes after a 64-byte boundary. */
#define EMU_GUARD_BYTES 64 /* canary bytes on each side */
#define EMU_GUARD_FILL 0xA5

typedef struct {
    std::vector<unsigned char> storage;
    size_t offset, size;
} guarded_buffer;

static void buffer_allocate(guarded_buffer *buf, size_t size, size_t misalign)
{
    buf->storage.assign(64 + EMU_GUARD_BYTES + misalign + size + EMU_GUARD_BYTES, EMU_GUARD_FILL);
    buf->offset = (64 - (uintptr_t)buf->storage.data() % 64) % 64 + EMU_GUARD_BYTES + misalign;
    buf->size = size;
}

static void *buffer_data(guarded_buffer *buf) { return buf->storage.data() + buf->offset; }

static bool buffer_guards_intact(const guarded_buffer *buf)
{
    for (size_t k = 0; k < buf->offset; k++)
        if (buf->storage[k] != EMU_GUARD_FILL)
            return false;
    for (size_t k = buf->offset + buf->size; k < buf->storage.size(); k++)
        if (buf->storage[k] != EMU_GUARD_FILL)
            return false;
    return true;
}

/* The first element where two buffers of `esize`-byte elements differ, or -1. */
static int64_t first_difference(guarded_buffer *a, guarded_buffer *b, size_t esize)
{
    if (a->size != b->size)
        return 0;
    if (a->size == 0)
        return -1;
    if (memcmp(buffer_data(a), buffer_data(b), a->size) == 0)
        return -1;
    const unsigned char *pa = (const unsigned char *)buffer_data(a);
    const unsigned char *pb = (const unsigned char *)buffer_data(b);
    size_t k = 0;
    while (pa[k] == pb[k])
        k++;
    return (int64_t)(k / esize);
}

/* splitmix64: fast, and the same sequence everywhere. */
typedef struct {
    uint64_t state;
} rng64;

static uint64_t rng_next(rng64 *r)
{
    uint64_t z = (r->state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* ---------------------------------------------------------------------------
 * The random modes (--random N [--seed S] [--first I]): cases drawn from the
 * seed and their index alone, so that a failed one runs again by itself
 * ------------------------------------------------------------------------- */

static uint64_t rng_below(rng64 *r, uint64_t n) { return n ? rng_next(r) % n : 0; }

/* One of the values, uniformly. */
template <typename T, size_t N> static T pick(rng64 *r, const T (&values)[N])
{
    return values[rng_below(r, N)];
}

/* The generator of random case `index` of `seed`. */
static rng64 random_case_rng(uint64_t seed, uint64_t index)
{
    return rng64{seed * 0x9E3779B97F4A7C15u + index};
}

typedef struct {
    long count; /* 0: the grid */
    uint64_t seed, first;
} random_args;

static random_args parse_random_args(int argc, char **argv)
{
    random_args a = {0, 1, 0};
    bool ok = argc % 2 == 1;
    for (int i = 1; ok && i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--random") == 0)
            a.count = atol(argv[i + 1]);
        else if (strcmp(argv[i], "--seed") == 0)
            a.seed = strtoull(argv[i + 1], NULL, 10);
        else if (strcmp(argv[i], "--first") == 0)
            a.first = strtoull(argv[i + 1], NULL, 10);
        else
            ok = false;
    }
    if (!ok) {
        fprintf(stderr, "usage: %s [--random N [--seed S] [--first I]]\n", argv[0]);
        exit(2);
    }
    return a;
}

/* Runs a.count random cases, case(seed, index) false for a failed one,
 * each failure's rerun command printed; stops after 10. */
static void run_random_cases(const random_args &a, bool (*run_case)(uint64_t, uint64_t))
{
    int failed = 0;
    for (long i = 0; i < a.count && failed < 10; i++)
        if (!run_case(a.seed, a.first + (uint64_t)i)) {
            printf("failed: --random 1 --seed %llu --first %llu\n", (unsigned long long)a.seed,
                   (unsigned long long)(a.first + (uint64_t)i));
            failed++;
        }
}

#endif /* REPROP_EMU_CHECK_H */
