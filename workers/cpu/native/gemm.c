/* Small-batch GEMM y[n, rows] = x[n, cols] @ W^T for F32, Q8_0 and Q4_0 weights.
 *
 * Quantized weights meet 8-bit activations in integer dot products, as fast CPU engines do.
 * The weights are packed in tiles of 8 rows (sx.h): a 256-bit chunk holds the same 4 quants of
 * all 8 rows, so one VPDPBUSD (maddubs + madd on plain AVX2) against a broadcast group of 4
 * activations adds 4 products to each row's sum; 8 of them give the 8 rows' exact block sums
 * in one vector, already in row order, which is scaled by the 8 rows' weight scales times the
 * activation scale in ONE fused multiply-add: no per-row float work, no horizontal sums.
 *
 * Zero points: Q4_0 nibbles (0..15) are used unsigned and the block sum starts from
 * -8 * sum(activations), precomputed per activation block (q4_zero_terms); Q8_0 weights are signed, so with VNNI the activations are made unsigned
 * (+128) and 128 * sum(weights) is subtracted (computed once per tile-block, reused for every
 * activation row); plain AVX2 uses the sign trick instead. Either way the integers are exact.
 *
 * Every output accumulates its blocks in the same order whatever the batch size, the tile
 * width or the thread count, so no sequence's logits depend on what else is in the batch. The
 * scalar build does the same integer sums and fused multiply-adds, one row at a time. */
#include "gemm.h"

#include <stdlib.h>

#include "simd.h"

#define MAXR 8
#define MAXC 4

/* ---- quantized tiles ------------------------------------------------------------------- */

#ifdef SX_AVX2
/* acc + per int32 lane the sum of 4 u8 x s8 products. */
static inline __m256i dot_us(__m256i acc, __m256i u, __m256i s) {
#ifdef SX_VNNI
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

static inline __m256i bcast4(const void *p) { /* 4 bytes into every int32 lane */
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

static inline __attribute__((always_inline)) void tile_q(int type, int C, const uint8_t *w, int nb,
                                                          const sx_act_block *a, const float *ad,
                                                          const int32_t *zq, float *out) {
    const size_t tb = type == SX_Q4_0 ? SX_Q4_TILE_BYTES : SX_Q8_TILE_BYTES;
    __m256 acc[MAXC];
    for (int c = 0; c < C; c++) acc[c] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += tb) {
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
        __m256i wq[8];
        __m256i base = _mm256_setzero_si256(); /* Q8_0: -128 * sum of each row's weights */
        if (type == SX_Q4_0) {
            for (int k = 0; k < 4; k++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * k));
                wq[k] = _mm256_and_si256(raw, _mm256_set1_epi8(0x0F));                         /* quants 4k.. */
                wq[k + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0F)); /* 16+4k.. */
            }
        } else {
            for (int j = 0; j < 8; j++) wq[j] = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * j));
#ifdef SX_VNNI
            __m256i ws = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) ws = dot_us(ws, _mm256_set1_epi8(1), wq[j]);
            base = _mm256_sub_epi32(base, _mm256_slli_epi32(ws, 7));
#endif
        }
        for (int c = 0; c < C; c++) {
            const sx_act_block *ab = a + (size_t)c * nb + b;
            __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
            if (type == SX_Q4_0) {
                /* Start from the zero point (one broadcast load, see q4_zero_terms). */
#ifdef SX_VNNI
                s0 = _mm256_set1_epi32(zq[(size_t)c * nb + b]);
                for (int k = 0; k < 4; k++) {
                    s0 = dot_us(s0, wq[k], bcast4(ab->qs + 4 * k));
                    s1 = dot_us(s1, wq[k + 4], bcast4(ab->qs + 16 + 4 * k));
                }
#else
                /* Each int16 lane ends at sum over its 16 quants of (w - 8) * a, at most
                 * 16 * 8 * 127 = 16256 in magnitude, and int16 adds wrap, so accumulating in
                 * int16 from the zero point is exact: one madd per block, no int32 add. */
                __m256i p16 = _mm256_set1_epi32(zq[(size_t)c * nb + b]);
                for (int k = 0; k < 4; k++) {
                    p16 = _mm256_add_epi16(p16, _mm256_maddubs_epi16(wq[k], bcast4(ab->qs + 4 * k)));
                    p16 = _mm256_add_epi16(p16, _mm256_maddubs_epi16(wq[k + 4], bcast4(ab->qs + 16 + 4 * k)));
                }
                s0 = _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
#endif
            } else {
                s0 = base;
                for (int j = 0; j < 8; j += 2) {
#ifdef SX_VNNI
                    s0 = dot_us(s0, bcast4(ab->qu + 4 * j), wq[j]);
                    s1 = dot_us(s1, bcast4(ab->qu + 4 * j + 4), wq[j + 1]);
#else
                    const __m256i a0 = bcast4(ab->qs + 4 * j), a1 = bcast4(ab->qs + 4 * j + 4);
                    s0 = dot_us(s0, _mm256_sign_epi8(wq[j], wq[j]), _mm256_sign_epi8(a0, wq[j]));
                    s1 = dot_us(s1, _mm256_sign_epi8(wq[j + 1], wq[j + 1]), _mm256_sign_epi8(a1, wq[j + 1]));
#endif
                }
            }
            /* lane r: row r's exact block sum */
#ifdef SX_VNNI
            const __m256i s = _mm256_add_epi32(s0, s1);
#else
            const __m256i s = type == SX_Q4_0 ? s0 : _mm256_add_epi32(s0, s1);
#endif
            const __m256 scale = _mm256_mul_ps(dw, _mm256_broadcast_ss(ad + (size_t)c * nb + b));
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[c]);
        }
    }
    for (int c = 0; c < C; c++) _mm256_storeu_ps(out + 8 * c, acc[c]);
}
#else
/* Scalar build (and aarch64, whose sdot does the 32-quant integer dot): the same integer block
 * sums and fused multiply-adds as above, one row at a time. */

/* One row of a tile-block as 32 signed quants (Q4_0 zero point removed); returns its scale. */
static inline float unpack_row(int type, const uint8_t *w, int r, int8_t *v) {
    const float d = sx_h2f(((const uint16_t *)w)[r]);
    for (int i = 0; i < (type == SX_Q4_0 ? SX_QK / 2 : SX_QK); i++) {
        const uint8_t q = w[16 + 32 * (i / 4) + 4 * r + i % 4];
        if (type == SX_Q4_0) {
            v[i] = (int8_t)((q & 0x0F) - 8);
            v[i + 16] = (int8_t)((q >> 4) - 8);
        } else {
            v[i] = (int8_t)q;
        }
    }
    return d;
}

static inline int dot32(const int8_t *w, const int8_t *a) {
#ifdef SX_NEON
    const int32x4_t z = vdupq_n_s32(0);
    return vaddvq_s32(vdotq_s32(vdotq_s32(z, vld1q_s8(w), vld1q_s8(a)), vld1q_s8(w + 16), vld1q_s8(a + 16)));
#else
    int s = 0;
    for (int i = 0; i < SX_QK; i++) s += w[i] * a[i];
    return s;
#endif
}

static inline __attribute__((always_inline)) void tile_q(int type, int C, const uint8_t *w, int nb,
                                                          const sx_act_block *a, const float *ad,
                                                          const int32_t *zq, float *out) {
    const size_t tb = type == SX_Q4_0 ? SX_Q4_TILE_BYTES : SX_Q8_TILE_BYTES;
    float acc[MAXC][SX_TILE] = {{0}};
    (void)zq; /* the scalar rows take the zero point off the weights instead */
    for (int b = 0; b < nb; b++, w += tb)
        for (int r = 0; r < SX_TILE; r++) {
            int8_t v[SX_QK];
            const float dw = unpack_row(type, w, r, v);
            for (int c = 0; c < C; c++) {
                const int s = dot32(v, a[(size_t)c * nb + b].qs);
                acc[c][r] = fmaf((float)s, dw * ad[(size_t)c * nb + b], acc[c][r]);
            }
        }
    for (int c = 0; c < C; c++)
        for (int r = 0; r < SX_TILE; r++) out[8 * c + r] = acc[c][r];
}
#endif

#define QSHAPES(X) X(1) X(2) X(4)
#define DEFQ(C)                                                                                \
    static void q4_c##C(const uint8_t *w, int nb, const sx_act_block *a, const float *ad,    \
                        const int32_t *as, float *out) { tile_q(SX_Q4_0, C, w, nb, a, ad, as, out); } \
    static void q8_c##C(const uint8_t *w, int nb, const sx_act_block *a, const float *ad,    \
                        const int32_t *as, float *out) { tile_q(SX_Q8_0, C, w, nb, a, ad, as, out); }
QSHAPES(DEFQ)
#undef DEFQ
typedef void (*qtile_fn)(const uint8_t *, int, const sx_act_block *, const float *, const int32_t *, float *);
static const qtile_fn Q4_TILES[] = {q4_c1, q4_c2, NULL, q4_c4};
static const qtile_fn Q8_TILES[] = {q8_c1, q8_c2, NULL, q8_c4};

static void gemm_rows_q(const sx_mat *w, int r0, int r1, int n, const sx_act *act, float *y, int ys, int nrc) {
    const int nb = w->cols / SX_QK;
    const size_t tb = w->type == SX_Q4_0 ? SX_Q4_TILE_BYTES : SX_Q8_TILE_BYTES;
    const qtile_fn *tiles = w->type == SX_Q4_0 ? Q4_TILES : Q8_TILES;
    const int cmax = (nrc == 1 || nrc == 2 || nrc == 4) ? nrc : MAXC;
    float out[MAXC * SX_TILE];
    for (int r = r0; r < r1; r += SX_TILE) {
        const uint8_t *wt = (const uint8_t *)w->data + (size_t)(r / SX_TILE) * nb * tb;
        const int live = r1 - r < SX_TILE ? r1 - r : SX_TILE;
        for (int c = 0; c < n;) {
            int C = 1;
            while (C * 2 <= cmax && C * 2 <= n - c) C *= 2;
            tiles[C - 1](wt, nb, act->blocks + (size_t)c * nb, act->scales + (size_t)c * nb,
                         act->zq + (size_t)c * nb, out);
            for (int j = 0; j < C; j++)
                for (int i = 0; i < live; i++)
                    y[(size_t)(c + j) * ys + r + i] = out[8 * j + i] + (w->bias ? w->bias[r + i] : 0.0f);
            c += C;
        }
    }
}

/* ---- float32 tiles --------------------------------------------------------------------- */

static inline __attribute__((always_inline)) void tile_f32(int R, int C, const float *w, int k,
                                                            const float *x, float *y, int ys) {
#ifdef SX_AVX2
    __m256 acc[MAXR][MAXC];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (int i = 0; i < k; i += 8)
        for (int r = 0; r < R; r++) {
            const __m256 wv = _mm256_loadu_ps(w + (size_t)r * k + i);
            for (int c = 0; c < C; c++)
                acc[r][c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (size_t)c * k + i), acc[r][c]);
        }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[(size_t)c * ys + r] = sx_hsum8(acc[r][c]);
#else
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[(size_t)c * ys + r] = sx_dot_f32(w + (size_t)r * k, x + (size_t)c * k, k);
#endif
}

#define FSHAPES(X) X(1, 1) X(1, 2) X(1, 4) X(2, 1) X(2, 2) X(2, 4) X(4, 1) X(4, 2) X(8, 1)
#define DEFF(R, C)                                                                      \
    static void f32_##R##x##C(const float *w, int k, const float *x, float *y, int ys) { \
        tile_f32(R, C, w, k, x, y, ys);                                                 \
    }
FSHAPES(DEFF)
#undef DEFF
#define PTR_F(R, C) f32_##R##x##C,
typedef void (*ftile_fn)(const float *, int, const float *, float *, int);
static const ftile_fn F32_TILES[] = {FSHAPES(PTR_F)};

static int f32_shape(int R, int C) {
    static const int rs[] = {1, 1, 1, 2, 2, 2, 4, 4, 8}, cs[] = {1, 2, 4, 1, 2, 4, 1, 2, 1};
    for (int i = 0; i < 9; i++)
        if (rs[i] == R && cs[i] == C) return i;
    return 0;
}

static void gemm_rows_f32(const sx_mat *w, int r0, int r1, int n, const float *x, float *y, int ys, int nrc) {
    const int k = w->cols;
    const int R0 = (nrc == 1 || nrc == 2 || nrc == 4 || nrc == 8) ? nrc : (n >= 4 ? 2 : 4);
    for (int r = r0; r < r1;) {
        int R = R0;
        while (R > r1 - r) R /= 2;
        const int cmax = R >= 8 ? 1 : (R >= 4 ? 2 : 4);
        for (int c = 0; c < n;) {
            int C = 1;
            while (C * 2 <= cmax && C * 2 <= n - c) C *= 2;
            F32_TILES[f32_shape(R, C)]((const float *)w->data + (size_t)r * k, k, x + (size_t)c * k,
                                       y + (size_t)c * ys + r, ys);
            c += C;
        }
        if (w->bias)
            for (int c = 0; c < n; c++)
                for (int i = r; i < r + R; i++) y[(size_t)c * ys + i] += w->bias[i];
        r += R;
    }
}

/* ---- drivers --------------------------------------------------------------------------- */

void sx_gemm_rows(const sx_mat *w, int r0, int r1, int n, const sx_act *act, float *y, int ys, int nrc) {
    if (w->type == SX_F32) gemm_rows_f32(w, r0, r1, n, act->x, y, ys, nrc);
    else gemm_rows_q(w, r0, r1, n, act, y, ys, nrc);
}

void sx_partition(int rows, int t, int nt, int *r0, int *r1) {
    const int groups = (rows + SX_PART - 1) / SX_PART;
    int a = (int)((int64_t)groups * t / nt) * SX_PART, b = (int)((int64_t)groups * (t + 1) / nt) * SX_PART;
    *r0 = a < rows ? a : rows;
    *r1 = b < rows ? b : rows;
}

/* Q4_0's zero point per activation block, -8 x the sum of its quants, in the form tile_q adds
 * it: one int32 (VNNI), or on plain AVX2 two int16 halves, -8 x the quants that land in the even
 * and in the odd int16 lanes of VPMADDUBSW (positions 0-1 and 2-3 of every group of 4), from
 * which the int16 accumulation starts. Computed once per activation row, used by every tile. */
static void q4_zero_terms(const sx_act_block *blocks, int count, int32_t *zq) {
    for (int i = 0; i < count; i++) {
#if defined(SX_AVX2) && !defined(SX_VNNI)
        int32_t even = 0, odd = 0;
        for (int j = 0; j < SX_QK; j++) *((j & 2) ? &odd : &even) += blocks[i].qs[j];
        zq[i] = (int32_t)((uint32_t)(uint16_t)(-8 * even) | ((uint32_t)(uint16_t)(-8 * odd) << 16));
#else
        zq[i] *= -8; /* it held the plain sum */
#endif
    }
}

void sx_act_prepare(const sx_mat *w, const float *x, int n, sx_act *act) {
    act->x = x;
    if (w->type == SX_F32) return;
    sx_quantize_act(x, n, w->cols, act->blocks, act->scales, act->zq);
    if (w->type == SX_Q4_0) q4_zero_terms(act->blocks, n * (w->cols / SX_QK), act->zq);
}

void sx_gemm(const sx_mat *w, int n, const float *x, float *y, int n_threads, int nrc) {
    const int nb = w->cols / SX_QK;
    sx_act act = {0};
    if (w->type != SX_F32) {
        act.blocks = (sx_act_block *)malloc((size_t)n * nb * sizeof(sx_act_block) + 32);
        act.scales = (float *)malloc((size_t)n * nb * sizeof(float) + 4);
        act.zq = (int32_t *)malloc((size_t)n * nb * sizeof(int32_t) + 4);
    }
    sx_act_prepare(w, x, n, &act);
#pragma omp parallel num_threads(n_threads < 1 ? 1 : n_threads)
    {
        int r0, r1;
        sx_partition(w->rows, sx_thread_num(), sx_num_threads(), &r0, &r1);
        sx_gemm_rows(w, r0, r1, n, &act, y, w->rows, nrc);
    }
    free(act.blocks);
    free(act.scales);
    free(act.zq);
}

void sx_pack(int type, const void *rowmajor, int rows, int cols, void *packed, int n_threads, int paired) {
    /* Each thread packs the tiles it computes (its sx_partition share), so they are first
     * touched by it. `paired`: the two halves [0, rows/2) and [rows/2, rows) split alike. */
    const int half = paired ? rows / 2 : rows;
#pragma omp parallel num_threads(n_threads < 1 ? 1 : n_threads)
    {
        int r0, r1;
        sx_partition(half, sx_thread_num(), sx_num_threads(), &r0, &r1);
        for (int h = 0; h < (paired ? 2 : 1); h++) {
            const int t0 = (h * half + r0) / SX_TILE, t1 = (h * half + r1 + SX_TILE - 1) / SX_TILE;
            sx_pack_tiles(type, rowmajor, rows, cols, packed, t0, t1);
        }
    }
}
