/* What tierkv's kernels share: 16-bit float rows read as fp32, scalar and AVX2 (+FMA, F16C). */
#ifndef TIERKV_SIMD_H
#define TIERKV_SIMD_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

enum { KIND_F32 = 0, KIND_F16 = 1, KIND_BF16 = 2 }; /* the `kind` argument of the kernels */

static inline float half_to_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13); /* inf, nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: man * 2^-24, normalised */
        exp = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline void row_scalar(const char *src, int kind, Py_ssize_t d, float *dst)
{
    if (kind == KIND_F32) {
        memcpy(dst, src, (size_t)d * sizeof(float));
        return;
    }
    const uint16_t *h = (const uint16_t *)src;
    for (Py_ssize_t i = 0; i < d; i++) {
        if (kind == KIND_F16) {
            dst[i] = half_to_float(h[i]);
        } else {
            uint32_t bits = (uint32_t)h[i] << 16;
            memcpy(dst + i, &bits, sizeof(float));
        }
    }
}

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

#endif
