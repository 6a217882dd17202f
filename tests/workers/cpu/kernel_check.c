/* Prints the kernels' results on fixed pseudo-random data as hex bits, so builds for other
 * instruction sets (e.g. aarch64 NEON, run under qemu) can be compared with this machine's. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"
#include "simd.h"
#include "sx.h"

static unsigned long long state = 88172645463325252ULL;
static float rnd(void) { /* xorshift64, uniform in [-2, 2) */
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return (float)((state >> 11) * (1.0 / 9007199254740992.0)) * 4.0f - 2.0f;
}

static void dump(const char *tag, const float *x, int n) {
    printf("%s", tag);
    for (int i = 0; i < n; i++) {
        unsigned u;
        memcpy(&u, &x[i], 4);
        printf(" %08x", u);
    }
    printf("\n");
}

int main(void) {
    enum { ROWS = 37, COLS = 160, N = 9 };
    float *w = malloc(sizeof(float) * ROWS * COLS), *x = malloc(sizeof(float) * N * COLS);
    float *y = malloc(sizeof(float) * N * ROWS), *bias = malloc(sizeof(float) * ROWS);
    for (int i = 0; i < ROWS * COLS; i++) w[i] = rnd();
    for (int i = 0; i < N * COLS; i++) x[i] = rnd() * 3.0f;
    for (int i = 0; i < ROWS; i++) bias[i] = rnd();
    const int types[] = {SX_F32, SX_Q8_0, SX_Q4_0};
    void *blocks = malloc(sizeof(float) * ROWS * COLS);
    void *packed = malloc(sizeof(float) * (ROWS + 8) * COLS);
    for (int t = 0; t < 3; t++) {
        sx_quantize(types[t], w, (int64_t)ROWS * COLS, blocks);
        if (types[t] != SX_F32) sx_pack(types[t], blocks, ROWS, COLS, packed, 2, 0);
        sx_mat m = {types[t], ROWS, COLS, 0, types[t] == SX_F32 ? blocks : packed, bias};
        for (int n = 1; n <= N; n += 4)
            for (int threads = 1; threads <= 2; threads++)
                for (int nrc = 0; nrc <= 8; nrc += 4) {
                    sx_gemm(&m, n, x, y, threads, nrc);
                    char tag[64];
                    snprintf(tag, sizeof tag, "gemm t%d n%d", types[t], n);
                    dump(tag, y, n * ROWS);
                }
    }
    /* Block types read as stored (no quantizer here): random bytes, finite fp16 scales. */
    enum { KCOLS = 512 };
    const int ktypes[] = {SX_F16, SX_Q4_1, SX_Q4_K, SX_Q5_K, SX_Q6_K};
    float *kx = malloc(sizeof(float) * N * KCOLS), *ky = malloc(sizeof(float) * N * ROWS * 2);
    for (int i = 0; i < N * KCOLS; i++) kx[i] = rnd() * 3.0f;
    unsigned char *raw = malloc((size_t)ROWS * KCOLS * 2), *kp = malloc((size_t)(ROWS + 8) * KCOLS * 2);
    for (int t = 0; t < 5; t++) {
        const int ty = ktypes[t];
        const size_t rb = sx_row_bytes(ty, KCOLS), be = (size_t)sx_block_elems(ty);
        const size_t bb = rb / (KCOLS / be);
        for (size_t i = 0; i < ROWS * rb; i++) raw[i] = (unsigned char)(rnd() * 64.0f + 128.0f);
        for (size_t b = 0; b < ROWS * rb / bb; b++) { /* the fp16 scale fields */
            uint16_t *h = (uint16_t *)(raw + b * bb + (ty == SX_Q6_K ? 208 : 0));
            h[0] = sx_f2h(rnd() * 0.01f);
            if (ty == SX_Q4_1 || ty == SX_Q4_K || ty == SX_Q5_K) h[1] = sx_f2h(rnd() * 0.01f);
        }
        sx_pack(ty, raw, ROWS, KCOLS, kp, 2, 0);
        sx_mat m = {ty, ROWS, KCOLS, 0, kp, bias, NULL};
        for (int n = 1; n <= N; n += 4)
            for (int threads = 1; threads <= 2; threads++)
                for (int nrc = 0; nrc <= 8; nrc += 4) {
                    sx_gemm(&m, n, kx, ky, threads, nrc);
                    char tag[64];
                    snprintf(tag, sizeof tag, "gemm t%d n%d", ty, n);
                    dump(tag, ky, n * ROWS);
                }
        float deq[KCOLS];
        sx_dequantize(ty, raw + rb, KCOLS, deq);
        dump("dequant", deq, KCOLS);
    }
    {   /* a stack of a Q6_K part (rows 0-31, from the last packing above) and an F32 part */
        float *wf = malloc(sizeof(float) * 8 * KCOLS);
        for (int i = 0; i < 8 * KCOLS; i++) wf[i] = rnd();
        sx_mat parts[2] = {{SX_Q6_K, 32, KCOLS, 0, kp, NULL, NULL}, {SX_F32, 8, KCOLS, 0, wf, NULL, NULL}};
        sx_mat st = {SX_STACK, 40, KCOLS, 2, NULL, NULL, parts};
        sx_gemm(&st, N, kx, ky, 2, 0);
        dump("stack", ky, N * 40);
    }
    float out[COLS];
    sx_rmsnorm(x, w, COLS, 1e-5f, out);
    dump("rmsnorm", out, COLS);
    memcpy(out, x, sizeof(out));
    sx_softmax_inplace(out, COLS - 3);
    dump("softmax", out, COLS - 3);
    {   /* attention of 1-7 heads of a KV group over a paged fp16 / f32 cache, 41 positions in
         * blocks of 16 taken out of order (scores 2 keys x up to 4 heads, a key tail) */
        enum { D = 72, BS = 16, KVH = 2, BLOCKS = 4, CACHED = 41, HMAX = 7 };
        static const int32_t table[BLOCKS] = {2, 0, 3, 1};
        const size_t n = (size_t)BLOCKS * KVH * BS * D;
        float *kf = malloc(n * 4), *vf = malloc(n * 4), q[HMAX * D], kn[D], vn[D];
        uint16_t *kh = malloc(n * 2), *vh = malloc(n * 2);
        float scores[HMAX * (CACHED + 1)], att[HMAX * D];
        for (size_t i = 0; i < n; i++) {
            kf[i] = rnd(), vf[i] = rnd();
            kh[i] = sx_f2h(kf[i]), vh[i] = sx_f2h(vf[i]);
        }
        for (int i = 0; i < HMAX * D; i++) q[i] = rnd() * 0.25f;
        for (int i = 0; i < D; i++) kn[i] = rnd(), vn[i] = rnd();
        for (int f16 = 0; f16 < 2; f16++)
            for (int heads = 1; heads <= HMAX; heads += 2) {
                sx_attend_heads_paged(q, heads, f16 ? (void *)kh : (void *)kf, f16 ? (void *)vh : (void *)vf, f16,
                                      table, BS, (size_t)KVH * BS * D, (size_t)BS * D, CACHED, kn, vn, D, 0.117851f,
                                      scores, CACHED + 1, att);
                char tag[32];
                snprintf(tag, sizeof tag, "attend_f%d_h%d", f16 ? 16 : 32, heads);
                dump(tag, att, heads * D);
            }
        free(kf), free(vf), free(kh), free(vh);
    }
    return 0;
}
