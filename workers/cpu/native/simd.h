/* The few SIMD primitives the kernels share, each with a scalar twin that computes the same
 * bits: lanes are modelled as arrays of 8, multiply-adds are fused (fmaf), and the horizontal
 * sum adds lanes in the order the AVX2 shuffle sequence does. */
#ifndef SX_SIMD_H
#define SX_SIMD_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(SX_PORTABLE)
#define SX_AVX2 1
#include <immintrin.h>
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SX_VNNI 1 /* 256-bit VPDPBUSD: the same lanes and integers as maddubs + madd */
#endif
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD) && !defined(SX_PORTABLE)
#define SX_NEON 1 /* NEON with the dot-product extension (ARMv8.2+): sdot for the GEMM */
#include <arm_neon.h>
#endif

#ifndef __FLT16_MAX__
#error "sysHAX kernels need a compiler with _Float16 (GCC >= 12 or clang >= 15)"
#endif

static inline float sx_h2f(uint16_t h) {
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}

static inline uint16_t sx_f2h(float f) {
    _Float16 v = (_Float16)f; /* round to nearest even, as numpy's astype(float16) */
    uint16_t h;
    memcpy(&h, &v, 2);
    return h;
}

/* ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7)): the AVX2 reduction below, written out. */
static inline float sx_hsum8_scalar(const float *l) {
    float a0 = l[0] + l[4], a1 = l[1] + l[5], a2 = l[2] + l[6], a3 = l[3] + l[7];
    float b0 = a0 + a2, b1 = a1 + a3;
    return b0 + b1;
}

#ifdef SX_AVX2
static inline float sx_hsum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#endif

/* Dot product of two float vectors in 8 lanes of fused multiply-adds; n % 8 may be != 0. */
static inline float sx_dot_f32(const float *a, const float *b, int n) {
    int i = 0;
    float tail = 0.0f;
#ifdef SX_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float head = sx_hsum8(acc);
#elif defined(SX_NEON)
    float32x4_t lo = vdupq_n_f32(0.0f), hi = vdupq_n_f32(0.0f);
    for (; i + 8 <= n; i += 8) {
        lo = vfmaq_f32(lo, vld1q_f32(a + i), vld1q_f32(b + i));
        hi = vfmaq_f32(hi, vld1q_f32(a + i + 4), vld1q_f32(b + i + 4));
    }
    float l[8];
    vst1q_f32(l, lo);
    vst1q_f32(l + 4, hi);
    float head = sx_hsum8_scalar(l);
#else
    float l[8] = {0};
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) l[j] = fmaf(a[i + j], b[i + j], l[j]);
    float head = sx_hsum8_scalar(l);
#endif
    for (; i < n; i++) tail = fmaf(a[i], b[i], tail);
    return head + tail;
}

/* y[i] += s * x[i] (fused), n any. */
static inline void sx_axpy(float s, const float *x, float *y, int n) {
    int i = 0;
#ifdef SX_AVX2
    __m256 vs = _mm256_set1_ps(s);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(vs, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] = fmaf(s, x[i], y[i]);
}
#endif
