/* The K-quant tiles (Q4_K, Q5_K, Q6_K; packed layouts in sx.h): the integer inner loops of
 * gemm.c's Q4_0 tiles with the K-quants' per-sub-block scales and mins, and a scalar twin that
 * computes the same bits (same exact integer sums, same fused multiply-adds in the same order). */
#include "gemm.h"

#ifdef SX_AVX2
SX_AI __m256i shift16(__m256i x, int left) { /* 16-bit lanes by `left` (< 0: right) */
    return left >= 0 ? _mm256_sll_epi16(x, _mm_cvtsi32_si128(left)) : _mm256_srl_epi16(x, _mm_cvtsi32_si128(-left));
}

/* Q4_K / Q5_K: per sub-block s, I = sc * sum(q a) exactly (int32), then per super-block
 * acc += d * sum_s(I_s * xs_s) - dmin * sum_s(mn_s * xsum_s), the sums in s order. One sub-block
 * at a time (8 registers of quants), so the C rows' sums stay in registers. */
SX_AI void tile_k(int type, int C, const uint8_t *w, int nb, const sx_act *act, size_t a0, float *out) {
    const size_t tb = type == SX_Q4_K ? SX_Q4K_TILE_BYTES : SX_Q5K_TILE_BYTES;
    const sx_act_block *a = act->blocks + a0;
    const float *ad = act->scales + a0, *xs = act->xsum + a0;
    const __m256i m4 = _mm256_set1_epi8(0x0F), b4 = _mm256_set1_epi8(0x10);
    memset(out, 0, sizeof(float) * 8 * C); /* the sums between super-blocks: registers are for the loop */
    for (int sb = 0; sb < nb / 8; sb++, w += tb) {
        for (size_t o = 0; o < tb; o += 64) /* stream from DRAM: prefetch SX_PF ahead (gemm.h) */
            _mm_prefetch((const char *)w + SX_PF + o, SX_PF_HINT);
        __m256 sd[SX_MAXC];
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) sd[c] = _mm256_setzero_ps();
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) { /* unrolled: the shift counts become immediates */
            __m256i q[8];
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(w + 160 + 256 * (s / 2) + 32 * k));
                q[k] = _mm256_and_si256(s & 1 ? _mm256_srli_epi16(raw, 4) : raw, m4);
                if (type == SX_Q5_K) { /* bit s of qh to bit 4 */
                    const __m256i qh = _mm256_loadu_si256((const __m256i *)(w + SX_Q4K_TILE_BYTES + 32 * k));
                    q[k] = _mm256_or_si256(q[k], _mm256_and_si256(shift16(qh, 4 - s), b4));
                }
            }
            const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + 32 + 8 * s)));
#ifndef SX_VNNI
            const __m256i sp = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));
#endif
#pragma GCC unroll 4
            for (int c = 0; c < C; c++) {
                const size_t i = (size_t)c * nb + 8 * sb + s;
                const sx_act_block *x = a + i;
                __m256i I;
#ifdef SX_VNNI
                __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
#pragma GCC unroll 8
                for (int k = 0; k < 8; k += 2) { /* two chains: VPDPBUSD's latency */
                    s0 = dot_us(s0, q[k], bcast4(x->qs + 4 * k));
                    s1 = dot_us(s1, q[k + 1], bcast4(x->qs + 4 * k + 4));
                }
                I = _mm256_mullo_epi32(_mm256_add_epi32(s0, s1), sc);
#else
                /* int16 lanes: Q4_K 16 products of at most 15 x 127 (30480); Q5_K's 31 x 127
                 * allows 8, so it goes to int32 every 4 chunks. */
                __m256i p = _mm256_setzero_si256();
                I = _mm256_setzero_si256();
#pragma GCC unroll 8
                for (int k = 0; k < 8; k++) {
                    p = _mm256_add_epi16(p, _mm256_maddubs_epi16(q[k], bcast4(x->qs + 4 * k)));
                    if (type == SX_Q5_K && k == 3) {
                        I = _mm256_madd_epi16(p, sp);
                        p = _mm256_setzero_si256();
                    }
                }
                I = _mm256_add_epi32(I, _mm256_madd_epi16(p, sp));
#endif
                sd[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_broadcast_ss(ad + i), sd[c]);
            }
        }
        /* the mins, each converted once for all C rows (s outer, the same per-row order) */
        __m256 sm[SX_MAXC];
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) sm[c] = _mm256_setzero_ps();
        for (int s = 0; s < 8; s++) {
            const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + 96 + 8 * s))));
#pragma GCC unroll 4
            for (int c = 0; c < C; c++) sm[c] = _mm256_fmadd_ps(mn, _mm256_broadcast_ss(xs + (size_t)c * nb + 8 * sb + s), sm[c]);
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
        const __m256 ndmin = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 16))));
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) {
            __m256 acc = _mm256_fmadd_ps(d, sd[c], _mm256_loadu_ps(out + 8 * c));
            _mm256_storeu_ps(out + 8 * c, _mm256_fmadd_ps(ndmin, sm[c], acc));
        }
    }
    }

/* Q6_K: per 32-block, I = sc_lo * sum_0-15((q - 32) a) + sc_hi * sum_16-31((q - 32) a) exactly;
 * per super-block acc += d * sum_b(I_b * xs_b). The zero point starts each half's sum (hsum).
 * One 16-quant half at a time (4 registers of quants), so the C rows' sums stay in registers. */
SX_AI void tile_k6(int C, const uint8_t *w, int nb, const sx_act *act, size_t a0, float *out) {
    const sx_act_block *a = act->blocks + a0;
    const float *ad = act->scales + a0;
    const int32_t *hs = act->hsum + 2 * a0;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
#ifndef SX_VNNI
    const __m256i duplo = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1, 0, 1, 4, 5, 4, 5,
                                           8, 9, 8, 9, 12, 13, 12, 13);
    const __m256i duphi = _mm256_add_epi8(duplo, _mm256_set1_epi8(2));
#endif
    memset(out, 0, sizeof(float) * 8 * C); /* the sums between super-blocks: registers are for the loop */
    for (int sb = 0; sb < nb / 8; sb++, w += SX_Q6K_TILE_BYTES) {
        __m256 sd[SX_MAXC];
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) sd[c] = _mm256_setzero_ps();
#pragma GCC unroll 8
        for (int b = 0; b < 8; b++) { /* unrolled: the shift counts become immediates */
            const int h = b / 4, t = b % 4, g = 2 * h + t % 2;
            /* the weights stream from DRAM: prefetch SX_PF bytes ahead into L2 (gemm.h) */
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) _mm_prefetch((const char *)w + SX_PF + 256 * b + 64 * j, SX_PF_HINT);
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 16 + 16 * b)));
#ifdef SX_VNNI
            const __m256i sl = _mm256_srai_epi32(_mm256_slli_epi32(sc16, 16), 16), sh = _mm256_srai_epi32(sc16, 16);
#else
            const __m256i sl = _mm256_shuffle_epi8(sc16, duplo), sh = _mm256_shuffle_epi8(sc16, duphi);
#endif
            __m256i I[SX_MAXC];
#pragma GCC unroll 2
            for (int half = 0; half < 2; half++) {
                __m256i q[4];
#pragma GCC unroll 8
                for (int k = 0; k < 4; k++) {
                    const int o = 32 * (4 * half + k);
                    const __m256i ql = _mm256_loadu_si256((const __m256i *)(w + 144 + 256 * g + o));
                    const __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 1168 + 256 * h + o));
                    const __m256i nib = _mm256_and_si256(t < 2 ? ql : _mm256_srli_epi16(ql, 4), m4);
                    q[k] = _mm256_or_si256(nib, _mm256_and_si256(shift16(qh, 4 - 2 * t), m30));
                }
#pragma GCC unroll 4
                for (int c = 0; c < C; c++) {
                    const size_t i = (size_t)c * nb + 8 * sb + b;
                    const int8_t *x = a[i].qs + 16 * half;
                    __m256i s0 = _mm256_set1_epi32(hs[2 * i + half]), m;
#ifdef SX_VNNI
#pragma GCC unroll 8
                    for (int k = 0; k < 4; k++) s0 = dot_us(s0, q[k], bcast4(x + 4 * k));
                    m = _mm256_mullo_epi32(s0, half ? sh : sl);
#else
                    /* int16 lanes from the zero point: 8 products (q - 32) a of at most 32 x 127,
                     * 32512 in all, so the wrapping int16 sum is exact; then x scale to int32. */
#pragma GCC unroll 8
                    for (int k = 0; k < 4; k++) s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(q[k], bcast4(x + 4 * k)));
                    m = _mm256_madd_epi16(s0, half ? sh : sl);
#endif
                    I[c] = half ? _mm256_add_epi32(I[c], m) : m;
                }
            }
#pragma GCC unroll 4
            for (int c = 0; c < C; c++) {
                const size_t i = (size_t)c * nb + 8 * sb + b;
                sd[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I[c]), _mm256_broadcast_ss(ad + i), sd[c]);
            }
        }
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
            _mm256_storeu_ps(out + 8 * c, _mm256_fmadd_ps(d, sd[c], _mm256_loadu_ps(out + 8 * c)));
        }
    }
    }
#else
/* Scalar build (and aarch64): the same integer block sums and fused multiply-adds as above, one
 * row at a time. */
SX_AI void tile_k(int type, int C, const uint8_t *w, int nb, const sx_act *act, size_t a0, float *out) {
    const size_t tb = type == SX_Q4_K ? SX_Q4K_TILE_BYTES : SX_Q5K_TILE_BYTES;
    const sx_act_block *a = act->blocks + a0;
    const float *ad = act->scales + a0, *xs = act->xsum + a0;
    float acc[SX_MAXC][SX_TILE] = {{0}};
    for (int sb = 0; sb < nb / 8; sb++, w += tb)
        for (int r = 0; r < SX_TILE; r++) {
            const float d = sx_h2f(((const uint16_t *)w)[r]), ndmin = 0.0f - sx_h2f(((const uint16_t *)w)[8 + r]);
            float sd[SX_MAXC] = {0}, sm[SX_MAXC] = {0};
            for (int s = 0; s < 8; s++) {
                int8_t v[SX_QK];
                for (int i = 0; i < SX_QK; i++) {
                    int q = (w[160 + 256 * (s / 2) + SX_CHUNK(i, r)] >> (4 * (s & 1))) & 0xF;
                    if (type == SX_Q5_K) q |= ((w[SX_Q4K_TILE_BYTES + SX_CHUNK(i, r)] >> s) & 1) << 4;
                    v[i] = (int8_t)q;
                }
                const int sc = w[32 + 8 * s + r];
                for (int c = 0; c < C; c++) {
                    const size_t i = (size_t)c * nb + 8 * sb + s;
                    sd[c] = fmaf((float)(sc * dot32(v, a[i].qs)), ad[i], sd[c]);
                }
            }
            for (int c = 0; c < C; c++) {
                for (int s = 0; s < 8; s++)
                    sm[c] = fmaf((float)w[96 + 8 * s + r], xs[(size_t)c * nb + 8 * sb + s], sm[c]);
                acc[c][r] = fmaf(d, sd[c], acc[c][r]);
                acc[c][r] = fmaf(ndmin, sm[c], acc[c][r]);
            }
        }
    for (int c = 0; c < C; c++)
        for (int r = 0; r < SX_TILE; r++) out[8 * c + r] = acc[c][r];
}

SX_AI void tile_k6(int C, const uint8_t *w, int nb, const sx_act *act, size_t a0, float *out) {
    const sx_act_block *a = act->blocks + a0;
    const float *ad = act->scales + a0;
    float acc[SX_MAXC][SX_TILE] = {{0}};
    for (int sb = 0; sb < nb / 8; sb++, w += SX_Q6K_TILE_BYTES)
        for (int r = 0; r < SX_TILE; r++) {
            const float d = sx_h2f(((const uint16_t *)w)[r]);
            float sd[SX_MAXC] = {0};
            for (int b = 0; b < 8; b++) {
                const int h = b / 4, t = b % 4, g = 2 * h + t % 2;
                int8_t v[SX_QK];
                for (int i = 0; i < SX_QK; i++) {
                    const int lo = (w[144 + 256 * g + SX_CHUNK(i, r)] >> (4 * (t / 2))) & 0xF;
                    v[i] = (int8_t)((lo | (((w[1168 + 256 * h + SX_CHUNK(i, r)] >> (2 * t)) & 3) << 4)) - 32);
                }
                const int sl = (int8_t)w[16 + 16 * b + 2 * r], sh = (int8_t)w[17 + 16 * b + 2 * r];
                for (int c = 0; c < C; c++) {
                    const size_t i = (size_t)c * nb + 8 * sb + b;
                    const int I = sl * dot16(v, a[i].qs) + sh * dot16(v + 16, a[i].qs + 16);
                    sd[c] = fmaf((float)I, ad[i], sd[c]);
                }
            }
            for (int c = 0; c < C; c++) acc[c][r] = fmaf(d, sd[c], acc[c][r]);
        }
    for (int c = 0; c < C; c++)
        for (int r = 0; r < SX_TILE; r++) out[8 * c + r] = acc[c][r];
}
#endif

#define QSHAPES(X) X(1) X(2) X(4)
#define DEFQ(C)                                                                                                  \
    static void q4k_c##C(const uint8_t *w, int nb, const sx_act *a, size_t o, float *y) { tile_k(SX_Q4_K, C, w, nb, a, o, y); } \
    static void q5k_c##C(const uint8_t *w, int nb, const sx_act *a, size_t o, float *y) { tile_k(SX_Q5_K, C, w, nb, a, o, y); } \
    static void q6k_c##C(const uint8_t *w, int nb, const sx_act *a, size_t o, float *y) { tile_k6(C, w, nb, a, o, y); }
QSHAPES(DEFQ)
#undef DEFQ
static const sx_qtile_fn Q4K_TILES[] = {q4k_c1, q4k_c2, NULL, q4k_c4}, Q5K_TILES[] = {q5k_c1, q5k_c2, NULL, q5k_c4};
static const sx_qtile_fn Q6K_TILES[] = {q6k_c1, q6k_c2, NULL, q6k_c4};

const sx_qtile_fn *sx_ktiles(int type) {
    return type == SX_Q4_K ? Q4K_TILES : type == SX_Q5_K ? Q5K_TILES : type == SX_Q6_K ? Q6K_TILES : NULL;
}

/* Q6_K's zero point per activation block and 16-quant half, -32 x the sum of its quants, in the
 * form tile_k6 starts each half's sum from: one int32 (VNNI, scalar), or on plain AVX2 two
 * int16, -32 x the quants that land in the even and in the odd int16 lanes of VPMADDUBSW
 * (positions 0-1 and 2-3 of every group of 4). hsum[2 i], hsum[2 i + 1]: block i's halves. */
void sx_kquant_act(unsigned type_mask, int count, sx_act *act) {
    if (!(type_mask & (1u << SX_Q6_K))) return;
    for (int i = 0; i < count; i++)
        for (int half = 0; half < 2; half++) {
            const int8_t *q = act->blocks[i].qs + 16 * half;
            int32_t even = 0, odd = 0;
            for (int j = 0; j < 16; j++) *((j & 2) ? &odd : &even) += q[j];
#if defined(SX_AVX2) && !defined(SX_VNNI)
            act->hsum[2 * i + half] = (int32_t)((uint32_t)(uint16_t)(-32 * even) | ((uint32_t)(uint16_t)(-32 * odd) << 16));
#else
            act->hsum[2 * i + half] = -32 * (even + odd);
#endif
        }
}
