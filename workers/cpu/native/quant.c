/* GGML Q8_0 / Q4_0 weight blocks and the 8-bit activation blocks the GEMM consumes.
 *
 * Weight quantization follows ggml's reference routines (quantize_row_q8_0_ref,
 * quantize_row_q4_0_ref) operation for operation, so a tensor quantized here equals the
 * same tensor quantized by llama.cpp or gguf-py, bit for bit (tests check the latter).
 * Activations are quantized per row and 32-element block with round-to-nearest-even; the
 * torch reference in the tests does the same. */
#include <math.h>

#include "simd.h"
#include "sx.h"

static void quantize_q8_0(const float *x, int64_t n, sx_block_q8_0 *y) {
    for (int64_t b = 0; b < n / SX_QK; b++, x += SX_QK) {
        float amax = 0.0f;
        for (int j = 0; j < SX_QK; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.0f;
        const float id = d ? 1.0f / d : 0.0f;
        y[b].d = sx_f2h(d);
        for (int j = 0; j < SX_QK; j++) y[b].qs[j] = (int8_t)roundf(x[j] * id);
    }
}

static void quantize_q4_0(const float *x, int64_t n, sx_block_q4_0 *y) {
    for (int64_t b = 0; b < n / SX_QK; b++, x += SX_QK) {
        float amax = 0.0f, max = 0.0f; /* the value of largest magnitude, sign kept */
        for (int j = 0; j < SX_QK; j++) {
            if (amax < fabsf(x[j])) {
                amax = fabsf(x[j]);
                max = x[j];
            }
        }
        const float d = max / -8.0f;
        const float id = d ? 1.0f / d : 0.0f;
        y[b].d = sx_f2h(d);
        for (int j = 0; j < SX_QK / 2; j++) {
            const float x0 = x[j] * id, x1 = x[j + SX_QK / 2] * id;
            int q0 = (int8_t)(x0 + 8.5f), q1 = (int8_t)(x1 + 8.5f);
            q0 = q0 < 15 ? q0 : 15;
            q1 = q1 < 15 ? q1 : 15;
            y[b].qs[j] = (uint8_t)(q0 | (q1 << 4));
        }
    }
}

void sx_quantize(int type, const float *x, int64_t n, void *out) {
    if (type == SX_Q8_0) quantize_q8_0(x, n, (sx_block_q8_0 *)out);
    else if (type == SX_Q4_0) quantize_q4_0(x, n, (sx_block_q4_0 *)out);
    else if (type == SX_F32) memcpy(out, x, (size_t)n * sizeof(float));
}

void sx_dequantize(int type, const void *in, int64_t n, float *out) {
    if (type == SX_F32) {
        memcpy(out, in, (size_t)n * sizeof(float));
        return;
    }
    for (int64_t b = 0; b < n / SX_QK; b++, out += SX_QK) {
        if (type == SX_Q8_0) {
            const sx_block_q8_0 *blk = (const sx_block_q8_0 *)in + b;
            const float d = sx_h2f(blk->d);
            for (int j = 0; j < SX_QK; j++) out[j] = blk->qs[j] * d;
        } else {
            const sx_block_q4_0 *blk = (const sx_block_q4_0 *)in + b;
            const float d = sx_h2f(blk->d);
            for (int j = 0; j < SX_QK / 2; j++) {
                out[j] = ((blk->qs[j] & 0x0F) - 8) * d;
                out[j + SX_QK / 2] = ((blk->qs[j] >> 4) - 8) * d;
            }
        }
    }
}

/* One block of 32 floats -> 32 int8 (nearest even), the per-lane Q4_0 corrections, the scale. */
static inline float quantize_act_block(const float *x, sx_act_block *out) {
#ifdef SX_AVX2
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
    __m256 v2 = _mm256_loadu_ps(x + 16), v3 = _mm256_loadu_ps(x + 24);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                             _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float d = _mm_cvtss_f32(h) / 127.0f;
    const __m256 id = _mm256_set1_ps(d ? 1.0f / d : 0.0f);
    const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, id), rnd));
    __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, id), rnd));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, id), rnd));
    __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, id), rnd));
    /* packs work per 128-bit half; the permute puts the 32 bytes back in element order. */
    __m256i q = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    q = _mm256_permutevar8x32_epi32(q, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)out->qs, q);
    __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q),
                                     _mm256_set1_epi16(1));
    _mm256_storeu_si256((__m256i *)out->corr,
                        _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sums, 3)));
    return d;
#else
    float amax = 0.0f;
    for (int j = 0; j < SX_QK; j++) amax = fmaxf(amax, fabsf(x[j]));
    const float d = amax / 127.0f;
    const float id = d ? 1.0f / d : 0.0f;
    for (int j = 0; j < SX_QK; j++) out->qs[j] = (int8_t)nearbyintf(x[j] * id);
    for (int l = 0; l < 8; l++) {
        int s = 0;
        for (int j = 0; j < 4; j++) s += out->qs[4 * l + j];
        out->corr[l] = -8 * s;
    }
    return d;
#endif
}

void sx_quantize_act(const float *x, int n, int k, sx_act_block *out, float *scales) {
    const int nb = k / SX_QK;
    for (int r = 0; r < n; r++)
        for (int b = 0; b < nb; b++)
            scales[r * nb + b] = quantize_act_block(x + (size_t)r * k + b * SX_QK, out + r * nb + b);
}
