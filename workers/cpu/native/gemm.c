/* Small-batch GEMM y[n, rows] = x[n, cols] @ W^T for F32, Q8_0 and Q4_0 weights.
 *
 * Quantized weights meet 8-bit activations in integer dot products, as fast CPU engines do:
 * per 32-weight block, maddubs + madd give 8 int32 lanes, which are scaled by
 * d_weight * d_activation and accumulated in float. Q4_0 nibbles (0..15) are used unsigned
 * (maddubs wants one unsigned operand) and the -8 zero point is added back per lane from the
 * activation block's precomputed correction, so no sign trick is needed for them.
 *
 * A tile computes R weight rows x C activation rows; each weight block is unpacked once per
 * tile and reused for C columns. Every (row, column) accumulates its blocks in the same order
 * whatever the tile shape, so results do not depend on the batch size or the thread count.
 * Rows are split between threads in groups of SX_PART rows (any R divides it). */
#include "gemm.h"

#include <stdlib.h>

#include "simd.h"

#define MAXR 8
#define MAXC 4

#ifdef SX_AVX2
static inline __m256i unpack_q4(const uint8_t *qs) {
    const __m128i t = _mm_loadu_si128((const __m128i *)qs);
    const __m256i v = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}
#endif

static inline __attribute__((always_inline)) void tile_q(int type, int R, int C, const void *w,
                                                          int nb, const sx_act_block *a,
                                                          const float *ad, float *y, int ys) {
#ifdef SX_AVX2
    __m256 acc[MAXR][MAXC];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    (void)ones;
    for (int b = 0; b < nb; b++) {
        for (int r = 0; r < R; r++) {
            __m256i wq, wabs;
            float dw;
            if (type == SX_Q4_0) {
                const sx_block_q4_0 *blk = (const sx_block_q4_0 *)w + (size_t)r * nb + b;
                wq = unpack_q4(blk->qs);
                wabs = wq;
                dw = _cvtsh_ss(blk->d);
            } else {
                const sx_block_q8_0 *blk = (const sx_block_q8_0 *)w + (size_t)r * nb + b;
                wq = _mm256_loadu_si256((const __m256i *)blk->qs);
                wabs = _mm256_sign_epi8(wq, wq);
                dw = _cvtsh_ss(blk->d);
            }
            const __m256 vdw = _mm256_set1_ps(dw);
            for (int c = 0; c < C; c++) {
                const sx_act_block *ab = a + (size_t)c * nb + b;
                __m256i aq = _mm256_loadu_si256((const __m256i *)ab->qs);
                __m256i s;
#ifdef SX_VNNI
                /* One instruction for maddubs + madd (+ the Q4_0 correction as its addend). */
                if (type == SX_Q4_0)
                    s = _mm256_dpbusd_epi32(_mm256_loadu_si256((const __m256i *)ab->corr), wabs, aq);
                else
                    s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wabs, _mm256_sign_epi8(aq, wq));
#else
                if (type == SX_Q4_0) {
                    s = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, aq), ones);
                    s = _mm256_add_epi32(s, _mm256_loadu_si256((const __m256i *)ab->corr));
                } else {
                    s = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(aq, wq)), ones);
                }
#endif
                const __m256 scale = _mm256_mul_ps(vdw, _mm256_broadcast_ss(ad + (size_t)c * nb + b));
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[(size_t)c * ys + r] = sx_hsum8(acc[r][c]);
#else
    float acc[MAXR][MAXC][8];
    memset(acc, 0, sizeof(acc));
    for (int b = 0; b < nb; b++) {
        for (int r = 0; r < R; r++) {
            int wv[SX_QK];
            float dw;
            if (type == SX_Q4_0) {
                const sx_block_q4_0 *blk = (const sx_block_q4_0 *)w + (size_t)r * nb + b;
                for (int j = 0; j < SX_QK / 2; j++) {
                    wv[j] = (blk->qs[j] & 0x0F) - 8;
                    wv[j + SX_QK / 2] = (blk->qs[j] >> 4) - 8;
                }
                dw = sx_h2f(blk->d);
            } else {
                const sx_block_q8_0 *blk = (const sx_block_q8_0 *)w + (size_t)r * nb + b;
                for (int j = 0; j < SX_QK; j++) wv[j] = blk->qs[j];
                dw = sx_h2f(blk->d);
            }
            for (int c = 0; c < C; c++) {
                const sx_act_block *ab = a + (size_t)c * nb + b;
                const float scale = dw * ad[(size_t)c * nb + b];
                for (int l = 0; l < 8; l++) {
                    int s = 0;
                    for (int j = 0; j < 4; j++) s += wv[4 * l + j] * ab->qs[4 * l + j];
                    acc[r][c][l] = fmaf((float)s, scale, acc[r][c][l]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[(size_t)c * ys + r] = sx_hsum8_scalar(acc[r][c]);
#endif
}

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

/* Instantiate every tile shape with constant R and C, so loops unroll and accumulators stay
 * in registers. */
#define SHAPES(X) X(1, 1) X(1, 2) X(1, 4) X(2, 1) X(2, 2) X(2, 4) X(4, 1) X(4, 2) X(8, 1)
#define DEF(R, C)                                                                             \
    static void q4_##R##x##C(const void *w, int nb, const sx_act_block *a, const float *ad,  \
                             float *y, int ys) { tile_q(SX_Q4_0, R, C, w, nb, a, ad, y, ys); } \
    static void q8_##R##x##C(const void *w, int nb, const sx_act_block *a, const float *ad,  \
                             float *y, int ys) { tile_q(SX_Q8_0, R, C, w, nb, a, ad, y, ys); } \
    static void f32_##R##x##C(const float *w, int k, const float *x, float *y, int ys) {       \
        tile_f32(R, C, w, k, x, y, ys);                                                       \
    }
SHAPES(DEF)
#undef DEF

typedef void (*qtile_fn)(const void *, int, const sx_act_block *, const float *, float *, int);
typedef void (*ftile_fn)(const float *, int, const float *, float *, int);

static int shape_index(int R, int C) {
    static const int rs[] = {1, 1, 1, 2, 2, 2, 4, 4, 8}, cs[] = {1, 2, 4, 1, 2, 4, 1, 2, 1};
    for (int i = 0; i < 9; i++)
        if (rs[i] == R && cs[i] == C) return i;
    return 0;
}
#define PTR_Q4(R, C) q4_##R##x##C,
#define PTR_Q8(R, C) q8_##R##x##C,
#define PTR_F(R, C) f32_##R##x##C,
static const qtile_fn Q4_TILES[] = {SHAPES(PTR_Q4)};
static const qtile_fn Q8_TILES[] = {SHAPES(PTR_Q8)};
static const ftile_fn F32_TILES[] = {SHAPES(PTR_F)};

/* The widest supported C for R, and the R to use for a batch of n (nrc = user's choice). */
static int cols_for(int R, int n) {
    int cmax = R >= 8 ? 1 : (R >= 4 ? 2 : 4);
    int c = 1;
    while (c * 2 <= cmax && c * 2 <= n) c *= 2;
    return c;
}

int sx_tile_rows(int nrc, int n) {
    if (nrc == 1 || nrc == 2 || nrc == 4 || nrc == 8) return nrc;
    return n >= 4 ? 2 : 4;
}

void sx_gemm_rows(const sx_mat *w, int r0, int r1, int n, const sx_act *act, float *y, int ys,
                  int nrc) {
    const int k = w->cols, nb = k / SX_QK;
    const int R0 = sx_tile_rows(nrc, n);
    for (int r = r0; r < r1;) {
        int R = R0;
        while (R > r1 - r) R /= 2;
        for (int c = 0; c < n;) {
            int C = cols_for(R, n - c);
            const int idx = shape_index(R, C);
            float *yt = y + (size_t)c * ys + r;
            if (w->type == SX_F32) {
                F32_TILES[idx]((const float *)w->data + (size_t)r * k, k, act->x + (size_t)c * k, yt, ys);
            } else {
                const size_t bsz = w->type == SX_Q4_0 ? sizeof(sx_block_q4_0) : sizeof(sx_block_q8_0);
                const void *wr = (const char *)w->data + (size_t)r * nb * bsz;
                const qtile_fn *tiles = w->type == SX_Q4_0 ? Q4_TILES : Q8_TILES;
                tiles[idx](wr, nb, act->blocks + (size_t)c * nb, act->scales + (size_t)c * nb, yt, ys);
            }
            c += C;
        }
        if (w->bias)
            for (int c = 0; c < n; c++)
                for (int i = r; i < r + R; i++) y[(size_t)c * ys + i] += w->bias[i];
        r += R;
    }
}

void sx_partition(int rows, int t, int nt, int *r0, int *r1) {
    const int groups = (rows + SX_PART - 1) / SX_PART;
    int a = (int)((int64_t)groups * t / nt) * SX_PART, b = (int)((int64_t)groups * (t + 1) / nt) * SX_PART;
    *r0 = a < rows ? a : rows;
    *r1 = b < rows ? b : rows;
}

void sx_act_prepare(const sx_mat *w, const float *x, int n, sx_act *act) {
    act->x = x;
    if (w->type != SX_F32) sx_quantize_act(x, n, w->cols, act->blocks, act->scales);
}

void sx_gemm(const sx_mat *w, int n, const float *x, float *y, int n_threads, int nrc) {
    const int nb = w->cols / SX_QK;
    sx_act act = {0};
    if (w->type != SX_F32) {
        act.blocks = (sx_act_block *)aligned_alloc(64, (size_t)n * nb * sizeof(sx_act_block) + 64);
        act.scales = (float *)malloc((size_t)n * nb * sizeof(float) + 4);
    }
    sx_act_prepare(w, x, n, &act);
    if (n_threads < 1) n_threads = 1;
#pragma omp parallel num_threads(n_threads)
    {
        int r0, r1;
        sx_partition(w->rows, sx_thread_num(), sx_num_threads(), &r0, &r1);
        sx_gemm_rows(w, r0, r1, n, &act, y, w->rows, nrc);
    }
    free(act.blocks);
    free(act.scales);
}

void sx_place(const sx_mat *w, void *dst, int n_threads, int nrc, int paired) {
    (void)nrc; /* the partition is in groups of SX_PART rows whatever the tile */
    const size_t row_bytes = w->type == SX_F32   ? (size_t)w->cols * 4
                             : w->type == SX_Q4_0 ? (size_t)w->cols / SX_QK * sizeof(sx_block_q4_0)
                                                  : (size_t)w->cols / SX_QK * sizeof(sx_block_q8_0);
    const int rows = paired ? w->rows / 2 : w->rows;
#pragma omp parallel num_threads(n_threads < 1 ? 1 : n_threads)
    {
        int r0, r1;
        sx_partition(rows, sx_thread_num(), sx_num_threads(), &r0, &r1);
        for (int half = 0; half < (paired ? 2 : 1); half++) {
            const size_t off = ((size_t)half * rows + r0) * row_bytes;
            memcpy((char *)dst + off, (const char *)w->data + off, (size_t)(r1 - r0) * row_bytes);
        }
    }
}
