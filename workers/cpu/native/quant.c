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

int sx_block_elems(int type) {
    switch (type) {
    case SX_F32: case SX_F16: return 1;
    case SX_Q4_0: case SX_Q4_1: case SX_Q5_0: case SX_Q5_1: case SX_Q8_0: return SX_QK;
    case SX_Q4_K: case SX_Q5_K: case SX_Q6_K: return SX_QKK;
    default: return 0;
    }
}

static size_t block_bytes(int type) {
    switch (type) {
    case SX_F32: return 4;
    case SX_F16: return 2;
    case SX_Q4_0: return 18;
    case SX_Q4_1: return 20;
    case SX_Q5_0: return 22;
    case SX_Q5_1: return 24;
    case SX_Q8_0: return 34;
    case SX_Q4_K: return 144;
    case SX_Q5_K: return 176;
    case SX_Q6_K: return 210;
    default: return 0;
    }
}

size_t sx_row_bytes(int type, int64_t cols) {
    const int e = sx_block_elems(type);
    return e ? (size_t)(cols / e) * block_bytes(type) : 0;
}

/* The 6-bit scale and min of sub-block j from a K-quant's 12 packed bytes (ggml's packing). */
static inline void kscale(const uint8_t *s, int j, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* One block -> its weights, with gguf-py's float32 operations in its order (no contraction:
 * the build has -ffp-contract=off), so the results are bit for bit its dequantize(). */
static void dequant_block(int type, const uint8_t *p, float *out) {
    switch (type) {
    case SX_F32: memcpy(out, p, 4); return;
    case SX_F16: *out = sx_h2f(*(const uint16_t *)p); return;
    case SX_Q8_0: {
        const float d = sx_h2f(*(const uint16_t *)p);
        for (int j = 0; j < SX_QK; j++) out[j] = (int8_t)p[2 + j] * d;
        return;
    }
    case SX_Q4_0: case SX_Q4_1: case SX_Q5_0: case SX_Q5_1: {
        const int has_m = type == SX_Q4_1 || type == SX_Q5_1, five = type == SX_Q5_0 || type == SX_Q5_1;
        const float d = sx_h2f(*(const uint16_t *)p), m = has_m ? sx_h2f(*(const uint16_t *)(p + 2)) : 0.0f;
        const uint8_t *q = p + 2 + 2 * has_m + 4 * five;
        uint32_t qh = 0;
        if (five) memcpy(&qh, p + 2 + 2 * has_m, 4);
        for (int j = 0; j < SX_QK; j++) {
            int v = (j < 16 ? q[j] & 0xF : q[j - 16] >> 4) | (five ? ((qh >> j) & 1) << 4 : 0);
            if (!has_m) v -= five ? 16 : 8;
            out[j] = has_m ? d * (float)v + m : (float)v * d;
        }
        return;
    }
    case SX_Q4_K: case SX_Q5_K: {
        const float d = sx_h2f(*(const uint16_t *)p), dmin = sx_h2f(*(const uint16_t *)(p + 2));
        const uint8_t *sc = p + 4, *qh = p + 16, *qs = p + (type == SX_Q5_K ? 48 : 16);
        for (int s = 0; s < 8; s++) {
            uint8_t a, m;
            kscale(sc, s, &a, &m);
            const float dd = d * (float)a, dm = dmin * (float)m;
            for (int i = 0; i < 32; i++) {
                int v = (qs[32 * (s / 2) + i] >> (4 * (s & 1))) & 0xF;
                if (type == SX_Q5_K) v |= ((qh[i] >> s) & 1) << 4;
                out[32 * s + i] = dd * (float)v - dm;
            }
        }
        return;
    }
    case SX_Q6_K: {
        const uint8_t *ql = p, *qh = p + 128;
        const int8_t *sc = (const int8_t *)(p + 192);
        const float d = sx_h2f(*(const uint16_t *)(p + 208));
        for (int w = 0; w < SX_QKK; w++) {
            const int h = w / 128, t = (w / 32) % 4, i = w % 32;
            const int lo = (ql[64 * h + 32 * (t % 2) + i] >> (4 * (t / 2))) & 0xF;
            const int v = (lo | (((qh[32 * h + i] >> (2 * t)) & 3) << 4)) - 32;
            out[w] = (d * (float)sc[w / 16]) * (float)v;
        }
        return;
    }
    }
}

void sx_dequantize(int type, const void *in, int64_t n, float *out) {
    if (type == SX_F32) {
        memcpy(out, in, (size_t)n * sizeof(float));
        return;
    }
    const int e = sx_block_elems(type);
    const size_t bb = block_bytes(type);
    if (!e) return;
    for (int64_t b = 0; b < n / e; b++) dequant_block(type, (const uint8_t *)in + b * bb, out + b * e);
}

void sx_dequantize_rows(int type, const void *table, int64_t row_bytes, int cols, const int64_t *ids,
                        int n, float *out) {
    for (int i = 0; i < n; i++)
        sx_dequantize(type, (const uint8_t *)table + ids[i] * row_bytes, cols, out + (size_t)i * cols);
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

static size_t tile_bytes(int type) {
    switch (type) {
    case SX_Q4_0: return SX_Q4_TILE_BYTES;
    case SX_Q8_0: return SX_Q8_TILE_BYTES;
    case SX_Q4_1: return SX_Q41_TILE_BYTES;
    case SX_Q4_K: return SX_Q4K_TILE_BYTES;
    case SX_Q5_K: return SX_Q5K_TILE_BYTES;
    case SX_Q6_K: return SX_Q6K_TILE_BYTES;
    default: return 0;
    }
}

size_t sx_packed_bytes(int type, int rows, int cols) {
    if (type == SX_F32 || type == SX_F16) return (size_t)rows * cols * (type == SX_F32 ? 4 : 2);
    const size_t tiles = (size_t)(rows + SX_TILE - 1) / SX_TILE, nb = (size_t)cols / sx_block_elems(type);
    return tiles * nb * tile_bytes(type);
}

/* Tile-block <-> 8 GGML blocks, as whole fields: per row, 2-byte fp16 values to 2r, and runs
 * of 4-byte quant groups to chunks (group j of row r at 32 j + 4 r). `rp[r]`: row r's block (a
 * zero block, or scratch when unpacking, for rows past the matrix). Fixed-size memcpy: plain
 * 16/32-bit loads and stores. */
#define AI static inline __attribute__((always_inline))
AI void mv(uint8_t *tile, uint8_t *blk, int n, int unpack) {
    if (n == 2) {
        if (unpack) memcpy(blk, tile, 2);
        else memcpy(tile, blk, 2);
    } else {
        if (unpack) memcpy(blk, tile, 4);
        else memcpy(tile, blk, 4);
    }
}

AI void halves(uint8_t *tile, uint8_t *const *rp, int dst, int src, int unpack) {
    for (int r = 0; r < SX_TILE; r++) mv(tile + dst + 2 * r, rp[r] + src, 2, unpack);
}

AI void chunks(uint8_t *tile, uint8_t *const *rp, int dst, int src, int groups, int unpack) {
    for (int j = 0; j < groups; j++)
        for (int r = 0; r < SX_TILE; r++) mv(tile + dst + 32 * j + 4 * r, rp[r] + src + 4 * j, 4, unpack);
}

/* The K-quants' 12 bytes of 6-bit scales and mins <-> bytes sc[8][8], mn[8][8] at 32, 96. */
AI void kscales(uint8_t *tile, uint8_t *const *rp, int unpack) {
    for (int r = 0; r < SX_TILE; r++) {
        uint8_t *sc = tile + 32 + r, *mn = tile + 96 + r, *s = rp[r] + 4;
        if (!unpack) {
            for (int j = 0; j < 8; j++) kscale(s, j, sc + 8 * j, mn + 8 * j);
            continue;
        }
        for (int j = 0; j < 4; j++) {
            s[j] = (uint8_t)(sc[8 * j] | ((sc[8 * (j + 4)] >> 4) << 6));
            s[j + 4] = (uint8_t)(mn[8 * j] | ((mn[8 * (j + 4)] >> 4) << 6));
            s[j + 8] = (uint8_t)((sc[8 * (j + 4)] & 0xF) | ((mn[8 * (j + 4)] & 0xF) << 4));
        }
    }
}

/* One tile-block (the layouts of sx.h). */
AI void tile_block(int type, uint8_t *tile, uint8_t *const *rp, int unpack) {
    switch (type) {
    case SX_Q4_0: case SX_Q8_0:
        halves(tile, rp, 0, 0, unpack);
        chunks(tile, rp, 16, 2, type == SX_Q4_0 ? 4 : 8, unpack);
        return;
    case SX_Q4_1:
        halves(tile, rp, 0, 0, unpack);
        halves(tile, rp, 16, 2, unpack);
        chunks(tile, rp, 32, 4, 4, unpack);
        return;
    case SX_Q4_K: case SX_Q5_K:
        halves(tile, rp, 0, 0, unpack);
        halves(tile, rp, 16, 2, unpack);
        kscales(tile, rp, unpack);
        if (type == SX_Q5_K) chunks(tile, rp, SX_Q4K_TILE_BYTES, 16, 8, unpack);
        chunks(tile, rp, 160, type == SX_Q5_K ? 48 : 16, 32, unpack);
        return;
    case SX_Q6_K:
        halves(tile, rp, 0, 208, unpack);
        for (int j = 0; j < 8; j++) halves(tile, rp, 16 + 16 * j, 192 + 2 * j, unpack);
        chunks(tile, rp, 144, 0, 32, unpack);
        chunks(tile, rp, 1168, 128, 16, unpack);
        return;
    }
}

/* Tiles [t0, t1), one type: tile-blocks in memory order, each from the 8 rows' blocks. */
AI void pack_tiles_of(int type, uint8_t *rowmajor, int rows, int cols, uint8_t *packed, int t0, int t1,
                      int unpack) {
    const int nb = cols / sx_block_elems(type);
    const size_t tb = tile_bytes(type), bsz = block_bytes(type), row_bytes = sx_row_bytes(type, cols);
    uint8_t pad[SX_TILE][256]; /* rows past the matrix: zero blocks (Q4_0's zero is nibble 8) */
    memset(pad, 0, sizeof pad);
    if (type == SX_Q4_0)
        for (int r = 0; r < SX_TILE; r++) memset(pad[r] + 2, 0x88, SX_QK / 2);
    for (int t = t0; t < t1; t++) {
        uint8_t *rp[SX_TILE];
        size_t step[SX_TILE];
        for (int r = 0; r < SX_TILE; r++) {
            const int live = t * SX_TILE + r < rows;
            rp[r] = live ? rowmajor + (size_t)(t * SX_TILE + r) * row_bytes : pad[r];
            step[r] = live ? bsz : 0;
        }
        uint8_t *tile = packed + (size_t)t * nb * tb;
        for (int b = 0; b < nb; b++, tile += tb) {
            tile_block(type, tile, rp, unpack);
            for (int r = 0; r < SX_TILE; r++) rp[r] += step[r];
        }
    }
}

static void pack_range(int type, uint8_t *rowmajor, int rows, int cols, uint8_t *packed, int t0, int t1,
                       int unpack) {
    if (type == SX_F32 || type == SX_F16) { /* row-major as stored: rows [8 t0, 8 t1) */
        const size_t rb = sx_row_bytes(type, cols);
        const int a = t0 * SX_TILE < rows ? t0 * SX_TILE : rows, z = t1 * SX_TILE < rows ? t1 * SX_TILE : rows;
        if (z > a) {
            if (unpack) memcpy(rowmajor + a * rb, packed + a * rb, (z - a) * rb);
            else memcpy(packed + a * rb, rowmajor + a * rb, (z - a) * rb);
        }
        return;
    }
#define CASE(T)                                                                                    \
    case T:                                                                                        \
        if (unpack) pack_tiles_of(T, rowmajor, rows, cols, packed, t0, t1, 1);                     \
        else pack_tiles_of(T, rowmajor, rows, cols, packed, t0, t1, 0);                            \
        return;
    switch (type) {
        CASE(SX_Q4_0) CASE(SX_Q8_0) CASE(SX_Q4_1) CASE(SX_Q4_K) CASE(SX_Q5_K) CASE(SX_Q6_K)
    }
#undef CASE
}

void sx_unpack(int type, const void *packed, int rows, int cols, void *rowmajor) {
    pack_range(type, (uint8_t *)rowmajor, rows, cols, (uint8_t *)packed, 0, (rows + SX_TILE - 1) / SX_TILE, 1);
}

void sx_pack_tiles(int type, const void *rowmajor, int rows, int cols, void *packed, int t0, int t1) {
    pack_range(type, (uint8_t *)rowmajor, rows, cols, (uint8_t *)packed, t0, t1, 0);
}
