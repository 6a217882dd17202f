/* sysHAX CPU kernels: GGML block formats (Q8_0/Q4_0 quantized here; F16, Q4_1 and the K-quants read as stored), small-batch GEMM, a fused decode step.
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
enum {
    SX_STACK = -1, /* an sx_mat that is a row-stack of parts (n_parts > 0) */
    SX_F32 = 0, SX_F16 = 1, SX_Q4_0 = 2, SX_Q4_1 = 3, SX_Q5_0 = 6, SX_Q5_1 = 7, SX_Q8_0 = 8,
    SX_Q4_K = 12, SX_Q5_K = 13, SX_Q6_K = 14
};
#define SX_QK 32  /* weights per block */
#define SX_Q8_BLOCK 34 /* bytes of a Q8_0 block: an fp16 scale, then 32 int8s */
#define SX_QKK 256 /* weights per K-quant super-block */

typedef struct { uint16_t d; uint8_t qs[SX_QK / 2]; } sx_block_q4_0; /* 18 bytes, as in GGUF */
typedef struct { uint16_t d; int8_t qs[SX_QK]; } sx_block_q8_0;      /* 34 bytes, as in GGUF */
/* The other GGUF blocks, byte for byte as stored (value of weight i):
 * Q4_1 (20): d, m fp16; qs[16] (byte j: weights j low, j+16 high nibble)   d*q + m
 * Q5_0 (22): d fp16; qh u32 (bit i: 5th bit of weight i); qs[16] as Q4_0  d*(q-16)
 * Q5_1 (24): d, m fp16; qh u32; qs[16]                                     d*q + m
 * Q4_K (144): d, dmin fp16; scales[12] (8 6-bit scales sc and mins mn, ggml's packing);
 *   qs[128]: sub-block s (32 weights) in the low (s even) / high (s odd) nibbles of
 *   qs[32 (s/2) .. 32 (s/2) + 31]                                          (d*sc)*q - dmin*mn
 * Q5_K (176): d, dmin, scales[12], qh[32] (bit s of qh[i]: 5th bit of sub-block s weight i),
 *   qs[128] as Q4_K                                                        (d*sc)*q - dmin*mn
 * Q6_K (210): ql[128], qh[64], int8 scales[16] (per 16 weights), d fp16; weight
 *   128h + 32t + i (h < 2, t < 4, i < 32): low 4 bits from ql[64h + 32(t%2) + i] (low nibble if
 *   t < 2, else high), high 2 bits (qh[32h + i] >> 2t) & 3                 (d*sc)*(q-32) */

/* An activation block quantized to 8 bits: the quants, and the same plus 128 as unsigned bytes
 * (the unsigned operand VPDPBUSD needs against signed Q8_0 weights). Scales and sums of the
 * quants are kept in arrays of their own. */
typedef struct { int8_t qs[SX_QK]; uint8_t qu[SX_QK]; } sx_act_block;

/* Packed weights: block matrices are repacked at load into tiles of 8 rows. For each tile
 * and each 32-column block: the 8 rows' fp16 scales, then 32-byte chunks each holding the same
 * 4 quant bytes of all 8 rows (row r at bytes 4r..4r+3), so one VPDPBUSD of a chunk against a
 * broadcast group of 4 activations adds 4 products to each of the 8 rows' sums at once.
 * Q4_0: 16 + 4 x 32 = 144 bytes (= 8 GGML blocks; byte i of a row holds quants i and i + 16);
 * Q8_0: 16 + 8 x 32 = 272 bytes. Rows are padded to a multiple of 8 with zero blocks.
 * Q4_1: d[8], m[8] fp16, then the 4 chunks as Q4_0: 160 bytes per 32 columns (= 8 blocks).
 * K-quants, per tile and 256-column super-block (arrays [sub-block][row] of bytes):
 * Q4_K: d[8], dmin[8] fp16 (32 bytes); sc[8][8], mn[8][8] unpacked 6-bit values (128);
 *   then for each pair of sub-blocks (2j, 2j+1) the 8 rows' qs[32j .. 32j+31] in 8 chunks as
 *   above (256 bytes: low nibbles = sub-block 2j, high = 2j + 1). 1184 bytes (file: 1152),
 *   4.625 bits per weight.
 * Q5_K: as Q4_K, then qh[32] of the 8 rows in 8 chunks (256): 1440 bytes (file: 1408),
 *   5.625 bits per weight.
 * Q6_K: d[8] fp16 (16); per 32-column block b the 16 int8 scales (row r: its scale of weights
 *   0-15 of b at byte 2r, of 16-31 at 2r+1) (128); ql: for each g = 2h + k (h, k < 2) the 8
 *   rows' ql[32g .. 32g+31] in 8 chunks (1024: low nibbles = block 4h + k, high = 4h + k + 2);
 *   qh: for each h the 8 rows' qh[32h .. 32h+31] in 8 chunks (512). 1680 bytes = 8 file
 *   blocks exactly, 6.5625 bits per weight.
 * F16: the file's row-major fp16 rows as they are (no tiles, no padding). */
#define SX_TILE 8
#define SX_Q4_TILE_BYTES 144
#define SX_Q8_TILE_BYTES 272
#define SX_Q41_TILE_BYTES 160
#define SX_Q4K_TILE_BYTES 1184
#define SX_Q5K_TILE_BYTES 1440
#define SX_Q6K_TILE_BYTES 1680

typedef struct sx_mat {
    int32_t type;      /* SX_F32 | SX_F16 | SX_Q4_0 | SX_Q4_1 | SX_Q8_0 | SX_Q4_K | SX_Q5_K | SX_Q6_K
                          | SX_STACK */
    int32_t rows;      /* output features */
    int32_t cols;      /* input features (a multiple of 32; of 256 for K-quants) */
    int32_t n_parts;   /* SX_STACK: the number of parts; else 0 */
    const void *data;  /* F32/F16: rows x cols row-major; block types: packed tiles (see above) */
    const float *bias; /* [rows] or NULL (SX_STACK: NULL; each part has its own) */
    /* SX_STACK: rows are parts[0]'s, then parts[1]'s, ...; all have `cols` columns and every
     * part but the last a multiple of 8 rows. A part may not itself be a stack. */
    const struct sx_mat *parts;
} sx_mat;

typedef struct {
    const float *attn_norm, *ffn_norm; /* [hidden] */
    const float *q_norm, *k_norm;      /* [head_dim] or NULL (Qwen3's per-head RMSNorm) */
    sx_mat qkv;     /* rows: q heads, k heads, v heads */
    sx_mat o;
    sx_mat gate_up; /* rows: gate [0, inter), up [inter, 2*inter) */
    sx_mat down;
    void *k_cache, *v_cache; /* this layer's [n_slots blocks, kv_heads, block_size, head_dim], float or fp16 */
} sx_layer;

typedef struct {
    int32_t n_layers, hidden, n_heads, n_kv_heads, head_dim, inter, vocab, max_len, n_slots;
    int32_t kv_type; /* the KV cache's rows: SX_F32, SX_F16 (rounded to nearest even) or SX_Q8_0
                      * (sx_kv_row_bytes) */
    float eps;
    const void *embed;       /* [vocab, hidden] rows of embed_type, GGML row-major blocks */
    const float *final_norm; /* [hidden] */
    sx_mat lm_head;
    const float *rope_cos, *rope_sin; /* [max_len, head_dim], Hugging Face rotate-half layout */
    const sx_layer *layers;
    int32_t embed_type;      /* SX_F32 (default), SX_F16 or any block type (as stored, unpacked) */
    int32_t embed_pad_;
    int64_t embed_row_bytes; /* row stride of embed in bytes; 0: sx_row_bytes(embed_type, hidden) */
    int32_t block_size;      /* positions per KV block (a multiple of 8 dividing max_len); 0: max_len,
                              * one block per sequence (a slot), n_slots of them */
    int32_t block_pad_;
} sx_model;

/* Bytes of one key or value row of head_dim d in a KV cache of kv_type: float32, fp16, or d / 32
 * Q8_0 blocks (quantized as sx_quantize, ggml's reference rounding: 8.5 bits an element, about
 * half of fp16's bytes). */
static inline size_t sx_kv_row_bytes(int kv_type, int d) {
    return kv_type == SX_Q8_0 ? (size_t)d / SX_QK * SX_Q8_BLOCK : (size_t)d * (kv_type == SX_F16 ? 2 : 4);
}

typedef struct sx_ctx sx_ctx;

const char *sx_simd(void);
int sx_max_threads(void);

/* Weights: GGML reference quantization (bit-exact with ggml-quants.c / gguf-py), Q8_0 and Q4_0.
 * n % 32 == 0. */
void sx_quantize(int type, const float *x, int64_t n, void *out);
/* Every type above (n a multiple of the type's block), bit-exact with gguf-py's dequantize. */
void sx_dequantize(int type, const void *in, int64_t n, float *out);
/* Weights per block (1 for F32/F16, 32, 256 for K-quants) and bytes per row of `cols`; 0 for
 * an unknown type. */
int sx_block_elems(int type);
size_t sx_row_bytes(int type, int64_t cols);
/* out[i, :] = dequantized row ids[i] of a row-major table (row stride row_bytes). */
void sx_dequantize_rows(int type, const void *table, int64_t row_bytes, int cols, const int64_t *ids,
                        int n, float *out);
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

/* Intel AMX for the Q4_0 GEMMs of prompt chunks and large batches (amx.c), where the build has
 * it (-march for a CPU with AMX-INT8): asks Linux for the tile state (on) and returns whether
 * AMX is now used; off: the VNNI tiles only. Results are the same bits either way. Call it
 * before steps run, not during one. Default: off. */
int sx_amx_enable(int on);
int sx_amx_active(void);

/* Pin thread i of the kernels' pool to cpus[i]; returns 0, or -1 if the pool's size differs
 * from n, or the 1-based index of the first thread whose pinning failed. */
int sx_pin_threads(const int *cpus, int n);

/* Zero a KV cache ([layers, blocks, kv_heads, block_size, head_dim] keys and values) from the
 * kernels' threads (first touch spreads its pages over their NUMA nodes). */
void sx_place_kv(void *k, void *v, int n_layers, int n_blocks, int n_kv_heads, int block_size, int head_dim,
                 int elem_bytes, int n_threads);

sx_ctx *sx_ctx_new(const sx_model *m, int max_batch, int n_threads, int nrc);
void sx_ctx_free(sx_ctx *c);
/* One decode step for the sequences in slots [0, n) of an unpaged cache (block_size 0):
 * tokens[i] at positions[i] (its KV is written there, attention covers [0, positions[i]]).
 * logits: [n, vocab]. Returns 0, or a negative error as sx_step. */
int sx_decode(sx_ctx *c, int n, const int64_t *tokens, const int64_t *positions, float *logits);
/* Profile builds only (-DSX_PROFILE, prof.h): each thread's op-class clocks (TSC ticks) per
 * layer into out[nt][n_layers + 1][SX_PROF_N]; returns nt, or -1 in a build without the clocks.
 * reset: zero them. */
int sx_prof_read(sx_ctx *c, uint64_t *out, int reset);
uint64_t sx_prof_tsc(void); /* the TSC (0 without SX_PROFILE) */
/* One step of n token rows (decodes and prompt chunks mixed): row i is tokens[i] of sequence
 * seqs[i] at positions[i] (its K/V is written there; attention covers [0, positions[i]]).
 * Sequence s's block table is tables[s * table_stride ...]: position t is in block
 * table[t / block_size]. NULL seqs: row i is sequence i; NULL tables (unpaged cache only):
 * sequence s is slot s. Rows of one sequence (a prompt chunk) must be adjacent, at
 * consecutive positions. Only rows out_rows[0..n_out) go through the LM head: logits
 * [n_out, vocab]. Errors: -1 batch size, -2 position, -3 token id, -4 a sequence or block out
 * of range, -5 rows of one sequence not adjacent or not consecutive, -6 an out row out of
 * range. */
int sx_step(sx_ctx *c, int n, const int64_t *tokens, const int64_t *positions, const int64_t *seqs,
            const int32_t *tables, int table_stride, int n_out, const int64_t *out_rows, float *logits);

/* Building blocks of the step, exposed for tests against float references. */
void sx_rmsnorm(const float *x, const float *w, int n, float eps, float *out);
void sx_softmax_inplace(float *x, int n);
#endif
