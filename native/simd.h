/* What tierkv's kernels share: rows of fp16 / bf16 / fp32 read as fp32 with AVX2, FMA and F16C,
 * and which CPUs and shapes they run on. */
#ifndef TIERKV_SIMD_H
#define TIERKV_SIMD_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

enum { KIND_F32 = 0, KIND_F16 = 1, KIND_BF16 = 2 }; /* the `kind` argument of the kernels */
#define MAX_GROUP 8 /* query heads a kv head, at most: their accumulators stay in registers */

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX2_PATH 1

#define AVX2 __attribute__((target("avx2,fma,f16c")))

/* 8 values of a row at element i, as fp32. */
AVX2 static inline __attribute__((always_inline)) __m256 load8(const char *row, int kind, Py_ssize_t i)
{
    if (kind == KIND_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * i)));
    if (kind == KIND_BF16) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * i)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    }
    return _mm256_loadu_ps((const float *)row + i);
}

AVX2 static inline __attribute__((always_inline)) float hsum(__m256 x)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline int have_avx2(void)
{
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                __builtin_cpu_supports("f16c");
    }
    return known;
}
#endif /* HAVE_AVX2_PATH */

/* Whether this CPU runs the kernels (an x86-64 CPU with AVX2, FMA and F16C). */
static inline int kernels_ready(void)
{
#ifdef HAVE_AVX2_PATH
    return have_avx2();
#else
    return 0;
#endif
}

/* Whether the kernels take `rows` rows of `g` query heads of `d` dims of `kind`. */
static inline int kernel_fits(Py_ssize_t rows, Py_ssize_t g, Py_ssize_t d, int kind)
{
    return kernels_ready() && rows >= 1 && g >= 1 && g <= MAX_GROUP && d >= 8 && d % 8 == 0 &&
           kind >= KIND_F32 && kind <= KIND_BF16;
}

#endif
