/* fill_units: a filter layer's choice of leaves for the group after it (policies/omnikv.py's
 * ``OmniKV._fill``, fetch units of whole records), in one call instead of ~25 small torch ones.
 *
 * fill_units(scores, n, cuts, u, bounds, m, sinks, budget, out) -> count   (the first, third,
 * fifth and last are addresses)
 *
 *   scores  fp32 (>= n,): attention mass per token
 *   cuts    int64 (u + 1,): the fetch units' bounds, 0 .. n, a subset of the leaves' bounds
 *   bounds  int64 (m + 1,): the leaves' bounds, 0 .. n
 *   out     int64 (m,): the chosen leaves, ascending; `count` of them are written
 *
 * The rule and its arithmetic are torch's path's, step for step, so both choose the same leaves:
 * a unit's mass is the difference of the fp64 running sums of the scores at its bounds, rounded
 * to fp32; its density that mass over its size in fp32; the units holding one of the first
 * `sinks` tokens come first, then the others by density, ties in index order (a stable sort);
 * units are taken while the running total of their sizes stays within max(budget, the sinks'
 * units); of those left, each no larger than what the budget has left competes in that order,
 * taken while the running total of the competitors' sizes stays within it. The caller checks
 * shapes, dtypes and contiguity.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

typedef struct {
    float density;
    int64_t unit;
} ranked;

/* Descending density, then ascending unit: torch.argsort(descending=True, stable=True). */
static int by_density(const void *pa, const void *pb)
{
    const ranked *a = pa, *b = pb;
    if (a->density != b->density)
        return a->density > b->density ? -1 : 1;
    return a->unit < b->unit ? -1 : (a->unit > b->unit);
}

static Py_ssize_t fill(const float *scores, const int64_t *cuts, Py_ssize_t u,
                       const int64_t *bounds, Py_ssize_t m, int64_t sinks, int64_t budget,
                       int64_t *out, ranked *order, unsigned char *chosen)
{
    double running = 0.0, before = 0.0;
    int64_t at = 0, forced = 0;
    for (Py_ssize_t k = 0; k < u; k++) {
        for (; at < cuts[k + 1]; at++)
            running += (double)scores[at];
        const int64_t size = cuts[k + 1] - cuts[k];
        const float mass = (float)(running - before);
        before = running;
        order[k].unit = k;
        if (cuts[k] < sinks) {
            order[k].density = (float)INFINITY;
            forced += size;
        } else {
            order[k].density = mass / (float)size;
        }
        chosen[k] = 0;
    }
    qsort(order, (size_t)u, sizeof(ranked), by_density);
    const int64_t first = budget > forced ? budget : forced;
    int64_t taken = 0;
    Py_ssize_t i = 0;
    for (; i < u; i++) { /* sizes are positive: what is taken is a prefix of the order */
        const int64_t size = cuts[order[i].unit + 1] - cuts[order[i].unit];
        if (taken + size > first)
            break;
        taken += size;
        chosen[order[i].unit] = 1;
    }
    const int64_t left = budget - taken;
    int64_t competing = 0;
    for (; i < u; i++) {
        const int64_t size = cuts[order[i].unit + 1] - cuts[order[i].unit];
        if (size > left)
            continue;
        competing += size;
        if (competing <= left)
            chosen[order[i].unit] = 1;
    }
    Py_ssize_t count = 0, k = 0;
    for (Py_ssize_t j = 0; j < m; j++) {
        while (k + 1 < u && cuts[k + 1] <= bounds[j])
            k++;
        if (chosen[k])
            out[count++] = j;
    }
    return count;
}

PyObject *py_fill_units(PyObject *self, PyObject *args)
{
    Py_ssize_t scores, n, cuts, u, bounds, m, out;
    long long sinks, budget;
    (void)self;
    if (!PyArg_ParseTuple(args, "nnnnnnLLn", &scores, &n, &cuts, &u, &bounds, &m, &sinks,
                          &budget, &out))
        return NULL;
    if (u < 1 || m < u || n < m) {
        PyErr_Format(PyExc_ValueError, "fill_units: %zd units over %zd leaves of %zd tokens", u,
                     m, n);
        return NULL;
    }
    ranked *order = malloc((size_t)u * sizeof(ranked));
    unsigned char *chosen = malloc((size_t)u);
    if (order == NULL || chosen == NULL) {
        free(order);
        free(chosen);
        return PyErr_NoMemory();
    }
    Py_ssize_t count;
    Py_BEGIN_ALLOW_THREADS
    count = fill((const float *)scores, (const int64_t *)cuts, u, (const int64_t *)bounds, m,
                 (int64_t)sinks, (int64_t)budget, (int64_t *)out, order, chosen);
    Py_END_ALLOW_THREADS
    free(order);
    free(chosen);
    return PyLong_FromSsize_t(count);
}
