/* bound_scores: the LKA upper bound of q . k over each chunk's keys, per query head, straight
 * from 16-bit min/max summaries (tierkv/summary.py defines the bound and its rounding slack).
 *
 * bound_scores(q, kmin, kmax, out, m, h, g, d, kind, alpha)   the first four are addresses
 *
 *   q           fp32 (h, g, d): the query heads grouped by kv head
 *   kmin, kmax  (m, h, d) of `kind` (0 fp32, 1 fp16, 2 bf16)
 *   out         fp32 (m, h, g): q+ . kmax + q- . kmin + alpha * |q| . max(|kmin|, |kmax|)
 *
 * Each summary row is read once and converted in registers; every query head of its GQA group
 * meets it there. The two d-term sums are accumulated together (for each d one of q+_d, q-_d is
 * zero, so it is one d-term sum in another order: the slack's bound holds for any order), the
 * slack's sum apart and added last, as torch's path does. The caller checks shapes and dtypes;
 * the CPUs and shapes it runs on are those of decode_attend (attend.c).
 */
#include <math.h>
#include <stdlib.h>

#include "kernels.h"
#include "simd.h"

#ifdef HAVE_AVX2_PATH
/* q+, q- and alpha |q|, each (h, g, d), from q. */
static void query_parts(const float *q, Py_ssize_t n, float alpha, float *pos, float *neg,
                        float *mag)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        pos[i] = q[i] > 0.0f ? q[i] : 0.0f;
        neg[i] = q[i] < 0.0f ? q[i] : 0.0f;
        mag[i] = alpha * fabsf(q[i]);
    }
}

AVX2 static inline __attribute__((always_inline)) void
bounds_avx2_g(const float *pos, const float *neg, const float *mag, const char *kmin,
              const char *kmax, float *out, Py_ssize_t m, Py_ssize_t h, Py_ssize_t d, const int G,
              const int kind)
{
    const size_t rb = (size_t)d * (kind == KIND_F32 ? 4 : 2);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (Py_ssize_t r = 0; r < m * h; r++) {
        const Py_ssize_t o = (r % h) * G * d;
        const char *lo = kmin + r * rb, *hi = kmax + r * rb;
        __m256 bound[G], slack[G];
        for (int j = 0; j < G; j++)
            bound[j] = slack[j] = _mm256_setzero_ps();
        for (Py_ssize_t i = 0; i < d; i += 8) {
            __m256 l = load8(lo, kind, i), u = load8(hi, kind, i);
            __m256 size = _mm256_max_ps(u, _mm256_xor_ps(l, sign)); /* max(|lo|, |hi|), lo <= hi */
            for (int j = 0; j < G; j++) {
                const Py_ssize_t at = o + j * d + i;
                bound[j] = _mm256_fmadd_ps(_mm256_loadu_ps(pos + at), u, bound[j]);
                bound[j] = _mm256_fmadd_ps(_mm256_loadu_ps(neg + at), l, bound[j]);
                slack[j] = _mm256_fmadd_ps(_mm256_loadu_ps(mag + at), size, slack[j]);
            }
        }
        for (int j = 0; j < G; j++)
            out[r * G + j] = hsum(bound[j]) + hsum(slack[j]);
    }
}

#define BOUNDS_G(G)                                                                             \
    AVX2 static void bounds_avx2_##G(const float *pos, const float *neg, const float *mag,      \
                                     const char *kmin, const char *kmax, float *out,            \
                                     Py_ssize_t m, Py_ssize_t h, Py_ssize_t d, int kind)        \
    {                                                                                           \
        if (kind == KIND_F16)                                                                   \
            bounds_avx2_g(pos, neg, mag, kmin, kmax, out, m, h, d, G, KIND_F16);                \
        else if (kind == KIND_BF16)                                                             \
            bounds_avx2_g(pos, neg, mag, kmin, kmax, out, m, h, d, G, KIND_BF16);               \
        else                                                                                    \
            bounds_avx2_g(pos, neg, mag, kmin, kmax, out, m, h, d, G, KIND_F32);                \
    }
BOUNDS_G(1)
BOUNDS_G(2)
BOUNDS_G(3)
BOUNDS_G(4)
BOUNDS_G(5)
BOUNDS_G(6)
BOUNDS_G(7)
BOUNDS_G(8)

typedef void (*bounds_fn)(const float *, const float *, const float *, const char *, const char *,
                          float *, Py_ssize_t, Py_ssize_t, Py_ssize_t, int);
static const bounds_fn BOUNDS_AVX2[] = {NULL, bounds_avx2_1, bounds_avx2_2, bounds_avx2_3,
                                        bounds_avx2_4, bounds_avx2_5, bounds_avx2_6,
                                        bounds_avx2_7, bounds_avx2_8};
#endif

PyObject *py_bound_scores(PyObject *self, PyObject *args)
{
    Py_ssize_t q, kmin, kmax, out, m, h, g, d;
    int kind;
    float alpha;
    (void)self;
    if (!PyArg_ParseTuple(args, "nnnnnnnnif", &q, &kmin, &kmax, &out, &m, &h, &g, &d, &kind,
                          &alpha))
        return NULL;
    if (!kernel_fits(h, g, d, kind) || m < 0) {
        PyErr_Format(PyExc_ValueError, "bound_scores: no kernel for m=%zd h=%zd g=%zd d=%zd "
                     "kind=%d on this CPU", m, h, g, d, kind);
        return NULL;
    }
#ifdef HAVE_AVX2_PATH
    const Py_ssize_t nq = h * g * d;
    float *parts = malloc((size_t)(3 * nq) * sizeof(float));
    if (parts == NULL)
        return PyErr_NoMemory();
    float *pos = parts, *neg = parts + nq, *mag = parts + 2 * nq;
    Py_BEGIN_ALLOW_THREADS
    query_parts((const float *)q, nq, alpha, pos, neg, mag);
    BOUNDS_AVX2[g](pos, neg, mag, (const char *)kmin, (const char *)kmax, (float *)out, m, h, d,
                   kind);
    Py_END_ALLOW_THREADS
    free(parts);
#endif
    Py_RETURN_NONE;
}
