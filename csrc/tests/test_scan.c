/*
 * test_scan.c: unit tests of the BPPSA scan (csrc/scan.c), built and run by
 * .ci/run under AddressSanitizer and UndefinedBehaviorSanitizer.
 *
 * Every level count, from the linear scan (0) through the hybrids to the
 * full Blelloch scan, against the recurrence evaluated step by step in
 * double, for every n up to 70 (powers of two and not), dense and
 * structured leaves (G = 1 and 3, with and without u), several H and
 * batches; in place (g == c); the sparse chain scan against dense
 * mat-vecs, with its plan reused for new values; and the error statuses.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../reprop.h"

#include "check.h"

static uint32_t rng_state = 2024u;

static float rnd(void)
{
    rng_state = rng_state * 1664525u + 1013904223u;
    return (float)((rng_state >> 8) & 0xffffffu) / 16777216.0f * 2.0f - 1.0f;
}

static float *rnd_array(int64_t len, float scale)
{
    float *a = malloc((size_t)(len > 0 ? len : 1) * sizeof *a);
    for (int64_t i = 0; i < len; i++)
        a[i] = scale * rnd();
    return a;
}

/* J[t]^T as a dense double matrix. */
static void leaf_dense(const rp_scan_jacobians *j, int64_t t, int64_t b, double *M)
{
    const int64_t H = j->dim, B = j->batch;
    for (int64_t i = 0; i < H; i++)
        for (int64_t m = 0; m < H; m++) {
            double acc;
            if (j->gates == 0) {
                acc = j->jt[((t * B + b) * H + i) * H + m];
            } else {
                acc = (j->u && i == m) ? j->u[(t * B + b) * H + i] : 0.0;
                for (int k = 0; k < j->gates; k++)
                    acc += (double)j->w[(k * H + m) * H + i] *
                           j->v[(t * B + b) * j->gates * H + k * H + m];
            }
            M[i * H + m] = acc;
        }
}

/* g in double, step by step; returns max |g| for the tolerance. */
static double reference(const rp_scan_jacobians *j, const float *c, double *g)
{
    const int64_t n = j->n, B = j->batch, H = j->dim;
    double *M = malloc((size_t)(H * H) * sizeof *M), top = 0.0;
    for (int64_t b = 0; b < B; b++) {
        for (int64_t i = 0; i < H; i++)
            g[((n - 1) * B + b) * H + i] = c[((n - 1) * B + b) * H + i];
        for (int64_t t = n - 2; t >= 0; t--) {
            leaf_dense(j, t + 1, b, M);
            for (int64_t i = 0; i < H; i++) {
                double acc = c[(t * B + b) * H + i];
                for (int64_t k = 0; k < H; k++)
                    acc += M[i * H + k] * g[((t + 1) * B + b) * H + k];
                g[(t * B + b) * H + i] = acc;
            }
        }
    }
    for (int64_t i = 0; i < n * B * H; i++)
        top = fmax(top, fabs(g[i]));
    free(M);
    return top;
}

static void test_recurrence(int64_t n, int64_t B, int64_t H, int gates, int with_u, int threads)
{
    const int64_t G = gates > 0 ? gates : 1;
    /* scaled so that products of many Jacobians neither explode nor vanish */
    const float scale = 0.9f / sqrtf((float)(G * H));
    float *w = rnd_array(G * H * H, 1.0f), *u = rnd_array(n * B * H, 0.5f);
    float *v = rnd_array(n * B * G * H, scale), *jt = rnd_array(n * B * H * H, scale * 1.3f);
    float *c = rnd_array(n * B * H, 1.0f), *g = malloc((size_t)(n * B * H) * sizeof *g);
    float *work = malloc((size_t)rp_scan_workspace_floats(n, B, H) * sizeof *work);
    double *want = malloc((size_t)(n * B * H) * sizeof *want);
    rp_scan_jacobians j = {n, B, H, gates, w, with_u ? u : NULL, v, jt};
    rp_error err = {{0}};
    const double top = reference(&j, c, want);
    for (int L = 0; L <= rp_scan_max_levels(n); L++) {
        double worst = 0.0;
        int rc = rp_scan_cpu(&j, c, g, L, work, threads, &err);
        CHECK(rc == RP_OK, "n=%lld L=%d: %s", (long long)n, L, err.msg);
        for (int64_t i = 0; i < n * B * H; i++)
            worst = fmax(worst, fabs(g[i] - want[i]));
        CHECK(worst <= 1e-5 * (top + 1.0), "n=%lld B=%lld H=%lld G=%d u=%d L=%d: error %g (max %g)",
              (long long)n, (long long)B, (long long)H, gates, with_u, L, worst, top);
    }
    /* in place: g written over c */
    {
        float *inplace = malloc((size_t)(n * B * H) * sizeof *inplace);
        double worst = 0.0;
        memcpy(inplace, c, (size_t)(n * B * H) * sizeof *c);
        CHECK(rp_scan_cpu(&j, inplace, inplace, rp_scan_max_levels(n), work, threads, &err) == RP_OK,
              "in place: %s", err.msg);
        for (int64_t i = 0; i < n * B * H; i++)
            worst = fmax(worst, fabs(inplace[i] - want[i]));
        CHECK(worst <= 1e-5 * (top + 1.0), "in place n=%lld: error %g", (long long)n, worst);
        free(inplace);
    }
    free(w), free(u), free(v), free(jt), free(c), free(g), free(work), free(want);
}

static void test_levels(void)
{
    CHECK(rp_scan_max_levels(1) == 0, "n=1");
    CHECK(rp_scan_max_levels(2) == 1, "n=2");
    CHECK(rp_scan_max_levels(3) == 1, "n=3");
    CHECK(rp_scan_max_levels(4) == 2, "n=4");
    CHECK(rp_scan_max_levels(1000) == 9, "n=1000");
    rp_scan_machine cpu = {2, 4000, 50}, gpu = {4096, 2e5, 2e4};
    CHECK(rp_scan_choose_levels(1000, 16, 20, 1, &cpu) == 0, "2 CPU threads: linear");
    CHECK(rp_scan_choose_levels(1000, 16, 20, 1, &gpu) > 4, "wide device: Blelloch levels");
}

static void test_errors(void)
{
    float buf[64] = {0};
    rp_error err = {{0}};
    rp_scan_jacobians j = {4, 1, 2, 1, buf, NULL, buf, NULL};
    CHECK(rp_scan_cpu(&j, buf, buf, 3, buf, 1, &err) == RP_EINVAL && strstr(err.msg, "levels"),
          "levels past the max: %s", err.msg);
    j.n = 0;
    CHECK(rp_scan_cpu(&j, buf, buf, 0, buf, 1, &err) == RP_EINVAL, "n = 0");
    j.n = 4, j.gates = 0;
    CHECK(rp_scan_cpu(&j, buf, buf, 0, buf, 1, &err) == RP_EINVAL && strstr(err.msg, "jt"),
          "dense without jt: %s", err.msg);
}

int main(void)
{
    test_levels();
    test_errors();
    for (int64_t n = 1; n <= 70; n++)
        test_recurrence(n, 2, 3, 1, 0, 2);
    for (int64_t n = 1; n <= 70; n += 3) {
        test_recurrence(n, 1, 4, 0, 0, 1);
        test_recurrence(n, 3, 5, 3, 1, 3);
    }
    test_recurrence(64, 2, 20, 1, 0, 2);
    test_recurrence(100, 1, 1, 1, 1, 2);
    test_recurrence(33, 2, 37, 3, 1, 2);
    if (failures) {
        fprintf(stderr, "test_scan: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_scan: all passed\n");
    return 0;
}
