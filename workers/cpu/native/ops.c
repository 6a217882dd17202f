/* RMSNorm, softmax, SiLU-and-mul and rope for the fused decode step (attention: attention.c).
 *
 * exp is computed in 8 lanes (range reduction to |r| <= ln2/2, degree-7 polynomial, about
 * 1 ulp) because libm's scalar expf in softmax and SiLU cost milliseconds per step at batch
 * 16; the scalar build runs the same operations one lane at a time. */
#include "ops.h"

#include "simd.h"

#define EXP_HI 88.3762626647949f
#define EXP_LO -87.3365447505531f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
/* 1/k! for k = 7..2 */
#define C7 1.98412698e-4f
#define C6 1.38888889e-3f
#define C5 8.33333333e-3f
#define C4 4.16666667e-2f
#define C3 1.66666667e-1f
#define C2 0.5f

static inline float exp_scalar(float x) {
    x = fminf(fmaxf(x, EXP_LO), EXP_HI);
    const float n = nearbyintf(x * LOG2E);
    float r = fmaf(n, -LN2_HI, x);
    r = fmaf(n, -LN2_LO, r);
    float p = fmaf(C7, r, C6);
    p = fmaf(p, r, C5);
    p = fmaf(p, r, C4);
    p = fmaf(p, r, C3);
    p = fmaf(p, r, C2);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return p * s;
}

#ifdef SX_AVX2
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(C7), r, _mm256_set1_ps(C6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(C5));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(C4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(C3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(C2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

void sx_rmsnorm(const float *x, const float *w, int n, float eps, float *out) {
    const float mean = sx_dot_f32(x, x, n) / (float)n;
    const float r = 1.0f / sqrtf(mean + eps);
    for (int i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

void sx_softmax_inplace(float *x, int n) {
    float max = x[0];
    int m = 1;
#ifdef SX_AVX2
    /* The maximum is exact in any order (the compiler will not vectorize the scalar loop: its
     * NaN and signed-zero rules differ from maxps's). */
    if (n >= 16) {
        __m256 vm = _mm256_loadu_ps(x);
        for (m = 8; m + 8 <= n; m += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(x + m));
        float lanes[8];
        _mm256_storeu_ps(lanes, vm);
        for (int j = 0; j < 8; j++) max = lanes[j] > max ? lanes[j] : max;
    }
#endif
    for (int i = m; i < n; i++) max = x[i] > max ? x[i] : max;
    float lanes[8] = {0}, tail = 0.0f;
    int i = 0;
#ifdef SX_AVX2
    __m256 vmax = _mm256_set1_ps(max), vsum = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmax));
        _mm256_storeu_ps(x + i, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    _mm256_storeu_ps(lanes, vsum);
#else
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) {
            x[i + j] = exp_scalar(x[i + j] - max);
            lanes[j] += x[i + j];
        }
#endif
    for (; i < n; i++) {
        x[i] = exp_scalar(x[i] - max);
        tail += x[i];
    }
    const float sum = sx_hsum8_scalar(lanes) + tail;
    for (int j = 0; j < n; j++) x[j] = x[j] / sum;
}

void sx_silu_mul(const float *g, const float *u, float *out, int n) {
    int i = 0;
#ifdef SX_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) out[i] = (g[i] / (1.0f + exp_scalar(-g[i]))) * u[i];
}

void sx_rope(float *x, const float *cos, const float *sin, int d) {
    const int h = d / 2;
    for (int i = 0; i < h; i++) {
        const float a = x[i], b = x[i + h];
        x[i] = a * cos[i] - b * sin[i];
        x[i + h] = b * cos[i + h] + a * sin[i + h];
    }
}
