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

/* One block of 32 floats -> 32 int8 (round half to even) and their sum; returns the scale. */
static inline float quantize_act_block(const float *x, sx_act_block *out, int32_t *sum) {
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
    /* The int32 sum before packing; packs work per 128-bit half, the permute restores order. */
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    *sum = _mm_cvtsi128_si32(s4);
    __m256i q = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    q = _mm256_permutevar8x32_epi32(q, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)out->qs, q);
    _mm256_storeu_si256((__m256i *)out->qu, _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80)));
    return d;
#else
    float amax = 0.0f;
    for (int j = 0; j < SX_QK; j++) amax = fmaxf(amax, fabsf(x[j]));
    const float d = amax / 127.0f;
    const float id = d ? 1.0f / d : 0.0f;
    int32_t s = 0;
    for (int j = 0; j < SX_QK; j++) {
        out->qs[j] = (int8_t)nearbyintf(x[j] * id);
        out->qu[j] = (uint8_t)(out->qs[j] + 128);
        s += out->qs[j];
    }
    *sum = s;
    return d;
#endif
}

void sx_quantize_act(const float *x, int n, int k, sx_act_block *out, float *scales, int32_t *sums) {
    const int nb = k / SX_QK;
    for (int r = 0; r < n; r++)
        for (int b = 0; b < nb; b++) {
            const int i = r * nb + b;
            scales[i] = quantize_act_block(x + (size_t)r * k + b * SX_QK, out + i, sums + i);
        }
}

/* ---- packing: GGML row-major blocks <-> tiles of 8 rows ---------------------------------- */

size_t sx_packed_bytes(int type, int rows, int cols) {
    const size_t tiles = (size_t)(rows + SX_TILE - 1) / SX_TILE, nb = (size_t)cols / SX_QK;
    return tiles * nb * (type == SX_Q4_0 ? SX_Q4_TILE_BYTES : SX_Q8_TILE_BYTES);
}

/* One tile-block <-> 8 GGML blocks (rows past `rows` are zero blocks). Quant byte i of row r
 * sits at 16 + 32 * (i / 4) + 4 * r + i % 4. */
static void pack_tile_block(int type, uint8_t *rowmajor, size_t row_bytes, int r0, int rows,
                            int b, uint8_t *tile, int unpack) {
    const size_t bsz = type == SX_Q4_0 ? sizeof(sx_block_q4_0) : sizeof(sx_block_q8_0);
    const int nq = type == SX_Q4_0 ? SX_QK / 2 : SX_QK; /* quant bytes per block */
    for (int r = 0; r < SX_TILE; r++) {
        const int live = r0 + r < rows;
        uint8_t *blk = rowmajor + (size_t)(r0 + r) * row_bytes + b * bsz;
        uint8_t *d = tile + 2 * r;
        if (unpack) {
            if (live) memcpy(blk, d, 2);
        } else if (live) {
            memcpy(d, blk, 2);
        } else {
            memset(d, 0, 2);
        }
        for (int i = 0; i < nq; i++) {
            uint8_t *q = tile + 16 + 32 * (i / 4) + 4 * r + i % 4;
            if (unpack) {
                if (live) blk[2 + i] = *q;
            } else {
                *q = live ? blk[2 + i] : (type == SX_Q4_0 ? 0x88 : 0); /* Q4_0 zero = nibble 8 */
            }
        }
    }
}

void sx_unpack(int type, const void *packed, int rows, int cols, void *rowmajor) {
    const int nb = cols / SX_QK, tiles = (rows + SX_TILE - 1) / SX_TILE;
    const size_t tb = type == SX_Q4_0 ? SX_Q4_TILE_BYTES : SX_Q8_TILE_BYTES;
    const size_t row_bytes = (size_t)nb * (type == SX_Q4_0 ? sizeof(sx_block_q4_0) : sizeof(sx_block_q8_0));
    for (int t = 0; t < tiles; t++)
        for (int b = 0; b < nb; b++)
            pack_tile_block(type, (uint8_t *)rowmajor, row_bytes, t * SX_TILE, rows, b,
                            (uint8_t *)packed + ((size_t)t * nb + b) * tb, 1);
}

void sx_pack_tiles(int type, const void *rowmajor, int rows, int cols, void *packed, int t0, int t1) {
    const int nb = cols / SX_QK;
    const size_t tb = type == SX_Q4_0 ? SX_Q4_TILE_BYTES : SX_Q8_TILE_BYTES;
    const size_t row_bytes = (size_t)nb * (type == SX_Q4_0 ? sizeof(sx_block_q4_0) : sizeof(sx_block_q8_0));
    for (int t = t0; t < t1; t++)
        for (int b = 0; b < nb; b++)
            pack_tile_block(type, (uint8_t *)rowmajor, row_bytes, t * SX_TILE, rows, b,
                            (uint8_t *)packed + ((size_t)t * nb + b) * tb, 0);
}
