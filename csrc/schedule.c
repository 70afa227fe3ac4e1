/*
 * schedule.c: out-of-order backprop (Oh et al., "Out-Of-Order BackProp",
 * EuroSys '22) as task graphs, the simulator that plays them, and the
 * paper's scheduling algorithms.
 *
 * Backprop of layer l is two tasks: dO(l), the gradient of the layer's
 * input, on the critical path to every layer below, and dW(l), the weight
 * gradient, which nothing needs until the weights are next used (their
 * all-reduce, the next forward). Conventional backprop (autograd) runs them
 * as one node, dW(l) then dO(l); the order of the dWs is in fact free, and
 * the paper's techniques choose it:
 *   gradient fast-forwarding (pipeline parallelism): every ready dO before
 *     any dW, so a stage hands its gradient to the previous stage early;
 *   modulo layer allocation: consecutive layers on different devices, so
 *     the fast-forwarded gradient reaches an idle device at once;
 *   reverse first-k (data parallelism, Algorithm 2): the dWs of the k layers
 *     nearest the input after the last dO, lowest layer first, so that the
 *     all-reduces the next forward waits on first are issued first;
 *   multi-region joint scheduling (single device, Algorithm 1): deferred
 *     dWs placed on a sub-stream beside the main stream's regions where
 *     co-running them speeds the device up most.
 *
 * rp_simulate plays any task graph over resources (streams, links) as a
 * discrete-event simulation; rp_iter_graph_build writes the graph of a
 * layered training iteration under each order, so the techniques can be
 * compared, and the paper's unit-time figures reproduced, from the numbers
 * alone (csrc/tests/test_schedule.c).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reprop.h"
#include "rp_internal.h"

/* Priorities are integers stored as double: exact below 2^53. Graphs are
 * kept far below that (and below what int64 sizes times 8 bytes allow). */
#define RP_SCHED_MAX_ITEMS ((int64_t)1 << 40)

/* ---------------------------------------------------------------------------
 * Small helpers
 * ------------------------------------------------------------------------- */

/* a * b for a, b >= 0, or -1 past RP_SCHED_MAX_ITEMS. */
static int64_t rp_sched_mul(int64_t a, int64_t b) { return rp_mul_capped(a, b, RP_SCHED_MAX_ITEMS); }

/* count elements of `size` bytes; never malloc(0), which may return NULL.
 * PTRDIFF_MAX bounds an object's size (and tells gcc the request fits). */
static void *rp_sched_alloc(int64_t count, size_t size)
{
    if (count < 0 || (uint64_t)count >= (uint64_t)PTRDIFF_MAX / size)
        return NULL;
    return malloc(((size_t)count + 1) * size);
}

static int rp_sched_oom(rp_error *err, const char *what)
{
    return rp_set_error(err, RP_ERUNTIME, "%s: out of memory", what);
}

/* A cost or time: finite and >= 0 (also rejects NaN). */
static int rp_sched_time_ok(double v) { return v >= 0.0 && isfinite(v); }

/* ---------------------------------------------------------------------------
 * A binary min-heap of (key, rank) items, for the simulator's queues and
 * Algorithm 1's proposals
 * ------------------------------------------------------------------------- */

typedef struct {
    double key;
    int64_t rank; /* tie-break: lower first; unique within a heap */
    int64_t task;
} rp_heap_item;

typedef struct {
    rp_heap_item *items;
    int64_t size;
} rp_heap;

static int rp_heap_less(const rp_heap_item *a, const rp_heap_item *b)
{
    return a->key < b->key || (a->key == b->key && a->rank < b->rank);
}

static void rp_heap_push(rp_heap *h, rp_heap_item item)
{
    int64_t i = h->size++;
    while (i > 0) {
        int64_t parent = (i - 1) / 2;
        if (!rp_heap_less(&item, &h->items[parent]))
            break;
        h->items[i] = h->items[parent];
        i = parent;
    }
    h->items[i] = item;
}

static rp_heap_item rp_heap_pop(rp_heap *h)
{
    rp_heap_item top = h->items[0], last = h->items[--h->size];
    int64_t i = 0;
    for (;;) {
        int64_t child = 2 * i + 1;
        if (child >= h->size)
            break;
        if (child + 1 < h->size && rp_heap_less(&h->items[child + 1], &h->items[child]))
            child++;
        if (!rp_heap_less(&h->items[child], &last))
            break;
        h->items[i] = h->items[child];
        i = child;
    }
    if (h->size > 0)
        h->items[i] = last;
    return top;
}

/* ---------------------------------------------------------------------------
 * The simulator
 *
 * State per task: its unfinished predecessors and the time it may start
 * (latest predecessor finish plus delay). A task whose predecessors are all
 * done is "released" into a heap by that time; once the clock reaches it,
 * it becomes available to its resource: IN_ORDER resources only look at
 * the next task of their program, the others keep a heap of available
 * tasks keyed by their policy. The clock then jumps to the next finish or
 * release, advancing every running task by rate * dt. Times are compared
 * with a tolerance relative to the time itself (a task's finish, the
 * clock), so that a finish computed as start + cost and a release computed
 * from it meet: not to the graph's largest cost, which made every task
 * running beside a cost of 1e12 finish within 1 unit of the next event.
 * ------------------------------------------------------------------------- */

static const char *const rp_task_names[4] = {"F", "dO", "dW", "S"};

typedef struct {
    const rp_task_graph *g;
    int64_t *order;      /* (n_tasks) task ids by resource, each resource's by (priority, id) */
    int64_t *res_start;  /* (n_resources + 1) resource r's tasks: order[res_start[r] ..) */
    int64_t *rank;       /* (n_tasks) position of a task in order */
    int64_t *succ_ptr;   /* (n_tasks + 1) successors of t: succ[succ_ptr[t] ..) */
    int64_t *succ;       /* (n_deps) successor task */
    double *succ_delay;  /* (n_deps) */
    int64_t *waiting;    /* (n_tasks) unfinished predecessors */
    double *ready;       /* (n_tasks) latest predecessor finish + delay */
    unsigned char *avail; /* (n_tasks) released and ready, not started */
    rp_heap released;    /* by ready time: waiting == 0, not yet available */
    rp_heap *queue;      /* (n_resources) PRIORITY / FIFO: available tasks */
    rp_heap_item *queue_items; /* (n_tasks) the queues' storage, by resource */
    int64_t *next;       /* (n_resources) IN_ORDER: position of the next task */
    int64_t *running;    /* (n_resources) running task or -1 */
    double *rem;         /* (n_resources) work left of the running task */
    int64_t *group_id;   /* (n_resources) first resource of its co-run group, or -1 */
    int64_t *group_busy; /* (n_resources) running resources per group_id */
    /* Only the resources an event touched are visited: a pass over every
     * resource per event made a pipeline of S stages cost events x S (10^4
     * stages: seconds where 10^4 layers on one stage take milliseconds). */
    int64_t *active;     /* (n_resources) the running resources, n_active of them */
    int64_t n_active;
    int64_t *touched;    /* (n_resources) idle resources that may start a task, n_touched */
    int64_t n_touched;
    unsigned char *is_touched; /* (n_resources) r is in touched */
} rp_sim;

/* Times within this of t are t: some thousand rounding errors of t, the
 * most the sums that make a time accumulate. */
static double rp_sim_tol(double t) { return 1e-12 * fabs(t); }

static int rp_sim_check_tasks(const rp_task_graph *g, rp_error *err)
{
    for (int64_t t = 0; t < g->n_tasks; t++) {
        if (g->resource[t] < 0 || g->resource[t] >= g->n_resources)
            return rp_set_error(err, RP_EINVAL,
                                "simulate: resource[%lld] = %d is outside [0, n_resources = %lld)",
                                (long long)t, g->resource[t], (long long)g->n_resources);
        if (!rp_sched_time_ok(g->cost[t]))
            return rp_set_error(err, RP_EINVAL, "simulate: cost[%lld] = %g must be finite and >= 0",
                                (long long)t, g->cost[t]);
        if (!isfinite(g->priority[t]))
            return rp_set_error(err, RP_EINVAL, "simulate: priority[%lld] = %g must be finite",
                                (long long)t, g->priority[t]);
        if (g->kind != NULL && (g->kind[t] < 0 || g->kind[t] > RP_TASK_SYNC))
            return rp_set_error(err, RP_EINVAL, "simulate: kind[%lld] = %d is not an rp_task_kind",
                                (long long)t, g->kind[t]);
        for (int64_t e = g->dep_ptr[t]; e < g->dep_ptr[t + 1]; e++) {
            if (g->dep_idx[e] < 0 || g->dep_idx[e] >= g->n_tasks || g->dep_idx[e] == t)
                return rp_set_error(err, RP_EINVAL,
                                    "simulate: dep_idx[%lld] = %lld (a predecessor of task %lld) "
                                    "must be a task in [0, %lld) other than itself",
                                    (long long)e, (long long)g->dep_idx[e], (long long)t,
                                    (long long)g->n_tasks);
            if (!rp_sched_time_ok(g->dep_delay[e]))
                return rp_set_error(err, RP_EINVAL,
                                    "simulate: dep_delay[%lld] = %g must be finite and >= 0",
                                    (long long)e, g->dep_delay[e]);
        }
    }
    return RP_OK;
}

static int rp_sim_check(const rp_task_graph *g, double corun_rate, const double *start,
                        const double *finish, const double *busy, const double *makespan,
                        rp_error *err)
{
    if (g == NULL || makespan == NULL)
        return rp_set_error(err, RP_EINVAL, "simulate: NULL graph or makespan");
    if (g->n_tasks < 0 || g->n_deps < 0 || g->n_resources < 0 ||
        g->n_tasks > RP_SCHED_MAX_ITEMS || g->n_deps > RP_SCHED_MAX_ITEMS ||
        g->n_resources > INT32_MAX)
        return rp_set_error(err, RP_EINVAL,
                            "simulate: need 0 <= n_tasks, n_deps <= 2^40, 0 <= n_resources <= "
                            "2^31 - 1 (got %lld, %lld, %lld)",
                            (long long)g->n_tasks, (long long)g->n_deps,
                            (long long)g->n_resources);
    if (g->n_tasks > 0 && g->n_resources == 0)
        return rp_set_error(err, RP_EINVAL, "simulate: %lld tasks but no resource",
                            (long long)g->n_tasks);
    if (!(corun_rate > 0.0 && corun_rate <= 1.0))
        return rp_set_error(err, RP_EINVAL, "simulate: corun_rate must be in (0, 1] (got %g)",
                            corun_rate);
    if (g->dep_ptr == NULL || (g->n_tasks > 0 && (g->resource == NULL || g->cost == NULL ||
                                                  g->priority == NULL || start == NULL ||
                                                  finish == NULL)))
        return rp_set_error(err, RP_EINVAL,
                            "simulate: NULL dep_ptr, resource, cost, priority, start or finish");
    if (g->n_deps > 0 && (g->dep_idx == NULL || g->dep_delay == NULL))
        return rp_set_error(err, RP_EINVAL, "simulate: NULL dep_idx or dep_delay");
    if (g->n_resources > 0 && (g->policy == NULL || g->group == NULL || busy == NULL))
        return rp_set_error(err, RP_EINVAL, "simulate: NULL policy, group or busy");
    if (g->dep_ptr[0] != 0 || g->dep_ptr[g->n_tasks] != g->n_deps)
        return rp_set_error(err, RP_EINVAL,
                            "simulate: dep_ptr must run from 0 to n_deps = %lld (got %lld .. %lld)",
                            (long long)g->n_deps, (long long)g->dep_ptr[0],
                            (long long)g->dep_ptr[g->n_tasks]);
    for (int64_t t = 0; t < g->n_tasks; t++)
        if (g->dep_ptr[t + 1] < g->dep_ptr[t] || g->dep_ptr[t + 1] > g->n_deps)
            return rp_set_error(err, RP_EINVAL,
                                "simulate: dep_ptr[%lld] = %lld: dep_ptr must be non-decreasing "
                                "within [0, n_deps = %lld]",
                                (long long)(t + 1), (long long)g->dep_ptr[t + 1],
                                (long long)g->n_deps);
    for (int64_t r = 0; r < g->n_resources; r++) {
        if (g->policy[r] < RP_RES_IN_ORDER || g->policy[r] > RP_RES_FIFO)
            return rp_set_error(err, RP_EINVAL,
                                "simulate: policy[%lld] = %d is not an rp_res_policy",
                                (long long)r, g->policy[r]);
        if (g->group[r] < -1)
            return rp_set_error(err, RP_EINVAL, "simulate: group[%lld] = %d must be >= -1",
                                (long long)r, g->group[r]);
    }
    return rp_sim_check_tasks(g, err);
}

static void rp_sim_free(rp_sim *s)
{
    free(s->order), free(s->res_start), free(s->rank), free(s->succ_ptr), free(s->succ);
    free(s->succ_delay), free(s->waiting), free(s->ready), free(s->avail);
    free(s->released.items), free(s->queue), free(s->queue_items), free(s->next);
    free(s->running), free(s->rem), free(s->group_id), free(s->group_busy);
    free(s->active), free(s->touched), free(s->is_touched);
}

static int rp_sim_alloc(rp_sim *s)
{
    const int64_t n = s->g->n_tasks, e = s->g->n_deps, r = s->g->n_resources;
    s->order = rp_sched_alloc(n, sizeof *s->order);
    s->res_start = rp_sched_alloc(r + 1, sizeof *s->res_start);
    s->rank = rp_sched_alloc(n, sizeof *s->rank);
    s->succ_ptr = rp_sched_alloc(n + 1, sizeof *s->succ_ptr);
    s->succ = rp_sched_alloc(e, sizeof *s->succ);
    s->succ_delay = rp_sched_alloc(e, sizeof *s->succ_delay);
    s->waiting = rp_sched_alloc(n, sizeof *s->waiting);
    s->ready = rp_sched_alloc(n, sizeof *s->ready);
    s->avail = rp_sched_alloc(n, sizeof *s->avail);
    s->released.items = rp_sched_alloc(n, sizeof *s->released.items);
    s->queue = rp_sched_alloc(r, sizeof *s->queue);
    s->queue_items = rp_sched_alloc(n, sizeof *s->queue_items);
    s->next = rp_sched_alloc(r, sizeof *s->next);
    s->running = rp_sched_alloc(r, sizeof *s->running);
    s->rem = rp_sched_alloc(r, sizeof *s->rem);
    s->group_id = rp_sched_alloc(r, sizeof *s->group_id);
    s->group_busy = rp_sched_alloc(r, sizeof *s->group_busy);
    s->active = rp_sched_alloc(r, sizeof *s->active);
    s->touched = rp_sched_alloc(r, sizeof *s->touched);
    s->is_touched = rp_sched_alloc(r, sizeof *s->is_touched);
    return s->order && s->res_start && s->rank && s->succ_ptr && s->succ && s->succ_delay &&
           s->waiting && s->ready && s->avail && s->released.items && s->queue &&
           s->queue_items && s->next && s->running && s->rem && s->group_id && s->group_busy &&
           s->active && s->touched && s->is_touched;
}

/* qsort has no context: tasks (or resources) are sorted as (key, id)
 * pairs, by key, then id, so every order is deterministic. */
typedef struct {
    double key;
    int64_t task;
} rp_task_key;

static int rp_task_key_cmp(const void *pa, const void *pb)
{
    const rp_task_key *a = pa, *b = pb;
    if (a->key != b->key)
        return a->key < b->key ? -1 : 1;
    return (a->task > b->task) - (a->task < b->task);
}

/* Groups the tasks by resource, each resource's sorted once by (priority, id). */
static int rp_sim_sort(rp_sim *s)
{
    const rp_task_graph *g = s->g;
    rp_task_key *keys = rp_sched_alloc(g->n_tasks, sizeof *keys);
    int64_t *fill = rp_sched_alloc(g->n_resources, sizeof *fill);
    if (keys == NULL || fill == NULL) {
        free(keys), free(fill);
        return -1;
    }
    memset(s->res_start, 0, (size_t)(g->n_resources + 1) * sizeof *s->res_start);
    for (int64_t t = 0; t < g->n_tasks; t++)
        s->res_start[g->resource[t] + 1]++;
    for (int64_t r = 0; r < g->n_resources; r++) {
        s->res_start[r + 1] += s->res_start[r];
        fill[r] = s->res_start[r];
    }
    for (int64_t t = 0; t < g->n_tasks; t++)
        keys[fill[g->resource[t]]++] = (rp_task_key){g->priority[t], t};
    for (int64_t r = 0; r < g->n_resources; r++)
        qsort(keys + s->res_start[r], (size_t)(s->res_start[r + 1] - s->res_start[r]),
              sizeof *keys, rp_task_key_cmp);
    for (int64_t i = 0; i < g->n_tasks; i++) {
        s->order[i] = keys[i].task;
        s->rank[keys[i].task] = i;
    }
    free(keys), free(fill);
    return 0;
}

/* Successor lists (the transpose of the predecessor lists), predecessor
 * counts and the empty queues. */
static void rp_sim_init(rp_sim *s)
{
    const rp_task_graph *g = s->g;
    memset(s->succ_ptr, 0, (size_t)(g->n_tasks + 1) * sizeof *s->succ_ptr);
    for (int64_t e = 0; e < g->n_deps; e++)
        s->succ_ptr[g->dep_idx[e] + 1]++;
    for (int64_t t = 0; t < g->n_tasks; t++)
        s->succ_ptr[t + 1] += s->succ_ptr[t];
    /* waiting[] first counts the successors written so far of each task */
    memset(s->waiting, 0, (size_t)g->n_tasks * sizeof *s->waiting);
    for (int64_t t = 0; t < g->n_tasks; t++)
        for (int64_t e = g->dep_ptr[t]; e < g->dep_ptr[t + 1]; e++) {
            int64_t p = g->dep_idx[e], slot = s->succ_ptr[p] + s->waiting[p]++;
            s->succ[slot] = t;
            s->succ_delay[slot] = g->dep_delay[e];
        }
    for (int64_t t = 0; t < g->n_tasks; t++) {
        s->waiting[t] = g->dep_ptr[t + 1] - g->dep_ptr[t];
        s->ready[t] = 0.0;
        s->avail[t] = 0;
    }
    s->released.size = 0;
    for (int64_t t = 0; t < g->n_tasks; t++)
        if (s->waiting[t] == 0)
            rp_heap_push(&s->released, (rp_heap_item){0.0, t, t});
    for (int64_t r = 0; r < g->n_resources; r++) {
        s->queue[r] = (rp_heap){s->queue_items + s->res_start[r], 0};
        s->next[r] = s->res_start[r];
        s->running[r] = -1;
        s->rem[r] = 0.0;
        s->group_busy[r] = 0;
        s->touched[r] = r; /* every resource is looked at once */
        s->is_touched[r] = 1;
    }
    s->n_active = 0;
    s->n_touched = g->n_resources;
}

/* r may start a task at the next dispatch: one of its tasks became
 * available, or it became idle. An idle resource that no event touched has
 * nothing to start (the last dispatch found nothing for it). */
static void rp_sim_touch(rp_sim *s, int64_t r)
{
    if (!s->is_touched[r]) {
        s->is_touched[r] = 1;
        s->touched[s->n_touched++] = r;
    }
}

/* group_id[r]: the first resource of r's co-run group, so that running
 * resources can be counted per group in an array of n_resources; one sort
 * of (group, resource) pairs. */
static int rp_sim_groups(rp_sim *s)
{
    const rp_task_graph *g = s->g;
    rp_task_key *keys = rp_sched_alloc(g->n_resources, sizeof *keys);
    if (keys == NULL)
        return -1;
    for (int64_t r = 0; r < g->n_resources; r++)
        keys[r] = (rp_task_key){(double)g->group[r], r};
    qsort(keys, (size_t)g->n_resources, sizeof *keys, rp_task_key_cmp);
    for (int64_t i = 0, first = 0; i < g->n_resources; i++) {
        if (i > 0 && keys[i].key != keys[i - 1].key)
            first = i;
        s->group_id[keys[i].task] = keys[i].key >= 0 ? keys[first].task : -1;
    }
    free(keys);
    return 0;
}

/* Moves the released tasks whose time has come to their resources. */
static void rp_sim_release(rp_sim *s, double now)
{
    const rp_task_graph *g = s->g;
    const double limit = now + rp_sim_tol(now);
    while (s->released.size > 0 && s->released.items[0].key <= limit) {
        int64_t t = rp_heap_pop(&s->released).task;
        int32_t r = g->resource[t];
        s->avail[t] = 1;
        rp_sim_touch(s, r);
        /* FIFO: earliest ready first; both policies break ties by (priority, id) */
        if (g->policy[r] != RP_RES_IN_ORDER)
            rp_heap_push(&s->queue[r],
                         (rp_heap_item){g->policy[r] == RP_RES_FIFO ? s->ready[t] : 0.0,
                                        s->rank[t], t});
    }
}

/* Starts a task on every idle resource that has one it may run: those
 * touched since the last dispatch (resources do not interact here, so the
 * order they are visited in does not matter). */
static void rp_sim_dispatch(rp_sim *s, double now, double *start)
{
    const rp_task_graph *g = s->g;
    for (int64_t i = 0; i < s->n_touched; i++) {
        const int64_t r = s->touched[i];
        int64_t t = -1;
        s->is_touched[r] = 0;
        if (s->running[r] >= 0)
            continue;
        if (g->policy[r] == RP_RES_IN_ORDER) {
            /* a program: its next task or nothing, however many others are ready */
            if (s->next[r] < s->res_start[r + 1] && s->avail[s->order[s->next[r]]] == 1)
                t = s->order[s->next[r]++];
        } else if (s->queue[r].size > 0) {
            t = rp_heap_pop(&s->queue[r]).task;
        }
        if (t >= 0) {
            s->avail[t] = 2; /* started */
            s->running[r] = t;
            s->rem[r] = g->cost[t];
            start[t] = now;
            s->active[s->n_active++] = r;
            if (s->group_id[r] >= 0)
                s->group_busy[s->group_id[r]]++;
        }
    }
    s->n_touched = 0;
}

/* The task on r is done at `now`: its successors may be released. */
static void rp_sim_finish(rp_sim *s, int64_t r, double now, double *finish)
{
    const int64_t t = s->running[r];
    finish[t] = now;
    s->running[r] = -1;
    rp_sim_touch(s, r);
    for (int64_t e = s->succ_ptr[t]; e < s->succ_ptr[t + 1]; e++) {
        int64_t u = s->succ[e];
        s->ready[u] = fmax(s->ready[u], now + s->succ_delay[e]);
        if (--s->waiting[u] == 0)
            rp_heap_push(&s->released, (rp_heap_item){s->ready[u], u, u});
    }
}

/* Rate of resource r's running task: corun_rate while another resource of
 * its group runs too. */
static double rp_sim_rate(const rp_sim *s, int64_t r, double corun_rate)
{
    const int64_t gid = s->group_id[r];
    return gid >= 0 && s->group_busy[gid] > 1 ? corun_rate : 1.0;
}

/* What rp_sim_step returns instead of a count of finished tasks. */
enum { RP_SIM_DEADLOCK = -1, RP_SIM_OVERFLOW = -2 };

/* Advances the clock to the next finish or release, finishing what ends
 * then. Returns the number of tasks finished; RP_SIM_DEADLOCK when nothing
 * is running and nothing will be released; RP_SIM_OVERFLOW when something
 * is, but past the largest double (finite costs whose sum, or whose time at
 * a tiny corun_rate, overflows). */
static int64_t rp_sim_step(rp_sim *s, double corun_rate, double *now, double *finish,
                           double *busy)
{
    double next = INFINITY;
    int64_t finished = 0, kept = 0, pending = s->released.size + s->n_active;
    /* group_busy counts the running resources per group (dispatch adds,
     * the end of this step removes), the rates of a step all from its start */
    for (int64_t i = 0; i < s->n_active; i++) {
        const int64_t r = s->active[i];
        next = fmin(next, *now + s->rem[r] / rp_sim_rate(s, r, corun_rate));
    }
    if (s->released.size > 0)
        next = fmin(next, s->released.items[0].key);
    if (pending == 0)
        return RP_SIM_DEADLOCK;
    if (isinf(next))
        return RP_SIM_OVERFLOW;
    for (int64_t i = 0; i < s->n_active; i++) {
        const int64_t r = s->active[i];
        const double rate = rp_sim_rate(s, r, corun_rate);
        busy[r] += next - *now;
        /* within the tolerance of its own finish (next, if it finishes now) */
        if (*now + s->rem[r] / rate <= next + rp_sim_tol(next)) {
            rp_sim_finish(s, r, next, finish);
            finished++;
            s->active[i] = -1 - r; /* its group is counted down below */
        } else {
            s->rem[r] = fmax(0.0, s->rem[r] - rate * (next - *now));
        }
    }
    for (int64_t i = 0; i < s->n_active; i++) {
        const int64_t r = s->active[i];
        if (r >= 0)
            s->active[kept++] = r;
        else if (s->group_id[-1 - r] >= 0)
            s->group_busy[s->group_id[-1 - r]]--;
    }
    s->n_active = kept;
    *now = next;
    return finished;
}

/* Task t as the errors name it: " F(layer 3, micro 0, iteration 0)" where
 * the graph has labels, else "". */
static void rp_sim_label(const rp_task_graph *g, int64_t t, char *label, size_t size)
{
    label[0] = '\0';
    if (g->kind != NULL && g->layer != NULL && g->micro != NULL && g->iteration != NULL)
        snprintf(label, size, " %s(layer %d, micro %d, iteration %d)", rp_task_names[g->kind[t]],
                 g->layer[t], g->micro[t], g->iteration[t]);
}

/* Names a task that never runs: the first still waiting on a predecessor
 * (when nothing runs or will be released, every unstarted task either waits
 * on one or sits behind an in-order program's next task that does). */
static int rp_sim_deadlock(const rp_sim *s, double now, rp_error *err)
{
    const rp_task_graph *g = s->g;
    int64_t t = 0;
    char label[96];
    while (t < g->n_tasks - 1 && s->waiting[t] == 0)
        t++;
    if (s->waiting[t] == 0) /* not expected; then any unstarted task */
        for (t = 0; t < g->n_tasks - 1 && s->avail[t] == 2; t++) {
        }
    rp_sim_label(g, t, label, sizeof label);
    return rp_set_error(err, RP_EINVAL,
                        "simulate: deadlock at t = %g: task %lld%s on resource %d waits on %lld "
                        "unfinished predecessor(s) (a cycle, or an in-order resource whose next "
                        "task waits on a later one)",
                        now, (long long)t, label, g->resource[t], (long long)s->waiting[t]);
}

/* Names a task whose finish (a running one) or release would lie past the
 * largest double: every one that is pending, as the next event is there. */
static int rp_sim_overflow(const rp_sim *s, double now, rp_error *err)
{
    const rp_task_graph *g = s->g;
    int64_t t = -1;
    char label[96];
    for (int64_t r = 0; r < g->n_resources && t < 0; r++)
        t = s->running[r];
    if (t < 0)
        t = s->released.items[0].task;
    rp_sim_label(g, t, label, sizeof label);
    return rp_set_error(err, RP_EINVAL,
                        "simulate: the simulated time overflows after t = %g: task %lld%s on "
                        "resource %d would %s past the largest double (scale the times down, "
                        "or raise corun_rate)",
                        now, (long long)t, label, g->resource[t],
                        s->avail[t] == 2 ? "finish" : "start");
}

int rp_simulate(const rp_task_graph *g, double corun_rate, double *start, double *finish,
                double *busy, double *makespan, rp_error *err)
{
    rp_sim s;
    double now = 0.0;
    int64_t done = 0;
    int rc = rp_sim_check(g, corun_rate, start, finish, busy, makespan, err);
    if (rc != RP_OK)
        return rc;
    memset(&s, 0, sizeof s);
    s.g = g;
    if (!rp_sim_alloc(&s) || rp_sim_sort(&s) != 0 || rp_sim_groups(&s) != 0) {
        rp_sim_free(&s);
        return rp_sched_oom(err, "simulate");
    }
    rp_sim_init(&s);
    for (int64_t t = 0; t < g->n_tasks; t++)
        start[t] = finish[t] = NAN; /* left so for tasks an error stops before */
    for (int64_t r = 0; r < g->n_resources; r++)
        busy[r] = 0.0;
    while (done < g->n_tasks) {
        int64_t finished;
        rp_sim_release(&s, now);
        rp_sim_dispatch(&s, now, start);
        finished = rp_sim_step(&s, corun_rate, &now, finish, busy);
        if (finished < 0) {
            rc = finished == RP_SIM_DEADLOCK ? rp_sim_deadlock(&s, now, err)
                                             : rp_sim_overflow(&s, now, err);
            break;
        }
        done += finished;
    }
    *makespan = 0.0;
    for (int64_t t = 0; rc == RP_OK && t < g->n_tasks; t++)
        *makespan = fmax(*makespan, finish[t]);
    rp_sim_free(&s);
    return rc;
}

/* ---------------------------------------------------------------------------
 * Reverse first-k (Algorithm 2): the backward order of one micro-batch
 *
 * 2L slots: dW(l), dO(l) for l = L-1 .. k, then dO(l) for l = k-1 .. 0,
 * then dW(0) .. dW(k-1). Slot of a task, in closed form so that the graph
 * builder and rp_sched_reverse_first_k agree by construction.
 * ------------------------------------------------------------------------- */

static int64_t rp_rfk_slot(int64_t L, int64_t k, int kind, int64_t l)
{
    if (l >= k)
        return 2 * (L - 1 - l) + (kind == RP_TASK_OUTPUT_GRAD);
    if (kind == RP_TASK_OUTPUT_GRAD)
        return 2 * (L - k) + (k - 1 - l);
    return 2 * (L - k) + k + l;
}

/* Paper's line 1: the largest k' <= k whose memory estimate stays under the
 * cap, 0 when none does (0 defers nothing: conventional order). */
static int rp_rfk_cap(int64_t layers, int64_t k, const int64_t *mem_out_grad,
                      const int64_t *mem_weight_grad, int64_t mem_forward, int64_t mem_cap,
                      int64_t *k_used, rp_error *err)
{
    int64_t total = mem_forward, out_tail = 0, w_head = 0;
    if (mem_out_grad == NULL || mem_weight_grad == NULL)
        return rp_set_error(err, RP_EINVAL,
                            "reverse first-k: a memory cap needs mem_out_grad and mem_weight_grad");
    if (mem_forward < 0)
        return rp_set_error(err, RP_EINVAL, "reverse first-k: mem_forward must be >= 0 (got %lld)",
                            (long long)mem_forward);
    for (int64_t i = 0; i < layers; i++) {
        if (mem_out_grad[i] < 0 || mem_weight_grad[i] < 0)
            return rp_set_error(err, RP_EINVAL,
                                "reverse first-k: mem_out_grad[%lld] and mem_weight_grad[%lld] "
                                "must be >= 0",
                                (long long)i, (long long)i);
        /* every partial sum below is bounded by this total */
        if (mem_out_grad[i] > INT64_MAX - total - mem_weight_grad[i])
            return rp_set_error(err, RP_EINVAL, "reverse first-k: memory sizes overflow int64");
        total += mem_out_grad[i] + mem_weight_grad[i];
    }
    /* estimate(k') = mem_forward - sum_{i >= k'} mem_out_grad + sum_{i < k'} mem_weight_grad */
    for (int64_t i = 0; i < layers; i++)
        out_tail += mem_out_grad[i];
    for (int64_t i = 0; i < k; i++)
        w_head += mem_weight_grad[i], out_tail -= mem_out_grad[i];
    *k_used = 0;
    for (int64_t kk = k; kk >= 0; kk--) {
        if (mem_forward - out_tail + w_head < mem_cap) {
            *k_used = kk;
            break;
        }
        if (kk > 0)
            w_head -= mem_weight_grad[kk - 1], out_tail += mem_out_grad[kk - 1];
    }
    return RP_OK;
}

int rp_sched_reverse_first_k(int64_t layers, int64_t k, const int64_t *mem_out_grad,
                             const int64_t *mem_weight_grad, int64_t mem_forward,
                             int64_t mem_cap, int32_t *kind, int32_t *layer, int64_t *k_used,
                             rp_error *err)
{
    int64_t kk;
    if (layers < 1 || layers > INT32_MAX / 2)
        return rp_set_error(err, RP_EINVAL,
                            "reverse first-k: layers must be in [1, 2^30) (got %lld)",
                            (long long)layers);
    if (k < 0)
        return rp_set_error(err, RP_EINVAL, "reverse first-k: k must be >= 0 (got %lld)",
                            (long long)k);
    if (kind == NULL || layer == NULL || k_used == NULL)
        return rp_set_error(err, RP_EINVAL, "reverse first-k: NULL kind, layer or k_used");
    kk = k < layers ? k : layers;
    if (mem_cap > 0) {
        int rc = rp_rfk_cap(layers, kk, mem_out_grad, mem_weight_grad, mem_forward, mem_cap, &kk,
                            err);
        if (rc != RP_OK)
            return rc;
    }
    for (int64_t l = 0; l < layers; l++) {
        int64_t o = rp_rfk_slot(layers, kk, RP_TASK_OUTPUT_GRAD, l);
        int64_t w = rp_rfk_slot(layers, kk, RP_TASK_WEIGHT_GRAD, l);
        kind[o] = RP_TASK_OUTPUT_GRAD, layer[o] = (int32_t)l;
        kind[w] = RP_TASK_WEIGHT_GRAD, layer[w] = (int32_t)l;
    }
    *k_used = kk;
    return RP_OK;
}

/* ---------------------------------------------------------------------------
 * The graph of layered training iterations
 *
 * Task ids per iteration (L layers, M micro-batches, B = 2L - 1 backward
 * tasks per micro-batch, 2L with input_grad), offset by iteration * T:
 *   F(l, m)   m L + l
 *   dO(l, m)  M L + m B + 2 (L-1-l)                  (l > 0 or input_grad)
 *   dW(l, m)  M L + m B + 2 (L-1-l) + [dO(l) exists]
 *   S(l)      M L + M B + l                          (sync)
 * which is creation order: forwards, then each micro-batch's backward from
 * the top layer down, then the all-reduces; every predecessor has a lower
 * id. Priorities are integers below 3 L M, plus iteration * 3 L M.
 * ------------------------------------------------------------------------- */

typedef struct {
    const rp_iter_spec *s;
    rp_task_graph *g;
    int64_t L, M, S, B, T, k; /* k clamped to [0, L] */
    int sub, sync, ig;
    int64_t n_tasks, n_deps;  /* written so far */
} rp_iter_builder;

static void rp_iter_setup(const rp_iter_spec *s, rp_iter_builder *b)
{
    memset(b, 0, sizeof *b);
    b->s = s;
    b->L = s->layers, b->M = s->micro, b->S = s->stages;
    b->sub = s->sub_stream != 0, b->sync = s->sync != NULL, b->ig = s->input_grad != 0;
    b->k = s->k < s->layers ? s->k : s->layers;
    b->B = 2 * b->L - (b->ig ? 0 : 1);
    /* -1 when too large (rp_iter_sizes reports it) */
    b->T = rp_sched_mul(b->M, b->L + b->B);
    if (b->T >= 0)
        b->T += b->sync ? b->L : 0;
}

/* Closed-form sizes; -1 in *n_tasks past RP_SCHED_MAX_ITEMS. */
static void rp_iter_sizes(const rp_iter_builder *b, int64_t *n_tasks, int64_t *n_deps,
                          int64_t *n_resources)
{
    const int64_t I = b->s->iterations, LM = rp_sched_mul(b->L, b->M);
    /* per iteration: F(l > 0) one each; every dO and dW one; S(l) M */
    int64_t per = rp_sched_mul(b->M, (b->L - 1) + (b->B - b->L) + b->L + (b->sync ? b->L : 0));
    /* from the second iteration: F(l, m) waits on S(l), or on every dW(l, .);
       none with one iteration, where L M^2 may be past the cap but unused */
    int64_t upd = I < 2 ? 0 : b->sync ? LM : rp_sched_mul(LM, b->M);
    int64_t deps = -1, a = rp_sched_mul(I, per), c = rp_sched_mul(I - 1, upd);
    if (a >= 0 && c >= 0 && a + c <= RP_SCHED_MAX_ITEMS)
        deps = a + c;
    *n_tasks = rp_sched_mul(b->T, I);
    *n_deps = deps;
    *n_resources = b->S * (1 + b->sub + b->sync);
    if (LM < 0 || per < 0 || deps < 0)
        *n_tasks = -1;
}

static int rp_iter_check_times(const char *name, const double *v, int64_t n, rp_error *err)
{
    if (v == NULL)
        return rp_set_error(err, RP_EINVAL, "iteration graph: NULL %s", name);
    for (int64_t i = 0; i < n; i++)
        if (!rp_sched_time_ok(v[i]))
            return rp_set_error(err, RP_EINVAL,
                                "iteration graph: %s[%lld] = %g must be finite and >= 0", name,
                                (long long)i, v[i]);
    return RP_OK;
}

static int rp_iter_check(const rp_iter_spec *s, rp_iter_builder *b, rp_error *err)
{
    int64_t n_tasks, n_deps, n_resources;
    int rc;
    if (s == NULL)
        return rp_set_error(err, RP_EINVAL, "iteration graph: NULL spec");
    if (s->layers < 1 || s->micro < 1 || s->stages < 1 || s->iterations < 1 ||
        s->layers > INT32_MAX || s->micro > INT32_MAX || s->iterations > INT32_MAX ||
        s->stages > INT32_MAX / 3)
        return rp_set_error(err, RP_EINVAL,
                            "iteration graph: need layers, micro, iterations in [1, 2^31) and "
                            "stages in [1, 2^31 / 3) (got %lld, %lld, %lld, %lld)",
                            (long long)s->layers, (long long)s->micro,
                            (long long)s->iterations, (long long)s->stages);
    if ((rc = rp_iter_check_times("fwd", s->fwd, s->layers, err)) != RP_OK ||
        (rc = rp_iter_check_times("out_grad", s->out_grad, s->layers, err)) != RP_OK ||
        (rc = rp_iter_check_times("weight_grad", s->weight_grad, s->layers, err)) != RP_OK ||
        (s->sync != NULL &&
         (rc = rp_iter_check_times("sync", s->sync, s->layers, err)) != RP_OK))
        return rc;
    if (!rp_sched_time_ok(s->transfer))
        return rp_set_error(err, RP_EINVAL,
                            "iteration graph: transfer = %g must be finite and >= 0",
                            s->transfer);
    for (int64_t l = 0; s->stage != NULL && l < s->layers; l++)
        if (s->stage[l] < 0 || s->stage[l] >= s->stages)
            return rp_set_error(err, RP_EINVAL,
                                "iteration graph: stage[%lld] = %d is outside [0, stages = %lld)",
                                (long long)l, s->stage[l], (long long)s->stages);
    if (s->order < RP_ORDER_CONVENTIONAL || s->order > RP_ORDER_REVERSE_FIRST_K)
        return rp_set_error(err, RP_EINVAL, "iteration graph: order %d is not an rp_order",
                            s->order);
    if (s->k < 0)
        return rp_set_error(err, RP_EINVAL, "iteration graph: k must be >= 0 (got %lld)",
                            (long long)s->k);
    rp_iter_setup(s, b);
    rp_iter_sizes(b, &n_tasks, &n_deps, &n_resources);
    if (n_tasks < 0)
        return rp_set_error(err, RP_EINVAL,
                            "iteration graph: %lld layers x %lld micro-batches x %lld iterations "
                            "is too large (over 2^40 tasks or dependencies)",
                            (long long)s->layers, (long long)s->micro, (long long)s->iterations);
    return RP_OK;
}

int rp_iter_graph_size(const rp_iter_spec *s, int64_t *n_tasks, int64_t *n_deps,
                       int64_t *n_resources, rp_error *err)
{
    rp_iter_builder b;
    int rc = rp_iter_check(s, &b, err);
    if (rc != RP_OK)
        return rc;
    if (n_tasks == NULL || n_deps == NULL || n_resources == NULL)
        return rp_set_error(err, RP_EINVAL, "iteration graph: NULL n_tasks, n_deps or n_resources");
    rp_iter_sizes(&b, n_tasks, n_deps, n_resources);
    return RP_OK;
}

static int64_t rp_iter_stage(const rp_iter_builder *b, int64_t l)
{
    return b->s->stage != NULL ? b->s->stage[l] : 0;
}

/* Resources: main streams [0, S), sub-streams [S, 2S), links after them. */
static int64_t rp_iter_main(const rp_iter_builder *b, int64_t l) { return rp_iter_stage(b, l); }

static int64_t rp_iter_link(const rp_iter_builder *b, int64_t l)
{
    return b->S * (1 + b->sub) + rp_iter_stage(b, l);
}

/* Where an activation or gradient goes from layer a to layer c. */
static double rp_iter_transfer(const rp_iter_builder *b, int64_t a, int64_t c)
{
    return rp_iter_stage(b, a) != rp_iter_stage(b, c) ? b->s->transfer : 0.0;
}

static int rp_iter_has_dO(const rp_iter_builder *b, int64_t l) { return l > 0 || b->ig; }

static int64_t rp_iter_F(const rp_iter_builder *b, int64_t it, int64_t l, int64_t m)
{
    return it * b->T + m * b->L + l;
}

static int64_t rp_iter_dO(const rp_iter_builder *b, int64_t it, int64_t l, int64_t m)
{
    return it * b->T + b->M * b->L + m * b->B + 2 * (b->L - 1 - l);
}

static int64_t rp_iter_dW(const rp_iter_builder *b, int64_t it, int64_t l, int64_t m)
{
    return rp_iter_dO(b, it, l, m) + rp_iter_has_dO(b, l);
}

static int64_t rp_iter_S(const rp_iter_builder *b, int64_t it, int64_t l)
{
    return it * b->T + b->M * b->L + b->M * b->B + l;
}

/* Priority of dO(l, m) or dW(l, m) within an iteration; forwards take
 * [0, M L), so every backward follows them on a device. */
static int64_t rp_iter_backward_priority(const rp_iter_builder *b, int kind, int64_t l, int64_t m)
{
    const int64_t L = b->L, ML = b->M * b->L;
    switch (b->s->order) {
    case RP_ORDER_FAST_FORWARD:
        /* every dO of the iteration before any dW: what a priority queue of
         * ready tasks then runs is "the gradient first, when there is one" */
        return (kind == RP_TASK_OUTPUT_GRAD ? ML : 2 * ML) + m * L + (L - 1 - l);
    case RP_ORDER_REVERSE_FIRST_K:
        return ML + m * 2 * L + rp_rfk_slot(L, b->k, kind, l);
    default:
        /* autograd: layer l's node computes dW(l) and then hands on dO(l) */
        return ML + m * 2 * L + 2 * (L - 1 - l) + (kind == RP_TASK_OUTPUT_GRAD);
    }
}

static void rp_iter_task(rp_iter_builder *b, int kind, int64_t l, int64_t m, int64_t it,
                         int64_t res, double cost, int64_t priority)
{
    rp_task_graph *g = b->g;
    const int64_t t = b->n_tasks++;
    g->kind[t] = kind;
    g->layer[t] = (int32_t)l, g->micro[t] = (int32_t)m, g->iteration[t] = (int32_t)it;
    g->resource[t] = (int32_t)res;
    g->cost[t] = cost;
    g->priority[t] = (double)(priority + it * 3 * b->L * b->M);
    g->dep_ptr[t] = b->n_deps;
}

static void rp_iter_dep(rp_iter_builder *b, int64_t task, double delay)
{
    b->g->dep_idx[b->n_deps] = task;
    b->g->dep_delay[b->n_deps] = delay;
    b->n_deps++;
}

static void rp_iter_forwards(rp_iter_builder *b, int64_t it)
{
    const rp_iter_spec *s = b->s;
    for (int64_t m = 0; m < b->M; m++)
        for (int64_t l = 0; l < b->L; l++) {
            rp_iter_task(b, RP_TASK_FORWARD, l, m, it, rp_iter_main(b, l), s->fwd[l], m * b->L + l);
            if (l > 0)
                rp_iter_dep(b, rp_iter_F(b, it, l - 1, m), rp_iter_transfer(b, l - 1, l));
            /* the weights must be updated first: by the all-reduce when there
             * is one, else as soon as every micro-batch's dW is in */
            if (it > 0 && b->sync)
                rp_iter_dep(b, rp_iter_S(b, it - 1, l), 0.0);
            for (int64_t mm = 0; it > 0 && !b->sync && mm < b->M; mm++)
                rp_iter_dep(b, rp_iter_dW(b, it - 1, l, mm), 0.0);
        }
}

static void rp_iter_backwards(rp_iter_builder *b, int64_t it)
{
    const rp_iter_spec *s = b->s;
    for (int64_t m = 0; m < b->M; m++)
        for (int64_t l = b->L - 1; l >= 0; l--) {
            /* both need the gradient of layer l's output: from the loss at the
             * top, else dO(l + 1) */
            const int64_t need =
                l == b->L - 1 ? rp_iter_F(b, it, l, m) : rp_iter_dO(b, it, l + 1, m);
            const double delay = l == b->L - 1 ? 0.0 : rp_iter_transfer(b, l + 1, l);
            const int64_t w_res = b->sub ? b->S + rp_iter_stage(b, l) : rp_iter_main(b, l);
            if (rp_iter_has_dO(b, l)) {
                rp_iter_task(b, RP_TASK_OUTPUT_GRAD, l, m, it, rp_iter_main(b, l), s->out_grad[l],
                             rp_iter_backward_priority(b, RP_TASK_OUTPUT_GRAD, l, m));
                rp_iter_dep(b, need, delay);
            }
            rp_iter_task(b, RP_TASK_WEIGHT_GRAD, l, m, it, w_res, s->weight_grad[l],
                         rp_iter_backward_priority(b, RP_TASK_WEIGHT_GRAD, l, m));
            rp_iter_dep(b, need, delay);
        }
    for (int64_t l = 0; b->sync && l < b->L; l++) {
        /* one per layer on its device's link; FIFO links use the ready time,
         * by-layer links this priority, lowest layer first */
        rp_iter_task(b, RP_TASK_SYNC, l, 0, it, rp_iter_link(b, l), s->sync[l], l);
        for (int64_t m = 0; m < b->M; m++)
            rp_iter_dep(b, rp_iter_dW(b, it, l, m), 0.0);
    }
}

static void rp_iter_resources(rp_iter_builder *b)
{
    rp_task_graph *g = b->g;
    /* a fixed program per stream, but for fast-forwarding, which is a
     * priority queue of ready tasks by construction */
    const int32_t stream = b->s->order == RP_ORDER_FAST_FORWARD ? RP_RES_PRIORITY : RP_RES_IN_ORDER;
    for (int64_t d = 0; d < b->S; d++) {
        g->policy[d] = stream;
        g->group[d] = b->sub ? (int32_t)d : -1;
        if (b->sub) {
            g->policy[b->S + d] = stream;
            g->group[b->S + d] = (int32_t)d;
        }
        if (b->sync) {
            const int64_t link = b->S * (1 + b->sub) + d;
            g->policy[link] = b->s->sync_by_layer ? RP_RES_PRIORITY : RP_RES_FIFO;
            g->group[link] = -1;
        }
    }
}

int rp_iter_graph_build(const rp_iter_spec *s, rp_task_graph *g, rp_error *err)
{
    rp_iter_builder b;
    int64_t n_tasks, n_deps, n_resources;
    int rc = rp_iter_check(s, &b, err);
    if (rc != RP_OK)
        return rc;
    if (g == NULL)
        return rp_set_error(err, RP_EINVAL, "iteration graph: NULL graph");
    rp_iter_sizes(&b, &n_tasks, &n_deps, &n_resources);
    if (g->n_tasks != n_tasks || g->n_deps != n_deps || g->n_resources != n_resources)
        return rp_set_error(err, RP_EINVAL,
                            "iteration graph: the graph must have the sizes rp_iter_graph_size "
                            "gives: %lld tasks, %lld deps, %lld resources (got %lld, %lld, %lld)",
                            (long long)n_tasks, (long long)n_deps, (long long)n_resources,
                            (long long)g->n_tasks, (long long)g->n_deps, (long long)g->n_resources);
    if (g->kind == NULL || g->layer == NULL || g->micro == NULL || g->iteration == NULL ||
        g->resource == NULL || g->cost == NULL || g->priority == NULL || g->dep_ptr == NULL ||
        g->dep_idx == NULL || g->dep_delay == NULL || g->policy == NULL || g->group == NULL)
        return rp_set_error(err, RP_EINVAL, "iteration graph: NULL array in the graph");
    b.g = g;
    for (int64_t it = 0; it < s->iterations; it++) {
        rp_iter_forwards(&b, it);
        rp_iter_backwards(&b, it);
    }
    g->dep_ptr[n_tasks] = b.n_deps;
    rp_iter_resources(&b);
    if (b.n_tasks != n_tasks || b.n_deps != n_deps) /* the closed forms above are wrong */
        return rp_set_error(err, RP_ERUNTIME, "iteration graph: internal error: wrote %lld tasks, "
                            "%lld deps", (long long)b.n_tasks, (long long)b.n_deps);
    return RP_OK;
}

/* ---------------------------------------------------------------------------
 * Layer allocation
 * ------------------------------------------------------------------------- */

int rp_sched_stages(int64_t layers, int64_t stages, int64_t group, int32_t *stage, rp_error *err)
{
    if (layers < 1 || layers > INT32_MAX || stages < 1 || stages > INT32_MAX)
        return rp_set_error(err, RP_EINVAL,
                            "stages: need layers and stages in [1, 2^31) (got %lld, %lld)",
                            (long long)layers, (long long)stages);
    if (group < 0)
        return rp_set_error(err, RP_EINVAL, "stages: group must be >= 0 (got %lld)",
                            (long long)group);
    if (stage == NULL)
        return rp_set_error(err, RP_EINVAL, "stages: NULL stage");
    for (int64_t l = 0; l < layers; l++)
        /* contiguous: floor(l S / L) puts floor or ceil(L / S) layers on each
         * device (none on some when L < S); l S < 2^62 */
        stage[l] = (int32_t)(group == 0 ? l * stages / layers : (l / group) % stages);
    return RP_OK;
}

/* ---------------------------------------------------------------------------
 * The search for k (Section 5.1), replayed from the scores alone
 *
 * The walk is deterministic given which scores are known, so each call
 * replays it from the start and stops at the first point it needs that is
 * still NaN: the caller keeps no state but the score array.
 * ------------------------------------------------------------------------- */

/* Whether k measured better than the best so far (-1: none); ties go to
 * the smaller k. */
static int rp_ks_better(const double *score, int64_t k, int64_t best)
{
    return best < 0 || score[k] > score[best] || (score[k] == score[best] && k < best);
}

int rp_ksearch_next(int64_t layers, const double *score, int64_t *next, int64_t *best,
                    rp_error *err)
{
    int64_t step, b = -1, first_missing = -1;
    if (layers < 1 || layers > RP_SCHED_MAX_ITEMS)
        return rp_set_error(err, RP_EINVAL, "k search: layers must be in [1, 2^40] (got %lld)",
                            (long long)layers);
    if (score == NULL || next == NULL || best == NULL)
        return rp_set_error(err, RP_EINVAL, "k search: NULL score, next or best");
    /* round 0: a coarse sweep of [0, L] in steps of L / 10, ending at k = L
     * (every layer's dW held), which no step of L / 10 may land on */
    step = layers / 10 > 1 ? layers / 10 : 1;
    for (int64_t k = 0;; k = k + step < layers ? k + step : layers) {
        if (isnan(score[k])) {
            if (first_missing < 0)
                first_missing = k;
        } else if (rp_ks_better(score, k, b)) {
            b = k;
        }
        if (k == layers)
            break;
    }
    *best = b;
    if (first_missing >= 0) {
        *next = first_missing;
        return RP_OK;
    }
    /* then halve the step around the best until a step of 1 has been tried.
     * For a concave score the maximum lies strictly within a step of the
     * best (its sampled neighbours score no higher); halving rounded up keeps
     * that so, as a move to a neighbour leaves at most step - ceil(step / 2)
     * <= ceil(step / 2) of the old interval on the far side. Rounded down
     * it would not: from a best of 0 at step 3, a step of 1 never measured
     * k = 2. A step of 1 leaves the best alone in its interval. */
    while (step > 1) {
        const int64_t center = b;
        step = (step + 1) / 2;
        for (int side = 0; side < 2; side++) {
            const int64_t k = side == 0 ? center - step : center + step;
            if (k >= 0 && k <= layers && isnan(score[k])) {
                *next = k;
                return RP_OK;
            }
        }
        for (int side = 0; side < 2; side++) {
            const int64_t k = side == 0 ? center - step : center + step;
            if (k >= 0 && k <= layers && rp_ks_better(score, k, b))
                b = k;
        }
        *best = b;
    }
    *next = -1;
    *best = b;
    return RP_OK;
}

/* ---------------------------------------------------------------------------
 * Multi-region joint scheduling (Algorithm 1) with pre-scheduling
 *
 * Region i of the main stream spans [start[i], start[i + 1]) with start[i]
 * the sum of t_main before it; now[i] is the sub-stream time already given
 * to tasks in region i, so a task is runnable there when it is ready by
 * start[i] + now[i] (the sub-stream reaches it) and i < deadline. Each round
 * every open region proposes its runnable task of highest speedup, the
 * region whose proposal speeds it up most takes it, and a region closes
 * once its sub-stream time covers its main-stream time. Pre-scheduled
 * regions [0, pre) instead run each task as soon as it is ready, which
 * frees its memory early: the price of fitting a memory cap.
 *
 * One run (one pre) costs O(n K log K) time and O(n K) memory for K tasks
 * (a rescan of the unplaced tasks per region per placement was O(n K^2):
 * seconds at 8000 tasks): each region keeps its runnable tasks in a heap,
 * each task offered to it once as its reach grows, and tasks placed
 * elsewhere are dropped only when they surface.
 *
 * Under a memory cap pre runs from 0 up, up to n + 1 runs: each round of a
 * run asked every open region for its proposal, pre-scheduling searched a
 * task's region linearly, and every run played to its end, O(n^2 K log K)
 * in all (64 regions, 1e5 tasks, a cap of 0: 11 s). Now the regions sit in
 * a tournament tree keyed by the speedup each last proposed (before it was
 * asked in the run: best[i]), an upper bound of what it proposes now: a
 * region's candidates only shrink until a task is placed in it, when it is
 * asked again. A round asks only the tree's top until its proposal is
 * current, O(log n) more per placement. A task's region (the last starting by its
 * ready time) is found once for all runs, and a run stops as soon as the
 * memory its placements hold at some region end passes that end's own cap
 * (a range-add max tree over region ends of held memory less the cap, all
 * below 0 while it fits; held memory only grows within a run): that pre
 * cannot fit, and the next is tried. The schedule is the plain loops'
 * (csrc/tests/test_schedule.c checks it against them).
 *
 * A storage several tasks read (rp_shared_reads) is held at the ends of
 * regions [sh_home, sh_reach): from the last region a reader's node runs
 * in (autograd holds it until then) to the latest region a reader runs in.
 * A placement only moves sh_reach on, so held memory still only grows
 * within a run, and each storage adds its bytes to the tree once per
 * reader placed past its reach.
 * ------------------------------------------------------------------------- */

typedef struct {
    int64_t n, n_tasks;
    const double *t_main, *ready, *t_sub, *speedup;
    const int64_t *deadline, *mem;
    const rp_shared_reads *shared; /* NULL: none */
    rp_task_key *by_ready;  /* (n_tasks) the tasks by (ready, id) */
    double *start;          /* (n + 1) */
    double *now;            /* (n) */
    unsigned char *open;    /* (n) still a candidate of Algorithm 1 */
    rp_heap *runnable;      /* (n) region i's runnable tasks, best proposal on top */
    rp_heap_item *runnable_items; /* (n * n_tasks) their storage, n_tasks per region */
    int64_t *fed;           /* (n) by_ready[0, fed[i]) have been offered to region i */
    int64_t *held;          /* (n) held memory at each region end (rp_regions_peak) */
    int64_t *seq;           /* (n_tasks) placement sequence */
    int64_t placed;
    int64_t *region;        /* (n_tasks) the caller's; -1 while unplaced */
    int64_t *home;          /* (n_tasks) the last region starting by ready[k] (n: past all) */
    int64_t n_early;        /* tasks ready before start[pre]: by_ready[0, n_early) */
    int64_t *top;           /* (n) region i's last proposal, RP_REGIONS_UNASKED, or -1: none */
    double *bound;          /* (n) its speedup there (unasked: best[i]): >= what region i offers now */
    double *best;           /* (n) under a cap, the most any task offers region i; else +inf */
    int64_t *tour;          /* (2 n) tournament over regions by (bound desc, index asc), -1: none */
    int64_t held_n;         /* leaves of the held-memory tree, a power of 2 >= n */
    int64_t *held_max;      /* (2 held_n) max over the subtree's region ends of held - cap */
    int64_t *held_add;      /* (2 held_n) added to the whole subtree */
    const int64_t *cap;     /* (n) a run stops once region end i holds more (NULL: never) */
    int64_t *sh_home;       /* (shared->n) the greatest home of the storage's readers */
    int64_t *sh_reach;      /* (shared->n) the run holds it at the ends of [sh_home, sh_reach) */
    int64_t *reads_start;   /* (n_tasks + 1) task k reads the shared storages */
    int64_t *reads;         /* (start[n]) reads[reads_start[k] .. reads_start[k + 1]) */
} rp_regions;

/* top[i] before region i was asked in this run: bound[i] is then best[i] */
#define RP_REGIONS_UNASKED (-2)

/* shared's storages: readers in [0, n_tasks), sizes >= 0 and, with the
 * tasks' mem_total, a sum within int64 (the held memory never passes it). */
static int rp_regions_check_shared(const rp_shared_reads *shared, const int64_t *mem,
                                   int64_t n_tasks, int64_t mem_total, rp_error *err)
{
    if (shared == NULL)
        return RP_OK;
    if (mem == NULL)
        return rp_set_error(err, RP_EINVAL, "regions: shared storages need mem");
    if (shared->n < 0 || shared->n > RP_SCHED_MAX_ITEMS)
        return rp_set_error(err, RP_EINVAL, "regions: %lld shared storages, need [0, 2^40]",
                            (long long)shared->n);
    if (shared->start == NULL || (shared->n > 0 && shared->size == NULL))
        return rp_set_error(err, RP_EINVAL, "regions: NULL shared size or start");
    if (shared->start[0] != 0)
        return rp_set_error(err, RP_EINVAL, "regions: shared start[0] = %lld must be 0",
                            (long long)shared->start[0]);
    /* every start first: the readers are read up to start[n] */
    for (int64_t s = 0; s < shared->n; s++)
        if (shared->start[s + 1] < shared->start[s] || shared->start[s + 1] > RP_SCHED_MAX_ITEMS)
            return rp_set_error(err, RP_EINVAL,
                                "regions: shared start[%lld] = %lld must be in [%lld, 2^40]",
                                (long long)(s + 1), (long long)shared->start[s + 1],
                                (long long)shared->start[s]);
    if (shared->start[shared->n] > 0 && shared->task == NULL)
        return rp_set_error(err, RP_EINVAL, "regions: NULL shared task");
    for (int64_t s = 0; s < shared->n; s++) {
        if (shared->size[s] < 0 || shared->size[s] > INT64_MAX - mem_total)
            return rp_set_error(err, RP_EINVAL,
                                "regions: shared size[%lld] = %lld must be >= 0, and the sum "
                                "with mem within int64",
                                (long long)s, (long long)shared->size[s]);
        mem_total += shared->size[s];
    }
    for (int64_t r = 0; r < shared->start[shared->n]; r++)
        if (shared->task[r] < 0 || shared->task[r] >= n_tasks)
            return rp_set_error(err, RP_EINVAL,
                                "regions: shared task[%lld] = %lld is outside [0, %lld)",
                                (long long)r, (long long)shared->task[r], (long long)n_tasks);
    return RP_OK;
}

static int rp_regions_check(int64_t n, const double *t_main, int64_t n_tasks, const double *ready,
                            const int64_t *deadline, const double *t_sub, const double *speedup,
                            const int64_t *mem, const rp_shared_reads *shared,
                            const int64_t *mem_cap, const int64_t *region, const int64_t *order,
                            const int64_t *pre, const int64_t *peak, rp_error *err)
{
    int64_t mem_total = 0;
    if (n < 1 || n_tasks < 0 || rp_sched_mul(n, n_tasks) < 0)
        return rp_set_error(err, RP_EINVAL,
                            "regions: need n >= 1, n_tasks >= 0, n * n_tasks <= 2^40 "
                            "(got %lld, %lld)",
                            (long long)n, (long long)n_tasks);
    if (t_main == NULL || pre == NULL || peak == NULL)
        return rp_set_error(err, RP_EINVAL, "regions: NULL t_main, pre or peak");
    if (n_tasks > 0 && (ready == NULL || deadline == NULL || t_sub == NULL || speedup == NULL ||
                        region == NULL || order == NULL))
        return rp_set_error(err, RP_EINVAL,
                            "regions: NULL ready, deadline, t_sub, speedup, region or order");
    for (int64_t i = 0; i < n; i++)
        if (!rp_sched_time_ok(t_main[i]))
            return rp_set_error(err, RP_EINVAL,
                                "regions: t_main[%lld] = %g must be finite and >= 0",
                                (long long)i, t_main[i]);
    for (int64_t i = 0; mem_cap != NULL && i < n; i++)
        if (mem_cap[i] < 0)
            return rp_set_error(err, RP_EINVAL, "regions: mem_cap[%lld] = %lld must be >= 0",
                                (long long)i, (long long)mem_cap[i]);
    for (int64_t k = 0; k < n_tasks; k++) {
        if (!rp_sched_time_ok(ready[k]))
            return rp_set_error(err, RP_EINVAL, "regions: ready[%lld] = %g must be finite and >= 0",
                                (long long)k, ready[k]);
        if (deadline[k] < 1 || deadline[k] > n)
            return rp_set_error(err, RP_EINVAL,
                                "regions: deadline[%lld] = %lld is outside [1, n = %lld]",
                                (long long)k, (long long)deadline[k], (long long)n);
        for (int64_t i = 0; i < n; i++) {
            if (!rp_sched_time_ok(t_sub[k * n + i]))
                return rp_set_error(err, RP_EINVAL,
                                    "regions: t_sub[%lld, %lld] = %g must be finite and >= 0",
                                    (long long)k, (long long)i, t_sub[k * n + i]);
            if (!isfinite(speedup[k * n + i]))
                return rp_set_error(err, RP_EINVAL,
                                    "regions: speedup[%lld, %lld] = %g must be finite",
                                    (long long)k, (long long)i, speedup[k * n + i]);
        }
        if (mem != NULL && (mem[k] < 0 || mem[k] > INT64_MAX - mem_total))
            return rp_set_error(err, RP_EINVAL,
                                "regions: mem[%lld] = %lld must be >= 0, and the sum within int64",
                                (long long)k, (long long)mem[k]);
        mem_total += mem != NULL ? mem[k] : 0;
    }
    return rp_regions_check_shared(shared, mem, n_tasks, mem_total, err);
}

/* The held-memory tree of a run's start, in slack form: leaf i is what
 * region end i holds less its cap (-cap[i], nothing held yet), so that
 * the root is past 0 exactly when some region end holds more than its
 * own cap. Leaves past n are never added to: INT64_MIN keeps them out of
 * every maximum. */
static void rp_regions_hold_init(rp_regions *x)
{
    for (int64_t i = 0; i < x->held_n; i++)
        x->held_max[x->held_n + i] = i < x->n ? -x->cap[i] : INT64_MIN;
    for (int64_t p = x->held_n - 1; p >= 1; p--) {
        const int64_t a = x->held_max[2 * p], b = x->held_max[2 * p + 1];
        x->held_max[p] = a > b ? a : b;
    }
    memset(x->held_add, 0, (size_t)(2 * x->held_n) * sizeof *x->held_add);
}

/* Adds v to the held memory at the ends of regions [l, r), bottom-up: the
 * nodes that cover the range take it, then their ancestors' maxima are
 * remade. Values stay within [-cap, the sum of mem] (checked within
 * int64). */
static void rp_regions_hold(rp_regions *x, int64_t l, int64_t r, int64_t v)
{
    int64_t lo = l + x->held_n, hi = r + x->held_n;
    const int64_t left = lo, right = hi - 1;
    if (l >= r || v == 0)
        return;
    for (; lo < hi; lo >>= 1, hi >>= 1) {
        if (lo & 1)
            x->held_max[lo] += v, x->held_add[lo++] += v;
        if (hi & 1)
            x->held_max[--hi] += v, x->held_add[hi] += v;
    }
    for (int side = 0; side < 2; side++)
        for (int64_t p = (side == 0 ? left : right) >> 1; p >= 1; p >>= 1) {
            const int64_t a = x->held_max[2 * p], b = x->held_max[2 * p + 1];
            x->held_max[p] = (a > b ? a : b) + x->held_add[p];
        }
}

/* Task k placed in region i holds its shared storages at the region ends
 * up to i that neither autograd nor an earlier placement holds them at. */
static void rp_regions_hold_shared(rp_regions *x, int64_t k, int64_t i)
{
    for (int64_t r = x->reads_start[k]; r < x->reads_start[k + 1]; r++) {
        const int64_t s = x->reads[r];
        if (i > x->sh_reach[s]) {
            rp_regions_hold(x, x->sh_reach[s], i, x->shared->size[s]);
            x->sh_reach[s] = i;
        }
    }
}

static void rp_regions_place(rp_regions *x, int64_t k, int64_t i)
{
    x->region[k] = i;
    x->seq[k] = x->placed++;
    x->now[i] += x->t_sub[k * x->n + i];
    if (x->now[i] >= x->t_main[i])
        x->open[i] = 0;
}

/* Pre-scheduling: a task ready before region `pre` starts runs in the
 * region where it becomes ready (its deadline's last region if that comes
 * first), in ready order. */
static void rp_regions_pre(rp_regions *x, int64_t pre)
{
    int64_t r = 0;
    for (; r < x->n_tasks && x->by_ready[r].key < x->start[pre]; r++) {
        const int64_t k = x->by_ready[r].task;
        /* the last region of [0, pre) starting by ready[k] (start[0] = 0 always does) */
        const int64_t i = x->home[k] < pre - 1 ? x->home[k] : pre - 1;
        rp_regions_place(x, k, i < x->deadline[k] - 1 ? i : x->deadline[k] - 1);
    }
    x->n_early = r;
}

/* Offers region i the tasks its sub-stream has reached since the last call:
 * reach only grows (now[i] only does), so each task is offered to each
 * region at most once, in ready order. Its heap orders them by speedup
 * there (highest first; the key is negated for the min-heap, which is exact),
 * then by rank in by_ready, i.e. earliest ready, then lowest id. */
static void rp_regions_feed(rp_regions *x, int64_t i)
{
    const double reach = x->start[i] + x->now[i];
    for (; x->fed[i] < x->n_tasks && x->by_ready[x->fed[i]].key <= reach; x->fed[i]++) {
        const int64_t k = x->by_ready[x->fed[i]].task;
        if (x->region[k] < 0 && i < x->deadline[k])
            rp_heap_push(&x->runnable[i],
                         (rp_heap_item){-x->speedup[k * x->n + i], x->fed[i], k});
    }
}

/* Region i's proposal: the unplaced task runnable there of highest speedup
 * (ties: earliest ready, then lowest id), or -1. Tasks placed elsewhere
 * since they were offered are dropped here, when they reach the top. */
static int64_t rp_regions_propose(rp_regions *x, int64_t i)
{
    rp_heap *h = &x->runnable[i];
    rp_regions_feed(x, i);
    while (h->size > 0 && x->region[h->items[0].task] >= 0)
        rp_heap_pop(h);
    return h->size > 0 ? h->items[0].task : -1;
}

/* The better of regions a and b (-1: none) as a round of Algorithm 1 picks:
 * the higher speedup, on a tie the lower region. */
static int64_t rp_regions_better(const rp_regions *x, int64_t a, int64_t b)
{
    if (a < 0 || b < 0)
        return a < 0 ? b : a;
    if (x->bound[a] != x->bound[b])
        return x->bound[a] > x->bound[b] ? a : b;
    return a < b ? a : b;
}

static void rp_regions_tour_set(rp_regions *x, int64_t i)
{
    int64_t p = i + x->n;
    x->tour[p] = x->top[i] != -1 ? i : -1;
    for (p >>= 1; p >= 1; p >>= 1)
        x->tour[p] = rp_regions_better(x, x->tour[2 * p], x->tour[2 * p + 1]);
}

/* Asks region i for its proposal now (none once closed). */
static void rp_regions_ask(rp_regions *x, int64_t i)
{
    const int64_t k = x->open[i] ? rp_regions_propose(x, i) : -1;
    x->top[i] = k;
    x->bound[i] = k >= 0 ? x->speedup[k * x->n + i] : 0.0;
    rp_regions_tour_set(x, i);
}

/* Algorithm 1 over regions [pre, n). A round's pick is the open region whose
 * proposal has the highest speedup, the lowest such region on a tie: the
 * tournament's top once its proposal is current, as every other region's
 * bound is at least its proposal's speedup (only a placement in a region
 * gives it new candidates, and that asks it again). Returns 0, or 1 when
 * the held memory passed a region's cap (the run is then left unfinished). */
static int rp_regions_algorithm1(rp_regions *x, int64_t pre)
{
    for (int64_t i = 0; i < x->n; i++) {
        x->top[i] = i >= pre ? RP_REGIONS_UNASKED : -1;
        x->bound[i] = x->best[i];
        x->tour[x->n + i] = x->top[i] != -1 ? i : -1;
    }
    for (int64_t p = x->n - 1; p >= 1; p--)
        x->tour[p] = rp_regions_better(x, x->tour[2 * p], x->tour[2 * p + 1]);
    while (x->placed < x->n_tasks) {
        const int64_t i = x->tour[1];
        if (i < 0)
            break;
        const int64_t k = x->top[i];
        if (k == RP_REGIONS_UNASKED || x->region[k] >= 0) {
            rp_regions_ask(x, i); /* a bound, not its proposal: ask it, pick again */
            continue;
        }
        rp_regions_place(x, k, i);
        /* held at the ends of regions [home, i), as rp_regions_peak counts it
         * (pre-scheduled tasks hold nothing; the fallback's come after the
         * last check) */
        if (x->cap != NULL) {
            rp_regions_hold(x, x->home[k], i, x->mem[k]);
            rp_regions_hold_shared(x, k, i);
            if (x->held_max[1] > 0)
                return 1;
        }
        rp_regions_ask(x, i);
    }
    /* the open regions cannot take the rest (the sub-stream is overcommitted,
     * or the tasks are ready too late): never lose a task, run each in the
     * last region its deadline allows, in ready order */
    for (int64_t r = x->n_early; r < x->n_tasks; r++) {
        const int64_t k = x->by_ready[r].task;
        if (x->region[k] < 0)
            rp_regions_place(x, k, x->deadline[k] - 1);
    }
    return 0;
}

/* Held memory at the end of each region (into held[], NULL mem: none),
 * and its peak: tasks ready before it ends and
 * placed in a later region. Regions are half-open, [start, end): a task
 * ready exactly at a boundary belongs to the region that starts there, as
 * in pre-scheduling, so that pre = n always holds nothing. Task k is held
 * at the ends of regions [first, region[k]), first the earliest region
 * ending after ready[k], i.e. home[k]: one pass adds and removes each task
 * once in held[], a prefix sum gives each region's total (never past the
 * sum of mem and the shared sizes, which the check keeps within int64). A
 * shared storage is held at the ends of [sh_home, the latest region of a
 * reader). */
static int64_t rp_regions_peak(rp_regions *x)
{
    int64_t peak = 0;
    memset(x->held, 0, (size_t)x->n * sizeof *x->held);
    for (int64_t k = 0; x->mem != NULL && k < x->n_tasks; k++) {
        const int64_t first = x->home[k];
        if (first < x->region[k]) {
            x->held[first] += x->mem[k];
            x->held[x->region[k]] -= x->mem[k];
        }
    }
    for (int64_t s = 0; x->shared != NULL && s < x->shared->n; s++) {
        int64_t last = x->sh_home[s];
        for (int64_t r = x->shared->start[s]; r < x->shared->start[s + 1]; r++)
            last = x->region[x->shared->task[r]] > last ? x->region[x->shared->task[r]] : last;
        if (x->sh_home[s] < last) {
            x->held[x->sh_home[s]] += x->shared->size[s];
            x->held[last] -= x->shared->size[s];
        }
    }
    for (int64_t i = 0; i < x->n; i++) {
        x->held[i] += i > 0 ? x->held[i - 1] : 0;
        peak = x->held[i] > peak ? x->held[i] : peak;
    }
    return peak;
}

/* Whether every region end holds at most its cap (after rp_regions_peak). */
static int rp_regions_fit(const rp_regions *x)
{
    for (int64_t i = 0; i < x->n; i++)
        if (x->held[i] > x->cap[i])
            return 0;
    return 1;
}

/* One run; 1 when it stopped as its held memory passed a region's cap. */
static int rp_regions_run(rp_regions *x, int64_t pre)
{
    for (int64_t k = 0; k < x->n_tasks; k++)
        x->region[k] = -1;
    x->placed = 0;
    if (x->cap != NULL)
        rp_regions_hold_init(x);
    for (int64_t s = 0; x->shared != NULL && s < x->shared->n; s++)
        x->sh_reach[s] = x->sh_home[s];
    for (int64_t i = 0; i < x->n; i++) {
        x->now[i] = 0.0;
        x->open[i] = 1;
    }
    rp_regions_pre(x, pre);
    /* the tasks ready before start[pre] are placed: no region need see them */
    for (int64_t i = 0; i < x->n; i++) {
        x->runnable[i] = (rp_heap){x->runnable_items + i * x->n_tasks, 0};
        x->fed[i] = x->n_early;
    }
    return rp_regions_algorithm1(x, pre);
}

/* order: tasks by region, then in the sequence they were placed. */
static void rp_regions_order(const rp_regions *x, int64_t *order, int64_t *fill, int64_t *by_seq)
{
    memset(fill, 0, (size_t)(x->n + 1) * sizeof *fill);
    for (int64_t k = 0; k < x->n_tasks; k++) {
        fill[x->region[k] + 1]++;
        by_seq[x->seq[k]] = k;
    }
    for (int64_t i = 0; i < x->n; i++)
        fill[i + 1] += fill[i];
    for (int64_t s = 0; s < x->n_tasks; s++) {
        const int64_t k = by_seq[s];
        order[fill[x->region[k]]++] = k;
    }
}

static void rp_regions_free(rp_regions *x)
{
    free(x->by_ready), free(x->start), free(x->now), free(x->open);
    free(x->runnable), free(x->runnable_items), free(x->fed), free(x->held), free(x->seq);
    free(x->home), free(x->top), free(x->bound), free(x->best), free(x->tour);
    free(x->held_max), free(x->held_add);
    free(x->sh_home), free(x->sh_reach), free(x->reads_start), free(x->reads);
}

/* Every buffer of x, once for all of rp_sched_regions' runs. */
static int rp_regions_alloc(rp_regions *x)
{
    const int64_t n_shared = x->shared != NULL ? x->shared->n : 0;
    const int64_t n_reads = x->shared != NULL ? x->shared->start[n_shared] : 0;
    x->by_ready = rp_sched_alloc(x->n_tasks, sizeof *x->by_ready);
    x->start = rp_sched_alloc(x->n + 1, sizeof *x->start);
    x->now = rp_sched_alloc(x->n, sizeof *x->now);
    x->open = rp_sched_alloc(x->n, sizeof *x->open);
    x->runnable = rp_sched_alloc(x->n, sizeof *x->runnable);
    x->runnable_items = rp_sched_alloc(rp_sched_mul(x->n, x->n_tasks), sizeof *x->runnable_items);
    x->fed = rp_sched_alloc(x->n, sizeof *x->fed);
    x->held = rp_sched_alloc(x->n, sizeof *x->held);
    x->seq = rp_sched_alloc(x->n_tasks, sizeof *x->seq);
    x->home = rp_sched_alloc(x->n_tasks, sizeof *x->home);
    x->top = rp_sched_alloc(x->n, sizeof *x->top);
    x->best = rp_sched_alloc(x->n, sizeof *x->best);
    x->bound = rp_sched_alloc(x->n, sizeof *x->bound);
    x->tour = rp_sched_alloc(rp_sched_mul(x->n, 2), sizeof *x->tour);
    /* the held-memory tree only under a cap; with tasks, n <= n * n_tasks <= 2^40 */
    x->held_n = 1;
    while (x->cap != NULL && x->held_n < x->n)
        x->held_n *= 2;
    x->held_max = rp_sched_alloc(2 * x->held_n, sizeof *x->held_max);
    x->held_add = rp_sched_alloc(2 * x->held_n, sizeof *x->held_add);
    x->sh_home = rp_sched_alloc(n_shared, sizeof *x->sh_home);
    x->sh_reach = rp_sched_alloc(n_shared, sizeof *x->sh_reach);
    x->reads_start = rp_sched_alloc(x->n_tasks + 1, sizeof *x->reads_start);
    x->reads = rp_sched_alloc(n_reads, sizeof *x->reads);
    return x->by_ready != NULL && x->start != NULL && x->now != NULL && x->open != NULL &&
           x->runnable != NULL && x->runnable_items != NULL && x->fed != NULL &&
           x->held != NULL && x->seq != NULL && x->home != NULL &&
           x->top != NULL && x->best != NULL && x->bound != NULL && x->tour != NULL &&
           x->held_max != NULL && x->held_add != NULL && x->sh_home != NULL &&
           x->sh_reach != NULL && x->reads_start != NULL && x->reads != NULL;
}

/* Task k's shared storages (the transpose of shared's readers), and each
 * storage's greatest reader home. */
static void rp_regions_reads(rp_regions *x)
{
    const rp_shared_reads *sh = x->shared;
    memset(x->reads_start, 0, (size_t)(x->n_tasks + 1) * sizeof *x->reads_start);
    for (int64_t s = 0; sh != NULL && s < sh->n; s++)
        for (int64_t r = sh->start[s]; r < sh->start[s + 1]; r++)
            x->reads_start[sh->task[r]]++;
    /* reads_start[k]: where task k's list ends (n_tasks: the total), then
     * each read moves it back one, so that it ends where the list starts */
    for (int64_t k = 1; k <= x->n_tasks; k++)
        x->reads_start[k] += x->reads_start[k - 1];
    for (int64_t s = 0; sh != NULL && s < sh->n; s++) {
        x->sh_home[s] = 0;
        for (int64_t r = sh->start[s]; r < sh->start[s + 1]; r++) {
            const int64_t k = sh->task[r];
            x->reads[--x->reads_start[k]] = s;
            x->sh_home[s] = x->home[k] > x->sh_home[s] ? x->home[k] : x->sh_home[s];
        }
    }
}

int rp_sched_regions(int64_t n, const double *t_main, int64_t n_tasks, const double *ready,
                     const int64_t *deadline, const double *t_sub, const double *speedup,
                     const int64_t *mem, const rp_shared_reads *shared, const int64_t *mem_cap,
                     int64_t *region, int64_t *order, int64_t *held, int64_t *pre,
                     int64_t *peak, rp_error *err)
{
    /* a run can stop early only where a cap is checked and pre may still grow */
    rp_regions x = {.n = n, .n_tasks = n_tasks, .t_main = t_main, .ready = ready,
                    .t_sub = t_sub, .speedup = speedup, .deadline = deadline, .mem = mem,
                    .shared = shared, .region = region,
                    .cap = mem != NULL && n_tasks > 0 ? mem_cap : NULL};
    int64_t *fill = NULL, *by_seq = NULL;
    int rc = rp_regions_check(n, t_main, n_tasks, ready, deadline, t_sub, speedup, mem, shared,
                              mem_cap, region, order, pre, peak, err);
    if (rc != RP_OK)
        return rc;
    fill = rp_sched_alloc(n + 1, sizeof *fill);
    by_seq = rp_sched_alloc(n_tasks, sizeof *by_seq);
    if (!rp_regions_alloc(&x) || fill == NULL || by_seq == NULL) {
        rc = rp_sched_oom(err, "regions");
        goto done;
    }
    x.start[0] = 0.0;
    for (int64_t i = 0; i < n; i++)
        x.start[i + 1] = x.start[i] + t_main[i];
    if (!isfinite(x.start[n])) {
        rc = rp_set_error(err, RP_EINVAL, "regions: the sum of t_main overflows");
        goto done;
    }
    for (int64_t k = 0; k < n_tasks; k++)
        x.by_ready[k] = (rp_task_key){ready[k], k};
    qsort(x.by_ready, (size_t)n_tasks, sizeof *x.by_ready, rp_task_key_cmp);
    /* home[k]: the last region starting by ready[k], which the by_ready order
     * only moves on (start[0] = 0 <= every ready) */
    for (int64_t r = 0, i = 0; r < n_tasks; r++) {
        const int64_t k = x.by_ready[r].task;
        while (i < n && !(ready[k] < x.start[i + 1]))
            i++;
        x.home[k] = i;
    }
    rp_regions_reads(&x);
    /* best[i], the bound of a region not yet asked in a run: under a cap,
     * where runs repeat and most stop at their first placements, the most
     * any task offers it (-inf: none may run there), so that only regions
     * that may win are fed; one pass, as the check's. Else +inf: one run
     * asks every region anyway. */
    for (int64_t i = 0; i < n; i++)
        x.best[i] = x.cap != NULL ? -INFINITY : INFINITY;
    for (int64_t k = 0; x.cap != NULL && k < n_tasks; k++)
        for (int64_t i = 0; i < deadline[k]; i++)
            x.best[i] = speedup[k * n + i] > x.best[i] ? speedup[k * n + i] : x.best[i];
    /* pre grows until the held memory fits every region's cap (or every
     * region is pre-scheduled: the caller may see held[i] > mem_cap[i]); a
     * run stopped once its held memory passed a cap would have ended past it */
    for (*pre = 0;; ++*pre) {
        if (rp_regions_run(&x, *pre) != 0 && *pre < n)
            continue;
        *peak = rp_regions_peak(&x);
        if (x.cap == NULL || rp_regions_fit(&x) || *pre == n)
            break;
    }
    if (held != NULL)
        memcpy(held, x.held, (size_t)n * sizeof *held);
    rp_regions_order(&x, order, fill, by_seq);
done:
    rp_regions_free(&x);
    free(fill), free(by_seq);
    return rc;
}
