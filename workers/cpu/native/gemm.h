/* Internal interface between the GEMM and the fused decode step. */
#ifndef SX_GEMM_H
#define SX_GEMM_H
#include "simd.h"
#include "sx.h"

#define SX_PART 8 /* rows per unit of the thread partition: one packed tile */
/* The tiles stream their weights from DRAM (the first pass over a tile; later activation-row
 * groups find it in cache) and prefetch them SX_PF bytes ahead into L2 (prefetcht1), not L1: an
 * L1 prefetch holds one of the core's ~24 L1 miss buffers until its line arrives, and at DRAM
 * latency that caps one core near 17 GB/s, while L2 keeps far more misses in flight. Measured
 * on a 2-core Zen 4 VM (tile harness, 2 threads, weights well over L3, alternating builds):
 * one activation row, vs L1 prefetches 4 KiB ahead: Q6_K 23-24 -> 33-40 GB/s, Q4_K 32-38 ->
 * 36-48, Q4_0 36-44 -> 36-53 (T1 and T2, both L2 here, alike); 4 and 16 rows, vs no prefetch:
 * Q4_0 60-63 -> 102-104 and 89-91 -> 116-119 GMAC/s per core. */
#ifndef SX_PF
#define SX_PF 8192
#endif
#ifndef SX_PF_HINT
#define SX_PF_HINT _MM_HINT_T1
#endif

#ifdef _OPENMP
#include <omp.h>
static inline int sx_thread_num(void) { return omp_get_thread_num(); }
static inline int sx_num_threads(void) { return omp_get_num_threads(); }
#else
static inline int sx_thread_num(void) { return 0; }
static inline int sx_num_threads(void) { return 1; }
#endif

/* Activations ready for one weight type: floats for F32, 8-bit blocks + scales otherwise. */
typedef struct {
    const float *x;
    sx_act_block *blocks;
    float *scales;
    int32_t *zq; /* per block: the quants' sum; Q4_0's zero-point term (in the form the tiles add
                    it) where the matrix has a Q4_0 part */
    float *xsum;   /* per block: scale x sum of the quants (Q4_1's m and the K-quants' mins) */
    int32_t *hsum; /* 2 per block: Q6_K's zero-point terms of quants 0-15, 16-31 (kquant.c) */
} sx_act;

/* Pack tiles [t0, t1) of a GGML row-major matrix (quant.c). */
void sx_pack_tiles(int type, const void *rowmajor, int rows, int cols, void *packed, int t0, int t1);
void sx_partition(int rows, int t, int nt, int *r0, int *r1);
/* Thread t's share [r0, r1) of `rows` split in whole `unit`s (sx_partition: units of SX_PART). */
void sx_partition_units(int rows, int unit, int t, int nt, int *r0, int *r1);
/* Quantize x for every part type of w; act's arrays hold n * cols / 32 entries. */
void sx_act_prepare(const sx_mat *w, const float *x, int n, sx_act *act);
/* sx_act_prepare for the 32-column blocks [b0, b1) of activation rows [r0, r0 + n) only, the
 * rest of act left as it was (act->x too): x holds row r0's columns from 32 b0 on, each next
 * row ldx floats further. The same per-block work, so a matrix's activations can be prepared
 * in column ranges by the threads that computed them. */
void sx_act_prepare_cols(const sx_mat *w, const float *x, int ldx, int r0, int n, int b0, int b1, sx_act *act);
/* Whether w has a quantized part (its activations are quantized; F32/F16 read act->x). */
int sx_act_quantized(const sx_mat *w);
/* Rows [r0, r1) of y (row stride ys) for all n activation rows. */
void sx_gemm_rows(const sx_mat *w, int r0, int r1, int n, const sx_act *act, float *y, int ys, int nrc);
/* The same, output row r (of w) at y[c ys + r - y0]: a window of the rows into a small buffer. */
void sx_gemm_rows_at(const sx_mat *w, int r0, int r1, int n, const sx_act *act, float *y, int ys, int y0, int nrc);
/* ---- shared by the tile code of gemm.c and kquant.c ------------------------------------- */

#define SX_MAXC 4 /* activation rows per tile call at most */
#define SX_AI static inline __attribute__((always_inline))
/* Chunked position of quant byte q (of a run of 32 per row) of row r in a tile-block. */
#define SX_CHUNK(q, r) (32 * ((q) / 4) + 4 * (r) + (q) % 4)

/* One tile of 8 rows x C activation rows (C = 1, 2, 4 by the table index C - 1): w the tile's
 * first block, nb 32-column blocks per row, activations from block a0, out[8 c + r]. */
typedef void (*sx_qtile_fn)(const uint8_t *w, int nb, const sx_act *act, size_t a0, float *out);
/* kquant.c: the tiles of Q4_K, Q5_K, Q6_K (NULL for another type) and their activation terms. */
const sx_qtile_fn *sx_ktiles(int type);
void sx_kquant_act(unsigned type_mask, int count, sx_act *act);

/* This thread's scratch buffer of at least `bytes` (64-byte aligned; grown, never shrunk), for
 * weights unpacked once per call and reused by every group of activation rows (amx.c, tile16.c:
 * one call fills it before any read, so they share it). NULL when it cannot grow. Fetch it once
 * per call: every use of a thread-local in -fPIC code is a call to __tls_get_addr. */
uint8_t *sx_thread_scratch(size_t bytes);

/* Activation rows of the next tile call over `left` rows: 1, 2 or 4, at most cmax. */
SX_AI int sx_group_rows(int cmax, int left) {
    int C = 1;
    while (C * 2 <= cmax && C * 2 <= left) C *= 2;
    return C;
}

/* A tile call's out[width k + i] (activation row c + k, weight row r + i < r + live) -> y at
 * column r + i - y0, plus the bias. */
SX_AI void sx_store_rows(const sx_mat *w, const float *out, int width, int r, int live, int c, int C, float *y, int ys,
                         int y0) {
    for (int k = 0; k < C; k++)
        for (int i = 0; i < live; i++)
            y[(size_t)(c + k) * ys + r - y0 + i] = out[width * k + i] + (w->bias ? w->bias[r + i] : 0.0f);
}

#if defined(SX_AVX2) && defined(SX_VNNI) && defined(__AVX512BW__)
#define SX_TILE16 1
/* tile16.c: Q4_0, Q4_K or Q6_K weight rows [r, r + 16) (two whole tiles) for all n activation
 * rows, in `passes` calls of up to cmax rows each. */
void sx_x2_rows(const sx_mat *w, int r, int n, int cmax, int passes, const sx_act *act, float *y, int ys, int y0);
/* How far ahead the calls prefetch, at least: the 16 rows SX_X2_PF bytes on. Rows of a wide
 * matrix are that far apart anyway (a Q4_0 row of 2048 columns: 16 rows are 18 KiB), but a
 * narrow one's next 16 rows are too close to arrive in time: a 576-column Q4_0 matrix (SmolLM2's
 * width) has 16 rows in 5 KiB, and 3-4 activation rows cost 1.3x one row there against 1.0-1.05x
 * at 2048 columns. Measured on a 2-core Zen 4 VM (16384 x 576 Q4_0 matrices, 160 MB, 2 threads,
 * alternating builds): 4 rows 6.7-6.8 -> 5.5-5.9 ms, 3 rows 6.6 -> 5.1-5.6 ms, 1 row (tile_q)
 * 5.4 ms either way; 8 KiB and 32 KiB alike; the padded SmolLM2's fused step (bench/
 * step_profile.py, 4 sequences) 21.9-22.3 -> 19.9-20.4 ms, 1 sequence unchanged. A narrow
 * matrix's two tiles are also one DRAM stream, so 4 rows there run as ONE call of 4 on the
 * 16-row tile (gemm.c): 16384 x 576 at 4 rows 5.3 -> 4.8 ms; the padded SmolLM2's step of 4
 * rows of one sequence (bench/spec_rows.py, four alternating runs) 23.5-24.8 -> 21.9-23.4 ms. */
#define SX_X2_PF 16384
/* Calls over one pair of K-quant tiles from which their quants are unpacked once into the
 * thread's scratch, not in every call (tile16.c) */
#ifndef SX_X2_UNPACK
#define SX_X2_UNPACK 8
#endif
/* Activation rows per call of the 16-row Q4_0 tile at most: 8 from batches of 8 on (tile16.c) */
#define SX_X2_MAXC 8

/* One call's share of the next tiles: `step` bytes per unit (a 32-column block; K-quants: a
 * super-block) from `next`, up to
 * `len` (next NULL: nothing, the last tiles of a matrix). */
typedef struct {
    const uint8_t *next;
    size_t step, len;
} sx_pf;

SX_AI void prefetch_share(const sx_pf *pf, int b) { /* the lines starting in [b step, (b + 1) step) */
    const size_t end = (size_t)(b + 1) * pf->step < pf->len ? (size_t)(b + 1) * pf->step : pf->len;
    for (size_t o = ((size_t)b * pf->step + 63) & ~(size_t)63; o < end; o += 64)
        _mm_prefetch((const char *)pf->next + o, SX_PF_HINT);
}

/* Two adjacent packed tiles side by side in one 512-bit register (tile16.c, amx.c). */
SX_AI __m512i ld2(const uint8_t *w, size_t tile, int off) { /* 32 bytes of each tile */
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(w + off))),
                              _mm256_loadu_si256((const __m256i *)(w + tile + off)), 1);
}

SX_AI __m128i ld2x8(const uint8_t *w, size_t tile, int off) { /* 8 bytes of each tile */
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(w + off)), _mm_loadl_epi64((const __m128i *)(w + tile + off)));
}

SX_AI __m512 ld2ph(const uint8_t *w, size_t tile, int off) { /* 8 fp16 of each tile */
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(w + off))),
                                                   _mm_loadu_si128((const __m128i *)(w + tile + off)), 1));
}

SX_AI __m512i shift16z(__m512i x, int left) { /* 16-bit lanes by `left` (< 0: right); a constant */
    return left > 0 ? _mm512_slli_epi16(x, left) : left < 0 ? _mm512_srli_epi16(x, -left) : x;
}

/* Q6_K over two tiles (sx.h's layout): quants 16 half + 4k .. + 3 of 32-column block b, as 0..63, of
 * the 16 rows (one 64-byte row of an AMX B tile); the block's int8 scales of its two 16-column
 * halves as int32 (tile16.c, amx.c). */
SX_AI __m512i q6k_quants(const uint8_t *w, size_t tile, int b, int half, int k) {
    const int h = b / 4, t = b % 4, g = 2 * h + t % 2, o = 32 * (4 * half + k);
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i ql = ld2(w, tile, 144 + 256 * g + o), qh = ld2(w, tile, 1168 + 256 * h + o);
    const __m512i nib = _mm512_and_si512(t < 2 ? ql : _mm512_srli_epi16(ql, 4), m4);
    return _mm512_or_si512(nib, _mm512_and_si512(shift16z(qh, 4 - 2 * t), m30));
}
SX_AI void q6k_scales(const uint8_t *w, size_t tile, int b, __m512i *sl, __m512i *sh) { /* block b's two halves */
    const __m512i sc16 = _mm512_cvtepi8_epi16(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(w + 16 + 16 * b))),
        _mm_loadu_si128((const __m128i *)(w + tile + 16 + 16 * b)), 1));
    *sl = _mm512_srai_epi32(_mm512_slli_epi32(sc16, 16), 16), *sh = _mm512_srai_epi32(sc16, 16);
}
#endif

/* Activation rows every sx_act's blocks, scales and xsum arrays hold beyond the rows in use: AMX
 * works on 16 activation rows at a time, in place (amx.c), and a last group of fewer rows reads
 * (and then drops) the rest. Every allocation of those arrays adds them. */
#define SX_ACT_PAD_ROWS 16

#if defined(SX_TILE16) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define SX_AMX 1
/* amx.c: rows [r, r + 16) (two whole tiles) of a Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or Q6_K matrix for all
 * n activation rows on AMX, the results bit for bit those of the VNNI tiles; 0 (nothing done) if the
 * thread's buffer could not be allocated. Only while sx_amx_active(), from SX_AMX_MIN_ROWS. */
int sx_amx_rows(const sx_mat *w, int r, int n, const sx_act *act, float *y, int ys, int y0);
/* amx.c: the whole 16-row groups of rows [r0, r1) of a Q4_0, Q4_1 or Q8_0 matrix in K chunks,
 * where n activation rows' blocks outgrow SX_AMX_ACT_L2; returns the rows done (0: the caller
 * goes on with sx_amx_rows per group). */
int sx_amx_span(const sx_mat *w, int r0, int r1, int n, const sx_act *act, float *y, int ys, int y0);
/* Bytes of activation blocks past which sx_amx_span chunks the columns: with a 16-row group's
 * unpacked weights they should stay in a core's L2 (2 MB on Sapphire Rapids). */
#ifndef SX_AMX_ACT_L2
#define SX_AMX_ACT_L2 (768 * 1024)
#endif
/* Activation rows from which those GEMMs run on AMX; below, the VNNI tiles. Measured on a
 * 2-core Sapphire Rapids class VM (bench/amx_rows.py gemm, 2 threads, AMX / VNNI): Q4_0 at 32
 * rows 0.84-1.07x, 48 rows 1.01-1.16x, 64 rows 1.02-1.19x (Q4_K 1.01-1.05x, 1.11-1.18x,
 * 1.17-1.20x); the fused step of a decode batch of 16 sequences 0.83x, of 32 0.96x: the
 * weights' unpacking per call needs enough activation rows to pay for it. */
#ifndef SX_AMX_MIN_ROWS
#define SX_AMX_MIN_ROWS 48
#endif
#endif

#ifdef SX_AVX2
/* acc + per int32 lane the sum of 4 u8 x s8 products. */
SX_AI __m256i dot_us(__m256i acc, __m256i u, __m256i s) {
#ifdef SX_VNNI
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

SX_AI __m256i bcast4(const void *p) { /* 4 bytes into every int32 lane */
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

#else
SX_AI int dot32(const int8_t *w, const int8_t *a) {
#ifdef SX_NEON
    const int32x4_t z = vdupq_n_s32(0);
    return vaddvq_s32(vdotq_s32(vdotq_s32(z, vld1q_s8(w), vld1q_s8(a)), vld1q_s8(w + 16), vld1q_s8(a + 16)));
#else
    int s = 0;
    for (int i = 0; i < SX_QK; i++) s += w[i] * a[i];
    return s;
#endif
}

SX_AI int dot16(const int8_t *w, const int8_t *a) {
    int s = 0;
    for (int i = 0; i < 16; i++) s += w[i] * a[i];
    return s;
}
#endif
#endif
