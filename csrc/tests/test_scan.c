/*
 * test_scan.c: unit tests of the BPPSA scan (csrc/scan.c), built and run by
 * .ci/run under AddressSanitizer and UndefinedBehaviorSanitizer.
 *
 * Every level count, from the linear scan (0) through the hybrids to the
 * full Blelloch scan, against the recurrence evaluated step by step in
 * double, for every n up to 70 (powers of two and not), dense and
 * structured leaves (G = 1 and 3, with and without u), several H and
 * batches; in place (g == c); v given as f'(y) (tanh, relu) and
 * pre_activation, bitwise against v given and g scaled afterwards; the sparse
 * chain scan against dense mat-vecs, with its plan reused for new values,
 * and its step table (rp_csr_plan_schedule) against the plan's products and
 * evaluated densely; and the error statuses.
 */
#include <float.h>
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
    float *work = malloc((size_t)rp_scan_workspace_floats(n, B, H, rp_scan_max_levels(n)) * sizeof *work);
    double *want = malloc((size_t)(n * B * H) * sizeof *want);
    rp_scan_jacobians j = {n, B, H, gates, w, with_u ? u : NULL, v, jt, RP_SCAN_ACT_NONE, NULL, 0};
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
    /* in place, g written over c: the linear scan (no workspace) and the full Blelloch scan */
    for (int k = 0; k < 2; k++) {
        const int L = k == 0 ? 0 : rp_scan_max_levels(n);
        float *inplace = malloc((size_t)(n * B * H) * sizeof *inplace);
        double worst = 0.0;
        memcpy(inplace, c, (size_t)(n * B * H) * sizeof *c);
        CHECK(rp_scan_cpu(&j, inplace, inplace, L, L > 0 ? work : NULL, threads, &err) == RP_OK,
              "in place L=%d: %s", L, err.msg);
        for (int64_t i = 0; i < n * B * H; i++)
            worst = fmax(worst, fabs(inplace[i] - want[i]));
        CHECK(worst <= 1e-5 * (top + 1.0), "in place n=%lld L=%d: error %g", (long long)n, L, worst);
        free(inplace);
    }
    free(w), free(u), free(v), free(jt), free(c), free(g), free(work), free(want);
}

/* The workspace has no float a scan with levels leaves unwritten: it starts
 * as a NaN no scan of finite data makes, and none may be left (a product
 * slot no pair writes, as slot 1's was, is memory the scan holds for nothing). */
static void test_workspace_all_written(int64_t n, int64_t B, int64_t H, int gates)
{
    const uint32_t unwritten = 0x7fa00badu;
    float *w = rnd_array(gates * H * H, 0.5f / sqrtf((float)(gates * H)));
    float *v = rnd_array(n * B * gates * H, 1.0f), *c = rnd_array(n * B * H, 1.0f);
    float *jt = rnd_array(n * B * H * H, 0.5f / sqrtf((float)H)), *g = malloc((size_t)(n * B * H) * sizeof *g);
    rp_scan_jacobians j = {n, B, H, gates, w, NULL, v, jt, RP_SCAN_ACT_NONE, NULL, 0};
    rp_error err = {{0}};
    for (int L = 1; L <= rp_scan_max_levels(n); L++) {
        const int64_t len = rp_scan_workspace_floats(n, B, H, L);
        float *work = malloc((size_t)len * sizeof *work);
        int64_t left = 0, first = -1;
        for (int64_t i = 0; i < len; i++)
            memcpy(&work[i], &unwritten, sizeof unwritten);
        CHECK(rp_scan_cpu(&j, c, g, L, work, 2, &err) == RP_OK, "n=%lld L=%d: %s", (long long)n, L, err.msg);
        for (int64_t i = 0; i < len; i++) {
            uint32_t bits;
            memcpy(&bits, &work[i], sizeof bits);
            if (bits == unwritten && left++ == 0)
                first = i;
        }
        CHECK(left == 0, "n=%lld B=%lld H=%lld G=%d L=%d: %lld of %lld workspace floats never written, from %lld",
              (long long)n, (long long)B, (long long)H, gates, L, (long long)left, (long long)len,
              (long long)first);
        free(work);
    }
    free(w), free(v), free(c), free(jt), free(g);
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

/* Sizes at the ends of int64: every call returns, an error where the sizes
 * cannot be, never an overflowed count (UBSan catches the shifts). */
static void test_size_limits(void)
{
    const rp_scan_machine m = {4096, 2e5, 2e4};
    rp_error err = {{0}};
    double cost = 0.0;
    CHECK(rp_scan_max_levels(INT64_MAX) == 62, "n = INT64_MAX: %d", rp_scan_max_levels(INT64_MAX));
    CHECK(rp_scan_max_levels((int64_t)1 << 62) == 62, "n = 2^62");
    CHECK(rp_scan_max_levels(((int64_t)1 << 62) - 1) == 61, "n = 2^62 - 1");
    CHECK(rp_scan_max_levels(0) == 0 && rp_scan_max_levels(INT64_MIN) == 0, "n < 1");
    CHECK(rp_scan_choose_levels(INT64_MAX, 1, 1, 1, &m) <= 62, "choose for n = INT64_MAX");
    CHECK(rp_scan_choose_levels(INT64_MIN, 1, 1, 1, &m) == 0, "choose for n < 1");
    for (int L = 0; L <= 62; L++)
        CHECK(rp_scan_cost(INT64_MAX, 0, 1, 1, L, &m, &cost, &err) == RP_OK && cost >= 0.0,
              "cost of L = %d for n = INT64_MAX: %s", L, err.msg);
    const int bad_levels[] = {-1, 4, 63, 64, INT32_MAX};
    for (size_t i = 0; i < sizeof bad_levels / sizeof *bad_levels; i++)
        CHECK(rp_scan_cost(10, 1, 1, 1, bad_levels[i], &m, &cost, &err) == RP_EINVAL &&
                  strstr(err.msg, "levels must be in [0, 3]"),
              "cost of levels = %d: %s", bad_levels[i], err.msg);
    CHECK(rp_scan_cost(10, 1, 1, -1, 0, &m, &cost, &err) == RP_EINVAL && strstr(err.msg, "gates"),
          "cost with gates < 0: %s", err.msg);
    /* (n + 1) B H + (n / 2 - 1) B H H floats, whose bytes must fit in int64 */
    const int64_t cap = INT64_MAX / 4;
    CHECK(rp_scan_workspace_floats((int64_t)1 << 62, (int64_t)1 << 62, (int64_t)1 << 62, 60) == -1,
          "2^62 cubed");
    CHECK(rp_scan_workspace_floats(cap - 1, 1, 1, 1) == -1, "n B H alone fits, with n/2 B H H not");
    /* B = H = 1: n + n / 2 floats, exactly cap (= 1 mod 3) for n = 2 (cap - 1) / 3 + 1 */
    CHECK(rp_scan_workspace_floats(2 * ((cap - 1) / 3) + 1, 1, 1, 1) == cap, "the largest workspace");
    CHECK(rp_scan_workspace_floats(2 * ((cap - 1) / 3) + 2, 1, 1, 1) == -1, "two floats past it");
    /* no products below n = 4: n = 2 and 3 combine slot 1 on the spine only */
    CHECK(rp_scan_workspace_floats(2, 3, 5, 1) == 3 * 15 && rp_scan_workspace_floats(3, 3, 5, 1) == 4 * 15,
          "n = 2, 3: the slots' vectors alone");
    CHECK(rp_scan_workspace_floats(1, 3, 5, 1) == 2 * 15, "n = 1 (levels past its max): vectors alone");
    CHECK(rp_scan_workspace_floats(-4, 1, 1, 1) == -1 && rp_scan_workspace_floats(4, -1, 1, 1) == -1,
          "negative sizes");
    CHECK(rp_scan_workspace_floats(INT64_MAX, INT64_MAX, INT64_MAX, 0) == 0, "the linear scan needs none");
    CHECK(rp_scan_check_sizes(INT64_MAX, 1, 1, 1, 0, &err) == RP_OK, "linear scan of INT64_MAX steps: %s",
          err.msg);
    CHECK(rp_scan_check_sizes((int64_t)1 << 40, 1 << 20, 1 << 10, 1, 1, &err) == RP_EINVAL &&
              strstr(err.msg, "workspace"),
          "workspace past int64: %s", err.msg);
}

static void test_errors(void)
{
    float buf[64] = {0};
    rp_error err = {{0}};
    rp_scan_jacobians j = {4, 1, 2, 1, buf, NULL, buf, NULL, RP_SCAN_ACT_NONE, NULL, 0};
    CHECK(rp_scan_cpu(&j, buf, buf, 3, buf, 1, &err) == RP_EINVAL && strstr(err.msg, "levels"),
          "levels past the max: %s", err.msg);
    j.n = 0;
    CHECK(rp_scan_cpu(&j, buf, buf, 0, buf, 1, &err) == RP_EINVAL, "n = 0");
    j.n = 4, j.gates = 0;
    CHECK(rp_scan_cpu(&j, buf, buf, 0, buf, 1, &err) == RP_EINVAL && strstr(err.msg, "jt"),
          "dense without jt: %s", err.msg);
    /* the linear scan needs no workspace; a Blelloch level does */
    j.gates = 1;
    CHECK(rp_scan_workspace_floats(1000, 16, 20, 0) == 0, "linear scan workspace");
    CHECK(rp_scan_workspace_floats(4, 1, 2, 1) == 5 * 2 + 1 * 4, "one level's workspace");
    CHECK(rp_scan_cpu(&j, buf, buf + 8, 0, NULL, 1, &err) == RP_OK, "linear, NULL work: %s", err.msg);
    CHECK(rp_scan_cpu(&j, buf, buf + 8, 1, NULL, 1, &err) == RP_EINVAL && strstr(err.msg, "workspace"),
          "a level without workspace: %s", err.msg);
    /* v, or y with an activation; pre_activation with one gate */
    j.act = 3;
    CHECK(rp_scan_cpu(&j, buf, buf + 8, 0, NULL, 1, &err) == RP_EINVAL && strstr(err.msg, "activation 3"),
          "unknown activation: %s", err.msg);
    j.act = RP_SCAN_ACT_TANH;
    CHECK(rp_scan_cpu(&j, buf, buf + 8, 0, NULL, 1, &err) == RP_EINVAL && strstr(err.msg, "v must be NULL"),
          "activation with v and no y: %s", err.msg);
    j.v = NULL, j.y = buf + 16;
    CHECK(rp_scan_cpu(&j, buf, buf + 8, 0, NULL, 1, &err) == RP_OK, "activation with y: %s", err.msg);
    j.act = RP_SCAN_ACT_NONE;
    CHECK(rp_scan_cpu(&j, buf, buf + 8, 0, NULL, 1, &err) == RP_EINVAL && strstr(err.msg, "need v"),
          "y without an activation: %s", err.msg);
    j.act = RP_SCAN_ACT_RELU, j.gates = 0, j.jt = buf + 16;
    CHECK(rp_scan_cpu(&j, buf, buf + 8, 0, NULL, 1, &err) == RP_EINVAL && strstr(err.msg, "no activation"),
          "dense leaves with an activation: %s", err.msg);
    j.act = RP_SCAN_ACT_NONE, j.pre_activation = 1;
    CHECK(rp_scan_cpu(&j, buf, buf + 8, 0, NULL, 1, &err) == RP_EINVAL && strstr(err.msg, "pre_activation"),
          "pre_activation on dense leaves: %s", err.msg);
}

/* f'(y) as the caller would form v: 1 - y * y (y * y rounded first), and
 * torch's relu slope, 0 where y <= 0, else 1 (a NaN y included). */
static float derivative(int act, float y)
{
    const float yy = y * y;
    return act == RP_SCAN_ACT_TANH ? 1.0f - yy : (y <= 0.0f ? 0.0f : 1.0f);
}

/* pre_activation's d = v g, with relu's v applied as torch's
 * threshold_backward applies it: a select, +0 where y <= 0. */
static float pre_activation_of(int act, float y, float v, float g)
{
    return act == RP_SCAN_ACT_RELU ? (y <= 0.0f ? 0.0f : g) : v * g;
}

static int same_bits(const float *a, const float *b, int64_t len)
{
    return memcmp(a, b, (size_t)len * sizeof *a) == 0;
}

/* v given as f'(y) must give the bits of v given, for every levels, in place
 * and not; pre_activation the bits of v * g (relu: the select). y includes
 * zeros of both signs, and for relu NaNs (slope 1, as torch's). */
static void test_activation(int64_t n, int64_t B, int64_t H, int gates, int act, int with_u, int threads)
{
    const int64_t len = n * B * H, vlen = n * B * gates * H;
    float *w = rnd_array(gates * H * H, 0.9f / sqrtf((float)(gates * H))), *u = rnd_array(len, 0.5f);
    float *y = rnd_array(vlen, 1.0f), *v = malloc((size_t)vlen * sizeof *v);
    float *c = rnd_array(len, 1.0f), *want = malloc((size_t)len * sizeof *want);
    float *got = malloc((size_t)len * sizeof *got), *scaled = malloc((size_t)len * sizeof *scaled);
    float *work = malloc((size_t)rp_scan_workspace_floats(n, B, H, rp_scan_max_levels(n)) * sizeof *work);
    for (int64_t i = 0; i < vlen; i++) {
        y[i] = i % 7 == 3 ? 0.0f : (i % 7 == 5 ? -0.0f : y[i]);
        if (act == RP_SCAN_ACT_RELU && i % 11 == 9)
            y[i] = NAN;
        v[i] = derivative(act, y[i]);
    }
    rp_scan_jacobians given = {n, B, H, gates, w, with_u ? u : NULL, v, NULL, RP_SCAN_ACT_NONE, NULL, 0};
    rp_scan_jacobians implied = given;
    implied.v = NULL, implied.act = act, implied.y = y;
    rp_error err = {{0}};
    for (int L = 0; L <= rp_scan_max_levels(n); L++) {
        for (int inplace = 0; inplace < 2; inplace++) {
            given.pre_activation = implied.pre_activation = 0;
            CHECK(rp_scan_cpu(&given, c, want, L, work, threads, &err) == RP_OK, "v given: %s", err.msg);
            memcpy(got, c, (size_t)len * sizeof *c);
            CHECK(rp_scan_cpu(&implied, inplace ? got : c, got, L, work, threads, &err) == RP_OK,
                  "f'(y): %s", err.msg);
            CHECK(same_bits(got, want, len), "act=%d G=%d n=%lld L=%d in place=%d: f'(y) differs from v",
                  act, gates, (long long)n, L, inplace);
            if (gates != 1)
                continue;
            for (int k = 0; k < 2; k++) {
                rp_scan_jacobians *j = k == 0 ? &given : &implied;
                for (int64_t i = 0; i < len; i++) /* G = 1: y and v are (n, B, H) like g */
                    scaled[i] = pre_activation_of(j->act, y[i], v[i], want[i]);
                j->pre_activation = 1;
                memcpy(got, c, (size_t)len * sizeof *c);
                CHECK(rp_scan_cpu(j, inplace ? got : c, got, L, work, threads, &err) == RP_OK,
                      "pre_activation: %s", err.msg);
                CHECK(same_bits(got, scaled, len),
                      "act=%d n=%lld L=%d in place=%d %s: pre_activation differs from v * g", act,
                      (long long)n, L, inplace, k == 0 ? "v given" : "f'(y)");
            }
        }
    }
    free(w), free(u), free(y), free(v), free(c), free(want), free(got), free(scaled), free(work);
}

/* Dense H = 1 leaves whose up-sweep product J[1] J[2] = 1e60 overflows to
 * +inf while every step of the recurrence stays finite (g[2] = 1e-40 is a
 * subnormal, g[1] = 1e-10, g[0] = 1e20): the scan's product then reaches a
 * result as inf, not NaN, and the finiteness check must see it as well and
 * run the linear scan, whose result is finite and exact here. */
static void test_overflow_to_inf_falls_back(void)
{
    const float jt[4] = {0.0f, 1e30f, 1e30f, 1.0f}, c[4] = {0.0f, 0.0f, 1e-40f, 0.0f};
    float work[64], g[4], lin[4];
    rp_scan_jacobians j = {4, 1, 1, 0, NULL, NULL, NULL, jt, RP_SCAN_ACT_NONE, NULL, 0};
    rp_error err = {{0}};
    CHECK(rp_scan_workspace_floats(4, 1, 1, 2) <= 64, "workspace");
    CHECK(rp_scan_cpu(&j, c, lin, 0, NULL, 1, &err) == RP_OK, "linear: %s", err.msg);
    CHECK(isfinite(lin[0]) && lin[0] > 9.9e19f && lin[0] < 1.01e20f, "linear g[0] = %g", (double)lin[0]);
    for (int L = 1; L <= 2; L++) {
        CHECK(rp_scan_cpu(&j, c, g, L, work, 1, &err) == RP_OK, "L=%d: %s", L, err.msg);
        CHECK(same_bits(g, lin, 4), "L=%d: overflowed product gave g = %g %g %g %g, the linear scan %g %g %g %g",
              L, (double)g[0], (double)g[1], (double)g[2], (double)g[3], (double)lin[0], (double)lin[1],
              (double)lin[2], (double)lin[3]);
    }
}

/* Where two level counts cost the same, the fewer levels win (the linear
 * scan needs no workspace), in the dense/structured model as in the sparse
 * planner, whose auto choice check_auto_levels holds to the first cheapest.
 * Dense: n = 3, H = G = 1, W = 100, level cost = step cost = 5: the linear
 * scan's two steps (2 + 5 each) and one level (2 + 5 up, 2 + 5 down) both
 * cost 14. Sparse: two 1 x 1 leaves, W = 1, level cost = step cost = 5:
 * two middle steps (1 + 5) or one level (2 madds + 2 * 5), 12 either way. */
static void test_cost_ties_choose_fewer_levels(void)
{
    const rp_scan_machine dense_m = {100, 5, 5}, sparse_m = {1, 5, 5};
    double c0 = -1.0, c1 = -2.0;
    rp_error err = {{0}};
    CHECK(rp_scan_cost(3, 1, 1, 1, 0, &dense_m, &c0, &err) == RP_OK &&
              rp_scan_cost(3, 1, 1, 1, 1, &dense_m, &c1, &err) == RP_OK && c0 == c1,
          "dense tie: costs %g and %g", c0, c1);
    CHECK(rp_scan_choose_levels(3, 1, 1, 1, &dense_m) == 0, "dense tie chose %d levels, not 0",
          rp_scan_choose_levels(3, 1, 1, 1, &dense_m));
    int32_t ptr[2] = {0, 1}, idx[1] = {0};
    const rp_csr_pattern unit = {1, 1, 1, ptr, idx, 0, NULL, 0}, leaves[2] = {unit, unit};
    rp_csr_plan *plan = NULL;
    rp_csr_plan_info info;
    double cost[2];
    for (int L = 0; L < 2; L++) {
        CHECK(rp_csr_plan_create(2, leaves, L, 0, &sparse_m, &plan, &err) == RP_OK, "plan: %s", err.msg);
        rp_csr_plan_describe(plan, &info);
        cost[L] = info.cost;
        rp_csr_plan_free(plan);
    }
    CHECK(cost[0] == cost[1], "sparse tie: costs %g and %g", cost[0], cost[1]);
    CHECK(rp_csr_plan_create(2, leaves, -1, 0, &sparse_m, &plan, &err) == RP_OK, "plan: %s", err.msg);
    rp_csr_plan_describe(plan, &info);
    CHECK(info.levels == 0, "sparse tie chose %d levels, not 0", info.levels);
    rp_csr_plan_free(plan);
}

/* ---- the sparse chain ---- */

typedef struct {
    int64_t rows, cols, nnz;
    int32_t *indptr, *indices;
} test_csr;

/* A random CSR pattern with about `density` of its entries set. */
static test_csr random_pattern(int64_t rows, int64_t cols, float density)
{
    test_csr m = {rows, cols, 0, malloc((size_t)(rows + 1) * sizeof(int32_t)),
                  malloc((size_t)(rows * cols) * sizeof(int32_t))};
    m.indptr[0] = 0;
    for (int64_t i = 0; i < rows; i++) {
        for (int64_t j = 0; j < cols; j++)
            if ((rnd() + 1.0f) * 0.5f < density)
                m.indices[m.nnz++] = (int32_t)j;
        m.indptr[i + 1] = (int32_t)m.nnz;
    }
    return m;
}

/* A value map as a layer's weights give one: each value at its own raw
 * offset, among more raw values than the pattern uses (the test fills only
 * the mapped ones: a read of another is a NaN). */
static int32_t *random_value_map(int64_t nnz, int64_t *values)
{
    int32_t *map = malloc((size_t)(nnz > 0 ? nnz : 1) * sizeof *map);
    *values = 2 * nnz + 1;
    for (int64_t q = 0; q < nnz; q++) /* a permutation of the odd offsets, reversed */
        map[q] = (int32_t)(2 * (nnz - 1 - q) + 1);
    return map;
}

/* A shared leaf has sequence 0's values in every sequence. */
static void share_values(const rp_csr_pattern *leaf, float *values, int64_t B)
{
    for (int64_t b = 1; leaf->shared && b < B; b++)
        memcpy(values + b * leaf->nnz, values, (size_t)leaf->nnz * sizeof *values);
}

/* Runs a plan's program on the CPU from per-layer values (B, nnz) and g_out
 * (B, out): the layout of reprop.h, batch-minor, shared leaves from
 * sequence 0. g[i] (B, in_i) receives the results. */
static int csr_run(const rp_csr_plan *plan, int64_t n, int64_t B, const test_csr *pat,
                   const rp_csr_pattern *leaves,
                   float *const *values, const float *g_out, int64_t out_len, const int64_t *size,
                   float *const *g, int threads, rp_error *err)
{
    const rp_csr_program *prog = rp_csr_plan_program(plan);
    float *seq = malloc((size_t)(B * prog->seq_floats) * sizeof *seq);
    float *shared = malloc((size_t)prog->shared_floats * sizeof *shared);
    for (int64_t o = 0; o < B * prog->seq_floats; o++)
        seq[o] = NAN;
    for (int64_t o = 0; o < prog->shared_floats; o++)
        shared[o] = NAN;
    shared[0] = 1.0f;
    for (int64_t i = 0; i < n; i++) {
        const uint32_t a = prog->leaf_addr[i];
        for (int64_t q = 0; q < pat[i].nnz; q++) {
            const int64_t o = (a & ~RP_CSR_SHARED) + (leaves[i].value_map ? leaves[i].value_map[q] : q);
            if (a & RP_CSR_SHARED)
                shared[o] = values[i][q];
            else
                for (int64_t b = 0; b < B; b++)
                    seq[o * B + b] = values[i][b * pat[i].nnz + q];
        }
    }
    for (int64_t j = 0; j < out_len; j++)
        for (int64_t b = 0; b < B; b++)
            seq[(prog->g_out_addr + j) * B + b] = g_out[b * out_len + j];
    int rc = rp_csr_run_cpu(prog, B, seq, shared, threads, err), finite = 0;
    (void)size; /* each g[i] holds B x size[i] floats: what rp_csr_gradients_cpu writes */
    if (rc == RP_OK)
        rc = rp_csr_gradients_cpu(plan, B, seq, g, threads, &finite, err);
    CHECK(rc != RP_OK || finite, "finite gradients reported as not finite");
    free(seq), free(shared);
    return rc;
}

/* The pruned search of levels="auto" finds the exhaustive search's choice. */
/* Matrix id of a schedule (reprop.h: matrix k - 1 is leaf n - k, products
 * follow): rows, cols and whether it is shared. */
static void schedule_dims(const rp_csr_schedule *s, int64_t n, const rp_csr_pattern *leaves, int64_t id,
                          int64_t dims[3])
{
    if (id < n) {
        const rp_csr_pattern *leaf = &leaves[n - 1 - id];
        dims[0] = leaf->rows, dims[1] = leaf->cols, dims[2] = leaf->shared != 0;
    } else {
        const int64_t *row = &s->products[(id - n) * RP_CSR_PRODUCT_COLS];
        dims[0] = row[2], dims[1] = row[3], dims[2] = row[4];
    }
}

/* The step table against its plan: the plan's products, each of the shape
 * and sharing its operands give, computed by one GEMM step after theirs;
 * every mat-vec of a matrix made by then, every vector in range. */
static void check_schedule(const rp_csr_plan *plan, const rp_csr_schedule *s, int64_t n,
                           const rp_csr_pattern *leaves)
{
    rp_csr_plan_info info;
    int64_t a[3], b[3], c[3], gemms = 0;
    char *made = calloc((size_t)(n + s->nproducts), 1);
    rp_csr_plan_describe(plan, &info);
    CHECK(s->nproducts == info.products, "schedule: %lld products, the plan has %lld",
          (long long)s->nproducts, (long long)info.products);
    CHECK(s->nvectors == n + 4, "schedule: %lld vectors for %lld layers", (long long)s->nvectors, (long long)n);
    memset(made, 1, (size_t)n);
    for (int64_t j = 0; j < s->nproducts; j++) {
        const int64_t *row = &s->products[j * RP_CSR_PRODUCT_COLS];
        const int ok = row[0] >= 0 && row[0] < n + j && row[1] >= 0 && row[1] < n + j;
        CHECK(ok, "schedule: product %lld of %lld x %lld", (long long)j, (long long)row[0], (long long)row[1]);
        if (!ok)
            continue;
        schedule_dims(s, n, leaves, row[0], a), schedule_dims(s, n, leaves, row[1], b);
        schedule_dims(s, n, leaves, n + j, c);
        CHECK(a[1] == b[0] && c[0] == a[0] && c[1] == b[1] && c[2] == (a[2] && b[2]),
              "schedule: product %lld is %lld x %lld (shared %lld) from %lld x %lld and %lld x %lld",
              (long long)j, (long long)c[0], (long long)c[1], (long long)c[2], (long long)a[0],
              (long long)a[1], (long long)b[0], (long long)b[1]);
    }
    for (int64_t t = 0; t < s->nsteps; t++) {
        const int64_t *st = &s->steps[t * RP_CSR_STEP_COLS], m = st[1], x = st[2], y = st[3];
        const int vecs = x >= 0 && x < s->nvectors && y >= 0 && y < s->nvectors && x != y;
        int ok;
        if (st[0] == RP_CSR_GEMM) {
            const int64_t *row = m >= n && m < n + s->nproducts ? &s->products[(m - n) * RP_CSR_PRODUCT_COLS]
                                                                : NULL;
            ok = row != NULL && row[0] >= 0 && row[0] < m && row[1] >= 0 && row[1] < m && !made[m] &&
                 made[row[0]] && made[row[1]];
            if (ok)
                made[m] = 1, gemms++;
        } else if (st[0] == RP_CSR_MV) {
            ok = vecs && m >= 0 && m < n + s->nproducts && made[m];
            if (ok)
                schedule_dims(s, n, leaves, m, c), ok = c[0] <= s->width && c[1] <= s->width;
        } else {
            ok = st[0] == RP_CSR_COPY && m == -1 && vecs && st[4] > 0 && st[4] <= s->width;
        }
        CHECK(ok, "schedule: step %lld (%lld, %lld, %lld, %lld, %lld) is not valid here", (long long)t,
              (long long)st[0], (long long)m, (long long)x, (long long)y, (long long)st[4]);
    }
    CHECK(gemms == s->nproducts, "schedule: %lld GEMM steps for %lld products", (long long)gemms,
          (long long)s->nproducts);
    free(made);
}

/* The table's steps in double over dense matrices (layers at most 8 wide),
 * sequence b: the worst difference of each g_i, out of vector n - i + 1,
 * from want (test_csr_chain's layout). */
static double schedule_error(const rp_csr_schedule *s, int64_t n, const rp_csr_pattern *leaves,
                             float *const *values, const float *g_out, int64_t b, const double *want)
{
    const int64_t W = s->width;
    double *mat = calloc((size_t)((n + s->nproducts) * 64), sizeof *mat);
    double *vec = calloc((size_t)(s->nvectors * W), sizeof *vec), worst = 0.0;
    int64_t a[3], c[3];
    for (int64_t id = 0; id < n; id++) {
        const rp_csr_pattern *leaf = &leaves[n - 1 - id];
        for (int64_t r = 0; r < leaf->rows; r++)
            for (int64_t q = leaf->indptr[r]; q < leaf->indptr[r + 1]; q++)
                mat[id * 64 + r * 8 + leaf->indices[q]] = values[n - 1 - id][b * leaf->nnz + q];
    }
    for (int64_t j = 0; j < leaves[n - 1].cols; j++)
        vec[j] = g_out[b * leaves[n - 1].cols + j];
    for (int64_t t = 0; t < s->nsteps; t++) {
        const int64_t *st = &s->steps[t * RP_CSR_STEP_COLS], m = st[1];
        double *x = &vec[st[2] * W], *y = &vec[st[3] * W];
        if (st[0] == RP_CSR_COPY) {
            memcpy(y, x, (size_t)st[4] * sizeof *y);
            continue;
        }
        schedule_dims(s, n, leaves, m, c);
        if (st[0] == RP_CSR_MV) {
            for (int64_t r = 0; r < c[0]; r++) {
                y[r] = 0.0;
                for (int64_t k = 0; k < c[1]; k++)
                    y[r] += mat[m * 64 + r * 8 + k] * x[k];
            }
            continue;
        }
        const int64_t *row = &s->products[(m - n) * RP_CSR_PRODUCT_COLS];
        schedule_dims(s, n, leaves, row[0], a);
        for (int64_t r = 0; r < c[0]; r++)
            for (int64_t k = 0; k < c[1]; k++)
                for (int64_t u = 0; u < a[1]; u++)
                    mat[m * 64 + r * 8 + k] += mat[row[0] * 64 + r * 8 + u] * mat[row[1] * 64 + u * 8 + k];
    }
    for (int64_t i = 0; i < n; i++)
        for (int64_t r = 0; r < leaves[i].rows; r++)
            worst = fmax(worst, fabs(vec[(n - i + 1) * W + r] - want[(b * (n + 1) + i) * 8 + r]));
    free(mat), free(vec);
    return worst;
}

static void check_auto_levels(int64_t n, const rp_csr_pattern *leaves, const rp_scan_machine *m)
{
    rp_error err = {{0}};
    rp_csr_plan_info info;
    rp_csr_plan *plan = NULL;
    double best_cost = INFINITY;
    int best = 0, chosen;
    for (int L = 0; L <= rp_scan_max_levels(n + 1); L++) {
        CHECK(rp_csr_plan_create(n, leaves, L, 0, m, &plan, &err) == RP_OK, "plan: %s", err.msg);
        rp_csr_plan_describe(plan, &info);
        if (info.cost < best_cost)
            best_cost = info.cost, best = L;
        rp_csr_plan_free(plan);
    }
    CHECK(rp_csr_plan_create(n, leaves, -1, 0, m, &plan, &err) == RP_OK, "plan: %s", err.msg);
    rp_csr_plan_describe(plan, &info);
    chosen = info.levels;
    rp_csr_plan_free(plan);
    CHECK(chosen == best, "csr n=%lld: auto chose %d levels, the cheapest is %d (machine %g %g %g)",
          (long long)n, chosen, best, m->workers, m->level_cost, m->step_cost);
}

static void test_csr_chain(int64_t n, int64_t B, int threads)
{
    test_csr *pat = malloc((size_t)n * sizeof *pat);
    rp_csr_pattern *leaves = malloc((size_t)n * sizeof *leaves);
    float **values = malloc((size_t)n * sizeof *values), **g = malloc((size_t)n * sizeof *g);
    int32_t **maps = calloc((size_t)n, sizeof *maps);
    int64_t *size = malloc((size_t)(n + 1) * sizeof *size);
    rp_scan_machine m = {4, 100, 10};
    rp_error err = {{0}};
    for (int64_t i = 0; i <= n; i++)
        size[i] = 1 + (int64_t)((rnd() + 1.0f) * 4.0f); /* layer sizes 1..8 */
    for (int64_t i = 0; i < n; i++) {
        pat[i] = random_pattern(size[i], size[i + 1], 0.4f);
        leaves[i] = (rp_csr_pattern){pat[i].rows, pat[i].cols, pat[i].nnz, pat[i].indptr, pat[i].indices,
                                     rnd() > 0.0f, NULL, 0};
        if (rnd() > 0.0f)
            leaves[i].value_map = maps[i] = random_value_map(pat[i].nnz, &leaves[i].values);
        values[i] = rnd_array(B * pat[i].nnz, 0.9f);
        share_values(&leaves[i], values[i], B);
        g[i] = malloc((size_t)(B * size[i]) * sizeof *g[i]);
    }
    float *g_out = rnd_array(B * size[n], 1.0f);
    const rp_scan_machine machines[3] = {{4, 100, 10}, {64, 0, 200}, {16, 5, 40}};
    for (int k = 0; k < 3; k++)
        check_auto_levels(n, leaves, &machines[k]);
    for (int round = 0; round < 2; round++) {
        /* reference: g_i = J_i^T g_{i+1} in double */
        double *want = malloc((size_t)(B * 8 * (n + 1)) * sizeof *want);
        for (int64_t b = 0; b < B; b++) {
            double cur[8], next[8];
            for (int64_t j = 0; j < size[n]; j++)
                cur[j] = g_out[b * size[n] + j];
            for (int64_t i = n - 1; i >= 0; i--) {
                for (int64_t r = 0; r < size[i]; r++) {
                    next[r] = 0.0;
                    for (int64_t q = pat[i].indptr[r]; q < pat[i].indptr[r + 1]; q++)
                        next[r] += (double)values[i][b * pat[i].nnz + q] * cur[pat[i].indices[q]];
                }
                memcpy(cur, next, sizeof cur);
                for (int64_t r = 0; r < size[i]; r++)
                    want[(b * (n + 1) + i) * 8 + r] = cur[r];
            }
        }
        for (int L = -1; L <= rp_scan_max_levels(n + 1); L++) {
            rp_csr_plan *plan = NULL;
            rp_csr_plan_info info;
            int rc = rp_csr_plan_create(n, leaves, L, 0, &m, &plan, &err);
            CHECK(rc == RP_OK, "plan n=%lld L=%d: %s", (long long)n, L, err.msg);
            if (rc != RP_OK)
                continue;
            rp_csr_plan_describe(plan, &info);
            CHECK(L < 0 || info.levels == L, "levels %d != %d", info.levels, L);
            rc = csr_run(plan, n, B, pat, leaves, values, g_out, size[n], size, g, threads, &err);
            CHECK(rc == RP_OK, "scan: %s", err.msg);
            double worst = 0.0;
            for (int64_t b = 0; b < B; b++)
                for (int64_t i = 0; i < n; i++)
                    for (int64_t r = 0; r < size[i]; r++)
                        worst = fmax(worst, fabs(g[i][b * size[i] + r] - want[(b * (n + 1) + i) * 8 + r]));
            CHECK(worst <= 1e-5, "csr n=%lld L=%d round %d: error %g", (long long)n, info.levels, round, worst);
            rp_csr_schedule sched;
            CHECK(rp_csr_plan_schedule(plan, &sched, &err) == RP_OK, "schedule: %s", err.msg);
            check_schedule(plan, &sched, n, leaves);
            for (int64_t b = 0; b < B; b++) {
                const double e = schedule_error(&sched, n, leaves, values, g_out, b, want);
                CHECK(e <= 1e-9, "csr n=%lld L=%d: the step table's scan is off by %g", (long long)n,
                      info.levels, e);
            }
            rp_csr_schedule_free(&sched);
            rp_csr_plan_free(plan);
        }
        free(want);
        /* new values, same patterns: plans are rebuilt above but must not care */
        for (int64_t i = 0; i < n; i++) {
            for (int64_t q = 0; q < B * pat[i].nnz; q++)
                values[i][q] = 0.9f * rnd();
            share_values(&leaves[i], values[i], B);
        }
    }
    for (int64_t i = 0; i < n; i++)
        free(pat[i].indptr), free(pat[i].indices), free(values[i]), free(g[i]), free(maps[i]);
    free(pat), free(leaves), free(values), free(g), free(size), free(g_out), free(maps);
}

static void test_csr_errors(void)
{
    int32_t ptr[3] = {0, 1, 2}, idx[2] = {1, 0}, bad[2] = {0, 5};
    rp_csr_pattern a = {2, 2, 2, ptr, idx, 0, NULL, 0}, b = {3, 2, 2, ptr, idx, 1, NULL, 0};
    rp_csr_pattern c = {2, 2, 2, ptr, bad, 0, NULL, 0}, d = {2, 2, 2, ptr, idx, 1, idx, 1};
    rp_csr_pattern chain[2] = {a, b};
    rp_scan_machine m = {1, 0, 0};
    rp_csr_plan *plan = NULL;
    rp_error err = {{0}};
    CHECK(rp_csr_plan_create(2, chain, -1, 0, &m, &plan, &err) == RP_EINVAL && strstr(err.msg, "outputs"),
          "mismatched chain: %s", err.msg);
    CHECK(rp_csr_plan_create(1, &c, -1, 0, &m, &plan, &err) == RP_EINVAL && strstr(err.msg, "row 1"),
          "column out of range: %s", err.msg);
    CHECK(rp_csr_plan_create(1, &d, -1, 0, &m, &plan, &err) == RP_EINVAL && strstr(err.msg, "value_map[0] = 1"),
          "value map out of range: %s", err.msg);
    /* a column twice in one row: refused, not summed twice */
    int32_t twice[2] = {1, 1}, row0[3] = {0, 2, 2};
    rp_csr_pattern dup = {2, 2, 2, row0, twice, 0, NULL, 0};
    CHECK(rp_csr_plan_create(1, &dup, -1, 0, &m, &plan, &err) == RP_EINVAL && strstr(err.msg, "unique"),
          "a repeated column: %s", err.msg);
    CHECK(plan == NULL, "no plan for a repeated column");
    rp_csr_plan_free(plan);
    plan = NULL;
    /* row 0 claims [0, 3) of 2 entries, row 1 steps back to 2 = nnz: refused
     * before any row is read (ASan: indices[2] is past the array) */
    int32_t back[3] = {0, 3, 2}, four[2] = {0, 1};
    rp_csr_pattern e = {2, 4, 2, back, four, 0, NULL, 0};
    CHECK(rp_csr_plan_create(1, &e, -1, 0, &m, &plan, &err) == RP_EINVAL && strstr(err.msg, "indptr"),
          "decreasing indptr: %s", err.msg);
    /* address spaces past 2^31 floats are refused, also where the sizes would
     * wrap int64 first (2^62 columns; shared leaves of 2^62 values each) */
    int32_t none[2] = {0, 0}, one[2] = {0, 1}, zero[1] = {0};
    const int64_t huge = (int64_t)1 << 62;
    rp_csr_pattern wide[2] = {{1, 1, 0, none, NULL, 0, NULL, 0}, {1, huge, 0, none, NULL, 0, NULL, 0}};
    rp_csr_pattern big = {1, 1, 1, one, zero, 1, zero, huge}, bigs[4] = {big, big, big, big};
    CHECK(rp_csr_plan_create(2, wide, 0, 0, &m, &plan, &err) == RP_EINVAL && strstr(err.msg, "2^31"),
          "2^62 columns: %s", err.msg);
    for (int k = 2; k <= 4; k++)
        CHECK(rp_csr_plan_create(k, bigs, 0, 0, &m, &plan, &err) == RP_EINVAL && strstr(err.msg, "2^31"),
              "%d leaves of 2^62 shared values: %s", k, err.msg);
    CHECK(plan == NULL, "no plan on error");
    /* a NaN machine cost plans (the budget was a NaN cast to int64: UBSan) */
    rp_csr_pattern units[3] = {big, big, big};
    for (int k = 0; k < 3; k++)
        units[k].values = 1;
    const rp_scan_machine nan_cost = {4, NAN, 0};
    CHECK(rp_csr_plan_create(3, units, -1, 0, &nan_cost, &plan, &err) == RP_OK, "NaN cost: %s", err.msg);
    rp_csr_plan_free(plan);
    plan = NULL;
    CHECK(rp_csr_plan_create(1, &a, -1, 0, &m, &plan, &err) == RP_OK, "plan: %s", err.msg);
    float seq[64], shared[64];
    CHECK(rp_csr_run_cpu(rp_csr_plan_program(plan), -1, seq, shared, 1, &err) == RP_EINVAL &&
              strstr(err.msg, "batch"), "negative batch: %s", err.msg);
    CHECK(rp_csr_run_cpu(rp_csr_plan_program(plan), 1, NULL, shared, 1, &err) == RP_EINVAL &&
              strstr(err.msg, "NULL"), "NULL seq: %s", err.msg);
    CHECK(rp_csr_run_cpu(rp_csr_plan_program(plan), 0, NULL, NULL, 1, &err) == RP_OK, "batch 0: %s", err.msg);
    /* the copy-out: batch-major out of the batch-minor buffer, and one
     * non-finite value anywhere (inf or NaN) makes the whole set not finite */
    const rp_csr_program *prog = rp_csr_plan_program(plan);
    const int64_t B = 3, at = (int64_t)prog->g_addr[0] * B;
    float *buf = calloc((size_t)(B * prog->seq_floats), sizeof *buf), out0[6];
    float *const out[1] = {out0};
    int finite = -1;
    CHECK(at + 2 * B <= B * prog->seq_floats, "g_0 inside the buffer");
    for (int64_t k = 0; k < 2 * B; k++)
        buf[at + k] = (float)k; /* row r, sequence b at r * B + b */
    CHECK(rp_csr_gradients_cpu(plan, B, buf, out, 1, &finite, &err) == RP_OK && finite == 1,
          "copy-out: %s", err.msg);
    for (int64_t b = 0; b < B; b++)
        for (int64_t r = 0; r < 2; r++)
            CHECK(out0[b * 2 + r] == (float)(r * B + b), "out[%lld][%lld]", (long long)b, (long long)r);
    /* the largest finite floats are finite */
    buf[at] = FLT_MAX, buf[at + 1] = -FLT_MAX;
    CHECK(rp_csr_gradients_cpu(plan, B, buf, out, 1, &finite, &err) == RP_OK && finite == 1,
          "+-FLT_MAX reported as not finite");
    const float bad_values[2] = {INFINITY, NAN};
    for (int k = 0; k < 2; k++) {
        buf[at + 2 * B - 1] = bad_values[k];
        CHECK(rp_csr_gradients_cpu(plan, B, buf, out, 1, &finite, &err) == RP_OK && finite == 0,
              "a non-finite value (%g) passed", (double)bad_values[k]);
    }
    CHECK(rp_csr_gradients_cpu(plan, -1, buf, out, 1, &finite, &err) == RP_EINVAL, "negative batch");
    CHECK(rp_csr_gradients_cpu(plan, 1, NULL, out, 1, &finite, &err) == RP_EINVAL, "NULL seq");
    free(buf);
    rp_csr_plan_free(plan);
}

/* ---- mutation audit (mut_scan): checks no other test made ---- */

/* An activation with both v and y, and pre_activation with G = 3 gates, are
 * refused (the checks accepted either when weakened to "y given" and
 * "G >= 1"); the workspace one float past the int64 byte cap is refused,
 * its spare slot's B H floats counted (dropped from the check, the count
 * passed as cap + 1). */
static void test_audit_checks(void)
{
    float buf[64] = {0};
    rp_error err = {{0}};
    rp_scan_jacobians j = {4, 1, 2, 1, buf, NULL, buf, NULL, RP_SCAN_ACT_TANH, buf + 16, 0};
    CHECK(rp_scan_cpu(&j, buf, buf + 8, 0, NULL, 1, &err) == RP_EINVAL && strstr(err.msg, "v must be NULL"),
          "activation with v and y: %s", err.msg);
    j = (rp_scan_jacobians){4, 1, 2, 3, buf, NULL, buf + 32, NULL, RP_SCAN_ACT_NONE, NULL, 1};
    CHECK(rp_scan_cpu(&j, buf, buf + 8, 0, NULL, 1, &err) == RP_EINVAL && strstr(err.msg, "gates = 1"),
          "pre_activation with 3 gates: %s", err.msg);
    /* B = 2, H = 1: 2 (n + 1) + 2 (n / 2 - 1) floats, cap + 1 (cap = 1 mod 6) for n = 2 (cap - 1) / 6 + 1 */
    const int64_t cap = INT64_MAX / 4, n = 2 * ((cap - 1) / 6) + 1;
    CHECK(rp_scan_workspace_floats(n - 2, 2, 1, 1) == cap - 5, "six floats below the cap");
    CHECK(rp_scan_workspace_floats(n, 2, 1, 1) == -1, "one float past the cap: %lld",
          (long long)rp_scan_workspace_floats(n, 2, 1, 1));
    CHECK(rp_scan_check_sizes(n, 2, 1, 1, 1, &err) == RP_EINVAL && strstr(err.msg, "workspace"),
          "one float past the cap: %s", err.msg);
}

/* The dense cost model against a hand-worked figure, and the choice of the
 * deepest level where it alone is cheapest. n = 8, B = 3, H = 2, G = 1, two
 * levels, W = 2, level cost 10, step cost 1: leaf mat-mat 2^3 + 2^2 = 12,
 * mat-mat 8, leaf mat-vec 2^2 + 2 = 6, mat-vec 4. Level 0: 4 pairs up and 4
 * down per sequence, 12 tasks in 6 rounds: 6 * 12 + 10 and 6 * 6 + 10;
 * level 1: 2 and 2, 6 tasks in 3 rounds: 3 * 8 + 10 and 3 * 4 + 10; the
 * middle: 8 / 4 - 1 = 1 step, 3 sequences in 2 rounds: 2 * 4 + 1. In all
 * 82 + 46 + 34 + 22 + 9 = 193. n = 3 with a step cost of 1000 and free
 * levels: the linear scan's 2 steps cost 2 (6 + 1000), one level 2 + 2. */
static void test_audit_cost(void)
{
    const rp_scan_machine m = {2, 10, 1}, steps_dear = {100, 0, 1000};
    rp_error err = {{0}};
    double cost = -1.0;
    CHECK(rp_scan_cost(8, 3, 2, 1, 2, &m, &cost, &err) == RP_OK && cost == 193.0, "hand-worked cost: %g",
          cost);
    CHECK(rp_scan_cost(3, 1, 1, 1, 1, &steps_dear, &cost, &err) == RP_OK && cost == 4.0, "n = 3, L = 1: %g",
          cost);
    CHECK(rp_scan_choose_levels(3, 1, 1, 1, &steps_dear) == 1, "the one level, cheapest, chose %d",
          rp_scan_choose_levels(3, 1, 1, 1, &steps_dear));
}

/* max_pairs caps a product at that many pairs: one of exactly max_pairs is
 * planned (three 1 x 1 leaves: level 0's one product off the spine has one
 * pair), one more than max_pairs is not. */
static void test_audit_max_pairs(void)
{
    const rp_scan_machine m = {1, 0, 0};
    int32_t ptr[2] = {0, 1}, idx[1] = {0};
    const rp_csr_pattern unit = {1, 1, 1, ptr, idx, 0, NULL, 0}, leaves[3] = {unit, unit, unit};
    rp_csr_plan *plan = NULL;
    rp_csr_plan_info info;
    rp_error err = {{0}};
    CHECK(rp_csr_plan_create(3, leaves, 1, 1, &m, &plan, &err) == RP_OK, "plan: %s", err.msg);
    rp_csr_plan_describe(plan, &info);
    CHECK(info.levels == 1 && info.products == 1 && info.pairs == 1,
          "max_pairs 1, a product of 1 pair: %d levels, %lld products", info.levels, (long long)info.products);
    rp_csr_plan_free(plan);
    int32_t ptr2[2] = {0, 2}, idx2[2] = {0, 1}, ptr3[3] = {0, 1, 2}, idx3[2] = {0, 0};
    /* 1 x 2 then 2 x 1 leaves: the product of slot 3 (leaf 0) and slot 2 (leaf 1) has 2 pairs */
    const rp_csr_pattern row = {1, 2, 2, ptr2, idx2, 0, NULL, 0}, col = {2, 1, 2, ptr3, idx3, 0, NULL, 0};
    const rp_csr_pattern chain[3] = {row, col, unit};
    CHECK(rp_csr_plan_create(3, chain, 1, 1, &m, &plan, &err) == RP_OK, "plan: %s", err.msg);
    rp_csr_plan_describe(plan, &info);
    CHECK(info.levels == 0 && info.products == 0, "max_pairs 1, a product of 2 pairs: %d levels", info.levels);
    rp_csr_plan_free(plan);
    CHECK(rp_csr_plan_create(3, chain, 1, 2, &m, &plan, &err) == RP_OK, "plan: %s", err.msg);
    rp_csr_plan_describe(plan, &info);
    CHECK(info.levels == 1 && info.pairs == 2, "max_pairs 2, a product of 2 pairs: %d levels, %lld pairs",
          info.levels, (long long)info.pairs);
    rp_csr_plan_free(plan);
}

/* Every mat-vec row of the program, with a leaf's map or a planned
 * product's, reads its input vector in ascending index: products' patterns
 * are sorted CSR like the leaves', so every row sums in column order (a
 * product sorted the other way gave the same values but for rounding). */
static void test_audit_products_sorted(void)
{
    enum { n = 12 };
    test_csr pat[n];
    rp_csr_pattern leaves[n];
    const rp_scan_machine m = {4, 100, 10};
    rp_csr_plan *plan = NULL;
    rp_csr_schedule sched;
    rp_error err = {{0}};
    for (int64_t i = 0; i < n; i++) {
        pat[i] = random_pattern(6, 6, 0.5f);
        leaves[i] = (rp_csr_pattern){6, 6, pat[i].nnz, pat[i].indptr, pat[i].indices, i % 2, NULL, 0};
    }
    CHECK(rp_csr_plan_create(n, leaves, rp_scan_max_levels(n + 1), 0, &m, &plan, &err) == RP_OK, "plan: %s",
          err.msg);
    CHECK(rp_csr_plan_schedule(plan, &sched, &err) == RP_OK, "schedule: %s", err.msg);
    const rp_csr_program *g = rp_csr_plan_program(plan);
    const uint32_t lo = g->g_out_addr, hi = lo + (uint32_t)(sched.nvectors * sched.width);
    int64_t rows = 0, product_rows = 0;
    for (int64_t r = 0; r < g->nrows; r++) {
        const int64_t t0 = g->term_ptr[r], t1 = g->term_ptr[r + 1];
        int matvec = t0 < t1, sorted = 1, of_product = 0;
        for (int64_t t = t0; t < t1 && matvec; t++) {
            matvec = !(g->ty[t] & RP_CSR_SHARED) && g->ty[t] >= lo && g->ty[t] < hi;
            sorted &= t == t0 || g->ty[t] > g->ty[t - 1];
            of_product |= !(g->tx[t] & RP_CSR_SHARED) && g->tx[t] >= hi; /* per-sequence products follow the vectors */
        }
        if (!matvec)
            continue;
        rows++, product_rows += of_product;
        CHECK(sorted, "mat-vec row %lld reads its vector out of order", (long long)r);
    }
    CHECK(rows > 0 && product_rows > 0, "%lld mat-vec rows, %lld of products", (long long)rows,
          (long long)product_rows);
    rp_csr_schedule_free(&sched);
    rp_csr_plan_free(plan);
    for (int64_t i = 0; i < n; i++)
        free(pat[i].indptr), free(pat[i].indices);
}

/* The sparse cost of one sequence against hand-worked figures: three 1 x 1
 * leaves (4 slots), W = 4, free levels and steps. The linear scan's 3
 * middle steps of 1 multiply-add each run one after another, whatever W:
 * 3; one level's 3 multiply-adds (up: the spine's 1 and a product's 1 pair;
 * down: 1) spread over the workers, 3 / 4, then the middle's one step (the
 * product's 1 multiply-add on one sequence, not shared out): 1.75. */
static void test_audit_csr_cost(void)
{
    const rp_scan_machine m = {4, 0, 0};
    int32_t ptr[2] = {0, 1}, idx[1] = {0};
    const rp_csr_pattern unit = {1, 1, 1, ptr, idx, 0, NULL, 0}, leaves[3] = {unit, unit, unit};
    const double want[2] = {3.0, 1.75};
    rp_csr_plan *plan = NULL;
    rp_csr_plan_info info;
    rp_error err = {{0}};
    for (int L = 0; L < 2; L++) {
        CHECK(rp_csr_plan_create(3, leaves, L, 0, &m, &plan, &err) == RP_OK, "plan: %s", err.msg);
        rp_csr_plan_describe(plan, &info);
        CHECK(info.cost == want[L], "L = %d: cost %g, hand-worked %g", L, info.cost, want[L]);
        rp_csr_plan_free(plan);
    }
}

/* A leaf whose indptr ends short of nnz, or past it (its last row would run
 * past indices), is refused; only a decreasing indptr was tested. */
static void test_audit_indptr_end(void)
{
    const rp_scan_machine m = {1, 0, 0};
    int32_t ptr_short[3] = {0, 1, 1}, ptr_past[3] = {0, 1, 3}, idx[2] = {0, 1};
    const rp_csr_pattern cases[2] = {{2, 2, 2, ptr_short, idx, 0, NULL, 0}, {2, 2, 2, ptr_past, idx, 0, NULL, 0}};
    for (int k = 0; k < 2; k++) {
        rp_csr_plan *plan = NULL;
        rp_error err = {{0}};
        CHECK(rp_csr_plan_create(1, &cases[k], 0, 0, &m, &plan, &err) == RP_EINVAL &&
                  strstr(err.msg, "from 0 to nnz") && plan == NULL,
              "indptr ending at %d for nnz 2: %s", (int)cases[k].indptr[2], err.msg);
        rp_csr_plan_free(plan);
    }
}

/* The 2^31 floats a program addresses bound the sum of its allocations, not
 * each one: two per-sequence leaves of 2^30 raw values each (a value map
 * reads one of them; nothing that large is allocated) pass it together and
 * are refused, where one of them fits. */
static void test_audit_address_space_sum(void)
{
    const rp_scan_machine m = {1, 0, 0};
    int32_t ptr[2] = {0, 1}, idx[1] = {0}, map[1] = {0};
    const rp_csr_pattern big = {1, 1, 1, ptr, idx, 0, map, (int64_t)1 << 30}, leaves[2] = {big, big};
    rp_csr_plan *plan = NULL;
    rp_error err = {{0}};
    CHECK(rp_csr_plan_create(1, leaves, 0, 0, &m, &plan, &err) == RP_OK, "one leaf of 2^30 values: %s",
          err.msg);
    rp_csr_plan_free(plan);
    plan = NULL;
    CHECK(rp_csr_plan_create(2, leaves, 0, 0, &m, &plan, &err) == RP_EINVAL && strstr(err.msg, "2^31 floats") &&
              plan == NULL,
          "two leaves of 2^30 values: %s", err.msg);
    rp_csr_plan_free(plan);
}

int main(void)
{
    test_audit_checks();
    test_audit_address_space_sum();
    test_audit_indptr_end();
    test_audit_csr_cost();
    test_audit_cost();
    test_audit_max_pairs();
    test_audit_products_sorted();
    test_csr_errors();
    for (int64_t n = 1; n <= 40; n++)
        test_csr_chain(n, 2, 2);
    test_csr_chain(70, 3, 3);
    test_levels();
    test_cost_ties_choose_fewer_levels();
    test_overflow_to_inf_falls_back();
    test_size_limits();
    test_errors();
    for (int64_t n = 1; n <= 70; n++)
        test_recurrence(n, 2, 3, 1, 0, 2);
    for (int64_t n = 1; n <= 70; n += 3) {
        test_recurrence(n, 1, 4, 0, 0, 1);
        test_recurrence(n, 3, 5, 3, 1, 3);
    }
    for (int64_t n = 1; n <= 70; n++)
        test_workspace_all_written(n, 2, 3, n % 2);
    test_workspace_all_written(1000, 2, 2, 1);
    test_recurrence(64, 2, 20, 1, 0, 2);
    test_recurrence(100, 1, 1, 1, 1, 2);
    test_recurrence(33, 2, 37, 3, 1, 2);
    for (int act = RP_SCAN_ACT_TANH; act <= RP_SCAN_ACT_RELU; act++) {
        for (int64_t n = 1; n <= 40; n++)
            test_activation(n, 3, 5, 1, act, 0, 2);
        test_activation(70, 2, 20, 1, act, 1, 2);
        test_activation(33, 2, 6, 3, act, 1, 3);
    }
    if (failures) {
        fprintf(stderr, "test_scan: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_scan: all passed\n");
    return 0;
}
