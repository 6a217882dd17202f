/* Small-batch GEMM y[n, rows] = x[n, cols] @ W^T for F32, F16, Q8_0, Q4_0 and Q4_1 weights (the
 * K-quant tiles are in kquant.c), the drivers, the thread partition and packing's placement.
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
#define MAXC SX_MAXC
#define AI SX_AI
#define CHUNK SX_CHUNK

static __thread uint8_t *scratch;
static __thread size_t scratch_bytes;

uint8_t *sx_thread_scratch(size_t bytes) {
    if (scratch_bytes < bytes) {
        free(scratch);
        scratch = (uint8_t *)aligned_alloc(64, (bytes + 63) & ~(size_t)63);
        scratch_bytes = scratch ? bytes : 0;
    }
    return scratch;
}

/* ---- quantized tiles ------------------------------------------------------------------- */

#ifdef SX_AVX2
static size_t qtile_bytes(int type) {
    return type == SX_Q4_0 ? SX_Q4_TILE_BYTES : type == SX_Q4_1 ? SX_Q41_TILE_BYTES : SX_Q8_TILE_BYTES;
}

AI void tile_q(int type, int C, const uint8_t *w, int nb, const sx_act *act, size_t a0, float *out) {
    const size_t tb = qtile_bytes(type);
    const sx_act_block *a = act->blocks + a0;
    const float *ad = act->scales + a0, *xs = act->xsum + a0;
    const int32_t *zq = act->zq + a0;
    const int q4 = type == SX_Q4_0 || type == SX_Q4_1, qo = type == SX_Q4_1 ? 32 : 16;
    __m256 acc[MAXC];
    for (int c = 0; c < C; c++) acc[c] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += tb) {
        /* the first pass over a tile streams it from DRAM: prefetch SX_PF bytes ahead into L2
         * (gemm.h; no effect on results) */
        for (size_t o = 0; o < tb; o += 64) _mm_prefetch((const char *)w + SX_PF + o, SX_PF_HINT);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
        __m256 mw = _mm256_setzero_ps();
        if (type == SX_Q4_1) mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 16)));
        __m256i wq[8];
        __m256i base = _mm256_setzero_si256(); /* Q8_0: -128 * sum of each row's weights */
        if (q4) {
            for (int k = 0; k < 4; k++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(w + qo + 32 * k));
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
            if (q4) {
                /* Q4_0 starts from the zero point (one broadcast load, see q4_zero_terms). */
                const int32_t z = type == SX_Q4_0 ? zq[(size_t)c * nb + b] : 0;
#ifdef SX_VNNI
                s0 = _mm256_set1_epi32(z);
                for (int k = 0; k < 4; k++) {
                    s0 = dot_us(s0, wq[k], bcast4(ab->qs + 4 * k));
                    s1 = dot_us(s1, wq[k + 4], bcast4(ab->qs + 16 + 4 * k));
                }
#else
                /* Each int16 lane ends at sum over its 16 quants of (w - 8) * a (Q4_0, at most
                 * 16 * 8 * 127 = 16256 in magnitude, and int16 adds wrap, so accumulating in
                 * int16 from the zero point is exact) or of w * a (Q4_1: at most 30480): one
                 * madd per block, no int32 add. */
                __m256i p16 = _mm256_set1_epi32(z);
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
            const __m256i s = q4 ? s0 : _mm256_add_epi32(s0, s1);
#endif
            const __m256 scale = _mm256_mul_ps(dw, _mm256_broadcast_ss(ad + (size_t)c * nb + b));
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[c]);
            if (type == SX_Q4_1) acc[c] = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(xs + (size_t)c * nb + b), acc[c]);
        }
    }
    for (int c = 0; c < C; c++) _mm256_storeu_ps(out + 8 * c, acc[c]);
}
#else
/* Scalar build (and aarch64, whose sdot does the 32-quant integer dot): the same integer block
 * sums and fused multiply-adds as above, one row at a time. */
static size_t qtile_bytes(int type) {
    return type == SX_Q4_0 ? SX_Q4_TILE_BYTES : type == SX_Q4_1 ? SX_Q41_TILE_BYTES : SX_Q8_TILE_BYTES;
}

/* One row of a tile-block as 32 quants (Q4_0 zero point removed); returns its scale. */
static inline float unpack_row(int type, const uint8_t *w, int r, int8_t *v) {
    const float d = sx_h2f(((const uint16_t *)w)[r]);
    const int q4 = type == SX_Q4_0 || type == SX_Q4_1, z = type == SX_Q4_0 ? 8 : 0;
    for (int i = 0; i < (q4 ? SX_QK / 2 : SX_QK); i++) {
        const uint8_t q = w[(type == SX_Q4_1 ? 32 : 16) + CHUNK(i, r)];
        if (q4) {
            v[i] = (int8_t)((q & 0x0F) - z);
            v[i + 16] = (int8_t)((q >> 4) - z);
        } else {
            v[i] = (int8_t)q;
        }
    }
    return d;
}


AI void tile_q(int type, int C, const uint8_t *w, int nb, const sx_act *act, size_t a0, float *out) {
    const size_t tb = qtile_bytes(type);
    const sx_act_block *a = act->blocks + a0;
    const float *ad = act->scales + a0, *xs = act->xsum + a0;
    float acc[MAXC][SX_TILE] = {{0}};
    for (int b = 0; b < nb; b++, w += tb)
        for (int r = 0; r < SX_TILE; r++) {
            int8_t v[SX_QK];
            const float dw = unpack_row(type, w, r, v);
            const float mw = type == SX_Q4_1 ? sx_h2f(((const uint16_t *)w)[8 + r]) : 0.0f;
            for (int c = 0; c < C; c++) {
                const size_t i = (size_t)c * nb + b;
                acc[c][r] = fmaf((float)dot32(v, a[i].qs), dw * ad[i], acc[c][r]);
                if (type == SX_Q4_1) acc[c][r] = fmaf(mw, xs[i], acc[c][r]);
            }
        }
    for (int c = 0; c < C; c++)
        for (int r = 0; r < SX_TILE; r++) out[8 * c + r] = acc[c][r];
}
#endif

#define QSHAPES(X) X(1) X(2) X(4)
#define TILE_ARGS const uint8_t *w, int nb, const sx_act *a, size_t o, float *y
#define DEFQ(C)                                                                              \
    static void q4_c##C(TILE_ARGS) { tile_q(SX_Q4_0, C, w, nb, a, o, y); }                   \
    static void q41_c##C(TILE_ARGS) { tile_q(SX_Q4_1, C, w, nb, a, o, y); }                  \
    static void q8_c##C(TILE_ARGS) { tile_q(SX_Q8_0, C, w, nb, a, o, y); }
QSHAPES(DEFQ)
#undef DEFQ
static const sx_qtile_fn Q4_TILES[] = {q4_c1, q4_c2, NULL, q4_c4}, Q41_TILES[] = {q41_c1, q41_c2, NULL, q41_c4};
static const sx_qtile_fn Q8_TILES[] = {q8_c1, q8_c2, NULL, q8_c4};

static const sx_qtile_fn *qtiles(int type) {
    switch (type) {
    case SX_Q4_0: return Q4_TILES;
    case SX_Q4_1: return Q41_TILES;
    case SX_Q8_0: return Q8_TILES;
    default: return sx_ktiles(type);
    }
}

static void gemm_rows_q(const sx_mat *w, int r0, int r1, int n, const sx_act *act, float *y, int ys, int y0, int nrc) {
    const int nb = w->cols / SX_QK;
    const size_t tile = sx_packed_bytes(w->type, SX_TILE, w->cols); /* bytes per tile of 8 rows */
    const sx_qtile_fn *tiles = qtiles(w->type);
    int cmax = (nrc == 1 || nrc == 2 || nrc == 4) ? nrc : MAXC;
#ifdef SX_TILE16
    const int x2 = w->type == SX_Q4_0 || w->type == SX_Q4_K || w->type == SX_Q5_K || w->type == SX_Q6_K; /* tile16.c */
    /* 3-4 rows: two calls (2 + 2, 2 + 1) on the 16-row tile beat one call of 4 on tile_q
     * (tile16.c), and on a narrow matrix 4 rows in one call on the 16-row tile beat both (its
     * two tiles are one stream there: SX_X2_PF); 2 rows are bandwidth-bound either way */
    const int one_x2 = w->type == SX_Q4_0 && nrc == 0 && n == 4 && 2 * tile < SX_X2_PF;
    if (w->type == SX_Q4_0 && nrc == 0 && n > 2 && n <= 4 && !one_x2) cmax = 2;
    /* 8 rows and more: calls of 8 on the 16-row Q4_0 tile (one unpack of the weights feeds 64
     * VPDPBUSDs, not 32) */
    if (w->type == SX_Q4_0 && nrc == 0 && n >= 8) cmax = SX_X2_MAXC;
#endif
    int passes = 0; /* tile calls per tile */
    for (int c = 0; c < n; c += sx_group_rows(cmax, n - c)) passes++;
    float out[MAXC * SX_TILE];
    if (!tiles) return;
#ifdef SX_AMX
    const int amx_type = w->type == SX_Q4_0 || w->type == SX_Q4_1 || w->type == SX_Q8_0 || w->type == SX_Q4_K ||
                         w->type == SX_Q5_K || w->type == SX_Q6_K;
    const int amx = amx_type && nrc == 0 && n >= SX_AMX_MIN_ROWS && sx_amx_active();
#endif
    int r = r0;
#ifdef SX_AMX
    if (amx) r += sx_amx_span(w, r0, r1, n, act, y, ys, y0);
#endif
    while (r < r1) {
#ifdef SX_AMX
        if (amx && r + 2 * SX_TILE <= r1 && sx_amx_rows(w, r, n, act, y, ys, y0)) {
            r += 2 * SX_TILE;
            continue;
        }
#endif
#ifdef SX_TILE16
        if (x2 && (passes > 1 || one_x2 || cmax > MAXC) && r + 2 * SX_TILE <= r1) {
            sx_x2_rows(w, r, n, cmax, passes, act, y, ys, y0);
            r += 2 * SX_TILE;
            continue;
        }
#endif
        const uint8_t *wt = (const uint8_t *)w->data + (size_t)(r / SX_TILE) * tile;
        const int live = r1 - r < SX_TILE ? r1 - r : SX_TILE;
        for (int c = 0; c < n;) {
            const int C = sx_group_rows(cmax < MAXC ? cmax : MAXC, n - c); /* the 8-row tiles take 4 */
            tiles[C - 1](wt, nb, act, (size_t)c * nb, out);
            sx_store_rows(w, out, SX_TILE, r, live, c, C, y, ys, y0);
            c += C;
        }
        r += SX_TILE;
    }
}

/* ---- float32 / float16 tiles ------------------------------------------------------------ */

#ifdef SX_AVX2
AI __m256 load8(const void *w, int f16, size_t i) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)))
               : _mm256_loadu_ps((const float *)w + i);
}
#endif

/* F16 weights: the same fused multiply-adds as F32 on the converted (exact) values. */
AI void tile_f32(int f16, int R, int C, const void *w, int k, const float *x, float *y, int ys) {
#ifdef SX_AVX2
    __m256 acc[MAXR][MAXC];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (int i = 0; i < k; i += 8)
        for (int r = 0; r < R; r++) {
            const __m256 wv = load8(w, f16, (size_t)r * k + i);
            for (int c = 0; c < C; c++)
                acc[r][c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (size_t)c * k + i), acc[r][c]);
        }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[(size_t)c * ys + r] = sx_hsum8(acc[r][c]);
#else
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            if (!f16) {
                y[(size_t)c * ys + r] = sx_dot_f32((const float *)w + (size_t)r * k, x + (size_t)c * k, k);
                continue;
            }
            const uint16_t *wr = (const uint16_t *)w + (size_t)r * k;
            float l[8] = {0};
            for (int i = 0; i < k; i += 8)
                for (int j = 0; j < 8; j++) l[j] = fmaf(sx_h2f(wr[i + j]), x[(size_t)c * k + i + j], l[j]);
            y[(size_t)c * ys + r] = sx_hsum8_scalar(l);
        }
#endif
}

#define FSHAPES(X) X(1, 1) X(1, 2) X(1, 4) X(2, 1) X(2, 2) X(2, 4) X(4, 1) X(4, 2) X(8, 1)
#define DEFF(R, C)                                                                          \
    static void f32_##R##x##C(const void *w, int k, const float *x, float *y, int ys) {     \
        tile_f32(0, R, C, w, k, x, y, ys);                                                  \
    }                                                                                       \
    static void f16_##R##x##C(const void *w, int k, const float *x, float *y, int ys) {     \
        tile_f32(1, R, C, w, k, x, y, ys);                                                  \
    }
FSHAPES(DEFF)
#undef DEFF
#define PTR_F(R, C) f32_##R##x##C,
#define PTR_H(R, C) f16_##R##x##C,
typedef void (*ftile_fn)(const void *, int, const float *, float *, int);
static const ftile_fn F32_TILES[] = {FSHAPES(PTR_F)}, F16_TILES[] = {FSHAPES(PTR_H)};

static int f32_shape(int R, int C) {
    static const int rs[] = {1, 1, 1, 2, 2, 2, 4, 4, 8}, cs[] = {1, 2, 4, 1, 2, 4, 1, 2, 1};
    for (int i = 0; i < 9; i++)
        if (rs[i] == R && cs[i] == C) return i;
    return 0;
}

static void gemm_rows_f32(const sx_mat *w, int r0, int r1, int n, const float *x, float *y, int ys, int y0, int nrc) {
    const int k = w->cols, f16 = w->type == SX_F16;
    const ftile_fn *tiles = f16 ? F16_TILES : F32_TILES;
    const int R0 = (nrc == 1 || nrc == 2 || nrc == 4 || nrc == 8) ? nrc : (n >= 4 ? 2 : 4);
    for (int r = r0; r < r1;) {
        int R = R0;
        while (R > r1 - r) R /= 2;
        const int cmax = R >= 8 ? 1 : (R >= 4 ? 2 : 4);
        for (int c = 0; c < n;) {
            int C = 1;
            while (C * 2 <= cmax && C * 2 <= n - c) C *= 2;
            tiles[f32_shape(R, C)]((const char *)w->data + (size_t)r * k * (f16 ? 2 : 4), k, x + (size_t)c * k,
                                   y + (size_t)c * ys + r - y0, ys);
            c += C;
        }
        if (w->bias)
            for (int c = 0; c < n; c++)
                for (int i = r; i < r + R; i++) y[(size_t)c * ys + i - y0] += w->bias[i];
        r += R;
    }
}

/* ---- drivers --------------------------------------------------------------------------- */

void sx_gemm_rows(const sx_mat *w, int r0, int r1, int n, const sx_act *act, float *y, int ys, int nrc) {
    sx_gemm_rows_at(w, r0, r1, n, act, y, ys, 0, nrc);
}

void sx_gemm_rows_at(const sx_mat *w, int r0, int r1, int n, const sx_act *act, float *y, int ys, int y0, int nrc) {
    if (w->n_parts > 0) { /* a stack: each part computes its share of [r0, r1) */
        int off = 0;
        for (int p = 0; p < w->n_parts; p++) {
            const sx_mat *part = &w->parts[p];
            const int a = r0 > off ? r0 : off, b = r1 < off + part->rows ? r1 : off + part->rows;
            if (a < b) sx_gemm_rows_at(part, a - off, b - off, n, act, y, ys, y0 - off, nrc);
            off += part->rows;
        }
    } else if (w->type == SX_F32 || w->type == SX_F16) {
        gemm_rows_f32(w, r0, r1, n, act->x, y, ys, y0, nrc);
    } else {
        gemm_rows_q(w, r0, r1, n, act, y, ys, y0, nrc);
    }
}

void sx_partition_units(int rows, int unit, int t, int nt, int *r0, int *r1) {
    const int groups = (rows + unit - 1) / unit;
    int a = (int)((int64_t)groups * t / nt) * unit, b = (int)((int64_t)groups * (t + 1) / nt) * unit;
    *r0 = a < rows ? a : rows;
    *r1 = b < rows ? b : rows;
}

void sx_partition(int rows, int t, int nt, int *r0, int *r1) { sx_partition_units(rows, SX_PART, t, nt, r0, r1); }

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

static unsigned type_mask(const sx_mat *w) { /* bit t: a part of type t */
    if (w->n_parts <= 0) return w->type >= 0 && w->type < 32 ? 1u << w->type : 0;
    unsigned m = 0;
    for (int p = 0; p < w->n_parts; p++) m |= type_mask(&w->parts[p]);
    return m;
}

/* What every activation block needs for the part types in `m`: the int8 quants and scale, the
 * sum (Q4_1/Q4_K/Q5_K: times the scale), Q6_K's half sums, Q4_0's zero term; n rows of `cols`
 * columns, their blocks at act's arrays' start. */
static void prepare_blocks(unsigned m, const float *x, int n, int cols, sx_act *act) {
    const unsigned count = (unsigned)n * (cols / SX_QK);
    sx_quantize_act(x, n, cols, act->blocks, act->scales, act->zq);
    if (m & ((1u << SX_Q4_1) | (1u << SX_Q4_K) | (1u << SX_Q5_K)))
        for (unsigned i = 0; i < count; i++) act->xsum[i] = act->scales[i] * (float)act->zq[i];
    sx_kquant_act(m, (int)count, act);
    if (m & (1u << SX_Q4_0)) q4_zero_terms(act->blocks, (int)count, act->zq);
}

int sx_act_quantized(const sx_mat *w) { return (type_mask(w) & ~((1u << SX_F32) | (1u << SX_F16))) != 0; }

void sx_act_prepare(const sx_mat *w, const float *x, int n, sx_act *act) {
    act->x = x;
    if (sx_act_quantized(w)) prepare_blocks(type_mask(w), x, n, w->cols, act);
}

void sx_act_prepare_cols(const sx_mat *w, const float *x, int ldx, int r0, int n, int b0, int b1, sx_act *act) {
    if (!sx_act_quantized(w) || b1 <= b0) return;
    const unsigned m = type_mask(w);
    const int nb = w->cols / SX_QK;
    for (int r = 0; r < n; r++) { /* row r0 + r's blocks [b0, b1) are one run of the arrays */
        const size_t o = (size_t)(r0 + r) * nb + b0;
        sx_act view = {NULL, act->blocks + o, act->scales + o, act->zq + o, act->xsum + o, act->hsum + 2 * o};
        prepare_blocks(m, x + (size_t)r * ldx, 1, (b1 - b0) * SX_QK, &view);
    }
}

void sx_gemm(const sx_mat *w, int n, const float *x, float *y, int n_threads, int nrc) {
    const size_t nb = (size_t)n * (w->cols / SX_QK), nb_pad = (size_t)(n + SX_ACT_PAD_ROWS) * (w->cols / SX_QK);
    sx_act act = {0};
    act.blocks = (sx_act_block *)calloc(nb_pad, sizeof(sx_act_block));
    act.scales = (float *)calloc(nb_pad, sizeof(float));
    act.zq = (int32_t *)malloc(nb * sizeof(int32_t) + 4);
    act.xsum = (float *)calloc(nb_pad, sizeof(float));
    act.hsum = (int32_t *)malloc(2 * nb * sizeof(int32_t) + 8);
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
    free(act.xsum);
    free(act.hsum);
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
