/* Attention of the fused decode step over the paged KV cache: float32, fp16 or Q8_0 rows
 * (sx_kv_row_bytes), the heads of a KV group scored and accumulated together, each head's numbers
 * those it gets alone and on the scalar build. */
#include "ops.h"

#include "simd.h"

/* q . k with 8 lanes of fused multiply-adds over d (d % 8 == 0) reduced as
 * ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)): the order of the 8-key transposed reduction below. */
static inline float attn_dot(const float *q, const float *k, int d) {
    float l[8] = {0};
    for (int i = 0; i < d; i += 8)
        for (int j = 0; j < 8; j++) l[j] = fmaf(q[i + j], k[i + j], l[j]);
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

/* Key / value row t as floats: a pointer into a float32 cache, or converted into `tmp` (fp16;
 * Q8_0 blocks dequantized as sx_dequantize does). */
static inline const float *kv_row(const void *base, int kind, int t, int d, float *tmp) {
    if (kind == SX_F32) return (const float *)base + (size_t)t * d;
    if (kind == SX_Q8_0) {
        sx_dequantize(SX_Q8_0, (const char *)base + (size_t)t * sx_kv_row_bytes(kind, d), d, tmp);
        return tmp;
    }
    const uint16_t *h = (const uint16_t *)base + (size_t)t * d;
    int i = 0;
#ifdef SX_AVX2
    for (; i + 8 <= d; i += 8) _mm256_storeu_ps(tmp + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < d; i++) tmp[i] = sx_h2f(h[i]);
    return tmp;
}

#ifdef SX_AVX2
/* The Q8_0 block of row t that holds element i: a row is d / 32 blocks of an fp16 scale and 32
 * int8s. */
static inline const uint8_t *q8_block(const void *base, size_t t, int d, int i) {
    return (const uint8_t *)base + t * sx_kv_row_bytes(SX_Q8_0, d) + (size_t)(i / SX_QK) * SX_Q8_BLOCK;
}

/* The scale of the Q8_0 block holding element i of row t, in 8 lanes (a loop over a block's
 * elements computes it once); zeros for float rows, which have none. */
static inline __m256 q8_scale(const void *base, int kind, size_t t, int d, int i) {
    if (kind != SX_Q8_0) return _mm256_setzero_ps();
    uint16_t h;
    memcpy(&h, q8_block(base, t, d, i), 2);
    return _mm256_cvtph_ps(_mm_set1_epi16((short)h));
}

/* Elements [i, i + 8) of key / value row t (i % 8 == 0) as floats, `scale` being q8_scale of
 * the same row and block. From Q8_0: the 8 ints times the block's scale, one rounding, the value
 * sx_dequantize gives. */
static inline __m256 load8_scaled(const void *base, int kind, size_t t, int d, int i, __m256 scale) {
    if (kind == SX_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + t * d + i)));
    if (kind == SX_Q8_0) {
        const uint8_t *b = q8_block(base, t, d, i) + 2 + i % SX_QK;
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)b))), scale);
    }
    return _mm256_loadu_ps((const float *)base + t * d + i);
}

/* The same, the scale read here. */
static inline __m256 load8(const void *base, int kind, size_t t, int d, int i) {
    return load8_scaled(base, kind, t, d, i, q8_scale(base, kind, t, d, i));
}

/* The 8-lane sums of eight accumulators, lane u of the result from acc[u]: the reduction
 * order of attn_dot. */
static inline __m256 reduce8(const __m256 *acc) {
    const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}
#endif

/* scores[t] = (q . k_t) * scale for t < len. */
static void attn_scores(const float *q, const void *k, int kind, int len, int d, float scale, float *scores) {
    int t = 0;
#ifdef SX_AVX2
    /* 8 keys at a time: 8 accumulators, then one transposed reduction for all 8 scores. */
    const __m256 vs = _mm256_set1_ps(scale);
    for (; t + 8 <= len; t += 8) {
        __m256 acc[8];
        for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();
        for (int i = 0; i < d; i += 8) {
            const __m256 qv = _mm256_loadu_ps(q + i);
            for (int u = 0; u < 8; u++)
                acc[u] = _mm256_fmadd_ps(qv, load8(k, kind, (size_t)(t + u), d, i), acc[u]);
        }
        _mm256_storeu_ps(scores + t, _mm256_mul_ps(reduce8(acc), vs));
    }
#endif
    float tmp[512];
    for (; t < len; t++) scores[t] = attn_dot(q, kv_row(k, kind, t, d, tmp), d) * scale;
}

/* out = sum_t p[t] v_t (t ascending, fused multiply-adds from 0; from out's values when `add`):
 * the same per element as repeated sx_axpy, with the output kept in registers. */
static void attn_values(const float *p, const void *v, int kind, int len, int d, int add, float *out) {
    int i0 = 0;
#ifdef SX_AVX2
    for (; i0 + 64 <= d; i0 += 64) {
        __m256 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = add ? _mm256_loadu_ps(out + i0 + 8 * j) : _mm256_setzero_ps();
        for (int t = 0; t < len; t++) {
            const __m256 pt = _mm256_set1_ps(p[t]);
            for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(pt, load8(v, kind, (size_t)t, d, i0 + 8 * j), acc[j]);
        }
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(out + i0 + 8 * j, acc[j]);
    }
#endif
    if (!add)
        for (int i = i0; i < d; i++) out[i] = 0.0f;
    if (i0 == d) return;
    float tmp[512];
    for (int t = 0; t < len; t++) {
        const float *vt = kv_row(v, kind, t, d, tmp);
        for (int i = i0; i < d; i++) out[i] = fmaf(p[t], vt[i], out[i]);
    }
}

/* This head's part of block b of a sequence's cache (table: the sequence's block table; a block
 * is block_bytes long, this head's rows start head_bytes into it). */
static inline const char *head_block(const void *cache, const int32_t *table, int b, size_t block_bytes,
                                     size_t head_bytes) {
    return (const char *)cache + (size_t)table[b] * block_bytes + head_bytes;
}

#ifdef SX_AVX2
/* Scores of HC (1-4) heads against SCORE_KEYS keys from t: per i step 4 query and SCORE_KEYS key
 * loads feed 4 x SCORE_KEYS multiply-adds (one head against 8 keys needs 9 loads for 8: the
 * loads, not the arithmetic, bound it). Each (head, key) pair keeps its own accumulator:
 * attn_dot's numbers. */
#define SCORE_KEYS 2 /* 4 (16 accumulators, AVX-512's registers) measured no faster on Zen 4 */
static inline __attribute__((always_inline)) void scores_block(const float *q, const int hc, const void *k,
                                                               const int kind, int t, int d, float scale,
                                                               float *scores, size_t stride) {
    __m256 acc[4 * SCORE_KEYS];
    for (int u = 0; u < 4 * SCORE_KEYS; u++) acc[u] = _mm256_setzero_ps();
    /* Q8_0: each key's block scale once per block, then its elements; float rows in one run */
    const int span = kind == SX_Q8_0 ? SX_QK : d;
    for (int i0 = 0; i0 < d; i0 += span) {
        __m256 sc[SCORE_KEYS];
        for (int u = 0; u < SCORE_KEYS; u++) sc[u] = q8_scale(k, kind, (size_t)(t + u), d, i0);
        for (int i = i0; i < i0 + span; i += 8) {
            __m256 kv[SCORE_KEYS];
            for (int u = 0; u < SCORE_KEYS; u++) kv[u] = load8_scaled(k, kind, (size_t)(t + u), d, i, sc[u]);
            for (int h = 0; h < hc; h++) {
                const __m256 qv = _mm256_loadu_ps(q + (size_t)h * d + i);
                for (int u = 0; u < SCORE_KEYS; u++)
                    acc[SCORE_KEYS * h + u] = _mm256_fmadd_ps(qv, kv[u], acc[SCORE_KEYS * h + u]);
            }
        }
    }
    float out[4 * SCORE_KEYS];
    for (int r = 0; r < hc * SCORE_KEYS; r += 8)
        _mm256_storeu_ps(out + r, _mm256_mul_ps(reduce8(acc + r), _mm256_set1_ps(scale)));
    for (int h = 0; h < hc; h++)
        for (int u = 0; u < SCORE_KEYS; u++) scores[h * stride + t + u] = out[SCORE_KEYS * h + u];
}

/* Values of HC (1-4) heads over n positions into out ([heads, d], accumulated in position
 * order from what it holds), VC vectors of dims per pass: each value vector is loaded once for
 * all the heads. Per element the multiply-adds of one head alone. */
#ifdef __AVX512VL__
#define VALUE_VECS 4 /* 16 accumulators: the 32 vector registers of AVX-512 hold them */
#else
#define VALUE_VECS 2
#endif
static inline __attribute__((always_inline)) void values_heads(const float *p, size_t stride, const int hc,
                                                               const void *v, const int kind, int n, int d, float *out) {
    int i0 = 0;
    for (; i0 + 8 * VALUE_VECS <= d; i0 += 8 * VALUE_VECS) {
        __m256 acc[4][VALUE_VECS];
        for (int h = 0; h < hc; h++)
            for (int j = 0; j < VALUE_VECS; j++) acc[h][j] = _mm256_loadu_ps(out + (size_t)h * d + i0 + 8 * j);
        for (int t = 0; t < n; t++) {
            __m256 vt[VALUE_VECS];
            /* 8 * VALUE_VECS <= 32 dims from a multiple of them: all in one Q8_0 block */
            const __m256 sc = q8_scale(v, kind, (size_t)t, d, i0);
            for (int j = 0; j < VALUE_VECS; j++) vt[j] = load8_scaled(v, kind, (size_t)t, d, i0 + 8 * j, sc);
            for (int h = 0; h < hc; h++) {
                const __m256 pt = _mm256_broadcast_ss(p + h * stride + t);
                for (int j = 0; j < VALUE_VECS; j++) acc[h][j] = _mm256_fmadd_ps(pt, vt[j], acc[h][j]);
            }
        }
        for (int h = 0; h < hc; h++)
            for (int j = 0; j < VALUE_VECS; j++) _mm256_storeu_ps(out + (size_t)h * d + i0 + 8 * j, acc[h][j]);
    }
    for (; i0 < d; i0 += 8) {
        __m256 acc[4];
        for (int h = 0; h < hc; h++) acc[h] = _mm256_loadu_ps(out + (size_t)h * d + i0);
        for (int t = 0; t < n; t++) {
            const __m256 vt = load8(v, kind, (size_t)t, d, i0);
            for (int h = 0; h < hc; h++) acc[h] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + h * stride + t), vt, acc[h]);
        }
        for (int h = 0; h < hc; h++) _mm256_storeu_ps(out + (size_t)h * d + i0, acc[h]);
    }
}
#endif

#ifdef SX_AVX2
/* kind is a constant at every call below, so each loop is compiled once per cache type. */
static inline __attribute__((always_inline)) void scores_chunk(const float *q, const int hc, const void *k,
                                                               const int kind, int n, int d, float scale,
                                                               float *scores, size_t stride) {
    int t = 0;
    for (; t + SCORE_KEYS <= n; t += SCORE_KEYS) scores_block(q, hc, k, kind, t, d, scale, scores, stride);
    float tmp[512];
    for (; t < n; t++) {
        const float *kt = kv_row(k, kind, t, d, tmp);
        for (int h = 0; h < hc; h++) scores[h * stride + t] = attn_dot(q + (size_t)h * d, kt, d) * scale;
    }
}

#define BY_HEADS(call, hc, ...)                                                                                     \
    switch (hc) { /* constant head counts: the loops over heads unroll into registers */                          \
        case 4: call(__VA_ARGS__, 4); break;                                                                        \
        case 3: call(__VA_ARGS__, 3); break;                                                                        \
        case 2: call(__VA_ARGS__, 2); break;                                                                        \
        default: call(__VA_ARGS__, 1); break;                                                                       \
    }
#define SCORES16(q, k, n, d, scale, s, stride, hc) scores_chunk(q, hc, k, SX_F16, n, d, scale, s, stride)
#define SCORES32(q, k, n, d, scale, s, stride, hc) scores_chunk(q, hc, k, SX_F32, n, d, scale, s, stride)
#define SCORESQ8(q, k, n, d, scale, s, stride, hc) scores_chunk(q, hc, k, SX_Q8_0, n, d, scale, s, stride)
#define VALUES16(p, stride, v, n, d, out, hc) values_heads(p, stride, hc, v, SX_F16, n, d, out)
#define VALUES32(p, stride, v, n, d, out, hc) values_heads(p, stride, hc, v, SX_F32, n, d, out)
#define VALUESQ8(p, stride, v, n, d, out, hc) values_heads(p, stride, hc, v, SX_Q8_0, n, d, out)
#endif

/* Scores of `heads` heads against n keys (rows of `kind`: float32, fp16 or Q8_0), into
 * scores[h * stride + t]: each key converted once for up to four heads. */
static void scores_group(const float *q, int heads, const void *k, int kind, int n, int d, float scale, float *scores,
                         size_t stride) {
    int h = 0;
#ifdef SX_AVX2
    for (; h < heads; h += 4) {
        const int hc = heads - h < 4 ? heads - h : 4;
        const float *qh = q + (size_t)h * d;
        float *sh = scores + h * stride;
        if (kind == SX_F16) {
            BY_HEADS(SCORES16, hc, qh, k, n, d, scale, sh, stride)
        } else if (kind == SX_Q8_0) {
            BY_HEADS(SCORESQ8, hc, qh, k, n, d, scale, sh, stride)
        } else {
            BY_HEADS(SCORES32, hc, qh, k, n, d, scale, sh, stride)
        }
    }
#endif
    for (; h < heads; h++) attn_scores(q + (size_t)h * d, k, kind, n, d, scale, scores + h * stride);
}

/* out[h] += sum_t p[h][t] v_t for the `heads` heads, t ascending. */
static void values_group(const float *p, size_t stride, int heads, const void *v, int kind, int n, int d, float *out) {
    int h = 0;
#ifdef SX_AVX2
    for (; h < heads; h += 4) {
        const int hc = heads - h < 4 ? heads - h : 4;
        const float *ph = p + h * stride;
        float *oh = out + (size_t)h * d;
        if (kind == SX_F16) {
            BY_HEADS(VALUES16, hc, ph, stride, v, n, d, oh)
        } else if (kind == SX_Q8_0) {
            BY_HEADS(VALUESQ8, hc, ph, stride, v, n, d, oh)
        } else {
            BY_HEADS(VALUES32, hc, ph, stride, v, n, d, oh)
        }
    }
#endif
    for (; h < heads; h++) attn_values(p + h * stride, v, kind, n, d, 1, out + (size_t)h * d);
}

/* Attention of the heads of one KV group over a paged cache: positions [t0, t0 + bs) of the
 * sequence live in block table[t0 / bs]. The heads of a group read the same keys and values, so
 * up to four heads are scored and accumulated per load of a key or value (converted from fp16
 * once for all of them, not once per head): 1.36x faster at context 2000 and 1.8x with the
 * cache in L2/L3 (1B shape, one thread, Zen 4; bench/attention.py, docs/benchmarks.md). Per
 * head the operations and their order are those of one head alone (8-lane multiply-adds per
 * key and attn_dot's reduction; values accumulated in position order), so the numbers do not
 * depend on how heads are grouped. The blocks are scattered (the hardware prefetcher cannot follow a
 * block table), and the weights' stream has pushed them out of cache since the last step, so
 * keys are prefetched two blocks ahead of the scores (into L1) and each block's values while its
 * keys are scored (into L2). Measured on the 1B shape, Zen 4, alternating within one process:
 * 2% faster steps at batch 1, 3% at batch 16. */
void sx_attend_heads_paged(const float *q, int heads, const void *k, const void *v, int kind, const int32_t *table,
                           int bs, size_t block_elems, size_t head_elems, int cached, const float *k_new,
                           const float *v_new, int d, float scale, float *scores, size_t score_stride, float *out) {
    const size_t rb = sx_kv_row_bytes(kind, d), bytes = (size_t)bs * rb; /* one head's part of a block */
    const size_t block_bytes = block_elems / (size_t)d * rb, head_bytes = head_elems / (size_t)d * rb;
    const int blocks = (cached + bs - 1) / bs;
    for (int j = 0; j < 2 && j < blocks; j++) {
        const char *kb = head_block(k, table, j, block_bytes, head_bytes);
        for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(kb + o, 0, 3);
    }
    for (int j = 0, t0 = 0; j < blocks; j++, t0 += bs) {
        const char *kb = head_block(k, table, j, block_bytes, head_bytes);
        const char *ka = j + 2 < blocks ? head_block(k, table, j + 2, block_bytes, head_bytes) : NULL;
        const char *vb = head_block(v, table, j, block_bytes, head_bytes);
        for (size_t o = 0; o < bytes; o += 64) {
            if (ka) __builtin_prefetch(ka + o, 0, 3);
            __builtin_prefetch(vb + o, 0, 2);
        }
        scores_group(q, heads, kb, kind, cached - t0 < bs ? cached - t0 : bs, d, scale, scores + t0, score_stride);
    }
    for (int h = 0; h < heads; h++) {
        float *sh = scores + h * score_stride, *oh = out + (size_t)h * d;
        sh[cached] = attn_dot(q + (size_t)h * d, k_new, d) * scale;
        sx_softmax_inplace(sh, cached + 1);
        for (int i = 0; i < d; i++) oh[i] = 0.0f;
    }
    for (int j = 0, t0 = 0; j < blocks; j++, t0 += bs) {
        const char *vb = head_block(v, table, j, block_bytes, head_bytes);
        values_group(scores + t0, score_stride, heads, vb, kind, cached - t0 < bs ? cached - t0 : bs, d, out);
    }
    for (int h = 0; h < heads; h++) sx_axpy(scores[h * score_stride + cached], v_new, out + (size_t)h * d, d);
}
