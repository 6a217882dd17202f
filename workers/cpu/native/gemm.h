/* Internal interface between the GEMM and the fused decode step. */
#ifndef SX_GEMM_H
#define SX_GEMM_H
#include "sx.h"

#define SX_PART 8 /* rows per unit of the thread partition: one packed tile */

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
    int32_t *zq; /* per block: Q4_0's zero-point term, in the form the tiles add it */
} sx_act;

/* Pack tiles [t0, t1) of a GGML row-major matrix (quant.c). */
void sx_pack_tiles(int type, const void *rowmajor, int rows, int cols, void *packed, int t0, int t1);
void sx_partition(int rows, int t, int nt, int *r0, int *r1);
void sx_act_prepare(const sx_mat *w, const float *x, int n, sx_act *act);
/* Rows [r0, r1) of y (row stride ys) for all n activation rows. */
void sx_gemm_rows(const sx_mat *w, int r0, int r1, int n, const sx_act *act, float *y, int ys, int nrc);
#endif
