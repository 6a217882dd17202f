/* Prints the kernels' results on fixed pseudo-random data as hex bits, so builds for other
 * instruction sets (e.g. aarch64 NEON, run under qemu) can be compared with this machine's. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    float out[COLS];
    sx_rmsnorm(x, w, COLS, 1e-5f, out);
    dump("rmsnorm", out, COLS);
    memcpy(out, x, sizeof(out));
    sx_softmax_inplace(out, COLS - 3);
    dump("softmax", out, COLS - 3);
    return 0;
}
