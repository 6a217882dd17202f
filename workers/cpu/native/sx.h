/* sysHAX CPU kernels: GGML Q8_0/Q4_0 block formats, small-batch GEMM, a fused decode step.
 *
 * Plain C ABI (loaded with ctypes, no torch headers: builds in seconds with gcc). One build is
 * compiled for the machine it runs on (-march=native); `SX_PORTABLE` forces the scalar path,
 * which computes bit-identical results to the SIMD path (same lane structure, fused
 * multiply-adds in the same order), so tests can check one against the other.
 */
#ifndef SX_H
#define SX_H
#include <stddef.h>
#include <stdint.h>

/* Weight types, numbered as ggml's GGMLQuantizationType. */
enum { SX_F32 = 0, SX_Q4_0 = 2, SX_Q8_0 = 8 };
#define SX_QK 32 /* weights per block */

typedef struct { uint16_t d; uint8_t qs[SX_QK / 2]; } sx_block_q4_0; /* 18 bytes, as in GGUF */
typedef struct { uint16_t d; int8_t qs[SX_QK]; } sx_block_q8_0;      /* 34 bytes, as in GGUF */

/* An activation block quantized to 8 bits: the quants, and the same plus 128 as unsigned bytes
 * (the unsigned operand VPDPBUSD needs against signed Q8_0 weights). Scales and sums of the
 * quants are kept in arrays of their own. */
typedef struct { int8_t qs[SX_QK]; uint8_t qu[SX_QK]; } sx_act_block;

/* Packed weights: Q4_0/Q8_0 matrices are repacked at load into tiles of 8 rows. For each tile
 * and each 32-column block: the 8 rows' fp16 scales, then 32-byte chunks each holding the same
 * 4 quant bytes of all 8 rows (row r at bytes 4r..4r+3), so one VPDPBUSD of a chunk against a
 * broadcast group of 4 activations adds 4 products to each of the 8 rows' sums at once.
 * Q4_0: 16 + 4 x 32 = 144 bytes (= 8 GGML blocks; byte i of a row holds quants i and i + 16);
 * Q8_0: 16 + 8 x 32 = 272 bytes. Rows are padded to a multiple of 8 with zero blocks. */
#define SX_TILE 8
#define SX_Q4_TILE_BYTES 144
#define SX_Q8_TILE_BYTES 272

typedef struct {
    int32_t type;      /* SX_F32 | SX_Q4_0 | SX_Q8_0 */
    int32_t rows;      /* output features */
    int32_t cols;      /* input features (a multiple of 32) */
    int32_t pad_;
    const void *data;  /* F32: rows x cols row-major; Q4_0/Q8_0: packed tiles (see above) */
    const float *bias; /* [rows] or NULL */
} sx_mat;

typedef struct {
    const float *attn_norm, *ffn_norm; /* [hidden] */
    const float *q_norm, *k_norm;      /* [head_dim] or NULL (Qwen3's per-head RMSNorm) */
    sx_mat qkv;     /* rows: q heads, k heads, v heads */
    sx_mat o;
    sx_mat gate_up; /* rows: gate [0, inter), up [inter, 2*inter) */
    sx_mat down;
    void *k_cache, *v_cache; /* this layer's [slots, kv_heads, max_len, head_dim], float or fp16 */
} sx_layer;

typedef struct {
    int32_t n_layers, hidden, n_heads, n_kv_heads, head_dim, inter, vocab, max_len, n_slots;
    int32_t kv_f16; /* 1: the KV cache holds fp16 (rounded to nearest even), 0: float32 */
    float eps;
    const float *embed;      /* [vocab, hidden] */
    const float *final_norm; /* [hidden] */
    sx_mat lm_head;
    const float *rope_cos, *rope_sin; /* [max_len, head_dim], Hugging Face rotate-half layout */
    const sx_layer *layers;
} sx_model;

typedef struct sx_ctx sx_ctx;

const char *sx_simd(void);
int sx_max_threads(void);

/* Weights: GGML reference quantization (bit-exact with ggml-quants.c / gguf-py). n % 32 == 0. */
void sx_quantize(int type, const float *x, int64_t n, void *out);
void sx_dequantize(int type, const void *in, int64_t n, float *out);
/* Activations: n rows of k floats -> int8 blocks, float scales, int32 sums of the quants. */
void sx_quantize_act(const float *x, int n, int k, sx_act_block *out, float *scales, int32_t *sums);

/* GGML row-major blocks <-> packed tiles. sx_pack writes each tile from the thread that will
 * compute it in sx_gemm / sx_decode, so first touch places the pages on that thread's NUMA
 * node; `paired`: partition like gate_up in the decode step (row r with row r + rows/2). */
size_t sx_packed_bytes(int type, int rows, int cols);
void sx_pack(int type, const void *rowmajor, int rows, int cols, void *packed, int n_threads, int paired);
void sx_unpack(int type, const void *packed, int rows, int cols, void *rowmajor);

/* y[n, rows] = x[n, cols] @ W^T (+ bias), threads over tiles of 8 rows. `nrc`: activation rows
 * per tile for the quantized types (1, 2, 4), weight rows per tile for F32 (1, 2, 4, 8);
 * 0 = default. */
void sx_gemm(const sx_mat *w, int n, const float *x, float *y, int n_threads, int nrc);

/* Pin thread i of the kernels' pool to cpus[i]; returns 0, or -1 if the pool's size differs
 * from n, or the 1-based index of the first thread whose pinning failed. */
int sx_pin_threads(const int *cpus, int n);

/* Zero a KV cache ([layers, slots, kv_heads, max_len, head_dim] keys and values) with each
 * (slot, kv head) region first touched by the thread that writes it in sx_decode. */
void sx_place_kv(void *k, void *v, int n_layers, int n_slots, int n_kv_heads, int max_len,
                 int head_dim, int elem_bytes, int n_threads);

sx_ctx *sx_ctx_new(const sx_model *m, int max_batch, int n_threads, int nrc);
void sx_ctx_free(sx_ctx *c);
/* One decode step for the sequences in slots [0, n): tokens[i] at positions[i] (its KV is
 * written there, attention covers [0, positions[i]]). logits: [n, vocab]. Returns 0, or a
 * negative error (bad batch size, position out of range). */
int sx_decode(sx_ctx *c, int n, const int64_t *tokens, const int64_t *positions, float *logits);

/* Building blocks of the step, exposed for tests against float references. */
void sx_rmsnorm(const float *x, const float *w, int n, float eps, float *out);
void sx_softmax_inplace(float *x, int n);
#endif
