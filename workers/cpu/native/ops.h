/* Element-wise and attention operators of the decode step (ops.c). */
#ifndef SX_OPS_H
#define SX_OPS_H
#include "sx.h"

/* out[i] = silu(g[i]) * u[i] */
void sx_silu_mul(const float *g, const float *u, float *out, int n);
/* Rotate-half rope of one head in place, with the cos/sin rows of its position. */
void sx_rope(float *x, const float *cos, const float *sin, int d);
/* Attention of `group` query heads (q: [group, d], already normalised and rotated) over
 * positions [0, len) of one KV head's keys and values ([len, d] each); out: [group, d].
 * scores: scratch of len floats. */
void sx_attend(const float *q, int group, const float *k, const float *v, int len, int d,
               float scale, float *scores, float *out);
#endif
