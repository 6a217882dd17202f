/* Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K rows on Intel AMX (Sapphire Rapids and later) for GEMMs of
 * 48 activation rows or more (SX_AMX_MIN_ROWS, gemm.h): prompt chunks, where the VNNI tiles
 * (gemm.c, tile16.c) are bound by arithmetic, not by the weights. The Q4_0 path is described
 * here; Q4_1 (unsigned quants, a min term) and Q8_0 (quants as stored) take the same one, the
 * K-quants their own at the end of the file (Q6_K: one TDPBSSD per 16-column half block).
 *
 * The packed Q4_0 tiles (sx.h) are already AMX's B layout: a 32-byte chunk holds 4 quant bytes
 * of each of 8 rows, so the low nibbles of the same chunk of two adjacent tiles are one 64-byte
 * row of a B tile (16 weight rows x 4 quants), the high nibbles another. Each 16-row pair of
 * tiles is unpacked once per call into a per-thread buffer as signed quants (nibble - 8: the
 * zero point is then in the integers, not added per activation row as the VNNI tiles add it).
 * TDPBSSD multiplies the activation quants (A: up to 16 activation rows x one 32-column block,
 * read in place from sx_act) by them: 16 x 16 exact block sums per instruction, what the VNNI
 * tile makes with 64 VPDPBUSDs. Each block sum then gets one multiply and one fused
 * multiply-add, with the same operands in the same order as tile16.c's tile_q4_x2: the results
 * are bit for bit those of the VNNI tiles, whatever the batch (tests/workers/cpu/test_amx.py).
 *
 * A 32-column block per instruction, not AMX's 64: Q4_0's scales change every 32 columns, so the
 * integer sums must be scaled block by block. That scaling (a tile store, then per activation
 * row a load, a convert, a multiply and an FMA) costs more than the TDPBSSD itself. */
#include "gemm.h"

#include <stdlib.h>

#ifdef SX_AMX
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define BLOCK_BUF 640 /* per block in the B buffer: 8 B-tile rows of 64 bytes, 16 scales, 16 mins */

static int amx_on; /* set by sx_amx_enable, before any step runs */

int sx_amx_enable(int on) {
    /* Linux (>= 5.16) hands out the 8 KiB of tile state only to a process that asks: without
     * the permission the first tile instruction raises SIGILL. It is process-wide. */
    amx_on = on && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return amx_on;
}

int sx_amx_active(void) { return amx_on; }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Tile registers (macros: the intrinsics paste the number into the instruction). Four blocks'
 * sums are made in four C tiles before the first is stored: a tile is not renamed, so with one
 * C tile each block's TDPBSSD waited for the previous block's store to have read it. */
#define T_C0 0
#define T_C1 1
#define T_C2 2
#define T_C3 3
#define T_A0 4
#define T_A1 5
#define T_B0 6
#define T_B1 7
#define GROUP 4 /* blocks per round of the C tiles */

/* Our tile shapes, loaded on every call where the thread's are not these. Not once per thread:
 * other code on the same threads uses the tiles too and leaves them released or shaped its
 * own way (PyTorch's oneDNN runs bf16 matmuls on AMX and ends with TILERELEASE; libgomp's pool
 * is shared), and a tile instruction on released tiles raises SIGILL (tests/workers/cpu/
 * test_amx.py). STTILECFG is cheap next to one call's work; LDTILECFG also zeroes the tiles. */
static uint8_t *thread_setup(size_t bytes, int a_cols) { /* the unpacked weights' buffer (B tiles, scales) */
    /* a_cols: the quants per activation row a TDPBSSD takes: 32 (a block), or Q6_K's 16 (a half
     * block, which has its own scale): its B tiles then have 4 rows, not 8 */
    tile_config want = {0}, now;
    want.palette = 1;
    for (int i = T_C0; i <= T_C3; i++) want.rows[i] = 16, want.colsb[i] = 64; /* 16 act rows x 16 sums */
    for (int i = T_A0; i <= T_A1; i++) want.rows[i] = 16, want.colsb[i] = a_cols; /* 16 act rows x quants */
    for (int i = T_B0; i <= T_B1; i++) want.rows[i] = a_cols / 4, want.colsb[i] = 64; /* (16 weight rows x 4) */
    _tile_storeconfig(&now);
    if (memcmp(&now, &want, sizeof want)) _tile_loadconfig(&want);
    return sx_thread_scratch(bytes);
}

/* Rows [r, r + 16) (two packed tiles, t and t + 1) of a Q4_0, Q4_1 or Q8_0 matrix -> the B
 * buffer: per block the 8 B-tile rows in the order of an sx_act_block's qs (Q4: chunk k's low
 * nibbles = quants 4k..4k+3 -> row k, its high nibbles = quants 16+4k.. -> row k + 4; Q4_0's
 * less 8, signed; Q4_1's unsigned. Q8_0: chunk k -> row k, as stored), the 16 rows' scales as
 * floats and Q4_1's mins. */
static void fill_b(int type, uint8_t *bbuf, const uint8_t *w, size_t tile, int nb, const uint8_t *next,
                   size_t next_len) {
    const size_t tb = sx_packed_bytes(type, SX_TILE, SX_QK);
    const int qo = type == SX_Q4_1 ? 32 : 16; /* the quants' offset in a tile-block */
    const __m512i m4 = _mm512_set1_epi8(0x0F), zero = _mm512_set1_epi8(type == SX_Q4_0 ? 8 : 0);
    const sx_pf pf = {next, nb ? (next_len + nb - 1) / nb : 0, next_len};
    for (int b = 0; b < nb; b++, w += tb) {
        prefetch_share(&pf, b); /* the next 16 rows, spread over this pass (it reads DRAM once) */
        uint8_t *dst = bbuf + (size_t)b * BLOCK_BUF;
        if (type == SX_Q8_0)
            for (int k = 0; k < 8; k++) _mm512_store_si512((__m512i *)(dst + 64 * k), ld2(w, tile, qo + 32 * k));
        else
            for (int k = 0; k < 4; k++) {
                const __m512i raw = ld2(w, tile, qo + 32 * k);
                _mm512_store_si512((__m512i *)(dst + 64 * k), _mm512_sub_epi8(_mm512_and_si512(raw, m4), zero));
                _mm512_store_si512((__m512i *)(dst + 64 * (k + 4)),
                                   _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(raw, 4), m4), zero));
            }
        _mm512_store_ps((float *)(dst + 512), ld2ph(w, tile, 0));
        if (type == SX_Q4_1) _mm512_store_ps((float *)(dst + 576), ld2ph(w, tile, 16));
    }
}

/* One block's sums (a tile stored at `sums`) into the 16 rows' accumulators, as tile_q4_x2 and
 * tile_q do: acc += s x (dw x ad), s the block's exact sum (Q4_0: with the zero point, which the
 * VNNI tiles add as zq; Q8_0: which they make with unsigned activations and a correction), then
 * Q4_1's acc += m x xsum. Rows past the batch compute garbage from the padding (gemm.h) and are
 * not stored. */
static inline __attribute__((always_inline)) void scale_block(int with_min, int nb, int b, const int32_t *sums,
                                                              const float *dws, const float *ad, const float *xs,
                                                              __m512 *acc) {
    const __m512 dw = _mm512_load_ps(dws), mw = with_min ? _mm512_load_ps(dws + 16) : dw;
#pragma GCC unroll 16
    for (int k = 0; k < 16; k++) {
        const __m512i s = _mm512_load_si512((const __m512i *)(sums + 16 * k));
        acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(ad[(size_t)k * nb + b])), acc[k]);
        if (with_min) acc[k] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[(size_t)k * nb + b]), acc[k]);
    }
}

#define BSRC(b) (bbuf + (size_t)((b) - b0) * BLOCK_BUF) /* the buffer holds blocks [b0, b1) */
#define BSCALES(b) ((const float *)(BSRC(b) + 512))
/* Block b's sums into tile C from tiles A (the activation quants at ASRC(b)) and B (the weights at
 * SRC(b)), multiplied by DP: TDPBSSD or TDPBSUD; rows past the batch read the padding. Needs a,
 * stride in scope. */
#define ABLK(b) (a[b].qs)                          /* a 32-column block's quants */
#define AHALF(h) (a[(h) / 2].qs + 16 * ((h) % 2)) /* Q6_K: half-block h's 16 */
#define DOT(C, A, B, b, ASRC, SRC, DP)                                                                                 \
    do {                                                                                                               \
        _tile_loadd(A, ASRC(b), stride);                                                                               \
        _tile_loadd(B, SRC(b), 64);                                                                                    \
        _tile_zero(C);                                                                                                 \
        DP(C, A, B);                                                                                                   \
    } while (0)
/* Blocks [b, b + 4) into the four C tiles, stored to out[0..3]. */
#define DOT_GROUP(b, ASRC, SRC, DP, out)                                                                               \
    do {                                                                                                               \
        DOT(T_C0, T_A0, T_B0, b, ASRC, SRC, DP);                                                                       \
        DOT(T_C1, T_A1, T_B1, (b) + 1, ASRC, SRC, DP);                                                                 \
        DOT(T_C2, T_A0, T_B0, (b) + 2, ASRC, SRC, DP);                                                                 \
        DOT(T_C3, T_A1, T_B1, (b) + 3, ASRC, SRC, DP);                                                                 \
        _tile_stored(T_C0, (out)[0], 64);                                                                              \
        _tile_stored(T_C1, (out)[1], 64);                                                                              \
        _tile_stored(T_C2, (out)[2], 64);                                                                              \
        _tile_stored(T_C3, (out)[3], 64);                                                                              \
    } while (0)

/* 16 activation rows from row c, blocks [b0, b1) (the buffer's): out[16 k + i] = row c + k,
 * weight row r + i, the blocks' terms added to what out holds where `cont` (blocks before b0,
 * sx_amx_span's K chunks: the same additions in the same order as in one pass).
 * Software-pipelined: the sums of blocks [b, b + 4) are stored while those of the 4 before are
 * scaled (a load right after the tile store it reads waits for that store to reach L1).
 *
 * Measured on a 2-core Sapphire Rapids class VM (1b gate/up, 16384 x 2048 at 128 rows, one
 * thread): this kernel 205-220 GMAC/s, the VNNI tiles 180-210. The tile work alone (no scaling)
 * and the scaling alone each take about half of the time: they add up instead of overlapping,
 * and the scaling, 3 vector operations per 16 sums, takes ~3.5 cycles per 16. Tried, no
 * faster: two activation x two weight groups per block (each tile load feeding two TDPBSSDs,
 * accumulators in memory) 195-200; the same scaling 4 blocks per accumulator load 188; the
 * scaling in 256-bit halves 170. */
static inline __attribute__((always_inline)) void rows_blocks(int type, const uint8_t *bbuf, int nb, int b0, int b1,
                                                              int cont, const sx_act *act, int c, float *out) {
    const size_t a0 = (size_t)c * nb;
    const sx_act_block *a = act->blocks + a0;
    const float *ad = act->scales + a0, *xs = act->xsum + a0;
    const long stride = (long)nb * (long)sizeof(sx_act_block);
    const int m = type == SX_Q4_1; /* Q4_1: unsigned quants (TDPBSUD) and a min term */
    int32_t sums[2][GROUP][16 * 16] __attribute__((aligned(64)));
    __m512 acc[16];
#pragma GCC unroll 16
    for (int k = 0; k < 16; k++) acc[k] = cont ? _mm512_loadu_ps(out + 16 * k) : _mm512_setzero_ps();
    int b = b0, cur = 0;
    for (; b + GROUP <= b1; b += GROUP, cur ^= 1) {
        if (m) DOT_GROUP(b, ABLK, BSRC, _tile_dpbsud, sums[cur]);
        else DOT_GROUP(b, ABLK, BSRC, _tile_dpbssd, sums[cur]);
        for (int j = 0; b > b0 && j < GROUP; j++)
            scale_block(m, nb, b - GROUP + j, sums[cur ^ 1][j], BSCALES(b - GROUP + j), ad, xs, acc);
    }
    for (int j = 0; b > b0 && j < GROUP; j++)
        scale_block(m, nb, b - GROUP + j, sums[cur ^ 1][j], BSCALES(b - GROUP + j), ad, xs, acc);
    for (; b < b1; b++) { /* the last (b1 - b0) % 4 blocks, in order after the groups */
        if (m) DOT(T_C0, T_A0, T_B0, b, ABLK, BSRC, _tile_dpbsud);
        else DOT(T_C0, T_A0, T_B0, b, ABLK, BSRC, _tile_dpbssd);
        _tile_stored(T_C0, sums[0][0], 64);
        scale_block(m, nb, b, sums[0][0], BSCALES(b), ad, xs, acc);
    }
#pragma GCC unroll 16
    for (int k = 0; k < 16; k++) _mm512_storeu_ps(out + 16 * k, acc[k]);
}

typedef void (*rows_fn)(const uint8_t *buf, int nb, int b0, int b1, int cont, const sx_act *act, int c, float *out);
static void rows_q4_0(const uint8_t *buf, int nb, int b0, int b1, int cont, const sx_act *act, int c, float *out) {
    rows_blocks(SX_Q4_0, buf, nb, b0, b1, cont, act, c, out);
}
static void rows_q4_1(const uint8_t *buf, int nb, int b0, int b1, int cont, const sx_act *act, int c, float *out) {
    rows_blocks(SX_Q4_1, buf, nb, b0, b1, cont, act, c, out);
}
static void rows_q8_0(const uint8_t *buf, int nb, int b0, int b1, int cont, const sx_act *act, int c, float *out) {
    rows_blocks(SX_Q8_0, buf, nb, b0, b1, cont, act, c, out);
}
static rows_fn block_rows(int type) { return type == SX_Q4_1 ? rows_q4_1 : type == SX_Q8_0 ? rows_q8_0 : rows_q4_0; }

/* ---- Q4_K and Q5_K ------------------------------------------------------------------------
 * The same scheme per 32-column sub-block: its B tile is the unsigned quants (no zero point:
 * the mins are their own term), TDPBSUD, then per activation row tile_qk_x2's product with the
 * 16 rows' sub-block scales, its multiply-add into the super-block's sum, and at each
 * super-block's end its mins term and the two multiply-adds into the row's accumulator, in
 * tile_qk_x2's order. The product is taken in float, not with tile_qk_x2's VPMULLD (two uops on
 * one port, as costly per 16 sums as the rest of the scaling): the sum is under 32 x 31 x 128
 * and the scale 6 bits, so the product is an integer under 2^23, exact in a float, and the
 * result the same bits. Per super-block the buffer holds the 8 sub-blocks' B tiles (4096 bytes),
 * their scales (512) and mins (512) as floats, d and -dmin (128). */
#define KSB_BUF 5248
#define KSRC(b) (buf + (size_t)((b) / 8) * KSB_BUF + 512 * ((b) % 8)) /* sub-block b's B tile */
#define KSC(b) ((const float *)(buf + (size_t)((b) / 8) * KSB_BUF + 4096 + 64 * ((b) % 8)))
#define KMN(sb, s) ((const float *)(buf + (size_t)(sb) * KSB_BUF + 4608 + 64 * (s)))
#define KD(sb) ((const float *)(buf + (size_t)(sb) * KSB_BUF + 5120))
#define KNDMIN(sb) ((const float *)(buf + (size_t)(sb) * KSB_BUF + 5184))

static void fill_k(int type, uint8_t *buf, const uint8_t *w, size_t tile, int nsb, const uint8_t *next,
                   size_t next_len) {
    const size_t tb = type == SX_Q4_K ? SX_Q4K_TILE_BYTES : SX_Q5K_TILE_BYTES;
    const __m512i m4 = _mm512_set1_epi8(0x0F), b4 = _mm512_set1_epi8(0x10);
    const sx_pf pf = {next, nsb ? (next_len + nsb - 1) / nsb : 0, next_len};
    for (int sb = 0; sb < nsb; sb++, w += tb) {
        prefetch_share(&pf, sb);
        uint8_t *dst = buf + (size_t)sb * KSB_BUF;
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) { /* unrolled: the shift counts become immediates */
            for (int k = 0; k < 8; k++) {
                const __m512i raw = ld2(w, tile, 160 + 256 * (s / 2) + 32 * k);
                __m512i q = _mm512_and_si512(s & 1 ? _mm512_srli_epi16(raw, 4) : raw, m4);
                if (type == SX_Q5_K) /* bit s of qh to bit 4 */
                    q = _mm512_or_si512(q, _mm512_and_si512(shift16z(ld2(w, tile, SX_Q4K_TILE_BYTES + 32 * k), 4 - s), b4));
                _mm512_store_si512((__m512i *)(dst + 512 * s + 64 * k), q);
            }
            _mm512_store_ps((float *)(dst + 4096 + 64 * s), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(ld2x8(w, tile, 32 + 8 * s))));
            _mm512_store_ps((float *)(dst + 4608 + 64 * s), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(ld2x8(w, tile, 96 + 8 * s))));
        }
        _mm512_store_ps((float *)(dst + 5120), ld2ph(w, tile, 0));
        _mm512_store_ps((float *)(dst + 5184), _mm512_sub_ps(_mm512_setzero_ps(), ld2ph(w, tile, 16)));
    }
}

/* 16 activation rows from row c, all super-blocks, pipelined as rows_blocks (groups of 4 sub-blocks
 * never straddle a super-block): out[16 k + i] = row c + k, weight row r + i. */
static void rows_k(const uint8_t *buf, int nb, const sx_act *act, int c, float *out) {
    const size_t a0 = (size_t)c * nb;
    const sx_act_block *a = act->blocks + a0;
    const float *ad = act->scales + a0, *xs = act->xsum + a0;
    const long stride = (long)nb * (long)sizeof(sx_act_block);
    int32_t sums[2][GROUP][16 * 16] __attribute__((aligned(64)));
    __m512 sd[16]; /* the super-block's sums */
#pragma GCC unroll 16
    for (int k = 0; k < 16; k++) sd[k] = _mm512_setzero_ps(), _mm512_storeu_ps(out + 16 * k, sd[k]);
    for (int b = 0, cur = 0; b <= nb; b += GROUP, cur ^= 1) {
        if (b < nb) DOT_GROUP(b, ABLK, KSRC, _tile_dpbsud, sums[cur]);
        if (b == 0) continue;
        const int p = b - GROUP; /* the previous group's first sub-block */
        for (int j = 0; j < GROUP; j++) {
            const __m512 sc = _mm512_load_ps(KSC(p + j));
#pragma GCC unroll 16
            for (int k = 0; k < 16; k++) {
                const __m512 I = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const __m512i *)(sums[cur ^ 1][j] + 16 * k))), sc);
                sd[k] = _mm512_fmadd_ps(I, _mm512_set1_ps(ad[(size_t)k * nb + p + j]), sd[k]);
            }
        }
        if ((p + GROUP) % 8) continue;
        const int sb = p / 8; /* its super-block is complete: the mins, then the accumulators */
        const __m512 d = _mm512_load_ps(KD(sb)), ndmin = _mm512_load_ps(KNDMIN(sb));
#pragma GCC unroll 16
        for (int k = 0; k < 16; k++) {
            __m512 sm = _mm512_setzero_ps();
            for (int s = 0; s < 8; s++) sm = _mm512_fmadd_ps(_mm512_load_ps(KMN(sb, s)), _mm512_set1_ps(xs[(size_t)k * nb + 8 * sb + s]), sm);
            const __m512 o = _mm512_loadu_ps(out + 16 * k);
            _mm512_storeu_ps(out + 16 * k, _mm512_fmadd_ps(ndmin, sm, _mm512_fmadd_ps(d, sd[k], o)));
            sd[k] = _mm512_setzero_ps();
        }
    }
}

/* ---- Q6_K ----------------------------------------------------------------------------------
 * Each 16-column half of a 32-column block has its own scale per weight row, so one TDPBSSD per
 * half (K = 16: A 16 activation rows x 16 quants, read in place at the half's offset; B 4 rows),
 * of the quants less 32, signed: the zero point is then in the integers, the same exact sums as
 * tile_q6k_x2's (which starts each half from hsum, -32 x the activation quants' sum). Then per
 * activation row, in tile_q6k_x2's order: I = s_lo x sc_lo + s_hi x sc_hi, the block's
 * multiply-add sd += I x ad, and per super-block acc += d x sd. I is taken in float (a multiply
 * and an FMA, not two VPMULLDs): |s| <= 16 x 32 x 128 = 2^16, so each product is an integer of
 * at most 2^23 and I of at most 2^24, all exact in a float: the same bits as the int32 I. Per
 * super-block the buffer holds the 16 halves' B tiles (4096 bytes), their scales as floats
 * (1024) and d (64). */
#define K6_BUF 5184
#define K6SRC(h) (buf + (size_t)((h) / 16) * K6_BUF + 256 * ((h) % 16)) /* half-block h = 2 b + half */
#define K6SC(h) ((const float *)(buf + (size_t)((h) / 16) * K6_BUF + 4096 + 64 * ((h) % 16)))
#define K6D(sb) ((const float *)(buf + (size_t)(sb) * K6_BUF + 5120))

static void fill_k6(uint8_t *buf, const uint8_t *w, size_t tile, int nsb, const uint8_t *next, size_t next_len) {
    const __m512i z = _mm512_set1_epi8(32);
    const sx_pf pf = {next, nsb ? (next_len + nsb - 1) / nsb : 0, next_len};
    for (int sb = 0; sb < nsb; sb++, w += SX_Q6K_TILE_BYTES) {
        prefetch_share(&pf, sb);
        uint8_t *dst = buf + (size_t)sb * K6_BUF;
#pragma GCC unroll 8
        for (int b = 0; b < 8; b++) { /* unrolled: the shift counts become immediates */
            for (int half = 0; half < 2; half++)
                for (int k = 0; k < 4; k++)
                    _mm512_store_si512((__m512i *)(dst + 256 * (2 * b + half) + 64 * k),
                                       _mm512_sub_epi8(q6k_quants(w, tile, b, half, k), z));
            __m512i sl, sh;
            q6k_scales(w, tile, b, &sl, &sh);
            _mm512_store_ps((float *)(dst + 4096 + 128 * b), _mm512_cvtepi32_ps(sl));
            _mm512_store_ps((float *)(dst + 4160 + 128 * b), _mm512_cvtepi32_ps(sh));
        }
        _mm512_store_ps((float *)(dst + 5120), ld2ph(w, tile, 0));
    }
}

/* 16 activation rows from row c, all super-blocks, pipelined as rows_k (a group of 4 halves is
 * 2 blocks and never straddles a super-block): out[16 k + i] = row c + k, weight row r + i. */
static void rows_k6(const uint8_t *buf, int nb, const sx_act *act, int c, float *out) {
    const size_t a0 = (size_t)c * nb;
    const sx_act_block *a = act->blocks + a0;
    const float *ad = act->scales + a0;
    const long stride = (long)nb * (long)sizeof(sx_act_block);
    int32_t sums[2][GROUP][16 * 16] __attribute__((aligned(64)));
    __m512 sd[16]; /* the super-block's sums */
#pragma GCC unroll 16
    for (int k = 0; k < 16; k++) sd[k] = _mm512_setzero_ps(), _mm512_storeu_ps(out + 16 * k, sd[k]);
    for (int h = 0, cur = 0; h <= 2 * nb; h += GROUP, cur ^= 1) {
        if (h < 2 * nb) DOT_GROUP(h, AHALF, K6SRC, _tile_dpbssd, sums[cur]);
        if (h == 0) continue;
        const int p = h - GROUP; /* the previous group's first half */
        for (int j = 0; j < GROUP; j += 2) {
            const __m512 sl = _mm512_load_ps(K6SC(p + j)), sh = _mm512_load_ps(K6SC(p + j + 1));
            const int b = (p + j) / 2;
#pragma GCC unroll 16
            for (int k = 0; k < 16; k++) {
                const __m512i lo = _mm512_load_si512((const __m512i *)(sums[cur ^ 1][j] + 16 * k));
                const __m512i hi = _mm512_load_si512((const __m512i *)(sums[cur ^ 1][j + 1] + 16 * k));
                const __m512 I = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), sh, _mm512_mul_ps(_mm512_cvtepi32_ps(lo), sl));
                sd[k] = _mm512_fmadd_ps(I, _mm512_set1_ps(ad[(size_t)k * nb + b]), sd[k]);
            }
        }
        if ((p + GROUP) % 16) continue;
        const __m512 d = _mm512_load_ps(K6D(p / 16)); /* its super-block is complete */
#pragma GCC unroll 16
        for (int k = 0; k < 16; k++) {
            _mm512_storeu_ps(out + 16 * k, _mm512_fmadd_ps(d, sd[k], _mm512_loadu_ps(out + 16 * k)));
            sd[k] = _mm512_setzero_ps();
        }
    }
}

int sx_amx_rows(const sx_mat *w, int r, int n, const sx_act *act, float *y, int ys, int y0) {
    const int nb = w->cols / SX_QK, kq = w->type == SX_Q4_K || w->type == SX_Q5_K, k6 = w->type == SX_Q6_K;
    uint8_t *buf = thread_setup(k6 ? (size_t)(nb / 8) * K6_BUF : kq ? (size_t)(nb / 8) * KSB_BUF : (size_t)nb * BLOCK_BUF,
                                k6 ? 16 : 32);
    if (!buf) return 0;
    const int n_tiles = (w->rows + SX_TILE - 1) / SX_TILE, t = r / SX_TILE;
    const size_t tile = sx_packed_bytes(w->type, SX_TILE, w->cols);
    const uint8_t *wt = (const uint8_t *)w->data + (size_t)t * tile;
    const int ahead = n_tiles - t - 2 < 2 ? n_tiles - t - 2 : 2; /* the next 16 rows' tiles */
    const uint8_t *next = ahead > 0 ? wt + 2 * tile : NULL;
    const size_t next_len = ahead > 0 ? (size_t)ahead * tile : 0;
    if (k6) fill_k6(buf, wt, tile, nb / 8, next, next_len);
    else if (kq) fill_k(w->type, buf, wt, tile, nb / 8, next, next_len);
    else fill_b(w->type, buf, wt, tile, nb, next, next_len);
    const rows_fn blk = block_rows(w->type);
    float out[16 * 16];
    for (int c = 0; c < n; c += 16) {
        if (k6) rows_k6(buf, nb, act, c, out);
        else if (kq) rows_k(buf, nb, act, c, out);
        else blk(buf, nb, 0, nb, 0, act, c, out);
        sx_store_rows(w, out, 16, r, 16, c, n - c < 16 ? n - c : 16, y, ys, y0);
    }
    return 1;
}

/* Q4_0, Q4_1 and Q8_0 rows [r0, r0 + 16 g) for all n activation rows, g the whole 16-row groups
 * of [r0, r1), where the activation blocks outgrow SX_AMX_ACT_L2: sx_amx_rows's loop reads all of
 * them again for every 16-row group, from L3 once they and the group's unpacked weights no longer
 * fit in L2 (a wide down projection at 100 rows: 1.7 MB of blocks and 327 KB of weights). Here
 * the columns go in chunks of kc blocks, outermost: every group's part of a chunk is unpacked and
 * multiplied by the chunk's activations, which stay in L2 across the groups, and each group keeps
 * its partial sums (16 x 16 floats per 16 activation rows) until the last chunk adds its terms,
 * in the order of one pass: the same bits. Returns the rows done (0: not this case, or no
 * buffer). */
int sx_amx_span(const sx_mat *w, int r0, int r1, int n, const sx_act *act, float *y, int ys, int y0) {
    const int nb = w->cols / SX_QK, groups = (r1 - r0) / (2 * SX_TILE), ncg = (n + 15) / 16;
    const size_t row_bytes = (size_t)nb * sizeof(sx_act_block);
    if (w->type == SX_Q4_K || w->type == SX_Q5_K || w->type == SX_Q6_K || groups < 2 ||
        (size_t)n * row_bytes <= SX_AMX_ACT_L2)
        return 0;
    int kc = (int)(SX_AMX_ACT_L2 / ((size_t)n * sizeof(sx_act_block))) & ~(GROUP - 1);
    if (kc < GROUP) kc = GROUP;
    const size_t bbytes = (size_t)kc * BLOCK_BUF, part_floats = (size_t)groups * ncg * 256;
    uint8_t *buf = thread_setup(bbytes + part_floats * sizeof(float), 32);
    if (!buf) return 0;
    float *part = (float *)(buf + bbytes);
    const size_t tile = sx_packed_bytes(w->type, SX_TILE, w->cols), tb = sx_packed_bytes(w->type, SX_TILE, SX_QK);
    const rows_fn blk = block_rows(w->type);
    for (int b0 = 0; b0 < nb; b0 += kc) {
        const int b1 = nb - b0 < kc ? nb : b0 + kc;
        for (int g = 0; g < groups; g++) {
            const uint8_t *wt = (const uint8_t *)w->data + (size_t)(r0 / SX_TILE + 2 * g) * tile + (size_t)b0 * tb;
            /* the next group's part of this chunk: its two tiles' runs (the second is one tile on) */
            const uint8_t *next = g + 1 < groups ? wt + 2 * tile : NULL;
            fill_b(w->type, buf, wt, tile, b1 - b0, next, next ? (size_t)(b1 - b0) * tb : 0);
            if (next)
                for (size_t o = 0; o < (size_t)(b1 - b0) * tb; o += 64) _mm_prefetch((const char *)next + tile + o, SX_PF_HINT);
            for (int c = 0; c < ncg; c++) blk(buf, nb, b0, b1, b0 > 0, act, 16 * c, part + ((size_t)g * ncg + c) * 256);
        }
    }
    for (int g = 0; g < groups; g++)
        for (int c = 0; c < ncg; c++)
            sx_store_rows(w, part + ((size_t)g * ncg + c) * 256, 16, r0 + 16 * g, 16, 16 * c, n - 16 * c < 16 ? n - 16 * c : 16, y, ys, y0);
    return 16 * groups;
}

#else
int sx_amx_enable(int on) {
    (void)on;
    return 0;
}

int sx_amx_active(void) { return 0; }
#endif
