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
#endif
