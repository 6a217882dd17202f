/* Test only: lets the kernels' AVX-512 VNNI branch (SX_VNNI) build and run on a CPU with AVX2
 * alone, with VPDPBUSD emulated exactly in scalar code. Used by test_other_isa.py as
 *   gcc -march=haswell -DSX_VNNI -include vnni_emul.h ...
 * so the VNNI code paths are checked against this machine's build without VNNI hardware. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* decode.c needs it, and this header comes first */
#endif
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline __m256i sx_emul_dpbusd(__m256i acc, __m256i u, __m256i s) {
    uint8_t a[32];
    int8_t b[32];
    int32_t r[8];
    memcpy(a, &u, 32);
    memcpy(b, &s, 32);
    memcpy(r, &acc, 32);
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 4; j++) r[i] += (int32_t)a[4 * i + j] * (int32_t)b[4 * i + j];
    __m256i out;
    memcpy(&out, r, 32);
    return out;
}
#undef _mm256_dpbusd_epi32
#define _mm256_dpbusd_epi32 sx_emul_dpbusd
