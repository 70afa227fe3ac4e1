/*
 * jacobian.c: CSR patterns of the transposed Jacobians of single layers, the
 * leaves of the sparse BPPSA scan (rp_csr_plan_create in csrc/scan.c).
 *
 * J^T of a layer y = f(x) has a row per element of one sample's input and a
 * column per element of its output, entry (p, q) = dy[q] / dx[p]. The batch
 * is excluded because the pattern is the same for every sample. Column
 * indices ascend within each row, as the planner and torch's CSR tensors
 * both require.
 *
 * Only the pattern is built here. Values change every step (weights train;
 * max positions and activation slopes follow the input), so instead of
 * values each routine returns gather maps with which the Python layer fills
 * all nnz values with one torch indexing op per step, on whatever device
 * the weights and activations live, without a trip through C or the host:
 *   conv2d, linear: values = weight.flatten()[wmap]
 *   maxpool2d:      values[b] = indices[b].flatten()[omap] == pmap
 *   diagonal:       values[b] = f'(x[b]).flatten()       (no map needed)
 * The pattern depends on the geometry alone, so a weight that happens to be
 * 0 or an input that is not a window's max is still an entry: the plan made
 * once ahead of training stays valid for every step.
 *
 * Shapes (one sample, row-major):
 *   input  (c_in, h_in, w_in)     row    p = (ci * h_in + ih) * w_in + iw
 *   output (c_out, h_out, w_out)  column q = (co * h_out + oh) * w_out + ow
 *   weight (c_out, c_in / groups, kh, kw) for conv2d, (out, in) for linear
 *   indptr (rows + 1); indices, wmap, omap, pmap (nnz); all int32
 *
 * Convolution and pooling factor over the two spatial axes: input row ih
 * meets output row oh through kernel row ki iff ih = oh * sh - ph + ki * dh,
 * whatever the columns and channels. ph and pw are the padding before each
 * axis; what is after only sets the output size (torch's padding='same' with
 * an odd total puts one more after, see rp_jac_pad_after). So each axis gets
 * a small table listing, per input coordinate, its (kernel offset, output
 * coordinate) taps in ascending output order, and a row of J^T is the
 * product of its ih list and its iw list (for conv2d once per output channel
 * of the group). Row lengths, and hence indptr, are closed-form, and each
 * row is written independently (OpenMP over rows) already in ascending
 * column order, so there is no sort and the work is O(rows + nnz). Counting
 * alone is O(h_out + w_out), so the count-only call rejects oversized layers
 * without touching memory.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "reprop.h"
#include "rp_internal.h"

/* Every index handed back is int32 (torch's CSR and the planner use int32). */
#define RP_JAC_I32_MAX ((int64_t)INT32_MAX)
/* Below this many non-zeros one thread beats a fork/join. */
#define RP_JAC_PARALLEL_MIN ((int64_t)1 << 16)
/* Every region names its threads, rp_omp_threads(0), OpenMP's default but
 * one in a forked child, where libgomp's inherited pool would hang (common.c). */

/* ---------------------------------------------------------------------------
 * Validation helpers
 * ------------------------------------------------------------------------- */

/* a * b for a, b >= 0, or -1 past int64: callers only compare the result
 * with the int32 limit, so saturating to an impossible value is enough. */
static int64_t rp_jac_mul(int64_t a, int64_t b) { return rp_mul_capped(a, b, INT64_MAX); }

/* A size that must fit the int32 arrays; `what` names it for the message. */
static int rp_jac_check_i32(const char *layer, const char *what, int64_t v, rp_error *err)
{
    if (v < 0)
        return rp_set_error(err, RP_EINVAL, "%s: %s overflows int64, so cannot be indexed by int32",
                            layer, what);
    if (v > RP_JAC_I32_MAX)
        return rp_set_error(err, RP_EINVAL, "%s: %s = %lld does not fit in int32 (max %lld)", layer,
                            what, (long long)v, (long long)RP_JAC_I32_MAX);
    return RP_OK;
}

/* The arrays are all given (fill) or all NULL (count only). An empty torch
 * tensor may hand down NULL, so when there are no non-zeros only indptr is
 * needed to fill. */
static int rp_jac_check_arrays(const char *layer, const char *names, const int32_t *indptr,
                               int n_given, int n, int64_t count, int *fill, rp_error *err)
{
    *fill = indptr != NULL;
    if (*fill ? n_given != n && count > 0 : n_given != 0)
        return rp_set_error(err, RP_EINVAL,
                            "%s: %s must be all NULL (count only) or all non-NULL", layer, names);
    return RP_OK;
}

typedef struct {
    const char *name;
    size_t offset;
    int64_t min;
} rp_jac_field;

#define RP_JAC_FIELD(f, lo) {#f, offsetof(rp_conv2d_geom, f), lo}

/* Bounding every field by int32 keeps all products of two fields, and the
 * output-size formulas, inside int64 without further checks. */
static const rp_jac_field rp_jac_fields[] = {
    RP_JAC_FIELD(c_in, 1),  RP_JAC_FIELD(h_in, 1),  RP_JAC_FIELD(w_in, 1),
    RP_JAC_FIELD(c_out, 1), RP_JAC_FIELD(h_out, 1), RP_JAC_FIELD(w_out, 1),
    RP_JAC_FIELD(kh, 1),    RP_JAC_FIELD(kw, 1),    RP_JAC_FIELD(sh, 1),
    RP_JAC_FIELD(sw, 1),    RP_JAC_FIELD(ph, 0),    RP_JAC_FIELD(pw, 0),
    RP_JAC_FIELD(dh, 1),    RP_JAC_FIELD(dw, 1),
};

static int rp_jac_check_fields(const char *layer, const rp_conv2d_geom *g, rp_error *err)
{
    size_t i;
    for (i = 0; i < sizeof rp_jac_fields / sizeof *rp_jac_fields; i++) {
        const rp_jac_field *f = &rp_jac_fields[i];
        int64_t v = *(const int64_t *)(const void *)((const char *)g + f->offset);
        if (v < f->min)
            return rp_set_error(err, RP_EINVAL, "%s: %s must be >= %lld (got %lld)", layer,
                                f->name, (long long)f->min, (long long)v);
        if (v > RP_JAC_I32_MAX)
            return rp_set_error(err, RP_EINVAL, "%s: %s = %lld does not fit in int32", layer,
                                f->name, (long long)v);
    }
    return RP_OK;
}

/* Rows and columns must be addressable by int32 indices. */
static int rp_jac_check_extents(const char *layer, const rp_conv2d_geom *g, rp_error *err)
{
    int rc = rp_jac_check_i32(layer, "rows (c_in * h_in * w_in)",
                              rp_jac_mul(rp_jac_mul(g->c_in, g->h_in), g->w_in), err);
    if (rc == RP_OK)
        rc = rp_jac_check_i32(layer, "columns (c_out * h_out * w_out)",
                              rp_jac_mul(rp_jac_mul(g->c_out, g->h_out), g->w_out), err);
    return rc;
}

/* ---------------------------------------------------------------------------
 * One spatial axis
 *
 * Input coordinate i meets output coordinate o through kernel offset k iff
 * i = o * s - p + k * d, 0 <= i < n_in, 0 <= k < k_size.
 * ------------------------------------------------------------------------- */

typedef struct {
    int64_t n_in, n_out, k, s, p, d;
} rp_jac_axis;

/* The kernel offsets of output o that land inside the input: [*k0, *k1). */
static void rp_jac_axis_range(const rp_jac_axis *a, int64_t o, int64_t *k0, int64_t *k1)
{
    int64_t start = o * a->s - a->p; /* input coordinate of offset 0, may be in the padding */
    int64_t lo = start >= 0 ? 0 : (-start + a->d - 1) / a->d;
    int64_t hi = start > a->n_in - 1 ? 0 : (a->n_in - 1 - start) / a->d + 1;
    if (hi > a->k)
        hi = a->k;
    *k0 = lo;
    *k1 = hi > lo ? hi : lo;
}

/* Number of (input, output) taps of the axis, in O(n_out). At most
 * n_out * k <= 2^62, so it cannot overflow. */
static int64_t rp_jac_axis_total(const rp_jac_axis *a)
{
    int64_t o, k0, k1, total = 0;
    for (o = 0; o < a->n_out; o++) {
        rp_jac_axis_range(a, o, &k0, &k1);
        total += k1 - k0;
    }
    return total;
}

/* The taps grouped by input coordinate, outputs ascending within each. */
typedef struct {
    int64_t total;
    int64_t *start; /* n_in + 1: the taps of input i are [start[i], start[i + 1]) */
    int32_t *k;     /* total: kernel offset */
    int32_t *o;     /* total: output coordinate */
} rp_jac_taps;

static void rp_jac_taps_free(rp_jac_taps *t)
{
    free(t->start);
    free(t->k);
    free(t->o);
}

/* A counting sort of the taps by input coordinate; walking the outputs in
 * ascending order is what leaves each input's list sorted by output. */
static int rp_jac_taps_build(const rp_jac_axis *a, rp_jac_taps *t)
{
    int64_t o, k, k0, k1, i;
    t->total = rp_jac_axis_total(a);
    t->start = calloc((size_t)a->n_in + 1, sizeof *t->start);
    /* +1: malloc(0) may return NULL, which must not read as a failure */
    t->k = malloc(((size_t)t->total + 1) * sizeof *t->k);
    t->o = malloc(((size_t)t->total + 1) * sizeof *t->o);
    if (t->start == NULL || t->k == NULL || t->o == NULL)
        return RP_ERUNTIME;
    for (o = 0; o < a->n_out; o++) {
        rp_jac_axis_range(a, o, &k0, &k1);
        for (k = k0; k < k1; k++)
            t->start[o * a->s - a->p + k * a->d + 1]++;
    }
    for (i = 0; i < a->n_in; i++)
        t->start[i + 1] += t->start[i];
    /* start[i] serves as input i's cursor, ending at start[i + 1]; shift back after */
    for (o = 0; o < a->n_out; o++) {
        rp_jac_axis_range(a, o, &k0, &k1);
        for (k = k0; k < k1; k++) {
            int64_t slot = t->start[o * a->s - a->p + k * a->d]++;
            t->k[slot] = (int32_t)k;
            t->o[slot] = (int32_t)o;
        }
    }
    for (i = a->n_in; i > 0; i--)
        t->start[i] = t->start[i - 1];
    t->start[0] = 0;
    return RP_OK;
}

static void rp_jac_axes(const rp_conv2d_geom *g, rp_jac_axis *ah, rp_jac_axis *aw)
{
    ah->n_in = g->h_in;
    ah->n_out = g->h_out;
    ah->k = g->kh;
    ah->s = g->sh;
    ah->p = g->ph;
    ah->d = g->dh;
    aw->n_in = g->w_in;
    aw->n_out = g->w_out;
    aw->k = g->kw;
    aw->s = g->sw;
    aw->p = g->pw;
    aw->d = g->dw;
}

/* Both axes' tables, or RP_ERUNTIME with both freed. */
static int rp_jac_build_both(const char *layer, const rp_conv2d_geom *g, rp_jac_taps *th,
                             rp_jac_taps *tw, rp_error *err)
{
    rp_jac_axis ah, aw;
    rp_jac_axes(g, &ah, &aw);
    th->start = tw->start = NULL;
    th->k = tw->k = th->o = tw->o = NULL;
    if (rp_jac_taps_build(&ah, th) != RP_OK || rp_jac_taps_build(&aw, tw) != RP_OK) {
        rp_jac_taps_free(th);
        rp_jac_taps_free(tw);
        return rp_set_error(err, RP_ERUNTIME, "%s: out of memory for the tap tables", layer);
    }
    return RP_OK;
}

/* ---------------------------------------------------------------------------
 * conv2d
 * ------------------------------------------------------------------------- */

/* The padding after the input along an axis whose padding before is p.
 * torch pads both sides alike, except padding='same' (stride 1) with an odd
 * total d (k - 1) = 2p + 1, where the odd one goes after and the output keeps
 * the input's size. The geometry has one padding per axis, the one the
 * pattern depends on (before); the output size tells the two apart. */
static int64_t rp_jac_pad_after(int64_t n_in, int64_t n_out, int64_t k, int64_t s, int64_t p,
                                int64_t d)
{
    return s == 1 && d * (k - 1) == 2 * p + 1 && n_out == n_in ? p + 1 : p;
}

/* torch's output size floor((n + p + p_after - d (k - 1) - 1) / s) + 1, which
 * must match the caller's, since a wrong size would silently misplace
 * columns. */
static int rp_jac_check_conv_out(const char *name, int64_t n_in, int64_t n_out, int64_t k,
                                 int64_t s, int64_t p, int64_t d, rp_error *err)
{
    int64_t padded = n_in + p + rp_jac_pad_after(n_in, n_out, k, s, p, d);
    int64_t span = padded - d * (k - 1) - 1;
    if (span < 0)
        return rp_set_error(err, RP_EINVAL,
                            "conv2d: the dilated kernel (%lld) is larger than the padded input "
                            "(%lld) along %s",
                            (long long)(d * (k - 1) + 1), (long long)padded, name);
    if (n_out != span / s + 1)
        return rp_set_error(err, RP_EINVAL, "conv2d: %s = %lld, but the geometry gives %lld", name,
                            (long long)n_out, (long long)(span / s + 1));
    return RP_OK;
}

static int rp_jac_conv2d_check(const rp_conv2d_geom *g, rp_error *err)
{
    int rc = rp_jac_check_fields("conv2d", g, err);
    if (rc != RP_OK)
        return rc;
    if (g->groups < 1 || g->groups > RP_JAC_I32_MAX)
        return rp_set_error(err, RP_EINVAL, "conv2d: groups must be in [1, 2^31 - 1] (got %lld)",
                            (long long)g->groups);
    if (g->c_in % g->groups != 0 || g->c_out % g->groups != 0)
        return rp_set_error(err, RP_EINVAL,
                            "conv2d: groups = %lld must divide c_in = %lld and c_out = %lld",
                            (long long)g->groups, (long long)g->c_in, (long long)g->c_out);
    rc = rp_jac_check_conv_out("h_out", g->h_in, g->h_out, g->kh, g->sh, g->ph, g->dh, err);
    if (rc == RP_OK)
        rc = rp_jac_check_conv_out("w_out", g->w_in, g->w_out, g->kw, g->sw, g->pw, g->dw, err);
    if (rc == RP_OK)
        rc = rp_jac_check_extents("conv2d", g, err);
    if (rc == RP_OK)
        rc = rp_jac_check_i32(
            "conv2d", "weight elements (c_out * c_in / groups * kh * kw)",
            rp_jac_mul(rp_jac_mul(rp_jac_mul(g->c_out, g->c_in / g->groups), g->kh), g->kw), err);
    return rc;
}

/* Row (ci, ih, iw): the group's output channels ascending, then the ih taps
 * (output rows ascending), then the iw taps (output columns ascending), which
 * is ascending q. A row starts after ci whole channels, the ih' < ih rows of
 * channel ci and the iw' < iw entries of row ih, all closed-form. */
static void rp_jac_conv2d_fill(const rp_conv2d_geom *g, const rp_jac_taps *th,
                               const rp_jac_taps *tw, int64_t nnz, int32_t *restrict indptr,
                               int32_t *restrict indices, int32_t *restrict wmap)
{
    const int64_t cpg_in = g->c_in / g->groups, cpg_out = g->c_out / g->groups;
    const int64_t per_channel = cpg_out * th->total * tw->total;
    const int64_t h_in = g->h_in, w_in = g->w_in;
    int64_t r;

#pragma omp parallel for schedule(static) num_threads(rp_omp_threads(0)) if (nnz >= RP_JAC_PARALLEL_MIN)
    for (r = 0; r < g->c_in * h_in; r++) {
        const int64_t ci = r / h_in, ih = r % h_in;
        const int64_t grp = ci / cpg_in;
        const int64_t h0 = th->start[ih], h1 = th->start[ih + 1];
        int64_t k = ci * per_channel + cpg_out * h0 * tw->total;
        int64_t iw, co, a, b;
        for (iw = 0; iw < w_in; iw++) {
            const int64_t w0 = tw->start[iw], w1 = tw->start[iw + 1];
            indptr[r * w_in + iw] = (int32_t)k;
            for (co = grp * cpg_out; co < (grp + 1) * cpg_out; co++) {
                const int64_t wbase = (co * cpg_in + ci - grp * cpg_in) * g->kh;
                for (a = h0; a < h1; a++) {
                    const int64_t qrow = (co * g->h_out + th->o[a]) * g->w_out;
                    const int64_t wrow = (wbase + th->k[a]) * g->kw;
                    for (b = w0; b < w1; b++, k++) {
                        indices[k] = (int32_t)(qrow + tw->o[b]);
                        wmap[k] = (int32_t)(wrow + tw->k[b]);
                    }
                }
            }
        }
    }
    indptr[g->c_in * h_in * w_in] = (int32_t)nnz;
}

/* ---------------------------------------------------------------------------
 * maxpool2d
 * ------------------------------------------------------------------------- */

/* With ceil_mode torch adds a last window that may run past the padded
 * input but never one starting past the input's left padding; any such
 * output size is accepted, the entries being whatever pairs exist. */
static int rp_jac_check_pool_out(const char *name, int64_t n_in, int64_t n_out, int64_t s,
                                 int64_t p, rp_error *err)
{
    if ((n_out - 1) * s - p >= n_in)
        return rp_set_error(err, RP_EINVAL,
                            "maxpool2d: %s = %lld is too large: its last window would start at "
                            "input coordinate %lld, past the input (size %lld)",
                            name, (long long)n_out, (long long)((n_out - 1) * s - p),
                            (long long)n_in);
    return RP_OK;
}

static int rp_jac_maxpool2d_check(const rp_conv2d_geom *g, rp_error *err)
{
    int rc = rp_jac_check_fields("maxpool2d", g, err);
    if (rc != RP_OK)
        return rc;
    if (g->c_out != g->c_in)
        return rp_set_error(err, RP_EINVAL, "maxpool2d: c_out = %lld must equal c_in = %lld",
                            (long long)g->c_out, (long long)g->c_in);
    rc = rp_jac_check_pool_out("h_out", g->h_in, g->h_out, g->sh, g->ph, err);
    if (rc == RP_OK)
        rc = rp_jac_check_pool_out("w_out", g->w_in, g->w_out, g->sw, g->pw, err);
    if (rc == RP_OK)
        rc = rp_jac_check_extents("maxpool2d", g, err);
    return rc;
}

/* As conv2d with one output channel per input channel; omap is the column
 * itself and pmap the row's position within its channel plane. */
static void rp_jac_maxpool2d_fill(const rp_conv2d_geom *g, const rp_jac_taps *th,
                                  const rp_jac_taps *tw, int64_t nnz, int32_t *restrict indptr,
                                  int32_t *restrict indices, int32_t *restrict omap,
                                  int32_t *restrict pmap)
{
    const int64_t per_channel = th->total * tw->total;
    const int64_t h_in = g->h_in, w_in = g->w_in;
    int64_t r;

#pragma omp parallel for schedule(static) num_threads(rp_omp_threads(0)) if (nnz >= RP_JAC_PARALLEL_MIN)
    for (r = 0; r < g->c_in * h_in; r++) {
        const int64_t c = r / h_in, ih = r % h_in;
        const int64_t h0 = th->start[ih], h1 = th->start[ih + 1];
        int64_t k = c * per_channel + h0 * tw->total;
        int64_t iw, a, b;
        for (iw = 0; iw < w_in; iw++) {
            const int64_t w0 = tw->start[iw], w1 = tw->start[iw + 1];
            const int32_t within = (int32_t)(ih * w_in + iw);
            indptr[r * w_in + iw] = (int32_t)k;
            for (a = h0; a < h1; a++) {
                const int64_t qrow = (c * g->h_out + th->o[a]) * g->w_out;
                for (b = w0; b < w1; b++, k++) {
                    indices[k] = (int32_t)(qrow + tw->o[b]);
                    omap[k] = indices[k];
                    pmap[k] = within;
                }
            }
        }
    }
    indptr[g->c_in * h_in * w_in] = (int32_t)nnz;
}

/* ---------------------------------------------------------------------------
 * conv2d and maxpool2d entry points
 * ------------------------------------------------------------------------- */

/* The entry of conv2d (pool = 0, maps: wmap) and maxpool2d (pool = 1, maps:
 * omap, pmap): validate, count, then fill when arrays are given. */
static int rp_jac_windowed(int pool, const rp_conv2d_geom *g, int64_t *nnz, int32_t *indptr,
                           int32_t *indices, int32_t *map0, int32_t *map1, rp_error *err)
{
    const char *name = pool ? "maxpool2d" : "conv2d";
    rp_jac_axis ah, aw;
    rp_jac_taps th, tw;
    int64_t count;
    int fill, rc;
    if (nnz == NULL)
        return rp_set_error(err, RP_EINVAL, "%s: nnz pointer is NULL", name);
    if (g == NULL)
        return rp_set_error(err, RP_EINVAL, "%s: geometry pointer is NULL", name);
    rc = pool ? rp_jac_maxpool2d_check(g, err) : rp_jac_conv2d_check(g, err);
    if (rc != RP_OK)
        return rc;
    rp_jac_axes(g, &ah, &aw);
    /* per input element: its windows, times the output channels it feeds */
    count = rp_jac_mul(rp_jac_mul(rp_jac_mul(g->c_in, pool ? 1 : g->c_out / g->groups),
                                  rp_jac_axis_total(&ah)),
                       rp_jac_axis_total(&aw));
    rc = rp_jac_check_i32(name, "nnz (non-zeros of the Jacobian)", count, err);
    if (rc == RP_OK)
        rc = rp_jac_check_arrays(name, pool ? "indptr, indices, omap and pmap" : "indptr, indices and wmap",
                                 indptr, (indptr != NULL) + (indices != NULL) + (map0 != NULL) +
                                     (pool && map1 != NULL),
                                 pool ? 4 : 3, count, &fill, err);
    if (rc != RP_OK)
        return rc;
    *nnz = count;
    if (!fill)
        return RP_OK;
    rc = rp_jac_build_both(name, g, &th, &tw, err);
    if (rc != RP_OK)
        return rc;
    if (pool)
        rp_jac_maxpool2d_fill(g, &th, &tw, count, indptr, indices, map0, map1);
    else
        rp_jac_conv2d_fill(g, &th, &tw, count, indptr, indices, map0);
    rp_jac_taps_free(&th);
    rp_jac_taps_free(&tw);
    return RP_OK;
}

int rp_jac_conv2d(const rp_conv2d_geom *g, int64_t *nnz, int32_t *indptr, int32_t *indices,
                  int32_t *wmap, rp_error *err)
{
    return rp_jac_windowed(0, g, nnz, indptr, indices, wmap, NULL, err);
}

int rp_jac_maxpool2d(const rp_conv2d_geom *g, int64_t *nnz, int32_t *indptr, int32_t *indices,
                     int32_t *omap, int32_t *pmap, rp_error *err)
{
    return rp_jac_windowed(1, g, nnz, indptr, indices, omap, pmap, err);
}

/* ---------------------------------------------------------------------------
 * linear and element-wise
 * ------------------------------------------------------------------------- */

int rp_jac_linear(int64_t in_features, int64_t out_features, int64_t *nnz, int32_t *indptr,
                  int32_t *indices, int32_t *wmap, rp_error *err)
{
    int64_t count, p;
    int fill, rc;
    if (nnz == NULL)
        return rp_set_error(err, RP_EINVAL, "linear: nnz pointer is NULL");
    if (in_features < 1 || out_features < 1)
        return rp_set_error(err, RP_EINVAL,
                            "linear: in_features and out_features must be >= 1 (got %lld, %lld)",
                            (long long)in_features, (long long)out_features);
    rc = rp_jac_check_i32("linear", "in_features", in_features, err);
    if (rc == RP_OK)
        rc = rp_jac_check_i32("linear", "out_features", out_features, err);
    if (rc != RP_OK)
        return rc;
    count = rp_jac_mul(in_features, out_features);
    rc = rp_jac_check_i32("linear", "nnz (in_features * out_features)", count, err);
    if (rc == RP_OK)
        rc = rp_jac_check_arrays("linear", "indptr, indices and wmap", indptr,
                                 (indptr != NULL) + (indices != NULL) + (wmap != NULL), 3, count,
                                 &fill, err);
    if (rc != RP_OK)
        return rc;
    *nnz = count;
    if (!fill)
        return RP_OK;

    /* Row p is column p of the (out, in) weight: element q * in + p. */
#pragma omp parallel for schedule(static) num_threads(rp_omp_threads(0)) if (count >= RP_JAC_PARALLEL_MIN)
    for (p = 0; p < in_features; p++) {
        int64_t q, k = p * out_features;
        indptr[p] = (int32_t)k;
        for (q = 0; q < out_features; q++) {
            indices[k + q] = (int32_t)q;
            wmap[k + q] = (int32_t)(q * in_features + p);
        }
    }
    indptr[in_features] = (int32_t)count;
    return RP_OK;
}

int rp_jac_diagonal(int64_t size, int64_t *nnz, int32_t *indptr, int32_t *indices,
                    rp_error *err)
{
    int64_t i;
    int fill, rc;
    if (nnz == NULL)
        return rp_set_error(err, RP_EINVAL, "diagonal: nnz pointer is NULL");
    if (size < 1)
        return rp_set_error(err, RP_EINVAL, "diagonal: size must be >= 1 (got %lld)",
                            (long long)size);
    rc = rp_jac_check_i32("diagonal", "size", size, err);
    if (rc == RP_OK)
        rc = rp_jac_check_arrays("diagonal", "indptr and indices", indptr,
                                 (indptr != NULL) + (indices != NULL), 2, size, &fill, err);
    if (rc != RP_OK)
        return rc;
    *nnz = size;
    if (!fill)
        return RP_OK;

#pragma omp parallel for schedule(static) num_threads(rp_omp_threads(0)) if (size >= RP_JAC_PARALLEL_MIN)
    for (i = 0; i < size; i++) {
        indptr[i] = (int32_t)i;
        indices[i] = (int32_t)i;
    }
    indptr[size] = (int32_t)size;
    return RP_OK;
}
