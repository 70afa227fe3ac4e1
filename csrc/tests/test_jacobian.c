/*
 * test_jacobian.c: unit tests of the analytic CSR transposed Jacobians
 * (csrc/jacobian.c), built and run under AddressSanitizer and
 * UndefinedBehaviorSanitizer.
 *
 * Each pattern is compared with a reference built by brute force straight
 * from the layer's definition, walking outputs and kernel taps the way the
 * forward pass does (never the input-side tap tables jacobian.c uses):
 * small layers against a dense J^T, larger ones (which take the OpenMP
 * path) against a sorted list of (row, column, map) triples. Every check
 * covers the CSR invariants (indptr monotone from 0 to nnz, columns
 * ascending and in range), every reference entry present exactly once,
 * nothing extra, and the gather maps: conv2d/linear values through wmap
 * equal the weights of the definition, and maxpool2d's
 * (indices[omap] == pmap) selects exactly each window's argmax. Then the
 * error statuses, including int32 overflow found by count-only calls.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../reprop.h"

#include "check.h"

static uint32_t rng_state = 20240611u;

static uint32_t rand_u32(void)
{
    rng_state = rng_state * 1664525u + 1013904223u;
    return rng_state >> 8;
}

/* Uniform in [lo, hi]. */
static int64_t rand_int(int64_t lo, int64_t hi)
{
    return lo + (int64_t)(rand_u32() % (uint32_t)(hi - lo + 1));
}

static float rand_float(void) { return (float)(rand_u32() & 0xffffffu) / 8388608.0f - 1.0f; }

static void describe(const rp_conv2d_geom *g, char *buf, size_t size)
{
    snprintf(buf, size,
             "c %lld->%lld in %lldx%lld out %lldx%lld k %lldx%lld s %lldx%lld p %lldx%lld "
             "d %lldx%lld groups %lld",
             (long long)g->c_in, (long long)g->c_out, (long long)g->h_in, (long long)g->w_in,
             (long long)g->h_out, (long long)g->w_out, (long long)g->kh, (long long)g->kw,
             (long long)g->sh, (long long)g->sw, (long long)g->ph, (long long)g->pw,
             (long long)g->dh, (long long)g->dw, (long long)g->groups);
}

/* torch's output sizes: Conv2d and MaxPool2d with ceil_mode false, and
 * MaxPool2d with ceil_mode true (the last window must start inside the input
 * or its left padding). */
static int64_t out_floor(int64_t n, int64_t k, int64_t s, int64_t p, int64_t d)
{
    return (n + 2 * p - d * (k - 1) - 1) / s + 1;
}

static int64_t out_ceil(int64_t n, int64_t k, int64_t s, int64_t p, int64_t d)
{
    int64_t o = (n + 2 * p - d * (k - 1) - 1 + s - 1) / s + 1;
    if ((o - 1) * s >= n + p)
        o--;
    return o;
}

/* A pattern as returned: nnz and arrays of rows + 1 and nnz elements. */
typedef struct {
    int64_t nnz;
    int32_t *indptr, *indices, *map1, *map2;
} jac;

static void jac_alloc(jac *j, int64_t rows, int maps)
{
    j->indptr = malloc((size_t)(rows + 1) * sizeof *j->indptr);
    j->indices = malloc((size_t)(j->nnz + 1) * sizeof *j->indices);
    j->map1 = maps >= 1 ? malloc((size_t)(j->nnz + 1) * sizeof *j->map1) : NULL;
    j->map2 = maps >= 2 ? malloc((size_t)(j->nnz + 1) * sizeof *j->map2) : NULL;
    if (j->indptr == NULL || j->indices == NULL || (maps >= 1 && j->map1 == NULL) ||
        (maps >= 2 && j->map2 == NULL)) {
        fprintf(stderr, "test_jacobian: out of memory\n");
        exit(1);
    }
}

static void jac_free(jac *j)
{
    free(j->indptr);
    free(j->indices);
    free(j->map1);
    free(j->map2);
}

/* The CSR invariants; 0 when broken, so that callers do not index with
 * out-of-range values. */
static int check_csr(const char *label, int64_t rows, int64_t cols, const jac *j)
{
    int64_t p, k;
    if (j->indptr[0] != 0 || j->indptr[rows] != j->nnz) {
        CHECK(0, "%s: indptr[0] = %d, indptr[rows] = %d, nnz = %lld", label, j->indptr[0],
              j->indptr[rows], (long long)j->nnz);
        return 0;
    }
    for (p = 0; p < rows; p++) {
        if (j->indptr[p + 1] < j->indptr[p]) {
            CHECK(0, "%s: indptr decreases at row %lld", label, (long long)p);
            return 0;
        }
        for (k = j->indptr[p]; k < j->indptr[p + 1]; k++) {
            if (j->indices[k] < 0 || j->indices[k] >= cols ||
                (k > j->indptr[p] && j->indices[k] <= j->indices[k - 1])) {
                CHECK(0, "%s: row %lld entry %lld: column %d out of range or not ascending",
                      label, (long long)p, (long long)k, j->indices[k]);
                return 0;
            }
        }
    }
    return 1;
}

/* ---- dense references of small layers ---- */

/* cnt[p * cols + q] counts the taps connecting input p and output q, val
 * sums their weights and widx keeps the last tap's weight index. */
typedef struct {
    int64_t rows, cols;
    int *cnt;
    double *val;
    int64_t *widx;
} dense;

static void dense_alloc(dense *d, int64_t rows, int64_t cols)
{
    d->rows = rows;
    d->cols = cols;
    d->cnt = calloc((size_t)(rows * cols), sizeof *d->cnt);
    d->val = calloc((size_t)(rows * cols), sizeof *d->val);
    d->widx = calloc((size_t)(rows * cols), sizeof *d->widx);
    if (d->cnt == NULL || d->val == NULL || d->widx == NULL) {
        fprintf(stderr, "test_jacobian: out of memory\n");
        exit(1);
    }
}

static void dense_free(dense *d)
{
    free(d->cnt);
    free(d->val);
    free(d->widx);
}

/* Entries of the dense reference: all single taps (0 for a double tap,
 * which no layer here may produce). */
static int64_t dense_count(const char *label, const dense *d)
{
    int64_t i, n = 0;
    for (i = 0; i < d->rows * d->cols; i++) {
        CHECK(d->cnt[i] <= 1, "%s: reference has %d taps on one entry", label, d->cnt[i]);
        n += d->cnt[i] != 0;
    }
    return n;
}

/* After the entries of a pattern have marked their cells 2: none left at 1. */
static void dense_check_all_seen(const char *label, const dense *d)
{
    int64_t i;
    for (i = 0; i < d->rows * d->cols; i++) {
        if (d->cnt[i] == 1) {
            CHECK(0, "%s: entry (%lld, %lld) missing", label, (long long)(i / d->cols),
                  (long long)(i % d->cols));
            return;
        }
    }
}

/* y[co, oh, ow] = sum over ci in co's group, ki, kj of
 *   w[co, ci - base, ki, kj] * x[ci, oh*sh - ph + ki*dh, ow*sw - pw + kj*dw]. */
static void conv2d_dense(const rp_conv2d_geom *g, const float *w, dense *d)
{
    const int64_t cpg_in = g->c_in / g->groups, cpg_out = g->c_out / g->groups;
    int64_t co, oh, ow, cl, ki, kj;
    for (co = 0; co < g->c_out; co++)
        for (oh = 0; oh < g->h_out; oh++)
            for (ow = 0; ow < g->w_out; ow++)
                for (cl = 0; cl < cpg_in; cl++)
                    for (ki = 0; ki < g->kh; ki++)
                        for (kj = 0; kj < g->kw; kj++) {
                            int64_t ih = oh * g->sh - g->ph + ki * g->dh;
                            int64_t iw = ow * g->sw - g->pw + kj * g->dw;
                            int64_t ci = co / cpg_out * cpg_in + cl, p, q, cell, widx;
                            if (ih < 0 || ih >= g->h_in || iw < 0 || iw >= g->w_in)
                                continue;
                            p = (ci * g->h_in + ih) * g->w_in + iw;
                            q = (co * g->h_out + oh) * g->w_out + ow;
                            widx = ((co * cpg_in + cl) * g->kh + ki) * g->kw + kj;
                            cell = p * d->cols + q;
                            d->cnt[cell]++;
                            d->val[cell] += (double)w[widx];
                            d->widx[cell] = widx;
                        }
}

static void test_conv2d_case(const rp_conv2d_geom *g)
{
    const int64_t rows = g->c_in * g->h_in * g->w_in, cols = g->c_out * g->h_out * g->w_out;
    const int64_t wnum = g->c_out * (g->c_in / g->groups) * g->kh * g->kw;
    char label[256];
    float *w = malloc((size_t)wnum * sizeof *w);
    dense d;
    jac j;
    rp_error err;
    int64_t i, p, k, want, nnz2 = -1;
    int rc;

    describe(g, label, sizeof label);
    if (w == NULL)
        exit(1);
    for (i = 0; i < wnum; i++)
        w[i] = rand_float();
    dense_alloc(&d, rows, cols);
    conv2d_dense(g, w, &d);
    want = dense_count(label, &d);

    memset(&j, 0, sizeof j);
    rc = rp_jac_conv2d(g, &j.nnz, NULL, NULL, NULL, &err);
    CHECK(rc == RP_OK, "conv2d %s: count: %s", label, err.msg);
    CHECK(j.nnz == want, "conv2d %s: nnz %lld, reference %lld", label, (long long)j.nnz,
          (long long)want);
    if (rc != RP_OK || j.nnz != want)
        goto done;
    jac_alloc(&j, rows, 1);
    rc = rp_jac_conv2d(g, &nnz2, j.indptr, j.indices, j.map1, &err);
    CHECK(rc == RP_OK && nnz2 == j.nnz, "conv2d %s: fill: rc %d nnz %lld: %s", label, rc,
          (long long)nnz2, err.msg);
    if (rc != RP_OK || !check_csr(label, rows, cols, &j))
        goto done_j;
    for (p = 0; p < rows; p++)
        for (k = j.indptr[p]; k < j.indptr[p + 1]; k++) {
            int64_t cell = p * cols + j.indices[k];
            int32_t wm = j.map1[k];
            if (d.cnt[cell] != 1) {
                CHECK(0, "conv2d %s: extra entry (%lld, %d)", label, (long long)p, j.indices[k]);
                goto done_j;
            }
            d.cnt[cell] = 2;
            CHECK(wm >= 0 && wm < wnum && wm == d.widx[cell] && (double)w[wm] == d.val[cell],
                  "conv2d %s: entry (%lld, %d): wmap %d, reference %lld", label, (long long)p,
                  j.indices[k], wm, (long long)d.widx[cell]);
        }
    dense_check_all_seen(label, &d);
done_j:
    jac_free(&j);
done:
    dense_free(&d);
    free(w);
}

/* Every (input, window) pair of a channel; windows scan ki, kj in order. */
static void maxpool2d_dense(const rp_conv2d_geom *g, dense *d)
{
    int64_t c, oh, ow, ki, kj;
    for (c = 0; c < g->c_in; c++)
        for (oh = 0; oh < g->h_out; oh++)
            for (ow = 0; ow < g->w_out; ow++)
                for (ki = 0; ki < g->kh; ki++)
                    for (kj = 0; kj < g->kw; kj++) {
                        int64_t ih = oh * g->sh - g->ph + ki * g->dh;
                        int64_t iw = ow * g->sw - g->pw + kj * g->dw;
                        if (ih < 0 || ih >= g->h_in || iw < 0 || iw >= g->w_in)
                            continue;
                        d->cnt[((c * g->h_in + ih) * g->w_in + iw) * d->cols +
                               (c * g->h_out + oh) * g->w_out + ow]++;
                    }
}

/* torch's return_indices of one sample: the within-plane index of the first
 * maximum of each window (padding is -inf, never chosen), -1 for a window
 * that lies entirely in the padding. */
static void maxpool2d_argmax(const rp_conv2d_geom *g, const float *x, int64_t *arg)
{
    int64_t c, oh, ow, ki, kj;
    for (c = 0; c < g->c_in; c++)
        for (oh = 0; oh < g->h_out; oh++)
            for (ow = 0; ow < g->w_out; ow++) {
                int64_t best = -1;
                for (ki = 0; ki < g->kh; ki++)
                    for (kj = 0; kj < g->kw; kj++) {
                        int64_t ih = oh * g->sh - g->ph + ki * g->dh;
                        int64_t iw = ow * g->sw - g->pw + kj * g->dw;
                        int64_t at = ih * g->w_in + iw;
                        const float *plane = x + c * g->h_in * g->w_in;
                        if (ih < 0 || ih >= g->h_in || iw < 0 || iw >= g->w_in)
                            continue;
                        if (best < 0 || plane[at] > plane[best])
                            best = at;
                    }
                arg[(c * g->h_out + oh) * g->w_out + ow] = best;
            }
}

static void test_maxpool2d_case(const rp_conv2d_geom *g)
{
    const int64_t plane = g->h_in * g->w_in;
    const int64_t rows = g->c_in * plane, cols = g->c_out * g->h_out * g->w_out;
    char label[256];
    float *x = malloc((size_t)rows * sizeof *x);
    int64_t *arg = malloc((size_t)cols * sizeof *arg);
    int *hits = calloc((size_t)cols, sizeof *hits);
    dense d;
    jac j;
    rp_error err;
    int64_t i, p, k, q, want, nnz2 = -1;
    int rc;

    describe(g, label, sizeof label);
    if (x == NULL || arg == NULL || hits == NULL)
        exit(1);
    dense_alloc(&d, rows, cols);
    maxpool2d_dense(g, &d);
    want = dense_count(label, &d);

    memset(&j, 0, sizeof j);
    rc = rp_jac_maxpool2d(g, &j.nnz, NULL, NULL, NULL, NULL, &err);
    CHECK(rc == RP_OK, "maxpool2d %s: count: %s", label, err.msg);
    CHECK(j.nnz == want, "maxpool2d %s: nnz %lld, reference %lld", label, (long long)j.nnz,
          (long long)want);
    if (rc != RP_OK || j.nnz != want)
        goto done;
    jac_alloc(&j, rows, 2);
    rc = rp_jac_maxpool2d(g, &nnz2, j.indptr, j.indices, j.map1, j.map2, &err);
    CHECK(rc == RP_OK && nnz2 == j.nnz, "maxpool2d %s: fill: rc %d nnz %lld: %s", label, rc,
          (long long)nnz2, err.msg);
    if (rc != RP_OK || !check_csr(label, rows, cols, &j))
        goto done_j;
    for (p = 0; p < rows; p++)
        for (k = j.indptr[p]; k < j.indptr[p + 1]; k++) {
            int64_t cell = p * cols + j.indices[k];
            if (d.cnt[cell] != 1) {
                CHECK(0, "maxpool2d %s: extra entry (%lld, %d)", label, (long long)p,
                      j.indices[k]);
                goto done_j;
            }
            d.cnt[cell] = 2;
            CHECK(j.map1[k] == j.indices[k] && j.map2[k] == p % plane,
                  "maxpool2d %s: entry (%lld, %d): omap %d pmap %d", label, (long long)p,
                  j.indices[k], j.map1[k], j.map2[k]);
        }
    dense_check_all_seen(label, &d);

    /* The values as the Python layer computes them, for two random inputs:
     * each window's argmax is selected by exactly one entry, in its row. */
    for (i = 0; i < 2; i++) {
        int64_t n;
        for (n = 0; n < rows; n++)
            x[n] = rand_float();
        maxpool2d_argmax(g, x, arg);
        memset(hits, 0, (size_t)cols * sizeof *hits);
        for (p = 0; p < rows; p++)
            for (k = j.indptr[p]; k < j.indptr[p + 1]; k++)
                if (j.map1[k] == j.indices[k] && arg[j.map1[k]] == j.map2[k]) {
                    q = j.indices[k];
                    hits[q]++;
                    CHECK(p == q / (g->h_out * g->w_out) * plane + arg[q],
                          "maxpool2d %s: window %lld selects row %lld", label, (long long)q,
                          (long long)p);
                }
        for (q = 0; q < cols; q++)
            CHECK(hits[q] == (arg[q] >= 0), "maxpool2d %s: window %lld selected %d times", label,
                  (long long)q, hits[q]);
    }
done_j:
    jac_free(&j);
done:
    dense_free(&d);
    free(x);
    free(arg);
    free(hits);
}

/* ---- triple references of larger layers (the OpenMP path) ---- */

typedef struct {
    int32_t p, q, aux;
} triple;

static int triple_cmp(const void *a, const void *b)
{
    const triple *x = a, *y = b;
    if (x->p != y->p)
        return x->p < y->p ? -1 : 1;
    if (x->q != y->q)
        return x->q < y->q ? -1 : 1;
    return 0;
}

/* conv2d (pool = 0, aux = weight index) or maxpool2d (pool = 1, aux = the
 * within-plane input index), enumerated from the output side. */
static triple *triples_build(const rp_conv2d_geom *g, int pool, int64_t *n)
{
    const int64_t cpg_in = pool ? 1 : g->c_in / g->groups;
    const int64_t cpg_out = pool ? 1 : g->c_out / g->groups;
    int64_t cap = g->c_out * g->h_out * g->w_out * cpg_in * g->kh * g->kw, co, oh, ow, cl, ki, kj;
    triple *t = malloc((size_t)(cap + 1) * sizeof *t);
    if (t == NULL)
        exit(1);
    *n = 0;
    for (co = 0; co < g->c_out; co++)
        for (oh = 0; oh < g->h_out; oh++)
            for (ow = 0; ow < g->w_out; ow++)
                for (cl = 0; cl < cpg_in; cl++)
                    for (ki = 0; ki < g->kh; ki++)
                        for (kj = 0; kj < g->kw; kj++) {
                            int64_t ih = oh * g->sh - g->ph + ki * g->dh;
                            int64_t iw = ow * g->sw - g->pw + kj * g->dw;
                            int64_t ci = co / cpg_out * cpg_in + cl;
                            triple *e = &t[*n];
                            if (ih < 0 || ih >= g->h_in || iw < 0 || iw >= g->w_in)
                                continue;
                            e->p = (int32_t)((ci * g->h_in + ih) * g->w_in + iw);
                            e->q = (int32_t)((co * g->h_out + oh) * g->w_out + ow);
                            e->aux = (int32_t)(pool ? ih * g->w_in + iw
                                                    : ((co * cpg_in + cl) * g->kh + ki) * g->kw +
                                                          kj);
                            (*n)++;
                        }
    qsort(t, (size_t)*n, sizeof *t, triple_cmp);
    return t;
}

static void test_large_case(const rp_conv2d_geom *g, int pool)
{
    const int64_t rows = g->c_in * g->h_in * g->w_in, cols = g->c_out * g->h_out * g->w_out;
    const char *name = pool ? "maxpool2d" : "conv2d";
    char label[256];
    int64_t n, p, k, nnz2 = -1;
    triple *t = triples_build(g, pool, &n);
    jac j;
    rp_error err;
    int rc;

    describe(g, label, sizeof label);
    for (k = 1; k < n; k++)
        CHECK(triple_cmp(&t[k - 1], &t[k]) != 0, "%s %s: reference has a double tap", name, label);
    memset(&j, 0, sizeof j);
    rc = pool ? rp_jac_maxpool2d(g, &j.nnz, NULL, NULL, NULL, NULL, &err)
              : rp_jac_conv2d(g, &j.nnz, NULL, NULL, NULL, &err);
    CHECK(rc == RP_OK && j.nnz == n, "%s %s: count: rc %d nnz %lld, reference %lld: %s", name,
          label, rc, (long long)j.nnz, (long long)n, err.msg);
    if (rc != RP_OK || j.nnz != n) {
        free(t);
        return;
    }
    jac_alloc(&j, rows, pool ? 2 : 1);
    rc = pool ? rp_jac_maxpool2d(g, &nnz2, j.indptr, j.indices, j.map1, j.map2, &err)
              : rp_jac_conv2d(g, &nnz2, j.indptr, j.indices, j.map1, &err);
    CHECK(rc == RP_OK && nnz2 == n, "%s %s: fill: %s", name, label, err.msg);
    if (rc == RP_OK && check_csr(label, rows, cols, &j)) {
        for (p = 0; p < rows; p++)
            for (k = j.indptr[p]; k < j.indptr[p + 1]; k++) {
                const triple *e = &t[k];
                int ok = e->p == p && e->q == j.indices[k] &&
                         (pool ? j.map1[k] == e->q && j.map2[k] == e->aux : j.map1[k] == e->aux);
                if (!ok) {
                    CHECK(0, "%s %s: entry %lld (%lld, %d) differs from reference (%d, %d)",
                          name, label, (long long)k, (long long)p, j.indices[k], e->p, e->q);
                    p = rows;
                    break;
                }
            }
    }
    jac_free(&j);
    free(t);
}

/* ---- geometries ---- */

static rp_conv2d_geom conv_geom(int64_t c_in, int64_t c_out, int64_t groups, int64_t h_in,
                                int64_t w_in, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                                int64_t ph, int64_t pw, int64_t dh, int64_t dw)
{
    rp_conv2d_geom g;
    g.c_in = c_in;
    g.c_out = c_out;
    g.groups = groups;
    g.h_in = h_in;
    g.w_in = w_in;
    g.kh = kh;
    g.kw = kw;
    g.sh = sh;
    g.sw = sw;
    g.ph = ph;
    g.pw = pw;
    g.dh = dh;
    g.dw = dw;
    g.h_out = out_floor(h_in, kh, sh, ph, dh);
    g.w_out = out_floor(w_in, kw, sw, pw, dw);
    return g;
}

/* Conv2d(padding='same') (stride 1): d (k - 1) padding in all per axis, half
 * before; an odd total puts the extra one after, and the output keeps the
 * input's size. */
static rp_conv2d_geom same_geom(int64_t c_in, int64_t c_out, int64_t groups, int64_t h_in,
                                int64_t w_in, int64_t kh, int64_t kw, int64_t dh, int64_t dw)
{
    rp_conv2d_geom g = conv_geom(c_in, c_out, groups, h_in, w_in, kh, kw, 1, 1, dh * (kh - 1) / 2,
                                 dw * (kw - 1) / 2, dh, dw);
    g.h_out = h_in;
    g.w_out = w_in;
    return g;
}

/* The smallest input the dilated kernel fits once padded, plus some. */
static int64_t rand_input(int64_t k, int64_t p, int64_t d, int64_t extra)
{
    int64_t need = d * (k - 1) + 1 - 2 * p;
    return (need < 1 ? 1 : need) + rand_int(0, extra);
}

static void test_conv2d(void)
{
    int64_t k, s, p, d, i;
    /* every square kernel, stride, padding and dilation in the ranges */
    for (k = 1; k <= 5; k++)
        for (s = 1; s <= 3; s++)
            for (p = 0; p <= 2; p++)
                for (d = 1; d <= 2; d++) {
                    rp_conv2d_geom g = conv_geom(2, 3, 1, rand_input(k, p, d, 5),
                                                 rand_input(k, p, d, 5), k, k, s, s, p, p, d, d);
                    test_conv2d_case(&g);
                    g = conv_geom(4, 2, 2, rand_input(k, p, d, 4), rand_input(k, p, d, 4), k, k, s,
                                  s, p, p, d, d);
                    test_conv2d_case(&g);
                }
    /* random mixtures: non-square kernels, per-axis strides, groups */
    for (i = 0; i < 1200; i++) {
        int64_t groups = rand_int(1, 3);
        int64_t kh = rand_int(1, 5), kw = rand_int(1, 5), ph = rand_int(0, 2),
                pw = rand_int(0, 2), dh = rand_int(1, 2), dw = rand_int(1, 2);
        rp_conv2d_geom g = conv_geom(groups * rand_int(1, 2), groups * rand_int(1, 3), groups,
                                     rand_input(kh, ph, dh, 6), rand_input(kw, pw, dw, 6), kh, kw,
                                     rand_int(1, 3), rand_int(1, 3), ph, pw, dh, dw);
        test_conv2d_case(&g);
    }
    /* padding='same', odd totals (the extra padding after) among even ones */
    for (i = 0; i < 200; i++) {
        int64_t groups = rand_int(1, 2);
        rp_conv2d_geom g = same_geom(groups * rand_int(1, 2), groups * rand_int(1, 3), groups,
                                     rand_int(1, 8), rand_int(1, 8), rand_int(1, 5), rand_int(1, 5),
                                     rand_int(1, 3), rand_int(1, 3));
        test_conv2d_case(&g);
    }
    /* edge cases: 1x1, kernel = input, padding bigger than the kernel, a
     * stride that skips every input (no non-zeros at all), a single pixel */
    {
        rp_conv2d_geom edges[] = {
            conv_geom(3, 5, 1, 6, 7, 1, 1, 1, 1, 0, 0, 1, 1),
            conv_geom(2, 2, 1, 5, 4, 5, 4, 1, 1, 0, 0, 1, 1),
            conv_geom(1, 2, 1, 3, 3, 1, 2, 2, 1, 2, 3, 1, 1),
            conv_geom(1, 1, 1, 1, 1, 1, 1, 3, 3, 2, 2, 1, 1),
            conv_geom(2, 4, 2, 1, 1, 3, 3, 1, 1, 1, 1, 1, 1),
            conv_geom(2, 2, 2, 9, 9, 3, 3, 3, 3, 0, 0, 3, 3),
        };
        for (i = 0; i < (int64_t)(sizeof edges / sizeof *edges); i++)
            test_conv2d_case(&edges[i]);
    }
    /* larger layers, parallel */
    {
        rp_conv2d_geom g = conv_geom(4, 6, 2, 40, 36, 3, 3, 1, 1, 1, 1, 1, 1);
        test_large_case(&g, 0);
        g = conv_geom(3, 8, 1, 45, 50, 5, 3, 2, 3, 2, 1, 2, 1);
        test_large_case(&g, 0);
    }
}

/* MaxPool2d output size, floor or ceil mode. */
static rp_conv2d_geom pool_geom(int64_t c, int64_t h_in, int64_t w_in, int64_t kh, int64_t kw,
                                int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh,
                                int64_t dw, int ceil_mode)
{
    rp_conv2d_geom g = conv_geom(c, c, 1, h_in, w_in, kh, kw, sh, sw, ph, pw, dh, dw);
    if (ceil_mode) {
        g.h_out = out_ceil(h_in, kh, sh, ph, dh);
        g.w_out = out_ceil(w_in, kw, sw, pw, dw);
    }
    g.groups = 0; /* ignored by maxpool2d */
    return g;
}

static void test_maxpool2d(void)
{
    int64_t i;
    for (i = 0; i < 800; i++) {
        int64_t kh = rand_int(1, 5), kw = rand_int(1, 5), dh = rand_int(1, 2), dw = rand_int(1, 2);
        /* mostly torch's limit (padding <= kernel / 2), sometimes beyond it */
        int64_t ph = rand_int(0, i % 4 == 0 ? 2 : kh / 2);
        int64_t pw = rand_int(0, i % 4 == 0 ? 2 : kw / 2);
        rp_conv2d_geom g =
            pool_geom(rand_int(1, 3), rand_input(kh, ph, dh, 7), rand_input(kw, pw, dw, 7), kh, kw,
                      rand_int(1, 3), rand_int(1, 3), ph, pw, dh, dw, (int)(i & 1));
        /* past torch's limit a window may start beyond the input: rejected */
        if ((g.h_out - 1) * g.sh - g.ph >= g.h_in || (g.w_out - 1) * g.sw - g.pw >= g.w_in) {
            rp_error err;
            int64_t nnz;
            err.msg[0] = '\0';
            CHECK(rp_jac_maxpool2d(&g, &nnz, NULL, NULL, NULL, NULL, &err) == RP_EINVAL &&
                      strstr(err.msg, "_out") != NULL,
                  "maxpool2d: a window past the input accepted: %s", err.msg);
            continue;
        }
        test_maxpool2d_case(&g);
    }
    {
        rp_conv2d_geom g[] = {
            pool_geom(2, 8, 8, 2, 2, 2, 2, 0, 0, 1, 1, 0),  /* the common 2x2/2 */
            pool_geom(2, 7, 7, 2, 2, 2, 2, 0, 0, 1, 1, 1),  /* ceil adds a partial window */
            pool_geom(1, 5, 6, 3, 3, 2, 2, 1, 1, 1, 1, 1),  /* ResNet stem style */
            pool_geom(3, 4, 4, 1, 1, 1, 1, 0, 0, 1, 1, 0),  /* identity */
            pool_geom(1, 6, 5, 5, 4, 1, 1, 0, 0, 1, 1, 0),  /* window = input */
            pool_geom(1, 1, 1, 3, 3, 1, 1, 1, 1, 1, 1, 0),  /* one pixel */
        };
        for (i = 0; i < (int64_t)(sizeof g / sizeof *g); i++)
            test_maxpool2d_case(&g[i]);
    }
    {
        rp_conv2d_geom g = pool_geom(16, 64, 60, 3, 3, 2, 2, 1, 1, 1, 1, 1);
        test_large_case(&g, 1);
        g = pool_geom(8, 50, 70, 4, 3, 1, 2, 2, 1, 2, 1, 0);
        test_large_case(&g, 1);
    }
}

static void test_linear(void)
{
    static const int64_t sizes[][2] = {{1, 1}, {1, 7}, {9, 1}, {13, 5}, {32, 17}, {300, 250}};
    size_t t;
    for (t = 0; t < sizeof sizes / sizeof *sizes; t++) {
        const int64_t in = sizes[t][0], out = sizes[t][1];
        float *w = malloc((size_t)(in * out) * sizeof *w); /* (out, in), as torch */
        int64_t i, p, k, nnz2 = -1;
        jac j;
        rp_error err;
        char label[64];
        int rc;
        snprintf(label, sizeof label, "linear %lld->%lld", (long long)in, (long long)out);
        if (w == NULL)
            exit(1);
        for (i = 0; i < in * out; i++)
            w[i] = rand_float();
        memset(&j, 0, sizeof j);
        rc = rp_jac_linear(in, out, &j.nnz, NULL, NULL, NULL, &err);
        CHECK(rc == RP_OK && j.nnz == in * out, "%s: count: %s", label, err.msg);
        if (rc != RP_OK || j.nnz != in * out) {
            free(w);
            continue;
        }
        jac_alloc(&j, in, 1);
        rc = rp_jac_linear(in, out, &nnz2, j.indptr, j.indices, j.map1, &err);
        CHECK(rc == RP_OK && nnz2 == j.nnz, "%s: fill: %s", label, err.msg);
        /* strictly ascending columns and in * out entries: every row is full */
        if (rc == RP_OK && check_csr(label, in, out, &j))
            for (p = 0; p < in; p++)
                for (k = j.indptr[p]; k < j.indptr[p + 1]; k++) {
                    int64_t q = j.indices[k];
                    /* y[q] = sum_p W[q, p] x[p], so J^T[p, q] = W[q, p] */
                    CHECK(j.map1[k] >= 0 && j.map1[k] < in * out && w[j.map1[k]] == w[q * in + p],
                          "%s: entry (%lld, %lld): wmap %d", label, (long long)p, (long long)q,
                          j.map1[k]);
                }
        jac_free(&j);
        free(w);
    }
}

static void test_diagonal(void)
{
    static const int64_t sizes[] = {1, 2, 77, 200003};
    size_t t;
    for (t = 0; t < sizeof sizes / sizeof *sizes; t++) {
        const int64_t n = sizes[t];
        int64_t i, nnz2 = -1;
        jac j;
        rp_error err;
        int rc;
        memset(&j, 0, sizeof j);
        rc = rp_jac_diagonal(n, &j.nnz, NULL, NULL, &err);
        CHECK(rc == RP_OK && j.nnz == n, "diagonal %lld: count: %s", (long long)n, err.msg);
        if (rc != RP_OK || j.nnz != n)
            continue;
        jac_alloc(&j, n, 0);
        rc = rp_jac_diagonal(n, &nnz2, j.indptr, j.indices, &err);
        CHECK(rc == RP_OK && nnz2 == n, "diagonal %lld: fill: %s", (long long)n, err.msg);
        CHECK(j.indptr[n] == n, "diagonal %lld: indptr[n] = %d", (long long)n, j.indptr[n]);
        for (i = 0; i < n; i++)
            if (j.indptr[i] != i || j.indices[i] != i) {
                CHECK(0, "diagonal %lld: row %lld", (long long)n, (long long)i);
                break;
            }
        jac_free(&j);
    }
}

/* ---- error statuses ---- */

/* rc is RP_EINVAL with a message that mentions `needle`. */
static void expect_einval(int rc, const rp_error *err, const char *needle, const char *what)
{
    CHECK(rc == RP_EINVAL, "%s: rc %d, want RP_EINVAL", what, rc);
    CHECK(err->msg[0] != '\0' && strstr(err->msg, needle) != NULL,
          "%s: message \"%s\" does not mention \"%s\"", what, err->msg, needle);
}

typedef struct {
    const char *name;
    size_t offset;
    int64_t bad;
} field_case;

#define FIELD(f, bad) {#f, offsetof(rp_conv2d_geom, f), bad}

static void test_errors(void)
{
    static const field_case fields[] = {
        FIELD(c_in, 0),  FIELD(h_in, 0),  FIELD(w_in, -1), FIELD(c_out, 0), FIELD(h_out, 0),
        FIELD(w_out, 0), FIELD(kh, 0),    FIELD(kw, -2),   FIELD(sh, 0),    FIELD(sw, 0),
        FIELD(ph, -1),   FIELD(pw, -1),   FIELD(dh, 0),    FIELD(dw, 0),
        FIELD(h_in, (int64_t)1 << 40),    FIELD(kh, (int64_t)1 << 33),
    };
    const rp_conv2d_geom base = conv_geom(4, 6, 2, 8, 9, 3, 2, 1, 2, 1, 0, 1, 1);
    rp_conv2d_geom g;
    rp_error err;
    int64_t nnz = -1;
    int32_t ip[512], ix[4096], m1[4096], m2[4096];
    size_t i;
    char what[96];

#define CALL_EINVAL(call, needle, ...)                                                             \
    do {                                                                                           \
        err.msg[0] = '\0';                                                                         \
        snprintf(what, sizeof what, __VA_ARGS__);                                                  \
        expect_einval((call), &err, (needle), what);                                               \
    } while (0)

    CHECK(rp_jac_conv2d(&base, &nnz, NULL, NULL, NULL, &err) == RP_OK, "base: %s", err.msg);
    for (i = 0; i < sizeof fields / sizeof *fields; i++) {
        g = base;
        *(int64_t *)(void *)((char *)&g + fields[i].offset) = fields[i].bad;
        CALL_EINVAL(rp_jac_conv2d(&g, &nnz, NULL, NULL, NULL, &err), fields[i].name,
                    "conv2d %s = %lld", fields[i].name, (long long)fields[i].bad);
        g.c_out = g.c_in; /* a pool-valid channel count, so only the field is wrong */
        if (fields[i].offset == offsetof(rp_conv2d_geom, c_out))
            g.c_out = fields[i].bad, g.c_in = 4;
        CALL_EINVAL(rp_jac_maxpool2d(&g, &nnz, NULL, NULL, NULL, NULL, &err), fields[i].name,
                    "maxpool2d %s = %lld", fields[i].name, (long long)fields[i].bad);
    }

    /* conv2d geometry */
    g = base;
    g.groups = 0;
    CALL_EINVAL(rp_jac_conv2d(&g, &nnz, NULL, NULL, NULL, &err), "groups", "groups 0");
    g.groups = 3;
    CALL_EINVAL(rp_jac_conv2d(&g, &nnz, NULL, NULL, NULL, &err), "groups", "groups 3, c_in 4");
    g = base;
    g.c_out = 5;
    CALL_EINVAL(rp_jac_conv2d(&g, &nnz, NULL, NULL, NULL, &err), "groups", "groups 2, c_out 5");
    g = base;
    g.h_out++;
    CALL_EINVAL(rp_jac_conv2d(&g, &nnz, NULL, NULL, NULL, &err), "h_out", "h_out + 1");
    g.h_out -= 2;
    CALL_EINVAL(rp_jac_conv2d(&g, &nnz, NULL, NULL, NULL, &err), "h_out", "h_out - 1");
    g = base;
    g.w_out++;
    CALL_EINVAL(rp_jac_conv2d(&g, &nnz, NULL, NULL, NULL, &err), "w_out", "w_out + 1");
    /* an odd 'same' total: the output keeps the input's size, and only that */
    g = same_geom(2, 2, 1, 6, 5, 2, 4, 1, 3);
    CHECK(rp_jac_conv2d(&g, &nnz, NULL, NULL, NULL, &err) == RP_OK, "same: %s", err.msg);
    g.h_out++;
    CALL_EINVAL(rp_jac_conv2d(&g, &nnz, NULL, NULL, NULL, &err), "h_out", "same h_out + 1");
    g = same_geom(2, 2, 1, 6, 5, 2, 4, 1, 3);
    g.sw = 2; /* 'same' is stride 1: with stride 2 the padding after is ph again */
    CALL_EINVAL(rp_jac_conv2d(&g, &nnz, NULL, NULL, NULL, &err), "w_out", "same stride 2");
    g = base;
    g.kh = 20; /* dilated kernel past the padded input */
    CALL_EINVAL(rp_jac_conv2d(&g, &nnz, NULL, NULL, NULL, &err), "h_out", "kernel too large");
    /* mutation audit (session 38): an odd total d (k - 1) = 2p + 1 with
     * h_out == h_in pads one more after only at stride 1 ('same'): one input
     * row, kernel 2, stride 2, no padding is a kernel past the input (torch
     * refuses it), not a 'same' layer of one output row */
    g = conv_geom(1, 1, 1, 1, 3, 2, 1, 2, 1, 0, 0, 1, 1);
    g.h_out = 1;
    CALL_EINVAL(rp_jac_conv2d(&g, &nnz, NULL, NULL, NULL, &err), "h_out",
                "kernel 2, stride 2 on one row");

    /* maxpool2d geometry */
    g = pool_geom(2, 7, 7, 2, 2, 2, 2, 0, 0, 1, 1, 1);
    CHECK(rp_jac_maxpool2d(&g, &nnz, NULL, NULL, NULL, NULL, &err) == RP_OK, "pool: %s", err.msg);
    g.c_out = 3;
    CALL_EINVAL(rp_jac_maxpool2d(&g, &nnz, NULL, NULL, NULL, NULL, &err), "c_out", "pool c_out");
    g = pool_geom(2, 7, 7, 2, 2, 2, 2, 0, 0, 1, 1, 1);
    g.h_out++; /* its last window would start past the input */
    CALL_EINVAL(rp_jac_maxpool2d(&g, &nnz, NULL, NULL, NULL, NULL, &err), "h_out", "pool h_out");
    g = pool_geom(2, 7, 7, 2, 2, 2, 2, 0, 0, 1, 1, 1);
    g.w_out++;
    CALL_EINVAL(rp_jac_maxpool2d(&g, &nnz, NULL, NULL, NULL, NULL, &err), "w_out", "pool w_out");

    /* pointers: NULL nnz, NULL geometry, a mix of NULL and non-NULL arrays */
    g = base;
    CALL_EINVAL(rp_jac_conv2d(&g, NULL, NULL, NULL, NULL, &err), "nnz", "conv2d NULL nnz");
    CALL_EINVAL(rp_jac_conv2d(NULL, &nnz, NULL, NULL, NULL, &err), "geometry", "conv2d NULL g");
    CALL_EINVAL(rp_jac_conv2d(&g, &nnz, ip, ix, NULL, &err), "NULL", "conv2d NULL wmap");
    CALL_EINVAL(rp_jac_conv2d(&g, &nnz, NULL, ix, m1, &err), "NULL", "conv2d NULL indptr");
    g = pool_geom(2, 7, 7, 2, 2, 2, 2, 0, 0, 1, 1, 1);
    CALL_EINVAL(rp_jac_maxpool2d(&g, NULL, NULL, NULL, NULL, NULL, &err), "nnz", "pool NULL nnz");
    CALL_EINVAL(rp_jac_maxpool2d(NULL, &nnz, NULL, NULL, NULL, NULL, &err), "geometry",
                "pool NULL g");
    CALL_EINVAL(rp_jac_maxpool2d(&g, &nnz, ip, ix, m1, NULL, &err), "NULL", "pool NULL pmap");
    CALL_EINVAL(rp_jac_maxpool2d(&g, &nnz, ip, NULL, m1, m2, &err), "NULL", "pool NULL indices");
    CALL_EINVAL(rp_jac_maxpool2d(&g, &nnz, NULL, NULL, m1, NULL, &err), "NULL",
                "pool NULL indptr");
    CALL_EINVAL(rp_jac_linear(3, 4, NULL, NULL, NULL, NULL, &err), "nnz", "linear NULL nnz");
    CALL_EINVAL(rp_jac_linear(3, 4, &nnz, ip, NULL, m1, &err), "NULL", "linear NULL indices");
    CALL_EINVAL(rp_jac_diagonal(3, NULL, NULL, NULL, &err), "nnz", "diagonal NULL nnz");
    CALL_EINVAL(rp_jac_diagonal(3, &nnz, NULL, ix, &err), "NULL", "diagonal NULL indptr");

    /* no non-zeros (the stride skips the only input): indptr alone fills */
    g = conv_geom(1, 2, 1, 1, 1, 1, 1, 3, 3, 2, 2, 1, 1);
    nnz = -1;
    CHECK(rp_jac_conv2d(&g, &nnz, NULL, NULL, NULL, &err) == RP_OK && nnz == 0,
          "empty conv2d: nnz %lld: %s", (long long)nnz, err.msg);
    ip[0] = ip[1] = -1;
    CHECK(rp_jac_conv2d(&g, &nnz, ip, NULL, NULL, &err) == RP_OK && ip[0] == 0 && ip[1] == 0,
          "empty conv2d fill: %s", err.msg);

    /* linear and diagonal sizes */
    CALL_EINVAL(rp_jac_linear(0, 4, &nnz, NULL, NULL, NULL, &err), "in_features", "linear in 0");
    CALL_EINVAL(rp_jac_linear(4, -1, &nnz, NULL, NULL, NULL, &err), "out_features",
                "linear out -1");
    CALL_EINVAL(rp_jac_linear((int64_t)1 << 31, 1, &nnz, NULL, NULL, NULL, &err), "in_features",
                "linear in 2^31");
    CALL_EINVAL(rp_jac_diagonal(0, &nnz, NULL, NULL, &err), "size", "diagonal 0");
    CALL_EINVAL(rp_jac_diagonal(-5, &nnz, NULL, NULL, &err), "size", "diagonal -5");

    /* int32 overflow, found by count-only calls without allocating */
    g = conv_geom(512, 512, 1, 56, 56, 3, 3, 1, 1, 1, 1, 1, 1); /* 7.4e9 non-zeros */
    CALL_EINVAL(rp_jac_conv2d(&g, &nnz, NULL, NULL, NULL, &err), "nnz", "conv2d nnz overflow");
    g = conv_geom(1, 1, 1, 65536, 65536, 1, 1, 1, 1, 0, 0, 1, 1);
    CALL_EINVAL(rp_jac_conv2d(&g, &nnz, NULL, NULL, NULL, &err), "rows", "conv2d rows overflow");
    g = conv_geom(1, 65536, 1, 256, 256, 1, 1, 1, 1, 0, 0, 1, 1);
    CALL_EINVAL(rp_jac_conv2d(&g, &nnz, NULL, NULL, NULL, &err), "columns",
                "conv2d columns overflow");
    g = conv_geom(65536, 65536, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1);
    CALL_EINVAL(rp_jac_conv2d(&g, &nnz, NULL, NULL, NULL, &err), "weight",
                "conv2d weight overflow");
    /* weight elements past int64: 2^30 * 2^30 * 2^30 */
    g = conv_geom((int64_t)1 << 30, 1, 1, 1, 1, (int64_t)1 << 30, (int64_t)1 << 30, 1, 1,
                  (int64_t)1 << 29, (int64_t)1 << 29, 1, 1);
    CALL_EINVAL(rp_jac_conv2d(&g, &nnz, NULL, NULL, NULL, &err), "weight",
                "conv2d weight past int64");
    g = pool_geom(512, 256, 256, 9, 9, 1, 1, 4, 4, 1, 1, 0); /* 2.7e9 non-zeros */
    CALL_EINVAL(rp_jac_maxpool2d(&g, &nnz, NULL, NULL, NULL, NULL, &err), "nnz",
                "maxpool2d nnz overflow");
    g = pool_geom(1024, 2048, 2048, 2, 2, 2, 2, 0, 0, 1, 1, 0);
    CALL_EINVAL(rp_jac_maxpool2d(&g, &nnz, NULL, NULL, NULL, NULL, &err), "rows",
                "maxpool2d rows overflow");
    CALL_EINVAL(rp_jac_linear(65536, 65536, &nnz, NULL, NULL, NULL, &err), "nnz",
                "linear nnz overflow");
    CALL_EINVAL(rp_jac_diagonal((int64_t)1 << 31, &nnz, NULL, NULL, &err), "size",
                "diagonal 2^31");

    /* the largest sizes that fit, and a big real layer, count only */
    CHECK(rp_jac_diagonal(INT32_MAX, &nnz, NULL, NULL, &err) == RP_OK && nnz == INT32_MAX,
          "diagonal INT32_MAX: %s", err.msg);
    CHECK(rp_jac_linear(46340, 46340, &nnz, NULL, NULL, NULL, &err) == RP_OK &&
              nnz == (int64_t)46340 * 46340,
          "linear 46340^2: %s", err.msg);
    /* VGG's first conv on 224x224: each axis has 224 * 3 - 2 taps (the
     * border pixels miss one) */
    g = conv_geom(3, 64, 1, 224, 224, 3, 3, 1, 1, 1, 1, 1, 1);
    CHECK(rp_jac_conv2d(&g, &nnz, NULL, NULL, NULL, &err) == RP_OK &&
              nnz == (int64_t)3 * 64 * 670 * 670,
          "VGG conv1: nnz %lld: %s", (long long)nnz, err.msg);

#undef CALL_EINVAL
}

int main(void)
{
    test_conv2d();
    test_maxpool2d();
    test_linear();
    test_diagonal();
    test_errors();
    if (failures) {
        fprintf(stderr, "test_jacobian: %d check(s) failed\n", failures);
        return 1;
    }
    printf("test_jacobian: all checks passed\n");
    return 0;
}
