/* The 16-row tiles of AVX-512 VNNI machines (Q4_0, Q4_K, Q5_K, Q6_K) and their driver: gemm.c calls
 * it where a batch makes several passes over a tile; everything else runs the 8-row tiles of
 * gemm.c and kquant.c. */
#include "gemm.h"

#ifdef SX_TILE16

/* Two adjacent Q4_0 tiles (16 rows) in 512-bit vectors: lanes 0-7 are tile w's rows, 8-15 tile
 * w + tile's, each computed exactly as tile_q computes it (the same integer sums, multiply and
 * fused multiply-add), so results do not depend on which tile ran. One 4-byte activation group
 * feeds 16 rows instead of 8, as an embedded broadcast of VPDPBUSD (one micro-fused load; GCC
 * does not fold a set1 into it), and all C rows' chains run side by side.
 *
 * It serves tiles that several calls cover (one call per group of activation rows: batches
 * over 4, and 3-4 rows as two calls of 2), the later calls finding the tiles in cache. The
 * first call alone would then read DRAM, in bursts (~25 GB/s from one core, then nothing), so
 * instead every call prefetches its share of the NEXT two tiles (sx_pf), which keeps the
 * stream steady. As the one call over its tiles it reads two DRAM streams and was 25-30%
 * slower than tile_q on Zen 4 (batch 1 and 4), so it is not used that way, but on narrow
 * matrices at 4 rows (gemm.h, SX_X2_PF: there the two tiles are one stream). Measured on a
 * 2-core Zen 4 VM (Q4_0 8192 x 2048 matrices well over L3, 2 threads, GMAC/s per core of a
 * 225-233 VPDPBUSD peak): batch 16 tile_q 111-118 (the spread prefetch alone: no change),
 * this tile with in-stream prefetch 132-142, with the spread prefetch 155-165; batch 8
 * 108-112 -> 136-162; batch 4 100-103 (tile_q, one call) -> 108-123 (two calls of 2). */

SX_AI __m512i dot_bcast4(__m512i acc, __m512i u, const void *s) { /* acc + u (u8) x 4 bytes at s (s8) */
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)s));
    return acc;
}

SX_AI void tile_q4_x2(int C, const uint8_t *w, size_t tile, int nb, const sx_act *act, size_t a0, float *out,
                      const sx_pf *pf) {
    const sx_act_block *a = act->blocks + a0;
    const float *ad = act->scales + a0;
    const int32_t *zq = act->zq + a0;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 acc[SX_X2_MAXC];
    for (int c = 0; c < C; c++) acc[c] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++, w += SX_Q4_TILE_BYTES) {
        prefetch_share(pf, b);
        const __m512 dw = ld2ph(w, tile, 0);
        __m512i wq[8];
        for (int k = 0; k < 4; k++) {
            const __m512i raw = ld2(w, tile, 16 + 32 * k);
            wq[k] = _mm512_and_si512(raw, m4);
            wq[k + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
        }
        /* all C rows' chains side by side: 2C independent VPDPBUSD chains in flight (C = 8:
         * one per row, 8 being enough to hide its latency, and two would not fit the 32
         * registers); the integer sums are exact either way */
        __m512i s0[SX_X2_MAXC], s1[SX_X2_MAXC];
        for (int c = 0; c < C; c++) {
            s0[c] = _mm512_set1_epi32(zq[(size_t)c * nb + b]);
            s1[c] = _mm512_setzero_si512();
        }
        for (int k = 0; k < 4; k++)
            for (int c = 0; c < C; c++) {
                const sx_act_block *ab = a + (size_t)c * nb + b;
                s0[c] = dot_bcast4(s0[c], wq[k], ab->qs + 4 * k);
                if (C < 8) s1[c] = dot_bcast4(s1[c], wq[k + 4], ab->qs + 16 + 4 * k);
            }
        if (C >= 8)
            for (int k = 0; k < 4; k++)
                for (int c = 0; c < C; c++) s0[c] = dot_bcast4(s0[c], wq[k + 4], a[(size_t)c * nb + b].qs + 16 + 4 * k);
        for (int c = 0; c < C; c++) {
            const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(ad[(size_t)c * nb + b]));
            const __m512i s = C < 8 ? _mm512_add_epi32(s0[c], s1[c]) : s0[c];
            acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[c]);
        }
    }
    for (int c = 0; c < C; c++) _mm512_storeu_ps(out + 16 * c, acc[c]);
}

/* Q4_K and Q5_K over two tiles: kquant.c's tile_k (VNNI) in 16 lanes, the same integer sums
 * (Q5_K: bit s of qh as bit 4 of sub-block s's quants), scale products and fused multiply-adds
 * in the same order per row. The scale product is taken in float, not with tile_k's VPMULLD
 * (two uops on one port on Intel): a sub-block's sum is under 32 x 31 x 128 and the scale has 6
 * bits, so the product is an integer under 2^23, exact in a float, the same value tile_k
 * converts (amx.c does the same).
 *
 * Unpacking the quants (a shift, an AND, Q5_K's fifth bit) costs as much as a third of the
 * VPDPBUSDs they feed at 4 activation rows a call, and a batch of n rows makes n / 4 calls over
 * the same tiles. So where there are several calls, the two tiles are unpacked ONCE into this
 * thread's scratch (qk_unpack: per super-block the 64 quant vectors, the 8 sub-block scales,
 * the 8 mins as floats, d and -dmin) and every call reads the vectors from there (pre != NULL):
 * the same values, so the same sums and results. */
#define QK_VECS 82 /* vectors per super-block in the scratch: 64 quants, 8 scales, 8 mins, d, -dmin */

SX_AI __m512i qk_quants(int type, const uint8_t *w, size_t tile, int s, int k) { /* sub-block s, chunk k */
    const __m512i m4 = _mm512_set1_epi8(0x0F), b4 = _mm512_set1_epi8(0x10);
    const __m512i raw = ld2(w, tile, 160 + 256 * (s / 2) + 32 * k);
    __m512i q = _mm512_and_si512(s & 1 ? _mm512_srli_epi16(raw, 4) : raw, m4);
    if (type == SX_Q5_K) {
        const __m512i qh = ld2(w, tile, SX_Q4K_TILE_BYTES + 32 * k);
        q = _mm512_or_si512(q, _mm512_and_si512(shift16z(qh, 4 - s), b4));
    }
    return q;
}
SX_AI __m512 qk_scales(const uint8_t *w, size_t tile, int s) { /* as floats: see tile_qk_x2 */
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(ld2x8(w, tile, 32 + 8 * s)));
}
SX_AI __m512 qk_mins(const uint8_t *w, size_t tile, int s) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(ld2x8(w, tile, 96 + 8 * s)));
}
SX_AI __m512 qk_ndmin(const uint8_t *w, size_t tile) { return _mm512_sub_ps(_mm512_setzero_ps(), ld2ph(w, tile, 16)); }

static void qk_unpack(int type, const uint8_t *w, size_t tile, int nsb, __m512i *buf, const sx_pf *pf) {
    const size_t tb = type == SX_Q4_K ? SX_Q4K_TILE_BYTES : SX_Q5K_TILE_BYTES;
    for (int sb = 0; sb < nsb; sb++, w += tb, buf += QK_VECS) {
        prefetch_share(pf, sb);
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) {
            for (int k = 0; k < 8; k++) _mm512_store_si512(buf + 8 * s + k, qk_quants(type, w, tile, s, k));
            _mm512_store_ps(buf + 64 + s, qk_scales(w, tile, s));
            _mm512_store_ps(buf + 72 + s, qk_mins(w, tile, s));
        }
        _mm512_store_ps(buf + 80, ld2ph(w, tile, 0));
        _mm512_store_ps(buf + 81, qk_ndmin(w, tile));
    }
}

SX_AI void tile_qk_x2(int type, int C, const uint8_t *w, size_t tile, const __m512i *pre, int nb, const sx_act *act,
                      size_t a0, float *out, const sx_pf *pf) {
    const size_t tb = type == SX_Q4_K ? SX_Q4K_TILE_BYTES : SX_Q5K_TILE_BYTES;
    const sx_act_block *a = act->blocks + a0;
    const float *ad = act->scales + a0, *xs = act->xsum + a0;
    __m512 acc[SX_MAXC];
    for (int c = 0; c < C; c++) acc[c] = _mm512_setzero_ps();
    for (int sb = 0; sb < nb / 8; sb++, w += tb) {
        const __m512i *p = pre ? pre + (size_t)sb * QK_VECS : NULL;
        prefetch_share(pf, sb);
        __m512 sd[SX_MAXC], sm[SX_MAXC];
        for (int c = 0; c < C; c++) sd[c] = sm[c] = _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) { /* unrolled: the shift becomes an immediate or goes */
            __m512i q[8];
            for (int k = 0; k < 8; k++) q[k] = p ? _mm512_load_si512(p + 8 * s + k) : qk_quants(type, w, tile, s, k);
            const __m512 sc = p ? _mm512_load_ps(p + 64 + s) : qk_scales(w, tile, s);
            __m512i s0[SX_MAXC], s1[SX_MAXC];
            for (int c = 0; c < C; c++) s0[c] = s1[c] = _mm512_setzero_si512();
            for (int k = 0; k < 8; k += 2)
                for (int c = 0; c < C; c++) {
                    const sx_act_block *x = a + (size_t)c * nb + 8 * sb + s;
                    s0[c] = dot_bcast4(s0[c], q[k], x->qs + 4 * k);
                    s1[c] = dot_bcast4(s1[c], q[k + 1], x->qs + 4 * k + 4);
                }
            for (int c = 0; c < C; c++) {
                const __m512 I = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0[c], s1[c])), sc);
                sd[c] = _mm512_fmadd_ps(I, _mm512_set1_ps(ad[(size_t)c * nb + 8 * sb + s]), sd[c]);
            }
        }
        for (int s = 0; s < 8; s++) { /* the mins, each converted once for all C rows */
            const __m512 mn = p ? _mm512_load_ps(p + 72 + s) : qk_mins(w, tile, s);
            for (int c = 0; c < C; c++) sm[c] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[(size_t)c * nb + 8 * sb + s]), sm[c]);
        }
        const __m512 d = p ? _mm512_load_ps(p + 80) : ld2ph(w, tile, 0), ndmin = p ? _mm512_load_ps(p + 81) : qk_ndmin(w, tile);
        for (int c = 0; c < C; c++) acc[c] = _mm512_fmadd_ps(ndmin, sm[c], _mm512_fmadd_ps(d, sd[c], acc[c]));
    }
    for (int c = 0; c < C; c++) _mm512_storeu_ps(out + 16 * c, acc[c]);
}

/* Q6_K over two tiles: kquant.c's tile_k6 (VNNI) in 16 lanes, the same integer sums, scale
 * products and fused multiply-adds in the same order per row. The block's I = s_lo x sc_lo +
 * s_hi x sc_hi is taken in float (a multiply and an FMA, not tile_k6's two VPMULLDs): each half
 * sum is at most 16 x 32 x 128 = 2^16, so the products are integers of at most 2^23 and I of at
 * most 2^24, all exact in a float. Its unpack (low and high bits,
 * two shifts, two ANDs, an OR per vector) outweighs the VPDPBUSDs it feeds at 4 rows a call,
 * so several calls read it from the scratch as the Q4_K tile does (q6k_unpack: per super-block
 * the 64 quant vectors, then per 32-column block the low and high 16-column scales, then d). */
#define Q6K_VECS 81 /* vectors per super-block in the scratch: 64 quants, 16 scales (floats), d */

static void q6k_unpack(const uint8_t *w, size_t tile, int nsb, __m512i *buf, const sx_pf *pf) {
    for (int sb = 0; sb < nsb; sb++, w += SX_Q6K_TILE_BYTES, buf += Q6K_VECS) {
        prefetch_share(pf, sb);
#pragma GCC unroll 8
        for (int b = 0; b < 8; b++) {
            for (int half = 0; half < 2; half++)
                for (int k = 0; k < 4; k++) _mm512_store_si512(buf + 8 * b + 4 * half + k, q6k_quants(w, tile, b, half, k));
            __m512i sl, sh;
            q6k_scales(w, tile, b, &sl, &sh);
            _mm512_store_ps(buf + 64 + 2 * b, _mm512_cvtepi32_ps(sl));
            _mm512_store_ps(buf + 65 + 2 * b, _mm512_cvtepi32_ps(sh));
        }
        _mm512_store_ps(buf + 80, ld2ph(w, tile, 0));
    }
}

SX_AI void tile_q6k_x2(int C, const uint8_t *w, size_t tile, const __m512i *pre, int nb, const sx_act *act, size_t a0,
                       float *out, const sx_pf *pf) {
    const sx_act_block *a = act->blocks + a0;
    const float *ad = act->scales + a0;
    const int32_t *hs = act->hsum + 2 * a0;
    __m512 acc[SX_MAXC];
    for (int c = 0; c < C; c++) acc[c] = _mm512_setzero_ps();
    for (int sb = 0; sb < nb / 8; sb++, w += SX_Q6K_TILE_BYTES) {
        const __m512i *p = pre ? pre + (size_t)sb * Q6K_VECS : NULL;
        prefetch_share(pf, sb);
        __m512 sd[SX_MAXC];
        for (int c = 0; c < C; c++) sd[c] = _mm512_setzero_ps();
        /* unrolled by 4 (t = b % 4 known: the shift counts become immediates), not by 8 as in
         * tile_k6: 16 lanes of everything spill at 8 (80 -> 98 GMAC/s per core at batch 16) */
#pragma GCC unroll 4
        for (int b = 0; b < 8; b++) {
            __m512 sl, sh;
            if (p) sl = _mm512_load_ps(p + 64 + 2 * b), sh = _mm512_load_ps(p + 65 + 2 * b);
            else {
                __m512i il, ih;
                q6k_scales(w, tile, b, &il, &ih);
                sl = _mm512_cvtepi32_ps(il), sh = _mm512_cvtepi32_ps(ih);
            }
            __m512 I[SX_MAXC];
#pragma GCC unroll 2
            for (int half = 0; half < 2; half++) {
                __m512i q[4];
                for (int k = 0; k < 4; k++)
                    q[k] = p ? _mm512_load_si512(p + 8 * b + 4 * half + k) : q6k_quants(w, tile, b, half, k);
                __m512i s0[SX_MAXC];
                for (int c = 0; c < C; c++) s0[c] = _mm512_set1_epi32(hs[2 * ((size_t)c * nb + 8 * sb + b) + half]);
                for (int k = 0; k < 4; k++)
                    for (int c = 0; c < C; c++)
                        s0[c] = dot_bcast4(s0[c], q[k], a[(size_t)c * nb + 8 * sb + b].qs + 16 * half + 4 * k);
                for (int c = 0; c < C; c++) {
                    const __m512 f = _mm512_cvtepi32_ps(s0[c]);
                    I[c] = half ? _mm512_fmadd_ps(f, sh, I[c]) : _mm512_mul_ps(f, sl);
                }
            }
            for (int c = 0; c < C; c++)
                sd[c] = _mm512_fmadd_ps(I[c], _mm512_set1_ps(ad[(size_t)c * nb + 8 * sb + b]), sd[c]);
        }
        const __m512 d = p ? _mm512_load_ps(p + 80) : ld2ph(w, tile, 0);
        for (int c = 0; c < C; c++) acc[c] = _mm512_fmadd_ps(d, sd[c], acc[c]);
    }
    for (int c = 0; c < C; c++) _mm512_storeu_ps(out + 16 * c, acc[c]);
}

/* One call on K-quant tiles already unpacked into the scratch (pre, never NULL here: the tiles'
 * other path compiles away). */
static void x2_unpacked(int type, int C, const uint8_t *wt, const __m512i *pre, int nb, const sx_act *act, size_t o,
                        float *out, const sx_pf *pf) {
    if (!pre) __builtin_unreachable();
    if (type == SX_Q6_K) {
        if (C == 4) tile_q6k_x2(4, wt, 0, pre, nb, act, o, out, pf);
        else if (C == 2) tile_q6k_x2(2, wt, 0, pre, nb, act, o, out, pf);
        else tile_q6k_x2(1, wt, 0, pre, nb, act, o, out, pf);
    } else if (type == SX_Q4_K) {
        if (C == 4) tile_qk_x2(SX_Q4_K, 4, wt, 0, pre, nb, act, o, out, pf);
        else if (C == 2) tile_qk_x2(SX_Q4_K, 2, wt, 0, pre, nb, act, o, out, pf);
        else tile_qk_x2(SX_Q4_K, 1, wt, 0, pre, nb, act, o, out, pf);
    } else {
        if (C == 4) tile_qk_x2(SX_Q5_K, 4, wt, 0, pre, nb, act, o, out, pf);
        else if (C == 2) tile_qk_x2(SX_Q5_K, 2, wt, 0, pre, nb, act, o, out, pf);
        else tile_qk_x2(SX_Q5_K, 1, wt, 0, pre, nb, act, o, out, pf);
    }
}

/* Rows [r, r + 16) (two whole tiles) of a Q4_0, Q4_K, Q5_K or Q6_K matrix for all n activation
 * rows, in `passes` calls, each prefetching its share of 16 later rows' tiles, the first such at
 * least SX_X2_PF bytes on (they may lie past this thread's chunk: it claims the next chunk next;
 * never past the matrix). K-quants over SX_X2_UNPACK calls or more are unpacked once into the
 * scratch first. */
void sx_x2_rows(const sx_mat *w, int r, int n, int cmax, int passes, const sx_act *act, float *y, int ys, int y0) {
    const int nb = w->cols / SX_QK, units = w->type == SX_Q4_0 ? nb : nb / 8;
    const int n_tiles = (w->rows + SX_TILE - 1) / SX_TILE, t = r / SX_TILE;
    const size_t tile = sx_packed_bytes(w->type, SX_TILE, w->cols);
    const uint8_t *wt = (const uint8_t *)w->data + (size_t)t * tile;
    const int skip = (int)(SX_X2_PF / (2 * tile)); /* 16-row chunks between this and the prefetched */
    const int ahead = n_tiles - t - 2 * (skip + 1) < 2 ? n_tiles - t - 2 * (skip + 1) : 2;
    const size_t len = ahead > 0 ? (size_t)ahead * tile : 0;
    const uint8_t *next = len ? wt + 2 * tile * (skip + 1) : NULL;
    __m512i *pre = NULL;
    if (w->type != SX_Q4_0 && passes >= SX_X2_UNPACK) {
        const size_t vecs = w->type == SX_Q6_K ? Q6K_VECS : QK_VECS;
        pre = (__m512i *)sx_thread_scratch((size_t)units * vecs * sizeof(__m512i));
    }
    /* The unpack is one more pass over the units: it takes its share of the prefetches as the
     * first call, the calls theirs after it (all of them in the unpack made the stream bursty:
     * decode steps of 16 rows ran 10-20% slower). */
    const int first = pre != NULL;
    const size_t per = (size_t)units * (passes + first), step = (len + per - 1) / per;
    if (pre) {
        const sx_pf pf = {next, step, len};
        if (w->type == SX_Q6_K) q6k_unpack(wt, tile, units, pre, &pf);
        else qk_unpack(w->type, wt, tile, units, pre, &pf);
    }
    float out[SX_X2_MAXC * 2 * SX_TILE];
    for (int c = 0, j = first; c < n; j++) {
        const int C = sx_group_rows(cmax, n - c);
        const size_t done = (size_t)j * units * step; /* what the earlier calls prefetched */
        const sx_pf pf = {len > done ? next + done : NULL, step, len > done ? len - done : 0};
        const size_t o = (size_t)c * nb;
        if (pre) {
            x2_unpacked(w->type, C, wt, pre, nb, act, o, out, &pf);
        } else if (w->type == SX_Q6_K) {
            if (C == 4) tile_q6k_x2(4, wt, tile, NULL, nb, act, o, out, &pf);
            else if (C == 2) tile_q6k_x2(2, wt, tile, NULL, nb, act, o, out, &pf);
            else tile_q6k_x2(1, wt, tile, NULL, nb, act, o, out, &pf);
        } else if (w->type == SX_Q4_K) {
            if (C == 4) tile_qk_x2(SX_Q4_K, 4, wt, tile, NULL, nb, act, o, out, &pf);
            else if (C == 2) tile_qk_x2(SX_Q4_K, 2, wt, tile, NULL, nb, act, o, out, &pf);
            else tile_qk_x2(SX_Q4_K, 1, wt, tile, NULL, nb, act, o, out, &pf);
        } else if (w->type == SX_Q5_K) {
            if (C == 4) tile_qk_x2(SX_Q5_K, 4, wt, tile, NULL, nb, act, o, out, &pf);
            else if (C == 2) tile_qk_x2(SX_Q5_K, 2, wt, tile, NULL, nb, act, o, out, &pf);
            else tile_qk_x2(SX_Q5_K, 1, wt, tile, NULL, nb, act, o, out, &pf);
        } else {
            if (C == 8) tile_q4_x2(8, wt, tile, nb, act, o, out, &pf);
            else if (C == 4) tile_q4_x2(4, wt, tile, nb, act, o, out, &pf);
            else if (C == 2) tile_q4_x2(2, wt, tile, nb, act, o, out, &pf);
            else tile_q4_x2(1, wt, tile, nb, act, o, out, &pf);
        }
        sx_store_rows(w, out, 2 * SX_TILE, r, 2 * SX_TILE, c, C, y, ys, y0);
        c += C;
    }
}
#endif
