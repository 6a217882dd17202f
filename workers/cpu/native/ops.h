/* Element-wise and attention operators of the decode step (ops.c, attention.c). */
#ifndef SX_OPS_H
#define SX_OPS_H
#include "sx.h"

/* out[i] = silu(g[i]) * u[i] */
void sx_silu_mul(const float *g, const float *u, float *out, int n);
/* Rotate-half rope of one head in place, with the cos/sin rows of its position. */
void sx_rope(float *x, const float *cos, const float *sin, int d);
/* Attention of `heads` query heads (q: [heads, d], normalised and rotated) that share one KV
 * head, over `cached` positions of a paged cache (rows of `kind`: SX_F32, SX_F16 or SX_Q8_0,
 * sx_kv_row_bytes each) and the new position's key and value; out: [heads, d]. Position t of
 * the sequence is at row t % bs of block table[t / bs]; a block holds block_elems elements
 * (rows times d), this KV head's rows start head_elems into it; bs % 8 == 0. scores: scratch of
 * `heads` rows of score_stride >= cached + 1 floats. Each head's numbers are those it gets
 * alone. */
void sx_attend_heads_paged(const float *q, int heads, const void *k, const void *v, int kind, const int32_t *table,
                           int bs, size_t block_elems, size_t head_elems, int cached, const float *k_new,
                           const float *v_new, int d, float scale, float *scores, size_t score_stride, float *out);
#endif
