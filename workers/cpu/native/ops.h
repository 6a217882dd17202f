/* Element-wise and attention operators of the decode step (ops.c). */
#ifndef SX_OPS_H
#define SX_OPS_H
#include "sx.h"

/* out[i] = silu(g[i]) * u[i] */
void sx_silu_mul(const float *g, const float *u, float *out, int n);
/* Rotate-half rope of one head in place, with the cos/sin rows of its position. */
void sx_rope(float *x, const float *cos, const float *sin, int d);
/* Attention of one query head (q: [d], normalised and rotated) over `cached` positions of its
 * KV head ([cached, d] keys and values, float32 or fp16 when f16) and the new position's key and
 * value; out: [d].
 * scores: scratch of cached + 1 floats. */
void sx_attend(const float *q, const void *k, const void *v, int f16, int cached,
               const float *k_new, const float *v_new, int d, float scale, float *scores, float *out);
/* sx_attend over a paged cache: position t of the sequence is at row t % bs of block
 * table[t / bs]; a block holds block_elems elements, this KV head's rows start head_elems into
 * it. Equal to sx_attend over the same keys and values when bs % 8 == 0. */
void sx_attend_paged(const float *q, const void *k, const void *v, int f16, const int32_t *table, int bs,
                     size_t block_elems, size_t head_elems, int cached, const float *k_new, const float *v_new,
                     int d, float scale, float *scores, float *out);
#endif
