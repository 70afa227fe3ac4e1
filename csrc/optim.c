/*
 * optim.c: fused multi-tensor optimizers on the CPU.
 *
 * One call updates a list of tensors of one parameter group and one dtype:
 * the tensors are cut into chunks of RP_CHUNK elements, and one OpenMP
 * parallel region walks all chunks of all tensors, so hundreds of small
 * tensors cost one fork/join, not hundreds. Each chunk runs a tight loop over
 * the shared per-element math of optim_math.h, compiled for AVX-512, AVX2 and
 * baseline x86-64 and picked at run time.
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>

#include "optim_math.h"
#include "reprop.h"
#include "rp_internal.h"

/* Elements per work item: big enough to amortise scheduling, small enough
 * that a few hundred items balance two to hundreds of threads. */
#define RP_CHUNK ((int64_t)32768)
/* Below this many elements in total a single thread wins over a fork/join. */
#define RP_PARALLEL_MIN ((int64_t)131072)

typedef struct {
    int64_t entry;
    int64_t start;
    int64_t len;
} rp_chunk;

/* ---- state-slot requirements and validation ---- */

static int rp_needs_step(int kind) { return kind != RP_SGD; }

/* ---- hyper-parameters that torch.optim refuses ----
 *
 * torch computes the step constants as Python floats, where a division by
 * zero raises ZeroDivisionError, a power beyond double's range OverflowError,
 * and a negative base to a fractional power (or the square root of a negative
 * number) gives a complex number the update then refuses. It passes some of
 * them as the alpha, value or weight of a float32 tensor op, which refuses a
 * finite value beyond float32's range ("value cannot be converted to type
 * float without overflow"; inf and NaN pass). The same values are refused
 * here, before anything is updated, where the fused update would otherwise
 * go on silently with inf or NaN. The checks are per call and per entry,
 * never per element. */

/* What c10 refuses when converting a double to float (inf and NaN pass). */
static int rp_beyond_float(double v) { return fabs(v) > FLT_MAX && isfinite(v); }

/* An SGD update reads a momentum buffer that it did not just create: only
 * then does torch use 1 - dampening. */
static int rp_sgd_reads_buffer(const rp_optim_hparams *hp, const rp_optim_entry *entries,
                               int64_t n)
{
    int64_t i;
    if (!rp_optim_has_momentum(hp))
        return 0;
    for (i = 0; i < n; i++)
        if (!(entries[i].flags & RP_ENTRY_FRESH_BUFFER))
            return 1;
    return 0;
}

/* The end of every refusal of a constant beyond float32: torch's own words. */
#define RP_BEYOND_FLOAT                                                                          \
    "is beyond float32's range (torch.optim raises \"value cannot be converted to type float " \
    "without overflow\")"

/* The step-independent constants torch passes to float32 ops (for Adam and
 * Adagrad the lr enters through the step scalars, checked per entry). */
int rp_optim_check_hparams(const rp_optim_hparams *hp, const rp_optim_entry *entries, int64_t n,
                           rp_error *err)
{
    const int k = hp->kind;
    const struct {
        int used;
        double value;
        const char *name, *expr;
    } ops[] = {
        {hp->weight_decay != 0.0 && !(k == RP_ADAM && hp->decoupled_weight_decay),
         hp->weight_decay, "weight_decay", "weight_decay"},
        {k == RP_SGD && hp->nesterov && rp_optim_has_momentum(hp), hp->momentum, "momentum",
         "momentum"},
        {k == RP_SGD && rp_sgd_reads_buffer(hp, entries, n), 1.0 - hp->dampening, "dampening",
         "1 - dampening"},
        {k == RP_ADAM, 1.0 - hp->beta1, "betas", "1 - beta1"},
        {k == RP_ADAM, 1.0 - hp->beta2, "betas", "1 - beta2"},
        {k == RP_RMSPROP, 1.0 - hp->alpha, "alpha", "1 - alpha"},
        {k == RP_ADADELTA, 1.0 - hp->rho, "rho", "1 - rho"},
        {k == RP_SGD || k == RP_RMSPROP || k == RP_ADADELTA, -hp->lr, "lr", "-lr"},
    };
    size_t i;
    for (i = 0; i < sizeof ops / sizeof ops[0]; i++)
        if (ops[i].used && rp_beyond_float(ops[i].value))
            return rp_set_error(err, RP_EINVAL,
                                "%s: %s = %g " RP_BEYOND_FLOAT,
                                ops[i].name, ops[i].expr, ops[i].value);
    return RP_OK;
}

static int rp_optim_check_kind(const rp_optim_hparams *hp, rp_error *err)
{
    if (hp->kind < RP_SGD || hp->kind > RP_ADADELTA)
        return rp_set_error(err, RP_EINVAL, "unknown optimizer kind %d", hp->kind);
    return RP_OK;
}

int rp_optim_check(const rp_optim_hparams *hp, const rp_optim_entry *entries, int64_t n,
                   rp_error *err)
{
    unsigned need;
    int64_t i;
    int s;
    if (rp_optim_check_kind(hp, err) != RP_OK)
        return RP_EINVAL;
    if (n < 0 || (n > 0 && entries == NULL))
        return rp_set_error(err, RP_EINVAL, "invalid entry table (n=%lld)", (long long)n);
    need = rp_optim_state_slots(hp);
    for (i = 0; i < n; i++) {
        const rp_optim_entry *e = &entries[i];
        if (e->numel < 0)
            return rp_set_error(err, RP_EINVAL, "entry %lld: negative numel", (long long)i);
        if (e->numel == 0)
            continue;
        if (e->param == NULL || e->grad == NULL)
            return rp_set_error(err, RP_EINVAL, "entry %lld: null param or grad pointer",
                                (long long)i);
        for (s = 0; s < 3; s++)
            if ((need >> s & 1u) && e->state[s] == NULL)
                return rp_set_error(err, RP_EINVAL, "entry %lld: state slot %d is required",
                                    (long long)i, s);
        if (rp_needs_step(hp->kind) && e->step == NULL)
            return rp_set_error(err, RP_EINVAL, "entry %lld: step pointer is required",
                                (long long)i);
    }
    return rp_optim_check_hparams(hp, entries, n, err);
}

/* beta ** t, a number beta's as Python computes it: finite operands with a
 * result that is not a finite real number raise there (see above). A
 * float16 tensor's: torch raises for a t beyond float16's range. */
static int rp_check_beta_pow(int kind, double beta, double t, double power, const char *name,
                             rp_error *err)
{
    if (kind == RP_LR_NUMBER && !isfinite(power) && isfinite(beta) && isfinite(t))
        return rp_set_error(err, RP_EINVAL,
                            "betas: %s ** step is not a finite real number at step %g (%s = %g); "
                            "torch.optim raises too", name, t, name, beta);
    if (kind == RP_LR_F16 && fabs(t) > 65504.0)
        return rp_set_error(err, RP_EINVAL,
                            "betas: the step %g is beyond float16, the dtype of %s, which torch's "
                            "%s ** step converts it to (torch.optim raises too)", t, name, name);
    return RP_OK;
}

/* Adam at step t: a = -lr / (1 - beta1^t), b = sqrt(1 - beta2^t). */
static int rp_adam_scalars(const rp_optim_hparams *hp, double t, rp_step_scalars *sc,
                           rp_error *err)
{
    rp_adam_terms r;
    int rc;
    rp_adam_step_terms(hp, hp->lr, t, &r);
    rc = rp_check_beta_pow(hp->beta1_kind, hp->beta1, t, r.pow1, "beta1", err);
    if (rc == RP_OK)
        rc = rp_check_beta_pow(hp->beta2_kind, hp->beta2, t, r.pow2, "beta2", err);
    if (rc != RP_OK)
        return rc;
    if (r.bc1 == 0.0 && hp->lr_kind == RP_LR_NUMBER && hp->beta1_kind == RP_LR_NUMBER)
        return rp_set_error(err, RP_EINVAL,
                            "betas: 1 - beta1 ** step is 0 at step %g (beta1 = %g), a division by "
                            "zero (torch.optim raises ZeroDivisionError)", t, hp->beta1);
    /* Python's (-inf) ** 0.5 is inf, not complex: beta2 = inf, or beyond 1
     * in size at an infinite step count (made by hand), where torch steps on;
     * a tensor's square root is NaN */
    if (r.bc2 < 0.0 && isfinite(r.bc2) && hp->beta2_kind == RP_LR_NUMBER)
        return rp_set_error(err, RP_EINVAL,
                            "betas: 1 - beta2 ** step = %g at step %g (beta2 = %g) is negative, "
                            "so its square root is complex; torch.optim raises too",
                            r.bc2, t, hp->beta2);
    if (rp_beyond_float(r.step_size))
        return rp_set_error(err, RP_EINVAL,
                            "lr: the step size lr / (1 - beta1 ** step) = %g at step %g "
                            RP_BEYOND_FLOAT, r.step_size, t);
    sc->a = (float)(-r.step_size);
    sc->b = (float)r.bc2_sqrt;
    return RP_OK;
}

/* Adagrad at step t: a = -lr / (1 + (t - 1) * lr_decay). */
static int rp_adagrad_scalars(const rp_optim_hparams *hp, double t, rp_step_scalars *sc,
                              rp_error *err)
{
    const double decay = rp_adagrad_decay(hp, t);
    double clr;
    if (decay == 0.0 && hp->lr_kind == RP_LR_NUMBER && hp->lr_decay_kind == RP_LR_NUMBER)
        return rp_set_error(err, RP_EINVAL,
                            "lr_decay: 1 + (step - 1) * lr_decay is 0 at step %g (lr_decay = %g), "
                            "a division by zero (torch.optim raises ZeroDivisionError)",
                            t, hp->lr_decay);
    clr = rp_lr_over(hp, hp->lr, hp->lr_decay_kind, decay);
    if (rp_beyond_float(clr))
        return rp_set_error(err, RP_EINVAL,
                            "lr: lr / (1 + (step - 1) * lr_decay) = %g at step %g "
                            RP_BEYOND_FLOAT, clr, t);
    sc->a = (float)(-clr);
    return RP_OK;
}

/* Advances the entries' step counters in table order, each entry's scalars
 * from its own new count, as torch's loop over a group's params does: a
 * counter shared by several entries (only state made or converted by hand
 * shares one) counts once per entry, so they see t, t + 1, ... in turn.
 * scalars[i].before keeps the counter as entry i found it. Returns the number
 * of entries advanced: n, or fewer when one was refused (its code in *rc). */
static int64_t rp_count_steps(const rp_optim_hparams *hp, const rp_optim_entry *entries, int64_t n,
                              rp_step_scalars *scalars, int *rc, rp_error *err)
{
    int64_t i;
    *rc = RP_OK;
    for (i = 0; i < n; i++) {
        /* torch: step_t += 1 on a float32 tensor, then step_t.item() */
        float *step = entries[i].step;
        double t;
        scalars[i].a = 0.0f;
        scalars[i].b = 1.0f;
        if (!rp_needs_step(hp->kind) || step == NULL)
            continue;
        scalars[i].before = *step;
        t = (double)(scalars[i].before + 1.0f);
        if (hp->kind == RP_ADAM)
            *rc = rp_adam_scalars(hp, t, &scalars[i], err);
        else if (hp->kind == RP_ADAGRAD)
            *rc = rp_adagrad_scalars(hp, t, &scalars[i], err);
        if (*rc != RP_OK)
            return i;
        *step = scalars[i].before + 1.0f;
    }
    return n;
}

/* Puts back the counters of the first `count` entries, the last first, so
 * that a shared counter ends as the first of its entries found it. */
static void rp_restore_steps(const rp_optim_hparams *hp, const rp_optim_entry *entries,
                             int64_t count, const rp_step_scalars *scalars)
{
    while (count-- > 0)
        if (rp_needs_step(hp->kind) && entries[count].step != NULL)
            *entries[count].step = scalars[count].before;
}

/* rp_count_steps, keeping the advanced counters unless `keep` is 0 or an
 * entry was refused: a refused step leaves every counter as it was. */
static int rp_run_steps(const rp_optim_hparams *hp, const rp_optim_entry *entries, int64_t n,
                        rp_step_scalars *scalars, int keep, rp_error *err)
{
    int rc;
    int64_t counted = rp_count_steps(hp, entries, n, scalars, &rc, err);
    if (rc != RP_OK || !keep)
        rp_restore_steps(hp, entries, counted, scalars);
    return rc;
}

int rp_optim_advance_steps(const rp_optim_hparams *hp, const rp_optim_entry *entries, int64_t n,
                           rp_step_scalars *scalars, rp_error *err)
{
    return rp_run_steps(hp, entries, n, scalars, 1, err);
}

void rp_optim_undo_steps(const rp_optim_hparams *hp, const rp_optim_entry *entries, int64_t n,
                         const rp_step_scalars *scalars)
{
    rp_restore_steps(hp, entries, n, scalars);
}

rp_step_scalars *rp_optim_scalars_alloc(int64_t n, rp_error *err)
{
    rp_step_scalars *scalars = (rp_step_scalars *)malloc((size_t)n * sizeof *scalars);
    if (scalars == NULL)
        rp_set_error(err, RP_ERUNTIME, "out of memory for %lld tensors", (long long)n);
    return scalars;
}

int rp_optim_check_update(const rp_optim_hparams *hp, const rp_optim_entry *entries, int64_t n,
                          int capturable, rp_error *err)
{
    rp_step_scalars *scalars;
    int rc = rp_optim_check_kind(hp, err);
    if (rc == RP_OK)
        rc = rp_optim_check_hparams(hp, entries, n, err);
    if (rc != RP_OK || capturable || n == 0)
        return rc;
    scalars = rp_optim_scalars_alloc(n, err);
    if (scalars == NULL)
        return RP_ERUNTIME;
    rc = rp_run_steps(hp, entries, n, scalars, 0, err); /* the scalars' refusals only */
    free(scalars);
    return rc;
}

void rp_optim_entries_done(rp_optim_entry *entries, int64_t n)
{
    int64_t i;
    /* SGD: a fresh momentum buffer is initialised once; later calls accumulate. */
    for (i = 0; i < n; i++)
        entries[i].flags &= ~(int64_t)RP_ENTRY_FRESH_BUFFER;
}

/* ---- the chunk loops: one per optimizer, generic over the param type ---- */

/* Each loop reads one chunk [0, len) of already-offset pointers. The consts
 * are copied into a local whose optional-state flags are set to literals (and
 * SGD's `fresh` is passed as one), so that GCC sees every flag as
 * loop-invariant (a local cannot alias the float arrays), drops the dead
 * branches and vectorizes the loop. The rounding of the multiply-adds is a
 * literal too, FUSED, one set of loops each: fused (one instruction in the
 * AVX2 and AVX-512 clones) and plain (packed multiplies and adds in the
 * baseline clone too, where a fused one is a libm call). Separate functions,
 * not both in one, which would pass GCC's limits for vectorizing some. */
#define RP_LOOP(SUFFIX, LOAD, STORE, CALL)                                                        \
    for (i = 0; i < len; i++)                                                                      \
        STORE(p, i, CALL);

#define RP_DEFINE_LOOPS(SUFFIX, LOAD, STORE, FUSED)                                                \
    RP_TARGET_CLONES static void rp_sgd_loop_##SUFFIX(                                             \
        const rp_optim_consts cv, void *restrict p, const void *restrict g, float *restrict buf,   \
        int fresh, int64_t len)                                                                    \
    {                                                                                              \
        rp_optim_consts c = cv;                                                                    \
        float unused = 0.0f;                                                                       \
        int64_t i;                                                                                 \
        c.fused_madd = FUSED;                                                                      \
        if (buf == NULL) {                                                                         \
            c.has_momentum = 0;                                                                    \
            RP_LOOP(SUFFIX, LOAD, STORE, rp_sgd_elem(&c, LOAD(p, i), LOAD(g, i), &unused, 0))      \
        } else if (fresh) {                                                                        \
            c.has_momentum = 1;                                                                    \
            RP_LOOP(SUFFIX, LOAD, STORE, rp_sgd_elem(&c, LOAD(p, i), LOAD(g, i), &buf[i], 1))      \
        } else {                                                                                   \
            c.has_momentum = 1;                                                                    \
            RP_LOOP(SUFFIX, LOAD, STORE, rp_sgd_elem(&c, LOAD(p, i), LOAD(g, i), &buf[i], 0))      \
        }                                                                                          \
    }                                                                                              \
    RP_TARGET_CLONES static void rp_adam_loop_##SUFFIX(                                            \
        const rp_optim_consts cv, void *restrict p, const void *restrict g, float *restrict m,     \
        float *restrict v, float *restrict vmax, float neg_step_size, float bc2_sqrt, int64_t len) \
    {                                                                                              \
        rp_optim_consts c = cv;                                                                    \
        float unused = 0.0f;                                                                       \
        int64_t i;                                                                                 \
        c.fused_madd = FUSED;                                                                      \
        if (vmax == NULL) {                                                                        \
            c.amsgrad = 0;                                                                         \
            RP_LOOP(SUFFIX, LOAD, STORE,                                                           \
                    rp_adam_elem(&c, LOAD(p, i), LOAD(g, i), &m[i], &v[i], &unused,                \
                                 neg_step_size, bc2_sqrt))                                         \
        } else {                                                                                   \
            c.amsgrad = 1;                                                                         \
            RP_LOOP(SUFFIX, LOAD, STORE,                                                           \
                    rp_adam_elem(&c, LOAD(p, i), LOAD(g, i), &m[i], &v[i], &vmax[i],               \
                                 neg_step_size, bc2_sqrt))                                         \
        }                                                                                          \
    }                                                                                              \
    RP_TARGET_CLONES static void rp_adagrad_loop_##SUFFIX(                                         \
        const rp_optim_consts cv, void *restrict p, const void *restrict g, float *restrict sum,   \
        float neg_clr, int64_t len)                                                                \
    {                                                                                              \
        rp_optim_consts c = cv;                                                                    \
        int64_t i;                                                                                 \
        c.fused_madd = FUSED;                                                                      \
        RP_LOOP(SUFFIX, LOAD, STORE, rp_adagrad_elem(&c, LOAD(p, i), LOAD(g, i), &sum[i], neg_clr)) \
    }                                                                                              \
    RP_TARGET_CLONES static void rp_rmsprop_loop_##SUFFIX(                                         \
        const rp_optim_consts cv, void *restrict p, const void *restrict g, float *restrict sq,    \
        float *restrict buf, float *restrict ga, int64_t len)                                      \
    {                                                                                              \
        rp_optim_consts c = cv;                                                                    \
        float unused_buf = 0.0f, unused_ga = 0.0f;                                                 \
        int64_t i;                                                                                 \
        c.fused_madd = FUSED;                                                                      \
        if (buf == NULL && ga == NULL) {                                                           \
            c.has_momentum = 0;                                                                    \
            c.centered = 0;                                                                        \
            RP_LOOP(SUFFIX, LOAD, STORE,                                                           \
                    rp_rmsprop_elem(&c, LOAD(p, i), LOAD(g, i), &sq[i], &unused_buf, &unused_ga))  \
        } else if (buf == NULL) {                                                                  \
            c.has_momentum = 0;                                                                    \
            c.centered = 1;                                                                        \
            RP_LOOP(SUFFIX, LOAD, STORE,                                                           \
                    rp_rmsprop_elem(&c, LOAD(p, i), LOAD(g, i), &sq[i], &unused_buf, &ga[i]))      \
        } else if (ga == NULL) {                                                                   \
            c.has_momentum = 1;                                                                    \
            c.centered = 0;                                                                        \
            RP_LOOP(SUFFIX, LOAD, STORE,                                                           \
                    rp_rmsprop_elem(&c, LOAD(p, i), LOAD(g, i), &sq[i], &buf[i], &unused_ga))      \
        } else {                                                                                   \
            c.has_momentum = 1;                                                                    \
            c.centered = 1;                                                                        \
            RP_LOOP(SUFFIX, LOAD, STORE,                                                           \
                    rp_rmsprop_elem(&c, LOAD(p, i), LOAD(g, i), &sq[i], &buf[i], &ga[i]))          \
        }                                                                                          \
    }                                                                                              \
    RP_TARGET_CLONES static void rp_adadelta_loop_##SUFFIX(                                        \
        const rp_optim_consts cv, void *restrict p, const void *restrict g, float *restrict sq,    \
        float *restrict acc, int64_t len)                                                          \
    {                                                                                              \
        rp_optim_consts c = cv;                                                                    \
        int64_t i;                                                                                 \
        c.fused_madd = FUSED;                                                                      \
        RP_LOOP(SUFFIX, LOAD, STORE, rp_adadelta_elem(&c, LOAD(p, i), LOAD(g, i), &sq[i], &acc[i])) \
    }                                                                                              \
    static void rp_chunk_##SUFFIX(const rp_optim_hparams *hp, const rp_optim_consts *c,            \
                                  const rp_optim_entry *e, const rp_step_scalars *sc,              \
                                  int64_t start, int64_t len, size_t esize)                         \
    {                                                                                               \
        void *p = (char *)e->param + start * (int64_t)esize;                                        \
        const void *g = (const char *)e->grad + start * (int64_t)esize;                             \
        float *s0 = e->state[0] ? e->state[0] + start : NULL;                                       \
        float *s1 = e->state[1] ? e->state[1] + start : NULL;                                       \
        float *s2 = e->state[2] ? e->state[2] + start : NULL;                                       \
        switch (hp->kind) {                                                                         \
        case RP_SGD:                                                                                \
            rp_sgd_loop_##SUFFIX(*c, p, g, c->has_momentum ? s0 : NULL, (int)(e->flags & RP_ENTRY_FRESH_BUFFER), len);        \
            break;                                                                                  \
        case RP_ADAM:                                                                               \
            rp_adam_loop_##SUFFIX(*c, p, g, s0, s1, c->amsgrad ? s2 : NULL, sc->a, sc->b, len);      \
            break;                                                                                  \
        case RP_ADAGRAD:                                                                            \
            rp_adagrad_loop_##SUFFIX(*c, p, g, s0, sc->a, len);                                      \
            break;                                                                                  \
        case RP_RMSPROP:                                                                            \
            rp_rmsprop_loop_##SUFFIX(*c, p, g, s0, c->has_momentum ? s1 : NULL,                      \
                                     c->centered ? s2 : NULL, len);                                 \
            break;                                                                                  \
        case RP_ADADELTA:                                                                           \
            rp_adadelta_loop_##SUFFIX(*c, p, g, s0, s1, len);                                        \
            break;                                                                                  \
        }                                                                                           \
    }

RP_DEFINE_LOOPS(f32_fused, RP_LOAD_F32, RP_STORE_F32, 1)
RP_DEFINE_LOOPS(f32_plain, RP_LOAD_F32, RP_STORE_F32, 0)
RP_DEFINE_LOOPS(bf16_fused, RP_LOAD_BF16, RP_STORE_BF16, 1)
RP_DEFINE_LOOPS(bf16_plain, RP_LOAD_BF16, RP_STORE_BF16, 0)
RP_DEFINE_LOOPS(f16_fused, RP_LOAD_F16, RP_STORE_F16, 1)
RP_DEFINE_LOOPS(f16_plain, RP_LOAD_F16, RP_STORE_F16, 0)

typedef void (*rp_chunk_fn)(const rp_optim_hparams *, const rp_optim_consts *,
                            const rp_optim_entry *, const rp_step_scalars *, int64_t, int64_t,
                            size_t);

/* Updates chunk `ch` of its entry. */
static void rp_run_chunk(rp_chunk_fn fn, const rp_optim_hparams *hp, const rp_optim_consts *c,
                         const rp_optim_entry *entries, const rp_step_scalars *scalars,
                         const rp_chunk *ch, size_t esize)
{
    fn(hp, c, &entries[ch->entry], &scalars[ch->entry], ch->start, ch->len, esize);
}

/* Cuts every entry into chunks; returns the number of chunks, or -1 when out of memory. */
static int64_t rp_make_chunks(const rp_optim_entry *entries, int64_t n, rp_chunk **out,
                              int64_t *total, rp_error *err)
{
    int64_t i, count = 0, k = 0;
    rp_chunk *chunks;
    *total = 0;
    for (i = 0; i < n; i++) {
        count += (entries[i].numel + RP_CHUNK - 1) / RP_CHUNK;
        *total += entries[i].numel;
    }
    chunks = (rp_chunk *)malloc((size_t)(count > 0 ? count : 1) * sizeof *chunks);
    if (chunks == NULL) {
        rp_set_error(err, RP_ERUNTIME, "out of memory for %lld chunks", (long long)count);
        return -1;
    }
    for (i = 0; i < n; i++) {
        int64_t start;
        for (start = 0; start < entries[i].numel; start += RP_CHUNK) {
            int64_t rest = entries[i].numel - start;
            chunks[k].entry = i;
            chunks[k].start = start;
            chunks[k].len = rest < RP_CHUNK ? rest : RP_CHUNK;
            k++;
        }
    }
    *out = chunks;
    return count;
}

int rp_optim_step_cpu(const rp_optim_hparams *hp, int dtype, rp_optim_entry *entries, int64_t n,
                      int num_threads, rp_error *err)
{
    rp_optim_consts c;
    rp_step_scalars *scalars;
    rp_chunk *chunks = NULL;
    rp_chunk_fn fn;
    size_t esize;
    int64_t nchunks, total, k;
    int rc = rp_optim_check(hp, entries, n, err);
    if (rc != RP_OK)
        return rc;
    rp_optim_make_consts(hp, hp->lr, &c);
    switch (dtype) {
    case RP_F32:
        fn = c.fused_madd ? rp_chunk_f32_fused : rp_chunk_f32_plain;
        esize = 4;
        break;
    case RP_BF16:
        fn = c.fused_madd ? rp_chunk_bf16_fused : rp_chunk_bf16_plain;
        esize = 2;
        break;
    case RP_F16:
        fn = c.fused_madd ? rp_chunk_f16_fused : rp_chunk_f16_plain;
        esize = 2;
        break;
    default:
        return rp_set_error(err, RP_EINVAL, "unsupported dtype code %d", dtype);
    }
    if (n == 0)
        return RP_OK;
    scalars = rp_optim_scalars_alloc(n, err);
    if (scalars == NULL)
        return RP_ERUNTIME;
    nchunks = rp_make_chunks(entries, n, &chunks, &total, err);
    if (nchunks < 0) {
        free(scalars);
        return RP_ERUNTIME;
    }
    rc = rp_optim_advance_steps(hp, entries, n, scalars, err);
    if (rc != RP_OK) {
        free(chunks);
        free(scalars);
        return rc;
    }
    num_threads = rp_omp_threads(num_threads);

    if (total < RP_PARALLEL_MIN || num_threads == 1) {
        /* the same chunks on this thread, without the OpenMP region that an
         * if(0) clause still sets up: about a tenth of the time of a call
         * updating one small layer (fused backward, per module) */
        for (k = 0; k < nchunks; k++)
            rp_run_chunk(fn, hp, &c, entries, scalars, &chunks[k], esize);
    } else {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
        for (k = 0; k < nchunks; k++)
            rp_run_chunk(fn, hp, &c, entries, scalars, &chunks[k], esize);
    }

    rp_optim_entries_done(entries, n);
    free(chunks);
    free(scalars);
    return RP_OK;
}
