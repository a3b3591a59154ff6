/* decode_attend: one query token's attention over a part of the keys, merged into a running
 * softmax state, reading 16-bit keys and values once (no fp32 copies of them).
 *
 * decode_attend(q, k, v, top, sum, out, B, g, n, d, kind[, stride])   the first six are addresses
 *
 *   q    fp32 (B, g, d), already scaled        k, v  (B, n, d) of `kind` (0 fp32, 1 fp16, 2 bf16),
 *                                              row b at b * stride tokens (stride >= n, default n)
 *   top  fp32 (B, g): the running max logit    sum   fp32 (B, g): the running sum of exp(s - top)
 *   out  fp32 (B, g, d): the running sum of exp(s - top) * v
 *
 * B is every (leading dim, kv head) pair, g the query heads of a GQA group. A fresh state is
 * top = -inf, sum = 0, out = 0. The caller (tierkv/attention.py) checks shapes, dtypes and
 * contiguity: the addresses are trusted here.
 *
 * It runs on x86-64 CPUs with AVX2, FMA and F16C (kernels_ready()), for head_dim a multiple of 8
 * and up to MAX_GROUP query heads a group; other calls raise ValueError, and the caller takes
 * torch's path for them (a scalar C loop was 4x slower than torch's vectorised path).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdlib.h>

#include "kernels.h"
#include "simd.h"

/* One part of decode_attend_parts: n rows of keys and values for kv head 0, the next head's
 * k_head / v_head bytes further on. */
struct part {
    const char *k, *v;
    Py_ssize_t k_head, v_head, n;
};

#ifdef HAVE_AVX2_PATH
/* exp for x <= 0 (Cephes' expf: range reduction by ln 2, a degree-5 polynomial; ~1 ulp);
 * below -87.3 it returns ~1e-38 rather than less, nothing next to the max's 1. */
AVX2 static inline __m256 exp_avx2(__m256 x)
{
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                                 _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
    e = _mm256_slli_epi32(e, 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

AVX2 static void merge_avx2(float *scores, float *top, float *sum, float *out, Py_ssize_t g,
                            Py_ssize_t n, Py_ssize_t d)
{
    for (Py_ssize_t j = 0; j < g; j++) {
        float *s = scores + j * n, mx = top[j];
        for (Py_ssize_t t = 0; t < n; t++)
            mx = s[t] > mx ? s[t] : mx;
        float c = top[j] == -INFINITY ? 0.0f : expf(top[j] - mx);
        __m256 vc = _mm256_set1_ps(c), vm = _mm256_set1_ps(mx), acc = _mm256_setzero_ps();
        for (Py_ssize_t i = 0; i < d; i += 8)
            _mm256_storeu_ps(out + j * d + i, _mm256_mul_ps(_mm256_loadu_ps(out + j * d + i), vc));
        Py_ssize_t t = 0;
        for (; t + 8 <= n; t += 8) {
            __m256 p = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm));
            _mm256_storeu_ps(s + t, p);
            acc = _mm256_add_ps(acc, p);
        }
        float total = sum[j] * c + hsum(acc);
        for (; t < n; t++) {
            s[t] = expf(s[t] - mx);
            total += s[t];
        }
        top[j] = mx;
        sum[j] = total;
    }
}

/* Scores of G query heads (G and kind constants where inlined) against n key rows, two rows
 * at a time: each 8 values of a row are converted once and meet every query head in registers. */
AVX2 static inline __attribute__((always_inline)) void
scores_avx2(const float *q, const char *k, const char *v, size_t rb, Py_ssize_t n, Py_ssize_t d,
            float *scores, Py_ssize_t pitch, const int G, const int kind)
{
    for (Py_ssize_t t = 0; t < n; t += 2) {
        const int two = t + 1 < n;
        const char *r0 = k + t * rb, *r1 = two ? r0 + rb : r0;
        /* the value rows these keys weigh: the weighing reads them a column block at a time,
         * an access the hardware prefetcher follows poorly */
        for (size_t at = 0; at < (two ? 2 : 1) * rb; at += 64)
            _mm_prefetch(v + t * rb + at, _MM_HINT_T0);
        __m256 a0[G], a1[G];
        for (int j = 0; j < G; j++)
            a0[j] = a1[j] = _mm256_setzero_ps();
        for (Py_ssize_t i = 0; i < d; i += 8) {
            __m256 x0 = load8(r0, kind, i), x1 = load8(r1, kind, i);
            for (int j = 0; j < G; j++) {
                __m256 qj = _mm256_loadu_ps(q + j * d + i);
                a0[j] = _mm256_fmadd_ps(qj, x0, a0[j]);
                a1[j] = _mm256_fmadd_ps(qj, x1, a1[j]);
            }
        }
        for (int j = 0; j < G; j++) {
            scores[j * pitch + t] = hsum(a0[j]);
            if (two)
                scores[j * pitch + t + 1] = hsum(a1[j]);
        }
    }
}

/* out (G, d) += p (G, n) @ v (n, d), 16 columns at a time: the accumulators of every query head
 * stay in registers over all n rows (a record's rows stay in L1 across the column passes).
 * Meanwhile the `ahead` bytes at `next` (the next keys, NULL for none) are prefetched, a share
 * per column pass: this pass reads only cached rows, so memory would otherwise idle while it
 * computes, and the next scores would wait on it (1 MiB fp16 records not in cache: 0.157 ms
 * against 0.181 without; 0.133 in cache). */
AVX2 static inline __attribute__((always_inline)) void
weigh_avx2(const float *p, Py_ssize_t pitch, const char *v, size_t rb, Py_ssize_t n, Py_ssize_t d,
           float *out, const int G, const int kind, const char *next, size_t ahead)
{
    const size_t passes = (size_t)(d + 15) / 16;
    const size_t share = ((ahead + passes - 1) / passes + 63) & ~(size_t)63;
    for (Py_ssize_t i = 0; i < d; i += 16) {
        const int two = i + 8 < d;
        if (next != NULL)
            for (size_t at = (size_t)i / 16 * share, end = at + share; at < end && at < ahead;
                 at += 64)
                _mm_prefetch(next + at, _MM_HINT_T0);
        __m256 a0[G], a1[G];
        for (int j = 0; j < G; j++)
            a0[j] = a1[j] = _mm256_setzero_ps();
        for (Py_ssize_t t = 0; t < n; t++) {
            const char *row = v + t * rb;
            __m256 x0 = load8(row, kind, i), x1 = two ? load8(row, kind, i + 8) : x0;
            for (int j = 0; j < G; j++) {
                __m256 pj = _mm256_broadcast_ss(p + j * pitch + t);
                a0[j] = _mm256_fmadd_ps(pj, x0, a0[j]);
                a1[j] = _mm256_fmadd_ps(pj, x1, a1[j]);
            }
        }
        for (int j = 0; j < G; j++) {
            float *o = out + j * d + i;
            _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), a0[j]));
            if (two)
                _mm256_storeu_ps(o + 8, _mm256_add_ps(_mm256_loadu_ps(o + 8), a1[j]));
        }
    }
}

AVX2 static inline __attribute__((always_inline)) void
attend_avx2_g(const float *q, const char *k, const char *v, float *top, float *sum, float *out,
              Py_ssize_t B, Py_ssize_t n, Py_ssize_t stride, Py_ssize_t d, float *scores,
              const int G, const int kind)
{
    size_t rb = (size_t)d * (kind == KIND_F32 ? 4 : 2);
    for (Py_ssize_t b = 0; b < B; b++) {
        const char *kb = k + (size_t)b * stride * rb, *vb = v + (size_t)b * stride * rb;
        scores_avx2(q + b * G * d, kb, vb, rb, n, d, scores, n, G, kind);
        merge_avx2(scores, top + b * G, sum + b * G, out + b * G * d, G, n, d);
        weigh_avx2(scores, n, vb, rb, n, d, out + b * G * d, G, kind,
                   b + 1 < B ? kb + stride * rb : NULL, n * rb);
    }
}

#define ATTEND_KIND(G)                                                                          \
    AVX2 static void attend_avx2_##G(const float *q, const char *k, const char *v, float *top,  \
                                     float *sum, float *out, Py_ssize_t B, Py_ssize_t n,         \
                                     Py_ssize_t stride, Py_ssize_t d, int kind, float *scores)  \
    {                                                                                           \
        if (kind == KIND_F16)                                                                   \
            attend_avx2_g(q, k, v, top, sum, out, B, n, stride, d, scores, G, KIND_F16);        \
        else if (kind == KIND_BF16)                                                             \
            attend_avx2_g(q, k, v, top, sum, out, B, n, stride, d, scores, G, KIND_BF16);       \
        else                                                                                    \
            attend_avx2_g(q, k, v, top, sum, out, B, n, stride, d, scores, G, KIND_F32);        \
    }
ATTEND_KIND(1)
ATTEND_KIND(2)
ATTEND_KIND(3)
ATTEND_KIND(4)
ATTEND_KIND(5)
ATTEND_KIND(6)
ATTEND_KIND(7)
ATTEND_KIND(8)

typedef void (*attend_fn)(const float *, const char *, const char *, float *, float *, float *,
                          Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t, int, float *);
static const attend_fn ATTEND_AVX2[] = {NULL, attend_avx2_1, attend_avx2_2, attend_avx2_3,
                                        attend_avx2_4, attend_avx2_5, attend_avx2_6,
                                        attend_avx2_7, attend_avx2_8};

#define PARTS_AHEAD 8192 /* bytes of keys prefetched ahead of the part being scored */

/* The parts of decode_attend_parts: each kv head's scores over every part go into one row of
 * `pitch` (all tokens), merged once, then each part's values are weighed by its share of it. */
AVX2 static inline __attribute__((always_inline)) void
attend_parts_avx2_g(const float *q, const struct part *parts, Py_ssize_t count, float *top,
                    float *sum, float *out, Py_ssize_t B, Py_ssize_t pitch, Py_ssize_t d,
                    float *scores, int per_head, const int G, const int kind)
{
    size_t rb = (size_t)d * (kind == KIND_F32 ? 4 : 2);
    for (Py_ssize_t b = 0; b < B; b++) {
        float *s = per_head ? scores + b * G * pitch : scores;
        Py_ssize_t at = 0, next = 0;
        size_t ahead = 0; /* bytes of keys prefetched and not yet scored */
        for (Py_ssize_t i = 0; i < count; i++) {
            const struct part *p = parts + i;
            /* parts lie apart, each a few rows: the hardware prefetcher does not follow from
             * one to the next, so the keys of the parts after this one are asked for now */
            for (; next < count && ahead < PARTS_AHEAD; next++) {
                const struct part *f = parts + next;
                const char *row = f->k + b * f->k_head;
                for (size_t at_ = 0; at_ < (size_t)f->n * rb; at_ += 64)
                    _mm_prefetch(row + at_, _MM_HINT_T0);
                ahead += (size_t)f->n * rb;
            }
            scores_avx2(q + b * G * d, p->k + b * p->k_head, p->v + b * p->v_head, rb, p->n, d,
                        s + at, pitch, G, kind);
            ahead -= (size_t)p->n * rb;
            at += p->n;
        }
        merge_avx2(s, top + b * G, sum + b * G, out + b * G * d, G, pitch, d);
        at = 0;
        for (Py_ssize_t i = 0; i < count; i++) {
            const struct part *p = parts + i;
            weigh_avx2(s + at, pitch, p->v + b * p->v_head, rb, p->n, d, out + b * G * d, G, kind,
                       NULL, 0);
            at += p->n;
        }
    }
}

#define ATTEND_PARTS_KIND(G)                                                                    \
    AVX2 static void attend_parts_avx2_##G(const float *q, const struct part *parts,             \
                                           Py_ssize_t count, float *top, float *sum, float *out, \
                                           Py_ssize_t B, Py_ssize_t pitch, Py_ssize_t d,         \
                                           float *scores, int per_head, int kind)                \
    {                                                                                           \
        if (kind == KIND_F16)                                                                   \
            attend_parts_avx2_g(q, parts, count, top, sum, out, B, pitch, d, scores, per_head,  \
                                G, KIND_F16);                                                   \
        else if (kind == KIND_BF16)                                                             \
            attend_parts_avx2_g(q, parts, count, top, sum, out, B, pitch, d, scores, per_head,  \
                                G, KIND_BF16);                                                  \
        else                                                                                    \
            attend_parts_avx2_g(q, parts, count, top, sum, out, B, pitch, d, scores, per_head,  \
                                G, KIND_F32);                                                   \
    }
ATTEND_PARTS_KIND(1)
ATTEND_PARTS_KIND(2)
ATTEND_PARTS_KIND(3)
ATTEND_PARTS_KIND(4)
ATTEND_PARTS_KIND(5)
ATTEND_PARTS_KIND(6)
ATTEND_PARTS_KIND(7)
ATTEND_PARTS_KIND(8)

typedef void (*attend_parts_fn)(const float *, const struct part *, Py_ssize_t, float *, float *,
                                float *, Py_ssize_t, Py_ssize_t, Py_ssize_t, float *, int, int);
static const attend_parts_fn ATTEND_PARTS_AVX2[] = {
    NULL, attend_parts_avx2_1, attend_parts_avx2_2, attend_parts_avx2_3, attend_parts_avx2_4,
    attend_parts_avx2_5, attend_parts_avx2_6, attend_parts_avx2_7, attend_parts_avx2_8};

#endif

PyObject *py_decode_attend(PyObject *self, PyObject *args)
{
    Py_ssize_t q, k, v, top, sum, out, B, g, n, d, stride = -1;
    int kind;
    (void)self;
    if (!PyArg_ParseTuple(args, "nnnnnnnnnni|n", &q, &k, &v, &top, &sum, &out, &B, &g, &n, &d,
                          &kind, &stride))
        return NULL;
    if (stride < 0)
        stride = n;
    if (!kernel_fits(B, g, d, kind) || n < 1 || stride < n) {
        PyErr_Format(PyExc_ValueError, "decode_attend: no kernel for B=%zd g=%zd n=%zd d=%zd "
                     "kind=%d stride=%zd on this CPU", B, g, n, d, kind, stride);
        return NULL;
    }
#ifdef HAVE_AVX2_PATH
    float *scores = malloc((size_t)(g * n) * sizeof(float));
    if (scores == NULL)
        return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    ATTEND_AVX2[g]((const float *)q, (const char *)k, (const char *)v, (float *)top, (float *)sum,
                   (float *)out, B, n, stride, d, kind, scores);
    Py_END_ALLOW_THREADS
    free(scores);
#endif
    Py_RETURN_NONE;
}

/* decode_attend_parts(q, scaling, table, count, slot, wk, wv, wk_head, wv_head, wn, out, scores,
 *                     tokens, B, g, d, kind)
 *
 * Attention of one query token over the keys and values of parts that lie apart (the records
 * of a fetch where they are held, then a recent window), read in place: no packed copy. The
 * whole call is here, so that a layer costs Python one call and two allocations (at 8K tokens
 * of SmolLM2, the softmax state and the scaled query made with torch took ~150 us a layer
 * inside a decode step, against ~280 us for the kernel itself).
 *
 *   q      fp32 (B, g, d), contiguous, unscaled: scaled by `scaling` into a copy
 *   table  int64 (count, 7): per part, the addresses of its keys and values (layer 0, kv head 0,
 *          first token), the bytes from one layer to the next in each, from one kv head to the
 *          next in each, and its tokens n >= 1; a part's rows (tokens) are contiguous
 *   slot   the layer of the parts read: its rows start slot * layer bytes on
 *   wk, wv, wk_head, wv_head, wn   the window, one more part (0 tokens: none)
 *   out    fp32 (B, g, d): the attention output, normalised
 *   scores fp32 (B, g, tokens) for every token's probability, or 0; tokens must be the parts'
 *          and the window's tokens together
 */
PyObject *py_decode_attend_parts(PyObject *self, PyObject *args)
{
    Py_ssize_t q, table, count, slot, wk, wv, wk_head, wv_head, wn, out, scores, tokens, B, g, d;
    double scaling;
    int kind;
    (void)self;
    if (!PyArg_ParseTuple(args, "ndnnnnnnnnnnnnnni", &q, &scaling, &table, &count, &slot, &wk,
                          &wv, &wk_head, &wv_head, &wn, &out, &scores, &tokens, &B, &g, &d,
                          &kind))
        return NULL;
    if (!kernel_fits(B, g, d, kind) || count < 0 || wn < 0 || count + wn == 0 || slot < 0) {
        PyErr_Format(PyExc_ValueError, "decode_attend_parts: no kernel for B=%zd g=%zd d=%zd "
                     "kind=%d count=%zd window=%zd slot=%zd on this CPU", B, g, d, kind, count,
                     wn, slot);
        return NULL;
    }
#ifdef HAVE_AVX2_PATH
    Py_ssize_t total = count + (wn > 0);
    struct part *parts = malloc((size_t)total * sizeof(struct part));
    if (parts == NULL)
        return PyErr_NoMemory();
    Py_ssize_t pitch = 0;
    const int64_t *row = (const int64_t *)table;
    for (Py_ssize_t i = 0; i < count; i++, row += 7) {
        parts[i].k = (const char *)(row[0] + slot * row[2]);
        parts[i].v = (const char *)(row[1] + slot * row[3]);
        parts[i].k_head = row[4];
        parts[i].v_head = row[5];
        parts[i].n = row[6];
        if (parts[i].n < 1) {
            free(parts);
            PyErr_Format(PyExc_ValueError, "decode_attend_parts: part %zd has %zd tokens", i,
                         parts[i].n);
            return NULL;
        }
        pitch += parts[i].n;
    }
    if (wn > 0) {
        parts[count] = (struct part){(const char *)wk, (const char *)wv, wk_head, wv_head, wn};
        pitch += wn;
    }
    if (scores && pitch != tokens) {
        free(parts);
        PyErr_Format(PyExc_ValueError, "decode_attend_parts: the parts hold %zd tokens, the "
                     "scores %zd", pitch, tokens);
        return NULL;
    }
    /* the scaled query, the softmax state (max, sum) and the scores when not asked for */
    size_t state = (size_t)(B * g) * (size_t)(d + 2) + (scores ? 0 : (size_t)(g * pitch));
    float *qs = malloc(state * sizeof(float));
    if (qs == NULL) {
        free(parts);
        return PyErr_NoMemory();
    }
    float *top = qs + B * g * d, *sum = top + B * g, *o = (float *)out;
    float *buffer = scores ? (float *)scores : sum + B * g;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < B * g * d; i++) {
        qs[i] = ((const float *)q)[i] * (float)scaling;
        o[i] = 0.0f;
    }
    for (Py_ssize_t i = 0; i < B * g; i++) {
        top[i] = -INFINITY;
        sum[i] = 0.0f;
    }
    ATTEND_PARTS_AVX2[g](qs, parts, total, top, sum, o, B, pitch, d, buffer, scores != 0, kind);
    for (Py_ssize_t i = 0; i < B * g; i++) {
        for (Py_ssize_t j = 0; j < d; j++)
            o[i * d + j] /= sum[i];
        if (scores)
            for (Py_ssize_t t = 0; t < pitch; t++)
                buffer[i * pitch + t] /= sum[i];
    }
    Py_END_ALLOW_THREADS
    free(qs);
    free(parts);
#endif
    Py_RETURN_NONE;
}

PyObject *py_kernels_ready(PyObject *self, PyObject *args)
{
    (void)self;
    (void)args;
    return PyBool_FromLong(kernels_ready());
}
