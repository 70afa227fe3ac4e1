/*
 * test_core.c: unit tests of the C core, built and run by .ci/run under
 * AddressSanitizer and UndefinedBehaviorSanitizer.
 *
 * The Python suite proves the math equal to torch.optim; these tests cover
 * what Python cannot see: chunk boundaries and offsets, every dtype path,
 * error statuses, and memory safety of every loop.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../optim_math.h"
#include "../reprop.h"
#include "../rp_internal.h"

#include "check.h"
#include "optim_shared.h"

static uint32_t rng_state = 12345u;

static float rand_uniform(void) /* in [-1, 1) */
{
    rng_state = rng_state * 1664525u + 1013904223u;
    return (float)((rng_state >> 8) & 0xffffffu) / 8388608.0f - 1.0f;
}

static int same_float(float a, float b) { return (a != a && b != b) || a == b; }

/* ---- element-type conversions ---- */

static void test_f16_round_trip(void)
{
    uint32_t h;
    for (h = 0; h < 65536u; h++) {
        float f = rp_f16_to_f32((uint16_t)h);
        uint16_t back = rp_f32_to_f16(f);
        if (f != f)
            CHECK(rp_f16_to_f32(back) != rp_f16_to_f32(back), "NaN half %04x lost", h);
        else
            CHECK(back == h, "half %04x -> %g -> %04x", h, f, back);
    }
}

/* f32 -> f16 must round to nearest even: compare against the two neighbours. */
static void test_f16_rounding(void)
{
    int i;
    for (i = 0; i < 200000; i++) {
        /* finite halves only, from subnormals up to the largest normal */
        float f = rand_uniform() * ldexpf(1.0f, (int)((rand_uniform() + 1.0f) * 13.0f) - 10);
        uint16_t h;
        if (fabsf(f) >= 65504.0f)
            continue;
        h = rp_f32_to_f16(f);
        double err = fabs((double)rp_f16_to_f32(h) - (double)f);
        /* neighbours in magnitude; below the smallest subnormal there is only zero */
        uint16_t up = (uint16_t)(h + 1), down = (uint16_t)((h & 0x7fffu) ? h - 1 : h);
        double err_up = fabs((double)rp_f16_to_f32(up) - (double)f);
        double err_down = fabs((double)rp_f16_to_f32(down) - (double)f);
        CHECK(err <= err_up && err <= err_down, "f16(%.9g) = %04x is not nearest", f, h);
        if (err == err_up || err == err_down)
            CHECK((h & 1u) == 0, "f16 tie for %.9g not to even", f);
    }
    CHECK(rp_f32_to_f16(65520.0f) == 0x7c00, "65520 must overflow to inf");
    CHECK(rp_f32_to_f16(65519.0f) == 0x7bff, "65519 must round to 65504");
    CHECK(rp_f32_to_f16(ldexpf(1.0f, -25)) == 0, "2^-25 ties to even zero");
    CHECK(rp_f32_to_f16(ldexpf(3.0f, -25)) == 2, "3*2^-25 ties to even 2*2^-24");
}

static void test_bf16(void)
{
    CHECK(rp_f32_to_bf16(1.0f) == 0x3f80, "bf16(1)");
    CHECK(rp_f32_to_bf16(rp_bits_to_f32(0x3f808000u)) == 0x3f80, "tie to even (down)");
    CHECK(rp_f32_to_bf16(rp_bits_to_f32(0x3f818000u)) == 0x3f82, "tie to even (up)");
    CHECK(rp_f32_to_bf16(rp_bits_to_f32(0x3f808001u)) == 0x3f81, "above tie rounds up");
    CHECK(rp_bf16_to_f32(rp_f32_to_bf16(NAN)) != rp_bf16_to_f32(rp_f32_to_bf16(NAN)), "NaN");
    CHECK(rp_f32_to_bf16(INFINITY) == 0x7f80, "inf");
}

/* ---- optimizer steps: the chunked, parallel core against a plain loop ---- */

typedef struct {
    int64_t numel;
    void *param;
    void *grad;
    float *state[3];
    float step;
    /* the reference copy */
    float *ref_param;
    float *ref_state[3];
    float ref_step;
} tensor_case;

static size_t elem_size(int dtype) { return dtype == RP_F32 ? 4 : 2; }

static void fill_case(tensor_case *t, int64_t numel, int dtype, int with_nan)
{
    int64_t i;
    int s;
    memset(t, 0, sizeof *t);
    t->numel = numel;
    t->param = malloc((size_t)(numel ? numel : 1) * elem_size(dtype));
    t->grad = malloc((size_t)(numel ? numel : 1) * elem_size(dtype));
    t->ref_param = malloc((size_t)(numel ? numel : 1) * sizeof(float));
    for (s = 0; s < 3; s++) {
        t->state[s] = malloc((size_t)(numel ? numel : 1) * sizeof(float));
        t->ref_state[s] = malloc((size_t)(numel ? numel : 1) * sizeof(float));
    }
    for (i = 0; i < numel; i++) {
        elem_store(dtype, t->param, i, rand_uniform());
        elem_store(dtype, t->grad, i, (with_nan && i % 97 == 5) ? NAN : rand_uniform());
        t->ref_param[i] = elem_load(dtype, t->param, i);
        for (s = 0; s < 3; s++)
            t->state[s][i] = t->ref_state[s][i] = 0.5f + 0.25f * rand_uniform();
    }
}

static void free_case(tensor_case *t)
{
    int s;
    free(t->param);
    free(t->grad);
    free(t->ref_param);
    for (s = 0; s < 3; s++) {
        free(t->state[s]);
        free(t->ref_state[s]);
    }
}

/* The reference: one element at a time through the shared element math. */
static void reference_step(const rp_optim_hparams *hp, int dtype, tensor_case *t, int fresh)
{
    rp_optim_consts c;
    rp_step_scalars sc = {0.0f, 1.0f, 0.0f};
    rp_optim_entry e;
    rp_error err;
    int64_t i;
    memset(&e, 0, sizeof e);
    e.step = &t->ref_step;
    CHECK(rp_optim_advance_steps(hp, &e, 1, &sc, &err) == RP_OK, "%s", err.msg);
    rp_optim_make_consts(hp, hp->lr, &c);
    for (i = 0; i < t->numel; i++) {
        float p = t->ref_param[i], g = elem_load(dtype, t->grad, i), out = 0.0f;
        float *s0 = &t->ref_state[0][i], *s1 = &t->ref_state[1][i], *s2 = &t->ref_state[2][i];
        switch (hp->kind) {
        case RP_SGD:
            out = rp_sgd_elem(&c, p, g, s0, fresh);
            break;
        case RP_ADAM:
            out = rp_adam_elem(&c, p, g, s0, s1, s2, sc.a, sc.b);
            break;
        case RP_ADAGRAD:
            out = rp_adagrad_elem(&c, p, g, s0, sc.a);
            break;
        case RP_RMSPROP:
            out = rp_rmsprop_elem(&c, p, g, s0, s1, s2);
            break;
        case RP_ADADELTA:
            out = rp_adadelta_elem(&c, p, g, s0, s1);
            break;
        }
        /* the parameter is stored in its dtype between steps */
        {
            union { float f; uint16_t h[2]; } u;
            if (dtype == RP_F32)
                t->ref_param[i] = out;
            else {
                elem_store(dtype, u.h, 0, out);
                t->ref_param[i] = elem_load(dtype, u.h, 0);
            }
        }
    }
}

static void run_optimizer_case(const rp_optim_hparams *hp, int dtype, int threads)
{
    /* sizes around the 32768-element chunk and the parallel threshold */
    static const int64_t sizes[] = {0, 1, 7, 32767, 32768, 32769, 65536 + 3, 140000};
    enum { NT = sizeof sizes / sizeof sizes[0] };
    tensor_case cases[NT];
    rp_optim_entry entries[NT];
    rp_error err;
    int k, step, s;
    for (k = 0; k < NT; k++) {
        fill_case(&cases[k], sizes[k], dtype, k == 6);
        memset(&entries[k], 0, sizeof entries[k]);
        entries[k].param = cases[k].param;
        entries[k].grad = cases[k].grad;
        for (s = 0; s < 3; s++)
            entries[k].state[s] = cases[k].state[s];
        entries[k].step = hp->kind == RP_SGD ? NULL : &cases[k].step;
        entries[k].numel = sizes[k];
        entries[k].flags = hp->kind == RP_SGD ? RP_ENTRY_FRESH_BUFFER : 0;
    }
    for (step = 0; step < 3; step++) {
        int rc = rp_optim_step_cpu(hp, dtype, entries, NT, threads, &err);
        CHECK(rc == RP_OK, "kind %d dtype %d: %s", hp->kind, dtype, err.msg);
        for (k = 0; k < NT; k++)
            reference_step(hp, dtype, &cases[k], step == 0);
        CHECK(entries[0].flags == 0, "fresh flag must be cleared after a step");
    }
    for (k = 0; k < NT; k++) {
        int64_t i, bad = 0;
        for (i = 0; i < cases[k].numel; i++) {
            bad += !same_float(elem_load(dtype, cases[k].param, i), cases[k].ref_param[i]);
            for (s = 0; s < 3; s++)
                bad += !same_float(cases[k].state[s][i], cases[k].ref_state[s][i]);
        }
        CHECK(bad == 0, "kind %d dtype %s size %lld: %lld mismatches", hp->kind,
              rp_dtype_name(dtype), (long long)cases[k].numel, (long long)bad);
        if (hp->kind != RP_SGD)
            CHECK(cases[k].step == 3.0f, "step counter %g", cases[k].step);
        free_case(&cases[k]);
    }
}

static void test_optimizers(void)
{
    static const int dtypes[] = {RP_F32, RP_BF16, RP_F16};
    int kind, d, variant;
    for (kind = RP_SGD; kind <= RP_ADADELTA; kind++)
        for (variant = 0; variant < 4; variant++)
            for (d = 0; d < 3; d++) {
                rp_optim_hparams hp = base_hparams(kind);
                hp.weight_decay = (variant & 1) ? 0.01 : 0.0;
                hp.maximize = variant == 3;
                hp.momentum = (variant & 2) ? 0.9 : 0.0;
                hp.nesterov = kind == RP_SGD && variant == 2;
                hp.amsgrad = variant >= 2;
                hp.decoupled_weight_decay = variant == 1;
                hp.centered = variant & 1;
                hp.lr_decay = variant == 2 ? 0.01 : 0.0;
                run_optimizer_case(&hp, dtypes[d], variant % 2 ? 1 : 2);
            }
}

/* A one-element float32 entry; s1 may be NULL (a missing state slot). */
static rp_optim_entry scalar_entry(float *p, float *g, float *s0, float *s1, float *step)
{
    rp_optim_entry e;
    memset(&e, 0, sizeof e);
    e.param = p;
    e.grad = g;
    e.state[0] = s0;
    e.state[1] = s1;
    e.step = step;
    e.numel = 1;
    return e;
}

/* Adam's first step moves every element by lr (bias correction cancels). */
static void test_adam_first_step(void)
{
    rp_optim_hparams hp = base_hparams(RP_ADAM);
    float p = 1.0f, g = 0.5f, m = 0.0f, v = 0.0f, step = 0.0f;
    rp_optim_entry e = scalar_entry(&p, &g, &m, &v, &step);
    rp_error err;
    CHECK(rp_optim_step_cpu(&hp, RP_F32, &e, 1, 1, &err) == RP_OK, "%s", err.msg);
    CHECK(fabsf(p - (1.0f - 0.01f)) < 1e-6f, "p = %.9g", p);
    CHECK(step == 1.0f, "step = %g", step);
}

static void test_errors(void)
{
    rp_optim_hparams hp = base_hparams(RP_ADAM);
    float p = 0.0f, g = 0.0f, m = 0.0f, step = 0.0f;
    rp_optim_entry e = scalar_entry(&p, &g, &m, NULL, &step);
    rp_error err;
    CHECK(rp_optim_step_cpu(&hp, RP_F32, &e, 1, 1, &err) == RP_EINVAL, "missing exp_avg_sq");
    CHECK(strstr(err.msg, "state slot 1") != NULL, "message: %s", err.msg);
    CHECK(step == 0.0f, "a failed call must not advance the step");
    CHECK(rp_optim_step_cpu(&hp, 7, &e, 1, 1, &err) == RP_EINVAL, "bad dtype");
    hp.kind = 42;
    CHECK(rp_optim_step_cpu(&hp, RP_F32, &e, 1, 1, &err) == RP_EINVAL, "bad kind");
    CHECK(rp_optim_check_update(&hp, &e, 1, 0, &err) == RP_EINVAL &&
              strstr(err.msg, "unknown optimizer kind 42") != NULL,
          "the pre-update check passed kind 42");
    /* every slot the hyper-parameters need, the third too, and the step counter */
    {
        float v = 0.0f;
        rp_optim_entry ams = scalar_entry(&p, &g, &m, &v, &step);
        hp.kind = RP_ADAM;
        hp.amsgrad = 1;
        CHECK(rp_optim_step_cpu(&hp, RP_F32, &ams, 1, 1, &err) == RP_EINVAL &&
                  strstr(err.msg, "state slot 2 is required") != NULL,
              "amsgrad without max_exp_avg_sq ran");
        hp.amsgrad = 0;
        ams.step = NULL;
        CHECK(rp_optim_step_cpu(&hp, RP_F32, &ams, 1, 1, &err) == RP_EINVAL &&
                  strstr(err.msg, "step pointer is required") != NULL,
              "Adam without a step counter ran");
        CHECK(p == 0.0f && m == 0.0f && v == 0.0f, "a refused call changed state");
    }
    hp.kind = RP_SGD;
    e.numel = -1;
    CHECK(rp_optim_step_cpu(&hp, RP_F32, &e, 1, 1, &err) == RP_EINVAL, "negative numel");
    CHECK(rp_optim_step_cpu(&hp, RP_F32, NULL, 0, 1, &err) == RP_OK, "empty table");
}

/* torch's RMSprop keeps no momentum buffer unless momentum > 0: a negative
 * or NaN momentum runs plain RMSprop (it required state slot 1). */
static void test_rmsprop_momentum_not_positive(void)
{
    rp_optim_hparams hp = base_hparams(RP_RMSPROP);
    float p = 1.0f, g = 0.5f, sq = 0.0f, step = 0.0f;
    rp_optim_entry e = scalar_entry(&p, &g, &sq, NULL, &step);
    rp_error err;
    hp.momentum = -0.5;
    CHECK(rp_optim_step_cpu(&hp, RP_F32, &e, 1, 1, &err) == RP_OK, "momentum < 0: %s", err.msg);
    hp.momentum = NAN;
    CHECK(rp_optim_step_cpu(&hp, RP_F32, &e, 1, 1, &err) == RP_OK, "momentum NaN: %s", err.msg);
    CHECK(step == 2.0f && p < 1.0f, "plain RMSprop steps: step %g, p %g", step, p);
}

/* Hyper-parameters torch.optim refuses at a step (a division by zero, a
 * complex bias correction, a constant beyond float32, beta1 ** step beyond
 * double's range: Python's OverflowError) are refused before anything
 * changes, each from the step count given. */
static void test_refused_hparams(void)
{
    static const struct {
        int kind, nesterov;
        double lr, beta1, beta2, lr_decay, weight_decay, momentum;
        float step;
        const char *message;
    } cases[] = {
        {RP_ADAM, 0, 1e-3, 1.0, 0.999, 0.0, 0.0, 0.0, 1.0f, "betas: 1 - beta1 ** step is 0"},
        {RP_ADAM, 0, 1e-3, 0.9, 1.5, 0.0, 0.0, 0.0, 1.0f, "betas: 1 - beta2 ** step"},
        {RP_ADAM, 0, 1e-3, 1e300, 0.999, 0.0, 0.0, 0.0, 1.0f, "betas: 1 - beta1 = "},
        {RP_ADAM, 0, 1e38, 0.9, 0.999, 0.0, 0.0, 0.0, 1.0f, "lr: the step size"},
        {RP_ADAM, 0, 1e-3, 1e30, 0.999, 0.0, 0.0, 0.0, 10.0f,
         "betas: beta1 ** step is not a finite real number"},
        {RP_ADAM, 0, 1e-3, 0.9, -1e39, 0.0, 0.0, 0.0, 0.0f, "betas: 1 - beta2 = "},
        {RP_ADAGRAD, 0, 1e-3, 0.0, 0.0, -1.0, 0.0, 0.0, 1.0f, "lr_decay: 1 + (step - 1) * lr_decay is 0"},
        {RP_ADAGRAD, 0, 1e300, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0f, "lr: lr / (1 + (step - 1) * lr_decay)"},
        {RP_SGD, 0, 1e300, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0f, "lr: -lr = "},
        {RP_SGD, 1, 1e-3, 0.0, 0.0, 0.0, 0.0, 1e39, 0.0f, "momentum: momentum = "},
        {RP_ADADELTA, 0, 1e-3, 0.0, 0.0, 0.0, -1e39, 0.0, 1.0f, "weight_decay: weight_decay = "},
    };
    size_t k;
    for (k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        rp_optim_hparams hp = base_hparams(cases[k].kind);
        float p = 1.0f, g = 0.5f, s0 = 0.0f, s1 = 0.0f, step = cases[k].step;
        rp_optim_entry e = scalar_entry(&p, &g, &s0, &s1, &step);
        rp_error err;
        hp.nesterov = cases[k].nesterov;
        hp.lr = cases[k].lr;
        hp.beta1 = cases[k].beta1;
        hp.beta2 = cases[k].beta2;
        hp.lr_decay = cases[k].lr_decay;
        hp.weight_decay = cases[k].weight_decay;
        hp.momentum = cases[k].momentum;
        CHECK(rp_optim_step_cpu(&hp, RP_F32, &e, 1, 1, &err) == RP_EINVAL, "case %zu ran", k);
        CHECK(strstr(err.msg, cases[k].message) != NULL, "case %zu: %s", k, err.msg);
        CHECK(p == 1.0f && step == cases[k].step && s0 == 0.0f && s1 == 0.0f,
              "case %zu changed state", k);
    }
}

/* A step refused at a later entry leaves every counter as it was, a counter
 * shared by several entries (state made by hand) included: the core puts
 * them back, the last first, so that the shared one ends as the first of
 * its entries found it. Adagrad with lr_decay = -0.5 refuses t = 3
 * (1 + 2 * lr_decay is 0) and takes t = 1 and 2. */
static void test_refused_step_restores_counters(void)
{
    rp_optim_hparams hp = base_hparams(RP_ADAGRAD);
    float p[3] = {1.0f, 1.0f, 1.0f}, g[3] = {0.5f, 0.5f, 0.5f}, sum[3] = {0.0f, 0.0f, 0.0f};
    float shared = 0.0f, own = 2.0f;
    rp_optim_entry e[3];
    rp_error err;
    int k;
    hp.lr_decay = -0.5;
    for (k = 0; k < 3; k++)
        e[k] = scalar_entry(&p[k], &g[k], &sum[k], NULL, k < 2 ? &shared : &own);
    CHECK(rp_optim_step_cpu(&hp, RP_F32, e, 3, 1, &err) == RP_EINVAL &&
              strstr(err.msg, "lr_decay") != NULL,
          "t = 3 with lr_decay -0.5 ran");
    CHECK(shared == 0.0f && own == 2.0f, "counters after a refused step: shared %g, own %g",
          shared, own);
    for (k = 0; k < 3; k++)
        CHECK(p[k] == 1.0f && sum[k] == 0.0f, "entry %d changed by a refused step", k);
}

/* The CUDA binding advances the counters before its launch and undoes that
 * if the launch fails: every counter back, a shared one too, whose entries
 * saw 2 and 3 and which ends as the first of them found it. */
static void test_undo_restores_advanced_counters(void)
{
    rp_optim_hparams hp = base_hparams(RP_ADAM);
    float p[3] = {1.0f, 1.0f, 1.0f}, g[3] = {0.5f, 0.5f, 0.5f}, m[3] = {0}, v[3] = {0};
    float shared = 1.0f, own = 5.0f;
    rp_step_scalars sc[3];
    rp_optim_entry e[3];
    rp_error err;
    int k;
    for (k = 0; k < 3; k++)
        e[k] = scalar_entry(&p[k], &g[k], &m[k], &v[k], k < 2 ? &shared : &own);
    CHECK(rp_optim_advance_steps(&hp, e, 3, sc, &err) == RP_OK, "%s", err.msg);
    CHECK(shared == 3.0f && own == 6.0f, "advanced: shared %g, own %g", shared, own);
    CHECK(sc[0].b != sc[1].b, "a shared counter's entries saw one step");
    rp_optim_undo_steps(&hp, e, 3, sc);
    CHECK(shared == 1.0f && own == 5.0f, "undone: shared %g, own %g", shared, own);
}

/* ---- C mutation audit of the optimizer core: what no test above caught ---- */

/* A non-empty entry without a gradient (or a parameter) is refused by the
 * check every update runs first, whichever pointer is missing: a check of
 * the param alone let the loops read a NULL gradient. */
static void test_null_pointers_refused(void)
{
    rp_optim_hparams hp = base_hparams(RP_SGD);
    float p = 1.0f, g = 0.5f;
    rp_optim_entry e = scalar_entry(&p, &g, NULL, NULL, NULL);
    rp_error err;
    CHECK(rp_optim_check(&hp, &e, 1, &err) == RP_OK, "a whole entry refused: %s", err.msg);
    e.grad = NULL;
    CHECK(rp_optim_check(&hp, &e, 1, &err) == RP_EINVAL &&
              strstr(err.msg, "entry 0: null param or grad pointer") != NULL,
          "a NULL gradient passed the check");
    e.grad = &g;
    e.param = NULL;
    CHECK(rp_optim_check(&hp, &e, 1, &err) == RP_EINVAL &&
              strstr(err.msg, "entry 0: null param or grad pointer") != NULL,
          "a NULL param passed the check");
    CHECK(p == 1.0f, "the check changed the param");
    /* a negative count is refused as such, not taken as an empty table (or
     * passed on to a malloc of n scalars) */
    CHECK(rp_optim_check(&hp, &e, -1, &err) == RP_EINVAL &&
              strstr(err.msg, "invalid entry table (n=-1)") != NULL,
          "n = -1 passed the check");
}

/* A capturable update's step counters are device memory, which the check
 * before it (rp_optim_check_update) must not read: with capturable it
 * checks the hyper-parameters alone, here passing a count that a
 * non-capturable check refuses (Adagrad's lr_decay -1 at step 2). */
static void test_capturable_check_reads_no_counter(void)
{
    rp_optim_hparams hp = base_hparams(RP_ADAGRAD);
    float p = 1.0f, g = 0.5f, sum = 0.0f, step = 1.0f;
    rp_optim_entry e = scalar_entry(&p, &g, &sum, NULL, &step);
    rp_error err;
    hp.lr_decay = -1.0;
    CHECK(rp_optim_check_update(&hp, &e, 1, 0, &err) == RP_EINVAL &&
              strstr(err.msg, "lr_decay") != NULL,
          "the host check passed 1 + (2 - 1) * -1 = 0");
    CHECK(rp_optim_check_update(&hp, &e, 1, 1, &err) == RP_OK,
          "the capturable check read the step counter: %s", err.msg);
    CHECK(step == 1.0f && p == 1.0f, "a check changed the counter or the param");
}

int main(void)
{
    test_f16_round_trip();
    test_f16_rounding();
    test_bf16();
    test_adam_first_step();
    test_errors();
    test_rmsprop_momentum_not_positive();
    test_refused_hparams();
    test_refused_step_restores_counters();
    test_undo_restores_advanced_counters();
    test_null_pointers_refused();
    test_capturable_check_reads_no_counter();
    test_optimizers();
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("C core tests passed\n");
    return 0;
}
